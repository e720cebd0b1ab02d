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
//!   worker ([`Dispatch`]) and, when the caller passes a clock reading, when its last token
//!   arrived; lifecycle calls hand back what metrics need ([`Step`], [`Freed`]) and the ledger
//!   itself reads no clock.
//! * **Exactly once.** A booking lives in exactly one ledger shard; whoever removes it from the
//!   shard (free, expiry, a worker leaving) is the only one who undoes its load. A second free
//!   finds nothing and gets [`LoadError::UnknownRequest`].
//! * **Leaving workers.** A rank whose worker leaves is marked retired before its bookings are
//!   purged; a booking made concurrently on the old snapshot sees the mark after inserting
//!   itself and undoes itself, so nothing is booked on a rank that is gone.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::config::PromptDecay;
use crate::event::{WorkerId, WorkerRank};
use crate::hash::LocalHash;
use crate::health::Health;
use crate::index::RankKey;
use crate::registry::KvEvents;
use crate::rng::mix64;
use crate::session::SessionId;
use crate::sync::{fence, AtomicBool, AtomicU64, AtomicU8, Mutex, MutexGuard, Ordering};

/// A request's identity, chosen by the caller (unique among its active requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct RequestId(pub u64);

/// Why a lifecycle call was rejected.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LoadError {
    #[error("request {request:?} is already booked")]
    DuplicateRequest { request: RequestId },
    #[error("request {request:?} is not booked (never routed, already freed, expired, or its worker left)")]
    UnknownRequest { request: RequestId },
    #[error("rank {rank} left while request {request:?} was being booked on it")]
    RankRetired {
        request: RequestId,
        rank: WorkerRank,
    },
}

/// A hasher for keys that are already well-mixed 64-bit hashes: it passes them through.
#[derive(Default, Clone, Copy, Debug)]
pub struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) ^ u64::from(b) ^ (self.0 >> 56);
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

type PassThrough = BuildHasherDefault<PassThroughHasher>;

/// The key before the first block.
const PREFIX_KEY_SEED: u64 = 0x243f_6a88_85a3_08d3;

/// One step of the prefix key chain: `k[i] = (k[i-1] ^ Li) · M`, M odd. For a given previous
/// key the step is a bijection of the block's hash, and for a given block a bijection of the
/// previous key, so two different prefixes share a key only by a 2⁻⁶⁴ accident of their
/// (already well mixed) local hashes. Its low bits mix poorly: tables hash the keys again.
/// Two operations on the chain, which a long prompt walks block by block.
#[inline(always)]
fn prefix_step(k: u64, l: LocalHash) -> u64 {
    (k ^ l.0).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The prefix key of each block of `locals` (each chained to the last from a constant seed).
/// Replaces `out`'s contents; allocation-free when `out` has the capacity. Internal to the
/// router (never compared with engine hashes), so it need only be cheap and collision-free.
pub fn prefix_keys_into(locals: &[LocalHash], out: &mut Vec<u64>) {
    out.clear();
    prefix_keys_extend(locals, out, locals.len());
}

/// Continues `out` (the prefix keys of `locals[..out.len()]`) up to `locals[..upto]`; the
/// same keys [`prefix_keys_into`] gives.
pub fn prefix_keys_extend(locals: &[LocalHash], out: &mut Vec<u64>, upto: usize) {
    let upto = upto.min(locals.len());
    let from = out.len().min(upto);
    let mut k = out.last().copied().unwrap_or(PREFIX_KEY_SEED);
    out.extend(locals[from..upto].iter().map(|&l| {
        k = prefix_step(k, l);
        k
    }));
}

/// One output block in [`LoadView::output_decay`]'s fixed point.
pub const DECAY_SCALE: u64 = 1 << 16;

/// Tokens generated when a request's `k`-th output block begins (`k ≥ 1`): the sequence first
/// needs `ceil(isl / bs) + k` blocks at its `bs · (ceil(isl / bs) + k − 1) + 1`-th token, the
/// reference's "generation crossed a block boundary". 0 for `k = 0`.
pub fn generated_at_block(prompt_tokens: u64, block_size: u32, k: u64) -> u64 {
    if k == 0 {
        return 0;
    }
    let bs = u64::from(block_size.max(1));
    (bs * (prompt_tokens.div_ceil(bs) + k - 1) + 1).saturating_sub(prompt_tokens)
}

/// The reference's decay fraction: what is left of the expected output after `generated`
/// tokens, `max(0, 1 − generated / max(expected, 1))`.
pub fn remaining_fraction(generated: u64, expected_output_tokens: u32) -> f64 {
    (1.0 - generated as f64 / f64::from(expected_output_tokens.max(1))).max(0.0)
}

/// How much of `k` output blocks decay has taken off, in [`DECAY_SCALE`] units:
/// `k − k · remaining_fraction(g_k, E)`, rounded. Never decreases with `k`.
pub fn output_decay(
    prompt_tokens: u64,
    block_size: u32,
    expected_output_tokens: u32,
    k: u64,
) -> u64 {
    let g = generated_at_block(prompt_tokens, block_size, k);
    decayed(k, remaining_fraction(g, expected_output_tokens))
}

/// What weighing `blocks` by `left` (in [0, 1]) takes off them, in [`DECAY_SCALE`] units:
/// `blocks − blocks · left`, rounded.
pub fn decayed(blocks: u64, left: f64) -> u64 {
    let full = blocks * DECAY_SCALE;
    let weighted = (full as f64 * left).round() as u64;
    full - weighted.min(full)
}

/// Whether a request reached its worker (only those record metrics and count as completed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Dispatch {
    #[default]
    NotYet,
    Reached,
}

/// What selection reads of one rank, in one cache line: the load counters, read lock-free,
/// and the flags that say whose overlap the rank takes.
#[derive(Debug)]
pub struct RankLoad {
    prefill_tokens: AtomicU64,
    prompt_blocks: AtomicU64,
    output_blocks: AtomicU64,
    output_decay: AtomicU64,
    prompt_decay: AtomicU64,
    requests: AtomicU64,
    /// The rank's key in the prefix index ([`crate::index::PrefixIndex::rank_key`]) as
    /// `epoch << 32 | id`; `u64::MAX` until it is registered.
    index_key: AtomicU64,
    /// Set once the rank's worker has left.
    retired: AtomicBool,
}

/// One consistent-enough reading of a rank's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadView {
    /// Prompt tokens booked for prefill and not yet reported done.
    pub prefill_tokens: u64,
    /// Distinct prompt blocks of active requests (shared prefixes once) plus their partial tails.
    pub prompt_blocks: u64,
    /// Blocks generated by active requests.
    pub output_blocks: u64,
    /// Output blocks taken off the decode load by decay, in [`DECAY_SCALE`] units (0 when no
    /// active request declared an expected output length).
    pub output_decay: u64,
    /// Unshared prompt blocks taken off the decode load by decay ([`PromptDecay::Unshared`]),
    /// in [`DECAY_SCALE`] units.
    pub prompt_decay: u64,
    /// Active requests.
    pub requests: u64,
}

impl LoadView {
    /// KV blocks the rank holds for active requests (output blocks undecayed: what occupies
    /// the cache).
    pub fn decode_blocks(&self) -> u64 {
        self.prompt_blocks + self.output_blocks
    }

    /// Output blocks as decode load: each request's output blocks weighted by what is left of
    /// its expected output.
    pub fn weighted_output_blocks(&self) -> f64 {
        // Never NaN: the comparison below stands in for `f64::max`.
        let x = crate::select::count_f64(self.output_blocks)
            - crate::select::count_f64(self.output_decay) / DECAY_SCALE as f64;
        if x > 0.0 {
            x
        } else {
            0.0
        }
    }

    /// Prompt blocks as decode load: the unshared prompt blocks of requests with an expected
    /// output length weighted by what is left of it, the rest whole.
    pub fn weighted_prompt_blocks(&self) -> f64 {
        let x = crate::select::count_f64(self.prompt_blocks)
            - crate::select::count_f64(self.prompt_decay) / DECAY_SCALE as f64;
        if x > 0.0 {
            x
        } else {
            0.0
        }
    }

    /// Load in blocks, for the load-only policies: decode blocks plus prefill tokens in blocks.
    pub fn load_blocks(&self, block_size: u32) -> u64 {
        self.decode_blocks() + self.prefill_tokens / u64::from(block_size.max(1))
    }

    /// True when every counter is zero.
    pub fn is_idle(&self) -> bool {
        *self == LoadView::default()
    }
}

/// The prompts active on one rank, kept in lexicographic order of their blocks' local hashes,
/// so that the blocks they hold together (shared prefixes once) are counted without a
/// refcount per block.
///
/// In sorted order every group of prompts sharing a prefix is contiguous, so the union of
/// their prefixes, the size of their trie, is `Σ len − Σ lcp(neighbours)`, and a prompt's
/// longest prefix held by another is the longer of its common prefixes with its two
/// neighbours. Booking inserts one prompt and removes nothing: the blocks it adds are its
/// length less that longest shared prefix. Freeing is the mirror image. Both cost a binary
/// search over the rank's prompts, each comparison a scan to the first differing block
/// (eight hashes at a time), and a shift of the order: `O(log r · n + r)` for `r` active
/// prompts of `n` blocks, instead of `n` refcount updates. Comparing local hashes from the
/// first block on needs nothing derived from the prompt: chained prefix keys would have let
/// a comparison binary-search, but computing them is a serial chain of multiplies per block,
/// slower than the scan.
#[derive(Debug, Default)]
pub struct PrefixRefs {
    /// One prompt's block hashes per slot. A free slot holds an empty vector that keeps its
    /// capacity (up to [`KEPT_SLOT_CAPACITY`], in up to [`KEPT_FREE_SLOTS`] free slots), so
    /// that booking allocates nothing in steady state.
    slots: Vec<Vec<LocalHash>>,
    free: Vec<u32>,
    /// Occupied slots in lexicographic order of their hashes, equal prompts by slot.
    order: Vec<u32>,
    /// Distinct prefixes held (the trie's size).
    distinct: u64,
}

