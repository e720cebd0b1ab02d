//! Request round trip over loopback: from `dispatch` to the first response item, io_uring
//! against epoll, at 1 and at 64 requests in flight, in the same run.
//!
//! ```text
//! cargo run --release -p kvroute-benches --bin roundtrip                  # 3 rounds
//! cargo run --release -p kvroute-benches --bin roundtrip -- --requests 20000 --rounds 5
//! cargo run --release -p kvroute-benches --bin roundtrip -- --in-flight 1,16,64
//! cargo run --release -p kvroute-benches --bin roundtrip -- --sqpoll-idle 50  # polled rings
//! ```
//!
//! One worker server (one runtime thread) with an engine that answers every request at once:
//! one item carrying one token, then a finishing item. One router thread runs a
//! `DispatchClient` on the same backend and keeps `in-flight` requests going, each a task that
//! dispatches, times the first item, reads the stream to its end and starts again. Each round
//! runs every backend once per in-flight level, alternating the backends (io_uring, epoll,
//! io_uring, ...) so that drift hits both alike; the latencies of all rounds go into one
//! histogram per (backend, level). The CPU time the whole process spent over the measured
//! requests (every thread's, the kernel's submission poller included) is reported per request,
//! summed over the rounds (`/proc/self/stat` counts in 10 ms ticks).

use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;
use kvroute_core::WorkerId;
use kvroute_transport::backend::{
    self, set_uring_submit, uring_submit, uring_support, Backend, BackendChoice, UringSubmit,
};
use kvroute_transport::wire::{
    Dispatch, DispatchHints, FinishReason, Hello, Role, Sampling, PROTOCOL_VERSION,
};
use kvroute_transport::{
    DispatchClient, DispatchConfig, Engine, ResponseSink, WorkerServer, WorkerServerConfig,
};

const WORKER: WorkerId = WorkerId(1);

struct Args {
    requests: u64,
    warmup: u64,
    rounds: usize,
    in_flight: Vec<usize>,
    prompt: usize,
    /// `None`: both (io_uring where available).
    only: Option<Backend>,
    /// io_uring submissions polled by a kernel thread that sleeps after this long idle.
    sqpoll_idle: Option<Duration>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        requests: 10_000,
        warmup: 1_000,
        rounds: 3,
        in_flight: vec![1, 64],
        prompt: 256,
        only: None,
        sqpoll_idle: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--requests" => args.requests = value()?.parse().context("--requests")?,
            "--warmup" => args.warmup = value()?.parse().context("--warmup")?,
            "--rounds" => args.rounds = value()?.parse().context("--rounds")?,
            "--prompt" => args.prompt = value()?.parse().context("--prompt")?,
            "--in-flight" => {
                args.in_flight = value()?
                    .split(',')
                    .map(|v| v.trim().parse::<usize>().context("--in-flight"))
                    .collect::<Result<_>>()?
            }
            "--sqpoll-idle" => {
                let ms: u64 = value()?.parse().context("--sqpoll-idle")?;
                args.sqpoll_idle = (ms > 0).then(|| Duration::from_millis(ms));
            }
            "--backend" => {
                args.only = match value()?.as_str() {
                    "both" => None,
                    "io_uring" => Some(Backend::IoUring),
                    "epoll" => Some(Backend::Epoll),
                    v => bail!("--backend is both, io_uring or epoll, not {v}"),
                }
            }
            "--help" | "-h" => {
                println!(
                    "roundtrip [--requests N (10000)] [--warmup W (1000)] [--rounds R (3)] \
                     [--in-flight A,B (1,64)] [--prompt TOKENS (256)] \
                     [--backend both|io_uring|epoll (both)] [--sqpoll-idle MS (0: off)]"
                );
                std::process::exit(0);
            }
            _ => bail!("unknown flag {flag} (try --help)"),
        }
    }
    if args.requests == 0 || args.rounds == 0 || args.in_flight.contains(&0) {
        bail!("--requests, --rounds and every --in-flight level must be positive");
    }
    Ok(args)
}

/// Answers every request at once: one token, then the end.
#[derive(Debug)]
struct Instant1;

impl Engine for Instant1 {
    // Not an `async fn`: that would borrow `self`, and the request's future must not.
    #[allow(clippy::manual_async_fn)]
    fn serve(
        &self,
        request: Dispatch,
        mut sink: ResponseSink,
    ) -> impl Future<Output = ()> + 'static {
        async move {
            let token = request.tokens.first().copied().unwrap_or(0);
            if sink.send(vec![token]).await.is_ok() {
                let _ = sink.finish(Vec::new(), FinishReason::Length).await;
            }
        }
    }
}

