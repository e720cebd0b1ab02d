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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::event::{WorkerId, WorkerRank};
use crate::hash::LocalHash;
use crate::index::RankKey;
use crate::rng::mix64;

/// Blocks recorded one by one at the start of a prompt.
pub const DENSE_BLOCKS: usize = 16;

/// A record of a chain its rank already holds to the end, expiring less than this before the
/// new one would (in nanoseconds), leaves the chain as it is ([`ApproxCache::record`]).
const REFRESH_SLACK_NS: i64 = 1_000_000;
/// Past [`DENSE_BLOCKS`], one block in this many is recorded.
pub const STRIDE: usize = 16;

/// Whether block `i` of a prompt of `n` full blocks is a checkpoint.
#[cfg(test)]
fn is_checkpoint(i: usize, n: usize) -> bool {
    i < DENSE_BLOCKS || (i + 1) % STRIDE == 0 || i + 1 == n
}

/// The checkpoint positions of a prompt of `n` full blocks, in order.
#[cfg(test)]
fn checkpoints(n: usize) -> impl Iterator<Item = usize> + Clone {
    let dense = 0..n.min(DENSE_BLOCKS);
    let strided = (DENSE_BLOCKS..n).filter(move |&i| is_checkpoint(i, n));
    dense.chain(strided)
}

/// One rank's record of one prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    slot: u32,
    /// The slot's generation when written: a retired or reassigned slot's holders are dead.
    generation: u32,
    /// Expiry, in [`ApproxCache::tick`]s.
    expires: i64,
}

impl Holder {
    #[inline]
    fn fingerprint(self) -> u64 {
        mix64(
            (u64::from(self.slot) << 32 | u64::from(self.generation)) ^ mix64(self.expires as u64),
        )
    }
}

/// The ranks holding a record of one prefix.
#[derive(Debug, Default)]
struct Node {
    /// Sorted by slot.
    holders: Vec<Holder>,
    /// XOR of the holders' fingerprints.
    fingerprint: u64,
    /// The latest expiry of any holder, live or not (a bound; exact after a sweep).
    latest: i64,
}

impl Node {
    /// Where `slot`'s holder is (`Ok`) or would go (`Err`), trying `hint` first.
    #[inline]
    fn place(&self, slot: u32, hint: usize) -> Result<usize, usize> {
        match self.holders.get(hint) {
            Some(h) if h.slot == slot => Ok(hint),
            _ => self.holders.binary_search_by_key(&slot, |h| h.slot),
        }
    }

    fn refresh(&mut self) {
        self.fingerprint = self.holders.iter().fold(0, |f, h| f ^ h.fingerprint());
        self.latest = self
            .holders
            .iter()
            .map(|h| h.expires)
            .max()
            .unwrap_or(i64::MIN);
    }
}

/// A rank the table has records of.
#[derive(Clone, Copy, Debug)]
struct Slot {
    rank: WorkerRank,
    key: RankKey,
    /// Bumped when the rank's worker evicts or clears blocks, leaves, or re-registers: its
    /// older holders stop counting.
    generation: u32,
    /// The stamp of the last lookup that reported the rank.
    seen: u32,
}

/// A hasher for the table's keys, which are already mixed.
#[derive(Default, Clone, Copy, Debug)]
struct Mixed(u64);

impl std::hash::Hasher for Mixed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix64(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = mix64(self.0 ^ x);
    }
    fn write_u32(&mut self, x: u32) {
        self.0 = mix64(self.0 ^ u64::from(x));
    }
}

type Table<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<Mixed>>;

#[derive(Debug, Default)]
struct Inner {
    /// Prefix key → the ranks holding a record of it.
    nodes: Table<u64, Node>,
    /// Holders over all nodes (the cap counts these).
    records: usize,
    slots: Vec<Slot>,
    slot_of: Table<WorkerRank, u32>,
    /// Slots of ranks that left, for reuse.
    free: Vec<u32>,
    /// The current lookup's stamp (see [`Slot::seen`]).
    stamp: u32,
}

impl Inner {
    /// The slot of `rank` under `key`, made if new; a rank registered again under another key
    /// starts a new generation.
    fn slot(&mut self, rank: WorkerRank, key: RankKey) -> (u32, u32) {
        if let Some(&s) = self.slot_of.get(&rank) {
            let slot = &mut self.slots[s as usize];
            if slot.key != key {
                slot.key = key;
                slot.generation = slot.generation.wrapping_add(1);
            }
            return (s, slot.generation);
        }
        let s = match self.free.pop() {
            Some(s) => {
                let slot = &mut self.slots[s as usize];
                slot.rank = rank;
                slot.key = key;
                s
            }
            None => {
                self.slots.push(Slot {
                    rank,
                    key,
                    generation: 0,
                    seen: 0,
                });
                (self.slots.len() - 1) as u32
            }
        };
        self.slot_of.insert(rank, s);
        (s, self.slots[s as usize].generation)
    }

    /// Removes the holders `gone` says are gone from every node; returns how many.
    fn purge(&mut self, mut gone: impl FnMut(&Holder) -> bool) -> usize {
        let mut removed = 0;
        self.nodes.retain(|_, node| {
            let before = node.holders.len();
            node.holders.retain(|h| !gone(h));
            if node.holders.len() != before {
                removed += before - node.holders.len();
                node.refresh();
            }
            !node.holders.is_empty()
        });
        self.records -= removed;
        removed
    }
}

