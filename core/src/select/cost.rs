//! The cost of serving a request on a rank, in blocks ([`CostTerms`]), the request's side of it
//! ([`Weights`], [`RequestShape`]), and the floors that bound it before a rank's load is read
//! ([`FloorTerms`]).

use crate::config::{Affinity, HotLoad, RouterConfig};
use crate::event::StorageTier;
use crate::load::LoadView;
/// The per-request numbers the cost needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weights {
    /// Credit per cached block, by tier (device: the overlap credit).
    pub credits: [f64; StorageTier::COUNT],
    /// Weight of a cached block in the cached-token estimate, by tier (device: 1).
    pub effective: [f64; StorageTier::COUNT],
    pub prefill_load_scale: f64,
    pub block_size: u32,
    /// Leading blocks held past which a rank's credit grows, for this prompt (∞: never;
    /// [`Affinity`], [`Weights::for_prompt`]).
    pub affinity_from: f64,
    /// Growth of the credit multiplier per block held past `affinity_from`.
    pub affinity_slope: f64,
    /// Context blocks past which a rank's context costs `hot_weight` a block (∞: never;
    /// [`Weights::with_fleet_load`]).
    pub hot_from: f64,
    /// Cost per context block past `hot_from` ([`HotLoad::weight`]).
    pub hot_weight: f64,
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
            affinity_from: f64::INFINITY,
            affinity_slope: 0.0,
            hot_from: f64::INFINITY,
            hot_weight: config.hot_load.weight,
        }
    }

    /// These weights for `shape` on a fleet whose ranks hold `mean_context` context blocks on
    /// average ([`LoadView::context_load`]): a rank's context past `hot.share` times that,
    /// plus the request's blocks, costs ([`CostTerms::hot_cost`]). Off with `hot.share` or
    /// `hot.weight` 0, or without a mean.
    pub fn with_fleet_load(
        mut self,
        hot: &HotLoad,
        mean_context: f64,
        shape: &RequestShape,
    ) -> Self {
        self.hot_from = if hot.share > 0.0 && self.hot_weight > 0.0 && mean_context.is_finite() {
            hot.share * mean_context + count_f64(shape.blocks)
        } else {
            f64::INFINITY
        };
        self
    }

    /// These weights with `affinity` applied to a prompt of `full_blocks` cacheable blocks.
    pub fn for_prompt(mut self, affinity: &Affinity, full_blocks: u32) -> Self {
        let blocks = f64::from(full_blocks);
        if affinity.boost > 0.0 && full_blocks > 0 && affinity.from_share < 1.0 {
            self.affinity_from = affinity.from_share * blocks;
            self.affinity_slope = affinity.boost / ((1.0 - affinity.from_share) * blocks);
        } else {
            self.affinity_from = f64::INFINITY;
            self.affinity_slope = 0.0;
        }
        self
    }

    /// The credit multiplier of a rank holding `blocks` leading blocks: 1 up to
    /// `affinity_from`, then growing linearly (exactly 1 with affinity off).
    #[inline(always)]
    pub fn affinity(&self, blocks: u32) -> f64 {
        1.0 + self.affinity_slope * positive_part(f64::from(blocks) - self.affinity_from)
    }

    /// The fewest blocks (a real number) whose credit at one credit per block reaches
    /// `units`: the inverse of `b · affinity(b)`, which grows with `b`.
    pub fn blocks_for_credit(&self, units: f64) -> f64 {
        let (k, from) = (self.affinity_slope, self.affinity_from);
        if units <= from || k <= 0.0 {
            return units;
        }
        // b · (1 + k · (b − from)) = units: k·b² + (1 − k·from)·b − units = 0, the root past
        // `from` (the product is `from` there, below `units`).
        let p = 1.0 - k * from;
        (-p + (p * p + 4.0 * k * units).sqrt()) / (2.0 * k)
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
    /// hot_weight · max(0, the rank's context blocks − `hot_from`): a rank far above the
    /// fleet's mean pays for it.
    pub hot_cost: f64,
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
        let hot_cost = Self::hot_cost(w, load);
        CostTerms {
            prefill_blocks,
            credit_blocks,
            prefill_cost,
            shared_blocks,
            decode_cost,
            hot_cost,
            pool_blocks: 0,
            preference: 0.0,
            total: prefill_cost + decode_cost + hot_cost,
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
        self.total = self.prefill_cost + self.decode_cost + self.hot_cost;
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
            + Self::hot_cost(w, load)
    }

    /// The rank's context ([`LoadView::context_load`]) past `hot_from`, at `hot_weight` a
    /// block: 0 on a rank not far above the fleet's mean. Never negative and independent of
    /// the request's shared blocks, so the floors and a probe's bound stay below the cost.
    #[inline(always)]
    pub fn hot_cost(w: &Weights, load: &LoadView) -> f64 {
        if w.hot_from == f64::INFINITY {
            return 0.0;
        }
        w.hot_weight * positive_part(count_f64(load.context_load()) - w.hot_from)
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

    /// The tier-weighted blocks, times the affinity multiplier of all the blocks held.
    #[inline]
    fn credit_blocks(w: &Weights, per_tier: &[u32; StorageTier::COUNT]) -> f64 {
        let credit: f64 = per_tier
            .iter()
            .zip(w.credits)
            .map(|(&b, c)| f64::from(b) * c)
            .sum();
        credit * w.affinity(per_tier.iter().sum())
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
