//! Routing under real conditions against a naive model: random interleavings of submits
//! (queued while every eligible worker is busy; with sessions, priorities and required labels),
//! frees, prefill completions, queue releases, taking and cancelling queued requests, session
//! expiries, health marks, worker leaves and request expiry, with approximate mode,
//! speculation and warm-up on. Checked after every step: the queue holds exactly the model's
//! waiting requests and their tokens, a request is released at most once and only if it
//! waited, every ResourceExhausted carries the model's numbers, frees succeed exactly for the
//! requests the model holds; at the end, once everything is freed, taken or cancelled, the load
//! is exactly zero and the queue's counters balance.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::{
    Admission, Approximate, BusyThresholds, Cancelled, Health, IndexConfig, KvEvents, Label,
    LoadError, PrefixIndex, PriorityClass, QueueOrder, Queueing, RequestId, RouteError, RouteHints,
    RouteRequest, Router, RouterConfig, SessionId, Speculative, TicketState, WarmUp, WorkerConfig,
    WorkerId,
};
use proptest::prelude::*;

use crate::common::{on_manual_clock, At};

const BS: u32 = 16;
const WORKERS: u64 = 4;
const CAP: u64 = 700;
const ZONE_A: [Label<'static>; 1] = [Label {
    key: "zone",
    value: "a",
}];

fn worker(w: u64) -> WorkerConfig {
    let zone = if w < 2 { "a" } else { "b" };
    WorkerConfig {
        labels: vec![("zone".to_string(), zone.to_string())],
        // Busy over 8 active blocks.
        ..WorkerConfig::simple(w, 16, BS)
    }
}

fn events(w: u64) -> KvEvents {
    if w == 3 {
        KvEvents::Absent
    } else {
        KvEvents::Published
    }
}

fn router(order: QueueOrder) -> Router {
    let config = RouterConfig {
        busy: BusyThresholds {
            decode_blocks_fraction: Some(0.5),
            prefill_tokens_fraction: None,
        },
        queue: Queueing::On {
            max_queued_tokens: CAP,
            order,
        },
        session_idle_ttl: Duration::from_secs(5),
        approximate: Approximate {
            speculative: Speculative::On {
                ttl: Duration::from_secs(1),
            },
            ..Approximate::default()
        },
        warm_up: WarmUp::On {
            share: 0.5,
            duration: Duration::from_secs(3),
            low_share: 0.1,
        },
        ..RouterConfig::default()
    };
    let r = on_manual_clock(config, PrefixIndex::new(IndexConfig::default()));
    for w in 0..WORKERS {
        r.join_worker(WorkerConfig {
            kv_events: events(w),
            ..worker(w)
        })
        .unwrap();
    }
    r
}

#[derive(Clone, Debug)]
enum Op {
    Submit {
        id: u64,
        len: usize,
        sys: bool,
        session: Option<u64>,
        class: u8,
        jump: u8,
        zone_a: bool,
    },
    Free(u64),
    PrefillDone(u64),
    Release,
    Take(u64),
    Cancel(u64),
    ExpireSessions,
    Health(u64, u8),
    Leave(u64),
    ExpireRequests,
    Tick,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..24u64, 1..200usize, any::<bool>(), proptest::option::of(0..4u64), 0..2u8, 0..3u8, any::<bool>())
            .prop_map(|(id, len, sys, session, class, jump, zone_a)| Op::Submit { id, len, sys, session, class, jump, zone_a }),
        4 => (0..24u64).prop_map(Op::Free),
        1 => (0..24u64).prop_map(Op::PrefillDone),
        1 => Just(Op::Release),
        3 => (0..24u64).prop_map(Op::Take),
        2 => (0..24u64).prop_map(Op::Cancel),
        1 => Just(Op::ExpireSessions),
        1 => (0..WORKERS, 0..3u8).prop_map(|(w, h)| Op::Health(w, h)),
        1 => (0..WORKERS).prop_map(Op::Leave),
        1 => Just(Op::ExpireRequests),
        1 => Just(Op::Tick),
    ]
}

/// A released request whose outcome was not taken yet, with what could have dropped its
/// booking since its release.
#[derive(Debug, Clone, Copy)]
struct ReleasedAt {
    leaves: [u64; WORKERS as usize],
    expiries: u64,
}

#[derive(Debug, Default)]
struct Model {
    /// Booked requests the caller holds: id → worker.
    active: HashMap<u64, WorkerId>,
    /// Waiting in the queue: id → prompt tokens.
    queued: HashMap<u64, u64>,
    released: HashMap<u64, ReleasedAt>,
    leaves: [u64; WORKERS as usize],
    expiries: u64,
    /// Every id ever released (a second release of one submit is a bug).
    released_ever: HashSet<(u64, u64)>,
    /// Submissions per id, to tell one submit's release from another's.
    submits: HashMap<u64, u64>,
}

