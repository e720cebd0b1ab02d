//! The prefix index against its literal reference model, driven by the fuzzer.
//!
//! The input decodes into a few prompts (each continues a cut of an earlier one, so prompts
//! share prefixes and branch) and a bounded sequence of operations on them: stores of any
//! stretch of a prompt, continuations of what a rank stored last, splices that continue one
//! prompt with blocks of another, removals (of leaves, of any blocks, of names nobody uses),
//! self-parent and repeated-block stores, clears, worker removals and queries. Every operation
//! goes to the reference and to two indexes, of one shard and of three; their results, errors
//! and pair counts must agree after each one. Early-exit matches must score the same ranks,
//! all but at most one exactly. At the end, with every worker removed, the indexes must be
//! empty.
//!
//! A rank names a block by a fixed function of (rank, prefix), as an engine does: the
//! reference identifies a block by its whole prefix, and agrees with the index on what a name
//! means only when a name never moves from one prefix to another. Arbitrary names are the
//! other target's business (`index_arbitrary_events`).

#![no_main]
#![deny(unsafe_code)]

#[path = "common/mod.rs"]
mod common;

use std::collections::HashMap;

use arbitrary::{Arbitrary, Unstructured};
use kvroute_core::testing::scores_of;
use kvroute_core::seq_hashes;
use kvroute_core::testing::ReferenceIndex;
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, IndexError, LocalHash, MatchOptions, PrefixIndex,
    StoredBlock, WorkerId, WorkerRank,
};
use libfuzzer_sys::fuzz_target;

const WORKERS: u8 = 3;
const DP_RANKS: u8 = 2;
const MAX_PROMPTS: usize = 6;
const MAX_PROMPT_LEN: usize = 160;
const MAX_OPS: usize = 192;
const MAX_REMOVALS: usize = 32;
const MAX_QUERY_TAIL: usize = 8;

/// The local hashes a written-out prompt block picks from: few, so that prompts collide and
/// branch often, plus the extremes of the hash space.
const SYMBOLS: [u64; 6] = [0, 1, 2, 3, u64::MAX, 1 << 63];