/// Hashes a free [`PrefixRefs`] slot keeps room for: a longer prompt's vector is dropped when
/// it is released.
const KEPT_SLOT_CAPACITY: usize = 1 << 13;
/// Free [`PrefixRefs`] slots that keep their vectors (the latest freed, which booking reuses
/// first): a rank holds at most this many idle vectors, of at most 64 KiB each, after a peak
/// of concurrent requests.
const KEPT_FREE_SLOTS: usize = 16;

/// How many leading blocks `a` and `b` share.
fn common_prefix(a: &[LocalHash], b: &[LocalHash]) -> usize {
    crate::hash::common_prefix(a, b)
}

/// Lexicographic order of two prompts' block hashes.
fn compare_keys(a: &[LocalHash], b: &[LocalHash]) -> std::cmp::Ordering {
    let m = common_prefix(a, b);
    match (a.get(m), b.get(m)) {
        (Some(x), Some(y)) => x.cmp(y),
        _ => a.len().cmp(&b.len()),
    }
}

impl PrefixRefs {
    /// Distinct keys held.
    pub fn len(&self) -> usize {
        self.distinct as usize
    }

    /// True when no key is held.
    pub fn is_empty(&self) -> bool {
        self.distinct == 0
    }

    fn keys(&self, slot: u32) -> &[LocalHash] {
        &self.slots[slot as usize]
    }

    /// Where `slot` sits in `order`: by binary search, or (should two different prefixes
    /// ever collide on a 64-bit key and leave the order inconsistent) by a scan, so that a
    /// held prompt is always found and released.
    fn position(&self, slot: u32) -> Option<usize> {
        let keys = self.keys(slot);
        self.order
            .binary_search_by(|&o| {
                // The slot itself: equal without reading its keys against themselves.
                if o == slot {
                    return std::cmp::Ordering::Equal;
                }
                compare_keys(self.keys(o), keys).then(o.cmp(&slot))
            })
            .ok()
            .or_else(|| self.order.iter().position(|&o| o == slot))
    }

    /// The longest prefix the prompt at `pos` in `order` shares with another active prompt.
    fn shared_at(&self, pos: usize) -> usize {
        let keys = self.keys(self.order[pos]);
        let before = pos
            .checked_sub(1)
            .map_or(0, |p| common_prefix(self.keys(self.order[p]), keys));
        let after = self
            .order
            .get(pos + 1)
            .map_or(0, |&o| common_prefix(self.keys(o), keys));
        before.max(after)
    }

    /// Holds the prompt of block hashes `keys` (copied into a free slot); returns its slot and
    /// how many of its prefixes were new on the rank.
    fn acquire(&mut self, keys: &[LocalHash]) -> (u32, u64) {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize].extend_from_slice(keys);
                slot
            }
            None => {
                self.slots.push(keys.to_vec());
                (self.slots.len() - 1) as u32
            }
        };
        let keys = self.keys(slot);
        let pos = self.order.partition_point(|&o| {
            compare_keys(self.keys(o), keys).then(o.cmp(&slot)) == std::cmp::Ordering::Less
        });
        self.order.insert(pos, slot);
        let new = (self.keys(slot).len() - self.shared_at(pos)) as u64;
        self.distinct += new;
        (slot, new)
    }

    /// Drops the prompt in `slot`; returns how many prefixes the rank no longer holds.
    fn release(&mut self, slot: u32) -> u64 {
        let Some(pos) = self.position(slot) else {
            return 0;
        };
        let gone = (self.keys(slot).len() - self.shared_at(pos)) as u64;
        self.order.remove(pos);
        self.free.push(slot);
        self.distinct = self.distinct.saturating_sub(gone);
        // Acquiring pops the latest free slot: the latest few keep their vectors, and the one
        // this release pushes out of that window gives its vector up.
        if let Some(i) = self.free.len().checked_sub(KEPT_FREE_SLOTS + 1) {
            let deep = self.free[i];
            self.slots[deep as usize] = Vec::new();
        }
        let kept = &mut self.slots[slot as usize];
        if kept.capacity() <= KEPT_SLOT_CAPACITY {
            kept.clear();
        } else {
            *kept = Vec::new();
        }
        gone
    }

    /// How many trailing blocks of the prompt in `slot` no other active prompt holds.
    fn unshared(&self, slot: u32) -> usize {
        self.position(slot)
            .map_or(0, |pos| self.keys(slot).len() - self.shared_at(pos))
    }

    /// How many leading blocks of the prompt `keys` (its blocks' local hashes) some active
    /// prompt shares: the longer of the common prefixes with the two prompts `keys` would
    /// sit between.
    pub fn shared_prefix(&self, keys: &[LocalHash]) -> usize {
        let pos = self
            .order
            .partition_point(|&o| compare_keys(self.keys(o), keys) == std::cmp::Ordering::Less);
        let before = pos
            .checked_sub(1)
            .map_or(0, |p| common_prefix(self.keys(self.order[p]), keys));
        let after = self
            .order
            .get(pos)
            .map_or(0, |&o| common_prefix(self.keys(o), keys));
        before.max(after)
    }
}

/// Everything the router knows about one rank's load. Lives in the registry snapshot (one
/// `Arc` per rank), so selection reaches it without a lookup.
#[derive(Debug)]
pub struct RankState {
    rank: WorkerRank,
    load: CachePadded<RankLoad>,
    refs: Mutex<PrefixRefs>,
    /// [`Health`] as a byte, set by the embedder.
    health: AtomicU8,
    /// True when the worker publishes no KV events ([`KvEvents::Absent`]).
    no_events: AtomicBool,
    /// Warm-up ends at this many nanoseconds past the router's epoch (0: not warming).
    warm_until_ns: AtomicU64,
    /// Device blocks the worker reported through its events (stored less removed).
    reported_blocks: AtomicU64,
}

impl RankState {
    /// A fresh, idle rank.
    pub fn new(rank: WorkerRank) -> Self {
        RankState {
            rank,
            load: CachePadded::new(RankLoad {
                prefill_tokens: AtomicU64::new(0),
                prompt_blocks: AtomicU64::new(0),
                output_blocks: AtomicU64::new(0),
                output_decay: AtomicU64::new(0),
                prompt_decay: AtomicU64::new(0),
                requests: AtomicU64::new(0),
                index_key: AtomicU64::new(u64::MAX),
                retired: AtomicBool::new(false),
            }),
            refs: Mutex::new(PrefixRefs::default()),
            health: AtomicU8::new(Health::Healthy.to_u8()),
            no_events: AtomicBool::new(false),
            warm_until_ns: AtomicU64::new(0),
            reported_blocks: AtomicU64::new(0),
        }
    }

    /// The rank.
    pub fn rank(&self) -> WorkerRank {
        self.rank
    }

    /// Reads the counters (four relaxed loads: advisory, possibly torn across counters).
    #[inline]
    pub fn load(&self) -> LoadView {
        let l = &*self.load;
        LoadView {
            prefill_tokens: l.prefill_tokens.load(Ordering::Relaxed),
            prompt_blocks: l.prompt_blocks.load(Ordering::Relaxed),
            output_blocks: l.output_blocks.load(Ordering::Relaxed),
            output_decay: l.output_decay.load(Ordering::Relaxed),
            prompt_decay: l.prompt_decay.load(Ordering::Relaxed),
            requests: l.requests.load(Ordering::Relaxed),
        }
    }

    /// Prefill tokens booked on the rank (a `SeqCst` read, for [`Ledger::refresh_prefill_floor`]).
    #[inline]
    pub fn booked_prefill(&self) -> u64 {
        self.load.prefill_tokens.load(Ordering::SeqCst)
    }

    /// True when some of the rank's prompt load is decayed ([`LoadView::prompt_decay`]).
    #[inline(always)]
    pub fn prompt_decay_pending(&self) -> bool {
        self.load.prompt_decay.load(Ordering::Relaxed) != 0
    }

