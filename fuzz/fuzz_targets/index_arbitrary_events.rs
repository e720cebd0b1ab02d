//! The prefix index fed events no engine would send: arbitrary names, parents, tiers, ranks and
//! event ids, with or without auto-registration, a small rank limit and a small memory budget.
//!
//! There is no model of what such names mean, so this target checks what must hold whatever
//! the events are:
//!
//! - nothing panics;
//! - a match of an empty query is empty; every score is of a live rank, at least one block and
//!   at most the query's length, and its per-tier counts add up to its blocks; a prefix of a
//!   query scores `min(score, prefix length)` for the same ranks; early exit scores the same
//!   ranks, all but at most one exactly and that one at most exactly;
//! - every rejection is the one the rules give (unknown rank, too many ranks, a chain naming
//!   its parent or a block twice in a row) or one the caller cannot predict (unknown parent,
//!   unknown blocks) reported consistently, changes nothing it should not, and is counted;
//! - holds move by exactly the blocks an event names: a stored event adds one hold or copy per
//!   block (fewer only when the budget evicts), a removal takes one per block it does not
//!   report unknown;
//! - event ids: events, gaps, missing ids, reorders, each rank's last id and its resync flag
//!   follow the rules `EventCounts` and `RankStatus` document;
//! - after a store of blocks the index is within its budget, or has nothing left to evict;
//! - before every query, the child table names each run's current array, and every run with
//!   a child has a hint (`PrefixIndex::check_links`);
//! - with every worker removed, the index is empty.

#![no_main]
#![deny(unsafe_code)]

#[path = "common/mod.rs"]
mod common;

use std::collections::{BTreeMap, HashMap};

use arbitrary::{Arbitrary, Unstructured};
use kvroute_core::testing::scores_of;
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, IndexError, IndexStats, LocalHash, MatchOptions,
    OverlapScores, PrefixIndex, StoredBlock, WorkerId, WorkerRank,
};
use libfuzzer_sys::fuzz_target;

const WORKERS: u8 = 4;
const DP_RANKS: u8 = 3;
const MAX_OPS: usize = 160;
const MAX_BLOCKS: usize = 256;
const MAX_QUERY: usize = 320;
/// Names a rank's recent stored events used, kept to pick parents and removals from.
const RECENT_NAMES: usize = 512;
/// Chains of local hashes kept to build queries that hit stored blocks.
const MAX_CHAINS: usize = 256;
const MAX_CHAIN_LEN: usize = 1024;

#[derive(Arbitrary, Debug)]
struct Setup {
    /// 1 to 4 shards.
    shards: u8,
    /// A budget of this many 256-byte units above what the empty index takes: 0 to 64 KB of
    /// blocks, so that stores evict often.
    budget: Option<u8>,
    auto_register: bool,
    /// At most 8 ranks (0 rejects every rank).
    max_ranks: u8,
}

/// A block name or local hash: from a small set, so that they collide, or any value.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Word {
    Small(u8),
    Any(u64),
}

impl Word {
    fn name(self) -> BlockHash {
        match self {
            Word::Small(b) => BlockHash(u64::from(b % 16)),
            Word::Any(x) => BlockHash(x),
        }
    }

    fn local(self) -> LocalHash {
        match self {
            Word::Small(b) => LocalHash(u64::from(b % 4)),
            Word::Any(x) => LocalHash(x),
        }
    }
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

/// The event id relative to the last one sent to the rank.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum IdSel {
    Next,
    Same,
    Skip(u8),
    Back(u8),
    Any(u64),
}

/// A stored event's blocks: written out, then `fresh.1` blocks named by a running counter with
/// local hashes counting up from `fresh.0` (long chains from a few input bytes).
#[derive(Arbitrary, Debug)]
struct Blocks {
    listed: Vec<(Word, Word)>,
    fresh: Option<(u8, u8)>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Stored {
        rank: RankSel,
        id: IdSel,
        tier: u8,
        parent: Option<Word>,
        blocks: Blocks,
    },
    /// A stored event whose parent is a name the rank stored recently.
    Extend {
        rank: RankSel,
        id: IdSel,
        tier: u8,
        parent: u16,
        blocks: Blocks,
    },
    Removed {
        rank: RankSel,
        id: IdSel,
        tier: u8,
        blocks: Vec<Word>,
    },
    /// A removal of names the rank stored recently.
    RemoveStored {
        rank: RankSel,
        id: IdSel,
        tier: u8,
        picks: Vec<u16>,
    },
    Cleared {
        rank: RankSel,
        id: IdSel,
        tier: u8,
    },
    RemoveWorker {
        worker: u8,
    },
    Register {
        rank: RankSel,
    },
    MarkResynced {
        rank: RankSel,
    },
    Query {
        early_exit: bool,
        blocks: Vec<Word>,
    },
    /// A prefix of a chain stored earlier, then a few more blocks.
    QueryStored {
        early_exit: bool,
        chain: u16,
        len: u16,
        tail: Vec<Word>,
    },
}

