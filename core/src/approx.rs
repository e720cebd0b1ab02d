//! Cache records the router writes itself: for workers that publish no KV events (approximate
//! mode), and, optionally and briefly, for workers that do (speculative records).
//!
//! ```text
//!   route ──booked on rank r──▶ record(prefix keys of the prompt, r, now + TTL)
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
//! from the worker retires its records at once (a per-rank epoch), so speculation never claims
//! blocks the worker said it dropped.
//!
//! **Structure.** Per rank, a table of `prefix key → (expiry, epoch)` (a search probes one
//! rank's records, so it stays in one small table), and an index of the ranks by the key of
//! each recorded prompt's first block. Prefix keys are the router's chained keys of the
//! prompt's blocks ([`crate::load::prefix_keys_into`]): equal keys mean equal prefixes. A route
//! records the whole chain with one expiry, and a key already present keeps the later of its
//! two expiries, so along any recorded chain expiries never increase: the live records of a
//! rank are closed under prefixes, and a query's depth on a rank is found by a galloping
//! search, which computes the query's prefix keys only as far as it looks. The search starts at
//! the first block, or past the rank's floor when the caller gives one (the index's overlap: a
//! record no deeper than what the index already says costs one probe), and tries the previous
//! rank's depth first (ranks recorded with one prompt end at one depth). To keep a long
//! prompt's record cheap, only *checkpoint* blocks are written: the first [`DENSE_BLOCKS`],
//! then every [`STRIDE`]-th, and the last; a depth is therefore exact up to [`DENSE_BLOCKS`]
//! and otherwise found to within [`STRIDE`] − 1 blocks below the truth (never above). The table
//! is capped; records past the cap are dropped and counted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::event::{WorkerId, WorkerRank};
use crate::hash::LocalHash;
use crate::load::prefix_keys_extend;
use crate::rng::mix64;

/// Blocks recorded one by one at the start of a prompt.
pub const DENSE_BLOCKS: usize = 16;
/// Past [`DENSE_BLOCKS`], one block in this many is recorded.
pub const STRIDE: usize = 16;

/// Whether block `i` of a prompt of `n` full blocks is a checkpoint.
#[inline]
fn is_checkpoint(i: usize, n: usize) -> bool {
    i < DENSE_BLOCKS || (i + 1) % STRIDE == 0 || i + 1 == n
}

/// The checkpoint positions of a prompt of `n` full blocks, in order.
fn checkpoints(n: usize) -> impl Iterator<Item = usize> + Clone {
    let dense = 0..n.min(DENSE_BLOCKS);
    let strided = (DENSE_BLOCKS..n).filter(move |&i| is_checkpoint(i, n));
    dense.chain(strided)
}

