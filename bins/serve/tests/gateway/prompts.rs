//! Prompts past the model's maximum length: refused with a 400 before they reach an engine,
//! after at most about that many tokens of work.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvroute_serve::ServeOptions;
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::gateway;

/// Qwen3's tokenizer files, fetched by `scripts/fixtures.sh` (the README's test command,
/// with `KVROUTE_FIXTURES=required`, runs it first and requires them); without them the test
/// is skipped.
fn qwen3() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/fixtures/qwen3");
    if dir.join("tokenizer.json").exists() {
        return Some(dir);
    }
    let why = format!("no {} (run scripts/fixtures.sh)", dir.display());
    if std::env::var("KVROUTE_FIXTURES").as_deref() == Ok("required") {
        panic!("{why}");
    }
    eprintln!("skipped: {why}");
    None
}

/// Adds a worker that would take a request if one were let through (nothing listens there).
async fn add_worker(client: &reqwest::Client, url: &str) {
    let added = client
        .post(format!("{url}/v1/workers"))
        .json(&json!({"id": 1, "url": "http://127.0.0.1:9", "kv_blocks": 1024}))
        .send()
        .await
        .unwrap();
    assert_eq!(added.status(), StatusCode::CREATED);
}

async fn post(client: &reqwest::Client, url: &str, path: &str, body: Value) -> (StatusCode, Value) {
    super::post_json(client, &format!("{url}{path}"), &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_past_the_models_maximum_is_refused_early() {
    let Some(dir) = qwen3() else { return };
    let (serve, url) = gateway(ServeOptions {
        tokenizer: Some(dir),
        max_model_len: Some(2_000),
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    // A worker that would take the request if it were let through.
    add_worker(&client, &url).await;

    // Token ids: one past the limit is refused, the limit itself is routed.
    let ask = |n: u32| json!({"prompt": (0..n).collect::<Vec<u32>>(), "max_tokens": 1});
    let (status, answer) = post(&client, &url, "/v1/route", ask(2_001)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert!(answer["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length is 2000"));
    let (status, _) = post(&client, &url, "/v1/route", ask(2_000)).await;
    assert_eq!(status, StatusCode::OK);

    // A 5 MB text, with no worker holding any of it (so tokenized only a little, the rest
    // estimated): refused, quickly, through both routes.
    let huge: String = "The quick brown fox jumps over the lazy dog. ".repeat(5 << 20 >> 6);
    for (path, body) in [
        ("/v1/completions", json!({"prompt": huge, "max_tokens": 1})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": huge}]}),
        ),
    ] {
        let start = Instant::now();
        let (status, answer) = post(&client, &url, path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {answer}");
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{path}: {:?}",
            start.elapsed()
        );
    }
    // A text of about 2,200 tokens whose estimate could go either way is tokenized to know.
    let near: String = "word ".repeat(2_200);
    let (status, _) = post(&client, &url, "/v1/route", json!({"prompt": near})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let short: String = "word ".repeat(1_500);
    let (status, answer) = post(&client, &url, "/v1/route", json!({"prompt": short})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    serve.stop();
}

#[tokio::test]
async fn without_a_flag_the_tokenizer_configs_maximum_holds() {
    let Some(dir) = qwen3() else { return };
    let (serve, url) = gateway(ServeOptions {
        tokenizer: Some(dir),
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    // Qwen3's tokenizer_config.json says 131,072.
    let ids: Vec<u32> = (0..131_073).map(|i| i % 1000).collect();
    let (status, answer) = post(&client, &url, "/v1/route", json!({"prompt": ids})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert!(answer["error"]["message"]
        .as_str()
        .unwrap()
        .contains("131072"));
    serve.stop();
}

/// The value of the metric line that starts with `name` (labels included), 0 when absent.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A text no worker holds is tokenized only in part for routing; its rest is tokenized
/// afterwards off the request path, into the piece cache, so a follow-up finds it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rest_of_a_prompt_tokenized_in_part_is_tokenized_later() {
    rests_tokenized_later(true).await;
}

/// With `tokenize_rests` off, the rest is left untokenized.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tokenize_rests_off_the_rest_is_left() {
    rests_tokenized_later(false).await;
}

async fn rests_tokenized_later(on: bool) {
    let Some(dir) = qwen3() else { return };
    let (serve, url) = gateway(ServeOptions {
        tokenizer: Some(dir),
        tokenize_rests: on,
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    add_worker(&client, &url).await;
    // One line of about 40 KB: cut into chunks at word ends.
    let text: String = (0..4_000)
        .map(|i| format!("step {i} of the plan, "))
        .collect();
    let (status, answer) = post(&client, &url, "/v1/route", json!({"prompt": text})).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    if !on {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let scrape = super::get_text(&client, &format!("{url}/metrics")).await;
        assert_eq!(
            metric(&scrape, "kvroute_prompt_rests_total{outcome=\"done\"}"),
            0.0
        );
        let misses = metric(&scrape, "kvroute_piece_cache{kind=\"misses\"}");
        assert!((misses as usize) < text.len() / 256, "{misses}");
        serve.stop();
        return;
    }
    let start = Instant::now();
    let scrape = loop {
        let scrape = super::get_text(&client, &format!("{url}/metrics")).await;
        if metric(&scrape, "kvroute_prompt_rests_total{outcome=\"done\"}") >= 1.0 {
            break scrape;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{scrape}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Routing stopped early: a few chunks tokenized; the rest, hundreds, came later.
    let tokenized = metric(&scrape, "kvroute_prompt_tokens_total{how=\"tokenized\"}");
    assert!(tokenized < 2_000.0, "{tokenized}");
    let misses = metric(&scrape, "kvroute_piece_cache{kind=\"misses\"}");
    assert!(misses as usize > text.len() / 256, "{misses}");
    serve.stop();
}
