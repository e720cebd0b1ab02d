use crate::common::*;
use std::collections::HashSet;

const BS: u32 = 16;
const MINUTE: Duration = Duration::from_secs(60);

fn router(share: f64, low_share: f64) -> Router {
    let r = on_manual_clock(
        RouterConfig {
            warm_up: WarmUp::On {
                share,
                duration: MINUTE,
                low_share,
            },
            ..RouterConfig::default()
        },
        PrefixIndex::new(IndexConfig::default()),
    );
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
    r
}

fn query(r: &Router, seed: u32, now: Instant) -> Decision {
    let t: Vec<u32> = (0..64).map(|i| seed * 1000 + i).collect();
    let mut q = RouteRequest {
        id: RequestId(u64::from(seed)),
        tokens: &t,
        hints: RouteHints::default(),
    };
    q.hints.mode = Mode::QueryOnly;
    r.at(now).route(&q).unwrap()
}

fn store(r: &Router, worker: u64, seed: u32, n: usize, id: u64) {
    let t: Vec<u32> = (0..(n * BS as usize) as u32)
        .map(|i| seed * 1000 + i)
        .collect();
    let blocks: Vec<StoredBlock> = BlockHasher::new(BS as usize)
        .local_hashes(&t)
        .iter()
        .enumerate()
        .map(|(i, h)| StoredBlock {
            block_hash: BlockHash(u64::from(seed) << 20 | i as u64),
            local_hash: *h,
        })
        .collect();
    r.apply_event(&KvEvent {
        header: EventHeader {
            source: WorkerRank::new(worker, 0),
            event_id: EventId(id),
            tier: StorageTier::Device,
        },
        data: KvEventData::Stored {
            parent: None,
            blocks,
        },
    })
    .unwrap();
}

#[test]
fn a_new_worker_takes_its_share_of_cache_misses_for_the_duration() {
    let r = router(1.0, 0.0);
    let t0 = Instant::now();
    let settled = t0 + MINUTE;
    for seed in 0..20 {
        assert_eq!(query(&r, seed, settled).decided_by, DecidedBy::Cost);
    }
    r.at(settled)
        .join_worker(WorkerConfig {
            kv_events: KvEvents::Published,
            ..WorkerConfig::simple(3, 1000, BS)
        })
        .unwrap();
    let now = settled + Duration::from_secs(1);
    for seed in 0..20 {
        let d = query(&r, seed, now);
        assert_eq!(
            (d.worker, d.decided_by),
            (WorkerRank::new(3, 0), DecidedBy::WarmUp)
        );
    }
    // A request with a holder is not a miss: the cost decides.
    store(&r, 1, 77, 4, 0);
    let d = query(&r, 77, now);
    assert_eq!(
        (d.worker, d.decided_by),
        (WorkerRank::new(1, 0), DecidedBy::Cost)
    );
    assert_eq!(query(&r, 5, settled + MINUTE).decided_by, DecidedBy::Cost);
    assert_eq!(r.counts().warm_up, 20);
}

#[test]
fn the_share_is_a_fraction_of_misses() {
    let r = router(0.25, 0.0);
    r.join_worker(WorkerConfig::simple(3, 1000, BS)).unwrap();
    let now = Instant::now();
    let warm = (0..4000)
        .filter(|&seed| query(&r, seed, now).decided_by == DecidedBy::WarmUp)
        .count();
    assert!((850..1150).contains(&warm), "{warm}");
}

/// Pruned selection and warm-up agree with the unpruned: worker 3 warms (it just joined),
/// workers 1 and 2 have warmed long ago. A miss whose warming candidate cannot win on cost
/// still goes to it (the pruned gather is redone for warm-up's pick); a request that a
/// free worker holds a block of is no miss, even when that worker is pruned for its load.
#[test]
fn pruning_keeps_warm_ups_misses_and_hits() {
    let r = router(1.0, 0.0);
    let t0 = Instant::now();
    let later = t0 + 3 * MINUTE;
    r.at(later)
        .join_worker(WorkerConfig {
            kv_events: KvEvents::Published,
            ..WorkerConfig::simple(3, 1000, BS)
        })
        .unwrap();
    // Worker 3 carries a little load, worker 1 a lot (and one block of query 9's prompt).
    let load = |worker: u64, id: u64, blocks: usize| {
        let t: Vec<u32> = (0..(blocks * BS as usize) as u32)
            .map(|i| 777_000 + i)
            .collect();
        let mut q = RouteRequest {
            id: RequestId(id),
            tokens: &t,
            hints: RouteHints::default(),
        };
        q.hints.pinned.backend_instance = Some(WorkerId(worker));
        r.at(later).route(&q).unwrap();
    };
    load(3, 100, 1);
    load(1, 101, 40);
    store(&r, 1, 9, 1, 1);
    // A miss: worker 3 costs more than worker 2, but warm-up takes it.
    for seed in 20..60 {
        assert_eq!(
            query(&r, seed, later).worker.worker,
            WorkerId(3),
            "seed {seed}"
        );
    }
    // Query 9: worker 1 holds its first block, so no miss; the cheapest serves (worker
    // 2, as worker 1's load outweighs its block).
    for _ in 0..40 {
        let d = query(&r, 9, later);
        assert_eq!(d.worker.worker, WorkerId(2));
        assert_eq!(d.decided_by, DecidedBy::Cost);
    }
}

/// A worker whose reported cache is far below the fleet's warms again at the next expire
/// sweep; a cleared worker warms at once.
#[test]
fn far_below_the_fleets_share_or_cleared_warms_again() {
    let r = router(1.0, 0.1);
    r.join_worker(WorkerConfig::simple(3, 1000, BS)).unwrap();
    store(&r, 1, 1, 50, 0);
    store(&r, 2, 2, 50, 0);
    store(&r, 3, 3, 5, 0);
    let later = Instant::now() + 2 * MINUTE;
    assert_eq!(query(&r, 9, later).decided_by, DecidedBy::Cost);
    r.at(later).expire();
    assert_eq!(
        r.counts().rewarmed,
        0,
        "5 of a mean 35 blocks is above 10 %"
    );
    store(&r, 1, 11, 200, 1);
    r.at(later).expire();
    assert_eq!(r.counts().rewarmed, 1, "5 of a mean 101.7 is below 10 %");
    let d = query(&r, 9, later);
    assert_eq!(
        (d.worker, d.decided_by),
        (WorkerRank::new(3, 0), DecidedBy::WarmUp)
    );
    r.apply_event(&KvEvent {
        header: EventHeader {
            source: WorkerRank::new(2, 0),
            event_id: EventId(1),
            tier: StorageTier::Device,
        },
        data: KvEventData::Cleared,
    })
    .unwrap();
    assert_eq!(r.fleet().ranks[1].state.reported_blocks(), 0);
    let now = Instant::now();
    let mut seen = HashSet::new();
    for seed in 100..140 {
        let d = query(&r, seed, now);
        assert_eq!(d.decided_by, DecidedBy::WarmUp);
        seen.insert(d.worker.worker.0);
    }
    assert!(seen.contains(&2), "{seen:?}");
}