#[derive(Arbitrary, Debug)]
struct PromptSpec {
    /// The earlier prompt this one continues, and after how many of its blocks.
    base: u8,
    cut: u16,
    /// Blocks written out, one symbol each.
    tail: Vec<u8>,
    /// Then this many blocks of hashes no other prompt uses, so that a prompt outgrows a run
    /// (64 blocks) from a few input bytes.
    fresh: u8,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
struct RankSel {
    worker: u8,
    dp: u8,
}

impl RankSel {
    fn rank(self) -> WorkerRank {
        WorkerRank::new(
            u64::from(self.worker % WORKERS),
            u32::from(self.dp % DP_RANKS),
        )
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// Blocks `from..from + len` of a prompt, continuing the block before `from`.
    Store {
        rank: RankSel,
        tier: u8,
        prompt: u8,
        from: u16,
        len: u16,
    },
    /// Blocks `from..from + len` of prompt `other`, continuing `prompt[..at]`.
    Splice {
        rank: RankSel,
        tier: u8,
        prompt: u8,
        at: u16,
        other: u8,
        from: u16,
        len: u16,
    },
    /// The next `len` blocks of a prompt after those the rank stored of it last (its cursor),
    /// as an engine does while a request runs: valid unless the rank lost the blocks since.
    Continue {
        rank: RankSel,
        tier: u8,
        prompt: u8,
        len: u8,
    },
    /// The last `count` blocks before the rank's cursor on a prompt, which moves back: the
    /// leaves, as an engine's LRU evicts them.
    RemoveTail {
        rank: RankSel,
        tier: u8,
        prompt: u8,
        count: u8,
    },
    /// The blocks at `positions` of a prompt.
    Remove {
        rank: RankSel,
        tier: u8,
        prompt: u8,
        positions: Vec<u16>,
    },
    /// A name no rank uses (most likely).
    RemoveBogus {
        rank: RankSel,
        tier: u8,
        name: u64,
    },
    /// A block stored as its own parent.
    SelfParent {
        rank: RankSel,
        tier: u8,
        prompt: u8,
        at: u16,
    },
    /// A block stored twice in a row in one event.
    Repeat {
        rank: RankSel,
        tier: u8,
        prompt: u8,
        at: u16,
    },
    Clear {
        rank: RankSel,
        tier: u8,
    },
    /// One more worker than exist, so that unknown workers are tried too.
    RemoveWorker {
        worker: u8,
    },
    /// A prefix of a prompt, then a few written-out blocks.
    Query {
        prompt: u8,
        len: u16,
        tail: Vec<u8>,
    },
}

#[derive(Debug)]
struct Script {
    prompts: Vec<PromptSpec>,
    ops: Vec<Op>,
}

impl<'a> Arbitrary<'a> for Script {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let prompts = u.arbitrary()?;
        let ops = common::ops_until_empty(u, MAX_OPS)?;
        Ok(Script { prompts, ops })
    }
}

use common::tier;

fn symbol(b: u8) -> LocalHash {
    LocalHash(SYMBOLS[usize::from(b) % SYMBOLS.len()])
}

fn build_prompts(specs: &[PromptSpec]) -> Vec<Vec<LocalHash>> {
    let mut out: Vec<Vec<LocalHash>> = Vec::new();
    for (k, spec) in specs.iter().take(MAX_PROMPTS).enumerate() {
        let mut p = match out.len() {
            0 => Vec::new(),
            n => {
                let b = &out[usize::from(spec.base) % n];
                b[..usize::from(spec.cut).min(b.len())].to_vec()
            }
        };
        p.extend(spec.tail.iter().map(|&b| symbol(b)));
        let fresh = (0..u64::from(spec.fresh)).map(|i| LocalHash(0x1_0000 * (k as u64 + 1) + i));
        p.extend(fresh);
        p.truncate(MAX_PROMPT_LEN);
        if p.is_empty() {
            p.push(symbol(spec.base));
        }
        out.push(p);
    }
    if out.is_empty() {
        out.push(vec![LocalHash(0)]);
    }
    out
}

/// A rank's names for the blocks of `prefix`: the chained hash of each leading prefix, salted
/// per rank except on worker 0, whose ranks all name a block alike.
fn names(rank: WorkerRank, prefix: &[LocalHash]) -> Vec<BlockHash> {
    let salt = match rank.worker.0 {
        0 => 0,
        w => 0x9E37_79B9_7F4A_7C15_u64.wrapping_mul(w * 8 + u64::from(rank.dp_rank.0) + 1),
    };
    seq_hashes(prefix)
        .into_iter()
        .map(|s| BlockHash(s.0 ^ salt))
        .collect()
}

/// The event that stores `blocks` after `before` (a prefix the rank is meant to hold).
fn stored(
    rank: WorkerRank,
    before: &[LocalHash],
    blocks: &[LocalHash],
) -> (Option<BlockHash>, Vec<StoredBlock>) {
    let mut prefix = before.to_vec();
    prefix.extend_from_slice(blocks);
    let named = names(rank, &prefix);
    let parent = before.len().checked_sub(1).map(|i| named[i]);
    let blocks = blocks
        .iter()
        .zip(&named[before.len()..])
        .map(|(&local_hash, &block_hash)| StoredBlock {
            block_hash,
            local_hash,
        })
        .collect();
    (parent, blocks)
}

/// The reference and the indexes under test, one per shard count, driven in lockstep.
struct Lockstep {
    indexes: Vec<PrefixIndex>,
    model: ReferenceIndex,
    next_event: HashMap<WorkerRank, u64>,
    /// Per (rank, prompt), how many leading blocks `Continue` has stored.
    cursor: HashMap<(WorkerRank, usize), usize>,
}

impl Lockstep {
    fn new(shard_counts: &[usize]) -> Self {
        let indexes = shard_counts
            .iter()
            .map(|&shards| {
                PrefixIndex::new(IndexConfig {
                    shards,
                    ..IndexConfig::default()
                })
            })
            .collect();
        Lockstep {
            indexes,
            model: ReferenceIndex::new(),
            next_event: HashMap::new(),
            cursor: HashMap::new(),
        }
    }

