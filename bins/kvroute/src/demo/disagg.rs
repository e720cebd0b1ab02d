//! `kvroute demo --disagg`: the same simulated GPUs serving the same workload aggregated,
//! disaggregated at several prefill:decode splits, and conditionally disaggregated, compared
//! by goodput: requests a second that met both latency objectives.
//!
//! ```text
//!  Workload ──▶ for each mode (threads): Fleet { split: None | P prefill, N − P decode } ──▶ ModeReport
//!                 aggregated, disagg-<P>p<D>d, conditional-<P>p<D>d             DisaggReport ──▶ table, JSON
//! ```
//!
//! Every mode routes with the same router configuration (its policy picks the prefill engine;
//! decode is chosen by load) and hands the KV over the same link.

use std::time::{Duration, Instant};

use kvroute_core::{Conditional, RouterConfig};
use serde::Serialize;

use super::DemoError;
use kvroute_sim::workload::Workload;
use kvroute_sim::{EngineConfig, Fleet, FleetConfig, FleetError, KvTransfer, Split};

/// How the comparison runs.
#[derive(Clone, Debug)]
pub struct DisaggConfig {
    /// Simulated GPUs, the same number in every mode.
    pub workers: usize,
    /// Every engine's model.
    pub engine: EngineConfig,
    /// The router's configuration in every mode.
    pub router: RouterConfig,
    /// The link prompts' KV crosses.
    pub transfer: KvTransfer,
    /// Prefill engines of each split compared (each at least 1 and below `workers`).
    pub splits: Vec<usize>,
    /// The time-to-first-token objective, ms.
    pub slo_ttft_ms: f64,
    /// The inter-token latency objective (a request's mean), ms.
    pub slo_itl_ms: f64,
    /// An objective on a request's longest wait between two tokens, ms (none: not counted).
    pub slo_gap_ms: Option<f64>,
    /// Conditional disaggregation's rule, for the conditional modes.
    pub conditional: Conditional,
    /// Runs at once; at least 1.
    pub threads: usize,
}

impl DisaggConfig {
    /// The splits worth comparing on `workers` GPUs: a quarter, three eighths and half of
    /// them computing prompts (at least one, and one decoding).
    pub fn default_splits(workers: usize) -> Vec<usize> {
        let mut splits: Vec<usize> = [workers / 4, workers * 3 / 8, workers / 2]
            .into_iter()
            .map(|p| p.clamp(1, workers.saturating_sub(1).max(1)))
            .collect();
        splits.dedup();
        splits
    }
}

/// One mode's figures (the JSON report's `modes` entries).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ModeReport {
    /// `aggregated`, `disagg-<P>p<D>d` or `conditional-<P>p<D>d`.
    pub name: String,
    /// Engines computing prompts (0 aggregated).
    pub prefill_workers: usize,
    /// Engines decoding (every engine, aggregated).
    pub decode_workers: usize,
    /// Mean time to first token, ms.
    pub ttft_mean_ms: f64,
    /// 99th percentile time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Mean of the requests' mean inter-token latencies, ms.
    pub itl_mean_ms: f64,
    /// 99th percentile of the same, ms.
    pub itl_p99_ms: f64,
    /// 99th percentile of the requests' longest waits between two tokens, ms: the stalls a
    /// decode sees when it shares a pass with a prefill chunk.
    pub gap_p99_ms: f64,
    /// Requests a virtual second that met the objectives.
    pub goodput_rps: f64,
    /// Output tokens a virtual second.
    pub throughput_tok_s: f64,
    /// Prompt tokens found cached (on the engine that computed the prompt) ÷ prompt tokens.
    pub hit_rate: f64,
    /// Requests served whole on a decode engine (conditional disaggregation).
    pub served_whole: usize,
    /// Requests that did not finish, or that the router still counted at the end (0 when
    /// all is well).
    pub unfinished: usize,
    /// Wall seconds the run took.
    pub wall_seconds: f64,
}

