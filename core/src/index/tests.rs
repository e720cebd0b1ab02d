//! Rules of the index, one test each.

use super::stats::ErrorCounts;
use super::*;
use crate::event::{
    BlockHash, EventHeader, EventId, StorageTier, StoredBlock, WorkerId, WorkerRank,
};
use crate::hash::LocalHash;
use crate::testing::scores_of;

fn idx() -> PrefixIndex {
    PrefixIndex::new(IndexConfig {
        shards: 2,
        ..IndexConfig::default()
    })
}

fn hdr(w: u64, dp: u32, id: u64, tier: StorageTier) -> EventHeader {
    EventHeader {
        source: WorkerRank::new(w, dp),
        event_id: EventId(id),
        tier,
    }
}

/// Blocks `from..to` of a chain whose local hashes are `i + 1` and engine names `1000 + i`
/// (plus `salt`).
fn chain(from: u64, to: u64, salt: u64) -> Vec<StoredBlock> {
    (from..to)
        .map(|i| StoredBlock {
            block_hash: BlockHash(1000 + i + salt),
            local_hash: LocalHash(i + 1),
        })
        .collect()
}

fn query(n: u64) -> Vec<LocalHash> {
    (0..n).map(|i| LocalHash(i + 1)).collect()
}

fn device() -> StorageTier {
    StorageTier::Device
}

#[test]
fn scores_count_leading_blocks_per_rank() {
    let mut ix = idx();
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 100, 0))
        .unwrap();
    ix.apply_stored(hdr(2, 0, 0, device()), None, &chain(0, 30, 0))
        .unwrap();
    let s = scores_of(&ix.reader(), &query(120), MatchOptions::default());
    assert_eq!(s.blocks(WorkerRank::new(1, 0)), 100);
    assert_eq!(s.blocks(WorkerRank::new(2, 0)), 30);
    assert_eq!(s.scores.len(), 2);
    let s = scores_of(&ix.reader(), &query(10), MatchOptions::default());
    assert_eq!(s.blocks(WorkerRank::new(1, 0)), 10);
    assert!(scores_of(&ix.reader(), &[], MatchOptions::default())
        .scores
        .is_empty());
    assert!(
        scores_of(&ix.reader(), &[LocalHash(77)], MatchOptions::default())
            .scores
            .is_empty()
    );
}

#[test]
fn a_chain_continues_from_its_parent_across_runs() {
    let mut ix = idx();
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 70, 0))
        .unwrap();
    ix.apply_stored(
        hdr(1, 0, 1, device()),
        Some(BlockHash(1000 + 69)),
        &chain(70, 150, 0),
    )
    .unwrap();
    let s = scores_of(&ix.reader(), &query(200), MatchOptions::default());
    assert_eq!(s.blocks(WorkerRank::new(1, 0)), 150);
}

#[test]
fn a_hole_ends_the_leading_count_and_refilling_it_restores_it() {
    let mut ix = idx();
    let r = WorkerRank::new(1, 0);
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 10, 0))
        .unwrap();
    ix.apply_removed(hdr(1, 0, 1, device()), &[BlockHash(1000 + 4)])
        .unwrap();
    assert_eq!(
        scores_of(&ix.reader(), &query(10), MatchOptions::default()).blocks(r),
        4
    );
    ix.apply_stored(
        hdr(1, 0, 2, device()),
        Some(BlockHash(1000 + 3)),
        &chain(4, 5, 0),
    )
    .unwrap();
    assert_eq!(
        scores_of(&ix.reader(), &query(10), MatchOptions::default()).blocks(r),
        10
    );
}

#[test]
fn duplicate_copies_leave_with_their_last_copy() {
    let mut ix = idx();
    let r = WorkerRank::new(1, 0);
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 3, 0))
        .unwrap();
    ix.apply_stored(hdr(1, 0, 1, device()), None, &chain(0, 3, 0))
        .unwrap();
    assert_eq!(ix.stats().duplicate_copies, 3);
    assert_eq!(ix.stats().stored_pairs, 3);
    ix.apply_removed(hdr(1, 0, 2, device()), &[BlockHash(1002)])
        .unwrap();
    assert_eq!(
        scores_of(&ix.reader(), &query(3), MatchOptions::default()).blocks(r),
        3
    );
    ix.apply_removed(hdr(1, 0, 3, device()), &[BlockHash(1002)])
        .unwrap();
    assert_eq!(
        scores_of(&ix.reader(), &query(3), MatchOptions::default()).blocks(r),
        2
    );
    assert_eq!(ix.stats().duplicate_copies, 2);
}

#[test]
fn copies_are_counted_per_tier() {
    let mut ix = idx();
    let r = WorkerRank::new(1, 0);
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 4, 0))
        .unwrap();
    ix.apply_stored(hdr(1, 0, 1, StorageTier::HostPinned), None, &chain(0, 4, 0))
        .unwrap();
    assert_eq!(ix.stats().duplicate_copies, 0);
    assert_eq!(ix.stats().stored_pairs, 8);
    // Removing the device copy of blocks 2 and 3 leaves them in host memory.
    ix.apply_removed(hdr(1, 0, 2, device()), &[BlockHash(1002), BlockHash(1003)])
        .unwrap();
    let s = scores_of(&ix.reader(), &query(4), MatchOptions::default());
    assert_eq!(s.blocks(r), 4);
    assert_eq!(s.scores[0].per_tier, [2, 2, 0, 0]);
}

#[test]
fn tier_split_gives_each_block_its_fastest_tier() {
    // The reference router's case: device 2 blocks, host 1, disk 2 on the first worker;
    // host 1 on the second.
    let mut ix = idx();
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 2, 0))
        .unwrap();
    ix.apply_stored(
        hdr(1, 0, 1, StorageTier::HostPinned),
        Some(BlockHash(1001)),
        &chain(2, 3, 0),
    )
    .unwrap();
    ix.apply_stored(
        hdr(1, 0, 2, StorageTier::Disk),
        Some(BlockHash(1002)),
        &chain(3, 5, 0),
    )
    .unwrap();
    ix.apply_stored(hdr(2, 0, 0, StorageTier::HostPinned), None, &chain(0, 1, 0))
        .unwrap();
    let s = scores_of(&ix.reader(), &query(5), MatchOptions::default());
    let first = s.scores.iter().find(|x| x.rank.worker.0 == 1).unwrap();
    assert_eq!((first.blocks, first.per_tier), (5, [2, 1, 2, 0]));
    let second = s.scores.iter().find(|x| x.rank.worker.0 == 2).unwrap();
    assert_eq!((second.blocks, second.per_tier), (1, [0, 1, 0, 0]));
}

#[test]
fn dp_ranks_are_separate_caches() {
    let mut ix = idx();
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 5, 0))
        .unwrap();
    ix.apply_stored(hdr(1, 1, 0, device()), None, &chain(0, 2, 0))
        .unwrap();
    let s = scores_of(&ix.reader(), &query(5), MatchOptions::default());
    assert_eq!(s.blocks(WorkerRank::new(1, 0)), 5);
    assert_eq!(s.blocks(WorkerRank::new(1, 1)), 2);
    // The parent is looked up in the event's own rank: another rank's block of that name
    // places the chain, which scores nothing for this rank without its ancestors.
    let err = ix
        .apply_stored(
            hdr(1, 1, 1, device()),
            Some(BlockHash(1004)),
            &chain(5, 6, 0),
        )
        .unwrap_err();
    assert!(matches!(
        err,
        IndexError::UnknownParent { placed: true, .. }
    ));
    let s = scores_of(&ix.reader(), &query(6), MatchOptions::default());
    assert_eq!(s.blocks(WorkerRank::new(1, 0)), 5);
    assert_eq!(s.blocks(WorkerRank::new(1, 1)), 2);
}

