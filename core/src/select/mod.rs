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
//! Every random draw comes from the caller's [`Rng`], so a seeded router decides reproducibly.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::config::{BusyThresholds, Policy, RouterConfig};
use crate::event::{StorageTier, WorkerRank};
use crate::health::Health;
use crate::load::LoadView;
use crate::registry::{RankEntry, WorkerConfig};
use crate::rng::{mix64, Rng};

mod scorer;
pub(crate) use self::scorer::*;

/// The per-request numbers the cost needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weights {
    /// Credit per cached block, by tier (device: the overlap credit).
    pub credits: [f64; StorageTier::COUNT],
    /// Weight of a cached block in the cached-token estimate, by tier (device: 1).
    pub effective: [f64; StorageTier::COUNT],
    pub prefill_load_scale: f64,
    pub block_size: u32,
}

impl Weights {
    /// The weights of `config`, with per-request overrides applied.
    pub fn new(config: &RouterConfig, overrides: &Overrides) -> Self {
        let mut credits = config.tier_credits();
        if let Some(c) = overrides.overlap_credit {
            credits[StorageTier::Device.index()] = c;
        }
        let mut effective = config.tier_credits();
        effective[StorageTier::Device.index()] = 1.0;
        Weights {
            credits,
            effective,
            prefill_load_scale: overrides
                .prefill_load_scale
                .unwrap_or(config.prefill_load_scale),
            block_size: config.block_size,
        }
    }
}

/// Per-request overrides of the configuration's weights and temperature. Values are clamped to
/// be finite and non-negative when used (a bad override falls back to the configured value).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Overrides {
    /// Replaces the configured overlap credit ([`RouterConfig::overlap_credit`]).
    pub overlap_credit: Option<f64>,
    /// Replaces the configured prefill weight ([`RouterConfig::prefill_load_scale`]).
    pub prefill_load_scale: Option<f64>,
    /// Replaces the configured temperature ([`RouterConfig::temperature`]).
    pub temperature: Option<f64>,
}

impl Overrides {
    /// The overrides with invalid (negative, NaN, infinite) values dropped.
    pub fn sanitized(self) -> Self {
        let ok = |x: Option<f64>| x.filter(|v| v.is_finite() && *v >= 0.0);
        Overrides {
            overlap_credit: ok(self.overlap_credit),
            prefill_load_scale: ok(self.prefill_load_scale),
            temperature: ok(self.temperature),
        }
    }
}

/// The request, as selection sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RequestShape {
    /// Prompt tokens.
    pub tokens: u64,
    /// Prompt blocks, a partial tail included.
    pub blocks: u64,
    /// Full prompt blocks (those that can be cached).
    pub full_blocks: u32,
    /// A key of the prompt's first blocks, for prefix-hash policies (`None`: prompt too short).
    pub prefix_key: Option<u64>,
}

/// Predicted cache overlap of one rank.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Overlap {
    /// Leading prompt blocks held, in any tier.
    pub blocks: u32,
    /// The same blocks by the fastest tier holding each.
    pub per_tier: [u32; StorageTier::COUNT],
    /// Blocks weighted by tier (device 1, lower tiers their weight).
    pub effective_blocks: f64,
    /// `effective_blocks` in tokens, at most the prompt.
    pub cached_tokens: u64,
}

impl Overlap {
    /// The overlap of `per_tier` blocks for a prompt of `shape`.
    pub fn new(per_tier: [u32; StorageTier::COUNT], w: &Weights, shape: &RequestShape) -> Self {
        let blocks = per_tier.iter().sum();
        let effective_blocks: f64 = per_tier
            .iter()
            .zip(w.effective)
            .map(|(&b, x)| f64::from(b) * x)
            .sum();
        let cached_tokens = ((effective_blocks * f64::from(w.block_size)) as u64).min(shape.tokens);
        Overlap {
            blocks,
            per_tier,
            effective_blocks,
            cached_tokens,
        }
    }
}

