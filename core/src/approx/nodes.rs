//! The record table's state behind its lock: the nodes (a prefix key's holders, their
//! fingerprint and latest expiry), the rank slots with their generations, and the hasher of
//! the table's already-mixed keys.

use std::collections::HashMap;

use crate::event::WorkerRank;
use crate::index::RankKey;
use crate::rng::mix64;

/// One rank's record of one prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Holder {
    pub(super) slot: u32,
    /// The slot's generation when written: a retired or reassigned slot's holders are dead.
    pub(super) generation: u32,
    /// Expiry, in [`ApproxCache::tick`](super::ApproxCache::tick)s.
    pub(super) expires: i64,
}

impl Holder {
    #[inline]
    pub(super) fn fingerprint(self) -> u64 {
        mix64(
            (u64::from(self.slot) << 32 | u64::from(self.generation)) ^ mix64(self.expires as u64),
        )
    }
}

/// The ranks holding a record of one prefix.
#[derive(Debug, Default)]
pub(super) struct Node {
    /// Sorted by slot.
    pub(super) holders: Vec<Holder>,
    /// XOR of the holders' fingerprints.
    pub(super) fingerprint: u64,
    /// The latest expiry of any holder, live or not (a bound; exact after a sweep).
    pub(super) latest: i64,
}

impl Node {
    /// Where `slot`'s holder is (`Ok`) or would go (`Err`), trying `hint` first.
    #[inline]
    pub(super) fn place(&self, slot: u32, hint: usize) -> Result<usize, usize> {
        match self.holders.get(hint) {
            Some(h) if h.slot == slot => Ok(hint),
            _ => self.holders.binary_search_by_key(&slot, |h| h.slot),
        }
    }

    pub(super) fn refresh(&mut self) {
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
pub(super) struct Slot {
    pub(super) rank: WorkerRank,
    pub(super) key: RankKey,
    /// Bumped when the rank's worker evicts or clears blocks, leaves, or re-registers: its
    /// older holders stop counting.
    pub(super) generation: u32,
    /// The stamp of the last lookup that reported the rank.
    pub(super) seen: u32,
}

/// A hasher for the table's keys, which are already mixed.
#[derive(Default, Clone, Copy, Debug)]
pub(super) struct Mixed(u64);

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

pub(super) type Table<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<Mixed>>;

#[derive(Debug, Default)]
pub(super) struct Inner {
    /// Prefix key → the ranks holding a record of it.
    pub(super) nodes: Table<u64, Node>,
    /// Holders over all nodes (the cap counts these).
    pub(super) records: usize,
    pub(super) slots: Vec<Slot>,
    pub(super) slot_of: Table<WorkerRank, u32>,
    /// Slots of ranks that left, for reuse.
    pub(super) free: Vec<u32>,
    /// The current lookup's stamp (see [`Slot::seen`]).
    pub(super) stamp: u32,
}

impl Inner {
    /// The slot of `rank` under `key`, made if new; a rank registered again under another key
    /// starts a new generation.
    pub(super) fn slot(&mut self, rank: WorkerRank, key: RankKey) -> (u32, u32) {
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
    pub(super) fn purge(&mut self, mut gone: impl FnMut(&Holder) -> bool) -> usize {
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