#[derive(Debug)]
struct Script {
    setup: Setup,
    ops: Vec<Op>,
}

impl<'a> Arbitrary<'a> for Script {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let setup = u.arbitrary()?;
        let ops = common::ops_until_empty(u, MAX_OPS)?;
        Ok(Script { setup, ops })
    }
}

use common::tier;

/// What the caller can know of one rank's event stream.
#[derive(Debug, Default)]
struct RankShadow {
    last_event: Option<u64>,
    needs_resync: bool,
}

/// Everything the checks derive from the events alone.
#[derive(Debug, Default)]
struct Shadow {
    auto_register: bool,
    max_ranks: usize,
    budget: Option<usize>,
    live: BTreeMap<WorkerRank, RankShadow>,
    events: u64,
    gaps: u64,
    /// Wide, so that ids jumping by nearly 2^64 add up exactly; checked while it fits a u64.
    missing: u128,
    reordered: u64,
    unknown_parent: u64,
    placed_under_peer: u64,
    unknown_blocks: u64,
    invalid_chain: u64,
    unknown_rank: u64,
    unknown_worker: u64,
    too_many_ranks: u64,
    /// The last event id sent per rank, to make the next one from.
    sent: HashMap<WorkerRank, u64>,
    /// Per rank, names it stored recently.
    names: HashMap<WorkerRank, Vec<BlockHash>>,
    /// Chains of local hashes stored, and where each (rank, name) was last stored in them.
    chains: Vec<Vec<LocalHash>>,
    placed: HashMap<(WorkerRank, BlockHash), (usize, usize)>,
    fresh_names: u64,
}

impl Shadow {
    fn event_id(&mut self, rank: WorkerRank, sel: IdSel) -> EventId {
        let last = self.sent.get(&rank).copied().unwrap_or(0);
        let id = match sel {
            IdSel::Next => last.wrapping_add(1),
            IdSel::Same => last,
            IdSel::Skip(n) => last.wrapping_add(2 + u64::from(n)),
            IdSel::Back(n) => last.wrapping_sub(1 + u64::from(n)),
            IdSel::Any(x) => x,
        };
        self.sent.insert(rank, id);
        EventId(id)
    }

    fn header(&mut self, rank: RankSel, id: IdSel, t: u8) -> EventHeader {
        let source = rank.rank();
        EventHeader {
            source,
            event_id: self.event_id(source, id),
            tier: tier(t),
        }
    }

    fn register(&mut self, rank: WorkerRank) -> Result<(), IndexError> {
        if self.live.contains_key(&rank) {
            return Ok(());
        }
        if self.live.len() >= self.max_ranks {
            self.too_many_ranks += 1;
            return Err(IndexError::TooManyRanks {
                rank,
                limit: self.max_ranks,
            });
        }
        self.live.insert(rank, RankShadow::default());
        Ok(())
    }

    /// The rank bookkeeping of one event: the rejection it must get, if any.
    fn admit(&mut self, h: EventHeader) -> Result<(), IndexError> {
        self.events += 1;
        if !self.live.contains_key(&h.source) {
            if !self.auto_register {
                self.unknown_rank += 1;
                return Err(IndexError::UnknownRank { rank: h.source });
            }
            self.register(h.source)?;
        }
        let state = self.live.get_mut(&h.source).expect("admitted above");
        let id = h.event_id.0;
        match state.last_event {
            Some(last) if id == last.wrapping_add(1) => {}
            Some(last) if id > last => {
                self.gaps += 1;
                self.missing += u128::from(id - last - 1);
                state.needs_resync = true;
            }
            Some(_) => {
                self.reordered += 1;
                return Ok(());
            }
            None => {}
        }
        state.last_event = Some(id);
        Ok(())
    }

