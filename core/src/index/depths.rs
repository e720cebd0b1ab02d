//! A match's result by the index's dense rank ids: one word per rank id, so that a caller that
//! knows its ranks' ids (a router visiting every rank of its fleet) reads each rank's overlap
//! with one load, and the walk writes one word per holder instead of building a score.
//!
//! The walk's first run is often shared by most ranks (a system prompt) while a selection
//! that prunes reads only the deep ranks: by default its holder words are kept as they are
//! (one copy), the ranks that hold all of it are narrowed straight from them at the next run,
//! and any other rank's overlap is read from them by bisection when asked for. A caller about
//! to read every rank asks for the first run written out as the walk goes
//! ([`RankDepths::set_eager`]).

use std::cell::{Cell, RefCell};

use super::run::{add_tiers, find_group, group_of, leading, rank_at};
use crate::event::{StorageTier, WorkerRank};

/// A registered rank's id, with the number of ids the index had freed when it gave the id out:
/// the key a caller that keeps rank ids reads a [`RankDepths`] by. Two keys of one id differ
/// in `epoch`, as the id was freed in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankKey {
    /// The rank's dense id in the index.
    pub id: u32,
    /// Ids the index had freed when it gave this one out.
    pub epoch: u32,
}

/// The tier byte of a rank whose blocks sit in more than one tier (its split is in the side
/// table).
const MIXED: u8 = 0xFF;
/// Bits of an entry below the stamp: the tier byte and the block count.
const STAMP_SHIFT: u32 = 40;
/// The match's deepest overlaps kept by [`RankDepths`].
const TOP: usize = 4;
/// Stamps wrap after this many matches (the table is then cleared once).
const STAMP_LIMIT: u32 = 1 << 24;

/// Leading blocks per rank id, from [`super::IndexReader::find_depths_into`]. Reuse one value
/// across calls: a match then neither allocates nor clears the table, as entries carry the
/// stamp of the match that wrote them.
///
/// Ids are the index's dense rank ids: stable while a rank is registered, and reused after it
/// is removed. A caller that keeps a rank's id reads by its [`RankKey`]
/// ([`super::PrefixIndex::rank_key`]), which carries how many ids the index had freed when it
/// gave the id out: [`RankDepths::get_for`] answers only for a key given out before the
/// match began, so an entry under a reused id never goes to a rank that took the id during the
/// match. (The other way round, a rank removed during the match may find its id's next owner's
/// blocks under its own: the router retires a rank before the index frees its id, and credits
/// retired ranks nothing.)
#[derive(Clone, Debug, Default)]
pub struct RankDepths {
    /// By rank id: `stamp << 40 | tier << 32 | blocks` (tier [`MIXED`]: see `split`).
    entries: Vec<u64>,
    /// By rank id: blocks per tier, for ranks whose entry says [`MIXED`].
    split: Vec<[u32; StorageTier::COUNT]>,
    /// Ids the index had freed when the match began ([`RankKey::epoch`]).
    epoch: u32,
    /// The current match's stamp (never 0, so an untouched entry never matches).
    stamp: u32,
    /// Ranks still holding every block so far: (rank id, rank id), as the walk narrows them.
    pub(super) active: Vec<(u32, u32)>,
    /// The match's deepest overlaps (the walk's, then raised): (blocks, rank id), deepest
    /// first (the first found of equals ahead), `(0, 0)` where there are fewer.
    top: [(u32, u32); TOP],
    /// The rank of the deepest, named when the walk ends.
    deepest: Option<WorkerRank>,
    /// The one rank id this match scores ([`super::IndexReader::find_depth_of_into`]), or
    /// `None` for every rank.
    pub(super) only: Option<u32>,
    /// The walk's first run's holder words, as the run held them: a rank whose entry was not
    /// written reads its overlap from here (the first `pending_m` blocks). Most ranks of a
    /// shared first run (a system prompt) go no further, and most matches read few of them.
    pending: Vec<u64>,
    /// Blocks the first run matched (0: nothing pending).
    pending_m: u32,
    /// The table's size when the first run was kept: ranks with ids past it are left out, as
    /// the eager walk leaves them out (a raise may grow the table since).
    pending_ids: usize,
    /// By rank id: the first run's entries (as `entries` holds them), written on the first
    /// read of a pending rank, so that a caller reading many ranks finds each with one load,
    /// while a match that reads none pays nothing for them.
    pending_at: RefCell<Vec<u64>>,
    /// True once `pending_at` is built for this match.
    pending_indexed: Cell<bool>,
    /// True while the ranks holding all of the first run are kept in `pending` rather than in
    /// `active` (until the next run narrows them).
    pub(super) pending_active: bool,
    /// How many of them, counted up to 2 (the walk only asks for none, one or more).
    pub(super) pending_full: usize,
    /// Every rank of the first run written during the walk ([`RankDepths::set_eager`]).
    pub(super) eager: bool,
}