fn request(id: u64, prompt: &[u32]) -> Dispatch {
    Dispatch {
        request_id: id,
        tokens: prompt.to_vec(),
        sampling: Sampling {
            max_tokens: 1,
            min_tokens: 0,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
        },
        hints: DispatchHints {
            dp_rank: 0,
            overlap_blocks: 0,
            lora_name: None,
            priority: 0,
            expected_output_tokens: None,
        },
        bootstrap: None,
    }
}

fn new_histogram() -> Result<Histogram<u64>> {
    // 1 ns to 10 s, 3 significant digits.
    Ok(Histogram::new_with_bounds(1, 10_000_000_000, 3)?)
}

/// CPU time this process has used, all its threads together, in seconds (clock ticks of
/// `/proc/self/stat`, 100 a second); `None` where there is no such file.
fn process_cpu() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces), from the third on: user and
    // system time are the 14th and 15th.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let user: f64 = fields.next()?.parse().ok()?;
    let system: f64 = fields.next()?.parse().ok()?;
    Some((user + system) / 100.0)
}

/// One run's figures.
struct Run {
    latencies: Histogram<u64>,
    /// Wall time of the measured requests.
    wall: f64,
    /// CPU seconds the process spent over them.
    cpu: Option<f64>,
}

/// One run: a fresh worker and client on `backend`; returns the first-item latencies of the
/// measured requests, their wall time and the CPU time spent meanwhile.
fn run(backend: Backend, in_flight: usize, args: &Args) -> Result<Run> {
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        worker_id: WORKER.0,
        dp_start: 0,
        dp_size: 1,
        kv_blocks: 1 << 20,
        block_size: 16,
        role: Role::Aggregated,
        max_batched_tokens: 8192,
        labels: Vec::new(),
    };
    let addr: SocketAddr = "127.0.0.1:0".parse()?;
    let worker = WorkerServer::start(
        WorkerServerConfig {
            backend: match backend {
                Backend::IoUring => BackendChoice::IoUring,
                Backend::Epoll => BackendChoice::Epoll,
            },
            threads: 1,
            ..WorkerServerConfig::new(addr)
        },
        hello,
        Arc::new(Instant1),
    )?;
    let addr = worker.local_addr();
    let (warmup, requests, prompt_len) = (args.warmup, args.requests, args.prompt);
    let router = thread::spawn(move || -> Result<Run> {
        backend::block_on(backend, async move {
            let client = Rc::new(DispatchClient::start(DispatchConfig {
                max_in_flight: in_flight,
                ..DispatchConfig::new(addr, WORKER, backend)
            }));
            client.wait_connected(Duration::from_secs(5)).await?;
            let prompt: Rc<[u32]> = (0..prompt_len as u32).collect();
            let total = warmup + requests;
            let next = Rc::new(std::cell::Cell::new(0u64));
            let started = Rc::new(std::cell::Cell::new(None::<(Instant, Option<f64>)>));
            let mut tasks = Vec::with_capacity(in_flight);
            for _ in 0..in_flight {
                let (client, prompt, next, started) = (
                    Rc::clone(&client),
                    Rc::clone(&prompt),
                    Rc::clone(&next),
                    Rc::clone(&started),
                );
                tasks.push(tokio::task::spawn_local(async move {
                    let mut hist = new_histogram()?;
                    loop {
                        let id = next.get();
                        if id >= total {
                            return Ok::<_, anyhow::Error>(hist);
                        }
                        next.set(id + 1);
                        if id == warmup {
                            started.set(Some((Instant::now(), process_cpu())));
                        }
                        let t0 = Instant::now();
                        let mut stream = client
                            .dispatch(request(id, &prompt))
                            .await
                            .map_err(|e| anyhow::anyhow!("{e}"))?;
                        match stream.next().await {
                            Some(Ok(_)) => {}
                            other => bail!("request {id}: first item {other:?}"),
                        }
                        let latency = t0.elapsed();
                        if id >= warmup {
                            hist.record(latency.as_nanos().max(1) as u64)?;
                        }
                        while let Some(item) = stream.next().await {
                            item?;
                        }
                    }
                }));
            }
            let mut hist = new_histogram()?;
            for t in tasks {
                hist.add(t.await??)?;
            }
            let (wall, cpu) = match started.get() {
                Some((at, cpu)) => (
                    at.elapsed().as_secs_f64(),
                    cpu.zip(process_cpu()).map(|(from, to)| to - from),
                ),
                None => (0.0, None),
            };
            let client =
                Rc::try_unwrap(client).map_err(|_| anyhow::anyhow!("client still shared"))?;
            let stats = client.shutdown().await;
            if stats.lost != 0 || stats.decode.rejected() != 0 {
                bail!("{backend}: errors in the run: {stats:?}");
            }
            Ok(Run {
                latencies: hist,
                wall,
                cpu,
            })
        })?
    });
    let out = router
        .join()
        .map_err(|_| anyhow::anyhow!("router thread panicked"))?;
    worker.shutdown()?;
    out
}

