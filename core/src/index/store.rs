//! Applying a Stored event: the parent is found, the chain placed in the shard's runs, and
//! each block's name entered in the rank's map.

use std::collections::HashSet;

use super::mix::{self, MixState};
use super::names::{HighHalves, NameMap};
use super::reader::shard_of;
use super::shard::{Placed, Pos};
use super::stats::IndexError;
use super::writer::{pack, unpack, PrefixIndex};
use crate::event::{BlockHash, EventHeader, StoredBlock};

/// How many names ahead a Stored event's loop prefetches (into the second-level cache, which
/// can wait on more lines at once: an insert writes its entry and reads nothing from it).
const INSERT_AHEAD: usize = 32;

/// One stretch of a Stored event's blocks, placed in one run.
#[derive(Clone, Copy)]
struct Stretch<'a> {
    blocks: &'a [StoredBlock],
    /// Index in `blocks` of the stretch's first block.
    at: usize,
    placed: &'a Placed,
    /// The packed position of the run's offset 0.
    base: u32,
    /// Whether the map takes every name of the event without a rebuild.
    room: bool,
}

/// Names the blocks of `stretch` in a rank's map, prefetching names ahead. With `ALIASES`,
/// a block the rank held before the event (`before`, bit = offset) that gets a name new to
/// the map has another name already: its position goes into `aliased`.
#[inline(always)]
fn insert_names<const ALIASES: bool>(
    names: &mut NameMap,
    aliased: &mut HashSet<u32, MixState>,
    stretch: Stretch<'_>,
    before: u64,
    highs: &impl HighHalves,
) {
    let Stretch {
        blocks,
        at,
        placed: st,
        base,
        room,
    } = stretch;
    for (k, b) in blocks[at..at + st.n as usize].iter().enumerate() {
        if let Some(ahead) = blocks.get(at + k + INSERT_AHEAD) {
            names.prefetch(ahead.block_hash.0, true);
        }
        let off = st.first as u32 + k as u32;
        let kept = st.side >> off & 1 == 0;
        let was = names.insert_compared(b.block_hash.0, base | off, kept, room, highs);
        if ALIASES && before >> off & 1 != 0 && was.is_none() {
            aliased.insert(base | off);
        }
    }
}

