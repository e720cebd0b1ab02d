//! The booking sync between `kvroute serve` replicas: what it adds to a routing decision, and
//! how soon a booking reaches another replica over a real NATS server on loopback.
//!
//! ```text
//! cargo run --release -p kvroute-benches --bin replica-sync
//! cargo run --release -p kvroute-benches --bin replica-sync -- --seconds 5 --rounds 7
//! cargo run --release -p kvroute-benches --bin replica-sync -- --cost-only
//! cargo run --release -p kvroute-benches --bin replica-sync -- --sync-batch-us 200
//! ```
//!
//! 1. **Route cost.** One core `Router` (8 workers), prompts of 1,024 tokens (16 shared
//!    prefixes of 960 tokens, then 64 of their own), each routed then freed: ns per route and
//!    free, without a booking sink and with serve's (each change appended to a `DeltaLog`
//!    that another thread takes every 500 µs into an `Outbox` and encodes, as serve's
//!    collector and publisher do), and with the log taken but never read (the appends
//!    alone). Rounds alternate; the medians and their ratios are printed. The routing thread
//!    runs on CPU 0 and the collectors on CPU 1.
//! 2. **Apply cost.** Another replica's messages as its outbox builds them (each 1,024-token
//!    request booked, then freed, in batches of 32 changes), taken by this router's `Inbox`:
//!    ns per remote request (its booking and its free read and applied). `--cost-only` stops
//!    here.
//! 3. **Delivery.** `nats-server` (the system's package; `scripts/fixtures.sh` installs it),
//!    a fake engine that answers at once, and two replicas A and B (`RunningServe` with
//!    `--nats`, their batch window `--sync-batch-us`, default serve's; the flag sets only
//!    these cells') in this process.
//!    Token-id completions go to A at 1 and 64 in flight for
//!    `--seconds` each; B's `kvroute_replica_delay_seconds` histogram (from the booking
//!    change on A, the oldest of its message, to B receiving it) gives the percentiles,
//!    interpolated within its buckets.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvroute_benches::affinity::pin_to;
use kvroute_benches::fake_engine::fake_engine;
use kvroute_benches::nats::NatsServer;
use kvroute_benches::{flag_value, median};
use kvroute_core::OwnedDelta;
use kvroute_core::{
    IndexConfig, PrefixIndex, ReplicaId, RequestId, RouteHints, RouteRequest, Router, RouterConfig,
    WorkerConfig,
};
use kvroute_serve::{parse_worker_flag, ReplicaOptions, RunningServe, ServeOptions};
use kvroute_transport::replicas::{DeltaLog, Inbox, Outbox, Replayer};
use serde_json::json;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn router() -> Result<Router> {
    let r = Router::new(
        RouterConfig::default(),
        PrefixIndex::new(IndexConfig::default()),
    )?;
    for w in 0..8 {
        r.join_worker(WorkerConfig::simple(w, 100_000, 16))?;
    }
    Ok(r)
}

fn prompts() -> Vec<Vec<u32>> {
    (0..4096u32)
        .map(|i| {
            let p = i % 16;
            (p * 100_000..p * 100_000 + 960)
                .chain(10_000_000 + i * 64..10_000_000 + i * 64 + 64)
                .collect()
        })
        .collect()
}

