//! The child table: a single-writer, many-reader hash table from (parent position, next block
//! hash) to the child run that continues the chain there.
//!
//! One table per shard holds every branch of that shard's tree, so that a run with thousands of
//! children (a system prompt followed by many conversations) costs one probe per lookup and one
//! entry per child, with nothing copied when a child is added.
//!
//! Entries are three atomic words `[meta, hash, value]` in open addressing with linear probing.
//! `meta` is 0 for an empty slot, 1 for a tombstone, or the packed parent position. The writer
//! fills `hash` and `value` before it publishes `meta` with `Release`; a reader loads `meta` with
//! `Acquire` before the other two words. A reader racing with the reuse of a tombstone may pair
//! an old `meta` with a new `hash`, so readers validate what they find against the child run
//! itself (its recorded parent position and first hash). When the table fills up, the writer
//! builds a larger one and publishes it through an `ArcSwap`; readers still holding the old one
//! finish on it, and it is freed when the last of them lets go.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

const EMPTY: u64 = 0;
const TOMB: u64 = 1;
const MIN_CAPACITY: usize = 256;

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
    #[inline]
    fn meta(self) -> u64 {
        // Low byte 2 keeps every live meta distinct from EMPTY and TOMB.
        ((self.parent as u64) << 32) | ((self.off as u64) << 8) | 2
    }
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

    /// Looks a key up. Any thread.
    #[inline]
    pub(crate) fn get(&self, key: ChildKey) -> Option<u32> {
        let meta = key.meta();
        let mut i = home(meta, key.hash, self.mask);
        for _ in 0..=self.mask {
            let w = &self.words[i * 3..i * 3 + 3];
            // Acquire: pairs with the writer's Release store of meta, so that hash and value
            // written before it are visible.
            let m = w[0].load(Ordering::Acquire);
            if m == EMPTY {
                return None;
            }
            if m == meta && w[1].load(Ordering::Relaxed) == key.hash {
                return Some(w[2].load(Ordering::Relaxed) as u32);
            }
            i = (i + 1) & self.mask;
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
            if m == EMPTY || m == TOMB {
                w[1].store(key.hash, Ordering::Relaxed);
                w[2].store(value as u64, Ordering::Relaxed);
                // Release: publishes hash and value together with the key.
                w[0].store(meta, Ordering::Release);
                return m == TOMB;
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
            if m == meta && w[1].load(Ordering::Relaxed) == key.hash {
                // Release: orders the tombstone after everything the writer did before it.
                w[0].store(TOMB, Ordering::Release);
                return true;
            }
            i = (i + 1) & self.mask;
        }
        false
    }

    fn live_entries(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.words.chunks_exact(3).filter_map(|w| {
            let m = w[0].load(Ordering::Relaxed);
            (m != EMPTY && m != TOMB).then(|| {
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

/// The writer's bookkeeping for one [`ChildTable`].
#[derive(Debug, Default)]
pub(crate) struct ChildTableWriter {
    live: usize,
    tombs: usize,
}

impl ChildTableWriter {
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    pub(crate) fn get(&self, table: &ChildTable, key: ChildKey) -> Option<u32> {
        table.inner.load().get(key)
    }

    /// Inserts `key`, which must be absent.
    pub(crate) fn insert(&mut self, table: &ChildTable, key: ChildKey, value: u32) {
        let cap = table.inner.load().capacity();
        // Keep live + tombstones under 3/4 of the slots so that probes stay short and every
        // probe sequence meets an empty slot.
        if (self.live + self.tombs + 1) * 4 > cap * 3 {
            self.rebuild(table, (self.live + 1) * 2);
        }
        if table.inner.load().insert(key, value) {
            self.tombs -= 1;
        }
        self.live += 1;
    }

    pub(crate) fn remove(&mut self, table: &ChildTable, key: ChildKey) -> bool {
        let removed = table.inner.load().remove(key);
        if removed {
            self.live -= 1;
            self.tombs += 1;
        }
        removed
    }

    fn rebuild(&mut self, table: &ChildTable, want: usize) {
        let old = table.inner.load_full();
        let cap = want.max(old.capacity() / 2).max(MIN_CAPACITY);
        let new = TableInner::with_capacity(cap);
        let mut n = 0;
        for (m, h, v) in old.live_entries() {
            let key = ChildKey {
                parent: (m >> 32) as u32,
                off: (m >> 8) as u8,
                hash: h,
            };
            new.insert(key, v as u32);
            n += 1;
        }
        self.live = n;
        self.tombs = 0;
        table.inner.store(Arc::new(new));
    }

    pub(crate) fn bytes(&self, table: &ChildTable) -> usize {
        table.inner.load().capacity() * 3 * 8 + std::mem::size_of::<TableInner>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn table_matches_a_hashmap_under_inserts_and_removes() {
        let t = ChildTable::new();
        let mut w = ChildTableWriter::default();
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
                assert!(w.remove(&t, key));
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