/// The terms of one rank's cost, in blocks.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct CostTerms {
    /// (active prefill tokens + prompt tokens) / block size.
    pub prefill_blocks: f64,
    /// Overlap credit, tier-weighted.
    pub credit_blocks: f64,
    /// prefill_load_scale · max(0, prefill_blocks − credit_blocks).
    pub prefill_cost: f64,
    /// Prompt blocks already active on the rank, not charged again (0 when not probed).
    pub shared_blocks: u32,
    /// Active prompt blocks, weighted output blocks and the request's blocks less the shared.
    pub decode_cost: f64,
    /// Blocks beyond the rank's own overlap found in the shared KV pool (credited at the pool
    /// multiplier, included in `credit_blocks`).
    pub pool_blocks: u32,
    /// Blocks taken off for the request's preferred labels the rank carries.
    pub preference: f64,
    /// prefill_cost + decode_cost − preference.
    pub total: f64,
}

impl CostTerms {
    /// The cost of serving `shape` on a rank with `load` and cached `per_tier` blocks.
    /// The cost of serving `shape` on a rank with `load`, cached `per_tier` blocks and
    /// `shared_blocks` of the prompt active.
    pub fn new(
        w: &Weights,
        shape: &RequestShape,
        load: &LoadView,
        per_tier: &[u32; StorageTier::COUNT],
        shared_blocks: u32,
    ) -> Self {
        let prefill_blocks =
            (load.prefill_tokens + shape.tokens) as f64 / f64::from(w.block_size.max(1));
        let credit_blocks = Self::credit_blocks(w, per_tier);
        let prefill_cost = Self::prefill_cost(w, prefill_blocks, credit_blocks);
        let decode_cost = Self::decode_cost(shape, load, shared_blocks);
        CostTerms {
            prefill_blocks,
            credit_blocks,
            prefill_cost,
            shared_blocks,
            decode_cost,
            pool_blocks: 0,
            preference: 0.0,
            total: prefill_cost + decode_cost,
        }
    }

    /// These terms with `extra_credit` more blocks of credit, for `pool_blocks` blocks found
    /// in a shared pool: the same operations as selection's [`CostTerms::total_of`] with the
    /// summed credit, so the totals agree to the bit. Apply before
    /// [`CostTerms::with_preference`].
    pub fn with_pool_credit(mut self, w: &Weights, extra_credit: f64, pool_blocks: u32) -> Self {
        self.credit_blocks += extra_credit;
        self.prefill_cost = Self::prefill_cost(w, self.prefill_blocks, self.credit_blocks);
        self.pool_blocks = pool_blocks;
        self.total = self.prefill_cost + self.decode_cost;
        self
    }

    /// These terms less `preference` blocks for preferred labels: the same subtraction
    /// selection applies to [`CostTerms::total_of`], so the totals agree to the bit.
    pub fn with_preference(mut self, preference: f64) -> Self {
        self.preference = preference;
        self.total -= preference;
        self
    }

    /// `CostTerms::new(..).total` without the other terms, from the rank's credit
    /// ([`CostTerms::credit_of`]): the same operations in the same order, so the two are equal
    /// to the bit.
    #[inline(always)]
    pub fn total_of(
        w: &Weights,
        shape: &RequestShape,
        load: &LoadView,
        credit_blocks: f64,
        shared_blocks: u32,
    ) -> f64 {
        let prefill_blocks = Self::prefill_blocks(w, shape, load);
        Self::prefill_cost(w, prefill_blocks, credit_blocks)
            + Self::decode_cost(shape, load, shared_blocks)
    }

