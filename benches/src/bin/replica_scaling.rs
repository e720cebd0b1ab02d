//! Requests/s of three `kvroute serve` replicas sharing their bookings, against one router,
//! where the routers are what bounds the machine: every router process is given the same
//! CPU quota (a cgroup's), so the load and the engines beside them always have room, and
//! requests/s measure what the routers can serve. With a core per replica this is what
//! three replicas on three machines (or cores) give against one.
//!
//! ```text
//! cargo run --release -p kvroute-benches --bin replica-scaling
//! cargo run --release -p kvroute-benches --bin replica-scaling -- --quota 0.25 --seconds 5 --rounds 3
//! cargo run --release -p kvroute-benches --bin replica-scaling -- --sync-batch-us 1000
//! ```
//!
//! Cells, alternating in each round; each starts its routers anew:
//! - `1 router`: one `kvroute serve`, no NATS;
//! - `1 replica, alone`: one with `--nats --fleet`, publishing its bookings to a fleet of one;
//! - `N replicas`: N replicas with `--nats --fleet`, sharing bookings and the worker registry
//!   through one `nats-server` with JetStream (the system's package; `scripts/fixtures.sh`
//!   installs it);
//! - `N routers, no sync`: N plain routers (what the sync costs at the fleet's scale).
//!
//! Each router is this program started again as a child (`--as-replica`): kvroute serve's
//! library (`RunningServe`, as `kvroute serve` runs it) on a multi-threaded runtime, moved
//! into a cgroup of its own with `--quota` CPUs (cgroup v2's `cpu.max`, or v1's
//! `cpu.cfs_quota_us`; it needs root, and says so). Four fake engines (answering at once)
//! serve every router. The load keeps 64 token-id completions (1,024 ids, one of 16 shared
//! prefixes) in flight on each router, and counts completed requests over `--seconds` after
//! a second's warm-up. `router CPU` is the routers' CPU time over the measured seconds
//! against their quotas' sum (near 100%: the routers bound the cell); `load CPU` is this
//! process's (the load and the engines), out of the machine's cores.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvroute_benches::cpu::{ticks_of, ticks_per_second};
use kvroute_benches::fake_engine::fake_engine;
use kvroute_benches::nats::NatsServer;
use kvroute_benches::{flag_value, median};
use kvroute_serve::{parse_worker_flag, ReplicaOptions, RunningServe, ServeOptions};
use serde_json::json;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Requests in flight on each router.
const IN_FLIGHT: usize = 64;
/// Fake engines behind every router.
const ENGINES: usize = 4;

/// The child's side: serve in front of `--engines` (comma-separated addresses), sharing
/// bookings through `--nats` when given; prints its address, then serves until its standard
/// input closes.
fn as_replica(args: &[String]) -> Result<()> {
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let engines = value("--engines").context("--engines")?;
    let mut workers = Vec::new();
    for (i, engine) in (0u64..).zip(engines.split(',')) {
        workers.push(parse_worker_flag(&format!("url=http://{engine}"), i)?);
    }
    let options = ServeOptions {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        workers,
        replicas: match value("--nats") {
            Some(nats) => Some(ReplicaOptions {
                batch: sync_batch(args)?,
                ..ReplicaOptions::new(nats, "scaling")
            }),
            None => None,
        },
        ..ServeOptions::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let serve = RunningServe::start(options).await?;
        println!("{}", serve.listen);
        // Until the parent closes our standard input.
        tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut Vec::new())).await??;
        serve.stop();
        Ok(())
    })
}

/// A cgroup with a CPU quota, removed when dropped (after its processes have exited).
struct Quota {
    dir: PathBuf,
}

impl Quota {
    fn new(name: &str, cpus: f64) -> Result<Self> {
        let period = 100_000u64;
        let quota = ((cpus * period as f64) as u64).max(1_000);
        let v2 = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "cpu"));
        let (dir, file, text) = if v2 {
            (
                PathBuf::from("/sys/fs/cgroup").join(name),
                "cpu.max",
                format!("{quota} {period}"),
            )
        } else {
            (
                PathBuf::from("/sys/fs/cgroup/cpu").join(name),
                "cpu.cfs_quota_us",
                quota.to_string(),
            )
        };
        std::fs::create_dir_all(&dir).with_context(|| {
            format!(
                "making cgroup {} (the quotas need root and a cgroup cpu controller)",
                dir.display()
            )
        })?;
        let q = Self { dir };
        if !v2 {
            std::fs::write(q.dir.join("cpu.cfs_period_us"), period.to_string())?;
        }
        std::fs::write(q.dir.join(file), text)
            .with_context(|| format!("setting {}", q.dir.join(file).display()))?;
        Ok(q)
    }

    fn add(&self, pid: u32) -> Result<()> {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving {pid} into {}", self.dir.display()))
    }
}

