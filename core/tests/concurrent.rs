//! Readers on several threads match while one writer applies events; with a memory budget,
//! while it evicts too.
//!
//! The writer grows one chain for rank 1 block by block and publishes, after each event, how
//! long the chain is (and, before each event, how long it is about to be); meanwhile it churns other ranks' chains (stores, removals, clears). Every
//! reader checks, for every answer, that rank 1's score lies between the length applied before
//! the match began and the length announced by the time it ended: a match never sees a chain
//! shorter than one already applied, nor a block not yet stored, whatever the churn around it.

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvroute_core::testing::scores_of;
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, LocalHash, MatchOptions, OverlapScores,
    PrefixIndex, StorageTier, StoredBlock, WorkerRank,
};

const LEN: u64 = 2_000;

fn header(worker: u64, id: u64) -> EventHeader {
    EventHeader {
        source: WorkerRank::new(worker, 0),
        event_id: EventId(id),
        tier: StorageTier::Device,
    }
}

/// Stops the readers and checks that they matched at all (a reader's panic fails the test).
fn stop(done: &AtomicBool, readers: Vec<std::thread::JoinHandle<u64>>) {
    done.store(true, Ordering::Release);
    let total: u64 = readers
        .into_iter()
        .map(|r| r.join().expect("reader panicked"))
        .sum();
    assert!(total > 0, "no reader matched");
}

#[test]
fn readers_see_monotonic_prefixes_while_the_writer_churns() {
    let mut index = PrefixIndex::new(IndexConfig {
        shards: 2,
        ..IndexConfig::default()
    });
    let published = Arc::new(AtomicU64::new(0));
    let announced = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let query: Vec<LocalHash> = (0..LEN).map(|i| LocalHash(i + 1)).collect();
    let rank = WorkerRank::new(1, 0);

    let readers: Vec<_> = (0..3)
        .map(|_| {
            let reader = index.reader();
            let published = Arc::clone(&published);
            let announced = Arc::clone(&announced);
            let done = Arc::clone(&done);
            let query = query.clone();
            std::thread::spawn(move || {
                let mut out = OverlapScores::default();
                let mut matches = 0u64;
                while !done.load(Ordering::Acquire) {
                    let before = published.load(Ordering::Acquire);
                    reader.find_matches_into(&query, MatchOptions::default(), &mut out);
                    let after = announced.load(Ordering::Acquire);
                    let got = out.blocks(rank) as u64;
                    assert!(
                        before <= got && got <= after,
                        "score {got} outside [{before}, {after}]"
                    );
                    for s in &out.scores {
                        assert!(s.blocks as usize <= query.len());
                    }
                    matches += 1;
                }
                matches
            })
        })
        .collect();

    let mut ids = [0u64; 8];
    for i in 0..LEN {
        let parent = (i > 0).then(|| BlockHash(i - 1));
        let block = StoredBlock {
            block_hash: BlockHash(i),
            local_hash: LocalHash(i + 1),
        };
        announced.store(i + 1, Ordering::Release);
        index
            .apply_stored(header(1, i), parent, &[block])
            .expect("rank 1's chain is valid");
        // Release: the chain of length i + 1 is applied before readers can see the number.
        published.store(i + 1, Ordering::Release);

        // Churn: other ranks store the same prefix and a private tail, then drop part of it.
        let w = 2 + (i % 6);
        let n = (i % 97) + 1;
        let blocks: Vec<StoredBlock> = (0..n)
            .map(|k| StoredBlock {
                block_hash: BlockHash(w * 1_000_000 + k),
                local_hash: LocalHash(if k < n / 2 {
                    k + 1
                } else {
                    10_000 + w * 1000 + k
                }),
            })
            .collect();
        ids[w as usize] += 1;
        let _ = index.apply_stored(header(w, ids[w as usize]), None, &blocks);
        ids[w as usize] += 1;
        let victims: Vec<BlockHash> = (n / 3..n).map(|k| BlockHash(w * 1_000_000 + k)).collect();
        let _ = index.apply_removed(header(w, ids[w as usize]), &victims);
        if i % 50 == 49 {
            ids[w as usize] += 1;
            index.apply_cleared(header(w, ids[w as usize])).unwrap();
        }
    }
    stop(&done, readers);
    assert_eq!(
        scores_of(&index.reader(), &query, MatchOptions::default()).blocks(rank),
        LEN as u32
    );
}

/// Prompt `p` of many distinct 40-block prompts, stored by rank `p % 4` alone.
fn prompt(p: u64) -> Vec<StoredBlock> {
    (0..40u64)
        .map(|i| StoredBlock {
            block_hash: BlockHash(p * 1000 + i),
            local_hash: LocalHash(p * 1000 + i + 1),
        })
        .collect()
}

#[test]
fn readers_mark_and_match_while_a_budget_evicts() {
    const PROMPTS: u64 = 3_000;
    let budget = 300_000;
    let mut index = PrefixIndex::new(IndexConfig {
        shards: 2,
        memory_budget: Some(budget),
        ..IndexConfig::default()
    });
    let stored = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    // Readers match the prompts stored lately, and prompt 0 throughout, marking the runs they
    // read while the writer evicts and reuses slots. An answer names the prompt's own rank
    // alone, with at most its 40 blocks: a walk that read a reused slot's stranger chain would
    // name another.
    let readers: Vec<_> = (0..3u64)
        .map(|t| {
            let reader = index.reader();
            let stored = Arc::clone(&stored);
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let mut out = OverlapScores::default();
                let mut depths = kvroute_core::RankDepths::default();
                let mut matches = 0u64;
                while !done.load(Ordering::Acquire) {
                    let n = stored.load(Ordering::Acquire);
                    let p = if matches % 2 == 0 {
                        0
                    } else {
                        n.saturating_sub(1 + (matches + t) % 64)
                    };
                    let query: Vec<LocalHash> = prompt(p).iter().map(|b| b.local_hash).collect();
                    let owner = WorkerRank::new(p % 4, 0);
                    if matches % 3 == 0 {
                        reader.find_depths_into(&query, MatchOptions::default(), &mut depths);
                        for s in depths.to_scores(&reader) {
                            assert!(s.rank == owner && s.blocks <= 40, "prompt {p}: {s:?}");
                        }
                    } else {
                        reader.find_matches_into(&query, MatchOptions::default(), &mut out);
                        for s in &out.scores {
                            assert!(s.rank == owner && s.blocks <= 40, "prompt {p}: {s:?}");
                        }
                    }
                    matches += 1;
                }
                matches
            })
        })
        .collect();

    for p in 0..PROMPTS {
        index
            .apply_stored(header(p % 4, p / 4), None, &prompt(p))
            .expect("distinct prompts store");
        stored.store(p + 1, Ordering::Release);
        assert!(index.memory_bytes() <= budget);
    }
    stop(&done, readers);
    let stats = index.stats();
    assert!(stats.evicted_blocks > 0, "the budget was meant to evict");
    if let Err(e) = index.check_links() {
        panic!("after the run: {e}");
    }
    let newest: Vec<LocalHash> = prompt(PROMPTS - 1).iter().map(|b| b.local_hash).collect();
    assert_eq!(
        scores_of(&index.reader(), &newest, MatchOptions::default()).max_blocks(),
        40
    );
}