#[test]
fn a_partially_known_rank_places_its_chains_under_a_peers_block_and_scores_only_rooted_ones() {
    let mut ix = idx();
    let (a, b) = (WorkerRank::new(1, 0), WorkerRank::new(2, 0));
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 10, 0))
        .unwrap();
    // Worker 2 was met late: it holds blocks 0..10 the index never saw stored, and stores
    // 10..12 after them. Worker 1 names block 9 alike, so the chain is placed there.
    let err = ix
        .apply_stored(
            hdr(2, 0, 0, device()),
            Some(BlockHash(1009)),
            &chain(10, 12, 0),
        )
        .unwrap_err();
    assert_eq!(
        err,
        IndexError::UnknownParent {
            rank: b,
            parent: BlockHash(1009),
            placed: true,
        }
    );
    assert!(err
        .to_string()
        .contains("placed under another rank's block"));
    let stats = ix.stats();
    assert_eq!(stats.errors.unknown_parent, 1);
    assert_eq!(stats.events.placed_under_peer, 1);
    assert_eq!(ix.ranks_needing_resync(), vec![b]);
    assert_eq!(stats.stored_pairs, 12);
    // Never credited with blocks it may not hold: its leading blocks are unknown.
    let s = scores_of(&ix.reader(), &query(12), MatchOptions::default());
    assert_eq!((s.blocks(a), s.blocks(b)), (10, 0));
    // Its own placed block is a parent now, and its removals apply.
    ix.apply_stored(
        hdr(2, 0, 1, device()),
        Some(BlockHash(1011)),
        &chain(12, 13, 0),
    )
    .unwrap();
    ix.apply_removed(hdr(2, 0, 2, device()), &[BlockHash(1012)])
        .unwrap();
    // Once it stores the leading blocks again, the whole chain scores.
    ix.apply_stored(hdr(2, 0, 3, device()), None, &chain(0, 10, 0))
        .unwrap();
    let s = scores_of(&ix.reader(), &query(13), MatchOptions::default());
    assert_eq!((s.blocks(a), s.blocks(b)), (10, 12));
    // Two ranks that name one block at two positions (engines that hash alike for some
    // blocks only) place nothing.
    ix.apply_stored(hdr(3, 0, 0, device()), None, &chain(20, 22, 0))
        .unwrap();
    let elsewhere = [StoredBlock {
        block_hash: BlockHash(1021),
        local_hash: LocalHash(31),
    }];
    ix.apply_stored(hdr(4, 0, 0, device()), None, &elsewhere)
        .unwrap();
    let before = ix.stats().stored_pairs;
    assert_eq!(
        ix.apply_stored(
            hdr(5, 0, 0, device()),
            Some(BlockHash(1021)),
            &chain(40, 41, 0)
        ),
        Err(IndexError::UnknownParent {
            rank: WorkerRank::new(5, 0),
            parent: BlockHash(1021),
            placed: false,
        })
    );
    assert_eq!(ix.stats().stored_pairs, before);
    assert_eq!(ix.stats().events.placed_under_peer, 1);
}

#[test]
fn unknown_parent_is_rejected_counted_and_flags_resync() {
    let mut ix = idx();
    let r = WorkerRank::new(1, 0);
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 3, 0))
        .unwrap();
    let err = ix
        .apply_stored(hdr(1, 0, 1, device()), Some(BlockHash(9)), &chain(3, 5, 0))
        .unwrap_err();
    assert_eq!(
        err,
        IndexError::UnknownParent {
            rank: r,
            parent: BlockHash(9),
            placed: false,
        }
    );
    assert!(err.to_string().contains("does not hold"));
    assert_eq!(ix.stats().errors.unknown_parent, 1);
    assert_eq!(ix.ranks_needing_resync(), vec![r]);
    assert_eq!(
        scores_of(&ix.reader(), &query(5), MatchOptions::default()).blocks(r),
        3
    );
    ix.mark_resynced(r);
    assert!(ix.ranks_needing_resync().is_empty());
}

#[test]
fn unknown_removals_are_counted_and_the_rest_applied() {
    let mut ix = idx();
    let r = WorkerRank::new(1, 0);
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 3, 0))
        .unwrap();
    let err = ix
        .apply_removed(
            hdr(1, 0, 1, device()),
            &[BlockHash(5), BlockHash(1002), BlockHash(6)],
        )
        .unwrap_err();
    assert_eq!(
        err,
        IndexError::UnknownBlocks {
            rank: r,
            count: 2,
            first: BlockHash(5)
        }
    );
    assert_eq!(ix.stats().errors.unknown_blocks, 2);
    assert_eq!(
        scores_of(&ix.reader(), &query(3), MatchOptions::default()).blocks(r),
        2
    );
    // A removal in a tier the block is not held in is unknown too.
    let err = ix
        .apply_removed(hdr(1, 0, 2, StorageTier::Disk), &[BlockHash(1000)])
        .unwrap_err();
    assert!(matches!(err, IndexError::UnknownBlocks { count: 1, .. }));
    assert_eq!(
        scores_of(&ix.reader(), &query(3), MatchOptions::default()).blocks(r),
        2
    );
}

#[test]
fn a_block_that_is_its_own_parent_is_rejected() {
    let mut ix = idx();
    let blocks = chain(0, 2, 0);
    let err = ix
        .apply_stored(hdr(1, 0, 0, device()), Some(blocks[1].block_hash), &blocks)
        .unwrap_err();
    assert!(matches!(err, IndexError::InvalidChain { .. }));
    let twice = [blocks[0], blocks[0]];
    assert!(ix
        .apply_stored(hdr(1, 0, 1, device()), None, &twice)
        .is_err());
    assert_eq!(ix.stats().errors.invalid_chain, 2);
    assert_eq!(ix.stats().stored_pairs, 0);
    assert!(scores_of(&ix.reader(), &query(2), MatchOptions::default())
        .scores
        .is_empty());
}

#[test]
fn event_id_gaps_and_reorders_are_counted_per_rank() {
    let mut ix = idx();
    let r = WorkerRank::new(3, 0);
    ix.apply_cleared(hdr(3, 0, 10, device())).unwrap();
    ix.apply_cleared(hdr(3, 0, 11, device())).unwrap();
    ix.apply_cleared(hdr(3, 0, 15, device())).unwrap();
    ix.apply_cleared(hdr(3, 0, 12, device())).unwrap();
    let st = ix.stats().events;
    assert_eq!((st.events, st.gaps, st.missing, st.reordered), (4, 1, 3, 1));
    let status = ix.rank_status();
    assert_eq!(status.len(), 1);
    assert_eq!(status[0].last_event, Some(EventId(15)));
    assert_eq!(status[0].gaps, 1);
    // A gap flags the rank for resync; only a cleared cache or an explicit resync clears it.
    ix.apply_stored(hdr(3, 0, 20, device()), None, &chain(0, 1, 0))
        .unwrap();
    assert_eq!(ix.ranks_needing_resync(), vec![r]);
    ix.apply_cleared(hdr(3, 0, 21, device())).unwrap();
    assert!(ix.ranks_needing_resync().is_empty());
}

