//! Eviction under a memory budget: the clock walks mark runs with, the queue of runs by when
//! they were last stored into, and dropping the least recently used leaf block.

use std::cmp::Reverse;

use super::{DroppedHold, Pos, ShardWriter};

impl ShardWriter {
    /// Publishes the index's clock (its last Stored event) for walks to mark runs with.
    /// Under a memory budget only.
    #[inline(never)]
    pub(crate) fn set_clock(&self, tick: u64) {
        if let Some(used) = &self.shared.used {
            used.set_now(tick);
        }
    }

    pub(super) fn touch(&mut self, slot: u32, tick: u64) {
        if let Some(lru) = &mut self.lru {
            let touch = &mut self.touches[slot as usize];
            if *touch != tick {
                *touch = tick;
                lru.push(Reverse((tick, slot)));
            }
        }
    }

    /// Evicts the least recently used leaf block of this shard (the last block of the run
    /// least recently stored into or matched that nothing branches from), dropping every hold
    /// of it. Returns false when there is nothing to evict. Commit afterwards.
    pub(crate) fn evict_one(&mut self, dropped: &mut Vec<DroppedHold>) -> bool {
        loop {
            let Some(Reverse((tick, slot))) = self.lru.as_mut().and_then(|l| l.pop()) else {
                return false;
            };
            let meta = &self.metas[slot as usize];
            if !meta.live || self.touches[slot as usize] != tick {
                continue;
            }
            // Matched since it was queued: it goes back in line at the time it was used.
            let used = self
                .shared
                .used
                .as_ref()
                .map_or(0, |u| u.last_used(slot, u.now()));
            if used > tick {
                self.touches[slot as usize] = used;
                if let Some(lru) = &mut self.lru {
                    lru.push(Reverse((used, slot)));
                }
                continue;
            }
            let len = self.with_run(slot, |_, _, h| h.len()).unwrap_or(0);
            if len == 0 || meta.has_children((len - 1) as u8) {
                continue;
            }
            let off = (len - 1) as u8;
            let shard = self.index;
            let eh = self.ehs[slot as usize]
                .get(off as usize)
                .copied()
                .unwrap_or(0);
            let renamed = meta.renamed;
            let buf = self.run_mut(slot);
            let bit = 1u64 << off;
            for h in buf.holders.iter_mut().filter(|h| h.mask & bit != 0) {
                h.mask &= !bit;
                dropped.push(DroppedHold {
                    shard,
                    pos: Pos { slot, off },
                    rank: h.rank,
                    tier: h.tier,
                    eh,
                    renamed,
                });
            }
            buf.holders.retain(|h| h.mask != 0);
            self.prune(slot);
            // The run may still have older blocks to give up later.
            if self.metas[slot as usize].live {
                if let Some(lru) = &mut self.lru {
                    lru.push(Reverse((tick, slot)));
                }
            }
            return true;
        }
    }
}
