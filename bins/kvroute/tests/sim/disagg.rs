//! Disaggregated serving end to end on loopback, every part a real process: two prefill and two
//! decode `kvroute worker`s behind `kvroute serve`, in vLLM's protocol and in SGLang's. The
//! decode workers answer, their KV events carry the transferred blocks, a client that leaves
//! after the prefill leaves the transfer to complete and no load behind, a killed decode worker
//! fails only the requests it held, and a killed prefill worker fails only the transfer it was
//! sending: the other takes the rest, and with both gone requests are served whole.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

use super::serve::kvroute;
use super::{free_port, Process};

/// The decode workers' transfer time: a fixed latency long enough to watch a transfer run.
const TRANSFER_MS: u64 = 250;

/// One `kvroute worker`: its process, URL, event endpoints, role and bootstrap port.
struct Worker {
    process: Process,
    id: u64,
    role: &'static str,
    url: String,
    events: String,
    replay: String,
    bootstrap: Option<u16>,
}

impl Worker {
    fn start(id: u64, role: &'static str) -> Worker {
        let (http, events, replay) = (free_port(), free_port(), free_port());
        let mut args: Vec<String> = [
            "worker",
            "--listen",
            &format!("127.0.0.1:{http}"),
            "--kv-events",
            &format!("tcp://127.0.0.1:{events}"),
            "--kv-replay",
            &format!("tcp://127.0.0.1:{replay}"),
            "--kv-blocks",
            "4096",
            "--speedup",
            "20",
            "--role",
            role,
            "--kv-transfer-latency-ms",
            &TRANSFER_MS.to_string(),
        ]
        .map(str::to_owned)
        .to_vec();
        let bootstrap = (role == "prefill").then(free_port);
        if let Some(port) = bootstrap {
            args.extend(["--bootstrap-port".to_owned(), port.to_string()]);
        }
        Worker {
            process: kvroute(&args),
            id,
            role,
            url: format!("http://127.0.0.1:{http}"),
            events: format!("tcp://127.0.0.1:{events}"),
            replay: format!("tcp://127.0.0.1:{replay}"),
            bootstrap,
        }
    }

    /// How serve's `--worker` names it.
    fn spec(&self) -> String {
        let mut spec = format!(
            "url={},events={},replay={},kv_blocks=4096,id={},role={}",
            self.url, self.events, self.replay, self.id, self.role
        );
        if let Some(port) = self.bootstrap {
            spec.push_str(&format!(",bootstrap_port={port}"));
        }
        spec
    }

    fn kill(&mut self) {
        self.process.0.kill().unwrap();
        self.process.0.wait().unwrap();
    }
}

/// Waits until `url` answers; false when `process` exits first (a port taken between
/// [`free_port`] and its bind: the caller starts it again).
async fn answers(client: &reqwest::Client, url: &str, process: &mut Process) -> bool {
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
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Serve and its workers, ready: ids 0 and 1 prefill, 2 and 3 decode.
struct Fleet {
    workers: Vec<Worker>,
    api: Api,
    _serve: Process,
}

/// Serve's HTTP API, cheap to clone into tasks that send at once.
#[derive(Clone)]
struct Api {
    url: String,
    client: reqwest::Client,
}

async fn fleet(protocol: &str) -> Fleet {
    let client = reqwest::Client::new();
    let mut workers = Vec::new();
    for (id, role) in [(0, "prefill"), (1, "prefill"), (2, "decode"), (3, "decode")] {
        let mut tries = 0;
        loop {
            let mut w = Worker::start(id, role);
            if answers(&client, &format!("{}/health", w.url), &mut w.process).await {
                workers.push(w);
                break;
            }
            tries += 1;
            assert!(tries < 3, "worker {id} would not start");
        }
    }
    let mut serve = None;
    for _ in 0..3 {
        let port = free_port();
        let mut args: Vec<String> = [
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--model",
            "kvroute-sim",
            "--pd-protocol",
            protocol,
            "--prefill-error-fallback",
            // A prefill that hangs fails after this long (and the request is served whole).
            "--first-byte-timeout-s",
            "2",
        ]
        .map(str::to_owned)
        .to_vec();
        for w in &workers {
            args.extend(["--worker".to_owned(), w.spec()]);
        }
        let mut process = kvroute(&args);
        let url = format!("http://127.0.0.1:{port}");
        if answers(&client, &format!("{url}/health"), &mut process).await {
            serve = Some((process, url));
            break;
        }
    }
    let (serve, url) = serve.expect("kvroute serve would not start");
    let f = Fleet {
        workers,
        api: Api { url, client },
        _serve: serve,
    };
    f.api
        .until("every worker is ready", |w| {
            w["workers"]
                .as_array()
                .unwrap()
                .iter()
                .all(|w| w["ready"] == true)
        })
        .await;
    f
}

/// What serve answered a completion.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// `x-kvroute-worker`.
    worker: Option<u64>,
    /// The usage (streamed: the last chunk's), when the answer completed.
    usage: Value,
    /// An error answer's message.
    error: String,
    took: Duration,
}