    fn blocks(&mut self, b: &Blocks) -> Vec<StoredBlock> {
        let mut out: Vec<StoredBlock> = b
            .listed
            .iter()
            .map(|&(name, local)| StoredBlock {
                block_hash: name.name(),
                local_hash: local.local(),
            })
            .collect();
        if let Some((seed, n)) = b.fresh {
            for i in 0..u64::from(n) {
                self.fresh_names += 1;
                out.push(StoredBlock {
                    block_hash: BlockHash(0x4000_0000_0000_0000 | self.fresh_names),
                    local_hash: LocalHash(u64::from(seed) + i),
                });
            }
        }
        out.truncate(MAX_BLOCKS);
        out
    }

    /// Remembers a stored event's names and chain, to build later events and queries from.
    fn remember(&mut self, rank: WorkerRank, parent: Option<BlockHash>, blocks: &[StoredBlock]) {
        let names = self.names.entry(rank).or_default();
        names.extend(blocks.iter().map(|b| b.block_hash));
        if names.len() > RECENT_NAMES {
            names.drain(..names.len() - RECENT_NAMES);
        }
        if self.chains.len() >= MAX_CHAINS {
            return;
        }
        let mut chain = match parent.and_then(|p| self.placed.get(&(rank, p))) {
            Some(&(c, at)) => self.chains[c][..=at].to_vec(),
            None => Vec::new(),
        };
        let c = self.chains.len();
        for b in blocks {
            if chain.len() >= MAX_CHAIN_LEN {
                break;
            }
            chain.push(b.local_hash);
            self.placed
                .insert((rank, b.block_hash), (c, chain.len() - 1));
        }
        self.chains.push(chain);
    }

    fn recent(&self, rank: WorkerRank, pick: u16) -> Option<BlockHash> {
        let names = self.names.get(&rank)?;
        names.get(usize::from(pick) % names.len().max(1)).copied()
    }
}

/// Holds of blocks, copies included.
fn holds(s: &IndexStats) -> u64 {
    s.stored_pairs + s.duplicate_copies
}

/// (holds, blocks, runs, names): what a rejected event leaves alone.
fn shape(s: &IndexStats) -> (u64, usize, usize, usize) {
    (holds(s), s.blocks, s.runs, s.names)
}

struct Harness {
    index: PrefixIndex,
    shadow: Shadow,
    out: OverlapScores,
    prefix: OverlapScores,
}

impl Harness {
    fn stored(&mut self, h: EventHeader, parent: Option<BlockHash>, blocks: &[StoredBlock]) {
        let before = self.index.stats();
        let got = self.index.apply_stored(h, parent, blocks);
        let after = self.index.stats();
        if let Err(e) = self.shadow.admit(h) {
            assert_eq!(got, Err(e), "stored event of a rank that must be rejected");
            assert_eq!(
                shape(&before),
                shape(&after),
                "a rejected event changed the index"
            );
            return;
        }
        let self_parent = parent.is_some_and(|p| blocks.iter().any(|b| b.block_hash == p));
        let repeated = blocks
            .windows(2)
            .any(|w| w[0].block_hash == w[1].block_hash);
        if self_parent || repeated {
            let Err(IndexError::InvalidChain { rank, block }) = got else {
                panic!("a chain naming its parent or a block twice in a row gave {got:?}");
            };
            assert_eq!(rank, h.source);
            let offends = |i: usize| {
                Some(blocks[i].block_hash) == parent
                    || (i > 0 && blocks[i - 1].block_hash == blocks[i].block_hash)
            };
            assert!(
                (0..blocks.len()).any(|i| blocks[i].block_hash == block && offends(i)),
                "InvalidChain names {block:?}, which is neither the parent nor a repeat"
            );
            self.shadow.invalid_chain += 1;
            assert_eq!(
                shape(&before),
                shape(&after),
                "a rejected chain changed the index"
            );
            return;
        }
        let placed = match got {
            Ok(()) => true,
            Err(IndexError::UnknownParent { rank, parent: p, placed: true }) => {
                assert_eq!((rank, Some(p)), (h.source, parent), "unknown parent reported");
                // Placed under another rank's block of that name: stored all the same.
                self.shadow.unknown_parent += 1;
                self.shadow.placed_under_peer += 1;
                if let Some(state) = self.shadow.live.get_mut(&h.source) {
                    state.needs_resync = true;
                }
                true
            }
            _ => false,
        };
        match got {
            _ if placed => {
                let added = blocks.len() as u64;
                let evicted = after.evicted_pairs - before.evicted_pairs;
                if self.shadow.budget.is_none() {
                    assert_eq!(holds(&after), holds(&before) + added, "holds after a store");
                } else {
                    assert!(
                        holds(&after) + evicted <= holds(&before) + added,
                        "a store added more holds than it had blocks"
                    );
                }
                // The budget is enforced after a store of blocks (an empty one can still
                // grow the index, by registering its rank).
                if let Some(budget) = self.shadow.budget.filter(|_| !blocks.is_empty()) {
                    assert!(
                        after.memory_bytes <= budget || after.blocks == 0,
                        "over budget ({} > {budget}) with {} blocks left",
                        after.memory_bytes,
                        after.blocks
                    );
                }
                self.shadow.remember(h.source, parent, blocks);
            }
            Err(IndexError::UnknownParent {
                rank,
                parent: p,
                placed: false,
            }) => {
                assert_eq!(
                    (rank, Some(p)),
                    (h.source, parent),
                    "unknown parent reported"
                );
                self.shadow.unknown_parent += 1;
                if let Some(state) = self.shadow.live.get_mut(&h.source) {
                    state.needs_resync = true;
                }
                assert_eq!(
                    shape(&before),
                    shape(&after),
                    "a rejected store changed the index"
                );
            }
            other => panic!("stored event rejected with {other:?}"),
        }
    }