#[test]
fn cleared_and_remove_worker_drop_everything_of_the_rank() {
    let mut ix = idx();
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 90, 0))
        .unwrap();
    ix.apply_stored(hdr(1, 1, 0, device()), None, &chain(0, 90, 7))
        .unwrap();
    ix.apply_stored(hdr(2, 0, 0, device()), None, &chain(0, 50, 0))
        .unwrap();
    ix.apply_cleared(hdr(2, 0, 1, device())).unwrap();
    let s = scores_of(&ix.reader(), &query(90), MatchOptions::default());
    assert_eq!(s.scores.len(), 2);
    ix.remove_worker(WorkerId(1)).unwrap();
    assert!(scores_of(&ix.reader(), &query(90), MatchOptions::default())
        .scores
        .is_empty());
    let st = ix.stats();
    assert_eq!((st.stored_pairs, st.blocks, st.runs), (0, 0, 0));
    assert_eq!(
        ix.remove_worker(WorkerId(1)),
        Err(IndexError::UnknownWorker {
            worker: WorkerId(1)
        })
    );
    assert_eq!(ix.stats().errors.unknown_worker, 1);
}

/// Names `from..to` of [`chain`].
fn names(from: u64, to: u64) -> Vec<BlockHash> {
    (from..to).map(|i| BlockHash(1000 + i)).collect()
}

#[test]
fn emptied_runs_are_freed_and_their_parents_trimmed() {
    let mut ix = idx();
    let shape = |ix: &PrefixIndex| {
        let st = ix.stats();
        (st.blocks, st.runs, st.stored_pairs)
    };
    let depth = |ix: &PrefixIndex, w: u64| {
        scores_of(&ix.reader(), &query(100), MatchOptions::default())
            .scores
            .iter()
            .find(|s| s.rank == WorkerRank::new(w, 0))
            .map_or(0, |s| s.blocks)
    };
    // Worker 1 holds 0..100 (a run of 64 and a child of 36), worker 2 the first 30.
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 100, 0))
        .unwrap();
    ix.apply_stored(hdr(2, 0, 0, device()), None, &chain(0, 30, 0))
        .unwrap();
    assert_eq!(shape(&ix), (100, 2, 130));
    // The child, held by worker 1 alone, goes whole; its parent keeps every block.
    ix.apply_removed(hdr(1, 0, 1, device()), &names(64, 100))
        .unwrap();
    assert_eq!(shape(&ix), (64, 1, 94));
    assert_eq!(depth(&ix, 1), 64);
    // The parent's tail, beyond what anyone still holds, is trimmed.
    ix.apply_removed(hdr(1, 0, 2, device()), &names(20, 64))
        .unwrap();
    assert_eq!(shape(&ix), (30, 1, 50));
    ix.apply_removed(hdr(2, 0, 1, device()), &names(0, 30))
        .unwrap();
    assert_eq!(shape(&ix), (20, 1, 20));
    assert_eq!((depth(&ix, 1), depth(&ix, 2)), (20, 0));
    // Its last holder leaving empties the index.
    ix.apply_removed(hdr(1, 0, 3, device()), &names(0, 20))
        .unwrap();
    assert_eq!(shape(&ix), (0, 0, 0));
    assert!(
        scores_of(&ix.reader(), &query(100), MatchOptions::default())
            .scores
            .is_empty()
    );

    // A child freed whole lets its parent give up the blocks it kept only for the child.
    ix.apply_stored(hdr(1, 0, 4, device()), None, &chain(0, 100, 0))
        .unwrap();
    ix.apply_removed(hdr(1, 0, 5, device()), &names(40, 64))
        .unwrap();
    assert_eq!(shape(&ix), (100, 2, 76), "blocks 40..64 lead to the child");
    assert_eq!(depth(&ix, 1), 40);
    ix.apply_removed(hdr(1, 0, 6, device()), &names(64, 100))
        .unwrap();
    assert_eq!(shape(&ix), (40, 1, 40));
    // The freed slots are taken again.
    ix.apply_stored(hdr(3, 0, 0, device()), None, &chain(0, 70, 0))
        .unwrap();
    assert_eq!((depth(&ix, 1), depth(&ix, 3)), (40, 70));
    assert_eq!(shape(&ix), (70, 2, 110));
    assert_eq!(ix.stats().errors, ErrorCounts::default());
}

#[test]
fn a_name_left_for_a_block_no_longer_held_is_not_a_parent() {
    let mut ix = idx();
    // One worker names the same three blocks twice (a second copy of each), then removes
    // them under both names: the first removal takes the copies, the second the holds.
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 3, 0))
        .unwrap();
    ix.apply_stored(hdr(1, 0, 1, device()), None, &chain(0, 3, 500))
        .unwrap();
    ix.apply_removed(hdr(1, 0, 2, device()), &names(0, 3))
        .unwrap();
    ix.apply_removed(
        hdr(1, 0, 3, device()),
        &(500..503).map(|i| BlockHash(1000 + i)).collect::<Vec<_>>(),
    )
    .unwrap();
    assert_eq!(ix.stats().stored_pairs, 0);
    // The first names may still be in the worker's map; they name nothing it holds.
    let child = [StoredBlock {
        block_hash: BlockHash(9),
        local_hash: LocalHash(9),
    }];
    assert_eq!(
        ix.apply_stored(hdr(1, 0, 4, device()), Some(BlockHash(1002)), &child),
        Err(IndexError::UnknownParent {
            rank: WorkerRank::new(1, 0),
            parent: BlockHash(1002),
            placed: false,
        })
    );
    assert_eq!(ix.stats().blocks, 0);
}

