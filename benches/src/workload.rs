//! The op stream every indexer replays: prompts, a simulated fleet, and the KV events it emits.
//!
//! ```text
//!  prompts (built-in generator ──hash──▶ local hashes ──▶ Simulator ──▶ Query  (with ground truth)
//!   or a Mooncake trace)                                 W workers,  Stored (blocks it lacked)
//!                                                        LRU of C    Removed (LRU evictions)
//!                                                        blocks each Query ...
//! ```
//!
//! For each request the [`Simulator`] first records a [`Query`] carrying, as ground truth, the
//! number of leading prompt blocks every worker holds at that moment. It then places the request
//! with a KV-aware rule under a load bound ([`Placement`]) and lets the chosen worker behave like
//! a vLLM engine: one Stored event for the prompt blocks it lacked, a touch of every prompt block
//! tail first (so the first block ends most recent and the LRU evicts chains from their tails, as
//! vLLM frees a finished request's blocks), then one Removed event for whatever fell out of the
//! cache. Because a block is always touched after its descendants, every cache stays
//! prefix-closed: a worker never holds a block without its parent, and evictions remove leaves.
//!
//! Blocks are keyed, in the caches and in the events, by their chained sequence hash: the engine
//! block hash of the Dynamo convention, which the positional peer requires.
//!
//! The built-in workload ([`ChatConfig`]) is a chat service: multi-turn conversations whose
//! prompt grows by the previous reply and a new user message each turn, opened by one of a few
//! shared system prompts and often by a document drawn from a Zipf-popular library, with many
//! conversations interleaved.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use kvroute_core::{seq_hashes, BlockHasher};
use kvroute_core::{BlockHash, LocalHash, SeqHash, StoredBlock};
pub use kvroute_sim::workload::{pseudo_token, ChatConfig, ChatWorkload};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------------------------
// Hashing
// ---------------------------------------------------------------------------------------------

/// Local hashes of the prompt's full blocks (a trailing partial block is not cached by engines
/// and is dropped).
pub fn hash_prompt(tokens: &[u32], block_size: usize) -> Vec<LocalHash> {
    BlockHasher::new(block_size).local_hashes(tokens)
}

/// Chained sequence hashes of a prompt's local hashes: `seq[0] = local[0]`,
/// `seq[i] = xxh3(le(seq[i-1]) ++ le(local[i]))`.
pub fn chain_hashes(locals: &[LocalHash]) -> Vec<SeqHash> {
    seq_hashes(locals)
}

// ---------------------------------------------------------------------------------------------
// The op stream
// ---------------------------------------------------------------------------------------------

/// One worker's overlap with a query: it holds the query's first `blocks` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Overlap {
    /// Worker index, `0..W`.
    pub worker: u32,
    /// Leading blocks held (always > 0 in answers and ground truth).
    pub blocks: u32,
}

/// A match request and what an exact index must answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Query {
    /// Local hashes of the prompt's full blocks.
    pub hashes: Vec<LocalHash>,
    /// Workers holding at least one leading block, sorted by worker.
    pub truth: Vec<Overlap>,
}

/// A worker stored `blocks` after `parent` (a prompt's start when `None`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub worker: u32,
    pub event_id: u64,
    pub parent: Option<BlockHash>,
    pub blocks: Vec<StoredBlock>,
}

/// A worker evicted `blocks`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removed {
    pub worker: u32,
    pub event_id: u64,
    pub blocks: Vec<BlockHash>,
}

/// One step of the replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Query(Query),
    Stored(Stored),
    Removed(Removed),
}

/// Counts of an op stream; see `benches/README.md` for what each figure means.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Requests placed (one query each).
    pub requests: u64,
    /// Requests without a single full block: neither queried nor placed.
    pub skipped_requests: u64,
    /// Prompt tokens of the placed requests.
    pub prompt_tokens: u64,
    /// Blocks of all queries.
    pub query_blocks: u64,
    pub stored_events: u64,
    pub stored_blocks: u64,
    pub removed_events: u64,
    pub removed_blocks: u64,
    /// Prompt blocks the chosen worker already held: the fleet's prefix hits.
    pub hit_blocks: u64,
    /// (worker, block) pairs cached when the stream ends.
    pub resident_pairs: u64,
}

impl StreamStats {
    /// Stored plus Removed events.
    pub fn events(&self) -> u64 {
        self.stored_events + self.removed_events
    }

    /// Query blocks plus stored and removed blocks.
    pub fn block_ops(&self) -> u64 {
        self.query_blocks + self.stored_blocks + self.removed_blocks
    }

