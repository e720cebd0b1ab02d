//! [`IndexReader`], the handle routing threads match through, and what it shares with the
//! writer: the shards' runs and tables, the rank table, the count of freed rank ids.

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::config::MatchOptions;
use super::depths::RankDepths;
use super::primitive;
use super::read;
use super::scores::OverlapScores;
use super::shard::ShardShared;
use crate::event::WorkerRank;
use crate::hash::LocalHash;

pub(super) struct Shared {
    pub(super) shards: Vec<Arc<ShardShared>>,
    /// Rank id -> rank, for turning holders into scores.
    pub(super) ranks: ArcSwap<Vec<Option<WorkerRank>>>,
    /// Rank ids freed so far (saturating), raised after the table without them is published.
    pub(super) frees: primitive::AtomicU32,
}

/// A cheap, cloneable, thread-safe handle that matches queries lock-free.
#[derive(Clone)]
pub struct IndexReader {
    pub(super) shared: Arc<Shared>,
}

impl std::fmt::Debug for IndexReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexReader")
            .field("shards", &self.shared.shards.len())
            .finish()
    }
}

#[inline]
pub(super) fn shard_of(h: LocalHash, n: usize) -> usize {
    let x = h.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    ((x * n as u64) >> 32) as usize
}

impl IndexReader {
    /// Scores every rank against `query` into `out` (cleared first). Lock-free; allocates
    /// nothing once `out` has grown to the number of ranks that match. Keep `out` from one
    /// match to the next: besides its memory, it keeps the scoring of recent first runs (the
    /// run most ranks share, as a system prompt), which a fresh result has to redo.
    pub fn find_matches_into(
        &self,
        query: &[LocalHash],
        opts: MatchOptions,
        out: &mut OverlapScores,
    ) {
        out.scores.clear();
        out.ids.clear();
        out.active.clear();
        let Some(first) = query.first() else {
            return;
        };
        let shards = &self.shared.shards;
        let shard = &shards[shard_of(*first, shards.len())];
        let ranks = self.shared.ranks.load();
        read::walk(shard, &ranks, query, opts, out);
    }

    /// [`IndexReader::find_matches_into`] by rank id: the same overlaps, left in a table keyed
    /// by the index's dense rank ids, for a caller that visits its own ranks by id
    /// ([`PrefixIndex::rank_key`]). Lock-free; allocates nothing once `out` has grown to the
    /// number of ranks.
    ///
    /// [`PrefixIndex::rank_key`]: super::PrefixIndex::rank_key
    pub fn find_depths_into(&self, query: &[LocalHash], opts: MatchOptions, out: &mut RankDepths) {
        // The count first: the table loaded after it has freed at least that many ids.
        let epoch = self.shared.frees.load(primitive::Ordering::Acquire);
        let ranks = self.shared.ranks.load();
        out.begin(ranks.len(), epoch);
        let Some(first) = query.first() else {
            return;
        };
        let shards = &self.shared.shards;
        let shard = &shards[shard_of(*first, shards.len())];
        read::walk(shard, &ranks, query, opts, out);
        out.end(&ranks);
    }

    /// [`IndexReader::find_depths_into`] for rank id `id` alone: the walk follows that rank
    /// only, and `out` holds nothing for any other (its deepest is that rank, or none). For a
    /// caller that has already chosen its rank (a pinned request) and wants its overlap.
    pub fn find_depth_of_into(&self, query: &[LocalHash], id: u32, out: &mut RankDepths) {
        let epoch = self.shared.frees.load(primitive::Ordering::Acquire);
        let ranks = self.shared.ranks.load();
        out.begin(ranks.len(), epoch);
        out.only = Some(id);
        let Some(first) = query.first() else {
            return;
        };
        let shards = &self.shared.shards;
        let shard = &shards[shard_of(*first, shards.len())];
        // No early exit: with one rank followed, it would end every walk after its first run.
        read::walk(
            shard,
            &ranks,
            query,
            MatchOptions { early_exit: false },
            out,
        );
        out.end(&ranks);
    }

    /// The rank that rank id `id` names now (`None`: a free id).
    pub fn rank_of(&self, id: u32) -> Option<WorkerRank> {
        self.shared.ranks.load().get(id as usize).copied().flatten()
    }
}
