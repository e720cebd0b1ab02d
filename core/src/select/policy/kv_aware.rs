//! The KV-aware cost's choice: the cheapest candidate (random ties), one drawn among the
//! near-cheapest, or a softmax sample.

use super::{
    argmin_random_ties, near_min_random, softmax_sample, PolicyKind, SelectInput, Selector,
};
use crate::rng::Rng;

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
        } else if input.near_tie > 0.0 {
            near_min_random(input.candidates, input.near_tie, rng, |c| c.cost)
        } else {
            argmin_random_ties(input.candidates, rng, |c| c.cost)
        }
    }
}
