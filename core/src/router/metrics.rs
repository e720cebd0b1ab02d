//! Routing counters, the overhead split ([`Timings`]) and per-request metrics
//! ([`RequestMetrics`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use hdrhistogram::Histogram;

use crossbeam_utils::CachePadded;

use super::{lock, Router};
use crate::approx::ApproxCounts;
use crate::load::{LedgerCounts, RequestId};
use crate::rng::mix64;

/// Overhead split of routing, in nanoseconds per decision (recorded when
/// [`Timing::On`](crate::Timing::On)).
#[derive(Debug, Clone)]
pub struct Timings {
    /// Hashing the prompt into its blocks' hashes.
    pub hash: Histogram<u64>,
    /// From the hashes to each rank's overlap: the request's constraints, its pin and the index
    /// match.
    pub matching: Histogram<u64>,
    /// From the overlaps to the chosen rank: scoring, the busy check and the policy.
    pub select: Histogram<u64>,
}

impl Timings {
    pub(super) fn new() -> Self {
        let h = || Histogram::new(3).unwrap_or_else(|_| unreachable_histogram());
        Timings {
            hash: h(),
            matching: h(),
            select: h(),
        }
    }
}

impl Timings {
    /// Records one decision's split.
    pub(super) fn record(&mut self, hash: u64, matching: u64, select: u64) {
        record(&mut self.hash, hash);
        record(&mut self.matching, matching);
        record(&mut self.select, select);
    }
}

/// Records `v`. The histograms grow to the largest value seen (an allocation only when a new
/// maximum arrives); `saturating_record` alone would clamp every value to the initial range of
/// 1..2, because it never resizes, so it only catches values past the largest trackable.
pub(super) fn record(h: &mut Histogram<u64>, v: u64) {
    if h.record(v).is_err() {
        h.saturating_record(v);
    }
}

/// Records `v` `n` times, growing the histogram as [`record`] does.
pub(super) fn record_n(h: &mut Histogram<u64>, v: u64, n: u64) {
    if h.record_n(v, n).is_err() {
        h.saturating_record_n(v, n);
    }
}

/// `elapsed` over `per` units, in µs, rounded.
pub(super) fn us_per(elapsed: std::time::Duration, per: u64) -> u64 {
    let per_ns = u128::from(per.max(1)) * 1000;
    u64::try_from((elapsed.as_nanos() + per_ns / 2) / per_ns).unwrap_or(u64::MAX)
}

/// A histogram of 3 significant digits sized for values up to `high` (recording within it
/// never allocates) that still grows past it.
pub(super) fn histogram_upto(high: u64) -> Histogram<u64> {
    match Histogram::new_with_bounds(1, high, 3) {
        Ok(mut h) => {
            h.auto(true);
            h
        }
        Err(_) => unreachable_histogram(),
    }
}

#[allow(
    clippy::expect_used,
    reason = "a histogram's constructors fail only for more than 5 significant digits"
)]
pub(super) fn unreachable_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 2, 0).expect("a minimal histogram is always valid")
}

/// Per-request metrics of the requests that reached a worker (see the module comment for
/// what each histogram holds and when it is recorded). Histograms of 3 significant digits,
/// sized up front (TTFT and ITL to 2^26 µs ≈ 67 s, ISL to 2^20 tokens, OSL to 2^16 blocks),
/// so that recording allocates only for a value past those; about 440 KB per shard (four
/// shards). Read them directly, or print [`RequestMetrics::quantiles`] / the `Display` table.
#[derive(Debug, Clone)]
pub struct RequestMetrics {
    /// Time to first token, µs.
    pub ttft_us: Histogram<u64>,
    /// Inter-token latency, µs per token, one sample per output block boundary.
    pub itl_us: Histogram<u64>,
    /// Input sequence length, prompt tokens.
    pub isl_tokens: Histogram<u64>,
    /// Output sequence length, output blocks.
    pub osl_blocks: Histogram<u64>,
    /// Predicted KV hit rate, basis points (10,000 = the whole prompt cached).
    pub kv_hit_bp: Histogram<u64>,
}