    /// Fraction of query blocks that were prefix hits on the chosen worker.
    pub fn hit_ratio(&self) -> f64 {
        ratio(self.hit_blocks, self.query_blocks)
    }
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// A complete op stream and the fleet it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpStream {
    pub ops: Vec<Op>,
    pub workers: usize,
    pub stats: StreamStats,
}

impl OpStream {
    /// The longest query, in blocks.
    pub fn max_query_blocks(&self) -> usize {
        self.ops
            .iter()
            .map(|op| match op {
                Op::Query(query) => query.hashes.len(),
                _ => 0,
            })
            .max()
            .unwrap_or(0)
    }
}

// ---------------------------------------------------------------------------------------------
// The simulated fleet
// ---------------------------------------------------------------------------------------------

/// The placement rule: KV-aware, weighed against load, under a load bound.
///
/// The last `window` placements stand in for the work in flight (the simulation has no clock).
/// A worker's `load` is the sum of the prompt blocks of its placements among them, and its
/// `share` their number. For a prompt of `n` blocks of which worker `w` holds the first
/// `held(w)`:
///
/// ```text
///  eligible:  share(w) < bound = ceil(slack * window / W)
///  cost(w)  = (n - held(w))  +  load(w)        blocks to prefill + blocks in flight
///  choice   = an eligible worker of lowest cost; ties broken uniformly at random (seeded)
/// ```
///
/// This is the reference router's cost (prefill blocks after overlap credit plus active
/// blocks) with unit weights and no temperature. The load term keeps cold workers in play: when
/// every prompt starts with the same system prompt, overlap under a share bound alone would
/// never pick a worker that lacks it. Should no worker be eligible (only possible with
/// `slack <= 1`), every worker is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Placement {
    /// Placements remembered as the work in flight.
    pub window: usize,
    /// How far above an even share of the window a worker may go.
    pub slack: f64,
}

impl Default for Placement {
    fn default() -> Self {
        Placement {
            window: 64,
            slack: 2.0,
        }
    }
}

impl Placement {
    /// Placements a worker may hold in the window before it stops being eligible.
    pub fn bound(&self, workers: usize) -> u32 {
        let even = self.window as f64 / workers.max(1) as f64;
        ((self.slack * even).ceil() as u32).max(1)
    }
}

/// Mixed into the benchmark's seed for the placement's tie-breaking generator, so that it draws
/// apart from the workload's.
pub const PLACEMENT_SEED_MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// The fleet's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimConfig {
    /// Workers (W).
    pub workers: usize,
    /// Blocks each worker caches (C).
    pub capacity: usize,
    /// Seed of the tie-breaking generator.
    pub seed: u64,
    pub placement: Placement,
}

/// W workers with LRU caches, a placement rule, and the op stream they produce.
#[derive(Debug)]
pub struct Simulator {
    config: SimConfig,
    caches: Vec<LruCache>,
    next_event_id: Vec<u64>,
    /// The last `window` placements (worker, prompt blocks), oldest first, and each worker's
    /// count and prompt blocks among them.
    recent: VecDeque<(u32, u32)>,
    share: Vec<u32>,
    load: Vec<u64>,
    bound: u32,
    rng: SmallRng,
    ops: Vec<Op>,
    stats: StreamStats,
}

impl Simulator {
    pub fn new(config: SimConfig) -> Self {
        assert!(config.workers > 0, "a fleet needs a worker");
        assert!(config.capacity > 0, "a worker needs room for a block");
        Simulator {
            caches: (0..config.workers)
                .map(|_| LruCache::new(config.capacity))
                .collect(),
            next_event_id: vec![0; config.workers],
            recent: VecDeque::with_capacity(config.placement.window + 1),
            share: vec![0; config.workers],
            load: vec![0; config.workers],
            bound: config.placement.bound(config.workers),
            rng: SmallRng::seed_from_u64(config.seed),
            ops: Vec::new(),
            stats: StreamStats::default(),
            config,
        }
    }

