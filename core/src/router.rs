//! The router facade: `route(request) -> Decision`, and the calls that keep load true for the
//! rest of the request's life.
//!
//! ```text
//!   route(&RouteRequest)
//!     1. hash      tokens ──BlockHasher(seed: LoRA, salt)──▶ LocalHash[]        (thread scratch)
//!     2. match     IndexReader::find_matches_into ──▶ overlap per rank, per tier (lock-free)
//!     3. select    Fleet snapshot × load counters ──▶ candidates ──Selector──▶ rank
//!     4. book      Ledger: prefill tokens, distinct prompt blocks, one request
//!   mark_dispatched / prefill_done / output_block / free
//!                                        by request id, or through a RequestGuard whose
//!                                        drop frees exactly once
//! ```
//!
//! **Under load and churn.** [`Router::submit`] admits through the admission queue
//! ([`crate::queue`]) when every eligible rank is busy; health marks ([`Router::set_health`])
//! steer around workers; required and preferred labels ([`RouteHints::required`],
//! [`RouteHints::preferred`]) constrain and bias the choice; a session id
//! ([`RouteHints::session`], [`crate::session`]) sticks to its rank; the router's own records
//! ([`crate::approx`]) stand in for the KV events of workers that publish none; warming workers
//! ([`crate::config::WarmUp`]) take a share of cache misses; and a shared pool's hits
//! ([`RouteHints::pool`]) earn credit beyond a worker's own overlap.
//!
//! **Phases.** A prefill-phase request goes to prefill workers; when none has joined it falls
//! back to aggregated workers (reported as [`Fallback::PrefillToAggregated`]) unless the config
//! enforces disaggregation ([`Disaggregation::Enforced`]).
//!
//! **Request metrics** ([`Metrics::On`]; [`Router::request_metrics`]) are recorded only for
//! requests marked as having reached their worker ([`Router::mark_dispatched`], or the guard's
//! [`RequestGuard::mark_dispatched`]) and only through the calls that follow:
//!
//! | metric | unit | recorded |
//! |---|---|---|
//! | TTFT | µs | at the first `prefill_done`: time since the route booked the request |
//! | ITL | µs per token | at each `output_block`: time since the previous token event (the first token or the previous block boundary), over the tokens generated in between (a block's worth, or for the first block the tokens after the first one up to the boundary; a boundary at the first token itself gives no sample) |
//! | ISL | tokens | at `free`: prompt tokens |
//! | OSL | blocks | at `free`: output blocks generated (the router sees block boundaries, not tokens) |
//! | KV hit rate | basis points | at `free`: 10,000 × predicted cached tokens / prompt tokens |
//!
//! Requests that expire or lose their worker record nothing at their end. With metrics off
//! the lifecycle calls read no clock; routing reads one only to stamp a booking (for expiry),
//! as before, metrics on or off.
//!
//! The router is driven entirely by calls and is `Sync`: route from any number of threads.
//! Per-thread scratch buffers make a steady-state `route` allocation-free (the full evidence
//! record, opt-in, allocates). It owns the prefix index's single writer behind a mutex
//! ([`Router::apply_event`]) and hands out lock-free readers.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use hdrhistogram::Histogram;

use crossbeam_utils::CachePadded;

use crate::approx::{checkpoint_keys_extend, ApproxCache, ApproxCounts};
use crate::config::{
    ConfigError, Disaggregation, Metrics, Queueing, RouterConfig, Speculative, Timing, WarmUp,
};
use crate::event::{
    BlockHash, DpRank, EventHeader, KvEvent, StorageTier, StoredBlock, WorkerId, WorkerRank,
};
use crate::hash::{BlockHasher, HashSeed, LocalHash};
use crate::health::Health;
use crate::index::{IndexError, IndexReader, MatchOptions, PrefixIndex, RankDepths, RankKey};
pub use crate::load::Dispatch;
use crate::load::{
    prefix_keys_into, BookingSpec, Freed, Generated, Ledger, LedgerCounts, LoadError, LoadView,
    RankState, RequestId, Step,
};
use crate::queue::{AdmissionQueue, OrderInput, PriorityClass, Refused, Waiting};
use crate::registry::{
    Fleet, KvEvents, RankEntry, Readiness, Registry, RegistryError, WorkerConfig, WorkerRole,
};
use crate::rng::{mix64, SharedRng};
use crate::select::{
    filter_busy, filter_unhealthy, selector_for, Busy, BusyOutcome, Candidate, CostTerms,
    FloorTerms, HealthOutcome, LeastLoaded, Overlap, Overrides, PolicyKind, ProbeTargets,
    RequestShape, Scored, SelectInput, Selector, Weights,
};
use crate::session::{
    SessionClose, SessionEnd, SessionEndReason, SessionId, SessionRouting, Sessions,
};

/// The serving phase a request is routed for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Phase {
    /// Prefill and decode on one worker (aggregated workers).
    #[default]
    Aggregated,
    /// The prefill half of disaggregated serving (prefill workers).
    Prefill,
    /// The decode half (decode workers; overlap credit off, no prefill booked).
    Decode,
}

/// Whether a decision books load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Decide and book.
    #[default]
    Book,
    /// Decide only; change no state.
    QueryOnly,
}

/// Whether the decision carries every candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum EvidenceLevel {
    #[default]
    Off,
    /// Every candidate with its load, overlap and cost (allocates).
    Full,
}

/// Workers pinned by the caller, per phase. Precedence (the reference's): in prefill, the
/// prefill worker before the backend instance; in decode, the decode worker before the backend
/// instance; aggregated uses the backend instance. The dp rank is the phase's own, else the
/// general one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Pinned {
    pub backend_instance: Option<WorkerId>,
    pub prefill_worker: Option<WorkerId>,
    pub decode_worker: Option<WorkerId>,
    pub dp_rank: Option<DpRank>,
    pub prefill_dp_rank: Option<DpRank>,
    pub decode_dp_rank: Option<DpRank>,
}

impl Pinned {
    /// The worker and dp rank pinned for `phase`, if any.
    pub fn for_phase(&self, phase: Phase) -> Option<(WorkerId, Option<DpRank>)> {
        let (worker, dp) = match phase {
            Phase::Prefill => (
                self.prefill_worker.or(self.backend_instance),
                self.prefill_dp_rank.or(self.dp_rank),
            ),
            Phase::Decode => (
                self.decode_worker.or(self.backend_instance),
                self.decode_dp_rank.or(self.dp_rank),
            ),
            Phase::Aggregated => (self.backend_instance, self.dp_rank),
        };
        worker.map(|w| (w, dp))
    }
}

/// What the caller knows about a request besides its tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteHints<'a> {
    pub phase: Phase,
    pub pinned: Pinned,
    pub mode: Mode,
    /// LoRA adapter: changes the block hash seed.
    pub lora_name: Option<&'a str>,
    /// Cache isolation salt: changes the block hash seed.
    pub cache_salt: Option<&'a str>,
    /// Seconds to move ahead in the admission queue (finite; see [`crate::queue`]); no effect
    /// on the choice.
    pub priority_jump: f64,
    /// Strict priority class in the admission queue: higher classes always go first.
    pub priority_class: PriorityClass,
    /// Expected generated tokens, when known: the request's output blocks then weigh what is
    /// left of it in the rank's decode load (see [`crate::load`]); recorded in the decision.
    pub expected_output_tokens: Option<u32>,
    /// Only these workers may serve (`None`: any).
    pub allowed: Option<&'a [WorkerId]>,
    /// Labels a worker must carry, every one, to serve ([`RouteError::NoEligibleWorker`] when
    /// none does).
    pub required: &'a [Label<'a>],
    /// Labels that lower the cost of a worker carrying them by their weight, in blocks.
    pub preferred: &'a [PreferredLabel<'a>],
    /// The sticky session the request belongs to (see [`crate::session`]); an explicit pin
    /// takes precedence over it.
    pub session: Option<SessionId>,
    /// Whether the session closes when this request ends.
    pub session_close: SessionClose,
    /// What the fleet's shared KV pool holds of the prompt.
    pub pool: PoolHits<'a>,
    pub overrides: Overrides,
    pub evidence: EvidenceLevel,
}

/// The shared KV pool's answer for a request's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PoolHits<'a> {
    /// No pool, or not asked.
    #[default]
    None,
    /// The pool holds these ranges of block positions (0 = the prompt's first block). Blocks
    /// beyond a worker's own overlap, contiguous with it, are credited at
    /// [`RouterConfig::pool_credit`]. Ranges past the prompt are clipped; a range whose start
    /// exceeds its end makes the whole answer count as failed.
    Hits(&'a [std::ops::Range<u32>]),
    /// The pool did not answer (timeout, error): counted and ignored.
    Failed,
}

/// A KV event as the router's own bookkeeping sees it ([`Router::note_event`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventSeen {
    Stored { blocks: u64 },
    Removed { blocks: u64 },
    Cleared,
}

/// KV events into a router's index, each noted ([`Router::event_writer`]).
pub struct EventWriter<'a> {
    index: MutexGuard<'a, PrefixIndex>,
    router: &'a Router,
}

impl std::fmt::Debug for EventWriter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventWriter").finish_non_exhaustive()
    }
}

impl EventWriter<'_> {
    fn noted(
        &self,
        header: EventHeader,
        seen: EventSeen,
        applied: Result<(), IndexError>,
    ) -> Result<(), IndexError> {
        if applied.is_ok() {
            self.router.note_event(header.source, header.tier, seen);
        }
        applied
    }
}

impl crate::index::ApplyEvents for EventWriter<'_> {
    fn apply_stored(
        &mut self,
        header: EventHeader,
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        let applied = self.index.apply_stored(header, parent, blocks);
        let seen = EventSeen::Stored {
            blocks: blocks.len() as u64,
        };
        self.noted(header, seen, applied)
    }

    fn apply_removed(
        &mut self,
        header: EventHeader,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError> {
        let applied = self.index.apply_removed(header, blocks);
        let seen = EventSeen::Removed {
            blocks: blocks.len() as u64,
        };
        self.noted(header, seen, applied)
    }

    fn apply_cleared(&mut self, header: EventHeader) -> Result<(), IndexError> {
        let applied = self.index.apply_cleared(header);
        self.noted(header, EventSeen::Cleared, applied)
    }
}

/// A worker label, `key=value`, as a request names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Label<'a> {
    pub key: &'a str,
    pub value: &'a str,
}

/// A label a request prefers, and by how much: a worker carrying it costs `weight` blocks
/// less (finite, ≥ 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PreferredLabel<'a> {
    pub label: Label<'a>,
    pub weight: f64,
}

/// One request to route.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    pub id: RequestId,
    pub tokens: &'a [u32],
    pub hints: RouteHints<'a>,
}

/// Why a request could not be routed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum RouteError {
    #[error("request {request:?} has no tokens")]
    NoTokens { request: RequestId },
    #[error("router not ready: {joined} of {needed} workers joined")]
    NotReady { joined: usize, needed: usize },
    #[error(
        "no worker may serve request {request:?} (none joined for its phase, or none allowed)"
    )]
    NoWorkers { request: RequestId },
    #[error("request {request:?} is pinned to unknown worker {worker:?}")]
    UnknownWorker {
        request: RequestId,
        worker: WorkerId,
    },
    #[error("no worker carries every label request {request:?} requires")]
    NoEligibleWorker { request: RequestId },
    #[error("request {request:?} is pinned to worker {worker:?}, which lacks a required label")]
    PinnedLacksLabels {
        request: RequestId,
        worker: WorkerId,
    },
    #[error("request {request:?} is pinned to worker {worker:?}, which its allowed set excludes")]
    PinnedNotAllowed {
        request: RequestId,
        worker: WorkerId,
    },
    #[error(
        "request {request:?} ({request_tokens} prompt tokens) rejected: {queued_tokens} tokens already queued, cap {cap_tokens}; retry later"
    )]
    ResourceExhausted {
        request: RequestId,
        request_tokens: u64,
        queued_tokens: u64,
        cap_tokens: u64,
    },
    #[error("request {request:?} is neither queued nor released and untaken")]
    NotQueued { request: RequestId },
    #[error("request {request:?} hint `{field}` is invalid: {reason}")]
    InvalidHint {
        request: RequestId,
        field: &'static str,
        reason: &'static str,
    },
    #[error(transparent)]
    Load(#[from] LoadError),
}

impl RouteError {
    /// True when the same request may succeed if retried later unchanged (the queue was full,
    /// or the fleet not yet ready).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            RouteError::ResourceExhausted { .. } | RouteError::NotReady { .. }
        )
    }
}

/// Why a router could not be built or a worker could not join or leave.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum RouterError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Index(#[from] IndexError),
}

/// Which rule chose the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecidedBy {
    /// The KV-aware cost function.
    Cost,
    /// Another configured policy.
    Policy(PolicyKind),
    /// The caller pinned the worker.
    Pinned,
    /// The request's sticky session is bound to the rank.
    Session,
    /// Every eligible rank was busy: the least loaded was taken.
    FallbackAllBusy,
    /// Every eligible rank's worker is marked unhealthy: the least loaded was taken.
    FallbackAllUnhealthy,
    /// A cache miss sent to a warming worker (see [`crate::config::WarmUp`]).
    WarmUp,
}

/// A decision that served the request differently from its phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// A prefill-phase request went to an aggregated worker: no prefill worker has joined
    /// (and disaggregation is not enforced).
    PrefillToAggregated,
}

/// Whether the decision booked load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bookkeeping {
    Booked,
    /// Query-only: nothing changed.
    QueryOnly,
    /// Pinned to a multi-rank worker without a usable dp rank: dispatch without bookkeeping.
    /// The reported rank is the worker's first.
    UntrackedDpRankUnresolved,
}

/// A routing decision and why it was made.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub request: RequestId,
    pub worker: WorkerRank,
    /// Predicted cached prefix on the chosen rank.
    pub overlap: Overlap,
    /// The chosen rank's cost terms.
    pub cost: CostTerms,
    /// Its load just before booking.
    pub load: LoadView,
    pub decided_by: DecidedBy,
    /// Set when the request was served outside its phase.
    pub fallback: Option<Fallback>,
    pub bookkeeping: Bookkeeping,
    pub expected_output_tokens: Option<u32>,
    /// How a session request's session steered it (`None` without a session, or when an
    /// explicit pin decided).
    pub session: Option<SessionRouting>,
    /// Every candidate considered (busy ones included), when asked for.
    pub evidence: Option<Vec<Candidate>>,
}

/// When a request may be booked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    /// Now, on the least loaded busy rank if every one is busy (`route`).
    Immediate,
    /// Now if some eligible rank is free; else wait (an admission with an empty queue, or the
    /// queue's head on release).
    IfFree,
    /// Wait behind the requests already queued (unless pinned).
    Behind,
}

/// What a gated route came to. The decision stays inline: boxing it would allocate per route.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Routed {
    Decided(Decision),
    /// Not booked: the request must wait. Carries what the queue orders by.
    Wait {
        new_prefill_tokens: u64,
    },
}

/// The time of one call: the caller's, or the clock's, read once and only when needed.
#[derive(Debug)]
struct Now(std::cell::Cell<Option<Instant>>);

impl Now {
    fn lazy() -> Self {
        Now(std::cell::Cell::new(None))
    }

    fn at(t: Instant) -> Self {
        Now(std::cell::Cell::new(Some(t)))
    }

    /// The time; a reading the caller already took stands in for the clock.
    fn get_or(&self, reading: Option<Instant>) -> Instant {
        match self.0.get() {
            Some(t) => t,
            None => {
                let t = reading.unwrap_or_else(Instant::now);
                self.0.set(Some(t));
                t
            }
        }
    }
}

/// Overhead split of routing, in nanoseconds (recorded when [`Timing::On`]).
#[derive(Debug, Clone)]
pub struct Timings {
    pub hash: Histogram<u64>,
    pub matching: Histogram<u64>,
    pub select: Histogram<u64>,
}

