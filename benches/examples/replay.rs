//! Replays the peer benchmark's op stream into kvroute alone, several times in one process, and
//! prints each replay's wall time and match p50 / p99, and with `--split` the time spent in
//! Stored events, Removed events and queries (one clock read around each op, about 1 ms per
//! trace replay). The figures are kvroute's alone: for profiling a replay (`perf record`), for
//! its instruction count (cachegrind with `--replays 1` and then `--replays 2`: the difference
//! is one replay, without building the op stream), and for comparing two builds run in turn.
//!
//! ```text
//! cargo run --release -p kvroute-benches --example replay                        # built-in
//! cargo run --release -p kvroute-benches --example replay -- \
//!     --trace ../shared/traces/mooncake_conversation.jsonl --replays 9 --split
//! valgrind --tool=cachegrind target/release/examples/replay --replays 2
//! ```
//!
//! The fleet and workload are the peer benchmark's defaults (16 workers of 16,384 blocks,
//! 64-token blocks, seed 42); `--unsized` replays into an index whose ranks are not registered
//! with their capacity (the benchmark's `kvroute-unsized`); `--budget BYTES` replays into an
//! unsized index with that memory budget, which evicts as it goes.
//!
//! `--versus NAME` replays one of the peer benchmark's other indexers too, in turn with
//! kvroute (the order swapped from replay to replay), and ends with the medians of the ratios
//! NAME / kvroute taken within each pair of replays: with `--split`, where the lead is made and
//! where it is not. `--hot` runs each query a second time at once and reports the second run's
//! latencies too: a query whose every line is in cache, the part of a match that is work, not
//! waiting.
//!
//! ```text
//! cargo run --release -p kvroute-benches --example replay -- \
//!     --versus kv-index-chain --split --hot --replays 7
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kvroute_benches::peers::{Indexer, Kind, Kvroute, PeerConfig};
use kvroute_benches::trace::{read_trace, trace_stream};
use kvroute_benches::workload::{
    builtin_stream, ChatConfig, Op, OpStream, Overlap, Placement, SimConfig, PLACEMENT_SEED_MIX,
};
use kvroute_core::IndexConfig;

const WORKERS: usize = 16;
const CAPACITY: usize = 16_384;
const BLOCK_SIZE: usize = 64;
const SEED: u64 = 42;

struct Args {
    trace: Option<PathBuf>,
    replays: usize,
    split: bool,
    sized: bool,
    versus: Option<Kind>,
    hot: bool,
    budget: Option<usize>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        trace: None,
        replays: 5,
        split: false,
        sized: true,
        versus: None,
        hot: false,
        budget: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--trace" => args.trace = Some(it.next().context("--trace needs a file")?.into()),
            "--replays" => {
                args.replays = it
                    .next()
                    .context("--replays needs a number")?
                    .parse()
                    .context("--replays")?
            }
            "--split" => args.split = true,
            "--unsized" => args.sized = false,
            "--budget" => {
                let bytes = it.next().context("--budget needs a number of bytes")?;
                args.budget = Some(bytes.parse().context("--budget")?);
                args.sized = false;
            }
            "--hot" => args.hot = true,
            "--versus" => {
                let name = it.next().context("--versus needs an indexer's name")?;
                let kind = Kind::from_name(&name)
                    .with_context(|| format!("unknown indexer {name} (see peer-index --help)"))?;
                args.versus = Some(kind);
            }
            "--help" | "-h" => {
                println!(
                    "replay [--trace FILE] [--replays N (5)] [--split] [--unsized] [--budget BYTES] [--hot] \
                     [--versus NAME]"
                );
                std::process::exit(0);
            }
            _ => bail!("unknown flag {flag} (try --help)"),
        }
    }
    if args.replays == 0 {
        bail!("--replays must be positive");
    }
    Ok(args)
}

/// One replay's figures, in nanoseconds.
struct Replay {
    wall: u64,
    p50: u64,
    p99: u64,
    stored: u64,
    removed: u64,
    queries: u64,
    /// With `--hot`: each query's second run, at once after the first (its time, clock reads
    /// included, is left out of `wall`).
    hot_p50: u64,
    hot_p99: u64,
}

impl Replay {
    /// The line the `ab` binary reads (its first fields must keep their form).
    fn line(&self, label: &str, args: &Args) -> String {
        let mut line = format!(
            "{label}: {:>8.2} ms  p50 {:>5} ns  p99 {:>6} ns",
            self.wall as f64 / 1e6,
            self.p50,
            self.p99
        );
        if args.split {
            line += &format!(
                "  stored {:.2} ms  removed {:.2} ms  queries {:.2} ms",
                self.stored as f64 / 1e6,
                self.removed as f64 / 1e6,
                self.queries as f64 / 1e6
            );
        }
        if args.hot {
            line += &format!("  hot p50 {} ns  hot p99 {} ns", self.hot_p50, self.hot_p99);
        }
        line
    }
}

/// The `p` quantile of `sorted`, 0 when it is empty.
fn quantile(sorted: &[u64], p: f64) -> u64 {
    sorted
        .get((sorted.len() as f64 * p) as usize)
        .copied()
        .unwrap_or(0)
}

