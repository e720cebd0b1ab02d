//! One rank's block names: a map from the engine's block hash to the block's packed 32-bit
//! position.
//!
//! A name is split in two halves. The high half of every block's name is kept once, by
//! position, beside the runs ([`HighHalves`]): ranks that name a block alike (engines hash the
//! same tokens the same way) share it. A rank's map keeps the low half and the position, 8
//! bytes a name, 64 bytes a group of seven with its control word. A candidate whose low half
//! matches is checked against the high half kept at its position, so every answer is exact. A
//! rank that names a block otherwise than the high half kept for it (another hash seed, a
//! salt) keeps that name whole in a small side map, which stays empty when ranks agree.
//!
//! The main map is a Swiss table whose groups count overflow instead of keeping tombstones.
//! The control words are kept apart from the entries, an eighth of the table, so that most of
//! them stay in cache: an insert then mostly writes an entry line (a write does not hold up
//! what follows it) rather than reading one first.
//!
//! ```text
//!  control words  [t0 t1 t2 t3 t4 t5 t6 | overflow] per group
//!  entries        [low half, position] x 7 per group (56 bytes)
//! ```
//!
//! A lookup compares the seven tags of the name's home group at once, checks the names of the
//! candidates, and moves on to the next group only while the group's overflow count is not
//! zero: the count is how many names sit beyond the group because it was full when they came.
//! So a lookup for an absent name (the insert of every new block) usually ends in its home
//! group. A removal empties its entry and lowers the counts its name raised, so nothing goes
//! stale however long an engine stores and evicts, and the table is rebuilt only to grow or
//! shrink. A count that reaches 255 stays there until the next rebuild (lookups through it
//! probe one group further). An unreserved table holds at most 70% of its entries and is
//! rebuilt at 50%; a reserved one is sized for its names at [`RESERVED_LOAD_PCT`].
//!
//! The entry for a name stays valid only while the high half kept at its position does not
//! change: the index changes a position's high half only while no rank holds the block, and a
//! rank's name for a block lives only while the rank holds it.
//!
//! The caller can [`NameMap::prefetch`] the home group of a name a few names ahead: an event's
//! names land on random groups, and overlapping those cache misses is most of the speed of
//! applying events.

use std::collections::HashMap;

use super::mix::{prefetch_addr, prefetch_addr_l2, set_bytes, MixState};

/// Entries per group.
pub(crate) const GROUP: usize = 7;
const EMPTY: u8 = 0x80;
const LOW: u64 = 0x0001_0101_0101_0101;
const HIGH: u64 = 0x0080_8080_8080_8080;
/// The control word of an empty group: seven empty tags, no overflow.
const EMPTY_GROUP: u64 = LOW * EMPTY as u64;
const COUNT_SHIFT: u32 = 56;
const ONE: u64 = 1 << COUNT_SHIFT;
const MIN_GROUPS: usize = 2;
/// How full a table sized for its reserved names is once they are all in: the time a lookup
/// takes grows steeply with the load (docs/experiments.md, §2.3 "Load", and the 45% row of
/// §2.1 "Kept, and the measurement that chose each").
pub(crate) const RESERVED_LOAD_PCT: usize = 45;
/// Bytes of a group: its control word and its entries.
pub(crate) const GROUP_BYTES: usize = 8 + std::mem::size_of::<Entries>();
/// The handle of an entry in the side map.
const SIDE: usize = usize::MAX;

/// Where the high halves of block names are kept: one per position, the half of the name the
/// block was stored under while no rank held it.
pub(crate) trait HighHalves {
    /// The high half of the name kept for the block at `pos`.
    fn high(&self, pos: u32) -> u32;
}

/// A group's entries: `[low half of the name, position]` per place.
type Entries = [[u32; 2]; GROUP];

const EMPTY_ENTRIES: Entries = [[u32::MAX; 2]; GROUP];

#[derive(Clone, Debug, Default)]
pub(crate) struct NameMap {
    /// One control word per group: seven tag bytes (seven bits of the name's hash, or
    /// [`EMPTY`]) and the overflow count. Apart from the entries, so that the words of all
    /// groups (an eighth of the table) stay in cache.
    ctrl: Vec<u64>,
    /// Each group's entries.
    entries: Vec<Entries>,
    /// Names in the table proper.
    len: usize,
    /// Names whose high half differs from the one kept at their position, whole.
    side: HashMap<u64, u32, MixState>,
    /// Names the rank is expected to hold ([`NameMap::reserve`]): the table keeps room for them
    /// (its [`NameMap::floor`]).
    reserved: usize,
}

#[inline]
fn high_half(name: u64) -> u32 {
    (name >> 32) as u32
}