    /// Route one request of `prompt_tokens` tokens whose full blocks hash to `locals`.
    pub fn request(&mut self, prompt_tokens: usize, locals: Vec<LocalHash>) {
        if locals.is_empty() {
            self.stats.skipped_requests += 1;
            return;
        }
        let seqs = chain_hashes(&locals);

        // Ground truth, before anything changes.
        let held: Vec<usize> = self.caches.iter().map(|c| c.leading(&seqs)).collect();
        let truth = held
            .iter()
            .enumerate()
            .filter(|(_, &blocks)| blocks > 0)
            .map(|(worker, &blocks)| Overlap {
                worker: worker as u32,
                blocks: blocks as u32,
            })
            .collect();

        let worker = self.choose(&held, locals.len());
        let cached = held[worker];
        self.stats.requests += 1;
        self.stats.prompt_tokens += prompt_tokens as u64;
        self.stats.query_blocks += locals.len() as u64;
        self.stats.hit_blocks += cached as u64;

        // The chosen worker stores what it lacked: the prompt's suffix after its cached prefix.
        let stored = (cached < seqs.len()).then(|| Stored {
            worker: worker as u32,
            event_id: self.next_event_id(worker),
            parent: cached.checked_sub(1).map(|i| BlockHash(seqs[i].0)),
            blocks: (cached..seqs.len())
                .map(|i| StoredBlock {
                    block_hash: BlockHash(seqs[i].0),
                    local_hash: locals[i],
                })
                .collect(),
        });

        // Touch tail first, so the first block ends most recent; then evict over capacity.
        let cache = &mut self.caches[worker];
        for seq in seqs.iter().rev() {
            cache.touch(seq.0);
        }
        let mut evicted = Vec::new();
        while cache.len() > self.config.capacity {
            evicted.extend(cache.pop_lru().map(BlockHash));
        }

        self.ops.push(Op::Query(Query {
            hashes: locals,
            truth,
        }));
        if let Some(stored) = stored {
            self.stats.stored_events += 1;
            self.stats.stored_blocks += stored.blocks.len() as u64;
            self.ops.push(Op::Stored(stored));
        }
        if !evicted.is_empty() {
            self.stats.removed_events += 1;
            self.stats.removed_blocks += evicted.len() as u64;
            let event_id = self.next_event_id(worker);
            self.ops.push(Op::Removed(Removed {
                worker: worker as u32,
                event_id,
                blocks: evicted,
            }));
        }
    }

    /// The stream so far, with the (worker, block) pairs resident at its end.
    pub fn finish(mut self) -> OpStream {
        self.stats.resident_pairs = self.caches.iter().map(|c| c.len() as u64).sum();
        OpStream {
            ops: self.ops,
            workers: self.config.workers,
            stats: self.stats,
        }
    }

    fn next_event_id(&mut self, worker: usize) -> u64 {
        let id = self.next_event_id[worker];
        self.next_event_id[worker] += 1;
        id
    }

    /// The placement rule of [`Placement`] for a prompt of `blocks` blocks; records the choice
    /// in the window.
    fn choose(&mut self, held: &[usize], blocks: usize) -> usize {
        let mut eligible: Vec<usize> = (0..held.len())
            .filter(|&w| self.share[w] < self.bound)
            .collect();
        if eligible.is_empty() {
            eligible = (0..held.len()).collect();
        }
        let cost = |w: usize| (blocks - held[w]) as u64 + self.load[w];
        let best = eligible.iter().map(|&w| cost(w)).min().unwrap_or(0);
        eligible.retain(|&w| cost(w) == best);
        let worker = eligible[self.rng.gen_range(0..eligible.len())];

        self.recent.push_back((worker as u32, blocks as u32));
        self.share[worker] += 1;
        self.load[worker] += blocks as u64;
        if self.recent.len() > self.config.placement.window {
            if let Some((old, old_blocks)) = self.recent.pop_front() {
                self.share[old as usize] -= 1;
                self.load[old as usize] -= u64::from(old_blocks);
            }
        }
        worker
    }
}

// ---------------------------------------------------------------------------------------------
// One worker's cache
// ---------------------------------------------------------------------------------------------

/// Hasher for keys that are already uniform hashes: the key is the hash.
#[derive(Default, Debug)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Node {
    key: u64,
    /// Toward the most recent end.
    prev: u32,
    /// Toward the least recent end.
    next: u32,
}

/// An LRU set of block hashes: a map to slots of an intrusive doubly linked list, most recent at
/// the head. It may exceed its capacity until the owner pops the least recent entries.
#[derive(Debug)]
struct LruCache {
    slots: HashMap<u64, u32, BuildHasherDefault<PassThrough>>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
}

