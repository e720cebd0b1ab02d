//! `kvroute`: the router's programs. `demo` runs a workload through a simulated fleet under
//! every routing policy and compares them.

// A program: it prints to its terminal.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use kvroute::demo::{self, DemoConfig, DemoPolicy};
use kvroute::sim::EngineConfig;
use kvroute::workload::{read_trace, ChatConfig, Workload};
use kvroute_core::RouterConfig;
use mimalloc::MiMalloc;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// kvroute — KV-cache-aware request router for LLM inference fleets.
#[derive(Debug, Parser)]
#[command(name = "kvroute", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Route a workload through a simulated fleet (in one process, on a virtual clock) once per
    /// policy, and compare hit rate, latency and balance.
    Demo(DemoArgs),
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// A Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length,
    /// hash_ids); without it, the built-in chat workload.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Requests to run: the trace's first N rows, or the built-in workload's length (default
    /// 4,000).
    #[arg(long, value_name = "N")]
    requests: Option<usize>,
    /// Arrivals come this many times sooner than the workload's own times.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// The built-in workload's mean arrivals per second (before the speed-up). At the default,
    /// round-robin's p99 time to first token is over 2 s on the default fleet.
    #[arg(long, default_value_t = 35.0)]
    rate: f64,
    /// Seed of the built-in workload and of the peers' random draws.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Simulated workers.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// KV blocks per worker (default: an H100 serving Llama-3.1-8B, about 393k tokens).
    #[arg(long, value_name = "N")]
    kv_blocks: Option<u32>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// The KV-aware cost's credit per cached block (kv-aware and kv-aware-temp; default: the
    /// router's, 1).
    #[arg(long, value_name = "X")]
    overlap_credit: Option<f64>,
    /// The KV-aware cost's weight of prefill blocks against decode blocks (kv-aware and
    /// kv-aware-temp; default: the router's, 1). Higher favours time to first token.
    #[arg(long, value_name = "X")]
    prefill_load_scale: Option<f64>,
    /// Policies to compare, comma-separated (default: all). Known: kv-aware, kv-aware-temp,
    /// dynamo-default, cache-threshold, prefix-hash, least-loaded, power-of-two, round-robin,
    /// random.
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    policies: Vec<DemoPolicy>,
    /// Runs at once (default: the machine's cores).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Draw TTFT CDFs, hit rates and per-worker load over time to this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Demo(args) => run_demo(args),
    }
}

fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    let workload = match &args.trace {
        Some(path) => {
            let rows = read_trace(path, args.requests)?;
            let name = path
                .file_stem()
                .map_or_else(|| "trace".to_owned(), |s| s.to_string_lossy().into_owned());
            Workload::trace(name, rows)
        }
        None => Workload::chat(ChatConfig {
            requests: args.requests.unwrap_or(4_000),
            seed: args.seed,
            rate: args.rate,
            ..ChatConfig::default()
        }),
    }
    .with_speedup(args.speedup);
    let defaults = DemoConfig::default();
    let engine = EngineConfig {
        block_size: args.block_size,
        kv_blocks: args.kv_blocks.unwrap_or(defaults.engine.kv_blocks),
        ..defaults.engine
    };
    engine.validate()?;
    let router = RouterConfig {
        block_size: args.block_size,
        overlap_credit: args
            .overlap_credit
            .unwrap_or(defaults.router.overlap_credit),
        prefill_load_scale: args
            .prefill_load_scale
            .unwrap_or(defaults.router.prefill_load_scale),
        ..defaults.router.clone()
    };
    router.validate()?;
    let config = DemoConfig {
        workers: args.workers,
        engine,
        router,
        policies: if args.policies.is_empty() {
            defaults.policies
        } else {
            args.policies
        },
        threads: args.threads.unwrap_or(defaults.threads),
        load_sample_every: Duration::from_secs(1),
        seed: args.seed,
    };
    eprintln!(
        "kvroute demo: {} ({} requests, arrivals ×{}) on {} simulated workers, {} policies, {} at a time",
        workload.name(),
        workload.len(),
        workload.speedup(),
        config.workers,
        config.policies.len(),
        config.threads
    );
    let report = demo::run(&workload, &config, &|p| {
        eprintln!(
            "  {:<16} done in {:>5.1} s: hit rate {:.3}, TTFT mean {:.0} ms",
            p.name, p.wall_seconds, p.hit_rate, p.ttft_mean_ms
        );
    })?;
    println!();
    print!("{}", report.table());
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        demo::write_svg(&report, path)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