impl Timings {
    fn new() -> Self {
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
    fn record(&mut self, hash: u64, matching: u64, select: u64) {
        record(&mut self.hash, hash);
        record(&mut self.matching, matching);
        record(&mut self.select, select);
    }
}

/// Records `v`. The histograms grow to the largest value seen (an allocation only when a new
/// maximum arrives); `saturating_record` alone would clamp every value to the initial range of
/// 1..2, because it never resizes, so it only catches values past the largest trackable.
fn record(h: &mut Histogram<u64>, v: u64) {
    if h.record(v).is_err() {
        h.saturating_record(v);
    }
}

/// Records `v` `n` times, growing the histogram as [`record`] does.
fn record_n(h: &mut Histogram<u64>, v: u64, n: u64) {
    if h.record_n(v, n).is_err() {
        h.saturating_record_n(v, n);
    }
}

/// `elapsed` over `per` units, in µs, rounded.
fn us_per(elapsed: std::time::Duration, per: u64) -> u64 {
    let per_ns = u128::from(per.max(1)) * 1000;
    u64::try_from((elapsed.as_nanos() + per_ns / 2) / per_ns).unwrap_or(u64::MAX)
}

/// A histogram of 3 significant digits sized for values up to `high` (recording within it
/// never allocates) that still grows past it.
fn histogram_upto(high: u64) -> Histogram<u64> {
    match Histogram::new_with_bounds(1, high, 3) {
        Ok(mut h) => {
            h.auto(true);
            h
        }
        Err(_) => unreachable_histogram(),
    }
}

fn unreachable_histogram() -> Histogram<u64> {
    // `Histogram::new(3)` only fails for more than 5 significant digits.
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
    pub count: u64,
    pub mean: f64,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
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
    fn new() -> Self {
        RequestMetrics {
            ttft_us: histogram_upto(1 << 26),
            itl_us: histogram_upto(1 << 26),
            isl_tokens: histogram_upto(1 << 20),
            osl_blocks: histogram_upto(1 << 16),
            kv_hit_bp: histogram_upto(10_000),
        }
    }

    fn each_mut(&mut self) -> [&mut Histogram<u64>; 5] {
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
struct MetricsShards {
    shards: [CachePadded<Mutex<RequestMetrics>>; Self::SHARDS],
}

impl MetricsShards {
    const SHARDS: usize = 4;

    fn new() -> Self {
        MetricsShards {
            shards: std::array::from_fn(|_| CachePadded::new(Mutex::new(RequestMetrics::new()))),
        }
    }

    fn shard(&self, request: RequestId) -> MutexGuard<'_, RequestMetrics> {
        lock(&self.shards[(mix64(request.0) >> 62) as usize % Self::SHARDS])
    }

    fn snapshot(&self) -> RequestMetrics {
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
    pub routed: u64,
    pub query_only: u64,
    pub untracked: u64,
    pub all_busy: u64,
    /// Prefill-phase requests served by aggregated workers (no prefill worker joined).
    pub prefill_fallbacks: u64,
    /// Ranks probed for prompt blocks already active on them.
    pub shared_probes: u64,
    /// Probes skipped because the rank's table was held by another thread.
    pub shared_probes_busy: u64,
    pub no_tokens: u64,
    pub not_ready: u64,
    pub no_workers: u64,
    pub unknown_worker: u64,
    pub pinned_not_allowed: u64,
    /// Requests freed after reaching a worker (marked dispatched, by id or by their guard).
    pub completed: u64,
    /// Requests rejected for a bad hint ([`RouteError::InvalidHint`]).
    pub invalid_hints: u64,
    /// Submits of an id already queued, released and untaken, or booked (one that finds a free
    /// rank at once meets the ledger's own duplicate check instead).
    pub duplicate_admissions: u64,
    /// Candidates left out because their worker was marked unreachable (one per request per
    /// rank).
    pub vetoed_unreachable: u64,
    /// The same for workers marked wedged.
    pub vetoed_wedged: u64,
    /// Requests whose every candidate was marked ([`DecidedBy::FallbackAllUnhealthy`]).
    pub all_unhealthy: u64,
    /// Requests no worker carried the required labels of ([`RouteError::NoEligibleWorker`]
    /// and [`RouteError::PinnedLacksLabels`]).
    pub no_eligible: u64,
    /// Sessions bound at their first booked request.
    pub sessions_bound: u64,
    /// Session requests whose bound rank had gone (or could not serve): chosen afresh.
    pub sessions_rerouted: u64,
    pub sessions_expired: u64,
    pub sessions_closed: u64,
    /// Routes where the router's own cache records raised some rank's overlap.
    pub approx_raised: u64,
    /// Cache misses sent to a warming worker ([`DecidedBy::WarmUp`]).
    pub warm_up: u64,
    /// Ranks put back to warming because their reported cache fell far below the fleet's.
    pub rewarmed: u64,
    /// Requests whose shared-pool answer failed (no answer, or a malformed one) and was
    /// ignored.
    pub pool_failed: u64,
    /// The record table's counters.
    pub approx: ApproxCounts,
    pub ledger: LedgerCounts,
}

#[derive(Debug, Default)]
struct Counters {
    routed: AtomicU64,
    query_only: AtomicU64,
    untracked: AtomicU64,
    all_busy: AtomicU64,
    prefill_fallbacks: AtomicU64,
    shared_probes: AtomicU64,
    shared_probes_busy: AtomicU64,
    no_tokens: AtomicU64,
    not_ready: AtomicU64,
    no_workers: AtomicU64,
    unknown_worker: AtomicU64,
    pinned_not_allowed: AtomicU64,
    completed: AtomicU64,
    invalid_hints: AtomicU64,
    duplicate_admissions: AtomicU64,
    vetoed_unreachable: AtomicU64,
    vetoed_wedged: AtomicU64,
    all_unhealthy: AtomicU64,
    no_eligible: AtomicU64,
    sessions_bound: AtomicU64,
    sessions_rerouted: AtomicU64,
    sessions_expired: AtomicU64,
    sessions_closed: AtomicU64,
    approx_raised: AtomicU64,
    warm_up: AtomicU64,
    rewarmed: AtomicU64,
    pool_failed: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A pinned route's rank, checked before the match.
#[derive(Clone, Copy)]
struct PinnedRank {
    /// The rank scored (in the fleet's table).
    index: usize,
    /// False when the pin named a worker with several dp ranks and none of them.
    resolved: bool,
    by: DecidedBy,
}

#[derive(Default)]
struct Scratch {
    locals: Vec<LocalHash>,
    /// Prefix keys of the blocks the policy keys on.
    keys: Vec<u64>,
    /// Checkpoint keys for the router's records, computed as far as they are looked at.
    marks: Vec<u64>,
    /// The match, by the index's rank ids.
    depths: RankDepths,
    candidates: Vec<Scored>,
    /// Every candidate, for warm-up's pick on a cache miss after a pruned gather.
    unpruned: Vec<Scored>,
    /// The request's preferred labels as (label bit, weight).
    preferred: Vec<(u64, f64)>,
    /// The pool's hits, clipped, sorted and merged into disjoint `[start, end)` ranges.
    pool: Vec<(u32, u32)>,
    /// Ranks whose load this thread read in selection only to find that they could not win,
    /// plus four per route, since it last refreshed the booked-prefill floor
    /// ([`Router::refresh_prefill_floor`]).
    loaded_losers: u64,
}

/// The router's records (approximate mode, speculation) raise a rank's overlap to their
/// depth, as device blocks; the index's overlap stands where it is deeper.
impl crate::approx::Overlaps for RankDepths {
    #[inline(always)]
    fn raise(&mut self, _: WorkerRank, key: RankKey, depth: u32) -> bool {
        // A key given out after the match began raises nothing (`RankDepths::raise`); a
        // retired rank's raise is never read (selection skips retired ranks), and a rank's
        // records leave the table before the index frees its id.
        RankDepths::raise(self, key, depth)
    }
}

/// The overlap `depths` gives rank `r` under its key, retired or not: at least the overlap
/// [`rank_depth`] gives it (a floor computed from it is no higher).
#[inline(always)]
fn rank_depth_unchecked(
    r: &RankEntry,
    depths: &RankDepths,
) -> Option<(RankKey, crate::index::Depth)> {
    let key = r.index_key?;
    Some((key, depths.get_for(key)?))
}

/// The overlap `depths` gives rank `r`, with its index key: `None` when it holds no block, is
/// not in the index, or the entry under its id is not its own.
///
/// An id changes hands only through a removal. The key's epoch keeps a rank that took its id
/// after the match began from the previous owner's entry ([`RankDepths::get_for`]); and as
/// the router retires a leaving rank before the index frees its id, a rank removed during the
/// match, whose entry may hold its id's next owner's blocks, reads as retired.
#[inline(always)]
fn rank_depth(r: &RankEntry, depths: &RankDepths) -> Option<(RankKey, crate::index::Depth)> {
    // Retirement is checked only for a rank that matched.
    rank_depth_unchecked(r, depths).filter(|_| !r.state.is_retired())
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The router.
pub struct Router {
    config: RouterConfig,
    registry: Registry,
    ledger: Ledger,
    index: Mutex<PrefixIndex>,
    reader: IndexReader,
    selector: Box<dyn Selector>,
    rng: SharedRng,
    counters: Counters,
    timings: Option<Mutex<Timings>>,
    metrics: Option<MetricsShards>,
    queue: Option<Queue>,
    /// Ranks whose worker is marked unhealthy; selection reads no mark while 0.
    marked_ranks: AtomicUsize,
    /// Serialises health marks with leaves, so that `marked_ranks` stays exact.
    health_writer: Mutex<()>,
    sessions: Sessions,
    approx: ApproxCache,
    /// Warm-up deadlines are nanoseconds past this instant.
    epoch: Instant,
    /// The latest warm-up deadline of any rank: no rank warms past it.
    warm_horizon_ns: AtomicU64,
    /// Told of every session that ends (expired or closed).
    on_session_end: std::sync::RwLock<Option<SessionCallback>>,
}

/// The embedder's handler of ended sessions ([`Router::on_session_end`]).
pub type SessionCallback = Box<dyn Fn(SessionEnd) + Send + Sync>;

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("config", &self.config)
            .field("workers", &self.registry.load().len())
            .field("active_requests", &self.ledger.active())
            .finish()
    }
}

impl Router {
    /// A router over `index` (whose block size must be `config.block_size`).
    pub fn new(config: RouterConfig, index: PrefixIndex) -> Result<Self, RouterError> {
        config.validate()?;
        let reader = index.reader();
        Ok(Router {
            registry: Registry::new(config.block_size, config.min_workers),
            ledger: Ledger::with_prompt_decay(config.prompt_decay),
            index: Mutex::new(index),
            reader,
            selector: selector_for(config.policy),
            rng: SharedRng::new(config.seed),
            counters: Counters::default(),
            timings: (config.timing == Timing::On).then(|| Mutex::new(Timings::new())),
            metrics: (config.metrics == Metrics::On).then(MetricsShards::new),
            queue: match config.queue {
                Queueing::Off => None,
                Queueing::On {
                    max_queued_tokens,
                    order,
                } => Some(Queue {
                    state: Mutex::new(QueueState::new(order, max_queued_tokens)),
                    depth: AtomicUsize::new(0),
                    untaken: AtomicUsize::new(0),
                    epoch: Instant::now(),
                }),
            },
            marked_ranks: AtomicUsize::new(0),
            health_writer: Mutex::new(()),
            sessions: Sessions::default(),
            approx: ApproxCache::new(config.approximate.max_records),
            epoch: Instant::now(),
            warm_horizon_ns: AtomicU64::new(0),
            on_session_end: std::sync::RwLock::new(None),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// A lock-free reader of the index.
    pub fn index_reader(&self) -> IndexReader {
        self.reader.clone()
    }

    /// Applies a KV event to the index (serialised with other writers), and tells the
    /// router's own bookkeeping of it ([`Router::note_event`]).
    pub fn apply_event(&self, event: &KvEvent) -> Result<(), IndexError> {
        crate::index::ApplyEvents::apply_event(&mut self.event_writer(), event)
    }

    /// A writer of KV events into the router's index for an ingest path that decodes them
    /// itself (the transport's): each event it applies is noted as [`Router::apply_event`]
    /// notes it. It holds the index's lock while it lives: keep it for a batch, not longer
    /// (joins and leaves wait on it; routes do not).
    pub fn event_writer(&self) -> EventWriter<'_> {
        EventWriter {
            index: lock(&self.index),
            router: self,
        }
    }

    /// Tells the router of a KV event applied to the index elsewhere (an ingest path that
    /// writes the index directly): an eviction or clear retires the worker's speculative
    /// records, and device blocks stored and removed feed warm-up's measure of each worker's
    /// cache (a clear warms the worker again). [`Router::apply_event`] calls it itself.
    pub fn note_event(&self, source: WorkerRank, tier: StorageTier, seen: EventSeen) {
        if matches!(seen, EventSeen::Removed { .. } | EventSeen::Cleared) {
            // The worker says its cache shrank: speculation about it stops counting.
            self.approx.retire_rank(source);
        }
        if tier != StorageTier::Device {
            return;
        }
        let fleet = self.registry.load();
        let Some(i) = fleet.rank_index(source) else {
            return;
        };
        let state = &fleet.ranks[i].state;
        match seen {
            EventSeen::Stored { blocks } => state.report_blocks(blocks, 0, false),
            EventSeen::Removed { blocks } => state.report_blocks(0, blocks, false),
            EventSeen::Cleared => {
                // A restart with an empty cache: warm it again.
                state.report_blocks(0, 0, true);
                self.warm(state, Instant::now());
            }
        }
    }

    /// Raises the ledger's booked-prefill floor to the least prefill booked on any rank of
    /// the fleet ([`Ledger::refresh_prefill_floor`]). A rank published while the refresh read
    /// an older fleet is fresh (nothing booked): its join lowers the floor after publishing,
    /// and if the refresh comes after that, the fleet it reads again below has the rank.
    pub fn refresh_prefill_floor(&self) {
        let fleet = self.registry.load();
        self.ledger
            .refresh_prefill_floor(fleet.ranks.iter().map(|r| &*r.state));
        let latest = self.registry.load();
        if latest.generation != fleet.generation {
            for r in latest.ranks.iter() {
                self.ledger.lower_prefill_floor(r.state.booked_prefill());
            }
        }
    }

    /// Prefill tokens every rank has booked at least, as selection's floors count them
    /// ([`Ledger::prefill_floor`]).
    pub fn prefill_floor(&self) -> u64 {
        self.ledger.prefill_floor()
    }

    /// The fleet snapshot.
    pub fn fleet(&self) -> std::sync::Arc<Fleet> {
        self.registry.load_full()
    }

    /// Ready once the configured minimum of workers joined.
    pub fn readiness(&self) -> Readiness {
        self.registry.readiness()
    }

    /// A worker that publishes KV events joins; its ranks are registered with the index.
    pub fn join_worker(&self, config: WorkerConfig) -> Result<(), RouterError> {
        self.join_worker_with(config, KvEvents::Published)
    }

    /// A worker joins, saying whether it publishes KV events (without them, the router records
    /// its own decisions as the worker's cache: approximate mode).
    pub fn join_worker_with(
        &self,
        config: WorkerConfig,
        events: KvEvents,
    ) -> Result<(), RouterError> {
        self.join_worker_at(config, events, Instant::now())
    }

    /// [`Router::join_worker_with`] at a given time (its warm-up starts then).
    pub fn join_worker_at(
        &self,
        config: WorkerConfig,
        events: KvEvents,
        now: Instant,
    ) -> Result<(), RouterError> {
        let (id, kv_blocks) = (config.id, config.kv_blocks);
        let fleet = self.registry.join(config)?;
        // Fresh ranks have booked nothing: published first, then the floor follows (see
        // `refresh_prefill_floor`).
        self.ledger.lower_prefill_floor(0);
        if let Some(w) = fleet.worker(id) {
            let mut index = lock(&self.index);
            for r in &fleet.ranks[w.ranks.clone()] {
                r.state.set_kv_events(events);
                self.warm(&r.state, now);
                // Registered with room for the names of a full cache: the rank's name map is
                // not rebuilt while the worker warms up.
                index.reserve_blocks(r.rank, kv_blocks)?;
                if let Some(key) = index.rank_key(r.rank) {
                    r.state.set_index_key(key);
                }
            }
            // The ranks' entries take their keys.
            self.registry.republish();
        }
        self.load_freed();
        Ok(())
    }

    /// A worker leaves: its bookings are dropped (returns how many) and its blocks leave the
    /// index.
    pub fn leave_worker(&self, worker: WorkerId) -> Result<usize, RouterError> {
        {
            let _w = lock(&self.health_writer);
            let retired = self.registry.leave(worker)?;
            let marked = retired.iter().filter(|r| !r.health().is_healthy()).count();
            self.marked_ranks.fetch_sub(marked, Ordering::Relaxed);
        }
        let purged = self.ledger.purge_worker(worker);
        self.approx.remove_worker(worker);
        let removed = lock(&self.index).remove_worker(worker);
        // A queued request whose only eligible workers left now fails instead of waiting.
        self.load_freed();
        match removed {
            Ok(()) | Err(IndexError::UnknownWorker { .. }) => Ok(purged),
            Err(e) => Err(e.into()),
        }
    }

    /// Marks a worker's health (see [`crate::health`]); returns its previous mark. Marking a
    /// worker healthy again may release queued requests.
    pub fn set_health(&self, worker: WorkerId, health: Health) -> Result<Health, RouterError> {
        let previous = {
            let _w = lock(&self.health_writer);
            let fleet = self.registry.load();
            let Some(w) = fleet.worker(worker) else {
                return Err(RegistryError::UnknownWorker { worker }.into());
            };
            let mut previous = Health::Healthy;
            for r in &fleet.ranks[w.ranks.clone()] {
                previous = r.state.set_health(health);
                match (previous.is_healthy(), health.is_healthy()) {
                    (true, false) => {
                        self.marked_ranks.fetch_add(1, Ordering::Relaxed);
                    }
                    (false, true) => {
                        self.marked_ranks.fetch_sub(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
            }
            previous
        };
        self.load_freed();
        Ok(previous)
    }

    /// Sets the handler told of every session that ends (expired or closed), so that the
    /// embedder can close it on its worker. Called outside the router's locks, but under the
    /// handler's own: it must not set a new handler itself.
    pub fn on_session_end(&self, f: impl Fn(SessionEnd) + Send + Sync + 'static) {
        *self
            .on_session_end
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Some(Box::new(f));
    }

    fn session_ended(&self, end: SessionEnd) {
        bump(match end.reason {
            SessionEndReason::Expired => &self.counters.sessions_expired,
            SessionEndReason::Closed => &self.counters.sessions_closed,
        });
        if let Some(f) = &*self
            .on_session_end
            .read()
            .unwrap_or_else(|p| p.into_inner())
        {
            f(end);
        }
    }

    /// Ends the sessions idle for `session_idle_ttl` at `now` (whose last request has ended),
    /// and those whose close-after-request is due; tells the session handler of each. Returns
    /// how many ended.
    pub fn expire_sessions(&self, now: Instant) -> usize {
        if self.sessions.is_empty() {
            return 0;
        }
        let mut ended = Vec::new();
        self.sessions.sweep(
            now,
            self.config.session_idle_ttl,
            |r| self.ledger.rank_of(r).is_some(),
            &mut ended,
        );
        for &end in &ended {
            self.session_ended(end);
        }
        ended.len()
    }

    /// Closes a session now (the handler is told); `None` if it was not bound.
    pub fn close_session(&self, session: SessionId) -> Option<SessionEnd> {
        let end = self.sessions.close(session)?;
        self.session_ended(end);
        Some(end)
    }

    /// The rank a session is bound to.
    pub fn session_rank(&self, session: SessionId) -> Option<WorkerRank> {
        self.sessions.bound(session)
    }

    /// Frees requests booked more than `request_expiry` before `now` (returns how many), drops
    /// the cache records that expired, warms ranks whose reported cache fell far below the
    /// fleet's (with warm-up on), and lets queued requests go if that freed room. Call it
    /// periodically (every second or so).
    pub fn expire(&self, now: Instant) -> usize {
        let n = self.ledger.expire(now, self.config.request_expiry);
        self.approx.sweep(now);
        self.rewarm_low_ranks(now);
        self.release_queued(now);
        n
    }

    /// A rank's load, if the rank exists.
    pub fn load(&self, rank: WorkerRank) -> Option<LoadView> {
        let fleet = self.registry.load();
        fleet.rank_index(rank).map(|i| fleet.ranks[i].state.load())
    }

    /// The summed load of every rank.
    pub fn total_load(&self) -> LoadView {
        let fleet = self.registry.load();
        fleet.ranks.iter().fold(LoadView::default(), |a, r| {
            let l = r.state.load();
            LoadView {
                prefill_tokens: a.prefill_tokens + l.prefill_tokens,
                prompt_blocks: a.prompt_blocks + l.prompt_blocks,
                output_blocks: a.output_blocks + l.output_blocks,
                output_decay: a.output_decay + l.output_decay,
                prompt_decay: a.prompt_decay + l.prompt_decay,
                requests: a.requests + l.requests,
            }
        })
    }

    /// Requests currently booked.
    pub fn active_requests(&self) -> usize {
        self.ledger.active()
    }

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

    /// A copy of the overhead histograms (`None` unless [`Timing::On`]).
    pub fn timings(&self) -> Option<Timings> {
        self.timings.as_ref().map(|t| lock(t).clone())
    }

    /// A merged copy of the request metrics (`None` unless [`Metrics::On`]).
    pub fn request_metrics(&self) -> Option<RequestMetrics> {
        self.metrics.as_ref().map(MetricsShards::snapshot)
    }

    /// The clock reading lifecycle calls pass on: only when metrics are on.
    fn metrics_now(&self) -> Option<Instant> {
        self.metrics.as_ref().map(|_| Instant::now())
    }

    /// The request reached its worker: from now on it records metrics and, when freed,
    /// counts as completed.
    pub fn mark_dispatched(&self, request: RequestId) -> Result<WorkerRank, LoadError> {
        self.ledger.mark_dispatched(request)
    }

    /// The request's first token arrived.
    pub fn prefill_done(&self, request: RequestId) -> Result<WorkerRank, LoadError> {
        let step = self.ledger.prefill_done(request, self.metrics_now())?;
        self.record_step(request, &step, |m| &mut m.ttft_us, 1);
        self.load_freed();
        Ok(step.rank)
    }

    /// The request's generation crossed into a new block.
    pub fn output_block(&self, request: RequestId) -> Result<WorkerRank, LoadError> {
        let step = self.ledger.output_block(request, self.metrics_now())?;
        if step.tokens > 0 {
            self.record_step(request, &step, |m| &mut m.itl_us, step.tokens);
        }
        Ok(step.rank)
    }

    /// `tokens` more output tokens of the request arrived (the first included): output blocks
    /// advance from the count, the first call completes the prefill and records the TTFT,
    /// later calls record the ITL once per token (the time since the previous call over its
    /// tokens; the other tokens of the first call have no interval of their own). Use either
    /// this or [`Router::output_block`] per request; they mix, but the latter samples the ITL
    /// only at block boundaries.
    pub fn tokens_generated(
        &self,
        request: RequestId,
        tokens: u64,
    ) -> Result<WorkerRank, LoadError> {
        let g: Generated = self
            .ledger
            .tokens_generated(request, tokens, self.metrics_now())?;
        if let (Some(m), Dispatch::Reached) = (&self.metrics, g.dispatch) {
            let mut m = m.shard(request);
            if let Some(t) = g.ttft {
                record(&mut m.ttft_us, us_per(t, 1));
            }
            if let Some(t) = g.itl {
                record_n(&mut m.itl_us, us_per(t, g.itl_tokens), g.itl_tokens);
            }
        }
        if g.prefill_released {
            self.load_freed();
        }
        Ok(g.rank)
    }

    /// Records a step's elapsed time over `per` units, in µs (rounded), when metrics are on
    /// and the request reached its worker.
    fn record_step(
        &self,
        request: RequestId,
        step: &Step,
        histogram: impl FnOnce(&mut RequestMetrics) -> &mut Histogram<u64>,
        per: u64,
    ) {
        if let (Some(m), Some(elapsed), Dispatch::Reached) =
            (&self.metrics, step.elapsed, step.dispatch)
        {
            record(histogram(&mut m.shard(request)), us_per(elapsed, per));
        }
    }

    /// The request ended (completed, cancelled, failed): its load is released, and when it
    /// had reached its worker, it counts as completed and records its ISL, OSL and hit rate.
    pub fn free(&self, request: RequestId) -> Result<Freed, LoadError> {
        let now = Instant::now();
        let freed = self.ledger.free_at(request, now)?;
        if freed.dispatch == Dispatch::Reached {
            bump(&self.counters.completed);
            if let Some(m) = &self.metrics {
                let hit_bp = (u128::from(freed.cached_tokens) * 10_000)
                    .checked_div(u128::from(freed.prompt_tokens))
                    .unwrap_or(0);
                let mut m = m.shard(request);
                record(&mut m.isl_tokens, freed.prompt_tokens);
                record(&mut m.osl_blocks, freed.output_blocks);
                record(&mut m.kv_hit_bp, u64::try_from(hit_bp).unwrap_or(u64::MAX));
            }
        }
        if let Some(sid) = freed.session {
            if let Some(end) = self.sessions.request_ended(sid, request, now) {
                self.session_ended(end);
            }
        }
        self.load_freed();
        Ok(freed)
    }

    /// Decides which rank serves `req`, and books it unless query-only. Never waits: when
    /// every eligible rank is busy the least loaded takes it ([`DecidedBy::FallbackAllBusy`]);
    /// [`Router::submit`] queues instead.
    pub fn route(&self, req: &RouteRequest<'_>) -> Result<Decision, RouteError> {
        match self.route_gated(req, &Now::lazy(), Gate::Immediate)? {
            Routed::Decided(d) => Ok(d),
            // `Gate::Immediate` always decides.
            Routed::Wait { .. } => Err(RouteError::NoWorkers { request: req.id }),
        }
    }

    /// [`Router::route`] at a given time (bookings, sessions and cache records are stamped with
    /// `now`), for callers that own the clock.
    pub fn route_at(&self, req: &RouteRequest<'_>, now: Instant) -> Result<Decision, RouteError> {
        match self.route_gated(req, &Now::at(now), Gate::Immediate)? {
            Routed::Decided(d) => Ok(d),
            Routed::Wait { .. } => Err(RouteError::NoWorkers { request: req.id }),
        }
    }

    fn route_gated(
        &self,
        req: &RouteRequest<'_>,
        now: &Now,
        gate: Gate,
    ) -> Result<Routed, RouteError> {
        SCRATCH.with(|s| match s.try_borrow_mut() {
            Ok(mut s) => self.route_with(req, &mut s, now, gate),
            // Re-entered from inside a route on this thread (not possible through this API,
            // but never panic): use a fresh scratch.
            Err(_) => self.route_with(req, &mut Scratch::default(), now, gate),
        })
    }

    fn route_with(
        &self,
        req: &RouteRequest<'_>,
        s: &mut Scratch,
        now: &Now,
        gate: Gate,
    ) -> Result<Routed, RouteError> {
        let request = req.id;
        let hints = &req.hints;
        if req.tokens.is_empty() {
            bump(&self.counters.no_tokens);
            return Err(RouteError::NoTokens { request });
        }
        if let Readiness::Waiting { joined, needed } = self.registry.readiness() {
            bump(&self.counters.not_ready);
            return Err(RouteError::NotReady { joined, needed });
        }
        let timing = self.timings.is_some();
        let t0 = timing.then(Instant::now);

        // 1. Hash. Prefix keys only as far as the policy keys on (records extend them).
        let bs = self.config.block_size;
        let hasher = BlockHasher::new(bs as usize)
            .with_seed(HashSeed::new(hints.lora_name, hints.cache_salt));
        hasher.local_hashes_into(req.tokens, &mut s.locals);
        let keyed = self.prefix_key_blocks().min(s.locals.len());
        prefix_keys_into(&s.locals[..keyed], &mut s.keys);
        s.marks.clear();
        let t1 = timing.then(Instant::now);

        let fleet = self.registry.load();
        let overrides = hints.overrides.sanitized();
        let mut weights = Weights::new(&self.config, &overrides);
        if hints.phase == Phase::Decode {
            weights.credits = [0.0; StorageTier::COUNT];
        }
        let tokens = req.tokens.len() as u64;
        let shape = RequestShape {
            tokens,
            blocks: tokens.div_ceil(u64::from(bs)),
            full_blocks: s.locals.len() as u32,
            prefix_key: self.prefix_key(&s.keys),
        };
        let temperature = overrides.temperature.unwrap_or(self.config.temperature);
        // Constraints: required labels as one mask; preferred ones as (bit, weight).
        let mut required = 0u64;
        for l in hints.required {
            match fleet.label_bit(l.key, l.value) {
                Some(bit) => required |= bit,
                None => {
                    bump(&self.counters.no_eligible);
                    return Err(RouteError::NoEligibleWorker { request });
                }
            }
        }
        s.preferred.clear();
        for p in hints.preferred {
            if !(p.weight.is_finite() && p.weight >= 0.0) {
                bump(&self.counters.invalid_hints);
                return Err(RouteError::InvalidHint {
                    request,
                    field: "preferred.weight",
                    reason: "must be a finite number ≥ 0",
                });
            }
            if let Some(bit) = fleet.label_bit(p.label.key, p.label.value) {
                s.preferred.push((bit, p.weight));
            }
        }
        s.pool.clear();
        match hints.pool {
            PoolHits::None => {}
            PoolHits::Failed => bump(&self.counters.pool_failed),
            PoolHits::Hits(ranges) => {
                if merge_pool_ranges(ranges, shape.full_blocks, &mut s.pool).is_err() {
                    bump(&self.counters.pool_failed);
                }
            }
        }
        let mut rng = self.rng.fork();
        let mut bookkeeping = match hints.mode {
            Mode::Book => Bookkeeping::Booked,
            Mode::QueryOnly => Bookkeeping::QueryOnly,
        };
        let probe = self.selector.kind() == PolicyKind::KvAware;
        let mut fallback = None;
        // A sticky session acts as a pin to its rank while that rank is present and may
        // serve the request; otherwise it is chosen afresh (and rebound when booked).
        let mut session_routing = None;
        let mut pin = hints
            .pinned
            .for_phase(hints.phase)
            .map(|p| (p, DecidedBy::Pinned));
        if let (None, Some(sid)) = (pin, hints.session) {
            session_routing = Some(match self.sessions.bound(sid) {
                None => SessionRouting::Bound,
                Some(rank) => {
                    let usable = fleet.rank_index(rank).is_some_and(|i| {
                        let r = &fleet.ranks[i];
                        r.label_bits & required == required
                            && hints.allowed.is_none_or(|a| a.contains(&rank.worker))
                    });
                    if usable {
                        pin = Some(((rank.worker, Some(rank.dp_rank)), DecidedBy::Session));
                        SessionRouting::Sticky
                    } else {
                        SessionRouting::Rerouted { previous: rank }
                    }
                }
            });
        }
        // A pin is checked and resolved to its rank before the match: that rank is the only
        // one scored. A worker with several dp ranks pinned without one is scored on its
        // first (and the booking is not tracked).
        let pinned = match pin {
            None => None,
            Some(((wid, dp), pinned_by)) => {
                let Some(w) = fleet.worker(wid) else {
                    bump(&self.counters.unknown_worker);
                    return Err(RouteError::UnknownWorker {
                        request,
                        worker: wid,
                    });
                };
                if hints.allowed.is_some_and(|a| !a.contains(&wid)) {
                    bump(&self.counters.pinned_not_allowed);
                    return Err(RouteError::PinnedNotAllowed {
                        request,
                        worker: wid,
                    });
                }
                if w.label_bits & required != required {
                    bump(&self.counters.no_eligible);
                    return Err(RouteError::PinnedLacksLabels {
                        request,
                        worker: wid,
                    });
                }
                let ranks = w.ranks.clone();
                let resolved = match dp {
                    Some(dp) => ranks.clone().find(|&i| fleet.ranks[i].rank.dp_rank == dp),
                    None if ranks.len() == 1 => Some(ranks.start),
                    None => None,
                };
                Some(PinnedRank {
                    index: resolved.unwrap_or(ranks.start),
                    resolved: resolved.is_some(),
                    by: pinned_by,
                })
            }
        };

        // Candidates that cannot win are not kept where only the winner matters: the
        // cheapest is taken (ties at random), and nothing else reads the whole list (no
        // evidence, no wait to estimate). While ranks warm up, warm-up's pick needs every
        // candidate on a cache miss: a request the kept candidates hold no block of is
        // gathered again, whole, for it.
        let prune = probe
            && temperature == 0.0
            && hints.evidence != EvidenceLevel::Full
            && gate != Gate::Behind;

        // 2. Match, by the index's rank ids; each fleet rank reads its own (`rank_depth`). A
        // pinned route's walk follows its rank alone. A pruning route reads few ranks, the
        // deep ones: the walk's first run (shared by many ranks, as a system prompt is) is
        // kept to be read when asked for. A route that reads every rank (no pruning, or no
        // credit for cached blocks, as in decode, so no least winning overlap) has every rank
        // written as the walk goes.
        let credit = weights
            .credits
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        s.depths
            .set_eager(!prune || credit.is_nan() || credit <= 0.0);
        match pinned.and_then(|p| fleet.ranks[p.index].index_key) {
            Some(key) => self.reader.find_depth_of_into(
                &s.locals,
                MatchOptions::default(),
                key.id,
                &mut s.depths,
            ),
            None => self
                .reader
                .find_depths_into(&s.locals, MatchOptions::default(), &mut s.depths),
        }
        let t2 = timing.then(Instant::now);

        // 3. Select.
        let (role, role_fallback) = self.selection_role(&fleet, hints.phase);
        let busy = &self.config.busy;
        let booked_floor = self.ledger.prefill_floor();
        let health_on = self.marked_ranks.load(Ordering::Relaxed) > 0;
        let decay_anywhere = self.ledger.prompt_decay_anywhere();
        // The scorer over the match as it stands (before and after the records raise it).
        macro_rules! scorer {
            ($known_seed:expr) => {
                Scorer {
                    pool: &s.pool,
                    pool_credit: self.config.pool_credit,
                    preferred: &s.preferred,
                    fleet: &fleet,
                    depths: &s.depths,
                    seed: s.depths.deepest().and_then(|rank| fleet.rank_index(rank)),
                    known_seed: $known_seed,
                    decay_anywhere,
                    booked_floor,
                    floor_terms: FloorTerms::new(&weights, &shape, booked_floor),
                    weights: &weights,
                    shape: &shape,
                    busy,
                    busy_on: busy.decode_blocks_fraction.is_some()
                        || busy.prefill_tokens_fraction.is_some(),
                    health_on,
                }
            };
        }
        // The router's own records (approximate mode, speculation) raise a rank's overlap to
        // their depth, as device blocks; the index's overlap stands where it is deeper. Where
        // only the winner matters, the deepest eligible rank is scored on the index's overlap
        // alone first: records shallower than any overlap that could beat it are not read
        // (`Scorer::least_winning_blocks`; the rank's cost without its records is no lower
        // than with them, so the depth found is no higher than it would be with them).
        let mut known_seed = None;
        if !self.approx.is_empty() && !s.locals.is_empty() {
            let mut least = 0;
            if prune && pin.is_none() {
                let first = scorer!(None);
                let (seed, blocks) =
                    first.least_after_seed(role, hints.allowed, required, &mut s.candidates);
                known_seed = seed;
                least = blocks.unwrap_or(0);
            } else if let Some(p) = pinned {
                // Only the pinned rank's overlap matters: records no deeper than what the
                // index gives it change nothing.
                least = rank_depth_unchecked(&fleet.ranks[p.index], &s.depths)
                    .map_or(0, |(_, d)| d.blocks)
                    .saturating_add(1);
            }
            let now = now.get_or(None);
            if self
                .approx
                .lookup_over(&s.locals, &mut s.marks, now, least, &mut s.depths)
            {
                bump(&self.counters.approx_raised);
            }
        }
        let scorer = scorer!(known_seed);
        let full = |c: &Scored| {
            let i = c.fleet_index as usize;
            let per_tier = scorer.per_tier(i);
            let mut c = Candidate::from_scored(c, fleet.ranks[i].rank, per_tier, &weights, &shape);
            let (pool_credit, pool_blocks) = scorer.pool_extension(c.overlap.blocks);
            if pool_blocks > 0 {
                c.cost = c.cost.with_pool_credit(&weights, pool_credit, pool_blocks);
            }
            if !scorer.preferred.is_empty() {
                c.cost = c
                    .cost
                    .with_preference(scorer.preference(fleet.ranks[i].label_bits));
            }
            c
        };

        let (chosen, decided_by, evidence) = if let Some(p) = pinned {
            let i = p.index;
            if !p.resolved && hints.mode == Mode::Book {
                bookkeeping = Bookkeeping::UntrackedDpRankUnresolved;
            }
            let pinned_by = p.by;
            s.candidates.clear();
            s.candidates.push(scorer.score(i));
            if probe {
                let mut targets = ProbeTargets::new(shape.full_blocks);
                targets.offer(0, &s.candidates[0]);
                self.probe_shared(
                    &fleet,
                    &scorer,
                    targets.targets(),
                    &s.locals,
                    &mut s.candidates,
                );
            }
            let c = full(&s.candidates[0]);
            let ev = (hints.evidence == EvidenceLevel::Full).then(|| vec![c]);
            (c, pinned_by, ev)
        } else {
            if role_fallback.is_some() {
                fallback = role_fallback;
            }
            s.candidates.clear();
            s.candidates.reserve(fleet.ranks.len());
            let warming = self.warming(now);
            let mut targets =
                ProbeTargets::new(if probe { shape.full_blocks } else { 0 }).pruning(prune);
            let unlabelled = scorer.gather(
                role,
                hints.allowed,
                required,
                &mut s.candidates,
                &mut targets,
            );
            // Loads read in vain say the booked-prefill floor may lag the fleet's loads: once
            // they add up to some sixteen reads of every rank, read every rank twice to raise
            // it (a refresh then costs at most an eighth of what triggered it). Each route
            // selecting over the fleet (neither pinned nor session-bound, which read no floor)
            // counts as four such reads as well: a floor left low (by joins, by releases) also
            // weakens what selection prunes before any load is read (the records' least depth,
            // the ranks visited), so it rises within four such routes per rank even when no
            // load is read in vain, at half a read per route.
            s.loaded_losers += u64::from(targets.loaded_losers()) + 4;
            if s.loaded_losers > 16 * fleet.ranks.len() as u64 {
                s.loaded_losers = 0;
                self.refresh_prefill_floor();
            }
            if s.candidates.is_empty() {
                if unlabelled > 0 {
                    bump(&self.counters.no_eligible);
                    return Err(RouteError::NoEligibleWorker { request });
                }
                bump(&self.counters.no_workers);
                return Err(RouteError::NoWorkers { request });
            }
            self.probe_shared(
                &fleet,
                &scorer,
                targets.targets(),
                &s.locals,
                &mut s.candidates,
            );
            let ev = (hints.evidence == EvidenceLevel::Full)
                .then(|| s.candidates.iter().map(full).collect());
            let health = if scorer.health_on {
                filter_unhealthy(&mut s.candidates)
            } else {
                HealthOutcome::Filtered {
                    unreachable: 0,
                    wedged: 0,
                }
            };
            let outcome = match health {
                HealthOutcome::AllVetoed => {
                    bump(&self.counters.all_unhealthy);
                    None
                }
                HealthOutcome::Filtered {
                    unreachable,
                    wedged,
                } => {
                    if unreachable + wedged > 0 {
                        let c = &self.counters;
                        c.vetoed_unreachable
                            .fetch_add(u64::from(unreachable), Ordering::Relaxed);
                        c.vetoed_wedged
                            .fetch_add(u64::from(wedged), Ordering::Relaxed);
                    }
                    Some(if scorer.busy_on {
                        filter_busy(&mut s.candidates)
                    } else {
                        BusyOutcome::Filtered
                    })
                }
            };
            let input = SelectInput {
                candidates: &s.candidates,
                ranks: &fleet.ranks,
                shape: &shape,
                block_size: bs,
                temperature,
            };
            let waits = hints.mode == Mode::Book
                && match gate {
                    Gate::Immediate => false,
                    Gate::IfFree => outcome == Some(BusyOutcome::AllBusy),
                    Gate::Behind => outcome.is_some(),
                };
            if waits {
                let best = s.candidates.iter().map(|c| c.overlap_blocks).max();
                let cached = u64::from(best.unwrap_or(0)) * u64::from(bs);
                return Ok(Routed::Wait {
                    new_prefill_tokens: tokens.saturating_sub(cached),
                });
            }
            let (pick, by) = match outcome {
                None => (
                    s.candidates[LeastLoaded.select(&input, &mut rng)],
                    DecidedBy::FallbackAllUnhealthy,
                ),
                Some(BusyOutcome::AllBusy) => {
                    bump(&self.counters.all_busy);
                    (
                        s.candidates[LeastLoaded.select(&input, &mut rng)],
                        DecidedBy::FallbackAllBusy,
                    )
                }
                Some(BusyOutcome::Filtered) => {
                    let by = match self.selector.kind() {
                        PolicyKind::KvAware => DecidedBy::Cost,
                        k => DecidedBy::Policy(k),
                    };
                    let miss = !s.candidates.iter().any(|c| c.overlap_blocks > 0);
                    let warm = if prune && warming && miss {
                        // Maybe a cache miss while ranks warm up (a pruned rank may hold a
                        // block): warm-up's pick sees every free, healthy candidate (there
                        // are some: a pruned gather keeps the cheapest of them).
                        let all = &mut s.unpruned;
                        all.clear();
                        let mut unpruned = ProbeTargets::new(0);
                        scorer.gather(role, hints.allowed, required, all, &mut unpruned);
                        if scorer.health_on {
                            filter_unhealthy(all);
                        }
                        if scorer.busy_on {
                            filter_busy(all);
                        }
                        self.warm_pick(&fleet, all, now, &mut rng).map(|i| all[i])
                    } else {
                        self.warm_pick(&fleet, &s.candidates, now, &mut rng)
                            .map(|i| s.candidates[i])
                    };
                    match warm {
                        Some(c) => (c, DecidedBy::WarmUp),
                        None => (s.candidates[self.selector.select(&input, &mut rng)], by),
                    }
                }
            };
            (full(&pick), by, ev)
        };
        let t3 = timing.then(Instant::now);

        // 4. Book.
        match bookkeeping {
            Bookkeeping::Booked => {
                let prefill_tokens = match hints.phase {
                    Phase::Decode => 0,
                    _ => tokens - chosen.overlap.cached_tokens,
                };
                self.ledger.book(BookingSpec {
                    request,
                    state: &fleet.ranks[chosen.fleet_index].state,
                    prefill_tokens,
                    block_hashes: &s.locals,
                    tail_blocks: u64::from(tokens % u64::from(bs) != 0),
                    prompt_tokens: tokens,
                    cached_tokens: chosen.overlap.cached_tokens,
                    block_size: bs,
                    expected_output_tokens: hints.expected_output_tokens,
                    session: hints.session,
                    now: now.get_or(t3),
                })?;
                bump(&self.counters.routed);
                let record_ttl = match fleet.ranks[chosen.fleet_index].state.kv_events() {
                    KvEvents::Absent => Some(self.config.approximate.ttl),
                    KvEvents::Published => match self.config.approximate.speculative {
                        Speculative::On { ttl } => Some(ttl),
                        Speculative::Off => None,
                    },
                };
                let entry = &fleet.ranks[chosen.fleet_index];
                if let (Some(ttl), Some(key)) = (record_ttl, entry.index_key) {
                    checkpoint_keys_extend(&s.locals, &mut s.marks, usize::MAX);
                    self.approx
                        .record(&s.marks, chosen.rank, key, now.get_or(t3) + ttl, || {
                            !entry.state.is_retired()
                        });
                }
                if let Some(sid) = hints.session {
                    self.sessions.record(
                        sid,
                        chosen.rank,
                        request,
                        now.get_or(t3),
                        hints.session_close,
                    );
                    match session_routing {
                        Some(SessionRouting::Bound) => bump(&self.counters.sessions_bound),
                        Some(SessionRouting::Rerouted { .. }) => {
                            bump(&self.counters.sessions_rerouted)
                        }
                        _ => {}
                    }
                }
                if fallback.is_some() {
                    bump(&self.counters.prefill_fallbacks);
                }
            }
            Bookkeeping::QueryOnly => bump(&self.counters.query_only),
            Bookkeeping::UntrackedDpRankUnresolved => bump(&self.counters.untracked),
        }

        if let (Some(t), Some(t0), Some(t1), Some(t2), Some(t3)) = (&self.timings, t0, t1, t2, t3) {
            let ns = |a: Instant, b: Instant| b.duration_since(a).as_nanos() as u64;
            lock(t).record(ns(t0, t1), ns(t1, t2), ns(t2, t3));
        }

        Ok(Routed::Decided(Decision {
            request,
            worker: chosen.rank,
            overlap: chosen.overlap,
            cost: chosen.cost,
            load: chosen.load,
            decided_by,
            fallback,
            bookkeeping,
            expected_output_tokens: hints.expected_output_tokens,
            session: session_routing,
            evidence,
        }))
    }

    /// Probes `targets` (candidates whose cost could fall to the cheapest, [`ProbeTargets`])
    /// for the prompt blocks already active on their rank, and lowers their cost by them.
    fn probe_shared(
        &self,
        fleet: &Fleet,
        scorer: &Scorer<'_>,
        targets: &[u32],
        locals: &[LocalHash],
        candidates: &mut [Scored],
    ) {
        let full = scorer.shape.full_blocks;
        let room = |c: &Scored| c.load.prompt_blocks.min(u64::from(full)) as usize;
        for &t in targets {
            let c = &mut candidates[t as usize];
            let blocks = &locals[..room(c)];
            match fleet.ranks[c.fleet_index as usize]
                .state
                .try_shared_prefix_blocks(blocks)
            {
                Some(shared) => {
                    bump(&self.counters.shared_probes);
                    *c = scorer.with_shared(c, shared as u32);
                }
                None => bump(&self.counters.shared_probes_busy),
            }
        }
    }

    /// Nanoseconds from the router's epoch to `t` (0 before it).
    fn ns_since_epoch(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Warms `state` from `now` for the configured duration (no-op with warm-up off).
    fn warm(&self, state: &RankState, now: Instant) {
        if let WarmUp::On { duration, .. } = self.config.warm_up {
            let until = self.ns_since_epoch(now + duration);
            state.warm_until(until);
            self.warm_horizon_ns.fetch_max(until, Ordering::Relaxed);
        }
    }

    /// True while some rank may still be warming up at `now` (warm-up's pick may then look
    /// at every candidate).
    /// The role a request of `phase` is served by, and the fallback taken to find it (with
    /// optional disaggregation and no prefill worker, prefill goes to aggregated workers).
    fn selection_role(&self, fleet: &Fleet, phase: Phase) -> (WorkerRole, Option<Fallback>) {
        let role = match phase {
            Phase::Aggregated => WorkerRole::Aggregated,
            Phase::Prefill => WorkerRole::Prefill,
            Phase::Decode => WorkerRole::Decode,
        };
        if role == WorkerRole::Prefill
            && self.config.disaggregation == Disaggregation::Optional
            && !fleet.ranks.iter().any(|r| r.role == WorkerRole::Prefill)
        {
            return (WorkerRole::Aggregated, Some(Fallback::PrefillToAggregated));
        }
        (role, None)
    }

    fn warming(&self, now: &Now) -> bool {
        matches!(self.config.warm_up, WarmUp::On { .. })
            && self.ns_since_epoch(now.get_or(None)) < self.warm_horizon_ns.load(Ordering::Relaxed)
    }

    /// For a cache miss (no candidate holds a block), with probability `share`, the least
    /// loaded candidate still warming (random ties); `None` otherwise.
    fn warm_pick(
        &self,
        fleet: &Fleet,
        candidates: &[Scored],
        now: &Now,
        rng: &mut crate::rng::Rng,
    ) -> Option<usize> {
        let WarmUp::On { share, .. } = self.config.warm_up else {
            return None;
        };
        let now_ns = self.ns_since_epoch(now.get_or(None));
        if now_ns >= self.warm_horizon_ns.load(Ordering::Relaxed)
            || candidates.iter().any(|c| c.overlap_blocks > 0)
            || rng.unit_f64() >= share
        {
            return None;
        }
        let bs = self.config.block_size;
        let (mut best, mut best_load, mut ties) = (None, u64::MAX, 0u64);
        for (i, c) in candidates.iter().enumerate() {
            if fleet.ranks[c.fleet_index as usize].state.warm_until_ns() <= now_ns {
                continue;
            }
            let load = c.load.load_blocks(bs);
            if load < best_load {
                (best, best_load, ties) = (Some(i), load, 1);
            } else if load == best_load {
                ties += 1;
                if rng.below(ties) == 0 {
                    best = Some(i);
                }
            }
        }
        if best.is_some() {
            bump(&self.counters.warm_up);
        }
        best
    }

    /// Warms every rank whose reported cache is below `low_share` of the fleet's mean and
    /// that is not warming already.
    fn rewarm_low_ranks(&self, now: Instant) {
        let WarmUp::On { low_share, .. } = self.config.warm_up else {
            return;
        };
        let fleet = self.registry.load();
        if low_share <= 0.0 || fleet.ranks.is_empty() {
            return;
        }
        let total: u64 = fleet.ranks.iter().map(|r| r.state.reported_blocks()).sum();
        let mean = total as f64 / fleet.ranks.len() as f64;
        let now_ns = self.ns_since_epoch(now);
        for r in fleet.ranks.iter() {
            if (r.state.reported_blocks() as f64) < low_share * mean
                && r.state.warm_until_ns() <= now_ns
            {
                self.warm(&r.state, now);
                bump(&self.counters.rewarmed);
            }
        }
    }

    /// How many leading blocks the prefix key covers.
    fn prefix_key_blocks(&self) -> usize {
        match self.config.policy {
            crate::config::Policy::PrefixHash { prefix_blocks, .. } => prefix_blocks as usize,
            _ => 1,
        }
    }

    /// The key of the prompt's first [`Router::prefix_key_blocks`] blocks (all of them when
    /// the prompt is shorter; `None` without a full block).
    fn prefix_key(&self, keys: &[u64]) -> Option<u64> {
        let n = self.prefix_key_blocks().min(keys.len());
        n.checked_sub(1).map(|i| keys[i])
    }
}

/// A request admitted by [`Router::submit`]: routed now, or waiting in the queue. The decision
/// stays inline, as [`Router::route`] returns it: boxing it would allocate per admission.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Admission {
    Routed(Decision),
    /// Waiting; its decision arrives through [`Router::poll_released`],
    /// [`Router::take_released`], [`Router::drain_released`] or [`Router::wait`].
    Queued(Ticket),
}

/// A queued request's claim on its decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket {
    pub request: RequestId,
}

/// Where a submitted request stands in the queue ([`Router::ticket_state`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TicketState {
    /// In the queue.
    Waiting,
    /// Released; its outcome waits to be taken.
    Released,
    /// Neither: never queued, taken, or cancelled.
    Unknown,
}

/// What a cancel removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// The request was still waiting: it leaves the queue, nothing was booked.
    Waiting,
    /// It had been released but its decision not taken: the booking is freed.
    Released,
}

/// A queued request, owned (the caller's buffers need not outlive the wait).
#[derive(Debug)]
struct OwnedRequest {
    tokens: Vec<u32>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    allowed: Option<Vec<WorkerId>>,
    required: Vec<(String, String)>,
    preferred: Vec<(String, String, f64)>,
    /// The pool's hits (`None` without an answer: a failed one was counted at admission).
    pool: Option<Vec<std::ops::Range<u32>>>,
    /// The hints with every borrowed field empty; [`OwnedRequest::request`] fills them in.
    hints: RouteHints<'static>,
    eligibility: Eligibility,
}

/// Which ranks may serve a queued request, in a canonical form: its phase, required labels
/// and allowed workers.
///
/// Whether a rank is busy (or marked unhealthy) does not depend on the request asking, so a
/// request waits exactly when every rank its eligibility admits is busy. Two requests of equal
/// eligibility therefore wait or go together, and a request that admits every rank of its
/// phase waits only when the whole phase is busy, and then so does every request of that
/// phase. The queue gives each eligibility a lane of its own, and a release pass tries a lane
/// only until one of its requests waits: a waiting head does not hold back requests that
/// other ranks could serve, and a pass ends once every lane with a request has waited.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Eligibility {
    /// A hash of the rest, compared first.
    key: u64,
    phase: Phase,
    /// Sorted, without repeats.
    required: Vec<(String, String)>,
    /// Sorted, without repeats.
    allowed: Option<Vec<WorkerId>>,
}

impl std::hash::Hash for Eligibility {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key.hash(state);
    }
}

impl Eligibility {
    fn of(req: &RouteRequest<'_>) -> Self {
        let h = &req.hints;
        let mut required: Vec<(String, String)> = h
            .required
            .iter()
            .map(|l| (l.key.to_owned(), l.value.to_owned()))
            .collect();
        required.sort();
        required.dedup();
        let allowed = h.allowed.map(|a| {
            let mut a = a.to_vec();
            a.sort();
            a.dedup();
            a
        });
        let key = {
            use std::hash::{Hash, Hasher};
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            (h.phase as u8, &required, &allowed).hash(&mut hasher);
            hasher.finish()
        };
        Eligibility {
            key,
            phase: h.phase,
            required,
            allowed,
        }
    }

    /// True when it admits every rank of its phase.
    fn whole_phase(&self) -> bool {
        self.required.is_empty() && self.allowed.is_none()
    }
}

/// Label slices rebuilt from an owned request's strings, for one route.
#[derive(Debug, Default)]
struct LabelBufs<'a> {
    required: Vec<Label<'a>>,
    preferred: Vec<PreferredLabel<'a>>,
}

impl OwnedRequest {
    fn new(req: &RouteRequest<'_>) -> Self {
        let h = &req.hints;
        OwnedRequest {
            tokens: req.tokens.to_vec(),
            lora_name: h.lora_name.map(str::to_owned),
            cache_salt: h.cache_salt.map(str::to_owned),
            allowed: h.allowed.map(<[WorkerId]>::to_vec),
            required: h
                .required
                .iter()
                .map(|l| (l.key.to_owned(), l.value.to_owned()))
                .collect(),
            preferred: h
                .preferred
                .iter()
                .map(|p| (p.label.key.to_owned(), p.label.value.to_owned(), p.weight))
                .collect(),
            pool: match h.pool {
                PoolHits::Hits(r) => Some(r.to_vec()),
                PoolHits::None | PoolHits::Failed => None,
            },
            hints: RouteHints {
                required: &[],
                preferred: &[],
                pool: PoolHits::None,
                session: h.session,
                session_close: h.session_close,
                phase: h.phase,
                pinned: h.pinned,
                mode: h.mode,
                lora_name: None,
                cache_salt: None,
                priority_jump: h.priority_jump,
                priority_class: h.priority_class,
                expected_output_tokens: h.expected_output_tokens,
                allowed: None,
                overrides: h.overrides,
                evidence: h.evidence,
            },
            eligibility: Eligibility::of(req),
        }
    }

    fn request<'a>(&'a self, id: RequestId, bufs: &'a mut LabelBufs<'a>) -> RouteRequest<'a> {
        bufs.required.extend(
            self.required
                .iter()
                .map(|(k, v)| Label { key: k, value: v }),
        );
        bufs.preferred
            .extend(self.preferred.iter().map(|(k, v, w)| PreferredLabel {
                label: Label { key: k, value: v },
                weight: *w,
            }));
        RouteRequest {
            id,
            tokens: &self.tokens,
            hints: RouteHints {
                lora_name: self.lora_name.as_deref(),
                cache_salt: self.cache_salt.as_deref(),
                allowed: self.allowed.as_deref(),
                required: &bufs.required,
                preferred: &bufs.preferred,
                pool: self.pool.as_deref().map_or(PoolHits::None, PoolHits::Hits),
                ..self.hints
            },
        }
    }
}

