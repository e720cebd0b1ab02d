//! `kvroute demo --replicas N`: the same fleet and workload routed by one router, then by N
//! routers (`kvroute serve` replicas behind a load balancer that hands them arrivals in turn),
//! their bookings told to each other after each delay asked, or never.
//!
//! ```text
//!  Workload ──▶ for each mode (threads): Fleet::with_replicas(1 | N, sync) ──▶ ReplicaMode
//!                 1 router, N replicas sync off, N replicas delay D ms     ReplicaReport ──▶ table, JSON
//! ```
//!
//! Every router sees every engine's KV events, so without the sync the replicas agree on the
//! caches but each counts only its own bookings: they send the same hot prefixes to the same
//! workers (herding), which the imbalance and the time to first token show against one router.

use std::fmt::Write;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::run::{run_replicated, PolicyReport};
use super::table::{aligned, ratio};
use super::{DemoConfig, DemoError, DemoPolicy};
use kvroute_sim::workload::Workload;
use kvroute_sim::{BookingSync, Replicas};

/// How the comparison runs.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    /// The fleet, its engines, the router's settings and the threads (`policies` is not read).
    pub demo: DemoConfig,
    /// The policy every router runs: one of the router's own.
    pub policy: DemoPolicy,
    /// Routers in the replicated modes, at least 2.
    pub replicas: usize,
    /// One replicated mode per entry: how the routers' bookings reach each other.
    pub syncs: Vec<BookingSync>,
    /// The replicas' near-tie share (`RouterConfig::near_tie`); one router keeps the
    /// configured one.
    pub near_tie: f64,
}

/// One mode's figures (the JSON report's `modes` entries): the policy's figures, flattened,
/// beside the mode's.
#[derive(Clone, Debug, Serialize)]
pub struct ReplicaMode {
    /// `1 router`, `N replicas, sync off` or `N replicas, delay D ms`.
    pub mode: String,
    /// Routers.
    pub replicas: usize,
    /// Whether the routers told each other their bookings.
    pub sync: bool,
    /// How late they learnt of each other's bookings, ms (none: one router, or no sync).
    pub delay_ms: Option<f64>,
    /// Hit rate ÷ one router's.
    pub hit_rate_vs_one: f64,
    /// Mean time to first token ÷ one router's.
    pub ttft_mean_vs_one: f64,
    /// Booking changes a router refused as about a booking it did not hold (0 here: they
    /// arrive in order).
    pub refused_bookings: u64,
    /// The run's figures (`name`: the policy).
    #[serde(flatten)]
    pub figures: PolicyReport,
}

/// The comparison, as `--json` writes it.
#[derive(Clone, Debug, Serialize)]
pub struct ReplicaReport {
    /// The workload's name.
    pub workload: String,
    /// Requests in it.
    pub requests: usize,
    /// Arrivals came this many times sooner than the workload's own times.
    pub speedup: f64,
    /// Simulated workers.
    pub workers: usize,
    /// The policy every router ran.
    pub policy: String,
    /// Routers in the replicated modes.
    pub replicas: usize,
    /// One router first, then each sync asked.
    pub modes: Vec<ReplicaMode>,
    /// Wall seconds the whole comparison took.
    pub wall_seconds: f64,
}

impl ReplicaReport {
    /// The figures of the mode named `name`.
    pub fn mode(&self, name: &str) -> Option<&ReplicaMode> {
        self.modes.iter().find(|m| m.mode == name)
    }

    /// The report as the terminal shows it.
    pub fn table(&self) -> String {
        let mut rows = vec![[
            "mode",
            "hit rate",
            "× 1 router",
            "TTFT mean",
            "× 1 router",
            "TTFT p99",
            "ITL mean",
            "imbalance",
        ]
        .map(str::to_owned)];
        for m in &self.modes {
            let f = &m.figures;
            rows.push([
                m.mode.clone(),
                format!("{:.3}", f.hit_rate),
                format!("{:.3}", m.hit_rate_vs_one),
                format!("{:.0} ms", f.ttft_mean_ms),
                format!("{:.3}", m.ttft_mean_vs_one),
                format!("{:.0} ms", f.ttft_p99_ms),
                format!("{:.1} ms", f.itl_mean_ms),
                format!("{:.2}", f.imbalance),
            ]);
        }
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{}: {} requests, {} workers, arrivals ×{}, {}; replicas take arrivals in turn",
            self.workload, self.requests, self.workers, self.speedup, self.policy
        );
        out.push_str(&aligned(&rows));
        let _ = writeln!(
            out,
            "× 1 router: the figure ÷ one router's. imbalance: the busiest worker's active \
             tokens ÷ the mean worker's, averaged over time. {:.1} s in all.",
            self.wall_seconds
        );
        out
    }
}

/// A `--replica-delay-ms` entry that is neither a delay nor `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("replica delay {0:?}: milliseconds (0 or more), or `off` for no sync")]
pub struct UnknownSync(pub String);

