//! The read path: walk a shard's runs along a query and score every rank.
//!
//! The walk follows the child table from the root to the run that starts with the query's
//! first block, compares the query against the run's hashes in one loop, scores the ranks that
//! hold the matched blocks, and continues into the child that branches off where the comparison
//! stopped. A rank stays in the running only while it holds every block so far; its score is
//! the number of leading blocks it holds, split by the fastest tier it holds each in. The
//! child comes from the run's slot hint when the hinted run is the one the table would give
//! (same parent, offset and first hash), fetched while the run before it was compared; from
//! the table otherwise. The slot two runs ahead is fetched a run earlier still, so that the
//! hint is read from a line already in, and so is the array two runs ahead, whose address the
//! run's array carries in its first line: on a long chain each run's lines are asked for two
//! compares before they are needed, not one. A run whose slot never had a child linked has no
//! children, and the walk ends there without a table lookup.
//!
//! Nothing here locks: runs are loaded under one epoch pin per walk, and every child found is
//! checked against the position it was looked up from, so a walk that races with the writer
//! sees each run either before or after a change, never torn. The one shared write is made
//! under a memory budget only: each run the walk matches is marked as used now (`uses.rs`),
//! for eviction to read.

use std::sync::Arc;

use super::config::MatchOptions;
use super::depths::RankDepths;
use super::mix::{prefetch_addr, prefetch_read};
use super::run::{add_tiers, find_group, group_of, leading, rank_at, Run};
use super::scores::{FirstRun, OverlapScores, RankScore, Ranks, KEPT_FIRST_RUNS};
use super::shard::ShardShared;
use super::slots::NO_NEXT;
use super::table::{ChildKey, ROOT};
use crate::event::{StorageTier, WorkerRank};
use crate::hash::{common_prefix, LocalHash};

/// Where a walk leaves its scores: per rank, the leading blocks and their tiers.
pub(super) trait Sink {
    /// Ranks still holding every block so far: (rank id, the key `add` takes), sorted by id.
    fn active(&mut self) -> &mut Vec<(u32, u32)>;
    /// Scores rank `id` (`rank`) of the first run with the first `lead` (≥ 1) blocks of its
    /// holder words `group`; returns the key later runs add to it by.
    fn first(&mut self, id: u32, rank: WorkerRank, group: &[u64], lead: usize) -> u32;
    /// Adds the first `lead` (≥ 1) blocks of `group` to the score under `key`.
    fn add(&mut self, key: u32, group: &[u64], lead: usize);
    /// Scores the ranks holding the first `m` matched blocks of the walk's first run (in
    /// `slot`, holder words `holders`).
    fn first_run(&mut self, _slot: u32, holders: &[u64], m: usize, ranks: &Ranks)
    where
        Self: Sized,
    {
        score_first(holders, m, ranks, self);
    }

    /// How many ranks hold every block so far (a sink that keeps them implicitly may answer
    /// 2 for any number above 1).
    fn active_len(&mut self) -> usize {
        self.active().len()
    }

    /// Narrows a sink that keeps the first run's active ranks implicitly against a later run
    /// (`holders`, `m` blocks matched); false when it keeps them in `active`.
    fn narrow_implicit(&mut self, _holders: &[u64], _m: usize) -> bool {
        false
    }

    /// `active` and `add` at once, for a pass that adds while it narrows the active list.
    fn narrow(&mut self, mut keep: impl FnMut(&mut Self, u32, u32) -> bool)
    where
        Self: Sized,
    {
        let mut active = std::mem::take(self.active());
        active.retain(|&(id, key)| keep(self, id, key));
        *self.active() = active;
    }
}

impl Sink for OverlapScores {
    #[inline(always)]
    fn active(&mut self) -> &mut Vec<(u32, u32)> {
        &mut self.active
    }

    /// Scores the first run (see [`OverlapScores::score_first_run`]); later runs narrow a
    /// mask of rank ids when every active id fits one.
    fn first_run(&mut self, slot: u32, holders: &[u64], m: usize, ranks: &Ranks) {
        self.score_first_run(slot, holders, m, ranks);
    }

    #[inline(always)]
    fn active_len(&mut self) -> usize {
        if self.by_mask {
            self.active_mask.count_ones() as usize
        } else {
            self.active.len()
        }
    }

