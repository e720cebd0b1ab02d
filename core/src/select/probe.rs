//! Which candidates to probe for prompt blocks already active on them ([`ProbeTargets`]), and
//! its literal form, kept for the tests to hold it to.

use super::candidate::Busy;
use super::candidate::Scored;
use super::cost::count_f64;
/// Most ranks probed per request for prompt blocks they already hold active.
pub const SHARED_PROBES: usize = 8;

// The literal form of `ProbeTargets`, which the tests hold it to.
#[cfg_attr(not(test), allow(dead_code))]
/// The candidates worth probing for active prompt blocks (see the module comment): free ones
/// (or none when every one is busy, as the least loaded then decides) whose
/// `cost − min(full_blocks, active prompt blocks)` is at most the cheapest cost, the
/// [`SHARED_PROBES`] lowest of those bounds. Writes candidate indices into `out`, lowest bound
/// first; returns how many. Allocation-free; [`ProbeTargets`] does the same while scoring.
pub(crate) fn shared_probe_targets(
    candidates: &[Scored],
    full_blocks: u32,
    out: &mut [u32; SHARED_PROBES],
) -> usize {
    let mut t = ProbeTargets::new(full_blocks);
    for (i, c) in candidates.iter().enumerate() {
        t.offer(i, c);
    }
    let picked = t.targets();
    out[..picked.len()].copy_from_slice(picked);
    picked.len()
}

/// [`shared_probe_targets`] in one pass, fed candidate by candidate as they are scored: it
/// keeps the [`SHARED_PROBES`] lowest bounds seen and the cheapest cost, and the targets are
/// those of the kept bounds at most the cheapest cost. (Every bound below a qualifying one
/// qualifies too, so the lowest bounds overall, cut at the cheapest cost, are the lowest
/// qualifying bounds.)
#[derive(Clone, Copy, Debug)]
pub(crate) struct ProbeTargets {
    full_blocks: u64,
    /// Refuse candidates that can no longer win ([`ProbeTargets::pruning`]).
    prune: bool,
    cheapest: f64,
    /// What a floor must exceed to be refused ([`ProbeTargets::cannot_win`]): `∞` while
    /// nothing is refused.
    bar: f64,
    n: usize,
    bounds: [f64; SHARED_PROBES],
    indices: [u32; SHARED_PROBES],
    /// The kept candidates' fleet indices, which order equal bounds.
    fleet: [u32; SHARED_PROBES],
    /// Candidates scored, load and all, and then refused.
    loaded_losers: u32,
}

impl ProbeTargets {
    /// An empty set for a prompt of `full_blocks` full blocks (0: nothing to probe).
    pub(crate) fn new(full_blocks: u32) -> Self {
        ProbeTargets {
            full_blocks: u64::from(full_blocks),
            prune: false,
            cheapest: f64::INFINITY,
            bar: f64::INFINITY,
            n: 0,
            bounds: [f64::INFINITY; SHARED_PROBES],
            indices: [0; SHARED_PROBES],
            fleet: [0; SHARED_PROBES],
            loaded_losers: 0,
        }
    }

    /// Counts a candidate whose load was read only for it to be refused
    /// ([`ProbeTargets::bound_cannot_win`] after the load); [`ProbeTargets::offer`] counts
    /// those it refuses itself.
    #[inline(always)]
    pub(crate) fn note_loaded_loser(&mut self) {
        self.loaded_losers += 1;
    }

    /// Candidates whose load was read only for them to be refused: what a tighter floor
    /// under the loads would have saved.
    pub(crate) fn loaded_losers(&self) -> u32 {
        self.loaded_losers
    }

    /// These targets, refusing (with `prune`) every candidate that can no longer win: one
    /// whose cost, less the most a probe could take off it (its room), is above the cheapest
    /// cost seen so far among the free, healthy ones. The cheapest only falls and a probe
    /// lowers a cost by at most its room, so a refused candidate ends strictly above the final
    /// minimum: for a policy that takes the cheapest (ties broken at random) and a request
    /// nothing else looks at, it need not be kept at all. Busy and marked candidates are
    /// always kept, so the busy and health filters see every one they may fall back to.
    pub(crate) fn pruning(mut self, prune: bool) -> Self {
        self.prune = prune;
        self
    }

    /// The cheapest cost of a free, healthy candidate offered so far (`∞`: none).
    #[inline(always)]
    pub(crate) fn cheapest(&self) -> f64 {
        self.cheapest
    }

