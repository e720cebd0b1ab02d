//! One rank's block names: a map from the engine's block hash to the block's packed 32-bit
//! position.
//!
//! A Swiss table whose groups count overflow instead of keeping tombstones. Entries sit in
//! groups of seven, each group with one 64-bit control word: seven tag bytes (seven bits of the
//! name's hash, or empty) and an overflow count.
//!
//! ```text
//!  control word  [t0 t1 t2 t3 t4 t5 t6 | overflow]     entries  [name, position] x 7
//! ```
//!
//! A lookup compares the seven tags of the name's home group at once, checks the names of the
//! candidates, and moves on to the next group only while the group's overflow count is not
//! zero: the count is how many names sit beyond the group because it was full when they came.
//! So a lookup for an absent name (the insert of every new block) usually ends in its home
//! group. A removal empties its entry and lowers the counts its name raised, so nothing goes
//! stale however long an engine stores and evicts, and the table is rebuilt only to grow or
//! shrink. A count that reaches 255 stays there until the next rebuild (lookups through it
//! probe one group further). The table holds at most 70% of its entries and is rebuilt at
//! 50%: measured on steady churn, that costs 22 bytes a name against 19 at 70-87%, and makes
//! inserts and removals together about 1.4x faster.
//!
//! The caller can [`NameMap::prefetch`] the home group of a name a few names ahead: an event's
//! names land on random groups, and overlapping those cache misses is most of the speed of
//! applying events.

use super::mix::prefetch_addr;

/// Entries per group.
const GROUP: usize = 7;
const EMPTY: u8 = 0x80;
const LOW: u64 = 0x0001_0101_0101_0101;
const HIGH: u64 = 0x0080_8080_8080_8080;
/// The control word of an empty group: seven empty tags, no overflow.
const EMPTY_GROUP: u64 = LOW * EMPTY as u64;
const COUNT_SHIFT: u32 = 56;
const ONE: u64 = 1 << COUNT_SHIFT;
const MIN_GROUPS: usize = 2;

#[derive(Clone, Debug, Default)]
pub(crate) struct NameMap {
    /// One control word per group.
    ctrl: Vec<u64>,
    /// `[name low, name high, position]` per entry: 12 bytes.
    entries: Vec<[u32; 3]>,
    len: usize,
    /// Names the rank is expected to hold ([`NameMap::reserve`]): the table keeps room for them
    /// (its [`NameMap::floor`]).
    reserved: usize,
}

#[inline]
fn join(lo: u32, hi: u32) -> u64 {
    lo as u64 | (hi as u64) << 32
}

