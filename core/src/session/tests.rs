use super::*;

#[test]
fn idle_sessions_expire_only_after_their_last_request_ended() {
    let s = Sessions::default();
    let t0 = Instant::now();
    let ttl = Duration::from_secs(10);
    let r = WorkerRank::new(1, 0);
    s.record(SessionId(1), r, RequestId(1), t0, SessionClose::Keep);
    s.record(SessionId(2), r, RequestId(2), t0, SessionClose::Keep);
    let mut out = Vec::new();
    s.sweep(t0 + Duration::from_secs(9), ttl, |_| false, &mut out);
    assert!(out.is_empty());
    // Request 2 still runs: its session stays past the TTL.
    s.sweep(
        t0 + Duration::from_secs(10),
        ttl,
        |r| r == RequestId(2),
        &mut out,
    );
    assert_eq!(
        out,
        vec![SessionEnd {
            session: SessionId(1),
            worker: r,
            reason: SessionEndReason::Expired
        }]
    );
    assert_eq!(s.len(), 1);
    // Its end counts as use.
    assert!(s
        .request_ended(SessionId(2), RequestId(2), t0 + Duration::from_secs(12))
        .is_none());
    out.clear();
    s.sweep(t0 + Duration::from_secs(21), ttl, |_| false, &mut out);
    assert!(out.is_empty());
    s.sweep(t0 + Duration::from_secs(22), ttl, |_| false, &mut out);
    assert_eq!(out.len(), 1);
    assert!(s.is_empty());
}

#[test]
fn a_close_with_a_request_waits_for_that_request() {
    let s = Sessions::default();
    let t0 = Instant::now();
    let r = WorkerRank::new(1, 0);
    s.record(
        SessionId(1),
        r,
        RequestId(1),
        t0,
        SessionClose::AfterThisRequest,
    );
    assert_eq!(s.request_ended(SessionId(1), RequestId(7), t0), None);
    assert_eq!(s.bound(SessionId(1)), Some(r));
    let end = s.request_ended(SessionId(1), RequestId(1), t0).unwrap();
    assert_eq!(end.reason, SessionEndReason::Closed);
    assert_eq!(s.bound(SessionId(1)), None);
    // A close whose request ended without a free (expired, worker lost) goes at the sweep.
    s.record(
        SessionId(2),
        r,
        RequestId(2),
        t0,
        SessionClose::AfterThisRequest,
    );
    let mut out = Vec::new();
    s.sweep(t0, Duration::from_secs(100), |_| true, &mut out);
    assert!(out.is_empty());
    s.sweep(t0, Duration::from_secs(100), |_| false, &mut out);
    assert_eq!(out[0].reason, SessionEndReason::Closed);
    assert_eq!(s.close(SessionId(2)), None, "ended once");
}
