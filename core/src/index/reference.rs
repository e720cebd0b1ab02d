//! A literal, obviously correct model of the index, kept beside it so that tests and benches can
//! check the fast structure against it after any sequence of events.
//!
//! A block is identified by its whole prefix (the local hashes from the first block to it). Each
//! rank keeps the names it stored blocks under and, per (prefix, tier), how many copies it
//! holds. A match counts, per rank, the leading prefixes of the query it holds in any tier.
//! Everything is a plain map; nothing is shared, compressed or clever.

use std::collections::{BTreeMap, HashMap};

use super::{IndexError, RankScore};
use crate::event::{BlockHash, EventHeader, StorageTier, StoredBlock, WorkerId, WorkerRank};
use crate::hash::LocalHash;

type Prefix = Vec<LocalHash>;

#[derive(Debug, Default)]
struct RankModel {
    names: HashMap<BlockHash, Prefix>,
    copies: HashMap<(Prefix, StorageTier), u32>,
}

impl RankModel {
    fn holds_any(&self, prefix: &Prefix) -> bool {
        StorageTier::ALL
            .iter()
            .any(|t| self.copies.contains_key(&(prefix.clone(), *t)))
    }
}

/// The reference model.
#[derive(Debug, Default)]
pub struct ReferenceIndex {
    ranks: BTreeMap<WorkerRank, RankModel>,
}

impl ReferenceIndex {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies a Stored event: the blocks continue the chain after `parent`.
    pub fn apply_stored(
        &mut self,
        header: EventHeader,
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        self.ranks.entry(header.source).or_default();
        if blocks.is_empty() {
            return Ok(());
        }
        for (i, b) in blocks.iter().enumerate() {
            let repeats = i > 0 && blocks[i - 1].block_hash == b.block_hash;
            if Some(b.block_hash) == parent || repeats {
                return Err(IndexError::InvalidChain {
                    rank: header.source,
                    block: b.block_hash,
                });
            }
        }
        // A parent the rank does not hold: the one prefix the other ranks hold under that
        // name, if they agree on one.
        let mut unrooted = None;
        let mut prefix = match parent {
            None => Vec::new(),
            Some(p) => match self.ranks[&header.source].names.get(&p) {
                Some(pre) if self.ranks[&header.source].holds_any(pre) => pre.clone(),
                _ => {
                    let peers: Vec<&Prefix> = (self.ranks.iter())
                        .filter(|(r, _)| **r != header.source)
                        .filter_map(|(_, m)| m.names.get(&p).filter(|pre| m.holds_any(pre)))
                        .collect();
                    let refused = IndexError::UnknownParent {
                        rank: header.source,
                        parent: p,
                        placed: false,
                    };
                    match peers.first() {
                        Some(&pre) if peers.iter().all(|&other| other == pre) => {
                            unrooted = Some(p);
                            pre.clone()
                        }
                        _ => return Err(refused),
                    }
                }
            },
        };
        let rank = self.ranks.entry(header.source).or_default();
        for b in blocks {
            prefix.push(b.local_hash);
            *rank
                .copies
                .entry((prefix.clone(), header.tier))
                .or_insert(0) += 1;
            rank.names.insert(b.block_hash, prefix.clone());
        }
        match unrooted {
            None => Ok(()),
            Some(parent) => Err(IndexError::UnknownParent {
                rank: header.source,
                parent,
                placed: true,
            }),
        }
    }

    /// Applies a Removed event: one copy of each named block leaves the event's tier.
    pub fn apply_removed(
        &mut self,
        header: EventHeader,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError> {
        let rank = self.ranks.entry(header.source).or_default();
        let mut unknown = Vec::new();
        for b in blocks {
            let key = rank.names.get(b).map(|p| (p.clone(), header.tier));
            match key.and_then(|k| rank.copies.get_mut(&k).map(|c| (k.clone(), c))) {
                Some((k, c)) => {
                    *c -= 1;
                    if *c == 0 {
                        rank.copies.remove(&k);
                    }
                }
                None => unknown.push(*b),
            }
        }
        match unknown.first() {
            None => Ok(()),
            Some(first) => Err(IndexError::UnknownBlocks {
                rank: header.source,
                count: unknown.len(),
                first: *first,
            }),
        }
    }

    /// Registers a rank that holds nothing yet (a no-op when it is known).
    pub fn register_rank(&mut self, rank: WorkerRank) {
        self.ranks.entry(rank).or_default();
    }

    /// Applies a Cleared event: the rank holds nothing afterwards.
    pub fn apply_cleared(&mut self, header: EventHeader) {
        let rank = self.ranks.entry(header.source).or_default();
        rank.names.clear();
        rank.copies.clear();
    }

    /// Removes every rank of a worker and all they hold.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Result<(), IndexError> {
        let before = self.ranks.len();
        self.ranks.retain(|r, _| r.worker != worker);
        if self.ranks.len() == before {
            return Err(IndexError::UnknownWorker { worker });
        }
        Ok(())
    }

    /// Scores, sorted by rank; ranks holding no leading block are left out.
    pub fn find_matches(&self, query: &[LocalHash]) -> Vec<RankScore> {
        let mut out = Vec::new();
        for (rank, model) in &self.ranks {
            let mut score = RankScore {
                rank: *rank,
                blocks: 0,
                per_tier: [0; StorageTier::COUNT],
            };
            for i in 0..query.len() {
                let prefix = query[..=i].to_vec();
                let tier = StorageTier::ALL
                    .iter()
                    .find(|t| model.copies.contains_key(&(prefix.clone(), **t)));
                match tier {
                    Some(t) => {
                        score.blocks += 1;
                        score.per_tier[t.index()] += 1;
                    }
                    None => break,
                }
            }
            if score.blocks > 0 {
                out.push(score);
            }
        }
        out
    }

    /// (rank, prefix, tier) holds, copies not counted.
    pub fn stored_pairs(&self) -> u64 {
        self.ranks.values().map(|m| m.copies.len() as u64).sum()
    }
}