/// Queue depth, waits and outcomes ([`Router::queue_stats`]).
#[derive(Debug, Clone)]
pub struct QueueStats {
    /// Requests waiting now.
    pub depth: usize,
    /// Their prompt tokens.
    pub queued_tokens: u64,
    pub cap_tokens: u64,
    /// Released decisions not yet taken.
    pub released_untaken: usize,
    pub enqueued: u64,
    /// Left the queue with a decision (booked) or an error.
    pub released: u64,
    /// Of those, released with an error (e.g. no eligible worker any more).
    pub released_failed: u64,
    /// Refused at the cap ([`RouteError::ResourceExhausted`]).
    pub rejected: u64,
    pub cancelled_waiting: u64,
    pub cancelled_released: u64,
    /// Time from submit to release, µs, for every released request.
    pub wait_us: Histogram<u64>,
}

#[derive(Debug)]
struct QueueState {
    queue: AdmissionQueue<OwnedRequest>,
    released: HashMap<RequestId, Result<Decision, RouteError>>,
    wakers: HashMap<RequestId, Waker>,
    wait_us: Histogram<u64>,
    enqueued: u64,
    released_n: u64,
    released_failed: u64,
    rejected: u64,
    cancelled_waiting: u64,
    cancelled_released: u64,
    /// The queue's lanes: one per eligibility with a request waiting.
    lanes: HashMap<Eligibility, usize>,
    /// By lane: its eligibility's phase (`None`: a free lane).
    lane_phase: Vec<Option<Phase>>,
    /// By lane: its eligibility, to forget it when the lane empties.
    lane_keys: Vec<Option<Eligibility>>,
    free_lanes: Vec<usize>,
    /// By lane, for one release pass: found waiting.
    blocked: Vec<bool>,
}

impl QueueState {
    fn new(order: crate::config::QueueOrder, cap: u64) -> Self {
        QueueState {
            queue: AdmissionQueue::new(order, cap),
            released: HashMap::new(),
            wakers: HashMap::new(),
            wait_us: histogram_upto(1 << 26),
            enqueued: 0,
            released_n: 0,
            released_failed: 0,
            rejected: 0,
            cancelled_waiting: 0,
            cancelled_released: 0,
            lanes: HashMap::new(),
            lane_phase: Vec::new(),
            lane_keys: Vec::new(),
            free_lanes: Vec::new(),
            blocked: Vec::new(),
        }
    }

    /// The lane of requests of eligibility `e`.
    fn lane_for(&mut self, e: &Eligibility) -> usize {
        if let Some(&lane) = self.lanes.get(e) {
            return lane;
        }
        let lane = self.free_lanes.pop().unwrap_or(self.lane_phase.len());
        if lane == self.lane_phase.len() {
            self.lane_phase.push(None);
            self.lane_keys.push(None);
        }
        self.lane_phase[lane] = Some(e.phase);
        self.lane_keys[lane] = Some(e.clone());
        self.lanes.insert(e.clone(), lane);
        lane
    }

    /// Forgets `lane` once nothing waits in it.
    fn lane_left(&mut self, lane: usize) {
        if self.queue.lane_len(lane) > 0 {
            return;
        }
        if let Some(e) = self.lane_keys.get_mut(lane).and_then(Option::take) {
            self.lanes.remove(&e);
            self.lane_phase[lane] = None;
            self.free_lanes.push(lane);
        }
    }

    /// Hands a released request's outcome to whoever waits for it.
    fn deliver(&mut self, request: RequestId, outcome: Result<Decision, RouteError>) {
        self.released_n += 1;
        if outcome.is_err() {
            self.released_failed += 1;
        }
        self.released.insert(request, outcome);
        if let Some(w) = self.wakers.remove(&request) {
            w.wake();
        }
    }
}

/// The admission queue and its waiters.
#[derive(Debug)]
struct Queue {
    state: Mutex<QueueState>,
    /// Requests waiting, readable without the lock (lifecycle calls release only when > 0).
    depth: AtomicUsize,
    /// Released outcomes not yet taken, readable without the lock.
    untaken: AtomicUsize,
    /// Arrival times are seconds since this instant.
    epoch: Instant,
}

impl Router {
    /// Admits `req`: routes and books it now when an eligible rank is free (or the request is
    /// pinned, query-only, or queueing is off); otherwise, with [`Queueing::On`], queues it
    /// behind the requests already waiting, in the configured order. Past the cap of queued
    /// prompt tokens it is rejected with the retryable [`RouteError::ResourceExhausted`].
    pub fn submit(&self, req: &RouteRequest<'_>) -> Result<Admission, RouteError> {
        self.submit_at(req, Instant::now())
    }

    /// [`Router::submit`] at a given time.
    pub fn submit_at(&self, req: &RouteRequest<'_>, now: Instant) -> Result<Admission, RouteError> {
        let Some(q) = &self.queue else {
            return self.route_at(req, now).map(Admission::Routed);
        };
        if !req.hints.priority_jump.is_finite() {
            bump(&self.counters.invalid_hints);
            return Err(RouteError::InvalidHint {
                request: req.id,
                field: "priority_jump",
                reason: "must be finite",
            });
        }
        // Nothing waits and no outcome is untaken: route without the queue's lock (a booked
        // duplicate id is refused by the ledger), and take the lock only to wait.
        let mut waits = None;
        if q.depth.load(Ordering::Relaxed) == 0 && q.untaken.load(Ordering::Relaxed) == 0 {
            match self.route_gated(req, &Now::at(now), Gate::IfFree)? {
                Routed::Decided(d) => return Ok(Admission::Routed(d)),
                Routed::Wait { new_prefill_tokens } => waits = Some(new_prefill_tokens),
            }
        }
        let mut st = lock(&q.state);
        if st.queue.contains(req.id)
            || st.released.contains_key(&req.id)
            || self.ledger.rank_of(req.id).is_some()
        {
            bump(&self.counters.duplicate_admissions);
            return Err(RouteError::Load(LoadError::DuplicateRequest {
                request: req.id,
            }));
        }
        let new_prefill_tokens = match waits {
            Some(n) => n,
            None => {
                let gate = if st.queue.is_empty() {
                    Gate::IfFree
                } else {
                    Gate::Behind
                };
                match self.route_gated(req, &Now::at(now), gate)? {
                    Routed::Decided(d) => return Ok(Admission::Routed(d)),
                    Routed::Wait { new_prefill_tokens } => new_prefill_tokens,
                }
            }
        };
        let tokens = req.tokens.len() as u64;
        let item = OwnedRequest::new(req);
        let lane = st.lane_for(&item.eligibility);
        let waiting = Waiting {
            request: req.id,
            tokens,
            enqueued_at: now,
            lane,
            item,
        };
        let order = OrderInput {
            class: req.hints.priority_class,
            priority_jump: req.hints.priority_jump,
            arrival_secs: now.saturating_duration_since(q.epoch).as_secs_f64(),
            new_prefill_tokens,
        };
        let pushed = st.queue.push(waiting, order);
        if pushed.is_err() {
            st.lane_left(lane);
        }
        match pushed {
            Ok(()) => {
                st.enqueued += 1;
                q.depth.store(st.queue.len(), Ordering::Relaxed);
            }
            Err(Refused::OverCap(over, _)) => {
                st.rejected += 1;
                return Err(RouteError::ResourceExhausted {
                    request: req.id,
                    request_tokens: tokens,
                    queued_tokens: over.queued_tokens,
                    cap_tokens: over.cap_tokens,
                });
            }
            Err(Refused::Duplicate(_)) => {
                return Err(RouteError::Load(LoadError::DuplicateRequest {
                    request: req.id,
                }));
            }
        }
        // Capacity may have freed between the check and the push.
        self.release_locked(q, &mut st, now);
        Ok(Admission::Queued(Ticket { request: req.id }))
    }