/// Prompt `i`: 552 tokens of its own.
fn prompt(i: u32) -> Vec<u32> {
    (i * 1_000..i * 1_000 + 552).collect()
}

impl Api {
    async fn post(&self, body: &Value, pin_prefill: Option<u64>) -> reqwest::Response {
        let mut request = self
            .client
            .post(format!("{}/v1/completions", self.url))
            .json(body);
        if let Some(id) = pin_prefill {
            request = request.header("x-kvroute-prefill-worker", id.to_string());
        }
        request.send().await.unwrap()
    }

    /// A completion of 4 tokens, streamed or not, read to its end.
    async fn complete(&self, prompt: Vec<u32>, stream: bool, pin_prefill: Option<u64>) -> Answer {
        let started = Instant::now();
        let body = json!({
            "model": "kvroute-sim", "prompt": prompt, "max_tokens": 4, "stream": stream,
            "stream_options": {"include_usage": true},
        });
        let r = self.post(&body, pin_prefill).await;
        let status = r.status().as_u16();
        let worker = r
            .headers()
            .get("x-kvroute-worker")
            .map(|v| v.to_str().unwrap().parse().unwrap());
        let text = r.text().await.unwrap_or_default();
        let mut usage = Value::Null;
        let mut error = String::new();
        if status != 200 {
            error = serde_json::from_str::<Value>(&text).map_or(text.clone(), |v| {
                v["error"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            });
        }
        if status == 200 && !stream {
            usage = serde_json::from_str::<Value>(&text).unwrap()["usage"].clone();
        }
        if status == 200 && stream && text.contains("data: [DONE]") {
            for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
                if let Ok(chunk) = serde_json::from_str::<Value>(data) {
                    if !chunk["usage"].is_null() {
                        usage = chunk["usage"].clone();
                    }
                }
            }
        }
        Answer {
            status,
            worker,
            usage,
            error,
            took: started.elapsed(),
        }
    }

