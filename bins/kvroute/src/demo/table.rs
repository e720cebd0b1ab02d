//! The demo's report as the terminal shows it: one row per policy, then the ceilings; and
//! the aligned columns the other demo tables are drawn in too.

use std::fmt::Write;

use super::DemoReport;

const HEADER: [&str; 11] = [
    "policy",
    "hit rate",
    "of oracle",
    "TTFT mean",
    "TTFT p99",
    "ITL mean",
    "worst ITL p99",
    "tok/s",
    "imbalance",
    "predicted",
    "route p99",
];

/// Renders `report` as an aligned text table.
pub(super) fn render(report: &DemoReport) -> String {
    let mut rows: Vec<[String; 11]> = vec![HEADER.map(str::to_owned)];
    for p in &report.policies {
        rows.push([
            p.name.clone(),
            format!("{:.3}", p.hit_rate),
            format!("{:.2}", ratio(p.hit_rate, report.oracle_hit_rate)),
            format!("{:.0} ms", p.ttft_mean_ms),
            format!("{:.0} ms", p.ttft_p99_ms),
            format!("{:.1} ms", p.itl_mean_ms),
            format!("{:.1} ms", p.worst_worker_itl_p99_ms),
            format!("{:.0}", p.throughput_tok_s),
            format!("{:.2}", p.imbalance),
            format!("{:.1}%", p.prediction_accuracy * 100.0),
            format!("{:.1} µs", p.route_p99_us),
        ]);
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} requests, {:.1}M prompt tokens, {} workers × {} blocks of {} tokens, arrivals ×{}",
        report.workload,
        report.requests,
        report.prompt_tokens as f64 / 1e6,
        report.workers,
        report.kv_blocks,
        report.block_size,
        report.speedup
    );
    out.push_str(&aligned(&rows));
    let _ = writeln!(
        out,
        "ceiling (one infinite cache shared by all workers): hit rate {:.3}",
        report.ceiling_hit_rate
    );
    let _ = writeln!(
        out,
        "fleet-sized LRU (one LRU cache of {} × {} blocks, no block cached twice): \
         hit rate {:.3}",
        report.workers, report.kv_blocks, report.fleet_lru_hit_rate
    );
    let _ = writeln!(
        out,
        "oracle (the best cache any worker held at each arrival, best run): hit rate {:.3}",
        report.oracle_hit_rate
    );
    let _ = writeln!(
        out,
        "worst ITL p99: the slowest-decoding worker's p99 of its requests' mean inter-token \
         latency; predicted: decisions whose predicted cached tokens equal the engine's; route: \
         wall time of one decision. {:.1} s in all.",
        report.wall_seconds
    );
    out
}

/// `rows` as aligned text: the first (the header) underlined, the first column to the left,
/// the others to the right.
pub(super) fn aligned<const N: usize>(rows: &[[String; N]]) -> String {
    let mut widths = [0usize; N];
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for (r, row) in rows.iter().enumerate() {
        let mut line = String::new();
        for (c, (cell, w)) in row.iter().zip(widths).enumerate() {
            let pad = w - cell.chars().count();
            if c == 0 {
                let _ = write!(line, "{cell}{}", " ".repeat(pad));
            } else {
                let _ = write!(line, "  {}{cell}", " ".repeat(pad));
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
        if r == 0 {
            let total = widths.iter().sum::<usize>() + 2 * (N - 1);
            let _ = writeln!(out, "{}", "-".repeat(total));
        }
    }
    out
}

/// `a ÷ b`, 0 when `b` is 0.
pub(super) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}
