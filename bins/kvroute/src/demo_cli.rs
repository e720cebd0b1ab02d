//! The binary's `demo --sweep-workers`, `demo --disagg`, `demo --replicas` and
//! `demo --live --replicas`, the live demo's table rows, and the built-in workload's mixes by
//! name: a module of `main.rs` (the command line), not of the library.

use std::path::Path;

use anyhow::Context;
use clap::Args;
use kvroute::demo::{self, DemoConfig, DemoPolicy, LiveReport};
use kvroute::replay::ReplayReport;
use kvroute_sim::workload::{ChatConfig, Workload};
use kvroute_sim::BookingSync;

use super::{workload, DemoArgs};

/// `demo --replicas`: several routers sharing one fleet.
#[derive(Debug, Args)]
pub(super) struct ReplicaArgs {
    /// Compare one router with N routers sharing the fleet (`kvroute serve` replicas behind a
    /// load balancer, which hands them arrivals in turn), each seeing every engine's KV events
    /// and learning of the others' bookings after each --replica-delay-ms. Runs the policy
    /// --policies names (one of the router's own; default kv-aware). With --live: one real
    /// `kvroute serve`, then N real replicas sharing their bookings through a `nats-server`
    /// the demo starts, the client handing them requests in turn.
    #[arg(
        long,
        default_value_t = 1,
        value_name = "N",
        conflicts_with_all = ["sweep_workers", "disagg"]
    )]
    pub(super) replicas: usize,
    /// With --replicas: how late each router learns of the others' bookings, in ms of the
    /// fleet's virtual time, one run each (0: at once; `off`: never, each router counts only
    /// its own; default off,0,2). Not with --live, where the delay is the real one through
    /// NATS.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        value_parser = demo::parse_booking_sync,
        conflicts_with = "live"
    )]
    pub(super) replica_delay_ms: Option<Vec<BookingSync>>,
}

/// One demo per fleet size of `--sweep-workers`, arrivals and requests scaled with the size.
pub(super) fn run_sweep(args: &DemoArgs, config: DemoConfig) -> anyhow::Result<()> {
    if args.sweep_workers.contains(&0) || args.workers == 0 {
        anyhow::bail!("--sweep-workers and --workers take sizes of at least 1");
    }
    let mut sizes = Vec::new();
    for &size in &args.sweep_workers {
        let scale = size as f64 / args.workers as f64;
        let scaled = |n: usize| ((n as f64 * scale).round() as usize).max(1);
        let (requests, rate, speedup) = match &args.trace {
            None => (
                Some(scaled(args.requests.unwrap_or(4_000))),
                args.rate * scale,
                args.speedup,
            ),
            Some(_) => (args.requests.map(scaled), args.rate, args.speedup * scale),
        };
        let workload = match &args.trace {
            Some(_) => workload(
                args.trace.as_deref(),
                requests,
                4_000,
                args.seed,
                rate,
                args.spread_ties,
            )?,
            // More users on a bigger fleet: the open conversations scale with it too, so that
            // each conversation's turns come as often at every size.
            None => {
                let base = mix(&args.mix)?;
                Workload::chat(ChatConfig {
                    requests: requests.unwrap_or(4_000),
                    seed: args.seed,
                    rate,
                    open_conversations: scaled(base.open_conversations),
                    ..base
                })
            }
        }
        .with_speedup(speedup);
        let sized = DemoConfig {
            workers: size,
            ..config.clone()
        };
        eprintln!(
            "kvroute demo, sweep: {} workers, {} ({} requests, arrivals ×{:.2}{})",
            size,
            workload.name(),
            workload.len(),
            workload.speedup(),
            if args.trace.is_none() {
                format!(", {rate:.0}/s")
            } else {
                String::new()
            }
        );
        let report = demo::run(&workload, &sized, &|p| {
            eprintln!(
                "  {:<16} done in {:>5.1} s: hit rate {:.3}, TTFT mean {:.0} ms",
                p.name, p.wall_seconds, p.hit_rate, p.ttft_mean_ms
            );
        })?;
        println!();
        println!("{size} workers:");
        print!("{}", report.table());
        sizes.push(serde_json::json!({
            "workers": size,
            "arrivals_per_second": if args.trace.is_none() { Some(rate) } else { None },
            "report": report,
        }));
    }
    write_json(args.json.as_deref(), &serde_json::json!({ "sweep": sizes }))
}

