//! The child table: a single-writer, many-reader hash table from (parent position, next block
//! hash) to the child run that continues the chain there.
//!
//! One table per shard holds every branch of that shard's tree, so that a run with thousands of
//! children (a system prompt followed by many conversations) costs one probe per lookup and one
//! entry per child, with nothing copied when a child is added.
//!
//! Entries are three atomic words `[meta, hash, value]` in open addressing with linear probing.
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

pub(crate) struct TableInner {
    mask: usize,
    words: Box<[AtomicU64]>,
}

impl TableInner {
    fn with_capacity(cap: usize) -> Self {
        let cap = cap.next_power_of_two().max(MIN_CAPACITY);
        TableInner {
            mask: cap - 1,
            words: (0..cap * 3).map(|_| AtomicU64::new(EMPTY)).collect(),
        }
    }

    fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Hints the CPU to fetch the entry a lookup of `key` starts at.
    #[inline]
    pub(crate) fn prefetch(&self, key: ChildKey) {
        let i = home(key.meta(), key.hash, self.mask);
        super::mix::prefetch_read(&self.words[i * 3]);
    }

    /// Looks a key up. Any thread.
    #[inline]
    pub(crate) fn get(&self, key: ChildKey) -> Option<u32> {
        let meta = key.meta();
        let mut i = home(meta, key.hash, self.mask);
        let mut probes = 0;
        while probes <= self.mask {
            let w = &self.words[i * 3..i * 3 + 3];
            // Acquire: pairs with the writer's Release store of meta, so that the hash and
            // value written before it are visible.
            let m1 = w[0].load(Ordering::Acquire);
            if m1 == EMPTY {
                return None;
            }
            if m1 & STATE == LIVE && m1 & KEY == meta {
                let hash = w[1].load(Ordering::Relaxed);
                let value = w[2].load(Ordering::Relaxed);
                // Acquire fence: if either load saw a later write, the writer's Release fence
                // before that write makes its busy mark visible to the re-check below.
                fence(Ordering::Acquire);
                if w[0].load(Ordering::Relaxed) != m1 {
                    continue; // rewritten while read: look at the same entry again
                }
                if hash == key.hash {
                    return Some(value as u32);
                }
            }
            i = (i + 1) & self.mask;
            probes += 1;
        }
        None
    }

