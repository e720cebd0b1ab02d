//! What a match returns ([`OverlapScores`], one [`RankScore`] per rank), with the scoring of
//! recent first runs it keeps for the next matches.

use std::sync::Arc;

use crate::event::{StorageTier, WorkerRank};

/// The table of ranks by id that a walk reads.
pub(super) type Ranks = Arc<Vec<Option<WorkerRank>>>;

/// One rank's overlap with a query.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankScore {
    /// The rank.
    pub rank: WorkerRank,
    /// Leading blocks of the query held, in any tier.
    pub blocks: u32,
    /// The same blocks split by the fastest tier each is held in.
    pub per_tier: [u32; StorageTier::COUNT],
}

/// Result of a match: one entry per rank holding at least the first block. Reuse one value
/// across calls to [`IndexReader::find_matches_into`] to match without allocating.
///
/// [`IndexReader::find_matches_into`]: super::IndexReader::find_matches_into
#[derive(Clone, Debug)]
pub struct OverlapScores {
    /// One score per rank holding at least the query's first block.
    pub scores: Vec<RankScore>,
    /// The index's dense id of each score's rank, as the walk left them (`ids[i]` belongs to
    /// `scores[i]`): stable while the rank is registered, reused after it leaves.
    pub(super) ids: Vec<u32>,
    /// Ranks still holding every block so far: (rank id, index in `scores`).
    pub(super) active: Vec<(u32, u32)>,
    /// The same ranks as a mask of ids, kept instead of `active` after the first run when
    /// every id is below 64 (`by_mask`): a later run is then narrowed by its holders alone.
    pub(super) active_mask: u64,
    pub(super) by_mask: bool,
    /// Index in `scores` of each rank id of `active_mask`.
    pub(super) key_of: [u32; 64],
    /// First runs of recent matches and how they scored, for the next matches that start in
    /// them (a few: most matches start in one of a few shared system prompts).
    pub(super) firsts: Vec<FirstRun>,
    /// The entry of `firsts` replaced last.
    pub(super) next_first: usize,
}

impl Default for OverlapScores {
    fn default() -> Self {
        OverlapScores {
            scores: Vec::new(),
            ids: Vec::new(),
            active: Vec::new(),
            active_mask: 0,
            by_mask: false,
            key_of: [0; 64],
            firsts: Vec::new(),
            next_first: 0,
        }
    }
}

/// First runs an [`OverlapScores`] keeps the scoring of.
pub(super) const KEPT_FIRST_RUNS: usize = 4;

/// A walk's first run as it was scored: its slot, its holder words, the blocks matched in it
/// and the table of ranks read, and the scores, ids and active ranks that gave.
#[derive(Clone, Debug, Default)]
pub(super) struct FirstRun {
    pub(super) slot: u32,
    pub(super) m: usize,
    pub(super) ranks: Option<Ranks>,
    pub(super) holders: Vec<u64>,
    pub(super) scores: Vec<RankScore>,
    pub(super) ids: Vec<u32>,
    pub(super) active: Vec<(u32, u32)>,
    /// Whether every active id is below 64 (the later runs then narrow a mask of them).
    pub(super) by_mask: bool,
}

impl OverlapScores {
    /// The score of one rank (0 blocks when absent).
    pub fn blocks(&self, rank: WorkerRank) -> u32 {
        self.scores
            .iter()
            .find(|s| s.rank == rank)
            .map_or(0, |s| s.blocks)
    }

    /// The index's dense rank ids of the scores the match produced, in the same order: a
    /// cheap key for a caller's own per-rank tables (check the rank too: an id is reused once
    /// its rank leaves the index).
    pub fn rank_ids(&self) -> &[u32] {
        &self.ids
    }

    /// The best score.
    pub fn max_blocks(&self) -> u32 {
        self.scores.iter().map(|s| s.blocks).max().unwrap_or(0)
    }
}
