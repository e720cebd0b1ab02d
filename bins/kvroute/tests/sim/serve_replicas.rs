//! Several `kvroute serve` replicas, one fleet, every part a real process on loopback: a real
//! `nats-server`, `kvroute worker` engines, and replicas sharing their bookings over NATS.
//! A replica sees the others' requests in flight, drops a killed one's within seconds, routes
//! on its own bookings while NATS is down and takes the others' back when it returns, and a
//! replica started late catches up. Workers added or removed through one replica's API reach
//! every replica through the registry in NATS JetStream's key-value store. Three replicas on
//! four workers serve a workload spread over them with one router's hit rate, through NATS
//! killed and restarted in the middle, and leave no booking behind.

use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

use super::serve::{ready_engines, ready_serve, signal, Engine};
use super::{free_port, skip_without_fixtures, Process};

/// A `nats-server` on a free port, the port, and a fleet name of the test's own (none when
/// `nats-server` is not installed).
fn nats_on_a_free_port() -> Option<(Process, u16, String)> {
    let port = free_port();
    // A store left by an earlier run on this port would hand its fleet's workers on.
    let _ = std::fs::remove_dir_all(store(port));
    Some((nats_server(port)?, port, format!("t{port}")))
}

/// Where the server on `port` stores JetStream's streams.
fn store(port: u16) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("kvroute-nats-{port}"))
}

