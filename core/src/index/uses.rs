//! When a match last read each run: what makes a memory budget's eviction least recently
//! *used*, not only least recently stored.
//!
//! The writer knows when it last stored into a run (its clock counts Stored events); only the
//! readers know when a match last read one. Under a budget each shard keeps a mark per slot,
//! and a walk raises the mark of every run it matches blocks in to the writer's clock, read
//! once when the walk starts. Eviction takes a run's recency as the later of its last store
//! and its mark.
//!
//! ```text
//!  writer: Stored event ── clock += 1 ──▶ clock (one word per shard, read by walks)
//!  walk:   now = clock ── run matched ──▶ mark[slot] = max(mark[slot], now)
//!  evict:  oldest (tick, slot) popped ── mark[slot] > tick? ── yes: pushed again at the mark
//! ```
//!
//! A mark is stored only when it would rise, so a run that every match reads (a system
//! prompt) is written once per clock tick, not once per match. Every access is `Relaxed`: a
//! mark or a clock read late only makes a run look a little older or newer than it is, which
//! changes which block is evicted, never what the index answers. Without a budget there are
//! no marks and walks write nothing.
//!
//! Marks live in segments that double in size and never move, laid out like the slots
//! themselves ([`super::slots::locate`]), so a walk can mark any slot it has reached while the
//! writer grows the array. A mark is the clock's low 32 bits (4 bytes a slot), read back
//! against the clock: a mark more than 2^32 Stored events old reads as recent, which at worst
//! spares one run for one round of eviction.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;

use crossbeam_utils::CachePadded;

use super::slots::{locate, segment_len, SEGMENTS};

type Segment = OnceLock<Box<[AtomicU32]>>;

/// Per-slot marks of a shard's last use by a match, and the clock they are read from.
pub(crate) struct UseMarks {
    /// The writer's clock as of its last Stored event. On a line of its own: the writer
    /// stores it at every Stored event, and walks read it at every start.
    clock: CachePadded<AtomicU64>,
    segs: Box<[Segment]>,
}

impl UseMarks {
    pub(crate) fn new() -> Self {
        UseMarks {
            clock: CachePadded::new(AtomicU64::new(0)),
            segs: (0..SEGMENTS).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The clock, for a walk to mark the runs it matches with. Any thread.
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        self.clock.load(Ordering::Relaxed)
    }

    /// Advances the clock. Writer only.
    pub(crate) fn set_now(&self, tick: u64) {
        self.clock.store(tick, Ordering::Relaxed);
    }

    #[inline]
    fn cell(&self, slot: u32) -> Option<&AtomicU32> {
        let (k, off) = locate(slot);
        self.segs.get(k)?.get()?.get(off)
    }

    /// Raises `slot`'s mark to `now`. Any thread; a slot whose segment the writer has not
    /// allocated yet (it cannot have been reached) is ignored. Kept out of line, so that the
    /// walk's code is the same with or without a budget.
    #[inline(never)]
    pub(crate) fn mark(&self, slot: u32, now: u64) {
        if let Some(m) = self.cell(slot) {
            let now = now as u32;
            // Read before written: most matches find the mark already raised, and leave the
            // line shared instead of taking it from the other cores.
            if (now.wrapping_sub(m.load(Ordering::Relaxed)) as i32) > 0 {
                m.store(now, Ordering::Relaxed);
            }
        }
    }

    /// When a match last read `slot`'s run, by the clock: `now` (the writer's clock) less the
    /// mark's age. A slot never marked since it was allocated reads as the time it was
    /// allocated.
    pub(crate) fn last_used(&self, slot: u32, now: u64) -> u64 {
        let mark = self
            .cell(slot)
            .map_or(now as u32, |m| m.load(Ordering::Relaxed));
        now.saturating_sub(u64::from((now as u32).wrapping_sub(mark)))
    }

    /// Allocates `slot`'s segment if needed and sets its mark to the clock, for a run newly
    /// placed in it. Writer only.
    #[inline(never)]
    pub(crate) fn reset(&self, slot: u32) {
        let (k, off) = locate(slot);
        let seg =
            self.segs[k].get_or_init(|| (0..segment_len(k)).map(|_| AtomicU32::new(0)).collect());
        seg[off].store(self.now() as u32, Ordering::Relaxed);
    }

    /// Bytes of the clock and the allocated segments.
    pub(crate) fn bytes(&self) -> usize {
        let segments: usize = self
            .segs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.get().is_some())
            .map(|(k, _)| segment_len(k) * std::mem::size_of::<AtomicU32>())
            .sum();
        segments + self.segs.len() * std::mem::size_of::<Segment>() + std::mem::size_of::<Self>()
    }
}

#[cfg(test)]
mod tests;