    /// A floor under the probe bound of a rank (`ProbeTargets::offer`: its cost less the
    /// most a probe could take off it) from the request and the rank's overlap credit alone,
    /// without its load; `prompt_decay` says whether the rank's prompt load may be decayed,
    /// `booked` is a number of prefill tokens the rank has booked at least
    /// ([`Router::prefill_floor`](crate::Router::prefill_floor); 0 knows nothing).
    ///
    /// The bound's terms each stay at or above the floor's: the prefill term with `booked`
    /// tokens booked, no more than the rank's (the same operations on a count no larger, all
    /// monotone); the prompt blocks less the room, at least the request's own blocks (all
    /// whole numbers below 2⁵³, so exact), or, with decay, those less the prompt's full
    /// blocks; the output, at least 0. The two sums round on their own, so
    /// `ProbeTargets::cannot_win` compares with a margin far above that.
    #[inline(always)]
    pub fn bound_floor(
        w: &Weights,
        shape: &RequestShape,
        credit_blocks: f64,
        prompt_decay: bool,
        booked: u64,
    ) -> f64 {
        FloorTerms::new(w, shape, booked).floor(credit_blocks, prompt_decay)
    }

    /// The least overlap credit a rank needs for its probe bound to reach `cheapest`, by what
    /// [`CostTerms::bound_floor`] gives (with the same `booked`): a rank with less credit (and
    /// the same decay flag) cannot win, whatever its load. Conservative by a margin far above
    /// rounding (`-∞`: any credit may win).
    pub fn credit_needed(
        w: &Weights,
        shape: &RequestShape,
        cheapest: f64,
        prompt_decay: bool,
        booked: u64,
    ) -> f64 {
        let s = w.prefill_load_scale;
        let own = count_f64(if prompt_decay {
            shape.blocks.saturating_sub(u64::from(shape.full_blocks))
        } else {
            shape.blocks
        });
        // The floor is s · max(0, T − credit) + own; it is above `cheapest` by more than the
        // margin when s · (T − credit) is.
        let margin = 1e-6 * cheapest.abs().max(own).max(1.0);
        let gap = cheapest + margin - own;
        if !gap.is_finite() || s < 0.0 {
            return f64::NEG_INFINITY;
        }
        if s == 0.0 {
            return if gap < 0.0 {
                f64::INFINITY
            } else {
                f64::NEG_INFINITY
            };
        }
        let least = LoadView {
            prefill_tokens: booked,
            ..LoadView::default()
        };
        let t = Self::prefill_blocks(w, shape, &least);
        let need = t - gap / s;
        need - 1e-9 * need.abs().max(1.0)
    }

    /// The overlap credit of `per_tier` cached blocks, in blocks.
    #[inline]
    pub fn credit_of(w: &Weights, per_tier: &[u32; StorageTier::COUNT]) -> f64 {
        Self::credit_blocks(w, per_tier)
    }

    /// Tokens in blocks. A power-of-two block size divides by multiplying with its exact
    /// reciprocal: the same result to the bit, without a division's latency.
    #[inline(always)]
    fn prefill_blocks(w: &Weights, shape: &RequestShape, load: &LoadView) -> f64 {
        let tokens = count_f64(load.prefill_tokens + shape.tokens);
        let bs = w.block_size.max(1);
        if bs.is_power_of_two() {
            tokens * (1.0 / f64::from(bs))
        } else {
            tokens / f64::from(bs)
        }
    }

    #[inline]
    fn credit_blocks(w: &Weights, per_tier: &[u32; StorageTier::COUNT]) -> f64 {
        per_tier
            .iter()
            .zip(w.credits)
            .map(|(&b, c)| f64::from(b) * c)
            .sum()
    }

    #[inline(always)]
    fn prefill_cost(w: &Weights, prefill_blocks: f64, credit_blocks: f64) -> f64 {
        w.prefill_load_scale * positive_part(prefill_blocks - credit_blocks)
    }

    /// Whole blocks first, then the weighted output: without decay the output is a whole
    /// number too, and the sum is exact.
    #[inline(always)]
    fn decode_cost(shape: &RequestShape, load: &LoadView, shared_blocks: u32) -> f64 {
        let own = shape.blocks.saturating_sub(u64::from(shared_blocks));
        let output = if load.output_decay == 0 {
            count_f64(load.output_blocks)
        } else {
            load.weighted_output_blocks()
        };
        let prompt = count_f64(load.prompt_blocks + own);
        let prompt = if load.prompt_decay == 0 {
            prompt
        } else {
            (prompt - count_f64(load.prompt_decay) / crate::load::DECAY_SCALE as f64)
                .max(count_f64(own))
        };
        prompt + output
    }
}