/// A `nats-server` on `port` (the system's package) with JetStream, storing in a directory of
/// its own, or none when it is not installed. Started again while it exits at once (the port
/// held a moment by another socket).
fn nats_server(port: u16) -> Option<Process> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let child = Command::new(kvroute_serve::nats_server_program())
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(store(port))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let Ok(child) = child else {
            skip_without_fixtures("no nats-server on PATH: run scripts/fixtures.sh");
            return None;
        };
        let mut server = Process(child);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server never listened");
            if server.0.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if server.0.try_wait().unwrap().is_none() {
            return Some(server);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The workers a replica lists, by id, with whether each is ready.
async fn workers(client: &reqwest::Client, url: &str) -> Vec<(u64, bool)> {
    let w = workers_json(client, url).await;
    let mut out: Vec<(u64, bool)> = w["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["id"].as_u64().unwrap(), w["ready"] == true))
        .collect();
    out.sort();
    out
}

/// What a replica's `/v1/workers` says of the registry.
async fn registry(client: &reqwest::Client, url: &str) -> String {
    let w = workers_json(client, url).await;
    w["registry"].as_str().unwrap_or_default().to_owned()
}

/// A worker's spec as `/v1/workers` takes it.
fn spec(id: u64, e: &Engine) -> Value {
    json!({"id": id, "url": e.url, "kv_events": e.events, "kv_replay": e.replay, "kv_blocks": 4096})
}

/// Adds a worker through a replica's API; its answer.
async fn add_worker(client: &reqwest::Client, url: &str, spec: Value) -> Value {
    let r = client
        .post(format!("{url}/v1/workers"))
        .json(&spec)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    r.json().await.unwrap()
}

/// Removes a worker through a replica's API; its answer.
async fn remove_worker(client: &reqwest::Client, url: &str, id: u64) -> Value {
    let r = client
        .delete(format!("{url}/v1/workers/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// A replica of the fleet `fleet` in front of `engines`, sharing bookings through the NATS
/// server on `nats`.
async fn replica(
    client: &reqwest::Client,
    engines: &[Engine],
    nats: u16,
    fleet: &str,
) -> (Process, String) {
    let ids: Vec<u64> = (0..engines.len() as u64).collect();
    replica_with(client, engines, &ids, nats, fleet).await
}

/// [`replica`], with the engines' worker ids.
async fn replica_with(
    client: &reqwest::Client,
    engines: &[Engine],
    ids: &[u64],
    nats: u16,
    fleet: &str,
) -> (Process, String) {
    let mut args = fleet_args(engines, ids);
    args.extend(sync_args(nats, fleet));
    // The cheapest worker exactly (replicas default to near-ties drawn at random), so that
    // the tests can tell where each request goes.
    args.extend(["--near-tie".into(), "0".into()]);
    ready_serve(client, &args).await
}

/// A router's flags for the model and `engines`, under worker ids `ids`.
fn fleet_args(engines: &[Engine], ids: &[u64]) -> Vec<String> {
    let mut args: Vec<String> = vec!["--model".into(), "kvroute-sim".into()];
    for (e, id) in engines.iter().zip(ids) {
        args.push("--worker".into());
        args.push(format!(
            "id={id},url={},events={},replay={},kv_blocks=4096",
            e.url, e.events, e.replay
        ));
    }
    args
}

/// The flags that make a router a replica of `fleet` through the NATS server on `nats`.
fn sync_args(nats: u16, fleet: &str) -> Vec<String> {
    vec![
        "--nats".into(),
        format!("nats://127.0.0.1:{nats}"),
        "--fleet".into(),
        fleet.into(),
    ]
}

/// A GET answered.
async fn get(client: &reqwest::Client, url: &str) -> reqwest::Response {
    client.get(url).send().await.unwrap()
}

/// A replica's `/v1/workers`.
async fn workers_json(client: &reqwest::Client, url: &str) -> Value {
    get(client, &format!("{url}/v1/workers"))
        .await
        .json()
        .await
        .unwrap()
}

/// Whether a replica's view is shared, and the others' requests it counts.
async fn view(client: &reqwest::Client, url: &str) -> (f64, f64) {
    (
        metric(client, url, "kvroute_replica_sync_up").await,
        metric(client, url, "kvroute_remote_requests").await,
    )
}

/// Requests a replica counts on each worker (its own and the others').
async fn requests(client: &reqwest::Client, url: &str) -> Vec<u64> {
    let w = workers_json(client, url).await;
    w["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            w["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["load"]["requests"].as_u64().unwrap_or(0))
                .sum()
        })
        .collect()
}

/// A gauge or counter of a replica's `/metrics` (0 when absent).
async fn metric(client: &reqwest::Client, url: &str, name: &str) -> f64 {
    let text = get(client, &format!("{url}/metrics"))
        .await
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Waits up to `within` for `check` to hold of what `probe` reads; panics with the last
/// reading otherwise.
async fn eventually<T: std::fmt::Debug, F: std::future::Future<Output = T>>(
    within: Duration,
    what: &str,
    mut probe: impl FnMut() -> F,
    check: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        let v = probe().await;
        if check(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: still {v:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The KV blocks each rank's engine reports in use, as the replica at `url` counts them.
async fn engine_blocks(client: &reqwest::Client, url: &str) -> Vec<u64> {
    workers_json(client, url).await["workers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["ranks"].as_array().unwrap().clone())
        .map(|r| r["engine_blocks"].as_u64().unwrap())
        .collect()
}

/// A long streamed completion through `url`, held open once its first token arrived.
async fn hold(
    client: &reqwest::Client,
    url: &str,
    family: u32,
) -> impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin {
    held_on(client, url, family).await.1
}

/// [`hold`], and the worker that serves it (`x-kvroute-worker`).
async fn held_on(
    client: &reqwest::Client,
    url: &str,
    family: u32,
) -> (
    String,
    impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin,
) {
    let prompt: Vec<u32> = (family * 10_000..family * 10_000 + 300).collect();
    let body =
        json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 3000, "stream": true});
    let response = client
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let worker = response.headers()["x-kvroute-worker"]
        .to_str()
        .unwrap()
        .to_owned();
    let mut stream = response.bytes_stream();
    stream.next().await.unwrap().unwrap();
    (worker, stream)
}

/// Engines at real time, so that a long answer stays in flight while the test looks.
async fn slow_engines(client: &reqwest::Client, n: usize) -> Vec<Engine> {
    ready_engines(client, n, &["--speedup".into(), "1".into()]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_see_each_others_requests_and_drop_a_killed_ones() {
    let Some((_nats, nats_port, fleet)) = nats_on_a_free_port() else {
        return;
    };
    let client = reqwest::Client::new();
    let engines = slow_engines(&client, 3).await;
    let (mut a, url_a) = replica(&client, &engines, nats_port, &fleet).await;
    let (_b, url_b) = replica(&client, &engines, nats_port, &fleet).await;
    let (mut c, url_c) = replica(&client, &engines, nats_port, &fleet).await;
    for url in [&url_a, &url_b, &url_c] {
        eventually(
            Duration::from_secs(10),
            "replica peers",
            || metric(&client, url, "kvroute_replica_peers"),
            |p| *p == 2.0,
        )
        .await;
    }

    // Three unrelated long requests, one through each replica: each replica sees the others'
    // and sends its own to a worker left idle.
    let mut held = Vec::new();
    for (i, url) in [&url_a, &url_b, &url_c].into_iter().enumerate() {
        held.push(hold(&client, url, 1 + i as u32).await);
        eventually(
            Duration::from_secs(2),
            "every replica sees the requests so far",
            || async {
                let mut all = Vec::new();
                for u in [&url_a, &url_b, &url_c] {
                    all.push(requests(&client, u).await.iter().sum::<u64>());
                }
                all
            },
            |all| all.iter().all(|n| *n == i as u64 + 1),
        )
        .await;
    }
    for url in [&url_a, &url_b, &url_c] {
        assert_eq!(requests(&client, url).await, vec![1, 1, 1], "{url}");
        assert_eq!(metric(&client, url, "kvroute_remote_requests").await, 2.0);
        assert_eq!(metric(&client, url, "kvroute_replica_sync_up").await, 1.0);
    }

    // A killed replica says no goodbye: the others drop its booking once it is quiet.
    signal(&a, "KILL");
    a.0.wait().unwrap();
    let gone = Instant::now();
    for url in [&url_b, &url_c] {
        eventually(
            Duration::from_secs(5),
            "the killed replica's booking leaves",
            || metric(&client, url, "kvroute_remote_requests"),
            |n| *n == 1.0,
        )
        .await;
    }
    assert!(gone.elapsed() < Duration::from_secs(5));
    // Only the killed replica's request failed: the others' still stream.
    for stream in &mut held[1..] {
        let chunk = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("a surviving replica's stream stalled");
        assert!(matches!(chunk, Some(Ok(_))), "{chunk:?}");
    }

    // The others end their requests: nothing is left anywhere.
    drop(held);
    for url in [&url_b, &url_c] {
        eventually(
            Duration::from_secs(5),
            "load back to zero",
            || requests(&client, url),
            |r| r.iter().all(|n| *n == 0),
        )
        .await;
    }

    // A replica told to stop says goodbye: B forgets it at once, not after 2 s of silence.
    signal(&c, "TERM");
    let asked = Instant::now();
    eventually(
        Duration::from_secs(5),
        "B forgets the replica that stopped",
        || metric(&client, &url_b, "kvroute_replica_peers"),
        |p| *p == 0.0,
    )
    .await;
    assert!(
        asked.elapsed() < Duration::from_millis(1_500),
        "{:?}",
        asked.elapsed()
    );
    assert!(c.0.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_nats_a_replica_routes_alone_and_takes_the_others_back_when_it_returns() {
    let Some((nats, nats_port, fleet)) = nats_on_a_free_port() else {
        return;
    };
    let client = reqwest::Client::new();
    let engines = slow_engines(&client, 2).await;
    let (_a, url_a) = replica(&client, &engines, nats_port, &fleet).await;
    let (_b, url_b) = replica(&client, &engines, nats_port, &fleet).await;
    let _held_a = hold(&client, &url_a, 1).await;
    eventually(
        Duration::from_secs(5),
        "B sees A's request",
        || metric(&client, &url_b, "kvroute_remote_requests"),
        |n| *n == 1.0,
    )
    .await;

    // NATS dies: B's view is its own, and it still routes.
    drop(nats);
    eventually(
        Duration::from_secs(5),
        "B's view is local",
        || view(&client, &url_b),
        |v| *v == (0.0, 0.0),
    )
    .await;
    let body =
        json!({"model": "kvroute-sim", "prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 2});
    let r = client
        .post(format!("{url_b}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // ...and weighs the engines' own word on their KV blocks, A's request's among them.
    eventually(
        Duration::from_secs(5),
        "B reads the engines' load",
        || engine_blocks(&client, &url_b),
        |b| b.iter().sum::<u64>() > 0,
    )
    .await;

    // NATS is back on the same port: both reconnect, and B takes A's request back.
    let Some(_nats) = nats_server(nats_port) else {
        return;
    };
    eventually(
        Duration::from_secs(10),
        "B takes A's booking back",
        || view(&client, &url_b),
        |v| *v == (1.0, 1.0),
    )
    .await;
    eventually(
        Duration::from_secs(5),
        "B sets the engines' word aside",
        || engine_blocks(&client, &url_b),
        |b| b.iter().all(|n| *n == 0),
    )
    .await;

    // A replica started now catches up with what is in flight.
    let (_c, url_c) = replica(&client, &engines, nats_port, &fleet).await;
    eventually(
        Duration::from_secs(5),
        "the late replica sees A's request",
        || metric(&client, &url_c, "kvroute_remote_requests"),
        |n| *n == 1.0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_added_or_removed_through_one_replica_reaches_every_replica() {
    let Some((_nats, nats_port, fleet)) = nats_on_a_free_port() else {
        return;
    };
    let client = reqwest::Client::new();
    let engines = ready_engines(&client, 2, &[]).await;
    // Both replicas start with the first engine only.
    let (_a, url_a) = replica(&client, &engines[..1], nats_port, &fleet).await;
    let (mut b, url_b) = replica(&client, &engines[..1], nats_port, &fleet).await;
    for url in [&url_a, &url_b] {
        eventually(
            Duration::from_secs(5),
            "the registry is shared",
            || registry(&client, url),
            |r| r == "shared",
        )
        .await;
    }

    // Added through A: B has it, ready, within a second.
    let added = add_worker(&client, &url_a, spec(7, &engines[1])).await;
    assert_eq!(added, json!({"id": 7, "shared": true, "pending": false}));
    let t = Instant::now();
    eventually(
        Duration::from_secs(1),
        "B has the worker A added",
        || workers(&client, &url_b),
        |w| *w == vec![(0, true), (7, true)],
    )
    .await;
    eprintln!("worker added through A ready on B after {:?}", t.elapsed());
    // B routes to it: two long answers at once through B go one to each worker.
    let (first, held) = held_on(&client, &url_b, 3).await;
    let (second, also_held) = held_on(&client, &url_b, 4).await;
    let mut served = [first, second];
    served.sort();
    assert_eq!(served, ["0", "7"], "B uses the worker added through A");
    drop((held, also_held));
    // Left by their client: freed on B, and so on A.
    for url in [&url_a, &url_b] {
        eventually(
            Duration::from_secs(5),
            "the held requests are freed everywhere",
            || requests(&client, url),
            |r| r.iter().all(|n| *n == 0),
        )
        .await;
    }
    // Another spec under the same id, through B: refused, not swapped in on every replica.
    let other = client
        .post(format!("{url_b}/v1/workers"))
        .json(&spec(7, &engines[0]))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), reqwest::StatusCode::CONFLICT);
    let url_of_7 = |v: Value| {
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["id"] == 7)
            .map(|w| w["url"].clone())
    };
    for url in [&url_a, &url_b] {
        let held = url_of_7(workers_json(&client, url).await);
        assert_eq!(held, Some(json!(engines[1].url)), "{url}");
    }

    // B restarts with its old configuration: the registry gives it the worker back.
    signal(&b, "KILL");
    b.0.wait().unwrap();
    let (mut b, url_b) = replica(&client, &engines[..1], nats_port, &fleet).await;
    eventually(
        Duration::from_secs(5),
        "a restarted replica takes the fleet's workers",
        || workers(&client, &url_b),
        |w| w.iter().map(|x| x.0).collect::<Vec<_>>() == vec![0, 7],
    )
    .await;

    // Removed through B: A drops it within a second.
    let removed = remove_worker(&client, &url_b, 7).await;
    assert_eq!(removed["shared"], true, "{removed}");
    eventually(
        Duration::from_secs(1),
        "A drops the worker B removed",
        || workers(&client, &url_a),
        |w| *w == vec![(0, true)],
    )
    .await;

    // A replica configured with the removed worker does not bring it back.
    signal(&b, "KILL");
    b.0.wait().unwrap();
    let (_b, url_b) = replica_with(&client, &engines, &[0, 7], nats_port, &fleet).await;
    eventually(
        Duration::from_secs(5),
        "the removed worker stays removed",
        || workers(&client, &url_b),
        |w| w.iter().map(|x| x.0).collect::<Vec<_>>() == vec![0],
    )
    .await;
    assert_eq!(workers(&client, &url_a).await, vec![(0, true)]);
}

/// Waits until the router at `url` has `n` workers, every one ready.
async fn all_ready(client: &reqwest::Client, url: &str, n: usize) {
    eventually(
        Duration::from_secs(10),
        "every worker ready",
        || workers(client, url),
        |w| w.len() == n && w.iter().all(|x| x.1),
    )
    .await;
}

/// Prompt families of [`workload`]: each request shares its family's first 512 tokens.
const FAMILIES: u32 = 8;

/// What a workload's answers said: the worker each request went to, and prompt tokens sent
/// and found cached by the engines (`usage.prompt_tokens_details.cached_tokens`).
#[derive(Debug, Default)]
struct Served {
    per_worker: std::collections::BTreeMap<String, u32>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

impl Served {
    fn hit_rate(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }

    /// The busiest worker's requests over the mean's, over `workers` workers.
    fn imbalance(&self, workers: usize) -> f64 {
        let total: u32 = self.per_worker.values().sum();
        let max = self.per_worker.values().copied().max().unwrap_or(0);
        max as f64 * workers as f64 / total.max(1) as f64
    }
}

/// Requests `first..last` of a workload of [`FAMILIES`] prompt families (numbered from
/// `base`), taken in turn, four in flight, request `i` sent to `urls[i % urls.len()]`; each
/// must be answered 200.
async fn workload(
    client: &reqwest::Client,
    urls: &[String],
    base: u32,
    requests: std::ops::Range<u32>,
    served: &mut Served,
) {
    let answers: Vec<(u32, reqwest::Response)> = futures_util::stream::iter(requests)
        .map(|i| {
            let family = base + i % FAMILIES;
            let mut prompt: Vec<u32> = (family * 2_000..family * 2_000 + 512).collect();
            prompt.extend(40_000 + i * 64..40_000 + i * 64 + 64);
            let body = json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 4});
            let url = format!("{}/v1/completions", urls[i as usize % urls.len()]);
            let client = client.clone();
            async move { (i, client.post(url).json(&body).send().await.unwrap()) }
        })
        .buffer_unordered(4)
        .collect()
        .await;
    for (i, r) in answers {
        assert_eq!(r.status(), 200, "request {i}");
        let worker = r.headers()["x-kvroute-worker"].to_str().unwrap().to_owned();
        *served.per_worker.entry(worker).or_default() += 1;
        let v: Value = r.json().await.unwrap();
        served.prompt_tokens += v["usage"]["prompt_tokens"].as_u64().unwrap();
        served.cached_tokens += v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_four_workers_serve_as_one_router_through_a_nats_restart() {
    let Some((nats, nats_port, fleet)) = nats_on_a_free_port() else {
        return;
    };
    let client = reqwest::Client::new();
    let engines = ready_engines(&client, 4, &[]).await;
    let ids: Vec<u64> = (0..4).collect();
    const N: u32 = 96;

    // One router, alone, on families 0..8.
    let (one, url) = ready_serve(&client, &fleet_args(&engines, &ids)).await;
    all_ready(&client, &url, 4).await;
    let mut alone = Served::default();
    workload(&client, &[url], 0, 0..N, &mut alone).await;
    drop(one);

    // Three replicas with the replicas' defaults, on families 8..16 of the same shape, the
    // requests handed to them in turn.
    let mut args = fleet_args(&engines, &ids);
    args.extend(sync_args(nats_port, &fleet));
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(ready_serve(&client, &args).await);
    }
    let urls: Vec<String> = replicas.iter().map(|r| r.1.clone()).collect();
    for url in &urls {
        all_ready(&client, url, 4).await;
    }
    let all_synced = |peers: f64| {
        let (client, urls) = (&client, &urls);
        async move {
            for url in urls {
                eventually(
                    Duration::from_secs(10),
                    "every replica shares its view",
                    || async {
                        (
                            metric(client, url, "kvroute_replica_sync_up").await,
                            metric(client, url, "kvroute_replica_peers").await,
                        )
                    },
                    |v| *v == (1.0, peers),
                )
                .await;
            }
        }
    };
    all_synced(2.0).await;
    let mut spread = Served::default();
    workload(&client, &urls, FAMILIES, 0..N / 3, &mut spread).await;
    // NATS dies mid-run: every request is still answered, each replica on its own view.
    drop(nats);
    for url in &urls {
        eventually(
            Duration::from_secs(5),
            "the view is local",
            || view(&client, url),
            |v| *v == (0.0, 0.0),
        )
        .await;
    }
    workload(&client, &urls, FAMILIES, N / 3..2 * N / 3, &mut spread).await;
    // It comes back: the replicas share their view again and finish the run.
    let Some(_nats) = nats_server(nats_port) else {
        return;
    };
    all_synced(2.0).await;
    workload(&client, &urls, FAMILIES, 2 * N / 3..N, &mut spread).await;

    eprintln!(
        "one router: hit rate {:.3}, imbalance {:.2} {:?}; three replicas: {:.3}, {:.2} {:?}",
        alone.hit_rate(),
        alone.imbalance(4),
        alone.per_worker,
        spread.hit_rate(),
        spread.imbalance(4),
        spread.per_worker
    );
    // Every family's later requests find its prefix wherever it was served first, through
    // the replicas as through one router.
    assert!(alone.hit_rate() > 0.7, "{alone:?}");
    assert!(
        spread.hit_rate() >= 0.97 * alone.hit_rate(),
        "replicas {spread:?} against one router {alone:?}"
    );
    // Not herded onto one worker (that would be 4). Eight families on four workers, each
    // request brief, may clump by chance through one router as through three (2 is four
    // families on one worker).
    assert!(spread.imbalance(4) <= 3.0, "{spread:?}");
    // Nothing booked is left behind on any replica, the outage's requests included.
    for url in &urls {
        eventually(
            Duration::from_secs(5),
            "every replica's load back to zero",
            || requests(&client, url),
            |r| r.iter().all(|n| *n == 0),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_removed_before_the_registry_was_reached_stays_removed_once_it_is() {
    let client = reqwest::Client::new();
    let engines = ready_engines(&client, 3, &[]).await;
    // No NATS server yet on the fleet's port.
    let port = free_port();
    let _ = std::fs::remove_dir_all(store(port));
    let fleet = format!("t{port}");
    let (_b, url_b) = replica(&client, &engines, port, &fleet).await;
    assert_eq!(registry(&client, &url_b).await, "unreachable");
    // Removed through B while it has no registry: to be written once there is one.
    let removed = remove_worker(&client, &url_b, 1).await;
    assert_eq!(
        (&removed["shared"], &removed["pending"]),
        (&json!(false), &json!(true))
    );
    // Worker 2 removed and added again: it stays.
    assert_eq!(remove_worker(&client, &url_b, 2).await["id"], 2);
    let added = add_worker(&client, &url_b, spec(2, &engines[2])).await;
    assert_eq!(added, json!({"id": 2, "shared": false, "pending": true}));
    eventually(
        Duration::from_secs(5),
        "B drops worker 1",
        || workers(&client, &url_b),
        |w| w.iter().map(|x| x.0).collect::<Vec<_>>() == vec![0, 2],
    )
    .await;

    // NATS starts, and A, configured with every worker, joins the fleet: whichever of A and B
    // reaches the registry first, the removal stands on both, and so does the worker added
    // again.
    let Some(_nats) = nats_server(port) else {
        return;
    };
    let (_a, url_a) = replica(&client, &engines, port, &fleet).await;
    for url in [&url_a, &url_b] {
        eventually(
            Duration::from_secs(10),
            "the registry is shared",
            || registry(&client, url),
            |r| r == "shared",
        )
        .await;
    }
    for url in [&url_a, &url_b] {
        eventually(
            Duration::from_secs(5),
            "the removal made before the registry was reached stands",
            || workers(&client, url),
            |w| w.iter().map(|x| x.0).collect::<Vec<_>>() == vec![0, 2],
        )
        .await;
    }
    // And stays: nothing brings worker 1 back, or takes worker 2 away, a moment later.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for url in [&url_a, &url_b] {
        let ids: Vec<u64> = workers(&client, url).await.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![0, 2], "{url}");
    }
}