/// The comparison, as `--json` writes it.
#[derive(Clone, Debug, Serialize)]
pub struct DisaggReport {
    /// The workload's name.
    pub workload: String,
    /// The time-to-first-token objective, ms.
    pub slo_ttft_ms: f64,
    /// The inter-token latency objective, ms.
    pub slo_itl_ms: f64,
    /// The objective on a request's longest wait between two tokens, ms, when one was set.
    pub slo_gap_ms: Option<f64>,
    /// Simulated GPUs in every mode.
    pub workers: usize,
    /// Each mode's figures: aggregated first, then each split, then each split conditional.
    pub modes: Vec<ModeReport>,
    /// Wall seconds the whole comparison took.
    pub wall_seconds: f64,
}

impl DisaggReport {
    /// The figures of the mode named `name`.
    pub fn mode(&self, name: &str) -> Option<&ModeReport> {
        self.modes.iter().find(|m| m.name == name)
    }

    /// The report as the terminal shows it.
    pub fn table(&self) -> String {
        let gap = self
            .slo_gap_ms
            .map(|g| format!(", longest gap ≤ {g:.0} ms"))
            .unwrap_or_default();
        let mut out = format!(
            "{} on {} GPUs; objectives: TTFT ≤ {:.0} ms, ITL ≤ {:.0} ms{gap}\n\n",
            self.workload, self.workers, self.slo_ttft_ms, self.slo_itl_ms
        );
        out.push_str(&format!(
            "{:<18} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>7} {:>7}\n",
            "mode",
            "TTFT mean",
            "TTFT p99",
            "ITL mean",
            "ITL p99",
            "gap p99",
            "goodput/s",
            "tok/s",
            "hit",
            "whole"
        ));
        for m in &self.modes {
            out.push_str(&format!(
                "{:<18} {:>9.0} {:>9.0} {:>9.1} {:>9.1} {:>9.0} {:>10.2} {:>10.0} {:>7.3} {:>7}\n",
                m.name,
                m.ttft_mean_ms,
                m.ttft_p99_ms,
                m.itl_mean_ms,
                m.itl_p99_ms,
                m.gap_p99_ms,
                m.goodput_rps,
                m.throughput_tok_s,
                m.hit_rate,
                m.served_whole
            ));
        }
        out
    }
}

/// One mode: no split, or a split with conditional disaggregation on or off.
#[derive(Clone, Copy, Debug)]
struct Mode {
    prefill_workers: usize,
    conditional: bool,
}

impl Mode {
    fn name(self, workers: usize) -> String {
        let d = workers - self.prefill_workers;
        match (self.prefill_workers, self.conditional) {
            (0, _) => "aggregated".to_owned(),
            (p, false) => format!("disagg-{p}p{d}d"),
            (p, true) => format!("conditional-{p}p{d}d"),
        }
    }
}

/// Runs `workload` in every mode, `config.threads` at a time; `done` is called as each ends.
pub fn run_disagg(
    workload: &Workload,
    config: &DisaggConfig,
    done: &(dyn Fn(&ModeReport) + Sync),
) -> Result<DisaggReport, DemoError> {
    if workload.is_empty() {
        return Err(DemoError::Empty("the workload has no request"));
    }
    if config.workers < 2 || config.splits.iter().any(|&p| p == 0 || p >= config.workers) {
        return Err(DemoError::Empty(
            "a split needs a prefill and a decode worker: 2 workers or more, splits in 1..workers",
        ));
    }
    let started = Instant::now();
    let mut modes = vec![Mode {
        prefill_workers: 0,
        conditional: false,
    }];
    for conditional in [false, true] {
        for &prefill_workers in &config.splits {
            modes.push(Mode {
                prefill_workers,
                conditional,
            });
        }
    }
    let (slots, ()) = super::parallel::run_each(
        &modes,
        config.threads,
        &|&mode| run_mode(workload, config, mode),
        done,
        || (),
    );
    let mut reports = Vec::with_capacity(slots.len());
    for (slot, mode) in slots.into_iter().zip(&modes) {
        match slot {
            Some(Ok(report)) => reports.push(report),
            Some(Err(source)) => {
                return Err(DemoError::Fleet {
                    policy: if mode.prefill_workers == 0 {
                        "aggregated"
                    } else {
                        "disaggregated"
                    },
                    source,
                })
            }
            None => return Err(DemoError::Empty("a run did not finish")),
        }
    }
    Ok(DisaggReport {
        workload: workload.name().to_owned(),
        slo_ttft_ms: config.slo_ttft_ms,
        slo_itl_ms: config.slo_itl_ms,
        slo_gap_ms: config.slo_gap_ms,
        workers: config.workers,
        modes: reports,
        wall_seconds: started.elapsed().as_secs_f64(),
    })
}

