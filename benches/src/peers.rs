//! The indexers under test, each behind the same small [`Indexer`] trait.
//!
//! Every adapter drives its indexer through the indexer's own public API, the way an embedding
//! router would: it builds the events in the indexer's own types from the op stream (owned
//! events where the API takes ownership, reused buffers where it takes slices) and reads the
//! indexer's own result type back into a list of [`Overlap`]s. That translation is part of what
//! is timed, for every indexer alike.
//!
//! | name                | indexer                                                      | events applied |
//! |---------------------|--------------------------------------------------------------|----------------|
//! | `kvroute`           | `kvroute_core::PrefixIndex`                                  | inline         |
//! | `dynamo-radix`      | `dynamo_kv_router::RadixTree`                                | inline         |
//! | `dynamo-concurrent` | `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`, 2 lanes  | on its lanes   |
//! | `dynamo-positional` | `ThreadPoolIndexer<PositionalIndexer(jump 32)>`, 2 lanes     | on its lanes   |
//! | `kv-index-chain`    | `kv_index::ChainIndex`, one `ChainBlockMap` per worker       | inline         |
//! | `kv-index-sharded`  | `kv_index::ShardedChainIndex`, 2 shards                      | inline         |
//!
//! The thread-pool indexers apply events asynchronously on their lanes and answer queries on
//! the caller's thread without waiting for them: their normal mode. Their `flush` waits for the
//! lanes to drain.

use std::fmt;

use dynamo_kv_router::indexer::SyncIndexer;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::{
    ConcurrentRadixTreeCompressed, PositionalIndexer, RadixTree, ThreadPoolIndexer,
};
use kv_index::{
    ApplyError, ChainBlockMap, ChainIndex, ContentHash, SequenceHash, ShardedChainIndex,
    SHARD_SHIFT,
};
use kvroute_core::{
    EventHeader, EventId, IndexConfig, IndexReader, LocalHash, MatchOptions, OverlapScores,
    PrefixIndex, StorageTier, WorkerRank,
};

use crate::workload::{Overlap, Removed, Stored};

/// What the replay needs of an indexer.
pub trait Indexer {
    /// Apply a Stored event. Errors are counted, not returned.
    fn apply_stored(&mut self, event: &Stored);
    /// Apply a Removed event. Errors are counted, not returned.
    fn apply_removed(&mut self, event: &Removed);
    /// Replace `answer` with every worker holding at least one leading block of `hashes`, in
    /// any order.
    fn query(&mut self, hashes: &[LocalHash], answer: &mut Vec<Overlap>);
    /// Wait until every event handed over so far is applied.
    fn flush(&mut self);
    /// Events the indexer rejected (or, for the thread pools, refused to enqueue).
    fn apply_errors(&self) -> u64;
    /// The indexer's own account of its memory, where it keeps one.
    fn accounted_bytes(&self) -> Option<usize> {
        None
    }
}

/// The indexers this benchmark knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// kvroute as a router runs it: each worker's rank registered with its KV capacity.
    Kvroute,
    /// kvroute without the capacity: ranks registered by their first event, name maps grown
    /// as they fill.
    KvrouteUnsized,
    DynamoRadix,
    DynamoConcurrent,
    DynamoPositional,
    KvIndexChain,
    KvIndexSharded,
}

