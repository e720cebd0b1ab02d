//! The binary's `demo --sweep-workers` and `demo --disagg`, and the built-in workload's mixes
//! by name: a module of `main.rs` (the command line), not of the library.

use anyhow::Context;
use kvroute::demo::{self, DemoConfig};
use kvroute_sim::workload::{ChatConfig, Workload};

use super::{workload, DemoArgs};

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
            Some(_) => workload(args.trace.as_deref(), requests, 4_000, args.seed, rate)?,
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
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&serde_json::json!({ "sweep": sizes }))?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
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
    let router = match args.policies.as_slice() {
        [] => config.router.clone(),
        [one] if one.router_policy().is_some() => one.router_config(&config.router),
        _ => anyhow::bail!(
            "--disagg takes one of the router's own policies in --policies (it picks the \
             prefill worker)"
        ),
    };
    let disagg = demo::DisaggConfig {
        workers: config.workers,
        engine: config.engine,
        router,
        transfer: kvroute_sim::KvTransfer {
            link_gbytes_per_s: args.disagg_link_gbps / 8.0,
            ..kvroute_sim::KvTransfer::default()
        },
        splits: if args.splits.is_empty() {
            demo::DisaggConfig::default_splits(config.workers)
        } else {
            args.splits.clone()
        },
        slo_ttft_ms: args.slo_ttft_ms,
        slo_itl_ms: args.slo_itl_ms,
        conditional_max_new_tokens: args.conditional_max_new_tokens,
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
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