/// Counters of the record table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApproxCounts {
    /// Records held (live or awaiting a sweep).
    pub records: usize,
    /// Records written (checkpoint blocks, new or refreshed).
    pub written: u64,
    /// Records not written because the table was full.
    pub dropped: u64,
    /// Records removed by sweeps (expired or retired) and by workers leaving.
    pub swept: u64,
}

/// What a lookup reports to ([`ApproxCache::lookup_over`]).
pub trait Overlaps {
    /// `rank`, known to the index as `key`, holds live records of the prompt's first `depth`
    /// blocks (and of no deeper checkpoint of it); true when that raised what the receiver
    /// knew of the rank.
    fn raise(&mut self, rank: WorkerRank, key: RankKey, depth: u32) -> bool;
}

/// The record table (see the module comment).
#[derive(Debug)]
pub struct ApproxCache {
    inner: Mutex<Inner>,
    max_records: usize,
    /// The origin of ticks.
    base: Instant,
    /// Records held, readable without the lock (lookups skip the table while 0).
    len: AtomicUsize,
    written: AtomicU64,
    dropped: AtomicU64,
    swept: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ApproxCache {
    /// An empty table holding at most `max_records` records.
    pub fn new(max_records: usize) -> Self {
        ApproxCache {
            inner: Mutex::new(Inner::default()),
            max_records,
            base: Instant::now(),
            len: AtomicUsize::new(0),
            written: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            swept: AtomicU64::new(0),
        }
    }

    /// `t` in nanoseconds from the table's origin (negative before it).
    fn tick(&self, t: Instant) -> i64 {
        let clamp = |d: std::time::Duration| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX);
        match t.checked_duration_since(self.base) {
            Some(d) => clamp(d),
            None => -clamp(self.base.duration_since(t)),
        }
    }