/// What [`CostTerms::bound_floor`] takes from the request alone, computed once for every
/// rank it is asked of: the floor is then one subtraction, one multiplication and one
/// addition a rank.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FloorTerms {
    scale: f64,
    /// Prefill blocks with `booked` tokens booked.
    prefill_blocks: f64,
    /// The request's own blocks, without and with prompt decay.
    own: [f64; 2],
}

impl FloorTerms {
    #[inline(always)]
    pub(crate) fn new(w: &Weights, shape: &RequestShape, booked: u64) -> Self {
        let least = LoadView {
            prefill_tokens: booked,
            ..LoadView::default()
        };
        FloorTerms {
            scale: w.prefill_load_scale,
            prefill_blocks: CostTerms::prefill_blocks(w, shape, &least),
            own: [
                count_f64(shape.blocks),
                count_f64(shape.blocks.saturating_sub(u64::from(shape.full_blocks))),
            ],
        }
    }

    /// [`CostTerms::bound_floor`] for a rank with `credit_blocks` of credit.
    #[inline(always)]
    pub(crate) fn floor(&self, credit_blocks: f64, prompt_decay: bool) -> f64 {
        self.scale * positive_part(self.prefill_blocks - credit_blocks)
            + self.own[usize::from(prompt_decay)]
    }
}

/// `max(x, 0)` for a cost term that is never NaN: one instruction, where `f64::max` adds NaN
/// handling to every rank's cost.
#[inline(always)]
fn positive_part(x: f64) -> f64 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

/// `x as f64` for a count, through the one-instruction signed conversion: the same value for
/// every count below 2⁶³ (every count the router keeps), 2⁶³ above. A plain `as f64` (or a
/// checked conversion, which the compiler folds back into it) is a five-instruction sequence
/// on x86-64, paid several times per rank in selection.
#[inline(always)]
pub(crate) fn count_f64(x: u64) -> f64 {
    x.min(i64::MAX as u64) as i64 as f64
}

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
    pub busy: Busy,
    /// The rank's health mark (always healthy when no worker is marked).
    pub health: Health,
    /// Prompt blocks active on the rank, when probed ([`shared_probe_targets`]); else 0.
    pub shared_blocks: u32,
    /// Total cost ([`CostTerms::total_of`]).
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
        if room == 0 || bound >= self.bounds[SHARED_PROBES - 1] {
            return true;
        }
        // Insert in order; when full, the highest bound drops out.
        let mut at = self.n.min(SHARED_PROBES - 1);
        while at > 0 && self.bounds[at - 1] > bound {
            self.bounds[at] = self.bounds[at - 1];
            self.indices[at] = self.indices[at - 1];
            at -= 1;
        }
        self.bounds[at] = bound;
        self.indices[at] = index as u32;
        self.n = (self.n + 1).min(SHARED_PROBES);
        true
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

/// The built-in policies, as named in decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// [`Policy::KvAware`].
    KvAware,
    /// [`Policy::RoundRobin`].
    RoundRobin,
    /// [`Policy::Random`].
    Random,
    /// [`Policy::LeastLoaded`].
    LeastLoaded,
    /// [`Policy::PowerOfTwo`].
    PowerOfTwo,
    /// [`Policy::PrefixHash`].
    PrefixHash,
    /// [`Policy::CacheThreshold`].
    CacheThreshold,
}

/// What a selector sees.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SelectInput<'a> {
    /// Never empty.
    pub candidates: &'a [Scored],
    /// The fleet snapshot's ranks, which [`Scored::fleet_index`] points into.
    pub ranks: &'a [RankEntry],
    pub shape: &'a RequestShape,
    pub block_size: u32,
    pub temperature: f64,
}

