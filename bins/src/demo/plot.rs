//! The demo's report as an SVG picture: the TTFT distribution and the hit rate of every
//! policy, and how evenly kvroute's and round-robin's choices loaded the workers over time.

use std::path::Path;

use plotters::prelude::*;

use super::{DemoReport, PolicyReport};

/// The picture could not be drawn or written.
#[derive(Debug, thiserror::Error)]
#[error("cannot draw {path}: {reason}")]
pub struct PlotError {
    /// The file asked for.
    pub path: String,
    /// What went wrong.
    pub reason: String,
}

/// Writes `report` as an SVG file of four panels: TTFT CDF per policy (log time axis), hit
/// rate per policy against the oracle and the ceiling, and per-worker active tokens over
/// virtual time under `kv-aware` and under `round-robin` (or the first two policies).
pub fn write_svg(report: &DemoReport, path: &Path) -> Result<(), PlotError> {
    let error = |e: &dyn std::fmt::Display| PlotError {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let root = SVGBackend::new(path, (1400, 1000)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| error(&e))?;
    let (top, bottom) = root.split_vertically(500);
    let (cdf, hits) = top.split_horizontally(700);
    let (left, right) = bottom.split_horizontally(700);
    ttft_cdf(&cdf, report).map_err(|e| error(&e))?;
    hit_rates(&hits, report).map_err(|e| error(&e))?;
    let shown: Vec<(&PolicyReport, Vec<Window>)> = load_policies(report)
        .into_iter()
        .map(|p| (p, windows(p)))
        .collect();
    let peak = shown
        .iter()
        .flat_map(|(_, w)| w.iter().flat_map(|(_, v)| v.iter().copied()))
        .fold(1.0, f64::max);
    for (area, (policy, windows)) in [left, right].iter().zip(&shown) {
        worker_load(area, policy, windows, peak).map_err(|e| error(&e))?;
    }
    root.present().map_err(|e| error(&e))?;
    Ok(())
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;
type DrawResult<'a> =
    Result<(), DrawingAreaErrorKind<<SVGBackend<'a> as DrawingBackend>::ErrorType>>;

fn ttft_cdf<'a>(area: &Area<'a>, report: &DemoReport) -> DrawResult<'a> {
    let all = || {
        report
            .policies
            .iter()
            .flat_map(|p| p.ttft_sorted_ms.iter().copied())
            .filter(|&t| t > 0.0)
    };
    let lo = all().fold(f64::INFINITY, f64::min);
    let hi = all().fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo, hi)
    } else {
        (1.0, 10.0)
    };
    let mut chart = ChartBuilder::on(area)
        .caption("time to first token (CDF)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms, log scale)")
        .y_desc("share of requests")
        .draw()?;
    for (i, p) in report.policies.iter().enumerate() {
        let n = p.ttft_sorted_ms.len().max(1) as f64;
        let color = Palette99::pick(i).to_rgba();
        let step = (p.ttft_sorted_ms.len() / 400).max(1);
        let points = p
            .ttft_sorted_ms
            .iter()
            .enumerate()
            .filter(|&(k, &t)| t > 0.0 && (k % step == 0 || k + 1 == p.ttft_sorted_ms.len()))
            .map(|(k, &t)| (t, (k + 1) as f64 / n));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(p.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()?;
    Ok(())
}

fn hit_rates<'a>(area: &Area<'a>, report: &DemoReport) -> DrawResult<'a> {
    let n = report.policies.len();
    let right = report.policies.iter().map(|p| p.hit_rate).fold(
        report.ceiling_hit_rate.max(report.oracle_hit_rate),
        f64::max,
    ) * 1.1;
    let names: Vec<&str> = report.policies.iter().map(|p| p.name.as_str()).collect();
    let mut chart = ChartBuilder::on(area)
        .caption("prefix hit rate", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(120)
        .build_cartesian_2d(
            0.0..right.max(0.01),
            (0..n.saturating_sub(1)).into_segmented(),
        )?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            // The first policy on top.
            SegmentValue::CenterOf(i) => names
                .get(n.saturating_sub(1 + *i))
                .copied()
                .unwrap_or("")
                .to_owned(),
            _ => String::new(),
        })
        .x_desc("cached prompt tokens ÷ prompt tokens")
        .draw()?;
    chart.draw_series(report.policies.iter().enumerate().map(|(i, p)| {
        let color = Palette99::pick(i).to_rgba();
        let row = n - 1 - i;
        let mut bar = Rectangle::new(
            [
                (0.0, SegmentValue::Exact(row)),
                (p.hit_rate, SegmentValue::Exact(row + 1)),
            ],
            color.filled(),
        );
        bar.set_margin(4, 4, 0, 0);
        bar
    }))?;
    for (value, label, color) in [
        (report.oracle_hit_rate, "oracle", BLACK),
        (report.ceiling_hit_rate, "ceiling", RED),
    ] {
        chart
            .draw_series(LineSeries::new(
                [(value, SegmentValue::Exact(0)), (value, SegmentValue::Last)],
                color.stroke_width(2),
            ))?
            .label(format!("{label} {value:.3}"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()?;
    Ok(())
}

/// `kv-aware` and `round-robin` when both ran, else the first two policies.
fn load_policies(report: &DemoReport) -> Vec<&PolicyReport> {
    match (report.policy("kv-aware"), report.policy("round-robin")) {
        (Some(a), Some(b)) => vec![a, b],
        _ => report.policies.iter().take(2).collect(),
    }
}

/// A window's end time and every worker's mean active tokens in it.
type Window = (f64, Vec<f64>);

/// Windows the load plot averages over, at most this many.
const LOAD_WINDOWS: usize = 120;

/// `p`'s load samples averaged over at most [`LOAD_WINDOWS`] windows of equal length: each
/// window's end time and every worker's mean active tokens in it.
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

fn worker_load<'a>(
    area: &Area<'a>,
    p: &PolicyReport,
    windows: &[Window],
    peak: f64,
) -> DrawResult<'a> {
    let workers = windows.first().map_or(0, |(_, v)| v.len());
    let end = windows.last().map_or(1.0, |(t, _)| *t).max(1e-3);
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!(
                "active tokens per worker: {} (imbalance {:.2})",
                p.name, p.imbalance
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..end, 0.0..peak * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("virtual time (s)")
        .y_desc("tokens held, window mean")
        .y_label_formatter(&|v| format!("{:.0}k", v / 1e3))
        .draw()?;
    for w in 0..workers {
        let color = Palette99::pick(w).to_rgba();
        let points = windows
            .iter()
            .map(|(t, v)| (*t, v.get(w).copied().unwrap_or(0.0)));
        chart.draw_series(LineSeries::new(points, color.stroke_width(1)))?;
    }
    Ok(())
}