    /// Releases queued requests in order: each that can be booked on a free eligible rank (or
    /// fails outright) leaves the queue; one that must still wait keeps its place, and the
    /// requests behind it that no free rank could serve either (the same eligibility, or its
    /// whole phase busy) are passed over untried. Returns how many left the queue. Frees, prefill completions,
    /// joins, leaves and health changes call this themselves; call it to drive the queue from
    /// a timer as well.
    pub fn release_queued(&self, now: Instant) -> usize {
        match &self.queue {
            Some(q) if q.depth.load(Ordering::Relaxed) > 0 => {
                let mut st = lock(&q.state);
                self.release_locked(q, &mut st, now)
            }
            _ => 0,
        }
    }

    fn release_locked(&self, q: &Queue, st: &mut QueueState, now: Instant) -> usize {
        let mut n = 0;
        // The lanes this pass found waiting; it ends once every lane with a request is one.
        // Each step tries the first request of the lanes not found waiting: it is either
        // taken or its lane is, so the pass never steps over a waiting lane's requests.
        st.blocked.clear();
        st.blocked.resize(st.lane_phase.len(), false);
        let mut blocked = 0;
        while blocked < st.queue.nonempty_lanes() {
            let Some((place, w)) = st.queue.first_head(|lane| st.blocked[lane]) else {
                break;
            };
            let lane = w.lane;
            let (phase, whole_phase) = (w.item.eligibility.phase, w.item.eligibility.whole_phase());
            let mut bufs = LabelBufs::default();
            let req = w.item.request(w.request, &mut bufs);
            let outcome = match self.route_gated(&req, &Now::at(now), Gate::IfFree) {
                Ok(Routed::Wait { .. }) => {
                    // Every request of a lane whose ranks are all busy waits too; so does
                    // every request of the phase when one that admits all of it waits.
                    st.blocked[lane] = true;
                    blocked += 1;
                    if whole_phase {
                        for l in 0..st.lane_phase.len() {
                            if !st.blocked[l]
                                && st.lane_phase[l] == Some(phase)
                                && st.queue.lane_len(l) > 0
                            {
                                st.blocked[l] = true;
                                blocked += 1;
                            }
                        }
                    }
                    continue;
                }
                Ok(Routed::Decided(d)) => Ok(d),
                Err(e) => Err(e),
            };
            let Some(w) = st.queue.take(place) else {
                // Not reached: the place was a lane head under this lock.
                break;
            };
            st.lane_left(w.lane);
            let waited = now.saturating_duration_since(w.enqueued_at);
            record(
                &mut st.wait_us,
                u64::try_from(waited.as_micros()).unwrap_or(u64::MAX),
            );
            st.deliver(w.request, outcome);
            n += 1;
        }
        q.depth.store(st.queue.len(), Ordering::Relaxed);
        q.untaken.store(st.released.len(), Ordering::Relaxed);
        n
    }

    /// The released outcome of a queued request, if it has one; registers `waker` to be woken
    /// at release otherwise. An outcome is handed out once; after that (or for a request that
    /// never queued, or was cancelled) the answer is [`RouteError::NotQueued`].
    pub fn poll_released(
        &self,
        request: RequestId,
        waker: Option<&Waker>,
    ) -> Poll<Result<Decision, RouteError>> {
        let Some(q) = &self.queue else {
            return Poll::Ready(Err(RouteError::NotQueued { request }));
        };
        let mut st = lock(&q.state);
        if let Some(outcome) = st.released.remove(&request) {
            q.untaken.store(st.released.len(), Ordering::Relaxed);
            return Poll::Ready(outcome);
        }
        if !st.queue.contains(request) {
            return Poll::Ready(Err(RouteError::NotQueued { request }));
        }
        if let Some(w) = waker {
            match st.wakers.get_mut(&request) {
                Some(old) if old.will_wake(w) => {}
                Some(old) => old.clone_from(w),
                None => {
                    st.wakers.insert(request, w.clone());
                }
            }
        }
        Poll::Pending
    }

    /// Where `request` stands, without taking anything.
    pub fn ticket_state(&self, request: RequestId) -> TicketState {
        let Some(q) = &self.queue else {
            return TicketState::Unknown;
        };
        let st = lock(&q.state);
        if st.queue.contains(request) {
            TicketState::Waiting
        } else if st.released.contains_key(&request) {
            TicketState::Released
        } else {
            TicketState::Unknown
        }
    }

    /// The released outcome of a queued request, once; `None` while it waits.
    pub fn take_released(&self, request: RequestId) -> Option<Result<Decision, RouteError>> {
        match self.poll_released(request, None) {
            Poll::Ready(r) => Some(r),
            Poll::Pending => None,
        }
    }

    /// Hands every released, untaken outcome to `f`; returns how many.
    pub fn drain_released(
        &self,
        mut f: impl FnMut(RequestId, Result<Decision, RouteError>),
    ) -> usize {
        let Some(q) = &self.queue else { return 0 };
        let taken: Vec<_> = {
            let mut st = lock(&q.state);
            q.untaken.store(0, Ordering::Relaxed);
            st.released.drain().collect()
        };
        let n = taken.len();
        for (id, outcome) in taken {
            f(id, outcome);
        }
        n
    }

    /// Withdraws a queued request exactly once: a waiting request leaves the queue; a released
    /// one whose decision was not taken has its booking freed. A second cancel (or one for a
    /// request whose decision was taken: free it instead) is [`RouteError::NotQueued`].
    pub fn cancel_queued(&self, request: RequestId) -> Result<Cancelled, RouteError> {
        let Some(q) = &self.queue else {
            return Err(RouteError::NotQueued { request });
        };
        let mut st = lock(&q.state);
        st.wakers.remove(&request);
        if let Some(w) = st.queue.remove(request) {
            st.lane_left(w.lane);
            st.cancelled_waiting += 1;
            q.depth.store(st.queue.len(), Ordering::Relaxed);
            return Ok(Cancelled::Waiting);
        }
        match st.released.remove(&request) {
            Some(outcome) => {
                st.cancelled_released += 1;
                q.untaken.store(st.released.len(), Ordering::Relaxed);
                drop(st);
                if let Ok(d) = outcome {
                    if d.bookkeeping == Bookkeeping::Booked {
                        // An error means the booking already went (its worker left, or it
                        // expired); the ledger counted it, and the cancel stands.
                        let _ = self.free(request);
                    }
                }
                Ok(Cancelled::Released)
            }
            None => Err(RouteError::NotQueued { request }),
        }
    }

    /// A future of a queued request's outcome, for async embedders (any executor: it only
    /// registers the task's waker). Dropping it before it resolves cancels the request.
    pub fn wait<R: Deref<Target = Router>>(router: R, ticket: Ticket) -> Released<R> {
        Released {
            router,
            request: ticket.request,
            done: false,
        }
    }

    /// Requests waiting in the queue now (one relaxed load; 0 without a queue).
    pub fn queue_depth(&self) -> usize {
        self.queue
            .as_ref()
            .map_or(0, |q| q.depth.load(Ordering::Relaxed))
    }

    /// Queue depth, waits and outcomes (`None` unless [`Queueing::On`]).
    pub fn queue_stats(&self) -> Option<QueueStats> {
        let q = self.queue.as_ref()?;
        let st = lock(&q.state);
        Some(QueueStats {
            depth: st.queue.len(),
            queued_tokens: st.queue.queued_tokens(),
            cap_tokens: st.queue.cap_tokens(),
            released_untaken: st.released.len(),
            enqueued: st.enqueued,
            released: st.released_n,
            released_failed: st.released_failed,
            rejected: st.rejected,
            cancelled_waiting: st.cancelled_waiting,
            cancelled_released: st.cancelled_released,
            wait_us: st.wait_us.clone(),
        })
    }

    /// Lets queued requests go after load freed (cheap when nothing waits).
    fn load_freed(&self) {
        if self
            .queue
            .as_ref()
            .is_some_and(|q| q.depth.load(Ordering::Relaxed) > 0)
        {
            self.release_queued(Instant::now());
        }
    }
}

/// The outcome of a queued request, as a future ([`Router::wait`]). Resolves once; dropped
/// unresolved, it cancels the request (and frees it if it was already released).
#[derive(Debug)]
pub struct Released<R: Deref<Target = Router>> {
    router: R,
    request: RequestId,
    done: bool,
}

impl<R: Deref<Target = Router> + Unpin> Future for Released<R> {
    type Output = Result<Decision, RouteError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let out = self.router.poll_released(self.request, Some(cx.waker()));
        if out.is_ready() {
            self.done = true;
        }
        out
    }
}

impl<R: Deref<Target = Router>> Drop for Released<R> {
    fn drop(&mut self) {
        if !self.done {
            // NotQueued here means it was already taken or cancelled elsewhere.
            let _ = self.router.cancel_queued(self.request);
        }
    }
}

/// Clips `ranges` to `full_blocks`, sorts and merges them into `out`; `Err` (and `out` empty)
/// when a range is inverted.
fn merge_pool_ranges(
    ranges: &[std::ops::Range<u32>],
    full_blocks: u32,
    out: &mut Vec<(u32, u32)>,
) -> Result<(), ()> {
    out.clear();
    for r in ranges {
        if r.start > r.end {
            out.clear();
            return Err(());
        }
        let (a, b) = (r.start.min(full_blocks), r.end.min(full_blocks));
        if a < b {
            out.push((a, b));
        }
    }
    out.sort_unstable();
    let mut merged = 0;
    for i in 0..out.len() {
        let (a, b) = out[i];
        if merged > 0 && a <= out[merged - 1].1 {
            out[merged - 1].1 = out[merged - 1].1.max(b);
        } else {
            out[merged] = (a, b);
            merged += 1;
        }
    }
    out.truncate(merged);
    Ok(())
}

/// [`CostTerms::credit_needed`] by decay flag, at one cheapest cost.
struct CreditBar {
    cheapest: f64,
    need: [f64; 2],
}

impl Default for CreditBar {
    /// Before any candidate: no bar.
    fn default() -> Self {
        CreditBar {
            cheapest: f64::INFINITY,
            need: [f64::NEG_INFINITY; 2],
        }
    }
}

impl CreditBar {
    fn at(w: &Weights, shape: &RequestShape, cheapest: f64, booked_floor: u64) -> Self {
        CreditBar {
            cheapest,
            need: [false, true]
                .map(|d| CostTerms::credit_needed(w, shape, cheapest, d, booked_floor)),
        }
    }
}

/// Everything one request's ranks are scored against.
struct Scorer<'a> {
    /// The shared pool's hits, disjoint and sorted (empty: no pool credit).
    pool: &'a [(u32, u32)],
    /// Credit per pool block.
    pool_credit: f64,
    /// The request's preferred labels, as (label bit, weight in blocks).
    preferred: &'a [(u64, f64)],
    fleet: &'a Fleet,
    /// The match, by the index's rank ids.
    depths: &'a RankDepths,
    /// The fleet index of the match's deepest rank, scored first where that helps.
    seed: Option<usize>,
    /// The rank a pruning gather scores first, when already chosen
    /// ([`Scorer::least_after_seed`]).
    known_seed: Option<usize>,
    /// False while no booking's prompt load is decayed ([`Ledger::prompt_decay_anywhere`]).
    decay_anywhere: bool,
    /// Prefill tokens every rank has booked at least ([`Ledger::prefill_floor`]).
    booked_floor: u64,
    /// The request's side of every rank's floor ([`CostTerms::bound_floor`]).
    floor_terms: FloorTerms,
    weights: &'a Weights,
    shape: &'a RequestShape,
    busy: &'a crate::config::BusyThresholds,
    /// False when every threshold is off: then no rank is busy, and the worker configs are
    /// never visited.
    busy_on: bool,
    /// False when no worker is marked: then every rank reads as healthy without a load.
    health_on: bool,
}

impl Scorer<'_> {
    /// True when pool hits, preferred labels or health marks apply: scoring then does more
    /// than the cost and the busy check.
    fn extras(&self) -> bool {
        self.health_on || !self.pool.is_empty() || !self.preferred.is_empty()
    }

    /// The overlap credit and the blocks of rank `i` of the fleet.
    #[inline(always)]
    fn overlap(&self, i: usize) -> (f64, u32) {
        self.credit_of(rank_depth(&self.fleet.ranks[i], self.depths))
    }

    /// The overlap credit and the blocks of a rank's depth ([`rank_depth`]).
    #[inline(always)]
    fn credit_of(&self, depth: Option<(RankKey, crate::index::Depth)>) -> (f64, u32) {
        let Some((key, d)) = depth else {
            return (0.0, 0);
        };
        let credit = match d.tier {
            // The sum over tiers with the others at 0: the same to the bit.
            Some(t) => f64::from(d.blocks) * self.weights.credits[t.index()],
            None => CostTerms::credit_of(self.weights, &self.depths.per_tier(key.id)),
        };
        (credit, d.blocks)
    }

    /// The blocks of rank `i` of the fleet by the fastest tier each is held in.
    fn per_tier(&self, i: usize) -> [u32; StorageTier::COUNT] {
        match rank_depth(&self.fleet.ranks[i], self.depths) {
            Some((key, _)) => self.depths.per_tier(key.id),
            None => [0; StorageTier::COUNT],
        }
    }

    /// Rank `i` of the fleet as selection sees it.
    fn score(&self, i: usize) -> Scored {
        if self.extras() {
            self.score_as::<true>(i)
        } else {
            self.score_as::<false>(i)
        }
    }

    /// True when rank `r` may serve a request for `role` (with `EXTRAS`: among `allowed`
    /// workers, carrying the `required` labels).
    #[inline(always)]
    fn eligible<const EXTRAS: bool>(
        r: &RankEntry,
        role: WorkerRole,
        allowed: Option<&[WorkerId]>,
        required: u64,
    ) -> bool {
        r.role == role
            && (!EXTRAS
                || (allowed.is_none_or(|a| a.contains(&r.rank.worker))
                    && r.label_bits & required == required))
    }

    /// The rank scored first where floors prune: the deepest (without extras, the walk's
    /// deepest; with them, the deepest eligible), if eligible.
    fn pick_seed<const EXTRAS: bool>(
        &self,
        role: WorkerRole,
        allowed: Option<&[WorkerId]>,
        required: u64,
    ) -> Option<usize> {
        let eligible = |r: &RankEntry| Self::eligible::<EXTRAS>(r, role, allowed, required);
        if EXTRAS {
            // The deepest eligible rank: its credit is likely the highest. The walk's deepest
            // few first, then every rank.
            let fleet = self.fleet;
            let known = self.depths.deepest_ids().find_map(|id| {
                let i = *fleet.by_index_id.get(id as usize)? as usize;
                fleet.ranks.get(i).filter(|r| eligible(r)).map(|_| i)
            });
            if known.is_some() {
                return known;
            }
            let mut best = (0u32, None);
            for (i, r) in self.fleet.ranks.iter().enumerate() {
                if let Some((_, d)) = rank_depth_unchecked(r, self.depths) {
                    if d.blocks > best.0 && eligible(r) {
                        best = (d.blocks, Some(i));
                    }
                }
            }
            best.1
        } else {
            self.seed.filter(|&i| eligible(&self.fleet.ranks[i]))
        }
    }

    /// The seed a pruning gather would score first ([`Scorer::pick_seed`]), and the fewest
    /// blocks a rank needs to beat it ([`Scorer::least_winning_blocks`]), from one scoring of
    /// the seed (into `scratch`, cleared).
    fn least_after_seed(
        &self,
        role: WorkerRole,
        allowed: Option<&[WorkerId]>,
        required: u64,
        scratch: &mut Vec<Scored>,
    ) -> (Option<usize>, Option<u32>) {
        let extras = self.extras() || allowed.is_some() || required != 0;
        let seed = if extras {
            self.pick_seed::<true>(role, allowed, required)
        } else {
            self.pick_seed::<false>(role, allowed, required)
        };
        let Some(i) = seed else {
            return (None, None);
        };
        let mut targets = ProbeTargets::new(self.shape.full_blocks).pruning(true);
        let mut bar = CreditBar::default();
        scratch.clear();
        if extras {
            self.offer_rank::<true>(i, true, &mut bar, &mut targets, scratch);
        } else {
            self.offer_rank::<false>(i, true, &mut bar, &mut targets, scratch);
        }
        scratch.clear();
        (seed, self.least_winning_blocks(&targets))
    }

    /// Scores every rank of `role` that `allowed` and `required` admit into `out`, offering
    /// each to `targets`; returns how many lacked a required label. One loop per kind of
    /// request, so that a plain one pays for no condition it does not use.
    fn gather(
        &self,
        role: WorkerRole,
        allowed: Option<&[WorkerId]>,
        required: u64,
        out: &mut Vec<Scored>,
        targets: &mut ProbeTargets,
    ) -> usize {
        if self.extras() || allowed.is_some() || required != 0 {
            self.gather_as::<true>(role, allowed, required, out, targets)
        } else {
            self.gather_as::<false>(role, allowed, required, out, targets)
        }
    }

    #[inline(always)]
    fn gather_as<const EXTRAS: bool>(
        &self,
        role: WorkerRole,
        allowed: Option<&[WorkerId]>,
        required: u64,
        out: &mut Vec<Scored>,
        targets: &mut ProbeTargets,
    ) -> usize {
        // The request's numbers as locals: the loop's stores into `out` cannot reach them, so
        // what derives from them (the block size's reciprocal, say) is computed once.
        let (weights, shape) = (*self.weights, *self.shape);
        let this = Scorer {
            weights: &weights,
            shape: &shape,
            ..*self
        };
        // A rank whose bound's floor cannot win is not scored at all; the rank likeliest to
        // be cheapest goes first, as it sets a low cheapest cost early.
        let floors = targets.prunes();
        let eligible = |r: &RankEntry| Self::eligible::<EXTRAS>(r, role, allowed, required);
        let seed = if floors {
            this.known_seed
                .or_else(|| this.pick_seed::<EXTRAS>(role, allowed, required))
        } else {
            None
        };
        let mut bar = CreditBar::default();
        if let Some(i) = seed {
            this.offer_rank::<EXTRAS>(i, floors, &mut bar, targets, out);
        }
        // Once a free, healthy rank set the cheapest cost, a rank can win only with some
        // least overlap: the ranks the match gave that many blocks are read off the match's
        // table, and no other rank is visited. (A candidate exists then: the one that set
        // the cost.)
        if floors {
            if let Some(least) = this.least_winning_blocks(targets) {
                for id in this.depths.ids_with_at_least(least) {
                    let Some(&i) = this.fleet.by_index_id.get(id as usize) else {
                        continue;
                    };
                    let i = i as usize;
                    match this.fleet.ranks.get(i) {
                        Some(r) if Some(i) != seed && eligible(r) => {
                            this.offer_rank::<EXTRAS>(i, floors, &mut bar, targets, out);
                        }
                        _ => {}
                    }
                }
                return 0;
            }
        }
        let mut unlabelled = 0;
        for (i, r) in this.fleet.ranks.iter().enumerate() {
            if r.role != role || Some(i) == seed {
                continue;
            }
            if EXTRAS {
                if allowed.is_some_and(|a| !a.contains(&r.rank.worker)) {
                    continue;
                }
                if r.label_bits & required != required {
                    unlabelled += 1;
                    continue;
                }
            }
            this.offer_rank::<EXTRAS>(i, floors, &mut bar, targets, out);
        }
        unlabelled
    }

    /// The fewest leading blocks a rank must hold to be worth scoring, now that a free,
    /// healthy rank has set the cheapest cost of `targets`: a rank of `b` blocks has at most
    /// `b` times the highest tier credit, plus the longest pool run's credit, of credit; and
    /// at most the sum of the preferred labels' weights of preference. With less credit than
    /// [`CostTerms::credit_needed`] asks to reach the bar plus that preference, its floor is
    /// above the bar ([`ProbeTargets::cannot_win`]) whatever its load. One block of slack
    /// covers rounding. `None` when no cost is set yet, when a rank holding nothing might
    /// still win, or when holding blocks earns no credit: every rank is visited then.
    fn least_winning_blocks(&self, targets: &ProbeTargets) -> Option<u32> {
        let bar = targets.bar();
        if !bar.is_finite() {
            return None;
        }
        let per_block = self
            .weights
            .credits
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        // (NaN credits too.)
        if per_block.is_nan() || per_block <= 0.0 {
            return None;
        }
        let preference: f64 = self.preferred.iter().map(|&(_, w)| w).sum();
        let longest = self.pool.iter().map(|&(a, b)| b - a).max().unwrap_or(0);
        let pool = (f64::from(longest) * self.pool_credit).max(0.0);
        // With decay anywhere, the lower floor of a decaying rank.
        let need = CostTerms::credit_needed(
            self.weights,
            self.shape,
            bar + preference,
            self.decay_anywhere,
            self.booked_floor,
        );
        if need == f64::INFINITY {
            return Some(u32::MAX);
        }
        let least = ((need - pool) / per_block).ceil() - 1.0;
        if least.is_nan() || least < 1.0 {
            return None;
        }
        Some(if least >= f64::from(u32::MAX) {
            u32::MAX
        } else {
            least as u32
        })
    }

    /// Scores rank `i` into `out` unless `targets` refuse it; with `floors`, first checks that
    /// it can win at all ([`ProbeTargets::cannot_win`]).
    #[inline(always)]
    fn offer_rank<const EXTRAS: bool>(
        &self,
        i: usize,
        floors: bool,
        bar: &mut CreditBar,
        targets: &mut ProbeTargets,
        out: &mut Vec<Scored>,
    ) {
        let r = &self.fleet.ranks[i];
        if floors && !EXTRAS {
            // The floor's test as a bar on the credit, moved only when the cheapest cost
            // falls: one comparison a rank.
            let credit = self.credit_of(rank_depth_unchecked(r, self.depths)).0;
            let decay = self.decay_anywhere && r.state.prompt_decay_pending();
            let cheapest = targets.cheapest();
            if cheapest != bar.cheapest {
                *bar = CreditBar::at(self.weights, self.shape, cheapest, self.booked_floor);
            }
            if credit < bar.need[usize::from(decay)] {
                return;
            }
        } else if floors {
            // The credit and preference are read once, for the floor and then the cost.
            // Neither the rank's load nor (while no booking decays its prompt) its decay is
            // read before the floor's test.
            let (own_credit, blocks) = self.overlap(i);
            let credit = self.with_pool::<EXTRAS>(own_credit, blocks);
            let preference = self.preference_of::<EXTRAS>(r);
            let decay = self.decay_anywhere && r.state.prompt_decay_pending();
            let floor = self.floor_terms.floor(credit, decay);
            if targets.cannot_win(floor - preference) {
                return;
            }
            let load = r.state.load();
            let cost = CostTerms::total_of(self.weights, self.shape, &load, credit, 0) - preference;
            // The bound itself, now that the load is read: the rest of the scoring (busy and
            // health marks) is not done for a rank that cannot win.
            if targets.bound_cannot_win(cost, load.prompt_blocks) {
                targets.note_loaded_loser();
                return;
            }
            let c = self.scored::<EXTRAS>(i, r, load, cost, blocks);
            if targets.offer(out.len(), &c) {
                out.push(c);
            }
            return;
        }
        let c = self.score_as::<EXTRAS>(i);
        if targets.offer(out.len(), &c) {
            out.push(c);
        }
    }

    /// Rank `i` scored; without `EXTRAS`, pool hits, preferences and health marks are known
    /// not to apply.
    #[inline(always)]
    fn score_as<const EXTRAS: bool>(&self, i: usize) -> Scored {
        self.score_with::<EXTRAS>(i, self.overlap(i))
    }

    /// [`Scorer::score_as`] with the rank's overlap (credit, blocks) already read.
    #[inline(always)]
    fn score_with<const EXTRAS: bool>(&self, i: usize, (own_credit, blocks): (f64, u32)) -> Scored {
        let r = &self.fleet.ranks[i];
        let load = r.state.load();
        let cost = self.cost_with::<EXTRAS>(r, &load, own_credit, blocks);
        self.scored::<EXTRAS>(i, r, load, cost, blocks)
    }

    /// The cost of rank `r` under `load`, with its own overlap credit and blocks.
    #[inline(always)]
    fn cost_with<const EXTRAS: bool>(
        &self,
        r: &RankEntry,
        load: &LoadView,
        own_credit: f64,
        blocks: u32,
    ) -> f64 {
        let credit = self.with_pool::<EXTRAS>(own_credit, blocks);
        let cost = CostTerms::total_of(self.weights, self.shape, load, credit, 0);
        if EXTRAS {
            self.less_preference(cost, r.label_bits)
        } else {
            cost
        }
    }

    /// A rank's own overlap credit with the pool's credit beyond it (with `EXTRAS`).
    #[inline(always)]
    fn with_pool<const EXTRAS: bool>(&self, own_credit: f64, blocks: u32) -> f64 {
        if EXTRAS && !self.pool.is_empty() {
            own_credit + self.pool_extension(blocks).0
        } else {
            own_credit
        }
    }

    /// What rank `r`'s preferred labels take off its cost (with `EXTRAS`; 0 without).
    #[inline(always)]
    fn preference_of<const EXTRAS: bool>(&self, r: &RankEntry) -> f64 {
        if EXTRAS && !self.preferred.is_empty() {
            self.preference(r.label_bits)
        } else {
            0.0
        }
    }

    /// Rank `i` (`r`) scored, from its load and cost.
    #[inline(always)]
    fn scored<const EXTRAS: bool>(
        &self,
        i: usize,
        r: &RankEntry,
        load: LoadView,
        cost: f64,
        blocks: u32,
    ) -> Scored {
        Scored {
            fleet_index: i as u32,
            overlap_blocks: blocks,
            busy: if self.busy_on {
                Busy::of(&load, &self.fleet.workers[r.worker].config, self.busy)
            } else {
                Busy::Free
            },
            health: if EXTRAS && self.health_on {
                r.state.health()
            } else {
                Health::Healthy
            },
            shared_blocks: 0,
            cost,
            load,
        }
    }

    /// The pool's credit and blocks for a rank holding `own` leading blocks: the pool's run
    /// of blocks starting where the rank's own overlap ends.
    #[inline]
    fn pool_extension(&self, own: u32) -> (f64, u32) {
        match self.pool.iter().find(|&&(a, b)| a <= own && own < b) {
            Some(&(_, b)) => (f64::from(b - own) * self.pool_credit, b - own),
            None => (0.0, 0),
        }
    }

    /// `cost` less the preference of a rank carrying `label_bits` (untouched without
    /// preferred labels, as [`CostTerms::with_preference`] is then not applied either).
    #[inline(always)]
    fn less_preference(&self, cost: f64, label_bits: u64) -> f64 {
        if self.preferred.is_empty() {
            cost
        } else {
            cost - self.preference(label_bits)
        }
    }

    /// Blocks off the cost of a rank carrying `label_bits` for the preferred labels.
    #[inline(always)]
    fn preference(&self, label_bits: u64) -> f64 {
        self.preferred
            .iter()
            .filter(|(bit, _)| label_bits & bit != 0)
            .map(|(_, w)| w)
            .sum()
    }

    /// `c` with `shared` of the prompt's blocks active on its rank: the same load, the cost
    /// recomputed.
    fn with_shared(&self, c: &Scored, shared: u32) -> Scored {
        let (own_credit, blocks) = self.overlap(c.fleet_index as usize);
        let credit = if self.pool.is_empty() {
            own_credit
        } else {
            own_credit + self.pool_extension(blocks).0
        };
        Scored {
            shared_blocks: shared,
            cost: self.less_preference(
                CostTerms::total_of(self.weights, self.shape, &c.load, credit, shared),
                self.fleet.ranks[c.fleet_index as usize].label_bits,
            ),
            ..*c
        }
    }
}

