//! Criterion bench of `Router::route` on an 8,192-token prompt (block size 16, 512 blocks)
//! over 256 single-rank workers, next to hashing the same prompt alone.
//!
//! The fleet: 64 conversations share a 1,024-token system prompt; each conversation's prompt
//! (8,192 tokens) is cached on 3 workers to depths of 25 %, 50 % and 100 %, so the query
//! matches a handful of workers deeply and many shallowly (the system prompt), like a
//! production fleet with prefix reuse. Every worker carries some load.
//!
//! `cargo bench -p kvroute-benches --bench route`

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use kvroute_core::hash::BlockHasher;
use kvroute_core::load::RequestId;
use kvroute_core::registry::WorkerConfig;
use kvroute_core::router::{Mode, RouteHints, RouteRequest, Router};
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, LocalHash, MatchOptions, OverlapScores,
    PrefixIndex, StorageTier, StoredBlock, WorkerRank,
};

const BS: usize = 16;
const WORKERS: u64 = 256;
const CONVERSATIONS: u32 = 64;
const PROMPT: usize = 8192;
const SYSTEM: usize = 1024;

fn prompt(conv: u32) -> Vec<u32> {
    (0..PROMPT as u32)
        .map(|i| {
            if (i as usize) < SYSTEM {
                i.wrapping_mul(2_654_435_761) % 128_000
            } else {
                (i ^ conv.wrapping_mul(40_503)).wrapping_mul(2_246_822_519) % 128_000
            }
        })
        .collect()
}

fn store(index: &mut PrefixIndex, rank: WorkerRank, locals: &[LocalHash], tag: u64) {
    let blocks: Vec<StoredBlock> = locals
        .iter()
        .enumerate()
        .map(|(i, h)| StoredBlock {
            block_hash: BlockHash((tag << 32) | i as u64),
            local_hash: *h,
        })
        .collect();
    let header = EventHeader {
        source: rank,
        event_id: EventId(tag),
        tier: StorageTier::Device,
    };
    index.apply_stored(header, None, &blocks).unwrap();
}

fn fleet() -> Router {
    let mut index = PrefixIndex::new(IndexConfig::default());
    let hasher = BlockHasher::new(BS);
    let mut event = 0u64;
    for conv in 0..CONVERSATIONS {
        let locals = hasher.local_hashes(&prompt(conv));
        for (k, frac) in [(0u64, 4usize), (1, 2), (2, 1)] {
            let w = (u64::from(conv) * 3 + k * 85) % WORKERS;
            event += 1;
            store(
                &mut index,
                WorkerRank::new(w, 0),
                &locals[..locals.len() / frac],
                event,
            );
        }
    }
    let router = Router::new(Default::default(), index).unwrap();
    for w in 0..WORKERS {
        router
            .join_worker(WorkerConfig::simple(w, 100_000, BS as u32))
            .unwrap();
    }
    // Background load: one 2,048-token request per worker.
    for w in 0..WORKERS {
        let tokens = prompt(1000 + w as u32)[..2048].to_vec();
        let mut q = RouteRequest {
            id: RequestId(1 << 40 | w),
            tokens: &tokens,
            hints: RouteHints::default(),
        };
        q.hints.pinned.backend_instance = Some(kvroute_core::WorkerId(w));
        router.route(&q).unwrap();
    }
    router
}

fn bench_route(c: &mut Criterion) {
    let router = fleet();
    let query = prompt(7);
    let mut g = c.benchmark_group("route_8k_256w");
    g.throughput(Throughput::Elements(1));
    g.bench_function("hash_only", |b| {
        let hasher = BlockHasher::new(BS);
        let mut out = Vec::with_capacity(PROMPT / BS);
        b.iter(|| {
            hasher.local_hashes_into(black_box(&query), &mut out);
            black_box(out.len())
        })
    });
    g.bench_function("hash_and_match_only", |b| {
        let hasher = BlockHasher::new(BS);
        let reader = router.index_reader();
        let mut out = Vec::with_capacity(PROMPT / BS);
        let mut scores = OverlapScores::default();
        b.iter(|| {
            hasher.local_hashes_into(black_box(&query), &mut out);
            reader.find_matches_into(&out, MatchOptions::default(), &mut scores);
            black_box(scores.scores.len())
        })
    });
    g.bench_function("route_query_only", |b| {
        let mut q = RouteRequest {
            id: RequestId(1),
            tokens: &query,
            hints: RouteHints::default(),
        };
        q.hints.mode = Mode::QueryOnly;
        b.iter(|| black_box(router.route(black_box(&q)).unwrap().worker))
    });
    g.bench_function("route_book_and_free", |b| {
        let q = RouteRequest {
            id: RequestId(2),
            tokens: &query,
            hints: RouteHints::default(),
        };
        b.iter(|| {
            let d = router.route(black_box(&q)).unwrap();
            router.free(RequestId(2)).unwrap();
            black_box(d.worker)
        })
    });
    g.finish();
}

criterion_group!(benches, bench_route);
criterion_main!(benches);
