//! `peer-index`: kvroute's prefix index against its peers, side by side, on one op stream.
//!
//! Builds one deterministic op stream (the built-in chat workload or a Mooncake trace, played
//! on a simulated fleet), replays it into every selected indexer in turn in this one process,
//! and prints speed, latency, memory and agreement with the ground truth. Every figure is
//! defined in `benches/README.md`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kvroute_benches::alloc::CountingAlloc;
use kvroute_benches::peers::{Kind, PeerConfig};
use kvroute_benches::replay::{replay, Measurement};
use kvroute_benches::trace::{read_trace, trace_stream};
use kvroute_benches::workload::{
    builtin_stream, ChatConfig, OpStream, Placement, SimConfig, PLACEMENT_SEED_MIX,
};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[derive(Debug)]
struct Args {
    trace: Option<PathBuf>,
    workers: usize,
    capacity: usize,
    block_size: usize,
    seed: u64,
    requests: Option<usize>,
    json: Option<PathBuf>,
    only: Vec<Kind>,
    rounds: usize,
}

fn usage() -> String {
    let w = ChatConfig::default();
    let p = Placement::default();
    let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
    format!(
        "\
peer-index: replay one KV-event op stream into kvroute and its peer indexers, side by side.

USAGE: peer-index [OPTIONS]

OPTIONS:
  --trace FILE         Mooncake-format trace (JSON lines); without it, the built-in workload
  --workers W          simulated workers [16]
  --capacity C         blocks each worker caches (LRU) [16384]
  --block-size B       tokens per KV block; must divide 512 with --trace [64]
  --seed S             seed of the built-in workload and of placement tie-breaks [42]
  --requests N         requests to generate (built-in) or to read (trace) [10000 / all]
  --json FILE          also write the figures as JSON
  --only NAME[,NAME]   replay only these indexers; names: {names}
  --rounds R           replay every indexer R times, interleaved; report each one's round of
                       median wall time [3]
  -h, --help           this text

BUILT-IN WORKLOAD (multi-turn chat; ranges inclusive, uniform):
  {open} conversations open at once; each request continues one chosen uniformly, and a
  finished conversation is replaced by a new one. A conversation has {t0}..{t1} turns, one
  request each. Its first prompt is a system prompt ({sp} shared ones, Zipf(1.0)-popular,
  {s0}..{s1} tokens each), then with probability {ds} a document ({docs} in the library,
  Zipf({dz})-popular, {d0}..{d1} tokens each), then a user message ({u0}..{u1} tokens).
  Every later prompt is the previous one plus the assistant's reply ({r0}..{r1} tokens) and a
  new user message. Tokens are deterministic pseudo-tokens of (content, position).

FLEET AND PLACEMENT:
  Each worker is an LRU cache of C blocks keyed by chained sequence hash. The last {window}
  placements stand for the work in flight: a worker's load is the prompt blocks of its
  placements among them. A request of n blocks goes to the worker of lowest
  cost = (n - leading blocks it holds) + load, among workers with fewer than
  ceil({slack} * {window} / W) of those placements; ties are broken at random (seeded).
  That worker stores the blocks it lacked (one Stored event), touches the prompt tail first, and
  evicts LRU blocks over C (one Removed event).
",
        names = names.join(", "),
        open = w.open_conversations,
        t0 = w.turns.0,
        t1 = w.turns.1,
        sp = w.system_prompts,
        s0 = w.system_prompt_tokens.0,
        s1 = w.system_prompt_tokens.1,
        ds = w.document_share,
        docs = w.documents,
        dz = w.document_zipf,
        d0 = w.document_tokens.0,
        d1 = w.document_tokens.1,
        u0 = w.user_tokens.0,
        u1 = w.user_tokens.1,
        r0 = w.reply_tokens.0,
        r1 = w.reply_tokens.1,
        slack = p.slack,
        window = p.window,
    )
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        trace: None,
        workers: 16,
        capacity: 16_384,
        block_size: 64,
        seed: 42,
        requests: None,
        json: None,
        only: Kind::ALL.to_vec(),
        rounds: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            print!("{}", usage());
            std::process::exit(0);
        }
        let value = it
            .next()
            .with_context(|| format!("{flag} needs a value (see --help)"))?;
        let number = |what: &str| -> Result<u64> {
            value
                .parse()
                .with_context(|| format!("{what} must be a non-negative integer, not {value:?}"))
        };
        match flag.as_str() {
            "--trace" => args.trace = Some(value.clone().into()),
            "--workers" => args.workers = number("--workers")? as usize,
            "--capacity" => args.capacity = number("--capacity")? as usize,
            "--block-size" => args.block_size = number("--block-size")? as usize,
            "--seed" => args.seed = number("--seed")?,
            "--requests" => args.requests = Some(number("--requests")? as usize),
            "--json" => args.json = Some(value.clone().into()),
            "--rounds" => args.rounds = number("--rounds")? as usize,
            "--only" => {
                args.only = value
                    .split(',')
                    .map(|name| {
                        Kind::from_name(name.trim()).with_context(|| {
                            let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
                            format!("unknown indexer {name:?}; known: {}", names.join(", "))
                        })
                    })
                    .collect::<Result<_>>()?;
            }
            _ => bail!("unknown option {flag:?} (see --help)"),
        }
    }
    if args.workers == 0 || args.workers > 1024 {
        bail!("--workers must be in 1..=1024 (the peers' limit)");
    }
    if args.capacity == 0 || args.block_size == 0 || args.rounds == 0 {
        bail!("--capacity, --block-size and --rounds must be positive");
    }
    Ok(args)
}