impl PrefixIndex {
    /// Applies a Stored event given by parts (the form a received frame is read in).
    pub fn apply_stored(
        &mut self,
        header: EventHeader,
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        let rank = self.event_rank(header)?;
        let Some(first) = blocks.first() else {
            self.enforce_budget();
            return Ok(());
        };
        if let Some(Some(state)) = self.ranks.get(rank as usize) {
            if let Some(capacity) = state.capacity {
                if state.names.len() as u64 + blocks.len() as u64 > capacity {
                    self.errors.over_capacity += 1;
                    self.flag_resync(rank);
                    return Err(IndexError::OverCapacity {
                        rank: header.source,
                        capacity,
                    });
                }
            }
        }
        // The event's blocks come from memory nobody touched lately: fetch their lines
        // at once, before the checks below read them one by one (four blocks to a line).
        for b in blocks.iter().step_by(4) {
            mix::prefetch_read(b);
        }
        // The parent is looked up first, so that its misses (its name, then its run) overlap
        // with the fetches of the event's lines; what it found is acted on after the checks.
        // The hold is checked, not assumed from the name: a rank that named one block twice
        // keeps the other name when one is removed.
        let found = match parent {
            None => Ok((shard_of(first.local_hash, self.shards.len()), None)),
            Some(p) => match self.lookup(rank, p.0) {
                Some(loc) if self.holds(loc, rank, None) => {
                    let (s, pos) = unpack(loc);
                    Ok((s, Some(pos)))
                }
                _ => Err(p),
            },
        };
        // The first block that names itself as the chain's parent, or repeats its predecessor.
        let invalid = blocks.iter().enumerate().find(|(i, b)| {
            Some(b.block_hash) == parent || (*i > 0 && blocks[i - 1].block_hash == b.block_hash)
        });
        if let Some((_, bad)) = invalid {
            self.errors.invalid_chain += 1;
            return Err(IndexError::InvalidChain {
                rank: header.source,
                block: bad.block_hash,
            });
        }
        let (shard, start, unrooted) = match found {
            Ok((shard, start)) => (shard, start, None),
            Err(p) => match self.peer_position(rank, p.0) {
                Some(loc) => {
                    let (shard, pos) = unpack(loc);
                    (shard, Some(pos), Some(p))
                }
                None => {
                    self.errors.unknown_parent += 1;
                    self.flag_resync(rank);
                    return Err(IndexError::UnknownParent {
                        rank: header.source,
                        parent: p,
                        placed: false,
                    });
                }
            },
        };
        // A store creates at most one run per block: refuse it whole if that could not fit.
        if !self.shards[shard].has_room_for(blocks.len()) {
            self.errors.full += 1;
            self.flag_resync(rank);
            return Err(IndexError::Full {
                rank: header.source,
            });
        }
        self.tick += 1;
        if self.config.memory_budget.is_some() {
            self.publish_clock();
        }
        let tier = header.tier as u8;
        let mut placed = std::mem::take(&mut self.placed);
        placed.clear();
        self.shards[shard].store(start, blocks, (rank, tier), self.tick, &mut placed);
        let Some(Some(state)) = self.ranks.get_mut(rank as usize) else {
            unreachable!("event_rank returned a live rank id");
        };
        // Whether the rank may hold a block in another tier: only then are its stretches'
        // holds there read, to tell a block stored again under another name.
        let other_tiers = state.tiers & !(1 << tier) != 0;
        state.tiers |= 1 << tier;
        let names = &mut state.names;
        for b in blocks.iter().take(INSERT_AHEAD) {
            names.prefetch(b.block_hash.0, true);
        }
        // Each stretch's blocks are consecutive offsets of one run and of the event.
        let mut at = 0;
        // Whether the map takes all of the event's names without a rebuild: then each insert
        // skips the check.
        let room = names.has_room_for(blocks.len());
        for st in &placed {
            let base = pack(
                shard,
                Pos {
                    slot: st.slot,
                    off: 0,
                },
            );
            let n = st.n as usize;
            // Blocks of the stretch the rank held before this event, in any tier.
            let mut before = st.held;
            if other_tiers {
                before |= self.shards[shard].rank_masks(st.slot, rank, tier).1;
            }
            let stretch = Stretch {
                blocks,
                at,
                placed: st,
                base,
                room,
            };
            // Blocks new to the rank (the common case) need no check for a second name.
            if before == 0 {
                insert_names::<false>(names, &mut state.aliased, stretch, 0, &self.shards);
            } else {
                insert_names::<true>(names, &mut state.aliased, stretch, before, &self.shards);
            }
            at += n;
            self.stored_pairs += (n - st.held.count_ones() as usize) as u64;
            let mut held = st.held;
            while held != 0 {
                let loc = base | held.trailing_zeros();
                *self.copies.entry((rank, tier, loc)).or_insert(0) += 1;
                self.duplicate_copies += 1;
                held &= held - 1;
            }
        }
        self.placed = placed;
        self.shards[shard].commit();
        self.enforce_budget();
        match unrooted {
            None => Ok(()),
            Some(parent) => {
                self.errors.unknown_parent += 1;
                self.events.placed_under_peer += 1;
                self.flag_resync(rank);
                Err(IndexError::UnknownParent {
                    rank: header.source,
                    parent,
                    placed: true,
                })
            }
        }
    }

    /// Where the other ranks hold a block named `name`: its packed position when every rank
    /// that holds a block so named holds it there (`None` when none does, or they disagree:
    /// engines that hash blocks differently may reuse a name for another block).
    fn peer_position(&self, rank: u32, name: u64) -> Option<u32> {
        let mut found = None;
        for (id, state) in self.ranks.iter().enumerate() {
            let id = id as u32;
            let Some(state) = state.as_ref().filter(|_| id != rank) else {
                continue;
            };
            let Some(loc) = state.names.get(name, &self.shards) else {
                continue;
            };
            if !self.holds(loc, id, None) {
                continue;
            }
            match found {
                None => found = Some(loc),
                Some(at) if at == loc => {}
                Some(_) => return None,
            }
        }
        found
    }
}
