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
//! with their capacity (the benchmark's `kvroute-unsized`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kvroute_benches::peers::{Indexer, Kvroute};
use kvroute_benches::trace::{read_trace, trace_stream};
use kvroute_benches::workload::{
    builtin_stream, Op, OpStream, Overlap, Placement, SimConfig, WorkloadConfig, PLACEMENT_SEED_MIX,
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
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        trace: None,
        replays: 5,
        split: false,
        sized: true,
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
            "--help" | "-h" => {
                println!("replay [--trace FILE] [--replays N (5)] [--split] [--unsized]");
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
}

fn replay(stream: &OpStream, args: &Args) -> Replay {
    let mut index = if args.sized {
        Kvroute::sized(WORKERS, CAPACITY)
    } else {
        Kvroute::with_config(IndexConfig::default())
    };
    let mut answer: Vec<Overlap> = Vec::new();
    let mut latencies = Vec::with_capacity(stream.ops.len());
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
            }
        }
    }
    let wall = start.elapsed().as_nanos() as u64;
    assert_eq!(index.apply_errors(), 0, "the op stream is valid");
    let queries = latencies.iter().sum();
    latencies.sort_unstable();
    let at = |q: f64| {
        latencies
            .get((latencies.len() as f64 * q) as usize)
            .copied()
    };
    Replay {
        wall,
        p50: at(0.5).unwrap_or(0),
        p99: at(0.99).unwrap_or(0),
        stored,
        removed,
        queries,
    }
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
            WorkloadConfig {
                seed: SEED,
                ..WorkloadConfig::default()
            },
            sim,
            BLOCK_SIZE,
        ),
    };
    println!(
        "{} ops, {} block ops; kvroute{}, {} replays",
        stream.ops.len(),
        stream.stats.block_ops(),
        if args.sized { "" } else { "-unsized" },
        args.replays
    );
    let mut walls = Vec::with_capacity(args.replays);
    for i in 0..args.replays {
        let r = replay(&stream, &args);
        let mut line = format!(
            "replay {:>2}: {:>8.2} ms  p50 {:>5} ns  p99 {:>6} ns",
            i + 1,
            r.wall as f64 / 1e6,
            r.p50,
            r.p99
        );
        if args.split {
            line += &format!(
                "  stored {:.2} ms  removed {:.2} ms  queries {:.2} ms",
                r.stored as f64 / 1e6,
                r.removed as f64 / 1e6,
                r.queries as f64 / 1e6
            );
        }
        println!("{line}");
        walls.push(r.wall);
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
