//! `kvroute`: the router's programs. `demo` runs a workload through a simulated fleet under
//! every routing policy and compares them.

// A program: it prints to its terminal.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use kvroute::demo::{self, DemoConfig, DemoPolicy};
use kvroute::replay::{self, ReplayOptions};
use kvroute::worker::{DisaggOptions, PublisherConfig, Role, RunningWorker, WorkerOptions};
use kvroute_core::{Affinity, HotLoad, RouterConfig};
use kvroute_serve::{RunningServe, ServeConfig, ServeOptions};
use kvroute_sim::workload::{read_trace, ChatConfig, Ties, Workload};
use kvroute_sim::{EngineConfig, KvTransfer, TimingModel};
use mimalloc::MiMalloc;

mod demo_cli;
use demo_cli::{
    live_policy, live_row, mix, print_live_notes, run_disagg_demo, run_live_replica_demo,
    run_replica_demo, run_sweep, ReplicaArgs, LIVE_HEADER,
};

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
    Demo(Box<DemoArgs>),
    /// A simulated GPU engine behind vLLM's own interfaces: OpenAI HTTP, KV events on vLLM's
    /// ZeroMQ wire (with a replay socket), Prometheus metrics under vLLM's names, and admin
    /// routes that inject faults.
    Worker(WorkerArgs),
    /// The router service: OpenAI-compatible HTTP in front of vLLM, SGLang or kvroute workers,
    /// routing each request by the engines' KV events and load.
    Serve(Box<ServeArgs>),
    /// Send a workload (a Mooncake-format trace or the built-in chat workload) to a live router
    /// or engine over HTTP, streaming, and report hit rate, latency, balance and predictions.
    Replay(ReplayArgs),
}

