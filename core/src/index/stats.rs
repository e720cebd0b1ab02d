//! What the index reports: why an event or call was rejected ([`IndexError`]), its counters,
//! each rank's event stream ([`RankStatus`]) and [`IndexStats`].

use crate::event::{BlockHash, EventId, WorkerId, WorkerRank};

/// Why an event or call was rejected. Every rejection is also counted in [`ErrorCounts`].
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum IndexError {
    /// A Stored event continues a parent block the rank does not hold (the index missed the
    /// parent's store: a rank met late, or cleared for a gap). When other ranks name a block
    /// so, all at one position (engines that hash blocks alike), the chain is placed there
    /// (`placed`): the rank holds the event's blocks but not their ancestors, so they score
    /// nothing for it until it stores those, and its removals and children apply. Otherwise
    /// nothing is stored. Either way the rank is flagged for resynchronisation.
    #[error("stored event of {rank} continues parent block {parent:?}, which the rank does not hold; {}", placed_text(.placed))]
    UnknownParent {
        /// The event's source.
        rank: WorkerRank,
        /// The parent it names.
        parent: BlockHash,
        /// Whether the blocks were placed under another rank's block of that name.
        placed: bool,
    },
    /// A Removed event names blocks the rank does not hold in that tier; the blocks it does
    /// hold were removed.
    #[error("removed event of {rank} names {count} block(s) the rank does not hold in that tier (first: {first:?}); the others were removed")]
    UnknownBlocks {
        /// The event's source.
        rank: WorkerRank,
        /// Blocks named but not held.
        count: usize,
        /// The first of them.
        first: BlockHash,
    },
    /// A Stored event names a block as its own parent, or the same block twice in a row:
    /// nothing is stored.
    #[error("stored event of {rank} names block {block:?} as its own parent or twice in a row")]
    InvalidChain {
        /// The event's source.
        rank: WorkerRank,
        /// The block named wrongly.
        block: BlockHash,
    },
    /// An event of a rank that is not registered, with
    /// [`IndexConfig::auto_register`](crate::IndexConfig::auto_register) off.
    #[error("event of unregistered rank {rank}")]
    UnknownRank {
        /// The event's source.
        rank: WorkerRank,
    },
    /// A call names a worker with no registered rank.
    #[error("unknown worker {worker:?}")]
    UnknownWorker {
        /// The worker named.
        worker: WorkerId,
    },
    /// Registering the rank would pass [`IndexConfig::max_ranks`](crate::IndexConfig::max_ranks).
    #[error("rank {rank} cannot be registered: the index already tracks {limit} ranks")]
    TooManyRanks {
        /// The rank refused.
        rank: WorkerRank,
        /// Most ranks the index tracks at once.
        limit: usize,
    },
    /// A Stored event does not fit: its shard is out of run slots. Nothing is stored, and the
    /// rank is flagged for resynchronisation.
    #[error("stored event of {rank} does not fit: its shard is out of run slots; the rank needs resynchronisation")]
    Full {
        /// The event's source.
        rank: WorkerRank,
    },
    /// A Stored event would take its rank past the capacity its worker declared
    /// ([`PrefixIndex::set_capacity`](super::PrefixIndex::set_capacity)). Nothing is stored,
    /// and the rank is flagged for resynchronisation.
    #[error("stored event of {rank} would hold more than its {capacity} blocks; the rank needs resynchronisation")]
    OverCapacity {
        /// The event's source.
        rank: WorkerRank,
        /// The rank's declared capacity.
        capacity: u64,
    },
}

fn placed_text(placed: &bool) -> &'static str {
    if *placed {
        "its blocks were placed under another rank's block of that name"
    } else {
        "nothing is stored; the rank needs resynchronisation"
    }
}

/// Rejections, per kind. `unknown_blocks` counts blocks, the others count events or calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErrorCounts {
    /// Stored events refused for an unknown parent ([`IndexError::UnknownParent`]).
    pub unknown_parent: u64,
    /// Blocks named by Removed events that the rank did not hold ([`IndexError::UnknownBlocks`]).
    pub unknown_blocks: u64,
    /// Stored events refused for a malformed chain ([`IndexError::InvalidChain`]).
    pub invalid_chain: u64,
    /// Events of unregistered ranks ([`IndexError::UnknownRank`]).
    pub unknown_rank: u64,
    /// Worker removals naming a worker with no registered rank ([`IndexError::UnknownWorker`]).
    pub unknown_worker: u64,
    /// Rank registrations refused at the rank limit ([`IndexError::TooManyRanks`]).
    pub too_many_ranks: u64,
    /// Stored events refused for want of run slots ([`IndexError::Full`]).
    pub full: u64,
    /// Stored events refused past their rank's capacity ([`IndexError::OverCapacity`]).
    pub over_capacity: u64,
}

/// Event-id bookkeeping, summed over ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventCounts {
    /// Events applied (rejected ones included).
    pub events: u64,
    /// Times an event id jumped ahead of the next expected one.
    pub gaps: u64,
    /// Event ids skipped over by those jumps.
    pub missing: u64,
    /// Events whose id was not above the last one seen (duplicates and late arrivals).
    pub reordered: u64,
    /// Stored events of a parent their rank did not hold, placed under another rank's block
    /// of that name ([`IndexError::UnknownParent`] with `placed`; counted there too).
    pub placed_under_peer: u64,
}

/// Where a rank's event stream stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankStatus {
    /// The rank.
    pub rank: WorkerRank,
    /// The highest event id applied.
    pub last_event: Option<EventId>,
    /// The stream no longer fits the index (a gap, an unknown parent): the rank's blocks should
    /// be re-read from the worker.
    pub needs_resync: bool,
    /// Gaps seen on this rank.
    pub gaps: u64,
}

/// Counters and sizes.
#[derive(Clone, Debug, Default)]
pub struct IndexStats {
    /// Shards of the index.
    pub shards: usize,
    /// Ranks registered.
    pub ranks: usize,
    /// Runs in use, over all shards (a run holds up to 64 blocks of a chain).
    pub runs: usize,
    /// Blocks in the structure (distinct positions).
    pub blocks: usize,
    /// (rank, block, tier) holds.
    pub stored_pairs: u64,
    /// Extra physical copies beyond the first of a (rank, block, tier).
    pub duplicate_copies: u64,
    /// Bytes the index accounts for itself.
    pub memory_bytes: usize,
    /// The configured memory budget, in bytes (`None`: unbounded).
    pub memory_budget: Option<usize>,
    /// Blocks evicted to stay within the budget.
    pub evicted_blocks: u64,
    /// The (rank, block, tier) holds those evictions took along.
    pub evicted_pairs: u64,
    /// Rejections, per kind.
    pub errors: ErrorCounts,
    /// Event-id bookkeeping, summed over ranks.
    pub events: EventCounts,
    /// Ranks flagged for resynchronisation ([`RankStatus::needs_resync`]).
    pub ranks_needing_resync: usize,
    /// Engine block names the ranks' maps resolve.
    pub names: usize,
}
