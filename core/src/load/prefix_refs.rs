//! The prompts active on one rank in lexicographic order ([`PrefixRefs`]), so that the blocks
//! they share count once without a refcount per block.

use crate::hash::LocalHash;

/// The prompts active on one rank, kept in lexicographic order of their blocks' local hashes,
/// so that the blocks they hold together (shared prefixes once) are counted without a
/// refcount per block.
///
/// In sorted order every group of prompts sharing a prefix is contiguous, so the union of
/// their prefixes, the size of their trie, is `Σ len − Σ lcp(neighbours)`, and a prompt's
/// longest prefix held by another is the longer of its common prefixes with its two
/// neighbours. Booking inserts one prompt and removes nothing: the blocks it adds are its
/// length less that longest shared prefix. Freeing is the mirror image. Both cost a binary
/// search over the rank's prompts, each comparison a scan to the first differing block
/// (eight hashes at a time), and a shift of the order: `O(log r · n + r)` for `r` active
/// prompts of `n` blocks, instead of `n` refcount updates. Comparing local hashes from the
/// first block on needs nothing derived from the prompt: chained prefix keys would have let
/// a comparison binary-search, but computing them is a serial chain of multiplies per block,
/// slower than the scan.
#[derive(Debug, Default)]
pub(crate) struct PrefixRefs {
    /// One prompt's block hashes per slot. A free slot holds an empty vector that keeps its
    /// capacity (up to [`KEPT_SLOT_CAPACITY`], in up to [`KEPT_FREE_SLOTS`] free slots), so
    /// that booking allocates nothing in steady state.
    pub(super) slots: Vec<Vec<LocalHash>>,
    pub(super) free: Vec<u32>,
    /// Occupied slots in lexicographic order of their hashes, equal prompts by slot.
    order: Vec<u32>,
    /// Distinct prefixes held (the trie's size).
    distinct: u64,
}

/// Hashes a free [`PrefixRefs`] slot keeps room for: a longer prompt's vector is dropped when
/// it is released.
pub(super) const KEPT_SLOT_CAPACITY: usize = 1 << 13;
/// Free [`PrefixRefs`] slots that keep their vectors (the latest freed, which booking reuses
/// first): a rank holds at most this many idle vectors, of at most 64 KiB each, after a peak
/// of concurrent requests.
pub(super) const KEPT_FREE_SLOTS: usize = 16;

/// How many leading blocks `a` and `b` share.
fn common_prefix(a: &[LocalHash], b: &[LocalHash]) -> usize {
    crate::hash::common_prefix(a, b)
}

/// Lexicographic order of two prompts' block hashes.
fn compare_keys(a: &[LocalHash], b: &[LocalHash]) -> std::cmp::Ordering {
    let m = common_prefix(a, b);
    match (a.get(m), b.get(m)) {
        (Some(x), Some(y)) => x.cmp(y),
        _ => a.len().cmp(&b.len()),
    }
}

impl PrefixRefs {
    /// Distinct keys held.
    pub(crate) fn len(&self) -> usize {
        self.distinct as usize
    }

    pub(super) fn keys(&self, slot: u32) -> &[LocalHash] {
        &self.slots[slot as usize]
    }

    /// Where `slot` sits in `order`: by binary search, or (should two different prefixes
    /// ever collide on a 64-bit key and leave the order inconsistent) by a scan, so that a
    /// held prompt is always found and released.
    fn position(&self, slot: u32) -> Option<usize> {
        let keys = self.keys(slot);
        self.order
            .binary_search_by(|&o| {
                // The slot itself: equal without reading its keys against themselves.
                if o == slot {
                    return std::cmp::Ordering::Equal;
                }
                compare_keys(self.keys(o), keys).then(o.cmp(&slot))
            })
            .ok()
            .or_else(|| self.order.iter().position(|&o| o == slot))
    }

    /// The longest prefix the prompt at `pos` in `order` shares with another active prompt.
    fn shared_at(&self, pos: usize) -> usize {
        let keys = self.keys(self.order[pos]);
        let before = pos
            .checked_sub(1)
            .map_or(0, |p| common_prefix(self.keys(self.order[p]), keys));
        let after = self
            .order
            .get(pos + 1)
            .map_or(0, |&o| common_prefix(self.keys(o), keys));
        before.max(after)
    }

    /// Holds the prompt of block hashes `keys` (copied into a free slot); returns its slot and
    /// how many of its prefixes were new on the rank.
    pub(super) fn acquire(&mut self, keys: &[LocalHash]) -> (u32, u64) {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize].extend_from_slice(keys);
                slot
            }
            None => {
                self.slots.push(keys.to_vec());
                (self.slots.len() - 1) as u32
            }
        };
        let keys = self.keys(slot);
        let pos = self.order.partition_point(|&o| {
            compare_keys(self.keys(o), keys).then(o.cmp(&slot)) == std::cmp::Ordering::Less
        });
        self.order.insert(pos, slot);
        let new = (self.keys(slot).len() - self.shared_at(pos)) as u64;
        self.distinct += new;
        (slot, new)
    }

    /// Drops the prompt in `slot`; returns how many prefixes the rank no longer holds.
    pub(super) fn release(&mut self, slot: u32) -> u64 {
        let Some(pos) = self.position(slot) else {
            return 0;
        };
        let gone = (self.keys(slot).len() - self.shared_at(pos)) as u64;
        self.order.remove(pos);
        self.free.push(slot);
        self.distinct = self.distinct.saturating_sub(gone);
        // Acquiring pops the latest free slot: the latest few keep their vectors, and the one
        // this release pushes out of that window gives its vector up.
        if let Some(i) = self.free.len().checked_sub(KEPT_FREE_SLOTS + 1) {
            let deep = self.free[i];
            self.slots[deep as usize] = Vec::new();
        }
        let kept = &mut self.slots[slot as usize];
        if kept.capacity() <= KEPT_SLOT_CAPACITY {
            kept.clear();
        } else {
            *kept = Vec::new();
        }
        gone
    }

    /// How many trailing blocks of the prompt in `slot` no other active prompt holds.
    pub(super) fn unshared(&self, slot: u32) -> usize {
        self.position(slot)
            .map_or(0, |pos| self.keys(slot).len() - self.shared_at(pos))
    }

    /// How many leading blocks of the prompt `keys` (its blocks' local hashes) some active
    /// prompt shares: the longer of the common prefixes with the two prompts `keys` would
    /// sit between.
    pub(crate) fn shared_prefix(&self, keys: &[LocalHash]) -> usize {
        let pos = self
            .order
            .partition_point(|&o| compare_keys(self.keys(o), keys) == std::cmp::Ordering::Less);
        let before = pos
            .checked_sub(1)
            .map_or(0, |p| common_prefix(self.keys(self.order[p]), keys));
        let after = self
            .order
            .get(pos)
            .map_or(0, |&o| common_prefix(self.keys(o), keys));
        before.max(after)
    }
}
