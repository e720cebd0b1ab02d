use crate::common::*;

const BS: u32 = 16;

fn router(speculative: Speculative) -> Router {
    on_manual_clock(
        RouterConfig {
            approximate: Approximate {
                speculative,
                ..Approximate::default()
            },
            ..RouterConfig::default()
        },
        PrefixIndex::new(IndexConfig::default()),
    )
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i * 13 + 5).collect()
}

/// Query-only overlap on `rank` at `now`.
fn overlap_on(r: &Router, tokens: &[u32], rank: WorkerRank, now: Instant) -> u32 {
    let mut q = RouteRequest {
        id: RequestId(999),
        tokens,
        hints: RouteHints::default(),
    };
    q.hints.mode = Mode::QueryOnly;
    q.hints.evidence = EvidenceLevel::Full;
    let d = r.at(now).route(&q).unwrap();
    let ev = d.evidence.unwrap();
    ev.iter()
        .find(|c| c.rank == rank)
        .map_or(0, |c| c.overlap.blocks)
}

fn pinned(r: &Router, id: u64, tokens: &[u32], worker: u64, now: Instant) {
    let mut q = RouteRequest {
        id: RequestId(id),
        tokens,
        hints: RouteHints::default(),
    };
    q.hints.pinned.backend_instance = Some(WorkerId(worker));
    r.at(now).route(&q).unwrap();
}

#[test]
fn decisions_on_a_worker_without_events_count_as_its_cache_for_the_ttl() {
    let r = router(Speculative::Off);
    r.join_worker(WorkerConfig {
        kv_events: KvEvents::Absent,
        ..WorkerConfig::simple(1, 1000, BS)
    })
    .unwrap();
    r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
    let t0 = Instant::now();
    let p = prompt(128); // 8 blocks
    pinned(&r, 1, &p, 1, t0);
    pinned(&r, 2, &p, 2, t0);
    r.free(RequestId(1)).unwrap();
    r.free(RequestId(2)).unwrap();
    let w1 = WorkerRank::new(1, 0);
    let longer: Vec<u32> = p.iter().copied().chain(1_000..1_100).collect();
    assert_eq!(overlap_on(&r, &longer, w1, t0 + Duration::from_secs(1)), 8);
    assert_eq!(
        overlap_on(&r, &longer, WorkerRank::new(2, 0), t0),
        0,
        "a worker with events is not recorded unless speculation is on"
    );
    let mut q = RouteRequest {
        id: RequestId(3),
        tokens: &longer,
        hints: RouteHints::default(),
    };
    q.hints.mode = Mode::QueryOnly;
    assert_eq!(
        r.at(t0 + Duration::from_secs(119))
            .route(&q)
            .unwrap()
            .worker,
        w1
    );
    assert_eq!(
        overlap_on(&r, &longer, w1, t0 + Duration::from_secs(120)),
        0
    );
    assert!(r.counts().approx_raised >= 2);
    r.at(t0 + Duration::from_secs(120)).expire();
    assert_eq!(r.counts().approx.records, 0);
}

/// A pinned route sees its rank's records where they go deeper than the index's overlap,
/// and the index's overlap where that is deeper (only records deeper than the index's
/// overlap of the pinned rank are read).
#[test]
fn a_pinned_route_reads_its_ranks_records_beyond_the_index() {
    let r = router(Speculative::Off);
    for w in [1, 2] {
        r.join_worker(WorkerConfig {
            kv_events: KvEvents::Absent,
            ..WorkerConfig::simple(w, 1000, BS)
        })
        .unwrap();
    }
    let t0 = Instant::now();
    let long = prompt(256); // 16 blocks
    pinned(&r, 1, &long[..128], 1, t0);
    pinned(&r, 2, &long, 2, t0);
    r.free(RequestId(1)).unwrap();
    r.free(RequestId(2)).unwrap();
    let on_pinned = |worker: u64| {
        let mut q = RouteRequest {
            id: RequestId(50 + worker),
            tokens: &long,
            hints: RouteHints::default(),
        };
        q.hints.mode = Mode::QueryOnly;
        q.hints.evidence = EvidenceLevel::Full;
        q.hints.pinned.backend_instance = Some(WorkerId(worker));
        let ev = r.at(t0).route(&q).unwrap().evidence.unwrap();
        assert_eq!(ev.len(), 1);
        ev[0].overlap.blocks
    };
    assert_eq!((on_pinned(1), on_pinned(2)), (8, 16));
    let locals = BlockHasher::new(BS as usize).local_hashes(&long);
    let w1 = WorkerRank::new(1, 0);
    store(&r, w1, StorageTier::Device, &locals[..4], 0);
    assert_eq!(on_pinned(1), 8, "the record goes deeper than the index");
    store(&r, w1, StorageTier::Device, &locals[..12], 1);
    assert_eq!(on_pinned(1), 12, "the index goes deeper than the record");
}