/// The name's high half folded into its low half, times an odd constant (Fibonacci hashing):
/// every bit of the name moves the product's high bits, which choose the group, and its bits 32
/// to 38, which make the tag.
#[inline]
fn mix(name: u64) -> u64 {
    (name ^ (name >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Tags of `word` equal to `tag` (with rare false positives above a true match, which the name
/// comparison weeds out).
#[inline]
fn matches(word: u64, tag: u8) -> u64 {
    let x = (word & !(0xFF << COUNT_SHIFT)) ^ (LOW * tag as u64);
    x.wrapping_sub(LOW) & !x & HIGH
}

/// Tags of `word` that are empty.
#[inline]
fn empties(word: u64) -> u64 {
    word & HIGH
}

#[inline]
fn overflow(word: u64) -> u8 {
    (word >> COUNT_SHIFT) as u8
}

/// An entry's handle: its group times 16, 8 if the group is the name's home group, and its
/// place in the group, so that nothing needs a division by seven and a removal from the home
/// group (the common case) need not find the home again.
#[inline]
fn handle(g: usize, s: usize, home: bool) -> usize {
    g << 4 | (home as usize) << 3 | s
}

/// The group and place of an entry's handle.
#[inline]
fn entry_at(h: usize) -> usize {
    (h >> 4) * GROUP + (h & 7)
}

impl NameMap {
    /// Makes room for `names` names at once, and keeps it: the table is not rebuilt while it
    /// fills up to them (60% full then), nor shrunk below them when names leave. It takes up to
    /// a quarter more before it grows (75% full): a rank may store a batch before it evicts
    /// to make room.
    pub(crate) fn reserve(&mut self, names: usize) {
        self.reserved = names;
        if self.groups() < self.floor() {
            self.resize(self.floor());
        }
    }

    /// Groups the table never shrinks below: room for the reserved names at 60%.
    #[inline]
    fn floor(&self) -> usize {
        match self.reserved {
            0 => 0,
            n => (n * 100).div_ceil(GROUP * 60).max(MIN_GROUPS),
        }
    }

    /// Gives the reserved room back: the table shrinks to what its names need.
    pub(crate) fn release(&mut self) {
        self.reserved = 0;
        if self.groups() > self.target_groups(self.len) {
            self.resize(self.target_groups(self.len));
        }
    }

    /// Heap bytes of the reserved room.
    pub(crate) fn reserved_bytes(&self) -> usize {
        self.floor() * (8 + GROUP * 12)
    }

    /// Forgets every name and keeps the reserved room.
    pub(crate) fn clear(&mut self) {
        let reserved = self.reserved;
        *self = NameMap::default();
        self.reserve(reserved);
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.ctrl.capacity() * 8 + self.entries.capacity() * std::mem::size_of::<[u32; 3]>()
    }

    #[inline]
    fn groups(&self) -> usize {
        self.ctrl.len()
    }

    /// Home group and tag of a name.
    #[inline]
    fn place(&self, name: u64) -> (usize, u8) {
        let h = mix(name);
        // Lemire's reduction of the high bits: any number of groups, no modulo.
        let g = ((h as u128 * self.groups() as u128) >> 64) as usize;
        (g, ((h >> 32) & 0x7F) as u8)
    }

    #[inline]
    fn next(&self, g: usize) -> usize {
        if g + 1 == self.groups() {
            0
        } else {
            g + 1
        }
    }

    /// Hints the CPU to fetch the group `name` starts probing at.
    #[inline]
    pub(crate) fn prefetch(&self, name: u64) {
        // Addresses only, never dereferenced: `g` is below `groups()` (or the table is empty,
        // and the hints point nowhere), so no bounds are checked.
        let (g, _) = self.place(name);
        prefetch_addr(self.ctrl.as_ptr().wrapping_add(g));
        // A group's 84 bytes span up to three cache lines; bytes 0, 36 and 80 of it fall in
        // each of them, wherever the group starts in its first line.
        let group = self.entries.as_ptr().wrapping_add(g * GROUP).cast::<u8>();
        prefetch_addr(group);
        prefetch_addr(group.wrapping_add(36));
        prefetch_addr(group.wrapping_add(80));
    }

    #[inline]
    pub(crate) fn get(&self, name: u64) -> Option<u32> {
        self.find(name).map(|(_, pos)| pos)
    }

    /// The place in group `g` (control word `word`) that holds `name`, if any.
    #[inline(always)]
    fn find_in(&self, g: usize, word: u64, tag: u8, name: u64) -> Option<usize> {
        let mut m = matches(word, tag);
        while m != 0 {
            // Entries are read only for matching tags: a new name, the common insert, reads
            // none of them.
            let s = (m.trailing_zeros() / 8) as usize;
            let [lo, hi, _] = self.entries[g * GROUP + s];
            // Bytes above a true match can match falsely, and an emptied entry keeps its old
            // name: the tag must match too.
            if join(lo, hi) == name && (word >> (s * 8)) as u8 == tag {
                return Some(s);
            }
            m &= m - 1;
        }
        None
    }

    /// Probes for `name` in a table with groups: `Ok(handle)` of the entry holding it, or
    /// `Err((room, home, tag))`: the first group with room on its path, its home group and
    /// its tag.
    #[inline(always)]
    fn probe(&self, name: u64) -> Result<usize, (usize, usize, u8)> {
        let (home, tag) = self.place(name);
        let mut g = home;
        let word = self.ctrl[g];
        if let Some(s) = self.find_in(g, word, tag, name) {
            return Ok(handle(g, s, true));
        }
        if overflow(word) == 0 && empties(word) != 0 {
            // The common case: an absent name whose home group has room.
            return Err((g, home, tag));
        }
        let mut room = (empties(word) != 0).then_some(g);
        let mut word = word;
        for _ in 1..self.groups() {
            if overflow(word) == 0 {
                break;
            }
            g = self.next(g);
            word = self.ctrl[g];
            if let Some(s) = self.find_in(g, word, tag, name) {
                return Ok(handle(g, s, false));
            }
            if room.is_none() && empties(word) != 0 {
                room = Some(g);
            }
        }
        Err((room.unwrap_or_else(|| self.room_from(g)), home, tag))
    }

    /// The first group with room from `g` on (the load bound guarantees one).
    #[inline]
    fn room_from(&self, mut g: usize) -> usize {
        while empties(self.ctrl[g]) == 0 {
            g = self.next(g);
        }
        g
    }

    /// The entry handle and position of a name, for [`NameMap::vacate`].
    #[inline(always)]
    pub(crate) fn find(&self, name: u64) -> Option<(usize, u32)> {
        if self.ctrl.is_empty() {
            return None;
        }
        let h = self.probe(name).ok()?;
        Some((h, self.entries[entry_at(h)][2]))
    }

    /// Inserts or replaces; returns the previous position. One probe serves both outcomes: a
    /// new name (the common case: a stored block is new to its rank) lands in the first group
    /// with room that the search passed.
    pub(crate) fn insert(&mut self, name: u64, pos: u32) -> Option<u32> {
        if self.due_to_grow() {
            if let Some((h, old)) = self.find(name) {
                self.entries[entry_at(h)][2] = pos;
                return Some(old);
            }
            self.resize(self.target_groups(self.len + 1));
        }
        self.insert_with_room(name, pos)
    }

    /// Whether `n` more names fit without a rebuild, so that each may be inserted with
    /// [`NameMap::insert_with_room`] (the check made once for a batch, not per name).
    #[inline]
    pub(crate) fn has_room_for(&self, n: usize) -> bool {
        !self.due_to_grow_by(n)
    }

    /// [`NameMap::insert`] into a table known to have room for the name
    /// ([`NameMap::has_room_for`]).
    #[inline(always)]
    pub(crate) fn insert_with_room(&mut self, name: u64, pos: u32) -> Option<u32> {
        debug_assert!(!self.ctrl.is_empty());
        match self.probe(name) {
            Ok(h) => {
                let entry = &mut self.entries[entry_at(h)];
                let old = entry[2];
                entry[2] = pos;
                Some(old)
            }
            Err((to, home, tag)) => {
                self.fill(name, pos, to, home, tag);
                None
            }
        }
    }

    /// Whether one more name would take the table over 70% full, or a table at its reserved
    /// room past its quarter of slack.
    #[inline]
    fn due_to_grow(&self) -> bool {
        self.due_to_grow_by(1)
    }

    /// Whether `n` more names would take the table over 70% full, or a table at its reserved
    /// room past its quarter of slack.
    #[inline]
    fn due_to_grow_by(&self, n: usize) -> bool {
        (self.len + n) * 10 > self.groups() * GROUP * 7
            && (self.groups() > self.floor() || self.len + n > self.reserved + self.reserved / 4)
    }

    /// Writes a new name (home group `home`, tag `tag`) into group `to`, which has room, and
    /// counts it in the overflow of every group it passed.
    #[inline]
    fn fill(&mut self, name: u64, pos: u32, to: usize, home: usize, tag: u8) {
        let mut g = home;
        while g != to {
            if overflow(self.ctrl[g]) != u8::MAX {
                self.ctrl[g] += ONE;
            }
            g = self.next(g);
        }
        let word = &mut self.ctrl[to];
        let s = (empties(*word).trailing_zeros() / 8) as usize;
        // The byte was EMPTY: flipping EMPTY's bit and the tag's bits leaves the tag.
        *word ^= ((EMPTY ^ tag) as u64) << (s * 8);
        self.entries[to * GROUP + s] = [name as u32, (name >> 32) as u32, pos];
        self.len += 1;
    }

    /// Removes a name; returns its position.
    pub(crate) fn remove(&mut self, name: u64) -> Option<u32> {
        let (h, pos) = self.find(name)?;
        self.vacate(h);
        self.settle();
        Some(pos)
    }

    /// Removes the entry `find` returned without resizing, so that the entries other finds
    /// returned stay where they are; [`NameMap::settle`] afterwards.
    #[inline(always)]
    pub(crate) fn vacate(&mut self, h: usize) {
        let (to, s) = (h >> 4, h & 7);
        if h & 8 == 0 {
            // Away from home: lower the counts of the groups it passed.
            let [lo, hi, _] = self.entries[entry_at(h)];
            let (mut g, _) = self.place(join(lo, hi));
            while g != to {
                // A saturated count no longer knows how many it stands for: it stays.
                if overflow(self.ctrl[g]) != u8::MAX {
                    self.ctrl[g] -= ONE;
                }
                g = self.next(g);
            }
        }
        Self::empty(&mut self.ctrl[to], s);
        self.len -= 1;
    }

    /// Shrinks the table when removals left it under a quarter full, down to its reserved room.
    pub(crate) fn settle(&mut self) {
        if self.len * 4 < self.groups() * GROUP && self.groups() > MIN_GROUPS.max(self.floor()) {
            self.resize(self.target_groups(self.len));
        }
    }

    /// Marks place `s` of a group's control word empty.
    #[inline]
    fn empty(word: &mut u64, s: usize) {
        *word = (*word & !(0xFF << (s * 8))) | (EMPTY as u64) << (s * 8);
    }

    /// Whether entry `i` (in `ctrl`'s numbering by groups of seven) is live.
    #[inline]
    fn live(ctrl: &[u64], i: usize) -> bool {
        (ctrl[i / GROUP] >> ((i % GROUP) * 8)) as u8 & EMPTY == 0
    }

    /// Keeps the entries for which `keep(name, position)` holds.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u64, u32) -> bool) {
        for i in 0..self.entries.len() {
            if Self::live(&self.ctrl, i) {
                let [lo, hi, v] = self.entries[i];
                if !keep(join(lo, hi), v) {
                    // Emptied in place: the rebuild below places the survivors afresh.
                    Self::empty(&mut self.ctrl[i / GROUP], i % GROUP);
                    self.len -= 1;
                }
            }
        }
        self.resize(self.target_groups(self.len));
    }

    /// Groups for `len` live names at 50% load, or the reserved room if that is more.
    fn target_groups(&self, len: usize) -> usize {
        (len * 2).div_ceil(GROUP).max(MIN_GROUPS).max(self.floor())
    }

    fn resize(&mut self, groups: usize) {
        let old_ctrl = std::mem::replace(&mut self.ctrl, vec![EMPTY_GROUP; groups]);
        // Written, not left to a zeroing allocation: the pages are taken now, while the table
        // is built (or reserved), instead of one fault at a time under the events that fill it.
        let mut entries = Vec::with_capacity(groups * GROUP);
        entries.resize(groups * GROUP, [u32::MAX; 3]);
        let old = std::mem::replace(&mut self.entries, entries);
        self.len = 0;
        for (word, group) in old_ctrl.iter().zip(old.chunks_exact(GROUP)) {
            // The places whose tag is not EMPTY, one high bit each.
            let mut live = !word & HIGH;
            while live != 0 {
                let [lo, hi, pos] = group[(live.trailing_zeros() / 8) as usize];
                live &= live - 1;
                let name = join(lo, hi);
                let (home, tag) = self.place(name);
                let to = self.room_from(home);
                self.fill(name, pos, to, home, tag);
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
        let word = u64::from_le_bytes([5, EMPTY, 5, 0x7F, EMPTY, 0, 5, 0xFF]);
        let m = matches(word, 5);
        assert_eq!(
            m & (0x80 | 0x80 << 16 | 0x80 << 48),
            0x80 | 0x80 << 16 | 0x80 << 48
        );
        assert_eq!(m >> COUNT_SHIFT, 0, "the overflow count is never a tag");
        assert_eq!(empties(word), 0x80 << 8 | 0x80 << 32);
        assert_eq!(overflow(word), 0xFF);
    }

    #[test]
    fn overflow_counts_return_to_zero_when_the_names_that_raised_them_leave() {
        let mut m = NameMap::default();
        m.resize(8);
        // Ten names with one home group: seven fill it, three go on.
        let home: Vec<u64> = (0..u64::MAX)
            .filter(|&n| m.place(n).0 == 3)
            .take(10)
            .collect();
        for (i, &n) in home.iter().enumerate() {
            assert_eq!(m.insert(n, i as u32), None);
        }
        assert_eq!(m.groups(), 8, "no rebuild in between");
        assert_eq!(overflow(m.ctrl[3]), 3);
        for (i, &n) in home.iter().enumerate() {
            assert_eq!(m.get(n), Some(i as u32));
        }
        // Emptying the home group leaves the count: the three beyond must stay reachable.
        for &n in &home[..7] {
            let (i, _) = m.find(n).unwrap();
            m.vacate(i);
        }
        assert_eq!(overflow(m.ctrl[3]), 3);
        for (i, &n) in home.iter().enumerate().skip(7) {
            assert_eq!(m.get(n), Some(i as u32));
        }
        for &n in &home[7..] {
            let (i, _) = m.find(n).unwrap();
            m.vacate(i);
        }
        assert!(m.ctrl.iter().all(|&w| overflow(w) == 0));
        assert_eq!(m.len(), 0);
    }

    #[test]
    fn reserved_room_is_neither_rebuilt_while_filling_nor_given_back() {
        let mut m = NameMap::default();
        m.reserve(10_000);
        let groups = m.groups();
        assert!(
            groups * GROUP * 65 >= 10_000 * 100,
            "room for 10,000 at 65%"
        );
        let mut model = HashMap::new();
        for n in 0..10_000u64 {
            let name = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555;
            assert_eq!(m.insert(name, n as u32), None);
            model.insert(name, n as u32);
        }
        assert_eq!(m.groups(), groups, "not rebuilt while it filled");
        // A quarter more fits before it grows.
        for n in 0..2_400u64 {
            assert_eq!(m.insert(!n, 7), None);
        }
        assert_eq!(m.groups(), groups, "not rebuilt within the slack");
        for n in 0..2_400u64 {
            assert_eq!(m.remove(!n), Some(7));
        }
        // Removals that leave it nearly empty do not shrink it below the reservation.
        let names: Vec<u64> = model.keys().copied().collect();
        for &name in &names[..9_990] {
            assert_eq!(m.remove(name), model.remove(&name));
        }
        assert_eq!(m.groups(), groups);
        for (k, v) in &model {
            assert_eq!(m.get(*k), Some(*v));
        }
        // Past the reservation it grows as an unreserved map would.
        for n in 0..20_000u64 {
            m.insert(n, 1);
        }
        assert!(m.groups() > groups);
        assert_eq!(m.len(), 20_010);
        // Clearing forgets the names and keeps the reserved room (not the growth past it).
        m.clear();
        assert_eq!((m.len(), m.groups()), (0, groups));
        assert_eq!(m.get(5), None);
    }

    #[test]
    fn room_checked_for_a_batch_is_room_for_each_of_its_inserts() {
        let mut m = NameMap::default();
        assert!(!m.has_room_for(1), "an empty table has no groups yet");
        m.reserve(1_000);
        let groups = m.groups();
        // Room for the reservation and its quarter of slack, and not one name more.
        assert!(m.has_room_for(1_250));
        assert!(!m.has_room_for(1_251));
        for n in 0..1_250u64 {
            assert_eq!(
                m.insert_with_room(n.wrapping_mul(0x9E37_79B9_7F4A_7C15), 1),
                None
            );
        }
        assert_eq!((m.groups(), m.len()), (groups, 1_250));
        assert!(!m.has_room_for(1));
        // A replacement needs no room, and `insert` grows the table once it is due.
        assert_eq!(m.insert_with_room(0, 2), Some(1));
        assert_eq!(m.insert(u64::MAX, 3), None);
        assert!(m.groups() > groups);
        assert_eq!(m.get(0), Some(2));
    }

    #[test]
    fn replacing_a_name_when_the_table_is_due_to_grow_keeps_one_entry() {
        let mut m = NameMap::default();
        let mut n = 0u64;
        while (m.len() + 1) * 10 <= m.groups() * GROUP * 7 || m.len() == 0 {
            n += 1;
            m.insert(n, n as u32);
        }
        let len = m.len();
        assert_eq!(m.insert(1, 99), Some(1));
        assert_eq!(m.len(), len);
        assert_eq!(m.remove(1), Some(99));
        assert_eq!(m.get(1), None);
    }
}