    /// One pass over the run's holders: a rank in the mask scores the blocks it holds from
    /// the run's start and stays if it holds all `m`; a rank that holds none of the run
    /// leaves without being looked at.
    fn narrow_implicit(&mut self, holders: &[u64], m: usize) -> bool {
        if !self.by_mask {
            return false;
        }
        let n = holders.len() / 2;
        let mut kept = 0u64;
        let mut h = 0;
        while h < n {
            let id = rank_at(holders, h);
            if id >= 64 || self.active_mask & (1 << id) == 0 {
                h += 1;
                continue;
            }
            let (end, union) = group_of(holders, h, n);
            let lead = leading(union, m);
            if lead > 0 {
                let key = self.key_of[id as usize];
                self.add(key, &holders[2 * h..2 * end], lead);
            }
            if lead == m {
                kept |= 1 << id;
            }
            h = end;
        }
        self.active_mask = kept;
        true
    }

    #[inline(always)]
    fn first(&mut self, id: u32, rank: WorkerRank, group: &[u64], lead: usize) -> u32 {
        let score = if group.len() == 2 {
            // One holder: its tier takes every block. Built lane by lane rather than by
            // indexing, so that the score is written once, whole (a narrow store into it
            // followed by a wide copy would stall the store buffer).
            let tier = group[0] as u8 as usize;
            RankScore {
                rank,
                blocks: lead as u32,
                per_tier: std::array::from_fn(|t| if t == tier { lead as u32 } else { 0 }),
            }
        } else {
            let mut per_tier = [0; StorageTier::COUNT];
            add_tiers(&mut per_tier, group, lead);
            RankScore {
                rank,
                blocks: lead as u32,
                per_tier,
            }
        };
        let key = self.scores.len() as u32;
        self.ids.push(id);
        self.scores.push(score);
        key
    }

    #[inline(always)]
    fn add(&mut self, key: u32, group: &[u64], lead: usize) {
        let score = &mut self.scores[key as usize];
        if group.len() == 2 {
            if let Some(t) = score.per_tier.get_mut(group[0] as u8 as usize) {
                *t += lead as u32;
            }
        } else {
            add_tiers(&mut score.per_tier, group, lead);
        }
        score.blocks += lead as u32;
    }
}

impl OverlapScores {
    /// Scores a walk's first run, unless a recent match scored it: the same holder words,
    /// matched as far, with the same table of ranks, score the same. Most matches start in
    /// a run that most ranks share (a system prompt), whose scoring is most of a short match.
    fn score_first_run(&mut self, slot: u32, holders: &[u64], m: usize, ranks: &Ranks) {
        debug_assert!(self.scores.is_empty() && self.ids.is_empty() && self.active.is_empty());
        let kept = self.firsts.iter().position(|f| {
            f.slot == slot
                && f.m == m
                && f.ranks.as_ref().is_some_and(|r| Arc::ptr_eq(r, ranks))
                && f.holders == holders
        });
        if let Some(i) = kept {
            let f = &self.firsts[i];
            self.scores.extend_from_slice(&f.scores);
            self.ids.extend_from_slice(&f.ids);
            self.active.extend_from_slice(&f.active);
            self.by_mask = f.by_mask;
            self.mask_active();
            return;
        }
        score_first(holders, m, ranks, self);
        self.by_mask = self.active.iter().all(|&(id, _)| id < 64);
        self.mask_active();
        let i = if self.firsts.len() < KEPT_FIRST_RUNS {
            self.firsts.push(FirstRun::default());
            self.firsts.len() - 1
        } else {
            self.next_first = (self.next_first + 1) % KEPT_FIRST_RUNS;
            self.next_first
        };
        let f = &mut self.firsts[i];
        f.slot = slot;
        f.m = m;
        // The same table as before, mostly: a clone and a drop are two locked instructions.
        if !f.ranks.as_ref().is_some_and(|r| Arc::ptr_eq(r, ranks)) {
            f.ranks = Some(Arc::clone(ranks));
        }
        f.holders.clear();
        f.holders.extend_from_slice(holders);
        f.scores.clone_from(&self.scores);
        f.ids.clone_from(&self.ids);
        f.active.clone_from(&self.active);
        f.by_mask = self.by_mask;
    }