/// Frees a booked request exactly once: on [`RequestGuard::finish`] or, whatever ends the
/// request otherwise (cancel, error, a dropped stream), on drop. `R` is `&Router` or
/// `Arc<Router>` (for guards that outlive a borrow, e.g. in async streams).
#[derive(Debug)]
pub struct RequestGuard<R: Deref<Target = Router>> {
    router: R,
    request: RequestId,
    armed: bool,
}

impl<R: Deref<Target = Router>> RequestGuard<R> {
    /// Guards the booked request `request`.
    pub fn new(router: R, request: RequestId) -> Self {
        RequestGuard {
            router,
            request,
            armed: true,
        }
    }

    pub fn request(&self) -> RequestId {
        self.request
    }

    /// The request reached its worker ([`Router::mark_dispatched`]).
    pub fn mark_dispatched(&mut self) -> Result<WorkerRank, LoadError> {
        self.router.mark_dispatched(self.request)
    }

    pub fn prefill_done(&self) -> Result<WorkerRank, LoadError> {
        self.router.prefill_done(self.request)
    }

    pub fn output_block(&self) -> Result<WorkerRank, LoadError> {
        self.router.output_block(self.request)
    }

    /// `tokens` more output tokens arrived ([`Router::tokens_generated`]).
    pub fn tokens_generated(&self, tokens: u64) -> Result<WorkerRank, LoadError> {
        self.router.tokens_generated(self.request, tokens)
    }

    /// Frees now and reports what was freed.
    pub fn finish(mut self) -> Result<Freed, LoadError> {
        self.release()
    }

    fn release(&mut self) -> Result<Freed, LoadError> {
        if !self.armed {
            return Err(LoadError::UnknownRequest {
                request: self.request,
            });
        }
        self.armed = false;
        self.router.free(self.request)
    }
}

impl<R: Deref<Target = Router>> Drop for RequestGuard<R> {
    fn drop(&mut self) {
        if self.armed {
            // An error here means the request was already freed elsewhere (by id, expiry or
            // its worker leaving); the ledger counted it.
            let _ = self.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{BlockHash, EventHeader, EventId, StoredBlock};
    use crate::index::IndexConfig;

    const BS: u32 = 16;

    fn router(config: RouterConfig) -> Router {
        Router::new(config, PrefixIndex::new(IndexConfig::default())).unwrap()
    }

    fn tokens(n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + 1).collect()
    }

    /// Stores `locals` as one chain on `rank` (block names by position and tier).
    pub(super) fn store(
        r: &Router,
        rank: WorkerRank,
        tier: StorageTier,
        locals: &[LocalHash],
        id: u64,
    ) {
        let blocks: Vec<StoredBlock> = locals
            .iter()
            .enumerate()
            .map(|(i, h)| StoredBlock {
                block_hash: BlockHash(1000 * (tier as u64 + 1) + i as u64),
                local_hash: *h,
            })
            .collect();
        let header = EventHeader {
            source: rank,
            event_id: EventId(id),
            tier,
        };
        lock(&r.index).apply_stored(header, None, &blocks).unwrap();
    }

    fn req(id: u64, tokens: &[u32]) -> RouteRequest<'_> {
        RouteRequest {
            id: RequestId(id),
            tokens,
            hints: RouteHints::default(),
        }
    }

