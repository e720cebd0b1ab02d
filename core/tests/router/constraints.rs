use crate::common::*;
use std::collections::HashSet;

const BS: u32 = 16;

fn labelled(id: u64, kv_blocks: u64, labels: &[(&str, &str)]) -> WorkerConfig {
    WorkerConfig {
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..WorkerConfig::simple(id, kv_blocks, BS)
    }
}

fn router(config: RouterConfig, kv_blocks: u64) -> Router {
    let r = on_manual_clock(config, PrefixIndex::new(IndexConfig::default()));
    r.join_worker(labelled(1, kv_blocks, &[("zone", "a"), ("gpu", "h100")]))
        .unwrap();
    r.join_worker(labelled(2, kv_blocks, &[("zone", "b"), ("gpu", "h100")]))
        .unwrap();
    r.join_worker(labelled(3, kv_blocks, &[("zone", "a"), ("gpu", "a10")]))
        .unwrap();
    r
}

const ZONE_A: Label<'static> = Label {
    key: "zone",
    value: "a",
};

#[test]
fn required_labels_filter_and_none_eligible_is_a_clear_error() {
    let r = router(RouterConfig::default(), 1000);
    let t: Vec<u32> = (0..64).collect();
    let mut q = RouteRequest {
        id: RequestId(1),
        tokens: &t,
        hints: RouteHints::default(),
    };
    q.hints.mode = Mode::QueryOnly;
    q.hints.required = &[ZONE_A];
    let mut seen = HashSet::new();
    for _ in 0..100 {
        seen.insert(r.route(&q).unwrap().worker.worker.0);
    }
    assert_eq!(seen, HashSet::from([1, 3]));
    let both = [
        Label {
            key: "zone",
            value: "b",
        },
        Label {
            key: "gpu",
            value: "a10",
        },
    ];
    q.hints.required = &both;
    assert_eq!(
        r.route(&q),
        Err(RouteError::NoEligibleWorker {
            request: RequestId(1)
        })
    );
    let unknown = [Label {
        key: "zone",
        value: "z",
    }];
    q.hints.required = &unknown;
    assert!(matches!(
        r.route(&q),
        Err(RouteError::NoEligibleWorker { .. })
    ));
    q.hints.required = &[ZONE_A];
    q.hints.pinned.backend_instance = Some(WorkerId(2));
    assert_eq!(
        r.route(&q),
        Err(RouteError::PinnedLacksLabels {
            request: RequestId(1),
            worker: WorkerId(2)
        })
    );
    assert_eq!(r.counts().no_eligible, 3);
}

#[test]
fn preferred_labels_lower_the_cost_by_their_weight() {
    let r = router(reference_weights(), 1000);
    let t: Vec<u32> = (0..64).collect();
    let prefer = [PreferredLabel {
        label: Label {
            key: "gpu",
            value: "h100",
        },
        weight: 3.0,
    }];
    let mut q = RouteRequest {
        id: RequestId(1),
        tokens: &t,
        hints: RouteHints::default(),
    };
    q.hints.mode = Mode::QueryOnly;
    q.hints.preferred = &prefer;
    q.hints.evidence = EvidenceLevel::Full;
    for _ in 0..50 {
        let d = r.route(&q).unwrap();
        assert_ne!(d.worker.worker, WorkerId(3));
        assert_eq!(d.cost.preference, 3.0);
        assert_eq!(d.cost.total, 4.0 + 4.0 - 3.0);
        let ev = d.evidence.unwrap();
        let w3 = ev.iter().find(|c| c.rank.worker == WorkerId(3)).unwrap();
        assert_eq!((w3.cost.preference, w3.cost.total), (0.0, 8.0));
    }
    let bad = [PreferredLabel {
        weight: f64::NAN,
        ..prefer[0]
    }];
    q.hints.preferred = &bad;
    assert!(matches!(
        r.route(&q),
        Err(RouteError::InvalidHint {
            field: "preferred.weight",
            ..
        })
    ));
    assert_eq!(r.counts().invalid_hints, 1);
}