    /// With `by_mask`, the active ranks as a mask of ids, and each id's key in `key_of` (the
    /// ids of the mask, and only they, are read from it).
    #[inline]
    fn mask_active(&mut self) {
        if self.by_mask {
            let mut mask = 0u64;
            for &(id, key) in &self.active {
                mask |= 1 << id;
                self.key_of[id as usize] = key;
            }
            self.active_mask = mask;
        }
    }
}

impl Sink for RankDepths {
    #[inline(always)]
    fn active(&mut self) -> &mut Vec<(u32, u32)> {
        &mut self.active
    }

    /// One rank (a pinned walk), every rank in one pass (eager: a rank with one holder, one
    /// tier, the common case, written in one store), or none: the holder words kept, to be
    /// read when asked for ([`RankDepths::set_eager`]). Ids are not checked against the table
    /// of ranks: a reader of this table keeps ids by [`super::RankKey`], which answers only
    /// for ids given out before the match began, and an id beyond the table is left out.
    fn first_run(&mut self, _slot: u32, holders: &[u64], m: usize, _ranks: &Ranks) {
        let n = holders.len() / 2;
        let holders = &holders[..2 * n];
        if let Some(id) = self.only {
            // One rank: its group is found by bisection, and no other rank enters the walk.
            if let Some((start, end, union)) = find_group(holders, id) {
                let lead = leading(union, m);
                if lead > 0 && self.holds(id) {
                    RankDepths::first(self, id, &holders[2 * start..2 * end], lead);
                    if lead == m {
                        self.active.push((id, id));
                    }
                }
            }
            return;
        }
        if !self.eager {
            // The run's holder words are kept as they are: a rank's overlap is read from them
            // when asked for, and the ranks that go on are written as the next run narrows
            // them.
            self.keep_first_run(holders, m);
            return;
        }
        // Every rank written now, in one pass, a rank with one holder (one tier: the common
        // case) in one store.
        let mut h = 0;
        while h < n {
            let pair = &holders[2 * h..2 * h + 2];
            let (word, mask) = (pair[0], pair[1]);
            let id = (word >> 8) as u32;
            let next = holders.get(2 * h + 2).map(|&w| (w >> 8) as u32);
            if next == Some(id) {
                // Several tiers: the general path.
                let (end, union) = group_of(holders, h, n);
                let lead = leading(union, m);
                if lead > 0 && self.holds(id) {
                    RankDepths::first(self, id, &holders[2 * h..2 * end], lead);
                    if lead == m {
                        self.active.push((id, id));
                    }
                }
                h = end;
                continue;
            }
            h += 1;
            let lead = leading(mask, m);
            if lead > 0 && self.holds(id) {
                self.first_single(id, word as u8, lead as u32);
                if lead == m {
                    self.active.push((id, id));
                }
            }
        }
    }

    #[inline(always)]
    fn active_len(&mut self) -> usize {
        if self.pending_active {
            self.pending_full
        } else {
            self.active.len()
        }
    }

    fn narrow_implicit(&mut self, holders: &[u64], m: usize) -> bool {
        if !self.pending_active {
            return false;
        }
        self.narrow_first_run(holders, m);
        true
    }

    #[inline(always)]
    fn first(&mut self, id: u32, _rank: WorkerRank, group: &[u64], lead: usize) -> u32 {
        RankDepths::first(self, id, group, lead);
        id
    }

    #[inline(always)]
    fn add(&mut self, key: u32, group: &[u64], lead: usize) {
        RankDepths::add(self, key, group, lead);
    }
}

/// Scores the ranks holding the first `m` matched blocks of the walk's first run.
fn score_first(holders: &[u64], m: usize, ranks: &[Option<WorkerRank>], out: &mut impl Sink) {
    let n = holders.len() / 2;
    let mut next = 0;
    while next < n {
        let (first, id) = (next, rank_at(holders, next));
        let (end, union) = group_of(holders, next, n);
        next = end;
        let lead = leading(union, m);
        if lead == 0 {
            continue;
        }
        let Some(Some(rank)) = ranks.get(id as usize) else {
            continue;
        };
        let key = out.first(id, *rank, &holders[2 * first..2 * end], lead);
        if lead == m {
            out.active().push((id, key));
        }
    }
}