    fn removed(&mut self, h: EventHeader, blocks: &[BlockHash]) {
        let before = self.index.stats();
        let got = self.index.apply_removed(h, blocks);
        let after = self.index.stats();
        if let Err(e) = self.shadow.admit(h) {
            assert_eq!(got, Err(e), "removal of a rank that must be rejected");
            assert_eq!(
                shape(&before),
                shape(&after),
                "a rejected event changed the index"
            );
            return;
        }
        let unknown = match got {
            Ok(()) => 0,
            Err(IndexError::UnknownBlocks { rank, count, first }) => {
                assert_eq!(rank, h.source);
                assert!(
                    count > 0 && count <= blocks.len(),
                    "{count} unknown of {}",
                    blocks.len()
                );
                assert!(
                    blocks.contains(&first),
                    "first unknown {first:?} was not named"
                );
                count
            }
            Err(e) => panic!("removal rejected with {e:?}"),
        };
        self.shadow.unknown_blocks += unknown as u64;
        let taken = (blocks.len() - unknown) as u64;
        // Under a budget the removal may also have evicted (and those holds' extra copies).
        let evicted = after.evicted_pairs - before.evicted_pairs;
        if evicted == 0 {
            assert_eq!(
                holds(&after) + taken,
                holds(&before),
                "holds after a removal"
            );
        } else {
            assert!(
                holds(&after) + taken + evicted <= holds(&before),
                "holds after a removal that evicted"
            );
        }
    }

    fn cleared(&mut self, h: EventHeader) {
        let before = self.index.stats();
        let got = self.index.apply_cleared(h);
        let after = self.index.stats();
        let want = self.shadow.admit(h);
        assert_eq!(got, want, "clear");
        if want.is_ok() {
            if let Some(state) = self.shadow.live.get_mut(&h.source) {
                state.needs_resync = false;
            }
        }
        assert!(holds(&after) <= holds(&before), "a clear added holds");
    }

    fn remove_worker(&mut self, worker: WorkerId) {
        let before = self.index.stats();
        let got = self.index.remove_worker(worker);
        let after = self.index.stats();
        let had = self.shadow.live.len();
        self.shadow.live.retain(|r, _| r.worker != worker);
        if self.shadow.live.len() == had {
            self.shadow.unknown_worker += 1;
            assert_eq!(got, Err(IndexError::UnknownWorker { worker }));
        } else {
            assert_eq!(got, Ok(()), "removing live worker {worker:?}");
        }
        assert!(
            holds(&after) <= holds(&before),
            "removing a worker added holds"
        );
    }