#[test]
fn a_second_name_for_a_block_goes_with_its_hold() {
    let mut ix = PrefixIndex::new(IndexConfig {
        shards: 1,
        ..IndexConfig::default()
    });
    let high = 0x1234_5678u64 << 32;
    let block = |name: u64, local: u64| StoredBlock {
        block_hash: BlockHash(high | name),
        local_hash: LocalHash(local),
    };
    let w = WorkerRank::new(1, 0);
    // One worker names block X twice (a second copy under another name), then removes it
    // under both names: the first removal takes the copy, the second the hold.
    ix.apply_stored(hdr(1, 0, 0, device()), None, &[block(1, 1)])
        .unwrap();
    ix.apply_stored(hdr(1, 0, 1, device()), None, &[block(2, 1)])
        .unwrap();
    ix.apply_removed(hdr(1, 0, 2, device()), &[BlockHash(high | 2)])
        .unwrap();
    ix.apply_removed(hdr(1, 0, 3, device()), &[BlockHash(high | 1)])
        .unwrap();
    assert_eq!(ix.stats().blocks, 0, "X is gone");
    // Block Y takes X's place (its run's slot, offset 0), under a name with the same high half.
    ix.apply_stored(hdr(1, 0, 4, device()), None, &[block(3, 7)])
        .unwrap();
    assert_eq!(
        scores_of(&ix.reader(), &[LocalHash(7)], MatchOptions::default()).blocks(w),
        1
    );
    // X's second name names nothing the worker holds now: removing it is an error, and Y
    // stays.
    assert_eq!(
        ix.apply_removed(hdr(1, 0, 5, device()), &[BlockHash(high | 2)]),
        Err(IndexError::UnknownBlocks {
            rank: w,
            count: 1,
            first: BlockHash(high | 2),
        })
    );
    assert_eq!(
        scores_of(&ix.reader(), &[LocalHash(7)], MatchOptions::default()).blocks(w),
        1
    );
    assert_eq!(ix.stats().stored_pairs, 1);

    // The same across tiers: block Z in device memory under one name, in host memory under
    // another. Removing the device copy keeps the first name (Z is still held); removing the
    // host copy ends the hold, and both names go.
    let host = StorageTier::HostPinned;
    ix.apply_stored(hdr(1, 0, 6, device()), None, &[block(4, 9)])
        .unwrap();
    ix.apply_stored(hdr(1, 0, 7, host), None, &[block(5, 9)])
        .unwrap();
    ix.apply_removed(hdr(1, 0, 8, device()), &[BlockHash(high | 4)])
        .unwrap();
    ix.apply_removed(hdr(1, 0, 9, host), &[BlockHash(high | 5)])
        .unwrap();
    let depth = scores_of(&ix.reader(), &[LocalHash(9)], MatchOptions::default());
    assert_eq!(depth.blocks(w), 0);
    // Block V takes Z's place; Z's first name does not reach it.
    ix.apply_stored(hdr(1, 0, 10, device()), None, &[block(6, 11)])
        .unwrap();
    assert!(ix
        .apply_removed(hdr(1, 0, 11, device()), &[BlockHash(high | 4)])
        .is_err());
    let depth = scores_of(&ix.reader(), &[LocalHash(11)], MatchOptions::default());
    assert_eq!(depth.blocks(w), 1);
    assert_eq!(ix.stats().stored_pairs, 2, "Y and V");
}

#[test]
fn ranks_that_name_one_block_differently_share_it() {
    let mut ix = idx();
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 5, 0))
        .unwrap();
    ix.apply_stored(hdr(2, 0, 0, device()), None, &chain(0, 5, 500))
        .unwrap();
    assert_eq!(ix.stats().blocks, 5);
    ix.apply_removed(hdr(2, 0, 1, device()), &[BlockHash(1504)])
        .unwrap();
    ix.apply_removed(hdr(1, 0, 1, device()), &[BlockHash(1002)])
        .unwrap();
    let s = scores_of(&ix.reader(), &query(5), MatchOptions::default());
    assert_eq!(s.blocks(WorkerRank::new(1, 0)), 2);
    assert_eq!(s.blocks(WorkerRank::new(2, 0)), 4);
    // Rank 2 stores a different block under a name rank 1 uses: each keeps its own meaning.
    let other = [StoredBlock {
        block_hash: BlockHash(1000),
        local_hash: LocalHash(99),
    }];
    ix.apply_stored(hdr(2, 0, 2, device()), None, &other)
        .unwrap();
    ix.apply_removed(hdr(2, 0, 3, device()), &[BlockHash(1000)])
        .unwrap();
    let s = scores_of(&ix.reader(), &query(5), MatchOptions::default());
    assert_eq!(s.blocks(WorkerRank::new(1, 0)), 2);
    assert!(
        scores_of(&ix.reader(), &[LocalHash(99)], MatchOptions::default())
            .scores
            .is_empty()
    );
}

#[test]
fn unregistered_ranks_are_rejected_without_auto_registration() {
    let mut ix = PrefixIndex::new(IndexConfig {
        shards: 1,
        auto_register: false,
        ..IndexConfig::default()
    });
    let err = ix
        .apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 2, 0))
        .unwrap_err();
    assert!(matches!(err, IndexError::UnknownRank { .. }));
    assert_eq!(ix.stats().errors.unknown_rank, 1);
    ix.register_rank(WorkerRank::new(1, 0)).unwrap();
    ix.apply_stored(hdr(1, 0, 1, device()), None, &chain(0, 2, 0))
        .unwrap();
    assert_eq!(ix.stats().stored_pairs, 2);
}

#[test]
fn rank_limit_is_enforced() {
    let mut ix = PrefixIndex::new(IndexConfig {
        shards: 1,
        max_ranks: 2,
        ..IndexConfig::default()
    });
    ix.register_rank(WorkerRank::new(1, 0)).unwrap();
    ix.register_rank(WorkerRank::new(2, 0)).unwrap();
    let err = ix
        .apply_stored(hdr(3, 0, 0, device()), None, &chain(0, 1, 0))
        .unwrap_err();
    assert!(matches!(err, IndexError::TooManyRanks { limit: 2, .. }));
    ix.remove_worker(WorkerId(1)).unwrap();
    ix.apply_stored(hdr(3, 0, 0, device()), None, &chain(0, 1, 0))
        .unwrap();
}

#[test]
fn early_exit_stops_when_one_rank_is_left() {
    let mut ix = idx();
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 200, 0))
        .unwrap();
    ix.apply_stored(hdr(2, 0, 0, device()), None, &chain(0, 10, 0))
        .unwrap();
    let full = scores_of(&ix.reader(), &query(200), MatchOptions::default());
    let early = scores_of(&ix.reader(), &query(200), MatchOptions { early_exit: true });
    assert_eq!(full.blocks(WorkerRank::new(1, 0)), 200);
    assert_eq!(early.blocks(WorkerRank::new(2, 0)), 10);
    let lone = early.blocks(WorkerRank::new(1, 0));
    assert!((10..200).contains(&lone), "early exit scored {lone}");
    // By id, the same: the walk stops where the scores' walk stops.
    let reader = ix.reader();
    let mut depths = crate::index::RankDepths::default();
    reader.find_depths_into(&query(200), MatchOptions { early_exit: true }, &mut depths);
    let id = |w: u64| ix.rank_key(WorkerRank::new(w, 0)).unwrap();
    assert_eq!(depths.get_for(id(1)).map(|d| d.blocks), Some(lone));
    assert_eq!(depths.get_for(id(2)).map(|d| d.blocks), Some(10));
}

/// An index of two shards under a budget of 200 KB.
fn budgeted() -> PrefixIndex {
    PrefixIndex::new(IndexConfig {
        shards: 2,
        memory_budget: Some(BUDGET),
        ..IndexConfig::default()
    })
}

const BUDGET: usize = 200_000;

/// Prompt `p` of many distinct 40-block prompts: its blocks, and its query.
fn distinct_prompt(p: u64) -> (Vec<StoredBlock>, Vec<LocalHash>) {
    let blocks: Vec<StoredBlock> = (0..40u64)
        .map(|i| StoredBlock {
            block_hash: BlockHash(p * 1000 + i),
            local_hash: LocalHash(p * 1000 + i + 1),
        })
        .collect();
    let query = blocks.iter().map(|b| b.local_hash).collect();
    (blocks, query)
}

/// The most blocks any rank holds of prompt `p`.
fn held_of(ix: &PrefixIndex, p: u64) -> u32 {
    scores_of(&ix.reader(), &distinct_prompt(p).1, MatchOptions::default()).max_blocks()
}