impl Model {
    fn known(&self, id: u64) -> bool {
        self.active.contains_key(&id)
            || self.queued.contains_key(&id)
            || self.released.contains_key(&id)
    }

    /// Moves the requests the router released since the last look.
    fn observe(&mut self, r: &Router) -> Result<(), TestCaseError> {
        let ids: Vec<u64> = self.queued.keys().copied().collect();
        for id in ids {
            match r.ticket_state(RequestId(id)) {
                TicketState::Waiting => {}
                TicketState::Released => {
                    self.queued.remove(&id);
                    let nth = self.submits[&id];
                    prop_assert!(self.released_ever.insert((id, nth)), "released twice");
                    let at = ReleasedAt {
                        leaves: self.leaves,
                        expiries: self.expiries,
                    };
                    self.released.insert(id, at);
                }
                TicketState::Unknown => prop_assert!(false, "queued request {id} lost"),
            }
        }
        Ok(())
    }

    /// The outcome of a released request was taken: is its booking still alive?
    fn alive(&self, at: ReleasedAt, worker: WorkerId) -> bool {
        at.expiries == self.expiries
            && at.leaves[worker.0 as usize] == self.leaves[worker.0 as usize]
    }
}

fn tokens(id: u64, len: usize, sys: bool, nth: u64) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            if sys && i < 64 {
                i
            } else {
                1_000_000 + (id as u32) * 10_000 + (nth as u32) * 1_000 + i
            }
        })
        .collect()
}