    fn header(&mut self, rank: RankSel, t: u8) -> EventHeader {
        let source = rank.rank();
        let id = self.next_event.entry(source).or_insert(0);
        *id += 1;
        EventHeader {
            source,
            event_id: EventId(*id),
            tier: tier(t),
        }
    }

    /// Applies a stored event everywhere; every index must answer as the reference does.
    fn stored(
        &mut self,
        h: EventHeader,
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        let want = self.model.apply_stored(h, parent, blocks);
        for index in &mut self.indexes {
            let got = index.apply_stored(h, parent, blocks);
            assert_eq!(
                got,
                want,
                "stored, {} shards: {h:?} parent {parent:?}, {} blocks",
                index.stats().shards,
                blocks.len()
            );
        }
        want
    }

    fn removed(&mut self, h: EventHeader, gone: &[BlockHash]) {
        let want = self.model.apply_removed(h, gone);
        for index in &mut self.indexes {
            let got = index.apply_removed(h, gone);
            let shards = index.stats().shards;
            assert_eq!(got, want, "removed, {shards} shards: {h:?} {gone:?}");
        }
    }

    fn cleared(&mut self, h: EventHeader) {
        self.model.apply_cleared(h);
        for index in &mut self.indexes {
            assert_eq!(index.apply_cleared(h), Ok(()), "clear of {h:?}");
        }
    }

    fn remove_worker(&mut self, w: WorkerId) {
        let want = self.model.remove_worker(w);
        for index in &mut self.indexes {
            assert_eq!(index.remove_worker(w), want, "remove worker {w:?}");
        }
    }

    fn query(&self, q: &[LocalHash]) {
        let want = self.model.find_matches(q);
        for index in &self.indexes {
            let shards = index.stats().shards;
            let reader = index.reader();
            let mut got = scores_of(&reader, q, MatchOptions::default()).scores;
            got.sort();
            assert_eq!(got, want, "query of {} blocks, {shards} shards", q.len());
            // With early exit, every rank still scores; all but at most one exactly, and that
            // one at most its exact score.
            let mut early = scores_of(&reader, q, MatchOptions { early_exit: true })
                .scores;
            early.sort();
            assert_eq!(early.len(), want.len(), "early exit lost or added a rank");
            let mut short = 0;
            for (e, w) in early.iter().zip(&want) {
                assert_eq!(e.rank, w.rank, "early exit scored other ranks");
                assert!(
                    e.blocks <= w.blocks,
                    "early exit scored above the exact score"
                );
                short += usize::from(e != w);
            }
            assert!(short <= 1, "early exit cut {short} scores short");
        }
    }