    /// True when no record is held: lookups can be skipped.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len.load(Ordering::Relaxed) == 0
    }

    /// Records that `rank`, known to the index as `key`, caches the prompt whose checkpoint
    /// keys ([`checkpoint_keys_extend`], all of them) are `marks`, until `expires`. `serving` is asked under the table's lock:
    /// when it says the rank is leaving, nothing is written (its records may already have been
    /// removed, and must not come back).
    pub fn record(
        &self,
        marks: &[u64],
        rank: WorkerRank,
        key: RankKey,
        expires: Instant,
        serving: impl FnOnce() -> bool,
    ) {
        if marks.is_empty() {
            return;
        }
        let expires = self.tick(expires);
        let mut g = lock(&self.inner);
        if !serving() {
            return;
        }
        let inner = &mut *g;
        let (slot, generation) = inner.slot(rank, key);
        // The rank holds this chain to its end, at this generation, expiring less than
        // `REFRESH_SLACK_NS` before this record would: the chain is left as it is (a record
        // writes its whole chain with one expiry, and expiries only grow, so every node above
        // holds the rank at least as long). A burst of requests with one prompt on one rank
        // writes it once; the record may end up to the slack early, never late.
        if let Some(node) = marks.last().and_then(|m| inner.nodes.get(m)) {
            if let Ok(p) = node.place(slot, 0) {
                let h = &node.holders[p];
                if h.generation == generation
                    && h.expires > expires.saturating_sub(REFRESH_SLACK_NS)
                {
                    return;
                }
            }
        }
        let fresh = Holder {
            slot,
            generation,
            expires,
        };
        let (mut written, mut dropped) = (0u64, 0u64);
        // Nodes along a chain mostly hold the same ranks: the rank's place in one node is
        // tried first in the next.
        let mut hint = 0usize;
        for &mark in marks {
            let full = inner.records >= self.max_records;
            match inner.nodes.get_mut(&mark) {
                Some(node) => match node.place(slot, hint) {
                    Ok(p) => {
                        let h = &mut node.holders[p];
                        let new = if h.generation == generation {
                            Holder {
                                expires: h.expires.max(expires),
                                ..fresh
                            }
                        } else {
                            fresh
                        };
                        node.fingerprint ^= h.fingerprint() ^ new.fingerprint();
                        node.latest = node.latest.max(new.expires);
                        *h = new;
                        written += 1;
                        hint = p;
                    }
                    Err(_) if full => dropped += 1,
                    Err(p) => {
                        hint = p;
                        node.holders.insert(p, fresh);
                        node.fingerprint ^= fresh.fingerprint();
                        node.latest = node.latest.max(expires);
                        inner.records += 1;
                        written += 1;
                    }
                },
                None if full => dropped += 1,
                None => {
                    inner.nodes.insert(
                        mark,
                        Node {
                            holders: vec![fresh],
                            fingerprint: fresh.fingerprint(),
                            latest: expires,
                        },
                    );
                    inner.records += 1;
                    written += 1;
                }
            }
        }
        self.len.store(inner.records, Ordering::Relaxed);
        self.written.fetch_add(written, Ordering::Relaxed);
        self.dropped.fetch_add(dropped, Ordering::Relaxed);
    }

    /// For every rank with live records of the prompt whose full blocks hash to `locals`,
    /// calls `f(rank, blocks)` with the depth of its longest live record. `marks` holds the
    /// prompt's checkpoint keys computed so far ([`checkpoint_keys_extend`]) and is extended
    /// only as far as the search looks.
    pub fn lookup(
        &self,
        locals: &[LocalHash],
        marks: &mut Vec<u64>,
        now: Instant,
        f: impl FnMut(WorkerRank, u32),
    ) {
        struct Every<F>(F);
        impl<F: FnMut(WorkerRank, u32)> Overlaps for Every<F> {
            fn raise(&mut self, rank: WorkerRank, _: RankKey, depth: u32) -> bool {
                (self.0)(rank, depth);
                true
            }
        }
        self.lookup_over(locals, marks, now, 0, &mut Every(f));
    }

    /// [`ApproxCache::lookup`], reporting each rank with its index key: a galloping search
    /// for the deepest node holding anything live, then one read of each distinct node up
    /// the chain from there (see the module comment), down to `min_depth` blocks: a node
    /// shallower is not read (a caller to whom no overlap below that depth matters). True
    /// when some report raised what `out` knew.
    pub fn lookup_over(
        &self,
        locals: &[LocalHash],
        marks: &mut Vec<u64>,
        now: Instant,
        min_depth: u32,
        out: &mut impl Overlaps,
    ) -> bool {
        let n = locals.len();
        if n == 0 || self.is_empty() {
            return false;
        }
        let now = self.tick(now);
        let mut guard = lock(&self.inner);
        let Inner {
            nodes,
            slots,
            stamp,
            ..
        } = &mut *guard;
        let nodes = &*nodes;
        let count = checkpoint_count(n);
        let lives = |node: Option<&Node>| node.is_some_and(|x| x.latest > now);
        // Nodes nest along a chain: where none lives at the first checkpoint that matters
        // (the first, or the first at `min_depth` blocks or deeper), none lives deeper.
        let from = if min_depth > 1 {
            first_checkpoint_from(min_depth as usize - 1, n, count)
        } else {
            0
        };
        if from >= count || !lives(node_at(nodes, locals, marks, from)) {
            return false;
        }
        // The deepest checkpoint whose node may hold something live: gallop (doubling the
        // depth in blocks, as each probe costs the keys up to it), then bisect.
        let mut lo = from;
        let mut hi = loop {
            let probe = first_checkpoint_from(2 * checkpoint_at(lo, n) + 1, n, count).max(lo + 1);
            if probe >= count {
                break count;
            }
            if !lives(node_at(nodes, locals, marks, probe)) {
                break probe;
            }
            lo = probe;
        };
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if lives(node_at(nodes, locals, marks, mid)) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        *stamp = stamp.wrapping_add(1);
        if *stamp == 0 {
            slots.iter_mut().for_each(|s| s.seen = 0);
            *stamp = 1;
        }
        let stamp = *stamp;
        // Read the deepest node, then the deepest one that differs from it, and so on up.
        // Ranks are marked seen only where another node follows, and looked up only after
        // the first.
        let mut top = lo;
        let mut first = true;
        let mut raised = false;
        while let Some(at) = node_at(nodes, locals, marks, top) {
            // Nodes holding what `top` holds form a run ending at `top`: the node above
            // where it starts is read next.
            let same = |x: Option<&Node>| x.is_some_and(|x| x.fingerprint == at.fingerprint);
            // Nodes above `from` are shallower than `min_depth`: none of them is read.
            let next = if top == from || same(node_at(nodes, locals, marks, from)) {
                None
            } else {
                let (mut differs, mut equal) = (from, top);
                while equal - differs > 1 {
                    let mid = differs + (equal - differs) / 2;
                    if same(node_at(nodes, locals, marks, mid)) {
                        equal = mid;
                    } else {
                        differs = mid;
                    }
                }
                Some(differs)
            };
            let depth = (checkpoint_at(top, n) + 1) as u32;
            if depth < min_depth {
                break;
            }
            for h in &at.holders {
                let slot = &mut slots[h.slot as usize];
                if h.generation != slot.generation || h.expires <= now {
                    continue;
                }
                if !first {
                    if slot.seen == stamp {
                        continue;
                    }
                    slot.seen = stamp;
                } else if next.is_some() {
                    slot.seen = stamp;
                }
                if out.raise(slot.rank, slot.key, depth) {
                    raised = true;
                }
            }
            match next {
                Some(j) => top = j,
                None => break,
            }
            first = false;
        }
        raised
    }

    /// `rank`'s records stop counting (its worker evicted or cleared blocks).
    pub fn retire_rank(&self, rank: WorkerRank) {
        if self.is_empty() {
            return;
        }
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        if let Some(&s) = inner.slot_of.get(&rank) {
            let slot = &mut inner.slots[s as usize];
            slot.generation = slot.generation.wrapping_add(1);
        }
    }

    /// Every record of `worker` goes (it left), and its ranks' slots are freed.
    pub fn remove_worker(&self, worker: WorkerId) {
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        let mut leaving = Vec::new();
        inner.slot_of.retain(|r, &mut s| {
            let leaves = r.worker == worker;
            if leaves {
                leaving.push(s);
            }
            !leaves
        });
        if leaving.is_empty() {
            return;
        }
        let gone = inner.purge(|h| leaving.contains(&h.slot));
        for &s in &leaving {
            let slot = &mut inner.slots[s as usize];
            slot.generation = slot.generation.wrapping_add(1);
            inner.free.push(s);
        }
        self.swept.fetch_add(gone as u64, Ordering::Relaxed);
        self.len.store(inner.records, Ordering::Relaxed);
    }

    /// Removes expired and retired records; returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        if self.is_empty() {
            return 0;
        }
        let now = self.tick(now);
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        let slots = std::mem::take(&mut inner.slots);
        let gone =
            inner.purge(|h| h.expires <= now || h.generation != slots[h.slot as usize].generation);
        inner.slots = slots;
        self.swept.fetch_add(gone as u64, Ordering::Relaxed);
        self.len.store(inner.records, Ordering::Relaxed);
        gone
    }

    /// Counters.
    pub fn counts(&self) -> ApproxCounts {
        ApproxCounts {
            records: self.len.load(Ordering::Relaxed),
            written: self.written.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            swept: self.swept.load(Ordering::Relaxed),
        }
    }
}

