//! The child table: a single-writer, many-reader hash table from (parent position, next block
//! hash) to the child run that continues the chain there.
//!
//! One table per shard holds every branch of that shard's tree, so that a run with thousands of
//! children (a system prompt followed by many conversations) costs one probe per lookup and one
//! entry per child, with nothing copied when a child is added.
//!
//! Entries are four atomic words `[meta, hash, value, run]` in open addressing with linear
//! probing; `run` is the address of the child's current array, so that a walk reaches the run
//! without first loading its slot.
//! `meta` packs the parent position, a 16-bit version and a state (empty, tombstone, busy,
//! live). Each entry is a small seqlock: the writer marks it busy, writes `hash` and `value`,
//! then publishes the new `meta` with `Release`; a reader loads `meta` with `Acquire`, reads
//! the other two words, and accepts them only if `meta` has not changed in between. When the
//! table fills up, the writer builds a larger one and publishes it through an `ArcSwap`;
//! readers still holding the old one finish on it, and it is freed when the last of them lets go.

use std::sync::Arc;

use super::primitive::{fence, AtomicU64, Ordering};

use arc_swap::ArcSwap;

const EMPTY: u64 = 0;
const TOMB: u64 = 1;
const BUSY: u64 = 3;
const LIVE: u64 = 2;
const STATE: u64 = 0xFF;
const VERSION: u64 = 0xFFFF << 8;
/// The bits of `meta` that name the key.
const KEY: u64 = !(VERSION | STATE);
#[cfg(not(loom))]
const MIN_CAPACITY: usize = 256;
#[cfg(loom)]
const MIN_CAPACITY: usize = 2;

/// Parent slot value that stands for the shard's root.
pub(crate) const ROOT: u32 = u32::MAX;

/// Key of a branch: the child continues the chain after position `(parent, off)` with `hash`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ChildKey {
    pub parent: u32,
    pub off: u8,
    pub hash: u64,
}

impl ChildKey {
    /// The key bits of `meta`: parent slot and offset.
    #[inline]
    fn meta(self) -> u64 {
        ((self.parent as u64) << 32) | ((self.off as u64) << 24)
    }
}

/// `meta` with its version advanced by one and the given state.
#[inline]
fn next_meta(old: u64, key: u64, state: u64) -> u64 {
    let version = (old.wrapping_add(1 << 8)) & VERSION;
    key | version | state
}