    /// How many leading blocks of a prompt (its blocks' local hashes) are active on the rank,
    /// or `None` when another thread holds the rank's table right now: never waits.
    pub fn try_shared_prefix_blocks(&self, keys: &[LocalHash]) -> Option<usize> {
        match self.refs.try_lock() {
            Ok(refs) => Some(refs.shared_prefix(keys)),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner().shared_prefix(keys)),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Distinct prompt prefix keys active on the rank.
    pub fn distinct_prefix_blocks(&self) -> usize {
        lock(&self.refs).len()
    }

    /// True once the rank's worker has left.
    pub fn is_retired(&self) -> bool {
        // The ledger shard mutex already orders a booking's insert against the purge that
        // follows `retire`; SeqCst keeps the flag correct for callers outside that protocol.
        self.load.retired.load(Ordering::SeqCst)
    }

    /// The rank's health mark (a relaxed load: advice, like the load counters).
    #[inline]
    pub fn health(&self) -> Health {
        Health::from_u8(self.health.load(Ordering::Relaxed))
    }

    /// Sets the health mark; returns the previous one.
    pub fn set_health(&self, h: Health) -> Health {
        Health::from_u8(self.health.swap(h.to_u8(), Ordering::Relaxed))
    }

    /// Whether the rank's worker publishes KV events.
    #[inline]
    pub fn kv_events(&self) -> KvEvents {
        if self.no_events.load(Ordering::Relaxed) {
            KvEvents::Absent
        } else {
            KvEvents::Published
        }
    }

    /// Sets whether the rank's worker publishes KV events.
    pub fn set_kv_events(&self, events: KvEvents) {
        self.no_events
            .store(events == KvEvents::Absent, Ordering::Relaxed);
    }

    /// When the rank's warm-up ends, in nanoseconds past the router's epoch (0: never warmed).
    #[inline]
    pub fn warm_until_ns(&self) -> u64 {
        self.warm_until_ns.load(Ordering::Relaxed)
    }

    /// Warms the rank until `until_ns` (past the router's epoch), or longer if already so.
    pub fn warm_until(&self, until_ns: u64) {
        self.warm_until_ns.fetch_max(until_ns, Ordering::Relaxed);
    }

    /// Device blocks the rank reported (stored less removed, since its last clear).
    pub fn reported_blocks(&self) -> u64 {
        self.reported_blocks.load(Ordering::Relaxed)
    }

    /// Adjusts the reported blocks: `stored` more, `removed` fewer (never below 0), or all
    /// gone on a clear.
    pub fn report_blocks(&self, stored: u64, removed: u64, cleared: bool) {
        let _ = self
            .reported_blocks
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some(if cleared {
                    0
                } else {
                    (b + stored).saturating_sub(removed)
                })
            });
    }

    /// Marks the rank as gone (its worker left).
    /// Records the rank's key in the prefix index, once it is registered there.
    pub fn set_index_key(&self, key: RankKey) {
        let packed = u64::from(key.epoch) << 32 | u64::from(key.id);
        self.load.index_key.store(packed, Ordering::Relaxed);
    }

    /// The rank's key in the prefix index (`None` before it is registered). Its id is the
    /// rank's for as long as the rank is not retired: the router retires a leaving rank before
    /// the index frees its id.
    #[inline(always)]
    pub fn index_key(&self) -> Option<RankKey> {
        match self.load.index_key.load(Ordering::Relaxed) {
            u64::MAX => None,
            k => Some(RankKey {
                id: k as u32,
                epoch: (k >> 32) as u32,
            }),
        }
    }

    pub fn retire(&self) {
        // SeqCst: see `is_retired`.
        self.load.retired.store(true, Ordering::SeqCst);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves counts that are still consistent
    // per operation (each critical section is a sequence of infallible updates), so a
    // poisoned lock is taken over rather than propagated.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a request holds on its rank, and its timeline.
#[derive(Debug)]
struct Booking {
    state: Arc<RankState>,
    prefill_tokens: u64,
    /// The request's prompt in its rank's [`PrefixRefs`].
    slot: u32,
    tail_blocks: u64,
    output_blocks: u64,
    /// Output tokens generated: counted by [`Ledger::tokens_generated`], or at least the
    /// token that opened the latest output block.
    generated: u64,
    /// What decay took off `output_blocks`, as added to the rank ([`DECAY_SCALE`] units).
    output_decay: u64,
    /// What decay took off the request's unshared prompt blocks, as added to the rank.
    prompt_decay: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    block_size: u32,
    expected_output_tokens: Option<u32>,
    booked_at: Instant,
    session: Option<SessionId>,
    dispatch: Dispatch,
    first_token_seen: bool,
    /// The last token event (first token or block boundary) timed by a caller's clock.
    last_token_at: Option<Instant>,
}

/// What to book for one request.
#[derive(Debug)]
pub struct BookingSpec<'a> {
    pub request: RequestId,
    /// The rank chosen.
    pub state: &'a Arc<RankState>,
    /// Prompt tokens the rank must compute (the prompt less what it has cached).
    pub prefill_tokens: u64,
    /// Local hashes of the prompt's full blocks.
    pub block_hashes: &'a [LocalHash],
    /// Blocks the prompt holds beyond its full ones (1 for a partial tail block, else 0).
    pub tail_blocks: u64,
    /// Prompt tokens (the ISL).
    pub prompt_tokens: u64,
    /// Prompt tokens predicted cached on the rank.
    pub cached_tokens: u64,
    /// Tokens per block, for the output timeline.
    pub block_size: u32,
    /// Expected output length, when known: output blocks decay by it.
    pub expected_output_tokens: Option<u32>,
    /// The sticky session the request belongs to, handed back when it is freed.
    pub session: Option<SessionId>,
    pub now: Instant,
}

/// What a lifecycle step observed, for request metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub rank: WorkerRank,
    pub dispatch: Dispatch,
    /// Time since the previous event: for the first token since booking (TTFT, on the first
    /// call only), for an output block since the previous token event. `None` without a
    /// clock reading or a previous event.
    pub elapsed: Option<Duration>,
    /// Tokens generated over `elapsed` (output blocks; 0 for the first token).
    pub tokens: u64,
}

/// What a [`Ledger::tokens_generated`] call observed, for request metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Generated {
    pub rank: WorkerRank,
    pub dispatch: Dispatch,
    /// These were the request's first tokens: its prefill tokens were released.
    pub prefill_released: bool,
    /// Time from booking to the first tokens (with a clock reading, on the first call only).
    pub ttft: Option<Duration>,
    /// Time since the previous token event, over `itl_tokens` tokens (`None` on the first
    /// call, without a clock reading, or without a previous timed event).
    pub itl: Option<Duration>,
    pub itl_tokens: u64,
    /// Output blocks the tokens opened.
    pub new_blocks: u64,
}

/// What a freed request had booked, as it was when freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    pub rank: WorkerRank,
    /// Prefill tokens still booked (non-zero when freed before prefill completed).
    pub prefill_tokens: u64,
    pub output_blocks: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub dispatch: Dispatch,
    pub age: Duration,
    pub session: Option<SessionId>,
}

/// Lifecycle counters of the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerCounts {
    pub booked: u64,
    pub freed: u64,
    pub expired: u64,
    /// Requests dropped because their worker left.
    pub purged: u64,
    pub duplicate_requests: u64,
    pub unknown_requests: u64,
    /// Bookings undone because their rank retired while they were made.
    pub retired_races: u64,
}

const SHARDS: usize = 16;

