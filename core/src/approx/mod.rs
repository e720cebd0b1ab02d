//! Cache records the router writes itself: for workers that publish no KV events (approximate
//! mode), and, optionally and briefly, for workers that do (speculative records).
//!
//! ```text
//!   route ──booked on rank r──▶ record(checkpoint keys of the prompt, r, now + TTL)
//!   route ──match──▶ index overlap per rank ──max──▶ overlap the selector sees
//!                         record depth per rank ─┘        (records count as device blocks)
//!   Removed / Cleared event from r ──▶ r's records from before it stop counting
//! ```
//!
//! A worker without events never tells the router what it caches, so the router assumes that
//! a prompt it sent there stays cached for a while (the TTL, 120 s by default) — what the
//! reference router does in its approximate mode. A worker with events tells it, but only after
//! its prefill: a burst of requests sharing a new prefix would each see no overlap anywhere
//! and scatter (or herd) before the first event lands. A speculative record, with a TTL of a
//! second or two, bridges that gap; once the worker's own events arrive the index's overlap is
//! at least the record's, so the record adds nothing and then expires. An eviction or clear
//! from the worker retires its records at once (a per-rank generation), so speculation never
//! claims blocks the worker said it dropped.
//!
//! **Structure.** To keep a long prompt's record cheap, only *checkpoint* blocks are written:
//! the first [`DENSE_BLOCKS`], then every [`STRIDE`]-th, and the last; a depth is therefore
//! exact up to [`DENSE_BLOCKS`] and otherwise found to within [`STRIDE`] − 1 blocks below the
//! truth (never above). One table maps a checkpoint's key to a *node*: the ranks holding a
//! record of that prefix (each with its expiry and generation, sorted by rank slot), the XOR
//! of their fingerprints, and the latest expiry among them. A checkpoint's key
//! ([`checkpoint_keys_extend`]) chains the previous checkpoint's with the blocks in between:
//! equal keys mean equal prefixes, and a long prompt's keys cost a chained step per
//! checkpoint, its blocks digested four at a time.
//!
//! A route records the whole chain with one expiry, and a key already held keeps the later of
//! its two expiries. So along any chain the nodes *nest*: a rank held at a deeper checkpoint is
//! held at every shallower one, with an expiry at least as late and a generation at least as
//! new. Two consequences make a search cheap whatever the number of ranks:
//! - a node holding anything live has a parent holding something live, so the query's deepest
//!   live node is found by a galloping search over its checkpoints, computing its keys only
//!   as far as it looks;
//! - the nodes of a query's chain that hold exactly what the deepest holds form a run ending
//!   there, found by bisection on the fingerprint; only where the holders change (ranks whose
//!   records stop shallower) is another node read.
//!
//! Ranks recorded with one system prompt therefore cost one read of one node, not one search
//! each. The fingerprint is a 64-bit XOR of mixed (slot, generation, expiry) triples; two
//! different holder sets agree on it with probability 2⁻⁶⁴, and then a shallower holder's
//! records would go unreported (never a deeper claim than recorded).
//!
//! A rank is named by a dense *slot* of the table's own, which carries its index key (the key
//! a match's [`RankDepths`](crate::index::RankDepths) is read by) and its generation. The
//! table is capped; records past the cap are dropped and counted.
//!
//! Module map:
//!
//! * `cache.rs`: [`ApproxCache`], writing records, the lookup's search, retiring and sweeping
//!   records, and its counters ([`ApproxCounts`]); the [`Overlaps`] a lookup reports to.
//! * `nodes.rs`: the table behind the cache's lock: nodes, holders, rank slots.
//! * `checkpoints.rs`: which blocks are checkpoints ([`DENSE_BLOCKS`], [`STRIDE`]) and their
//!   keys ([`checkpoint_keys_extend`]).
//! * `tests.rs`: unit tests.

mod cache;
mod checkpoints;
mod nodes;

pub use cache::ApproxCache;
pub use cache::ApproxCounts;
pub(crate) use cache::Overlaps;
pub use checkpoints::checkpoint_keys_extend;

#[cfg(test)]
mod tests;