#[test]
fn memory_budget_evicts_least_recently_stored_leaves_first() {
    let mut ix = budgeted();
    // Many distinct prompts on 4 ranks.
    for p in 0..400u64 {
        ix.apply_stored(hdr(p % 4, 0, p / 4, device()), None, &distinct_prompt(p).0)
            .unwrap();
        assert!(
            ix.memory_bytes() <= BUDGET,
            "after prompt {p}: {} bytes over a budget of {BUDGET}",
            ix.memory_bytes()
        );
    }
    let st = ix.stats();
    assert!(st.evicted_blocks > 0 && st.evicted_pairs >= st.evicted_blocks);
    assert_eq!(st.stored_pairs + st.evicted_pairs, 400 * 40);
    // The newest prompt survives whole; the oldest is gone.
    assert_eq!(held_of(&ix, 399), 40);
    assert_eq!(held_of(&ix, 0), 0);
    // Whatever is left of a prompt is a prefix of it (leaves went first): every pair still
    // stored is reached by matching its prompt from the start.
    let reached: u64 = (0..400u64).map(|p| u64::from(held_of(&ix, p))).sum();
    assert_eq!(reached, ix.stats().stored_pairs);
    // Removing an evicted block is an unknown block, counted, and harmless.
    let err = ix.apply_removed(hdr(0, 0, 100, device()), &[BlockHash(0)]);
    assert!(matches!(err, Err(IndexError::UnknownBlocks { .. })));
}

#[test]
fn memory_budget_keeps_leaves_that_matches_keep_reading() {
    let mut ix = budgeted();
    // Prompt 0 is matched after every store, through the scores and through the depth table
    // by turns; prompt 1, stored just after it, never is.
    let reader = ix.reader();
    let mut depths = crate::index::RankDepths::default();
    let hot = distinct_prompt(0).1;
    for p in 0..400u64 {
        ix.apply_stored(hdr(p % 4, 0, p / 4, device()), None, &distinct_prompt(p).0)
            .unwrap();
        if p % 2 == 0 {
            assert_eq!(held_of(&ix, 0), 40);
        } else {
            reader.find_depths_into(&hot, MatchOptions::default(), &mut depths);
            let id = ix.rank_key(WorkerRank::new(0, 0)).unwrap();
            assert_eq!(depths.get_for(id).map(|d| d.blocks), Some(40));
        }
    }
    assert!(
        ix.stats().evicted_blocks > 400,
        "the budget evicted too little to tell"
    );
    assert_eq!(held_of(&ix, 1), 0);
    assert_eq!(held_of(&ix, 399), 40);
}

#[test]
fn accounted_memory_grows_with_content_and_returns_when_cleared() {
    let mut ix = idx();
    let empty = ix.memory_bytes();
    for p in 0..50u64 {
        let blocks: Vec<StoredBlock> = (0..64u64)
            .map(|i| StoredBlock {
                block_hash: BlockHash(p * 1000 + i),
                local_hash: LocalHash(p * 1000 + i + 1),
            })
            .collect();
        ix.apply_stored(hdr(1, 0, p, device()), None, &blocks)
            .unwrap();
    }
    let full = ix.memory_bytes();
    let per_block = (full - empty) / (50 * 64);
    assert!((8..200).contains(&per_block), "{per_block} bytes per block");
    ix.apply_cleared(hdr(1, 0, 50, device())).unwrap();
    let st = ix.stats();
    assert_eq!((st.blocks, st.runs), (0, 0));
}

#[test]
fn reserved_name_room_changes_no_answer_and_counts_in_memory() {
    let (mut plain, mut sized) = (idx(), idx());
    let r1 = WorkerRank::new(1, 0);
    sized.reserve_blocks(r1, 4_000).unwrap();
    assert!(sized.memory_bytes() >= plain.memory_bytes() + 4_000 * 12);
    assert_eq!(sized.stats().ranks, 1, "reserving registers the rank");
    let room = sized.memory_bytes();
    // The same events, stores and removals, give the same answers.
    for p in 0..40u64 {
        let w = 1 + p % 3;
        let base = (p % 10) * 100;
        let blocks = chain(base, base + 60, p * 10_000);
        let removed: Vec<BlockHash> = blocks[30..].iter().map(|b| b.block_hash).collect();
        for ix in [&mut plain, &mut sized] {
            ix.apply_stored(hdr(w, 0, 2 * p, device()), None, &blocks)
                .unwrap();
            if p % 2 == 1 {
                ix.apply_removed(hdr(w, 0, 2 * p + 1, device()), &removed)
                    .unwrap();
            }
        }
        for n in [1, 30, 59, 60, 200] {
            let q: Vec<LocalHash> = (base..base + n).map(|i| LocalHash(i + 1)).collect();
            let (a, b) = (
                scores_of(&plain.reader(), &q, MatchOptions::default()),
                scores_of(&sized.reader(), &q, MatchOptions::default()),
            );
            for w in 1..=3 {
                let r = WorkerRank::new(w, 0);
                assert_eq!(
                    a.blocks(r),
                    b.blocks(r),
                    "prompt {p}, query {n}, worker {w}"
                );
            }
        }
    }
    // A cleared rank keeps its room; its blocks are gone.
    sized.apply_cleared(hdr(1, 0, 1_000, device())).unwrap();
    plain.apply_cleared(hdr(1, 0, 1_000, device())).unwrap();
    assert_eq!(sized.stats().blocks, plain.stats().blocks);
    assert!(sized.memory_bytes() >= room - 1_000);
    // Under a budget, reservations together stay within a quarter of it.
    let budget = 1 << 20;
    let mut capped = PrefixIndex::new(IndexConfig {
        shards: 1,
        memory_budget: Some(budget),
        ..IndexConfig::default()
    });
    let base = capped.memory_bytes();
    for w in 0..8 {
        capped
            .reserve_blocks(WorkerRank::new(w, 0), u64::MAX)
            .unwrap();
    }
    // Each rank's own bookkeeping and a group of rounding come on top.
    assert!(capped.memory_bytes() - base <= budget / 4 + 8 * 512);
    assert!(capped.memory_bytes() - base >= budget / 5);
}

#[test]
fn huge_event_id_jumps_saturate_the_missing_count() {
    // Found by fuzzing: two ranks jumping to ids near 2^64 overflowed the sum of missing ids.
    let mut ix = idx();
    for dp in 0..2 {
        ix.apply_cleared(hdr(0, dp, 1, device())).unwrap();
        ix.apply_cleared(hdr(0, dp, u64::MAX, device())).unwrap();
    }
    let st = ix.stats().events;
    assert_eq!((st.gaps, st.missing), (2, u64::MAX));
}

#[test]
fn an_invalid_chain_names_its_first_offending_block() {
    // Found by fuzzing: blocks [A, A, P] with parent P name A (the second block), as the
    // reference model does.
    let mut ix = idx();
    let a = StoredBlock {
        block_hash: BlockHash(1),
        local_hash: LocalHash(1),
    };
    let p = StoredBlock {
        block_hash: BlockHash(2),
        local_hash: LocalHash(2),
    };
    let err = ix
        .apply_stored(hdr(1, 0, 0, device()), Some(p.block_hash), &[a, a, p])
        .unwrap_err();
    assert_eq!(
        err,
        IndexError::InvalidChain {
            rank: WorkerRank::new(1, 0),
            block: a.block_hash
        }
    );
}