#[derive(Debug, Args)]
struct ReplayArgs {
    /// The router's (or an engine's) base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// A Mooncake-format trace; without it, the built-in chat workload.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Requests: the trace's first N rows, or the built-in workload's length [default: 500].
    #[arg(long, value_name = "N")]
    requests: Option<usize>,
    /// Arrivals come this many times sooner than the workload's own times (open loop).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// A trace's arrivals that share a timestamp come evenly over the gap to its next
    /// timestamp, instead of all at once (the Mooncake release stamps arrivals on a 3 s grid,
    /// about ten a stamp).
    #[arg(long)]
    spread_ties: bool,
    /// The built-in workload's mean arrivals per second (before the speed-up).
    #[arg(long, default_value_t = 5.0)]
    rate: f64,
    /// Seed of the built-in workload.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Closed loop: this many requests in flight, ignoring the workload's times.
    #[arg(long, value_name = "N")]
    concurrency: Option<usize>,
    /// The model name sent with every request.
    #[arg(long)]
    model: Option<String>,
    /// Bearer key sent to the router.
    #[arg(long, env = "KVROUTE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Longest a request may take, in seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout_s: f64,
    /// Write the report and every request's record as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Send text prompts, decoded with this model's tokenizer files (a directory with
    /// tokenizer.json), for routers that take no token ids.
    #[arg(long, value_name = "DIR")]
    text_with: Option<PathBuf>,
    /// This run's name in the JSON file and the plot [default: the URL].
    #[arg(long, value_name = "NAME")]
    label: Option<String>,
    /// Draw the TTFT distribution, the hit rate and the workers' load over time to this SVG
    /// file, with the runs of --plot-with beside this one.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Earlier runs to draw beside this one: files written by `replay --json`. Repeat it.
    #[arg(long, value_name = "FILE.json")]
    plot_with: Vec<PathBuf>,
    /// A worker behind the router (`kvroute worker`'s base URL), asked at each sending how
    /// many of the prompt's tokens it holds: with every worker named, the report gives the
    /// oracle's hit rate. Comma-separated or repeated.
    #[arg(long = "oracle-worker", value_name = "URL", value_delimiter = ',')]
    oracle_workers: Vec<String>,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// A TOML file (see kvroute.example.toml): its keys, then KVROUTE_* variables, then
    /// flags, each over the one before.
    #[arg(long, value_name = "FILE", env = "KVROUTE_CONFIG")]
    config: Option<PathBuf>,
    /// Print the effective configuration (every key, the keys' secrets left out) as TOML,
    /// and exit.
    #[arg(long)]
    print_config: bool,
    #[command(flatten)]
    settings: ServeConfig,
}
#[derive(Debug, Args)]
struct WorkerArgs {
    /// Address and port HTTP listens on.
    #[arg(long, default_value = "127.0.0.1:8000", env = "KVROUTE_WORKER_LISTEN")]
    listen: std::net::SocketAddr,
    /// The model name served.
    #[arg(long, default_value = "kvroute-sim")]
    model: String,
    /// Where KV events are published (vLLM's `endpoint`); omit for none.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    kv_events: Option<String>,
    /// Where the replay socket listens (vLLM's `replay_endpoint`).
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "kv_events")]
    kv_replay: Option<String>,
    /// The topic of every live KV-event message.
    #[arg(long, default_value = "")]
    kv_topic: String,
    /// KV-event batches kept for replay (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = 10_000)]
    kv_buffer: usize,
    /// KV blocks in the cache (default: an H100 serving Llama-3.1-8B, about 393k tokens).
    #[arg(long)]
    kv_blocks: Option<u32>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Passes run this many times faster than the timing model says.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Timing model: `blis-h100` (Llama-3.1-8B on one H100, fitted to real vLLM runs; also
    /// `blis-h100-vllm-0.11`, `blis-h100-tp2`, `blis-a100`), `dynamo` (Dynamo's mocker
    /// polynomial), or a calibration file (TOML, see docs/calibration-a100.toml).
    #[arg(long, default_value = "blis-h100", value_name = "NAME|FILE")]
    timing: String,
    /// Longest prompt plus output a request may ask for.
    #[arg(long, default_value_t = 131_072)]
    max_model_len: u32,
    /// The model's tokenizer files (a directory with tokenizer.json and
    /// tokenizer_config.json): text prompts and chat requests need them.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// Also serve kvroute's own request wire (rkyv frames over io_uring, or epoll where
    /// io_uring is unavailable) on this address.
    #[arg(long, value_name = "HOST:PORT")]
    wire: Option<std::net::SocketAddr>,
    /// The worker's id in the request wire's handshake.
    #[arg(long, default_value_t = 0, requires = "wire")]
    worker_id: u64,
    /// Its part when prefill and decode are split: `prefill` computes prompts for decode
    /// workers (vLLM's `kv_transfer_params` with do_remote_decode, SGLang's bootstrap room),
    /// `decode` pulls a prompt's KV from one and decodes, `both` serves whole requests and
    /// either half of vLLM's protocol. Every role serves a request with no transfer whole.
    #[arg(long, default_value = "both", value_name = "both|prefill|decode")]
    role: Role,
    /// The port of a prefill worker's bootstrap server, where SGLang's decode workers pull
    /// a room's KV (on --listen's address; 0: the system picks). Default with --role
    /// prefill: 8998, SGLang's.
    #[arg(long, value_name = "PORT")]
    bootstrap_port: Option<u16>,
    /// The KV transfer link's bandwidth, in gigabits per second (a decode worker times its
    /// pulls by it).
    #[arg(long, default_value_t = 400.0, value_name = "GBIT/S")]
    kv_link_gbps: f64,
    /// The fixed cost of one KV transfer (handshake and first round trip), in milliseconds.
    #[arg(long, default_value_t = 1.0, value_name = "MS")]
    kv_transfer_latency_ms: f64,
    /// How long a prefill worker keeps a computed prompt for its decode worker, and how
    /// long a decode worker waits for a bootstrap room, in milliseconds.
    #[arg(long, default_value_t = 60_000, value_name = "MS")]
    kv_transfer_timeout_ms: u64,
    /// The model's layers, for the KV bytes a token moves (default: Llama-3.1-8B's 32).
    #[arg(long, value_name = "N")]
    kv_layers: Option<u32>,
    /// Its key-value heads (default 8).
    #[arg(long, value_name = "N")]
    kv_heads: Option<u32>,
    /// Dimensions per head (default 128).
    #[arg(long, value_name = "N")]
    kv_head_dim: Option<u32>,
    /// Bytes per KV value (default 2, BF16; 1 for FP8).
    #[arg(long, value_name = "N")]
    kv_dtype_bytes: Option<u32>,
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
    /// A trace's arrivals that share a timestamp come evenly over the gap to its next
    /// timestamp, instead of all at once (the Mooncake release stamps arrivals on a 3 s grid,
    /// about ten a stamp).
    #[arg(long)]
    spread_ties: bool,
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
    /// Tokens one engine pass may compute, prefill chunks and decodes together (vLLM's
    /// `max_num_batched_tokens`, default 8,192): smaller chunks bound the stall a long prompt
    /// puts on the decodes sharing its passes, at some prefill speed.
    #[arg(long, value_name = "TOKENS")]
    max_batched_tokens: Option<u32>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// The engines' timing model: `blis-h100` (the default), `blis-h100-vllm-0.11`,
    /// `blis-h100-tp2`, `blis-a100`, `dynamo`, or a calibration file (TOML, see
    /// docs/calibration-a100.toml).
    #[arg(long, default_value = "blis-h100", value_name = "NAME|FILE")]
    timing: String,
    /// The KV-aware cost's credit per cached block (kv-aware and kv-aware-temp; default: the
    /// router's, 2; the reference router's is 1).
    #[arg(long, value_name = "X")]
    overlap_credit: Option<f64>,
    /// The KV-aware cost's weight of prefill blocks against decode blocks (kv-aware and
    /// kv-aware-temp; default: the router's, 32; the reference router's is 1). Higher favours
    /// time to first token.
    #[arg(long, value_name = "X")]
    prefill_load_scale: Option<f64>,
    /// How much more credit a rank holding nearly all of the prompt earns per cached block:
    /// `1 + X` times at the whole prompt, growing from --affinity-from (kv-aware and
    /// kv-aware-temp; default: the router's, 8; 0 turns it off).
    #[arg(long, value_name = "X")]
    affinity_boost: Option<f64>,
    /// The share of the prompt held past which a rank's credit grows (default: the
    /// router's, 0.7).
    #[arg(long, value_name = "SHARE")]
    affinity_from: Option<f64>,
    /// A worker whose context runs past this many times the fleet's mean pays for each block
    /// beyond (kv-aware and kv-aware-temp; default: the router's, 1.4; 0 turns it off).
    #[arg(long, value_name = "SHARE")]
    hot_load_share: Option<f64>,
    /// What each block of context past that costs (default: the router's, 16).
    #[arg(long, value_name = "X")]
    hot_load_weight: Option<f64>,
    /// kv-aware draws its choice among the workers whose cost is within this share of the
    /// cheapest's (default: 0 for one router; with --replicas, the replicas' default).
    #[arg(long, value_name = "SHARE")]
    near_tie: Option<f64>,
    /// Policies to compare, comma-separated (default: all). Known: kv-aware, kv-aware-temp,
    /// dynamo-default, sglang-cache-aware, cache-threshold, prefix-hash, least-loaded,
    /// power-of-two, round-robin, random.
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
    /// Run through real processes on loopback instead (N `kvroute worker`, one `kvroute
    /// serve`, a replay client), for the first policy given (default kv-aware), and compare
    /// with the in-process run.
    #[arg(long)]
    live: bool,
    /// With --live: wall time runs this many times faster than the engines' model. At 10, the
    /// default fleet's processes outrun two cores and fall behind the model.
    #[arg(long, default_value_t = 4.0)]
    time_scale: f64,
    /// With --live: drop event batches, restart a worker and kill another mid-run.
    #[arg(long, requires = "live")]
    faults: bool,
    /// With --live: ask every worker before each request how much of its prompt it holds,
    /// for the hit rate over the oracle. It loads the workers: use a lower --time-scale.
    #[arg(long, requires = "live")]
    oracle: bool,
    /// Fleet sizes to run one after the other (e.g. 8,32,64,128), arrivals scaled with the
    /// size: the built-in workload's rate, or a trace's speed-up, times size ÷ --workers, and
    /// its requests and open conversations too (the built-in workload's default or
    /// --requests; a trace's --requests when given). A table per size; with --json, every
    /// size's report.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "SIZES",
        conflicts_with = "live"
    )]
    sweep_workers: Vec<usize>,
    /// The built-in workload's mix: `chat` (the default), or `long` (long documents and long
    /// replies: where splitting prefill from decode pays).
    #[arg(long, default_value = "chat", value_name = "chat|long")]
    mix: String,
    /// Compare serving whole requests with disaggregated prefill and decode on the same
    /// GPUs (--workers), at several splits, with and without conditional disaggregation, by
    /// goodput (requests a second meeting --slo-ttft-ms and --slo-itl-ms).
    #[arg(long, conflicts_with_all = ["live", "sweep_workers"])]
    disagg: bool,
    /// With --disagg: the prefill workers of each split (default: a quarter, three eighths
    /// and half of --workers).
    #[arg(long, value_delimiter = ',', value_name = "P", requires = "disagg")]
    splits: Vec<usize>,
    /// With --disagg: the time-to-first-token objective, ms.
    #[arg(long, default_value_t = 2_000.0, value_name = "MS")]
    slo_ttft_ms: f64,
    /// With --disagg: the inter-token latency objective (a request's mean), ms.
    #[arg(long, default_value_t = 25.0, value_name = "MS")]
    slo_itl_ms: f64,
    /// With --disagg: an objective on a request's longest wait between two tokens, ms (the
    /// stall of a decode that shares a pass with a prefill chunk; default: none).
    #[arg(long, value_name = "MS", requires = "disagg")]
    slo_gap_ms: Option<f64>,
    /// With --disagg: conditional disaggregation serves a request whole on its decode worker
    /// when that worker's cache leaves at most this many prompt tokens to compute.
    #[arg(long, default_value_t = 512, value_name = "TOKENS")]
    conditional_max_new_tokens: u64,
    /// With --disagg: conditional disaggregation also serves a request whole on its decode
    /// worker once every prefill worker has at least this many prompt tokens booked for
    /// prefill (default: never).
    #[arg(long, value_name = "TOKENS")]
    conditional_prefill_busy_tokens: Option<u64>,
    /// With --disagg: conditional disaggregation serves nothing whole on a decode worker with
    /// more than this many prompt tokens booked for prefill (default: no limit).
    #[arg(long, value_name = "TOKENS")]
    conditional_decode_busy_tokens: Option<u64>,
    /// With --disagg: the link the KV crosses from prefill to decode, in gigabits per
    /// second (the default: a 400 Gb/s RDMA NIC).
    #[arg(long = "kv-link-gbps", default_value_t = 400.0, value_name = "GBIT/S")]
    disagg_link_gbps: f64,
    #[command(flatten)]
    replica: ReplicaArgs,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Demo(args) => run_demo(*args),
        Command::Worker(args) => run_worker(args),
        Command::Serve(args) => run_serve(*args),
        Command::Replay(args) => run_replay(args),
    }
}

