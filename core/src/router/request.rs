//! The request vocabulary: what a caller hands to [`super::Router::route`] (tokens and
//! hints), and why a request can be refused ([`RouteError`]).

use crate::event::{DpRank, WorkerId};
use crate::load::{LoadError, RequestId};
use crate::queue::PriorityClass;
use crate::select::Overrides;
use crate::session::{SessionClose, SessionId};

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
    /// The chosen rank's figures only; nothing allocated.
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
    /// The worker for every phase, unless the phase's own worker is set.
    pub backend_instance: Option<WorkerId>,
    /// The worker for the prefill phase.
    pub prefill_worker: Option<WorkerId>,
    /// The worker for the decode phase.
    pub decode_worker: Option<WorkerId>,
    /// The dp rank for every phase, unless the phase's own dp rank is set.
    pub dp_rank: Option<DpRank>,
    /// The dp rank for the prefill phase.
    pub prefill_dp_rank: Option<DpRank>,
    /// The dp rank for the decode phase.
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
    /// The phase the request is routed for.
    pub phase: Phase,
    /// Workers the caller pinned: a pin for the phase decides the worker.
    pub pinned: Pinned,
    /// Whether the decision books load.
    pub mode: Mode,
    /// LoRA adapter: changes the block hash seed.
    pub lora_name: Option<&'a str>,
    /// Cache isolation salt: changes the block hash seed.
    pub cache_salt: Option<&'a str>,
    /// Seconds to move ahead in the admission queue (finite; see the `queue` module); no effect
    /// on the choice.
    pub priority_jump: f64,
    /// Strict priority class in the admission queue: higher classes always go first.
    pub priority_class: PriorityClass,
    /// The prompt's length in tokens when [`RouteRequest::tokens`] holds only its beginning:
    /// a caller that tokenized a long prompt only as far as some rank could hold it
    /// ([`Router::held_blocks`](super::Router::held_blocks)). The rest counts as uncached
    /// prefill and as the request's own prompt blocks; only the tokens given are hashed,
    /// matched and booked as active. Ignored unless longer than the tokens given; past 2^32
    /// tokens the request is refused ([`RouteError::InvalidHint`]).
    pub prompt_len: Option<u64>,
    /// Expected generated tokens, when known: the request's output blocks then weigh what is
    /// left of it in the rank's decode load (see the `load` module); recorded in the decision.
    pub expected_output_tokens: Option<u32>,
    /// Only these workers may serve (`None`: any).
    pub allowed: Option<&'a [WorkerId]>,
    /// Labels a worker must carry, every one, to serve ([`RouteError::NoEligibleWorker`] when
    /// none does).
    pub required: &'a [Label<'a>],
    /// Labels that lower the cost of a worker carrying them by their weight, in blocks.
    pub preferred: &'a [PreferredLabel<'a>],
    /// The sticky session the request belongs to (see the `session` module); an explicit pin
    /// takes precedence over it.
    pub session: Option<SessionId>,
    /// Whether the session closes when this request ends.
    pub session_close: SessionClose,
    /// What the fleet's shared KV pool holds of the prompt.
    pub pool: PoolHits<'a>,
    /// Per-request overrides of the configured weights and temperature.
    pub overrides: Overrides,
    /// Whether the decision carries every candidate.
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
    /// [`RouterConfig::pool_credit`](crate::RouterConfig::pool_credit). Ranges past the prompt are
    /// clipped; a range whose start
    /// exceeds its end makes the whole answer count as failed.
    Hits(&'a [std::ops::Range<u32>]),
    /// The pool did not answer (timeout, error): counted and ignored.
    Failed,
}

/// A worker label, `key=value`, as a request names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Label<'a> {
    /// The label's name.
    pub key: &'a str,
    /// Its value.
    pub value: &'a str,
}

/// A label a request prefers, and by how much: a worker carrying it costs `weight` blocks
/// less (finite, ≥ 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PreferredLabel<'a> {
    /// The label.
    pub label: Label<'a>,
    /// Blocks taken off the cost of a worker carrying it (finite, ≥ 0).
    pub weight: f64,
}

