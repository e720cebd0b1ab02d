//! [`PrefixIndex`], the single writer: its state, construction, the event entry points
//! ([`ApplyEvents`]), positions packed into 32 bits, commits and statistics. Storing,
//! removing, the ranks and the memory budget each have a file of their own.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::config::{IndexConfig, MAX_SHARDS};
use super::mix::MixState;
use super::names::{HighHalves, NameMap};
use super::primitive;
use super::reader::{IndexReader, Shared};
use super::shard::{self, DroppedHold, Placed, Pos, ShardWriter};
use super::stats::{ErrorCounts, EventCounts, IndexError, IndexStats};
use crate::event::{BlockHash, EventHeader, KvEvent, KvEventData, StoredBlock, WorkerRank};

#[derive(Debug)]
pub(super) struct RankRecord {
    pub(super) rank: WorkerRank,
    /// Ids freed before this rank was given its id ([`RankKey::epoch`](super::RankKey::epoch)).
    pub(super) epoch: u32,
    /// The rank's block names -> packed position.
    pub(super) names: NameMap,
    /// Positions of blocks the rank stored again under another name while it held them: when
    /// its hold of one ends, every name it has for the block goes, not only the one the event
    /// named (engines name a block one way; this is for those that do not).
    pub(super) aliased: HashSet<u32, MixState>,
    /// Tiers the rank has stored blocks in (bit = tier).
    pub(super) tiers: u8,
    pub(super) last_event: Option<u64>,
    pub(super) needs_resync: bool,
    pub(super) gaps: u64,
    /// Most blocks the rank may hold ([`PrefixIndex::set_capacity`]); none: no bound.
    pub(super) capacity: Option<u64>,
}

