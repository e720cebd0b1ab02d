//! `kvroute demo --live`: the same workload through real processes on loopback, the
//! production path end to end: N `kvroute worker` engines (vLLM's HTTP and ZeroMQ
//! interfaces), one `kvroute serve`, and `kvroute replay`'s client, with faults injected
//! mid-run when asked. With `--replicas N`, N `kvroute serve` replicas instead, sharing their
//! bookings through a `nats-server` the run starts, the client handing them requests in turn.
//!
//! Time runs `time_scale` times faster than the engines' model: their passes are scaled by it
//! and the workload's arrivals too, so the fleet sees the same load as the in-process demo's
//! virtual clock, in less wall time.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::replay::{self, ReplayOptions, ReplayRecord, ReplayReport};
use kvroute_sim::workload::Workload;
use kvroute_sim::EngineConfig;

/// How the live demo runs.
#[derive(Clone, Debug)]
pub struct LiveOptions {
    /// The `kvroute` executable to start the processes from.
    pub exe: PathBuf,
    /// Workers.
    pub workers: usize,
    /// Every engine's model.
    pub engine: EngineConfig,
    /// The engines' timing model as `kvroute worker --timing` takes it (a name or a
    /// calibration file): `engine.timing` as the workers will read it.
    pub timing: String,
    /// How much faster than the model wall time runs (engine passes and arrivals alike).
    pub time_scale: f64,
    /// The serving policy (`kv-aware`, `round-robin`, ...).
    pub policy: String,
    /// Inject faults mid-run: two event batches dropped on worker 0 at a third of the run,
    /// worker 1 restarted (cache emptied, event sequence back to 0) at half, worker 2 killed at
    /// two thirds.
    pub faults: bool,
    /// Ask every worker, before each request is sent, how much of its prompt it holds (the
    /// replay's oracle). Each worker then reads every prompt once more: at a high time scale
    /// on few cores that load slows the fleet it measures.
    pub oracle: bool,
    /// The routers: 1 is one `kvroute serve`; N ≥ 2 are N replicas of one fleet sharing their
    /// bookings through a `nats-server` the run starts (it must be on PATH), the client
    /// handing them requests in turn.
    pub replicas: usize,
}

/// One worker's cache as the engine holds it and as the router's index holds it.
#[derive(Clone, Debug, Serialize)]
pub struct CacheCheck {
    /// The worker.
    pub worker: usize,
    /// Blocks the engine caches, each copy of a block counted as the events name them (none
    /// when it was killed).
    pub engine_blocks: Option<u64>,
    /// Blocks the router's index holds for it.
    pub index_blocks: u64,
    /// Its KV-event stream as the router saw it (gaps, replays, restarts, ...).
    pub events: Value,
}

/// What the live run did.
#[derive(Clone, Debug, Serialize)]
pub struct LiveReport {
    /// The replay's figures.
    pub replay: ReplayReport,
    /// Each worker's cache, engine against index, once the run was over.
    pub caches: Vec<CacheCheck>,
    /// Requests the router still held at the end (0 when load returned to zero).
    pub active_at_end: u64,
    /// The faults injected, in order, with when.
    pub faults: Vec<String>,
    /// Failed requests by the worker kvroute had sent them to (`None`: never routed).
    pub failed_by_worker: Vec<(Option<u64>, usize)>,
    /// The first failure of each of those, as the client saw it: the worker, when it was sent
    /// (ms from the start), the HTTP status (0: no answer) and the error.
    pub first_failures: Vec<(Option<u64>, f64, u16, String)>,
    /// Each replica at the end, with several (empty with one router).
    pub replicas: Vec<ReplicaCheck>,
}

/// One `kvroute serve` replica at the end of a run with several.
#[derive(Clone, Debug, Serialize)]
pub struct ReplicaCheck {
    /// Its base URL.
    pub url: String,
    /// Requests the client sent it.
    pub sent: usize,
    /// Requests it answered, by its own count (`kvroute_requests_total`, outcome `ok`, over
    /// every route).
    pub served: f64,
    /// `kvroute_replica_sync_up`: 1 while it shared bookings over NATS.
    pub sync_up: Option<f64>,
    /// `kvroute_replica_peers`: the other replicas whose bookings it held.
    pub peers: Option<f64>,
    /// `kvroute_replica_sync{kind="applied"}`: the others' booking changes it applied.
    pub applied: Option<f64>,
}

