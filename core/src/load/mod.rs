//! Load tracking: what every (worker, dp rank) is busy with, kept true across each request's life.
//!
//! ```text
//!   selection (any thread)           lifecycle (route, prefill done, output block, free, expire)
//!        │ Relaxed loads                     │
//!        ▼                                   ▼
//!   RankState ── CachePadded<RankLoad> ◀── Ledger: request id -> Booking   (16 mutex shards)
//!             └─ Mutex<PrefixRefs>     ◀──        active prompts per rank, in key order
//! ```
//!
//! * **Counters** ([`RankLoad`]): active prefill tokens, distinct active prompt blocks, output
//!   blocks, their decay and active requests, one cache line per rank. Selection reads them with relaxed
//!   loads and never locks; a read may mix two moments, which costs at most a slightly worse
//!   choice (the counters are advice, the ledger is the truth).
//! * **Shared prefixes count once.** Two concurrent requests with the same system prompt hold its
//!   KV blocks once on the worker. The ledger names each full prompt block by a *prefix key*, a
//!   cheap 64-bit chain over the block's local hashes (so equal keys mean equal prefixes), and
//!   keeps each rank's active prompts in lexicographic order of their keys ([`PrefixRefs`]):
//!   a booking adds its length less the longest prefix it shares with its two neighbours,
//!   a free removes as much, so the counter holds the distinct blocks without a refcount per
//!   block. The table lives behind the rank's own mutex, taken only when a request is booked,
//!   advanced past a block with decay, or freed on that rank. Selection reads them only through [`RankState::try_shared_prefix_blocks`],
//!   for a few candidates and with `try_lock` (a busy table is skipped, never waited for).
//! * **Output decay.** When a request's expected output length `E` is known, its output blocks
//!   weigh what is left of it, as in the reference: at its `k`-th output block, generated
//!   tokens `g_k` ([`generated_at_block`]), every one of its `k` output blocks weighs
//!   `r_k = max(0, 1 − g_k / max(E, 1))`, so it adds `k · r_k` blocks of decode load instead of
//!   `k`. The rank keeps the difference, `k − k · r_k`, in fixed point ([`DECAY_SCALE`]) beside
//!   the plain count ([`LoadView::output_decay`]): capacity checks read the blocks held, the
//!   cost reads the weighted load. A request without `E` never decays. With
//!   [`PromptDecay::Unshared`] (the default, as the reference router), the prompt blocks only
//!   this request holds on its rank (the end of its chain past its longest shared prefix,
//!   and its partial tail) weigh `r` too: at each output block their count `u` is taken
//!   and `u − u · r` kept in [`LoadView::prompt_decay`] until the next block or the free.
//!   Shared prompt blocks always weigh 1.
//! * **Request timeline.** A booking remembers when it was booked, whether it reached its
//!   worker ([`DispatchState`]) and, when the caller passes a clock reading, when its last token
//!   arrived; lifecycle calls hand back what metrics need ([`Step`], [`Freed`]) and the ledger
//!   itself reads no clock.
//! * **Exactly once.** A booking lives in exactly one ledger shard; whoever removes it from the
//!   shard (free, expiry, a worker leaving) is the only one who undoes its load. A second free
//!   finds nothing and gets [`LoadError::UnknownRequest`].
//! * **Leaving workers.** A rank whose worker leaves is marked retired before its bookings are
//!   purged; a booking made concurrently on the old snapshot sees the mark after inserting
//!   itself and undoes itself, so nothing is booked on a rank that is gone.
//!
//! Module map:
//!
//! * `ledger.rs`: [`Ledger`], the sharded request table, and every lifecycle step that moves
//!   a rank's counters (book, first token, output blocks, decay, free, expiry, purge), with
//!   the prefill floor.
//! * `records.rs`: what callers hand the ledger and get back: [`RequestId`], [`BookingSpec`],
//!   [`Step`], [`Generated`], [`Freed`], [`LedgerCounts`], [`LoadError`].
//! * `rank.rs`: [`RankState`], one rank's lock-free counters ([`RankLoad`], read as
//!   [`LoadView`]), its prefix table, health, KV-event mode, warm-up and index key.
//! * `prefix_refs.rs`: [`PrefixRefs`], a rank's active prompts in key order.
//! * `keys.rs`: prefix keys ([`prefix_keys_into`]) and the [`PassThroughHasher`].
//! * `decay.rs`: the decay arithmetic ([`output_decay`], [`DECAY_SCALE`]).
//! * `tests.rs`: unit tests; `loom_tests.rs`: loom models of the lifecycle races.
//!
//! [`PromptDecay::Unshared`]: crate::config::PromptDecay::Unshared

mod decay;
mod keys;
mod ledger;
mod prefix_refs;
mod rank;
mod records;

pub(crate) use decay::DECAY_SCALE;
pub use decay::{decayed, generated_at_block, output_decay, remaining_fraction};
pub(crate) use keys::prefix_keys_into;
pub(crate) use ledger::{Key, Ledger};
pub(crate) use rank::{context_total, ContextTotal};
pub use rank::{LoadView, RankState};
pub(crate) use records::{BookingSpec, Generated, Step};
pub use records::{DispatchState, Freed, LedgerCounts, LoadError, RequestId};

#[cfg(all(test, not(loom)))]
mod tests;

/// Loom models of the lifecycle races: the real ledger and counters, on loom's atomics and
/// mutexes (`crate::sync`). Run with
/// `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p kvroute-core --lib loom`.
#[cfg(all(test, loom))]
mod loom_tests;
