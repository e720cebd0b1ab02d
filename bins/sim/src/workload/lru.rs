//! A set of KV blocks of a fixed size that evicts the least recently used first: the fleet's
//! caches as one, for [`Workload::ceiling`](super::Workload::ceiling)'s LRU figure.
//!
//! Each use is logged with its tick; the map keeps every held block's last tick. Eviction pops
//! the log's front, skipping entries a later use made stale, so a use and an eviction are
//! amortized O(1). The log is compacted when its stale entries outnumber the blocks the set may
//! hold (or a million).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// At most `capacity` blocks, the least recently used evicted first.
#[derive(Debug)]
pub(crate) struct Lru<K> {
    capacity: usize,
    tick: u64,
    last: HashMap<K, u64>,
    log: VecDeque<(K, u64)>,
}

impl<K: Copy + Eq + Hash> Lru<K> {
    /// An empty set of at most `capacity` blocks (0 holds nothing).
    pub(crate) fn new(capacity: usize) -> Self {
        Lru {
            capacity,
            tick: 0,
            last: HashMap::new(),
            log: VecDeque::new(),
        }
    }

    /// Whether `key` is held.
    pub(crate) fn contains(&self, key: &K) -> bool {
        self.last.contains_key(key)
    }

    /// Uses `key`: held now as the most recently used, the least recently used evicted if the
    /// set is over its size.
    pub(crate) fn touch(&mut self, key: K) {
        if self.capacity == 0 {
            return;
        }
        self.tick += 1;
        self.last.insert(key, self.tick);
        self.log.push_back((key, self.tick));
        while self.last.len() > self.capacity {
            let Some((old, tick)) = self.log.pop_front() else {
                break;
            };
            if self.last.get(&old) == Some(&tick) {
                self.last.remove(&old);
            }
        }
        if self.log.len() > self.last.len() + self.capacity.min(1 << 20) + 1024 {
            let last = &self.last;
            self.log.retain(|(k, t)| last.get(k) == Some(t));
        }
    }

    /// Blocks held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.last.len()
    }
}

#[cfg(test)]
mod tests {
    use super::Lru;

    #[test]
    fn the_least_recently_used_block_goes_first() {
        let mut lru = Lru::new(2);
        lru.touch(1);
        lru.touch(2);
        lru.touch(1);
        lru.touch(3);
        assert!(lru.contains(&1) && lru.contains(&3) && !lru.contains(&2));
        assert_eq!(lru.len(), 2);
    }

    #[test]
    fn stale_uses_are_compacted_and_never_evict_a_held_block() {
        let mut lru = Lru::new(3);
        for _ in 0..5_000 {
            lru.touch(7);
        }
        lru.touch(8);
        lru.touch(9);
        assert!(lru.log.len() < 1_100, "log kept {} entries", lru.log.len());
        lru.touch(10);
        assert!(!lru.contains(&7) && lru.contains(&8) && lru.contains(&10));
        let mut none = Lru::new(0);
        none.touch(1);
        assert!(!none.contains(&1));
    }
}
