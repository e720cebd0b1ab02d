//! A rank as selection sees it: the compact [`Scored`] record every rank gets, the full
//! [`Candidate`] the winner (or the evidence) gets, and the busy and health vetoes over them.

use super::cost::CostTerms;
use super::cost::Overlap;
use super::cost::RequestShape;
use super::cost::Weights;
use crate::config::BusyThresholds;
use crate::event::StorageTier;
use crate::event::WorkerRank;
use crate::health::Health;
use crate::load::LoadView;
use crate::registry::WorkerConfig;
/// Whether a rank is over a busy threshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Busy {
    /// Under every threshold, or no threshold is set.
    #[default]
    Free,
    /// Over a threshold: the rank leaves selection while some rank is under them all.
    Busy,
}

impl Busy {
    /// The rank's state against `thresholds`, given its worker's config.
    pub fn of(load: &LoadView, worker: &WorkerConfig, thresholds: &BusyThresholds) -> Self {
        let over =
            |x: u64, cap: u64, frac: Option<f64>| frac.is_some_and(|f| x as f64 > f * cap as f64);
        if over(
            load.decode_blocks(),
            worker.kv_blocks,
            thresholds.decode_blocks_fraction,
        ) || over(
            load.prefill_tokens,
            worker.max_batched_tokens,
            thresholds.prefill_tokens_fraction,
        ) {
            Busy::Busy
        } else {
            Busy::Free
        }
    }
}

/// One rank that may serve the request, as selection sees it: what every policy needs, and no
/// more.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scored {
    /// Index in the fleet snapshot's ranks.
    pub fleet_index: u32,
    /// Leading prompt blocks the rank holds, in any tier.
    pub overlap_blocks: u32,
    /// Whether it is over a busy threshold.
    pub busy: Busy,
    /// The rank's health mark (always healthy when no worker is marked).
    pub health: Health,
    /// Prompt blocks active on the rank, when probed (the KV-aware cost probes the ranks that
    /// could win); else 0.
    pub shared_blocks: u32,
    /// Total KV-aware cost, lower is better ([`CostTerms`]).
    pub cost: f64,
    /// The load the cost was computed from.
    pub load: LoadView,
}

/// One rank that may serve the request, with everything known about it: the decision's and the
/// evidence record's view.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// The rank.
    pub rank: WorkerRank,
    /// Index in the fleet snapshot's ranks.
    pub fleet_index: usize,
    /// Its load when scored.
    pub load: LoadView,
    /// Its predicted cached prefix.
    pub overlap: Overlap,
    /// Its cost terms.
    pub cost: CostTerms,
    /// Whether it is over a busy threshold.
    pub busy: Busy,
    /// Its worker's health mark.
    pub health: Health,
}

impl Candidate {
    /// The full record of a scored rank holding `per_tier` blocks: the same load, so the same
    /// cost.
    pub fn from_scored(
        scored: &Scored,
        rank: WorkerRank,
        per_tier: [u32; StorageTier::COUNT],
        w: &Weights,
        shape: &RequestShape,
    ) -> Self {
        Candidate {
            rank,
            fleet_index: scored.fleet_index as usize,
            load: scored.load,
            overlap: Overlap::new(per_tier, w, shape),
            cost: CostTerms::new(w, shape, &scored.load, &per_tier, scored.shared_blocks),
            busy: scored.busy,
            health: scored.health,
        }
    }
}

/// Which rule of selection applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BusyOutcome {
    /// No rank was busy, or busy ones were set aside.
    Filtered,
    /// Every rank was busy: all stay candidates, and the least loaded is chosen.
    AllBusy,
}

/// Drops busy candidates when at least one is free (in place, allocation-free).
pub(crate) fn filter_busy(candidates: &mut Vec<Scored>) -> BusyOutcome {
    if candidates.iter().all(|c| c.busy == Busy::Busy) && !candidates.is_empty() {
        return BusyOutcome::AllBusy;
    }
    candidates.retain(|c| c.busy == Busy::Free);
    BusyOutcome::Filtered
}

/// What the health filter did ([`filter_unhealthy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HealthOutcome {
    /// Marked ranks were set aside (as many of each kind), or none was marked.
    Filtered { unreachable: u32, wedged: u32 },
    /// Every candidate is marked: all stay, and the least loaded serves.
    AllVetoed,
}

/// Drops marked candidates when at least one is healthy (in place, allocation-free).
pub(crate) fn filter_unhealthy(candidates: &mut Vec<Scored>) -> HealthOutcome {
    if !candidates.is_empty() && candidates.iter().all(|c| !c.health.is_healthy()) {
        return HealthOutcome::AllVetoed;
    }
    let (mut unreachable, mut wedged) = (0, 0);
    candidates.retain(|c| match c.health {
        Health::Healthy => true,
        Health::Unreachable => {
            unreachable += 1;
            false
        }
        Health::Wedged => {
            wedged += 1;
            false
        }
    });
    HealthOutcome::Filtered {
        unreachable,
        wedged,
    }
}