/// ns per route and free over `n` requests.
fn route_round(r: &Router, prompts: &[Vec<u32>], n: usize, first_id: u64) -> f64 {
    let start = Instant::now();
    for i in 0..n {
        let id = RequestId(first_id + i as u64);
        let req = RouteRequest {
            id,
            tokens: &prompts[i % prompts.len()],
            hints: RouteHints::default(),
        };
        if r.route(&req).is_ok() {
            let _ = r.free(id);
        }
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

/// A router with serve's booking sink, and its collector on CPU 1: every 500 µs it takes the
/// log and, when `read`, replays it into an [`Outbox`] and encodes it, as serve's collector
/// and publisher do. Without `read` the batch is handed back unread: what remains is the
/// routing thread's own appending, without another core reading what it wrote.
struct Synced {
    router: Router,
    done: Arc<AtomicBool>,
    encoded: Arc<AtomicU64>,
    lost: Arc<AtomicU64>,
    collector: std::thread::JoinHandle<()>,
}

impl Synced {
    fn new(read: bool) -> Result<Self> {
        let router = router()?;
        let log = Arc::new(DeltaLog::new());
        let sink = Arc::clone(&log);
        router.on_booking(move |d| sink.append(d));
        let (encoded, lost) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let done = Arc::new(AtomicBool::new(false));
        let (sent, lost2, done2) = (Arc::clone(&encoded), Arc::clone(&lost), Arc::clone(&done));
        let collector = std::thread::spawn(move || {
            if let Err(e) = pin_to(1) {
                eprintln!("collector not pinned: {e}");
            }
            let (mut outbox, mut replayer) = (Outbox::new(ReplicaId(1), 16), Replayer::new());
            while !done2.load(Ordering::Relaxed) {
                let taken = log.take();
                if taken.lost {
                    lost2.fetch_add(1, Ordering::Relaxed);
                }
                if read {
                    replayer.replay(&taken, &mut outbox);
                    for m in outbox.flush(taken.oldest_ns) {
                        sent.fetch_add(m.len() as u64, Ordering::Relaxed);
                    }
                }
                log.recycle(taken.words);
                std::thread::sleep(kvroute_serve::SYNC_BATCH);
            }
        });
        Ok(Synced {
            router,
            done,
            encoded,
            lost,
            collector,
        })
    }

    fn stop(self) -> Result<(u64, u64)> {
        self.done.store(true, Ordering::Relaxed);
        self.collector
            .join()
            .map_err(|_| anyhow::anyhow!("collector thread"))?;
        Ok((
            self.lost.load(Ordering::Relaxed),
            self.encoded.load(Ordering::Relaxed),
        ))
    }
}

/// Route cost without the booking sink, with serve's, and with the sink's log taken unread;
/// prints the medians.
fn route_cost(rounds: usize) -> Result<()> {
    let prompts = prompts();
    let plain = router()?;
    let (synced, unread) = (Synced::new(true)?, Synced::new(false)?);
    // The routing thread on CPU 0, the collectors on CPU 1, as a frontend's cores would be.
    pin_to(0).context("pinning the routing thread to CPU 0")?;
    let n = 50_000;
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    // Warm all three (the index learns every prefix), then alternate.
    for r in [&plain, &synced.router, &unread.router] {
        route_round(r, &prompts, n, 0);
    }
    for round in 0..rounds {
        let id = (round as u64 + 1) * 1_000_000;
        a.push(route_round(&plain, &prompts, n, id));
        b.push(route_round(&synced.router, &prompts, n, id));
        c.push(route_round(&unread.router, &prompts, n, id));
    }
    let (lost, encoded) = synced.stop()?;
    unread.stop()?;
    let (a, b, c) = (
        median(a).unwrap_or(0.0),
        median(b).unwrap_or(0.0),
        median(c).unwrap_or(0.0),
    );
    println!("route + free, {n} requests × {rounds} rounds (medians):");
    println!("  without sync:          {a:>8.0} ns");
    println!(
        "  with sync:             {b:>8.0} ns   ({:.3}×; {lost} losses, {:.1} MB encoded)",
        b / a,
        encoded as f64 / 1e6
    );
    println!(
        "  with the log unread:   {c:>8.0} ns   ({:.3}×: the appends alone, no other core reading them)",
        c / a
    );
    Ok(())
}

/// ns per remote request applied: another replica's bookings and frees of the prompts, as
/// its outbox sends them, read by a fresh inbox each round; prints the median.
fn apply_cost(rounds: usize) -> Result<()> {
    let prompts = prompts();
    // The other replica's changes: each prompt routed there, then freed.
    let sender = router()?;
    let changes = Arc::new(std::sync::Mutex::new(Vec::<OwnedDelta>::new()));
    let sink = Arc::clone(&changes);
    sender.on_booking(move |d| sink.lock().unwrap().push(OwnedDelta::from(d)));
    route_round(&sender, &prompts, prompts.len(), 0);
    let changes = std::mem::take(&mut *changes.lock().unwrap());
    let mut outbox = Outbox::new(ReplicaId(7), 16);
    let mut messages = outbox.snapshot(0);
    for batch in changes.chunks(32) {
        for d in batch {
            outbox.push(&d.as_delta());
        }
        messages.extend(outbox.flush(0));
    }
    let receiver = router()?;
    // The receiver's index knows the prompts (the engines' events would have told it).
    route_round(&receiver, &prompts, prompts.len(), 0);
    let requests = prompts.len() as f64;
    let mut ns = Vec::new();
    for _ in 0..=rounds {
        let mut inbox = Inbox::new(ReplicaId(1), 16);
        let start = Instant::now();
        let mut applied = 0;
        for m in &messages {
            applied += inbox
                .receive(&receiver, m, Instant::now(), 0)
                .map_or(0, |r| r.applied);
        }
        let elapsed = start.elapsed().as_nanos() as f64;
        if applied as usize != changes.len() || receiver.remote_requests() != 0 {
            bail!("applied {applied} of {} changes", changes.len());
        }
        ns.push(elapsed / requests);
    }
    // The first round warmed the ledger and the allocator (each round's inbox is new: its
    // buffers grow in its first messages, as a replica's do once).
    ns.remove(0);
    println!(
        "apply another replica's request (booked, then freed; {} messages of 32 changes), median of {rounds}: {:.0} ns",
        messages.len() - 1,
        median(ns).unwrap_or(0.0)
    );
    Ok(())
}

/// The bucket counts of histogram `name` in Prometheus text: (upper bound, cumulative).
fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// Quantile `q` of the counts between two scrapes, interpolated within a bucket.
fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let counts: Vec<(f64, f64)> = after
        .iter()
        .map(|&(le, n)| {
            let was = before.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
            (le, n - was)
        })
        .collect();
    let total = counts.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let want = q * total;
    let (mut lo, mut below) = (0.0, 0.0);
    for &(le, n) in &counts {
        if n >= want {
            if le.is_infinite() {
                return Some(lo);
            }
            let share = if n > below {
                (want - below) / (n - below)
            } else {
                1.0
            };
            return Some(lo + share * (le - lo));
        }
        (lo, below) = (le, n);
    }
    None
}

async fn scrape(client: &reqwest::Client, url: &str) -> Result<String> {
    Ok(client
        .get(format!("{url}/metrics"))
        .send()
        .await?
        .text()
        .await?)
}

/// Token-id completions to `url` for `seconds`: one at a time (`rate` none), or `rate` a
/// second whatever is in flight; completed requests.
async fn drive(url: &str, rate: Option<f64>, seconds: f64) -> Result<u64> {
    let client = reqwest::Client::builder().tcp_nodelay(true).build()?;
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let send = |i: u32| {
        let (client, url, done) = (client.clone(), url.to_owned(), Arc::clone(&done));
        async move {
            let p = i % 16;
            let prompt: Vec<u32> = (p * 100_000..p * 100_000 + 1_024).collect();
            let body = json!({"model": "fake", "prompt": prompt, "max_tokens": 4});
            let ok = client
                .post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                done.fetch_add(1, Ordering::Relaxed);
            }
        }
    };
    let mut i = 0u32;
    match rate {
        None => {
            while Instant::now() < until {
                send(i).await;
                i += 1;
            }
        }
        Some(rate) => {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            let mut tasks = Vec::new();
            while Instant::now() < until {
                tick.tick().await;
                tasks.push(tokio::spawn(send(i)));
                i += 1;
            }
            for t in tasks {
                t.await?;
            }
        }
    }
    Ok(done.load(Ordering::Relaxed))
}