#[test]
fn the_budget_holds_after_every_kind_of_call() {
    let budget = 60_000;
    let mut ix = PrefixIndex::new(IndexConfig {
        shards: 1,
        memory_budget: Some(budget),
        ..IndexConfig::default()
    });
    for p in 0..200u64 {
        let blocks: Vec<StoredBlock> = (0..20u64)
            .map(|i| StoredBlock {
                block_hash: BlockHash(p * 100 + i),
                local_hash: LocalHash(p * 100 + i + 1),
            })
            .collect();
        let _ = ix.apply_stored(hdr(p % 7, 0, p, device()), None, &blocks);
        let _ = ix.register_rank(WorkerRank::new(1000 + p % 13, 0));
        let _ = ix.reserve_blocks(WorkerRank::new(2000 + p % 5, 0), u64::MAX);
        let _ = ix.apply_removed(hdr(p % 7, 0, p + 1000, device()), &[BlockHash(p * 100)]);
        assert!(
            ix.memory_bytes() <= budget,
            "after prompt {p}: {}",
            ix.memory_bytes()
        );
    }
}

#[test]
fn a_removal_spanning_runs_with_repeats_counts_each_block_once_in_event_order() {
    let mut ix = idx();
    let r = WorkerRank::new(1, 0);
    // 100 blocks: two runs.
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 100, 0))
        .unwrap();
    let blocks = [
        BlockHash(1099),
        BlockHash(1098),
        BlockHash(1098), // a repeat: no longer held the second time
        BlockHash(1010), // back in the first run
        BlockHash(7),    // never stored
        BlockHash(1099), // a repeat across a run change
        BlockHash(1097),
    ];
    let err = ix
        .apply_removed(hdr(1, 0, 2, device()), &blocks)
        .unwrap_err();
    assert_eq!(
        err,
        IndexError::UnknownBlocks {
            rank: r,
            count: 3,
            first: BlockHash(1098)
        }
    );
    // Blocks 0..10 lead; 97..100 and 10 are gone, the rest stay.
    let q = query(100);
    assert_eq!(
        scores_of(&ix.reader(), &q, MatchOptions::default()).blocks(r),
        10
    );
    assert_eq!(ix.stats().stored_pairs, 96);
    // Every removed name is forgotten, every other one still resolves.
    for gone in [1099u64, 1098, 1097, 1010] {
        assert!(matches!(
            ix.apply_removed(hdr(1, 0, 3, device()), &[BlockHash(gone)]),
            Err(IndexError::UnknownBlocks { count: 1, .. })
        ));
    }
    ix.apply_removed(hdr(1, 0, 4, device()), &[BlockHash(1096), BlockHash(1011)])
        .unwrap();
    assert_eq!(ix.stats().stored_pairs, 94);
}

/// A wide fleet: 48 ranks share a long prefix and few take each branch, so the walk narrows
/// many active ranks by a run with few holders (searched) and by runs with many (merged), with
/// holes and several tiers; every query agrees with the reference model, and each score comes
/// with its rank's id.
#[test]
fn wide_fleets_narrow_by_search_and_by_merge_like_the_reference() {
    // 48 ranks: ids fit a mask, which later runs narrow; 80: they do not, and the active
    // list is narrowed by merge or by search.
    for workers in [24, 40] {
        wide_fleet_matches_the_reference(workers);
    }
}

fn wide_fleet_matches_the_reference(workers: u64) {
    use crate::index::reference::ReferenceIndex;
    let mut ix = idx();
    let mut model = ReferenceIndex::new();
    let mut rng = crate::rng::Rng::new(7);
    // Prompt p: blocks 0..70 shared, then its own tail.
    let prompt = |p: u64| -> Vec<LocalHash> {
        (0..200u64)
            .map(|i| LocalHash(if i < 70 { i + 1 } else { (p + 1) << 32 | i }))
            .collect()
    };
    let name = |r: WorkerRank, p: u64, i: u64| {
        BlockHash(
            r.worker.0 << 40
                | u64::from(r.dp_rank.0) << 36
                | (if i < 70 { 0 } else { p + 1 }) << 16
                | i,
        )
    };
    let mut id = 0;
    for w in 0..workers {
        for dp in 0..2u32 {
            let r = WorkerRank::new(w, dp);
            let p = rng.below(8);
            let len = 5 + rng.below(190);
            let tier = StorageTier::ALL[rng.below(3) as usize];
            let q = prompt(p);
            let blocks: Vec<StoredBlock> = (0..len)
                .map(|i| StoredBlock {
                    block_hash: name(r, p, i),
                    local_hash: q[i as usize],
                })
                .collect();
            id += 1;
            let h = hdr(w, dp, id, tier);
            assert_eq!(
                ix.apply_stored(h, None, &blocks),
                model.apply_stored(h, None, &blocks)
            );
            // A second tier for some, and a hole for others.
            if rng.below(3) == 0 {
                id += 1;
                let h = hdr(w, dp, id, StorageTier::HostPinned);
                let part = &blocks[..(len as usize / 2)];
                assert_eq!(
                    ix.apply_stored(h, None, part),
                    model.apply_stored(h, None, part)
                );
            }
            if rng.below(4) == 0 {
                id += 1;
                let h = hdr(w, dp, id, tier);
                let hole = [blocks[rng.below(len) as usize].block_hash];
                assert_eq!(ix.apply_removed(h, &hole), model.apply_removed(h, &hole));
            }
        }
    }
    let reader = ix.reader();
    let mut out = OverlapScores::default();
    let mut depths = crate::index::RankDepths::default();
    for p in 0..9u64 {
        for len in [1usize, 40, 64, 65, 70, 71, 100, 128, 129, 200] {
            let q = &prompt(p)[..len];
            reader.find_matches_into(q, MatchOptions::default(), &mut out);
            assert_eq!(out.rank_ids().len(), out.scores.len());
            let mut ids = out.rank_ids().to_vec();
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), out.scores.len(), "one id per scored rank");
            let mut got = out.scores.clone();
            got.sort();
            assert_eq!(got, model.find_matches(q), "prompt {p}, {len} blocks");
            reader.find_depths_into(q, MatchOptions::default(), &mut depths);
            let ids: Vec<u32> = depths.ids().collect();
            assert_eq!(ids, out.rank_ids(), "the same ranks, by id");
            // Written as the walk goes or read from the first run when asked for: the same.
            let mut eager = crate::index::RankDepths::default();
            eager.set_eager(true);
            reader.find_depths_into(q, MatchOptions::default(), &mut eager);
            assert_eq!(eager.ids().collect::<Vec<_>>(), ids);
            for id in 0..2 * workers as u32 {
                assert_eq!(
                    eager.get(id),
                    depths.get(id),
                    "prompt {p}, {len} blocks, id {id}"
                );
                assert_eq!(eager.per_tier(id), depths.per_tier(id));
            }
            assert_eq!(
                eager.deepest_ids().collect::<Vec<_>>(),
                depths.deepest_ids().collect::<Vec<_>>()
            );
            // The deepest few, deepest first, without repeats.
            let blocks = |id: u32| depths.get(id).map_or(0, |d| d.blocks);
            let mut deepest: Vec<u32> = ids.iter().map(|&id| blocks(id)).collect();
            deepest.sort_unstable_by(|a, b| b.cmp(a));
            deepest.truncate(4);
            let top: Vec<u32> = depths.deepest_ids().collect();
            let mut unique = top.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(unique.len(), top.len(), "prompt {p}, {len} blocks: {top:?}");
            let top: Vec<u32> = top.into_iter().map(blocks).collect();
            assert_eq!(top, deepest, "prompt {p}, {len} blocks");
            raised_records_follow_the_table(&depths, p, len);
            let mut dense = depths.to_scores(&reader);
            dense.sort();
            assert_eq!(dense, got, "prompt {p}, {len} blocks, by id");
            // With the early exit, by id as by rank: the same ranks, the same lower bounds.
            let early = MatchOptions { early_exit: true };
            reader.find_matches_into(q, early, &mut out);
            let mut want = out.scores.clone();
            want.sort();
            let mut early_depths = crate::index::RankDepths::default();
            reader.find_depths_into(q, early, &mut early_depths);
            let mut dense = early_depths.to_scores(&reader);
            dense.sort();
            assert_eq!(dense, want, "prompt {p}, {len} blocks, early exit");
            // One rank's walk: that rank's overlap and tiers, nothing for any other (ids
            // scored or not, and ids past the table's 48 ranks).
            let all = depths.clone();
            let mut one = crate::index::RankDepths::default();
            for id in 0..64u32 {
                reader.find_depth_of_into(q, id, &mut one);
                let scored: Vec<u32> = one.ids().collect();
                match all.get(id) {
                    Some(d) => {
                        assert_eq!(scored, vec![id], "prompt {p}, {len} blocks, id {id}");
                        assert_eq!(one.get(id), Some(d));
                        assert_eq!(one.per_tier(id), all.per_tier(id));
                        assert_eq!(one.deepest_ids().collect::<Vec<_>>(), vec![id]);
                    }
                    None => assert!(scored.is_empty(), "prompt {p}, {len} blocks, id {id}"),
                }
            }
        }
    }
}