/// The node of the `j`-th checkpoint of the prompt `locals`, its checkpoint keys extended as
/// far as needed.
#[inline]
fn node_at<'a>(
    nodes: &'a Table<u64, Node>,
    locals: &[LocalHash],
    marks: &mut Vec<u64>,
    j: usize,
) -> Option<&'a Node> {
    checkpoint_keys_extend(locals, marks, j + 1);
    nodes.get(&marks[j])
}

/// The key before a prompt's first checkpoint.
const MARK_SEED: u64 = 0x243f_6a88_85a3_08d3;

/// One step of a key chain: `(k ^ x) · M`, M odd; for a given `k` a bijection of `x` and for
/// a given `x` a bijection of `k` (see [`crate::load::prefix_keys_into`]).
#[inline(always)]
fn chain(k: u64, x: u64) -> u64 {
    (k ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A digest of the local hashes of a run of blocks, in four independent multiply chains folded
/// together. Each step of a chain takes a pair of blocks, the second rotated by an odd amount
/// first (so a pair and its swap differ unless the two hashes are equal or complements), and
/// a chain's step is its pair's position in the run mod 4: one multiply per two blocks, four
/// in flight, where one chain over the run would wait on each multiply in turn. The run's
/// length seeds the first chain, so runs of different lengths never meet by construction (a
/// lone last block chained alone would otherwise equal a pair ending in a zero hash).
#[inline(always)]
fn digest(run: &[LocalHash]) -> u64 {
    const SEEDS: [u64; 4] = [
        0x1319_8a2e_0370_7344,
        0xa409_3822_299f_31d0,
        0x082e_fa98_ec4e_6c89,
        0x4528_21e6_38d0_1377,
    ];
    #[inline(always)]
    fn pair(a: LocalHash, b: LocalHash) -> u64 {
        a.0 ^ b.0.rotate_left(23)
    }
    let mut lanes = SEEDS;
    lanes[0] ^= run.len() as u64;
    let mut eights = run.chunks_exact(8);
    for eight in &mut eights {
        for (lane, two) in lanes.iter_mut().zip(eight.chunks_exact(2)) {
            *lane = chain(*lane, pair(two[0], two[1]));
        }
    }
    let rest = eights.remainder();
    let mut twos = rest.chunks_exact(2);
    for (lane, two) in lanes.iter_mut().zip(&mut twos) {
        *lane = chain(*lane, pair(two[0], two[1]));
    }
    if let [last] = twos.remainder() {
        // A lone last block is chained alone, into a lane no pair of a run this short uses.
        lanes[3] = chain(lanes[3], last.0);
    }
    lanes[0] ^ lanes[1].rotate_left(16) ^ lanes[2].rotate_left(32) ^ lanes[3].rotate_left(48)
}

/// Continues `marks` (the checkpoint keys of the prompt `locals`, in checkpoint order) up to
/// checkpoint `upto` (exclusive; at most the prompt's checkpoints). The key of a checkpoint
/// chains the previous one with its run of blocks: the block itself in the dense part, a
/// digest of the blocks since the previous checkpoint past it. It names the prefix up to
/// that block: two prompts share it exactly when they share the prefix (a 2⁻⁶⁴ accident
/// aside), whatever their lengths, as the runs before a prompt's last block do not depend on
/// its length.
pub fn checkpoint_keys_extend(locals: &[LocalHash], marks: &mut Vec<u64>, upto: usize) {
    let n = locals.len();
    let upto = upto.min(checkpoint_count(n));
    let mut k = marks.last().copied().unwrap_or(MARK_SEED);
    let mut j = marks.len();
    marks.reserve(upto.saturating_sub(j));
    // The dense checkpoints are the blocks themselves.
    while j < upto.min(DENSE_BLOCKS) {
        k = chain(k, locals[j].0);
        marks.push(k);
        j += 1;
    }
    if j >= upto {
        return;
    }
    // Then runs of STRIDE blocks, the last one cut at the prompt's end.
    let mut start = checkpoint_at(j - 1, n) + 1;
    while j < upto {
        let end = checkpoint_at(j, n);
        let run = &locals[start..=end];
        // Every run but the last is a full stride: digested with its length known.
        let d = match <&[LocalHash; STRIDE]>::try_from(run) {
            Ok(full) => digest(full),
            Err(_) => digest(run),
        };
        k = chain(k, d);
        marks.push(k);
        start = end + 1;
        j += 1;
    }
}

/// Checkpoints of a prompt of `n` full blocks.
fn checkpoint_count(n: usize) -> usize {
    if n <= DENSE_BLOCKS {
        return n;
    }
    // Blocks i past the dense ones with (i + 1) a multiple of STRIDE.
    let strided = n / STRIDE - DENSE_BLOCKS / STRIDE;
    let last_extra = usize::from(n % STRIDE != 0);
    DENSE_BLOCKS + strided + last_extra
}

/// The index of the first checkpoint at or past block `i` of a prompt of `n` full blocks,
/// which has `count` of them (`count` when there is none).
fn first_checkpoint_from(i: usize, n: usize, count: usize) -> usize {
    let (mut lo, mut hi) = (0usize, count);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if checkpoint_at(mid, n) < i {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The `j`-th checkpoint of a prompt of `n` full blocks.
fn checkpoint_at(j: usize, n: usize) -> usize {
    if j < DENSE_BLOCKS.min(n) {
        return j;
    }
    // Strided checkpoints are the blocks i with (i + 1) % STRIDE == 0 past the dense ones.
    let first_strided = DENSE_BLOCKS.div_ceil(STRIDE) * STRIDE;
    let first_strided = if first_strided == DENSE_BLOCKS {
        first_strided + STRIDE
    } else {
        first_strided
    };
    let i = first_strided + (j - DENSE_BLOCKS) * STRIDE - 1;
    i.min(n - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn locals(seed: u64, n: usize) -> Vec<LocalHash> {
        (0..n as u64)
            .map(|i| LocalHash(mix64(seed * 1_000_003 + i)))
            .collect()
    }

    /// All the checkpoint keys of a prompt.
    fn marks_of(locals: &[LocalHash]) -> Vec<u64> {
        let mut k = Vec::new();
        checkpoint_keys_extend(locals, &mut k, usize::MAX);
        k
    }

    /// The index key the tests give a rank.
    fn key_of(r: WorkerRank) -> RankKey {
        RankKey {
            id: r.worker.0 as u32 * 8 + r.dp_rank.0,
            epoch: 0,
        }
    }

    fn rec(c: &ApproxCache, marks: &[u64], r: WorkerRank, until: Instant) {
        c.record(marks, r, key_of(r), until, || true);
    }

    /// `lookup` from scratch keys (as a route starts with few).
    fn look(c: &ApproxCache, l: &[LocalHash], now: Instant) -> Vec<(WorkerRank, u32)> {
        let mut keys = Vec::new();
        let mut got = Vec::new();
        c.lookup(l, &mut keys, now, |rank, d| got.push((rank, d)));
        got.sort();
        got
    }

    /// The closed forms agree with the definition, for every prompt length.
    #[test]
    fn checkpoint_positions_match_the_rule() {
        for n in 1..300 {
            let listed: Vec<usize> = checkpoints(n).collect();
            let literal: Vec<usize> = (0..n).filter(|&i| is_checkpoint(i, n)).collect();
            assert_eq!(listed, literal, "n = {n}");
            assert_eq!(checkpoint_count(n), literal.len(), "n = {n}");
            for (j, &i) in literal.iter().enumerate() {
                assert_eq!(checkpoint_at(j, n), i, "n = {n}, j = {j}");
            }
            for i in 0..n + 2 {
                let first = literal
                    .iter()
                    .position(|&c| c >= i)
                    .unwrap_or(literal.len());
                assert_eq!(
                    first_checkpoint_from(i, n, literal.len()),
                    first,
                    "n = {n}, i = {i}"
                );
            }
        }
    }

    /// A checkpoint's key names the prefix up to it, whatever the prompt's length: a prefix
    /// of a prompt has the prompt's keys at the checkpoints they share, and a different
    /// block anywhere before a checkpoint changes its key.
    #[test]
    fn checkpoint_keys_name_prefixes_at_any_length() {
        let a = locals(1, 300);
        let all = marks_of(&a);
        for n in 1..=a.len() {
            let part = marks_of(&a[..n]);
            assert_eq!(part.len(), checkpoint_count(n));
            // One block more, with a hash of 0 (or all ones): the shorter prompt's last key
            // is not among the longer one's, whatever the extra block.
            for extra in [0, u64::MAX] {
                let mut longer = a[..n].to_vec();
                longer.push(LocalHash(extra));
                let last = *part.last().unwrap();
                let is_checkpoint =
                    (0..checkpoint_count(n + 1)).any(|jj| checkpoint_at(jj, n + 1) == n - 1);
                assert_eq!(
                    marks_of(&longer).contains(&last),
                    is_checkpoint,
                    "n = {n}, extra {extra:#x}"
                );
            }
            for (j, &k) in part.iter().enumerate() {
                let i = checkpoint_at(j, n);
                match (0..all.len()).find(|&jj| checkpoint_at(jj, a.len()) == i) {
                    // The same block is a checkpoint of both: the same prefix, the same key.
                    Some(jj) => assert_eq!(k, all[jj], "n = {n}, block {i}"),
                    // The prefix's own last checkpoint: a prefix no checkpoint of `a` ends at.
                    None => assert!(!all.contains(&k), "n = {n}, block {i}"),
                }
            }
            // One block changed, or two swapped (within a pair, a run, or across runs), in
            // the dense part and past it: every key from the first one's checkpoint on
            // changes.
            for at in [11 % n, mix64(n as u64) as usize % n] {
                let mut b = a[..n].to_vec();
                b[at] = LocalHash(b[at].0 ^ 1);
                let mut variants = vec![(b, at)];
                for gap in [1, 2, 3, 7, 8, 17] {
                    if at + gap < n {
                        let mut b = a[..n].to_vec();
                        b.swap(at, at + gap);
                        variants.push((b, at + gap));
                    }
                }
                for (b, other) in variants {
                    let changed = marks_of(&b);
                    for (j, (&x, &y)) in part.iter().zip(&changed).enumerate() {
                        assert_eq!(
                            x == y,
                            checkpoint_at(j, n) < at,
                            "n = {n}, changed {at} and {other}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn depth_is_exact_when_dense_and_never_above_the_truth() {
        let c = ApproxCache::new(1 << 20);
        let t0 = Instant::now();
        let r = WorkerRank::new(1, 0);
        let a = locals(1, 100);
        rec(&c, &marks_of(&a[..10]), r, t0 + Duration::from_secs(5));
        assert_eq!(look(&c, &a, t0), vec![(r, 10)]);
        rec(&c, &marks_of(&a), r, t0 + Duration::from_secs(5));
        assert_eq!(
            look(&c, &a, t0),
            vec![(r, 100)],
            "the last block is a checkpoint"
        );
        for q in [1usize, 15, 16, 17, 20, 47, 63, 64, 99] {
            // A query that shares q blocks and then diverges.
            let mut b = a[..q].to_vec();
            b.extend(locals(9, 50));
            let d = look(&c, &b, t0)[0].1 as usize;
            assert!(d <= q && d + STRIDE > q, "q = {q}, found {d}");
            if q <= DENSE_BLOCKS {
                assert_eq!(d, q);
            }
        }
        assert!(look(&c, &locals(2, 30), t0).is_empty());
    }

    /// The galloping search computes only the keys it looks at: none past the first for a
    /// prompt no record starts, a few for a shallow record.
    #[test]
    fn lookup_extends_keys_only_as_far_as_it_looks() {
        let c = ApproxCache::new(1 << 20);
        let t0 = Instant::now();
        let a = locals(1, 512);
        rec(
            &c,
            &marks_of(&a[..3]),
            WorkerRank::new(1, 0),
            t0 + Duration::from_secs(5),
        );
        let other = locals(2, 512);
        let mut keys = Vec::new();
        c.lookup(&other, &mut keys, t0, |_, _| {});
        assert_eq!(keys.len(), 1);
        let mut keys = Vec::new();
        let mut depth = 0;
        c.lookup(&a, &mut keys, t0, |_, d| depth = d);
        assert_eq!(depth, 3);
        assert!(keys.len() <= 5, "{}", keys.len());
        assert_eq!(keys, marks_of(&a)[..keys.len()]);
    }

    /// Ranks searched one after another, most at one depth and some deeper or shallower (the
    /// search tries the previous rank's depth first), each get the depth they get alone.
    #[test]
    fn depths_of_ranks_in_a_row_match_each_rank_alone() {
        let t0 = Instant::now();
        let until = t0 + Duration::from_secs(5);
        let a = locals(3, 300);
        let depths = [
            30usize, 30, 30, 100, 30, 7, 30, 300, 31, 16, 17, 1, 299, 30, 64, 63, 65,
        ];
        let all = ApproxCache::new(1 << 20);
        let mut want = Vec::new();
        for (w, &d) in depths.iter().enumerate() {
            let r = WorkerRank::new(w as u64, 0);
            rec(&all, &marks_of(&a[..d]), r, until);
            let alone = ApproxCache::new(1 << 20);
            rec(&alone, &marks_of(&a[..d]), r, until);
            want.extend(look(&alone, &a, t0));
        }
        want.sort();
        assert_eq!(look(&all, &a, t0), want);
    }

    /// A record never outlives its TTL, and a longer-lived refresh of a prefix keeps the
    /// prefix only.
    #[test]
    fn records_never_outlive_their_ttl() {
        let c = ApproxCache::new(1 << 20);
        let t0 = Instant::now();
        let r = WorkerRank::new(1, 0);
        let a = locals(1, 40);
        rec(&c, &marks_of(&a), r, t0 + Duration::from_secs(2));
        rec(&c, &marks_of(&a[..8]), r, t0 + Duration::from_secs(10));
        let depth = |at: Instant| look(&c, &a, at).first().map_or(0, |x| x.1);
        assert_eq!(depth(t0 + Duration::from_millis(1999)), 40);
        assert_eq!(depth(t0 + Duration::from_secs(2)), 8);
        assert_eq!(depth(t0 + Duration::from_secs(10)), 0);
        // 18 checkpoints (blocks 0-15, 31, 39); the first 8 live on.
        assert_eq!(c.counts().records, 18);
        assert_eq!(c.sweep(t0 + Duration::from_secs(2)), 18 - 8);
        assert_eq!(c.sweep(t0 + Duration::from_secs(10)), 8);
        assert!(c.is_empty());
    }

    #[test]
    fn retiring_a_rank_drops_its_records_and_new_ones_count_again() {
        let c = ApproxCache::new(1 << 20);
        let t0 = Instant::now();
        let (r1, r2) = (WorkerRank::new(1, 0), WorkerRank::new(2, 0));
        let a = locals(1, 20);
        rec(&c, &marks_of(&a), r1, t0 + Duration::from_secs(5));
        rec(&c, &marks_of(&a), r2, t0 + Duration::from_secs(5));
        c.retire_rank(r1);
        assert_eq!(look(&c, &a, t0), vec![(r2, 20)]);
        rec(&c, &marks_of(&a[..5]), r1, t0 + Duration::from_secs(5));
        assert_eq!(look(&c, &a, t0), vec![(r1, 5), (r2, 20)]);
        // 17 checkpoints each (blocks 0-15, 19); rank 1 refreshed 5 of its own.
        assert_eq!(c.sweep(t0), 12, "the retired epoch's tail");
        c.remove_worker(WorkerId(2));
        assert_eq!(c.counts().records, 5);
    }

    /// A record asked for a rank that is leaving writes nothing: its worker's records may
    /// already be gone, and must not come back.
    #[test]
    fn a_leaving_rank_gets_no_records() {
        let c = ApproxCache::new(1 << 20);
        let t0 = Instant::now();
        let r = WorkerRank::new(1, 0);
        let k = marks_of(&locals(1, 20));
        c.record(&k, r, key_of(r), t0 + Duration::from_secs(1), || false);
        assert!(c.is_empty());
        assert_eq!(c.counts().written, 0);
    }

    #[test]
    fn the_cap_drops_and_counts() {
        let c = ApproxCache::new(10);
        let t0 = Instant::now();
        let k = marks_of(&locals(1, 14));
        rec(&c, &k, WorkerRank::new(1, 0), t0 + Duration::from_secs(1));
        let n = c.counts();
        assert_eq!((n.records, n.written, n.dropped), (10, 10, 4));
    }

    /// The table against a plain model (per rank: prefix key → generation and expiry, and a
    /// query's depth is its deepest checkpoint live for the rank), over random records on
    /// branching prompts, retirements, re-registrations, leaves, sweeps and lookups.
    #[test]
    fn agrees_with_a_plain_model() {
        /// Prefix key → (generation, expiry).
        type Records = HashMap<u64, (u32, Instant)>;
        #[derive(Default)]
        struct Model {
            /// rank → (key, generation, records).
            ranks: HashMap<WorkerRank, (RankKey, u32, Records)>,
        }
        impl Model {
            fn records(&self) -> usize {
                self.ranks.values().map(|r| r.2.len()).sum()
            }
        }
        let t0 = Instant::now();
        let ms = |x: u64| t0 + Duration::from_millis(x);
        let trunk = locals(1, 160);
        let branches: Vec<Vec<LocalHash>> = (0..4).map(|b| locals(10 + b, 120)).collect();
        let mut rng = crate::rng::Rng::new(7);
        let prompt = |rng: &mut crate::rng::Rng| {
            let cut = rng.below(trunk.len() as u64 + 1) as usize;
            let mut p = trunk[..cut].to_vec();
            let b = &branches[rng.below(branches.len() as u64) as usize];
            p.extend_from_slice(&b[..rng.below(b.len() as u64) as usize]);
            if p.is_empty() {
                p.push(trunk[0]);
            }
            p
        };
        for round in 0..40 {
            let c = ApproxCache::new(1 << 20);
            let mut m = Model::default();
            let mut epoch = 0u32;
            let mut epochs = HashMap::new();
            for _ in 0..300 {
                let r = WorkerRank::new(rng.below(6), rng.below(2) as u32);
                match rng.below(20) {
                    0..=9 => {
                        let p = prompt(&mut rng);
                        let marks = marks_of(&p);
                        let until = ms(rng.below(100));
                        let key = RankKey {
                            id: r.worker.0 as u32 * 2 + r.dp_rank.0,
                            epoch: *epochs.get(&r).unwrap_or(&0),
                        };
                        let entry = m.ranks.entry(r).or_insert((key, 0, HashMap::new()));
                        if entry.0 != key {
                            // Registered again: the older records stop counting.
                            entry.0 = key;
                            entry.1 += 1;
                        }
                        let (key, generation) = (entry.0, entry.1);
                        c.record(&marks, r, key, until, || true);
                        for &mark in &marks {
                            let e = entry.2.entry(mark).or_insert((generation, until));
                            *e = if e.0 == generation {
                                (generation, e.1.max(until))
                            } else {
                                (generation, until)
                            };
                        }
                    }
                    10..=11 => {
                        c.retire_rank(r);
                        if let Some(e) = m.ranks.get_mut(&r) {
                            e.1 += 1;
                        }
                    }
                    12 => {
                        // Registered again under a new key, from its next record on.
                        epoch += 1;
                        epochs.insert(r, epoch);
                    }
                    13 => {
                        c.remove_worker(r.worker);
                        m.ranks.retain(|x, _| x.worker != r.worker);
                    }
                    14 => {
                        let now = ms(rng.below(100));
                        let before = m.records();
                        for (_, generation, recs) in m.ranks.values_mut() {
                            recs.retain(|_, &mut (g, t)| g == *generation && t > now);
                        }
                        assert_eq!(c.sweep(now), before - m.records(), "round {round}");
                    }
                    _ => {
                        let q = prompt(&mut rng);
                        let now = ms(rng.below(100));
                        let kq = marks_of(&q);
                        let mut want = Vec::new();
                        for (&rank, (_, generation, recs)) in &m.ranks {
                            let deepest = (0..checkpoint_count(q.len()))
                                .filter(|&j| {
                                    recs.get(&kq[j])
                                        .is_some_and(|&(g, t)| g == *generation && t > now)
                                })
                                .map(|j| checkpoint_at(j, q.len()))
                                .max();
                            if let Some(i) = deepest {
                                want.push((rank, i as u32 + 1));
                            }
                        }
                        want.sort();
                        let mut got = Vec::new();
                        let mut keys = Vec::new();
                        c.lookup_over(&q, &mut keys, now, 0, &mut Keys(&m, &mut got));
                        got.sort();
                        assert_eq!(got, want, "round {round}");
                        assert_eq!(keys, kq[..keys.len()]);
                        // Down to a least depth: the same reports, less those shallower.
                        let least = rng.below(q.len() as u64 + 2) as u32;
                        let mut deep = Vec::new();
                        c.lookup_over(&q, &mut keys, now, least, &mut Keys(&m, &mut deep));
                        deep.sort();
                        want.retain(|&(_, d)| d >= least);
                        assert_eq!(deep, want, "round {round}, from {least} blocks");
                    }
                }
                assert_eq!(c.counts().records, m.records(), "round {round}");
            }
        }

        /// Checks each reported key against the model's.
        struct Keys<'a>(&'a Model, &'a mut Vec<(WorkerRank, u32)>);
        impl Overlaps for Keys<'_> {
            fn raise(&mut self, rank: WorkerRank, key: RankKey, depth: u32) -> bool {
                assert_eq!(self.0.ranks[&rank].0, key);
                self.1.push((rank, depth));
                true
            }
        }
    }

    /// Many ranks recorded with one system prompt, each with its own tail: a query sharing the
    /// prompt gets every rank at the prompt's depth, and ranks recorded deeper or shallower
    /// at theirs, while looking at few keys past the shared depth.
    #[test]
    fn ranks_sharing_a_prompt_are_read_together() {
        let c = ApproxCache::new(1 << 20);
        let t0 = Instant::now();
        let until = t0 + Duration::from_secs(5);
        let system = locals(1, 64);
        for w in 0..256u64 {
            let mut p = system.clone();
            p.extend(locals(100 + w, 64));
            rec(&c, &marks_of(&p), WorkerRank::new(w, 0), until);
        }
        // Two ranks hold shallower records only: of 20 blocks (the query sees its first 16,
        // the checkpoints they share), and of 3.
        rec(&c, &marks_of(&system[..20]), WorkerRank::new(300, 0), until);
        rec(&c, &marks_of(&system[..3]), WorkerRank::new(301, 0), until);
        let mut q = system.clone();
        q.extend(locals(7, 448));
        let mut keys = Vec::new();
        let mut got = Vec::new();
        c.lookup(&q, &mut keys, t0, |r, d| got.push((r.worker.0, d)));
        got.sort();
        let mut want: Vec<(u64, u32)> = (0..256).map(|w| (w, 64)).collect();
        want.extend([(300, 16), (301, 3)]);
        assert_eq!(got, want);
        // The gallop doubles the depth in blocks: it stops at the first checkpoint past 127
        // (the 23rd).
        assert!(keys.len() <= 23, "{}", keys.len());
    }

    /// A record of a chain the rank already holds to its end, expiring within the slack of
    /// the one held, writes nothing; one that expires later by more, one that goes deeper,
    /// and one made after the rank was retired each write their chain.
    #[test]
    fn a_record_the_rank_already_holds_is_not_written_again() {
        let c = ApproxCache::new(1 << 20);
        let t0 = Instant::now();
        let r = WorkerRank::new(1, 0);
        let p = locals(1, 64);
        let marks = marks_of(&p);
        let slack = Duration::from_nanos(REFRESH_SLACK_NS as u64);
        let until = t0 + Duration::from_secs(5);
        rec(&c, &marks, r, until);
        let written = c.counts().written;
        assert_eq!(written, marks.len() as u64);
        // Within the slack, and a prefix of the chain: nothing written, the first expiry kept.
        rec(&c, &marks, r, until + slack / 2);
        rec(&c, &marks_of(&p[..32]), r, until + slack / 2);
        assert_eq!(c.counts().written, written);
        assert_eq!(look(&c, &p, until + slack / 4), vec![]);
        assert_eq!(look(&c, &p, until - slack / 4), vec![(r, 64)]);
        // Later by more than the slack: the chain is refreshed.
        rec(&c, &marks, r, until + 2 * slack);
        assert_eq!(c.counts().written, 2 * written);
        assert_eq!(look(&c, &p, until + slack), vec![(r, 64)]);
        // Deeper: written.
        let mut longer = p.clone();
        longer.extend(locals(2, 16));
        rec(&c, &marks_of(&longer), r, until + 2 * slack);
        assert_eq!(
            c.counts().written,
            2 * written + marks_of(&longer).len() as u64
        );
        // Retired, then recorded within the slack: written again, and counted in lookups.
        c.retire_rank(r);
        assert_eq!(look(&c, &p, t0), vec![]);
        rec(&c, &marks, r, until + 2 * slack);
        assert_eq!(look(&c, &p, t0), vec![(r, 64)]);
    }
}
