//! Several routers, one fleet: one router's booking changes, applied to another, give the other
//! the same load on every rank; a router that leaves takes its bookings with it; bad deltas
//! change nothing.

use proptest::prelude::*;

use crate::common::*;

const BS: u32 = 16;
const WORKERS: u64 = 3;

fn router() -> Router {
    let r = on_manual_clock(
        RouterConfig::default(),
        PrefixIndex::new(IndexConfig::default()),
    );
    for w in 0..WORKERS {
        r.join_worker(WorkerConfig::simple(w, 100_000, BS)).unwrap();
    }
    r
}

/// A router whose own booking changes queue up in the returned outbox.
fn telling_router() -> (Router, Arc<Mutex<Vec<OwnedDelta>>>) {
    let r = router();
    let out = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&out);
    assert!(r.on_booking(move |d| lock(&sink).push(OwnedDelta::from(d))));
    assert!(!r.on_booking(|_| {}), "a second sink is refused");
    (r, out)
}

/// Applies everything queued in `outbox` to `to`, as router `from`.
fn deliver(outbox: &Mutex<Vec<OwnedDelta>>, from: ReplicaId, to: &Router) {
    for d in lock(outbox).drain(..) {
        to.apply_remote(from, &d.as_delta()).unwrap();
    }
}

fn loads(r: &Router) -> Vec<LoadView> {
    (0..WORKERS)
        .map(|w| r.load(WorkerRank::new(w, 0)).unwrap())
        .collect()
}

fn prompt(sys: u32, shared: usize, own: usize, seed: u64) -> Vec<u32> {
    (0..shared)
        .map(|i| sys * 7919 + i as u32)
        .chain((0..own).map(|i| 1_000_000 + (seed as u32) * 131 + i as u32))
        .collect()
}

fn route(r: &Router, id: u64, tokens: &[u32], expected: Option<u32>) -> Option<WorkerRank> {
    let hints = RouteHints {
        expected_output_tokens: expected,
        ..RouteHints::default()
    };
    r.route(&RouteRequest {
        id: RequestId(id),
        tokens,
        hints,
    })
    .ok()
    .map(|d| d.worker)
}

#[derive(Clone, Debug)]
enum Op {
    Route {
        sys: u32,
        shared: usize,
        own: usize,
        expected: Option<u32>,
    },
    PrefillDone(usize),
    OutputBlock(usize),
    Tokens(usize, u64),
    Free(usize),
    /// Deliver what is queued so far.
    Deliver,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..3, 0usize..80, 0usize..60, prop::option::of(1u32..200)).prop_map(
            |(sys, shared, own, expected)| Op::Route { sys, shared, own: own + 1, expected }
        ),
        2 => any::<usize>().prop_map(Op::PrefillDone),
        2 => any::<usize>().prop_map(Op::OutputBlock),
        1 => (any::<usize>(), 1u64..40).prop_map(|(i, n)| Op::Tokens(i, n)),
        2 => any::<usize>().prop_map(Op::Free),
        2 => Just(Op::Deliver),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever router A does, router B holds A's load on every rank once A's changes are
    /// delivered, and nothing once A's requests end.
    #[test]
    fn a_mirror_holds_the_same_load_as_the_router_it_follows(ops in prop::collection::vec(op(), 1..80)) {
        let (a, outbox) = telling_router();
        let b = router();
        let from = ReplicaId(7);
        let mut live: Vec<u64> = Vec::new();
        for (n, op) in ops.into_iter().enumerate() {
            let pick = |i: usize| (!live.is_empty()).then(|| live[i % live.len()]);
            match op {
                Op::Route { sys, shared, own, expected } => {
                    let id = n as u64 + 1;
                    if route(&a, id, &prompt(sys, shared, own, id), expected).is_some() {
                        live.push(id);
                    }
                }
                Op::PrefillDone(i) => if let Some(id) = pick(i) {
                    a.prefill_done(RequestId(id)).unwrap();
                },
                Op::OutputBlock(i) => if let Some(id) = pick(i) {
                    a.output_block(RequestId(id)).unwrap();
                },
                Op::Tokens(i, t) => if let Some(id) = pick(i) {
                    a.tokens_generated(RequestId(id), t).unwrap();
                },
                Op::Free(i) => if let Some(id) = pick(i) {
                    a.free(RequestId(id)).unwrap();
                    live.retain(|x| *x != id);
                },
                Op::Deliver => {
                    deliver(&outbox, from, &b);
                    prop_assert_eq!(loads(&a), loads(&b));
                    prop_assert_eq!(b.remote_requests(), a.active_requests());
                    prop_assert_eq!(b.active_requests(), 0);
                }
            }
        }
        deliver(&outbox, from, &b);
        prop_assert_eq!(loads(&a), loads(&b));
        for id in live {
            a.free(RequestId(id)).unwrap();
        }
        deliver(&outbox, from, &b);
        prop_assert_eq!(b.remote_requests(), 0);
        for l in loads(&b) {
            prop_assert_eq!(l, LoadView::default());
        }
    }
}

