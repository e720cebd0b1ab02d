//! An engine's life under `kvroute serve`, every part a real process on loopback: an engine
//! down when serve starts, engines that publish before serve is there, engines killed and
//! started again on the same ports. Each scenario ends with serve's index equal to the
//! engine's cache, block for block.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::serve::kvroute;
use super::{free_port, Process};

/// One engine's ports, kept so that it can be started again on them.
struct Ports {
    http: u16,
    events: u16,
    replay: u16,
}

impl Ports {
    fn new() -> Self {
        Ports {
            http: free_port(),
            events: free_port(),
            replay: free_port(),
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http)
    }

    /// The engine as serve's `--worker` flag gives it.
    fn worker_flag(&self) -> String {
        format!(
            "url={},events=tcp://127.0.0.1:{},replay=tcp://127.0.0.1:{},kv_blocks=4096",
            self.url(),
            self.events,
            self.replay
        )
    }

    /// A `kvroute worker` process on these ports.
    fn start(&self) -> Process {
        kvroute(&[
            "worker".into(),
            "--listen".into(),
            format!("127.0.0.1:{}", self.http),
            "--kv-events".into(),
            format!("tcp://127.0.0.1:{}", self.events),
            "--kv-replay".into(),
            format!("tcp://127.0.0.1:{}", self.replay),
            "--kv-blocks".into(),
            "4096".into(),
            "--speedup".into(),
            "50".into(),
        ])
    }
}

/// Polls `check` every 20 ms until it holds, for at most `within`; panics with `what`.
async fn until<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn get(client: &reqwest::Client, url: &str) -> Option<Value> {
    client.get(url).send().await.ok()?.json().await.ok()
}

/// Serve's view of worker 0's rank 0.
async fn rank(client: &reqwest::Client, serve: &str) -> Value {
    let workers = get(client, &format!("{serve}/v1/workers")).await.unwrap();
    workers["workers"][0]["ranks"][0].clone()
}

/// The blocks the engine's cache holds (`None`: it does not answer).
async fn engine_blocks(client: &reqwest::Client, engine: &Ports) -> Option<u64> {
    let stats = get(client, &format!("{}/admin/stats", engine.url())).await?;
    stats["blocks"]["cached_copies"].as_u64()
}