    /// Checks one match's scores on their own.
    fn check_scores(&self, query: &[LocalHash], scores: &OverlapScores) {
        if query.is_empty() {
            assert!(scores.scores.is_empty(), "an empty query matched");
        }
        let mut seen = Vec::new();
        for s in &scores.scores {
            assert!(s.blocks >= 1, "a score of no blocks is listed: {s:?}");
            assert!(
                s.blocks as usize <= query.len(),
                "{s:?} beyond a {}-block query",
                query.len()
            );
            assert_eq!(
                s.per_tier.iter().sum::<u32>(),
                s.blocks,
                "tiers do not add up: {s:?}"
            );
            assert!(
                self.shadow.live.contains_key(&s.rank),
                "{s:?} of a rank not live"
            );
            seen.push(s.rank);
        }
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), scores.scores.len(), "a rank scored twice");
    }

    fn query(&mut self, q: &[LocalHash], early_exit: bool) {
        if let Err(e) = self.index.check_links() {
            panic!("links out of step with the runs: {e}");
        }
        let reader = self.index.reader();
        let mut exact = std::mem::take(&mut self.out);
        reader.find_matches_into(q, MatchOptions::default(), &mut exact);
        self.check_scores(q, &exact);
        exact.scores.sort();
        // Prefixes of the query score min(score, length) for the same ranks.
        let mut prefix = std::mem::take(&mut self.prefix);
        let cuts = [1, q.len() / 2, q.len().saturating_sub(1)];
        for k in cuts.into_iter().filter(|&k| k >= 1 && k < q.len()) {
            reader.find_matches_into(&q[..k], MatchOptions::default(), &mut prefix);
            self.check_scores(&q[..k], &prefix);
            prefix.scores.sort();
            assert_eq!(
                prefix.scores.len(),
                exact.scores.len(),
                "a prefix scored other ranks"
            );
            for (p, e) in prefix.scores.iter().zip(&exact.scores) {
                assert_eq!(p.rank, e.rank, "a prefix scored other ranks");
                assert_eq!(
                    p.blocks,
                    e.blocks.min(k as u32),
                    "prefix of {k} blocks: {p:?} vs {e:?}"
                );
                assert!(
                    p.per_tier.iter().zip(&e.per_tier).all(|(a, b)| a <= b),
                    "prefix of {k} blocks has more in a tier: {p:?} vs {e:?}"
                );
            }
        }
        if early_exit {
            reader.find_matches_into(q, MatchOptions { early_exit: true }, &mut prefix);
            self.check_scores(q, &prefix);
            prefix.scores.sort();
            assert_eq!(
                prefix.scores.len(),
                exact.scores.len(),
                "early exit scored other ranks"
            );
            let mut short = 0;
            for (p, e) in prefix.scores.iter().zip(&exact.scores) {
                assert_eq!(p.rank, e.rank, "early exit scored other ranks");
                assert!(
                    p.blocks <= e.blocks,
                    "early exit above exact: {p:?} vs {e:?}"
                );
                short += usize::from(p != e);
            }
            assert!(short <= 1, "early exit cut {short} scores short");
        }
        self.out = exact;
        self.prefix = prefix;
    }

    /// Checks the counters and rank states against the shadow.
    fn check_books(&self) {
        let s = self.index.stats();
        let sh = &self.shadow;
        assert_eq!(s.ranks, sh.live.len(), "live ranks");
        let events = (
            s.events.events,
            s.events.gaps,
            s.events.reordered,
            s.events.placed_under_peer,
        );
        let want = (sh.events, sh.gaps, sh.reordered, sh.placed_under_peer);
        assert_eq!(events, want, "event counts");
        if let Ok(missing) = u64::try_from(sh.missing) {
            assert_eq!(s.events.missing, missing, "missing event ids");
        }
        let e = s.errors;
        assert_eq!(
            [
                e.unknown_parent,
                e.unknown_blocks,
                e.invalid_chain,
                e.unknown_rank,
                e.unknown_worker,
                e.too_many_ranks
            ],
            [
                sh.unknown_parent,
                sh.unknown_blocks,
                sh.invalid_chain,
                sh.unknown_rank,
                sh.unknown_worker,
                sh.too_many_ranks
            ],
            "error counts"
        );
        let mut status = self.index.rank_status();
        status.sort_by_key(|r| r.rank);
        let want: Vec<_> = sh
            .live
            .iter()
            .map(|(r, st)| (*r, st.last_event, st.needs_resync))
            .collect();
        let got: Vec<_> = status
            .iter()
            .map(|r| (r.rank, r.last_event.map(|e| e.0), r.needs_resync))
            .collect();
        assert_eq!(got, want, "rank status");
        assert_eq!(
            s.ranks_needing_resync,
            self.index.ranks_needing_resync().len()
        );
    }
}