/// Writes `report` as pretty JSON to `path`, when given.
fn write_json(path: Option<&Path>, report: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(path) = path {
        let json = serde_json::to_string_pretty(report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// The one policy of the router's own that `--policies` names for `mode` (none named: none),
/// or why not: `mode` runs one, and `what` it does with it.
fn own_policy(args: &DemoArgs, mode: &str, what: &str) -> anyhow::Result<Option<DemoPolicy>> {
    match args.policies.as_slice() {
        [] => Ok(None),
        [one] if one.router_policy().is_some() => Ok(Some(*one)),
        _ => anyhow::bail!("{mode} takes one of the router's own policies in --policies ({what})"),
    }
}

/// The built-in workload's mix by name.
pub(super) fn mix(name: &str) -> anyhow::Result<ChatConfig> {
    Ok(match name {
        "chat" => ChatConfig::default(),
        "long" => ChatConfig::long_mix(),
        other => anyhow::bail!("--mix {other:?}: chat or long"),
    })
}

/// `demo --disagg`: aggregated against disaggregated serving on the same GPUs.
pub(super) fn run_disagg_demo(
    args: &DemoArgs,
    workload: &Workload,
    config: DemoConfig,
) -> anyhow::Result<()> {
    // The policy that picks prefill workers: the one --policies names, else kv-aware.
    let router = match own_policy(args, "--disagg", "it picks the prefill worker")? {
        None => config.router.clone(),
        Some(one) => one.router_config(&config.router),
    };
    let transfer = kvroute_sim::KvTransfer {
        link_gbytes_per_s: args.disagg_link_gbps / 8.0,
        ..kvroute_sim::KvTransfer::default()
    };
    if let Err(why) = transfer.check() {
        anyhow::bail!("--kv-link-gbps: {why}");
    }
    let disagg = demo::DisaggConfig {
        workers: config.workers,
        engine: config.engine,
        router,
        transfer,
        splits: if args.splits.is_empty() {
            demo::DisaggConfig::default_splits(config.workers)
        } else {
            args.splits.clone()
        },
        slo_ttft_ms: args.slo_ttft_ms,
        slo_itl_ms: args.slo_itl_ms,
        slo_gap_ms: args.slo_gap_ms,
        conditional: kvroute_core::Conditional {
            prefill_busy_tokens: args.conditional_prefill_busy_tokens,
            decode_busy_tokens: args.conditional_decode_busy_tokens,
            ..kvroute_core::Conditional::new_tokens_at_most(args.conditional_max_new_tokens)
        },
        threads: config.threads,
    };
    let report = demo::run_disagg(workload, &disagg, &|m| {
        eprintln!(
            "  {:<18} done in {:>5.1} s: goodput {:.2}/s, TTFT mean {:.0} ms, ITL mean {:.1} ms",
            m.name, m.wall_seconds, m.goodput_rps, m.ttft_mean_ms, m.itl_mean_ms
        );
    })?;
    println!();
    print!("{}", report.table());
    write_json(args.json.as_deref(), &report)
}

/// `demo --replicas N`: one router against N sharing the fleet, at each booking sync.
pub(super) fn run_replica_demo(
    args: &DemoArgs,
    workload: &Workload,
    config: DemoConfig,
) -> anyhow::Result<()> {
    let policy = own_policy(
        args,
        "--replicas",
        "the peers' pickers route for one router",
    )?
    .unwrap_or(DemoPolicy::KvAware);
    let replicas = demo::ReplicaConfig {
        demo: config,
        policy,
        replicas: args.replica.replicas,
        syncs: args.replica.replica_delay_ms.clone().unwrap_or_else(|| {
            vec![
                BookingSync::Off,
                BookingSync::After(std::time::Duration::ZERO),
                BookingSync::After(std::time::Duration::from_millis(2)),
            ]
        }),
        // As `kvroute serve` does: replicas break near-ties at random, one router does not.
        near_tie: args.near_tie.unwrap_or(kvroute_core::REPLICA_NEAR_TIE),
    };
    eprintln!(
        "replicas: 1 router, then {} at {} booking syncs, {policy}",
        replicas.replicas,
        replicas.syncs.len()
    );
    let report = demo::run_replicas(workload, &replicas, &|m| {
        let f = &m.figures;
        eprintln!(
            "  {:<24} done in {:>5.1} s: hit rate {:.3}, TTFT mean {:.0} ms, imbalance {:.2}",
            m.mode, f.wall_seconds, f.hit_rate, f.ttft_mean_ms, f.imbalance
        );
    })?;
    println!();
    print!("{}", report.table());
    write_json(args.json.as_deref(), &report)
}

/// The live demo's table header.
pub(super) const LIVE_HEADER: &str =
    "                 hit rate  of oracle  TTFT mean  TTFT p99  ITL mean  imbalance  predicted";

/// The policy `--live` serves with: the first --policies names (default kv-aware), one of
/// kvroute's own.
pub(super) fn live_policy(config: &DemoConfig) -> anyhow::Result<DemoPolicy> {
    let policy = config
        .policies
        .first()
        .copied()
        .unwrap_or(DemoPolicy::KvAware);
    if matches!(
        policy,
        DemoPolicy::DynamoDefault | DemoPolicy::SglangCacheAware
    ) {
        anyhow::bail!(
            "--live serves with kvroute's own policies; {policy} runs in process only \
             (scripts/live_vs_sglang.sh runs SGLang's router itself)"
        );
    }
    Ok(policy)
}

/// A live run's row of the table under [`LIVE_HEADER`], labelled `label`.
pub(super) fn live_row(label: &str, r: &ReplayReport, oracle: bool, time_scale: f64) -> String {
    // Live times are wall times at the time scale: brought back to the model's.
    format!(
        "{label:<17}{:>8.3}  {:>9}  {:>6.0} ms  {:>5.0} ms  {:>5.1} ms  {:>9.2}  {:>8.1}%",
        r.hit_rate,
        if oracle {
            format!("{:.3}", r.hit_over_oracle)
        } else {
            "-".to_owned()
        },
        r.ttft_mean_ms * time_scale,
        r.ttft_p99_ms * time_scale,
        r.itl_mean_ms * time_scale,
        r.imbalance,
        r.prediction_accuracy * 100.0
    )
}

/// A live run's faults, failures and caches against the router's index.
pub(super) fn print_live_notes(live: &LiveReport) {
    for f in &live.faults {
        println!("fault at {f}");
    }
    for (worker, n) in &live.failed_by_worker {
        match worker {
            Some(w) => println!("{n} requests failed on worker {w}"),
            None => println!("{n} requests failed before being routed"),
        }
    }
    for (worker, sent_ms, status, error) in &live.first_failures {
        let on = worker.map_or("before routing".to_owned(), |w| format!("on worker {w}"));
        let at = sent_ms / 1e3;
        println!(
            "first failure {on}: sent at {at:.2} s, status {status}, {}",
            error.trim()
        );
    }
    for c in &live.caches {
        println!(
            "worker {}: engine caches {} blocks, the router's index holds {}",
            c.worker,
            c.engine_blocks
                .map_or("(gone)".to_owned(), |b| b.to_string()),
            c.index_blocks
        );
    }
}

/// `demo --live --replicas N`: the workload through one real `kvroute serve`, then through N
/// real replicas sharing a real `nats-server`, each on fresh engines.
pub(super) fn run_live_replica_demo(
    args: &DemoArgs,
    workload: &Workload,
    config: DemoConfig,
) -> anyhow::Result<()> {
    let replicas = args.replica.replicas;
    if replicas < 2 {
        anyhow::bail!("--live --replicas takes at least 2 replicas");
    }
    let policy = live_policy(&config)?;
    // Before the first fleet's run, not after it.
    if std::process::Command::new(kvroute_serve::nats_server_program())
        .arg("--version")
        .output()
        .is_err()
    {
        anyhow::bail!(
            "--live --replicas needs nats-server on PATH (scripts/fixtures.sh installs it)"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut runs = Vec::new();
    for (label, routers) in [
        ("1 router".to_owned(), 1),
        (format!("{replicas} replicas"), replicas),
    ] {
        let options = demo::LiveOptions {
            exe: std::env::current_exe()?,
            workers: config.workers,
            engine: config.engine,
            timing: args.timing.clone(),
            time_scale: args.time_scale,
            policy: policy.name().to_owned(),
            faults: args.faults,
            oracle: args.oracle,
            replicas: routers,
        };
        eprintln!(
            "live, {label}: {} kvroute worker processes, replay at ×{}{}",
            config.workers,
            args.time_scale,
            if args.faults { ", faults injected" } else { "" }
        );
        let bar = indicatif::ProgressBar::new(workload.len() as u64);
        let live = runtime.block_on(demo::run_live(workload, &options, &|done, _| {
            bar.set_position(done as u64);
        }))?;
        bar.finish_and_clear();
        runs.push((label, live));
    }
    println!(
        "{}: {} requests, {policy}, live at ×{}",
        workload.name(),
        workload.len(),
        args.time_scale
    );
    println!("{LIVE_HEADER}");
    for (label, live) in &runs {
        println!(
            "{}",
            live_row(label, &live.replay, args.oracle, args.time_scale)
        );
    }
    for (label, live) in &runs {
        let r = &live.replay;
        println!();
        println!(
            "{label}: requests {} ok, {} failed; load at the end: {} requests",
            r.ok, r.failed, live.active_at_end
        );
        for (i, c) in live.replicas.iter().enumerate() {
            let show = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.0}"));
            println!(
                "replica {i}: sent {}, served {:.0}; sync up {}, peers {}, the others' booking changes applied {}",
                c.sent,
                c.served,
                show(c.sync_up),
                show(c.peers),
                show(c.applied)
            );
        }
        print_live_notes(live);
    }
    let [(_, one), (_, many)] = runs.as_slice() else {
        anyhow::bail!("the live replica demo ran {} fleets, not 2", runs.len());
    };
    let out = serde_json::json!({
        "one_router": one,
        "replicas": many,
        "replica_count": replicas,
        "time_scale": args.time_scale,
    });
    write_json(args.json.as_deref(), &out)
}