/// The name's high half folded into its low half, times an odd constant (Fibonacci hashing):
/// every bit of the name moves the product's high bits, which choose the group, and its bits 32
/// to 38, which make the tag.
#[inline]
fn mix(name: u64) -> u64 {
    (name ^ (name >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Tags of `word` equal to `tag` (with rare false positives above a true match, which the name
/// comparison weeds out). The overflow count needs no masking: `HIGH` leaves its byte out, and
/// a borrow only ever runs upwards, from the tags into it.
#[inline]
fn matches(word: u64, tag: u8) -> u64 {
    let x = word ^ (LOW * tag as u64);
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
/// place in the group, so that a removal from the home group (the common case) need not find
/// the home again. [`SIDE`] for the side map.
#[inline]
fn handle(g: usize, s: usize, home: bool) -> usize {
    g << 4 | (home as usize) << 3 | s
}

impl NameMap {
    /// Makes room for `names` names at once, and keeps it: the table is not rebuilt while it
    /// fills up to them ([`RESERVED_LOAD_PCT`] full then), nor shrunk below them when names
    /// leave. It takes half as many again before it grows (70% full): a rank may store a
    /// batch before it evicts to make room.
    pub(crate) fn reserve(&mut self, names: usize, highs: &impl HighHalves) {
        self.reserved = names;
        if self.groups() < self.floor() {
            self.resize(self.floor(), highs);
        }
    }

    /// Groups the table never shrinks below: room for the reserved names at
    /// [`RESERVED_LOAD_PCT`].
    #[inline]
    fn floor(&self) -> usize {
        match self.reserved {
            0 => 0,
            n => (n * 100)
                .div_ceil(GROUP * RESERVED_LOAD_PCT)
                .max(MIN_GROUPS),
        }
    }

    /// Gives the reserved room back: the table shrinks to what its names need.
    pub(crate) fn release(&mut self, highs: &impl HighHalves) {
        self.reserved = 0;
        if self.groups() > self.target_groups(self.len) {
            self.resize(self.target_groups(self.len), highs);
        }
    }

    /// Heap bytes of the reserved room.
    pub(crate) fn reserved_bytes(&self) -> usize {
        self.floor() * GROUP_BYTES
    }

    /// Forgets every name and keeps the reserved room. (An empty table needs no high halves.)
    pub(crate) fn clear(&mut self) {
        let reserved = self.reserved;
        *self = NameMap::default();
        self.reserved = reserved;
        self.resize_empty(self.floor());
    }

    pub(crate) fn len(&self) -> usize {
        self.len + self.side.len()
    }

    /// Heap bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.ctrl.capacity() * 8
            + self.entries.capacity() * std::mem::size_of::<Entries>()
            + set_bytes::<(u64, u32)>(self.side.capacity())
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

    /// Hints the CPU to fetch the group `name` starts probing at: its control word into the
    /// first-level cache, and its entries there too, or with `to_l2` into the second level
    /// only (see [`super::mix::prefetch_addr_l2`]; an insert writes its entry, which waits
    /// on nothing, and a burst of lookups at an event's start fetches more names at once than
    /// the first level has room to wait on).
    #[inline]
    pub(crate) fn prefetch(&self, name: u64, to_l2: bool) {
        // An address only, never dereferenced: `g` is below `groups()` (or the table is empty,
        // and the hint points nowhere), so no bounds are checked.
        let (g, _) = self.place(name);
        prefetch_addr(self.ctrl.as_ptr().wrapping_add(g));
        // A group's 56 bytes of entries span one or two cache lines: their first and last
        // bytes fall in each.
        let entries = self.entries.as_ptr().wrapping_add(g).cast::<u8>();
        let last = entries.wrapping_add(std::mem::size_of::<Entries>() - 1);
        if to_l2 {
            prefetch_addr_l2(entries);
            prefetch_addr_l2(last);
        } else {
            prefetch_addr(entries);
            prefetch_addr(last);
        }
    }

    #[inline]
    pub(crate) fn get(&self, name: u64, highs: &impl HighHalves) -> Option<u32> {
        self.find(name, highs).map(|(_, pos)| pos)
    }

    /// The place in group `g` (control word `word`) that holds `name`, and its position.
    #[inline(always)]
    fn find_in(
        &self,
        g: usize,
        word: u64,
        tag: u8,
        name: u64,
        highs: &impl HighHalves,
    ) -> Option<(usize, u32)> {
        let mut m = matches(word, tag);
        while m != 0 {
            // Entries are read only for matching tags: a new name, the common insert, reads
            // none of them.
            let s = (m.trailing_zeros() / 8) as usize;
            let [low, pos] = self.entries[g][s];
            // Bytes above a true match can match falsely, and an emptied entry keeps its old
            // contents: the tag must match too, before the position is trusted.
            if (word >> (s * 8)) as u8 == tag
                && low == name as u32
                && highs.high(pos) == high_half(name)
            {
                return Some((s, pos));
            }
            m &= m - 1;
        }
        None
    }

    /// Probes for `name` in a table with groups: `Ok((handle, position))` of the entry
    /// holding it, or `Err((room, home, tag))`: the first group with room on its path, its
    /// home group and its tag.
    #[inline(always)]
    fn probe(
        &self,
        name: u64,
        highs: &impl HighHalves,
    ) -> Result<(usize, u32), (usize, usize, u8)> {
        let (home, tag) = self.place(name);
        let mut g = home;
        let word = self.ctrl[g];
        if let Some((s, pos)) = self.find_in(g, word, tag, name, highs) {
            return Ok((handle(g, s, true), pos));
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
            if let Some((s, pos)) = self.find_in(g, word, tag, name, highs) {
                return Ok((handle(g, s, false), pos));
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

    /// The entry in the table proper, if the name is there.
    #[inline(always)]
    fn find_main(&self, name: u64, highs: &impl HighHalves) -> Option<(usize, u32)> {
        if self.ctrl.is_empty() {
            return None;
        }
        self.probe(name, highs).ok()
    }

    /// The entry handle and position of a name, for [`NameMap::vacate`].
    #[inline(always)]
    pub(crate) fn find(&self, name: u64, highs: &impl HighHalves) -> Option<(usize, u32)> {
        if let Some(found) = self.find_main(name, highs) {
            return Some(found);
        }
        if self.side.is_empty() {
            return None;
        }
        self.side.get(&name).map(|&pos| (SIDE, pos))
    }

    /// Inserts or replaces; returns the previous position. The high half kept at `pos` must be
    /// set.
    #[cfg(test)]
    pub(crate) fn insert(&mut self, name: u64, pos: u32, highs: &impl HighHalves) -> Option<u32> {
        let kept = highs.high(pos) == high_half(name);
        self.insert_compared(name, pos, kept, false, highs)
    }

    /// Whether `n` more names fit without a rebuild, so that each may be inserted with
    /// `room` set (the check made once for a batch, not per name).
    #[inline]
    pub(crate) fn has_room_for(&self, n: usize) -> bool {
        !self.due_to_grow_by(n)
    }

    /// Inserts or replaces a name the caller compared with the high half kept at `pos`
    /// (`kept`: they are equal), into a table known to have room for it when `room`
    /// ([`NameMap::has_room_for`]); returns the previous position. One probe serves both
    /// outcomes: a new name (the common case: a stored block is new to its rank) lands in the
    /// first group with room that the search passed.
    #[inline(always)]
    pub(crate) fn insert_compared(
        &mut self,
        name: u64,
        pos: u32,
        kept: bool,
        room: bool,
        highs: &impl HighHalves,
    ) -> Option<u32> {
        debug_assert_eq!(kept, highs.high(pos) == high_half(name));
        if !kept {
            return self.insert_side(name, pos, highs);
        }
        if !room && self.due_to_grow() {
            if let Some((h, old)) = self.find_main(name, highs) {
                self.set_pos(h, pos);
                return Some(old);
            }
            self.resize(self.target_groups(self.len + 1), highs);
        }
        self.insert_main(name, pos, highs)
    }

    /// Inserts a name whose high half is the one kept at `pos` into a table with room.
    #[inline(always)]
    fn insert_main(&mut self, name: u64, pos: u32, highs: &impl HighHalves) -> Option<u32> {
        match self.probe(name, highs) {
            Ok((h, old)) => {
                self.set_pos(h, pos);
                Some(old)
            }
            Err((to, home, tag)) => {
                self.fill(name, pos, to, home, tag);
                if self.side.is_empty() {
                    None
                } else {
                    self.side.remove(&name)
                }
            }
        }
    }

    /// Inserts a name whose high half differs from the one kept at `pos`: whole, in the side
    /// map.
    #[cold]
    fn insert_side(&mut self, name: u64, pos: u32, highs: &impl HighHalves) -> Option<u32> {
        let old = self.find_main(name, highs).map(|(h, old)| {
            self.vacate(h, name);
            old
        });
        self.side.insert(name, pos).or(old)
    }

    #[inline]
    fn set_pos(&mut self, h: usize, pos: u32) {
        self.entries[h >> 4][h & 7][1] = pos;
    }

    /// Whether one more name would take the table over 70% full.
    #[inline]
    fn due_to_grow(&self) -> bool {
        self.due_to_grow_by(1)
    }

    /// Whether `n` more names would take the table over 70% full (a table sized for its
    /// reserved names takes half as many again before that).
    #[inline]
    fn due_to_grow_by(&self, n: usize) -> bool {
        (self.len + n) * 10 > self.groups() * GROUP * 7
    }

    /// Writes a new name (home group `home`, tag `tag`) into group `to`, which has room, and
    /// counts it in the overflow of every group it passed. Always inlined: with the call
    /// kept, Stored events took about 1.05× the time (the entry's store usually waits for
    /// its line, and the call's register saves are likely more stores queued behind it).
    #[inline(always)]
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
        self.entries[to][s] = [name as u32, pos];
        self.len += 1;
    }

    /// Removes a name; returns its position.
    pub(crate) fn remove(&mut self, name: u64, highs: &impl HighHalves) -> Option<u32> {
        let (h, pos) = self.find(name, highs)?;
        self.vacate(h, name);
        self.settle(highs);
        Some(pos)
    }

    /// Removes the entry `find` returned for `name` without resizing, so that the entries
    /// other finds returned stay where they are; [`NameMap::settle`] afterwards.
    #[inline(always)]
    pub(crate) fn vacate(&mut self, h: usize, name: u64) {
        if h == SIDE {
            self.side.remove(&name);
            return;
        }
        let (to, s) = (h >> 4, h & 7);
        if h & 8 == 0 {
            // Away from home: lower the counts of the groups it passed.
            let (mut g, _) = self.place(name);
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
    pub(crate) fn settle(&mut self, highs: &impl HighHalves) {
        if self.len * 4 < self.groups() * GROUP && self.groups() > MIN_GROUPS.max(self.floor()) {
            self.resize(self.target_groups(self.len), highs);
        }
    }

    /// Marks place `s` of a group's control word empty.
    #[inline]
    fn empty(word: &mut u64, s: usize) {
        *word = (*word & !(0xFF << (s * 8))) | (EMPTY as u64) << (s * 8);
    }

    /// The live entries of a table's groups: (name, position).
    fn live<'a>(
        (ctrl, entries): &'a (Vec<u64>, Vec<Entries>),
        highs: &'a impl HighHalves,
    ) -> impl Iterator<Item = (u64, u32)> + 'a {
        ctrl.iter().zip(entries).flat_map(move |(word, group)| {
            // The places whose tag is not EMPTY, one high bit each.
            let mut live = !word & HIGH;
            std::iter::from_fn(move || {
                if live == 0 {
                    return None;
                }
                let [low, pos] = group[(live.trailing_zeros() / 8) as usize];
                live &= live - 1;
                Some((u64::from(highs.high(pos)) << 32 | u64::from(low), pos))
            })
        })
    }

    /// Keeps the entries for which `keep(name, position)` holds.
    pub(crate) fn retain(
        &mut self,
        mut keep: impl FnMut(u64, u32) -> bool,
        highs: &impl HighHalves,
    ) {
        self.side.retain(|&name, &mut pos| keep(name, pos));
        let old = self.resize_empty(0);
        let kept: Vec<(u64, u32)> = Self::live(&old, highs)
            .filter(|&(name, pos)| keep(name, pos))
            .collect();
        drop(old);
        self.resize_empty(self.target_groups(kept.len()));
        for (name, pos) in kept {
            self.refill(name, pos);
        }
    }

    /// Groups for `len` live names at 50% load, or the reserved room if that is more.
    fn target_groups(&self, len: usize) -> usize {
        (len * 2).div_ceil(GROUP).max(MIN_GROUPS).max(self.floor())
    }

    /// Replaces the table with `groups` empty groups; returns the old one. Written, not left
    /// to a zeroing allocation: the pages are taken now, while the table is built (or
    /// reserved), instead of one fault at a time under the events that fill it.
    fn resize_empty(&mut self, groups: usize) -> (Vec<u64>, Vec<Entries>) {
        let mut ctrl = Vec::with_capacity(groups);
        ctrl.resize(groups, EMPTY_GROUP);
        let mut entries = Vec::with_capacity(groups);
        entries.resize(groups, EMPTY_ENTRIES);
        self.len = 0;
        (
            std::mem::replace(&mut self.ctrl, ctrl),
            std::mem::replace(&mut self.entries, entries),
        )
    }

    /// Places a name known to be absent, into a table with room.
    fn refill(&mut self, name: u64, pos: u32) {
        let (home, tag) = self.place(name);
        let to = self.room_from(home);
        self.fill(name, pos, to, home, tag);
    }

    fn resize(&mut self, groups: usize, highs: &impl HighHalves) {
        let old = self.resize_empty(groups);
        for (name, pos) in Self::live(&old, highs) {
            self.refill(name, pos);
        }
    }
}

#[cfg(test)]
mod tests;