#[derive(Clone, Copy, Debug)]
struct Record {
    expires: Instant,
    epoch: u32,
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

/// One rank's records. Kept apart from other ranks' so that the probes of one search, all
/// for one rank, land in one small table.
#[derive(Debug, Default)]
struct RankRecords {
    /// Bumped when the rank's worker evicts or clears blocks: older records stop counting.
    epoch: u32,
    /// Prefix key → record.
    records: Table<u64, Record>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Ranks holding records, with their records.
    ranks: Table<WorkerRank, RankRecords>,
    /// Records held, over all ranks (the cap counts these).
    records: usize,
    /// The key of a recorded prompt's first block → the ranks it was recorded on: a lookup
    /// visits only the ranks whose records start like the query.
    heads: Table<u64, Vec<WorkerRank>>,
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
    /// Records removed by sweeps (expired or retired).
    pub swept: u64,
}

/// What a lookup reports to ([`ApproxCache::lookup_over`]).
pub trait Overlaps {
    /// Leading blocks of the prompt already known cached on `rank` (by the index): only a
    /// record deeper than this is reported.
    fn floor(&self, rank: WorkerRank) -> u32;
    /// `rank` holds live records of the prompt's first `depth` blocks, more than its floor.
    fn raise(&mut self, rank: WorkerRank, depth: u32);
}

/// The record table (see the module comment).
#[derive(Debug)]
pub struct ApproxCache {
    inner: Mutex<Inner>,
    max_records: usize,
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
            len: AtomicUsize::new(0),
            written: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            swept: AtomicU64::new(0),
        }
    }

    /// True when no record is held: lookups can be skipped.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len.load(Ordering::Relaxed) == 0
    }

    /// Records that `rank` caches the prompt whose full blocks have prefix `keys`, until
    /// `expires`.
    pub fn record(&self, keys: &[u64], rank: WorkerRank, expires: Instant) {
        if keys.is_empty() {
            return;
        }
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        let rr = inner.ranks.entry(rank).or_default();
        let heads = inner.heads.entry(keys[0]).or_default();
        if !heads.contains(&rank) {
            heads.push(rank);
        }
        let (mut written, mut dropped) = (0u64, 0u64);
        for i in checkpoints(keys.len()) {
            let full = inner.records >= self.max_records;
            match rr.records.get_mut(&keys[i]) {
                Some(r) if r.epoch == rr.epoch => {
                    r.expires = r.expires.max(expires);
                    written += 1;
                }
                Some(r) => {
                    *r = Record {
                        expires,
                        epoch: rr.epoch,
                    };
                    written += 1;
                }
                None if full => dropped += 1,
                None => {
                    rr.records.insert(
                        keys[i],
                        Record {
                            expires,
                            epoch: rr.epoch,
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
    /// calls `f(rank, blocks)` with the depth of its longest live record. `keys` holds the
    /// prompt's prefix keys computed so far and is extended only as far as the search looks:
    /// a galloping search from the first block, so a shallow or absent record costs a few
    /// keys, not the whole prompt's.
    pub fn lookup(
        &self,
        locals: &[LocalHash],
        keys: &mut Vec<u64>,
        now: Instant,
        f: impl FnMut(WorkerRank, u32),
    ) {
        struct Every<F>(F);
        impl<F: FnMut(WorkerRank, u32)> Overlaps for Every<F> {
            fn floor(&self, _: WorkerRank) -> u32 {
                0
            }
            fn raise(&mut self, rank: WorkerRank, depth: u32) {
                (self.0)(rank, depth)
            }
        }
        self.lookup_over(locals, keys, now, &mut Every(f));
    }

    /// [`ApproxCache::lookup`] for ranks whose overlap is partly known already (the index's):
    /// a rank's search starts at the first checkpoint past its floor, so a record no deeper
    /// than the floor costs one probe (none when the floor is past the prompt), and only
    /// depths above the floor are reported.
    pub fn lookup_over(
        &self,
        locals: &[LocalHash],
        keys: &mut Vec<u64>,
        now: Instant,
        out: &mut impl Overlaps,
    ) {
        let n = locals.len();
        if n == 0 || self.is_empty() {
            return;
        }
        prefix_keys_extend(locals, keys, 1);
        let key0 = keys[0];
        let mut guard = lock(&self.inner);
        let inner = &mut *guard;
        let Some(heads) = inner.heads.get_mut(&key0) else {
            return;
        };
        let ranks = &inner.ranks;
        let count = checkpoint_count(n);
        let mut last_depth: Option<usize> = None;
        // One pass over the ranks whose records start like the query. A rank whose first
        // record expired or was retired leaves the list when it is looked at there (no
        // allocation; a new record puts it back, and sweeps clear the rest).
        heads.retain(|&rank| {
            let Some(rr) = ranks.get(&rank) else {
                return false;
            };
            let live_at = |key: u64| {
                rr.records
                    .get(&key)
                    .is_some_and(|r| r.epoch == rr.epoch && r.expires > now)
            };
            // The first checkpoint at or past the floor: a record ending before it adds nothing.
            let floor = out.floor(rank) as usize;
            let (mut start, mut end) = (0usize, count);
            while start < end {
                let mid = start + (end - start) / 2;
                if checkpoint_at(mid, n) < floor {
                    start = mid + 1;
                } else {
                    end = mid;
                }
            }
            if start == count {
                return true;
            }
            let mut live = |j: usize| {
                let i = checkpoint_at(j, n);
                prefix_keys_extend(locals, keys, i + 1);
                live_at(keys[i])
            };
            if !live(start) {
                // Dead at its first record: gone for good. Dead later: kept (records are
                // closed under prefixes, so nothing deeper is live either).
                return start > 0;
            }
            // `lo` is live, `hi` dead (or the end). Ranks recorded with one prompt end at one
            // depth, so the previous rank's depth is tried first: two probes when it holds.
            let mut lo = start;
            let mut hi = None;
            if let Some(h) = last_depth.filter(|&h| h > lo) {
                if !live(h) {
                    hi = Some(h);
                } else {
                    lo = h;
                    if h + 1 >= count || !live(h + 1) {
                        hi = Some(h + 1);
                    } else {
                        lo = h + 1;
                    }
                }
            }
            // Else gallop to a dead checkpoint (or the end); then bisect.
            let mut hi = match hi {
                Some(hi) => hi,
                None => {
                    let mut step = 1usize;
                    loop {
                        let probe = lo + step;
                        if probe >= count {
                            break count;
                        }
                        if !live(probe) {
                            break probe;
                        }
                        lo = probe;
                        step *= 2;
                    }
                }
            };
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if live(mid) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            last_depth = Some(lo);
            out.raise(rank, (checkpoint_at(lo, n) + 1) as u32);
            true
        });
    }

    /// `rank`'s records stop counting (its worker evicted or cleared blocks).
    pub fn retire_rank(&self, rank: WorkerRank) {
        if self.is_empty() {
            return;
        }
        if let Some(rr) = lock(&self.inner).ranks.get_mut(&rank) {
            rr.epoch = rr.epoch.wrapping_add(1);
        }
    }

    /// Every record of `worker` goes (it left).
    pub fn remove_worker(&self, worker: WorkerId) {
        if self.is_empty() {
            return;
        }
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        let mut gone = 0;
        inner.ranks.retain(|r, rr| {
            let leaves = r.worker == worker;
            if leaves {
                gone += rr.records.len();
            }
            !leaves
        });
        inner.records -= gone;
        inner.heads.retain(|_, ranks| {
            ranks.retain(|r| r.worker != worker);
            !ranks.is_empty()
        });
        self.swept.fetch_add(gone as u64, Ordering::Relaxed);
        self.len.store(inner.records, Ordering::Relaxed);
    }

    /// Removes expired and retired records; returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        if self.is_empty() {
            return 0;
        }
        let mut g = lock(&self.inner);
        let inner = &mut *g;
        let mut gone = 0;
        inner.ranks.retain(|_, rr| {
            let (epoch, before) = (rr.epoch, rr.records.len());
            rr.records
                .retain(|_, r| r.epoch == epoch && r.expires > now);
            gone += before - rr.records.len();
            !rr.records.is_empty()
        });
        inner.records -= gone;
        let ranks = &inner.ranks;
        inner.heads.retain(|key, list| {
            list.retain(|r| ranks.get(r).is_some_and(|rr| rr.records.contains_key(key)));
            !list.is_empty()
        });
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

/// Checkpoints of a prompt of `n` full blocks.
fn checkpoint_count(n: usize) -> usize {
    if n <= DENSE_BLOCKS {
        return n;
    }
    let strided = (DENSE_BLOCKS + 1..=n).filter(|j| j % STRIDE == 0).count();
    let last_extra = usize::from(n % STRIDE != 0);
    DENSE_BLOCKS + strided + last_extra
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

    fn keys_of(locals: &[LocalHash]) -> Vec<u64> {
        let mut k = Vec::new();
        crate::load::prefix_keys_into(locals, &mut k);
        k
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
        }
    }

    #[test]
    fn depth_is_exact_when_dense_and_never_above_the_truth() {
        let c = ApproxCache::new(1 << 20);
        let t0 = Instant::now();
        let r = WorkerRank::new(1, 0);
        let a = locals(1, 100);
        let ka = keys_of(&a);
        c.record(&ka[..10], r, t0 + Duration::from_secs(5));
        assert_eq!(look(&c, &a, t0), vec![(r, 10)]);
        c.record(&ka, r, t0 + Duration::from_secs(5));
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
        c.record(
            &keys_of(&a[..3]),
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
        assert_eq!(keys, keys_of(&a[..keys.len()]));
    }

    /// With floors, a lookup reports what a plain lookup reports above each floor and
    /// nothing else, and a record no deeper than its floor costs one key past it.
    #[test]
    fn floors_report_only_deeper_records_and_search_from_the_floor() {
        struct Floors {
            floors: HashMap<WorkerRank, u32>,
            got: Vec<(WorkerRank, u32)>,
        }
        impl Overlaps for Floors {
            fn floor(&self, rank: WorkerRank) -> u32 {
                self.floors.get(&rank).copied().unwrap_or(0)
            }
            fn raise(&mut self, rank: WorkerRank, depth: u32) {
                assert!(depth > self.floor(rank));
                self.got.push((rank, depth));
            }
        }
        let c = ApproxCache::new(1 << 20);
        let t0 = Instant::now();
        let a = locals(1, 300);
        let ka = keys_of(&a);
        let until = t0 + Duration::from_secs(5);
        for (w, depth) in (0..40u64).zip((5..300).step_by(7)) {
            c.record(&ka[..depth], WorkerRank::new(w, 0), until);
        }
        let plain = look(&c, &a, t0);
        assert_eq!(plain.len(), 40);
        for floor in [0u32, 1, 16, 17, 40, 64, 100, 250, 299, 300, 1000] {
            let mut f = Floors {
                floors: (0..40).map(|w| (WorkerRank::new(w, 0), floor)).collect(),
                got: Vec::new(),
            };
            let mut keys = Vec::new();
            c.lookup_over(&a, &mut keys, t0, &mut f);
            f.got.sort();
            let want: Vec<(WorkerRank, u32)> =
                plain.iter().copied().filter(|&(_, d)| d > floor).collect();
            assert_eq!(f.got, want, "floor {floor}");
        }
        // Every record below a floor of 250: the search looks at one key past the floor.
        let mut f = Floors {
            floors: (0..40).map(|w| (WorkerRank::new(w, 0), 250)).collect(),
            got: Vec::new(),
        };
        let c2 = ApproxCache::new(1 << 20);
        for w in 0..40u64 {
            c2.record(&ka[..100], WorkerRank::new(w, 0), until);
        }
        let mut keys = Vec::new();
        c2.lookup_over(&a, &mut keys, t0, &mut f);
        assert!(f.got.is_empty());
        assert!(keys.len() <= 256, "{}", keys.len());
    }

    /// Ranks searched one after another, most at one depth and some deeper or shallower (the
    /// search tries the previous rank's depth first), each get the depth they get alone.
    #[test]
    fn depths_of_ranks_in_a_row_match_each_rank_alone() {
        let t0 = Instant::now();
        let until = t0 + Duration::from_secs(5);
        let a = locals(3, 300);
        let ka = keys_of(&a);
        let depths = [
            30usize, 30, 30, 100, 30, 7, 30, 300, 31, 16, 17, 1, 299, 30, 64, 63, 65,
        ];
        let all = ApproxCache::new(1 << 20);
        let mut want = Vec::new();
        for (w, &d) in depths.iter().enumerate() {
            let r = WorkerRank::new(w as u64, 0);
            all.record(&ka[..d], r, until);
            let alone = ApproxCache::new(1 << 20);
            alone.record(&ka[..d], r, until);
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
        let ka = keys_of(&a);
        c.record(&ka, r, t0 + Duration::from_secs(2));
        c.record(&ka[..8], r, t0 + Duration::from_secs(10));
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
        let ka = keys_of(&a);
        c.record(&ka, r1, t0 + Duration::from_secs(5));
        c.record(&ka, r2, t0 + Duration::from_secs(5));
        c.retire_rank(r1);
        assert_eq!(look(&c, &a, t0), vec![(r2, 20)]);
        c.record(&ka[..5], r1, t0 + Duration::from_secs(5));
        assert_eq!(look(&c, &a, t0), vec![(r1, 5), (r2, 20)]);
        // 17 checkpoints each (blocks 0-15, 19); rank 1 refreshed 5 of its own.
        assert_eq!(c.sweep(t0), 12, "the retired epoch's tail");
        c.remove_worker(WorkerId(2));
        assert_eq!(c.counts().records, 5);
    }

    #[test]
    fn the_cap_drops_and_counts() {
        let c = ApproxCache::new(10);
        let t0 = Instant::now();
        let k = keys_of(&locals(1, 14));
        c.record(&k, WorkerRank::new(1, 0), t0 + Duration::from_secs(1));
        let n = c.counts();
        assert_eq!((n.records, n.written, n.dropped), (10, 10, 4));
    }
}