async fn replica(engine: SocketAddr, nats: &str, batch: Duration) -> Result<RunningServe> {
    let options = ServeOptions {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        workers: vec![parse_worker_flag(&format!("url=http://{engine}"), 0)?],
        replicas: Some(ReplicaOptions {
            batch,
            ..ReplicaOptions::new(nats, "bench")
        }),
        ..ServeOptions::default()
    };
    Ok(RunningServe::start(options).await?)
}

/// Delivery delays between two replicas through NATS; prints the percentiles per cell.
fn delivery(seconds: f64, batch: Duration) -> Result<()> {
    let nats = NatsServer::start()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = rt.block_on(async {
        let engine = fake_engine().await?;
        let a = replica(engine, &nats.url, batch).await?;
        let b = replica(engine, &nats.url, batch).await?;
        let (url_a, url_b) = (
            format!("http://{}", a.listen),
            format!("http://{}", b.listen),
        );
        let client = reqwest::Client::new();
        // Until A and B hear each other.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !scrape(&client, &url_b)
            .await?
            .lines()
            .any(|l| l == "kvroute_replica_peers 1")
        {
            if Instant::now() > deadline {
                bail!("the replicas never heard each other");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!("booking delivery A → B through nats-server on loopback ({seconds} s a cell):");
        println!("  load              req/s    p50 µs    p99 µs");
        for rate in [None, Some(200.0), Some(1000.0), Some(2000.0)] {
            let name = "kvroute_replica_delay_seconds";
            let before = buckets(&scrape(&client, &url_b).await?, name);
            let done = drive(&url_a, rate, seconds).await?;
            tokio::time::sleep(Duration::from_millis(200)).await;
            let after = buckets(&scrape(&client, &url_b).await?, name);
            let q = |p| quantile(&before, &after, p).map_or(f64::NAN, |s| s * 1e6);
            let load = rate.map_or("1 in flight".to_owned(), |r| format!("{r:.0}/s open"));
            println!(
                "  {load:<15} {:>7.0} {:>9.0} {:>9.0}",
                done as f64 / seconds,
                q(0.5),
                q(0.99),
            );
        }
        a.stop();
        b.stop();
        Ok(())
    });
    drop(nats);
    result
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str, default: f64| flag_value(&args, flag, default);
    let seconds = value("--seconds", 3.0);
    let rounds = value("--rounds", 5.0) as usize;
    route_cost(rounds)?;
    apply_cost(rounds)?;
    if args.iter().any(|a| a == "--cost-only") {
        return Ok(());
    }
    // The delivery cells' window (the route-cost collector takes serve's default).
    let default_us = kvroute_serve::SYNC_BATCH.as_micros() as f64;
    let batch = Duration::from_micros(value("--sync-batch-us", default_us) as u64);
    delivery(seconds, batch)
}
