//! Scoring one request's ranks: each rank's cost from its overlap and load, with the floors
//! that let selection skip ranks that cannot win.

use crate::config::BusyThresholds;
use crate::event::{StorageTier, WorkerId};
use crate::health::Health;
use crate::index::{RankDepths, RankKey};
use crate::load::LoadView;
use crate::registry::{Fleet, RankEntry, WorkerRole};
use crate::select::{
    Busy, Candidate, CostTerms, FloorTerms, ProbeTargets, RequestShape, Scored, Weights,
};

/// The overlap `depths` gives rank `r` under its key, retired or not: at least the overlap
/// [`rank_depth`] gives it (a floor computed from it is no higher).
#[inline(always)]
pub(crate) fn rank_depth_unchecked(
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
pub(crate) fn rank_depth(
    r: &RankEntry,
    depths: &RankDepths,
) -> Option<(RankKey, crate::index::Depth)> {
    // Retirement is checked only for a rank that matched.
    rank_depth_unchecked(r, depths).filter(|_| !r.state.is_retired())
}

/// Clips `ranges` to `full_blocks`, sorts and merges them into `out`; `Err` (and `out` empty)
/// when a range is inverted.
pub(crate) fn merge_pool_ranges(
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
pub(crate) struct CreditBar {
    pub(crate) cheapest: f64,
    pub(crate) need: [f64; 2],
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
    pub(crate) fn at(w: &Weights, shape: &RequestShape, cheapest: f64, booked_floor: u64) -> Self {
        CreditBar {
            cheapest,
            need: [false, true]
                .map(|d| CostTerms::credit_needed(w, shape, cheapest, d, booked_floor)),
        }
    }
}

/// What scoring reads of one request besides the match: fixed for the route.
#[derive(Clone, Copy)]
pub(crate) struct ScoreInput<'a> {
    pub(crate) fleet: &'a Fleet,
    pub(crate) weights: &'a Weights,
    pub(crate) shape: &'a RequestShape,
    /// The shared pool's hits, disjoint and sorted (empty: no pool credit).
    pub(crate) pool: &'a [(u32, u32)],
    /// Credit per pool block.
    pub(crate) pool_credit: f64,
    /// The request's preferred labels, as (label bit, weight in blocks).
    pub(crate) preferred: &'a [(u64, f64)],
    pub(crate) busy: &'a BusyThresholds,
    /// Prefill tokens every rank has booked at least ([`crate::load::Ledger::prefill_floor`]).
    pub(crate) booked_floor: u64,
    /// False while no booking's prompt load is decayed.
    pub(crate) decay_anywhere: bool,
    /// False when no worker is marked.
    pub(crate) health_on: bool,
}

/// Everything one request's ranks are scored against.
pub(crate) struct Scorer<'a> {
    /// The shared pool's hits, disjoint and sorted (empty: no pool credit).
    pub(crate) pool: &'a [(u32, u32)],
    /// Credit per pool block.
    pub(crate) pool_credit: f64,
    /// The request's preferred labels, as (label bit, weight in blocks).
    pub(crate) preferred: &'a [(u64, f64)],
    pub(crate) fleet: &'a Fleet,
    /// The match, by the index's rank ids.
    pub(crate) depths: &'a RankDepths,
    /// The fleet index of the match's deepest rank, scored first where that helps.
    pub(crate) seed: Option<usize>,
    /// The rank a pruning gather scores first, when already chosen
    /// ([`Scorer::least_after_seed`]).
    pub(crate) known_seed: Option<usize>,
    /// False while no booking's prompt load is decayed ([`Ledger::prompt_decay_anywhere`]).
    pub(crate) decay_anywhere: bool,
    /// Prefill tokens every rank has booked at least ([`Ledger::prefill_floor`]).
    pub(crate) booked_floor: u64,
    /// The request's side of every rank's floor ([`CostTerms::bound_floor`]).
    pub(crate) floor_terms: FloorTerms,
    pub(crate) weights: &'a Weights,
    pub(crate) shape: &'a RequestShape,
    pub(crate) busy: &'a crate::config::BusyThresholds,
    /// False when every threshold is off: then no rank is busy, and the worker configs are
    /// never visited.
    pub(crate) busy_on: bool,
    /// False when no worker is marked: then every rank reads as healthy without a load.
    pub(crate) health_on: bool,
}