#[test]
fn two_routers_see_each_others_load_and_spread_their_choices() {
    let (a, to_b) = telling_router();
    let (b, to_a) = telling_router();
    let (ia, ib) = (ReplicaId(1), ReplicaId(2));
    // Three long, unrelated prompts, alternately on A and B, each delivered before the next:
    // every one goes to an idle worker.
    let mut chosen = Vec::new();
    for i in 0..3u64 {
        let (r, id) = if i % 2 == 0 {
            (&a, 10 + i)
        } else {
            (&b, 20 + i)
        };
        chosen.push(route(r, id, &prompt(9 + i as u32, 0, 4000, i), None).unwrap());
        deliver(&to_b, ia, &b);
        deliver(&to_a, ib, &a);
    }
    chosen.sort();
    chosen.dedup();
    assert_eq!(
        chosen.len(),
        3,
        "each router saw the other's bookings: {chosen:?}"
    );
    assert_eq!(loads(&a), loads(&b));
    assert_eq!((a.active_requests(), a.remote_requests()), (2, 1));
    assert_eq!((b.active_requests(), b.remote_requests()), (1, 2));

    // Without delivery, B does not know: it piles onto a busy worker.
    let (c, _) = telling_router();
    let (d, _) = telling_router();
    let first = route(&c, 1, &prompt(1, 0, 4000, 1), None).unwrap();
    let second = route(&d, 2, &prompt(2, 0, 4000, 2), None).unwrap();
    assert_eq!(
        first, second,
        "two routers blind to each other choose alike"
    );
}

#[test]
fn a_shared_system_prompt_counts_once_across_routers() {
    let (a, to_b) = telling_router();
    let b = router();
    let p = prompt(3, 320, 16, 1);
    let rank = route(&a, 1, &p, None).unwrap();
    deliver(&to_b, ReplicaId(5), &b);
    let before = b.load(rank).unwrap().prompt_blocks;
    assert_eq!(before, 21);
    // B books the same prompt itself, pinned to the same rank: the shared blocks count once.
    let hints = RouteHints {
        pinned: Pinned {
            backend_instance: Some(rank.worker),
            dp_rank: Some(rank.dp_rank),
            ..Pinned::default()
        },
        ..RouteHints::default()
    };
    b.route(&RouteRequest {
        id: RequestId(1),
        tokens: &p,
        hints,
    })
    .unwrap();
    assert_eq!(b.load(rank).unwrap().prompt_blocks, before);
    assert_eq!(b.load(rank).unwrap().requests, 2);
    assert_eq!(b.drop_replica(ReplicaId(5)), 1);
    assert_eq!(b.load(rank).unwrap().prompt_blocks, before);
    assert_eq!(b.load(rank).unwrap().requests, 1);
}

