//! SGLang's router's `cache_aware` policy (PyPI `sglang-router` 0.3.2, its defaults) as a
//! [`Picker`]: the peer's rule on the same simulated fleet, so that the in-process demo shows
//! what the live comparison (`scripts/live_vs_sglang.sh`) measures against.
//!
//! The peer keeps no view of the engines' caches: it remembers, per worker, the prompts it sent
//! there (an approximate radix tree of their text). Per request:
//!
//! 1. Load is the count of the worker's requests in flight (the router's own count). The fleet
//!    is imbalanced when max − min > 64 and max > 1.5 × min; then the least loaded worker takes
//!    the request.
//! 2. Otherwise, the worker whose remembered prompts share the longest prefix with this one
//!    takes it when that prefix is over 30% of the prompt; else the worker that remembers the
//!    least (the smallest tree).
//! 3. The prompt is remembered on the chosen worker, whichever way it was chosen.
//!
//! Modelled here at block granularity (chained block hashes instead of characters) and with
//! the tree's memory capped per worker at 2^26 characters, about 2^24 tokens at four characters
//! a token; over the cap the least recently used blocks are forgotten, deepest first. Ties go
//! to a random worker.

use std::collections::HashMap;

use kvroute_core::{
    seq_hashes, BlockHasher, RequestId, Rng, RouteError, Router, SeqHash, WorkerRank,
};

use kvroute_sim::Picker;

/// The policy's defaults in `sglang-router` 0.3.2 (`router_args.py`).
const CACHE_THRESHOLD: f64 = 0.3;
const BALANCE_ABS: u64 = 64;
const BALANCE_REL: f64 = 1.5;
/// `max_tree_size` (2^26 characters) in tokens, at about four characters a token.
const MAX_TREE_TOKENS: u64 = 1 << 24;

/// What one worker's tree remembers: each block's last use and depth.
#[derive(Debug, Default)]
struct Remembered {
    blocks: HashMap<SeqHash, (u64, u32)>,
}

/// SGLang's `cache_aware` rule over workers `0..workers` (single-rank).
#[derive(Debug)]
pub struct SglangPicker {
    trees: Vec<Remembered>,
    hasher: BlockHasher,
    cap_blocks: usize,
    clock: u64,
    rng: Rng,
}

impl SglangPicker {
    /// The rule for `workers` workers with blocks of `block_size` tokens; ties drawn from `seed`.
    pub fn new(workers: usize, block_size: u32, seed: u64) -> Self {
        SglangPicker {
            trees: (0..workers).map(|_| Remembered::default()).collect(),
            hasher: BlockHasher::new(block_size as usize),
            cap_blocks: (MAX_TREE_TOKENS / u64::from(block_size.max(1))) as usize,
            clock: 0,
            rng: Rng::new(seed),
        }
    }

    /// The rule's choice for a prompt of these chained block hashes, given each worker's
    /// requests in flight.
    fn choose(&mut self, hashes: &[SeqHash], in_flight: &[u64]) -> usize {
        let lo = in_flight.iter().copied().min().unwrap_or(0);
        let hi = in_flight.iter().copied().max().unwrap_or(0);
        if hi - lo > BALANCE_ABS && hi as f64 > BALANCE_REL * lo as f64 {
            return self.random_among(in_flight.len(), |w| in_flight[w] == lo);
        }
        let matched: Vec<usize> = self
            .trees
            .iter()
            .map(|t| {
                hashes
                    .iter()
                    .take_while(|h| t.blocks.contains_key(h))
                    .count()
            })
            .collect();
        let best = matched.iter().copied().max().unwrap_or(0);
        if !hashes.is_empty() && best as f64 / hashes.len() as f64 > CACHE_THRESHOLD {
            return self.random_among(matched.len(), |w| matched[w] == best);
        }
        let sizes: Vec<usize> = self.trees.iter().map(|t| t.blocks.len()).collect();
        let smallest = sizes.iter().copied().min().unwrap_or(0);
        self.random_among(sizes.len(), |w| sizes[w] == smallest)
    }