/// A speculative record bridges the time to the worker's first events, is overtaken by
/// them, and never outlives its TTL; an eviction from the worker retires it at once.
#[test]
fn speculative_records_bridge_to_real_events_and_never_outlive_their_ttl() {
    let ttl = Duration::from_millis(1500);
    let r = router(Speculative::On { ttl });
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
    let t0 = Instant::now();
    let p = prompt(128);
    let w1 = WorkerRank::new(1, 0);
    pinned(&r, 1, &p, 1, t0);
    // A burst of the same prefix now sees it on worker 1.
    for ms in [0u64, 1, 500, 1499] {
        assert_eq!(overlap_on(&r, &p, w1, t0 + Duration::from_millis(ms)), 8);
    }
    for ms in [1500u64, 1501, 5000, 120_000] {
        assert_eq!(
            overlap_on(&r, &p, w1, t0 + Duration::from_millis(ms)),
            0,
            "{ms} ms"
        );
    }
    // The worker's events for the first 4 blocks: the index's overlap stays after the
    // record expired; before, the deeper of the two counts.
    let blocks = first_blocks(&p, 4);
    let header = EventHeader {
        source: w1,
        event_id: EventId(0),
        tier: StorageTier::Device,
    };
    r.apply_event(&KvEvent {
        header,
        data: KvEventData::Stored {
            parent: None,
            blocks,
        },
    })
    .unwrap();
    let t1 = t0 + Duration::from_secs(10);
    pinned(&r, 2, &p, 1, t1);
    assert_eq!(overlap_on(&r, &p, w1, t1 + Duration::from_millis(10)), 8);
    assert_eq!(overlap_on(&r, &p, w1, t1 + ttl), 4);
    // An eviction from the worker retires its speculation immediately.
    pinned(&r, 3, &prompt(200), 1, t1);
    r.apply_event(&KvEvent {
        header: EventHeader {
            event_id: EventId(1),
            ..header
        },
        data: KvEventData::Removed {
            blocks: vec![BlockHash(4)],
        },
    })
    .unwrap();
    assert_eq!(overlap_on(&r, &p, w1, t1 + Duration::from_millis(10)), 3);
}

/// The first `n` blocks of prompt `p` as an engine would store them (block hashes 1..=n).
fn first_blocks(p: &[u32], n: usize) -> Vec<StoredBlock> {
    let locals = BlockHasher::new(BS as usize).local_hashes(p);
    locals[..n]
        .iter()
        .enumerate()
        .map(|(i, h)| StoredBlock {
            block_hash: BlockHash(i as u64 + 1),
            local_hash: *h,
        })
        .collect()
}

/// A router speculating for 5 s, worker 1 joined, and a booked 8-block prompt on it:
/// the router, the time, the prompt and the worker's rank.
fn speculating_on_one_worker() -> (Router, Instant, Vec<u32>, WorkerRank) {
    let r = router(Speculative::On {
        ttl: Duration::from_secs(5),
    });
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let t0 = Instant::now();
    let p = prompt(128);
    let w1 = WorkerRank::new(1, 0);
    pinned(&r, 1, &p, 1, t0);
    assert_eq!(overlap_on(&r, &p, w1, t0), 8);
    (r, t0, p, w1)
}

/// An ingest path that writes the index itself tells the router through `note_event`:
/// an eviction reported that way retires the speculation just the same.
#[test]
fn events_applied_elsewhere_are_noted() {
    let (r, t0, p, w1) = speculating_on_one_worker();
    r.note_event(w1, StorageTier::Device, EventSeen::Stored { blocks: 8 });
    assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 8);
    r.note_event(w1, StorageTier::Device, EventSeen::Removed { blocks: 3 });
    assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 5);
    assert_eq!(overlap_on(&r, &p, w1, t0), 0);
}