impl<'a> Scorer<'a> {
    /// The scorer of `input`'s request over the match `depths`; a pruning gather scores
    /// `known_seed` first when given ([`Scorer::least_after_seed`]).
    #[inline(always)]
    pub(crate) fn new(
        input: ScoreInput<'a>,
        depths: &'a RankDepths,
        known_seed: Option<usize>,
    ) -> Self {
        let busy = input.busy;
        Scorer {
            pool: input.pool,
            pool_credit: input.pool_credit,
            preferred: input.preferred,
            fleet: input.fleet,
            depths,
            seed: depths
                .deepest()
                .and_then(|rank| input.fleet.rank_index(rank)),
            known_seed,
            decay_anywhere: input.decay_anywhere,
            booked_floor: input.booked_floor,
            floor_terms: FloorTerms::new(input.weights, input.shape, input.booked_floor),
            weights: input.weights,
            shape: input.shape,
            busy,
            busy_on: busy.decode_blocks_fraction.is_some()
                || busy.prefill_tokens_fraction.is_some(),
            health_on: input.health_on,
        }
    }
}

impl Scorer<'_> {
    /// The full record of a scored candidate: its tier split, and its cost with the pool's
    /// credit and its preference applied as the score applied them.
    #[inline]
    pub(crate) fn candidate(&self, c: &Scored) -> Candidate {
        let i = c.fleet_index as usize;
        let entry = &self.fleet.ranks[i];
        let per_tier = self.per_tier(i);
        let mut c = Candidate::from_scored(c, entry.rank, per_tier, self.weights, self.shape);
        let (pool_credit, pool_blocks) = self.pool_extension(c.overlap.blocks);
        if pool_blocks > 0 {
            c.cost = c
                .cost
                .with_pool_credit(self.weights, pool_credit, pool_blocks);
        }
        if !self.preferred.is_empty() {
            c.cost = c.cost.with_preference(self.preference(entry.label_bits));
        }
        c
    }

    /// True when pool hits, preferred labels or health marks apply: scoring then does more
    /// than the cost and the busy check.
    pub(crate) fn extras(&self) -> bool {
        self.health_on || !self.pool.is_empty() || !self.preferred.is_empty()
    }

    /// The overlap credit and the blocks of rank `i` of the fleet.
    #[inline(always)]
    pub(crate) fn overlap(&self, i: usize) -> (f64, u32) {
        self.credit_of(rank_depth(&self.fleet.ranks[i], self.depths))
    }

    /// The overlap credit and the blocks of a rank's depth ([`rank_depth`]).
    #[inline(always)]
    pub(crate) fn credit_of(&self, depth: Option<(RankKey, crate::index::Depth)>) -> (f64, u32) {
        let Some((key, d)) = depth else {
            return (0.0, 0);
        };
        let credit = match d.tier {
            // The sum over tiers with the others at 0, times the same multiplier: the same
            // to the bit.
            Some(t) => {
                f64::from(d.blocks)
                    * self.weights.credits[t.index()]
                    * self.weights.affinity(d.blocks)
            }
            None => CostTerms::credit_of(self.weights, &self.depths.per_tier(key.id)),
        };
        (credit, d.blocks)
    }

    /// The blocks of rank `i` of the fleet by the fastest tier each is held in.
    pub(crate) fn per_tier(&self, i: usize) -> [u32; StorageTier::COUNT] {
        match rank_depth(&self.fleet.ranks[i], self.depths) {
            Some((key, _)) => self.depths.per_tier(key.id),
            None => [0; StorageTier::COUNT],
        }
    }

    /// Rank `i` of the fleet as selection sees it.
    pub(crate) fn score(&self, i: usize) -> Scored {
        if self.extras() {
            self.score_as::<true>(i)
        } else {
            self.score_as::<false>(i)
        }
    }

    /// True when rank `r` may serve a request for `role` (with `EXTRAS`: among `allowed`
    /// workers, carrying the `required` labels).
    #[inline(always)]
    pub(crate) fn eligible<const EXTRAS: bool>(
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
    pub(crate) fn pick_seed<const EXTRAS: bool>(
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
    pub(crate) fn least_after_seed(
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
    pub(crate) fn gather(
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
    pub(crate) fn gather_as<const EXTRAS: bool>(
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
    /// `b · affinity(b)` times the highest tier credit, plus the longest pool run's credit, of credit; and
    /// at most the sum of the preferred labels' weights of preference. With less credit than
    /// [`CostTerms::credit_needed`] asks to reach the bar plus that preference, its floor is
    /// above the bar ([`ProbeTargets::cannot_win`]) whatever its load. One block of slack
    /// covers rounding. `None` when no cost is set yet, when a rank holding nothing might
    /// still win, or when holding blocks earns no credit: every rank is visited then.
    #[inline]
    pub(crate) fn least_winning_blocks(&self, targets: &ProbeTargets) -> Option<u32> {
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
        // Credit grows no faster than `per_block · b · affinity(b)`.
        let least = self
            .weights
            .blocks_for_credit((need - pool) / per_block)
            .ceil()
            - 1.0;
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
    pub(crate) fn offer_rank<const EXTRAS: bool>(
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
            let load = r.state.selection_load();
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
    pub(crate) fn score_as<const EXTRAS: bool>(&self, i: usize) -> Scored {
        self.score_with::<EXTRAS>(i, self.overlap(i))
    }

    /// [`Scorer::score_as`] with the rank's overlap (credit, blocks) already read.
    #[inline(always)]
    pub(crate) fn score_with<const EXTRAS: bool>(
        &self,
        i: usize,
        (own_credit, blocks): (f64, u32),
    ) -> Scored {
        let r = &self.fleet.ranks[i];
        let load = r.state.selection_load();
        let cost = self.cost_with::<EXTRAS>(r, &load, own_credit, blocks);
        self.scored::<EXTRAS>(i, r, load, cost, blocks)
    }

    /// The cost of rank `r` under `load`, with its own overlap credit and blocks.
    #[inline(always)]
    pub(crate) fn cost_with<const EXTRAS: bool>(
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
    pub(crate) fn with_pool<const EXTRAS: bool>(&self, own_credit: f64, blocks: u32) -> f64 {
        if EXTRAS && !self.pool.is_empty() {
            own_credit + self.pool_extension(blocks).0
        } else {
            own_credit
        }
    }

    /// What rank `r`'s preferred labels take off its cost (with `EXTRAS`; 0 without).
    #[inline(always)]
    pub(crate) fn preference_of<const EXTRAS: bool>(&self, r: &RankEntry) -> f64 {
        if EXTRAS && !self.preferred.is_empty() {
            self.preference(r.label_bits)
        } else {
            0.0
        }
    }

    /// Rank `i` (`r`) scored, from its load and cost.
    #[inline(always)]
    pub(crate) fn scored<const EXTRAS: bool>(
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
    pub(crate) fn pool_extension(&self, own: u32) -> (f64, u32) {
        match self.pool.iter().find(|&&(a, b)| a <= own && own < b) {
            Some(&(_, b)) => (f64::from(b - own) * self.pool_credit, b - own),
            None => (0.0, 0),
        }
    }

    /// `cost` less the preference of a rank carrying `label_bits` (untouched without
    /// preferred labels, as [`CostTerms::with_preference`] is then not applied either).
    #[inline(always)]
    pub(crate) fn less_preference(&self, cost: f64, label_bits: u64) -> f64 {
        if self.preferred.is_empty() {
            cost
        } else {
            cost - self.preference(label_bits)
        }
    }

    /// Blocks off the cost of a rank carrying `label_bits` for the preferred labels.
    #[inline(always)]
    pub(crate) fn preference(&self, label_bits: u64) -> f64 {
        self.preferred
            .iter()
            .filter(|(bit, _)| label_bits & bit != 0)
            .map(|(_, w)| w)
            .sum()
    }

    /// `c` with `shared` of the prompt's blocks active on its rank: the same load, the cost
    /// recomputed.
    pub(crate) fn with_shared(&self, c: &Scored, shared: u32) -> Scored {
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
