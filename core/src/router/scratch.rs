//! One thread's buffers for its routes, reused route after route so that a steady-state route
//! allocates nothing.

use crate::hash::LocalHash;
use crate::index::RankDepths;
use crate::select::Scored;

/// One thread's buffers, reused route after route so that a steady-state route allocates
/// nothing.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) prompt: Prompt,
    pub(super) constraints: Constraints,
    /// The match, by the index's rank ids.
    pub(super) depths: RankDepths,
    pub(super) candidates: Candidates,
}

/// The prompt as the index and the router's records key it.
#[derive(Default)]
pub(super) struct Prompt {
    pub(super) locals: Vec<LocalHash>,
    /// Prefix keys of the blocks the policy keys on.
    pub(super) keys: Vec<u64>,
    /// Checkpoint keys for the router's records, computed as far as they are looked at.
    pub(super) marks: Vec<u64>,
}

/// The request's soft constraints, resolved against the fleet's labels and the prompt.
#[derive(Default)]
pub(super) struct Constraints {
    /// The request's preferred labels as (label bit, weight).
    pub(super) preferred: Vec<(u64, f64)>,
    /// The pool's hits, clipped, sorted and merged into disjoint `[start, end)` ranges.
    pub(super) pool: Vec<(u32, u32)>,
}

/// The ranks selection scores.
#[derive(Default)]
pub(super) struct Candidates {
    pub(super) kept: Vec<Scored>,
    /// Every candidate, for warm-up's pick on a cache miss after a pruned gather.
    pub(super) unpruned: Vec<Scored>,
    /// Ranks whose load this thread read in selection only to find that they could not win,
    /// plus four per route, since it last refreshed the booked-prefill floor
    /// ([`Router::refresh_prefill_floor`]).
    pub(super) loaded_losers: u64,
}
