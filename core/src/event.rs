//! The KV event model: what a worker tells the router about the blocks in its KV cache.
//!
//! Every event comes from one data-parallel rank of one worker (a [`WorkerRank`]) and carries an
//! event id that grows by one per event on that rank, so that the index can see gaps and
//! reorders. Blocks are named twice: by the engine's own opaque [`BlockHash`] (how the engine
//! refers to the block in later events) and by the [`LocalHash`] of the block's tokens (how the
//! router finds the block from a prompt).

use std::fmt;

use crate::hash::LocalHash;

/// Identity of a worker (an engine instance).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct WorkerId(pub u64);

/// A data-parallel rank inside a worker. Each rank has its own KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DpRank(pub u32);

/// One KV cache: a worker and one of its data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct WorkerRank {
    /// The worker.
    pub worker: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
}

impl WorkerRank {
    /// Rank `dp_rank` of worker `worker`.
    pub const fn new(worker: u64, dp_rank: u32) -> Self {
        WorkerRank {
            worker: WorkerId(worker),
            dp_rank: DpRank(dp_rank),
        }
    }
}

impl fmt::Display for WorkerRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker.0, self.dp_rank.0)
    }
}

/// Per-rank event sequence number; consecutive events of one rank differ by one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct EventId(pub u64);

/// The engine's own identifier of a block: opaque to the router, used only to name the block
/// again in later events (as a parent, or in a removal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct BlockHash(pub u64);

/// Where a cached block lives. Lower tiers are slower to load back and earn less overlap
/// credit when a worker is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(u8)]
pub enum StorageTier {
    /// GPU memory.
    #[default]
    Device = 0,
    /// Pinned host memory.
    HostPinned = 1,
    /// Local disk.
    Disk = 2,
    /// A store outside the worker (a remote or shared KV pool).
    External = 3,
}

impl StorageTier {
    /// Number of tiers.
    pub const COUNT: usize = 4;
    /// All tiers, fastest first.
    pub const ALL: [StorageTier; 4] = [
        StorageTier::Device,
        StorageTier::HostPinned,
        StorageTier::Disk,
        StorageTier::External,
    ];

    /// Position of the tier in [`StorageTier::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// One block of a Stored event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The engine's identifier of the block.
    pub block_hash: BlockHash,
    /// The hash of the block's own tokens (see [`BlockHasher`](crate::BlockHasher)).
    pub local_hash: LocalHash,
}

/// What every event carries besides its payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventHeader {
    /// The KV cache the event comes from.
    pub source: WorkerRank,
    /// The rank's event sequence number.
    pub event_id: EventId,
    /// The tier the event is about.
    pub tier: StorageTier,
}

/// The payload of a KV event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEventData {
    /// Blocks were stored, continuing the chain after `parent` (or starting a prompt when
    /// `parent` is `None`). Blocks are in prompt order: each is the parent of the next.
    Stored {
        /// The block the chain continues from, as the engine names it.
        parent: Option<BlockHash>,
        /// The blocks stored, in prompt order.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks were evicted.
    Removed {
        /// The blocks evicted, as the engine names them.
        blocks: Vec<BlockHash>,
    },
    /// The rank dropped its whole cache (of this tier).
    Cleared,
}

/// A KV event as the router's own bookkeeping sees it: what happened and to how many blocks
/// (`Router::note_event`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventSeen {
    /// Blocks were stored.
    Stored {
        /// How many.
        blocks: u64,
    },
    /// Blocks were evicted.
    Removed {
        /// How many.
        blocks: u64,
    },
    /// The rank dropped its whole cache.
    Cleared,
}

/// A KV event: a header and a payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    /// Where it comes from, its sequence number and its tier.
    pub header: EventHeader,
    /// What happened.
    pub data: KvEventData,
}
