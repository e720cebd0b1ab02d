//! Tokenizing for routing: an 8k-token chat rendered with the model's template and tokenized
//! fresh, against the follow-up turn of the same conversation through the piece cache.
//!
//! ```text
//! bash scripts/fixtures.sh        # Qwen3's tokenizer files, into target/fixtures/qwen3
//! cargo run --release -p kvroute-benches --bin chat-tokenize
//! cargo run --release -p kvroute-benches --bin chat-tokenize -- --model-dir DIR --runs 50
//! ```
//!
//! The conversation: a system prompt and turns of user and assistant text until the rendered
//! chat is about 8,192 tokens. `fresh` renders it and tokenizes the text at once (what a
//! router without the cache does per request); `follow-up` adds one user message to a
//! conversation whose earlier turns went through the cache (a new tokenizer each run, primed
//! with the previous turn), renders and tokenizes through the cache. Both must give the same
//! ids as a fresh tokenization. Medians over runs.
//!
//! `tokenizers' own pipeline` is the text tokenized at once by Hugging Face `tokenizers`;
//! `kvroute, fresh` is the same chat through kvroute's tokenizer with an empty piece cache (the
//! exact fast path where the tokenizer has one).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use kvroute_benches::median;
use kvroute_text::{ModelText, RenderInput};
use serde_json::{json, Value};

fn conversation(turns: usize) -> Vec<Value> {
    let mut messages = vec![json!({"role": "system", "content":
        "You are a careful assistant for an operations team. Cite the runbook section for every step, \
         and say when you are unsure."})];
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": format!(
            "Step {t}: the router at node {t} reports {} requests queued and a cache hit rate of {}%. \
             What should we check first, and why? Please be specific about metrics and thresholds.",
            t * 37 % 500, t * 13 % 100)}));
        messages.push(json!({"role": "assistant", "content": format!(
            "For node {t}, first compare the queue depth with the admission limit (runbook 4.{t}); \
             a queue above 80% of the limit for more than a minute points to a slow worker. Then \
             check the KV-event stream for gaps and replays, since a stale index lowers hits. \
             Finally, look at per-worker load imbalance; anything above 1.3 deserves a drain and \
             a look at that worker's logs.")}));
    }
    messages
}

fn main() -> Result<()> {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/fixtures/qwen3");
    let mut runs = 30usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model-dir" => dir = PathBuf::from(args.next().unwrap_or_default()),
            "--runs" => runs = args.next().unwrap_or_default().parse()?,
            other => bail!("unknown argument {other}; --model-dir DIR, --runs N"),
        }
    }
    if !dir.join("tokenizer.json").exists() {
        bail!(
            "no {} (run scripts/fixtures.sh)",
            dir.join("tokenizer.json").display()
        );
    }
    let model = ModelText::load(&dir)?;
    let Some(template) = model.template.as_ref() else {
        bail!("the model has no chat template");
    };
    // Grow the conversation to about 8k tokens.
    let mut turns = 1;
    let render = |messages: &[Value]| {
        template.render(&RenderInput {
            messages,
            tools: None,
            add_generation_prompt: true,
        })
    };
    let tokens = loop {
        let text = render(&conversation(turns))?;
        let n = model.tokenizer.encode_fresh(&text)?.len();
        if n >= 8_192 {
            break n;
        }
        turns += 1;
    };
    let full = conversation(turns);
    let mut follow = full.clone();
    follow.push(json!({"role": "user", "content": "And if all of that looks fine?"}));
    let follow_request = json!({ "messages": follow });
    let earlier_request = json!({ "messages": full });
    let mut reference_us = Vec::new();
    let mut fresh_us = Vec::new();
    let mut render_us = Vec::new();
    let mut follow_us = Vec::new();
    for _ in 0..runs {
        // An empty cache, and a cache primed with the previous turn only (both loaded first,
        // so that the timings below start from the same warm state).
        let cold = ModelText::load(&dir)?;
        let primed = ModelText::load(&dir)?;
        primed.chat_ids(&earlier_request)?;
        let t = Instant::now();
        let text = render(&follow)?;
        let rendered = t.elapsed();
        let reference = model.tokenizer.encode_fresh(&text)?;
        reference_us.push(t.elapsed().as_secs_f64() * 1e6);
        render_us.push(rendered.as_secs_f64() * 1e6);
        let t = Instant::now();
        let fresh = cold.chat_ids(&follow_request)?;
        fresh_us.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let ids = primed.chat_ids(&follow_request)?;
        follow_us.push(t.elapsed().as_secs_f64() * 1e6);
        if ids != reference || fresh != reference {
            bail!("kvroute's ids differ from the tokenizer's");
        }
    }
    let reference = median(reference_us).unwrap_or(0.0);
    let fresh = median(fresh_us).unwrap_or(0.0);
    let follow = median(follow_us).unwrap_or(0.0);
    println!(
        "chat-tokenize: {turns} turns, {tokens} tokens, {runs} runs, medians (fast path {})",
        if model.tokenizer.fast() { "on" } else { "off" }
    );
    println!(
        "  render alone                           {:>9.1} µs",
        median(render_us).unwrap_or(0.0)
    );
    println!("  render + tokenizers' own pipeline      {reference:>9.1} µs");
    println!("  render + tokenize, kvroute, fresh      {fresh:>9.1} µs");
    println!("  follow-up turn, kvroute, piece cache   {follow:>9.1} µs");
    println!(
        "  tokenizers ÷ kvroute fresh             {:>9.2}×",
        reference / fresh.max(1e-9)
    );
    Ok(())
}
