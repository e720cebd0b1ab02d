//! One rank's block names: a map from the engine's block hash to the block's packed 32-bit
//! position.
//!
//! A small Swiss table: entries sit in groups of eight, each group with one 64-bit word of tag
//! bytes (seven bits of the name's hash, or empty, or removed). A lookup reads the tag word of
//! the name's home group, compares all eight tags at once, checks the names of the candidates,
//! and stops at the first group with an empty tag, so a miss costs one or two groups even when
//! the table is 7/8 full. Removed entries in full groups stay marked until the table is
//! rebuilt, at 7/8 counting them, to 70% live: memory follows the live names, and a rebuild
//! moves each name about once per (7/8 - 7/10) of the table's removals. The caller can [`NameMap::prefetch`] the home group of a name a few names
//! ahead: an event's names land on random groups, and overlapping those cache misses is most of
//! the speed of applying events.

use super::mix::prefetch_read;

const GROUP: usize = 8;
const EMPTY: u8 = 0x80;
const REMOVED: u8 = 0xFE;
const LOW: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;
const MIN_GROUPS: usize = 2;

#[derive(Clone, Debug, Default)]
pub(crate) struct NameMap {
    /// One tag byte per entry, eight per word.
    tags: Vec<u64>,
    /// `[name low, name high, position]` per entry: 12 bytes.
    entries: Vec<[u32; 3]>,
    len: usize,
    removed: usize,
}

#[inline]
fn join(lo: u32, hi: u32) -> u64 {
    lo as u64 | (hi as u64) << 32
}