/// One rank's overlap as [`RankDepths::get`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Depth {
    /// Leading blocks held, in any tier.
    pub blocks: u32,
    /// The tier holding all of them, or `None` when they are spread over several (see
    /// [`RankDepths::per_tier`]).
    pub tier: Option<StorageTier>,
}

impl RankDepths {
    /// Starts a match over rank ids below `ranks`, `epoch` ids freed so far.
    pub(super) fn begin(&mut self, ranks: usize, epoch: u32) {
        self.epoch = epoch;
        self.top = [(0, 0); TOP];
        self.deepest = None;
        self.only = None;
        self.pending.clear();
        self.pending_m = 0;
        self.pending_ids = 0;
        self.pending_indexed.set(false);
        self.pending_active = false;
        self.pending_full = 0;
        self.active.clear();
        self.stamp += 1;
        if self.stamp >= STAMP_LIMIT {
            self.entries.iter_mut().for_each(|e| *e = 0);
            self.pending_at.get_mut().iter_mut().for_each(|e| *e = 0);
            self.stamp = 1;
        }
        if self.entries.len() < ranks {
            self.grow(ranks);
        }
    }

    fn grow(&mut self, ranks: usize) {
        self.entries.resize(ranks, 0);
        self.split.resize(ranks, [0; StorageTier::COUNT]);
    }

    #[inline(always)]
    fn live(&self, e: u64) -> bool {
        (e >> STAMP_SHIFT) as u32 == self.stamp
    }

    #[inline(always)]
    fn entry(&self, tier: u8, blocks: u32) -> u64 {
        u64::from(self.stamp) << STAMP_SHIFT | u64::from(tier) << 32 | u64::from(blocks)
    }

    /// The overlap of rank id `id` (`None`: it holds not even the first block).
    #[inline(always)]
    pub fn get(&self, id: u32) -> Option<Depth> {
        let e = *self.entries.get(id as usize)?;
        if !self.live(e) {
            return self.pending_get(id);
        }
        let t = (e >> 32) as u8;
        Some(Depth {
            blocks: e as u32,
            tier: StorageTier::ALL.get(t as usize).copied(),
        })
    }

    /// [`RankDepths::get`] of a rank with no entry written: its first-run overlap, if any.
    #[inline(never)]
    fn pending_get(&self, id: u32) -> Option<Depth> {
        let e = self.pending_entry(id)?;
        Some(Depth {
            blocks: e as u32,
            tier: StorageTier::ALL.get((e >> 32) as u8 as usize).copied(),
        })
    }

    /// The entry rank id `id` would have had, had the first run been written (`None`: it
    /// holds none of it, or its id is past the table).
    #[inline]
    fn pending_entry(&self, id: u32) -> Option<u64> {
        if self.pending_m == 0 || id as usize >= self.pending_ids {
            return None;
        }
        if !self.pending_indexed.get() {
            self.index_pending();
        }
        let e = self.pending_at.borrow()[id as usize];
        self.live(e).then_some(e)
    }