fn run(order: QueueOrder, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let r = router(order);
    let ended = Arc::new(AtomicU64::new(0));
    let sink = Arc::clone(&ended);
    r.on_session_end(move |_| {
        sink.fetch_add(1, Ordering::Relaxed);
    });
    let t0 = Instant::now();
    let mut now = t0;
    let mut horizon = t0;
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Submit {
                id,
                len,
                sys,
                session,
                class,
                jump,
                zone_a,
            } => {
                let nth = m.submits.get(&id).copied().unwrap_or(0) + 1;
                let t = tokens(id, len, sys, nth);
                let mut q = RouteRequest {
                    id: RequestId(id),
                    tokens: &t,
                    hints: RouteHints::default(),
                };
                q.hints.session = session.map(SessionId);
                q.hints.priority_class = PriorityClass(class);
                q.hints.priority_jump = f64::from(jump);
                if zone_a {
                    q.hints.required = &ZONE_A;
                }
                match r.at(now).submit(&q) {
                    Ok(Admission::Routed(d)) => {
                        prop_assert!(!m.known(id));
                        m.submits.insert(id, nth);
                        m.active.insert(id, d.worker.worker);
                    }
                    Ok(Admission::Queued(ticket)) => {
                        prop_assert!(!m.known(id));
                        prop_assert_eq!(ticket.request, RequestId(id));
                        m.submits.insert(id, nth);
                        m.queued.insert(id, len as u64);
                    }
                    Err(RouteError::ResourceExhausted {
                        request,
                        request_tokens,
                        queued_tokens,
                        cap_tokens,
                    }) => {
                        prop_assert!(!m.known(id));
                        let model_queued: u64 = m.queued.values().sum();
                        prop_assert_eq!(
                            (request, request_tokens, cap_tokens),
                            (RequestId(id), len as u64, CAP)
                        );
                        prop_assert_eq!(queued_tokens, model_queued);
                        prop_assert!(queued_tokens + request_tokens > cap_tokens);
                    }
                    Err(RouteError::Load(LoadError::DuplicateRequest { .. })) => {
                        prop_assert!(m.known(id))
                    }
                    Err(RouteError::Load(LoadError::RankRetired { .. })) => {}
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                }
            }
            // A released request's booking is the caller's only once its outcome is taken (a
            // caller that gives up on it cancels), so the model frees only what it holds.
            Op::Free(id) | Op::PrefillDone(id) if m.released.contains_key(&id) => {}
            Op::Free(id) => {
                let held = m.active.remove(&id).is_some();
                prop_assert_eq!(r.free(RequestId(id)).is_ok(), held, "free {}", id);
            }
            Op::PrefillDone(id) => {
                prop_assert_eq!(
                    r.prefill_done(RequestId(id)).is_ok(),
                    m.active.contains_key(&id)
                );
            }
            Op::Release => {
                r.at(now).release_queued();
            }
            Op::Take(id) => {
                m.observe(&r)?;
                match r.take_released(RequestId(id)) {
                    Some(Ok(d)) => {
                        let at = m.released.remove(&id);
                        prop_assert!(at.is_some(), "taken without a release: {}", id);
                        if let Some(at) = at {
                            if m.alive(at, d.worker.worker) {
                                m.active.insert(id, d.worker.worker);
                            }
                        }
                    }
                    Some(Err(RouteError::NotQueued { .. })) => {
                        prop_assert!(!m.released.contains_key(&id) && !m.queued.contains_key(&id));
                    }
                    Some(Err(_)) => {
                        prop_assert!(m.released.remove(&id).is_some());
                    }
                    None => prop_assert!(m.queued.contains_key(&id)),
                }
            }
            Op::Cancel(id) => {
                m.observe(&r)?;
                match r.cancel_queued(RequestId(id)) {
                    Ok(Cancelled::Waiting) => prop_assert!(m.queued.remove(&id).is_some()),
                    Ok(Cancelled::Released) => prop_assert!(m.released.remove(&id).is_some()),
                    Err(RouteError::NotQueued { .. }) => {
                        prop_assert!(!m.queued.contains_key(&id) && !m.released.contains_key(&id))
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                }
            }
            Op::ExpireSessions => {
                now += Duration::from_secs(3);
                r.at(now).expire_sessions();
            }
            Op::Health(w, h) => {
                let h = [Health::Healthy, Health::Unreachable, Health::Wedged][h as usize];
                r.set_health(WorkerId(w), h).unwrap();
            }
            Op::Leave(w) => {
                m.observe(&r)?;
                m.active.retain(|_, worker| *worker != WorkerId(w));
                m.leaves[w as usize] += 1;
                r.leave_worker(WorkerId(w)).unwrap();
                r.join_worker(WorkerConfig {
                    kv_events: events(w),
                    ..worker(w)
                })
                .unwrap();
            }
            Op::ExpireRequests => {
                m.observe(&r)?;
                // Past every booking's stamp: the test's time, or an earlier expiry's (the
                // releases it drove were stamped then). The test's time itself stays well
                // within one request expiry of its start, so that ticks never expire anything.
                horizon = horizon.max(now) + r.config().request_expiry + Duration::from_secs(1);
                r.at(horizon).expire();
                m.active.clear();
                m.expiries += 1;
            }
            Op::Tick => {
                now += Duration::from_millis(700);
                r.at(now).expire();
            }
        }
        m.observe(&r)?;
        let st = r.queue_stats().unwrap();
        prop_assert_eq!(st.depth, m.queued.len());
        prop_assert_eq!(st.queued_tokens, m.queued.values().sum::<u64>());
        prop_assert_eq!(st.released_untaken, m.released.len());
        let c = r.counts();
        prop_assert_eq!(
            ended.load(Ordering::Relaxed),
            c.sessions_expired + c.sessions_closed
        );
    }
    // Drain: every worker healthy, free what is held, take what is released, until nothing
    // waits; then nothing may remain booked.
    for w in 0..WORKERS {
        r.set_health(WorkerId(w), Health::Healthy).unwrap();
    }
    for _ in 0..1000 {
        for (id, _) in std::mem::take(&mut m.active) {
            r.free(RequestId(id)).unwrap();
        }
        r.at(now).release_queued();
        m.observe(&r)?;
        let released: Vec<(u64, ReleasedAt)> = m.released.drain().collect();
        for (id, at) in released {
            match r.take_released(RequestId(id)) {
                Some(Ok(d)) if m.alive(at, d.worker.worker) => {
                    m.active.insert(id, d.worker.worker);
                }
                Some(_) => {}
                None => prop_assert!(false, "released {id} has no outcome"),
            }
        }
        if m.queued.is_empty() && m.active.is_empty() {
            break;
        }
    }
    prop_assert!(
        m.queued.is_empty(),
        "requests stuck in the queue: {:?}",
        m.queued
    );
    prop_assert!(r.total_load().is_idle(), "{:?}", r.total_load());
    prop_assert_eq!(r.active_requests(), 0);
    let st = r.queue_stats().unwrap();
    prop_assert_eq!(st.enqueued, st.released + st.cancelled_waiting);
    let c = r.counts().ledger;
    prop_assert_eq!(c.booked, c.freed + c.expired + c.purged + c.retired_races);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn fcfs_nothing_lost_released_twice_or_freed_twice(ops in proptest::collection::vec(op(), 1..120)) {
        run(QueueOrder::Fcfs, ops)?;
    }

    #[test]
    fn wspt_nothing_lost_released_twice_or_freed_twice(ops in proptest::collection::vec(op(), 1..120)) {
        run(QueueOrder::Wspt, ops)?;
    }
}