/// One timed replay of `stream` into `index` (the clock stops after its `flush`).
fn replay(stream: &OpStream, args: &Args, mut index: Box<dyn Indexer>) -> Replay {
    let mut answer: Vec<Overlap> = Vec::new();
    let mut latencies = Vec::with_capacity(stream.ops.len());
    let mut hot = Vec::new();
    let (mut stored, mut removed) = (0u64, 0u64);
    let start = Instant::now();
    for op in &stream.ops {
        match op {
            Op::Stored(e) if args.split => {
                let t = Instant::now();
                index.apply_stored(e);
                stored += t.elapsed().as_nanos() as u64;
            }
            Op::Removed(e) if args.split => {
                let t = Instant::now();
                index.apply_removed(e);
                removed += t.elapsed().as_nanos() as u64;
            }
            Op::Stored(e) => index.apply_stored(e),
            Op::Removed(e) => index.apply_removed(e),
            Op::Query(q) => {
                let t = Instant::now();
                index.query(&q.hashes, &mut answer);
                latencies.push(t.elapsed().as_nanos() as u64);
                if args.hot {
                    let t = Instant::now();
                    index.query(&q.hashes, &mut answer);
                    hot.push(t.elapsed().as_nanos() as u64);
                }
            }
        }
    }
    index.flush();
    // The second runs of `--hot` are not part of the replay.
    let wall = start.elapsed().as_nanos() as u64 - hot.iter().sum::<u64>();
    if index.apply_errors() != 0 {
        eprintln!(
            "{} events of a valid op stream were rejected",
            index.apply_errors()
        );
    }
    let queries = latencies.iter().sum();
    latencies.sort_unstable();
    hot.sort_unstable();
    Replay {
        wall,
        p50: quantile(&latencies, 0.5),
        p99: quantile(&latencies, 0.99),
        stored,
        removed,
        queries,
        hot_p50: quantile(&hot, 0.5),
        hot_p99: quantile(&hot, 0.99),
    }
}

/// Medians over the pairs of the ratios peer / kvroute within each pair.
fn print_ratios(name: &str, pairs: &[(Replay, Replay)], args: &Args) {
    type Figure = (&'static str, fn(&Replay) -> u64, bool);
    let figures: [Figure; 8] = [
        ("wall", |r| r.wall, true),
        ("match p50", |r| r.p50, true),
        ("p99", |r| r.p99, true),
        ("stored", |r| r.stored, args.split),
        ("removed", |r| r.removed, args.split),
        ("queries", |r| r.queries, args.split),
        ("hot p50", |r| r.hot_p50, args.hot),
        ("hot p99", |r| r.hot_p99, args.hot),
    ];
    let mut line = format!("median ratio {name} / kvroute over {} pairs:", pairs.len());
    for (label, figure, shown) in figures {
        if !shown {
            continue;
        }
        let mut r: Vec<f64> = pairs
            .iter()
            .map(|(ours, theirs)| figure(theirs) as f64 / figure(ours).max(1) as f64)
            .collect();
        r.sort_by(f64::total_cmp);
        line += &format!("  {label} {:.3}", r[r.len() / 2]);
    }
    println!("{line}");
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let sim = SimConfig {
        workers: WORKERS,
        capacity: CAPACITY,
        seed: SEED ^ PLACEMENT_SEED_MIX,
        placement: Placement::default(),
    };
    let stream = match &args.trace {
        Some(path) => {
            let rows = read_trace(path, None).with_context(|| format!("reading {path:?}"))?;
            trace_stream(&rows, sim, BLOCK_SIZE)?
        }
        None => builtin_stream(
            ChatConfig {
                seed: SEED,
                ..ChatConfig::default()
            },
            sim,
            BLOCK_SIZE,
        ),
    };
    println!(
        "{} ops, {} block ops; kvroute{}{}, {} replays",
        stream.ops.len(),
        stream.stats.block_ops(),
        if args.sized { "" } else { "-unsized" },
        args.versus
            .map_or(String::new(), |kind| format!(" and {kind} in turn")),
        args.replays
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .context("cannot start the tokio runtime the thread-pool peers flush on")?;
    let config = PeerConfig {
        workers: WORKERS,
        capacity: CAPACITY,
        block_size: BLOCK_SIZE,
        runtime: runtime.handle().clone(),
    };
    let ours = || -> Box<dyn Indexer> {
        if args.sized {
            Box::new(Kvroute::sized(WORKERS, CAPACITY))
        } else {
            Box::new(Kvroute::with_config(IndexConfig {
                memory_budget: args.budget,
                ..IndexConfig::default()
            }))
        }
    };
    let mut walls = Vec::with_capacity(args.replays);
    let mut pairs = Vec::new();
    for i in 0..args.replays {
        let Some(kind) = args.versus else {
            let r = replay(&stream, &args, ours());
            println!("{}", r.line(&format!("replay {:>2}", i + 1), &args));
            walls.push(r.wall);
            continue;
        };
        // The order swapped from pair to pair, so that drift touches both alike.
        let (r, theirs) = if i % 2 == 0 {
            let r = replay(&stream, &args, ours());
            (r, replay(&stream, &args, kind.build(&config)))
        } else {
            let theirs = replay(&stream, &args, kind.build(&config));
            (replay(&stream, &args, ours()), theirs)
        };
        println!("{}", r.line(&format!("replay {:>2}", i + 1), &args));
        println!("{}", theirs.line(&format!("{kind} {:>2}", i + 1), &args));
        walls.push(r.wall);
        pairs.push((r, theirs));
    }
    if let Some(kind) = args.versus {
        print_ratios(kind.name(), &pairs, &args);
    }
    walls.sort_unstable();
    println!(
        "median {:.2} ms, fastest {:.2} ms, {:.1} M block ops/s at the median",
        walls[walls.len() / 2] as f64 / 1e6,
        walls[0] as f64 / 1e6,
        stream.stats.block_ops() as f64 / walls[walls.len() / 2] as f64 * 1e3
    );
    Ok(())
}