    /// Writes `pending_at`: the first run's entries, as the eager walk writes them into the
    /// table (a rank's blocks split over several tiers marked [`MIXED`], its split read again
    /// from the run when asked for).
    #[cold]
    fn index_pending(&self) {
        let mut at = self.pending_at.borrow_mut();
        if at.len() < self.pending_ids {
            at.resize(self.pending_ids, 0);
        }
        let m = self.pending_m as usize;
        let holders = &self.pending;
        let n = holders.len() / 2;
        let mut h = 0;
        while h < n {
            let (word, mask) = (holders[2 * h], holders[2 * h + 1]);
            let id = (word >> 8) as usize;
            if holders
                .get(2 * h + 2)
                .is_none_or(|&w| (w >> 8) as usize != id)
            {
                // One holder (one tier): the common case.
                h += 1;
                let lead = leading(mask, m);
                if let (Some(slot), true) = (at.get_mut(id), lead > 0) {
                    *slot = self.entry(word as u8, lead as u32);
                }
                continue;
            }
            let (end, union) = group_of(holders, h, n);
            let group = &holders[2 * h..2 * end];
            h = end;
            let lead = leading(union, m);
            let Some(slot) = at.get_mut(id) else {
                continue;
            };
            if lead == 0 {
                continue;
            }
            let tier = if group.len() == 2 {
                group[0] as u8
            } else {
                let mut split = [0; StorageTier::COUNT];
                add_tiers(&mut split, group, lead);
                let mut tiers = split.iter().enumerate().filter(|(_, &b)| b > 0);
                match (tiers.next(), tiers.next()) {
                    (Some((t, _)), None) => t as u8,
                    _ => MIXED,
                }
            };
            *slot = self.entry(tier, lead as u32);
        }
        self.pending_indexed.set(true);
    }

    /// True when `key` was given out before the match began: the entry under its id is then
    /// its rank's (or its rank was removed during the match).
    #[inline(always)]
    pub fn covers(&self, key: RankKey) -> bool {
        key.epoch <= self.epoch
    }

    /// The overlap of the rank `key` was given to (`None`: it holds not even the first block,
    /// or took its id after the match began).
    #[inline(always)]
    pub fn get_for(&self, key: RankKey) -> Option<Depth> {
        if self.covers(key) {
            self.get(key.id)
        } else {
            None
        }
    }

    /// The blocks of rank id `id` split by the fastest tier each is held in.
    #[inline]
    pub fn per_tier(&self, id: u32) -> [u32; StorageTier::COUNT] {
        let Some(&e) = self.entries.get(id as usize) else {
            return [0; StorageTier::COUNT];
        };
        if !self.live(e) {
            return self.pending_per_tier(id);
        }
        let t = (e >> 32) as u8;
        if t == MIXED {
            self.split[id as usize]
        } else {
            one_tier(t, e as u32)
        }
    }

    /// [`RankDepths::per_tier`] of a rank with no entry written: its first-run blocks, if any.
    #[inline(never)]
    fn pending_per_tier(&self, id: u32) -> [u32; StorageTier::COUNT] {
        let mut split = [0; StorageTier::COUNT];
        let Some(e) = self.pending_entry(id) else {
            return split;
        };
        let (tier, blocks) = ((e >> 32) as u8, e as u32);
        if tier != MIXED {
            return one_tier(tier, blocks);
        }
        if let Some((start, end, _)) = find_group(&self.pending, id) {
            add_tiers(
                &mut split,
                &self.pending[2 * start..2 * end],
                blocks as usize,
            );
        }
        split
    }

    /// The rank the walk found deepest (the first found of equals), as the index named it when
    /// the match began; a hint for a caller that visits ranks cheapest first.
    pub fn deepest(&self) -> Option<WorkerRank> {
        self.deepest
    }