/// A selection policy. Implementations must be cheap, allocation-free and side-effect free
/// apart from their own counters: booking is the router's job.
pub(crate) trait Selector: Send + Sync + fmt::Debug {
    fn kind(&self) -> PolicyKind;
    /// The index of the chosen candidate (`input.candidates` is not empty).
    fn select(&self, input: &SelectInput<'_>, rng: &mut Rng) -> usize;
}

/// The selector for a configured policy.
pub(crate) fn selector_for(policy: Policy) -> Box<dyn Selector> {
    match policy {
        Policy::KvAware => Box::new(KvAware),
        Policy::RoundRobin => Box::new(RoundRobin::default()),
        Policy::Random => Box::new(RandomPick),
        Policy::LeastLoaded => Box::new(LeastLoaded),
        Policy::PowerOfTwo => Box::new(PowerOfTwo),
        Policy::PrefixHash {
            prefix_blocks: _,
            load_factor,
        } => Box::new(PrefixHash { load_factor }),
        Policy::CacheThreshold {
            min_match_ratio,
            balance_abs,
            balance_rel,
        } => Box::new(CacheThreshold {
            min_match_ratio,
            balance_abs,
            balance_rel,
        }),
    }
}

/// Index of the smallest `key`, ties broken uniformly at random (reservoir sampling).
pub(crate) fn argmin_random_ties<T>(items: &[T], rng: &mut Rng, key: impl Fn(&T) -> f64) -> usize {
    let mut best = 0;
    let mut best_key = f64::INFINITY;
    let mut ties = 0u64;
    for (i, item) in items.iter().enumerate() {
        let k = key(item);
        if k < best_key {
            best = i;
            best_key = k;
            ties = 1;
        } else if k == best_key {
            ties += 1;
            if rng.below(ties) == 0 {
                best = i;
            }
        }
    }
    best
}

/// Samples an index with probability ∝ exp(−normalised cost / temperature), costs normalised
/// to [0, 1] over the candidates (uniform when all are equal). Two passes, no allocation.
pub(crate) fn softmax_sample<T>(
    items: &[T],
    temperature: f64,
    rng: &mut Rng,
    cost: impl Fn(&T) -> f64,
) -> usize {
    let (lo, hi) = items
        .iter()
        .map(&cost)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), c| {
            (lo.min(c), hi.max(c))
        });
    let range = hi - lo;
    if !(range.is_finite() && range > 0.0) {
        return rng.below(items.len() as u64) as usize;
    }
    let weight = |c: f64| (-((c - lo) / range) / temperature).exp();
    let total: f64 = items.iter().map(|x| weight(cost(x))).sum();
    let mut target = rng.unit_f64() * total;
    for (i, x) in items.iter().enumerate() {
        target -= weight(cost(x));
        if target < 0.0 {
            return i;
        }
    }
    items.len() - 1
}

/// The reference's cost-based choice.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct KvAware;

impl Selector for KvAware {
    fn kind(&self) -> PolicyKind {
        PolicyKind::KvAware
    }
    fn select(&self, input: &SelectInput<'_>, rng: &mut Rng) -> usize {
        if input.temperature > 0.0 {
            softmax_sample(input.candidates, input.temperature, rng, |c| c.cost)
        } else {
            argmin_random_ties(input.candidates, rng, |c| c.cost)
        }
    }
}

/// Ranks in turn (over the candidates of each request).
#[derive(Debug, Default)]
pub(crate) struct RoundRobin {
    next: AtomicUsize,
}

impl Selector for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }
    fn select(&self, input: &SelectInput<'_>, _rng: &mut Rng) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % input.candidates.len()
    }
}

/// A uniformly random rank.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RandomPick;

impl Selector for RandomPick {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Random
    }
    fn select(&self, input: &SelectInput<'_>, rng: &mut Rng) -> usize {
        rng.below(input.candidates.len() as u64) as usize
    }
}

