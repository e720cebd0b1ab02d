//! SGLang-style cache threshold: the best match when good and balanced, else the least loaded.

use super::least_loaded::LeastLoaded;
use super::{argmin_random_ties, PolicyKind, SelectInput, Selector};
use crate::rng::Rng;

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
