//! `kvroute demo`: a workload routed through a simulated fleet once per policy, on one virtual
//! clock per run, and the comparison.
//!
//! ```text
//!  Workload ──▶ for each policy (threads): Fleet (engines + the core's Router) ──▶ PolicyReport
//!     │                                                                              │
//!     └──▶ ceiling (infinite shared cache)                 DemoReport ◀──────────────┘
//!                                                            ├─ table()   the terminal's
//!                                                            ├─ JSON      serde
//!                                                            └─ plot::write_svg
//! ```
//!
//! Every run sees the same requests at the same virtual times, on engines of the same model;
//! only the choice of worker differs. No socket, no sleep: a trace of an hour runs in seconds.
//!
//! Module map:
//!
//! * `policy.rs`: [`DemoPolicy`], the policies compared and their settings.
//! * `dynamo.rs`: [`DynamoPicker`], Dynamo's own selector on the same fleet.
//! * `sglang.rs`: [`SglangPicker`], SGLang's router's `cache_aware` rule on the same fleet.
//! * `run.rs`: one policy's run and its [`PolicyReport`].
//! * `live.rs`: [`run_live`], the same through real processes (`demo --live`).
//! * `disagg.rs`: [`run_disagg`], aggregated against disaggregated serving (`demo --disagg`).
//! * `replicas.rs`: [`run_replicas`], one router against several sharing the fleet, their
//!   bookings synced late or never (`demo --replicas`).
//! * `parallel.rs`: runs side by side on a few threads.
//! * `table.rs`: the report as the terminal shows it.
//! * `plot.rs`: the report as an SVG picture.

mod disagg;
mod dynamo;
mod live;
mod parallel;
mod plot;
mod policy;
mod replicas;
mod run;
mod sglang;
mod table;

use std::time::{Duration, Instant};

use serde::Serialize;

use kvroute_core::RouterConfig;

use kvroute_sim::workload::Workload;
use kvroute_sim::{EngineConfig, FleetError};

pub use crate::plot::PlotError;
pub use disagg::{run_disagg, DisaggConfig, DisaggReport, ModeReport};
pub use dynamo::DynamoPicker;
pub use live::{run_live, CacheCheck, LiveOptions, LiveReport, ReplicaCheck};
pub use plot::write_svg;
pub use policy::{DemoPolicy, UnknownPolicy};
pub use replicas::{
    parse_booking_sync, run_replicas, ReplicaConfig, ReplicaMode, ReplicaReport, UnknownSync,
};
pub use run::PolicyReport;
pub use sglang::SglangPicker;

/// How the demo runs.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// Simulated workers, one rank each.
    pub workers: usize,
    /// Every engine's model.
    pub engine: EngineConfig,
    /// The router's configuration under every policy (its block size must be the engines'):
    /// the KV-aware policies' weights come from here; each policy sets its own selection.
    pub router: RouterConfig,
    /// The policies, in the report's order.
    pub policies: Vec<DemoPolicy>,
    /// Runs at once (each on its own thread); at least 1.
    pub threads: usize,
    /// Step of virtual time between load samples for the plot (zero: none).
    pub load_sample_every: Duration,
    /// Seed of the peers' random draws.
    pub seed: u64,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            workers: 8,
            engine: EngineConfig::default(),
            router: RouterConfig::default(),
            policies: DemoPolicy::ALL.to_vec(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            load_sample_every: Duration::from_secs(1),
            seed: 7,
        }
    }
}

/// The comparison, as `--json` writes it.
#[derive(Clone, Debug, Serialize)]
pub struct DemoReport {
    /// The workload's name.
    pub workload: String,
    /// Requests in it.
    pub requests: u64,
    /// Its prompt tokens.
    pub prompt_tokens: u64,
    /// Arrivals came this many times sooner than the workload's own times.
    pub speedup: f64,
    /// Simulated workers.
    pub workers: usize,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks per worker.
    pub kv_blocks: u32,
    /// Hit rate with one infinite cache every worker shares: no policy can beat it.
    pub ceiling_hit_rate: f64,
    /// Hit rate with one cache of the fleet's size (workers × KV blocks) that evicts the least
    /// recently used, as the engines do: a reference for placement that never caches a block
    /// twice, with the load even ([`Workload::ceiling`]; not a bound).
    pub fleet_lru_hit_rate: f64,
    /// The highest of the runs' oracle hit rates: at each arrival, the most prompt tokens any
    /// engine held.
    pub oracle_hit_rate: f64,
    /// Each policy's figures, in the order asked.
    pub policies: Vec<PolicyReport>,
    /// Wall seconds the whole demo took.
    pub wall_seconds: f64,
}

impl DemoReport {
    /// The figures of the policy named `name`.
    pub fn policy(&self, name: &str) -> Option<&PolicyReport> {
        self.policies.iter().find(|p| p.name == name)
    }

    /// The report as the terminal shows it.
    pub fn table(&self) -> String {
        table::render(self)
    }
}

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// No policy to run, or no request.
    #[error("nothing to run: {0}")]
    Empty(&'static str),
    /// A fleet failed (the policy named).
    #[error("policy {policy}: {source}")]
    Fleet {
        /// The policy whose run failed.
        policy: &'static str,
        /// What failed.
        source: FleetError,
    },
}

/// Runs `workload` once per policy, `config.threads` runs at a time; `done` is called as each
/// run ends, with its report.
pub fn run(
    workload: &Workload,
    config: &DemoConfig,
    done: &(dyn Fn(&PolicyReport) + Sync),
) -> Result<DemoReport, DemoError> {
    if config.policies.is_empty() {
        return Err(DemoError::Empty("no policy"));
    }
    if workload.is_empty() {
        return Err(DemoError::Empty("the workload has no request"));
    }
    let started = Instant::now();
    let (slots, ceiling) = parallel::run_each(
        &config.policies,
        config.threads,
        &|&policy| {
            run::run_policy(workload, config, policy).map_err(|source| DemoError::Fleet {
                policy: policy.name(),
                source,
            })
        },
        done,
        || {
            let fleet_blocks = config.workers * config.engine.kv_blocks as usize;
            workload.ceiling(config.engine.block_size, fleet_blocks)
        },
    );
    let mut policies = Vec::with_capacity(slots.len());
    for slot in slots {
        match slot {
            Some(result) => policies.push(result?),
            None => return Err(DemoError::Empty("a run did not finish")),
        }
    }
    let oracle = policies
        .iter()
        .map(|p| p.oracle_hit_rate)
        .fold(0.0, f64::max);
    Ok(DemoReport {
        workload: workload.name().to_owned(),
        requests: ceiling.requests,
        prompt_tokens: ceiling.prompt_tokens,
        speedup: workload.speedup(),
        workers: config.workers,
        block_size: config.engine.block_size,
        kv_blocks: config.engine.kv_blocks,
        ceiling_hit_rate: ceiling.hit_rate(),
        fleet_lru_hit_rate: ceiling.lru_hit_rate(),
        oracle_hit_rate: oracle,
        policies,
        wall_seconds: started.elapsed().as_secs_f64(),
    })
}