/// Keeps the active ranks that hold all `m` matched blocks of a later run, crediting each the
/// leading blocks it holds: one merge of the two lists, both sorted by rank id.
fn narrow_by_merge<S: Sink>(holders: &[u64], m: usize, out: &mut S) {
    let n = holders.len() / 2;
    let mut h = 0usize;
    out.narrow(|out, rank, key| {
        while h < n && rank_at(holders, h) < rank {
            h += 1;
        }
        if h == n || rank_at(holders, h) != rank {
            return false;
        }
        let (start, (end, union)) = (h, group_of(holders, h, n));
        h = end;
        let lead = leading(union, m);
        if lead > 0 {
            out.add(key, &holders[2 * start..2 * end], lead);
        }
        lead == m
    });
}

/// [`narrow_by_merge`] for a run with far fewer holders than active ranks (a branch that few
/// ranks took): each holder is searched for among the active ranks instead.
fn narrow_by_search(holders: &[u64], m: usize, out: &mut impl Sink) {
    let n = holders.len() / 2;
    let mut active = std::mem::take(out.active());
    let (mut h, mut lo, mut kept) = (0usize, 0usize, 0usize);
    while h < n && lo < active.len() {
        let id = rank_at(holders, h);
        let (start, (end, union)) = (h, group_of(holders, h, n));
        h = end;
        match active[lo..].binary_search_by_key(&id, |a| a.0) {
            Ok(p) => {
                let at = lo + p;
                let (_, key) = active[at];
                let lead = leading(union, m);
                if lead > 0 {
                    out.add(key, &holders[2 * start..2 * end], lead);
                }
                if lead == m {
                    // kept <= at: survivors move down in order.
                    active[kept] = active[at];
                    kept += 1;
                }
                lo = at + 1;
            }
            Err(p) => lo += p,
        }
    }
    active.truncate(kept);
    *out.active() = active;
}

/// Hints the CPU to fetch every cache line of a run's words: a walk compares them from the
/// first to the last, and one run's lines are more than the hardware fetches ahead on its own.
#[inline]
fn prefetch_words(w: &[u64]) {
    for x in w.iter().step_by(8) {
        prefetch_read(x);
    }
}

/// Words of a hinted run fetched by address before its length is known (eight lines: the
/// header and 55 or more hashes); the rest are fetched when the run is read.
const AHEAD_WORDS: usize = 64;

/// Lines of a query's hashes fetched when its walk starts: 1,024 blocks.
const QUERY_LINES: usize = 128;

/// Hints the CPU to fetch the query's hashes, all at once. A caller's hashes may come from
/// memory nobody touched lately (a prompt hashed earlier, a request read off the wire); the
/// compare loops read them a line at a time, each line's miss behind the last run's, and the
/// hardware's own prefetch does not run far enough ahead across a walk's jumps between runs.
/// Hashes already in cache cost one instruction per line.
#[inline]
fn prefetch_query(query: &[LocalHash]) {
    for h in query.iter().step_by(8).take(QUERY_LINES) {
        prefetch_read(h);
    }
}

/// Whether published run words `w` are the child `key` names: its parent, offset and first
/// hash.
#[inline]
fn leads_from(w: &[u64], key: ChildKey) -> bool {
    Run::link(w) == Some((key.parent, key.off, key.hash))
}

