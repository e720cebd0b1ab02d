//! kvroute's routing core: for every request, which worker serves it, from a prefix index of
//! the KV blocks each worker holds (kept current by the workers' KV events) and each worker's
//! load. The [`Router`] is what an embedder drives; around its decisions it carries what a
//! real fleet needs: an admission queue ([`Router::submit`]), worker health marks
//! ([`Router::set_health`]), sticky sessions ([`RouteHints::session`]), label constraints, and
//! the router's own cache records for workers without KV events ([`KvEvents::Absent`]).
//!
//! The core does no I/O and starts no threads. It is data structures and decisions, driven by
//! whoever embeds it: a transport's shard loops, a service, a simulator, a test. Its time comes
//! from one [`Clock`].
//!
//! ```text
//!  RouteRequest ──hash──▶ LocalHash[] ──match──▶ overlap per rank ──select──▶ Decision ──book──▶ load
//!                                        ▲
//!  KvEvent (Stored / Removed / Cleared) ──apply──┘  one writer (the router's), lock-free readers
//! ```
//!
//! The modules, each a file or a folder of `core/src`: `hash` (block hashing, bit-identical to
//! Dynamo's), `event` (the KV event model), `index` (the sharded prefix index and its
//! reference model), `registry` (the fleet snapshot), `load` (per-rank load and the ledger of
//! bookings), `select` (the cost and the policies), `router` (the facade and the route's
//! steps), `queue`, `session`, `health`, `approx` (records for workers without events),
//! `config`, `clock`. They are private: this page lists everything an embedder uses.
//!
//! ```
//! use kvroute_core::{
//!     BlockHash, BlockHasher, EventHeader, EventId, IndexConfig, KvEvent, KvEventData, PrefixIndex,
//!     RequestGuard, RequestId, RouteHints, RouteRequest, Router, RouterConfig, StorageTier,
//!     StoredBlock, WorkerConfig, WorkerRank,
//! };
//!
//! let config = RouterConfig::default(); // 16 tokens a block, the KV-aware cost
//! let block_size = config.block_size;
//! let router = Router::new(config, PrefixIndex::new(IndexConfig::default())).unwrap();
//! for worker in 0..4 {
//!     router.join_worker(WorkerConfig::simple(worker, 10_000, block_size)).unwrap();
//! }
//!
//! // Worker 2 reports the blocks of a prompt it has cached (an engine's block hashes are opaque
//! // names; the router keys blocks by the hashes of their tokens).
//! let system_prompt: Vec<u32> = (0..512).collect();
//! let locals = BlockHasher::new(block_size as usize).local_hashes(&system_prompt);
//! let blocks = locals
//!     .iter()
//!     .enumerate()
//!     .map(|(i, h)| StoredBlock { block_hash: BlockHash(i as u64), local_hash: *h })
//!     .collect();
//! router
//!     .apply_event(&KvEvent {
//!         header: EventHeader {
//!             source: WorkerRank::new(2, 0),
//!             event_id: EventId(0),
//!             tier: StorageTier::Device,
//!         },
//!         data: KvEventData::Stored { parent: None, blocks },
//!     })
//!     .unwrap();
//!
//! // A request that starts with that prompt goes where its prefix is cached.
//! let tokens: Vec<u32> = system_prompt.iter().copied().chain(9000..9100).collect();
//! let request = RouteRequest { id: RequestId(1), tokens: &tokens, hints: RouteHints::default() };
//! let decision = router.route(&request).unwrap();
//! assert_eq!(decision.worker, WorkerRank::new(2, 0));
//! assert_eq!(decision.overlap.blocks, 32);
//!
//! // Its load stays booked on worker 2 until it ends; the guard frees it exactly once, however
//! // the request ends (completion, error, a dropped stream).
//! let mut guard = RequestGuard::new(&router, decision.request);
//! guard.mark_dispatched().unwrap(); // it reached the worker
//! guard.prefill_done().unwrap(); // its first token arrived
//! guard.finish().unwrap();
//! assert_eq!(router.active_requests(), 0);
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod approx;
mod clock;
mod config;
mod event;
mod hash;
mod health;
mod index;
mod load;
mod queue;
mod registry;
mod rng;
mod router;
mod select;
mod session;
mod sync;

pub use approx::ApproxCounts;
pub use clock::{Clock, ManualClock};
pub use config::{
    Affinity, Approximate, BusyThresholds, ConfigError, Disaggregation, HotLoad, Metrics, Policy,
    PromptDecay, QueueOrder, Queueing, RouterConfig, Speculative, TierWeights, Timing, WarmUp,
    REPLICA_NEAR_TIE,
};
pub use event::{
    BlockHash, DpRank, EventHeader, EventId, EventSeen, KvEvent, KvEventData, StorageTier,
    StoredBlock, WorkerId, WorkerRank,
};
pub use hash::{
    next_seq_hash, seq_hashes, seq_hashes_into, BlockHasher, HashSeed, LocalHash, SeqHash,
};
pub use health::Health;
pub use index::{
    ApplyEvents, Depth, ErrorCounts, EventCounts, IndexConfig, IndexError, IndexReader, IndexStats,
    MatchOptions, OverlapScores, PrefixIndex, RankDepths, RankKey, RankScore, RankStatus,
};
pub use load::{DispatchState, Freed, LedgerCounts, LoadError, LoadView, RankState, RequestId};
pub use queue::PriorityClass;
pub use registry::{
    Fleet, KvEvents, RankEntry, Readiness, RegistryError, WorkerConfig, WorkerEntry, WorkerRole,
};
pub use rng::{mix64, Rng};
pub use router::{
    Admission, BookingDelta, BookingSink, Bookkeeping, Cancelled, Conditional, DecidedBy, Decision,
    EventWriter, EvidenceLevel, Fallback, Label, Mode, OwnedDelta, Phase, Pinned, PoolHits,
    PreferredLabel, Quantiles, QueueStats, Released, RemoteBooking, RemoteError, ReplicaId,
    RequestGuard, RequestMetrics, RouteError, RouteHints, RouteRequest, Router, RouterCounts,
    RouterError, SessionCallback, Ticket, TicketState, Timings, Whole, MAX_DELTA_OUTPUT_BLOCKS,
};
pub use select::{
    Busy, Candidate, CostTerms, Overlap, Overrides, PolicyKind, RequestShape, Scored, SelectInput,
    Selector, UnknownPolicy,
};
pub use session::{SessionClose, SessionEnd, SessionEndReason, SessionId, SessionRouting};

/// Hooks for the project's own tests, benchmarks and fuzz targets: not part of the API.
#[doc(hidden)]
pub mod testing {
    use crate::hash::LocalHash;
    use crate::index::{IndexReader, MatchOptions, OverlapScores};

    pub use crate::approx::{checkpoint_keys_extend, ApproxCache};
    pub use crate::index::reference::ReferenceIndex;
    pub use crate::load::{decayed, generated_at_block, output_decay, remaining_fraction};
    pub use crate::select::SHARED_PROBES;

    /// The scores of `query` in a fresh result: for tests that compare answers (a router
    /// keeps its result from one match to the next, [`IndexReader::find_matches_into`]).
    pub fn scores_of(
        reader: &IndexReader,
        query: &[LocalHash],
        opts: MatchOptions,
    ) -> OverlapScores {
        let mut out = OverlapScores::default();
        reader.find_matches_into(query, opts, &mut out);
        out
    }
}

/// The README's code, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
