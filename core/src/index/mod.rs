//! The sharded prefix index: for a prompt's block hashes, which ranks hold how many leading
//! blocks, in which storage tier.
//!
//! ```text
//!   shard = f(first block hash)          one writer (PrefixIndex), readers anywhere (IndexReader)
//!   ┌ shard 0 ──────────────────────────────────────────────────────────────┐
//!   │ child table: (parent run, offset, next hash) -> run                    │
//!   │ runs (ArcSwap slots):  [h0 h1 h2 .. h63] holders: rank/tier -> bitmask │
//!   └────────────────────────────────────────────────────────────────────────┘
//!   per rank: engine block hash -> (shard, run, offset)    writer only: removals, parents
//! ```
//!
//! Chains live in runs of up to 64 blocks; a chain that diverges mid-run continues in a child
//! run linked from the divergence point, so a run is never split and a block never moves. A
//! match compares the query against each run's hashes in one loop and probes the child table
//! once per run. Every chain lives in the shard of its first block, so a match visits one shard.
//!
//! Engines name blocks by their own opaque hashes. Each rank keeps its own map from name to
//! position: the names of one rank's events are looked up in one small map that stays warm in
//! cache while that rank's events are applied. Only a Stored event whose parent its rank does
//! not hold (a rank known in part) looks in the other ranks' maps, to place the chain where
//! they all hold a block of that name.
//! Physical copies of one block in one (rank, tier) are counted, so the block leaves only with
//! its last copy.
//!
//! The measurements behind these choices: the figures in `benches/RESULTS.md`, what was tried,
//! kept and dropped in `docs/experiments.md` §2–6.
//!
//! Module map. The facade and its vocabulary:
//!
//! * `writer.rs`: [`PrefixIndex`], the single writer: state, construction, [`ApplyEvents`],
//!   packed positions, commits, statistics.
//! * `store.rs`, `remove.rs`: applying Stored events; Removed and Cleared events.
//! * `ranks.rs`: registering ranks, reserving room for their names, event-id bookkeeping,
//!   resynchronisation flags, removing a worker.
//! * `budget.rs`: the memory the index accounts for and eviction under a budget.
//! * `reader.rs`: [`IndexReader`], the lock-free handle, and what it shares with the writer.
//! * `config.rs`: [`IndexConfig`], [`MatchOptions`], [`MAX_SHARDS`], [`MAX_RESERVED_BLOCKS`].
//! * `scores.rs`: what a match returns: [`OverlapScores`], [`RankScore`].
//! * `depths.rs`: the same overlaps by rank id ([`RankDepths`], [`Depth`], [`RankKey`]).
//! * `stats.rs`: [`IndexError`], [`ErrorCounts`], [`EventCounts`], [`RankStatus`],
//!   [`IndexStats`].
//!
//! The engine underneath:
//!
//! * `read.rs`: the walk along a query through one shard's runs.
//! * `shard/`: one shard's runs and its writer's transactions (`commit.rs`), eviction
//!   (`evict.rs`).
//! * `run.rs`: a run's layout and its holder words, and the helpers that read them.
//! * `slots.rs`: the run slots readers load lock-free; `uses.rs`: when each run was last
//!   matched (under a budget).
//! * `table.rs`: the child table linking runs.
//! * `names.rs`: each rank's map from engine block names to positions.
//! * `mix.rs`: hashing and prefetch helpers; `primitive.rs`: std's atomics, or loom's.
//! * `reference.rs`: a literal reference index the fast one is checked against.
//! * `tests.rs`: the index's rules, one test each; a module's own unit tests sit in the
//!   folder named for it (`slots/tests.rs`, `table/loom_tests.rs`, `shard/tests.rs`, ...).

mod budget;
mod config;
mod depths;
mod mix;
mod names;
mod primitive;
mod ranks;
mod read;
mod reader;
pub(crate) mod reference;
mod remove;
mod run;
mod scores;
mod shard;
mod slots;
mod stats;
mod store;
mod table;
mod uses;
mod writer;

pub use self::config::{IndexConfig, MatchOptions};
pub use self::depths::{Depth, RankDepths, RankKey};
pub use self::reader::IndexReader;
pub use self::scores::{OverlapScores, RankScore};
pub use self::stats::{ErrorCounts, EventCounts, IndexError, IndexStats, RankStatus};
pub use self::writer::{ApplyEvents, PrefixIndex};

#[cfg(test)]
mod tests;