    /// What a floor must exceed for [`ProbeTargets::cannot_win`] (`∞` while nothing is
    /// refused).
    #[inline]
    pub(crate) fn bar(&self) -> f64 {
        self.bar
    }

    /// True when these targets prune ([`ProbeTargets::pruning`]).
    pub(crate) fn prunes(&self) -> bool {
        self.prune
    }

    /// Considers candidate `index`; false when it is refused ([`ProbeTargets::pruning`]).
    #[inline(always)]
    pub(crate) fn offer(&mut self, index: usize, c: &Scored) -> bool {
        // A busy or marked rank is chosen only when every rank is (the busy and health
        // filters then fall back to the least loaded of all): it is kept, not probed, and its
        // cost does not cut the others.
        if c.busy == Busy::Busy || !c.health.is_healthy() {
            return true;
        }
        if c.cost < self.cheapest {
            self.cheapest = c.cost;
            if self.prune {
                self.bar = Self::bar_at(c.cost);
            }
        }
        let room = c.load.prompt_blocks.min(self.full_blocks);
        let bound = c.cost - count_f64(room);
        if self.prune && bound > self.cheapest {
            self.loaded_losers += 1;
            return false;
        }
        let last = SHARED_PROBES - 1;
        if room == 0 || !Self::precedes(bound, c.fleet_index, self.bounds[last], self.fleet[last]) {
            return true;
        }
        // Insert in order; when full, the highest bound drops out.
        let mut at = self.n.min(last);
        while at > 0
            && Self::precedes(
                bound,
                c.fleet_index,
                self.bounds[at - 1],
                self.fleet[at - 1],
            )
        {
            self.bounds[at] = self.bounds[at - 1];
            self.indices[at] = self.indices[at - 1];
            self.fleet[at] = self.fleet[at - 1];
            at -= 1;
        }
        self.bounds[at] = bound;
        self.indices[at] = index as u32;
        self.fleet[at] = c.fleet_index;
        self.n = (self.n + 1).min(SHARED_PROBES);
        true
    }

    /// The order of the kept bounds: lowest first, equal bounds by fleet index. A total order
    /// on the ranks, so the kept set is the same whatever order the candidates come in (a
    /// pruning gather offers them in another order than a full one).
    #[inline(always)]
    fn precedes(bound: f64, fleet: u32, other: f64, other_fleet: u32) -> bool {
        bound < other || (bound == other && fleet < other_fleet)
    }

    /// True when pruning and a rank whose probe bound is at least `floor`
    /// ([`CostTerms::bound_floor`]) would be refused whatever its load: it need not be scored.
    /// Busy and marked ranks too: once a free, healthy rank set the cheapest cost, neither
    /// filter falls back to them.
    #[inline(always)]
    pub(crate) fn cannot_win(&self, floor: f64) -> bool {
        floor > self.bar
    }

    /// The bar over `cheapest`: a floor above it is above `cheapest` by more than
    /// 10⁻⁹ · max(|floor|, 1), a margin that covers the bound's own rounding (a few units in
    /// the last place of its largest term) many times over. (Above `c + 2·10⁻⁹ · max(|c|, 1)`
    /// a floor f satisfies f − 10⁻⁹ · max(|f|, 1) > c whatever the signs; the bar's own
    /// rounding is some 10⁻¹⁶ of it.)
    fn bar_at(cheapest: f64) -> f64 {
        cheapest + 2e-9 * cheapest.abs().max(1.0)
    }

    /// [`ProbeTargets::cannot_win`] for a rank's probe bound itself: its `cost` less its room
    /// (its `prompt_blocks`, up to the prompt's full blocks), as [`ProbeTargets::offer`]
    /// computes it. True only where `offer` would refuse the rank too, or (busy or marked)
    /// where a free, healthy rank has set the cheapest cost.
    #[inline(always)]
    pub(crate) fn bound_cannot_win(&self, cost: f64, prompt_blocks: u64) -> bool {
        self.cannot_win(cost - count_f64(prompt_blocks.min(self.full_blocks)))
    }

    /// The candidates to probe, lowest bound first.
    pub(crate) fn targets(&self) -> &[u32] {
        let n = self.bounds[..self.n]
            .iter()
            .take_while(|&&b| b <= self.cheapest)
            .count();
        &self.indices[..n]
    }
}
