//! `kvroute serve` end to end on loopback, every part a real process: three `kvroute worker`
//! engines (vLLM's HTTP and ZeroMQ interfaces) and the router service in front of them, driven
//! by an HTTP client.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

use super::{free_port, Process};

/// A `kvroute` process with `args`, quiet.
pub(super) fn kvroute(args: &[String]) -> Process {
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .env("KVROUTE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Process(child)
}

/// One engine: its process, its HTTP URL and its event endpoints.
pub(super) struct Engine {
    pub(super) process: Process,
    pub(super) url: String,
    pub(super) events: String,
    pub(super) replay: String,
}

fn engine(extra: &[String]) -> Engine {
    let (http, events, replay) = (free_port(), free_port(), free_port());
    let mut args: Vec<String> = vec![
        "worker".into(),
        "--listen".into(),
        format!("127.0.0.1:{http}"),
        "--kv-events".into(),
        format!("tcp://127.0.0.1:{events}"),
        "--kv-replay".into(),
        format!("tcp://127.0.0.1:{replay}"),
        "--kv-blocks".into(),
        "4096".into(),
    ];
    // Twenty times real time, unless the caller says otherwise.
    if !extra.iter().any(|a| a == "--speedup") {
        args.extend(["--speedup".into(), "20".into()]);
    }
    args.extend_from_slice(extra);
    let process = kvroute(&args);
    Engine {
        process,
        url: format!("http://127.0.0.1:{http}"),
        events: format!("tcp://127.0.0.1:{events}"),
        replay: format!("tcp://127.0.0.1:{replay}"),
    }
}

/// Waits until `url` answers; false when `process` exits first (its port was taken between
/// [`free_port`] and its bind, say: the caller starts it again on other ports).
pub(super) async fn answers(client: &reqwest::Client, url: &str, process: &mut Process) -> bool {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                return true;
            }
        }
        if process.0.try_wait().unwrap().is_some() {
            return false;
        }
        assert!(Instant::now() < deadline, "{url} never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `n` engines given `extra` flags, each answering; one that could not start is started again
/// on other ports.
pub(super) async fn ready_engines(
    client: &reqwest::Client,
    n: usize,
    extra: &[String],
) -> Vec<Engine> {
    let mut engines: Vec<Engine> = (0..n).map(|_| engine(extra)).collect();
    for e in &mut engines {
        let mut tries = 1;
        while !answers(client, &format!("{}/health", e.url), &mut e.process).await {
            assert!(tries < 3, "an engine would not start");
            tries += 1;
            *e = engine(extra);
        }
    }
    engines
}

/// `kvroute serve` with `args` after `--listen`, answering on the URL returned; started again
/// on another port if it could not start.
pub(super) async fn ready_serve(client: &reqwest::Client, args: &[String]) -> (Process, String) {
    for _ in 0..3 {
        let port = free_port();
        let mut all: Vec<String> = vec![
            "serve".into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
        ];
        all.extend_from_slice(args);
        let mut process = kvroute(&all);
        let url = format!("http://127.0.0.1:{port}");
        if answers(client, &format!("{url}/health"), &mut process).await {
            return (process, url);
        }
    }
    panic!("kvroute serve would not start");
}

/// Serve and three engines, ready.
struct Fleet {
    engines: Vec<Engine>,
    url: String,
    serve: Process,
    client: reqwest::Client,
}

async fn fleet() -> Fleet {
    fleet_with(&[], &[]).await
}

/// Serve and three engines, each also given `extra` flags, and serve `serve_extra` too.
async fn fleet_with(extra: &[String], serve_extra: &[String]) -> Fleet {
    let client = reqwest::Client::new();
    let engines = ready_engines(&client, 3, extra).await;
    let mut args: Vec<String> = vec![
        "--model".into(),
        "kvroute-sim".into(),
        "--max-body-bytes".into(),
        "1000000".into(),
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(serve_extra);
    for e in &engines {
        args.push("--worker".into());
        args.push(format!(
            "url={},events={},replay={},kv_blocks=4096",
            e.url, e.events, e.replay
        ));
    }
    let (serve, url) = ready_serve(&client, &args).await;
    let fleet = Fleet {
        engines,
        url,
        serve,
        client,
    };
    // Requests go only to workers serve has seen answer, with their events flowing.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let w = fleet.workers().await;
        if w["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["ready"] == true)
        {
            return fleet;
        }
        assert!(
            Instant::now() < deadline,
            "the workers never got ready: {w}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Fleet {
    /// A streamed completion of `max_tokens` tokens, answered 200: its body as it arrives.
    async fn stream(
        &self,
        tokens: Vec<u32>,
        max_tokens: u32,
    ) -> impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> {
        let body = json!({"prompt": tokens, "max_tokens": max_tokens, "stream": true});
        let response = self.post("/v1/completions", &body).await;
        assert_eq!(response.status(), 200);
        response.bytes_stream()
    }

    async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.url))
            .json(body)
            .send()
            .await
            .unwrap()
    }

    async fn workers(&self) -> Value {
        self.client
            .get(format!("{}/v1/workers", self.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Requests the router still holds, over every worker.
    async fn active(&self) -> u64 {
        let w = self.workers().await;
        w["workers"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|w| w["ranks"].as_array().unwrap().clone())
            .map(|r| r["load"]["requests"].as_u64().unwrap_or(0))
            .sum()
    }

    /// Serve's Prometheus text.
    async fn metrics(&self) -> String {
        self.client
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn wait_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.active().await != 0 {
            assert!(Instant::now() < deadline, "load never returned to zero");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Prompt `i` of family `family`: 512 shared tokens, then 40 of its own.
fn prompt(family: u32, i: u32) -> Vec<u32> {
    let mut p: Vec<u32> = (family * 10_000..family * 10_000 + 512).collect();
    p.extend(1_000_000 + i * 100..1_000_000 + i * 100 + 40);
    p
}

/// Sends one completion, streaming or not, and returns its usage.
async fn complete(f: &Fleet, tokens: Vec<u32>, stream: bool) -> Value {
    let body = json!({
        "model": "kvroute-sim",
        "prompt": tokens,
        "max_tokens": 4,
        "stream": stream,
        "stream_options": {"include_usage": true},
    });
    let response = f.post("/v1/completions", &body).await;
    assert_eq!(response.status(), 200);
    if !stream {
        let v: Value = response.json().await.unwrap();
        return v["usage"].clone();
    }
    let text = response.text().await.unwrap();
    let mut usage = Value::Null;
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    assert!(text.contains("[DONE]"), "{text}");
    usage
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_land_where_their_prefix_is_and_load_returns_to_zero() {
    let f = fleet().await;
    // The first request of each of 6 families stores its prefix on some engine, in turn.
    for family in 0..6 {
        complete(&f, prompt(family, family), family % 2 == 0).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // 180 more, 8 at a time, streaming and not: each should find its family's 512 tokens.
    let mut cached = 0u64;
    let mut prompt_tokens = 0u64;
    let requests: Vec<(u32, u32)> = (0..180u32).map(|i| (i % 6, 100 + i)).collect();
    for batch in requests.chunks(8) {
        let usages = futures_util::future::join_all(
            batch
                .iter()
                .map(|&(family, i)| complete(&f, prompt(family, i), i % 2 == 0)),
        )
        .await;
        for u in usages {
            cached += u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            prompt_tokens += u["prompt_tokens"].as_u64().unwrap();
        }
    }
    // Each prompt is 552 tokens of which 512 are its family's: 0.93 at best.
    let hit = cached as f64 / prompt_tokens as f64;
    assert!(hit > 0.85, "hit rate {hit}");
    // The decision alone names the engine holding the prefix.
    let decision: Value = f
        .post("/v1/route", &json!({"prompt": prompt(3, 9_999)}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(decision["predicted_cached_tokens"], 512, "{decision}");
    assert_eq!(decision["booked"], false);
    f.wait_idle().await;
    let metrics = f.metrics().await;
    assert!(
        metrics.contains("kvroute_requests_total{outcome=\"ok\",route=\"completions\"} 186"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_a_clear_4xx_and_book_nothing() {
    let f = fleet().await;
    let raw = |body: String| {
        f.client
            .post(format!("{}/v1/completions", f.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    for (body, status) in [
        ("{oops".to_owned(), 400),
        (json!({"prompt": []}).to_string(), 400),
        (json!({"model": "gpt-x", "prompt": [1, 2]}).to_string(), 404),
        (json!({"prompt": "text"}).to_string(), 400),
        (json!({"max_tokens": 3}).to_string(), 400),
        (json!({"prompt": vec![7u32; 600_000]}).to_string(), 413),
    ] {
        let r = raw(body).await.unwrap();
        assert_eq!(r.status().as_u16(), status);
        if status != 413 {
            let v: Value = r.json().await.unwrap();
            assert!(v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()));
        }
    }
    assert_eq!(f.active().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_load_and_the_engine_stops() {
    let f = fleet().await;
    let mut body = f.stream(prompt(1, 1), 20_000).await;
    let _first = body.next().await.unwrap().unwrap();
    assert_eq!(f.active().await, 1);
    drop(body);
    f.wait_idle().await;
    // The engine saw the connection close and aborted the request.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut aborted = 0;
        for e in &f.engines {
            let s: Value = f
                .client
                .get(format!("{}/admin/stats", e.url))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            aborted += s["aborted"].as_u64().unwrap();
        }
        if aborted == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "no engine aborted the request");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_fails_only_its_own_requests_and_leaves_the_index() {
    let mut f = fleet().await;
    // One long stream per engine's family, started after each family is stored.
    for family in 0..3 {
        complete(&f, prompt(family, family), false).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let workers = f.workers().await;
    let holder = |w: &Value| w["ranks"][0]["index_blocks"].as_u64().unwrap_or(0);
    assert!(
        workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| holder(w) > 0),
        "{workers}"
    );
    let mut streams = Vec::new();
    for family in 0..3 {
        let r = f
            .post(
                "/v1/completions",
                &json!({"prompt": prompt(family, 50 + family), "max_tokens": 400, "stream": true}),
            )
            .await;
        assert_eq!(r.status(), 200);
        streams.push(r.bytes_stream());
    }
    for s in &mut streams {
        s.next().await.unwrap().unwrap();
    }
    // Kill the engine serving family 2's stream: find it by its load.
    let victim = {
        let w = f.workers().await;
        let decision: Value = f
            .post("/v1/route", &json!({"prompt": prompt(2, 7)}))
            .await
            .json()
            .await
            .unwrap();
        let id = decision["worker"].as_u64().unwrap() as usize;
        assert!(
            w["workers"][id]["ranks"][0]["load"]["requests"]
                .as_u64()
                .unwrap()
                >= 1
        );
        id
    };
    let engine = f.engines.remove(victim);
    drop(engine.process);
    let mut failed = 0;
    let mut finished = 0;
    for s in streams {
        let chunks: Vec<_> = s.collect().await;
        if chunks.iter().any(|c| c.is_err()) {
            failed += 1;
        } else {
            finished += 1;
        }
    }
    assert_eq!(
        (failed, finished),
        (1, 2),
        "only the killed engine's stream fails"
    );
    f.wait_idle().await;
    let w = f.workers().await;
    let dead = &w["workers"][victim]["ranks"][0];
    assert_eq!(dead["health"], "Unreachable", "{w}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while holder(&f.workers().await["workers"][victim]) != 0 {
        assert!(Instant::now() < deadline, "its blocks stayed in the index");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // New requests go to the living.
    for i in 0..6 {
        complete(&f, prompt(i % 3, 300 + i), false).await;
    }
}

#[test]
fn the_example_config_and_worker_flags_read_as_documented() {
    use kvroute_serve::{parse_worker_flag, ServeConfig, ServeOptions};
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kvroute.example.toml");
    let options = ServeConfig::read(&path)
        .unwrap()
        .apply(ServeOptions::default())
        .unwrap();
    assert_eq!(options.workers.len(), 2);
    assert_eq!(
        options.workers[0].kv_replay.as_deref(),
        Some("tcp://10.0.0.11:5558")
    );
    assert_eq!(options.workers[0].labels["zone"], "a");
    assert_eq!(
        options.model.as_deref(),
        Some("meta-llama/Llama-3.1-8B-Instruct")
    );
    assert_eq!(options.retries, 1);
    assert_eq!(
        options.router.affinity,
        kvroute_core::Affinity::default(),
        "the example's affinity is the router's"
    );
    let off = ServeConfig {
        affinity_boost: Some(0.0),
        ..ServeConfig::default()
    };
    assert_eq!(
        off.apply(ServeOptions::default())
            .unwrap()
            .router
            .affinity
            .boost,
        0.0
    );
    let whole_prompt = ServeConfig {
        affinity_from_share: Some(1.0),
        ..ServeConfig::default()
    };
    assert!(
        whole_prompt.apply(ServeOptions::default()).is_err(),
        "a share must leave room to grow"
    );
    let w = parse_worker_flag("url=http://h:1,events=tcp://h:2,kv_blocks=9,dp_size=2", 3).unwrap();
    assert_eq!((w.id, w.kv_blocks, w.dp_size), (3, 9, 2));
    assert!(parse_worker_flag("events=tcp://h:2", 0).is_err(), "no url");
    assert!(parse_worker_flag("url=http://h:1,colour=blue", 0).is_err());
    let bad = ServeConfig {
        policy: Some("fastest".into()),
        ..ServeConfig::default()
    };
    assert!(bad.apply(ServeOptions::default()).is_err());
    assert!(
        !options.tokenize_whole,
        "as far as a worker may hold it, by default"
    );
    let whole = ServeConfig {
        tokenize_whole: Some(true),
        ..ServeConfig::default()
    };
    assert!(whole.apply(ServeOptions::default()).unwrap().tokenize_whole);
    let speculative = ServeConfig {
        speculative_s: Some(1.5),
        ..ServeConfig::default()
    };
    assert_eq!(
        speculative
            .apply(ServeOptions::default())
            .unwrap()
            .router
            .approximate
            .speculative,
        kvroute_core::Speculative::On {
            ttl: Duration::from_millis(1_500)
        }
    );
    let negative = ServeConfig {
        speculative_s: Some(-1.0),
        ..ServeConfig::default()
    };
    assert!(negative.apply(ServeOptions::default()).is_err());
    let unnamed = ServeConfig {
        lora_adapters: Some(vec!["sql-lora".into(), String::new()]),
        ..ServeConfig::default()
    };
    assert!(
        unnamed.apply(ServeOptions::default()).is_err(),
        "an empty adapter name"
    );
    let unknown_key = "listen = \"127.0.0.1:1\"\nlisten_port = 3\n";
    assert!(toml_parse(unknown_key).is_err(), "unknown keys are refused");
}

fn toml_parse(text: &str) -> Result<kvroute_serve::ServeConfig, ()> {
    let dir = std::env::temp_dir().join(format!("kvroute-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.toml");
    std::fs::write(&path, text).unwrap();
    kvroute_serve::ServeConfig::read(&path).map_err(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chats_are_routed_by_the_conversation_the_engine_renders() {
    let dir =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/fixtures/qwen3");
    if !dir.join("tokenizer.json").exists() {
        crate::skip_without_fixtures(&format!("no {} (run scripts/fixtures.sh)", dir.display()));
        return;
    }
    let f = fleet_with(&["--tokenizer".into(), dir.display().to_string()], &[]).await;
    let system = |i: usize| {
        format!(
            "You are assistant number {i}. {}",
            "Answer carefully and cite the manual. ".repeat(40)
        )
    };
    // Four conversations, three turns each, one turn of every conversation at a time.
    let mut history: Vec<Vec<Value>> = (0..4)
        .map(|i| vec![json!({"role": "system", "content": system(i)})])
        .collect();
    let mut usages = Vec::new();
    for turn in 0..3 {
        for (i, messages) in history.iter_mut().enumerate() {
            messages.push(
                json!({"role": "user", "content": format!("Turn {turn} of chat {i}: go on.")}),
            );
            let body = json!({"model": "kvroute-sim", "messages": messages, "max_tokens": 3,
                "stream": turn % 2 == 1, "stream_options": {"include_usage": true}});
            let r = f.post("/v1/chat/completions", &body).await;
            assert_eq!(r.status(), 200);
            let usage = if turn % 2 == 1 {
                let text = r.text().await.unwrap();
                assert!(text.contains("chat.completion.chunk") && text.contains("[DONE]"));
                let last = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .rfind(|d| *d != "[DONE]")
                    .unwrap()
                    .to_owned();
                serde_json::from_str::<Value>(&last).unwrap()["usage"].clone()
            } else {
                let v: Value = r.json().await.unwrap();
                assert_eq!(v["object"], "chat.completion");
                let content = v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                messages.push(json!({"role": "assistant", "content": content}));
                v["usage"].clone()
            };
            if turn % 2 == 1 {
                messages.push(json!({"role": "assistant", "content": "Noted."}));
            }
            usages.push((turn, usage));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // After the first turn, each conversation's history is cached where it went.
    for (turn, usage) in &usages {
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let prompt = usage["prompt_tokens"].as_u64().unwrap();
        if *turn > 0 {
            assert!(
                cached * 10 >= prompt * 8,
                "turn {turn}: {cached} of {prompt} cached"
            );
        }
    }
    // The router's own prediction for a follow-up names the conversation's worker.
    let mut follow = history[2].clone();
    follow.push(json!({"role": "user", "content": "One more?"}));
    let decision: Value = f
        .post("/v1/route", &json!({"messages": follow}))
        .await
        .json()
        .await
        .unwrap();
    assert!(
        decision["predicted_cached_tokens"].as_u64().unwrap() > 300,
        "{decision}"
    );
    f.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_fleet_queues_requests_and_refuses_past_the_cap_with_a_429() {
    let client = reqwest::Client::new();
    let engines = ready_engines(&client, 2, &[]).await;
    // Busy as soon as a worker has a request in prefill; at most ~5 prompts queued.
    let mut args: Vec<String> = vec![
        "--busy-prefill-fraction".into(),
        "0.01".into(),
        "--queue-max-tokens".into(),
        "3000".into(),
    ];
    for e in &engines {
        args.push("--worker".into());
        args.push(format!("url={},kv_blocks=4096", e.url));
    }
    let (_serve, url) = ready_serve(&client, &args).await;
    let responses = futures_util::future::join_all((0..16u32).map(|i| {
        let client = client.clone();
        let url = url.clone();
        async move {
            let r = client
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": prompt(i % 4, i), "max_tokens": 64}))
                .send()
                .await
                .unwrap();
            let retry_after = r.headers().get("retry-after").is_some();
            (r.status().as_u16(), retry_after)
        }
    }))
    .await;
    let ok = responses.iter().filter(|(s, _)| *s == 200).count();
    let refused: Vec<_> = responses.iter().filter(|(s, _)| *s == 429).collect();
    assert_eq!(ok + refused.len(), 16, "{responses:?}");
    assert!(ok > 2, "queued requests were served: {responses:?}");
    assert!(!refused.is_empty(), "past the cap: {responses:?}");
    assert!(refused.iter().all(|(_, retry)| *retry), "{responses:?}");
    let metrics = client
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let waited = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvroute_queue_wait_seconds_count "))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(waited >= 1, "{metrics}");
    assert!(metrics.contains("kvroute_queue_depth 0"), "{metrics}");
}

/// How `process` exited, waiting up to 10 s for it to.
async fn exit_status(process: &mut Process) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = process.0.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "the process did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `signal` (a name `kill` knows) to a process.
pub(super) fn signal(process: &Process, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(process.0.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_accepting_lets_requests_in_flight_finish_and_exits_0() {
    let mut f = fleet().await;
    // A stream of a few thousand tokens: about a second at the engines' ×20.
    let mut body = f.stream(prompt(1, 1), 3_000).await;
    let mut text = String::from_utf8(body.next().await.unwrap().unwrap().to_vec()).unwrap();
    signal(&f.serve, "TERM");
    // New connections are refused once the signal is handled...
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let fresh = reqwest::Client::new();
        if fresh.get(format!("{}/health", f.url)).send().await.is_err() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "serve still accepts after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...while the request in flight streams to its end.
    while let Some(chunk) = body.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(text.contains("[DONE]"), "the stream was cut: {text}");
    let tokens = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter(|c| c["choices"][0]["text"].is_string())
        .count();
    assert!(tokens >= 2_900, "only {tokens} chunks arrived");
    // Then serve exits by itself, with status 0.
    let status = exit_status(&mut f.serve).await;
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_grace_period_serve_exits_with_requests_in_flight() {
    let mut f = fleet_with(&[], &["--grace-s".into(), "0.3".into()]).await;
    let mut body = f.stream(prompt(1, 1), 20_000).await;
    let _first = body.next().await.unwrap().unwrap();
    let sent = Instant::now();
    signal(&f.serve, "INT");
    let status = exit_status(&mut f.serve).await;
    assert!(status.success(), "{status}");
    assert!(
        sent.elapsed() >= Duration::from_millis(300),
        "no grace given"
    );
    // The stream ends without its [DONE].
    let mut text = String::new();
    while let Some(Ok(chunk)) = body.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(!text.contains("[DONE]"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_text_prompts_are_routed_by_the_tokens_the_engine_makes() {
    let dir =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/fixtures/qwen3");
    if !dir.join("tokenizer.json").exists() {
        crate::skip_without_fixtures(&format!("no {} (run scripts/fixtures.sh)", dir.display()));
        return;
    }
    let f = fleet_with(&["--tokenizer".into(), dir.display().to_string()], &[]).await;
    // Documents of some 24 KB in lines: read and tokenized off serve's runtime threads, in
    // chunks cut at line breaks.
    let document = |i: usize| {
        (0..360)
            .map(|l| format!("Document {i}, line {l}: the router reads what the engine reads.\n"))
            .collect::<String>()
            + &"  indented, then a blank line\n\n".repeat(30)
    };
    for round in 0..2 {
        for i in 0..4 {
            let body = json!({"model": "kvroute-sim", "max_tokens": 2,
                "prompt": format!("{}Question {round}: what comes first?", document(i))});
            assert!(body.to_string().len() > 20_000);
            // Serve tokenizes only as far as some worker may hold the prompt: a new document
            // to its first chunk, one seen before through it.
            let r = f.post("/v1/route", &body).await;
            assert_eq!(r.status(), 200);
            let route: Value = r.json().await.unwrap();
            let tokenized = route["tokenized_tokens"].as_u64().unwrap();
            let estimated = route["prompt_tokens"].as_u64().unwrap();
            let r = f.post("/v1/completions", &body).await;
            assert_eq!(r.status(), 200);
            let predicted: u64 = r.headers()["x-kvroute-predicted-cached-tokens"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            let decision_us: f64 = r.headers()["x-kvroute-decision-us"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!(decision_us > 0.0 && decision_us < 1e6, "{decision_us}");
            // How long serve read the 20 kB text and tokenized its new chunks.
            let read_us: f64 = r.headers()["x-kvroute-prompt-read-us"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!(read_us > 0.0 && read_us < 1e7, "{read_us}");
            let v: Value = r.json().await.unwrap();
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
            assert_eq!(predicted, cached, "round {round}, document {i}");
            assert!(
                estimated.abs_diff(prompt) * 10 <= prompt,
                "{estimated} estimated for {prompt}"
            );
            if round == 0 {
                assert!(tokenized * 4 < prompt, "{tokenized} of {prompt} tokenized");
            } else {
                assert!(cached * 10 >= prompt * 9, "{cached} of {prompt} cached");
                assert!(
                    tokenized >= cached,
                    "{tokenized} tokenized, {cached} cached"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    f.wait_idle().await;
    // Tokens tokenized and tokens estimated are both counted.
    let metrics = f.metrics().await;
    let counted = |how: &str| -> u64 {
        let key = format!("kvroute_prompt_tokens_total{{how=\"{how}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    assert!(
        counted("tokenized") > 0 && counted("estimated") > 0,
        "{metrics}"
    );
}

/// With `--tokenize-whole`, a new text is tokenized to its end: nothing is estimated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_whole_tokenizes_a_new_text_to_its_end() {
    let dir =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/fixtures/qwen3");
    if !dir.join("tokenizer.json").exists() {
        crate::skip_without_fixtures(&format!("no {} (run scripts/fixtures.sh)", dir.display()));
        return;
    }
    // Serve alone: `/v1/route` asks no engine. A worker that holds nothing and publishes no
    // events is enough to route to.
    let client = reqwest::Client::new();
    let (_serve, url) = ready_serve(
        &client,
        &[
            "--tokenizer".into(),
            dir.display().to_string(),
            "--tokenize-whole".into(),
            "--worker".into(),
            format!("url=http://127.0.0.1:{},kv_blocks=4096", free_port()),
        ],
    )
    .await;
    let text: String = (0..200)
        .map(|l| format!("A new document, line {l}: nothing of it is cached anywhere.\n"))
        .collect();
    let r = client
        .post(format!("{url}/v1/route"))
        .json(&json!({"prompt": text, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let route: Value = r.json().await.unwrap();
    let tokenized = route["tokenized_tokens"].as_u64().unwrap();
    assert!(tokenized > 2_000, "{route}");
    assert_eq!(route["prompt_tokens"].as_u64(), Some(tokenized), "{route}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_adapter_is_served_by_name_and_routed_by_its_own_blocks() {
    let f = fleet_with(&[], &["--lora-adapter".into(), "sql-lora,chat-lora".into()]).await;
    complete(&f, prompt(1, 1), false).await;
    let route = |model: &'static str| {
        let f = &f;
        async move {
            f.post(
                "/v1/route",
                &json!({"model": model, "prompt": prompt(1, 2), "max_tokens": 1}),
            )
            .await
        }
    };
    // The base model's blocks are known once the engine's events arrive.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = route("kvroute-sim").await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        if v["predicted_cached_tokens"].as_u64().unwrap() >= 512 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the base prefix never showed: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The same tokens under an adapter are other KV blocks: none is cached.
    let r = route("sql-lora").await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["predicted_cached_tokens"], 0, "{v}");
    assert_eq!(route("no-such-lora").await.status(), 404);
    let models: Value = f
        .client
        .get(format!("{}/v1/models", f.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["kvroute-sim", "sql-lora", "chat-lora"]);
    assert_eq!(models["data"][1]["parent"], "kvroute-sim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_salt_keeps_a_requests_blocks_apart_from_other_salts() {
    let f = fleet().await;
    let body = |salt: Option<&str>, i: u32| {
        let mut b = json!({"model": "kvroute-sim", "prompt": prompt(3, i), "max_tokens": 1});
        if let Some(salt) = salt {
            b["cache_salt"] = json!(salt);
        }
        b
    };
    let predicted = |salt: Option<&'static str>| {
        let f = &f;
        async move {
            let r = f.post("/v1/route", &body(salt, 2)).await;
            assert_eq!(r.status(), 200);
            let v: Value = r.json().await.unwrap();
            v["predicted_cached_tokens"].as_u64().unwrap()
        }
    };
    assert_eq!(
        f.post("/v1/completions", &body(Some("tenant-a"), 1))
            .await
            .status(),
        200
    );
    // The engine names the salt on the chain's first block; the router seeds the chain with it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while predicted(Some("tenant-a")).await < 512 {
        assert!(Instant::now() < deadline, "the salted prefix never showed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The same tokens under another salt, or none, are other KV blocks, in the router as in
    // the engine.
    assert_eq!(predicted(Some("tenant-b")).await, 0);
    assert_eq!(predicted(None).await, 0);
    for (salt, cached) in [(Some("tenant-b"), 0), (Some("tenant-a"), 512)] {
        let r = f.post("/v1/completions", &body(salt, 2)).await;
        assert_eq!(r.status(), 200);
        let header: u64 = r.headers()["x-kvroute-predicted-cached-tokens"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"], cached,
            "{salt:?}"
        );
        assert_eq!(header, cached, "{salt:?}");
    }
    // A salt that is not a non-empty string is refused, as vLLM refuses it.
    for salt in [json!(""), json!(7)] {
        let mut b = body(None, 1);
        b["cache_salt"] = salt.clone();
        let r = f.post("/v1/completions", &b).await;
        assert_eq!(r.status(), 400, "{salt}");
    }
    f.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_data_parallel_ranks_is_told_the_rank_chosen() {
    use std::sync::{Arc, Mutex};
    // A stand-in engine with two data-parallel ranks and no KV events: it records the rank
    // header of each request and answers after 0.4 s, so both requests are in flight at once.
    let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let record = Arc::clone(&seen);
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            axum::routing::post(move |headers: axum::http::HeaderMap| {
                let record = Arc::clone(&record);
                async move {
                    let rank = headers
                        .get("x-data-parallel-rank")
                        .map(|v| v.to_str().unwrap().to_owned());
                    record.lock().unwrap().push(rank);
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    axum::Json(json!({"object": "text_completion", "choices": [],
                        "usage": {"prompt_tokens": 552, "completion_tokens": 1}}))
                }
            }),
        )
        .route("/health", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    let (_serve, url) = ready_serve(
        &client,
        &[
            "--worker".into(),
            format!("url={engine},dp_size=2,kv_blocks=4096"),
        ],
    )
    .await;
    let send = |family: u32| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            client
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": prompt(family, 1), "max_tokens": 1}))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    let (a, b) = tokio::join!(send(1), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        send(2).await
    });
    assert_eq!((a.as_u16(), b.as_u16()), (200, 200));
    let mut ranks = seen.lock().unwrap().clone();
    ranks.sort();
    assert_eq!(ranks, [Some("0".to_owned()), Some("1".to_owned())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_key_is_checked_and_never_forwarded_and_each_worker_gets_its_own() {
    use std::sync::{Arc, Mutex};
    // Two stand-in engines recording the Authorization header of each request they get.
    let mut engines = Vec::new();
    let mut seen: Vec<Arc<Mutex<Vec<Option<String>>>>> = Vec::new();
    for _ in 0..2 {
        let record: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
        seen.push(Arc::clone(&record));
        let app = axum::Router::new()
            .route(
                "/v1/completions",
                axum::routing::post(move |headers: axum::http::HeaderMap| {
                    let record = Arc::clone(&record);
                    async move {
                        let key = headers
                            .get("authorization")
                            .map(|v| v.to_str().unwrap().to_owned());
                        record.lock().unwrap().push(key);
                        axum::Json(json!({"object": "text_completion", "choices": [],
                            "usage": {"prompt_tokens": 552, "completion_tokens": 1}}))
                    }
                }),
            )
            .route("/health", axum::routing::get(|| async { "ok" }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        engines.push(format!("http://{}", listener.local_addr().unwrap()));
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    let client = reqwest::Client::new();
    let (_serve, url) = ready_serve(
        &client,
        &[
            "--api-key".into(),
            "client-key".into(),
            "--worker".into(),
            format!("url={},api_key=engine-key", engines[0]),
            "--worker".into(),
            format!("url={}", engines[1]),
        ],
    )
    .await;
    let send = |key: Option<&'static str>, i: u32| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let mut post = client
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": prompt(i, 1), "max_tokens": 1}));
            if let Some(key) = key {
                post = post.bearer_auth(key);
            }
            post.send().await.unwrap().status().as_u16()
        }
    };
    assert_eq!(send(None, 0).await, 401);
    assert_eq!(send(Some("wrong"), 0).await, 401);
    for i in 0..12 {
        assert_eq!(send(Some("client-key"), i).await, 200);
    }
    let keyed = seen[0].lock().unwrap().clone();
    let open = seen[1].lock().unwrap().clone();
    // Refused requests reach no engine; the client's key reaches none at all.
    assert_eq!(keyed.len() + open.len(), 12);
    assert!(
        keyed
            .iter()
            .all(|k| k.as_deref() == Some("Bearer engine-key")),
        "{keyed:?}"
    );
    assert!(open.iter().all(Option::is_none), "{open:?}");
}

#[test]
fn print_config_shows_every_key_as_it_took_effect() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kvroute.example.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--print-config", "--config"])
        .arg(&path)
        .args([
            "--max-connections",
            "7",
            "--worker",
            "url=http://127.0.0.1:9",
        ])
        .env("KVROUTE_HEADER_TIMEOUT_S", "12.5")
        .env("KVROUTE_API_KEY", "secret-key")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let printed: toml::Table = toml::from_str(&text).unwrap();
    assert_eq!(printed["max_connections"].as_integer(), Some(7), "the flag");
    assert_eq!(
        printed["header_timeout_s"].as_float(),
        Some(12.5),
        "the variable"
    );
    assert_eq!(
        printed["model"].as_str(),
        Some("meta-llama/Llama-3.1-8B-Instruct"),
        "the file"
    );
    assert_eq!(printed["workers"].as_array().unwrap().len(), 3);
    assert!(!text.contains("secret-key"), "secrets are left out");
}
