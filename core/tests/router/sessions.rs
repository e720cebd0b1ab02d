use crate::common::*;

const BS: u32 = 16;

fn router() -> Router {
    let r = on_manual_clock(
        RouterConfig {
            session_idle_ttl: Duration::from_secs(30),
            ..RouterConfig::default()
        },
        PrefixIndex::new(IndexConfig::default()),
    );
    for w in 1..=4 {
        r.join_worker(WorkerConfig {
            dp_size: 2,
            ..WorkerConfig::simple(w, 1000, BS)
        })
        .unwrap();
    }
    r
}

fn turn(r: &Router, id: u64, session: u64, now: Instant) -> Decision {
    let t: Vec<u32> = (0..48).map(|i| (id as u32) * 1000 + i).collect();
    let mut q = RouteRequest {
        id: RequestId(id),
        tokens: &t,
        hints: RouteHints::default(),
    };
    q.hints.session = Some(SessionId(session));
    r.at(now).route(&q).unwrap()
}

#[test]
fn a_session_sticks_to_its_rank_and_is_rerouted_when_its_worker_left() {
    let r = router();
    let t0 = Instant::now();
    let first = turn(&r, 1, 7, t0);
    assert_eq!(first.session, Some(SessionRouting::Bound));
    assert_eq!(r.session_rank(SessionId(7)), Some(first.worker));
    // Later turns go to the same (worker, dp rank), whatever the load says.
    for id in 2..10 {
        let d = turn(&r, id, 7, t0);
        assert_eq!(d.worker, first.worker);
        assert_eq!(
            (d.session, d.decided_by),
            (Some(SessionRouting::Sticky), DecidedBy::Session)
        );
    }
    r.leave_worker(first.worker.worker).unwrap();
    let d = turn(&r, 10, 7, t0);
    assert_ne!(d.worker.worker, first.worker.worker);
    assert_eq!(
        d.session,
        Some(SessionRouting::Rerouted {
            previous: first.worker
        })
    );
    assert_eq!(r.session_rank(SessionId(7)), Some(d.worker), "rebound");
    assert_eq!(turn(&r, 11, 7, t0).session, Some(SessionRouting::Sticky));
    let c = r.counts();
    assert_eq!((c.sessions_bound, c.sessions_rerouted), (1, 1));
}

#[test]
fn idle_sessions_expire_through_the_callback() {
    let r = router();
    let ended = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&ended);
    r.on_session_end(move |e| lock(&sink).push(e));
    let t0 = Instant::now();
    let a = turn(&r, 1, 1, t0);
    turn(&r, 2, 2, t0 + Duration::from_secs(20));
    r.free(RequestId(1)).unwrap();
    r.free(RequestId(2)).unwrap();
    // The frees read the clock (after t0 + 0): session 1 was last used then.
    let late = Instant::now() + Duration::from_secs(60);
    assert_eq!(r.at(t0 + Duration::from_secs(29)).expire_sessions(), 0);
    assert_eq!(r.at(late).expire_sessions(), 2);
    let got = lock(&ended).clone();
    assert_eq!(got.len(), 2);
    assert!(got.contains(&SessionEnd {
        session: SessionId(1),
        worker: a.worker,
        reason: SessionEndReason::Expired
    }));
    assert_eq!(r.counts().sessions_expired, 2);
    assert_eq!(turn(&r, 3, 1, late).session, Some(SessionRouting::Bound));
}

/// A session whose request is still generating does not expire, however long it runs.
#[test]
fn a_running_request_keeps_its_session() {
    let r = router();
    let t0 = Instant::now();
    turn(&r, 1, 1, t0);
    assert_eq!(r.at(t0 + Duration::from_secs(3600)).expire_sessions(), 0);
    r.free(RequestId(1)).unwrap();
    assert_eq!(
        r.at(t0 + Duration::from_secs(3600 + 31)).expire_sessions(),
        1
    );
}

#[test]
fn a_close_with_a_request_is_deferred_until_it_ends() {
    let r = router();
    let ended = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&ended);
    r.on_session_end(move |e| lock(&sink).push(e));
    let t0 = Instant::now();
    let first = turn(&r, 1, 5, t0);
    let t: Vec<u32> = (0..48).collect();
    let mut q = RouteRequest {
        id: RequestId(2),
        tokens: &t,
        hints: RouteHints::default(),
    };
    q.hints.session = Some(SessionId(5));
    q.hints.session_close = SessionClose::AfterThisRequest;
    r.at(t0).route(&q).unwrap();
    r.free(RequestId(1)).unwrap();
    assert!(lock(&ended).is_empty(), "request 2 still generates");
    assert_eq!(r.session_rank(SessionId(5)), Some(first.worker));
    r.output_block(RequestId(2)).unwrap();
    r.free(RequestId(2)).unwrap();
    assert_eq!(
        lock(&ended).clone(),
        vec![SessionEnd {
            session: SessionId(5),
            worker: first.worker,
            reason: SessionEndReason::Closed
        }]
    );
    assert_eq!(r.session_rank(SessionId(5)), None);
    // Closed with a request that then expired: the sweep closes it.
    r.at(t0).route(&q).unwrap();
    assert_eq!(r.at(Instant::now() + r.config().request_expiry).expire(), 1);
    assert_eq!(r.at(t0).expire_sessions(), 1);
    assert_eq!(lock(&ended).len(), 2);
    assert_eq!(r.counts().sessions_closed, 2);
    assert_eq!(r.close_session(SessionId(5)), None);
}