/// Raised by records (some ranks deeper, some held nothing before), the four deepest and the
/// ids with a least overlap still follow the table.
fn raised_records_follow_the_table(depths: &crate::index::RankDepths, p: u64, len: usize) {
    let blocks = |id: u32| depths.get(id).map_or(0, |d| d.blocks);
    let mut raised = depths.clone();
    let mut expect: Vec<u32> = (0..64).map(blocks).collect();
    for k in 0..(p as u32 + 3) {
        let id = (k * 7 + p as u32 * 5) % 52;
        let depth = (k * 37 + len as u32) % 260 + 1;
        raised.raise(crate::index::RankKey { id, epoch: 0 }, depth);
        expect[id as usize] = expect[id as usize].max(depth);
    }
    let deep = |id: u32| raised.get(id).map_or(0, |d| d.blocks);
    let now: Vec<u32> = (0..64).map(deep).collect();
    assert_eq!(
        now, expect,
        "prompt {p}, {len} blocks: a raise never lowers"
    );
    let mut want: Vec<u32> = raised.ids().map(deep).collect();
    want.sort_unstable_by(|a, b| b.cmp(a));
    want.truncate(4);
    let top4: Vec<u32> = raised.deepest_ids().map(deep).collect();
    assert_eq!(top4, want, "prompt {p}, {len} blocks, raised");
    for least in [0, 1, 2, 40, 64, 65, 100, 128, 199, 200, 250, 261] {
        let scan: Vec<u32> = raised
            .ids()
            .filter(|&id| deep(id) >= least.max(1))
            .collect();
        let read: Vec<u32> = raised.ids_with_at_least(least).collect();
        assert_eq!(read, scan, "prompt {p}, {len} blocks, at least {least}");
    }
}

/// Blocks `from..to` of a chain that shares blocks `0..from` with [`chain`] and then goes its
/// own way: local hashes `5000 * fork + i`, names `100_000 * fork + i`.
fn fork(fork: u64, from: u64, to: u64) -> Vec<StoredBlock> {
    (from..to)
        .map(|i| StoredBlock {
            block_hash: BlockHash(100_000 * fork + i),
            local_hash: LocalHash(5000 * fork + i),
        })
        .collect()
}

#[test]
fn every_child_is_found_whichever_one_the_walk_is_hinted() {
    let r = |w: u64| WorkerRank::new(w, 0);
    let forked = |f: u64, n: u64| -> Vec<LocalHash> {
        (0..n)
            .map(|i| LocalHash(if i < 64 { i + 1 } else { 5000 * f + i }))
            .collect()
    };
    // Rank `w` stores the full first run, then fork `f` after it up to block `to`.
    let store_forked = |ix: &mut PrefixIndex, w: u64, f: u64, to: u64| {
        ix.apply_stored(hdr(w, 0, 0, device()), None, &chain(0, 64, 0))
            .unwrap();
        ix.apply_stored(
            hdr(w, 0, 1, device()),
            Some(BlockHash(1063)),
            &fork(f, 64, to),
        )
        .unwrap();
    };
    let mut ix = idx();
    // One full run, then two children at its end; the later one is the hinted one.
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 150, 0))
        .unwrap();
    store_forked(&mut ix, 2, 1, 150);
    let check = |ix: &PrefixIndex, one: u32, two: u32| {
        let s = scores_of(&ix.reader(), &query(150), MatchOptions::default());
        assert_eq!((s.blocks(r(1)), s.blocks(r(2))), (150, 64));
        let s = scores_of(&ix.reader(), &forked(1, 150), MatchOptions::default());
        assert_eq!((s.blocks(r(1)), s.blocks(r(2))), (64, two));
        let s = scores_of(
            &ix.reader(),
            &query(150)[..one as usize],
            MatchOptions::default(),
        );
        assert_eq!(s.blocks(r(1)), one);
    };
    check(&ix, 150, 150);
    // The hinted child goes, and its slot serves another chain: the hint is stale.
    let gone: Vec<BlockHash> = (64..150).map(|i| BlockHash(100_000 + i)).collect();
    ix.apply_removed(hdr(2, 0, 2, device()), &gone).unwrap();
    for w in 3..6u64 {
        let other: Vec<StoredBlock> = (0..130u64)
            .map(|i| StoredBlock {
                block_hash: BlockHash(w << 40 | i),
                local_hash: LocalHash(w << 40 | i),
            })
            .collect();
        ix.apply_stored(hdr(w, 0, 0, device()), None, &other)
            .unwrap();
    }
    check(&ix, 150, 64);
    check(&ix, 100, 64);
    // A third child, hinted now; the first two are still found.
    ix.apply_stored(
        hdr(2, 0, 3, device()),
        Some(BlockHash(1063)),
        &fork(1, 64, 150),
    )
    .unwrap();
    store_forked(&mut ix, 6, 2, 200);
    check(&ix, 150, 150);
    let s = scores_of(&ix.reader(), &forked(2, 200), MatchOptions::default());
    assert_eq!(
        (s.blocks(r(1)), s.blocks(r(2)), s.blocks(r(6))),
        (64, 64, 200)
    );
    // A child inside the full run, hinted last: walks past it still go on at the end.
    ix.apply_stored(hdr(7, 0, 0, device()), None, &chain(0, 30, 0))
        .unwrap();
    ix.apply_stored(
        hdr(7, 0, 1, device()),
        Some(BlockHash(1029)),
        &fork(3, 30, 90),
    )
    .unwrap();
    check(&ix, 150, 150);
    let inner: Vec<LocalHash> = (0..90u64)
        .map(|i| LocalHash(if i < 30 { i + 1 } else { 15_000 + i }))
        .collect();
    let s = scores_of(&ix.reader(), &inner, MatchOptions::default());
    assert_eq!((s.blocks(r(1)), s.blocks(r(7))), (30, 90));
}