    fn check_pairs(&self, op: &Op) {
        let want = self.model.stored_pairs();
        for index in &self.indexes {
            let s = index.stats();
            assert_eq!(
                s.stored_pairs, want,
                "pairs after {op:?}, {} shards",
                s.shards
            );
        }
    }
}

fn run(shard_counts: &[usize], prompts: &[Vec<LocalHash>], ops: &[Op]) {
    let mut ls = Lockstep::new(shard_counts);
    let which = |i: u8| usize::from(i) % prompts.len();
    let prompt = |i: u8| &prompts[which(i)];
    for op in ops {
        match *op {
            Op::Store {
                rank,
                tier,
                prompt: pi,
                from,
                len,
            } => {
                let p = prompt(pi);
                let from = usize::from(from) % p.len();
                let end = (from + usize::from(len)).min(p.len());
                let h = ls.header(rank, tier);
                let (parent, blocks) = stored(h.source, &p[..from], &p[from..end]);
                let _ = ls.stored(h, parent, &blocks);
            }
            Op::Continue {
                rank,
                tier,
                prompt: pi,
                len,
            } => {
                let p = prompt(pi);
                let h = ls.header(rank, tier);
                let key = (h.source, which(pi));
                let from = ls.cursor.get(&key).copied().unwrap_or(0) % p.len();
                let end = (from + usize::from(len)).min(p.len());
                let (parent, blocks) = stored(h.source, &p[..from], &p[from..end]);
                let ok = ls.stored(h, parent, &blocks).is_ok();
                ls.cursor.insert(key, if ok { end } else { 0 });
            }
            Op::RemoveTail {
                rank,
                tier,
                prompt: pi,
                count,
            } => {
                let p = prompt(pi);
                let h = ls.header(rank, tier);
                let key = (h.source, which(pi));
                let end = ls.cursor.get(&key).copied().unwrap_or(0).min(p.len());
                let start = end.saturating_sub(usize::from(count));
                let named = names(h.source, &p[..end]);
                let gone: Vec<BlockHash> = named[start..].iter().rev().copied().collect();
                ls.removed(h, &gone);
                ls.cursor.insert(key, start);
            }
            Op::Splice {
                rank,
                tier,
                prompt: pi,
                at,
                other,
                from,
                len,
            } => {
                let p = prompt(pi);
                let o = prompt(other);
                let at = usize::from(at) % (p.len() + 1);
                let from = usize::from(from) % o.len();
                let end = (from + usize::from(len)).min(o.len());
                let h = ls.header(rank, tier);
                let (parent, blocks) = stored(h.source, &p[..at], &o[from..end]);
                let _ = ls.stored(h, parent, &blocks);
            }
            Op::Remove {
                rank,
                tier,
                prompt: pi,
                ref positions,
            } => {
                let p = prompt(pi);
                let h = ls.header(rank, tier);
                let named = names(h.source, p);
                let gone: Vec<BlockHash> = positions
                    .iter()
                    .take(MAX_REMOVALS)
                    .map(|&i| named[usize::from(i) % p.len()])
                    .collect();
                ls.removed(h, &gone);
            }
            Op::RemoveBogus { rank, tier, name } => {
                let h = ls.header(rank, tier);
                ls.removed(h, &[BlockHash(name)]);
            }
            Op::SelfParent {
                rank,
                tier,
                prompt: pi,
                at,
            } => {
                let p = prompt(pi);
                let at = usize::from(at) % p.len();
                let h = ls.header(rank, tier);
                let (_, blocks) = stored(h.source, &p[..at], &p[at..=at]);
                let got = ls.stored(h, Some(blocks[0].block_hash), &blocks);
                assert!(got.is_err(), "a block that is its own parent was accepted");
            }
            Op::Repeat {
                rank,
                tier,
                prompt: pi,
                at,
            } => {
                let p = prompt(pi);
                let at = usize::from(at) % p.len();
                let h = ls.header(rank, tier);
                let (parent, mut blocks) = stored(h.source, &p[..at], &p[at..=at]);
                blocks.push(blocks[0]);
                let got = ls.stored(h, parent, &blocks);
                assert!(got.is_err(), "a block stored twice in a row was accepted");
            }
            Op::Clear { rank, tier } => {
                let h = ls.header(rank, tier);
                ls.cleared(h);
            }
            Op::RemoveWorker { worker } => {
                ls.remove_worker(WorkerId(u64::from(worker % (WORKERS + 1))));
            }
            Op::Query {
                prompt: pi,
                len,
                ref tail,
            } => {
                let p = prompt(pi);
                let mut q = p[..=usize::from(len) % p.len()].to_vec();
                q.extend(tail.iter().take(MAX_QUERY_TAIL).map(|&b| symbol(b)));
                ls.query(&q);
            }
        }
        ls.check_pairs(op);
    }
    for p in prompts {
        for len in [1, p.len() / 2 + 1, p.len()] {
            ls.query(&p[..len]);
        }
    }
    // With every worker gone, nothing may be left behind.
    for w in 0..WORKERS {
        for index in &mut ls.indexes {
            let _ = index.remove_worker(WorkerId(u64::from(w)));
        }
    }
    for index in &ls.indexes {
        let s = index.stats();
        assert_eq!(
            (
                s.ranks,
                s.stored_pairs,
                s.duplicate_copies,
                s.blocks,
                s.runs,
                s.names
            ),
            (0, 0, 0, 0, 0, 0),
            "left behind after every worker was removed: {s:?}"
        );
        for p in prompts {
            assert!(scores_of(&index.reader(), p, MatchOptions::default())
                .scores
                .is_empty());
        }
    }
}

fuzz_target!(|script: Script| {
    let prompts = build_prompts(&script.prompts);
    run(&[1, 3], &prompts, &script.ops);
});