pub(crate) fn walk(
    shard: &ShardShared,
    ranks: &Arc<Vec<Option<WorkerRank>>>,
    query: &[LocalHash],
    opts: MatchOptions,
    out: &mut impl Sink,
) {
    let Some(first) = query.first() else {
        return;
    };
    prefetch_query(query);
    // One pin for the whole walk: every run loaded below stays valid until it ends. Taken
    // before the table is loaded, so that the arrays its entries name are covered (see
    // `TableInner::get`).
    let guard = crossbeam_epoch::pin();
    let table = shard.children.load();
    let used = shard.used.as_ref().map(|u| (u, u.now()));
    let mut key = ChildKey {
        parent: ROOT,
        off: 0,
        hash: first.0,
    };
    let mut pos = 0usize;
    let mut started = false;
    // The next run when a hint named it (checked like any child): (slot, its array's address,
    // its hint). The array is read only here, a run after its lines were fetched.
    let mut hinted: Option<(u32, u64, u32)> = None;
    loop {
        let from_hint = hinted.take().and_then(|(slot, address, next)| {
            // SAFETY: `address` was read from the slot under `guard`, which was pinned before.
            #[allow(unsafe_code)]
            let words = unsafe { shard.slots.words_at(address, &guard) }?;
            if let Some(rest) = words.get(AHEAD_WORDS..) {
                prefetch_words(rest);
            }
            leads_from(words, key).then_some((slot, address, words, next))
        });
        let (slot, address, words, next) = match from_hint {
            Some(h) => h,
            None => {
                let Some((slot, address)) = table.get(key) else {
                    break;
                };
                // The array comes from the entry, and the slot's hints from its cell: two
                // loads that wait on the entry alone, not on each other.
                // SAFETY: `address` was read from the table, loaded after `guard` was pinned;
                // the writer updates an entry's address before it retires the array.
                #[allow(unsafe_code)]
                let words = unsafe { shard.slots.words_at(address, &guard) };
                let Some(words) = words else {
                    break;
                };
                let (next, next2) = shard.slots.hints(slot);
                // The slot two runs ahead, so that its line is in when the run after this one
                // reads it.
                if next2 != NO_NEXT {
                    shard.slots.prefetch(next2);
                }
                (slot, address, words, next)
            }
        };
        let Some(run) = Run::parse(words) else {
            break;
        };
        let rest = &query[pos..];
        // The array two runs ahead on the hinted path, named in this one's first line: its
        // first lines are fetched now, two runs before they are compared (the next run's were
        // fetched a run ago, or are fetched below).
        if next != NO_NEXT && rest.len() > run.hashes.len() + 1 {
            // SAFETY: `address` was read under `guard`, from the slot or the table.
            #[allow(unsafe_code)]
            let two = unsafe { shard.slots.ahead_at(address, &guard) };
            if two != 0 {
                for line in 0..AHEAD_WORDS / 8 {
                    prefetch_addr((two as usize + 64 * line) as *const u8);
                }
            }
        }
        // While the hashes are compared, fetch what likely comes next: the holders, and the
        // run the slot's hint names (checked before it is used, like any child found), else
        // the child-table entry of a query that runs past this run's end.
        if let Some(h) = run.holders.first() {
            prefetch_read(h);
        }
        let mut ahead = None;
        if rest.len() > 1 && next != NO_NEXT {
            let (address, n, n2) = shard.slots.address_with_hints(next, &guard);
            if address != 0 {
                if n2 != NO_NEXT {
                    shard.slots.prefetch(n2);
                }
                // The array's first lines by address, its length unknown until it arrives:
                // reading the length here would hold the walk up until it did.
                for line in 0..AHEAD_WORDS / 8 {
                    prefetch_addr((address as usize + 64 * line) as *const u8);
                }
                ahead = Some((next, address, n));
            }
        }
        // A slot no child was ever linked to has none: the walk ends with this run.
        let childless = next == NO_NEXT;
        if let (Some(last), Some(next_hash)) =
            (run.hashes.len().checked_sub(1), rest.get(run.hashes.len()))
        {
            if ahead.is_none() && !childless {
                table.prefetch(ChildKey {
                    parent: slot,
                    off: last as u8,
                    hash: next_hash.0,
                });
            }
        }
        if run.parent != key.parent
            || run.parent_off != key.off
            || run.hashes.first() != rest.first().map(|h| &h.0)
        {
            break; // the slot was reused since the link was read
        }
        let m = common_prefix(run.hashes, rest);
        if let Some((u, now)) = used {
            u.mark(slot, now);
        }
        if !started {
            started = true;
            out.first_run(slot, run.holders, m, ranks);
        } else if out.narrow_implicit(run.holders, m) {
            // The first run's ranks, narrowed where they were kept.
        } else if run.holders.len() / 2 * 4 < out.active().len() {
            narrow_by_search(run.holders, m, out);
        } else {
            narrow_by_merge(run.holders, m, out);
        }
        pos += m;
        let active = out.active_len();
        if childless || active == 0 || pos >= query.len() || (opts.early_exit && active == 1) {
            break;
        }
        key = ChildKey {
            parent: slot,
            off: (m - 1) as u8,
            hash: query[pos].0,
        };
        // The next turn takes the hinted run if it is this key's child, and looks the key up
        // otherwise.
        hinted = ahead;
    }
    out.active().clear();
}