#[test]
fn a_run_keeps_the_block_its_last_child_branches_from_and_no_longer() {
    let mut ix = idx();
    // Rank 1 holds one full run; ranks 2, 3 and 4 each branch a chain of their own off its last
    // block, so that block has three children (one counted in the slot's mask, two aside).
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 64, 0))
        .unwrap();
    for w in 2..5u64 {
        ix.apply_stored(hdr(w, 0, 0, device()), None, &chain(0, 64, 0))
            .unwrap();
        ix.apply_stored(
            hdr(w, 0, 1, device()),
            Some(BlockHash(1063)),
            &fork(w, 64, 70),
        )
        .unwrap();
        let shared: Vec<BlockHash> = (0..64).map(|i| BlockHash(1000 + i)).collect();
        ix.apply_removed(hdr(w, 0, 2, device()), &shared).unwrap();
    }
    assert_eq!(ix.stats().runs, 4);
    ix.apply_removed(
        hdr(1, 0, 1, device()),
        &(0..64).map(|i| BlockHash(1000 + i)).collect::<Vec<_>>(),
    )
    .unwrap();
    // Nobody holds the first run, but its blocks stay: chains still go on from them.
    assert_eq!(ix.stats().blocks, 64 + 3 * 6);
    for w in 2..5u64 {
        let gone: Vec<BlockHash> = (64..70).map(|i| BlockHash(100_000 * w + i)).collect();
        ix.apply_removed(hdr(w, 0, 3, device()), &gone).unwrap();
        let children_left = 4 - w;
        if children_left > 0 {
            assert_eq!(
                ix.stats().blocks as u64,
                64 + 6 * children_left,
                "after fork {w}"
            );
        }
    }
    // The last child gone, the unheld run goes too.
    let s = ix.stats();
    assert_eq!((s.runs, s.blocks, s.stored_pairs), (0, 0, 0));
    let left = scores_of(&ix.reader(), &query(64), MatchOptions::default());
    assert!(left.scores.is_empty());
}

#[test]
fn a_reused_result_scores_a_first_run_again_when_its_ranks_change() {
    let mut ix = idx();
    let reader = ix.reader();
    let query = query(40);
    let mut out = OverlapScores::default();
    let ranks = |out: &OverlapScores| -> Vec<(WorkerRank, u32)> {
        out.scores.iter().map(|s| (s.rank, s.blocks)).collect()
    };
    ix.apply_stored(hdr(1, 0, 0, device()), None, &chain(0, 40, 0))
        .unwrap();
    reader.find_matches_into(&query, MatchOptions::default(), &mut out);
    assert_eq!(ranks(&out), [(WorkerRank::new(1, 0), 40)]);
    // Kept and reused while nothing changes.
    reader.find_matches_into(&query, MatchOptions::default(), &mut out);
    assert_eq!(ranks(&out), [(WorkerRank::new(1, 0), 40)]);
    // Another rank takes the freed id and stores the same blocks: the run's holder words are
    // the same as before, but the rank they name is not.
    ix.remove_worker(WorkerId(1)).unwrap();
    ix.apply_stored(hdr(2, 0, 0, device()), None, &chain(0, 40, 0))
        .unwrap();
    reader.find_matches_into(&query, MatchOptions::default(), &mut out);
    assert_eq!(ranks(&out), [(WorkerRank::new(2, 0), 40)]);
    // And a change of holds is scored afresh too.
    ix.apply_removed(hdr(2, 0, 1, device()), &[BlockHash(1039)])
        .unwrap();
    reader.find_matches_into(&query, MatchOptions::default(), &mut out);
    assert_eq!(ranks(&out), [(WorkerRank::new(2, 0), 39)]);
}

/// One reused result alternating between a first run whose ranks fit a mask of ids and one
/// held by a rank whose id does not: each reuse of a kept first run answers as a fresh result
/// does, the later runs narrowed the way that run's ranks allow.
#[test]
fn a_reused_result_keeps_how_each_first_run_narrows() {
    let mut ix = idx();
    for w in 0..70 {
        ix.register_rank(WorkerRank::new(w, 0)).unwrap();
    }
    let other = |from: u64, to: u64| -> Vec<StoredBlock> {
        (from..to)
            .map(|i| StoredBlock {
                block_hash: BlockHash(900_000 + i),
                local_hash: LocalHash(500_000 + i),
            })
            .collect()
    };
    let mut id = 0;
    let mut store = |ix: &mut PrefixIndex, w: u64, blocks: &[StoredBlock]| {
        id += 1;
        ix.apply_stored(hdr(w, 0, id, device()), None, blocks)
            .unwrap();
    };
    // Chain A: three low ids share its first run, two go on into a second run, one of them
    // only part of the way.
    for w in [0, 1, 2] {
        store(&mut ix, w, &chain(0, 64, 0));
    }
    let a = chain(0, 100, 0);
    store(&mut ix, 0, &a);
    store(&mut ix, 1, &a[..80]);
    // Chain B: held by the rank with id 69 and a low one, into a second run as well.
    let b = other(0, 100);
    store(&mut ix, 69, &b);
    store(&mut ix, 2, &b[..70]);
    let qa = query(100);
    let qb: Vec<LocalHash> = b.iter().map(|s| s.local_hash).collect();
    let reader = ix.reader();
    let mut reused = OverlapScores::default();
    let sorted = |out: &OverlapScores| {
        let mut s = out.scores.clone();
        s.sort();
        s
    };
    // Every order of the two: each kept first run reused right after the other one and
    // right after itself.
    for (step, q) in [&qb, &qa, &qb, &qa, &qa, &qb, &qb, &qa]
        .into_iter()
        .enumerate()
    {
        let mut fresh = OverlapScores::default();
        reader.find_matches_into(q, MatchOptions::default(), &mut fresh);
        reader.find_matches_into(q, MatchOptions::default(), &mut reused);
        assert_eq!(sorted(&reused), sorted(&fresh), "step {step}");
        assert!(fresh.scores.len() >= 2);
    }
    let mut out = OverlapScores::default();
    reader.find_matches_into(&qa, MatchOptions::default(), &mut out);
    let blocks: Vec<(u64, u32)> = sorted(&out)
        .iter()
        .map(|s| (s.rank.worker.0, s.blocks))
        .collect();
    assert_eq!(blocks, [(0, 100), (1, 80), (2, 64)]);
    reader.find_matches_into(&qb, MatchOptions::default(), &mut out);
    let mut blocks: Vec<(u64, u32)> = out
        .scores
        .iter()
        .map(|s| (s.rank.worker.0, s.blocks))
        .collect();
    blocks.sort();
    assert_eq!(blocks, [(2, 70), (69, 100)]);
}
