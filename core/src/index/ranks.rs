//! The writer's ranks: registering them (and the room reserved for their names), the rank
//! id an event belongs to and its event-id bookkeeping, resynchronisation flags, and
//! removing a worker's ranks.

use std::collections::HashSet;
use std::sync::Arc;

use super::config::MAX_RESERVED_BLOCKS;
use super::depths::RankKey;
use super::names::{self, NameMap};
use super::primitive;
use super::stats::{IndexError, RankStatus};
use super::writer::{PrefixIndex, RankRecord};
use crate::event::{EventHeader, EventId, WorkerId, WorkerRank};

/// Bytes a reserved name takes in its map (64-byte groups of seven at
/// [`names::RESERVED_LOAD_PCT`]), rounded up.
const RESERVED_NAME_BYTES: u64 =
    (names::GROUP_BYTES * 100).div_ceil(names::GROUP * names::RESERVED_LOAD_PCT) as u64;

impl PrefixIndex {
    /// Registers a rank (a no-op when it is known).
    pub fn register_rank(&mut self, rank: WorkerRank) -> Result<(), IndexError> {
        self.rank_id_or_register(rank)?;
        self.enforce_budget();
        Ok(())
    }

    /// Registers a rank (if it is new) and makes room in its name map for `blocks` blocks: the
    /// KV capacity its worker reports (every tier it publishes events for), so that the map is
    /// not rebuilt again and again while the rank fills (each rebuild moves every name, a
    /// stall of the writer that grows with the rank), and is not shrunk below it when blocks
    /// leave. A rank holding more grows its map as usual. The room counts in
    /// [`PrefixIndex::memory_bytes`] from now on; it is capped at `MAX_RESERVED_BLOCKS` and,
    /// under a memory budget, so that all ranks' reserved room together stays within a
    /// quarter of the budget. A later call with fewer blocks lowers the floor without
    /// shrinking the map at once.
    pub fn reserve_blocks(&mut self, rank: WorkerRank, blocks: u64) -> Result<(), IndexError> {
        let id = self.rank_id_or_register(rank)?;
        let mut cap = MAX_RESERVED_BLOCKS;
        if let Some(budget) = self.config.memory_budget {
            let others: usize = (self.ranks.iter().enumerate())
                .filter(|&(i, _)| i != id as usize)
                .filter_map(|(_, r)| r.as_ref())
                .map(|r| r.names.reserved_bytes())
                .sum();
            let room = (budget / 4).saturating_sub(others) as u64;
            cap = cap.min(room / RESERVED_NAME_BYTES);
        }
        if let Some(Some(state)) = self.ranks.get_mut(id as usize) {
            state.names.reserve(blocks.min(cap) as usize, &self.shards);
        }
        self.enforce_budget();
        Ok(())
    }

    /// Bounds what a registered rank may hold: a Stored event that would take it past
    /// `blocks` (the engine's declared KV capacity, every tier it publishes) is refused
    /// whole ([`IndexError::OverCapacity`], counted) and the rank flagged for
    /// resynchronisation. An engine never holds more than its cache; a stream that claims
    /// more has lost removals, or its size was misdeclared.
    pub fn set_capacity(&mut self, rank: WorkerRank, blocks: u64) -> Result<(), IndexError> {
        let id = self.rank_id_or_register(rank)?;
        if let Some(Some(state)) = self.ranks.get_mut(id as usize) {
            state.capacity = Some(blocks);
        }
        Ok(())
    }

    /// The key of a registered rank (see [`RankDepths`]): its id is stable until the rank is
    /// removed, then free for the next rank to register.
    ///
    /// [`RankDepths`]: super::RankDepths
    pub fn rank_key(&self, rank: WorkerRank) -> Option<RankKey> {
        let id = *self.rank_ids.get(&rank)?;
        let epoch = self.ranks[id as usize].as_ref()?.epoch;
        Some(RankKey { id, epoch })
    }

    /// Whether `more` ranks can still be registered under [`IndexConfig::max_ranks`]
    /// (counted as an error when they cannot). A caller that registers several ranks asks
    /// first, so that it changes nothing when they do not all fit.
    ///
    /// [`IndexConfig::max_ranks`]: crate::IndexConfig::max_ranks
    pub fn check_rank_room(&mut self, rank: WorkerRank, more: u32) -> Result<(), IndexError> {
        let limit = self.config.max_ranks;
        if self.rank_ids.len().saturating_add(more as usize) > limit {
            self.errors.too_many_ranks += 1;
            return Err(IndexError::TooManyRanks { rank, limit });
        }
        Ok(())
    }