    /// The booked-prefill floor that joins left at 0 rises by routing alone, within four
    /// routes per rank, though no load is read in vain.
    #[test]
    fn routing_raises_a_floor_left_low() {
        let r = router(RouterConfig::default());
        for w in 1..=4 {
            r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
        }
        let own: Vec<u32> = (0..320u32).map(|i| i * 13 + 5).collect();
        for w in 1..=4u64 {
            let mut q = req(100 + w, &own);
            q.hints.pinned.backend_instance = Some(WorkerId(w));
            r.route(&q).unwrap();
        }
        assert_eq!(r.prefill_floor(), 0, "bookings do not raise the floor");
        // On a thread of its own: the count that triggers a refresh is the thread's.
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let t = tokens(160);
                let mut q = req(1, &t);
                q.hints.mode = Mode::QueryOnly;
                for _ in 0..4 * 4 {
                    r.route(&q).unwrap();
                }
                assert_eq!(r.prefill_floor(), 0);
                r.route(&q).unwrap();
                assert_eq!(r.prefill_floor(), 320);
            });
        });
    }

    /// A pinned or session-bound route walks the index for its rank alone: the rank's
    /// overlap, tiers, load and cost are what an unpinned route's full evidence gives it,
    /// whatever the other ranks hold.
    #[test]
    fn a_pinned_route_scores_its_rank_as_the_full_match_does() {
        let r = router(RouterConfig::default());
        for w in 1..=5 {
            r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
        }
        let mut two = WorkerConfig::simple(6, 1000, BS);
        two.dp_size = 2;
        r.join_worker(two).unwrap();
        // 100 blocks: more than one run of the index.
        let t = tokens(1600);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        let rank = |w: u64, dp: u32| WorkerRank::new(w, dp);
        let (device, host) = (StorageTier::Device, StorageTier::HostPinned);
        store(&r, rank(1, 0), device, &locals, 1);
        store(&r, rank(2, 0), device, &locals[..30], 2);
        store(&r, rank(2, 0), host, &locals[..70], 3);
        store(&r, rank(3, 0), host, &locals[..5], 4);
        store(&r, rank(4, 0), device, &locals[..66], 5);
        store(&r, rank(6, 0), device, &locals[..80], 6);
        store(&r, rank(6, 1), device, &locals[..64], 7);
        // Load on some ranks (of a prompt sharing no block with `t`), so that costs differ
        // by more than the overlap.
        let other: Vec<u32> = (0..96u32).map(|i| i * 13 + 5).collect();
        for (id, w) in [(100u64, 1u64), (101, 2), (102, 6)] {
            let mut q = req(id, &other);
            q.hints.pinned.backend_instance = Some(WorkerId(w));
            q.hints.pinned.dp_rank = Some(DpRank(0));
            r.route(&q).unwrap();
        }
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        q.hints.evidence = EvidenceLevel::Full;
        let full = r.route(&q).unwrap().evidence.unwrap();
        assert_eq!(full.len(), 7);
        let of = |rank: WorkerRank| *full.iter().find(|c| c.rank == rank).unwrap();
        for (w, dp) in [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (6, 1)] {
            let mut p = q;
            p.hints.pinned.backend_instance = Some(WorkerId(w));
            p.hints.pinned.dp_rank = Some(DpRank(dp));
            let ev = r.route(&p).unwrap().evidence.unwrap();
            assert_eq!(ev, vec![of(rank(w, dp))], "worker {w}, dp rank {dp}");
        }
        // A worker of two dp ranks pinned without one: its first rank's.
        let mut p = q;
        p.hints.pinned.backend_instance = Some(WorkerId(6));
        assert_eq!(r.route(&p).unwrap().evidence.unwrap(), vec![of(rank(6, 0))]);
        // Bound to a session: its rank's, as pinned.
        let mut first = req(2, &t);
        first.hints.session = Some(SessionId(9));
        first.hints.pinned.backend_instance = Some(WorkerId(2));
        first.hints.pinned.dp_rank = Some(DpRank(0));
        r.route(&first).unwrap();
        let mut again = q;
        again.hints.session = Some(SessionId(9));
        let d = r.route(&again).unwrap();
        assert_eq!(d.session, Some(SessionRouting::Sticky));
        assert_eq!(d.worker, rank(2, 0));
        assert_eq!(d.overlap, of(rank(2, 0)).overlap);
    }

    /// The reference's tier-weighted estimate, through the index and the router.
    #[test]
    fn tier_weighted_overlap_through_the_router() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
        let t = tokens(160);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        let w1 = WorkerRank::new(1, 0);
        let w2 = WorkerRank::new(2, 0);
        // Worker 1: blocks 0-1 on device, 0-2 in host memory, 0-4 on disk; worker 2: block 0
        // in host memory. Fastest tier per block: w1 = 2 device, 1 host, 2 disk; w2 = 1 host.
        store(&r, w1, StorageTier::Device, &locals[..2], 0);
        store(&r, w1, StorageTier::HostPinned, &locals[..3], 1);
        store(&r, w1, StorageTier::Disk, &locals[..5], 2);
        store(&r, w2, StorageTier::HostPinned, &locals[..1], 0);
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        q.hints.evidence = EvidenceLevel::Full;
        let d = r.route(&q).unwrap();
        let ev = d.evidence.unwrap();
        let of = |rank| ev.iter().find(|c| c.rank == rank).unwrap().overlap;
        assert_eq!(of(w1).per_tier, [2, 1, 2, 0]);
        assert_eq!(of(w1).effective_blocks, 3.25);
        assert_eq!(of(w1).cached_tokens, 52);
        assert_eq!(of(w2).effective_blocks, 0.75);
        assert_eq!(of(w2).cached_tokens, 12);
        assert_eq!(d.worker, w1, "the better cached worker wins at equal load");
        assert_eq!(d.decided_by, DecidedBy::Cost);
    }

    /// Overlaps, read by index id, never go to another rank: not after a leave shifts fleet
    /// indices and a join reuses the leaver's index id, and not between two routers on one
    /// thread whose ids name different ranks.
    #[test]
    fn overlaps_follow_their_ranks_across_leaves_joins_and_routers() {
        let t = tokens(160);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        let overlaps = |r: &Router| -> Vec<(u64, u32)> {
            let mut q = req(1, &t);
            q.hints.mode = Mode::QueryOnly;
            q.hints.evidence = EvidenceLevel::Full;
            let mut v: Vec<(u64, u32)> = r
                .route(&q)
                .unwrap()
                .evidence
                .unwrap()
                .iter()
                .map(|c| (c.rank.worker.0, c.overlap.blocks))
                .collect();
            v.sort();
            v
        };
        // A worker joins, holding the first `n` blocks.
        let join = |r: &Router, w: u64, n: usize| {
            r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
            let rank = WorkerRank::new(w, 0);
            store(r, rank, StorageTier::Device, &locals[..n], 0);
        };
        let a = router(RouterConfig::default());
        for (w, n) in [(1u64, 2usize), (2, 4), (3, 6)] {
            join(&a, w, n);
        }
        assert_eq!(overlaps(&a), [(1, 2), (2, 4), (3, 6)]);
        // Worker 1 leaves (worker 2 and 3 move down one fleet index); worker 0 joins first in
        // fleet order and takes worker 1's index id.
        a.leave_worker(WorkerId(1)).unwrap();
        assert_eq!(overlaps(&a), [(2, 4), (3, 6)]);
        join(&a, 0, 9);
        assert_eq!(overlaps(&a), [(0, 9), (2, 4), (3, 6)]);
        // A second router on the same thread, its ids in another order.
        let b = router(RouterConfig::default());
        for (w, n) in [(3u64, 1usize), (2, 3), (0, 5)] {
            join(&b, w, n);
        }
        assert_eq!(overlaps(&b), [(0, 5), (2, 3), (3, 1)]);
        assert_eq!(overlaps(&a), [(0, 9), (2, 4), (3, 6)]);
    }

    /// An index id changes hands through a leave and a join, and no match credits one owner's
    /// blocks to the other: whichever of the two fleets (before, after) reads whichever of the
    /// two matches, and a rank that left takes nothing even from a match of its own blocks.
    #[test]
    fn a_reused_index_id_never_credits_one_owner_with_the_others_blocks() {
        let t = tokens(160);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        let r = router(RouterConfig::default());
        let mut before = RankDepths::default();
        let mut after = RankDepths::default();
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        store(
            &r,
            WorkerRank::new(1, 0),
            StorageTier::Device,
            &locals[..2],
            0,
        );
        let stale = r.fleet();
        let old = &stale.ranks[0];
        r.reader
            .find_depths_into(&locals, MatchOptions::default(), &mut before);
        assert_eq!(rank_depth(old, &before).map(|(_, d)| d.blocks), Some(2));
        r.leave_worker(WorkerId(1)).unwrap();
        r.join_worker(WorkerConfig::simple(0, 1000, BS)).unwrap();
        store(
            &r,
            WorkerRank::new(0, 0),
            StorageTier::Device,
            &locals[..9],
            0,
        );
        let fresh = r.fleet();
        let new = &fresh.ranks[0];
        assert_eq!(
            (old.rank, new.rank),
            (WorkerRank::new(1, 0), WorkerRank::new(0, 0))
        );
        let id = |r: &crate::registry::RankEntry| r.state.index_key().map(|k| k.id);
        assert_eq!(id(old), id(new), "the id was reused");
        r.reader
            .find_depths_into(&locals, MatchOptions::default(), &mut after);
        assert_eq!(rank_depth(new, &after).map(|(_, d)| d.blocks), Some(9));
        assert_eq!(rank_depth(new, &before), None, "the leaver's blocks");
        assert_eq!(rank_depth(old, &after), None, "the newcomer's blocks");
        assert_eq!(rank_depth(old, &before), None, "it left");
    }

    /// A rank whose prompt load is decayed can win on a cost below the floor that ignores
    /// decay; pruned selection bounds it with the decay and still picks it. Worker 0 holds
    /// the query's first 2 blocks and sets the cheapest cost first; worker 1 holds nothing,
    /// but has the query's first 10 blocks active in a request past its expected output.
    #[test]
    fn a_decayed_rank_is_not_pruned_on_a_floor_that_ignores_decay() {
        let r = router(RouterConfig::default());
        let t = tokens(20 * BS as usize);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        for w in 0..2 {
            r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
        }
        store(
            &r,
            WorkerRank::new(0, 0),
            StorageTier::Device,
            &locals[..2],
            0,
        );
        let mut active = req(7, &t[..10 * BS as usize]);
        active.hints.pinned.backend_instance = Some(WorkerId(1));
        active.hints.expected_output_tokens = Some(1);
        r.route(&active).unwrap();
        r.prefill_done(RequestId(7)).unwrap();
        r.output_block(RequestId(7)).unwrap();
        assert!(r.load(WorkerRank::new(1, 0)).unwrap().prompt_decay > 0);
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        q.hints.evidence = EvidenceLevel::Full;
        assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(1, 0));
        q.hints.evidence = EvidenceLevel::Off;
        assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(1, 0));
    }

    /// Preferred labels and pool hits lower a rank's cost below the floor of its own overlap;
    /// pruned selection takes both into its floors. Worker 0 holds all 20 of the query's
    /// blocks and is scored first; worker 1 holds 18 and carries the preferred label, and
    /// wins; worker 2 holds 16 and finds the other 4 in the pool, and ties with worker 0 (as
    /// does worker 1, with 2 from the pool).
    #[test]
    fn preferences_and_pool_hits_lower_the_floors_pruning_uses() {
        let r = router(RouterConfig {
            pool_credit: 1.0,
            ..RouterConfig::default()
        });
        let t = tokens(20 * BS as usize);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        for (w, depth) in [(0u64, 20usize), (1, 18), (2, 16)] {
            let mut c = WorkerConfig::simple(w, 1000, BS);
            if w == 1 {
                c.labels = vec![("gpu".to_string(), "fast".to_string())];
            }
            r.join_worker(c).unwrap();
            store(
                &r,
                WorkerRank::new(w, 0),
                StorageTier::Device,
                &locals[..depth],
                0,
            );
        }
        let picks = |q: &RouteRequest<'_>| {
            (0..200)
                .map(|_| r.route(q).unwrap().worker.worker.0)
                .collect::<std::collections::BTreeSet<u64>>()
        };
        let preferred = [PreferredLabel {
            label: Label {
                key: "gpu",
                value: "fast",
            },
            weight: 3.0,
        }];
        let pool = [16..18u32, 18..20];
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        q.hints.preferred = &preferred;
        assert_eq!(picks(&q), [1].into());
        q.hints.preferred = &[];
        q.hints.pool = PoolHits::Hits(&pool);
        assert_eq!(picks(&q), [0, 1, 2].into());
    }

    /// Selection that reads only the ranks the match gave enough blocks to win, and only the
    /// records deep enough to matter, picks what the full evidence says: 48 workers with
    /// overlaps spread over every depth (so the least winning depth falls among them), tier
    /// weights, background prefill on every worker (a booked-prefill floor above 0), some
    /// prompts active, and requests with preferred labels, pool hits, both or neither; in
    /// half the rounds, records of finished requests on workers with and without events,
    /// beside heavily loaded deep ones. Each round's pick set over repeated routes equals the
    /// set of cheapest free candidates. (Reading records from two blocks above the least
    /// winning depth fails it.)
    #[test]
    fn selection_from_the_deep_ranks_picks_what_the_full_evidence_says() {
        let mut rng = crate::rng::Rng::new(29);
        for round in 0..64u64 {
            // Half the rounds record every route (speculation), and some workers publish no
            // events: records then raise overlaps, the shallow ones unread where pruning
            // finds them unable to win.
            let records = round % 8 >= 4;
            let r = router(RouterConfig {
                pool_credit: [0.5, 1.0, 0.9][round as usize % 3],
                approximate: crate::config::Approximate {
                    speculative: if records {
                        crate::config::Speculative::On {
                            ttl: std::time::Duration::from_secs(600),
                        }
                    } else {
                        crate::config::Speculative::Off
                    },
                    ..crate::config::Approximate::default()
                },
                ..RouterConfig::default()
            });
            let t = tokens(40 * BS as usize);
            let locals = BlockHasher::new(BS as usize).local_hashes(&t);
            for w in 0..48u64 {
                let mut c = WorkerConfig::simple(w, 1000, BS);
                if rng.below(3) == 0 {
                    c.labels = vec![("gpu".to_string(), "fast".to_string())];
                }
                let events = if records && rng.below(4) == 0 {
                    KvEvents::Absent
                } else {
                    KvEvents::Published
                };
                r.join_worker_with(c, events).unwrap();
                let depth = rng.below(41) as usize;
                if depth > 0 {
                    let tier = if rng.below(4) == 0 {
                        StorageTier::HostPinned
                    } else {
                        StorageTier::Device
                    };
                    store(&r, WorkerRank::new(w, 0), tier, &locals[..depth], 0);
                }
                // Background prefill everywhere, of several sizes; some of the query's own
                // blocks active on a few.
                let own = rng.below(if records { 2 } else { 4 }) == 0;
                let body: Vec<u32> = if own {
                    t[..BS as usize * (1 + rng.below(40) as usize)].to_vec()
                } else {
                    // With records, the index's deep ranks carry heavy loads, so that ranks
                    // known by their records alone win near the least winning depth.
                    let most = if records { 60 } else { 6 };
                    let n = BS * (1 + rng.below(most) as u32);
                    (0..n).map(|i| 700_000 + i + 1000 * (w as u32)).collect()
                };
                let id = 1_000_000 * (round + 1) + w;
                let mut q = req(id, &body);
                q.hints.pinned.backend_instance = Some(WorkerId(w));
                r.route(&q).unwrap();
                // A finished request leaves its record and no load.
                if records && own {
                    r.free(RequestId(id)).unwrap();
                }
            }
            r.refresh_prefill_floor();
            let preferred = [PreferredLabel {
                label: Label {
                    key: "gpu",
                    value: "fast",
                },
                weight: [1.0, 3.0, 7.5][rng.below(3) as usize],
            }];
            let start = rng.below(20) as u32;
            let mid = start + 3 + rng.below(15) as u32;
            let pool = [start..mid, mid + 2..mid + 2 + rng.below(9) as u32];
            let mut q = req(1, &t);
            q.hints.mode = Mode::QueryOnly;
            if round % 4 >= 2 {
                q.hints.preferred = &preferred;
            }
            if round % 2 == 1 {
                q.hints.pool = PoolHits::Hits(&pool);
            }
            q.hints.evidence = EvidenceLevel::Full;
            let ev = r.route(&q).unwrap().evidence.unwrap();
            let min = ev
                .iter()
                .map(|c| c.cost.total)
                .fold(f64::INFINITY, f64::min);
            let want: std::collections::BTreeSet<WorkerRank> = ev
                .iter()
                .filter(|c| c.cost.total == min)
                .map(|c| c.rank)
                .collect();
            q.hints.evidence = EvidenceLevel::Off;
            let picked: std::collections::BTreeSet<WorkerRank> =
                (0..200).map(|_| r.route(&q).unwrap().worker).collect();
            assert_eq!(picked, want, "round {round}");
        }
    }

    /// Without evidence, selection keeps only candidates that can still win; it picks from
    /// exactly the ranks the full evidence says it should, each of them over repeated routes:
    /// the cheapest healthy, free ones, or the least loaded where the busy or health filter
    /// falls back. Fleets with ties, deep and shallow overlaps, prompt blocks already active
    /// (some of them decayed), busy workers, the cheapest worker marked wedged, and requests
    /// with preferred labels and pool hits.
    #[test]
    fn pruned_selection_picks_what_the_full_evidence_says() {
        let mut rng = crate::rng::Rng::new(11);
        let (mut by_cost, mut by_load, mut loaded_floors) = (0, 0, 0);
        for round in 0..32u64 {
            let busy = round % 2 == 1;
            // Every worker loaded and tiny: all busy, so the least loaded serves.
            let all_busy = round % 4 == 3;
            // Prefill booked on every worker: the floors count it (`Ledger::prefill_floor`).
            let loaded_everywhere = round % 8 < 2;
            let r = router(RouterConfig {
                busy: crate::config::BusyThresholds {
                    decode_blocks_fraction: busy.then_some(0.5),
                    prefill_tokens_fraction: None,
                },
                ..RouterConfig::default()
            });
            let t = tokens(320);
            let locals = BlockHasher::new(BS as usize).local_hashes(&t);
            let mut deepest = (0, WorkerId(0));
            for w in 0..16u64 {
                let kv = if all_busy { 4 } else { 20 };
                let mut c = WorkerConfig::simple(w, kv, BS);
                if rng.below(3) == 0 {
                    c.labels = vec![("gpu".to_string(), "fast".to_string())];
                }
                r.join_worker(c).unwrap();
                let depth = [0, 0, 2, 5, 5, 20][rng.below(6) as usize];
                if depth > 0 {
                    store(
                        &r,
                        WorkerRank::new(w, 0),
                        StorageTier::Device,
                        &locals[..depth],
                        0,
                    );
                }
                if depth > deepest.0 {
                    deepest = (depth, WorkerId(w));
                }
                // Load: the query's own first blocks active on some, other prompts on others.
                let requests = if all_busy || loaded_everywhere {
                    1 + rng.below(2)
                } else {
                    rng.below(3)
                };
                for k in 0..requests {
                    // Another prompt's 4 blocks make a 4-block worker busy.
                    let own = !(all_busy || loaded_everywhere && k == 0) && rng.below(2) == 0;
                    let body: Vec<u32> = if own {
                        t[..16 * (1 + rng.below(10) as usize)].to_vec()
                    } else {
                        (0..64).map(|i| 900_000 + i + 1000 * (w as u32)).collect()
                    };
                    let id = 1000 * (round + 1) + 10 * w + k;
                    let mut q = req(id, &body);
                    q.hints.pinned.backend_instance = Some(WorkerId(w));
                    // Some decay their unshared prompt blocks, from their first output block.
                    let decays = rng.below(3) == 0;
                    if decays {
                        q.hints.expected_output_tokens = Some(40);
                    }
                    r.route(&q).unwrap();
                    if decays {
                        r.output_block(RequestId(id)).unwrap();
                    }
                }
            }
            if round % 3 == 2 {
                r.set_health(deepest.1, Health::Wedged).unwrap();
            }
            let mut q = req(1, &t);
            q.hints.mode = Mode::QueryOnly;
            q.hints.evidence = EvidenceLevel::Full;
            // Some rounds prefer a label and bring pool hits: both lower costs.
            let preferred = [PreferredLabel {
                label: Label {
                    key: "gpu",
                    value: "fast",
                },
                weight: 3.0,
            }];
            let pool = [0..8u32, 12..16];
            if round % 5 >= 3 {
                q.hints.preferred = &preferred;
                q.hints.pool = PoolHits::Hits(&pool);
            }
            let ev = r.route(&q).unwrap().evidence.unwrap();
            let healthy: Vec<&Candidate> = ev.iter().filter(|c| c.health.is_healthy()).collect();
            let pool = if healthy.is_empty() {
                ev.iter().collect()
            } else {
                healthy
            };
            let free: Vec<&Candidate> = pool
                .iter()
                .copied()
                .filter(|c| c.busy == crate::select::Busy::Free)
                .collect();
            let want: std::collections::BTreeSet<WorkerRank> = if free.is_empty() {
                by_load += 1;
                let least = pool.iter().map(|c| c.load.load_blocks(BS)).min().unwrap();
                pool.iter()
                    .filter(|c| c.load.load_blocks(BS) == least)
                    .map(|c| c.rank)
                    .collect()
            } else {
                by_cost += 1;
                let min = free
                    .iter()
                    .map(|c| c.cost.total)
                    .fold(f64::INFINITY, f64::min);
                free.iter()
                    .filter(|c| c.cost.total == min)
                    .map(|c| c.rank)
                    .collect()
            };
            q.hints.evidence = EvidenceLevel::Off;
            r.refresh_prefill_floor();
            if loaded_everywhere || all_busy {
                assert!(r.prefill_floor() >= 64, "round {round}");
                loaded_floors += 1;
            }
            let mut picked = std::collections::BTreeSet::new();
            for _ in 0..300 {
                let d = r.route(&q).unwrap();
                assert!(want.contains(&d.worker), "round {round}: {d:?}");
                picked.insert(d.worker);
            }
            assert_eq!(picked, want, "round {round}");
        }
        assert!(
            by_cost >= 16 && by_load >= 4 && loaded_floors >= 12,
            "{by_cost} by cost, {by_load} by load, {loaded_floors} floors over booked prefill"
        );
    }

    #[test]
    fn query_only_changes_no_state() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        let t = tokens(100);
        r.route(&req(1, &t)).unwrap();
        let before = (r.total_load(), r.active_requests(), r.counts().ledger);
        let mut q = req(2, &t);
        q.hints.mode = Mode::QueryOnly;
        let d = r.route(&q).unwrap();
        assert_eq!(d.bookkeeping, Bookkeeping::QueryOnly);
        assert_eq!(
            (r.total_load(), r.active_requests(), r.counts().ledger),
            before
        );
        assert_eq!(
            r.free(RequestId(2)),
            Err(LoadError::UnknownRequest {
                request: RequestId(2)
            })
        );
    }

    #[test]
    fn pinned_precedence_per_phase() {
        let p = Pinned {
            backend_instance: Some(WorkerId(1)),
            prefill_worker: Some(WorkerId(2)),
            decode_worker: Some(WorkerId(3)),
            dp_rank: Some(DpRank(0)),
            prefill_dp_rank: Some(DpRank(5)),
            decode_dp_rank: None,
        };
        assert_eq!(
            p.for_phase(Phase::Prefill),
            Some((WorkerId(2), Some(DpRank(5))))
        );
        assert_eq!(
            p.for_phase(Phase::Decode),
            Some((WorkerId(3), Some(DpRank(0))))
        );
        assert_eq!(
            p.for_phase(Phase::Aggregated),
            Some((WorkerId(1), Some(DpRank(0))))
        );
        let only_backend = Pinned {
            backend_instance: Some(WorkerId(1)),
            ..Pinned::default()
        };
        assert_eq!(
            only_backend.for_phase(Phase::Prefill),
            Some((WorkerId(1), None))
        );
        assert_eq!(
            only_backend.for_phase(Phase::Decode),
            Some((WorkerId(1), None))
        );
        assert_eq!(Pinned::default().for_phase(Phase::Aggregated), None);
    }

    #[test]
    fn pinned_routes_book_the_pinned_rank_or_report_untracked() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.join_worker(WorkerConfig {
            dp_size: 2,
            ..WorkerConfig::simple(2, 1000, BS)
        })
        .unwrap();
        let t = tokens(64);
        let mut q = req(1, &t);
        q.hints.pinned.backend_instance = Some(WorkerId(2));
        q.hints.pinned.dp_rank = Some(DpRank(1));
        let d = r.route(&q).unwrap();
        assert_eq!(
            (d.worker, d.decided_by),
            (WorkerRank::new(2, 1), DecidedBy::Pinned)
        );
        assert_eq!(r.load(WorkerRank::new(2, 1)).unwrap().requests, 1);
        // No dp rank on a two-rank worker: dispatched without bookkeeping.
        let mut q = req(2, &t);
        q.hints.pinned.backend_instance = Some(WorkerId(2));
        let d = r.route(&q).unwrap();
        assert_eq!(d.bookkeeping, Bookkeeping::UntrackedDpRankUnresolved);
        assert_eq!(r.active_requests(), 1);
        assert_eq!(r.counts().untracked, 1);
        // A single-rank worker resolves without a dp rank.
        let mut q = req(3, &t);
        q.hints.pinned.backend_instance = Some(WorkerId(1));
        assert_eq!(r.route(&q).unwrap().bookkeeping, Bookkeeping::Booked);
        // Unknown and disallowed pins are errors.
        let mut q = req(4, &t);
        q.hints.pinned.backend_instance = Some(WorkerId(9));
        assert_eq!(
            r.route(&q),
            Err(RouteError::UnknownWorker {
                request: RequestId(4),
                worker: WorkerId(9)
            })
        );
        q.hints.pinned.backend_instance = Some(WorkerId(1));
        q.hints.allowed = Some(&[WorkerId(2)]);
        assert!(matches!(
            r.route(&q),
            Err(RouteError::PinnedNotAllowed { .. })
        ));
    }

    #[test]
    fn bad_requests_are_typed_errors_and_counted() {
        // Enforced disaggregation: a prefill request without prefill workers is an error (see
        // `prefill_falls_back_to_aggregated_unless_enforced` for the default).
        let r = router(RouterConfig {
            min_workers: 1,
            disaggregation: Disaggregation::Enforced,
            ..RouterConfig::default()
        });
        let t = tokens(32);
        assert_eq!(
            r.route(&req(1, &t)),
            Err(RouteError::NotReady {
                joined: 0,
                needed: 1
            })
        );
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        assert_eq!(
            r.route(&req(1, &[])),
            Err(RouteError::NoTokens {
                request: RequestId(1)
            })
        );
        let mut q = req(1, &t);
        q.hints.allowed = Some(&[WorkerId(5)]);
        assert_eq!(
            r.route(&q),
            Err(RouteError::NoWorkers {
                request: RequestId(1)
            })
        );
        q.hints.allowed = None;
        q.hints.phase = Phase::Prefill;
        assert_eq!(
            r.route(&q),
            Err(RouteError::NoWorkers {
                request: RequestId(1)
            })
        );
        r.route(&req(1, &t)).unwrap();
        let load = r.total_load();
        assert_eq!(
            r.route(&req(1, &t)),
            Err(RouteError::Load(LoadError::DuplicateRequest {
                request: RequestId(1)
            }))
        );
        assert_eq!(r.total_load(), load, "a rejected duplicate books nothing");
        let c = r.counts();
        assert_eq!((c.not_ready, c.no_tokens, c.no_workers), (1, 1, 2));
        assert_eq!(c.ledger.duplicate_requests, 1);
    }

    #[test]
    fn lifecycle_by_id_returns_load_to_zero() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        let t = tokens(40); // 2 full blocks + a tail
        let d = r.route(&req(1, &t)).unwrap();
        let l = r.load(d.worker).unwrap();
        assert_eq!((l.prefill_tokens, l.prompt_blocks, l.requests), (40, 3, 1));
        r.prefill_done(RequestId(1)).unwrap();
        r.output_block(RequestId(1)).unwrap();
        assert_eq!(r.load(d.worker).unwrap().decode_blocks(), 4);
        r.free(RequestId(1)).unwrap();
        assert!(r.total_load().is_idle());
    }

    #[test]
    fn guard_frees_exactly_once_and_counts_only_dispatched() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        let t = tokens(64);
        r.route(&req(1, &t)).unwrap();
        {
            let g = RequestGuard::new(&r, RequestId(1));
            g.prefill_done().unwrap();
            // Dropped before dispatch: freed, not counted as completed.
        }
        assert!(r.total_load().is_idle());
        assert_eq!(r.counts().completed, 0);
        r.route(&req(2, &t)).unwrap();
        let mut g = RequestGuard::new(&r, RequestId(2));
        g.mark_dispatched().unwrap();
        g.finish().unwrap();
        assert_eq!(r.counts().completed, 1);
        // Freed by id first: the guard's drop finds nothing and frees nothing else.
        r.route(&req(3, &t)).unwrap();
        r.route(&req(4, &t)).unwrap();
        let g = RequestGuard::new(&r, RequestId(3));
        r.free(RequestId(3)).unwrap();
        drop(g);
        assert_eq!(r.total_load().requests, 1);
        assert_eq!(r.counts().ledger.freed, 3);
        // An Arc'd router works too.
        let a = std::sync::Arc::new(router(RouterConfig::default()));
        a.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        a.route(&req(1, &t)).unwrap();
        drop(RequestGuard::new(std::sync::Arc::clone(&a), RequestId(1)));
        assert!(a.total_load().is_idle());
    }

    #[test]
    fn lora_name_changes_the_hash_and_so_the_match() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        let t = tokens(64);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        store(&r, WorkerRank::new(1, 0), StorageTier::Device, &locals, 0);
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        assert_eq!(r.route(&q).unwrap().overlap.blocks, 4);
        q.hints.lora_name = Some("adapter-a");
        assert_eq!(r.route(&q).unwrap().overlap.blocks, 0);
    }

    #[test]
    fn load_steers_choices_and_busy_ranks_are_skipped() {
        let r = router(RouterConfig {
            busy: crate::config::BusyThresholds {
                decode_blocks_fraction: Some(0.5),
                prefill_tokens_fraction: None,
            },
            ..RouterConfig::default()
        });
        r.join_worker(WorkerConfig::simple(1, 10, BS)).unwrap();
        r.join_worker(WorkerConfig::simple(2, 10, BS)).unwrap();
        let t = tokens(16 * 6); // 6 blocks: over half the capacity of a 10-block rank
        let a = r.route(&req(1, &t)).unwrap().worker;
        let b = r.route(&req(2, &tokens(16 * 6 + 1))).unwrap();
        assert_ne!(a, b.worker, "the first rank is busy");
        let c = r.route(&req(3, &tokens(17))).unwrap();
        assert_eq!(c.decided_by, DecidedBy::FallbackAllBusy);
        assert_eq!(r.counts().all_busy, 1);
    }

    #[test]
    fn leaving_worker_loses_its_load_and_blocks() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
        let t = tokens(64);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        store(&r, WorkerRank::new(1, 0), StorageTier::Device, &locals, 0);
        let mut q = req(1, &t);
        q.hints.pinned.backend_instance = Some(WorkerId(1));
        r.route(&q).unwrap();
        assert_eq!(r.leave_worker(WorkerId(1)).unwrap(), 1);
        assert!(r.total_load().is_idle());
        assert_eq!(
            r.free(RequestId(1)),
            Err(LoadError::UnknownRequest {
                request: RequestId(1)
            })
        );
        assert_eq!(
            r.index_reader()
                .find_matches(&locals, MatchOptions::default())
                .max_blocks(),
            0
        );
        assert!(matches!(
            r.leave_worker(WorkerId(1)),
            Err(RouterError::Registry(_))
        ));
    }

    #[test]
    fn expiry_frees_forgotten_requests() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.route(&req(1, &tokens(64))).unwrap();
        assert_eq!(r.expire(Instant::now()), 0);
        let later = Instant::now() + r.config().request_expiry;
        assert_eq!(r.expire(later), 1);
        assert!(r.total_load().is_idle());
        assert_eq!(r.counts().ledger.expired, 1);
    }

    #[test]
    fn timing_on_records_the_overhead_split() {
        let r = router(RouterConfig {
            timing: Timing::On,
            ..RouterConfig::default()
        });
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.route(&req(1, &tokens(64))).unwrap();
        let t = r.timings().unwrap();
        assert_eq!((t.hash.len(), t.matching.len(), t.select.len()), (1, 1, 1));
        assert!(router(RouterConfig::default()).timings().is_none());
    }

    /// The overhead histograms once clamped every value to their initial 1..2 ns range
    /// (`saturating_record` never resizes): a 3 µs select step read back as 2 ns.
    #[test]
    fn timing_histograms_keep_microseconds() {
        let mut t = Timings::new();
        t.record(1_500, 2_000, 3_000);
        t.record(900_000, 1, 7);
        assert_eq!(
            t.hash.value_at_quantile(0.0),
            t.hash.lowest_equivalent(1_500)
        );
        assert_eq!(t.matching.value_at_quantile(0.0), 1);
        assert_eq!(
            t.select.value_at_quantile(1.0),
            t.select.highest_equivalent(3_000)
        );
        assert!(t.hash.max() >= 899_000, "{}", t.hash.max());
    }

    #[test]
    fn decode_phase_gets_no_overlap_credit_and_books_no_prefill() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig {
            role: WorkerRole::Decode,
            ..WorkerConfig::simple(1, 1000, BS)
        })
        .unwrap();
        let t = tokens(64);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        store(&r, WorkerRank::new(1, 0), StorageTier::Device, &locals, 0);
        let mut q = req(1, &t);
        q.hints.phase = Phase::Decode;
        let d = r.route(&q).unwrap();
        assert_eq!(d.cost.credit_blocks, 0.0);
        assert_eq!(r.load(d.worker).unwrap().prefill_tokens, 0);
    }

    #[test]
    fn prefill_falls_back_to_aggregated_unless_enforced() {
        let t = tokens(64);
        let mut q = req(1, &t);
        q.hints.phase = Phase::Prefill;
        // Default: no prefill worker, so an aggregated worker serves, and the decision says so.
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        let d = r.route(&q).unwrap();
        assert_eq!(d.worker, WorkerRank::new(1, 0));
        assert_eq!(d.fallback, Some(Fallback::PrefillToAggregated));
        assert_eq!(d.decided_by, DecidedBy::Cost);
        assert_eq!(
            r.load(d.worker).unwrap().prefill_tokens,
            64,
            "prefill is booked"
        );
        assert_eq!(r.counts().prefill_fallbacks, 1);
        // Once a prefill worker joins, prefill goes there and nothing falls back.
        r.join_worker(WorkerConfig {
            role: WorkerRole::Prefill,
            ..WorkerConfig::simple(2, 1000, BS)
        })
        .unwrap();
        let d = r.route(&req(2, &t)).unwrap();
        assert_eq!(
            d.fallback, None,
            "an aggregated request is never a fallback"
        );
        let mut q2 = req(3, &t);
        q2.hints.phase = Phase::Prefill;
        let d = r.route(&q2).unwrap();
        assert_eq!((d.worker, d.fallback), (WorkerRank::new(2, 0), None));
        // A prefill worker outside the allowed set is still a prefill worker: no fallback.
        let mut q3 = req(4, &t);
        q3.hints.phase = Phase::Prefill;
        q3.hints.allowed = Some(&[WorkerId(1)]);
        assert_eq!(
            r.route(&q3),
            Err(RouteError::NoWorkers {
                request: RequestId(4)
            })
        );
        assert_eq!(r.counts().prefill_fallbacks, 1);
        // Enforced: no fallback, a typed error.
        let r = router(RouterConfig {
            disaggregation: Disaggregation::Enforced,
            ..RouterConfig::default()
        });
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        assert_eq!(
            r.route(&q),
            Err(RouteError::NoWorkers {
                request: RequestId(1)
            })
        );
        assert!(r.total_load().is_idle());
        // Decode never falls back.
        let mut qd = req(5, &t);
        qd.hints.phase = Phase::Decode;
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        assert!(matches!(r.route(&qd), Err(RouteError::NoWorkers { .. })));
    }

    /// Two workers, equal but for one running a request with the same 8-block system prompt:
    /// with the prompt counted once, that worker is cheaper by the shared blocks and wins,
    /// where charging the whole prompt again would make it the dearer one.
    #[test]
    fn decode_term_counts_prompt_blocks_active_on_the_worker_once() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
        let sys: Vec<u32> = (0..128).map(|i| i * 3 + 5).collect();
        let with = |tail: u32| -> Vec<u32> {
            sys.iter()
                .copied()
                .chain((0..32).map(|i| i + tail))
                .collect()
        };
        // Worker 1 runs a request with the system prompt; worker 2 one of the same size
        // without it. Prefill done on both, so only decode load differs by what is shared.
        let running = with(10_000);
        let other: Vec<u32> = (0..160).map(|i| i + 50_000).collect();
        let mut q = req(1, &running);
        q.hints.pinned.backend_instance = Some(WorkerId(1));
        r.route(&q).unwrap();
        let mut q = req(2, &other);
        q.hints.pinned.backend_instance = Some(WorkerId(2));
        r.route(&q).unwrap();
        r.prefill_done(RequestId(1)).unwrap();
        r.prefill_done(RequestId(2)).unwrap();
        // Equal load: only the shared blocks separate them.
        let probes_before = r.counts().shared_probes;
        let incoming = with(20_000);
        let mut q = req(3, &incoming);
        q.hints.mode = Mode::QueryOnly;
        q.hints.evidence = EvidenceLevel::Full;
        for _ in 0..20 {
            let d = r.route(&q).unwrap();
            assert_eq!(d.worker, WorkerRank::new(1, 0), "{d:?}");
            assert_eq!(d.cost.shared_blocks, 8);
            assert_eq!(d.cost.decode_cost, 10.0 + 10.0 - 8.0);
            let ev = d.evidence.unwrap();
            let w2 = ev.iter().find(|c| c.rank == WorkerRank::new(2, 0)).unwrap();
            assert_eq!(w2.cost.shared_blocks, 0);
            assert_eq!(w2.cost.decode_cost, 20.0);
        }
        assert!(r.counts().shared_probes > probes_before);
        // Booking agrees with the prediction: 8 blocks were shared.
        let mut q = req(4, &incoming);
        q.hints.pinned.backend_instance = Some(WorkerId(1));
        r.route(&q).unwrap();
        assert_eq!(r.load(WorkerRank::new(1, 0)).unwrap().prompt_blocks, 10 + 2);
    }

    /// Probes are bounded per request, whatever the fleet size, and skip ranks that cannot win.
    #[test]
    fn shared_probes_are_bounded_per_route() {
        let r = router(RouterConfig::default());
        for w in 0..40 {
            r.join_worker(WorkerConfig::simple(w, 100_000, BS)).unwrap();
        }
        let t = tokens(320);
        for w in 0..40 {
            let mut q = req(100 + w, &t);
            q.hints.pinned.backend_instance = Some(WorkerId(w));
            r.route(&q).unwrap();
        }
        let before = r.counts().shared_probes;
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        let d = r.route(&q).unwrap();
        let probes = r.counts().shared_probes - before;
        assert!(probes as usize <= crate::select::SHARED_PROBES, "{probes}");
        assert!(probes > 0);
        assert_eq!(
            d.cost.shared_blocks, 20,
            "every worker runs the same prompt"
        );
        // Other policies never probe.
        let rr = router(RouterConfig {
            policy: crate::config::Policy::LeastLoaded,
            ..RouterConfig::default()
        });
        rr.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        rr.route(&req(1, &t)).unwrap();
        rr.route(&q).unwrap();
        assert_eq!(rr.counts().shared_probes, 0);
    }

    /// Expected output length decays the chosen rank's output load, and the decay steers the
    /// next choice: of two ranks with equal output blocks, the one whose request is nearly
    /// done is cheaper.
    #[test]
    fn expected_output_decays_output_load_in_the_cost() {
        let r = router(RouterConfig::default());
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
        let a: Vec<u32> = (0..64).map(|i| i + 70_000).collect();
        let b: Vec<u32> = (0..64).map(|i| i + 80_000).collect();
        let mut q = req(1, &a);
        q.hints.pinned.backend_instance = Some(WorkerId(1));
        q.hints.expected_output_tokens = Some(100);
        r.route(&q).unwrap();
        let mut q = req(2, &b);
        q.hints.pinned.backend_instance = Some(WorkerId(2));
        r.route(&q).unwrap();
        for id in [1, 2] {
            r.prefill_done(RequestId(id)).unwrap();
            for _ in 0..4 {
                r.output_block(RequestId(id)).unwrap();
            }
        }
        // Request 1: 64-token prompt, 4th block opens at output token 49: r = 0.51.
        let l1 = r.load(WorkerRank::new(1, 0)).unwrap();
        assert_eq!(l1.output_blocks, 4);
        let expect = 4.0 * (1.0 - 49.0 / 100.0);
        assert!(
            (l1.weighted_output_blocks() - expect).abs() < 1e-4,
            "{l1:?}"
        );
        assert_eq!(r.load(WorkerRank::new(2, 0)).unwrap().output_decay, 0);
        let t: Vec<u32> = (0..64).map(|i| i + 90_000).collect();
        let mut q = req(3, &t);
        q.hints.mode = Mode::QueryOnly;
        let d = r.route(&q).unwrap();
        assert_eq!(d.worker, WorkerRank::new(1, 0));
        // Its 4 prompt blocks, unshared, weigh what is left of its output too.
        let prompt = 4.0 * (1.0 - 49.0 / 100.0);
        assert!((l1.weighted_prompt_blocks() - prompt).abs() < 1e-4);
        assert!((d.cost.decode_cost - (prompt + expect + 4.0)).abs() < 1e-4);
        r.free(RequestId(1)).unwrap();
        r.free(RequestId(2)).unwrap();
        assert!(r.total_load().is_idle());
    }

    /// Output blocks follow token counts: one token at a time they open where
    /// `output_block` would, with the same load and decay; the first call completes the
    /// prefill and records the TTFT, later ones the ITL per token; by guard and by id.
    #[test]
    fn tokens_generated_advances_blocks_and_records_itl_per_token() {
        let config = RouterConfig {
            metrics: Metrics::On,
            ..RouterConfig::default()
        };
        let by_tokens = router(config.clone());
        let by_blocks = router(config);
        for r in [&by_tokens, &by_blocks] {
            r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        }
        let t: Vec<u32> = (0..64).map(|i| i + 70_000).collect();
        let mut q = req(1, &t);
        q.hints.expected_output_tokens = Some(100);
        by_tokens.route(&q).unwrap();
        by_blocks.route(&q).unwrap();
        let rank = WorkerRank::new(1, 0);
        let mut g = RequestGuard::new(&by_tokens, RequestId(1));
        g.mark_dispatched().unwrap();
        assert_eq!(g.tokens_generated(0), Ok(rank), "no tokens, no change");
        assert_eq!(by_tokens.load(rank).unwrap().prefill_tokens, 64);
        by_blocks.prefill_done(RequestId(1)).unwrap();
        for generated in 1..=40u64 {
            g.tokens_generated(1).unwrap();
            if generated == 1 {
                assert_eq!(by_tokens.load(rank).unwrap().prefill_tokens, 0);
            }
            // A 64-token prompt fills 4 blocks: tokens 1, 17 and 33 open blocks.
            if generated % 16 == 1 {
                by_blocks.output_block(RequestId(1)).unwrap();
            }
            assert_eq!(by_tokens.load(rank), by_blocks.load(rank), "{generated}");
        }
        let l = by_tokens.load(rank).unwrap();
        assert_eq!(l.output_blocks, 3);
        assert_eq!(l.output_decay, crate::load::output_decay(64, BS, 100, 3));
        let m = by_tokens.request_metrics().unwrap();
        assert_eq!((m.ttft_us.len(), m.itl_us.len()), (1, 39));
        g.finish().unwrap();

        // By id, in chunks: 40 tokens at once open 3 blocks, weighed at 40 generated.
        let mut q = req(2, &t);
        q.hints.expected_output_tokens = Some(100);
        by_tokens.route(&q).unwrap();
        by_tokens.mark_dispatched(RequestId(2)).unwrap();
        by_tokens.tokens_generated(RequestId(2), 40).unwrap();
        let l = by_tokens.load(rank).unwrap();
        assert_eq!(l.output_blocks, 3);
        assert_eq!(
            l.output_decay,
            crate::load::decayed(3, crate::load::remaining_fraction(40, 100))
        );
        by_tokens.tokens_generated(RequestId(2), 8).unwrap();
        assert_eq!(
            by_tokens.load(rank).unwrap().output_blocks,
            3,
            "48: still 3"
        );
        by_tokens.tokens_generated(RequestId(2), 1).unwrap();
        assert_eq!(
            by_tokens.load(rank).unwrap().output_blocks,
            4,
            "49 opens a 4th"
        );
        let m = by_tokens.request_metrics().unwrap();
        assert_eq!((m.ttft_us.len(), m.itl_us.len()), (2, 39 + 9));
        by_tokens.free(RequestId(2)).unwrap();
        assert_eq!(
            by_tokens.tokens_generated(RequestId(2), 1),
            Err(LoadError::UnknownRequest {
                request: RequestId(2)
            })
        );
        by_blocks.free(RequestId(1)).unwrap();
        assert!(by_tokens.total_load().is_idle());
        assert_eq!(by_tokens.request_metrics().unwrap().osl_blocks.max(), 4);
    }

    /// `PromptDecay::Off` keeps prompt blocks whole; only the output decays.
    #[test]
    fn prompt_decay_off_keeps_prompt_blocks_whole() {
        let r = router(RouterConfig {
            prompt_decay: crate::config::PromptDecay::Off,
            ..RouterConfig::default()
        });
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        let a: Vec<u32> = (0..64).map(|i| i + 70_000).collect();
        let mut q = req(1, &a);
        q.hints.expected_output_tokens = Some(100);
        r.route(&q).unwrap();
        for _ in 0..4 {
            r.output_block(RequestId(1)).unwrap();
        }
        let l = r.load(WorkerRank::new(1, 0)).unwrap();
        assert_eq!((l.prompt_decay, l.weighted_prompt_blocks()), (0, 4.0));
        assert!(l.output_decay > 0);
        r.free(RequestId(1)).unwrap();
        assert!(r.total_load().is_idle());
    }

    #[test]
    fn request_metrics_record_only_dispatched_requests() {
        let r = router(RouterConfig {
            metrics: Metrics::On,
            ..RouterConfig::default()
        });
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        let t = tokens(64);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        store(
            &r,
            WorkerRank::new(1, 0),
            StorageTier::Device,
            &locals[..1],
            0,
        );
        // Never dispatched: freed by its guard, records nothing.
        r.route(&req(1, &t)).unwrap();
        {
            let g = RequestGuard::new(&r, RequestId(1));
            g.prefill_done().unwrap();
            g.output_block().unwrap();
        }
        let m = r.request_metrics().unwrap();
        assert!(m.quantiles().iter().all(|(_, q)| q.count == 0), "{m}");
        assert_eq!(r.counts().completed, 0);
        // Dispatched through the guard: TTFT once, no ITL sample for the block that opens at
        // the first token (a 64-token prompt), one per later block, the rest when it ends.
        r.route(&req(2, &t)).unwrap();
        let mut g = RequestGuard::new(&r, RequestId(2));
        g.mark_dispatched().unwrap();
        g.prefill_done().unwrap();
        g.prefill_done().unwrap();
        for _ in 0..3 {
            g.output_block().unwrap();
        }
        g.finish().unwrap();
        // Dispatched by id (the engine-side contract), freed by id.
        r.route(&req(3, &t)).unwrap();
        r.mark_dispatched(RequestId(3)).unwrap();
        r.prefill_done(RequestId(3)).unwrap();
        r.free(RequestId(3)).unwrap();
        // Dispatched but expired: its end records nothing.
        r.route(&req(4, &t)).unwrap();
        r.mark_dispatched(RequestId(4)).unwrap();
        r.expire(Instant::now() + r.config().request_expiry);
        let m = r.request_metrics().unwrap();
        assert_eq!(m.ttft_us.len(), 2);
        assert_eq!(m.itl_us.len(), 2);
        assert_eq!(m.isl_tokens.len(), 2);
        assert_eq!(m.isl_tokens.max(), 64);
        assert_eq!(m.osl_blocks.max(), 3);
        assert_eq!(m.osl_blocks.min(), 0);
        // One of four blocks cached: 25 % = 2,500 basis points.
        assert_eq!(m.kv_hit_bp.min(), 2_500);
        assert!(m.kv_hit_bp.equivalent(m.kv_hit_bp.max(), 2_500));
        assert_eq!(r.counts().completed, 2);
        let table = m.to_string();
        assert!(
            table.contains("ttft_us") && table.contains("kv_hit_bp"),
            "{table}"
        );
        assert_eq!(m.quantiles()[2].1.p50, 64);
        // Off: nothing to read, and lifecycle calls still work.
        let off = router(RouterConfig::default());
        assert!(off.request_metrics().is_none());
    }

    #[test]
    fn itl_is_microseconds_per_token() {
        let r = router(RouterConfig {
            metrics: Metrics::On,
            ..RouterConfig::default()
        });
        let step = Step {
            rank: WorkerRank::new(1, 0),
            dispatch: Dispatch::Reached,
            elapsed: Some(std::time::Duration::from_micros(1_600)),
            tokens: 16,
        };
        r.record_step(RequestId(1), &step, |m| &mut m.itl_us, step.tokens);
        let not_dispatched = Step {
            dispatch: Dispatch::NotYet,
            ..step
        };
        r.record_step(RequestId(1), &not_dispatched, |m| &mut m.itl_us, 16);
        let m = r.request_metrics().unwrap();
        assert_eq!((m.itl_us.len(), m.itl_us.max()), (1, 100));
    }

    #[test]
    fn merged_metrics_keep_every_shards_samples() {
        let mut a = RequestMetrics::new();
        let mut b = RequestMetrics::new();
        record(&mut a.ttft_us, 5);
        record(&mut b.ttft_us, 5_000_000);
        a.merge(&b);
        assert_eq!(a.ttft_us.len(), 2);
        assert!(a.ttft_us.max() >= 4_990_000);
        let q = Quantiles::of(&a.ttft_us);
        assert_eq!((q.count, q.p50), (2, 5));
        assert_eq!(Quantiles::of(&RequestMetrics::new().itl_us).count, 0);
    }
}