impl Kind {
    /// Every indexer, in replay order.
    pub const ALL: [Kind; 7] = [
        Kind::Kvroute,
        Kind::KvrouteUnsized,
        Kind::DynamoRadix,
        Kind::DynamoConcurrent,
        Kind::DynamoPositional,
        Kind::KvIndexChain,
        Kind::KvIndexSharded,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Kvroute => "kvroute",
            Kind::KvrouteUnsized => "kvroute-unsized",
            Kind::DynamoRadix => "dynamo-radix",
            Kind::DynamoConcurrent => "dynamo-concurrent",
            Kind::DynamoPositional => "dynamo-positional",
            Kind::KvIndexChain => "kv-index-chain",
            Kind::KvIndexSharded => "kv-index-sharded",
        }
    }

    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|kind| kind.name() == name)
    }

    /// Build the indexer, empty, for `config`'s fleet.
    pub fn build(self, config: &PeerConfig) -> Box<dyn Indexer> {
        match self {
            Kind::Kvroute => Box::new(Kvroute::sized(config.workers, config.capacity)),
            Kind::KvrouteUnsized => Box::new(Kvroute::new()),
            Kind::DynamoRadix => Box::new(DynamoRadix::new()),
            Kind::DynamoConcurrent => Box::new(DynamoPool::new(
                ConcurrentRadixTreeCompressed::new(),
                config,
            )),
            Kind::DynamoPositional => Box::new(DynamoPool::new(PositionalIndexer::new(32), config)),
            Kind::KvIndexChain => Box::new(KvIndex::new(
                ChainIndex::with_max_workers(config.workers),
                config.workers,
            )),
            Kind::KvIndexSharded => Box::new(KvIndex::new(
                ShardedChainIndex::new(2, config.workers),
                config.workers,
            )),
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What every adapter needs to know about the fleet.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    pub workers: usize,
    /// Blocks each worker caches: its KV capacity, which a router learns when the worker
    /// registers (no peer's API takes it).
    pub capacity: usize,
    pub block_size: usize,
    /// The runtime the thread-pool indexers' `flush` futures are driven on.
    pub runtime: tokio::runtime::Handle,
}

// ---------------------------------------------------------------------------------------------
// kvroute
// ---------------------------------------------------------------------------------------------

/// kvroute's index behind the benchmark's trait.
#[derive(Debug)]
pub struct Kvroute {
    index: PrefixIndex,
    reader: IndexReader,
    scores: OverlapScores,
    errors: u64,
}

impl Kvroute {
    fn new() -> Self {
        Self::with_config(IndexConfig::default())
    }

    /// kvroute's index with workers `0..workers` registered as a router registers them: each
    /// with its KV capacity, `capacity` blocks.
    pub fn sized(workers: usize, capacity: usize) -> Self {
        let mut k = Self::new();
        for w in 0..workers {
            let rank = Self::header(w as u32, 0).source;
            k.index
                .reserve_blocks(rank, capacity as u64)
                .expect("the benchmark's fleet is within the rank limit");
        }
        k
    }

    /// kvroute's index with a configuration of its own (a memory budget, a shard count).
    pub fn with_config(config: IndexConfig) -> Self {
        let index = PrefixIndex::new(config);
        Kvroute {
            reader: index.reader(),
            index,
            scores: OverlapScores::default(),
            errors: 0,
        }
    }

    /// The index's statistics.
    pub fn stats(&self) -> kvroute_core::IndexStats {
        self.index.stats()
    }

    fn header(worker: u32, event_id: u64) -> EventHeader {
        EventHeader {
            source: WorkerRank::new(u64::from(worker), 0),
            event_id: EventId(event_id),
            tier: StorageTier::Device,
        }
    }
}

impl Indexer for Kvroute {
    fn apply_stored(&mut self, event: &Stored) {
        let header = Self::header(event.worker, event.event_id);
        if self
            .index
            .apply_stored(header, event.parent, &event.blocks)
            .is_err()
        {
            self.errors += 1;
        }
    }

    fn apply_removed(&mut self, event: &Removed) {
        let header = Self::header(event.worker, event.event_id);
        if self.index.apply_removed(header, &event.blocks).is_err() {
            self.errors += 1;
        }
    }

    fn query(&mut self, hashes: &[LocalHash], answer: &mut Vec<Overlap>) {
        self.reader
            .find_matches_into(hashes, MatchOptions::default(), &mut self.scores);
        answer.clear();
        answer.extend(
            self.scores
                .scores
                .iter()
                .filter(|score| score.blocks > 0)
                .map(|score| Overlap {
                    worker: score.rank.worker.0 as u32,
                    blocks: score.blocks,
                }),
        );
    }

    fn flush(&mut self) {}

    fn apply_errors(&self) -> u64 {
        self.errors
    }

    fn accounted_bytes(&self) -> Option<usize> {
        Some(self.index.stats().memory_bytes)
    }
}

// ---------------------------------------------------------------------------------------------
// dynamo-kv-router
// ---------------------------------------------------------------------------------------------

fn dynamo_stored(event: &Stored) -> RouterEvent {
    RouterEvent::new(
        u64::from(event.worker),
        KvCacheEvent {
            event_id: event.event_id,
            dp_rank: 0,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: event.parent.map(|p| ExternalSequenceBlockHash(p.0)),
                start_position: None,
                blocks: event
                    .blocks
                    .iter()
                    .map(|block| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(block.block_hash.0),
                        tokens_hash: LocalBlockHash(block.local_hash.0),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
        },
    )
}

fn dynamo_removed(event: &Removed) -> RouterEvent {
    RouterEvent::new(
        u64::from(event.worker),
        KvCacheEvent {
            event_id: event.event_id,
            dp_rank: 0,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: event
                    .blocks
                    .iter()
                    .map(|hash| ExternalSequenceBlockHash(hash.0))
                    .collect(),
            }),
        },
    )
}

