//! A run: a stretch of one chain of blocks, stored once for every rank that holds part of it.
//!
//! ```text
//!  run 7 (parent: run 3 after offset 5)
//!  hashes   h0 h1 h2 h3 h4 ... (at most RUN_CAP)
//!  holders  rank 1 device  mask 0b11111
//!           rank 4 device  mask 0b00111      rank 4 holds the first three blocks
//!           rank 4 host    mask 0b01000      and the fourth in host memory
//! ```
//!
//! A holder's mask has bit `i` set when the rank holds block `i` of the run in that tier, so a
//! rank that holds only part of a run, or has a hole in it, needs no split and no copy of the
//! hashes. Runs are immutable once published; the writer replaces a changed run whole, sharing
//! the hash array with the old version when only holders changed.

use std::sync::Arc;

use crate::hash::LocalHash;

/// Blocks per run at most: one bit per block in a holder's mask.
pub(crate) const RUN_CAP: usize = 64;

/// One (rank, tier) that holds blocks of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub rank: u32,
    pub tier: u8,
    pub mask: u64,
}

/// A published run.
#[derive(Debug)]
pub(crate) struct Run {
    /// Slot of the run this one continues, or `table::ROOT`.
    pub parent: u32,
    /// Offset in the parent of the block this run continues after.
    pub parent_off: u8,
    pub hashes: Arc<[LocalHash]>,
    /// Sorted by (rank, tier).
    pub holders: Box<[Holder]>,
}

/// A working copy's hashes: still those of the published run, or the writer's own.
#[derive(Clone, Debug)]
pub(crate) enum Hashes {
    Shared(Arc<[LocalHash]>),
    Owned(Vec<LocalHash>),
}

impl Hashes {
    #[inline]
    pub(crate) fn as_slice(&self) -> &[LocalHash] {
        match self {
            Hashes::Shared(a) => a,
            Hashes::Owned(v) => v,
        }
    }

    /// The hashes to change, copied out of the published run on first use.
    pub(crate) fn to_mut(&mut self) -> &mut Vec<LocalHash> {
        if let Hashes::Shared(a) = self {
            *self = Hashes::Owned(a.to_vec());
        }
        match self {
            Hashes::Owned(v) => v,
            Hashes::Shared(_) => unreachable!("just made owned"),
        }
    }

    fn into_shared(self) -> Arc<[LocalHash]> {
        match self {
            Hashes::Shared(a) => a,
            Hashes::Owned(v) => v.into(),
        }
    }
}

/// The writer's working copy of a run during one event.
#[derive(Clone, Debug)]
pub(crate) struct RunBuf {
    pub parent: u32,
    pub parent_off: u8,
    pub hashes: Hashes,
    pub holders: Vec<Holder>,
}

impl RunBuf {
    pub(crate) fn from_run(run: &Run) -> Self {
        RunBuf {
            parent: run.parent,
            parent_off: run.parent_off,
            hashes: Hashes::Shared(Arc::clone(&run.hashes)),
            holders: run.holders.to_vec(),
        }
    }

    pub(crate) fn into_run(self) -> Run {
        Run {
            parent: self.parent,
            parent_off: self.parent_off,
            hashes: self.hashes.into_shared(),
            holders: self.holders.into_boxed_slice(),
        }
    }

    /// Sets the bits of `bits` for (rank, tier). Returns those that were already set.
    pub(crate) fn hold(&mut self, rank: u32, tier: u8, bits: u64) -> u64 {
        match self
            .holders
            .binary_search_by_key(&(rank, tier), |h| (h.rank, h.tier))
        {
            Ok(i) => {
                let held = self.holders[i].mask & bits;
                self.holders[i].mask |= bits;
                held
            }
            Err(i) => {
                self.holders.insert(
                    i,
                    Holder {
                        rank,
                        tier,
                        mask: bits,
                    },
                );
                0
            }
        }
    }

    /// Clears the bits of `bits` for (rank, tier). Returns `(cleared, elsewhere)`: the bits
    /// that were set, and those of them the rank still holds in another tier.
    pub(crate) fn unhold(&mut self, rank: u32, tier: u8, bits: u64) -> (u64, u64) {
        let Ok(i) = self
            .holders
            .binary_search_by_key(&(rank, tier), |h| (h.rank, h.tier))
        else {
            return (0, 0);
        };
        let cleared = self.holders[i].mask & bits;
        self.holders[i].mask &= !cleared;
        // Sorted by (rank, tier): the rank's other tiers sit right beside this entry.
        let same_rank = |h: &&Holder| h.rank == rank;
        let elsewhere = self.holders[..i]
            .iter()
            .rev()
            .take_while(same_rank)
            .chain(self.holders[i + 1..].iter().take_while(same_rank))
            .fold(0, |m, h| m | h.mask)
            & cleared;
        if self.holders[i].mask == 0 {
            self.holders.remove(i);
        }
        (cleared, elsewhere)
    }

    /// Whether `rank` still has any holder entry in the run.
    pub(crate) fn has_rank(&self, rank: u32) -> bool {
        self.holders.iter().any(|h| h.rank == rank)
    }

    /// Union of every holder's mask.
    pub(crate) fn held_mask(&self) -> u64 {
        self.holders.iter().fold(0, |m, h| m | h.mask)
    }
}

/// Heap bytes of a published run, its hash array's `Arc` header included.
pub(crate) fn run_bytes(hashes: usize, holders: usize) -> usize {
    2 * std::mem::size_of::<usize>()
        + std::mem::size_of::<Run>()
        + hashes * std::mem::size_of::<LocalHash>()
        + holders * std::mem::size_of::<Holder>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_and_unhold_track_bits_per_rank_and_tier() {
        let mut r = RunBuf {
            parent: 0,
            parent_off: 0,
            hashes: Hashes::Owned(vec![LocalHash(1), LocalHash(2)]),
            holders: vec![],
        };
        assert_eq!(r.hold(3, 0, 0b01), 0);
        assert_eq!(r.hold(3, 0, 0b10), 0);
        assert_eq!(r.hold(3, 0, 0b11), 0b11);
        assert_eq!(r.hold(1, 1, 0b01), 0);
        assert_eq!(r.holders.len(), 2);
        assert_eq!(r.holders[0].rank, 1);
        assert_eq!(r.held_mask(), 0b11);
        assert_eq!(r.unhold(3, 0, 0b01), (0b01, 0));
        assert_eq!(r.unhold(3, 0, 0b01), (0, 0));
        r.hold(3, 1, 0b10);
        assert_eq!(r.unhold(3, 0, 0b11), (0b10, 0b10));
        assert_eq!(r.unhold(3, 1, 0b10), (0b10, 0));
        assert_eq!(r.unhold(7, 0, 0b10), (0, 0));
        assert!(!r.has_rank(3));
        assert!(r.has_rank(1));
    }
}