    pub(super) fn rank_id_or_register(&mut self, rank: WorkerRank) -> Result<u32, IndexError> {
        if let Some(&id) = self.rank_ids.get(&rank) {
            return Ok(id);
        }
        if self.rank_ids.len() >= self.config.max_ranks {
            self.errors.too_many_ranks += 1;
            return Err(IndexError::TooManyRanks {
                rank,
                limit: self.config.max_ranks,
            });
        }
        let id = self.free_rank_ids.pop().unwrap_or(self.ranks.len() as u32);
        if id as usize == self.ranks.len() {
            self.ranks.push(None);
        }
        self.ranks[id as usize] = Some(RankRecord {
            rank,
            epoch: self.reader.shared.frees.load(primitive::Ordering::Relaxed),
            names: NameMap::default(),
            aliased: HashSet::default(),
            tiers: 0,
            last_event: None,
            needs_resync: false,
            capacity: None,
            gaps: 0,
        });
        self.rank_ids.insert(rank, id);
        self.publish_ranks();
        Ok(id)
    }

    pub(super) fn publish_ranks(&self) {
        let list = self
            .ranks
            .iter()
            .map(|r| r.as_ref().map(|s| s.rank))
            .collect();
        self.reader.shared.ranks.store(Arc::new(list));
    }

    /// The rank id for an event, registering the rank when allowed; counts the event id.
    pub(super) fn event_rank(&mut self, header: EventHeader) -> Result<u32, IndexError> {
        self.events.events += 1;
        let id = match self.rank_ids.get(&header.source) {
            Some(&id) => id,
            None if self.config.auto_register => self.rank_id_or_register(header.source)?,
            None => {
                self.errors.unknown_rank += 1;
                return Err(IndexError::UnknownRank {
                    rank: header.source,
                });
            }
        };
        if let Some(Some(state)) = self.ranks.get_mut(id as usize) {
            let id_now = header.event_id.0;
            match state.last_event {
                None => state.last_event = Some(id_now),
                Some(last) if id_now == last.wrapping_add(1) => state.last_event = Some(id_now),
                Some(last) if id_now > last => {
                    self.events.gaps += 1;
                    self.events.missing = self.events.missing.saturating_add(id_now - last - 1);
                    state.gaps += 1;
                    state.needs_resync = true;
                    state.last_event = Some(id_now);
                }
                Some(_) => self.events.reordered += 1,
            }
        }
        Ok(id)
    }

    pub(super) fn flag_resync(&mut self, rank: u32) {
        if let Some(Some(state)) = self.ranks.get_mut(rank as usize) {
            state.needs_resync = true;
        }
    }

    /// Status of every tracked rank.
    pub fn rank_status(&self) -> Vec<RankStatus> {
        self.ranks
            .iter()
            .flatten()
            .map(|s| RankStatus {
                rank: s.rank,
                last_event: s.last_event.map(EventId),
                needs_resync: s.needs_resync,
                gaps: s.gaps,
            })
            .collect()
    }

    /// Ranks whose event stream no longer fits the index.
    pub fn ranks_needing_resync(&self) -> Vec<WorkerRank> {
        self.ranks
            .iter()
            .flatten()
            .filter(|s| s.needs_resync)
            .map(|s| s.rank)
            .collect()
    }

    /// Clears a rank's resynchronisation flag (after its blocks were re-read).
    pub fn mark_resynced(&mut self, rank: WorkerRank) {
        if let Some(&id) = self.rank_ids.get(&rank) {
            if let Some(Some(state)) = self.ranks.get_mut(id as usize) {
                state.needs_resync = false;
            }
        }
    }

    /// Removes every rank of a worker and all they hold.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Result<(), IndexError> {
        let ranks: Vec<(WorkerRank, u32)> = self
            .rank_ids
            .iter()
            .filter(|(r, _)| r.worker == worker)
            .map(|(r, id)| (*r, *id))
            .collect();
        if ranks.is_empty() {
            self.errors.unknown_worker += 1;
            return Err(IndexError::UnknownWorker { worker });
        }
        let freed = ranks.len() as u32;
        for (rank, id) in ranks {
            self.clear_rank(id);
            self.rank_ids.remove(&rank);
            self.ranks[id as usize] = None;
            self.free_rank_ids.push(id);
        }
        self.publish_ranks();
        let frees = &self.reader.shared.frees;
        let n = frees.load(primitive::Ordering::Relaxed);
        frees.store(n.saturating_add(freed), primitive::Ordering::Release);
        Ok(())
    }
}