fn dynamo_answer(scores: &dynamo_kv_router::OverlapScores, answer: &mut Vec<Overlap>) {
    answer.clear();
    answer.extend(scores.scores.iter().filter(|(_, &blocks)| blocks > 0).map(
        |(worker, &blocks)| Overlap {
            worker: worker.worker_id as u32,
            blocks,
        },
    ));
}

/// The single-threaded radix tree, events applied inline.
struct DynamoRadix {
    tree: RadixTree,
    errors: u64,
}

impl DynamoRadix {
    fn new() -> Self {
        DynamoRadix {
            tree: RadixTree::new(),
            errors: 0,
        }
    }
}

impl Indexer for DynamoRadix {
    fn apply_stored(&mut self, event: &Stored) {
        if self.tree.apply_event(dynamo_stored(event)).is_err() {
            self.errors += 1;
        }
    }

    fn apply_removed(&mut self, event: &Removed) {
        if self.tree.apply_event(dynamo_removed(event)).is_err() {
            self.errors += 1;
        }
    }

    fn query(&mut self, hashes: &[LocalHash], answer: &mut Vec<Overlap>) {
        // `find_matches` takes the sequence by value: a fresh vector per query is its API.
        let sequence = hashes.iter().map(|h| LocalBlockHash(h.0)).collect();
        dynamo_answer(&self.tree.find_matches(sequence, false), answer);
    }

    fn flush(&mut self) {}

    fn apply_errors(&self) -> u64 {
        self.errors
    }
}

/// A thread-pool indexer: events go to its lanes, queries run on the caller's thread.
struct DynamoPool<T: SyncIndexer> {
    pool: ThreadPoolIndexer<T>,
    runtime: tokio::runtime::Handle,
    sequence: Vec<LocalBlockHash>,
    errors: u64,
}

impl<T: SyncIndexer> DynamoPool<T> {
    fn new(backend: T, config: &PeerConfig) -> Self {
        DynamoPool {
            pool: ThreadPoolIndexer::new(backend, 2, config.block_size as u32),
            runtime: config.runtime.clone(),
            sequence: Vec::new(),
            errors: 0,
        }
    }
}

impl<T: SyncIndexer> Indexer for DynamoPool<T> {
    fn apply_stored(&mut self, event: &Stored) {
        if self.pool.enqueue_event(dynamo_stored(event)).is_err() {
            self.errors += 1;
        }
    }

    fn apply_removed(&mut self, event: &Removed) {
        if self.pool.enqueue_event(dynamo_removed(event)).is_err() {
            self.errors += 1;
        }
    }

    fn query(&mut self, hashes: &[LocalHash], answer: &mut Vec<Overlap>) {
        self.sequence.clear();
        self.sequence
            .extend(hashes.iter().map(|h| LocalBlockHash(h.0)));
        let scores = self.pool.backend().find_matches(&self.sequence, false);
        dynamo_answer(&scores, answer);
    }

    fn flush(&mut self) {
        self.runtime.block_on(self.pool.flush());
    }

    fn apply_errors(&self) -> u64 {
        self.errors
    }
}

// ---------------------------------------------------------------------------------------------
// kv-index
// ---------------------------------------------------------------------------------------------

/// The operations the adapter uses, common to the chain index and its sharded form.
trait ChainLike {
    fn intern(&self, name: &str) -> u32;
    fn stored(
        &self,
        worker: u32,
        blocks: &[kv_index::StoredBlock],
        parent: Option<SequenceHash>,
        map: &mut ChainBlockMap,
    ) -> Result<(), ApplyError>;
    fn removed(&self, worker: u32, hashes: &[SequenceHash], map: &mut ChainBlockMap);
    fn score(&self, hashes: &[LocalHash], report: impl FnMut(u32, u32));
}

/// Both kv-index flavours have the same inherent API; one body serves both.
macro_rules! chain_like {
    ($index:ty) => {
        impl ChainLike for $index {
            fn intern(&self, name: &str) -> u32 {
                self.intern_worker(name)
                    .expect("the index is sized for the fleet")
            }
            fn stored(
                &self,
                worker: u32,
                blocks: &[kv_index::StoredBlock],
                parent: Option<SequenceHash>,
                map: &mut ChainBlockMap,
            ) -> Result<(), ApplyError> {
                self.apply_stored(worker, blocks, parent, map)
            }
            fn removed(&self, worker: u32, hashes: &[SequenceHash], map: &mut ChainBlockMap) {
                self.apply_removed(worker, hashes, map);
            }
            fn score(&self, hashes: &[LocalHash], report: impl FnMut(u32, u32)) {
                self.score_into(hashes, |h| h.0, false, report);
            }
        }
    };
}

chain_like!(ChainIndex);
chain_like!(ShardedChainIndex);

