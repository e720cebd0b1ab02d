use crate::common::*;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

const BS: u32 = 16;

/// One worker of 10 blocks, busy over 5 active blocks: a 96-token (6-block) request makes
/// it busy.
fn busy_router(order: QueueOrder, cap: u64) -> Router {
    let r = on_manual_clock(
        RouterConfig {
            busy: BusyThresholds {
                decode_blocks_fraction: Some(0.5),
                prefill_tokens_fraction: None,
            },
            queue: Queueing::On {
                max_queued_tokens: cap,
                order,
            },
            ..RouterConfig::default()
        },
        PrefixIndex::new(IndexConfig::default()),
    );
    r.join_worker(WorkerConfig::simple(1, 10, BS)).unwrap();
    r
}

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_000 + i).collect()
}

fn req(id: u64, tokens: &[u32]) -> RouteRequest<'_> {
    RouteRequest {
        id: RequestId(id),
        tokens,
        hints: RouteHints::default(),
    }
}

fn queued(a: Admission) -> Ticket {
    match a {
        Admission::Queued(t) => t,
        Admission::Routed(d) => panic!("routed {d:?}"),
    }
}

#[test]
fn submit_queues_while_busy_and_frees_release_in_fcfs_order_with_jumps() {
    let r = busy_router(QueueOrder::Fcfs, 10_000);
    let t0 = Instant::now();
    let (a, b, c) = (toks(1, 96), toks(2, 96), toks(3, 96));
    assert!(matches!(
        r.at(t0).submit(&req(1, &a)),
        Ok(Admission::Routed(_))
    ));
    let tb = queued(
        r.at(t0 + Duration::from_secs(1))
            .submit(&req(2, &b))
            .unwrap(),
    );
    // Arrives a second later with a 1.5 s jump: goes ahead of request 2.
    let mut qc = req(3, &c);
    qc.hints.priority_jump = 1.5;
    let tc = queued(r.at(t0 + Duration::from_secs(2)).submit(&qc).unwrap());
    let st = r.queue_stats().unwrap();
    assert_eq!((st.depth, st.queued_tokens, st.enqueued), (2, 192, 2));
    assert!(r.take_released(tb.request).is_none());
    // Freeing request 1 lets one request go: request 3, which makes the worker busy again.
    r.free(RequestId(1)).unwrap();
    let d3 = r.take_released(tc.request).unwrap().unwrap();
    assert_eq!(d3.request, RequestId(3));
    assert!(r.take_released(tb.request).is_none(), "still waiting");
    r.free(RequestId(3)).unwrap();
    assert_eq!(
        r.take_released(tb.request).unwrap().unwrap().request,
        RequestId(2)
    );
    assert_eq!(
        r.take_released(tb.request),
        Some(Err(RouteError::NotQueued {
            request: RequestId(2)
        })),
        "handed out once"
    );
    let st = r.queue_stats().unwrap();
    assert_eq!((st.depth, st.released, st.wait_us.len()), (0, 2, 2));
    r.free(RequestId(2)).unwrap();
    assert!(r.total_load().is_idle());
}

#[test]
fn route_never_queues_and_submit_without_a_queue_routes() {
    let r = busy_router(QueueOrder::Fcfs, 10_000);
    r.route(&req(1, &toks(1, 96))).unwrap();
    let d = r.route(&req(2, &toks(2, 96))).unwrap();
    assert_eq!(d.decided_by, DecidedBy::FallbackAllBusy);
    let plain = on_manual_clock(
        RouterConfig::default(),
        PrefixIndex::new(IndexConfig::default()),
    );
    plain.join_worker(WorkerConfig::simple(1, 10, BS)).unwrap();
    assert!(matches!(
        plain.submit(&req(1, &toks(1, 96))),
        Ok(Admission::Routed(_))
    ));
    assert!(plain.queue_stats().is_none());
}

