//! Criterion bench of `Router::route` on an 8,192-token prompt (block size 16, 512 blocks)
//! over 256 single-rank workers, next to hashing the same prompt alone.
//!
//! The fleet: 64 conversations share a 1,024-token system prompt; each conversation's prompt
//! (8,192 tokens) is cached on 3 workers to depths of 25 %, 50 % and 100 %, so the query
//! matches a handful of workers deeply and many shallowly (the system prompt), like a
//! production fleet with prefix reuse. Every worker carries some load.
//!
//! | bench | what it times |
//! |---|---|
//! | `hash_only` | hashing the prompt's blocks |
//! | `hash_and_match_only` | hashing, then the match by rank id (`find_depths_into`), as `route()` does |
//! | `hash_match_and_read_every_rank` | the same, then every rank's overlap read (the first run, kept as its holder words, written aside on the first read) |
//! | `hash_match_and_read_every_rank_eager` | the same with the first run written as the walk goes (`RankDepths::set_eager`, as a route that reads every rank sets it) |
//! | `hash_and_match_scores` | hashing, then the match as a list of scores (`find_matches_into`) |
//! | `route_query_only` | `route()` deciding without booking |
//! | `route_book_and_free` | `route()` booking, then `free` |
//! | `route_book_and_free_hot_load_off` | the same without the hot-load term (`HotLoad::OFF`), which reads every rank's context for the fleet's mean |
//!
//! The `vs_dynamo` group puts the selection step next to Dynamo's own: dynamo-kv-router
//! 1.6.1's `DefaultWorkerSelector::select_worker` (its reference cost function) over the same
//! 256 workers, the same overlaps (this index's match of the same prompt), the same loads
//! (this router's counters) and the same new blocks per worker (the prompt less the blocks
//! already active there, which our decode term subtracts and Dynamo's scheduler passes as
//! `additional_active_blocks`), in the same process and run:
//!
//! | bench | what it times |
//! |---|---|
//! | `kvroute_route_query_only` | our whole `route()`: hash, match, select (as in the first group) |
//! | `kvroute_select_step` | our select step alone: the router's own select-time histogram (Timing::On), median per iteration |
//! | `dynamo_select_worker` | Dynamo's `select_worker` on a prepared `SchedulingRequest` |
//! | `dynamo_prepare_and_select` | the same, plus building its per-request maps (overlap per tier, effective blocks and tokens, load projections) from a match and the loads, which its scheduler does per request |
//!
//! The `route_8k_256w_all_conditions` group times the same query with every routing condition
//! on: admission through the queue (`submit`, nothing waiting), busy thresholds, a sticky
//! session, one worker marked wedged, required and preferred labels (half the workers in the
//! required zone), one worker without KV events (approximate records), speculative records
//! (live on every worker for the whole run: each background request left its own, and all
//! share the system prompt, as after a burst), warm-up and shared-pool hits:
//!
//! | bench | what it times |
//! |---|---|
//! | `route_query_only` | `route()` in query-only mode with the hints above |
//! | `submit_book_and_free` | `submit()` booking the request (session bound, records written), then `free` |
//! | `submit_book_and_free_unbound` | the same without the session: every eligible rank is a candidate, as on a session's first turn |
//!
//! A session-bound route scores its bound rank alone (its index walk follows that rank only),
//! so `submit_book_and_free` times the sticky path and `submit_book_and_free_unbound` the
//! selection over the fleet.
//!
//! The `record_lookup_256_ranks` group times the router's record table alone: one lookup of the
//! prompt against 256 ranks' records, all to one depth (`one_depth`) or each to its own
//! (`every_depth`, the lookup's worst case).
//!
//! `cargo bench -p kvroute-benches --bench route`

use std::collections::HashMap;
use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use dynamo_kv_router::protocols::{RoutingConstraints, WorkerConfigLike, WorkerWithDpRank};
use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode, SchedulingRequest};
use dynamo_kv_router::selector::{DefaultWorkerSelector, WorkerSelectionInput, WorkerSelector};
use dynamo_kv_router::{KvRouterConfig, WorkerLoadProjection};
use kvroute_core::BlockHasher;
use kvroute_core::Health;
use kvroute_core::KvEvents;
use kvroute_core::RequestId;
use kvroute_core::SessionId;
use kvroute_core::WorkerConfig;
use kvroute_core::{Admission, Label, PoolHits, PreferredLabel};
use kvroute_core::{
    Approximate, BusyThresholds, HotLoad, QueueOrder, Queueing, RouterConfig, Speculative, Timing,
    WarmUp,
};
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, LocalHash, MatchOptions, OverlapScores,
    PrefixIndex, RankDepths, StorageTier, StoredBlock, WorkerRank,
};
use kvroute_core::{Mode, RouteHints, RouteRequest, Router};

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