/// A Mooncake-format trace's first `requests` rows, or the built-in chat workload of
/// `requests` (else `default_requests`) turns at `rate` a second from `seed`.
fn workload(
    trace: Option<&std::path::Path>,
    requests: Option<usize>,
    default_requests: usize,
    seed: u64,
    rate: f64,
    spread_ties: bool,
) -> anyhow::Result<Workload> {
    Ok(match trace {
        Some(path) => {
            let rows = read_trace(path, requests)?;
            let name = path
                .file_stem()
                .map_or_else(|| "trace".to_owned(), |s| s.to_string_lossy().into_owned());
            let ties = if spread_ties {
                Ties::Spread
            } else {
                Ties::Stamped
            };
            Workload::trace(name, rows).with_ties(ties)
        }
        None => Workload::chat(ChatConfig {
            requests: requests.unwrap_or(default_requests),
            seed,
            rate,
            ..ChatConfig::default()
        }),
    })
}

fn run_replay(args: ReplayArgs) -> anyhow::Result<()> {
    let workload = workload(
        args.trace.as_deref(),
        args.requests,
        500,
        args.seed,
        args.rate,
        args.spread_ties,
    )?
    .with_speedup(args.speedup);
    let options = ReplayOptions {
        url: args.url.trim_end_matches('/').to_owned(),
        model: args.model,
        concurrency: args.concurrency,
        timeout: std::time::Duration::from_secs_f64(args.timeout_s.max(0.001)),
        api_key: args.api_key,
        text: match &args.text_with {
            Some(dir) => Some(std::sync::Arc::new(kvroute_text::ModelText::load(dir)?)),
            None => None,
        },
        oracle: args
            .oracle_workers
            .iter()
            .map(|u| u.trim_end_matches('/').to_owned())
            .collect(),
    };
    let bar = indicatif::ProgressBar::new(workload.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests answered",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (records, report) = runtime.block_on(replay::run(&workload, &options, &|done, _| {
        bar.set_position(done as u64);
    }))?;
    bar.finish_and_clear();
    print!("{}", replay::table(&report, workload.name()));
    let label = args.label.clone().unwrap_or_else(|| options.url.clone());
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "workload": workload.name(),
            "label": label,
            "url": options.url,
            "speedup": workload.speedup(),
            "concurrency": options.concurrency,
            "report": report,
            "requests": records,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        let mut runs = Vec::new();
        for file in &args.plot_with {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not replay's JSON", file.display()))?;
            let stem = file
                .file_stem()
                .map_or_else(String::new, |s| s.to_string_lossy().into());
            runs.push(replay::PlottedRun::from_json(&value, &stem)?);
        }
        runs.insert(
            0,
            replay::PlottedRun {
                label: label.clone(),
                records: records.clone(),
                report: report.clone(),
            },
        );
        replay::write_plot(&runs, path)?;
        eprintln!("wrote {}", path.display());
    }
    if report.failed > 0 {
        let first = records
            .iter()
            .find_map(|r| r.error.clone())
            .unwrap_or_default();
        eprintln!("{} requests failed; the first: {first}", report.failed);
    }
    Ok(())
}

fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let file = match &args.config {
        Some(path) => ServeConfig::read(path)?,
        None => ServeConfig::default(),
    };
    let config = args.settings.over(file)?;
    if args.print_config {
        let mut effective = ServeConfig::effective(&config.clone().apply(ServeOptions::default())?);
        // Workers given as flags print as the tables they became.
        effective.worker_flags.clear();
        print!("{}", toml::to_string(&effective)?);
        return Ok(());
    }
    init_logs();
    let options = config.apply(ServeOptions::default())?;
    if options.workers.is_empty() {
        tracing::warn!("no worker configured: add some with POST /v1/workers");
    }
    let grace = options.grace;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let mut serve = RunningServe::start(options).await?;
        tracing::info!(listen = %serve.listen, "kvroute serve listening");
        let stopped = tokio::select! {
            () = shutdown_signal() => false,
            result = serve.wait() => {
                result?;
                true
            }
        };
        if !stopped {
            tracing::info!(
                grace_s = grace.as_secs_f64(),
                "stopping: draining requests in flight"
            );
            serve.stop();
            if tokio::time::timeout(grace, serve.wait()).await.is_err() {
                tracing::warn!("grace period over: exiting with requests in flight");
            }
        }
        Ok(())
    })
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}

fn run_live_demo(
    workload: &Workload,
    config: DemoConfig,
    timing: &str,
    time_scale: f64,
    faults: bool,
    oracle: bool,
    json: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let policy = live_policy(&config)?;
    let in_process = DemoConfig {
        policies: vec![policy],
        ..config.clone()
    };
    eprintln!(
        "in process: {} on {} simulated workers",
        policy, config.workers
    );
    let local = demo::run(workload, &in_process, &|_| {})?;
    let options = demo::LiveOptions {
        exe: std::env::current_exe()?,
        workers: config.workers,
        engine: config.engine,
        timing: timing.to_owned(),
        time_scale,
        policy: policy.name().to_owned(),
        faults,
        oracle,
        replicas: 1,
    };
    eprintln!(
        "live: {} kvroute worker processes, kvroute serve, replay at ×{time_scale}{}",
        config.workers,
        if faults { ", faults injected" } else { "" }
    );
    let bar = indicatif::ProgressBar::new(workload.len() as u64);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let live = runtime.block_on(demo::run_live(workload, &options, &|done, _| {
        bar.set_position(done as u64);
    }))?;
    bar.finish_and_clear();
    let l = &local.policies[0];
    let r = &live.replay;
    println!("{}: {} requests, {policy}", workload.name(), workload.len());
    println!("{LIVE_HEADER}");
    let of = |hit: f64, oracle: f64| if oracle > 0.0 { hit / oracle } else { 0.0 };
    println!(
        "in process       {:>8.3}  {:>9.3}  {:>6.0} ms  {:>5.0} ms  {:>5.1} ms  {:>9.2}  {:>8.1}%",
        l.hit_rate,
        of(l.hit_rate, l.oracle_hit_rate),
        l.ttft_mean_ms,
        l.ttft_p99_ms,
        l.itl_mean_ms,
        l.imbalance,
        l.prediction_accuracy * 100.0
    );
    println!("{}", live_row("live", r, oracle, time_scale));
    println!(
        "live ÷ in process hit rate: {:.3}; requests {} ok, {} failed; load at the end: {} requests",
        if l.hit_rate > 0.0 { r.hit_rate / l.hit_rate } else { 0.0 },
        r.ok,
        r.failed,
        live.active_at_end
    );
    print_live_notes(&live);
    if let Some(path) = json {
        let out = serde_json::json!({"in_process": local, "live": live, "time_scale": time_scale});
        std::fs::write(path, serde_json::to_string_pretty(&out)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn run_worker(args: WorkerArgs) -> anyhow::Result<()> {
    init_logs();
    let defaults = WorkerOptions::default();
    let timing = TimingModel::from_arg(&args.timing)?;
    let engine = EngineConfig {
        block_size: args.block_size,
        kv_blocks: args.kv_blocks.unwrap_or(defaults.engine.kv_blocks),
        speedup: args.speedup,
        timing,
        ..defaults.engine
    };
    engine.validate()?;
    let disagg = worker_disagg(&args)?;
    let options = WorkerOptions {
        http: args.listen,
        model: args.model,
        engine,
        max_model_len: args.max_model_len,
        tokenizer: args.tokenizer,
        wire: args.wire,
        worker_id: args.worker_id,
        kv_events: args.kv_events.map(|endpoint| PublisherConfig {
            endpoint,
            replay_endpoint: args.kv_replay,
            topic: args.kv_topic,
            buffer_batches: args.kv_buffer,
            dp_rank: 0,
        }),
        disagg,
        ..defaults
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let mut worker = RunningWorker::start(options).await?;
        tracing::info!(
            http = %worker.http,
            events = ?worker.events,
            replay = ?worker.replay,
            wire = ?worker.wire,
            bootstrap = ?worker.bootstrap,
            "kvroute worker serving"
        );
        let exited = tokio::select! {
            () = shutdown_signal() => {
                tracing::info!("interrupted: stopping");
                false
            }
            result = worker.wait() => {
                result?;
                true
            }
        };
        if !exited {
            worker.stop();
            worker.wait().await?;
        }
        Ok(())
    })
}

/// The worker's role, bootstrap server and transfer link from its flags.
fn worker_disagg(args: &WorkerArgs) -> anyhow::Result<DisaggOptions> {
    use kvroute_serve::disagg::SGLANG_BOOTSTRAP_PORT;
    let bootstrap_port = match (args.role, args.bootstrap_port) {
        (Role::Prefill, port) => Some(port.unwrap_or(SGLANG_BOOTSTRAP_PORT)),
        (_, None) => None,
        (role, Some(_)) => anyhow::bail!(
            "--bootstrap-port is a prefill worker's (this one's --role is {})",
            role.as_str()
        ),
    };
    if !(args.kv_transfer_latency_ms.is_finite() && args.kv_transfer_latency_ms >= 0.0) {
        anyhow::bail!("--kv-transfer-latency-ms must be a number of at least 0");
    }
    let shape = KvTransfer::default();
    let transfer = KvTransfer {
        layers: args.kv_layers.unwrap_or(shape.layers),
        kv_heads: args.kv_heads.unwrap_or(shape.kv_heads),
        head_dim: args.kv_head_dim.unwrap_or(shape.head_dim),
        dtype_bytes: args.kv_dtype_bytes.unwrap_or(shape.dtype_bytes),
        link_gbytes_per_s: args.kv_link_gbps / 8.0,
        latency: Duration::from_secs_f64(args.kv_transfer_latency_ms / 1e3),
    };
    if let Err(why) = transfer.check() {
        anyhow::bail!(
            "{why} (--kv-link-gbps, --kv-layers, --kv-heads, --kv-head-dim, --kv-dtype-bytes)"
        );
    }
    Ok(DisaggOptions {
        role: args.role,
        bootstrap: bootstrap_port.map(|port| std::net::SocketAddr::new(args.listen.ip(), port)),
        transfer,
        timeout: Duration::from_millis(args.kv_transfer_timeout_ms),
    })
}

fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVROUTE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    let base = mix(&args.mix)?;
    let workload = match &args.trace {
        Some(_) => workload(
            args.trace.as_deref(),
            args.requests,
            4_000,
            args.seed,
            args.rate,
            args.spread_ties,
        )?,
        None => Workload::chat(ChatConfig {
            requests: args.requests.unwrap_or(4_000),
            seed: args.seed,
            rate: args.rate,
            ..base
        }),
    }
    .with_speedup(args.speedup);
    let defaults = DemoConfig::default();
    let engine = EngineConfig {
        block_size: args.block_size,
        kv_blocks: args.kv_blocks.unwrap_or(defaults.engine.kv_blocks),
        max_num_batched_tokens: args
            .max_batched_tokens
            .unwrap_or(defaults.engine.max_num_batched_tokens),
        timing: TimingModel::from_arg(&args.timing)?,
        ..defaults.engine
    };
    if engine.max_num_batched_tokens < engine.max_num_seqs {
        // As vLLM requires: a pass must have room for one token of every running request.
        anyhow::bail!(
            "--max-batched-tokens must be at least {} (the engines' max_num_seqs)",
            engine.max_num_seqs
        );
    }
    engine.validate()?;
    let router = RouterConfig {
        block_size: args.block_size,
        overlap_credit: args
            .overlap_credit
            .unwrap_or(defaults.router.overlap_credit),
        prefill_load_scale: args
            .prefill_load_scale
            .unwrap_or(defaults.router.prefill_load_scale),
        affinity: Affinity {
            from_share: args
                .affinity_from
                .unwrap_or(defaults.router.affinity.from_share),
            boost: args
                .affinity_boost
                .unwrap_or(defaults.router.affinity.boost),
        },
        hot_load: HotLoad {
            share: args
                .hot_load_share
                .unwrap_or(defaults.router.hot_load.share),
            weight: args
                .hot_load_weight
                .unwrap_or(defaults.router.hot_load.weight),
        },
        near_tie: args.near_tie.unwrap_or(defaults.router.near_tie),
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
            args.policies.clone()
        },
        threads: args.threads.unwrap_or(defaults.threads),
        load_sample_every: Duration::from_secs(1),
        seed: args.seed,
    };
    // What runs: the modes of --disagg, the routers of --replicas, or the policies.
    let runs = if args.disagg {
        "serving whole, split and conditionally split".to_owned()
    } else if args.replica.replicas != 1 {
        format!("1 router, then {} replicas", args.replica.replicas)
    } else {
        format!("{} policies", config.policies.len())
    };
    eprintln!(
        "kvroute demo: {} ({} requests, arrivals ×{}) on {} simulated workers, {runs}, {} at a time",
        workload.name(),
        workload.len(),
        workload.speedup(),
        config.workers,
        config.threads
    );
    if !args.sweep_workers.is_empty() {
        return run_sweep(&args, config);
    }
    if args.disagg {
        return run_disagg_demo(&args, &workload, config);
    }
    if !(1..=64).contains(&args.replica.replicas) {
        anyhow::bail!("--replicas takes 1 to 64 routers");
    }
    if args.replica.replicas == 1 && args.replica.replica_delay_ms.is_some() {
        anyhow::bail!("--replica-delay-ms needs --replicas N (2 or more)");
    }
    if args.live && args.replica.replicas != 1 {
        return run_live_replica_demo(&args, &workload, config);
    }
    if args.replica.replicas != 1 {
        return run_replica_demo(&args, &workload, config);
    }
    if args.live {
        eprintln!("(the in-process run below is the first policy's only)");
        return run_live_demo(
            &workload,
            config,
            &args.timing,
            args.time_scale,
            args.faults,
            args.oracle,
            args.json.as_deref(),
        );
    }
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
