//! Random sequences of events and matches, applied to the index and to the reference model;
//! every answer, every error and the pair count must agree, and so must the index's books:
//! its error counters and each rank's event-id status, against the rules written out here.

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::collections::HashMap;

use kvroute_core::testing::scores_of;
use kvroute_core::testing::ReferenceIndex;
use kvroute_core::{next_seq_hash, SeqHash};
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, IndexError, LocalHash, MatchOptions, PrefixIndex,
    StorageTier, StoredBlock, WorkerId, WorkerRank,
};
use kvroute_core::{ErrorCounts, EventCounts, RankScore};
use proptest::prelude::*;

const WORKERS: u64 = 3;
const RANKS: u32 = 2;

#[derive(Clone, Debug)]
enum Op {
    Store {
        rank: (u64, u32),
        tier: u8,
        prompt: usize,
        from: usize,
        len: usize,
    },
    Remove {
        rank: (u64, u32),
        tier: u8,
        prompt: usize,
        positions: Vec<usize>,
    },
    RemoveBogus {
        rank: (u64, u32),
        name: u64,
    },
    SelfParent {
        rank: (u64, u32),
        prompt: usize,
        at: usize,
    },
    Clear {
        rank: (u64, u32),
    },
    RemoveWorker {
        worker: u64,
    },
    /// Room for a rank's names: changes no answer.
    Reserve {
        rank: (u64, u32),
        blocks: u64,
    },
    Query {
        prompt: usize,
        len: usize,
    },
    /// The rank's next event id jumps ahead: a gap.
    Skip {
        rank: (u64, u32),
        by: u64,
    },
    /// The rank's next event repeats its last id: a late arrival.
    Repeat {
        rank: (u64, u32),
    },
    /// The rank's blocks were re-read: its resync flag goes.
    Resynced {
        rank: (u64, u32),
    },
}

/// The index's books as its documentation states them, kept beside it. Per rank, event ids
/// follow one another: a jump ahead is a gap (the ids between are missing) and flags the rank
/// for resynchronisation, as an unknown parent or a store that does not fit does; an id not
/// above the last is a late arrival, applied all the same; a Cleared event or
/// `mark_resynced` lowers the flag; a rank that leaves with its worker forgets its stream.
/// Every rejection is counted by kind, `unknown_blocks` by block.
#[derive(Default)]
struct Books {
    ranks: HashMap<WorkerRank, RankBook>,
    events: EventCounts,
    errors: ErrorCounts,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct RankBook {
    last: Option<u64>,
    gaps: u64,
    resync: bool,
}

impl Books {
    fn event(&mut self, h: EventHeader) {
        self.events.events += 1;
        let book = self.ranks.entry(h.source).or_default();
        let id = h.event_id.0;
        match book.last {
            Some(last) if id == last + 1 => book.last = Some(id),
            Some(last) if id > last => {
                self.events.gaps += 1;
                self.events.missing += id - last - 1;
                book.gaps += 1;
                book.resync = true;
                book.last = Some(id);
            }
            Some(_) => self.events.reordered += 1,
            None => book.last = Some(id),
        }
    }

    fn outcome(&mut self, h: EventHeader, result: &Result<(), IndexError>) {
        let Err(e) = result else {
            return;
        };
        match e {
            IndexError::UnknownParent { placed, .. } => {
                self.errors.unknown_parent += 1;
                self.events.placed_under_peer += u64::from(*placed);
                self.ranks.entry(h.source).or_default().resync = true;
            }
            IndexError::Full { .. } => {
                self.errors.full += 1;
                self.ranks.entry(h.source).or_default().resync = true;
            }
            IndexError::OverCapacity { .. } => {
                self.errors.over_capacity += 1;
                self.ranks.entry(h.source).or_default().resync = true;
            }
            IndexError::UnknownBlocks { count, .. } => self.errors.unknown_blocks += *count as u64,
            IndexError::InvalidChain { .. } => self.errors.invalid_chain += 1,
            IndexError::UnknownRank { .. } => self.errors.unknown_rank += 1,
            IndexError::UnknownWorker { .. } => self.errors.unknown_worker += 1,
            IndexError::TooManyRanks { .. } => self.errors.too_many_ranks += 1,
        }
    }

