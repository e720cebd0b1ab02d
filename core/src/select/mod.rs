//! Worker selection: from each candidate rank's overlap and load, which one serves the request.
//!
//! ```text
//!   Scored (fleet index, load, overlap blocks, cost total)   built by the router, one per rank
//!        │ busy filter: drop ranks over a threshold while some rank is under every threshold
//!        ▼
//!   Selector::select ──▶ index of the chosen candidate
//!        │
//!        ▼
//!   Candidate (overlap per tier, cost terms): only for the winner, or every rank as evidence
//!     KvAware      argmin of cost (random ties) or softmax over normalised costs
//!     RoundRobin, Random, LeastLoaded, PowerOfTwo, PrefixHash (bounded load), CacheThreshold
//! ```
//!
//! **The cost** (the reference's, in blocks):
//!
//! ```text
//!   credit   = overlap_credit·device + w_host·host + w_disk·disk + w_ext·external   (blocks)
//!   prefill  = prefill_load_scale · max(0, (active prefill tokens + prompt tokens)/block − credit)
//!   decode   = active prompt blocks + weighted output blocks + prompt blocks − shared
//!   cost     = prefill + decode
//! ```
//!
//! *Weighted output blocks* are the rank's output blocks, each request's decayed by what is left
//! of its expected output ([`crate::load`]). *Shared* is the number of the prompt's leading
//! blocks already active on the rank (held by a running request), which the booking would count
//! once. Finding it takes the rank's refcount table, so selection does not probe every rank:
//! every rank is scored with shared = 0 (an upper bound of its cost), then only ranks whose
//! cost could fall to the cheapest, because their `cost − min(full prompt blocks, active prompt
//! blocks)` is at most the cheapest upper bound, are probed, at most [`SHARED_PROBES`] of them
//! (lowest bound first) and only with `try_lock` ([`shared_probe_targets`]). With temperature 0
//! the choice is then the exact argmin whenever at most [`SHARED_PROBES`] ranks qualify and no
//! probed table was busy; otherwise, and for softmax sampling, the unprobed ranks keep their
//! upper bound (they can only look slightly worse than they are).
//!
//! Selection looks at a [`Scored`] record per rank, small enough that a few hundred ranks are
//! scored in well under a microsecond; the full [`Candidate`] (every cost term, the tier split)
//! is built from it for the winner, and for every rank only when evidence is asked for. Both
//! compute the total with the same code ([`CostTerms::total_of`]), so they agree to the bit.
//!
//! Every random draw comes from the caller's `Rng`, so a seeded router decides reproducibly.
//!
//! | file | owns |
//! |---|---|
//! | `cost.rs` | the cost terms, the request's weights and shape, the floors that bound a rank's cost |
//! | `candidate.rs` | `Scored` and `Candidate`, and the busy and health vetoes |
//! | `probe.rs` | which candidates to probe for active prompt blocks |
//! | `scorer.rs` | scoring one request's ranks over a match, pruning the ranks that cannot win |
//! | `policy/` | the public `Selector` trait, the policy names, and one file per policy |
//! | `tests.rs` | the unit tests |

mod candidate;
mod cost;
mod policy;
mod probe;
mod scorer;

pub use self::candidate::Scored;
pub(crate) use self::candidate::{filter_busy, filter_unhealthy, BusyOutcome, HealthOutcome};
pub use self::candidate::{Busy, Candidate};
pub use self::cost::RequestShape;
pub(crate) use self::cost::{count_f64, FloorTerms, Weights};
pub use self::cost::{CostTerms, Overlap, Overrides};
pub(crate) use self::policy::{selector_for, LeastLoaded};
pub use self::policy::{PolicyKind, SelectInput, Selector, UnknownPolicy};
#[cfg(test)]
pub(crate) use self::probe::shared_probe_targets;
pub(crate) use self::probe::ProbeTargets;
pub use self::probe::SHARED_PROBES;
pub(crate) use self::scorer::*;

#[cfg(test)]
mod tests;
