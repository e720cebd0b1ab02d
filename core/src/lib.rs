//! kvroute's routing core: block hashing, the KV event model, the sharded prefix index, and
//! routing decisions (worker registry, load tracking, selection, the [`router::Router`] facade),
//! with what a real fleet needs around them: an admission queue ([`queue`]), worker health
//! marks ([`health`]), sticky sessions ([`session`]) and the router's own cache records for
//! workers without KV events ([`approx`]).
//!
//! The core does no I/O and starts no threads. It is data structures and decisions, driven by
//! whoever embeds it: a transport's shard loops, a test, a benchmark.
//!
//! ```text
//!  tokens ──hash──▶ LocalHash[] ──find_matches──▶ OverlapScores (per worker rank, per tier)
//!                                      ▲
//!  KV events (Stored / Removed / Cleared) ──apply──┘  one writer, lock-free readers
//! ```
//!
//! ```
//! use kvroute_core::hash::BlockHasher;
//! use kvroute_core::{
//!     BlockHash, EventHeader, EventId, IndexConfig, MatchOptions, PrefixIndex, StorageTier,
//!     StoredBlock, WorkerRank,
//! };
//!
//! let mut index = PrefixIndex::new(IndexConfig::default());
//! let reader = index.reader(); // clone into every routing thread; matches are lock-free
//!
//! let prompt: Vec<u32> = (0..256).collect();
//! let locals = BlockHasher::new(64).local_hashes(&prompt);
//!
//! // A worker reports the blocks it cached (engine block hashes are opaque names).
//! let blocks: Vec<StoredBlock> = locals
//!     .iter()
//!     .enumerate()
//!     .map(|(i, h)| StoredBlock { block_hash: BlockHash(1000 + i as u64), local_hash: *h })
//!     .collect();
//! let header = EventHeader {
//!     source: WorkerRank::new(7, 0),
//!     event_id: EventId(0),
//!     tier: StorageTier::Device,
//! };
//! index.apply_stored(header, None, &blocks).unwrap();
//!
//! let scores = reader.find_matches(&locals, MatchOptions::default());
//! assert_eq!(scores.blocks(WorkerRank::new(7, 0)), 4);
//! ```
#![deny(unsafe_code)]

pub mod approx;
mod clock;
pub mod config;
pub mod event;
pub mod hash;
pub mod health;
pub mod index;
pub mod load;
pub mod queue;
pub mod registry;
pub mod rng;
pub mod router;
pub mod select;
pub mod session;
mod sync;

pub use approx::ApproxCounts;
pub use clock::{Clock, ManualClock};
pub use config::{
    Approximate, BusyThresholds, ConfigError, Disaggregation, Metrics, Policy, PromptDecay,
    QueueOrder, Queueing, RouterConfig, Speculative, TierWeights, Timing, WarmUp,
};
pub use event::{
    BlockHash, DpRank, EventHeader, EventId, EventSeen, KvEvent, KvEventData, StorageTier,
    StoredBlock, WorkerId, WorkerRank,
};
pub use hash::{BlockHasher, HashSeed, LocalHash, SeqHash};
pub use health::Health;
pub use index::{
    ApplyEvents, Depth, IndexConfig, IndexError, IndexReader, IndexStats, MatchOptions,
    OverlapScores, PrefixIndex, RankDepths, RankKey, RankScore,
};
pub use load::{DispatchState, Freed, LedgerCounts, LoadError, LoadView, RequestId};
pub use queue::PriorityClass;
pub use registry::{KvEvents, Readiness, RegistryError, WorkerConfig, WorkerRole};
pub use router::{
    Admission, Bookkeeping, Cancelled, DecidedBy, Decision, EventWriter, EvidenceLevel, Fallback,
    Label, Mode, Phase, Pinned, PoolHits, PreferredLabel, Quantiles, QueueStats, Released,
    RequestGuard, RequestMetrics, RouteError, RouteHints, RouteRequest, Router, RouterCounts,
    RouterError, SessionCallback, Ticket, TicketState, Timings,
};
pub use select::{Busy, Candidate, CostTerms, Overlap, Overrides, PolicyKind};
pub use session::{SessionClose, SessionEnd, SessionEndReason, SessionId, SessionRouting};

/// Hooks for the project's own tests and benchmarks: not part of the API.
#[doc(hidden)]
pub mod testing {
    pub use crate::load::{decayed, generated_at_block, output_decay, remaining_fraction};
    pub use crate::rng::Rng;
    pub use crate::select::SHARED_PROBES;
}