/// Waits until serve's index holds exactly what the engine's cache does, and that is
/// `at_least` blocks or more.
async fn index_matches(client: &reqwest::Client, serve: &str, engine: &Ports, at_least: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let cached = engine_blocks(client, engine).await;
        let r = rank(client, serve).await;
        if cached.is_some_and(|c| c >= at_least && r["index_blocks"].as_u64() == Some(c)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the index never matched the engine's cache: engine {cached:?}, serve {r}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `n` completions of prompts of their own (64 tokens: 4 blocks each) sent to `url`. Through
/// serve, each answer's prediction is checked against the engine's own count: no request is
/// routed on a block the engine does not hold.
async fn complete(client: &reqwest::Client, url: &str, first: u32, n: u32) {
    for i in 0..n {
        let prompt: Vec<u32> = (0..64).map(|t| (first + i) * 1_000 + t).collect();
        let r = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let predicted: Option<u64> = r
            .headers()
            .get("x-kvroute-predicted-cached-tokens")
            .and_then(|v| v.to_str().ok()?.parse().ok());
        let body: Value = r.json().await.unwrap();
        let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        if let Some(predicted) = predicted {
            assert!(
                predicted <= cached,
                "predicted {predicted} cached tokens, the engine held {cached}"
            );
        }
    }
}

/// `kvroute serve` in front of `engines`, answering: started again on another port if that
/// one was taken.
async fn serve(client: &reqwest::Client, engines: &[&Ports]) -> (Process, String) {
    for _ in 0..3 {
        let port = free_port();
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--model".into(),
            "kvroute-sim".into(),
        ];
        for e in engines {
            args.push("--worker".into());
            args.push(e.worker_flag());
        }
        let mut process = kvroute(&args);
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if client.get(format!("{url}/health")).send().await.is_ok() {
                return (process, url);
            }
            if process.0.try_wait().unwrap().is_some() || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    panic!("kvroute serve would not start");
}

async fn engine_up(client: &reqwest::Client, engine: &Ports) -> Process {
    let mut process = engine.start();
    let deadline = Instant::now() + Duration::from_secs(30);
    while client
        .get(format!("{}/health", engine.url()))
        .send()
        .await
        .is_err()
    {
        assert!(process.0.try_wait().unwrap().is_none(), "the engine exited");
        assert!(Instant::now() < deadline, "the engine never answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    process
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_listens_with_its_engine_down_and_follows_it_through_restarts() {
    let client = reqwest::Client::new();
    let engine = Ports::new();
    // The engine is not there: serve answers at once all the same, and says so.
    let started = Instant::now();
    let (_serve, url) = serve(&client, &[&engine]).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(rank(&client, &url).await["events"]["state"], "connecting");
    // It comes up: within a second its events flow, and the index follows its cache.
    let mut process = engine_up(&client, &engine).await;
    until(
        Duration::from_secs(3),
        "the stream never went live",
        || async { rank(&client, &url).await["events"]["state"] == "live" },
    )
    .await;
    complete(&client, &url, 0, 8).await;
    index_matches(&client, &url, &engine, 32).await;
    // Killed: the rank is down; what the index holds stays until the engine is back.
    drop(process);
    until(
        Duration::from_secs(3),
        "the stream never went down",
        || async { rank(&client, &url).await["events"]["state"] == "down" },
    )
    .await;
    // Started again on the same ports, a new process with an empty cache: the blocks of the
    // old one leave the index at once, and the new one's are followed from its first batch.
    process = engine_up(&client, &engine).await;
    until(
        Duration::from_secs(3),
        "the new process was never followed",
        || async {
            let r = rank(&client, &url).await;
            r["events"]["state"] == "live" && r["events"]["new_epochs"] == 1
        },
    )
    .await;
    assert_eq!(rank(&client, &url).await["index_blocks"], 0);
    // The old process's prompts again: the new one lacks them, and no prediction claims them
    // (`complete` checks each against the engine's count); sent twice, they are found.
    complete(&client, &url, 0, 8).await;
    complete(&client, &url, 0, 8).await;
    complete(&client, &url, 100, 4).await;
    index_matches(&client, &url, &engine, 48).await;
    // Restarted with batches published before serve reconnects: the catch-up fetches them.
    drop(process);
    process = engine_up(&client, &engine).await;
    complete(&client, &engine.url(), 200, 6).await;
    index_matches(&client, &url, &engine, 24).await;
    let r = rank(&client, &url).await;
    assert_eq!(r["events"]["new_epochs"], 2, "{r}");
    assert_eq!(r["events"]["lost_batches"], 0, "{r}");
    // A dropped batch after all that is still replayed: the replay socket was remade.
    client
        .post(format!("{}/admin/events/drop?batches=1", engine.url()))
        .send()
        .await
        .unwrap();
    complete(&client, &url, 300, 3).await;
    index_matches(&client, &url, &engine, 36).await;
    let r = rank(&client, &url).await;
    assert!(r["events"]["replayed"].as_u64().unwrap() >= 1, "{r}");
    assert_eq!(r["events"]["lost_batches"], 0, "{r}");
    drop(process);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_started_after_its_engine_published_catches_up_from_the_replay() {
    let client = reqwest::Client::new();
    let engine = Ports::new();
    let _process = engine_up(&client, &engine).await;
    // The engine serves and publishes with nobody listening.
    complete(&client, &engine.url(), 0, 10).await;
    let (_serve, url) = serve(&client, &[&engine]).await;
    // Serve's first connection asks the replay for everything: the index equals the cache
    // before any new request.
    index_matches(&client, &url, &engine, 40).await;
    let r = rank(&client, &url).await;
    assert_eq!(r["events"]["state"], "live", "{r}");
    assert_eq!(r["events"]["catch_ups"], 1, "{r}");
    assert!(
        r["events"]["caught_up_batches"].as_u64().unwrap() >= 10,
        "{r}"
    );
    // And it goes on live.
    complete(&client, &url, 100, 2).await;
    index_matches(&client, &url, &engine, 48).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_pass_over_an_engine_until_it_answers_and_its_events_flow() {
    let client = reqwest::Client::new();
    let (up, later) = (Ports::new(), Ports::new());
    let _up = engine_up(&client, &up).await;
    let (_serve, url) = serve(&client, &[&up, &later]).await;
    until(
        Duration::from_secs(3),
        "the first engine was never ready",
        || async {
            let w = get(&client, &format!("{url}/v1/workers")).await.unwrap();
            w["workers"][0]["ready"] == true
        },
    )
    .await;
    // The second engine is not there: no request is sent to it (none fails over from it).
    let worker_of =
        |r: &reqwest::Response| r.headers()["x-kvroute-worker"].to_str().unwrap().to_owned();
    for i in 0..6u32 {
        let prompt: Vec<u32> = (0..64).map(|t| i * 1_000 + t).collect();
        let r = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(worker_of(&r), "0");
    }
    let metrics = client
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !metrics.contains("kvroute_upstream_failures_total{kind=\"connect\"}"),
        "{metrics}"
    );
    // Once it is up and its events flow, it takes requests.
    let _later = engine_up(&client, &later).await;
    let workers = || async {
        let w = get(&client, &format!("{url}/v1/workers")).await.unwrap();
        w["workers"][1]["ready"] == true
    };
    until(
        Duration::from_secs(3),
        "the second engine was never ready",
        workers,
    )
    .await;
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..12u32 {
        let prompt: Vec<u32> = (0..64).map(|t| (100 + i) * 1_000 + t).collect();
        let r = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        seen.insert(worker_of(&r));
    }
    assert!(seen.contains("1"), "{seen:?}");
}
