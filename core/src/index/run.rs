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
//! hashes.
//!
//! A published run is one array of words, header, hashes and holders together, so that a
//! reader reaches all of it through one pointer and its first cache line holds the header and
//! the first hashes:
//!
//! ```text
//!  [parent slot | parent offset | length | holders] [hash 0] ... [hash n-1] [rank|tier, mask] ...
//! ```
//!
//! Runs are immutable once published; the writer edits a working copy ([`RunBuf`]) and
//! publishes it whole.
//!
//! The helpers that read holder words (a rank's group of holders, the leading blocks of a
//! mask, blocks per tier) live here beside the format, for the walk, the depth scorer and the
//! shard writer alike.

use std::mem::MaybeUninit;

use crate::event::StorageTier;

/// Blocks per run at most: one bit per block in a holder's mask.
pub(crate) const RUN_CAP: usize = 64;

/// One (rank, tier) that holds blocks of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub rank: u32,
    pub tier: u8,
    pub mask: u64,
}

impl Holder {
    /// The holder of a word pair `[rank << 8 | tier, mask]`.
    #[inline]
    pub(crate) fn from_pair(p: &[u64]) -> Self {
        Holder {
            rank: (p[0] >> 8) as u32,
            tier: p[0] as u8,
            mask: p[1],
        }
    }

    #[inline]
    fn pair(&self) -> [u64; 2] {
        [(self.rank as u64) << 8 | self.tier as u64, self.mask]
    }
}

/// The rank of holder `i` of a run's holder words.
#[inline]
pub(crate) fn rank_at(holders: &[u64], i: usize) -> u32 {
    (holders[2 * i] >> 8) as u32
}

/// The holders of a run's holder words.
#[inline]
pub(crate) fn holders_of(words: &[u64]) -> impl Iterator<Item = Holder> + '_ {
    words.chunks_exact(2).map(Holder::from_pair)
}

/// Leading blocks of `mask` held from offset 0, at most `limit`.
#[inline]
pub(super) fn leading(mask: u64, limit: usize) -> usize {
    (mask.trailing_ones() as usize).min(limit)
}

/// Adds the first `lead` blocks of one rank's holders to `per_tier`, each under its fastest
/// tier.
#[inline]
pub(super) fn add_tiers(per_tier: &mut [u32; StorageTier::COUNT], holders: &[u64], lead: usize) {
    let lead_mask = if lead >= 64 { !0 } else { (1u64 << lead) - 1 };
    let mut assigned = 0u64;
    for h in holders_of(holders) {
        let bits = h.mask & lead_mask & !assigned;
        if let Some(t) = per_tier.get_mut(h.tier as usize) {
            *t += bits.count_ones();
        }
        assigned |= bits;
    }
}

/// The holders of rank `id` starting at holder `from`: the end of its group and the union of
/// its masks (a rank's holders, one per tier, are adjacent).
#[inline(always)]
pub(super) fn group_of(holders: &[u64], from: usize, n: usize) -> (usize, u64) {
    let id = rank_at(holders, from);
    let mut union = holders[2 * from + 1];
    let mut end = from + 1;
    while end < n && rank_at(holders, end) == id {
        union |= holders[2 * end + 1];
        end += 1;
    }
    (end, union)
}

/// The holders of rank `id` among holder words `holders` (sorted by rank id), by bisection:
/// where its group starts and ends, and the union of its masks.
#[inline]
pub(super) fn find_group(holders: &[u64], id: u32) -> Option<(usize, usize, u64)> {
    let n = holders.len() / 2;
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if rank_at(holders, mid) < id {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if lo < n && rank_at(holders, lo) == id {
        let (end, union) = group_of(holders, lo, n);
        Some((lo, end, union))
    } else {
        None
    }
}

/// A published run, read in place.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Run<'a> {
    pub parent: u32,
    pub parent_off: u8,
    pub hashes: &'a [u64],
    /// Word pairs `[rank << 8 | tier, mask]`, sorted by (rank, tier).
    pub holders: &'a [u64],
}

impl<'a> Run<'a> {
    /// Words of the published form.
    pub(crate) fn words(&self) -> usize {
        1 + self.hashes.len() + self.holders.len()
    }

    /// The parent slot, parent offset and first hash of a run's words, without parsing the
    /// rest.
    #[inline]
    pub(crate) fn link(words: &[u64]) -> Option<(u32, u8, u64)> {
        match words {
            [head, first, ..] => Some((*head as u32, (*head >> 32) as u8, *first)),
            _ => None,
        }
    }

    /// Reads a run's words; `None` if they are not a run (never for published words).
    #[inline]
    pub(crate) fn parse(words: &'a [u64]) -> Option<Self> {
        let (&head, rest) = words.split_first()?;
        let len = (head >> 40) as u8 as usize;
        let holders = (head >> 48) as usize;
        let hashes = rest.get(..len)?;
        Some(Run {
            parent: head as u32,
            parent_off: (head >> 32) as u8,
            hashes,
            holders: rest.get(len..len + 2 * holders)?,
        })
    }
}

/// The writer's working copy of a run during one event.
#[derive(Clone, Debug, Default)]
pub(crate) struct RunBuf {
    pub parent: u32,
    pub parent_off: u8,
    pub hashes: Vec<u64>,
    pub holders: Vec<Holder>,
}

impl RunBuf {
    /// Becomes a copy of `run`, in the vectors it already has.
    pub(crate) fn copy_run(&mut self, run: Run<'_>) {
        self.parent = run.parent;
        self.parent_off = run.parent_off;
        self.hashes.clear();
        self.hashes.extend_from_slice(run.hashes);
        self.holders.clear();
        self.holders.extend(holders_of(run.holders));
    }

    /// Becomes an empty run under `parent`, in the vectors it already has.
    pub(crate) fn reset(&mut self, parent: u32) {
        self.parent = parent;
        self.parent_off = 0;
        self.hashes.clear();
        self.holders.clear();
    }

    /// Heap bytes of its vectors.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.hashes.capacity() * 8 + self.holders.capacity() * std::mem::size_of::<Holder>()
    }

    /// Words the published form takes.
    pub(crate) fn words(&self) -> usize {
        1 + self.hashes.len() + 2 * self.holders.len()
    }

    /// Writes the published form into the first [`RunBuf::words`] words of `out` and returns
    /// how many it wrote (fewer only if `out` is too short).
    pub(crate) fn write(&self, out: &mut [MaybeUninit<u64>]) -> usize {
        debug_assert!(self.hashes.len() <= RUN_CAP && self.holders.len() < 1 << 16);
        let head = self.parent as u64
            | (self.parent_off as u64) << 32
            | (self.hashes.len() as u64) << 40
            | (self.holders.len() as u64) << 48;
        let Some((first, rest)) = out.split_first_mut() else {
            return 0;
        };
        first.write(head);
        let n = self.hashes.len().min(rest.len());
        let (hashes, holders) = rest.split_at_mut(n);
        for (o, &h) in hashes.iter_mut().zip(&self.hashes) {
            o.write(h);
        }
        let mut written = 1 + n;
        for (o, h) in holders.chunks_exact_mut(2).zip(&self.holders) {
            let [rank_tier, mask] = h.pair();
            o[0].write(rank_tier);
            o[1].write(mask);
            written += 2;
        }
        written
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

/// Heap bytes of a published run of `words` words, with the array's length and the address of
/// the array two runs ahead (see `slots.rs`).
pub(crate) fn run_bytes(words: usize) -> usize {
    (words + 2) * std::mem::size_of::<u64>()
}

#[cfg(test)]
mod tests;