/// A child process killed when dropped.
struct Process(Option<Child>);

impl Process {
    fn kill(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn spawn(exe: &PathBuf, args: &[String]) -> std::io::Result<Process> {
    let child = Command::new(exe)
        .args(args)
        .env("KVROUTE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    Ok(Process(Some(child)))
}

/// Starts a process from `build` (its arguments, its base URL and what the caller keeps of
/// it, for fresh ports each time) and waits for its `/health`. One that exits first (a port
/// taken between choosing it and binding it) is started again on other ports, twice at most.
async fn start<T>(
    client: &reqwest::Client,
    exe: &PathBuf,
    mut build: impl FnMut() -> std::io::Result<(Vec<String>, String, T)>,
) -> anyhow::Result<(Process, String, T)> {
    for _ in 0..3 {
        let (args, url, kept) = build()?;
        let mut process = spawn(exe, &args)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = client.get(format!("{url}/health")).send().await {
                if r.status().is_success() {
                    return Ok((process, url, kept));
                }
            }
            let exited = match process.0.as_mut() {
                Some(child) => child.try_wait()?.is_some(),
                None => true,
            };
            if exited {
                break;
            }
            if Instant::now() >= deadline {
                anyhow::bail!("{url} never answered");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    anyhow::bail!("{} would not start", exe.display())
}

async fn get_json(client: &reqwest::Client, url: &str) -> Option<Value> {
    client.get(url).send().await.ok()?.json().await.ok()
}

/// A `nats-server` with JetStream on a free loopback port, its store in a directory of its
/// own: killed, and its store removed, when dropped.
struct NatsServer {
    process: Process,
    store: PathBuf,
    url: String,
}

impl NatsServer {
    async fn start() -> anyhow::Result<Self> {
        let port = free_port()?;
        let store =
            std::env::temp_dir().join(format!("kvroute-demo-nats-{}-{port}", std::process::id()));
        let child = Command::new(kvroute_serve::nats_server_program())
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(&store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let mut server = match child {
            Ok(child) => Self {
                process: Process(Some(child)),
                store,
                url: format!("nats://127.0.0.1:{port}"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!(
                "--live --replicas needs nats-server on PATH (scripts/fixtures.sh installs it)"
            ),
            Err(e) => return Err(anyhow::Error::new(e).context("starting nats-server")),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            let exited = match server.process.0.as_mut() {
                Some(child) => child.try_wait()?.is_some(),
                None => true,
            };
            if exited || Instant::now() >= deadline {
                anyhow::bail!("nats-server never listened on 127.0.0.1:{port}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(server)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.process.kill();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

/// The engines: their processes, base URLs and specs as `kvroute serve --worker` takes them.
struct Engines {
    processes: Vec<Process>,
    urls: Vec<String>,
    specs: Vec<String>,
}

/// Starts `options.workers` engines, their passes `scale` times faster than their model.
async fn start_engines(
    client: &reqwest::Client,
    options: &LiveOptions,
    scale: f64,
) -> anyhow::Result<Engines> {
    let mut engines = Engines {
        processes: Vec::new(),
        urls: Vec::new(),
        specs: Vec::new(),
    };
    for _ in 0..options.workers {
        let build = || {
            let (http, events, replay) = (free_port()?, free_port()?, free_port()?);
            let args: Vec<String> = vec![
                "worker".into(),
                "--listen".into(),
                format!("127.0.0.1:{http}"),
                "--kv-events".into(),
                format!("tcp://127.0.0.1:{events}"),
                "--kv-replay".into(),
                format!("tcp://127.0.0.1:{replay}"),
                "--kv-blocks".into(),
                options.engine.kv_blocks.to_string(),
                "--block-size".into(),
                options.engine.block_size.to_string(),
                "--speedup".into(),
                scale.to_string(),
                "--timing".into(),
                options.timing.clone(),
            ];
            let url = format!("http://127.0.0.1:{http}");
            let spec = format!(
                "url={url},events=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay},kv_blocks={},block_size={}",
                options.engine.kv_blocks, options.engine.block_size
            );
            Ok((args, url, spec))
        };
        let (process, url, spec) = start(client, &options.exe, build).await?;
        engines.processes.push(process);
        engines.specs.push(spec);
        engines.urls.push(url);
    }
    Ok(engines)
}

/// Starts the routers in front of `specs`: one `kvroute serve`, or with `nats` as many
/// replicas of one fleet as `options.replicas`, sharing their bookings through it.
async fn start_routers(
    client: &reqwest::Client,
    options: &LiveOptions,
    specs: &[String],
    nats: Option<&NatsServer>,
) -> anyhow::Result<(Vec<Process>, Vec<String>)> {
    let (mut processes, mut urls) = (Vec::new(), Vec::new());
    let count = if nats.is_some() { options.replicas } else { 1 };
    for _ in 0..count {
        let build = || {
            let port = free_port()?;
            let mut args: Vec<String> = vec![
                "serve".into(),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--policy".into(),
                options.policy.clone(),
            ];
            if let Some(nats) = nats {
                args.extend(["--nats".into(), nats.url.clone()]);
                args.extend(["--fleet".into(), "demo".into()]);
            }
            for spec in specs {
                args.push("--worker".into());
                args.push(spec.clone());
            }
            Ok((args, format!("http://127.0.0.1:{port}"), ()))
        };
        let (process, url, ()) = start(client, &options.exe, build).await?;
        processes.push(process);
        urls.push(url);
    }
    Ok((processes, urls))
}

/// Injects `--faults`' faults over `span`, the workload's length in wall time: worker 0
/// drops event batches, worker 1 restarts, and `victim` (worker 2) is killed. Each noted in
/// `log` with its time.
fn inject_faults(
    client: &reqwest::Client,
    urls: &[String],
    victim: Option<Child>,
    span: Duration,
    log: &std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) -> tokio::task::JoinHandle<()> {
    let client = client.clone();
    let urls = urls.to_vec();
    let log = std::sync::Arc::clone(log);
    tokio::spawn(async move {
        let started = Instant::now();
        let at = |f: f64| span.mul_f64(f);
        let note = |what: String| {
            if let Ok(mut l) = log.lock() {
                l.push(format!("{:.1} s: {what}", started.elapsed().as_secs_f64()));
            }
        };
        tokio::time::sleep(at(1.0 / 3.0)).await;
        let _ = client
            .post(format!("{}/admin/events/drop?batches=2", urls[0]))
            .send()
            .await;
        note("worker 0 drops its next 2 KV-event batches".into());
        tokio::time::sleep(at(0.5).saturating_sub(started.elapsed())).await;
        // A restarted engine: its cache empty, its sequence back to 0.
        let _ = client
            .post(format!("{}/admin/restart", urls[1]))
            .send()
            .await;
        note("worker 1 restarts (cache emptied, event sequence back to 0)".into());
        tokio::time::sleep(at(2.0 / 3.0).saturating_sub(started.elapsed())).await;
        let mut victim = Process(victim);
        victim.kill();
        note("worker 2 killed".into());
    })
}

/// Failed requests by the worker they were sent to, and the first failure of each.
type Failures = (
    Vec<(Option<u64>, usize)>,
    Vec<(Option<u64>, f64, u16, String)>,
);

fn tally_failures(records: &[ReplayRecord]) -> Failures {
    let mut failed: std::collections::BTreeMap<Option<u64>, usize> = Default::default();
    let mut first_failures = Vec::new();
    for r in records {
        let Some(error) = &r.error else { continue };
        let n = failed.entry(r.worker).or_default();
        if *n == 0 {
            first_failures.push((r.worker, r.sent_ms, r.status, error.clone()));
        }
        *n += 1;
    }
    (failed.into_iter().collect(), first_failures)
}

/// Each engine's cache against the index of the router at `router`, and the requests that
/// router still held.
async fn check_caches(
    client: &reqwest::Client,
    router: &str,
    engines: &[String],
) -> (Vec<CacheCheck>, u64) {
    let listed = get_json(client, &format!("{router}/v1/workers")).await;
    let mut caches = Vec::new();
    let mut active = 0;
    for (w, url) in engines.iter().enumerate() {
        let rank = listed
            .as_ref()
            .and_then(|l| l["workers"].as_array()?.get(w).cloned())
            .map(|v| v["ranks"][0].clone())
            .unwrap_or(Value::Null);
        active += rank["load"]["requests"].as_u64().unwrap_or(0);
        let engine = get_json(client, &format!("{url}/admin/stats"))
            .await
            .and_then(|s| s["blocks"]["cached_copies"].as_u64());
        caches.push(CacheCheck {
            worker: w,
            engine_blocks: engine,
            index_blocks: rank["index_blocks"].as_u64().unwrap_or(0),
            events: rank["events"].clone(),
        });
    }
    (caches, active)
}

/// The value of the sample `name` (with its labels, as the text format writes them).
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// What each of several replicas served and heard of the others (none with one router).
async fn check_replicas(
    client: &reqwest::Client,
    routers: &[String],
    records: &[ReplayRecord],
) -> Vec<ReplicaCheck> {
    if routers.len() < 2 {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (i, url) in routers.iter().enumerate() {
        let text = match client.get(format!("{url}/metrics")).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        out.push(ReplicaCheck {
            url: url.clone(),
            sent: records
                .iter()
                .filter(|r| r.index % routers.len() == i)
                .count(),
            served: text
                .lines()
                .filter(|l| {
                    l.starts_with("kvroute_requests_total{") && l.contains("outcome=\"ok\"")
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum(),
            sync_up: metric(&text, "kvroute_replica_sync_up"),
            peers: metric(&text, "kvroute_replica_peers"),
            applied: metric(&text, "kvroute_replica_sync{kind=\"applied\"}"),
        });
    }
    out
}

/// Runs `workload` (its arrivals already at the user's speed-up) through the live fleet.
pub async fn run_live(
    workload: &Workload,
    options: &LiveOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> anyhow::Result<LiveReport> {
    let client = reqwest::Client::new();
    let scale = options.time_scale.max(1e-3);
    let nats = if options.replicas >= 2 {
        Some(NatsServer::start().await?)
    } else {
        None
    };
    let mut engines = start_engines(&client, options, scale).await?;
    let (_routers, routers) =
        start_routers(&client, options, &engines.specs, nats.as_ref()).await?;
    // Let the subscriptions connect before the first stores (ZeroMQ's slow joiner).
    tokio::time::sleep(Duration::from_millis(500)).await;

    let scaled = workload.clone().with_speedup(workload.speedup() * scale);
    let span = scaled.requests().last().map_or(Duration::ZERO, |r| r.at);
    let fault_log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let fault_task = (options.faults && options.workers >= 3).then(|| {
        let victim = engines.processes.get_mut(2).and_then(|p| p.0.take());
        inject_faults(&client, &engines.urls, victim, span, &fault_log)
    });
    let replay_options = ReplayOptions {
        url: routers.first().cloned().unwrap_or_default(),
        model: None,
        concurrency: None,
        timeout: Duration::from_secs(600),
        api_key: None,
        text: None,
        oracle: if options.oracle {
            engines.urls.clone()
        } else {
            Vec::new()
        },
    };
    let (records, report) =
        replay::run_spread(&scaled, &replay_options, &routers, progress).await?;
    let (failed_by_worker, first_failures) = tally_failures(&records);
    if let Some(task) = fault_task {
        let _ = task.await;
    }
    // Let the last events arrive, then compare each cache with the index.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (caches, active_at_end) = check_caches(&client, &replay_options.url, &engines.urls).await;
    let replicas = check_replicas(&client, &routers, &records).await;
    let faults = fault_log.lock().map(|l| l.clone()).unwrap_or_default();
    Ok(LiveReport {
        replay: report,
        caches,
        active_at_end,
        faults,
        failed_by_worker,
        first_failures,
        replicas,
    })
}