#[inline]
fn mix(name: u64) -> u64 {
    let x = (name ^ (name >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// Bytes of `word` equal to `tag` (with rare false positives above a true match, which the
/// name comparison weeds out).
#[inline]
fn matches(word: u64, tag: u8) -> u64 {
    let x = word ^ (LOW * tag as u64);
    x.wrapping_sub(LOW) & !x & HIGH
}

/// Bytes of `word` that are `EMPTY` (high bit set, next bit clear; `REMOVED` has both).
#[inline]
fn empties(word: u64) -> u64 {
    word & !(word << 1) & HIGH
}

/// Bytes of `word` that are `EMPTY` or `REMOVED`.
#[inline]
fn free(word: u64) -> u64 {
    word & HIGH
}

impl NameMap {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.tags.capacity() * 8 + self.entries.capacity() * std::mem::size_of::<[u32; 3]>()
    }

    #[inline]
    fn groups(&self) -> usize {
        self.tags.len()
    }

    /// Home group and tag of a name.
    #[inline]
    fn place(&self, name: u64) -> (usize, u8) {
        let h = mix(name);
        // Lemire's reduction: any number of groups, no modulo.
        let g = ((h as u128 * self.groups() as u128) >> 64) as usize;
        (g, (h & 0x7F) as u8)
    }

    /// Hints the CPU to fetch the group `name` starts probing at.
    #[inline]
    pub(crate) fn prefetch(&self, name: u64) {
        if self.tags.is_empty() {
            return;
        }
        let (g, _) = self.place(name);
        prefetch_read(&self.tags[g]);
        prefetch_read(&self.entries[g * GROUP]);
        prefetch_read(&self.entries[g * GROUP + GROUP / 2]);
    }

    #[inline]
    pub(crate) fn get(&self, name: u64) -> Option<u32> {
        self.find(name).map(|(_, pos)| pos)
    }

    /// The entry index and position of a name, for [`NameMap::remove_at`].
    #[inline]
    pub(crate) fn find(&self, name: u64) -> Option<(usize, u32)> {
        let n = self.groups();
        if n == 0 {
            return None;
        }
        let (mut g, tag) = self.place(name);
        for _ in 0..n {
            let word = self.tags[g];
            let mut m = matches(word, tag);
            while m != 0 {
                let i = g * GROUP + (m.trailing_zeros() / 8) as usize;
                let [lo, hi, v] = self.entries[i];
                if join(lo, hi) == name && self.tag_at(i) == tag {
                    return Some((i, v));
                }
                m &= m - 1;
            }
            if empties(word) != 0 {
                return None;
            }
            g += 1;
            if g == n {
                g = 0;
            }
        }
        None
    }

    #[inline]
    fn tag_at(&self, i: usize) -> u8 {
        (self.tags[i / GROUP] >> ((i % GROUP) * 8)) as u8
    }

    #[inline]
    fn set_tag(&mut self, i: usize, tag: u8) {
        let shift = (i % GROUP) * 8;
        let word = &mut self.tags[i / GROUP];
        *word = (*word & !(0xFF << shift)) | ((tag as u64) << shift);
    }

    /// Inserts or replaces; returns the previous position.
    ///
    /// One probe serves both outcomes: it looks for the name and notes the first free entry on
    /// the way, so a new name (the common case: a stored block is new to its rank) lands where
    /// the search ended without probing again.
    pub(crate) fn insert(&mut self, name: u64, pos: u32) -> Option<u32> {
        let n = self.groups();
        let mut spot = None;
        if n > 0 {
            let (mut g, tag) = self.place(name);
            for _ in 0..n {
                let word = self.tags[g];
                let mut m = matches(word, tag);
                while m != 0 {
                    let i = g * GROUP + (m.trailing_zeros() / 8) as usize;
                    let [lo, hi, old] = self.entries[i];
                    if join(lo, hi) == name && self.tag_at(i) == tag {
                        self.entries[i][2] = pos;
                        return Some(old);
                    }
                    m &= m - 1;
                }
                let f = free(word);
                if spot.is_none() && f != 0 {
                    spot = Some((g * GROUP + (f.trailing_zeros() / 8) as usize, tag));
                }
                if empties(word) != 0 {
                    break;
                }
                g += 1;
                if g == n {
                    g = 0;
                }
            }
        }
        match spot {
            // Reusing a removed entry keeps the count of used entries; a fresh one must fit
            // under 7/8.
            Some((i, tag))
                if self.tag_at(i) == REMOVED
                    || (self.len + self.removed + 1) * 8 <= n * GROUP * 7 =>
            {
                self.fill(i, tag, name, pos);
            }
            _ => {
                // Rebuild without the removed entries, sized so that live entries fill 70%.
                self.resize(self.target_groups(self.len + 1));
                self.put_new(name, pos);
            }
        }
        None
    }

    /// Writes a new name into the free entry `i`.
    #[inline]
    fn fill(&mut self, i: usize, tag: u8, name: u64, pos: u32) {
        if self.tag_at(i) == REMOVED {
            self.removed -= 1;
        }
        self.set_tag(i, tag);
        self.entries[i] = [name as u32, (name >> 32) as u32, pos];
        self.len += 1;
    }

    /// Places a name known to be absent; the table has room.
    fn put_new(&mut self, name: u64, pos: u32) {
        let n = self.groups();
        let (mut g, tag) = self.place(name);
        loop {
            let f = free(self.tags[g]);
            if f != 0 {
                let i = g * GROUP + (f.trailing_zeros() / 8) as usize;
                self.fill(i, tag, name, pos);
                return;
            }
            g += 1;
            if g == n {
                g = 0;
            }
        }
    }

    /// Removes a name; returns its position.
    pub(crate) fn remove(&mut self, name: u64) -> Option<u32> {
        let (i, pos) = self.find(name)?;
        self.remove_at(i);
        Some(pos)
    }

    /// Removes the entry `find` returned (nothing changed the map in between).
    pub(crate) fn remove_at(&mut self, i: usize) {
        self.vacate(i);
        self.settle();
    }

    /// Removes the entry `find` returned without resizing, so that the entries other finds
    /// returned stay where they are; [`NameMap::settle`] afterwards.
    pub(crate) fn vacate(&mut self, i: usize) {
        // A group with an empty entry never sent a probe on to the next group, so its entries
        // may become empty; in a full group they must stay marked as removed.
        if empties(self.tags[i / GROUP]) != 0 {
            self.set_tag(i, EMPTY);
        } else {
            self.set_tag(i, REMOVED);
            self.removed += 1;
        }
        self.len -= 1;
    }

    /// Shrinks the table when removals left it under a quarter full.
    pub(crate) fn settle(&mut self) {
        if self.len * 4 < self.groups() * GROUP && self.groups() > MIN_GROUPS {
            self.resize(self.target_groups(self.len));
        }
    }

    /// Keeps the entries for which `keep(name, position)` holds.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u64, u32) -> bool) {
        for i in 0..self.entries.len() {
            let t = self.tag_at(i);
            if t & 0x80 == 0 {
                let [lo, hi, v] = self.entries[i];
                if !keep(join(lo, hi), v) {
                    self.set_tag(i, REMOVED);
                    self.removed += 1;
                    self.len -= 1;
                }
            }
        }
        self.resize(self.target_groups(self.len));
    }

    /// Groups for `len` live entries at 70% load.
    fn target_groups(&self, len: usize) -> usize {
        (len * 10 / 7).div_ceil(GROUP).max(MIN_GROUPS)
    }

    fn resize(&mut self, groups: usize) {
        let old_tags = std::mem::replace(&mut self.tags, vec![LOW * EMPTY as u64; groups]);
        let old = std::mem::replace(&mut self.entries, vec![[0, 0, 0]; groups * GROUP]);
        self.len = 0;
        self.removed = 0;
        for (i, e) in old.into_iter().enumerate() {
            let t = (old_tags[i / GROUP] >> ((i % GROUP) * 8)) as u8;
            if t & 0x80 == 0 {
                self.put_new(join(e[0], e[1]), e[2]);
            }
        }
    }
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
        for step in 0..300_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Small names collide often; some are 0; the size swings up and down.
            let range = if (step / 50_000) % 2 == 0 { 5_000 } else { 300 };
            let name = x % range;
            match x % 7 {
                0..=3 => assert_eq!(m.insert(name, step as u32), model.insert(name, step as u32)),
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

    #[test]
    fn tag_matching_finds_every_equal_byte() {
        let word = u64::from_le_bytes([5, EMPTY, 5, 0x7F, REMOVED, 0, 5, 1]);
        let m = matches(word, 5);
        assert_eq!(
            m & (0x80 | 0x80 << 16 | 0x80 << 48),
            0x80 | 0x80 << 16 | 0x80 << 48
        );
        assert_eq!(empties(word), 0x80 << 8);
        assert_eq!(free(word), 0x80 << 8 | 0x80 << 32);
    }
}