#[test]
fn over_the_cap_is_resource_exhausted_with_exact_numbers() {
    let r = busy_router(QueueOrder::Fcfs, 150);
    let t0 = Instant::now();
    r.at(t0).submit(&req(1, &toks(1, 96))).unwrap();
    queued(r.at(t0).submit(&req(2, &toks(2, 96))).unwrap());
    let e = r.at(t0).submit(&req(3, &toks(3, 80))).unwrap_err();
    assert_eq!(
        e,
        RouteError::ResourceExhausted {
            request: RequestId(3),
            request_tokens: 80,
            queued_tokens: 96,
            cap_tokens: 150,
        }
    );
    assert!(e.is_retryable());
    assert!(
        e.to_string().contains("96 tokens already queued, cap 150"),
        "{e}"
    );
    // 54 more tokens fit exactly.
    queued(r.at(t0).submit(&req(4, &toks(4, 54))).unwrap());
    let st = r.queue_stats().unwrap();
    assert_eq!(
        (st.rejected, st.queued_tokens, st.cap_tokens),
        (1, 150, 150)
    );
    // A second submit of a waiting id is a duplicate, not a second entry.
    assert!(matches!(
        r.at(t0).submit(&req(2, &toks(2, 10))),
        Err(RouteError::Load(LoadError::DuplicateRequest { .. }))
    ));
    assert!(!RouteError::NoTokens {
        request: RequestId(1)
    }
    .is_retryable());
}

/// A submit once queued an id that was already booked (the ledger checks duplicates
/// only when booking), so its release failed and the caller saw two outcomes for one id.
#[test]
fn submit_of_a_booked_id_is_a_duplicate_not_a_queue_entry() {
    let r = busy_router(QueueOrder::Fcfs, 10_000);
    let t0 = Instant::now();
    r.at(t0).submit(&req(1, &toks(1, 96))).unwrap();
    assert_eq!(
        r.at(t0).submit(&req(1, &toks(1, 16))).unwrap_err(),
        RouteError::Load(LoadError::DuplicateRequest {
            request: RequestId(1)
        })
    );
    assert_eq!(r.queue_stats().unwrap().depth, 0);
    assert_eq!(r.counts().duplicate_admissions, 1);
}

/// Cancelling a released request whose booking already went (its worker left) once
/// reported an error although the cancel took effect.
#[test]
fn cancel_after_the_released_booking_was_purged_still_cancels() {
    let r = busy_router(QueueOrder::Fcfs, 10_000);
    let t0 = Instant::now();
    r.at(t0).submit(&req(1, &toks(1, 96))).unwrap();
    let t = queued(r.at(t0).submit(&req(2, &toks(2, 96))).unwrap());
    r.free(RequestId(1)).unwrap();
    assert_eq!(r.ticket_state(t.request), TicketState::Released);
    r.leave_worker(WorkerId(1)).unwrap();
    assert_eq!(r.cancel_queued(t.request), Ok(Cancelled::Released));
    assert_eq!(r.ticket_state(t.request), TicketState::Unknown);
    assert_eq!(r.active_requests(), 0);
}

#[test]
fn wspt_releases_the_shortest_new_prefill_first() {
    let r = busy_router(QueueOrder::Wspt, 10_000);
    let t0 = Instant::now();
    r.at(t0).submit(&req(1, &toks(1, 96))).unwrap();
    queued(r.at(t0).submit(&req(2, &toks(2, 160))).unwrap());
    queued(
        r.at(t0 + Duration::from_secs(5))
            .submit(&req(3, &toks(3, 112)))
            .unwrap(),
    );
    let t4 = toks(4, 160);
    let mut q4 = req(4, &t4);
    q4.hints.priority_class = PriorityClass(1);
    queued(r.at(t0 + Duration::from_secs(9)).submit(&q4).unwrap());
    let mut order = Vec::new();
    let mut active = 1u64;
    while order.len() < 3 {
        r.free(RequestId(active)).unwrap();
        let mut got = Vec::new();
        r.drain_released(|id, d| {
            d.unwrap();
            got.push(id.0)
        });
        assert_eq!(got.len(), 1, "one at a time: each makes the worker busy");
        active = got[0];
        order.push(active);
    }
    assert_eq!(order, vec![4, 3, 2], "class first, then shortest");
}