/// The labelled fleet with 10-block workers, busy over 5 active blocks, and an FCFS queue.
fn queued_labelled_router() -> Router {
    router(
        RouterConfig {
            busy: BusyThresholds {
                decode_blocks_fraction: Some(0.5),
                prefill_tokens_fraction: None,
            },
            queue: Queueing::On {
                max_queued_tokens: 10_000,
                order: QueueOrder::Fcfs,
            },
            ..RouterConfig::default()
        },
        10,
    )
}

/// A waiting head holds back only what no free rank could serve: with zone a busy, a
/// zone-a request waits, a request for any worker behind it goes to zone b at once, and a
/// second zone-a request keeps its place behind the first.
#[test]
fn a_waiting_head_does_not_block_requests_other_ranks_can_serve() {
    let r = queued_labelled_router();
    let t: Vec<u32> = (0..96).collect();
    let q = |id: u64, zone_a: bool| {
        let mut q = RouteRequest {
            id: RequestId(id),
            tokens: &t,
            hints: RouteHints::default(),
        };
        if zone_a {
            q.hints.required = &[ZONE_A];
        }
        q
    };
    for w in [1, 3] {
        let mut p = q(w, false);
        p.hints.pinned.backend_instance = Some(WorkerId(w));
        r.route(&p).unwrap();
    }
    let t0 = Instant::now();
    assert!(matches!(
        r.at(t0).submit(&q(9, true)),
        Ok(Admission::Queued(_))
    ));
    // Queued behind the waiting head, then released by the same call: zone b is free.
    assert!(matches!(
        r.at(t0).submit(&q(10, false)),
        Ok(Admission::Queued(_))
    ));
    let d = r.take_released(RequestId(10)).unwrap().unwrap();
    assert_eq!(d.worker, WorkerRank::new(2, 0));
    assert!(matches!(
        r.at(t0).submit(&q(11, true)),
        Ok(Admission::Queued(_))
    ));
    assert_eq!(r.at(t0).release_queued(), 0, "zone a is still busy");
    assert_eq!(r.ticket_state(RequestId(9)), TicketState::Waiting);
    assert_eq!(r.ticket_state(RequestId(11)), TicketState::Waiting);
    // Zone a frees one worker: the first zone-a request takes it, the second still waits.
    r.free(RequestId(3)).unwrap();
    assert_eq!(
        r.take_released(RequestId(9)).unwrap().unwrap().worker,
        WorkerRank::new(3, 0)
    );
    assert_eq!(r.ticket_state(RequestId(11)), TicketState::Waiting);
    r.free(RequestId(1)).unwrap();
    assert_eq!(
        r.take_released(RequestId(11)).unwrap().unwrap().worker,
        WorkerRank::new(1, 0)
    );
    for id in [9, 10, 11] {
        r.free(RequestId(id)).unwrap();
    }
    assert!(r.total_load().is_idle());
    assert_eq!(r.queue_stats().unwrap().depth, 0);
}

/// A queued request keeps its constraints: with the zone-a workers busy and zone b free,
/// it waits, and goes to zone a when load frees there.
#[test]
fn queued_requests_keep_their_labels() {
    let r = queued_labelled_router();
    let t: Vec<u32> = (0..96).collect();
    for (id, w) in [(1, 1), (3, 3)] {
        let mut q = RouteRequest {
            id: RequestId(id),
            tokens: &t,
            hints: RouteHints::default(),
        };
        q.hints.pinned.backend_instance = Some(WorkerId(w));
        r.route(&q).unwrap();
    }
    let mut q = RouteRequest {
        id: RequestId(9),
        tokens: &t,
        hints: RouteHints::default(),
    };
    q.hints.required = &[ZONE_A];
    assert!(matches!(r.submit(&q), Ok(Admission::Queued(_))));
    r.free(RequestId(3)).unwrap();
    let d = r.take_released(RequestId(9)).unwrap().unwrap();
    assert_eq!(d.worker, WorkerRank::new(3, 0));
}
