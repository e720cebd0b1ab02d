//! One rank's block names: a map from the engine's block hash to the block's packed position.
//!
//! Open addressing with linear probing over 16-byte entries (name, position + 1; 0 marks an
//! empty entry), at most 3/4 full, grown by half again rather than doubled so that the
//! table averages about three fifths full (a power-of-two table that doubles averages one
//! half). Removal shifts the following entries back, so there are no tombstones. The caller
//! can [`NameMap::prefetch`] the entry of a name a few names ahead: an event's names land on
//! random entries, and overlapping those cache misses is most of the speed of applying events.

const MAX_LOAD_NUM: usize = 3;
const MAX_LOAD_DEN: usize = 4;
const MIN_CAPACITY: usize = 16;

#[derive(Clone, Debug, Default)]
pub(crate) struct NameMap {
    /// `[name, position + 1]`; position + 1 == 0 marks an empty entry.
    entries: Vec<[u64; 2]>,
    len: usize,
}

#[inline]
fn mix(name: u64) -> u64 {
    let x = (name ^ (name >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

impl NameMap {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.entries.capacity() * 16
    }

    #[inline]
    fn home(&self, name: u64) -> usize {
        // Lemire's reduction: any table size, no modulo.
        ((mix(name) as u128 * self.entries.len() as u128) >> 64) as usize
    }

    /// Hints the CPU to fetch the entry `name` starts probing at.
    #[inline]
    pub(crate) fn prefetch(&self, name: u64) {
        if self.entries.is_empty() {
            return;
        }
        let entry = &self.entries[self.home(name)];
        prefetch_read(entry);
    }

    #[inline]
    pub(crate) fn get(&self, name: u64) -> Option<u64> {
        self.find(name).map(|(_, pos)| pos)
    }

    /// The entry index and position of a name, for [`NameMap::remove_at`].
    #[inline]
    pub(crate) fn find(&self, name: u64) -> Option<(usize, u64)> {
        let n = self.entries.len();
        if n == 0 {
            return None;
        }
        let mut i = self.home(name);
        loop {
            let [k, v] = self.entries[i];
            if v == 0 {
                return None;
            }
            if k == name {
                return Some((i, v - 1));
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    /// Removes the entry `find` returned (nothing changed the map in between).
    pub(crate) fn remove_at(&mut self, index: usize) {
        self.delete_at(index);
    }

    /// Inserts or replaces; returns the previous position.
    pub(crate) fn insert(&mut self, name: u64, pos: u64) -> Option<u64> {
        if (self.len + 1) * MAX_LOAD_DEN > self.entries.len() * MAX_LOAD_NUM {
            self.resize(((self.entries.len() * 3) / 2).max(MIN_CAPACITY));
        }
        let n = self.entries.len();
        let mut i = self.home(name);
        loop {
            let [k, v] = self.entries[i];
            if v == 0 {
                self.entries[i] = [name, pos + 1];
                self.len += 1;
                return None;
            }
            if k == name {
                self.entries[i][1] = pos + 1;
                return Some(v - 1);
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    /// Removes a name; returns its position.
    pub(crate) fn remove(&mut self, name: u64) -> Option<u64> {
        let n = self.entries.len();
        if n == 0 {
            return None;
        }
        let mut i = self.home(name);
        loop {
            let [k, v] = self.entries[i];
            if v == 0 {
                return None;
            }
            if k == name {
                self.delete_at(i);
                return Some(v - 1);
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    /// Empties entry `i` and shifts back the entries after it that probed past it.
    fn delete_at(&mut self, mut i: usize) {
        let n = self.entries.len();
        let mut j = i;
        loop {
            j += 1;
            if j == n {
                j = 0;
            }
            let [k, v] = self.entries[j];
            if v == 0 {
                break;
            }
            let h = self.home(k);
            // The entry at j may move to i only if its home is not cyclically in (i, j].
            let stays = if i <= j {
                i < h && h <= j
            } else {
                i < h || h <= j
            };
            if !stays {
                self.entries[i] = self.entries[j];
                i = j;
            }
        }
        self.entries[i] = [0, 0];
        self.len -= 1;
        if self.len * 4 < self.entries.len() && self.entries.len() > MIN_CAPACITY {
            self.resize((self.len * 2).max(MIN_CAPACITY));
        }
    }

    /// Keeps the entries for which `keep(name, position)` holds.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u64, u64) -> bool) {
        let old = std::mem::take(&mut self.entries);
        self.len = 0;
        let live: Vec<[u64; 2]> = old
            .into_iter()
            .filter(|[k, v]| *v != 0 && keep(*k, *v - 1))
            .collect();
        self.entries = vec![[0, 0]; (live.len() * 3 / 2).max(MIN_CAPACITY)];
        for [k, v] in live {
            self.insert(k, v - 1);
        }
    }

    fn resize(&mut self, cap: usize) {
        let old = std::mem::replace(&mut self.entries, vec![[0, 0]; cap]);
        self.len = 0;
        for [k, v] in old {
            if v != 0 {
                self.insert(k, v - 1);
            }
        }
    }
}

/// A read prefetch of the cache line of `x`.
#[inline]
#[allow(unsafe_code)]
fn prefetch_read<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY:
    // - `_mm_prefetch` only needs SSE, which every x86_64 target has.
    // - A prefetch is a hint: it reads nothing into the program and never faults, and the
    //   pointer comes from a live reference anyway.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
            (x as *const T).cast(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn name_map_matches_a_hashmap() {
        let mut m = NameMap::default();
        let mut model = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Small names collide often; some are 0.
            let name = x % 5_000;
            match x % 7 {
                0..=3 => assert_eq!(m.insert(name, step), model.insert(name, step)),
                4 | 5 => assert_eq!(m.remove(name), model.remove(&name)),
                _ => assert_eq!(m.get(name), model.get(&name).copied()),
            }
            assert_eq!(m.len(), model.len());
        }
        for (k, v) in &model {
            assert_eq!(m.get(*k), Some(*v));
        }
        m.retain(|k, _| k % 2 == 0);
        model.retain(|k, _| k % 2 == 0);
        assert_eq!(m.len(), model.len());
        for (k, v) in &model {
            assert_eq!(m.get(*k), Some(*v));
            m.prefetch(*k);
        }
        assert_eq!(m.get(1), None);
    }
}
