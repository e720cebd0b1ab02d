//! `Router::route` allocates nothing in steady state: after a warm-up, routing (query-only and
//! booked) and freeing on a populated 64-worker fleet makes no heap allocation on this thread.
//! The same holds with request metrics on, with expected output lengths (output decay), with
//! requests marked dispatched, and with prompt blocks shared by running requests (the decode
//! term's probes).

use kvroute_benches::alloc::{thread_allocations, CountingAlloc};
use kvroute_core::config::{Metrics, RouterConfig};
use kvroute_core::hash::BlockHasher;
use kvroute_core::load::RequestId;
use kvroute_core::registry::WorkerConfig;
use kvroute_core::router::{Mode, RouteHints, RouteRequest, Router};
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, PrefixIndex, StorageTier, StoredBlock, WorkerRank,
};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const BS: usize = 16;

fn prompt(conv: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| if i < 512 { i } else { i ^ (conv << 16) })
        .collect()
}

fn route_allocates_nothing_in_steady_state_with(config: RouterConfig) {
    let mut index = PrefixIndex::new(IndexConfig::default());
    let hasher = BlockHasher::new(BS);
    for conv in 0..32u32 {
        let locals = hasher.local_hashes(&prompt(conv, 4096));
        let blocks: Vec<StoredBlock> = locals
            .iter()
            .enumerate()
            .map(|(i, h)| StoredBlock {
                block_hash: BlockHash(u64::from(conv) << 32 | i as u64),
                local_hash: *h,
            })
            .collect();
        let header = EventHeader {
            source: WorkerRank::new(u64::from(conv) % 64, 0),
            event_id: EventId(u64::from(conv)),
            tier: StorageTier::Device,
        };
        index.apply_stored(header, None, &blocks).unwrap();
    }
    let metrics = config.metrics;
    let router = Router::new(config, index).unwrap();
    for w in 0..64 {
        router
            .join_worker(WorkerConfig::simple(w, 100_000, BS as u32))
            .unwrap();
    }
    let queries: Vec<Vec<u32>> = (0..8).map(|c| prompt(c * 3, 4096 + 7)).collect();
    let cycle = |router: &Router| {
        for (i, q) in queries.iter().enumerate() {
            let mut r = RouteRequest {
                id: RequestId(i as u64),
                tokens: q,
                hints: RouteHints::default(),
            };
            r.hints.expected_output_tokens = (i % 2 == 0).then_some(100);
            router.route(&r).unwrap();
            router.mark_dispatched(r.id).unwrap();
            router.prefill_done(r.id).unwrap();
            router.output_block(r.id).unwrap();
            router.output_block(r.id).unwrap();
            r.hints.mode = Mode::QueryOnly;
            router.route(&r).unwrap();
        }
        for i in 0..queries.len() {
            router.free(RequestId(i as u64)).unwrap();
        }
    };
    for _ in 0..3 {
        cycle(&router);
    }
    let before = thread_allocations();
    assert!(before > 0, "the counting allocator is installed");
    for _ in 0..50 {
        cycle(&router);
    }
    assert_eq!(
        thread_allocations() - before,
        0,
        "route allocated in steady state"
    );
    assert!(router.total_load().is_idle());
    assert!(
        router.counts().shared_probes > 0,
        "the decode term's probes ran"
    );
    if metrics == Metrics::On {
        let m = router.request_metrics().unwrap();
        assert_eq!(m.isl_tokens.len(), 53 * queries.len() as u64);
    }
}

#[test]
fn route_allocates_nothing_in_steady_state() {
    route_allocates_nothing_in_steady_state_with(RouterConfig::default());
}

#[test]
fn route_and_lifecycle_allocate_nothing_with_metrics_on() {
    route_allocates_nothing_in_steady_state_with(RouterConfig {
        metrics: Metrics::On,
        ..RouterConfig::default()
    });
}