fuzz_target!(|script: Script| {
    let setup = &script.setup;
    let max_ranks = usize::from(setup.max_ranks % 9);
    let config = IndexConfig {
        shards: 1 + usize::from(setup.shards % 4),
        memory_budget: None,
        auto_register: setup.auto_register,
        max_ranks,
    };
    let empty = PrefixIndex::new(config.clone()).memory_bytes();
    let budget = setup.budget.map(|units| empty + usize::from(units) * 256);
    let mut hx = Harness {
        index: PrefixIndex::new(IndexConfig {
            memory_budget: budget,
            ..config
        }),
        shadow: Shadow {
            auto_register: setup.auto_register,
            max_ranks,
            budget,
            ..Shadow::default()
        },
        out: OverlapScores::default(),
        prefix: OverlapScores::default(),
    };
    for op in &script.ops {
        match op {
            Op::Stored {
                rank,
                id,
                tier,
                parent,
                blocks,
            } => {
                let h = hx.shadow.header(*rank, *id, *tier);
                let blocks = hx.shadow.blocks(blocks);
                hx.stored(h, parent.map(Word::name), &blocks);
            }
            Op::Extend {
                rank,
                id,
                tier,
                parent,
                blocks,
            } => {
                let h = hx.shadow.header(*rank, *id, *tier);
                let parent = hx.shadow.recent(h.source, *parent);
                let blocks = hx.shadow.blocks(blocks);
                hx.stored(h, parent, &blocks);
            }
            Op::Removed {
                rank,
                id,
                tier,
                blocks,
            } => {
                let h = hx.shadow.header(*rank, *id, *tier);
                let names: Vec<BlockHash> =
                    blocks.iter().take(MAX_BLOCKS).map(|w| w.name()).collect();
                hx.removed(h, &names);
            }
            Op::RemoveStored {
                rank,
                id,
                tier,
                picks,
            } => {
                let h = hx.shadow.header(*rank, *id, *tier);
                let names: Vec<BlockHash> = picks
                    .iter()
                    .take(MAX_BLOCKS)
                    .filter_map(|&p| hx.shadow.recent(h.source, p))
                    .collect();
                hx.removed(h, &names);
            }
            Op::Cleared { rank, id, tier } => {
                let h = hx.shadow.header(*rank, *id, *tier);
                hx.cleared(h);
            }
            Op::RemoveWorker { worker } => {
                hx.remove_worker(WorkerId(u64::from(worker % (WORKERS + 1))));
            }
            Op::Register { rank } => {
                let want = hx.shadow.register(rank.rank());
                assert_eq!(hx.index.register_rank(rank.rank()), want, "register");
            }
            Op::MarkResynced { rank } => {
                hx.index.mark_resynced(rank.rank());
                if let Some(state) = hx.shadow.live.get_mut(&rank.rank()) {
                    state.needs_resync = false;
                }
            }
            Op::Query { early_exit, blocks } => {
                let q: Vec<LocalHash> = blocks.iter().take(MAX_QUERY).map(|w| w.local()).collect();
                hx.query(&q, *early_exit);
            }
            Op::QueryStored {
                early_exit,
                chain,
                len,
                tail,
            } => {
                let mut q = match hx.shadow.chains.len() {
                    0 => Vec::new(),
                    n => {
                        let c = &hx.shadow.chains[usize::from(*chain) % n];
                        c[..usize::from(*len) % (c.len() + 1)].to_vec()
                    }
                };
                q.extend(tail.iter().take(8).map(|w| w.local()));
                q.truncate(MAX_QUERY);
                hx.query(&q, *early_exit);
            }
        }
        hx.check_books();
    }
    let chains = std::mem::take(&mut hx.shadow.chains);
    for c in chains.iter().take(32) {
        hx.query(&c[..c.len().min(MAX_QUERY)], true);
    }
    // With every worker gone, nothing may be left behind.
    let workers: Vec<WorkerId> = hx.shadow.live.keys().map(|r| r.worker).collect();
    for w in workers {
        if hx.shadow.live.keys().any(|r| r.worker == w) {
            hx.remove_worker(w);
        }
    }
    hx.check_books();
    let s = hx.index.stats();
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
    for c in chains.iter().take(32) {
        let q = &c[..c.len().min(MAX_QUERY)];
        assert!(scores_of(&hx.index.reader(), q, MatchOptions::default())
            .scores
            .is_empty());
    }
});
