//! The least loaded candidate.

use super::{argmin_random_ties, PolicyKind, SelectInput, Selector};
use crate::rng::Rng;

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