/// The request table: which request holds what on which rank.
#[derive(Debug)]
pub struct Ledger {
    shards: [CachePadded<Mutex<HashMap<RequestId, Booking, PassThrough>>>; SHARDS],
    prompt_decay: PromptDecay,
    /// Bookings whose prompt load is decayed now, on any rank: while 0, no rank's
    /// [`LoadView::prompt_decay`] is either (selection bounds costs tighter then).
    decaying: AtomicU64,
    /// At most every rank's booked prefill tokens ([`Ledger::prefill_floor`]).
    prefill_floor: CachePadded<AtomicU64>,
    booked: AtomicU64,
    freed: AtomicU64,
    expired: AtomicU64,
    purged: AtomicU64,
    duplicate: AtomicU64,
    unknown: AtomicU64,
    retired_races: AtomicU64,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            shards: std::array::from_fn(|_| CachePadded::new(Mutex::new(HashMap::default()))),
            prompt_decay: PromptDecay::default(),
            decaying: AtomicU64::new(0),
            prefill_floor: CachePadded::new(AtomicU64::new(0)),
            booked: AtomicU64::new(0),
            freed: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            purged: AtomicU64::new(0),
            duplicate: AtomicU64::new(0),
            unknown: AtomicU64::new(0),
            retired_races: AtomicU64::new(0),
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Ledger {
    pub fn new() -> Self {
        Self::default()
    }

    /// A ledger whose requests' unshared prompt blocks decay as `mode` says.
    pub fn with_prompt_decay(mode: PromptDecay) -> Self {
        Ledger {
            prompt_decay: mode,
            ..Self::default()
        }
    }

    fn shard(&self, id: RequestId) -> &Mutex<HashMap<RequestId, Booking, PassThrough>> {
        &self.shards[(mix64(id.0) >> 60) as usize % SHARDS]
    }

    /// Books a request on its rank: the prefill tokens, the prompt blocks not already active on
    /// the rank, the tail, one request.
    pub fn book(&self, spec: BookingSpec<'_>) -> Result<(), LoadError> {
        let BookingSpec {
            request,
            state,
            prefill_tokens,
            block_hashes,
            tail_blocks,
            prompt_tokens,
            cached_tokens,
            block_size,
            expected_output_tokens,
            session,
            now,
        } = spec;
        {
            let mut shard = lock(self.shard(request));
            if shard.contains_key(&request) {
                drop(shard);
                bump(&self.duplicate);
                return Err(LoadError::DuplicateRequest { request });
            }
            // Under the shard lock, so that a concurrent free of the same id cannot release
            // references before they are taken.
            let l = &*state.load;
            let slot = {
                // The counter moves under the table's lock, so that its every value is the
                // table's distinct keys plus the tails at some moment.
                let mut refs = lock(&state.refs);
                let (slot, new_blocks) = refs.acquire(block_hashes);
                l.prompt_blocks
                    .fetch_add(new_blocks + tail_blocks, Ordering::Relaxed);
                slot
            };
            l.prefill_tokens
                .fetch_add(prefill_tokens, Ordering::Relaxed);
            l.requests.fetch_add(1, Ordering::Relaxed);
            shard.insert(
                request,
                Booking {
                    state: Arc::clone(state),
                    prefill_tokens,
                    slot,
                    tail_blocks,
                    output_blocks: 0,
                    generated: 0,
                    output_decay: 0,
                    prompt_decay: 0,
                    prompt_tokens,
                    cached_tokens,
                    block_size,
                    expected_output_tokens,
                    booked_at: now,
                    session,
                    dispatch: Dispatch::NotYet,
                    first_token_seen: false,
                    last_token_at: None,
                },
            );
        }
        bump(&self.booked);
        if state.is_retired() {
            // The worker left while we booked; the purge may have missed us. Whoever removes
            // the booking undoes it, so this cannot double-free.
            if let Some(b) = self.remove(request) {
                self.undo(b, now);
                bump(&self.retired_races);
            }
            return Err(LoadError::RankRetired {
                request,
                rank: state.rank,
            });
        }
        Ok(())
    }

    fn remove(&self, request: RequestId) -> Option<Booking> {
        lock(self.shard(request)).remove(&request)
    }

    /// Releases everything `b` booked; the request's age is counted up to `now`.
    fn undo(&self, b: Booking, now: Instant) -> Freed {
        let l = &*b.state.load;
        {
            let mut refs = lock(&b.state.refs);
            let gone = refs.release(b.slot);
            l.prompt_blocks
                .fetch_sub(gone + b.tail_blocks, Ordering::Relaxed);
        }
        self.release_prefill(&b.state, b.prefill_tokens);
        // Counters with nothing to give back are not written.
        if b.output_blocks > 0 {
            l.output_blocks
                .fetch_sub(b.output_blocks, Ordering::Relaxed);
        }
        if b.output_decay > 0 {
            l.output_decay.fetch_sub(b.output_decay, Ordering::Relaxed);
        }
        if b.prompt_decay > 0 {
            l.prompt_decay.fetch_sub(b.prompt_decay, Ordering::Relaxed);
            self.decaying.fetch_sub(1, Ordering::Relaxed);
        }
        l.requests.fetch_sub(1, Ordering::Relaxed);
        Freed {
            rank: b.state.rank,
            prefill_tokens: b.prefill_tokens,
            output_blocks: b.output_blocks,
            prompt_tokens: b.prompt_tokens,
            cached_tokens: b.cached_tokens,
            dispatch: b.dispatch,
            age: now.saturating_duration_since(b.booked_at),
            session: b.session,
        }
    }

    fn unknown(&self, request: RequestId) -> LoadError {
        bump(&self.unknown);
        LoadError::UnknownRequest { request }
    }

    /// The request reached its worker. Repeated calls are harmless.
    pub fn mark_dispatched(&self, request: RequestId) -> Result<WorkerRank, LoadError> {
        let mut shard = lock(self.shard(request));
        let Some(b) = shard.get_mut(&request) else {
            drop(shard);
            return Err(self.unknown(request));
        };
        b.dispatch = Dispatch::Reached;
        Ok(b.state.rank)
    }

    /// The request's first token arrived (at `now`, when the caller times it): its prefill
    /// tokens are no longer pending. Repeated calls are harmless (the second releases nothing
    /// and reports no elapsed time).
    pub fn prefill_done(
        &self,
        request: RequestId,
        now: Option<Instant>,
    ) -> Result<Step, LoadError> {
        let mut shard = lock(self.shard(request));
        let Some(b) = shard.get_mut(&request) else {
            drop(shard);
            return Err(self.unknown(request));
        };
        let tokens = std::mem::take(&mut b.prefill_tokens);
        self.release_prefill(&b.state, tokens);
        let first = !std::mem::replace(&mut b.first_token_seen, true);
        let elapsed = match now {
            Some(now) if first => {
                b.last_token_at.get_or_insert(now);
                Some(now.saturating_duration_since(b.booked_at))
            }
            _ => None,
        };
        Ok(Step {
            rank: b.state.rank,
            dispatch: b.dispatch,
            elapsed,
            tokens: 0,
        })
    }

    /// Generation crossed into a new block (at `now`, when the caller times it). With an
    /// expected output length, the request's output blocks decay (see the module comment).
    pub fn output_block(
        &self,
        request: RequestId,
        now: Option<Instant>,
    ) -> Result<Step, LoadError> {
        let mut shard = lock(self.shard(request));
        let Some(b) = shard.get_mut(&request) else {
            drop(shard);
            return Err(self.unknown(request));
        };
        b.output_blocks += 1;
        let k = b.output_blocks;
        b.state.load.output_blocks.fetch_add(1, Ordering::Relaxed);
        let g_k = generated_at_block(b.prompt_tokens, b.block_size, k);
        b.generated = b.generated.max(g_k);
        self.decay(b, g_k);
        let (g, g_before) = (
            generated_at_block(b.prompt_tokens, b.block_size, k),
            generated_at_block(b.prompt_tokens, b.block_size, k - 1).max(1),
        );
        let elapsed = now.and_then(|now| {
            b.last_token_at
                .replace(now)
                .map(|t| now.saturating_duration_since(t))
        });
        Ok(Step {
            rank: b.state.rank,
            dispatch: b.dispatch,
            elapsed,
            tokens: g.saturating_sub(g_before),
        })
    }

    /// `tokens` more output tokens arrived (at `now`, when the caller times it). Every output
    /// token counts, the first included: the first call with tokens also completes the
    /// prefill as [`Ledger::prefill_done`] does (and reports the TTFT); later calls report the
    /// time since the previous token event over their tokens (the ITL). Output blocks follow
    /// the count: the request holds `ceil((prompt + generated) / block size)` blocks, so a
    /// call may open several or none, and decay is taken at the count when one opens.
    /// Mixes with [`Ledger::output_block`], which counts at least the token opening its block.
    pub fn tokens_generated(
        &self,
        request: RequestId,
        tokens: u64,
        now: Option<Instant>,
    ) -> Result<Generated, LoadError> {
        let mut shard = lock(self.shard(request));
        let Some(b) = shard.get_mut(&request) else {
            drop(shard);
            return Err(self.unknown(request));
        };
        let mut out = Generated {
            rank: b.state.rank,
            dispatch: b.dispatch,
            prefill_released: false,
            ttft: None,
            itl: None,
            itl_tokens: 0,
            new_blocks: 0,
        };
        if tokens == 0 {
            return Ok(out);
        }
        if !std::mem::replace(&mut b.first_token_seen, true) {
            let pending = std::mem::take(&mut b.prefill_tokens);
            self.release_prefill(&b.state, pending);
            out.prefill_released = true;
            if let Some(now) = now {
                b.last_token_at = Some(now);
                out.ttft = Some(now.saturating_duration_since(b.booked_at));
            }
        } else if let Some(now) = now {
            if let Some(prev) = b.last_token_at.replace(now) {
                out.itl = Some(now.saturating_duration_since(prev));
                out.itl_tokens = tokens;
            }
        }
        b.generated = b.generated.saturating_add(tokens);
        let bs = u64::from(b.block_size.max(1));
        let held = (b.prompt_tokens.saturating_add(b.generated)).div_ceil(bs)
            - b.prompt_tokens.div_ceil(bs);
        if held > b.output_blocks {
            out.new_blocks = held - b.output_blocks;
            b.output_blocks = held;
            b.state
                .load
                .output_blocks
                .fetch_add(out.new_blocks, Ordering::Relaxed);
            let g = b.generated;
            self.decay(b, g);
        }
        Ok(out)
    }

    /// Re-weighs a request with an expected output length after `generated` output tokens:
    /// its output blocks, and with [`PromptDecay::Unshared`] its prompt blocks no other
    /// request on the rank holds, weigh what is left of its expected output.
    fn decay(&self, b: &mut Booking, generated: u64) {
        let Some(expected) = b.expected_output_tokens else {
            return;
        };
        let l = &*b.state.load;
        let left = remaining_fraction(generated, expected);
        let out = decayed(b.output_blocks, left);
        l.output_decay
            .fetch_add(out.saturating_sub(b.output_decay), Ordering::Relaxed);
        b.output_decay = out.max(b.output_decay);
        if self.prompt_decay == PromptDecay::Unshared {
            // Under the table's lock: the unshared count is read, and the decay moved, at
            // one moment of the rank's prefix table.
            let refs = lock(&b.state.refs);
            let unshared = refs.unshared(b.slot) as u64 + b.tail_blocks;
            let now = decayed(unshared, left);
            // The count of decaying bookings rises before a rank's decay does and falls
            // after, so that it is 0 only while no rank's is.
            if b.prompt_decay == 0 && now > 0 {
                self.decaying.fetch_add(1, Ordering::Relaxed);
            }
            if now >= b.prompt_decay {
                l.prompt_decay
                    .fetch_add(now - b.prompt_decay, Ordering::Relaxed);
            } else {
                l.prompt_decay
                    .fetch_sub(b.prompt_decay - now, Ordering::Relaxed);
            }
            drop(refs);
            if b.prompt_decay > 0 && now == 0 {
                self.decaying.fetch_sub(1, Ordering::Relaxed);
            }
            b.prompt_decay = now;
        }
    }

    /// A number of prefill tokens that every rank has booked at least: selection's floors
    /// count them on every rank before reading its load. Lowered at once whenever a rank's
    /// booked prefill falls below it (a release, or a new rank: [`Ledger::lower_prefill_floor`]),
    /// raised only by [`Ledger::refresh_prefill_floor`]; 0 until then.
    #[inline]
    pub fn prefill_floor(&self) -> u64 {
        self.prefill_floor.load(Ordering::SeqCst)
    }

    /// Keeps [`Ledger::prefill_floor`] at most `tokens`, some rank's booked prefill now.
    #[inline]
    pub fn lower_prefill_floor(&self, tokens: u64) {
        if tokens < self.prefill_floor.load(Ordering::SeqCst) {
            self.prefill_floor.fetch_min(tokens, Ordering::SeqCst);
        }
    }

    /// Raises [`Ledger::prefill_floor`] to the least prefill booked on `ranks` (every rank
    /// that can be selected; the caller covers ranks published meanwhile).
    ///
    /// The floor stays a floor against releases racing with the refresh. A release lowers its
    /// rank's counter, then (past a `SeqCst` fence) reads the floor; the refresh swaps its
    /// minimum in, then (past a `SeqCst` fence) reads every rank again and lowers the floor to
    /// any count below it. The fences order each side's write before its read, so a release
    /// that the second pass misses reads the swapped-in floor (or a lower one) and lowers it
    /// itself. A refresh that loses the swap to another writer changes nothing. The loom
    /// model `loom_a_refresh_racing_a_release_never_leaves_the_floor_above_a_rank` fails
    /// without either fence or without the second pass.
    pub fn refresh_prefill_floor<'a, I>(&self, ranks: I)
    where
        I: IntoIterator<Item = &'a RankState>,
        I::IntoIter: Clone,
    {
        let ranks = ranks.into_iter();
        let seen = self.prefill_floor.load(Ordering::SeqCst);
        let least = ranks
            .clone()
            .map(RankState::booked_prefill)
            .min()
            .unwrap_or(0);
        if least == seen
            || self
                .prefill_floor
                .compare_exchange(seen, least, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
        {
            return;
        }
        fence(Ordering::SeqCst);
        for r in ranks {
            self.lower_prefill_floor(r.booked_prefill());
        }
    }

    /// Releases `tokens` of prefill booked on `state`, keeping the floor under its new count.
    fn release_prefill(&self, state: &RankState, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let before = state
            .load
            .prefill_tokens
            .fetch_sub(tokens, Ordering::SeqCst);
        // The count's change is ordered before the floor is read (see
        // `refresh_prefill_floor`).
        fence(Ordering::SeqCst);
        self.lower_prefill_floor(before.wrapping_sub(tokens));
    }

    /// True when some booking's prompt load is decayed now (on some rank,
    /// [`LoadView::prompt_decay`] is not 0). Advisory, like every counter read.
    pub fn prompt_decay_anywhere(&self) -> bool {
        self.decaying.load(Ordering::Relaxed) != 0
    }

    /// The request ended: everything it booked is released.
    pub fn free(&self, request: RequestId) -> Result<Freed, LoadError> {
        self.free_at(request, Instant::now())
    }

    /// [`Ledger::free`] at `now`, which dates the request's [`Freed::age`].
    pub fn free_at(&self, request: RequestId, now: Instant) -> Result<Freed, LoadError> {
        match self.remove(request) {
            Some(b) => {
                bump(&self.freed);
                Ok(self.undo(b, now))
            }
            None => Err(self.unknown(request)),
        }
    }

    /// Frees every request booked at or before `now - max_age`; returns how many.
    pub fn expire(&self, now: Instant, max_age: Duration) -> usize {
        let n = self.drain_where(now, |b| {
            now.saturating_duration_since(b.booked_at) >= max_age
        });
        self.expired.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Drops every booking on a rank of `worker` (whose ranks must already be retired);
    /// returns how many.
    pub fn purge_worker(&self, worker: WorkerId) -> usize {
        let n = self.drain_where(Instant::now(), |b| b.state.rank.worker == worker);
        self.purged.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Removes every booking `drop` selects and undoes its load; returns how many.
    fn drain_where(&self, now: Instant, mut drop: impl FnMut(&Booking) -> bool) -> usize {
        let mut n = 0;
        for shard in &self.shards {
            let gone: Vec<Booking> = {
                let mut s = lock(shard);
                let ids: Vec<RequestId> = s
                    .iter()
                    .filter(|(_, b)| drop(b))
                    .map(|(id, _)| *id)
                    .collect();
                ids.iter().filter_map(|id| s.remove(id)).collect()
            };
            for b in gone {
                self.undo(b, now);
                n += 1;
            }
        }
        n
    }

    /// The rank a request is booked on.
    pub fn rank_of(&self, request: RequestId) -> Option<WorkerRank> {
        lock(self.shard(request))
            .get(&request)
            .map(|b| b.state.rank)
    }

    /// Requests currently booked.
    pub fn active(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Lifecycle counters.
    pub fn counts(&self) -> LedgerCounts {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LedgerCounts {
            booked: r(&self.booked),
            freed: r(&self.freed),
            expired: r(&self.expired),
            purged: r(&self.purged),
            duplicate_requests: r(&self.duplicate),
            unknown_requests: r(&self.unknown),
            retired_races: r(&self.retired_races),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// The block hashes of a prompt whose blocks hash to `locals`.
    fn blocks(locals: &[u64]) -> Vec<LocalHash> {
        locals.iter().map(|&x| LocalHash(x)).collect()
    }

    /// The prefix keys of a prompt whose blocks hash to `locals`: equal keys, equal prefixes.
    fn keys(locals: &[u64]) -> Vec<u64> {
        let mut out = Vec::new();
        prefix_keys_into(&blocks(locals), &mut out);
        out
    }

    fn spec<'a>(
        id: u64,
        state: &'a Arc<RankState>,
        tokens: u64,
        block_hashes: &'a [LocalHash],
        now: Instant,
    ) -> BookingSpec<'a> {
        BookingSpec {
            request: RequestId(id),
            state,
            prefill_tokens: tokens,
            block_hashes,
            tail_blocks: 0,
            prompt_tokens: tokens,
            cached_tokens: 0,
            block_size: 16,
            expected_output_tokens: None,
            session: None,
            now,
        }
    }

    #[test]
    fn prefix_keys_name_prefixes_not_blocks() {
        let a = keys(&[1, 2, 3]);
        let b = keys(&[1, 2, 4]);
        let c = keys(&[9, 2, 3]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(
            a[1], c[1],
            "same block after a different prefix is a different key"
        );
    }

    #[test]
    fn shared_prefix_blocks_count_once() {
        let ledger = Ledger::new();
        let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let now = Instant::now();
        let a = blocks(&[1, 2, 3, 4]);
        let b = blocks(&[1, 2, 7, 8, 9]);
        ledger.book(spec(1, &s, 64, &a, now)).unwrap();
        ledger.book(spec(2, &s, 80, &b, now)).unwrap();
        let l = s.load();
        assert_eq!(l.prompt_blocks, 4 + 3, "blocks 1, 2 shared");
        assert_eq!(l.prefill_tokens, 144);
        assert_eq!(l.requests, 2);
        ledger.free(RequestId(1)).unwrap();
        assert_eq!(
            s.load().prompt_blocks,
            5,
            "shared blocks stay while request 2 holds them"
        );
        ledger.free(RequestId(2)).unwrap();
        assert!(s.load().is_idle());
        assert_eq!(s.distinct_prefix_blocks(), 0);
    }

    #[test]
    fn prefill_done_releases_tokens_once_and_output_blocks_grow() {
        let ledger = Ledger::new();
        let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let k = blocks(&[1, 2]);
        ledger
            .book(BookingSpec {
                tail_blocks: 1,
                ..spec(5, &s, 40, &k, Instant::now())
            })
            .unwrap();
        assert_eq!(s.load().prompt_blocks, 3);
        ledger.prefill_done(RequestId(5), None).unwrap();
        ledger.prefill_done(RequestId(5), None).unwrap();
        assert_eq!(s.load().prefill_tokens, 0);
        ledger.output_block(RequestId(5), None).unwrap();
        ledger.output_block(RequestId(5), None).unwrap();
        assert_eq!(s.load().decode_blocks(), 5);
        let freed = ledger.free(RequestId(5)).unwrap();
        assert_eq!(freed.output_blocks, 2);
        assert_eq!(freed.prefill_tokens, 0);
        assert!(s.load().is_idle());
    }

    #[test]
    fn bad_ids_are_typed_errors_and_counted() {
        let ledger = Ledger::new();
        let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let k = blocks(&[1]);
        ledger.book(spec(1, &s, 10, &k, Instant::now())).unwrap();
        assert_eq!(
            ledger.book(spec(1, &s, 10, &k, Instant::now())),
            Err(LoadError::DuplicateRequest {
                request: RequestId(1)
            })
        );
        assert_eq!(s.load().requests, 1, "a rejected duplicate books nothing");
        ledger.free(RequestId(1)).unwrap();
        let unknown = LoadError::UnknownRequest {
            request: RequestId(1),
        };
        assert_eq!(ledger.free(RequestId(1)), Err(unknown.clone()));
        assert_eq!(
            ledger.prefill_done(RequestId(1), None),
            Err(unknown.clone())
        );
        assert_eq!(
            ledger.output_block(RequestId(1), None),
            Err(unknown.clone())
        );
        assert_eq!(ledger.mark_dispatched(RequestId(1)), Err(unknown));
        let c = ledger.counts();
        assert_eq!((c.duplicate_requests, c.unknown_requests), (1, 4));
        assert!(s.load().is_idle());
    }

    #[test]
    fn expiry_frees_only_old_requests() {
        let ledger = Ledger::new();
        let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let t0 = Instant::now();
        let k = blocks(&[1, 2]);
        ledger.book(spec(1, &s, 10, &k, t0)).unwrap();
        ledger
            .book(spec(2, &s, 10, &k, t0 + Duration::from_secs(10)))
            .unwrap();
        let n = ledger.expire(t0 + Duration::from_secs(15), Duration::from_secs(10));
        assert_eq!(n, 1);
        assert_eq!(ledger.rank_of(RequestId(1)), None);
        assert_eq!(s.load().requests, 1);
        assert_eq!(s.load().prompt_blocks, 2);
        assert_eq!(ledger.counts().expired, 1);
    }

    #[test]
    fn booking_on_a_retired_rank_undoes_itself() {
        let ledger = Ledger::new();
        let s = Arc::new(RankState::new(WorkerRank::new(3, 0)));
        s.retire();
        let k = blocks(&[1, 2]);
        assert!(matches!(
            ledger.book(spec(1, &s, 10, &k, Instant::now())),
            Err(LoadError::RankRetired { .. })
        ));
        assert!(s.load().is_idle());
        assert_eq!(ledger.active(), 0);
    }

    #[test]
    fn purge_drops_only_the_leaving_workers_bookings() {
        let ledger = Ledger::new();
        let a = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let b = Arc::new(RankState::new(WorkerRank::new(2, 0)));
        let k = blocks(&[1, 2]);
        ledger.book(spec(1, &a, 10, &k, Instant::now())).unwrap();
        ledger.book(spec(2, &b, 10, &k, Instant::now())).unwrap();
        a.retire();
        assert_eq!(ledger.purge_worker(WorkerId(1)), 1);
        assert!(a.load().is_idle());
        assert_eq!(b.load().requests, 1);
    }

    /// Over many prompts branching from shared prefixes (small and structured local hashes
    /// included), distinct prefixes get distinct keys and equal prefixes equal keys.
    #[test]
    fn prefix_keys_tell_prefixes_apart() {
        let mut rng = crate::rng::Rng::new(3);
        let mut by_key: HashMap<u64, Vec<u64>> = HashMap::new();
        for p in 0..2_000u64 {
            // A branch of one of a few trunks, its hashes random or tiny.
            let trunk = p % 7;
            let cut = rng.below(40);
            let locals: Vec<u64> = (0..80u64)
                .map(|i| match (i < cut, p % 2) {
                    (true, _) => trunk * 1_000 + i,
                    (false, 0) => rng.next_u64(),
                    (false, _) => rng.below(4),
                })
                .collect();
            for (i, k) in keys(&locals).into_iter().enumerate() {
                let prefix = locals[..=i].to_vec();
                let seen = by_key.entry(k).or_insert_with(|| prefix.clone());
                assert_eq!(*seen, prefix, "two prefixes share key {k:#x}");
            }
        }
        assert!(by_key.len() > 50_000, "{}", by_key.len());
    }

    #[test]
    fn prefix_keys_extend_continues_the_same_chain() {
        let locals: Vec<LocalHash> = (0..40).map(|i| LocalHash(i * 31 + 7)).collect();
        let mut all = Vec::new();
        prefix_keys_into(&locals, &mut all);
        let mut part = Vec::new();
        prefix_keys_into(&locals[..3], &mut part);
        prefix_keys_extend(&locals, &mut part, 17);
        assert_eq!(part, all[..17]);
        prefix_keys_extend(&locals, &mut part, 10);
        assert_eq!(part.len(), 17, "never shrinks");
        prefix_keys_extend(&locals, &mut part, 99);
        assert_eq!(part, all);
        let mut fresh = Vec::new();
        prefix_keys_extend(&locals, &mut fresh, 5);
        assert_eq!(fresh, all[..5]);
    }

    /// The search over held prompts equals a linear count of the query's leading prefix keys
    /// held, for prompts sharing prefixes of every length with the active requests, and for
    /// blocks that recur at other positions.
    #[test]
    fn shared_prefix_equals_a_linear_scan() {
        let ledger = Ledger::new();
        let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let active = [vec![1, 2, 3, 4, 5, 6], vec![1, 2, 9], vec![7, 8]];
        for (i, k) in active.iter().enumerate() {
            ledger
                .book(spec(i as u64, &s, 1, &blocks(k), Instant::now()))
                .unwrap();
        }
        let linear = |q: &[u64]| {
            let held: std::collections::HashSet<u64> =
                active.iter().flat_map(|a| keys(a)).collect();
            keys(q).iter().take_while(|k| held.contains(k)).count()
        };
        let queries = [
            vec![1, 2, 3, 4, 5, 6, 7, 8],
            vec![1, 2, 3],
            vec![1, 2, 9, 9],
            vec![1, 5],
            vec![7, 8, 9],
            vec![3],
            vec![2, 3, 4],
            vec![],
        ];
        for q in queries {
            let got = s.try_shared_prefix_blocks(&blocks(&q));
            assert_eq!(got, Some(linear(&q)), "{q:?}");
        }
        assert_eq!(
            s.try_shared_prefix_blocks(&blocks(&[1, 2, 3, 4, 5, 6, 7])),
            Some(6)
        );
        // A held table is skipped, not waited for.
        let held = lock(&s.refs);
        assert_eq!(s.try_shared_prefix_blocks(&blocks(&[1])), None);
        drop(held);
    }

    /// The sorted-prompt table against per-key refcounts: random prompts over a small
    /// alphabet (so that they share prefixes of every length, and some are equal) acquired
    /// and released in random order give the same distinct count, shared prefix of any query
    /// and unshared suffix of every held prompt as counting each prefix key's holders.
    #[test]
    fn free_slots_keep_few_vectors_and_booking_reuses_them() {
        let mut refs = PrefixRefs::default();
        let prompt =
            |p: u64, len: u64| blocks(&(0..len).map(|i| p * 100_000 + i).collect::<Vec<_>>());
        let slots: Vec<u32> = (0..40).map(|p| refs.acquire(&prompt(p, 100)).0).collect();
        for &slot in &slots {
            refs.release(slot);
        }
        let holding = || refs.slots.iter().filter(|v| v.capacity() > 0).count();
        assert_eq!(
            holding(),
            KEPT_FREE_SLOTS,
            "only the latest free slots keep vectors"
        );
        assert!(refs.slots.iter().all(|v| v.is_empty()));
        // Booking takes the latest free slot first: those with a vector, none allocated.
        for p in 0..KEPT_FREE_SLOTS as u64 {
            let next = *refs.free.last().unwrap();
            assert!(refs.slots[next as usize].capacity() >= 100);
            let (slot, _) = refs.acquire(&prompt(100 + p, 100));
            assert_eq!(slot, next);
            assert_eq!(refs.keys(slot), prompt(100 + p, 100).as_slice());
        }
        // A prompt longer than a kept vector may be gives its vector up when released.
        let (long, _) = refs.acquire(&prompt(999, KEPT_SLOT_CAPACITY as u64 + 1));
        refs.release(long);
        assert_eq!(refs.slots[long as usize].capacity(), 0);
    }

    #[test]
    fn prefix_table_equals_per_key_refcounts() {
        let mut x = 0x5eed_u64;
        let mut next = |n: u64| {
            x = mix64(x.wrapping_add(0x9e37_79b9_7f4a_7c15));
            x % n
        };
        for _ in 0..200 {
            let mut refs = PrefixRefs::default();
            let mut held: Vec<(u32, Vec<u64>)> = Vec::new();
            for _ in 0..40 {
                if held.is_empty() || next(3) > 0 {
                    let len = next(9) as usize;
                    let locals: Vec<u64> = (0..len).map(|_| next(3)).collect();
                    let k = keys(&locals);
                    let (slot, new) = refs.acquire(&blocks(&locals));
                    let before: std::collections::HashSet<u64> =
                        held.iter().flat_map(|(_, k)| k.iter().copied()).collect();
                    assert_eq!(new, k.iter().filter(|k| !before.contains(k)).count() as u64);
                    held.push((slot, k));
                } else {
                    let i = next(held.len() as u64) as usize;
                    let (slot, k) = held.swap_remove(i);
                    let after: std::collections::HashSet<u64> =
                        held.iter().flat_map(|(_, k)| k.iter().copied()).collect();
                    let held_keys: Vec<u64> = refs.keys(slot).iter().map(|b| b.0).collect();
                    assert_eq!(keys(&held_keys), k);
                    let gone = refs.release(slot);
                    assert!(refs.keys(slot).is_empty());
                    assert_eq!(gone, k.iter().filter(|k| !after.contains(k)).count() as u64);
                }
                let mut counts: HashMap<u64, usize> = HashMap::new();
                for (_, k) in &held {
                    for key in k {
                        *counts.entry(*key).or_default() += 1;
                    }
                }
                assert_eq!(refs.len(), counts.len());
                for (slot, k) in &held {
                    let unshared = k.iter().filter(|key| counts[key] == 1).count();
                    assert_eq!(refs.unshared(*slot), unshared);
                }
                let q: Vec<u64> = (0..next(10)).map(|_| next(3)).collect();
                let linear = keys(&q)
                    .iter()
                    .take_while(|k| counts.contains_key(k))
                    .count();
                assert_eq!(refs.shared_prefix(&blocks(&q)), linear);
            }
        }
    }

    #[test]
    fn generated_tokens_at_each_block_boundary() {
        // A 40-token prompt fills 3 blocks of 16 (48 slots): output token 9 opens block 4.
        assert_eq!(generated_at_block(40, 16, 0), 0);
        assert_eq!(generated_at_block(40, 16, 1), 9);
        assert_eq!(generated_at_block(40, 16, 2), 25);
        // A prompt of whole blocks: the first output token opens a block.
        assert_eq!(generated_at_block(32, 16, 1), 1);
        assert_eq!(generated_at_block(32, 16, 3), 33);
        assert_eq!(remaining_fraction(25, 100), 0.75);
        assert_eq!(remaining_fraction(250, 100), 0.0);
        assert_eq!(
            remaining_fraction(1, 0),
            0.0,
            "an expected length of 0 counts as 1"
        );
    }

    /// The documented formula: after k blocks a request weighs `k · max(0, 1 − g_k / E)`
    /// blocks, its decay never decreases, and it is whole-block exact at the ends.
    #[test]
    fn output_decay_follows_the_remaining_fraction() {
        // Prompt 32 tokens, E = 64: g_k = 16(k − 1) + 1.
        for k in 1..10u64 {
            let g = 16 * (k - 1) + 1;
            let weighted = k as f64 * (1.0 - g as f64 / 64.0).max(0.0);
            let d = output_decay(32, 16, 64, k);
            let expect = k * DECAY_SCALE - (weighted * DECAY_SCALE as f64).round() as u64;
            assert_eq!(d, expect, "k = {k}");
            assert!(d >= output_decay(32, 16, 64, k - 1));
        }
        assert_eq!(output_decay(32, 16, 64, 0), 0);
        assert_eq!(
            output_decay(32, 16, 64, 6),
            6 * DECAY_SCALE,
            "past E: no load"
        );
        for (isl, e) in [(0, 1), (17, 5), (1000, 100_000), (5, u32::MAX)] {
            let mut last = 0;
            for k in 0..200 {
                let d = output_decay(isl, 16, e, k);
                assert!(d >= last && d <= k * DECAY_SCALE, "{isl} {e} {k}");
                last = d;
            }
        }
    }

    #[test]
    fn expected_output_decays_the_ranks_output_load_and_free_restores_it() {
        let ledger = Ledger::new();
        let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let k = blocks(&[1, 2]);
        ledger
            .book(BookingSpec {
                expected_output_tokens: Some(64),
                ..spec(1, &s, 32, &k, Instant::now())
            })
            .unwrap();
        ledger.book(spec(2, &s, 32, &k, Instant::now())).unwrap();
        for _ in 0..2 {
            ledger.output_block(RequestId(1), None).unwrap();
            ledger.output_block(RequestId(2), None).unwrap();
        }
        // Request 1 at k = 2: g = 17, r = 47/64, weight 2 · 47/64; request 2 undecayed.
        let l = s.load();
        assert_eq!(l.output_blocks, 4);
        assert_eq!(l.output_decay, output_decay(32, 16, 64, 2));
        assert_eq!(l.weighted_output_blocks(), 2.0 + 2.0 * 47.0 / 64.0);
        assert_eq!(l.decode_blocks(), 2 + 4, "capacity counts every block held");
        ledger.free(RequestId(2)).unwrap();
        for _ in 0..6 {
            ledger.output_block(RequestId(1), None).unwrap();
        }
        assert_eq!(
            s.load().weighted_output_blocks(),
            0.0,
            "past its expected output"
        );
        ledger.free(RequestId(1)).unwrap();
        assert!(s.load().is_idle());
    }

    /// With an expected output, a request's prompt blocks that no other request holds (and its
    /// partial tail) weigh what is left of its output, as its output blocks do; blocks it
    /// shares stay whole; the count follows sharing at each output block; a free undoes it.
    #[test]
    fn unshared_prompt_blocks_decay_and_shared_ones_do_not() {
        let ledger = Ledger::with_prompt_decay(PromptDecay::Unshared);
        let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let a = blocks(&[1, 2, 3, 4]);
        let b = blocks(&[1, 2, 9]);
        let now = Instant::now();
        // Request 1: 4 full blocks and a tail (70 tokens), E = 100.
        ledger
            .book(BookingSpec {
                tail_blocks: 1,
                prompt_tokens: 70,
                expected_output_tokens: Some(100),
                ..spec(1, &s, 70, &a, now)
            })
            .unwrap();
        ledger.book(spec(2, &s, 48, &b, now)).unwrap();
        assert_eq!(s.load().prompt_blocks, 5 + 1);
        assert!(!ledger.prompt_decay_anywhere());
        // First output block of request 1 opens at output token 11 (80 slots): r = 0.89.
        ledger.output_block(RequestId(1), None).unwrap();
        assert!(ledger.prompt_decay_anywhere());
        let left = remaining_fraction(11, 100);
        let l = s.load();
        assert_eq!(
            l.prompt_decay,
            decayed(2 + 1, left),
            "blocks 3, 4 and the tail"
        );
        assert!((l.weighted_prompt_blocks() - (6.0 - 3.0 * (1.0 - left))).abs() < 1e-4);
        // Request 3 shares all of request 1's full blocks: at the next output block, only
        // the tail is unshared.
        ledger.book(spec(3, &s, 64, &a, now)).unwrap();
        ledger.output_block(RequestId(1), None).unwrap();
        assert_eq!(
            s.load().prompt_decay,
            decayed(1, remaining_fraction(27, 100))
        );
        // Request 3 leaves: at the next block, blocks 3 and 4 are its own again.
        ledger.free(RequestId(3)).unwrap();
        ledger.output_block(RequestId(1), None).unwrap();
        assert_eq!(
            s.load().prompt_decay,
            decayed(3, remaining_fraction(43, 100))
        );
        // Request 2 (no expected output) never decays; freeing 1 takes its decay away.
        ledger.output_block(RequestId(2), None).unwrap();
        assert!(ledger.prompt_decay_anywhere());
        ledger.free(RequestId(1)).unwrap();
        assert!(!ledger.prompt_decay_anywhere());
        assert_eq!((s.load().prompt_decay, s.load().output_decay), (0, 0));
        ledger.free(RequestId(2)).unwrap();
        assert!(s.load().is_idle());
    }

    /// Tokens open blocks where the count crosses a boundary, however they are chunked, and
    /// mix with `output_block`; the first tokens release the prefill and give the TTFT.
    #[test]
    fn tokens_generated_open_blocks_at_boundaries() {
        let ledger = Ledger::new();
        let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let k = blocks(&[1, 2]);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        // 40 prompt tokens in 3 blocks (48 slots): output token 9 opens the first block.
        ledger.book(spec(1, &s, 40, &k, t0)).unwrap();
        let first = ledger
            .tokens_generated(RequestId(1), 8, Some(at(20)))
            .unwrap();
        assert!(first.prefill_released);
        assert_eq!(
            (first.ttft, first.itl, first.new_blocks),
            (Some(Duration::from_millis(20)), None, 0)
        );
        assert_eq!(s.load().prefill_tokens, 0);
        let next = ledger
            .tokens_generated(RequestId(1), 1, Some(at(30)))
            .unwrap();
        assert_eq!(
            (next.ttft, next.itl, next.itl_tokens, next.new_blocks),
            (None, Some(Duration::from_millis(10)), 1, 1)
        );
        // 9 + 40 = 49 tokens: blocks open at 9, 25 and 41.
        assert_eq!(
            ledger
                .tokens_generated(RequestId(1), 40, None)
                .unwrap()
                .new_blocks,
            2
        );
        assert_eq!(s.load().output_blocks, 3);
        // An output block call counts on from there; tokens then continue past it.
        ledger.output_block(RequestId(1), None).unwrap();
        assert_eq!(s.load().output_blocks, 4);
        assert_eq!(
            ledger
                .tokens_generated(RequestId(1), 8, None)
                .unwrap()
                .new_blocks,
            0,
            "57 + 8 = 65 < 73"
        );
        assert_eq!(
            ledger
                .tokens_generated(RequestId(1), 8, None)
                .unwrap()
                .new_blocks,
            1
        );
        assert_eq!(
            ledger
                .tokens_generated(RequestId(1), 0, None)
                .unwrap()
                .new_blocks,
            0
        );
        assert_eq!(ledger.free(RequestId(1)).unwrap().output_blocks, 5);
        assert!(s.load().is_idle());
        assert_eq!(
            ledger.tokens_generated(RequestId(1), 1, None),
            Err(LoadError::UnknownRequest {
                request: RequestId(1)
            })
        );
    }

    #[test]
    fn prompt_decay_off_decays_only_output_blocks() {
        let ledger = Ledger::with_prompt_decay(PromptDecay::Off);
        let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let a = blocks(&[1, 2, 3]);
        ledger
            .book(BookingSpec {
                expected_output_tokens: Some(10),
                ..spec(1, &s, 48, &a, Instant::now())
            })
            .unwrap();
        ledger.output_block(RequestId(1), None).unwrap();
        assert_eq!(s.load().prompt_decay, 0);
        assert!(s.load().output_decay > 0);
        ledger.free(RequestId(1)).unwrap();
        assert!(s.load().is_idle());
    }

    #[test]
    fn the_timeline_reports_ttft_block_intervals_and_dispatch() {
        let ledger = Ledger::new();
        let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let k = blocks(&[1, 2]);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        // 40 prompt tokens: the first output block opens at output token 9.
        ledger
            .book(BookingSpec {
                cached_tokens: 16,
                ..spec(1, &s, 40, &k, t0)
            })
            .unwrap();
        let step = ledger.output_block(RequestId(1), None).unwrap();
        assert_eq!((step.dispatch, step.elapsed), (Dispatch::NotYet, None));
        ledger.free(RequestId(1)).unwrap();

        ledger
            .book(BookingSpec {
                cached_tokens: 16,
                ..spec(2, &s, 40, &k, t0)
            })
            .unwrap();
        ledger.mark_dispatched(RequestId(2)).unwrap();
        let first = ledger.prefill_done(RequestId(2), Some(at(30))).unwrap();
        assert_eq!(first.elapsed, Some(Duration::from_millis(30)));
        assert_eq!(first.dispatch, Dispatch::Reached);
        let again = ledger.prefill_done(RequestId(2), Some(at(31))).unwrap();
        assert_eq!(again.elapsed, None, "TTFT once");
        let b1 = ledger.output_block(RequestId(2), Some(at(46))).unwrap();
        assert_eq!(
            (b1.elapsed, b1.tokens),
            (Some(Duration::from_millis(16)), 8)
        );
        let b2 = ledger.output_block(RequestId(2), Some(at(78))).unwrap();
        assert_eq!(
            (b2.elapsed, b2.tokens),
            (Some(Duration::from_millis(32)), 16)
        );
        let freed = ledger.free(RequestId(2)).unwrap();
        assert_eq!(
            (
                freed.prompt_tokens,
                freed.cached_tokens,
                freed.output_blocks,
                freed.dispatch
            ),
            (40, 16, 2, Dispatch::Reached)
        );
    }

    /// The booked-prefill floor follows every release down at once, and a refresh raises it
    /// to the least booked prefill of the ranks it is given, never above any of them.
    #[test]
    fn the_prefill_floor_follows_releases_down_and_refreshes_up() {
        let ledger = Ledger::new();
        let now = Instant::now();
        let a = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let b = Arc::new(RankState::new(WorkerRank::new(2, 0)));
        let k = blocks(&[1, 2]);
        ledger.book(spec(1, &a, 300, &k, now)).unwrap();
        ledger.book(spec(2, &a, 200, &k, now)).unwrap();
        ledger.book(spec(3, &b, 700, &k, now)).unwrap();
        assert_eq!(ledger.prefill_floor(), 0, "nothing known before a refresh");
        let ranks = [&*a, &*b];
        ledger.refresh_prefill_floor(ranks);
        assert_eq!(ledger.prefill_floor(), 500);
        // Each way prefill is released lowers it to the rank's new count at once.
        ledger.prefill_done(RequestId(2), None).unwrap();
        assert_eq!(ledger.prefill_floor(), 300);
        ledger.tokens_generated(RequestId(3), 5, None).unwrap();
        assert_eq!(ledger.prefill_floor(), 0);
        ledger.refresh_prefill_floor(ranks);
        assert_eq!(ledger.prefill_floor(), 0, "rank b has nothing booked now");
        ledger.book(spec(4, &b, 100, &k, now)).unwrap();
        ledger.refresh_prefill_floor(ranks);
        assert_eq!(ledger.prefill_floor(), 100);
        ledger.free(RequestId(1)).unwrap();
        assert_eq!(ledger.prefill_floor(), 0);
        ledger.refresh_prefill_floor(ranks);
        assert_eq!(ledger.prefill_floor(), 0);
        ledger.lower_prefill_floor(7);
        assert_eq!(ledger.prefill_floor(), 0, "lowering never raises");
        ledger.refresh_prefill_floor([]);
        assert_eq!(ledger.prefill_floor(), 0, "no ranks: nothing known");
    }
}

/// Loom models of the lifecycle races: the real ledger and counters, on loom's atomics and
/// mutexes (`crate::sync`). Run with
/// `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p kvroute-core --lib loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc as LoomArc;

    /// Loom's exhaustive search, bounded to two preemptions per execution (enough for the
    /// races below, each of which needs one thread to stop between two steps of another),
    /// so each model finishes in seconds.
    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(2);
        builder.check(f);
    }

    fn blocks(locals: &[u64]) -> Vec<LocalHash> {
        locals.iter().map(|&x| LocalHash(x)).collect()
    }

    fn book(
        ledger: &Ledger,
        state: &Arc<RankState>,
        id: u64,
        keys: &[LocalHash],
    ) -> Result<(), LoadError> {
        ledger.book(BookingSpec {
            request: RequestId(id),
            state,
            prefill_tokens: 16 * keys.len() as u64 + 3,
            block_hashes: keys,
            tail_blocks: 1,
            prompt_tokens: 16 * keys.len() as u64 + 3,
            cached_tokens: 0,
            block_size: 16,
            expected_output_tokens: Some(40),
            session: None,
            now: Instant::now(),
        })
    }

    /// Nothing is left on the rank: every counter and every prefix reference is back to zero.
    fn assert_idle(state: &RankState) {
        assert_eq!(state.load(), LoadView::default());
        assert_eq!(state.distinct_prefix_blocks(), 0);
    }

    /// A free by id, a guard's drop (which frees by the same id) and an expiry sweep race for
    /// one request with output blocks: exactly one of them frees it, the others are told it
    /// is unknown, and the rank's load returns to exactly zero.
    #[test]
    fn loom_free_by_id_guard_drop_and_expiry_free_exactly_once() {
        model(|| {
            let ledger = LoomArc::new(Ledger::new());
            let state = Arc::new(RankState::new(WorkerRank::new(1, 0)));
            let k = blocks(&[1, 2]);
            book(&ledger, &state, 7, &k).unwrap();
            ledger.output_block(RequestId(7), None).unwrap();
            let by_id = {
                let ledger = LoomArc::clone(&ledger);
                loom::thread::spawn(move || ledger.free(RequestId(7)).is_ok())
            };
            let expiry = {
                let ledger = LoomArc::clone(&ledger);
                loom::thread::spawn(move || ledger.expire(Instant::now(), Duration::ZERO))
            };
            // The guard's drop: `RequestGuard` frees its request by id through the router.
            let guard = ledger.free(RequestId(7)).is_ok();
            let by_id = by_id.join().unwrap();
            let expired = expiry.join().unwrap();
            assert_eq!(usize::from(by_id) + usize::from(guard) + expired, 1);
            assert_idle(&state);
            let c = ledger.counts();
            assert_eq!(c.freed + c.expired, 1);
            assert_eq!(c.unknown_requests, 2 - c.freed);
            assert_eq!(ledger.active(), 0);
        });
    }

    /// Two requests sharing a prefix are booked, advanced and freed on one rank at once: the
    /// shared blocks are counted once while both hold them (the prompt-block counter moves
    /// with the rank's prefix table, so no reading ever counts a freed request's blocks
    /// beside a new booking's copy of them), and the counters end at zero.
    #[test]
    fn loom_concurrent_book_and_free_on_one_rank_leave_the_counters_at_zero() {
        model(|| {
            let ledger = LoomArc::new(Ledger::new());
            let state = Arc::new(RankState::new(WorkerRank::new(1, 0)));
            let other = {
                let ledger = LoomArc::clone(&ledger);
                let state = Arc::clone(&state);
                loom::thread::spawn(move || {
                    let k = blocks(&[1, 2, 4]);
                    book(&ledger, &state, 2, &k).unwrap();
                    ledger.prefill_done(RequestId(2), None).unwrap();
                    ledger.free(RequestId(2)).unwrap();
                })
            };
            let k = blocks(&[1, 2, 3]);
            book(&ledger, &state, 1, &k).unwrap();
            ledger.output_block(RequestId(1), None).unwrap();
            let held = state.load().prompt_blocks;
            assert!(
                (4..=6).contains(&held),
                "own 3 blocks and tail, at most 2 more: {held}"
            );
            ledger.free(RequestId(1)).unwrap();
            other.join().unwrap();
            assert_idle(&state);
            assert_eq!(ledger.counts().freed, 2);
        });
    }

    /// A booking races its worker leaving (retire, then purge): whichever removes the
    /// booking undoes it, once.
    #[test]
    fn loom_booking_racing_a_leaving_worker_is_undone_once() {
        model(|| {
            let ledger = LoomArc::new(Ledger::new());
            let state = Arc::new(RankState::new(WorkerRank::new(3, 0)));
            let booker = {
                let ledger = LoomArc::clone(&ledger);
                let state = Arc::clone(&state);
                loom::thread::spawn(move || book(&ledger, &state, 1, &blocks(&[5])).is_ok())
            };
            state.retire();
            let purged = ledger.purge_worker(WorkerId(3));
            let booked = booker.join().unwrap();
            let c = ledger.counts();
            assert_eq!(c.purged + c.retired_races, 1);
            assert_eq!(purged as u64, c.purged);
            if booked {
                assert_eq!(purged, 1, "a booking that saw no retirement is purged");
            }
            assert_idle(&state);
            assert_eq!(ledger.active(), 0);
        });
    }

    /// A refresh of the booked-prefill floor races a release on one of its ranks and a
    /// booking on the other: once both are done, the floor is at most every rank's booked
    /// prefill (a refresh that swapped in a minimum read before the release must not leave
    /// it standing). The model fails if the refresh's second pass is taken out.
    #[test]
    fn loom_a_refresh_racing_a_release_never_leaves_the_floor_above_a_rank() {
        model(|| {
            let ledger = LoomArc::new(Ledger::new());
            let a = Arc::new(RankState::new(WorkerRank::new(1, 0)));
            let b = Arc::new(RankState::new(WorkerRank::new(2, 0)));
            book(&ledger, &a, 1, &blocks(&[1])).unwrap();
            book(&ledger, &b, 2, &blocks(&[2])).unwrap();
            let release = {
                let ledger = LoomArc::clone(&ledger);
                loom::thread::spawn(move || {
                    ledger.prefill_done(RequestId(1), None).unwrap();
                })
            };
            let refresh = {
                let (ledger, a, b) = (LoomArc::clone(&ledger), Arc::clone(&a), Arc::clone(&b));
                loom::thread::spawn(move || ledger.refresh_prefill_floor([&*a, &*b]))
            };
            book(&ledger, &b, 3, &blocks(&[3])).unwrap();
            release.join().unwrap();
            refresh.join().unwrap();
            let floor = ledger.prefill_floor();
            assert!(floor <= a.booked_prefill(), "{floor} over rank a");
            assert!(floor <= b.booked_prefill(), "{floor} over rank b");
        });
    }
}