#[inline]
fn home(meta: u64, hash: u64, mask: usize) -> usize {
    let x = (hash ^ meta.rotate_left(29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((x ^ (x >> 32)) as usize) & mask
}

/// One entry: `meta`, the key's hash and the child's slot (the seqlocked words), and the
/// child run's current array (see [`TableInner::get`]). Four words, aligned so that an
/// entry never straddles two cache lines.
#[repr(C, align(32))]
struct Entry {
    meta: AtomicU64,
    hash: AtomicU64,
    value: AtomicU64,
    run: AtomicU64,
}

impl Entry {
    fn empty() -> Self {
        Entry {
            meta: AtomicU64::new(EMPTY),
            hash: AtomicU64::new(0),
            value: AtomicU64::new(0),
            run: AtomicU64::new(0),
        }
    }
}

pub(crate) struct TableInner {
    mask: usize,
    entries: Box<[Entry]>,
}

impl TableInner {
    fn with_capacity(cap: usize) -> Self {
        let cap = cap.next_power_of_two().max(MIN_CAPACITY);
        TableInner {
            mask: cap - 1,
            entries: (0..cap).map(|_| Entry::empty()).collect(),
        }
    }

    fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Hints the CPU to fetch the entry a lookup of `key` starts at.
    #[inline]
    pub(crate) fn prefetch(&self, key: ChildKey) {
        let i = home(key.meta(), key.hash, self.mask);
        super::mix::prefetch_read(&self.entries[i]);
    }

    /// Looks a key up. Any thread. Returns the child's slot and the address of the array its
    /// slot held when the lookup read the entry (0 if none), which the writer keeps equal to
    /// the slot's: it stores a new array's address here before it retires the old one, and
    /// removes the entry before it retires the array of a slot it clears. An address read
    /// under an epoch pin taken before the table was loaded is therefore alive until the pin
    /// ends, as the slot's own pointer would be.
    #[inline]
    pub(crate) fn get(&self, key: ChildKey) -> Option<(u32, u64)> {
        let meta = key.meta();
        let mut i = home(meta, key.hash, self.mask);
        let mut probes = 0;
        while probes <= self.mask {
            let e = &self.entries[i];
            // Acquire: pairs with the writer's Release store of meta, so that the hash and
            // value written before it are visible.
            let m1 = e.meta.load(Ordering::Acquire);
            if m1 == EMPTY {
                return None;
            }
            if m1 & STATE == LIVE && m1 & KEY == meta {
                let hash = e.hash.load(Ordering::Relaxed);
                let value = e.value.load(Ordering::Relaxed);
                // Acquire: pairs with the Release store of a new array's address, so that its
                // words are visible.
                let run = e.run.load(Ordering::Acquire);
                // Acquire fence: if either load saw a later write, the writer's Release fence
                // before that write makes its busy mark visible to the re-check below.
                fence(Ordering::Acquire);
                if e.meta.load(Ordering::Relaxed) != m1 {
                    continue; // rewritten while read: look at the same entry again
                }
                if hash == key.hash {
                    return Some((value as u32, run));
                }
            }
            i = (i + 1) & self.mask;
            probes += 1;
        }
        None
    }

    /// Inserts a key known to be absent, with the child's slot and array address. Writer
    /// only. Returns the entry's index and whether a tombstone was reused.
    fn insert(&self, key: ChildKey, value: u32, run: u64) -> (usize, bool) {
        let meta = key.meta();
        let mut i = home(meta, key.hash, self.mask);
        loop {
            let e = &self.entries[i];
            let m = e.meta.load(Ordering::Relaxed);
            if m == EMPTY || m & STATE == TOMB {
                let busy = next_meta(m, m & KEY, BUSY);
                e.meta.store(busy, Ordering::Relaxed);
                // Release fence: a reader that sees any write below also sees `busy`.
                fence(Ordering::Release);
                e.hash.store(key.hash, Ordering::Relaxed);
                e.value.store(value as u64, Ordering::Relaxed);
                e.run.store(run, Ordering::Release);
                // Release: publishes hash and value together with the key.
                e.meta.store(next_meta(busy, meta, LIVE), Ordering::Release);
                return (i, m != EMPTY);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Tombstones a key. Writer only. Returns its entry's index and slot if it was present.
    fn remove(&self, key: ChildKey) -> Option<(usize, u32)> {
        let meta = key.meta();
        let mut i = home(meta, key.hash, self.mask);
        for _ in 0..=self.mask {
            let e = &self.entries[i];
            let m = e.meta.load(Ordering::Relaxed);
            if m == EMPTY {
                return None;
            }
            if m & STATE == LIVE && m & KEY == meta && e.hash.load(Ordering::Relaxed) == key.hash {
                // Release: orders the tombstone after everything the writer did before it.
                e.meta.store(next_meta(m, m & KEY, TOMB), Ordering::Release);
                return Some((i, e.value.load(Ordering::Relaxed) as u32));
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// The live entries: (index, (meta, hash, value, run)).
    fn live_entries(&self) -> impl Iterator<Item = (usize, (u64, u64, u64, u64))> + '_ {
        self.entries.iter().enumerate().filter_map(|(i, e)| {
            let m = e.meta.load(Ordering::Relaxed);
            (m & STATE == LIVE).then(|| {
                (
                    i,
                    (
                        m,
                        e.hash.load(Ordering::Relaxed),
                        e.value.load(Ordering::Relaxed),
                        e.run.load(Ordering::Relaxed),
                    ),
                )
            })
        })
    }
}

/// The published table. Readers `load` it; the writer goes through [`ChildTableWriter`].
pub(crate) struct ChildTable {
    inner: ArcSwap<TableInner>,
}

impl ChildTable {
    pub(crate) fn new() -> Self {
        ChildTable {
            inner: ArcSwap::from_pointee(TableInner::with_capacity(MIN_CAPACITY)),
        }
    }

    /// The current table; hold the guard for the duration of one walk.
    #[inline]
    pub(crate) fn load(&self) -> arc_swap::Guard<Arc<TableInner>> {
        self.inner.load()
    }
}

/// The writer's side of one [`ChildTable`]: the current table, held directly so that the
/// writer's own lookups cost no atomic read-modify-write, the fill counts, and where each
/// slot's entry is, so that a slot's new array reaches its entry without a lookup.
pub(crate) struct ChildTableWriter {
    current: Arc<TableInner>,
    live: usize,
    tombs: usize,
    /// Per slot, the index of the live entry that names it, or `NOWHERE`.
    at: Vec<u32>,
}

const NOWHERE: u32 = u32::MAX;

impl ChildTableWriter {
    pub(crate) fn new(table: &ChildTable) -> Self {
        ChildTableWriter {
            current: table.inner.load_full(),
            live: 0,
            tombs: 0,
            at: Vec::new(),
        }
    }

    #[cfg(all(test, not(loom)))]
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    #[inline]
    pub(crate) fn get(&self, key: ChildKey) -> Option<u32> {
        self.current.get(key).map(|(slot, _)| slot)
    }

    fn place(&mut self, slot: u32, entry: usize) {
        let slot = slot as usize;
        if self.at.len() <= slot {
            self.at.resize(slot + 1, NOWHERE);
        }
        self.at[slot] = entry as u32;
    }

    /// Inserts `key`, which must be absent, naming slot `value`, whose array is at `run`.
    pub(crate) fn insert(&mut self, table: &ChildTable, key: ChildKey, value: u32, run: u64) {
        // Keep live + tombstones under 3/4 of the slots so that probes stay short and every
        // probe sequence meets an empty slot.
        if (self.live + self.tombs + 1) * 4 > self.current.capacity() * 3 {
            self.rebuild(table, (self.live + 1) * 2);
        }
        let (entry, reused) = self.current.insert(key, value, run);
        if reused {
            self.tombs -= 1;
        }
        self.live += 1;
        self.place(value, entry);
    }

    pub(crate) fn remove(&mut self, key: ChildKey) -> bool {
        let Some((entry, slot)) = self.current.remove(key) else {
            return false;
        };
        self.live -= 1;
        self.tombs += 1;
        if let Some(at) = self
            .at
            .get_mut(slot as usize)
            .filter(|at| **at == entry as u32)
        {
            *at = NOWHERE;
        }
        true
    }

    /// Records that slot `slot` now holds the array at `run`. Called before the old array is
    /// retired.
    #[inline]
    pub(crate) fn set_run(&self, slot: u32, run: u64) {
        if let Some(&at) = self.at.get(slot as usize).filter(|at| **at != NOWHERE) {
            // Release: a reader that loads the address sees the array's words.
            self.current.entries[at as usize]
                .run
                .store(run, Ordering::Release);
        }
    }

    fn rebuild(&mut self, table: &ChildTable, want: usize) {
        let cap = want.max(self.current.capacity() / 2).max(MIN_CAPACITY);
        let new = TableInner::with_capacity(cap);
        let mut n = 0;
        // A slot relinked in the commit under way has two live entries until its old link is
        // removed; the one recorded for it (the newer) stays recorded.
        let old = Arc::clone(&self.current);
        for (i, (m, h, v, run)) in old.live_entries() {
            let key = ChildKey {
                parent: (m >> 32) as u32,
                off: (m >> 24) as u8,
                hash: h,
            };
            let (entry, _) = new.insert(key, v as u32, run);
            if self.at.get(v as usize) == Some(&(i as u32)) {
                self.at[v as usize] = entry as u32;
            }
            n += 1;
        }
        self.live = n;
        self.tombs = 0;
        self.current = Arc::new(new);
        table.inner.store(Arc::clone(&self.current));
    }

    /// The live entries: (key, slot, array address).
    pub(crate) fn entries(&self) -> impl Iterator<Item = (ChildKey, u32, u64)> + '_ {
        self.current.live_entries().map(|(_, (m, h, v, run))| {
            let key = ChildKey {
                parent: (m >> 32) as u32,
                off: (m >> 24) as u8,
                hash: h,
            };
            (key, v as u32, run)
        })
    }

    pub(crate) fn bytes(&self) -> usize {
        self.current.capacity() * std::mem::size_of::<Entry>()
            + std::mem::size_of::<TableInner>()
            + self.at.capacity() * 4
    }
}

#[cfg(all(test, not(loom)))]
mod tests;

#[cfg(all(test, not(loom)))]
mod address_tests;

#[cfg(all(test, loom))]
mod loom_tests;
