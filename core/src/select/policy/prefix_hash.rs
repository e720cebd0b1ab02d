//! Bounded-load consistent hashing of the prompt's first blocks.

use super::least_loaded::LeastLoaded;
use super::{PolicyKind, SelectInput, Selector};
use crate::rng::mix64;
use crate::rng::Rng;
use crate::select::candidate::Scored;

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