#[cfg(test)]
mod queue_tests {
    use super::*;
    use crate::config::{BusyThresholds, QueueOrder};
    use crate::index::IndexConfig;
    use std::sync::Arc;
    use std::time::Duration;

    const BS: u32 = 16;

    /// One worker of 10 blocks, busy over 5 active blocks: a 96-token (6-block) request makes
    /// it busy.
    fn busy_router(order: QueueOrder, cap: u64) -> Router {
        let r = Router::new(
            RouterConfig {
                busy: BusyThresholds {
                    decode_blocks_fraction: Some(0.5),
                    prefill_tokens_fraction: None,
                },
                queue: Queueing::On {
                    max_queued_tokens: cap,
                    order,
                },
                ..RouterConfig::default()
            },
            PrefixIndex::new(IndexConfig::default()),
        )
        .unwrap();
        r.join_worker(WorkerConfig::simple(1, 10, BS)).unwrap();
        r
    }

    fn toks(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 100_000 + i).collect()
    }

    fn req(id: u64, tokens: &[u32]) -> RouteRequest<'_> {
        RouteRequest {
            id: RequestId(id),
            tokens,
            hints: RouteHints::default(),
        }
    }

    fn queued(a: Admission) -> Ticket {
        match a {
            Admission::Queued(t) => t,
            Admission::Routed(d) => panic!("routed {d:?}"),
        }
    }

    #[test]
    fn submit_queues_while_busy_and_frees_release_in_fcfs_order_with_jumps() {
        let r = busy_router(QueueOrder::Fcfs, 10_000);
        let t0 = Instant::now();
        let (a, b, c) = (toks(1, 96), toks(2, 96), toks(3, 96));
        assert!(matches!(
            r.submit_at(&req(1, &a), t0),
            Ok(Admission::Routed(_))
        ));
        let tb = queued(
            r.submit_at(&req(2, &b), t0 + Duration::from_secs(1))
                .unwrap(),
        );
        // Arrives a second later with a 1.5 s jump: goes ahead of request 2.
        let mut qc = req(3, &c);
        qc.hints.priority_jump = 1.5;
        let tc = queued(r.submit_at(&qc, t0 + Duration::from_secs(2)).unwrap());
        let st = r.queue_stats().unwrap();
        assert_eq!((st.depth, st.queued_tokens, st.enqueued), (2, 192, 2));
        assert!(r.take_released(tb.request).is_none());
        // Freeing request 1 lets one request go: request 3, which makes the worker busy again.
        r.free(RequestId(1)).unwrap();
        let d3 = r.take_released(tc.request).unwrap().unwrap();
        assert_eq!(d3.request, RequestId(3));
        assert!(r.take_released(tb.request).is_none(), "still waiting");
        r.free(RequestId(3)).unwrap();
        assert_eq!(
            r.take_released(tb.request).unwrap().unwrap().request,
            RequestId(2)
        );
        assert_eq!(
            r.take_released(tb.request),
            Some(Err(RouteError::NotQueued {
                request: RequestId(2)
            })),
            "handed out once"
        );
        let st = r.queue_stats().unwrap();
        assert_eq!((st.depth, st.released, st.wait_us.len()), (0, 2, 2));
        r.free(RequestId(2)).unwrap();
        assert!(r.total_load().is_idle());
    }

    #[test]
    fn route_never_queues_and_submit_without_a_queue_routes() {
        let r = busy_router(QueueOrder::Fcfs, 10_000);
        r.route(&req(1, &toks(1, 96))).unwrap();
        let d = r.route(&req(2, &toks(2, 96))).unwrap();
        assert_eq!(d.decided_by, DecidedBy::FallbackAllBusy);
        let plain = Router::new(
            RouterConfig::default(),
            PrefixIndex::new(IndexConfig::default()),
        )
        .unwrap();
        plain.join_worker(WorkerConfig::simple(1, 10, BS)).unwrap();
        assert!(matches!(
            plain.submit(&req(1, &toks(1, 96))),
            Ok(Admission::Routed(_))
        ));
        assert!(plain.queue_stats().is_none());
    }

    #[test]
    fn over_the_cap_is_resource_exhausted_with_exact_numbers() {
        let r = busy_router(QueueOrder::Fcfs, 150);
        let t0 = Instant::now();
        r.submit_at(&req(1, &toks(1, 96)), t0).unwrap();
        queued(r.submit_at(&req(2, &toks(2, 96)), t0).unwrap());
        let e = r.submit_at(&req(3, &toks(3, 80)), t0).unwrap_err();
        assert_eq!(
            e,
            RouteError::ResourceExhausted {
                request: RequestId(3),
                request_tokens: 80,
                queued_tokens: 96,
                cap_tokens: 150,
            }
        );
        assert!(e.is_retryable());
        assert!(
            e.to_string().contains("96 tokens already queued, cap 150"),
            "{e}"
        );
        // 54 more tokens fit exactly.
        queued(r.submit_at(&req(4, &toks(4, 54)), t0).unwrap());
        let st = r.queue_stats().unwrap();
        assert_eq!(
            (st.rejected, st.queued_tokens, st.cap_tokens),
            (1, 150, 150)
        );
        // A second submit of a waiting id is a duplicate, not a second entry.
        assert!(matches!(
            r.submit_at(&req(2, &toks(2, 10)), t0),
            Err(RouteError::Load(LoadError::DuplicateRequest { .. }))
        ));
        assert!(!RouteError::NoTokens {
            request: RequestId(1)
        }
        .is_retryable());
    }

    /// A submit once queued an id that was already booked (the ledger checks duplicates
    /// only when booking), so its release failed and the caller saw two outcomes for one id.
    #[test]
    fn submit_of_a_booked_id_is_a_duplicate_not_a_queue_entry() {
        let r = busy_router(QueueOrder::Fcfs, 10_000);
        let t0 = Instant::now();
        r.submit_at(&req(1, &toks(1, 96)), t0).unwrap();
        assert_eq!(
            r.submit_at(&req(1, &toks(1, 16)), t0).unwrap_err(),
            RouteError::Load(LoadError::DuplicateRequest {
                request: RequestId(1)
            })
        );
        assert_eq!(r.queue_stats().unwrap().depth, 0);
        assert_eq!(r.counts().duplicate_admissions, 1);
    }

    /// Cancelling a released request whose booking already went (its worker left) once
    /// reported an error although the cancel took effect.
    #[test]
    fn cancel_after_the_released_booking_was_purged_still_cancels() {
        let r = busy_router(QueueOrder::Fcfs, 10_000);
        let t0 = Instant::now();
        r.submit_at(&req(1, &toks(1, 96)), t0).unwrap();
        let t = queued(r.submit_at(&req(2, &toks(2, 96)), t0).unwrap());
        r.free(RequestId(1)).unwrap();
        assert_eq!(r.ticket_state(t.request), TicketState::Released);
        r.leave_worker(WorkerId(1)).unwrap();
        assert_eq!(r.cancel_queued(t.request), Ok(Cancelled::Released));
        assert_eq!(r.ticket_state(t.request), TicketState::Unknown);
        assert_eq!(r.active_requests(), 0);
    }

    #[test]
    fn wspt_releases_the_shortest_new_prefill_first() {
        let r = busy_router(QueueOrder::Wspt, 10_000);
        let t0 = Instant::now();
        r.submit_at(&req(1, &toks(1, 96)), t0).unwrap();
        queued(r.submit_at(&req(2, &toks(2, 160)), t0).unwrap());
        queued(
            r.submit_at(&req(3, &toks(3, 112)), t0 + Duration::from_secs(5))
                .unwrap(),
        );
        let t4 = toks(4, 160);
        let mut q4 = req(4, &t4);
        q4.hints.priority_class = PriorityClass(1);
        queued(r.submit_at(&q4, t0 + Duration::from_secs(9)).unwrap());
        let mut order = Vec::new();
        let mut active = 1u64;
        while order.len() < 3 {
            r.free(RequestId(active)).unwrap();
            let mut got = Vec::new();
            r.drain_released(|id, d| {
                d.unwrap();
                got.push(id.0)
            });
            assert_eq!(got.len(), 1, "one at a time: each makes the worker busy");
            active = got[0];
            order.push(active);
        }
        assert_eq!(order, vec![4, 3, 2], "class first, then shortest");
    }

    struct CountWake(AtomicU64);
    impl std::task::Wake for CountWake {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn cancel_removes_exactly_once_and_the_future_wakes_and_resolves() {
        let r = Arc::new(busy_router(QueueOrder::Fcfs, 10_000));
        let t0 = Instant::now();
        r.submit_at(&req(1, &toks(1, 96)), t0).unwrap();
        let t2 = queued(r.submit_at(&req(2, &toks(2, 96)), t0).unwrap());
        let t3 = queued(r.submit_at(&req(3, &toks(3, 96)), t0).unwrap());
        // Waiting: leaves the queue once.
        assert_eq!(r.cancel_queued(t2.request), Ok(Cancelled::Waiting));
        assert_eq!(
            r.cancel_queued(t2.request),
            Err(RouteError::NotQueued {
                request: RequestId(2)
            })
        );
        // A future registers its waker, is woken at release and resolves once.
        let counter = Arc::new(CountWake(AtomicU64::new(0)));
        let waker = Waker::from(Arc::clone(&counter));
        let mut cx = Context::from_waker(&waker);
        let mut fut = Router::wait(Arc::clone(&r), t3);
        assert!(Pin::new(&mut fut).poll(&mut cx).is_pending());
        r.free(RequestId(1)).unwrap();
        assert_eq!(counter.0.load(Ordering::Relaxed), 1);
        match Pin::new(&mut fut).poll(&mut cx) {
            Poll::Ready(Ok(d)) => assert_eq!(d.request, RequestId(3)),
            other => panic!("{other:?}"),
        }
        drop(fut);
        assert_eq!(r.active_requests(), 1, "a resolved future cancels nothing");
        // Released but untaken, then cancelled: the booking is freed.
        let t4 = queued(r.submit_at(&req(4, &toks(4, 96)), t0).unwrap());
        r.free(RequestId(3)).unwrap();
        assert_eq!(r.active_requests(), 1);
        assert_eq!(r.cancel_queued(t4.request), Ok(Cancelled::Released));
        assert!(r.total_load().is_idle());
        assert!(r.cancel_queued(t4.request).is_err());
        // A future dropped while waiting cancels its request.
        r.submit_at(&req(5, &toks(5, 96)), t0).unwrap();
        let t6 = queued(r.submit_at(&req(6, &toks(6, 96)), t0).unwrap());
        let mut fut = Router::wait(Arc::clone(&r), t6);
        assert!(Pin::new(&mut fut).poll(&mut cx).is_pending());
        drop(fut);
        let st = r.queue_stats().unwrap();
        assert_eq!(
            (st.depth, st.cancelled_waiting, st.cancelled_released),
            (0, 2, 1)
        );
        r.free(RequestId(5)).unwrap();
        assert!(r.total_load().is_idle());
    }
}

#[cfg(test)]
mod health_tests {
    use super::*;
    use crate::index::IndexConfig;

    const BS: u32 = 16;

    fn router() -> Router {
        let r = Router::new(
            RouterConfig::default(),
            PrefixIndex::new(IndexConfig::default()),
        )
        .unwrap();
        for w in 1..=3 {
            r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
        }
        r
    }

    fn req(id: u64, tokens: &[u32]) -> RouteRequest<'_> {
        RouteRequest {
            id: RequestId(id),
            tokens,
            hints: RouteHints::default(),
        }
    }

    /// Worker 1 holds the whole prompt; marked, it is steered around, whatever its cache.
    #[test]
    fn marked_workers_are_steered_around_and_counted_per_reason() {
        let r = router();
        let t: Vec<u32> = (0..64).collect();
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        super::tests::store(&r, WorkerRank::new(1, 0), StorageTier::Device, &locals, 0);
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(1, 0));
        assert_eq!(
            r.set_health(WorkerId(1), Health::Unreachable).unwrap(),
            Health::Healthy
        );
        r.set_health(WorkerId(2), Health::Wedged).unwrap();
        for _ in 0..10 {
            let d = r.route(&q).unwrap();
            assert_eq!(d.worker, WorkerRank::new(3, 0));
            assert_eq!(d.decided_by, DecidedBy::Cost);
        }
        let c = r.counts();
        assert_eq!(
            (c.vetoed_unreachable, c.vetoed_wedged, c.all_unhealthy),
            (10, 10, 0)
        );
        // Every candidate marked: never refused, the least loaded serves.
        r.set_health(WorkerId(3), Health::Wedged).unwrap();
        r.route(&req(10, &(1000..1100).collect::<Vec<u32>>()))
            .unwrap();
        let booked = r.fleet().ranks[0].state.load().requests
            + r.fleet().ranks[1].state.load().requests
            + r.fleet().ranks[2].state.load().requests;
        assert_eq!(booked, 1);
        for _ in 0..5 {
            let d = r.route(&q).unwrap();
            assert_eq!(d.decided_by, DecidedBy::FallbackAllUnhealthy);
            assert_eq!(d.load.requests, 0, "least loaded: {d:?}");
        }
        assert_eq!(
            r.counts().all_unhealthy,
            6,
            "the booked request and five queries"
        );
        // Healthy again: the cache wins again.
        r.set_health(WorkerId(1), Health::Healthy).unwrap();
        assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(1, 0));
        assert_eq!(
            r.set_health(WorkerId(9), Health::Wedged),
            Err(RouterError::Registry(RegistryError::UnknownWorker {
                worker: WorkerId(9)
            }))
        );
    }

    /// The count of marked ranks, which lets selection skip reading marks, stays exact across
    /// repeated marks and a marked worker leaving.
    #[test]
    fn marked_rank_count_follows_marks_and_leaves() {
        let r = router();
        r.join_worker(WorkerConfig {
            dp_size: 4,
            ..WorkerConfig::simple(7, 1000, BS)
        })
        .unwrap();
        r.set_health(WorkerId(7), Health::Wedged).unwrap();
        r.set_health(WorkerId(7), Health::Unreachable).unwrap();
        r.set_health(WorkerId(1), Health::Unreachable).unwrap();
        assert_eq!(r.marked_ranks.load(Ordering::Relaxed), 5);
        r.leave_worker(WorkerId(7)).unwrap();
        assert_eq!(r.marked_ranks.load(Ordering::Relaxed), 1);
        r.set_health(WorkerId(1), Health::Healthy).unwrap();
        assert_eq!(r.marked_ranks.load(Ordering::Relaxed), 0);
    }

    /// Pinned requests go where pinned, marked or not: the caller chose.
    #[test]
    fn pins_ignore_marks() {
        let r = router();
        r.set_health(WorkerId(2), Health::Unreachable).unwrap();
        let t: Vec<u32> = (0..40).collect();
        let mut q = req(1, &t);
        q.hints.pinned.backend_instance = Some(WorkerId(2));
        assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(2, 0));
    }
}

#[cfg(test)]
mod constraint_tests {
    use super::*;
    use crate::config::{BusyThresholds, QueueOrder};
    use crate::index::IndexConfig;
    use std::collections::HashSet;

    const BS: u32 = 16;

    fn labelled(id: u64, kv_blocks: u64, labels: &[(&str, &str)]) -> WorkerConfig {
        WorkerConfig {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..WorkerConfig::simple(id, kv_blocks, BS)
        }
    }

    fn router(config: RouterConfig, kv_blocks: u64) -> Router {
        let r = Router::new(config, PrefixIndex::new(IndexConfig::default())).unwrap();
        r.join_worker(labelled(1, kv_blocks, &[("zone", "a"), ("gpu", "h100")]))
            .unwrap();
        r.join_worker(labelled(2, kv_blocks, &[("zone", "b"), ("gpu", "h100")]))
            .unwrap();
        r.join_worker(labelled(3, kv_blocks, &[("zone", "a"), ("gpu", "a10")]))
            .unwrap();
        r
    }

    const ZONE_A: Label<'static> = Label {
        key: "zone",
        value: "a",
    };

    #[test]
    fn required_labels_filter_and_none_eligible_is_a_clear_error() {
        let r = router(RouterConfig::default(), 1000);
        let t: Vec<u32> = (0..64).collect();
        let mut q = RouteRequest {
            id: RequestId(1),
            tokens: &t,
            hints: RouteHints::default(),
        };
        q.hints.mode = Mode::QueryOnly;
        q.hints.required = &[ZONE_A];
        let mut seen = HashSet::new();
        for _ in 0..100 {
            seen.insert(r.route(&q).unwrap().worker.worker.0);
        }
        assert_eq!(seen, HashSet::from([1, 3]));
        let both = [
            Label {
                key: "zone",
                value: "b",
            },
            Label {
                key: "gpu",
                value: "a10",
            },
        ];
        q.hints.required = &both;
        assert_eq!(
            r.route(&q),
            Err(RouteError::NoEligibleWorker {
                request: RequestId(1)
            })
        );
        let unknown = [Label {
            key: "zone",
            value: "z",
        }];
        q.hints.required = &unknown;
        assert!(matches!(
            r.route(&q),
            Err(RouteError::NoEligibleWorker { .. })
        ));
        q.hints.required = &[ZONE_A];
        q.hints.pinned.backend_instance = Some(WorkerId(2));
        assert_eq!(
            r.route(&q),
            Err(RouteError::PinnedLacksLabels {
                request: RequestId(1),
                worker: WorkerId(2)
            })
        );
        assert_eq!(r.counts().no_eligible, 3);
    }

    #[test]
    fn preferred_labels_lower_the_cost_by_their_weight() {
        let r = router(RouterConfig::default(), 1000);
        let t: Vec<u32> = (0..64).collect();
        let prefer = [PreferredLabel {
            label: Label {
                key: "gpu",
                value: "h100",
            },
            weight: 3.0,
        }];
        let mut q = RouteRequest {
            id: RequestId(1),
            tokens: &t,
            hints: RouteHints::default(),
        };
        q.hints.mode = Mode::QueryOnly;
        q.hints.preferred = &prefer;
        q.hints.evidence = EvidenceLevel::Full;
        for _ in 0..50 {
            let d = r.route(&q).unwrap();
            assert_ne!(d.worker.worker, WorkerId(3));
            assert_eq!(d.cost.preference, 3.0);
            assert_eq!(d.cost.total, 4.0 + 4.0 - 3.0);
            let ev = d.evidence.unwrap();
            let w3 = ev.iter().find(|c| c.rank.worker == WorkerId(3)).unwrap();
            assert_eq!((w3.cost.preference, w3.cost.total), (0.0, 8.0));
        }
        let bad = [PreferredLabel {
            weight: f64::NAN,
            ..prefer[0]
        }];
        q.hints.preferred = &bad;
        assert!(matches!(
            r.route(&q),
            Err(RouteError::InvalidHint {
                field: "preferred.weight",
                ..
            })
        ));
        assert_eq!(r.counts().invalid_hints, 1);
    }

    /// The labelled fleet with 10-block workers, busy over 5 active blocks, and an FCFS queue.
    fn queued_labelled_router() -> Router {
        router(
            RouterConfig {
                busy: BusyThresholds {
                    decode_blocks_fraction: Some(0.5),
                    prefill_tokens_fraction: None,
                },
                queue: Queueing::On {
                    max_queued_tokens: 10_000,
                    order: QueueOrder::Fcfs,
                },
                ..RouterConfig::default()
            },
            10,
        )
    }

    /// A waiting head holds back only what no free rank could serve: with zone a busy, a
    /// zone-a request waits, a request for any worker behind it goes to zone b at once, and a
    /// second zone-a request keeps its place behind the first.
    #[test]
    fn a_waiting_head_does_not_block_requests_other_ranks_can_serve() {
        let r = queued_labelled_router();
        let t: Vec<u32> = (0..96).collect();
        let q = |id: u64, zone_a: bool| {
            let mut q = RouteRequest {
                id: RequestId(id),
                tokens: &t,
                hints: RouteHints::default(),
            };
            if zone_a {
                q.hints.required = &[ZONE_A];
            }
            q
        };
        for w in [1, 3] {
            let mut p = q(w, false);
            p.hints.pinned.backend_instance = Some(WorkerId(w));
            r.route(&p).unwrap();
        }
        let t0 = Instant::now();
        assert!(matches!(
            r.submit_at(&q(9, true), t0),
            Ok(Admission::Queued(_))
        ));
        // Queued behind the waiting head, then released by the same call: zone b is free.
        assert!(matches!(
            r.submit_at(&q(10, false), t0),
            Ok(Admission::Queued(_))
        ));
        let d = r.take_released(RequestId(10)).unwrap().unwrap();
        assert_eq!(d.worker, WorkerRank::new(2, 0));
        assert!(matches!(
            r.submit_at(&q(11, true), t0),
            Ok(Admission::Queued(_))
        ));
        assert_eq!(r.release_queued(t0), 0, "zone a is still busy");
        assert_eq!(r.ticket_state(RequestId(9)), TicketState::Waiting);
        assert_eq!(r.ticket_state(RequestId(11)), TicketState::Waiting);
        // Zone a frees one worker: the first zone-a request takes it, the second still waits.
        r.free(RequestId(3)).unwrap();
        assert_eq!(
            r.take_released(RequestId(9)).unwrap().unwrap().worker,
            WorkerRank::new(3, 0)
        );
        assert_eq!(r.ticket_state(RequestId(11)), TicketState::Waiting);
        r.free(RequestId(1)).unwrap();
        assert_eq!(
            r.take_released(RequestId(11)).unwrap().unwrap().worker,
            WorkerRank::new(1, 0)
        );
        for id in [9, 10, 11] {
            r.free(RequestId(id)).unwrap();
        }
        assert!(r.total_load().is_idle());
        assert_eq!(r.queue_stats().unwrap().depth, 0);
    }

    /// A queued request keeps its constraints: with the zone-a workers busy and zone b free,
    /// it waits, and goes to zone a when load frees there.
    #[test]
    fn queued_requests_keep_their_labels() {
        let r = queued_labelled_router();
        let t: Vec<u32> = (0..96).collect();
        for (id, w) in [(1, 1), (3, 3)] {
            let mut q = RouteRequest {
                id: RequestId(id),
                tokens: &t,
                hints: RouteHints::default(),
            };
            q.hints.pinned.backend_instance = Some(WorkerId(w));
            r.route(&q).unwrap();
        }
        let mut q = RouteRequest {
            id: RequestId(9),
            tokens: &t,
            hints: RouteHints::default(),
        };
        q.hints.required = &[ZONE_A];
        assert!(matches!(r.submit(&q), Ok(Admission::Queued(_))));
        r.free(RequestId(3)).unwrap();
        let d = r.take_released(RequestId(9)).unwrap().unwrap();
        assert_eq!(d.worker, WorkerRank::new(3, 0));
    }
}

#[cfg(test)]
mod session_tests {
    use super::*;
    use crate::index::IndexConfig;
    use std::sync::Arc;
    use std::time::Duration;

    const BS: u32 = 16;

    fn router() -> Router {
        let r = Router::new(
            RouterConfig {
                session_idle_ttl: Duration::from_secs(30),
                ..RouterConfig::default()
            },
            PrefixIndex::new(IndexConfig::default()),
        )
        .unwrap();
        for w in 1..=4 {
            r.join_worker(WorkerConfig {
                dp_size: 2,
                ..WorkerConfig::simple(w, 1000, BS)
            })
            .unwrap();
        }
        r
    }

    fn turn(r: &Router, id: u64, session: u64, now: Instant) -> Decision {
        let t: Vec<u32> = (0..48).map(|i| (id as u32) * 1000 + i).collect();
        let mut q = RouteRequest {
            id: RequestId(id),
            tokens: &t,
            hints: RouteHints::default(),
        };
        q.hints.session = Some(SessionId(session));
        r.route_at(&q, now).unwrap()
    }