    /// Remembers the prompt on `worker`, forgetting its least recently used blocks over the cap.
    fn remember(&mut self, worker: usize, hashes: &[SeqHash]) {
        self.clock += 1;
        let tree = &mut self.trees[worker];
        for (depth, h) in hashes.iter().enumerate() {
            tree.blocks.insert(*h, (self.clock, depth as u32));
        }
        if tree.blocks.len() > self.cap_blocks {
            let mut by_age: Vec<(u64, std::cmp::Reverse<u32>, SeqHash)> = tree
                .blocks
                .iter()
                .map(|(h, &(used, depth))| (used, std::cmp::Reverse(depth), *h))
                .collect();
            by_age.sort_unstable();
            let excess = tree.blocks.len() - self.cap_blocks;
            for (_, _, h) in by_age.into_iter().take(excess) {
                tree.blocks.remove(&h);
            }
        }
    }

    /// A uniformly random index below `n` among those that `keep` (some index always does).
    fn random_among(&mut self, n: usize, keep: impl Fn(usize) -> bool) -> usize {
        let ties: Vec<usize> = (0..n).filter(|&w| keep(w)).collect();
        ties[self.rng.below(ties.len() as u64) as usize]
    }
}

impl Picker for SglangPicker {
    fn pick(
        &mut self,
        router: &Router,
        id: RequestId,
        tokens: &[u32],
    ) -> Result<WorkerRank, RouteError> {
        let workers = self.trees.len();
        if workers == 0 {
            return Err(RouteError::NoWorkers { request: id });
        }
        let hashes = seq_hashes(&self.hasher.local_hashes(tokens));
        let in_flight: Vec<u64> = (0..workers as u64)
            .map(|w| {
                router
                    .load(WorkerRank::new(w, 0))
                    .map_or(0, |load| load.requests)
            })
            .collect();
        let worker = self.choose(&hashes, &in_flight);
        self.remember(worker, &hashes);
        Ok(WorkerRank::new(worker as u64, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(n: u64, base: u64) -> Vec<SeqHash> {
        (0..n).map(|i| SeqHash(base + i)).collect()
    }

    #[test]
    fn a_prompt_goes_back_where_over_thirty_percent_of_it_was_sent() {
        let mut p = SglangPicker::new(3, 16, 7);
        let first = hashes(10, 100);
        p.remember(2, &first);
        // 4 of 10 blocks remembered on worker 2: over the threshold.
        let mut next = hashes(4, 100);
        next.extend(hashes(6, 900));
        assert_eq!(p.choose(&next, &[0, 0, 0]), 2);
        // 3 of 10 is not over it: the smallest tree (worker 0 or 1, both empty) takes it.
        let mut low = hashes(3, 100);
        low.extend(hashes(7, 900));
        assert_ne!(p.choose(&low, &[0, 0, 0]), 2);
    }

    #[test]
    fn a_miss_goes_to_the_worker_that_remembers_least() {
        let mut p = SglangPicker::new(3, 16, 7);
        p.remember(0, &hashes(10, 0));
        p.remember(1, &hashes(3, 50));
        p.remember(2, &hashes(5, 80));
        assert_eq!(p.choose(&hashes(4, 1000), &[0, 0, 0]), 1);
    }

    #[test]
    fn an_imbalanced_fleet_sends_to_the_least_loaded_even_on_a_full_match() {
        let mut p = SglangPicker::new(3, 16, 7);
        p.remember(0, &hashes(10, 0));
        // Spread 70 > 64 and 80 > 1.5 × 10: imbalanced.
        assert_eq!(p.choose(&hashes(10, 0), &[80, 10, 20]), 1);
        // Spread 64 is not over 64: balanced, the match wins.
        assert_eq!(p.choose(&hashes(10, 0), &[74, 10, 20]), 0);
    }

    #[test]
    fn over_the_cap_the_oldest_blocks_are_forgotten_deepest_first() {
        let mut p = SglangPicker::new(1, 16, 7);
        p.cap_blocks = 4;
        p.remember(0, &hashes(3, 0));
        p.remember(0, &hashes(2, 10));
        // The first prompt's deepest block went first; its first two stay.
        let tree = &p.trees[0].blocks;
        assert_eq!(tree.len(), 4);
        assert!(!tree.contains_key(&SeqHash(2)));
        assert!(tree.contains_key(&SeqHash(0)) && tree.contains_key(&SeqHash(1)));
    }
}