/// The rank with the least load in blocks (random ties).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct LeastLoaded;

impl Selector for LeastLoaded {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastLoaded
    }
    fn select(&self, input: &SelectInput<'_>, rng: &mut Rng) -> usize {
        let bs = input.block_size;
        argmin_random_ties(input.candidates, rng, |c| c.load.load_blocks(bs) as f64)
    }
}

/// The less loaded of two distinct random ranks.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PowerOfTwo;

impl Selector for PowerOfTwo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PowerOfTwo
    }
    fn select(&self, input: &SelectInput<'_>, rng: &mut Rng) -> usize {
        let n = input.candidates.len() as u64;
        if n == 1 {
            return 0;
        }
        let a = rng.below(n);
        let b = (a + 1 + rng.below(n - 1)) % n;
        let load = |i: u64| {
            input.candidates[i as usize]
                .load
                .load_blocks(input.block_size)
        };
        let (la, lb) = (load(a), load(b));
        let pick = if la < lb || (la == lb && rng.below(2) == 0) {
            a
        } else {
            b
        };
        pick as usize
    }
}

/// Bounded-load consistent hashing of the prompt's first blocks, by rendezvous hashing: each
/// rank's weight is a hash of (prefix key, rank); the heaviest rank whose load is within
/// `load_factor` × (mean load + 1) wins, so a prefix keeps its rank while the fleet changes
/// around it, and a hot prefix spills over instead of overloading one rank.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrefixHash {
    pub load_factor: f64,
}

impl Selector for PrefixHash {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PrefixHash
    }
    fn select(&self, input: &SelectInput<'_>, rng: &mut Rng) -> usize {
        let Some(key) = input.shape.prefix_key else {
            return LeastLoaded.select(input, rng);
        };
        let bs = input.block_size;
        let c = input.candidates;
        let mean = c.iter().map(|x| x.load.load_blocks(bs)).sum::<u64>() as f64 / c.len() as f64;
        let bound = self.load_factor * (mean + 1.0);
        let weight = |x: &Scored| {
            let rank = input.ranks[x.fleet_index as usize].rank;
            let r = (rank.worker.0 << 20) ^ u64::from(rank.dp_rank.0);
            mix64(key ^ mix64(r))
        };
        let mut best: Option<(usize, u64)> = None;
        for (i, x) in c.iter().enumerate() {
            if x.load.load_blocks(bs) as f64 > bound {
                continue;
            }
            let w = weight(x);
            if best.is_none_or(|(_, bw)| w > bw) {
                best = Some((i, w));
            }
        }
        // Some rank is always within the bound (the least loaded is at most the mean).
        best.map_or_else(|| LeastLoaded.select(input, rng), |(i, _)| i)
    }
}

/// The best-matching rank when the match is good and the fleet balanced; the least loaded
/// otherwise.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CacheThreshold {
    pub min_match_ratio: f64,
    pub balance_abs: u64,
    pub balance_rel: f64,
}

impl Selector for CacheThreshold {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheThreshold
    }
    fn select(&self, input: &SelectInput<'_>, rng: &mut Rng) -> usize {
        let bs = input.block_size;
        let c = input.candidates;
        let (lo, hi) = c
            .iter()
            .map(|x| x.load.load_blocks(bs))
            .fold((u64::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        let balanced = hi - lo <= self.balance_abs || hi as f64 <= self.balance_rel * lo as f64;
        let best = argmin_random_ties(c, rng, |x| -f64::from(x.overlap_blocks));
        let ratio = if input.shape.blocks == 0 {
            0.0
        } else {
            f64::from(c[best].overlap_blocks) / input.shape.blocks as f64
        };
        if balanced && ratio >= self.min_match_ratio && c[best].overlap_blocks > 0 {
            best
        } else {
            LeastLoaded.select(input, rng)
        }
    }
}

#[cfg(test)]
mod tests;