/// The usual summary of one histogram.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Quantiles {
    /// Samples recorded.
    pub count: u64,
    /// Their mean.
    pub mean: f64,
    /// The median.
    pub p50: u64,
    /// The 90th percentile.
    pub p90: u64,
    /// The 99th percentile.
    pub p99: u64,
    /// The largest sample.
    pub max: u64,
}

impl Quantiles {
    /// The summary of `h` (all zero when empty).
    pub fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Quantiles {
                count: 0,
                mean: 0.0,
                p50: 0,
                p90: 0,
                p99: 0,
                max: 0,
            };
        }
        Quantiles {
            count: h.len(),
            mean: h.mean(),
            p50: h.value_at_quantile(0.5),
            p90: h.value_at_quantile(0.9),
            p99: h.value_at_quantile(0.99),
            max: h.max(),
        }
    }
}

impl RequestMetrics {
    pub(super) fn new() -> Self {
        RequestMetrics {
            ttft_us: histogram_upto(1 << 26),
            itl_us: histogram_upto(1 << 26),
            isl_tokens: histogram_upto(1 << 20),
            osl_blocks: histogram_upto(1 << 16),
            kv_hit_bp: histogram_upto(10_000),
        }
    }

    pub(super) fn each_mut(&mut self) -> [&mut Histogram<u64>; 5] {
        [
            &mut self.ttft_us,
            &mut self.itl_us,
            &mut self.isl_tokens,
            &mut self.osl_blocks,
            &mut self.kv_hit_bp,
        ]
    }

    /// Adds `other`'s samples to these.
    pub fn merge(&mut self, other: &RequestMetrics) {
        let theirs = [
            &other.ttft_us,
            &other.itl_us,
            &other.isl_tokens,
            &other.osl_blocks,
            &other.kv_hit_bp,
        ];
        for (h, o) in self.each_mut().into_iter().zip(theirs) {
            if h.add(o).is_err() {
                // Only a histogram that cannot resize refuses an addend; keep every sample,
                // clamped to its range.
                for v in o.iter_recorded() {
                    for _ in 0..v.count_at_value() {
                        h.saturating_record(v.value_iterated_to());
                    }
                }
            }
        }
    }

    /// Each histogram's name (with its unit) and summary, in declaration order.
    pub fn quantiles(&self) -> [(&'static str, Quantiles); 5] {
        [
            ("ttft_us", Quantiles::of(&self.ttft_us)),
            ("itl_us_per_token", Quantiles::of(&self.itl_us)),
            ("isl_tokens", Quantiles::of(&self.isl_tokens)),
            ("osl_blocks", Quantiles::of(&self.osl_blocks)),
            ("kv_hit_bp", Quantiles::of(&self.kv_hit_bp)),
        ]
    }
}

impl std::fmt::Display for RequestMetrics {
    /// One line per metric: `name count mean p50 p90 p99 max`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<17} {:>8} {:>10} {:>8} {:>8} {:>8} {:>8}",
            "metric", "count", "mean", "p50", "p90", "p99", "max"
        )?;
        for (name, q) in self.quantiles() {
            writeln!(
                f,
                "{:<17} {:>8} {:>10.1} {:>8} {:>8} {:>8} {:>8}",
                name, q.count, q.mean, q.p50, q.p90, q.p99, q.max
            )?;
        }
        Ok(())
    }
}

/// Request metrics, sharded by request id so that lifecycle calls on different requests
/// rarely meet on one lock.
pub(super) struct MetricsShards {
    pub(super) shards: [CachePadded<Mutex<RequestMetrics>>; Self::SHARDS],
}

impl MetricsShards {
    const SHARDS: usize = 4;

    pub(super) fn new() -> Self {
        MetricsShards {
            shards: std::array::from_fn(|_| CachePadded::new(Mutex::new(RequestMetrics::new()))),
        }
    }

    pub(super) fn shard(&self, request: RequestId) -> MutexGuard<'_, RequestMetrics> {
        lock(&self.shards[(mix64(request.0) >> 62) as usize % Self::SHARDS])
    }

    pub(super) fn snapshot(&self) -> RequestMetrics {
        let mut all = RequestMetrics::new();
        for s in &self.shards {
            all.merge(&lock(s));
        }
        all
    }
}