fn fleet(config: RouterConfig) -> Router {
    fleet_with(config, Conditions::Off)
}

/// Whether the fleet carries labels, a marked worker and a worker without events.
#[derive(Clone, Copy, PartialEq)]
enum Conditions {
    Off,
    On,
}

fn fleet_with(config: RouterConfig, conditions: Conditions) -> Router {
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
    let router = Router::new(config, index).unwrap();
    for w in 0..WORKERS {
        let mut c = WorkerConfig::simple(w, 100_000, BS as u32);
        if conditions == Conditions::On {
            let zone = if w % 2 == 0 { "a" } else { "b" };
            c.labels = vec![
                ("zone".to_string(), zone.to_string()),
                ("gpu".to_string(), format!("g{}", w % 3)),
            ];
            if w == WORKERS - 2 {
                c.kv_events = KvEvents::Absent;
            }
        }
        router.join_worker(c).unwrap();
    }
    if conditions == Conditions::On {
        router
            .set_health(kvroute_core::WorkerId(4), Health::Wedged)
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
    let router = fleet(RouterConfig::default());
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
        let mut depths = RankDepths::default();
        b.iter(|| {
            hasher.local_hashes_into(black_box(&query), &mut out);
            reader.find_depths_into(&out, MatchOptions::default(), &mut depths);
            black_box(depths.deepest())
        })
    });
    for (name, eager) in [
        ("hash_match_and_read_every_rank", false),
        ("hash_match_and_read_every_rank_eager", true),
    ] {
        g.bench_function(name, |b| {
            let hasher = BlockHasher::new(BS);
            let reader = router.index_reader();
            let mut out = Vec::with_capacity(PROMPT / BS);
            let mut depths = RankDepths::default();
            depths.set_eager(eager);
            b.iter(|| {
                hasher.local_hashes_into(black_box(&query), &mut out);
                reader.find_depths_into(&out, MatchOptions::default(), &mut depths);
                let mut blocks = 0u64;
                for id in 0..WORKERS as u32 {
                    blocks += depths.get(id).map_or(0, |d| u64::from(d.blocks));
                }
                black_box(blocks)
            })
        });
    }
    g.bench_function("hash_and_match_scores", |b| {
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
    let cold = fleet(RouterConfig {
        hot_load: HotLoad::OFF,
        ..RouterConfig::default()
    });
    for (name, router) in [
        ("route_book_and_free", &router),
        ("route_book_and_free_hot_load_off", &cold),
    ] {
        g.bench_function(name, |b| {
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
    }
    g.finish();
}

/// A Dynamo worker config: what its selector reads of a worker.
struct PeerWorker {
    kv_blocks: u64,
    max_batched_tokens: u64,
}

impl WorkerConfigLike for PeerWorker {
    fn data_parallel_start_rank(&self) -> u32 {
        0
    }
    fn data_parallel_size(&self) -> u32 {
        1
    }
    fn max_num_batched_tokens(&self) -> Option<u64> {
        Some(self.max_batched_tokens)
    }
    fn total_kv_blocks(&self) -> Option<u64> {
        Some(self.kv_blocks)
    }
}

/// The prompt blocks already active on each worker (by worker id), read from the router's
/// per-rank prompt tables: what Dynamo's scheduler subtracts to get a worker's new blocks.
fn shared_blocks(router: &Router, locals: &[LocalHash]) -> Vec<usize> {
    let fleet = router.fleet();
    (0..WORKERS)
        .map(|w| {
            let i = fleet.rank_index(WorkerRank::new(w, 0)).unwrap();
            fleet.ranks[i]
                .state
                .try_shared_prefix_blocks(locals)
                .unwrap()
        })
        .collect()
}

/// Dynamo's per-request input for `query` against `router`'s index and loads: the match per
/// tier, the tier-weighted effective blocks and cached tokens (weights 1 / 0.75 / 0.25, as
/// both routers default), and each worker's load. `additional_active_blocks` is the prompt
/// less the blocks already active on the worker (`shared`, by worker id), as our decode term
/// charges it.
fn dynamo_request(
    router: &Router,
    locals: &[LocalHash],
    shared: &[usize],
    scores: &mut OverlapScores,
) -> SchedulingRequest {
    let tokens = PROMPT;
    let blocks = tokens.div_ceil(BS);
    router
        .index_reader()
        .find_matches_into(locals, MatchOptions::default(), scores);
    let mut overlap = OverlapSignals::default();
    for s in &scores.scores {
        let w = WorkerWithDpRank::new(s.rank.worker.0, s.rank.dp_rank.0);
        let [device, host, disk, external] = s.per_tier.map(|b| b as usize);
        let effective = device as f64 + 0.75 * host as f64 + 0.25 * (disk + external) as f64;
        let t = &mut overlap.tier_overlap_blocks;
        t.device.insert(w, device);
        t.host_pinned.insert(w, host);
        t.disk.insert(w, disk + external);
        overlap.effective_overlap_blocks.insert(w, effective);
        overlap
            .effective_cached_tokens
            .insert(w, ((effective * BS as f64) as usize).min(tokens));
    }
    let mut request = SchedulingRequest {
        mode: ScheduleMode::QueryOnly { request_id: None },
        token_seq: None,
        isl_tokens: tokens,
        lora_name: None,
        expected_output_tokens: None,
        affinity_target: None,
        pinned_worker: None,
        allowed_worker_ids: None,
        routing_constraints: RoutingConstraints::default(),
        router_config_override: None,
        track_prefill_tokens: true,
        priority_jump: 0.0,
        strict_priority: 0,
        policy_class: None,
        session_context: None,
        overlap,
        kv_transfer_candidates: None,
        retain_kv_transfer_chain: false,
        shared_cache_hits: None,
        worker_loads: Default::default(),
        resp_tx: None,
    };
    for w in 0..WORKERS {
        let l = router.load(WorkerRank::new(w, 0)).unwrap();
        request.worker_loads.insert(
            WorkerWithDpRank::new(w, 0),
            WorkerLoadProjection {
                active_prefill_tokens: l.prefill_tokens as usize,
                active_decode_blocks: l.decode_blocks() as usize,
                active_requests: l.requests as usize,
                additional_active_blocks: blocks - shared[w as usize],
            },
        );
    }
    request
}

fn bench_vs_dynamo(c: &mut Criterion) {
    let router = fleet(RouterConfig::default());
    let timed = fleet(RouterConfig {
        timing: Timing::On,
        ..RouterConfig::default()
    });
    let query = prompt(7);
    let locals = BlockHasher::new(BS).local_hashes(&query);
    let mut q = RouteRequest {
        id: RequestId(1),
        tokens: &query,
        hints: RouteHints::default(),
    };
    q.hints.mode = Mode::QueryOnly;

    let workers: HashMap<u64, PeerWorker> = (0..WORKERS)
        .map(|w| {
            let peer = PeerWorker {
                kv_blocks: 100_000,
                max_batched_tokens: 8192,
            };
            (w, peer)
        })
        .collect();
    let selector = DefaultWorkerSelector::new_seeded(Some(KvRouterConfig::default()), "decode", 7);
    let mut scores = OverlapScores::default();
    let shared = shared_blocks(&router, &locals);
    let request = dynamo_request(&router, &locals, &shared, &mut scores);
    let select = |request: &SchedulingRequest| {
        let input =
            WorkerSelectionInput::configured(&workers, request, request.eligibility(), BS as u32);
        selector.select_worker(input).unwrap()
    };
    for _ in 0..1000 {
        timed.route(&q).unwrap();
    }
    let t = timed.timings().unwrap();
    println!(
        "vs_dynamo: router's own split over {} routes, medians: hash {} ns, match {} ns, select {} ns",
        t.select.len(),
        t.hash.value_at_quantile(0.5),
        t.matching.value_at_quantile(0.5),
        t.select.value_at_quantile(0.5)
    );
    let theirs = select(&request);
    let ours = router.route(&q).unwrap();
    println!(
        "vs_dynamo: kvroute chose {} ({} blocks cached), dynamo chose {}/{} ({:.0} blocks)",
        ours.worker,
        ours.overlap.blocks,
        theirs.worker.worker_id,
        theirs.worker.dp_rank,
        theirs.effective_overlap_blocks
    );

    let mut g = c.benchmark_group("vs_dynamo_8k_256w");
    g.throughput(Throughput::Elements(1));
    g.bench_function("kvroute_route_query_only", |b| {
        b.iter(|| black_box(router.route(black_box(&q)).unwrap().worker))
    });
    g.bench_function("kvroute_select_step", |b| {
        // The router's own split: criterion's clock covers the whole route, the reported
        // figure is the select step's share, measured inside route by the router itself.
        b.iter_custom(|iters| {
            let before = timed.timings().unwrap().select;
            let (sum0, n0) = (before.mean() * before.len() as f64, before.len());
            for _ in 0..iters {
                black_box(timed.route(black_box(&q)).unwrap().worker);
            }
            let after = timed.timings().unwrap().select;
            let sum1 = after.mean() * after.len() as f64;
            debug_assert_eq!(after.len() - n0, iters);
            Duration::from_nanos((sum1 - sum0).max(0.0) as u64)
        })
    });
    g.bench_function("dynamo_select_worker", |b| {
        b.iter(|| black_box(select(black_box(&request)).worker))
    });
    g.bench_function("dynamo_prepare_and_select", |b| {
        b.iter(|| {
            let request = dynamo_request(&router, black_box(&locals), &shared, &mut scores);
            black_box(select(&request).worker)
        })
    });
    g.finish();
}

fn bench_all_conditions(c: &mut Criterion) {
    let config = RouterConfig {
        busy: BusyThresholds {
            decode_blocks_fraction: Some(0.9),
            prefill_tokens_fraction: None,
        },
        queue: Queueing::On {
            max_queued_tokens: 1 << 24,
            order: QueueOrder::Fcfs,
        },
        approximate: Approximate {
            speculative: Speculative::On {
                ttl: Duration::from_secs(600),
            },
            ..Approximate::default()
        },
        warm_up: WarmUp::On {
            share: 0.1,
            duration: Duration::from_secs(60),
            low_share: 0.1,
        },
        ..RouterConfig::default()
    };
    let router = fleet_with(config, Conditions::On);
    let query = prompt(7);
    let required = [Label {
        key: "zone",
        value: "a",
    }];
    let preferred = [PreferredLabel {
        label: Label {
            key: "gpu",
            value: "g1",
        },
        weight: 4.0,
    }];
    let pool = [0..200, 220..300];
    let hints = RouteHints {
        required: &required,
        preferred: &preferred,
        pool: PoolHits::Hits(&pool),
        session: Some(SessionId(7)),
        priority_jump: 1.0,
        ..RouteHints::default()
    };
    let mut g = c.benchmark_group("route_8k_256w_all_conditions");
    g.throughput(Throughput::Elements(1));
    g.bench_function("route_query_only", |b| {
        let mut q = RouteRequest {
            id: RequestId(1),
            tokens: &query,
            hints,
        };
        q.hints.mode = Mode::QueryOnly;
        b.iter(|| black_box(router.route(black_box(&q)).unwrap().worker))
    });
    g.bench_function("submit_book_and_free", |b| {
        let q = RouteRequest {
            id: RequestId(2),
            tokens: &query,
            hints,
        };
        b.iter(|| {
            let w = match router.submit(black_box(&q)).unwrap() {
                Admission::Routed(d) => d.worker,
                Admission::Queued(t) => panic!("nothing waits here: {t:?}"),
            };
            router.free(RequestId(2)).unwrap();
            black_box(w)
        })
    });
    g.bench_function("submit_book_and_free_unbound", |b| {
        let mut q = RouteRequest {
            id: RequestId(3),
            tokens: &query,
            hints,
        };
        q.hints.session = None;
        b.iter(|| {
            let w = match router.submit(black_box(&q)).unwrap() {
                Admission::Routed(d) => d.worker,
                Admission::Queued(t) => panic!("nothing waits here: {t:?}"),
            };
            router.free(RequestId(3)).unwrap();
            black_box(w)
        })
    });
    g.finish();
}

/// The router's record table alone: 256 ranks holding records of one 512-block prompt, all to
/// one depth (64 blocks: one node read) or each to its own (2, 4, ..., 512 blocks: every
/// checkpoint's node read, the lookup's worst case); one lookup of the whole prompt.
fn bench_record_lookup(c: &mut Criterion) {
    use kvroute_core::testing::{checkpoint_keys_extend, ApproxCache};
    use kvroute_core::RankKey;
    use std::time::Instant;

    let prompt: Vec<LocalHash> = BlockHasher::new(BS).local_hashes(&prompt(7));
    let mut g = c.benchmark_group("record_lookup_256_ranks");
    g.throughput(Throughput::Elements(1));
    for (name, depth) in [
        ("one_depth", (|_| 64) as fn(usize) -> usize),
        ("every_depth", |w| 2 * w + 2),
    ] {
        let table = ApproxCache::new(1 << 22);
        let now = Instant::now();
        for w in 0..WORKERS as usize {
            let mut marks = Vec::new();
            checkpoint_keys_extend(
                &prompt[..depth(w).min(prompt.len())],
                &mut marks,
                usize::MAX,
            );
            let key = RankKey {
                id: w as u32,
                epoch: 0,
            };
            let rank = WorkerRank::new(w as u64, 0);
            table.record(&marks, rank, key, now + Duration::from_secs(3600), || true);
        }
        let mut marks = Vec::new();
        g.bench_function(name, |b| {
            b.iter(|| {
                marks.clear();
                let mut deepest = 0;
                table.lookup(black_box(&prompt), &mut marks, now, |_, d| {
                    deepest = deepest.max(d)
                });
                deepest
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_route,
    bench_vs_dynamo,
    bench_all_conditions,
    bench_record_lookup
);
criterion_main!(benches);
