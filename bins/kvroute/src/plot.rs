//! Runs compared in one SVG picture: the TTFT distribution and the hit rate of every run, and
//! how evenly two of them loaded the workers over time. The demo draws its policies
//! (`demo::write_svg`), replay its run beside earlier ones (`replay --plot`).

use std::path::Path;

use plotters::prelude::*;

/// One run: a policy of the demo, or a replay against a router.
#[derive(Clone, Debug)]
pub struct Run<'a> {
    /// Its label.
    pub name: &'a str,
    /// Its requests' times to first token, ms, ascending.
    pub ttft_sorted_ms: &'a [f64],
    /// Cached prompt tokens ÷ prompt tokens.
    pub hit_rate: f64,
}

/// How one run loaded the workers: each window's end time and every worker's mean active
/// tokens in it.
#[derive(Clone, Debug)]
pub struct Load<'a> {
    /// The run's label.
    pub name: &'a str,
    /// Its load imbalance.
    pub imbalance: f64,
    /// (window end, per-worker mean tokens), in time order.
    pub windows: Vec<Window>,
}

/// A window's end time and every worker's mean active tokens in it.
pub type Window = (f64, Vec<f64>);

/// What the picture shows.
#[derive(Clone, Debug)]
pub struct Picture<'a> {
    /// The runs, in the legend's order.
    pub runs: Vec<Run<'a>>,
    /// Hit rates drawn as vertical lines on the hit-rate panel (the oracle, the ceiling).
    pub marks: Vec<(&'static str, f64)>,
    /// Up to two runs' load over time (none: the bottom panels stay empty).
    pub loads: Vec<Load<'a>>,
    /// The load panels' time axis (`"virtual time (s)"`, `"wall time (s)"`).
    pub time_axis: &'static str,
}

/// The picture could not be drawn or written.
#[derive(Debug, thiserror::Error)]
#[error("cannot draw {path}: {reason}")]
pub struct PlotError {
    /// The file asked for.
    pub path: String,
    /// What went wrong.
    pub reason: String,
}

/// Writes `picture` as an SVG file of four panels: TTFT CDF per run (log time axis), hit rate
/// per run against the marks, and per-worker active tokens over time for up to two runs.
pub fn write_svg(picture: &Picture<'_>, path: &Path) -> Result<(), PlotError> {
    let error = |e: &dyn std::fmt::Display| PlotError {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let root = SVGBackend::new(path, (1400, 1000)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| error(&e))?;
    let (top, bottom) = root.split_vertically(500);
    let (cdf, hits) = top.split_horizontally(700);
    let (left, right) = bottom.split_horizontally(700);
    ttft_cdf(&cdf, &picture.runs).map_err(|e| error(&e))?;
    hit_rates(&hits, picture).map_err(|e| error(&e))?;
    let peak = picture
        .loads
        .iter()
        .flat_map(|l| l.windows.iter().flat_map(|(_, v)| v.iter().copied()))
        .fold(1.0, f64::max);
    for (area, load) in [left, right].iter().zip(&picture.loads) {
        worker_load(area, load, peak, picture.time_axis).map_err(|e| error(&e))?;
    }
    root.present().map_err(|e| error(&e))?;
    Ok(())
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;
type DrawResult<'a> =
    Result<(), DrawingAreaErrorKind<<SVGBackend<'a> as DrawingBackend>::ErrorType>>;

fn ttft_cdf<'a>(area: &Area<'a>, runs: &[Run<'_>]) -> DrawResult<'a> {
    let all = || {
        runs.iter()
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
    for (i, p) in runs.iter().enumerate() {
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
            .label(p.name)
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

fn hit_rates<'a>(area: &Area<'a>, picture: &Picture<'_>) -> DrawResult<'a> {
    let runs = &picture.runs;
    let n = runs.len();
    let right = runs
        .iter()
        .map(|p| p.hit_rate)
        .chain(picture.marks.iter().map(|&(_, v)| v))
        .fold(0.0, f64::max)
        * 1.1;
    let names: Vec<&str> = runs.iter().map(|p| p.name).collect();
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
    chart.draw_series(runs.iter().enumerate().map(|(i, p)| {
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
    for (k, &(label, value)) in picture.marks.iter().enumerate() {
        let color = [BLACK, RED, BLUE][k % 3];
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

fn worker_load<'a>(area: &Area<'a>, p: &Load<'_>, peak: f64, time_axis: &str) -> DrawResult<'a> {
    let windows = &p.windows;
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
        .x_desc(time_axis)
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