impl LruCache {
    fn new(capacity: usize) -> Self {
        LruCache {
            slots: HashMap::with_capacity_and_hasher(capacity + 1, Default::default()),
            nodes: Vec::with_capacity(capacity + 1),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    fn len(&self) -> usize {
        self.slots.len()
    }

    /// How many leading hashes of `seqs` the cache holds.
    fn leading(&self, seqs: &[SeqHash]) -> usize {
        seqs.iter()
            .take_while(|seq| self.slots.contains_key(&seq.0))
            .count()
    }

    /// Make `key` the most recent entry, inserting it if absent.
    fn touch(&mut self, key: u64) {
        if let Some(&slot) = self.slots.get(&key) {
            self.unlink(slot);
            self.push_front(slot);
            return;
        }
        let node = Node {
            key,
            prev: NIL,
            next: NIL,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.slots.insert(key, slot);
        self.push_front(slot);
    }

    /// Remove and return the least recent entry.
    fn pop_lru(&mut self) -> Option<u64> {
        if self.tail == NIL {
            return None;
        }
        let slot = self.tail;
        self.unlink(slot);
        self.free.push(slot);
        let key = self.nodes[slot as usize].key;
        self.slots.remove(&key);
        Some(key)
    }

    fn unlink(&mut self, slot: u32) {
        let Node { prev, next, .. } = self.nodes[slot as usize];
        match prev {
            NIL => self.head = next,
            prev => self.nodes[prev as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.nodes[next as usize].prev = prev,
        }
    }

    fn push_front(&mut self, slot: u32) {
        let old_head = self.head;
        self.nodes[slot as usize].prev = NIL;
        self.nodes[slot as usize].next = old_head;
        match old_head {
            NIL => self.tail = slot,
            head => self.nodes[head as usize].prev = slot,
        }
        self.head = slot;
    }
}

// ---------------------------------------------------------------------------------------------
// The built-in workload
// ---------------------------------------------------------------------------------------------

/// Simulate the built-in workload on a fleet.
pub fn builtin_stream(workload: ChatConfig, sim: SimConfig, block_size: usize) -> OpStream {
    let mut generator = ChatWorkload::new(workload);
    let mut simulator = Simulator::new(sim);
    while let Some(prompt) = generator.next_prompt() {
        let tokens = prompt.len();
        let locals = hash_prompt(prompt, block_size);
        simulator.request(tokens, locals);
    }
    simulator.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_workload(seed: u64) -> ChatConfig {
        ChatConfig {
            requests: 300,
            seed,
            documents: 50,
            open_conversations: 8,
            ..ChatConfig::default()
        }
    }

    fn fleet(workers: usize, capacity: usize) -> SimConfig {
        SimConfig {
            workers,
            capacity,
            seed: 7,
            placement: Placement::default(),
        }
    }

    fn locals(values: &[u64]) -> Vec<LocalHash> {
        values.iter().copied().map(LocalHash).collect()
    }

    fn engine(locals_so_far: &[u64]) -> BlockHash {
        BlockHash(chain_hashes(&locals(locals_so_far)).last().unwrap().0)
    }

    #[test]
    fn same_seed_same_stream() {
        let a = builtin_stream(small_workload(1), fleet(4, 512), 64);
        let b = builtin_stream(small_workload(1), fleet(4, 512), 64);
        assert_eq!(a, b);
        assert!(a.stats.removed_events > 0, "the small fleet must evict");
        let c = builtin_stream(small_workload(2), fleet(4, 512), 64);
        assert_ne!(a.ops, c.ops);
    }

    #[test]
    fn conversations_grow_turn_by_turn() {
        let mut generator = ChatWorkload::new(ChatConfig {
            open_conversations: 1,
            turns: (3, 3),
            ..small_workload(3)
        });
        let first = generator.next_prompt().unwrap().to_vec();
        let second = generator.next_prompt().unwrap().to_vec();
        assert!(second.len() > first.len());
        assert_eq!(&second[..first.len()], &first[..]);
    }

    fn queries(stream: &OpStream) -> Vec<&Query> {
        stream
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Query(q) => Some(q),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn ground_truth_is_leading_blocks_per_worker() {
        // Two workers with room for everything.
        let mut sim = Simulator::new(fleet(2, 100));
        sim.request(3 * 64, locals(&[1, 2, 3]));
        // Worker x holds [1, 2, 3] with a load of 3: cost 0 + 3 there, 2 + 0 on the other.
        sim.request(2 * 64, locals(&[1, 2]));
        // Both hold [1, 2]; costs 1 + 3 on x and 1 + 2 on y.
        sim.request(3 * 64, locals(&[1, 2, 4]));
        let stream = sim.finish();
        let Op::Stored(first) = &stream.ops[1] else {
            panic!("the first request stores its blocks");
        };
        let (x, y) = (first.worker, 1 - first.worker);
        let truths: Vec<&Vec<Overlap>> = queries(&stream).iter().map(|q| &q.truth).collect();
        assert!(truths[0].is_empty());
        assert_eq!(
            truths[1],
            &vec![Overlap {
                worker: x,
                blocks: 2
            }]
        );
        let mut both = vec![
            Overlap {
                worker: x,
                blocks: 2,
            },
            Overlap {
                worker: y,
                blocks: 2,
            },
        ];
        both.sort();
        assert_eq!(truths[2], &both);
        // The last request went to y, which stored the one block it lacked after block 2.
        let Op::Stored(last) = stream.ops.last().unwrap() else {
            panic!("the last request stores its new block");
        };
        assert_eq!(last.worker, y);
        assert_eq!(last.parent, Some(engine(&[1, 2])));
        assert_eq!(last.blocks.len(), 1);
        assert_eq!(last.blocks[0].block_hash, engine(&[1, 2, 4]));
        assert_eq!(last.blocks[0].local_hash, LocalHash(4));
        assert_eq!(stream.stats.resident_pairs, 6);
    }

    /// Replays a stream's events into plain per-worker sets and checks every query's ground
    /// truth, every parent and every removal against them.
    #[test]
    fn ground_truth_matches_a_replay_of_the_events() {
        use std::collections::HashSet;
        let stream = builtin_stream(small_workload(4), fleet(4, 400), 64);
        assert!(
            stream.stats.removed_events > 0,
            "the small fleet must evict"
        );
        let mut held: Vec<HashSet<BlockHash>> = vec![HashSet::new(); 4];
        for op in &stream.ops {
            match op {
                Op::Stored(event) => {
                    let blocks = &mut held[event.worker as usize];
                    if let Some(parent) = event.parent {
                        assert!(blocks.contains(&parent));
                    }
                    blocks.extend(event.blocks.iter().map(|b| b.block_hash));
                }
                Op::Removed(event) => {
                    for hash in &event.blocks {
                        assert!(held[event.worker as usize].remove(hash));
                    }
                }
                Op::Query(query) => {
                    let seqs = chain_hashes(&query.hashes);
                    let expected: Vec<Overlap> = held
                        .iter()
                        .enumerate()
                        .map(|(worker, blocks)| Overlap {
                            worker: worker as u32,
                            blocks: seqs
                                .iter()
                                .take_while(|s| blocks.contains(&BlockHash(s.0)))
                                .count() as u32,
                        })
                        .filter(|o| o.blocks > 0)
                        .collect();
                    assert_eq!(query.truth, expected);
                }
            }
        }
        let pairs: usize = held.iter().map(HashSet::len).sum();
        assert_eq!(pairs as u64, stream.stats.resident_pairs);
    }

    #[test]
    fn every_worker_receives_requests_when_all_prompts_share_a_prefix() {
        let mut sim = Simulator::new(fleet(8, 1_000));
        for request in 0..400u64 {
            sim.request(3 * 64, locals(&[1, 2, 1_000 + request]));
        }
        let stream = sim.finish();
        let mut placed = [0u32; 8];
        for op in &stream.ops {
            if let Op::Stored(event) = op {
                placed[event.worker as usize] += 1;
            }
        }
        assert!(placed.iter().all(|&n| n > 0), "{placed:?}");
    }

    #[test]
    fn event_ids_count_per_worker_from_zero() {
        let stream = builtin_stream(small_workload(5), fleet(3, 256), 64);
        let mut next = [0u64; 3];
        for op in &stream.ops {
            let (worker, id) = match op {
                Op::Stored(s) => (s.worker, s.event_id),
                Op::Removed(r) => (r.worker, r.event_id),
                Op::Query(_) => continue,
            };
            assert_eq!(id, next[worker as usize]);
            next[worker as usize] += 1;
        }
    }

    #[test]
    fn reverse_touch_evicts_tails_first() {
        // One worker with room for four blocks: a three-block prompt, then a disjoint one.
        let mut sim = Simulator::new(fleet(1, 4));
        sim.request(3 * 64, locals(&[1, 2, 3]));
        sim.request(3 * 64, locals(&[7, 8, 9]));
        // Re-querying the first prompt finds only its head left.
        sim.request(3 * 64, locals(&[1, 2, 3]));
        let stream = sim.finish();
        let removed: Vec<&Removed> = stream
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Removed(r) => Some(r),
                _ => None,
            })
            .collect();
        // The tail goes first, then its parent; the head block survives.
        assert_eq!(removed[0].blocks, vec![engine(&[1, 2, 3]), engine(&[1, 2])]);
        let Op::Query(third) = &stream.ops[5] else {
            panic!("the third request's query follows the second's two events");
        };
        assert_eq!(
            third.truth,
            vec![Overlap {
                worker: 0,
                blocks: 1
            }]
        );
    }
}