#[test]
fn a_router_that_leaves_takes_its_bookings_with_it() {
    let (a, to_b) = telling_router();
    let b = router();
    for id in 1..=5 {
        route(&a, id, &prompt(1, 64, 40, id), Some(50)).unwrap();
    }
    a.prefill_done(RequestId(2)).unwrap();
    a.tokens_generated(RequestId(3), 33).unwrap();
    deliver(&to_b, ReplicaId(9), &b);
    assert_eq!(b.remote_requests(), 5);
    assert_eq!(b.drop_replica(ReplicaId(9)), 5);
    assert_eq!(b.drop_replica(ReplicaId(9)), 0);
    assert_eq!(b.remote_requests(), 0);
    for l in loads(&b) {
        assert_eq!(l, LoadView::default());
    }
    // Its late frees change nothing.
    a.free(RequestId(1)).unwrap();
    for d in lock(&to_b).drain(..) {
        assert!(matches!(
            b.apply_remote(ReplicaId(9), &d.as_delta()),
            Err(RemoteError::Load(LoadError::UnknownRequest { .. }))
        ));
    }
    assert_eq!(
        b.counts().ledger.unknown_requests,
        0,
        "a remote unknown is not this router's"
    );
}

#[test]
fn remote_bookings_expire_as_local_ones_do() {
    let (a, to_b) = telling_router();
    let b = router();
    route(&a, 1, &prompt(1, 0, 100, 1), None).unwrap();
    deliver(&to_b, ReplicaId(3), &b);
    assert_eq!(b.remote_requests(), 1);
    b.after(RouterConfig::default().request_expiry + Duration::from_secs(1));
    assert_eq!(b.expire(), 1);
    assert_eq!(b.remote_requests(), 0);
    assert_eq!(loads(&b), vec![LoadView::default(); WORKERS as usize]);
}

#[test]
fn bad_deltas_are_refused_and_change_nothing() {
    let b = router();
    let hashes = [LocalHash(1), LocalHash(2)];
    let booking = RemoteBooking {
        request: RequestId(1),
        rank: WorkerRank::new(0, 0),
        prefill_tokens: 40,
        block_hashes: &hashes,
        prompt_tokens: 40,
        cached_tokens: 0,
        expected_output_tokens: None,
    };
    let ok = BookingDelta::Booked(booking);
    assert_eq!(
        b.apply_remote(ReplicaId(0), &ok),
        Err(RemoteError::ReservedReplica)
    );
    let bad = [
        BookingDelta::Booked(RemoteBooking {
            rank: WorkerRank::new(99, 0),
            ..booking
        }),
        BookingDelta::Booked(RemoteBooking {
            prompt_tokens: 16,
            prefill_tokens: 16,
            ..booking
        }),
        BookingDelta::Booked(RemoteBooking {
            prefill_tokens: 41,
            ..booking
        }),
        BookingDelta::Booked(RemoteBooking {
            cached_tokens: 41,
            ..booking
        }),
        BookingDelta::PrefillDone(RequestId(1)),
        BookingDelta::Freed(RequestId(1)),
    ];
    for d in &bad {
        assert!(b.apply_remote(ReplicaId(4), d).is_err(), "{d:?}");
    }
    assert_eq!(loads(&b), vec![LoadView::default(); WORKERS as usize]);
    b.apply_remote(ReplicaId(4), &ok).unwrap();
    assert!(matches!(
        b.apply_remote(ReplicaId(4), &ok),
        Err(RemoteError::Load(LoadError::DuplicateRequest { .. }))
    ));
    assert_eq!(
        b.apply_remote(
            ReplicaId(4),
            &BookingDelta::OutputBlocks {
                request: RequestId(1),
                blocks: MAX_DELTA_OUTPUT_BLOCKS + 1,
                generated: 0,
            }
        ),
        Err(RemoteError::Malformed(
            "too many output blocks in one delta"
        ))
    );
    // The same id from another router is another booking; from this one, another request.
    b.apply_remote(ReplicaId(5), &ok).unwrap();
    route(&b, 1, &prompt(1, 0, 40, 1), None).unwrap();
    assert_eq!((b.remote_requests(), b.active_requests()), (2, 1));
    let l = loads(&b);
    assert_eq!(l.iter().map(|l| l.requests).sum::<u64>(), 3);
}

