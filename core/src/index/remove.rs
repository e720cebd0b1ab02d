//! Applying a Removed event (block by block, one holder update per run) and a Cleared one.

use super::shard::{Pos, ShardWriter};
use super::stats::IndexError;
use super::writer::{pack, unpack, PrefixIndex};
use crate::event::{BlockHash, EventHeader};

/// How many names ahead a Removed event's loop prefetches (into the first-level cache: each
/// lookup reads its entry, then the high half it names, at once).
const PREFETCH_AHEAD: usize = 16;

/// What a Removed event did, block by block.
#[derive(Default)]
struct Removal {
    removed: u64,
    unknown: usize,
    /// Index in the event of the first block that was not held.
    first_unknown: u32,
    /// Shards changed (bit = shard % 64).
    touched: u64,
}

impl Removal {
    fn unknown(&mut self, i: usize) {
        if self.unknown == 0 || (i as u32) < self.first_unknown {
            self.first_unknown = i as u32;
        }
        self.unknown += 1;
    }
}

/// One run's hold by the (rank, tier) a Removed event clears, while the event's blocks in it
/// are gathered.
struct RunHold {
    shard: usize,
    slot: u32,
    /// The run's packed position without an offset: `pack(shard, slot, 0) >> 6`.
    run: u32,
    /// Blocks (rank, tier) holds in the run.
    held: u64,
    /// Blocks the rank holds in the run in another tier.
    elsewhere: u64,
    /// Blocks of the event gathered so far.
    bits: u64,
}

impl RunHold {
    const NONE: RunHold = RunHold {
        shard: usize::MAX,
        slot: u32::MAX,
        run: u32::MAX,
        held: 0,
        elsewhere: 0,
        bits: 0,
    };

    #[inline]
    fn read(shards: &[ShardWriter], shard: usize, slot: u32, (rank, tier): (u32, u8)) -> Self {
        let (held, elsewhere) = shards
            .get(shard)
            .map_or((0, 0), |s| s.rank_masks(slot, rank, tier));
        RunHold {
            shard,
            slot,
            run: pack(shard, Pos { slot, off: 0 }) >> 6,
            held,
            elsewhere,
            bits: 0,
        }
    }

    /// Clears the gathered blocks with one holder update.
    #[inline]
    fn clear(&self, shards: &mut [ShardWriter], (rank, tier): (u32, u8), tally: &mut Removal) {
        if self.bits == 0 {
            return;
        }
        let (cleared, _) = shards[self.shard].unhold(self.slot, rank, tier, self.bits);
        debug_assert_eq!(cleared, self.bits);
        tally.touched |= 1 << (self.shard % 64);
    }
}

impl PrefixIndex {
    /// Applies a Removed event given by parts. Blocks the rank does not hold are skipped,
    /// counted and reported; the others are removed.
    pub fn apply_removed(
        &mut self,
        header: EventHeader,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError> {
        let rank = self.event_rank(header)?;
        let tier = header.tier as u8;
        let Some(Some(state)) = self.ranks.get_mut(rank as usize) else {
            return Ok(());
        };
        let names = &mut state.names;
        let aliased = &mut state.aliased;
        // Blocks whose hold ended that the rank also named otherwise.
        let mut unnamed = Vec::new();
        let shards = &mut self.shards;
        let mut tally = Removal::default();
        // The blocks of one run are cleared together, with one holder update. The run's masks
        // are read when the walk reaches it, so that each block is judged (held, held in
        // another tier too) and its name forgotten at once.
        let mut run = RunHold::NONE;
        // The first names at once, into the second level: a burst the first level has too
        // few miss buffers for; the later ones one at a time, into the first.
        for b in blocks.iter().take(PREFETCH_AHEAD) {
            names.prefetch(b.0, true);
        }
        for (i, b) in blocks.iter().enumerate() {
            if let Some(ahead) = blocks.get(i + PREFETCH_AHEAD) {
                names.prefetch(ahead.0, false);
            }
            let Some((entry, loc)) = names.find(b.0, &*shards) else {
                tally.unknown(i);
                continue;
            };
            // Extra copies exist only while the block is held in that tier.
            let extra = match self.copies.is_empty() {
                true => None,
                false => self.copies.get_mut(&(rank, tier, loc)),
            };
            if let Some(c) = extra {
                *c -= 1;
                if *c == 0 {
                    self.copies.remove(&(rank, tier, loc));
                }
                self.duplicate_copies -= 1;
                continue;
            }
            // The run's shard and slot are the position's bits above its offset.
            if loc >> 6 != run.run {
                run.clear(shards, (rank, tier), &mut tally);
                let (shard, pos) = unpack(loc);
                run = RunHold::read(shards, shard, pos.slot, (rank, tier));
                // The high halves the next names of this run are checked against (an event
                // goes down a run's offsets), and where the event likely goes on once it is
                // done with the run.
                shards[shard].prefetch_highs_below(pos);
                shards[shard].prefetch_parent(pos.slot);
            }
            let bit = 1u64 << (loc & 63);
            // Not held in this tier, or already cleared by another name for the same block.
            if (run.held & !run.bits) & bit == 0 {
                tally.unknown(i);
                continue;
            }
            run.bits |= bit;
            tally.removed += 1;
            if run.elsewhere & bit == 0 {
                names.vacate(entry, b.0);
                if !aliased.is_empty() && aliased.remove(&loc) {
                    unnamed.push(loc);
                }
            }
        }
        run.clear(shards, (rank, tier), &mut tally);
        if !unnamed.is_empty() {
            // One pass over the map for all of them.
            unnamed.sort_unstable();
            names.retain(|_, l| unnamed.binary_search(&l).is_err(), &*shards);
        }
        names.settle(&*shards);
        self.stored_pairs -= tally.removed;
        self.commit_touched(tally.touched);
        self.enforce_budget();
        if tally.unknown > 0 {
            self.errors.unknown_blocks += tally.unknown as u64;
            return Err(IndexError::UnknownBlocks {
                rank: header.source,
                count: tally.unknown,
                first: blocks[tally.first_unknown as usize],
            });
        }
        Ok(())
    }

    /// Applies a Cleared event: the rank holds nothing any more, in any tier. Its stream fits
    /// the index again.
    pub fn apply_cleared(&mut self, header: EventHeader) -> Result<(), IndexError> {
        let rank = self.event_rank(header)?;
        self.clear_rank(rank);
        self.enforce_budget();
        if let Some(Some(state)) = self.ranks.get_mut(rank as usize) {
            state.needs_resync = false;
        }
        Ok(())
    }

    pub(super) fn clear_rank(&mut self, rank: u32) {
        let mut dropped = std::mem::take(&mut self.dropped);
        dropped.clear();
        for s in &mut self.shards {
            s.clear_rank(rank, &mut dropped);
        }
        self.stored_pairs -= dropped.len() as u64;
        let mut copies_gone = 0u64;
        self.copies.retain(|&(r, _, _), n| {
            if r == rank {
                copies_gone += *n as u64;
            }
            r != rank
        });
        self.duplicate_copies -= copies_gone;
        if let Some(Some(state)) = self.ranks.get_mut(rank as usize) {
            state.names.clear();
            state.aliased.clear();
        }
        self.dropped = dropped;
        self.commit_touched(u64::MAX);
    }
}