/// One request to route.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// The caller's id for the request: its booking is known by it until freed.
    pub id: RequestId,
    /// The prompt's tokens.
    pub tokens: &'a [u32],
    /// What the caller knows besides the tokens.
    pub hints: RouteHints<'a>,
}

impl RouteRequest<'_> {
    /// The prompt's length in tokens: the tokens given, or [`RouteHints::prompt_len`] when
    /// that is more.
    #[inline(always)]
    pub fn prompt_tokens(&self) -> u64 {
        (self.tokens.len() as u64).max(self.hints.prompt_len.unwrap_or(0))
    }
}

/// Why a request could not be routed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum RouteError {
    /// The request has no tokens.
    #[error("request {request:?} has no tokens")]
    NoTokens {
        /// The request refused.
        request: RequestId,
    },
    /// Fewer workers have joined than
    /// [`RouterConfig::min_workers`](crate::RouterConfig::min_workers)
    /// asks for. Retryable.
    #[error("router not ready: {joined} of {needed} workers joined")]
    NotReady {
        /// Workers joined so far.
        joined: usize,
        /// Workers that must join first.
        needed: usize,
    },
    /// No rank is a candidate: none joined for the request's phase, or none is in its allowed
    /// set (also a prefill request with no prefill worker under
    /// [`Disaggregation::Enforced`](crate::Disaggregation::Enforced)).
    #[error(
        "no worker may serve request {request:?} (none joined for its phase, or none allowed)"
    )]
    NoWorkers {
        /// The request refused.
        request: RequestId,
    },
    /// The request is pinned to a worker that has not joined.
    #[error("request {request:?} is pinned to unknown worker {worker:?}")]
    UnknownWorker {
        /// The request refused.
        request: RequestId,
        /// The worker it is pinned to.
        worker: WorkerId,
    },
    /// No worker carries every label the request requires (or a required label is one no
    /// worker has).
    #[error("no worker carries every label request {request:?} requires")]
    NoEligibleWorker {
        /// The request refused.
        request: RequestId,
    },
    /// The request is pinned to a worker that lacks one of its required labels.
    #[error("request {request:?} is pinned to worker {worker:?}, which lacks a required label")]
    PinnedLacksLabels {
        /// The request refused.
        request: RequestId,
        /// The worker it is pinned to.
        worker: WorkerId,
    },
    /// The request is pinned to a worker outside its allowed set.
    #[error("request {request:?} is pinned to worker {worker:?}, which its allowed set excludes")]
    PinnedNotAllowed {
        /// The request refused.
        request: RequestId,
        /// The worker it is pinned to.
        worker: WorkerId,
    },
    /// The admission queue is full: its waiting prompt tokens and this request's would pass the
    /// cap. Retryable.
    #[error(
        "request {request:?} ({request_tokens} prompt tokens) rejected: {queued_tokens} tokens already queued, cap {cap_tokens}; retry later"
    )]
    ResourceExhausted {
        /// The request refused.
        request: RequestId,
        /// Its prompt tokens.
        request_tokens: u64,
        /// Prompt tokens of the requests already waiting.
        queued_tokens: u64,
        /// The cap on waiting prompt tokens.
        cap_tokens: u64,
    },
    /// The request has no outcome to hand out: it never queued, its outcome was taken, or it
    /// was cancelled.
    #[error("request {request:?} is neither queued nor released and untaken")]
    NotQueued {
        /// The request asked about.
        request: RequestId,
    },
    /// A hint has a value the router cannot use.
    #[error("request {request:?} hint `{field}` is invalid: {reason}")]
    InvalidHint {
        /// The request refused.
        request: RequestId,
        /// The hint, as a path from [`RouteHints`] (`"preferred.weight"`).
        field: &'static str,
        /// What it must be.
        reason: &'static str,
    },
    /// Booking the decision failed (the id is already booked, or the rank left meanwhile).
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