/// A booking sync by the name users type: `off`, or a delay in milliseconds (`0`: at once).
pub fn parse_booking_sync(s: &str) -> Result<BookingSync, UnknownSync> {
    let s = s.trim();
    if s == "off" {
        return Ok(BookingSync::Off);
    }
    match s.parse::<f64>() {
        Ok(ms) if ms.is_finite() && ms >= 0.0 => {
            Ok(BookingSync::After(Duration::from_secs_f64(ms / 1e3)))
        }
        _ => Err(UnknownSync(s.to_owned())),
    }
}

/// `d` in milliseconds, from whole nanoseconds (so that a delay typed in prints back as typed).
fn ms(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e6
}

/// The mode's name in the table.
fn mode_name(replicas: Replicas) -> String {
    match (replicas.count, replicas.sync) {
        (1, _) => "1 router".to_owned(),
        (n, BookingSync::Off) => format!("{n} replicas, sync off"),
        (n, BookingSync::After(d)) => format!("{n} replicas, delay {} ms", ms(d)),
    }
}

/// Runs `workload` with one router and then with `config.replicas` at each sync,
/// `config.demo.threads` runs at a time; `done` is called as each ends (its ratios to one
/// router are set once every run has ended).
pub fn run_replicas(
    workload: &Workload,
    config: &ReplicaConfig,
    done: &(dyn Fn(&ReplicaMode) + Sync),
) -> Result<ReplicaReport, DemoError> {
    if workload.is_empty() {
        return Err(DemoError::Empty("the workload has no request"));
    }
    if config.replicas < 2 || config.syncs.is_empty() {
        return Err(DemoError::Empty(
            "replicas compare one router with 2 or more, at one sync or more",
        ));
    }
    let started = Instant::now();
    let mut modes = vec![Replicas::ONE];
    modes.extend(config.syncs.iter().map(|&sync| Replicas {
        count: config.replicas,
        sync,
    }));
    let policy = config.policy;
    let mut replicated = config.demo.clone();
    replicated.router.near_tie = config.near_tie;
    let (slots, ()) = super::parallel::run_each(
        &modes,
        config.demo.threads,
        &|&replicas| {
            let demo = if replicas.count > 1 {
                &replicated
            } else {
                &config.demo
            };
            let (figures, refused) =
                run_replicated(workload, demo, policy, replicas).map_err(|source| {
                    DemoError::Fleet {
                        policy: policy.name(),
                        source,
                    }
                })?;
            Ok(ReplicaMode {
                mode: mode_name(replicas),
                replicas: replicas.count,
                sync: replicas.count > 1 && replicas.sync != BookingSync::Off,
                delay_ms: match replicas.sync {
                    BookingSync::After(d) if replicas.count > 1 => Some(ms(d)),
                    _ => None,
                },
                hit_rate_vs_one: 0.0,
                ttft_mean_vs_one: 0.0,
                refused_bookings: refused,
                figures,
            })
        },
        done,
        || (),
    );
    let mut reports = Vec::with_capacity(slots.len());
    for slot in slots {
        match slot {
            Some(result) => reports.push(result?),
            None => return Err(DemoError::Empty("a run did not finish")),
        }
    }
    let (one_hit, one_ttft) = reports
        .first()
        .map_or((0.0, 0.0), |m| (m.figures.hit_rate, m.figures.ttft_mean_ms));
    for m in &mut reports {
        m.hit_rate_vs_one = ratio(m.figures.hit_rate, one_hit);
        m.ttft_mean_vs_one = ratio(m.figures.ttft_mean_ms, one_ttft);
    }
    Ok(ReplicaReport {
        workload: workload.name().to_owned(),
        requests: workload.len(),
        speedup: workload.speedup(),
        workers: config.demo.workers,
        policy: policy.name().to_owned(),
        replicas: config.replicas,
        modes: reports,
        wall_seconds: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syncs_parse_from_a_delay_in_ms_or_off() {
        assert_eq!(parse_booking_sync("off"), Ok(BookingSync::Off));
        assert_eq!(
            parse_booking_sync("0"),
            Ok(BookingSync::After(Duration::ZERO))
        );
        assert_eq!(
            parse_booking_sync(" 2.5"),
            Ok(BookingSync::After(Duration::from_micros(2_500)))
        );
        for bad in ["-1", "never", "", "inf", "NaN"] {
            assert!(parse_booking_sync(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn modes_are_named_by_their_routers_and_sync() {
        let r = |count, sync| mode_name(Replicas { count, sync });
        assert_eq!(r(1, BookingSync::Off), "1 router");
        assert_eq!(r(3, BookingSync::Off), "3 replicas, sync off");
        assert_eq!(
            r(3, BookingSync::After(Duration::ZERO)),
            "3 replicas, delay 0 ms"
        );
        assert_eq!(
            r(3, BookingSync::After(Duration::from_millis(10))),
            "3 replicas, delay 10 ms"
        );
    }
}
