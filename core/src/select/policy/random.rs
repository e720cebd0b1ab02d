//! A uniformly random candidate.

use super::{PolicyKind, SelectInput, Selector};
use crate::rng::Rng;

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