    fn check(&self, index: &PrefixIndex, step: usize, op: &Op) {
        let stats = index.stats();
        assert_eq!(
            stats.errors, self.errors,
            "step {step}: error counts after {op:?}"
        );
        assert_eq!(
            stats.events, self.events,
            "step {step}: event counts after {op:?}"
        );
        let mut got: Vec<(WorkerRank, RankBook)> = index
            .rank_status()
            .into_iter()
            .map(|s| {
                let book = RankBook {
                    last: s.last_event.map(|e| e.0),
                    gaps: s.gaps,
                    resync: s.needs_resync,
                };
                (s.rank, book)
            })
            .collect();
        got.sort_by_key(|(r, _)| *r);
        let mut want: Vec<(WorkerRank, RankBook)> =
            self.ranks.iter().map(|(r, b)| (*r, *b)).collect();
        want.sort_by_key(|(r, _)| *r);
        assert_eq!(got, want, "step {step}: rank status after {op:?}");
        let flagged: Vec<WorkerRank> = want
            .iter()
            .filter(|(_, b)| b.resync)
            .map(|(r, _)| *r)
            .collect();
        let mut needing = index.ranks_needing_resync();
        needing.sort();
        assert_eq!(
            needing, flagged,
            "step {step}: ranks needing resync after {op:?}"
        );
    }
}

/// An early-exit answer against the full one: the same ranks; every rank but one scored in
/// full; that one, if any, short of its full score only where no other rank was still
/// holding every block (its score at least every other's).
fn check_early_exit(early: &[RankScore], full: &[RankScore], step: usize) {
    assert_eq!(
        early.len(),
        full.len(),
        "step {step}: early exit changed the ranks"
    );
    let short: Vec<(&RankScore, &RankScore)> =
        early.iter().zip(full).filter(|(e, f)| e != f).collect();
    assert!(
        short.len() <= 1,
        "step {step}: early exit cut {} ranks short",
        short.len()
    );
    if let Some((e, f)) = short.first() {
        assert_eq!(e.rank, f.rank, "step {step}: early exit changed the ranks");
        assert!(
            e.blocks < f.blocks,
            "step {step}: early exit over-reported {e:?}"
        );
        let others = full
            .iter()
            .filter(|o| o.rank != f.rank)
            .map(|o| o.blocks)
            .max();
        assert!(
            e.blocks >= others.unwrap_or(1),
            "step {step}: early exit stopped {e:?} while another rank held {others:?}"
        );
    }
}

fn tier(t: u8) -> StorageTier {
    StorageTier::ALL[(t % 3) as usize]
}

/// Prompts that share prefixes: each extends a prefix of an earlier one with a random tail.
fn prompts() -> impl Strategy<Value = Vec<Vec<LocalHash>>> {
    prop::collection::vec(
        (
            0usize..8,
            0usize..160,
            prop::collection::vec(0u64..4, 1..160),
        ),
        2..8,
    )
    .prop_map(|specs| {
        let mut out: Vec<Vec<LocalHash>> = Vec::new();
        for (base, cut, tail) in specs {
            let mut p = match out.get(base % out.len().max(1)) {
                Some(b) => b[..cut.min(b.len())].to_vec(),
                None => Vec::new(),
            };
            p.extend(tail.into_iter().map(LocalHash));
            out.push(p);
        }
        out
    })
}

fn op() -> impl Strategy<Value = Op> {
    let rank = (0..WORKERS, 0..RANKS);
    prop_oneof![
        // Half of the stores start at a prompt's first block, so that long chains (more than
        // one run of 64 blocks) and holes in them are common; the rest start anywhere and
        // mostly continue a chain or name an unknown parent.
        6 => (rank.clone(), any::<u8>(), any::<usize>(), prop_oneof![Just(0usize), any::<usize>()], 1usize..200).prop_map(
            |(rank, tier, prompt, from, len)| Op::Store { rank, tier, prompt, from, len }
        ),
        3 => (rank.clone(), any::<u8>(), any::<usize>(), prop::collection::vec(any::<usize>(), 1..20))
            .prop_map(|(rank, tier, prompt, positions)| Op::Remove { rank, tier, prompt, positions }),
        1 => (rank.clone(), any::<u64>()).prop_map(|(rank, name)| Op::RemoveBogus { rank, name }),
        1 => (rank.clone(), any::<usize>(), any::<usize>())
            .prop_map(|(rank, prompt, at)| Op::SelfParent { rank, prompt, at }),
        1 => rank.clone().prop_map(|rank| Op::Clear { rank }),
        1 => (0..WORKERS + 1).prop_map(|worker| Op::RemoveWorker { worker }),
        1 => (rank.clone(), 0u64..2_000).prop_map(|(rank, blocks)| Op::Reserve { rank, blocks }),
        6 => (any::<usize>(), any::<usize>()).prop_map(|(prompt, len)| Op::Query { prompt, len }),
        1 => (rank.clone(), 1u64..4).prop_map(|(rank, by)| Op::Skip { rank, by }),
        1 => rank.clone().prop_map(|rank| Op::Repeat { rank }),
        1 => rank.clone().prop_map(|rank| Op::Resynced { rank }),
    ]
}

/// A rank's name for the block at the end of `prefix`: the chained hash of the prefix, salted
/// for some ranks so that ranks name the same block differently: for ranks of odd workers
/// in both halves, for ranks of workers 2, 6, 10... in the low half only.
fn name(rank: WorkerRank, prefix: &[LocalHash]) -> BlockHash {
    let mut h = SeqHash(0);
    for (i, l) in prefix.iter().enumerate() {
        h = if i == 0 {
            SeqHash(l.0)
        } else {
            next_seq_hash(h, *l)
        };
    }
    let salt = match rank.worker.0 % 4 {
        1 | 3 => 0x5bd1_e995 * (rank.worker.0 * 8 + rank.dp_rank.0 as u64 + 1),
        2 => (0x9e37_79b9 * (rank.dp_rank.0 as u64 + 1)) & 0xFFFF_FFFF,
        _ => 0,
    };
    BlockHash(h.0 ^ salt)
}

fn run(shards: usize, prompts: &[Vec<LocalHash>], ops: &[Op]) {
    let mut index = PrefixIndex::new(IndexConfig {
        shards,
        ..IndexConfig::default()
    });
    let reader = index.reader();
    // One table reused across every query, as a router thread keeps it.
    let mut depths = kvroute_core::RankDepths::default();
    let mut reused = kvroute_core::OverlapScores::default();
    let mut model = ReferenceIndex::new();
    let mut books = Books::default();
    // Per rank, the id its next event carries.
    let mut next_id: HashMap<WorkerRank, u64> = HashMap::new();
    let rank_of = |rank: (u64, u32)| WorkerRank::new(rank.0, rank.1);
    for (step, op) in ops.iter().enumerate() {
        // Each op makes at most one event; its header, noted in the books.
        let mut header = |rank: (u64, u32), t: u8| {
            let r = rank_of(rank);
            let id = next_id.entry(r).or_insert(1);
            let h = EventHeader {
                source: r,
                event_id: EventId(*id),
                tier: tier(t),
            };
            *id += 1;
            books.event(h);
            h
        };
        match op {
            Op::Store {
                rank,
                tier,
                prompt,
                from,
                len,
            } => {
                let p = &prompts[prompt % prompts.len()];
                let from = from % p.len();
                let end = (from + len).min(p.len());
                let h = header(*rank, *tier);
                let parent = (from > 0).then(|| name(h.source, &p[..from]));
                let blocks: Vec<StoredBlock> = (from..end)
                    .map(|i| StoredBlock {
                        block_hash: name(h.source, &p[..=i]),
                        local_hash: p[i],
                    })
                    .collect();
                let a = index.apply_stored(h, parent, &blocks);
                let b = model.apply_stored(h, parent, &blocks);
                assert_eq!(a, b, "step {step}: {op:?}");
                books.outcome(h, &b);
            }
            Op::Remove {
                rank,
                tier,
                prompt,
                positions,
            } => {
                let p = &prompts[prompt % prompts.len()];
                let h = header(*rank, *tier);
                let names: Vec<BlockHash> = positions
                    .iter()
                    .map(|i| name(h.source, &p[..=(i % p.len())]))
                    .collect();
                let a = index.apply_removed(h, &names);
                let b = model.apply_removed(h, &names);
                assert_eq!(a, b, "step {step}: {op:?}");
                books.outcome(h, &b);
            }
            Op::RemoveBogus { rank, name } => {
                let h = header(*rank, 0);
                let a = index.apply_removed(h, &[BlockHash(*name)]);
                let b = model.apply_removed(h, &[BlockHash(*name)]);
                assert_eq!(a, b, "step {step}: {op:?}");
                books.outcome(h, &b);
            }
            Op::SelfParent { rank, prompt, at } => {
                let p = &prompts[prompt % prompts.len()];
                let at = at % p.len();
                let h = header(*rank, 0);
                let block = StoredBlock {
                    block_hash: name(h.source, &p[..=at]),
                    local_hash: p[at],
                };
                let a = index.apply_stored(h, Some(block.block_hash), &[block]);
                let b = model.apply_stored(h, Some(block.block_hash), &[block]);
                assert!(
                    a.is_err(),
                    "step {step}: a block that is its own parent was accepted"
                );
                assert_eq!(a, b, "step {step}: {op:?}");
                books.outcome(h, &b);
            }
            Op::Clear { rank } => {
                let h = header(*rank, 0);
                index
                    .apply_cleared(h)
                    .expect("clear never fails for a known rank");
                model.apply_cleared(h);
                books.ranks.entry(h.source).or_default().resync = false;
            }
            Op::RemoveWorker { worker } => {
                let a = index.remove_worker(WorkerId(*worker));
                let b = model.remove_worker(WorkerId(*worker));
                assert_eq!(a, b, "step {step}: {op:?}");
                if let Err(IndexError::UnknownWorker { .. }) = b {
                    books.errors.unknown_worker += 1;
                }
                books.ranks.retain(|r, _| r.worker != WorkerId(*worker));
            }
            Op::Reserve { rank, blocks } => {
                let r = rank_of(*rank);
                index
                    .reserve_blocks(r, *blocks)
                    .expect("the rank limit is far");
                model.register_rank(r);
                books.ranks.entry(r).or_default();
            }
            Op::Skip { rank, by } => {
                *next_id.entry(rank_of(*rank)).or_insert(1) += by;
            }
            Op::Repeat { rank } => {
                let id = next_id.entry(rank_of(*rank)).or_insert(1);
                *id = id.saturating_sub(1).max(1);
            }
            Op::Resynced { rank } => {
                let r = rank_of(*rank);
                index.mark_resynced(r);
                if let Some(book) = books.ranks.get_mut(&r) {
                    book.resync = false;
                }
            }
            Op::Query { prompt, len } => {
                let p = &prompts[prompt % prompts.len()];
                let q = &p[..=(len % p.len())];
                let mut got = scores_of(&reader, q, MatchOptions::default()).scores;
                got.sort();
                let want = model.find_matches(q);
                assert_eq!(got, want, "step {step}: query of {} blocks", q.len());
                // The same through one result reused across all queries, which keeps the
                // scoring of recent first runs.
                reader.find_matches_into(q, MatchOptions::default(), &mut reused);
                let mut again = reused.scores.clone();
                again.sort();
                assert_eq!(
                    again,
                    want,
                    "step {step}: reused, query of {} blocks",
                    q.len()
                );
                reader.find_depths_into(q, MatchOptions::default(), &mut depths);
                let mut dense = depths.to_scores(&reader);
                dense.sort();
                assert_eq!(
                    dense,
                    want,
                    "step {step}: by id, query of {} blocks",
                    q.len()
                );
                let mut early = scores_of(&reader, q, MatchOptions { early_exit: true }).scores;
                early.sort();
                check_early_exit(&early, &want, step);
            }
        }
        books.check(&index, step, op);
        assert_eq!(
            index.stats().stored_pairs,
            model.stored_pairs(),
            "step {step}: pair count after {op:?}"
        );
        if let Err(e) = index.check_links() {
            panic!("step {step}: after {op:?}: {e}");
        }
    }
    // Every prompt, every length, at the end.
    for p in prompts {
        for len in [1, p.len() / 2 + 1, p.len()] {
            let mut got = scores_of(&reader, &p[..len], MatchOptions::default()).scores;
            got.sort();
            assert_eq!(got, model.find_matches(&p[..len]), "final query");
            reader.find_depths_into(&p[..len], MatchOptions::default(), &mut depths);
            let mut dense = depths.to_scores(&reader);
            dense.sort();
            assert_eq!(dense, got, "final query by id");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn index_equals_reference_one_shard(prompts in prompts(), ops in prop::collection::vec(op(), 1..160)) {
        run(1, &prompts, &ops);
    }

    #[test]
    fn index_equals_reference_three_shards(prompts in prompts(), ops in prop::collection::vec(op(), 1..160)) {
        run(3, &prompts, &ops);
    }
}