/// One mode's run on a fresh fleet.
fn run_mode(
    workload: &Workload,
    config: &DisaggConfig,
    mode: Mode,
) -> Result<ModeReport, FleetError> {
    let started = Instant::now();
    let split = (mode.prefill_workers > 0).then_some(Split {
        prefill_workers: mode.prefill_workers,
        transfer: config.transfer,
        conditional: mode.conditional.then_some(config.conditional),
    });
    let mut fleet = Fleet::new(FleetConfig {
        workers: config.workers,
        engine: config.engine,
        router: config.router.clone(),
        split,
    })?;
    super::run::play(&mut fleet, workload)?;
    let report = fleet.report();
    let records = fleet.records();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut ttft: Vec<f64> = records
        .iter()
        .filter_map(|r| r.first_token.map(|t| ms(t - r.arrival)))
        .collect();
    ttft.sort_by(f64::total_cmp);
    // A request's mean inter-token latency (none for a single token: it meets any objective).
    let itl = |r: &kvroute_sim::RequestRecord| -> Option<f64> {
        let gaps = r.output_tokens.checked_sub(1).filter(|&g| g > 0)?;
        Some(ms(r.finished? - r.first_token?) / f64::from(gaps))
    };
    let mut itls: Vec<f64> = records.iter().filter_map(itl).collect();
    itls.sort_by(f64::total_cmp);
    let good = records
        .iter()
        .filter(|r| r.finished.is_some())
        .filter(|r| {
            r.first_token
                .is_some_and(|t| ms(t - r.arrival) <= config.slo_ttft_ms)
        })
        .filter(|r| itl(r).is_none_or(|v| v <= config.slo_itl_ms))
        .filter(|r| config.slo_gap_ms.is_none_or(|g| ms(r.longest_gap) <= g))
        .count();
    let mut gaps: Vec<f64> = records
        .iter()
        .filter(|r| r.finished.is_some() && r.output_tokens >= 2)
        .map(|r| ms(r.longest_gap))
        .collect();
    gaps.sort_by(f64::total_cmp);
    let first = records.iter().map(|r| r.arrival).min().unwrap_or_default();
    let last = records.iter().filter_map(|r| r.finished).max();
    let span = last.map_or(0.0, |l| l.saturating_sub(first).as_secs_f64());
    let served_whole = match split {
        Some(_) => records
            .iter()
            .filter(|r| r.prefill_worker.is_none())
            .count(),
        None => 0,
    };
    Ok(ModeReport {
        name: mode.name(config.workers),
        prefill_workers: mode.prefill_workers,
        decode_workers: config.workers - mode.prefill_workers,
        ttft_mean_ms: mean(&ttft),
        ttft_p99_ms: nearest_rank(&ttft, 0.99),
        itl_mean_ms: mean(&itls),
        itl_p99_ms: nearest_rank(&itls, 0.99),
        gap_p99_ms: nearest_rank(&gaps, 0.99),
        goodput_rps: if span > 0.0 { good as f64 / span } else { 0.0 },
        throughput_tok_s: report.throughput,
        hit_rate: report.hit_rate,
        served_whole,
        unfinished: (report.requests - report.finished) + report.active_requests,
        wall_seconds: started.elapsed().as_secs_f64(),
    })
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// The `q` quantile of sorted `values` by nearest rank, 0 when empty.
fn nearest_rank(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let rank = (q * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_default_to_a_quarter_three_eighths_and_half_of_the_fleet() {
        assert_eq!(DisaggConfig::default_splits(8), vec![2, 3, 4]);
        assert_eq!(DisaggConfig::default_splits(16), vec![4, 6, 8]);
        assert_eq!(DisaggConfig::default_splits(2), vec![1]);
        assert_eq!(DisaggConfig::default_splits(3), vec![1]);
    }

    #[test]
    fn modes_are_named_by_their_split() {
        let m = |p, c| Mode {
            prefill_workers: p,
            conditional: c,
        };
        assert_eq!(m(0, false).name(8), "aggregated");
        assert_eq!(m(2, false).name(8), "disagg-2p6d");
        assert_eq!(m(3, true).name(8), "conditional-3p5d");
    }
}
