//! The read path: walk a shard's runs along a query and score every rank.
//!
//! The walk follows the child table from the root to the run that starts with the query's
//! first block, compares the query against the run's hashes in one loop, scores the ranks that
//! hold the matched blocks, and continues into the child that branches off where the comparison
//! stopped. A rank stays in the running only while it holds every block so far; its score is
//! the number of leading blocks it holds, split by the fastest tier it holds each in.
//!
//! Nothing here locks or writes shared memory: runs are loaded under one epoch pin per walk, and
//! every child found is checked against the position it was looked up from, so a walk that
//! races with the writer sees each run either before or after a change, never torn.

use std::sync::Arc;

use super::mix::prefetch_read;
use super::run::{holders_of, rank_at, Run};
use super::shard::ShardShared;
use super::table::{ChildKey, ROOT};
use super::{OverlapScores, RankScore};
use crate::event::{StorageTier, WorkerRank};
use crate::hash::LocalHash;

/// Leading blocks of `mask` held from offset 0, at most `limit`.
#[inline]
fn leading(mask: u64, limit: usize) -> usize {
    (mask.trailing_ones() as usize).min(limit)
}

/// Adds the first `lead` blocks of one rank's holders to its score, each under its fastest tier.
#[inline]
fn add_tiers(score: &mut RankScore, holders: &[u64], lead: usize) {
    let lead_mask = if lead >= 64 { !0 } else { (1u64 << lead) - 1 };
    let mut assigned = 0u64;
    for h in holders_of(holders) {
        let bits = h.mask & lead_mask & !assigned;
        if let Some(t) = score.per_tier.get_mut(h.tier as usize) {
            *t += bits.count_ones();
        }
        assigned |= bits;
    }
    score.blocks += lead as u32;
}

pub(crate) fn walk(
    shard: &ShardShared,
    ranks: &Arc<Vec<Option<WorkerRank>>>,
    query: &[LocalHash],
    early_exit: bool,
    out: &mut OverlapScores,
) {
    let Some(first) = query.first() else {
        return;
    };
    let table = shard.children.load();
    // One pin for the whole walk: every run loaded below stays valid until it ends.
    let guard = crossbeam_epoch::pin();
    let mut key = ChildKey {
        parent: ROOT,
        off: 0,
        hash: first.0,
    };
    let mut pos = 0usize;
    let mut started = false;
    while let Some(slot) = table.get(key) {
        let Some(run) = shard.slots.load(slot, &guard).and_then(Run::parse) else {
            break;
        };
        let rest = &query[pos..];
        // While the hashes are compared, fetch what comes next in the common case: the
        // holders, and the child-table entry of a query that runs past this run's end.
        if let Some(h) = run.holders.first() {
            prefetch_read(h);
        }
        if let (Some(last), Some(next)) =
            (run.hashes.len().checked_sub(1), rest.get(run.hashes.len()))
        {
            table.prefetch(ChildKey {
                parent: slot,
                off: last as u8,
                hash: next.0,
            });
        }
        if run.parent != key.parent
            || run.parent_off != key.off
            || run.hashes.first() != rest.first().map(|h| &h.0)
        {
            break; // the slot was reused since the link was read
        }
        let m = run
            .hashes
            .iter()
            .zip(rest)
            .take_while(|(a, b)| **a == b.0)
            .count();
        if !started {
            started = true;
            let holders = run.holders;
            let n = holders.len() / 2;
            let mut next = 0;
            while next < n {
                // The rank's holders (one per tier) are adjacent.
                let (first, id) = (next, rank_at(holders, next));
                while next < n && rank_at(holders, next) == id {
                    next += 1;
                }
                let group = &holders[2 * first..2 * next];
                let union = holders_of(group).fold(0, |u, h| u | h.mask);
                let lead = leading(union, m);
                let Some(Some(rank)) = ranks.get(id as usize) else {
                    continue;
                };
                if lead == 0 {
                    continue;
                }
                let mut score = RankScore {
                    rank: *rank,
                    blocks: 0,
                    per_tier: [0; StorageTier::COUNT],
                };
                add_tiers(&mut score, group, lead);
                if lead == m {
                    out.active.push((id, out.scores.len() as u32));
                }
                out.scores.push(score);
            }
        } else {
            let holders = run.holders;
            let n = holders.len() / 2;
            let mut h = 0usize;
            out.active.retain(|&(rank, idx)| {
                while h < n && rank_at(holders, h) < rank {
                    h += 1;
                }
                let start = h;
                while h < n && rank_at(holders, h) == rank {
                    h += 1;
                }
                let group = &holders[2 * start..2 * h];
                let union = holders_of(group).fold(0, |u, x| u | x.mask);
                let lead = leading(union, m);
                if lead > 0 {
                    add_tiers(&mut out.scores[idx as usize], group, lead);
                }
                lead == m
            });
        }
        pos += m;
        if out.active.is_empty() || pos >= query.len() || (early_exit && out.active.len() == 1) {
            break;
        }
        key = ChildKey {
            parent: slot,
            off: (m - 1) as u8,
            hash: query[pos].0,
        };
    }
    out.active.clear();
}