    async fn get(&self, url: &str) -> Value {
        self.client
            .get(url)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Serve's `/v1/workers`.
    async fn serve_workers(&self) -> Value {
        self.get(&format!("{}/v1/workers", self.url)).await
    }

    /// Waits (at most 10 s) until `check` holds of serve's `/v1/workers`.
    async fn until(&self, what: &str, check: impl Fn(&Value) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let w = self.serve_workers().await;
            if check(&w) {
                return;
            }
            assert!(Instant::now() < deadline, "never: {what}: {w}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Serve's `kvroute_disagg_requests_total{how}`.
    async fn disagg_count(&self, how: &str) -> u64 {
        let text = self
            .client
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let key = format!("kvroute_disagg_requests_total{{how=\"{how}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .map_or(0, |n| n.parse().unwrap())
    }
}

/// Asserts `a` is a whole answer of 4 tokens from a decode worker, and returns that worker.
fn decoded(a: &Answer) -> u64 {
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.usage["completion_tokens"], 4, "{a:?}");
    let worker = a.worker.unwrap();
    assert!([2, 3].contains(&worker), "a decode worker answers: {a:?}");
    worker
}

/// The index blocks serve holds of worker `id`.
fn index_blocks(w: &Value, id: u64) -> u64 {
    w["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == id)
        .map_or(0, |w| w["ranks"][0]["index_blocks"].as_u64().unwrap_or(0))
}

impl Fleet {
    /// Worker `id`'s `/admin/stats`.
    async fn stats(&self, id: usize) -> Value {
        self.api
            .get(&format!("{}/admin/stats", self.workers[id].url))
            .await
    }

    /// A transfer count (`/admin/stats` → `transfers`) summed over workers `ids`.
    async fn transfers(&self, ids: &[usize], what: &str) -> u64 {
        let mut n = 0;
        for &id in ids {
            n += self.stats(id).await["transfers"][what].as_u64().unwrap();
        }
        n
    }

    /// An engine count (`/admin/stats` → `what`) summed over workers `ids`.
    async fn engine(&self, ids: &[usize], what: &str) -> u64 {
        let mut n = 0;
        for &id in ids {
            n += self.stats(id).await[what].as_u64().unwrap();
        }
        n
    }

    /// Waits until serve holds no load on any rank, and no transfer is left on a live worker.
    async fn settled(&self, live: &[usize]) {
        self.api
            .until("no load is booked on any rank", |w| {
                w["workers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|w| w["ranks"].as_array().unwrap().clone())
                    .all(|r| r["load"]["requests"] == 0)
            })
            .await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.transfers(live, "waiting").await + self.transfers(live, "active").await != 0 {
            assert!(Instant::now() < deadline, "a transfer was left unfinished");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until serve no longer takes worker `id` as ready.
    async fn until_not_ready(&self, id: u64) {
        self.api
            .until(&format!("worker {id} is not ready"), |w| {
                w["workers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|w| w["id"] == id && w["ready"] == false)
            })
            .await;
    }
}

/// Requests streamed and not are prefilled on a prefill worker, the KV pulled over the link's
/// time, and decoded on a decode worker, whose events carry the transferred blocks; a client
/// that leaves after the prefill leaves the transfer to complete and no load booked.
async fn split_and_client_leaves(protocol: &str) {
    let f = fleet(protocol).await;
    let mut served = Vec::new();
    for i in 0..6 {
        let a = f.api.complete(prompt(i), i % 2 == 0, None).await;
        let worker = decoded(&a);
        assert!(
            a.took >= Duration::from_millis(TRANSFER_MS),
            "the answer waited for the transfer: {a:?}"
        );
        served.push((i, worker));
    }
    assert_eq!(f.api.disagg_count("disaggregated").await, 6);
    // Every prompt was computed on a prefill worker and handed over once.
    assert_eq!(f.transfers(&[0, 1], "prefilled").await, 6);
    assert_eq!(f.transfers(&[0, 1], "sent").await, 6);
    assert_eq!(f.transfers(&[2, 3], "received").await, 6);
    // Each prompt new to its decode worker: all 34 full blocks came over the link.
    assert_eq!(f.transfers(&[2, 3], "received_tokens").await, 6 * 544);
    assert_eq!(f.engine(&[2, 3], "transferred").await, 6);
    // The decode engines hold the prompts' 34 full blocks each (552 tokens, the last one's
    // block computed there), and serve's index follows their events.
    for &(i, worker) in &served {
        let cached: Value = f
            .api
            .client
            .post(format!("{}/admin/cached", f.workers[worker as usize].url))
            .json(&json!({"prompt": prompt(i)}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            cached["cached_tokens"], 544,
            "prompt {i} on {worker}: {cached}"
        );
    }
    let engines = {
        let mut blocks = Vec::new();
        for id in [2, 3] {
            blocks.push(f.stats(id).await["blocks"]["cached"].as_u64().unwrap());
        }
        blocks
    };
    assert!(engines[0] + engines[1] >= 6 * 34, "{engines:?}");
    f.api
        .until("serve's index holds the decode workers' blocks", |w| {
            index_blocks(w, 2) == engines[0] && index_blocks(w, 3) == engines[1]
        })
        .await;
    f.settled(&[0, 1, 2, 3]).await;

    // A client that leaves once the transfer runs: it completes, and no load is left.
    let (sent, received) = (
        f.transfers(&[0, 1], "sent").await,
        f.transfers(&[2, 3], "received").await,
    );
    let body = json!({"prompt": prompt(50), "max_tokens": 5_000, "stream": true});
    let client = f.api.client.clone();
    let url = format!("{}/v1/completions", f.api.url);
    let leaving = tokio::spawn(async move {
        let r = client.post(url).json(&body).send().await.unwrap();
        let mut body = r.bytes_stream();
        while body.next().await.is_some() {}
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.transfers(&[0, 1], "active").await == 0 {
        assert!(Instant::now() < deadline, "the transfer never began");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    leaving.abort();
    let _ = leaving.await;
    f.settled(&[0, 1, 2, 3]).await;
    assert_eq!(f.transfers(&[0, 1], "sent").await, sent + 1);
    assert_eq!(f.transfers(&[2, 3], "received").await, received + 1);
    assert_eq!(f.transfers(&[0, 1], "cut").await, 0);
    // The decode engine stopped generating for it.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running = f.engine(&[2, 3], "running").await;
        let aborted = f.engine(&[2, 3], "aborted").await;
        if running == 0 && aborted == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the decode engine kept generating"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefill_and_decode_workers_split_requests_and_a_leaving_client_leaves_no_load() {
    split_and_client_leaves("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_and_decode_workers_split_requests_and_a_leaving_client_leaves_no_load() {
    split_and_client_leaves("sglang").await;
}

/// A killed decode worker fails only the streams it held; a prefill worker killed while it
/// sends a transfer fails only that request, and the other prefill worker takes the rest;
/// with both gone, requests are served whole.
async fn killed_workers(protocol: &str) {
    let mut f = fleet(protocol).await;
    // Long streams, read until they flow.
    let mut streams = Vec::new();
    for i in 0..4 {
        let body = json!({"prompt": prompt(100 + i), "max_tokens": 20_000, "stream": true});
        let r = f.api.post(&body, None).await;
        assert_eq!(r.status(), 200);
        let worker: u64 = r.headers()["x-kvroute-worker"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let mut body = r.bytes_stream();
        body.next().await.unwrap().unwrap();
        streams.push((worker, body));
    }
    let victim = streams[0].0;
    let survivor = 5 - victim;
    // Decode choice is by load: the streams are spread over both decode workers.
    assert!(streams.iter().any(|(w, _)| *w == survivor));
    f.workers[victim as usize].kill();
    for (worker, body) in &mut streams {
        if *worker == victim {
            // Cut: an error or an end without [DONE].
            let mut rest = Vec::new();
            while let Some(Ok(chunk)) = body.next().await {
                rest.extend_from_slice(&chunk);
            }
            assert!(!String::from_utf8_lossy(&rest).contains("[DONE]"));
        } else {
            for _ in 0..20 {
                body.next().await.unwrap().unwrap();
            }
        }
    }
    drop(streams);
    f.until_not_ready(victim).await;
    for i in 0..4 {
        let a = f.api.complete(prompt(200 + i), i % 2 == 0, None).await;
        assert_eq!(decoded(&a), survivor, "{a:?}");
    }

    // Prefill worker 0 killed while it sends a transfer: that request fails; one that worker
    // 1 sends meanwhile succeeds.
    let (sending, other) = {
        let (a, b) = (f.api.clone(), f.api.clone());
        (
            tokio::spawn(async move { a.complete(prompt(300), false, Some(0)).await }),
            tokio::spawn(async move { b.complete(prompt(301), true, Some(1)).await }),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.transfers(&[0], "active").await == 0 || f.transfers(&[1], "active").await == 0 {
        assert!(Instant::now() < deadline, "the transfers never began");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    f.workers[0].kill();
    let failed = sending.await.unwrap();
    assert_eq!(failed.status, 503, "{failed:?}");
    assert!(failed.error.contains("KV transfer failed"), "{failed:?}");
    decoded(&other.await.unwrap());
    f.until_not_ready(0).await;
    let sent = f.transfers(&[1], "sent").await;
    for i in 0..4 {
        let a = f.api.complete(prompt(400 + i), i % 2 == 1, None).await;
        decoded(&a);
    }
    assert_eq!(f.transfers(&[1], "sent").await, sent + 4);

    if protocol == "vllm" {
        // The last prefill worker stalls (paused): its prefill fails after serve's first-byte
        // timeout, and with --prefill-error-fallback the request is served whole.
        let admin = |what: &str| format!("{}/admin/{what}", f.workers[1].url);
        let paused = f.api.client.post(admin("pause")).send().await.unwrap();
        assert_eq!(paused.status(), 200);
        let received = f.transfers(&[survivor as usize], "received").await;
        let a = f.api.complete(prompt(500), false, None).await;
        assert_eq!(decoded(&a), survivor);
        assert_eq!(f.api.disagg_count("prefill_fallback").await, 1);
        assert_eq!(
            f.transfers(&[survivor as usize], "received").await,
            received
        );
        let resumed = f.api.client.post(admin("resume")).send().await.unwrap();
        assert_eq!(resumed.status(), 200);
    }
    // Both prefill workers gone: requests are served whole on the decode worker.
    f.workers[1].kill();
    f.until_not_ready(1).await;
    let received = f.transfers(&[survivor as usize], "received").await;
    for i in 0..4 {
        let a = f.api.complete(prompt(600 + i), i % 2 == 0, None).await;
        assert_eq!(decoded(&a), survivor);
    }
    assert_eq!(f.api.disagg_count("whole").await, 4);
    assert_eq!(
        f.transfers(&[survivor as usize], "received").await,
        received,
        "served whole: nothing transferred"
    );
    f.settled(&[survivor as usize]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_killed_workers_fail_only_their_own_requests() {
    killed_workers("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_killed_workers_fail_only_their_own_requests() {
    killed_workers("sglang").await;
}