/// Events written through the router's event writer (as an ingest path writes them)
/// reach the index and are noted: stored blocks feed warm-up's measure, an eviction
/// retires speculation, and a rejected event is noted not at all.
#[test]
fn the_event_writer_applies_and_notes() {
    use kvroute_core::ApplyEvents;
    let (r, t0, p, w1) = speculating_on_one_worker();
    let blocks = first_blocks(&p, 4);
    let header = |id: u64| EventHeader {
        source: w1,
        event_id: EventId(id),
        tier: StorageTier::Device,
    };
    {
        let mut w = r.event_writer();
        w.apply_stored(header(0), None, &blocks).unwrap();
        let unknown = EventHeader {
            source: WorkerRank::new(9, 0),
            ..header(1)
        };
        assert!(w.apply_removed(unknown, &[BlockHash(1)]).is_err());
    }
    assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 4);
    assert_eq!(overlap_on(&r, &p, w1, t0), 8, "the record is still deeper");
    r.event_writer()
        .apply_removed(header(1), &[BlockHash(4)])
        .unwrap();
    assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 3);
    assert_eq!(
        overlap_on(&r, &p, w1, t0),
        3,
        "the eviction retired the record"
    );
    r.event_writer().apply_cleared(header(2)).unwrap();
    assert_eq!(overlap_on(&r, &p, w1, t0), 0);
}

/// Records are kept by the rank's index key: when a worker leaves and another takes its
/// index id, the newcomer gets none of the leaver's records, and a worker that rejoins
/// starts without its old ones.
#[test]
fn a_departed_workers_records_credit_no_one() {
    let r = router(Speculative::On {
        ttl: Duration::from_secs(60),
    });
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
    let t0 = Instant::now();
    let p = prompt(128);
    let (w1, w3) = (WorkerRank::new(1, 0), WorkerRank::new(3, 0));
    pinned(&r, 1, &p, 1, t0);
    assert_eq!(overlap_on(&r, &p, w1, t0), 8);
    let id_of = |w: WorkerRank| {
        let f = r.fleet();
        f.ranks[f.rank_index(w).unwrap()].index_key.unwrap().id
    };
    let old_id = id_of(w1);
    r.leave_worker(WorkerId(1)).unwrap();
    assert_eq!(r.counts().approx.records, 0);
    r.join_worker(WorkerConfig::simple(3, 1000, BS)).unwrap();
    assert_eq!(id_of(w3), old_id, "the newcomer takes the freed id");
    assert_eq!(overlap_on(&r, &p, w3, t0), 0);
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    assert_eq!(overlap_on(&r, &p, w1, t0), 0);
    pinned(&r, 2, &p, 1, t0);
    assert_eq!(overlap_on(&r, &p, w1, t0), 8);
    assert_eq!(overlap_on(&r, &p, w3, t0), 0);
}

/// The records of a worker without events count in `held_blocks` for their TTL, whatever
/// was routed on the thread just before.
#[test]
fn held_blocks_reads_the_records_of_workers_without_events() {
    let r = router(Speculative::Off);
    r.join_worker(WorkerConfig {
        kv_events: KvEvents::Absent,
        ..WorkerConfig::simple(1, 1000, BS)
    })
    .unwrap();
    let t0 = Instant::now();
    let p = prompt(128); // 8 blocks
    pinned(&r, 1, &p, 1, t0);
    r.free(RequestId(1)).unwrap();
    let longer: Vec<u32> = p.iter().copied().chain(1_000..1_100).collect();
    let other: Vec<u32> = (0..300).map(|i| i * 31 + 2).collect();
    let none = RouteHints::default();
    for _ in 0..2 {
        assert_eq!(
            r.at(t0 + Duration::from_secs(1))
                .held_blocks(&longer, &none),
            8
        );
        // A route of another prompt leaves its checkpoint keys in the thread's buffers.
        overlap_on(
            &r,
            &other,
            WorkerRank::new(1, 0),
            t0 + Duration::from_secs(1),
        );
    }
    assert!(!r.needs_more_tokens(&longer, &none));
    assert!(r.needs_more_tokens(&longer[..128], &none));
    assert_eq!(
        r.at(t0 + Duration::from_secs(120))
            .held_blocks(&longer, &none),
        0
    );
}
