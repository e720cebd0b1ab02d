//! One policy's run: the workload through a simulated fleet (routed by one router, or by
//! several replicas), and its figures.

use std::time::{Duration, Instant};

use kvroute_core::RequestId;
use serde::Serialize;

use super::dynamo::DynamoPicker;
use super::policy::DemoPolicy;
use super::sglang::SglangPicker;
use super::DemoConfig;
use kvroute_sim::workload::Workload;
use kvroute_sim::{Arrival, Fleet, FleetConfig, FleetError, LoadSeries, Replicas};

/// One policy's figures (the JSON report's `policies` entries).
#[derive(Clone, Debug, Serialize)]
pub struct PolicyReport {
    /// The policy's name.
    pub name: String,
    /// Prompt tokens the engines found cached ÷ prompt tokens.
    pub hit_rate: f64,
    /// The most prompt tokens any engine held at each arrival ÷ prompt tokens, in this run.
    pub oracle_hit_rate: f64,
    /// Mean time to first token, ms.
    pub ttft_mean_ms: f64,
    /// Median time to first token, ms.
    pub ttft_p50_ms: f64,
    /// 99th percentile time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Mean inter-token latency, ms.
    pub itl_mean_ms: f64,
    /// 99th percentile of a request's mean inter-token latency, ms.
    pub itl_p99_ms: f64,
    /// The same over each worker's requests, by worker id, ms.
    pub worker_itl_p99_ms: Vec<f64>,
    /// The highest of `worker_itl_p99_ms`: the worst worker's decoding, ms.
    pub worst_worker_itl_p99_ms: f64,
    /// Mean arrival to last token, ms.
    pub e2e_mean_ms: f64,
    /// Output tokens per virtual second.
    pub throughput_tok_s: f64,
    /// Busiest worker's time-averaged active tokens ÷ the mean worker's.
    pub imbalance: f64,
    /// Share of decisions whose predicted cached tokens equal the engine's.
    pub prediction_accuracy: f64,
    /// Median wall time of a routing decision, µs.
    pub route_p50_us: f64,
    /// 99th percentile wall time of a routing decision, µs.
    pub route_p99_us: f64,
    /// Requests routed.
    pub requests: usize,
    /// Requests finished.
    pub finished: usize,
    /// Requests the router still counted as active at the end (0 when all is well).
    pub active_at_end: usize,
    /// Preemptions in all engines.
    pub preemptions: u64,
    /// Virtual seconds from the first arrival to the last finish.
    pub virtual_seconds: f64,
    /// Wall seconds the run took.
    pub wall_seconds: f64,
    /// Times to first token, ms, sorted (for the plot's CDF).
    #[serde(skip)]
    pub ttft_sorted_ms: Vec<f64>,
    /// Per-worker active tokens over virtual time (for the plot).
    #[serde(skip)]
    pub load: LoadSeries,
}

/// Submits `workload`'s requests as the fleet's time reaches each, then runs it until idle.
pub(super) fn play(fleet: &mut Fleet, workload: &Workload) -> Result<(), FleetError> {
    for (i, request) in workload.requests().enumerate() {
        fleet.run_to(request.at)?;
        fleet.submit(Arrival {
            at: request.at.max(fleet.now()),
            id: RequestId(i as u64),
            prompt: request.prompt,
            max_output_tokens: request.output_tokens,
        })?;
    }
    fleet.run_until_idle()
}

/// Runs `workload` under `policy` on a fresh fleet.
pub(super) fn run_policy(
    workload: &Workload,
    config: &DemoConfig,
    policy: DemoPolicy,
) -> Result<PolicyReport, FleetError> {
    run_replicated(workload, config, policy, Replicas::ONE).map(|(report, _)| report)
}

/// Runs `workload` under `policy` on a fresh fleet routed by `replicas`; returns its figures
/// and the booking changes its routers refused. The peers' policies route for one router.
pub(super) fn run_replicated(
    workload: &Workload,
    config: &DemoConfig,
    policy: DemoPolicy,
    replicas: Replicas,
) -> Result<(PolicyReport, u64), FleetError> {
    let started = Instant::now();
    let engine = config.engine;
    if replicas.count > 1 && policy.router_policy().is_none() {
        return Err(FleetError::Config {
            reason: "a peer's policy routes for one router: several run the router's own",
        });
    }
    let mut fleet = Fleet::with_replicas(
        FleetConfig {
            workers: config.workers,
            engine,
            router: policy.router_config(&config.router),
            split: None,
        },
        replicas,
    )?;
    if policy == DemoPolicy::DynamoDefault {
        fleet.set_picker(Box::new(DynamoPicker::new(
            config.workers,
            u64::from(engine.kv_blocks),
            u64::from(engine.max_num_batched_tokens),
            engine.block_size,
            config.seed,
        )));
    }
    if policy == DemoPolicy::SglangCacheAware {
        fleet.set_picker(Box::new(SglangPicker::new(
            config.workers,
            engine.block_size,
            config.seed,
        )));
    }
    fleet.sample_load_every(config.load_sample_every);
    play(&mut fleet, workload)?;
    let report = fleet.report();
    let mut route_ns = fleet.route_times_ns().to_vec();
    route_ns.sort_unstable();
    let records = fleet.records();
    let mut ttft: Vec<f64> = records
        .iter()
        .filter_map(|r| r.first_token.map(|t| ms(t - r.arrival)))
        .collect();
    ttft.sort_by(f64::total_cmp);
    let e2e: Vec<f64> = records
        .iter()
        .filter_map(|r| r.finished.map(|t| ms(t - r.arrival)))
        .collect();
    let first = records.iter().map(|r| r.arrival).min().unwrap_or_default();
    let last = records.iter().filter_map(|r| r.finished).max();
    let figures = PolicyReport {
        name: policy.name().to_owned(),
        hit_rate: report.hit_rate,
        oracle_hit_rate: report.oracle_hit_rate,
        ttft_mean_ms: report.ttft_mean_ms,
        ttft_p50_ms: quantile(&ttft, 0.5),
        ttft_p99_ms: report.ttft_p99_ms,
        itl_mean_ms: report.itl_mean_ms,
        itl_p99_ms: report.itl_p99_ms,
        worst_worker_itl_p99_ms: report.worker_itl_p99_ms.iter().copied().fold(0.0, f64::max),
        worker_itl_p99_ms: report.worker_itl_p99_ms,
        e2e_mean_ms: mean(&e2e),
        throughput_tok_s: report.throughput,
        imbalance: report.load_imbalance,
        prediction_accuracy: report.prediction_accuracy,
        route_p50_us: quantile_ns(&route_ns, 0.5) / 1e3,
        route_p99_us: quantile_ns(&route_ns, 0.99) / 1e3,
        requests: report.requests,
        finished: report.finished,
        active_at_end: report.active_requests,
        preemptions: fleet.engines().iter().map(|e| e.stats().preemptions).sum(),
        virtual_seconds: last.map_or(0.0, |l| l.saturating_sub(first).as_secs_f64()),
        wall_seconds: started.elapsed().as_secs_f64(),
        ttft_sorted_ms: ttft,
        load: fleet.load_series().clone(),
    };
    Ok((figures, fleet.refused_bookings()))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// The `q` quantile of sorted values by nearest rank (0 when empty).
pub(super) fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn quantile_ns(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64
}