#[test]
fn near_ties_spread_the_choices_of_routers_blind_to_each_other() {
    // Two routers, their loads in step but slightly uneven over 8 workers; both route a new
    // prompt at once, before either hears of the other's. How often do they pick the same?
    let same_choices = |near_tie: f64| {
        let mut same = 0;
        for seed in 0..40u64 {
            let config = |s: u64| RouterConfig {
                near_tie,
                seed: s,
                ..RouterConfig::default()
            };
            let make = |s: u64| {
                let r = Router::new(config(s), PrefixIndex::new(IndexConfig::default())).unwrap();
                for w in 0..8 {
                    r.join_worker(WorkerConfig::simple(w, 100_000, BS)).unwrap();
                }
                r
            };
            let (a, b) = (make(2 * seed), make(2 * seed + 1));
            // Uneven load: worker w holds a request of 400 + 8w tokens, on both routers.
            for w in 0..8u64 {
                let tokens: Vec<u32> = (0..400 + 8 * w as u32)
                    .map(|t| t + 50_000 * w as u32)
                    .collect();
                for r in [&a, &b] {
                    let hints = RouteHints {
                        pinned: Pinned {
                            backend_instance: Some(WorkerId(w)),
                            ..Pinned::default()
                        },
                        ..RouteHints::default()
                    };
                    r.route(&RouteRequest {
                        id: RequestId(100 + w),
                        tokens: &tokens,
                        hints,
                    })
                    .unwrap();
                }
            }
            let p = prompt(77, 0, 400, seed);
            if route(&a, 1, &p, None) == route(&b, 1, &p, None) {
                same += 1;
            }
        }
        same
    };
    assert_eq!(
        same_choices(0.0),
        40,
        "without near ties both take the least loaded"
    );
    let spread = same_choices(0.05);
    assert!(
        spread < 20,
        "with near ties they spread: {spread} of 40 alike"
    );
}

/// A router that cannot hear the others (the sync down) is told its engines' own KV usage:
/// blocks past its bookings weigh in selection, its own bookings and load stay as they are,
/// and blocks it has booked itself are not counted twice.
#[test]
fn engine_reported_blocks_past_the_bookings_weigh_in_selection_only() {
    let r = router();
    let (busy, idle) = (WorkerRank::new(0, 0), WorkerRank::new(1, 0));
    assert!(r.set_engine_blocks(busy, 10_000));
    assert!(r.set_engine_blocks(WorkerRank::new(2, 0), 10_000));
    assert!(
        !r.set_engine_blocks(WorkerRank::new(9, 0), 1),
        "an unknown rank"
    );
    // Every fresh prompt goes to the one engine that says it is idle.
    for id in 1..=3 {
        assert_eq!(
            route(&r, id, &prompt(id as u32, 0, 64, id), None),
            Some(idle)
        );
    }
    assert_eq!(
        r.load(busy).unwrap(),
        LoadView::default(),
        "the bookings are the router's own"
    );
    // Forgotten: the engines' word no longer counts, and the busy ranks are chosen again.
    r.clear_engine_blocks();
    let chosen: Vec<_> = (4..=9)
        .map(|id| route(&r, id, &prompt(id as u32, 0, 64, id), None).unwrap())
        .collect();
    assert!(chosen.contains(&busy), "{chosen:?}");
    // Reported blocks no more than booked ones change nothing.
    let booked = r.load(idle).unwrap().decode_blocks();
    assert!(booked > 0);
    r.set_engine_blocks(idle, booked);
    let fleet = r.fleet();
    let i = fleet.rank_index(idle).unwrap();
    assert_eq!(
        fleet.ranks[i].state.selection_load(),
        fleet.ranks[i].state.load()
    );
    r.set_engine_blocks(idle, booked + 5);
    let lifted = fleet.ranks[i].state.selection_load();
    assert_eq!(
        lifted.prompt_blocks,
        fleet.ranks[i].state.load().prompt_blocks + 5
    );
}
