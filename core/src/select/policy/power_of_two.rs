//! The power of two choices: the less loaded of two random candidates.

use super::{PolicyKind, SelectInput, Selector};
use crate::rng::Rng;

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