impl Drop for Quota {
    fn drop(&mut self) {
        // The kernel removes an empty cgroup's directory itself: rmdir, not remove_dir_all.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// One router process in its cgroup.
struct Router {
    child: Child,
    url: String,
    _quota: Quota,
}

impl Router {
    fn start(engines: &str, nats: Option<&str>, quota: Quota) -> Result<Self> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["--as-replica", "--engines", engines]);
        if let Some(nats) = nats {
            cmd.args(["--nats", nats]);
            // The batch window asked of this run, for every replica.
            let args: Vec<String> = std::env::args().collect();
            if let Some(us) = args.windows(2).find(|w| w[0] == "--sync-batch-us") {
                cmd.args(["--sync-batch-us", &us[1]]);
            }
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        quota.add(child.id())?;
        let mut line = String::new();
        let stdout = child.stdout.take().context("router's stdout")?;
        BufReader::new(stdout).read_line(&mut line)?;
        let addr: SocketAddr = line
            .trim()
            .parse()
            .with_context(|| format!("router's address {line:?}"))?;
        Ok(Self {
            child,
            url: format!("http://{addr}"),
            _quota: quota,
        })
    }

    /// CPU time so far, in clock ticks (utime + stime of /proc/PID/stat).
    fn cpu_ticks(&self) -> u64 {
        ticks_of(&format!("/proc/{}/stat", self.child.id()))
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Until every router of a synced cell hears the others.
async fn await_peers(client: &reqwest::Client, routers: &[Router]) -> Result<()> {
    let want = format!("kvroute_replica_peers {}", routers.len() - 1);
    let deadline = Instant::now() + Duration::from_secs(15);
    for r in routers {
        loop {
            let text = client
                .get(format!("{}/metrics", r.url))
                .send()
                .await?
                .text()
                .await?;
            if text.lines().any(|l| l == want) {
                break;
            }
            if Instant::now() > deadline {
                bail!("{} never heard its peers", r.url);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// Keeps [`IN_FLIGHT`] completions on each router until `stop`; counts those answered 200
/// while `counting`, and the failures.
async fn load(
    urls: Vec<String>,
    counting: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
) -> Result<()> {
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(IN_FLIGHT)
        .build()?;
    let mut tasks = Vec::new();
    for (r, url) in urls.into_iter().enumerate() {
        for t in 0..IN_FLIGHT {
            let (client, url) = (client.clone(), format!("{url}/v1/completions"));
            let (counting, stop) = (Arc::clone(&counting), Arc::clone(&stop));
            let (done, failed) = (Arc::clone(&done), Arc::clone(&failed));
            tasks.push(tokio::spawn(async move {
                let mut i = (r * IN_FLIGHT + t) as u32;
                while !stop.load(Ordering::Relaxed) {
                    let p = i % 16;
                    let mut prompt: Vec<u32> = (p * 100_000..p * 100_000 + 960).collect();
                    prompt.extend((0..64).map(|k| 50_000_000 + i * 64 + k));
                    let body = json!({"model": "fake", "prompt": prompt, "max_tokens": 4});
                    let ok = match client.post(&url).json(&body).send().await {
                        Ok(answer) => answer.status().is_success() && answer.bytes().await.is_ok(),
                        Err(_) => false,
                    };
                    if counting.load(Ordering::Relaxed) {
                        if ok {
                            done.fetch_add(1, Ordering::Relaxed);
                        } else {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    i = i.wrapping_add(7_919);
                }
            }));
        }
    }
    for t in tasks {
        t.await?;
    }
    Ok(())
}

struct Cell {
    rps: f64,
    failed: u64,
    /// The routers' CPU time over the measured seconds, as a share of their quotas' sum.
    router_cpu: f64,
    /// This process's CPU time (the load and the engines) in cores.
    load_cpu: f64,
}

async fn cell(
    engines: &str,
    count: usize,
    nats: Option<&str>,
    quota: f64,
    seconds: f64,
    tag: &str,
) -> Result<Cell> {
    let mut routers = Vec::new();
    for i in 0..count {
        let q = Quota::new(
            &format!("kvroute-scaling-{}-{tag}-{i}", std::process::id()),
            quota,
        )?;
        routers.push(Router::start(engines, nats, q)?);
    }
    let client = reqwest::Client::new();
    if nats.is_some() && count > 1 {
        await_peers(&client, &routers).await?;
    }
    let (counting, stop) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (done, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let urls = routers.iter().map(|r| r.url.clone()).collect();
    let driver = tokio::spawn(load(
        urls,
        Arc::clone(&counting),
        Arc::clone(&stop),
        Arc::clone(&done),
        Arc::clone(&failed),
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let own = "/proc/self/stat";
    let before: Vec<u64> = routers.iter().map(Router::cpu_ticks).collect();
    let own_before = ticks_of(own);
    let start = Instant::now();
    counting.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    counting.store(false, Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    let after: Vec<u64> = routers.iter().map(Router::cpu_ticks).collect();
    let own_after = ticks_of(own);
    stop.store(true, Ordering::Relaxed);
    driver.await??;
    let ticks: u64 = after.iter().zip(&before).map(|(a, b)| a - b).sum();
    let hz = ticks_per_second();
    drop(routers);
    Ok(Cell {
        rps: done.load(Ordering::Relaxed) as f64 / elapsed,
        failed: failed.load(Ordering::Relaxed),
        router_cpu: ticks as f64 / hz / elapsed / (quota * count as f64),
        load_cpu: (own_after - own_before) as f64 / hz / elapsed,
    })
}

/// The replicas' batch window: `--sync-batch-us`, serve's default without it; refused outside
/// the range serve takes (it would clamp it, and the run be filed under the wrong window).
fn sync_batch(args: &[String]) -> Result<Duration> {
    let Some(us) = args.windows(2).find(|w| w[0] == "--sync-batch-us") else {
        return Ok(kvroute_serve::SYNC_BATCH);
    };
    let batch = Duration::from_micros(us[1].parse().context("--sync-batch-us: microseconds")?);
    if !kvroute_serve::SYNC_BATCH_RANGE.contains(&batch) {
        bail!("--sync-batch-us takes 50 to 100000");
    }
    Ok(batch)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--as-replica") {
        return as_replica(&args);
    }
    let value = |flag: &str, default: f64| flag_value(&args, flag, default);
    let quota = value("--quota", 0.25);
    let seconds = value("--seconds", 5.0);
    let rounds = value("--rounds", 3.0) as usize;
    let replicas = value("--replicas", 3.0) as usize;
    if !(0.05..=64.0).contains(&quota) || replicas < 2 || rounds == 0 {
        bail!("--quota takes 0.05–64 CPUs, --replicas 2 or more, --rounds 1 or more");
    }
    let batch = sync_batch(&args)?;
    let nats = NatsServer::start()?;
    let url = nats.url.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let mut engines = Vec::new();
        for _ in 0..ENGINES {
            engines.push(fake_engine().await?.to_string());
        }
        let engines = engines.join(",");
        let names = [
            "1 router".to_owned(),
            "1 replica, alone".to_owned(),
            format!("{replicas} replicas"),
            format!("{replicas} routers, no sync"),
        ];
        let mut cells: Vec<Vec<Cell>> = (0..names.len()).map(|_| Vec::new()).collect();
        let runs = [
            (1, None),
            (1, Some(url.as_str())),
            (replicas, Some(url.as_str())),
            (replicas, None),
        ];
        for round in 0..rounds {
            for (c, (count, nats)) in runs.into_iter().enumerate() {
                let tag = format!("{round}-{c}");
                let got = cell(&engines, count, nats, quota, seconds, &tag).await?;
                eprintln!(
                    "round {round}: {:<22} {:>8.0} req/s  router CPU {:>4.0}%  load CPU {:.2}  failed {}",
                    names[c],
                    got.rps,
                    got.router_cpu * 100.0,
                    got.load_cpu,
                    got.failed
                );
                cells[c].push(got);
            }
        }
        let med = |c: usize, f: fn(&Cell) -> f64| {
            median(cells[c].iter().map(f).collect()).unwrap_or(f64::NAN)
        };
        let one = med(0, |c| c.rps);
        println!(
            "{rounds} rounds of {seconds} s; every router limited to {quota} CPU; {ENGINES} fake \
             engines; {IN_FLIGHT} in flight a router; the replicas' batch window {} µs; medians",
            batch.as_micros()
        );
        println!("cell                       req/s  × 1 router  router CPU  load CPU  failed");
        for (c, name) in names.iter().enumerate() {
            let failed: u64 = cells[c].iter().map(|c| c.failed).sum();
            println!(
                "{name:<22} {:>9.0} {:>11.2} {:>10.0}% {:>9.2} {failed:>7}",
                med(c, |c| c.rps),
                med(c, |c| c.rps) / one,
                med(c, |c| c.router_cpu) * 100.0,
                med(c, |c| c.load_cpu),
            );
        }
        for (base, name) in [(0, "1 router"), (1, "1 replica")] {
            let ratios: Vec<String> = (0..rounds)
                .map(|r| format!("{:.2}", cells[2][r].rps / cells[base][r].rps))
                .collect();
            println!("{replicas} replicas / {name} by round: {}", ratios.join(", "));
        }
        Ok(())
    });
    drop(nats);
    result
}
