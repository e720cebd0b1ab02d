//! Publishing a shard's transaction: pruning the runs that lost holds, publishing every
//! changed run once, then the new links and the hints that follow them, then unlinking and
//! freeing dead runs, and handing retired arrays to the epoch collector.

use std::cmp::Reverse;

use super::{ShardWriter, CLEAN, FLUSH_EVERY, SPARE_BUFS};
use crate::index::run::run_bytes;
use crate::index::table::ROOT;

impl ShardWriter {
    /// Publishes the transaction.
    pub(crate) fn commit(&mut self) {
        let mut pending = std::mem::take(&mut self.prune_pending);
        for &slot in &pending {
            let meta = &mut self.metas[slot as usize];
            meta.prune_queued = false;
            if meta.live {
                self.prune(slot);
            }
        }
        pending.clear();
        self.prune_pending = pending;
        // Borrowed, not cloned: an `Arc` clone and drop are two locked instructions.
        let shared = &*self.shared;
        let guard = crossbeam_epoch::pin();
        let mut dirty = std::mem::take(&mut self.dirty);
        for (slot, buf) in dirty.drain(..) {
            let meta = &mut self.metas[slot as usize];
            meta.dirty = CLEAN;
            if !meta.live {
                continue; // freed below
            }
            if let Some(old) = self.published(slot) {
                self.run_bytes -= run_bytes(old.words());
            }
            self.run_bytes += run_bytes(buf.words());
            self.metas[slot as usize].words =
                u16::try_from(run_bytes(buf.words()) / std::mem::size_of::<u64>())
                    .unwrap_or(u16::MAX);
            let table = &self.table;
            shared.slots.publish(
                slot,
                buf.words(),
                shared.slots.address_of_next2(slot),
                |out| buf.write(out),
                |address| table.set_run(slot, address),
                &guard,
            );
            self.fresh.push(slot);
            if self.spare.len() < SPARE_BUFS {
                self.spare_bytes += buf.heap_bytes();
                self.spare.push(buf);
            }
        }
        self.dirty = dirty;
        // The lists are taken and put back emptied, so that they keep their capacity.
        let mut new_links = std::mem::take(&mut self.new_links);
        for &(key, slot) in &new_links {
            if self.metas[slot as usize].live {
                let address = shared.slots.address(slot);
                self.table.insert(&shared.children, key, slot, address);
                // The newest child is where the next walk through its parent likely goes on.
                if key.parent != ROOT {
                    let grandparent =
                        Some(self.metas[key.parent as usize].parent).filter(|&g| g != ROOT);
                    shared.slots.set_next(key.parent, slot, grandparent);
                    // The parent's second hint changed. (The grandparent's, when it did, names
                    // the new child, which was just published: see below.)
                    shared
                        .slots
                        .set_ahead(key.parent, shared.slots.address_of_next2(key.parent));
                }
            }
        }
        new_links.clear();
        self.new_links = new_links;
        // A run with a new array is two ahead of its grandparent's: tell the grandparent, when
        // its second hint names the run.
        for &slot in &self.fresh {
            let parent = self.metas[slot as usize].parent;
            if parent == ROOT {
                continue;
            }
            let grandparent = self.metas[parent as usize].parent;
            if grandparent != ROOT && shared.slots.hints(grandparent).1 == slot {
                shared
                    .slots
                    .set_ahead(grandparent, shared.slots.address(slot));
            }
        }
        self.fresh.clear();
        for key in self.dead_links.drain(..) {
            self.table.remove(key);
        }
        let mut dead_slots = std::mem::take(&mut self.dead_slots);
        for &slot in &dead_slots {
            if let Some(old) = self.published(slot) {
                self.run_bytes -= run_bytes(old.words());
                // Its link is gone already; should an entry still name it, it names no array.
                let table = &self.table;
                shared
                    .slots
                    .clear(slot, |address| table.set_run(slot, address), &guard);
            }
            self.free.push(slot);
        }
        dead_slots.clear();
        self.dead_slots = dead_slots;
        // Hand the retired runs to the collector every few commits, and let this thread, not
        // a reader, do the freeing that is due (a flush costs about as much as publishing a
        // run; the thread's own bag holds what waits, at most 64 runs).
        self.unflushed += 1;
        if self.unflushed >= FLUSH_EVERY {
            self.unflushed = 0;
            guard.flush();
        }
        if let Some(lru) = &mut self.lru {
            if lru.len() > 4 * self.live_runs + 1024 {
                let (metas, touches) = (&self.metas, &self.touches);
                lru.retain(|Reverse((t, s))| metas[*s as usize].live && touches[*s as usize] == *t);
            }
        }
    }
}