/// A kv-index chain index with one lane map per worker, applied inline. Queries go through the
/// allocation-free `score_into`, which reads our `LocalHash` slice directly.
struct KvIndex<C: ChainLike> {
    index: C,
    /// Per worker: its interned id and its lane map.
    ids: Vec<u32>,
    maps: Vec<ChainBlockMap>,
    /// Interned id back to the worker: `[shard][local id]`.
    workers_of: Vec<Vec<u32>>,
    blocks: Vec<kv_index::StoredBlock>,
    hashes: Vec<SequenceHash>,
    errors: u64,
}

impl<C: ChainLike> KvIndex<C> {
    fn new(index: C, workers: usize) -> Self {
        let ids: Vec<u32> = (0..workers)
            .map(|w| index.intern(&format!("worker-{w}")))
            .collect();
        let mut workers_of: Vec<Vec<u32>> = Vec::new();
        for (worker, &id) in ids.iter().enumerate() {
            let (shard, local) = split_id(id);
            if workers_of.len() <= shard {
                workers_of.resize(shard + 1, Vec::new());
            }
            if workers_of[shard].len() <= local {
                workers_of[shard].resize(local + 1, u32::MAX);
            }
            workers_of[shard][local] = worker as u32;
        }
        KvIndex {
            index,
            maps: (0..workers).map(|_| ChainBlockMap::new()).collect(),
            ids,
            workers_of,
            blocks: Vec::new(),
            hashes: Vec::new(),
            errors: 0,
        }
    }
}

fn split_id(id: u32) -> (usize, usize) {
    (
        (id >> SHARD_SHIFT) as usize,
        (id & ((1 << SHARD_SHIFT) - 1)) as usize,
    )
}

impl<C: ChainLike> Indexer for KvIndex<C> {
    fn apply_stored(&mut self, event: &Stored) {
        self.blocks.clear();
        self.blocks
            .extend(event.blocks.iter().map(|block| kv_index::StoredBlock {
                seq_hash: SequenceHash(block.block_hash.0),
                content_hash: ContentHash(block.local_hash.0),
            }));
        let worker = event.worker as usize;
        let parent = event.parent.map(|p| SequenceHash(p.0));
        if self
            .index
            .stored(
                self.ids[worker],
                &self.blocks,
                parent,
                &mut self.maps[worker],
            )
            .is_err()
        {
            self.errors += 1;
        }
    }

    fn apply_removed(&mut self, event: &Removed) {
        self.hashes.clear();
        self.hashes
            .extend(event.blocks.iter().map(|hash| SequenceHash(hash.0)));
        let worker = event.worker as usize;
        self.index
            .removed(self.ids[worker], &self.hashes, &mut self.maps[worker]);
    }

    fn query(&mut self, hashes: &[LocalHash], answer: &mut Vec<Overlap>) {
        answer.clear();
        let workers_of = &self.workers_of;
        self.index.score(hashes, |id, blocks| {
            let (shard, local) = split_id(id);
            if blocks > 0 {
                answer.push(Overlap {
                    worker: workers_of[shard][local],
                    blocks,
                });
            }
        });
    }

    fn flush(&mut self) {}

    fn apply_errors(&self) -> u64 {
        self.errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{builtin_stream, ChatConfig, Op, Placement, SimConfig};

    /// Given time to apply every event before each query, every indexer answers exactly the
    /// ground truth: the adapters translate events and answers faithfully.
    #[test]
    fn every_indexer_agrees_when_flushed_before_each_query() {
        let workload = ChatConfig {
            requests: 400,
            documents: 50,
            open_conversations: 8,
            ..ChatConfig::default()
        };
        let sim = SimConfig {
            workers: 4,
            capacity: 600,
            seed: 3,
            placement: Placement::default(),
        };
        let stream = builtin_stream(workload, sim, 64);
        assert!(stream.stats.removed_events > 0, "the stream must evict");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let config = PeerConfig {
            workers: 4,
            capacity: 600,
            block_size: 64,
            runtime: runtime.handle().clone(),
        };
        for kind in Kind::ALL {
            let mut indexer = kind.build(&config);
            let mut answer = Vec::new();
            let mut disagreements = 0;
            for op in &stream.ops {
                match op {
                    Op::Stored(event) => indexer.apply_stored(event),
                    Op::Removed(event) => indexer.apply_removed(event),
                    Op::Query(query) => {
                        indexer.flush();
                        indexer.query(&query.hashes, &mut answer);
                        answer.sort_unstable();
                        if answer != query.truth {
                            disagreements += 1;
                        }
                    }
                }
            }
            assert_eq!(disagreements, 0, "{kind}");
            assert_eq!(indexer.apply_errors(), 0, "{kind}");
        }
    }
}