/// The rounds of one (level, backend): all latencies, and each round's wall and CPU seconds.
type Rounds = (Histogram<u64>, Vec<f64>, Vec<f64>);

fn us(ns: u64) -> f64 {
    ns as f64 / 1_000.0
}

fn main() -> Result<()> {
    let args = parse_args()?;
    if let Some(idle) = args.sqpoll_idle {
        if let Err(mode) = set_uring_submit(UringSubmit::KernelPoll { idle }) {
            bail!("io_uring submission already fixed: {mode}");
        }
    }
    let mut backends = Vec::new();
    match uring_support() {
        Ok(()) => backends.push(Backend::IoUring),
        Err(reason) => println!("io_uring unavailable ({reason}): epoll only"),
    }
    backends.push(Backend::Epoll);
    if let Some(only) = args.only {
        if !backends.contains(&only) {
            bail!("{only} is not available here");
        }
        backends = vec![only];
    }
    println!(
        "dispatch to first response item, loopback, {} measured requests per run after {} \
         warm-up, {} rounds, {}-token prompts; io_uring {}",
        args.requests,
        args.warmup,
        args.rounds,
        args.prompt,
        uring_submit()
    );
    // (level, backend) -> latencies of every round, and each round's wall and CPU times.
    let mut results: Vec<Vec<Rounds>> = Vec::new();
    for _ in &args.in_flight {
        let mut per_backend = Vec::new();
        for _ in &backends {
            per_backend.push((new_histogram()?, Vec::new(), Vec::new()));
        }
        results.push(per_backend);
    }
    for _ in 0..args.rounds {
        for (l, level) in args.in_flight.iter().enumerate() {
            for (b, backend) in backends.iter().enumerate() {
                let r = run(*backend, *level, &args)?;
                let slot = &mut results[l][b];
                slot.0.add(&r.latencies)?;
                slot.1.push(r.wall);
                slot.2.extend(r.cpu);
            }
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    println!(
        "{:>9} {:<9} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "in-flight", "backend", "p50 µs", "p99 µs", "p99.9 µs", "requests/s", "CPU µs/req"
    );
    for (l, level) in args.in_flight.iter().enumerate() {
        for (b, backend) in backends.iter().enumerate() {
            let (hist, walls, cpus) = &results[l][b];
            let wall = median(walls).unwrap_or(f64::NAN);
            // Summed over the rounds: a clock tick is 10 ms, a short run only a few of them.
            let cpu = match cpus.len() {
                0 => "-".to_owned(),
                n => format!(
                    "{:.1}",
                    cpus.iter().sum::<f64>() * 1e6 / (n as f64 * args.requests as f64)
                ),
            };
            println!(
                "{:>9} {:<9} {:>9.1} {:>9.1} {:>9.1} {:>11.0} {:>11}",
                level,
                backend.name(),
                us(hist.value_at_quantile(0.5)),
                us(hist.value_at_quantile(0.99)),
                us(hist.value_at_quantile(0.999)),
                args.requests as f64 / wall,
                cpu,
            );
        }
        if let [(u, _, _), (e, _, _)] = results[l].as_slice() {
            println!(
                "{:>9} {:<9} {:>9.3} {:>9.3} {:>9} {:>11}",
                level,
                "ratio",
                u.value_at_quantile(0.5) as f64 / e.value_at_quantile(0.5) as f64,
                u.value_at_quantile(0.99) as f64 / e.value_at_quantile(0.99) as f64,
                "",
                "",
            );
        }
    }
    Ok(())
}
