//! What callers hand the ledger and what it hands back: request ids, booking specs, the
//! lifecycle observations ([`Step`], [`Generated`], [`Freed`]), counters and errors.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::rank::RankState;
use crate::event::WorkerRank;
use crate::hash::LocalHash;
use crate::session::SessionId;

/// A request's identity, chosen by the caller (unique among its active requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct RequestId(pub u64);

/// Why a lifecycle call was rejected.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// A booking for an id that is already booked.
    #[error("request {request:?} is already booked")]
    DuplicateRequest {
        /// The request.
        request: RequestId,
    },
    /// A call for a request that is not booked.
    #[error("request {request:?} is not booked (never routed, already freed, expired, or its worker left)")]
    UnknownRequest {
        /// The request.
        request: RequestId,
    },
    /// The rank chosen left while the request was being booked on it: the booking is undone.
    #[error("rank {rank} left while request {request:?} was being booked on it")]
    RankRetired {
        /// The request.
        request: RequestId,
        /// The rank that left.
        rank: WorkerRank,
    },
}

/// Whether a request reached its worker (only those record metrics and count as completed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DispatchState {
    /// Booked, not yet reported at its worker.
    #[default]
    NotYet,
    /// Reported at its worker ([`Router::mark_dispatched`](crate::Router::mark_dispatched)).
    Reached,
}

/// What to book for one request.
#[derive(Debug)]
pub(crate) struct BookingSpec<'a> {
    pub request: RequestId,
    /// The rank chosen.
    pub state: &'a Arc<RankState>,
    /// Prompt tokens the rank must compute (the prompt less what it has cached).
    pub prefill_tokens: u64,
    /// Local hashes of the prompt's full blocks.
    pub block_hashes: &'a [LocalHash],
    /// Blocks the prompt holds beyond its full ones (1 for a partial tail block, else 0).
    pub tail_blocks: u64,
    /// Prompt tokens (the ISL).
    pub prompt_tokens: u64,
    /// Prompt tokens predicted cached on the rank.
    pub cached_tokens: u64,
    /// Tokens per block, for the output timeline.
    pub block_size: u32,
    /// Expected output length, when known: output blocks decay by it.
    pub expected_output_tokens: Option<u32>,
    /// The sticky session the request belongs to, handed back when it is freed.
    pub session: Option<SessionId>,
    pub now: Instant,
}

/// What a lifecycle step observed, for request metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Step {
    pub rank: WorkerRank,
    pub dispatch: DispatchState,
    /// Time since the previous event: for the first token since booking (TTFT, on the first
    /// call only), for an output block since the previous token event. `None` without a
    /// clock reading or a previous event.
    pub elapsed: Option<Duration>,
    /// Tokens generated over `elapsed` (output blocks; 0 for the first token).
    pub tokens: u64,
    /// The output tokens an output block's decay was taken at (0 for the first token).
    pub decayed_at: u64,
}

/// What a [`Ledger::tokens_generated`] call observed, for request metrics.
///
/// [`Ledger::tokens_generated`]: super::Ledger::tokens_generated
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Generated {
    pub rank: WorkerRank,
    pub dispatch: DispatchState,
    /// These were the request's first tokens: its prefill tokens were released.
    pub prefill_released: bool,
    /// Time from booking to the first tokens (with a clock reading, on the first call only).
    pub ttft: Option<Duration>,
    /// Time since the previous token event, over `itl_tokens` tokens (`None` on the first
    /// call, without a clock reading, or without a previous timed event).
    pub itl: Option<Duration>,
    pub itl_tokens: u64,
    /// Output blocks the tokens opened.
    pub new_blocks: u64,
    /// Output tokens generated so far (what decay was taken at when a block opened).
    pub generated: u64,
}

/// What a freed request had booked, as it was when freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    /// The rank it was booked on.
    pub rank: WorkerRank,
    /// Prefill tokens still booked (non-zero when freed before prefill completed).
    pub prefill_tokens: u64,
    /// Output blocks it had generated.
    pub output_blocks: u64,
    /// Its prompt's tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens predicted cached on the rank when it was booked.
    pub cached_tokens: u64,
    /// Whether it had reached its worker.
    pub dispatch: DispatchState,
    /// Time from its booking to its free.
    pub age: Duration,
    /// The sticky session it belonged to, if any.
    pub session: Option<SessionId>,
}

/// Lifecycle counters of the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerCounts {
    /// Requests booked.
    pub booked: u64,
    /// Requests freed (by id, by their guard, or by cancelling a released request).
    pub freed: u64,
    /// Requests freed by expiry, booked longer than `request_expiry`.
    pub expired: u64,
    /// Requests dropped because their worker left.
    pub purged: u64,
    /// Bookings refused for an id already booked ([`LoadError::DuplicateRequest`]).
    pub duplicate_requests: u64,
    /// Lifecycle calls and frees naming a request not booked ([`LoadError::UnknownRequest`]).
    pub unknown_requests: u64,
    /// Bookings undone because their rank retired while they were made.
    pub retired_races: u64,
}