/// Routing counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouterCounts {
    /// Decisions booked.
    pub routed: u64,
    /// Decisions made without booking ([`Mode::QueryOnly`](crate::Mode::QueryOnly)).
    pub query_only: u64,
    /// Decisions pinned to a multi-rank worker without a usable dp rank, dispatched without
    /// bookkeeping
    /// ([`Bookkeeping::UntrackedDpRankUnresolved`](crate::Bookkeeping::UntrackedDpRankUnresolved)).
    pub untracked: u64,
    /// Decisions that found every eligible rank busy and took the least loaded
    /// ([`DecidedBy::FallbackAllBusy`](crate::DecidedBy::FallbackAllBusy)).
    pub all_busy: u64,
    /// Prefill-phase requests served by aggregated workers, or by decode workers in a fleet
    /// without aggregated ones (no prefill worker joined).
    pub prefill_fallbacks: u64,
    /// Whole requests served by a decode worker: the fleet has no aggregated worker
    /// ([`Fallback::AggregatedToDecode`](crate::Fallback::AggregatedToDecode)).
    pub whole_on_decode: u64,
    /// Ranks probed for prompt blocks already active on them.
    pub shared_probes: u64,
    /// Probes skipped because the rank's table was held by another thread.
    pub shared_probes_busy: u64,
    /// Requests refused for having no tokens
    /// ([`RouteError::NoTokens`](crate::RouteError::NoTokens)).
    pub no_tokens: u64,
    /// Requests refused before enough workers joined
    /// ([`RouteError::NotReady`](crate::RouteError::NotReady)).
    pub not_ready: u64,
    /// Requests left with no candidate rank
    /// ([`RouteError::NoWorkers`](crate::RouteError::NoWorkers)).
    pub no_workers: u64,
    /// Requests pinned to a worker that has not joined
    /// ([`RouteError::UnknownWorker`](crate::RouteError::UnknownWorker)).
    pub unknown_worker: u64,
    /// Requests pinned to a worker outside their allowed set
    /// ([`RouteError::PinnedNotAllowed`](crate::RouteError::PinnedNotAllowed)).
    pub pinned_not_allowed: u64,
    /// Requests freed after reaching a worker (marked dispatched, by id or by their guard).
    pub completed: u64,
    /// Requests rejected for a bad hint
    /// ([`RouteError::InvalidHint`](crate::RouteError::InvalidHint)).
    pub invalid_hints: u64,
    /// Submits of an id already queued, released and untaken, or booked (one that finds a free
    /// rank at once meets the ledger's own duplicate check instead).
    pub duplicate_admissions: u64,
    /// Candidates left out because their worker was marked unreachable (one per request per
    /// rank).
    pub vetoed_unreachable: u64,
    /// The same for workers marked wedged.
    pub vetoed_wedged: u64,
    /// Requests whose every candidate was marked
    /// ([`DecidedBy::FallbackAllUnhealthy`](crate::DecidedBy::FallbackAllUnhealthy)).
    pub all_unhealthy: u64,
    /// Requests no worker carried the required labels of
    /// ([`RouteError::NoEligibleWorker`](crate::RouteError::NoEligibleWorker) and
    /// [`RouteError::PinnedLacksLabels`](crate::RouteError::PinnedLacksLabels)).
    pub no_eligible: u64,
    /// Sessions bound at their first booked request.
    pub sessions_bound: u64,
    /// Session requests whose bound rank had gone (or could not serve): chosen afresh.
    pub sessions_rerouted: u64,
    /// Sessions ended for idling past their TTL
    /// ([`SessionEndReason::Expired`](crate::SessionEndReason::Expired)).
    pub sessions_expired: u64,
    /// Sessions closed after their request or by [`Router::close_session`]
    /// ([`SessionEndReason::Closed`](crate::SessionEndReason::Closed)).
    pub sessions_closed: u64,
    /// Routes where the router's own cache records raised some rank's overlap.
    pub approx_raised: u64,
    /// Cache misses sent to a warming worker ([`DecidedBy::WarmUp`](crate::DecidedBy::WarmUp)).
    pub warm_up: u64,
    /// Ranks put back to warming because their reported cache fell far below the fleet's.
    pub rewarmed: u64,
    /// Requests whose shared-pool answer failed (no answer, or a malformed one) and was
    /// ignored.
    pub pool_failed: u64,
    /// The record table's counters.
    pub approx: ApproxCounts,
    /// The ledger's lifecycle counters.
    pub ledger: LedgerCounts,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) routed: AtomicU64,
    pub(super) query_only: AtomicU64,
    pub(super) untracked: AtomicU64,
    pub(super) all_busy: AtomicU64,
    pub(super) prefill_fallbacks: AtomicU64,
    pub(super) whole_on_decode: AtomicU64,
    pub(super) shared_probes: AtomicU64,
    pub(super) shared_probes_busy: AtomicU64,
    pub(super) no_tokens: AtomicU64,
    pub(super) not_ready: AtomicU64,
    pub(super) no_workers: AtomicU64,
    pub(super) unknown_worker: AtomicU64,
    pub(super) pinned_not_allowed: AtomicU64,
    pub(super) completed: AtomicU64,
    pub(super) invalid_hints: AtomicU64,
    pub(super) duplicate_admissions: AtomicU64,
    pub(super) vetoed_unreachable: AtomicU64,
    pub(super) vetoed_wedged: AtomicU64,
    pub(super) all_unhealthy: AtomicU64,
    pub(super) no_eligible: AtomicU64,
    pub(super) sessions_bound: AtomicU64,
    pub(super) sessions_rerouted: AtomicU64,
    pub(super) sessions_expired: AtomicU64,
    pub(super) sessions_closed: AtomicU64,
    pub(super) approx_raised: AtomicU64,
    pub(super) warm_up: AtomicU64,
    pub(super) rewarmed: AtomicU64,
    pub(super) pool_failed: AtomicU64,
}