fn build_stream(args: &Args) -> Result<OpStream> {
    let sim = SimConfig {
        workers: args.workers,
        capacity: args.capacity,
        seed: args.seed ^ PLACEMENT_SEED_MIX,
        placement: Placement::default(),
    };
    match &args.trace {
        Some(path) => {
            if !path.is_file() {
                bail!(
                    "trace file {} not found; the Mooncake trace lives outside the project \
                     (../shared/traces/mooncake_conversation.jsonl from the workspace); \
                     run without --trace for the built-in workload",
                    path.display()
                );
            }
            let rows = read_trace(path, args.requests)?;
            Ok(trace_stream(&rows, sim, args.block_size)?)
        }
        None => {
            let workload = ChatConfig {
                requests: args.requests.unwrap_or(ChatConfig::default().requests),
                seed: args.seed,
                ..ChatConfig::default()
            };
            Ok(builtin_stream(workload, sim, args.block_size))
        }
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("peer-index: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args = parse_args()?;
    let began = Instant::now();
    let stream = build_stream(&args)?;
    let s = &stream.stats;
    println!(
        "workload   {}",
        match &args.trace {
            Some(path) => format!("trace {}", path.display()),
            None => format!("built-in, seed {}", args.seed),
        }
    );
    println!(
        "fleet      {} workers x {} blocks of {} tokens",
        args.workers, args.capacity, args.block_size
    );
    println!(
        "op stream  {} requests ({} skipped), mean prompt {:.0} tokens / {:.1} blocks; \
         {} events ({} stored, {} removed); {} block ops ({} query, {} stored, {} removed)",
        s.requests,
        s.skipped_requests,
        s.prompt_tokens as f64 / s.requests.max(1) as f64,
        s.query_blocks as f64 / s.requests.max(1) as f64,
        s.events(),
        s.stored_events,
        s.removed_events,
        s.block_ops(),
        s.query_blocks,
        s.stored_blocks,
        s.removed_blocks,
    );
    println!(
        "           prefix hit ratio {:.1}%, {} (worker, block) pairs resident at the end; \
         built in {:.2} s",
        100.0 * s.hit_ratio(),
        s.resident_pairs,
        began.elapsed().as_secs_f64()
    );

    // Everything the replays share is allocated before the first heap reading.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .context("cannot start the tokio runtime the thread-pool peers flush on")?;
    let config = PeerConfig {
        workers: args.workers,
        capacity: args.capacity,
        block_size: args.block_size,
        runtime: runtime.handle().clone(),
    };
    // Rounds are interleaved (every indexer once per round) so that drift in the machine's
    // state touches all indexers alike.
    let mut rounds: Vec<Vec<Measurement>> = args
        .only
        .iter()
        .map(|_| Vec::with_capacity(args.rounds))
        .collect();
    kvroute_benches::alloc::settle_heap();
    for round in 0..args.rounds {
        eprint!("round {}/{}:", round + 1, args.rounds);
        for (kind, measurements) in args.only.iter().zip(&mut rounds) {
            let measurement = replay(kind.name(), &stream, || kind.build(&config));
            // The indexer is gone: its freed heap must not slow down the next one.
            kvroute_benches::alloc::settle_heap();
            eprint!(" {kind} {:.2} s", measurement.wall.as_secs_f64());
            measurements.push(measurement);
        }
        eprintln!();
    }
    let results: Vec<Measurement> = rounds
        .into_iter()
        .map(|mut measurements| {
            measurements.sort_by_key(|m| m.wall);
            measurements.swap_remove(measurements.len() / 2)
        })
        .collect();

    println!();
    print_table(&results);
    if let Some(path) = &args.json {
        write_json(path, &args, &stream, &results)?;
        println!("\nwrote {}", path.display());
    }
    Ok(())
}

fn si(value: f64) -> String {
    if value >= 1e9 {
        format!("{:.2}G", value / 1e9)
    } else if value >= 1e6 {
        format!("{:.2}M", value / 1e6)
    } else if value >= 1e3 {
        format!("{:.1}k", value / 1e3)
    } else {
        format!("{value:.0}")
    }
}

fn print_table(results: &[Measurement]) {
    println!(
        "{:<18} {:>11} {:>10} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "speed", "block-ops/s", "events/s", "p50 ns", "p99 ns", "p99.9 ns", "allocs/q", "wall s"
    );
    for m in results {
        println!(
            "{:<18} {:>11} {:>10} {:>9} {:>9} {:>9} {:>9.2} {:>8.3}",
            m.name,
            si(m.block_ops_per_s()),
            si(m.events_per_s()),
            m.match_p50_ns,
            m.match_p99_ns,
            m.match_p999_ns,
            m.allocations_per_query(),
            m.wall.as_secs_f64(),
        );
    }
    println!(
        "\n{:<18} {:>9} {:>10} {:>10} {:>8} {:>8} {:>7}",
        "memory, agreement", "B/block", "acct B/blk", "agreement", "under", "over", "errors"
    );
    for m in results {
        println!(
            "{:<18} {:>9.1} {:>10} {:>9.2}% {:>7.2}% {:>7.2}% {:>7}",
            m.name,
            m.bytes_per_block(),
            m.accounted_bytes_per_block()
                .map_or_else(|| "-".to_owned(), |b| format!("{b:.1}")),
            100.0 * m.agreement(),
            100.0 * m.under_reporting_share(),
            100.0 * m.over_reporting_share(),
            m.apply_errors,
        );
    }

    let Some(ours) = results.iter().find(|m| m.name == Kind::Kvroute.name()) else {
        return;
    };
    // The goals compare against the best peer that answers as the ground truth does: a peer
    // that skips work it has not caught up with is fast for the wrong reason.
    // Peers only: kvroute's own variants are not compared against.
    let others: Vec<&Measurement> = (results.iter())
        .filter(|m| !m.name.starts_with(Kind::Kvroute.name()))
        .collect();
    let exact: Vec<&Measurement> = others
        .iter()
        .copied()
        .filter(|m| m.agreement() >= EXACT)
        .collect();
    let (peers, which) = if exact.is_empty() {
        (others, "best peer (none exact)")
    } else {
        (exact, "best exact peer")
    };
    if peers.is_empty() {
        return;
    }
    println!("\nkvroute / {which}:");
    for figure in RATIOS {
        let key = figure.key;
        let peer = peers
            .iter()
            .copied()
            .max_by(|a, b| {
                let order = key(a).total_cmp(&key(b));
                if figure.higher_is_better {
                    order
                } else {
                    order.reverse()
                }
            })
            .expect("peers is not empty");
        let ratio = if key(peer) == 0.0 {
            f64::NAN
        } else {
            key(ours) / key(peer)
        };
        println!(
            "  {:<12} {ratio:>8.3}x  (best peer {}; {} is better)",
            figure.label,
            peer.name,
            if figure.higher_is_better {
                "higher"
            } else {
                "lower"
            }
        );
    }
}

/// Agreement with the ground truth from which a peer counts as exact.
const EXACT: f64 = 0.999;

/// A figure compared between kvroute and the best peer at the bottom of the table.
struct Ratio {
    label: &'static str,
    key: fn(&Measurement) -> f64,
    higher_is_better: bool,
}

const RATIOS: [Ratio; 3] = [
    Ratio {
        label: "block-ops/s",
        key: Measurement::block_ops_per_s,
        higher_is_better: true,
    },
    Ratio {
        label: "p99 match",
        key: |m| m.match_p99_ns as f64,
        higher_is_better: false,
    },
    Ratio {
        label: "bytes/block",
        key: Measurement::bytes_per_block,
        higher_is_better: false,
    },
];

fn write_json(
    path: &PathBuf,
    args: &Args,
    stream: &OpStream,
    results: &[Measurement],
) -> Result<()> {
    let s = &stream.stats;
    let indexers: Vec<serde_json::Value> = results
        .iter()
        .map(|m| {
            serde_json::json!({
                "name": m.name,
                "block_ops_per_s": m.block_ops_per_s(),
                "events_per_s": m.events_per_s(),
                "match_p50_ns": m.match_p50_ns,
                "match_p99_ns": m.match_p99_ns,
                "match_p999_ns": m.match_p999_ns,
                "bytes_per_block": m.bytes_per_block(),
                "agreement": m.agreement(),
                "under_reporting": m.under_reporting_share(),
                "over_reporting": m.over_reporting_share(),
                "accounted_bytes_per_block": m.accounted_bytes_per_block(),
                "apply_errors": m.apply_errors,
                "allocations_per_query": m.allocations_per_query(),
                "wall_s": m.wall.as_secs_f64(),
            })
        })
        .collect();
    let doc = serde_json::json!({
        "trace": args.trace.as_ref().map(|p| p.display().to_string()),
        "config": {
            "workers": args.workers,
            "capacity": args.capacity,
            "block_size": args.block_size,
            "seed": args.seed,
            "rounds": args.rounds,
        },
        "ops": {
            "requests": s.requests,
            "events": s.events(),
            "blocks": s.block_ops(),
            "query_blocks": s.query_blocks,
            "stored_blocks": s.stored_blocks,
            "removed_blocks": s.removed_blocks,
            "resident_pairs": s.resident_pairs,
            "hit_ratio": s.hit_ratio(),
        },
        "indexers": indexers,
    });
    let text = serde_json::to_string_pretty(&doc)?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))
}
