//! The memory budget: what the index accounts for itself ([`PrefixIndex::memory_bytes`]),
//! the clock walks mark runs with, and eviction of the least recently used leaf blocks.

use super::mix::set_bytes;
use super::writer::{pack, PrefixIndex, RankRecord};
use crate::event::WorkerRank;

impl PrefixIndex {
    /// Bytes the index accounts for itself: runs, tables, maps and bookkeeping, by capacity.
    pub fn memory_bytes(&self) -> usize {
        let shards: usize = self.shards.iter().map(|s| s.bytes()).sum();
        let names: usize = self
            .ranks
            .iter()
            .flatten()
            .map(|r| r.names.bytes() + set_bytes::<u32>(r.aliased.capacity()))
            .sum();
        shards
            + names
            + set_bytes::<((u32, u8, u32), u32)>(self.copies.capacity())
            + set_bytes::<(WorkerRank, u32)>(self.rank_ids.capacity())
            + self.ranks.capacity() * std::mem::size_of::<Option<RankRecord>>()
            + self.ranks.len() * std::mem::size_of::<Option<WorkerRank>>()
            + std::mem::size_of::<Self>()
    }

    /// Publishes the clock of Stored events to every shard, for walks to mark the runs they
    /// match with (under a budget only). Out of line: the event loop's code stays as it is
    /// without a budget.
    #[inline(never)]
    pub(super) fn publish_clock(&self) {
        for s in &self.shards {
            s.set_clock(self.tick);
        }
    }

    pub(super) fn enforce_budget(&mut self) {
        let Some(budget) = self.config.memory_budget else {
            return;
        };
        let mut nothing_left = false;
        while !nothing_left && self.memory_bytes() > budget {
            let mut dropped = std::mem::take(&mut self.dropped);
            dropped.clear();
            let mut evicted = 0u64;
            let mut touched = 0u64;
            'batch: for _ in 0..32 {
                let mut any = false;
                for (i, s) in self.shards.iter_mut().enumerate() {
                    if s.evict_one(&mut dropped) {
                        evicted += 1;
                        any = true;
                        touched |= 1 << (i % 64);
                    }
                }
                if !any {
                    nothing_left = true;
                    break 'batch;
                }
            }
            self.evicted_blocks += evicted;
            self.evicted_pairs += dropped.len() as u64;
            for d in &dropped {
                let loc = pack(d.shard, d.pos);
                if let Some(n) = self.copies.remove(&(d.rank, d.tier, loc)) {
                    self.duplicate_copies -= n as u64;
                }
            }
            self.stored_pairs -= dropped.len() as u64;
            // Forget the names of the holds dropped, unless the rank still holds the block in
            // another tier. A rank that named the block other than it was first stored under
            // is searched for it.
            for d in &dropped {
                let loc = pack(d.shard, d.pos);
                if self.shards[d.shard].holds(d.pos, d.rank, None) {
                    continue;
                }
                let Some(Some(state)) = self.ranks.get_mut(d.rank as usize) else {
                    continue;
                };
                let names = &mut state.names;
                if state.aliased.remove(&loc) {
                    names.retain(|_, l| l != loc, &self.shards);
                } else if names.get(d.eh, &self.shards) == Some(loc) {
                    names.remove(d.eh, &self.shards);
                } else if d.renamed {
                    names.retain(|_, l| l != loc, &self.shards);
                }
            }
            self.dropped = dropped;
            self.commit_touched(touched);
        }
        if nothing_left && self.memory_bytes() > budget {
            // Nothing left to evict: the budget comes before the room reserved for names.
            for state in self.ranks.iter_mut().flatten() {
                state.names.release(&self.shards);
            }
        }
    }
}