pub(super) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Router {
    /// Counters.
    pub fn counts(&self) -> RouterCounts {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let c = &self.counters;
        RouterCounts {
            routed: r(&c.routed),
            query_only: r(&c.query_only),
            untracked: r(&c.untracked),
            all_busy: r(&c.all_busy),
            prefill_fallbacks: r(&c.prefill_fallbacks),
            whole_on_decode: r(&c.whole_on_decode),
            shared_probes: r(&c.shared_probes),
            shared_probes_busy: r(&c.shared_probes_busy),
            no_tokens: r(&c.no_tokens),
            not_ready: r(&c.not_ready),
            no_workers: r(&c.no_workers),
            unknown_worker: r(&c.unknown_worker),
            pinned_not_allowed: r(&c.pinned_not_allowed),
            completed: r(&c.completed),
            invalid_hints: r(&c.invalid_hints),
            duplicate_admissions: r(&c.duplicate_admissions),
            vetoed_unreachable: r(&c.vetoed_unreachable),
            vetoed_wedged: r(&c.vetoed_wedged),
            all_unhealthy: r(&c.all_unhealthy),
            no_eligible: r(&c.no_eligible),
            sessions_bound: r(&c.sessions_bound),
            sessions_rerouted: r(&c.sessions_rerouted),
            sessions_expired: r(&c.sessions_expired),
            sessions_closed: r(&c.sessions_closed),
            approx_raised: r(&c.approx_raised),
            warm_up: r(&c.warm_up),
            rewarmed: r(&c.rewarmed),
            pool_failed: r(&c.pool_failed),
            approx: self.approx.counts(),
            ledger: self.ledger.counts(),
        }
    }

    /// A copy of the overhead histograms (`None` unless [`Timing::On`](crate::Timing::On)).
    pub fn timings(&self) -> Option<Timings> {
        self.timings.as_ref().map(|t| lock(t).clone())
    }

    /// A merged copy of the request metrics (`None` unless [`Metrics::On`](crate::Metrics::On)).
    pub fn request_metrics(&self) -> Option<RequestMetrics> {
        self.metrics.as_ref().map(MetricsShards::snapshot)
    }
}
