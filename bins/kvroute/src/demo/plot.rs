//! The demo's report as a picture (`crate::plot`): every policy's TTFT distribution and hit
//! rate against the oracle and the ceiling, and the workers' load over virtual time under
//! `kv-aware` and `round-robin`.

use std::path::Path;

use super::{DemoReport, PolicyReport};
use crate::plot::{Load, Picture, PlotError, Run, Window};

/// Windows the load panels average over, at most this many.
const LOAD_WINDOWS: usize = 120;

/// Writes `report` as an SVG file (see [`crate::plot::write_svg`]).
pub fn write_svg(report: &DemoReport, path: &Path) -> Result<(), PlotError> {
    let picture = Picture {
        runs: report
            .policies
            .iter()
            .map(|p| Run {
                name: &p.name,
                ttft_sorted_ms: &p.ttft_sorted_ms,
                hit_rate: p.hit_rate,
            })
            .collect(),
        marks: vec![
            ("oracle", report.oracle_hit_rate),
            ("ceiling", report.ceiling_hit_rate),
        ],
        loads: load_policies(report)
            .into_iter()
            .map(|p| Load {
                name: &p.name,
                imbalance: p.imbalance,
                windows: windows(p),
            })
            .collect(),
        time_axis: "virtual time (s)",
    };
    crate::plot::write_svg(&picture, path)
}

/// `kv-aware` and `round-robin` when both ran, else the first two policies.
fn load_policies(report: &DemoReport) -> Vec<&PolicyReport> {
    match (report.policy("kv-aware"), report.policy("round-robin")) {
        (Some(a), Some(b)) => vec![a, b],
        _ => report.policies.iter().take(2).collect(),
    }
}

/// `p`'s load samples averaged over at most [`LOAD_WINDOWS`] windows of equal length.
fn windows(p: &PolicyReport) -> Vec<Window> {
    let samples = &p.load.samples;
    let every = p.load.every.as_secs_f64();
    let per = samples.len().div_ceil(LOAD_WINDOWS).max(1);
    samples
        .chunks(per)
        .enumerate()
        .map(|(i, chunk)| {
            let workers = chunk.first().map_or(0, Vec::len);
            let mean = (0..workers)
                .map(|w| chunk.iter().map(|s| s[w] as f64).sum::<f64>() / chunk.len() as f64)
                .collect();
            (((i * per) + chunk.len()) as f64 * every, mean)
        })
        .collect()
}
