//! Round-robin: candidates in turn.

use super::{PolicyKind, SelectInput, Selector};
use crate::rng::Rng;
use std::sync::atomic::{AtomicUsize, Ordering};

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
