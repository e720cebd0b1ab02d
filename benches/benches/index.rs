//! Criterion benches of the core's hot paths, one thing each: hashing a prompt, matching a
//! prompt against a populated index, and applying the events of one request.
//!
//! `cargo bench -p kvroute-benches --bench index`

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvroute_core::{seq_hashes_into, BlockHasher};
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, LocalHash, MatchOptions, OverlapScores,
    PrefixIndex, StorageTier, StoredBlock, WorkerRank,
};

const RANKS: u64 = 16;
const PROMPTS: u64 = 2_000;
const SYSTEM: u64 = 32;
const PROMPT_BLOCKS: u64 = 128;

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) % 128_000)
        .collect()
}

/// Prompt `p`: a 32-block system prompt shared by all, then 96 blocks of its own.
fn prompt(p: u64) -> Vec<LocalHash> {
    (0..PROMPT_BLOCKS)
        .map(|i| {
            LocalHash(if i < SYSTEM {
                i + 1
            } else {
                ((p + 1) << 20) | i
            })
        })
        .collect()
}

fn store_event(index: &mut PrefixIndex, rank: u64, id: u64, hashes: &[LocalHash], salt: u64) {
    let blocks: Vec<StoredBlock> = hashes
        .iter()
        .map(|h| StoredBlock {
            block_hash: BlockHash(h.0 ^ salt),
            local_hash: *h,
        })
        .collect();
    let header = EventHeader {
        source: WorkerRank::new(rank, 0),
        event_id: EventId(id),
        tier: StorageTier::Device,
    };
    index
        .apply_stored(header, None, &blocks)
        .expect("valid chain");
}

fn populated() -> PrefixIndex {
    let mut index = PrefixIndex::new(IndexConfig::default());
    for p in 0..PROMPTS {
        store_event(&mut index, p % RANKS, p / RANKS, &prompt(p), 0);
    }
    index
}

fn hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash");
    let toks = tokens(8192, 7);
    for bs in [16usize, 64] {
        let hasher = BlockHasher::new(bs);
        let mut out = Vec::with_capacity(8192 / bs);
        g.throughput(Throughput::Elements((8192 / bs) as u64));
        g.bench_function(format!("local_hashes/8192_tokens/block_{bs}"), |b| {
            b.iter(|| {
                hasher.local_hashes_into(black_box(&toks), &mut out);
                black_box(out.len())
            })
        });
    }
    let locals = BlockHasher::new(16).local_hashes(&toks);
    let mut seqs = Vec::with_capacity(locals.len());
    g.bench_function("seq_hashes/512_blocks", |b| {
        b.iter(|| {
            seq_hashes_into(black_box(&locals), &mut seqs);
            black_box(seqs.len())
        })
    });
    g.finish();
}

fn matching(c: &mut Criterion) {
    let index = populated();
    let reader = index.reader();
    let mut out = OverlapScores::default();
    let mut g = c.benchmark_group("find_matches");
    g.throughput(Throughput::Elements(PROMPT_BLOCKS));
    let hit = prompt(PROMPTS / 2);
    g.bench_function("hit_128_blocks_16_ranks", |b| {
        b.iter(|| {
            reader.find_matches_into(black_box(&hit), MatchOptions::default(), &mut out);
            black_box(out.scores.len())
        })
    });
    let mut miss = prompt(PROMPTS + 1);
    miss[0] = LocalHash(u64::MAX);
    g.bench_function("miss_128_blocks", |b| {
        b.iter(|| {
            reader.find_matches_into(black_box(&miss), MatchOptions::default(), &mut out);
            black_box(out.scores.len())
        })
    });
    g.finish();
}

fn applying(c: &mut Criterion) {
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements(2 * PROMPT_BLOCKS));
    let mut index = populated();
    let mut id = 1_000_000u64;
    let fresh = prompt(PROMPTS + 7);
    let names: Vec<BlockHash> = fresh.iter().map(|h| BlockHash(h.0 ^ 99)).collect();
    g.bench_function("store_then_remove_128_blocks", |b| {
        b.iter_batched(
            || (),
            |()| {
                id += 2;
                store_event(&mut index, 3, id, &fresh, 99);
                let header = EventHeader {
                    source: WorkerRank::new(3, 0),
                    event_id: EventId(id + 1),
                    tier: StorageTier::Device,
                };
                index
                    .apply_removed(header, black_box(&names))
                    .expect("stored just before");
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, hashing, matching, applying);
criterion_main!(benches);