struct CountWake(AtomicU64);
impl std::task::Wake for CountWake {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn cancel_removes_exactly_once_and_the_future_wakes_and_resolves() {
    let r = Arc::new(busy_router(QueueOrder::Fcfs, 10_000));
    let t0 = Instant::now();
    r.at(t0).submit(&req(1, &toks(1, 96))).unwrap();
    let t2 = queued(r.at(t0).submit(&req(2, &toks(2, 96))).unwrap());
    let t3 = queued(r.at(t0).submit(&req(3, &toks(3, 96))).unwrap());
    // Waiting: leaves the queue once.
    assert_eq!(r.cancel_queued(t2.request), Ok(Cancelled::Waiting));
    assert_eq!(
        r.cancel_queued(t2.request),
        Err(RouteError::NotQueued {
            request: RequestId(2)
        })
    );
    // A future registers its waker, is woken at release and resolves once.
    let counter = Arc::new(CountWake(AtomicU64::new(0)));
    let waker = Waker::from(Arc::clone(&counter));
    let mut cx = Context::from_waker(&waker);
    let mut fut = Router::wait(Arc::clone(&r), t3);
    assert!(Pin::new(&mut fut).poll(&mut cx).is_pending());
    r.free(RequestId(1)).unwrap();
    assert_eq!(counter.0.load(Ordering::Relaxed), 1);
    match Pin::new(&mut fut).poll(&mut cx) {
        Poll::Ready(Ok(d)) => assert_eq!(d.request, RequestId(3)),
        other => panic!("{other:?}"),
    }
    drop(fut);
    assert_eq!(r.active_requests(), 1, "a resolved future cancels nothing");
    // Released but untaken, then cancelled: the booking is freed.
    let t4 = queued(r.at(t0).submit(&req(4, &toks(4, 96))).unwrap());
    r.free(RequestId(3)).unwrap();
    assert_eq!(r.active_requests(), 1);
    assert_eq!(r.cancel_queued(t4.request), Ok(Cancelled::Released));
    assert!(r.total_load().is_idle());
    assert!(r.cancel_queued(t4.request).is_err());
    // A future dropped while waiting cancels its request.
    r.at(t0).submit(&req(5, &toks(5, 96))).unwrap();
    let t6 = queued(r.at(t0).submit(&req(6, &toks(6, 96))).unwrap());
    let mut fut = Router::wait(Arc::clone(&r), t6);
    assert!(Pin::new(&mut fut).poll(&mut cx).is_pending());
    drop(fut);
    let st = r.queue_stats().unwrap();
    assert_eq!(
        (st.depth, st.cancelled_waiting, st.cancelled_released),
        (0, 2, 1)
    );
    r.free(RequestId(5)).unwrap();
    assert!(r.total_load().is_idle());
}

/// The engine's own word can make a rank busy (a replica cut off from the others): a request
/// waits, and is released when that word falls, with no free of this router's to wake it.
#[test]
fn engine_reported_blocks_queue_a_request_until_they_fall() {
    let r = busy_router(QueueOrder::Fcfs, 10_000);
    let rank = WorkerRank::new(1, 0);
    assert!(r.set_engine_blocks(rank, 8));
    let a = toks(1, 32);
    let t = queued(r.submit(&req(1, &a)).unwrap());
    assert!(r.take_released(t.request).is_none());
    // Still over the threshold: nothing moves.
    r.set_engine_blocks(rank, 7);
    assert!(r.take_released(t.request).is_none());
    r.clear_engine_blocks();
    let d = r.take_released(t.request).unwrap().unwrap();
    assert_eq!(d.worker, rank);
    r.free(RequestId(1)).unwrap();
    assert!(r.total_load().is_idle());
}