/// Something KV events are applied to: the index itself, or a router's writer that applies
/// them to its index and notes each one ([`crate::router::EventWriter`]). An ingest path
/// that decodes events from the wire writes through this, whichever it feeds.
pub trait ApplyEvents {
    /// [`PrefixIndex::apply_stored`].
    fn apply_stored(
        &mut self,
        header: EventHeader,
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError>;
    /// [`PrefixIndex::apply_removed`].
    fn apply_removed(
        &mut self,
        header: EventHeader,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError>;
    /// [`PrefixIndex::apply_cleared`].
    fn apply_cleared(&mut self, header: EventHeader) -> Result<(), IndexError>;

    /// Applies one event, whichever kind.
    fn apply_event(&mut self, event: &KvEvent) -> Result<(), IndexError> {
        match &event.data {
            KvEventData::Stored { parent, blocks } => {
                self.apply_stored(event.header, *parent, blocks)
            }
            KvEventData::Removed { blocks } => self.apply_removed(event.header, blocks),
            KvEventData::Cleared => self.apply_cleared(event.header),
        }
    }
}

impl ApplyEvents for PrefixIndex {
    fn apply_stored(
        &mut self,
        header: EventHeader,
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        PrefixIndex::apply_stored(self, header, parent, blocks)
    }
    fn apply_removed(
        &mut self,
        header: EventHeader,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError> {
        PrefixIndex::apply_removed(self, header, blocks)
    }
    fn apply_cleared(&mut self, header: EventHeader) -> Result<(), IndexError> {
        PrefixIndex::apply_cleared(self, header)
    }
}

/// The prefix index, as its single writer sees it. Reads go through [`PrefixIndex::reader`]
/// handles, from any thread, while this value applies events.
pub struct PrefixIndex {
    pub(super) config: IndexConfig,
    pub(super) reader: IndexReader,
    pub(super) shards: Vec<ShardWriter>,
    pub(super) ranks: Vec<Option<RankRecord>>,
    pub(super) rank_ids: HashMap<WorkerRank, u32, MixState>,
    pub(super) free_rank_ids: Vec<u32>,
    /// (rank, tier, position) -> copies beyond the first.
    pub(super) copies: HashMap<(u32, u8, u32), u32, MixState>,
    pub(super) tick: u64,
    pub(super) stored_pairs: u64,
    pub(super) duplicate_copies: u64,
    pub(super) evicted_blocks: u64,
    pub(super) evicted_pairs: u64,
    pub(super) errors: ErrorCounts,
    pub(super) events: EventCounts,
    pub(super) dropped: Vec<DroppedHold>,
    /// Scratch: where a Stored event's blocks landed.
    pub(super) placed: Vec<Placed>,
}

impl std::fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// A block's position in 32 bits: shard (4 bits), run slot (22 bits), offset (6 bits). Names
/// map to it, so its size is most of a name's cost.
#[inline]
pub(super) fn pack(shard: usize, pos: Pos) -> u32 {
    ((shard as u32) << 28) | (pos.slot << 6) | pos.off as u32
}

#[inline]
pub(super) fn unpack(loc: u32) -> (usize, Pos) {
    (
        (loc >> 28) as usize,
        Pos {
            slot: (loc >> 6) & (shard::MAX_SLOTS - 1),
            off: (loc & 63) as u8,
        },
    )
}

impl HighHalves for Vec<ShardWriter> {
    #[inline]
    fn high(&self, loc: u32) -> u32 {
        let (shard, pos) = unpack(loc);
        self[shard].high(pos)
    }
}

impl PrefixIndex {
    /// An empty index set up by `config`.
    pub fn new(config: IndexConfig) -> Self {
        let n = match config.shards {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
        .min(MAX_SHARDS);
        let track_lru = config.memory_budget.is_some();
        let shards: Vec<ShardWriter> = (0..n).map(|i| ShardWriter::new(i, track_lru)).collect();
        let shared = Arc::new(Shared {
            shards: shards.iter().map(|s| Arc::clone(&s.shared)).collect(),
            ranks: ArcSwap::from_pointee(Vec::new()),
            frees: primitive::AtomicU32::new(0),
        });
        PrefixIndex {
            config,
            reader: IndexReader { shared },
            shards,
            ranks: Vec::new(),
            rank_ids: HashMap::default(),
            free_rank_ids: Vec::new(),
            copies: HashMap::default(),
            tick: 0,
            stored_pairs: 0,
            duplicate_copies: 0,
            evicted_blocks: 0,
            evicted_pairs: 0,
            errors: ErrorCounts::default(),
            events: EventCounts::default(),
            dropped: Vec::new(),
            placed: Vec::new(),
        }
    }

    /// A reading handle; clone it into every thread that routes.
    pub fn reader(&self) -> IndexReader {
        self.reader.clone()
    }

    /// Applies one event.
    pub fn apply(&mut self, event: &KvEvent) -> Result<(), IndexError> {
        ApplyEvents::apply_event(self, event)
    }

    pub(super) fn lookup(&self, rank: u32, eh: u64) -> Option<u32> {
        self.ranks
            .get(rank as usize)?
            .as_ref()?
            .names
            .get(eh, &self.shards)
    }

    pub(super) fn holds(&self, loc: u32, rank: u32, tier: Option<u8>) -> bool {
        let (shard, pos) = unpack(loc);
        self.shards
            .get(shard)
            .is_some_and(|s| s.holds(pos, rank, tier))
    }

    /// Commits the shards in `mask` (bit = shard % 64).
    pub(super) fn commit_touched(&mut self, mask: u64) {
        for (i, s) in self.shards.iter_mut().enumerate() {
            if mask & (1 << (i % 64)) != 0 {
                s.commit();
            }
        }
    }

    /// Checks the shards' links (child table, array addresses, hints) against their runs;
    /// for tests and fuzzing. A description of the first inconsistency, if any.
    #[doc(hidden)]
    pub fn check_links(&self) -> Result<(), String> {
        self.shards.iter().try_for_each(|s| s.check_links())
    }

    /// Its counters and sizes, read now (walks every shard and rank).
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            shards: self.shards.len(),
            ranks: self.rank_ids.len(),
            runs: self.shards.iter().map(|s| s.runs()).sum(),
            blocks: self.shards.iter().map(|s| s.positions()).sum(),
            stored_pairs: self.stored_pairs,
            duplicate_copies: self.duplicate_copies,
            memory_bytes: self.memory_bytes(),
            memory_budget: self.config.memory_budget,
            evicted_blocks: self.evicted_blocks,
            evicted_pairs: self.evicted_pairs,
            errors: self.errors,
            events: self.events,
            ranks_needing_resync: self
                .ranks
                .iter()
                .flatten()
                .filter(|s| s.needs_resync)
                .count(),
            names: self.ranks.iter().flatten().map(|r| r.names.len()).sum(),
        }
    }
}
