//! What a route answers: the chosen rank, and the evidence of why.

use crate::event::WorkerRank;
use crate::load::{LoadView, RequestId};
use crate::select::{Candidate, CostTerms, Overlap, PolicyKind};
use crate::session::SessionRouting;

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
    /// A whole request (aggregated, or prefill with no prefill worker and disaggregation not
    /// enforced) went to a decode worker: the fleet has no aggregated worker, and a decode
    /// worker computes a prompt no prefill worker handed it.
    AggregatedToDecode,
    /// A decode-phase request went to an aggregated worker: the fleet has no decode worker,
    /// and an aggregated worker takes the KV a prefill worker handed it.
    DecodeToAggregated,
}

/// Whether the decision booked load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bookkeeping {
    /// The request's load is booked on the rank until it is freed.
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
    /// The request decided.
    pub request: RequestId,
    /// The rank chosen.
    pub worker: WorkerRank,
    /// Predicted cached prefix on the chosen rank, as the index holds it.
    pub overlap: Overlap,
    /// Prompt tokens the engine is expected to find cached when it schedules the request: the
    /// leading blocks the index holds on the rank in any tier (`overlap.blocks`, unweighted),
    /// or, when more, the prompt blocks already active there (`cost.shared_blocks`: an earlier
    /// request still in its prefill stores them before this one is scheduled, though the index
    /// has not heard of them yet); in tokens, less the prompt's last token, which engines always
    /// compute. What serve reports as the predicted cached tokens; booking and cost keep to
    /// `overlap`.
    pub predicted_cached_tokens: u64,
    /// The chosen rank's cost terms.
    pub cost: CostTerms,
    /// Its load just before booking.
    pub load: LoadView,
    /// Which rule chose the rank.
    pub decided_by: DecidedBy,
    /// Set when the request was served outside its phase.
    pub fallback: Option<Fallback>,
    /// Whether load was booked.
    pub bookkeeping: Bookkeeping,
    /// The request's expected output tokens, as its hints gave them.
    pub expected_output_tokens: Option<u32>,
    /// How a session request's session steered it (`None` without a session, or when an
    /// explicit pin decided).
    pub session: Option<SessionRouting>,
    /// Every candidate considered (busy ones included), when asked for.
    pub evidence: Option<Vec<Candidate>>,
}
