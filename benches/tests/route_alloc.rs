//! `Router::route` allocates nothing in steady state: after a warm-up, routing (query-only and
//! booked) and freeing on a populated 64-worker fleet makes no heap allocation on this thread.
//! The same holds with request metrics on, with expected output lengths (output decay), with
//! requests marked dispatched, and with prompt blocks shared by running requests (the decode
//! term's probes). And with every routing condition on: admission through the queue (nothing
//! waits), sticky sessions, a worker marked unhealthy, required and preferred labels, a
//! worker without KV events (approximate records), speculative records, warm-up and shared-pool
//! hits.

use kvroute_benches::alloc::{thread_allocations, CountingAlloc};
use std::time::Duration;

use kvroute_core::BlockHasher;
use kvroute_core::Health;
use kvroute_core::KvEvents;
use kvroute_core::RequestId;
use kvroute_core::SessionId;
use kvroute_core::WorkerConfig;
use kvroute_core::WorkerId;
use kvroute_core::{Admission, Label, PoolHits, PreferredLabel};
use kvroute_core::{
    Approximate, BusyThresholds, Metrics, QueueOrder, Queueing, RouterConfig, Speculative, WarmUp,
};
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, PrefixIndex, StorageTier, StoredBlock, WorkerRank,
};
use kvroute_core::{Mode, RouteHints, RouteRequest, Router};

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

#[test]
fn route_allocates_nothing_with_every_condition_on() {
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
    let config = RouterConfig {
        busy: BusyThresholds {
            decode_blocks_fraction: Some(0.9),
            prefill_tokens_fraction: None,
        },
        queue: Queueing::On {
            max_queued_tokens: 1 << 20,
            order: QueueOrder::Wspt,
        },
        approximate: Approximate {
            speculative: Speculative::On {
                ttl: Duration::from_secs(600),
            },
            ..Approximate::default()
        },
        warm_up: WarmUp::On {
            share: 0.5,
            duration: Duration::from_secs(600),
            low_share: 0.1,
        },
        ..RouterConfig::default()
    };
    let router = Router::new(config, index).unwrap();
    for w in 0..64u64 {
        let zone = if w % 2 == 0 { "a" } else { "b" };
        let events = if w == 63 {
            KvEvents::Absent
        } else {
            KvEvents::Published
        };
        router
            .join_worker(WorkerConfig {
                labels: vec![
                    ("zone".to_string(), zone.to_string()),
                    ("gpu".to_string(), format!("g{}", w % 3)),
                ],
                kv_events: events,
                ..WorkerConfig::simple(w, 100_000, BS as u32)
            })
            .unwrap();
    }
    router.set_health(WorkerId(4), Health::Wedged).unwrap();
    let required = [Label {
        key: "zone",
        value: "a",
    }];
    let preferred = [PreferredLabel {
        label: Label {
            key: "gpu",
            value: "g1",
        },
        weight: 2.0,
    }];
    let pool = [0..40, 100..300];
    let queries: Vec<Vec<u32>> = (0..8).map(|c| prompt(c * 3, 4096 + 7)).collect();
    let cycle = |router: &Router| {
        for (i, q) in queries.iter().enumerate() {
            let mut r = RouteRequest {
                id: RequestId(i as u64),
                tokens: q,
                hints: RouteHints::default(),
            };
            r.hints.session = Some(SessionId(i as u64 % 3));
            r.hints.required = &required;
            r.hints.preferred = &preferred;
            r.hints.pool = PoolHits::Hits(&pool);
            r.hints.priority_jump = 1.0;
            match router.submit(&r).unwrap() {
                Admission::Routed(_) => {}
                Admission::Queued(t) => panic!("nothing should wait: {t:?}"),
            }
            router.mark_dispatched(r.id).unwrap();
            router.prefill_done(r.id).unwrap();
            router.output_block(r.id).unwrap();
            r.hints.mode = Mode::QueryOnly;
            r.hints.session = None;
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
    for _ in 0..50 {
        cycle(&router);
    }
    assert_eq!(
        thread_allocations() - before,
        0,
        "route allocated in steady state with every condition on"
    );
    assert!(router.total_load().is_idle());
    let c = router.counts();
    assert!(c.vetoed_wedged > 0, "the health filter ran");
    assert!(c.approx.written > 0, "records were written");
    assert!(c.approx_raised > 0, "records were consulted");
    assert!(c.sessions_bound > 0);
}