    /// The ids of the match's deepest overlaps (at most four; the walk's, and those
    /// [`RankDepths::raise`] raised), deepest first: a hint for a caller that wants a deep
    /// rank it may use without scanning every rank.
    pub fn deepest_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.top
            .iter()
            .take_while(|&&(b, _)| b > 0)
            .map(|&(_, id)| id)
    }

    /// Names the deepest rank from the walk's table of ranks.
    pub(super) fn end(&mut self, ranks: &[Option<WorkerRank>]) {
        if self.top[0].0 > 0 {
            self.deepest = ranks.get(self.top[0].1 as usize).copied().flatten();
        }
    }

    /// The ids this match gave at least `blocks` blocks (at least 1), in increasing order.
    /// Deeper than the fourth deepest, they are among the four deepest, read from there;
    /// otherwise one pass over the table.
    pub fn ids_with_at_least(&self, blocks: u32) -> impl Iterator<Item = u32> + '_ {
        let blocks = blocks.max(1);
        let few = blocks > self.top[TOP - 1].0;
        let mut deep = [u32::MAX; TOP];
        let mut n = 0;
        if few {
            for &(b, id) in &self.top {
                if b >= blocks {
                    deep[n] = id;
                    n += 1;
                }
            }
            deep[..n].sort_unstable();
        }
        let scan = (!few).then(|| self.scan(blocks));
        deep.into_iter().take(n).chain(scan.into_iter().flatten())
    }

    /// The ids this match scored, in increasing order (a scan of the table).
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.scan(1)
    }

    /// The ids with at least `blocks` (≥ 1) blocks, in increasing order: the table's entries,
    /// and the pending first run's ranks where no entry was written.
    fn scan(&self, blocks: u32) -> Scan<'_> {
        Scan {
            depths: self,
            blocks,
            id: 0,
            holder: 0,
        }
    }

    /// Sets the overlap of rank id `id` (below the `ranks` of [`RankDepths::begin`]) as the
    /// first `lead` blocks of `group` (its holder words).
    #[inline(always)]
    pub(super) fn first(&mut self, id: u32, group: &[u64], lead: usize) {
        let i = id as usize;
        self.entries[i] = if group.len() == 2 {
            self.entry(group[0] as u8, lead as u32)
        } else {
            let mut split = [0; StorageTier::COUNT];
            add_tiers(&mut split, group, lead);
            self.single_or_split(i, split, lead as u32)
        };
        self.note_depth(id, lead as u32);
    }

    /// True when rank id `id` has an entry slot (below the `ranks` of [`RankDepths::begin`]).
    #[inline(always)]
    pub(super) fn holds(&self, id: u32) -> bool {
        (id as usize) < self.entries.len()
    }

    /// Keeps the walk's first run, `holders` with `m` blocks matched, to be read when asked
    /// for; notes its deepest ranks (the first four that hold all `m`, none being deeper, or
    /// every rank when fewer do) and counts those that hold all `m`, up to 2.
    pub(super) fn keep_first_run(&mut self, holders: &[u64], m: usize) {
        self.pending.clear();
        self.pending.extend_from_slice(holders);
        self.pending_m = m as u32;
        self.pending_ids = self.entries.len();
        self.pending_active = true;
        let n = holders.len() / 2;
        let mut full = 0;
        let mut h = 0;
        while h < n {
            let id = rank_at(holders, h);
            let (end, union) = group_of(holders, h, n);
            h = end;
            let lead = leading(union, m);
            if lead == 0 || !self.holds(id) {
                continue;
            }
            self.note_depth(id, lead as u32);
            if lead == m {
                full += 1;
                if full == TOP {
                    break;
                }
            }
        }
        self.pending_full = full.min(2);
    }

    /// Narrows the pending first run's ranks that hold all of it against the walk's next run
    /// (`holders`, `m` blocks matched): each rank of the next run that held all of the first
    /// gets its entry, and stays active while it holds all `m`.
    pub(super) fn narrow_first_run(&mut self, holders: &[u64], m: usize) {
        self.pending_active = false;
        self.active.clear();
        let first_m = self.pending_m as usize;
        let n = holders.len() / 2;
        let mut h = 0;
        while h < n {
            let id = rank_at(holders, h);
            let (end, union) = group_of(holders, h, n);
            let group = h..end;
            h = end;
            let lead = leading(union, m);
            if lead == 0 || !self.holds(id) {
                continue;
            }
            let Some((start, stop, first)) = find_group(&self.pending, id) else {
                continue;
            };
            if leading(first, first_m) != first_m {
                continue;
            }
            let pending = std::mem::take(&mut self.pending);
            RankDepths::first(self, id, &pending[2 * start..2 * stop], first_m);
            self.pending = pending;
            RankDepths::add(self, id, &holders[2 * group.start..2 * group.end], lead);
            if lead == m {
                self.active.push((id, id));
            }
        }
    }

    /// [`RankDepths::first`] for a rank with one holder, in `tier`: one store.
    #[inline(always)]
    pub(super) fn first_single(&mut self, id: u32, tier: u8, lead: u32) {
        let e = self.entry(tier, lead);
        if let Some(slot) = self.entries.get_mut(id as usize) {
            *slot = e;
            self.note_depth(id, lead);
        }
    }

    /// Whether matches write every rank of the walk's first run as they go (`true`: for a
    /// caller about to read most ranks, each then with one load) or keep its holder words to
    /// be read when asked for (`false`, the default: for a caller that reads few ranks, the
    /// deep ones). Stays set across matches.
    pub fn set_eager(&mut self, eager: bool) {
        self.eager = eager;
    }

    /// Writes rank id `id`'s entry from the pending first run; true when it had one there.
    fn settle(&mut self, id: u32) -> bool {
        let Some(e) = self.pending_entry(id) else {
            return false;
        };
        if (e >> 32) as u8 != MIXED {
            self.entries[id as usize] = e;
            self.note_depth(id, e as u32);
            return true;
        }
        let Some((start, end, _)) = find_group(&self.pending, id) else {
            return false;
        };
        let pending = std::mem::take(&mut self.pending);
        RankDepths::first(self, id, &pending[2 * start..2 * end], e as u32 as usize);
        self.pending = pending;
        true
    }

    #[inline(always)]
    fn note_depth(&mut self, id: u32, blocks: u32) {
        if blocks > self.top[TOP - 1].0 {
            self.note_deep(id, blocks);
        }
    }

    /// Puts rank id `id` at `blocks` among the deepest (it is deeper than the last of them).
    fn note_deep(&mut self, id: u32, blocks: u32) {
        let mut at = self
            .top
            .iter()
            .position(|&(b, i)| b > 0 && i == id)
            .unwrap_or(TOP - 1);
        self.top[at] = (blocks, id);
        while at > 0 && self.top[at - 1].0 < blocks {
            self.top.swap(at - 1, at);
            at -= 1;
        }
    }

    /// Adds the first `lead` blocks of `group` to the overlap of rank id `id` (which has one).
    #[inline(always)]
    pub(super) fn add(&mut self, id: u32, group: &[u64], lead: usize) {
        let i = id as usize;
        let e = self.entries[i];
        let (tier, blocks) = ((e >> 32) as u8, e as u32);
        self.note_depth(id, blocks + lead as u32);
        if group.len() == 2 && group[0] as u8 == tier {
            self.entries[i] = e + lead as u64;
            return;
        }
        let mut split = if tier == MIXED {
            self.split[i]
        } else {
            one_tier(tier, blocks)
        };
        add_tiers(&mut split, group, lead);
        self.entries[i] = self.single_or_split(i, split, blocks + lead as u32);
    }

    /// Raises the rank of `key` to `depth` blocks when it holds fewer, the blocks added counted
    /// as device blocks (a caller's own evidence of cached blocks); true when it rose. A key
    /// the match does not cover ([`RankDepths::covers`]) is not raised. Raises come after the
    /// walk (which only deepens entries it wrote itself), so the four deepest stay exact.
    #[inline]
    pub fn raise(&mut self, key: RankKey, depth: u32) -> bool {
        if !self.covers(key) {
            return false;
        }
        let i = key.id as usize;
        let Some(&e) = self.entries.get(i) else {
            self.grow(i + 1);
            return self.raise(key, depth);
        };
        if !self.live(e) && self.settle(key.id) {
            return self.raise(key, depth);
        }
        let (tier, blocks) = if self.live(e) {
            ((e >> 32) as u8, e as u32)
        } else {
            (StorageTier::Device as u8, 0)
        };
        if depth <= blocks {
            return false;
        }
        let device = StorageTier::Device as u8;
        if tier == device {
            self.entries[i] = self.entry(device, depth);
        } else {
            self.raise_split(i, tier, blocks, depth);
        }
        self.note_depth(key.id, depth);
        true
    }

    /// [`RankDepths::raise`] of an entry not all on the device tier.
    #[cold]
    fn raise_split(&mut self, i: usize, tier: u8, blocks: u32, depth: u32) {
        let device = StorageTier::Device as u8;
        let mut split = if tier == MIXED {
            self.split[i]
        } else {
            one_tier(tier, blocks)
        };
        split[device as usize] += depth - blocks;
        self.entries[i] = self.single_or_split(i, split, depth);
    }

    /// The entry for `split` (summing to `blocks`): one tier when only one holds blocks,
    /// otherwise [`MIXED`] with the split stored.
    fn single_or_split(&mut self, i: usize, split: [u32; StorageTier::COUNT], blocks: u32) -> u64 {
        let mut tiers = split.iter().enumerate().filter(|(_, &b)| b > 0);
        match (tiers.next(), tiers.next()) {
            (Some((t, _)), None) => self.entry(t as u8, blocks),
            _ => {
                self.split[i] = split;
                self.entry(MIXED, blocks)
            }
        }
    }

    /// The overlaps as scores, ranks named through `reader` (as it names them now: call it
    /// while no rank is removed, or expect ids reused since the match under their new rank).
    pub fn to_scores(&self, reader: &super::IndexReader) -> Vec<super::RankScore> {
        self.ids()
            .filter_map(|id| {
                let rank = reader.rank_of(id)?;
                let per_tier = self.per_tier(id);
                Some(super::RankScore {
                    rank,
                    blocks: per_tier.iter().sum(),
                    per_tier,
                })
            })
            .collect()
    }

    /// Entries' bytes, for accounting by callers that keep one per thread.
    pub fn capacity_bytes(&self) -> usize {
        self.entries.capacity() * 8
            + self.split.capacity() * std::mem::size_of::<[u32; StorageTier::COUNT]>()
            + 2 * self.active.capacity() * 4
            + self.pending.capacity() * 8
    }
}