    #[test]
    fn a_session_sticks_to_its_rank_and_is_rerouted_when_its_worker_left() {
        let r = router();
        let t0 = Instant::now();
        let first = turn(&r, 1, 7, t0);
        assert_eq!(first.session, Some(SessionRouting::Bound));
        assert_eq!(r.session_rank(SessionId(7)), Some(first.worker));
        // Later turns go to the same (worker, dp rank), whatever the load says.
        for id in 2..10 {
            let d = turn(&r, id, 7, t0);
            assert_eq!(d.worker, first.worker);
            assert_eq!(
                (d.session, d.decided_by),
                (Some(SessionRouting::Sticky), DecidedBy::Session)
            );
        }
        r.leave_worker(first.worker.worker).unwrap();
        let d = turn(&r, 10, 7, t0);
        assert_ne!(d.worker.worker, first.worker.worker);
        assert_eq!(
            d.session,
            Some(SessionRouting::Rerouted {
                previous: first.worker
            })
        );
        assert_eq!(r.session_rank(SessionId(7)), Some(d.worker), "rebound");
        assert_eq!(turn(&r, 11, 7, t0).session, Some(SessionRouting::Sticky));
        let c = r.counts();
        assert_eq!((c.sessions_bound, c.sessions_rerouted), (1, 1));
    }

    #[test]
    fn idle_sessions_expire_through_the_callback() {
        let r = router();
        let ended = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&ended);
        r.on_session_end(move |e| lock(&sink).push(e));
        let t0 = Instant::now();
        let a = turn(&r, 1, 1, t0);
        turn(&r, 2, 2, t0 + Duration::from_secs(20));
        r.free(RequestId(1)).unwrap();
        r.free(RequestId(2)).unwrap();
        // The frees read the clock (after t0 + 0): session 1 was last used then.
        let late = Instant::now() + Duration::from_secs(60);
        assert_eq!(r.expire_sessions(t0 + Duration::from_secs(29)), 0);
        assert_eq!(r.expire_sessions(late), 2);
        let got = lock(&ended).clone();
        assert_eq!(got.len(), 2);
        assert!(got.contains(&SessionEnd {
            session: SessionId(1),
            worker: a.worker,
            reason: SessionEndReason::Expired
        }));
        assert_eq!(r.counts().sessions_expired, 2);
        assert_eq!(turn(&r, 3, 1, late).session, Some(SessionRouting::Bound));
    }

    /// A session whose request is still generating does not expire, however long it runs.
    #[test]
    fn a_running_request_keeps_its_session() {
        let r = router();
        let t0 = Instant::now();
        turn(&r, 1, 1, t0);
        assert_eq!(r.expire_sessions(t0 + Duration::from_secs(3600)), 0);
        r.free(RequestId(1)).unwrap();
        assert_eq!(
            r.expire_sessions(Instant::now() + Duration::from_secs(31)),
            1
        );
    }

    #[test]
    fn a_close_with_a_request_is_deferred_until_it_ends() {
        let r = router();
        let ended = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&ended);
        r.on_session_end(move |e| lock(&sink).push(e));
        let t0 = Instant::now();
        let first = turn(&r, 1, 5, t0);
        let t: Vec<u32> = (0..48).collect();
        let mut q = RouteRequest {
            id: RequestId(2),
            tokens: &t,
            hints: RouteHints::default(),
        };
        q.hints.session = Some(SessionId(5));
        q.hints.session_close = SessionClose::AfterThisRequest;
        r.route_at(&q, t0).unwrap();
        r.free(RequestId(1)).unwrap();
        assert!(lock(&ended).is_empty(), "request 2 still generates");
        assert_eq!(r.session_rank(SessionId(5)), Some(first.worker));
        r.output_block(RequestId(2)).unwrap();
        r.free(RequestId(2)).unwrap();
        assert_eq!(
            lock(&ended).clone(),
            vec![SessionEnd {
                session: SessionId(5),
                worker: first.worker,
                reason: SessionEndReason::Closed
            }]
        );
        assert_eq!(r.session_rank(SessionId(5)), None);
        // Closed with a request that then expired: the sweep closes it.
        r.route_at(&q, t0).unwrap();
        assert_eq!(r.expire(Instant::now() + r.config().request_expiry), 1);
        assert_eq!(r.expire_sessions(t0), 1);
        assert_eq!(lock(&ended).len(), 2);
        assert_eq!(r.counts().sessions_closed, 2);
        assert_eq!(r.close_session(SessionId(5)), None);
    }
}

#[cfg(test)]
mod approx_tests {
    use super::*;
    use crate::config::Approximate;
    use crate::event::{BlockHash, EventHeader, EventId, KvEventData, StoredBlock};
    use crate::index::IndexConfig;
    use std::time::Duration;

    const BS: u32 = 16;

    fn router(speculative: Speculative) -> Router {
        Router::new(
            RouterConfig {
                approximate: Approximate {
                    speculative,
                    ..Approximate::default()
                },
                ..RouterConfig::default()
            },
            PrefixIndex::new(IndexConfig::default()),
        )
        .unwrap()
    }

    fn prompt(n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| i * 13 + 5).collect()
    }

    /// Query-only overlap on `rank` at `now`.
    fn overlap_on(r: &Router, tokens: &[u32], rank: WorkerRank, now: Instant) -> u32 {
        let mut q = RouteRequest {
            id: RequestId(999),
            tokens,
            hints: RouteHints::default(),
        };
        q.hints.mode = Mode::QueryOnly;
        q.hints.evidence = EvidenceLevel::Full;
        let d = r.route_at(&q, now).unwrap();
        let ev = d.evidence.unwrap();
        ev.iter()
            .find(|c| c.rank == rank)
            .map_or(0, |c| c.overlap.blocks)
    }

    fn pinned(r: &Router, id: u64, tokens: &[u32], worker: u64, now: Instant) {
        let mut q = RouteRequest {
            id: RequestId(id),
            tokens,
            hints: RouteHints::default(),
        };
        q.hints.pinned.backend_instance = Some(WorkerId(worker));
        r.route_at(&q, now).unwrap();
    }

    #[test]
    fn decisions_on_a_worker_without_events_count_as_its_cache_for_the_ttl() {
        let r = router(Speculative::Off);
        r.join_worker_with(WorkerConfig::simple(1, 1000, BS), KvEvents::Absent)
            .unwrap();
        r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
        let t0 = Instant::now();
        let p = prompt(128); // 8 blocks
        pinned(&r, 1, &p, 1, t0);
        pinned(&r, 2, &p, 2, t0);
        r.free(RequestId(1)).unwrap();
        r.free(RequestId(2)).unwrap();
        let w1 = WorkerRank::new(1, 0);
        let longer: Vec<u32> = p.iter().copied().chain(1_000..1_100).collect();
        assert_eq!(overlap_on(&r, &longer, w1, t0 + Duration::from_secs(1)), 8);
        assert_eq!(
            overlap_on(&r, &longer, WorkerRank::new(2, 0), t0),
            0,
            "a worker with events is not recorded unless speculation is on"
        );
        let mut q = RouteRequest {
            id: RequestId(3),
            tokens: &longer,
            hints: RouteHints::default(),
        };
        q.hints.mode = Mode::QueryOnly;
        assert_eq!(
            r.route_at(&q, t0 + Duration::from_secs(119))
                .unwrap()
                .worker,
            w1
        );
        assert_eq!(
            overlap_on(&r, &longer, w1, t0 + Duration::from_secs(120)),
            0
        );
        assert!(r.counts().approx_raised >= 2);
        r.expire(t0 + Duration::from_secs(120));
        assert_eq!(r.counts().approx.records, 0);
    }

    /// A pinned route sees its rank's records where they go deeper than the index's overlap,
    /// and the index's overlap where that is deeper (only records deeper than the index's
    /// overlap of the pinned rank are read).
    #[test]
    fn a_pinned_route_reads_its_ranks_records_beyond_the_index() {
        let r = router(Speculative::Off);
        for w in [1, 2] {
            r.join_worker_with(WorkerConfig::simple(w, 1000, BS), KvEvents::Absent)
                .unwrap();
        }
        let t0 = Instant::now();
        let long = prompt(256); // 16 blocks
        pinned(&r, 1, &long[..128], 1, t0);
        pinned(&r, 2, &long, 2, t0);
        r.free(RequestId(1)).unwrap();
        r.free(RequestId(2)).unwrap();
        let on_pinned = |worker: u64| {
            let mut q = RouteRequest {
                id: RequestId(50 + worker),
                tokens: &long,
                hints: RouteHints::default(),
            };
            q.hints.mode = Mode::QueryOnly;
            q.hints.evidence = EvidenceLevel::Full;
            q.hints.pinned.backend_instance = Some(WorkerId(worker));
            let ev = r.route_at(&q, t0).unwrap().evidence.unwrap();
            assert_eq!(ev.len(), 1);
            ev[0].overlap.blocks
        };
        assert_eq!((on_pinned(1), on_pinned(2)), (8, 16));
        let locals = BlockHasher::new(BS as usize).local_hashes(&long);
        let w1 = WorkerRank::new(1, 0);
        tests::store(&r, w1, StorageTier::Device, &locals[..4], 0);
        assert_eq!(on_pinned(1), 8, "the record goes deeper than the index");
        tests::store(&r, w1, StorageTier::Device, &locals[..12], 1);
        assert_eq!(on_pinned(1), 12, "the index goes deeper than the record");
    }

    /// A speculative record bridges the time to the worker's first events, is overtaken by
    /// them, and never outlives its TTL; an eviction from the worker retires it at once.
    #[test]
    fn speculative_records_bridge_to_real_events_and_never_outlive_their_ttl() {
        let ttl = Duration::from_millis(1500);
        let r = router(Speculative::On { ttl });
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
        let t0 = Instant::now();
        let p = prompt(128);
        let w1 = WorkerRank::new(1, 0);
        pinned(&r, 1, &p, 1, t0);
        // A burst of the same prefix now sees it on worker 1.
        for ms in [0u64, 1, 500, 1499] {
            assert_eq!(overlap_on(&r, &p, w1, t0 + Duration::from_millis(ms)), 8);
        }
        for ms in [1500u64, 1501, 5000, 120_000] {
            assert_eq!(
                overlap_on(&r, &p, w1, t0 + Duration::from_millis(ms)),
                0,
                "{ms} ms"
            );
        }
        // The worker's events for the first 4 blocks: the index's overlap stays after the
        // record expired; before, the deeper of the two counts.
        let blocks = first_blocks(&p, 4);
        let header = EventHeader {
            source: w1,
            event_id: EventId(0),
            tier: StorageTier::Device,
        };
        r.apply_event(&KvEvent {
            header,
            data: KvEventData::Stored {
                parent: None,
                blocks,
            },
        })
        .unwrap();
        let t1 = t0 + Duration::from_secs(10);
        pinned(&r, 2, &p, 1, t1);
        assert_eq!(overlap_on(&r, &p, w1, t1 + Duration::from_millis(10)), 8);
        assert_eq!(overlap_on(&r, &p, w1, t1 + ttl), 4);
        // An eviction from the worker retires its speculation immediately.
        pinned(&r, 3, &prompt(200), 1, t1);
        r.apply_event(&KvEvent {
            header: EventHeader {
                event_id: EventId(1),
                ..header
            },
            data: KvEventData::Removed {
                blocks: vec![BlockHash(4)],
            },
        })
        .unwrap();
        assert_eq!(overlap_on(&r, &p, w1, t1 + Duration::from_millis(10)), 3);
    }

    /// The first `n` blocks of prompt `p` as an engine would store them (block hashes 1..=n).
    fn first_blocks(p: &[u32], n: usize) -> Vec<StoredBlock> {
        let locals = BlockHasher::new(BS as usize).local_hashes(p);
        locals[..n]
            .iter()
            .enumerate()
            .map(|(i, h)| StoredBlock {
                block_hash: BlockHash(i as u64 + 1),
                local_hash: *h,
            })
            .collect()
    }

    /// A router speculating for 5 s, worker 1 joined, and a booked 8-block prompt on it:
    /// the router, the time, the prompt and the worker's rank.
    fn speculating_on_one_worker() -> (Router, Instant, Vec<u32>, WorkerRank) {
        let r = router(Speculative::On {
            ttl: Duration::from_secs(5),
        });
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        let t0 = Instant::now();
        let p = prompt(128);
        let w1 = WorkerRank::new(1, 0);
        pinned(&r, 1, &p, 1, t0);
        assert_eq!(overlap_on(&r, &p, w1, t0), 8);
        (r, t0, p, w1)
    }

    /// An ingest path that writes the index itself tells the router through `note_event`:
    /// an eviction reported that way retires the speculation just the same.
    #[test]
    fn events_applied_elsewhere_are_noted() {
        let (r, t0, p, w1) = speculating_on_one_worker();
        r.note_event(w1, StorageTier::Device, EventSeen::Stored { blocks: 8 });
        assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 8);
        r.note_event(w1, StorageTier::Device, EventSeen::Removed { blocks: 3 });
        assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 5);
        assert_eq!(overlap_on(&r, &p, w1, t0), 0);
    }

    /// Events written through the router's event writer (as an ingest path writes them)
    /// reach the index and are noted: stored blocks feed warm-up's measure, an eviction
    /// retires speculation, and a rejected event is noted not at all.
    #[test]
    fn the_event_writer_applies_and_notes() {
        use crate::index::ApplyEvents;
        let (r, t0, p, w1) = speculating_on_one_worker();
        let blocks = first_blocks(&p, 4);
        let header = |id: u64| EventHeader {
            source: w1,
            event_id: EventId(id),
            tier: StorageTier::Device,
        };
        {
            let mut w = r.event_writer();
            w.apply_stored(header(0), None, &blocks).unwrap();
            let unknown = EventHeader {
                source: WorkerRank::new(9, 0),
                ..header(1)
            };
            assert!(w.apply_removed(unknown, &[BlockHash(1)]).is_err());
        }
        assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 4);
        assert_eq!(overlap_on(&r, &p, w1, t0), 8, "the record is still deeper");
        r.event_writer()
            .apply_removed(header(1), &[BlockHash(4)])
            .unwrap();
        assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 3);
        assert_eq!(
            overlap_on(&r, &p, w1, t0),
            3,
            "the eviction retired the record"
        );
        r.event_writer().apply_cleared(header(2)).unwrap();
        assert_eq!(overlap_on(&r, &p, w1, t0), 0);
    }

    /// Records are kept by the rank's index key: when a worker leaves and another takes its
    /// index id, the newcomer gets none of the leaver's records, and a worker that rejoins
    /// starts without its old ones.
    #[test]
    fn a_departed_workers_records_credit_no_one() {
        let r = router(Speculative::On {
            ttl: Duration::from_secs(60),
        });
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
        let t0 = Instant::now();
        let p = prompt(128);
        let (w1, w3) = (WorkerRank::new(1, 0), WorkerRank::new(3, 0));
        pinned(&r, 1, &p, 1, t0);
        assert_eq!(overlap_on(&r, &p, w1, t0), 8);
        let id_of = |w: WorkerRank| {
            let f = r.fleet();
            f.ranks[f.rank_index(w).unwrap()].index_key.unwrap().id
        };
        let old_id = id_of(w1);
        r.leave_worker(WorkerId(1)).unwrap();
        assert_eq!(r.counts().approx.records, 0);
        r.join_worker(WorkerConfig::simple(3, 1000, BS)).unwrap();
        assert_eq!(id_of(w3), old_id, "the newcomer takes the freed id");
        assert_eq!(overlap_on(&r, &p, w3, t0), 0);
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        assert_eq!(overlap_on(&r, &p, w1, t0), 0);
        pinned(&r, 2, &p, 1, t0);
        assert_eq!(overlap_on(&r, &p, w1, t0), 8);
        assert_eq!(overlap_on(&r, &p, w3, t0), 0);
    }
}

#[cfg(test)]
mod warm_up_tests {
    use super::*;
    use crate::event::{BlockHash, EventHeader, EventId, KvEventData, StoredBlock};
    use crate::index::IndexConfig;
    use std::collections::HashSet;
    use std::time::Duration;

    const BS: u32 = 16;
    const MINUTE: Duration = Duration::from_secs(60);

    fn router(share: f64, low_share: f64) -> Router {
        let r = Router::new(
            RouterConfig {
                warm_up: WarmUp::On {
                    share,
                    duration: MINUTE,
                    low_share,
                },
                ..RouterConfig::default()
            },
            PrefixIndex::new(IndexConfig::default()),
        )
        .unwrap();
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
        r
    }

    fn query(r: &Router, seed: u32, now: Instant) -> Decision {
        let t: Vec<u32> = (0..64).map(|i| seed * 1000 + i).collect();
        let mut q = RouteRequest {
            id: RequestId(u64::from(seed)),
            tokens: &t,
            hints: RouteHints::default(),
        };
        q.hints.mode = Mode::QueryOnly;
        r.route_at(&q, now).unwrap()
    }

    fn store(r: &Router, worker: u64, seed: u32, n: usize, id: u64) {
        let t: Vec<u32> = (0..(n * BS as usize) as u32)
            .map(|i| seed * 1000 + i)
            .collect();
        let blocks: Vec<StoredBlock> = BlockHasher::new(BS as usize)
            .local_hashes(&t)
            .iter()
            .enumerate()
            .map(|(i, h)| StoredBlock {
                block_hash: BlockHash(u64::from(seed) << 20 | i as u64),
                local_hash: *h,
            })
            .collect();
        r.apply_event(&KvEvent {
            header: EventHeader {
                source: WorkerRank::new(worker, 0),
                event_id: EventId(id),
                tier: StorageTier::Device,
            },
            data: KvEventData::Stored {
                parent: None,
                blocks,
            },
        })
        .unwrap();
    }

    #[test]
    fn a_new_worker_takes_its_share_of_cache_misses_for_the_duration() {
        let r = router(1.0, 0.0);
        let t0 = Instant::now();
        let settled = t0 + MINUTE;
        for seed in 0..20 {
            assert_eq!(query(&r, seed, settled).decided_by, DecidedBy::Cost);
        }
        r.join_worker_at(
            WorkerConfig::simple(3, 1000, BS),
            KvEvents::Published,
            settled,
        )
        .unwrap();
        let now = settled + Duration::from_secs(1);
        for seed in 0..20 {
            let d = query(&r, seed, now);
            assert_eq!(
                (d.worker, d.decided_by),
                (WorkerRank::new(3, 0), DecidedBy::WarmUp)
            );
        }
        // A request with a holder is not a miss: the cost decides.
        store(&r, 1, 77, 4, 0);
        let d = query(&r, 77, now);
        assert_eq!(
            (d.worker, d.decided_by),
            (WorkerRank::new(1, 0), DecidedBy::Cost)
        );
        assert_eq!(query(&r, 5, settled + MINUTE).decided_by, DecidedBy::Cost);
        assert_eq!(r.counts().warm_up, 20);
    }

    #[test]
    fn the_share_is_a_fraction_of_misses() {
        let r = router(0.25, 0.0);
        r.join_worker(WorkerConfig::simple(3, 1000, BS)).unwrap();
        let now = Instant::now();
        let warm = (0..4000)
            .filter(|&seed| query(&r, seed, now).decided_by == DecidedBy::WarmUp)
            .count();
        assert!((850..1150).contains(&warm), "{warm}");
    }

    /// Pruned selection and warm-up agree with the unpruned: worker 3 warms (it just joined),
    /// workers 1 and 2 have warmed long ago. A miss whose warming candidate cannot win on cost
    /// still goes to it (the pruned gather is redone for warm-up's pick); a request that a
    /// free worker holds a block of is no miss, even when that worker is pruned for its load.
    #[test]
    fn pruning_keeps_warm_ups_misses_and_hits() {
        let r = router(1.0, 0.0);
        let t0 = Instant::now();
        let later = t0 + 3 * MINUTE;
        r.join_worker_at(
            WorkerConfig::simple(3, 1000, BS),
            KvEvents::Published,
            later,
        )
        .unwrap();
        // Worker 3 carries a little load, worker 1 a lot (and one block of query 9's prompt).
        let load = |worker: u64, id: u64, blocks: usize| {
            let t: Vec<u32> = (0..(blocks * BS as usize) as u32)
                .map(|i| 777_000 + i)
                .collect();
            let mut q = RouteRequest {
                id: RequestId(id),
                tokens: &t,
                hints: RouteHints::default(),
            };
            q.hints.pinned.backend_instance = Some(WorkerId(worker));
            r.route_at(&q, later).unwrap();
        };
        load(3, 100, 1);
        load(1, 101, 40);
        store(&r, 1, 9, 1, 1);
        // A miss: worker 3 costs more than worker 2, but warm-up takes it.
        for seed in 20..60 {
            assert_eq!(
                query(&r, seed, later).worker.worker,
                WorkerId(3),
                "seed {seed}"
            );
        }
        // Query 9: worker 1 holds its first block, so no miss; the cheapest serves (worker
        // 2, as worker 1's load outweighs its block).
        for _ in 0..40 {
            let d = query(&r, 9, later);
            assert_eq!(d.worker.worker, WorkerId(2));
            assert_eq!(d.decided_by, DecidedBy::Cost);
        }
    }

    /// A worker whose reported cache is far below the fleet's warms again at the next expire
    /// sweep; a cleared worker warms at once.
    #[test]
    fn far_below_the_fleets_share_or_cleared_warms_again() {
        let r = router(1.0, 0.1);
        r.join_worker(WorkerConfig::simple(3, 1000, BS)).unwrap();
        store(&r, 1, 1, 50, 0);
        store(&r, 2, 2, 50, 0);
        store(&r, 3, 3, 5, 0);
        let later = Instant::now() + 2 * MINUTE;
        assert_eq!(query(&r, 9, later).decided_by, DecidedBy::Cost);
        r.expire(later);
        assert_eq!(
            r.counts().rewarmed,
            0,
            "5 of a mean 35 blocks is above 10 %"
        );
        store(&r, 1, 11, 200, 1);
        r.expire(later);
        assert_eq!(r.counts().rewarmed, 1, "5 of a mean 101.7 is below 10 %");
        let d = query(&r, 9, later);
        assert_eq!(
            (d.worker, d.decided_by),
            (WorkerRank::new(3, 0), DecidedBy::WarmUp)
        );
        r.apply_event(&KvEvent {
            header: EventHeader {
                source: WorkerRank::new(2, 0),
                event_id: EventId(1),
                tier: StorageTier::Device,
            },
            data: KvEventData::Cleared,
        })
        .unwrap();
        assert_eq!(r.fleet().ranks[1].state.reported_blocks(), 0);
        let now = Instant::now();
        let mut seen = HashSet::new();
        for seed in 100..140 {
            let d = query(&r, seed, now);
            assert_eq!(d.decided_by, DecidedBy::WarmUp);
            seen.insert(d.worker.worker.0);
        }
        assert!(seen.contains(&2), "{seen:?}");
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)]
mod pool_tests {
    use super::*;
    use crate::index::IndexConfig;

    const BS: u32 = 16;

    #[test]
    fn ranges_are_clipped_sorted_and_merged() {
        let mut out = Vec::new();
        merge_pool_ranges(&[5..8, 0..3, 2..6, 9..40, 12..12], 20, &mut out).unwrap();
        assert_eq!(out, vec![(0, 8), (9, 20)]);
        #[allow(clippy::reversed_empty_ranges)]
        let bad = [0..3, 7..4];
        assert!(merge_pool_ranges(&bad, 20, &mut out).is_err());
        assert!(out.is_empty());
    }

    fn setup() -> (Router, Vec<u32>) {
        let r = Router::new(
            RouterConfig::default(),
            PrefixIndex::new(IndexConfig::default()),
        )
        .unwrap();
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
        let t: Vec<u32> = (0..160).map(|i| i * 3 + 1).collect(); // 10 blocks
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        let first = WorkerRank::new(1, 0);
        super::tests::store(&r, first, StorageTier::Device, &locals[..4], 0);
        (r, t)
    }

    fn evidence<'a>(r: &Router, t: &'a [u32], pool: PoolHits<'a>) -> (Decision, Vec<Candidate>) {
        let mut q = RouteRequest {
            id: RequestId(1),
            tokens: t,
            hints: RouteHints::default(),
        };
        q.hints.mode = Mode::QueryOnly;
        q.hints.evidence = EvidenceLevel::Full;
        q.hints.pool = pool;
        let mut d = r.route(&q).unwrap();
        let mut ev = d.evidence.take().unwrap();
        ev.sort_by_key(|c| c.rank);
        (d, ev)
    }

    /// Worker 1 holds blocks 0-3, worker 2 nothing; the pool holds 0-9. Each is credited the
    /// pool's blocks beyond its own overlap, at 0.25.
    #[test]
    fn pool_hits_beyond_the_own_overlap_are_credited_at_the_multiplier() {
        let (r, t) = setup();
        let hits = [0..10];
        let (d, ev) = evidence(&r, &t, PoolHits::Hits(&hits));
        assert_eq!(
            (ev[0].cost.pool_blocks, ev[0].cost.credit_blocks),
            (6, 4.0 + 1.5)
        );
        assert_eq!(
            (ev[1].cost.pool_blocks, ev[1].cost.credit_blocks),
            (10, 2.5)
        );
        assert_eq!(ev[0].cost.total, (10.0 - 5.5) + 10.0);
        assert_eq!(d.worker, WorkerRank::new(1, 0));
        assert_eq!(
            d.cost, ev[0].cost,
            "the decision's terms are the evidence's"
        );
        // A pool run that does not continue the worker's own prefix earns nothing.
        let gap = [6..10];
        let (_, ev) = evidence(&r, &t, PoolHits::Hits(&gap));
        assert_eq!((ev[0].cost.pool_blocks, ev[1].cost.pool_blocks), (0, 0));
        // Credit enough to change the choice: at 1.0, worker 2 ties worker 1 on credit and
        // the tie is broken at random; both are chosen over many draws.
        let r2 = Router::new(
            RouterConfig {
                pool_credit: 1.0,
                ..RouterConfig::default()
            },
            PrefixIndex::new(IndexConfig::default()),
        )
        .unwrap();
        r2.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
        r2.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..50 {
            seen.insert(evidence(&r2, &t, PoolHits::Hits(&hits)).0.worker);
        }
        assert_eq!(seen.len(), 2);
    }

    #[test]
    fn a_failed_or_malformed_pool_answer_is_counted_and_ignored() {
        let (r, t) = setup();
        let (plain, _) = evidence(&r, &t, PoolHits::None);
        let (failed, _) = evidence(&r, &t, PoolHits::Failed);
        #[allow(clippy::reversed_empty_ranges)]
        let bad = [3..1];
        let (malformed, _) = evidence(&r, &t, PoolHits::Hits(&bad));
        assert_eq!(plain.cost, failed.cost);
        assert_eq!(plain.cost, malformed.cost);
        assert_eq!(r.counts().pool_failed, 2);
    }
}
