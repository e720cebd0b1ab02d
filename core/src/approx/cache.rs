//! [`ApproxCache`], the record table: writing a prompt's chain of checkpoints for a rank,
//! the search for a prompt's live records, retiring a rank's records, sweeps and counters.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::checkpoints::{
    checkpoint_at, checkpoint_count, checkpoint_keys_extend, first_checkpoint_from,
};
use super::nodes::{Holder, Inner, Node, Table};
use crate::event::{WorkerId, WorkerRank};
use crate::hash::LocalHash;
use crate::index::RankKey;

/// A record of a chain its rank already holds to the end, expiring less than this before the
/// new one would (in nanoseconds), leaves the chain as it is ([`ApproxCache::record`]).
pub(super) const REFRESH_SLACK_NS: i64 = 1_000_000;

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
