//! What the index reports: why an event or call was rejected ([`IndexError`]), its counters,
//! each rank's event stream ([`RankStatus`]) and [`IndexStats`].

use crate::event::{BlockHash, EventId, WorkerId, WorkerRank};

/// Why an event or call was rejected. Every rejection is also counted in [`ErrorCounts`].
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum IndexError {
    #[error("stored event of {rank} continues parent block {parent:?}, which the rank does not hold; the rank needs resynchronisation")]
    UnknownParent { rank: WorkerRank, parent: BlockHash },
    #[error("removed event of {rank} names {count} block(s) the rank does not hold in that tier (first: {first:?}); the others were removed")]
    UnknownBlocks {
        rank: WorkerRank,
        count: usize,
        first: BlockHash,
    },
    #[error("stored event of {rank} names block {block:?} as its own parent or twice in a row")]
    InvalidChain { rank: WorkerRank, block: BlockHash },
    #[error("event of unregistered rank {rank}")]
    UnknownRank { rank: WorkerRank },
    #[error("unknown worker {worker:?}")]
    UnknownWorker { worker: WorkerId },
    #[error("rank {rank} cannot be registered: the index already tracks {limit} ranks")]
    TooManyRanks { rank: WorkerRank, limit: usize },
    #[error("stored event of {rank} does not fit: its shard is out of run slots; the rank needs resynchronisation")]
    Full { rank: WorkerRank },
}

/// Rejections, per kind. `unknown_blocks` counts blocks, the others count events or calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErrorCounts {
    pub unknown_parent: u64,
    pub unknown_blocks: u64,
    pub invalid_chain: u64,
    pub unknown_rank: u64,
    pub unknown_worker: u64,
    pub too_many_ranks: u64,
    pub full: u64,
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
}

/// Where a rank's event stream stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankStatus {
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
    pub shards: usize,
    pub ranks: usize,
    pub runs: usize,
    /// Blocks in the structure (distinct positions).
    pub blocks: usize,
    /// (rank, block, tier) holds.
    pub stored_pairs: u64,
    /// Extra physical copies beyond the first of a (rank, block, tier).
    pub duplicate_copies: u64,
    /// Bytes the index accounts for itself.
    pub memory_bytes: usize,
    pub memory_budget: Option<usize>,
    /// Blocks evicted to stay within the budget, and the holds they took along.
    pub evicted_blocks: u64,
    pub evicted_pairs: u64,
    pub errors: ErrorCounts,
    pub events: EventCounts,
    pub ranks_needing_resync: usize,
    /// Engine block names the ranks' maps resolve.
    pub names: usize,
}