/// `blocks` all in tier `t`.
#[inline(always)]
fn one_tier(t: u8, blocks: u32) -> [u32; StorageTier::COUNT] {
    std::array::from_fn(|i| if i == t as usize { blocks } else { 0 })
}

/// The ids of a [`RankDepths`] with at least some blocks, in increasing order: the table's
/// live entries, and the pending first run's ranks whose entry was not written.
pub(super) struct Scan<'a> {
    depths: &'a RankDepths,
    blocks: u32,
    /// The next id to look at.
    id: usize,
    /// The next pending holder not yet passed.
    holder: usize,
}

impl Iterator for Scan<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        let d = self.depths;
        let pending = &d.pending;
        let n = pending.len() / 2;
        while self.id < d.entries.len() {
            let id = self.id;
            self.id += 1;
            let e = d.entries[id];
            if d.live(e) {
                if e as u32 >= self.blocks {
                    return Some(id as u32);
                }
                continue;
            }
            if d.pending_m == 0 || id >= d.pending_ids {
                continue;
            }
            while self.holder < n && (rank_at(pending, self.holder) as usize) < id {
                self.holder += 1;
            }
            if self.holder < n && rank_at(pending, self.holder) as usize == id {
                let (end, union) = group_of(pending, self.holder, n);
                self.holder = end;
                if leading(union, d.pending_m as usize) as u32 >= self.blocks {
                    return Some(id as u32);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests;
