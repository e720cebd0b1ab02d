//! kvroute's routing core: block hashing, the KV event model and the sharded prefix index.
//!
//! The core does no I/O and starts no threads. It is data structures and decisions, driven by
//! whoever embeds it: a transport's shard loops, a test, a benchmark.
//!
//! ```text
//!  tokens ──hash──▶ LocalHash[] ──find_matches──▶ OverlapScores (per worker rank, per tier)
//!                                      ▲
//!  KV events (Stored / Removed / Cleared) ──apply──┘  one writer, lock-free readers
//! ```
#![deny(unsafe_code)]

pub mod event;
pub mod hash;
pub mod index;

pub use event::{
    BlockHash, DpRank, EventHeader, EventId, KvEvent, KvEventData, StorageTier, StoredBlock,
    WorkerId, WorkerRank,
};
pub use hash::{LocalHash, SeqHash};
pub use index::{
    IndexConfig, IndexError, IndexReader, IndexStats, MatchOptions, OverlapScores, PrefixIndex,
    RankScore,
};
