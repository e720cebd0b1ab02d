use crate::common::*;

const BS: u32 = 16;

fn router() -> Router {
    let r = Router::new(
        RouterConfig::default(),
        PrefixIndex::new(IndexConfig::default()),
    )
    .unwrap();
    for w in 1..=3 {
        r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
    }
    r
}

fn req(id: u64, tokens: &[u32]) -> RouteRequest<'_> {
    RouteRequest {
        id: RequestId(id),
        tokens,
        hints: RouteHints::default(),
    }
}

/// Worker 1 holds the whole prompt; marked, it is steered around, whatever its cache.
#[test]
fn marked_workers_are_steered_around_and_counted_per_reason() {
    let r = router();
    let t: Vec<u32> = (0..64).collect();
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    store(&r, WorkerRank::new(1, 0), StorageTier::Device, &locals, 0);
    let mut q = req(1, &t);
    q.hints.mode = Mode::QueryOnly;
    assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(1, 0));
    assert_eq!(
        r.set_health(WorkerId(1), Health::Unreachable).unwrap(),
        Health::Healthy
    );
    r.set_health(WorkerId(2), Health::Wedged).unwrap();
    for _ in 0..10 {
        let d = r.route(&q).unwrap();
        assert_eq!(d.worker, WorkerRank::new(3, 0));
        assert_eq!(d.decided_by, DecidedBy::Cost);
    }
    let c = r.counts();
    assert_eq!(
        (c.vetoed_unreachable, c.vetoed_wedged, c.all_unhealthy),
        (10, 10, 0)
    );
    // Every candidate marked: never refused, the least loaded serves.
    r.set_health(WorkerId(3), Health::Wedged).unwrap();
    r.route(&req(10, &(1000..1100).collect::<Vec<u32>>()))
        .unwrap();
    let booked = r.fleet().ranks[0].state.load().requests
        + r.fleet().ranks[1].state.load().requests
        + r.fleet().ranks[2].state.load().requests;
    assert_eq!(booked, 1);
    for _ in 0..5 {
        let d = r.route(&q).unwrap();
        assert_eq!(d.decided_by, DecidedBy::FallbackAllUnhealthy);
        assert_eq!(d.load.requests, 0, "least loaded: {d:?}");
    }
    assert_eq!(
        r.counts().all_unhealthy,
        6,
        "the booked request and five queries"
    );
    // Healthy again: the cache wins again.
    r.set_health(WorkerId(1), Health::Healthy).unwrap();
    assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(1, 0));
    assert_eq!(
        r.set_health(WorkerId(9), Health::Wedged),
        Err(RouterError::Registry(RegistryError::UnknownWorker {
            worker: WorkerId(9)
        }))
    );
}

/// Pinned requests go where pinned, marked or not: the caller chose.
#[test]
fn pins_ignore_marks() {
    let r = router();
    r.set_health(WorkerId(2), Health::Unreachable).unwrap();
    let t: Vec<u32> = (0..40).collect();
    let mut q = req(1, &t);
    q.hints.pinned.backend_instance = Some(WorkerId(2));
    assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(2, 0));
}