    /// Inserts a key known to be absent. Writer only. Returns whether a tombstone was reused.
    fn insert(&self, key: ChildKey, value: u32) -> bool {
        let meta = key.meta();
        let mut i = home(meta, key.hash, self.mask);
        loop {
            let w = &self.words[i * 3..i * 3 + 3];
            let m = w[0].load(Ordering::Relaxed);
            if m == EMPTY || m & STATE == TOMB {
                let busy = next_meta(m, m & KEY, BUSY);
                w[0].store(busy, Ordering::Relaxed);
                // Release fence: a reader that sees either write below also sees `busy`.
                fence(Ordering::Release);
                w[1].store(key.hash, Ordering::Relaxed);
                w[2].store(value as u64, Ordering::Relaxed);
                // Release: publishes hash and value together with the key.
                w[0].store(next_meta(busy, meta, LIVE), Ordering::Release);
                return m != EMPTY;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Tombstones a key. Writer only. Returns whether it was present.
    fn remove(&self, key: ChildKey) -> bool {
        let meta = key.meta();
        let mut i = home(meta, key.hash, self.mask);
        for _ in 0..=self.mask {
            let w = &self.words[i * 3..i * 3 + 3];
            let m = w[0].load(Ordering::Relaxed);
            if m == EMPTY {
                return false;
            }
            if m & STATE == LIVE && m & KEY == meta && w[1].load(Ordering::Relaxed) == key.hash {
                // Release: orders the tombstone after everything the writer did before it.
                w[0].store(next_meta(m, m & KEY, TOMB), Ordering::Release);
                return true;
            }
            i = (i + 1) & self.mask;
        }
        false
    }

    fn live_entries(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.words.chunks_exact(3).filter_map(|w| {
            let m = w[0].load(Ordering::Relaxed);
            (m & STATE == LIVE).then(|| {
                (
                    m,
                    w[1].load(Ordering::Relaxed),
                    w[2].load(Ordering::Relaxed),
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
/// writer's own lookups cost no atomic read-modify-write, and the fill counts.
pub(crate) struct ChildTableWriter {
    current: Arc<TableInner>,
    live: usize,
    tombs: usize,
}

impl ChildTableWriter {
    pub(crate) fn new(table: &ChildTable) -> Self {
        ChildTableWriter {
            current: table.inner.load_full(),
            live: 0,
            tombs: 0,
        }
    }

    #[cfg(all(test, not(loom)))]
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    #[inline]
    pub(crate) fn get(&self, key: ChildKey) -> Option<u32> {
        self.current.get(key)
    }

    /// Inserts `key`, which must be absent.
    pub(crate) fn insert(&mut self, table: &ChildTable, key: ChildKey, value: u32) {
        // Keep live + tombstones under 3/4 of the slots so that probes stay short and every
        // probe sequence meets an empty slot.
        if (self.live + self.tombs + 1) * 4 > self.current.capacity() * 3 {
            self.rebuild(table, (self.live + 1) * 2);
        }
        if self.current.insert(key, value) {
            self.tombs -= 1;
        }
        self.live += 1;
    }

    pub(crate) fn remove(&mut self, key: ChildKey) -> bool {
        let removed = self.current.remove(key);
        if removed {
            self.live -= 1;
            self.tombs += 1;
        }
        removed
    }

    fn rebuild(&mut self, table: &ChildTable, want: usize) {
        let cap = want.max(self.current.capacity() / 2).max(MIN_CAPACITY);
        let new = TableInner::with_capacity(cap);
        let mut n = 0;
        for (m, h, v) in self.current.live_entries() {
            let key = ChildKey {
                parent: (m >> 32) as u32,
                off: (m >> 24) as u8,
                hash: h,
            };
            new.insert(key, v as u32);
            n += 1;
        }
        self.live = n;
        self.tombs = 0;
        self.current = Arc::new(new);
        table.inner.store(Arc::clone(&self.current));
    }

    pub(crate) fn bytes(&self) -> usize {
        self.current.capacity() * 3 * 8 + std::mem::size_of::<TableInner>()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn table_matches_a_hashmap_under_inserts_and_removes() {
        let t = ChildTable::new();
        let mut w = ChildTableWriter::new(&t);
        let mut model = HashMap::new();
        let mut x = 0x1234_5678_u64;
        for i in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = ChildKey {
                parent: (x % 97) as u32,
                off: (x % 5) as u8,
                hash: x % 1000,
            };
            if model.remove(&key).is_some() {
                assert!(w.remove(key));
            } else {
                w.insert(&t, key, i);
                model.insert(key, i);
            }
            assert_eq!(w.len(), model.len());
        }
        for (k, v) in &model {
            assert_eq!(t.load().get(*k), Some(*v));
        }
        let absent = ChildKey {
            parent: 1000,
            off: 0,
            hash: 1,
        };
        assert_eq!(t.load().get(absent), None);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Two keys of one parent position whose probes start at the same entry.
    fn colliding_keys(mask: usize) -> (ChildKey, ChildKey) {
        let a = ChildKey {
            parent: 7,
            off: 3,
            hash: 1,
        };
        let target = home(a.meta(), a.hash, mask);
        let hash = (2..)
            .find(|h| home(a.meta(), *h, mask) == target)
            .expect("some hash collides");
        (a, ChildKey { hash, ..a })
    }

    #[test]
    fn a_reader_never_pairs_a_key_with_another_keys_value() {
        loom::model(|| {
            let table = Arc::new(TableInner::with_capacity(2));
            let (k1, k2) = colliding_keys(table.mask);
            let reader = {
                let table = Arc::clone(&table);
                loom::thread::spawn(move || (table.get(k1), table.get(k2)))
            };
            table.insert(k1, 11);
            table.remove(k1);
            table.insert(k2, 22);
            let (got1, got2) = reader.join().expect("reader");
            assert!(got1.is_none() || got1 == Some(11), "k1 -> {got1:?}");
            assert!(got2.is_none() || got2 == Some(22), "k2 -> {got2:?}");
            assert_eq!(table.get(k1), None);
            assert_eq!(table.get(k2), Some(22));
        });
    }
}
