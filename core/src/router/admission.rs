//! The admission queue as the router drives it: submit, release, the waiters' tickets and
//! futures, cancels.

use std::collections::HashMap;
use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use hdrhistogram::Histogram;

use super::plan::{Gate, Now};
use super::route::Routed;
use super::{
    bump, histogram_upto, lock, record, Bookkeeping, Decision, Label, Phase, PoolHits,
    PreferredLabel, RouteError, RouteHints, RouteRequest, Router,
};
use crate::event::WorkerId;
use crate::load::{LoadError, RequestId};
use crate::queue::{AdmissionQueue, OrderInput, Refused, Waiting};

/// A request admitted by [`Router::submit`]: routed now, or waiting in the queue. The decision
/// stays inline, as [`Router::route`] returns it: boxing it would allocate per admission.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Admission {
    /// Routed now: the decision, as [`Router::route`] returns it.
    Routed(Decision),
    /// Waiting; its decision arrives through [`Router::poll_released`],
    /// [`Router::take_released`], [`Router::drain_released`] or [`Router::wait`].
    Queued(Ticket),
}

/// A queued request's claim on its decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket {
    /// The queued request.
    pub request: RequestId,
}

/// Where a submitted request stands in the queue ([`Router::ticket_state`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TicketState {
    /// In the queue.
    Waiting,
    /// Released; its outcome waits to be taken.
    Released,
    /// Neither: never queued, taken, or cancelled.
    Unknown,
}

/// What a cancel removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// The request was still waiting: it leaves the queue, nothing was booked.
    Waiting,
    /// It had been released but its decision not taken: the booking is freed.
    Released,
}

/// A queued request, owned (the caller's buffers need not outlive the wait).
#[derive(Debug)]
pub(super) struct OwnedRequest {
    pub(super) tokens: Vec<u32>,
    pub(super) lora_name: Option<String>,
    pub(super) cache_salt: Option<String>,
    pub(super) allowed: Option<Vec<WorkerId>>,
    pub(super) required: Vec<(String, String)>,
    pub(super) preferred: Vec<(String, String, f64)>,
    /// The pool's hits (`None` without an answer: a failed one was counted at admission).
    pub(super) pool: Option<Vec<std::ops::Range<u32>>>,
    /// The hints with every borrowed field empty; [`OwnedRequest::request`] fills them in.
    pub(super) hints: RouteHints<'static>,
    pub(super) eligibility: Eligibility,
}

/// Which ranks may serve a queued request, in a canonical form: its phase, required labels
/// and allowed workers.
///
/// Whether a rank is busy (or marked unhealthy) does not depend on the request asking, so a
/// request waits exactly when every rank its eligibility admits is busy. Two requests of equal
/// eligibility therefore wait or go together, and a request that admits every rank of its
/// phase waits only when the whole phase is busy, and then so does every request of that
/// phase. The queue gives each eligibility a lane of its own, and a release pass tries a lane
/// only until one of its requests waits: a waiting head does not hold back requests that
/// other ranks could serve, and a pass ends once every lane with a request has waited.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Eligibility {
    /// A hash of the rest, compared first.
    pub(super) key: u64,
    pub(super) phase: Phase,
    /// Sorted, without repeats.
    pub(super) required: Vec<(String, String)>,
    /// Sorted, without repeats.
    pub(super) allowed: Option<Vec<WorkerId>>,
}

impl std::hash::Hash for Eligibility {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key.hash(state);
    }
}

impl Eligibility {
    pub(super) fn of(req: &RouteRequest<'_>) -> Self {
        let h = &req.hints;
        let mut required: Vec<(String, String)> = h
            .required
            .iter()
            .map(|l| (l.key.to_owned(), l.value.to_owned()))
            .collect();
        required.sort();
        required.dedup();
        let allowed = h.allowed.map(|a| {
            let mut a = a.to_vec();
            a.sort();
            a.dedup();
            a
        });
        let key = {
            use std::hash::{Hash, Hasher};
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            (h.phase as u8, &required, &allowed).hash(&mut hasher);
            hasher.finish()
        };
        Eligibility {
            key,
            phase: h.phase,
            required,
            allowed,
        }
    }

    /// True when it admits every rank of its phase.
    pub(super) fn whole_phase(&self) -> bool {
        self.required.is_empty() && self.allowed.is_none()
    }
}

/// Label slices rebuilt from an owned request's strings, for one route.
#[derive(Debug, Default)]
pub(super) struct LabelBufs<'a> {
    pub(super) required: Vec<Label<'a>>,
    pub(super) preferred: Vec<PreferredLabel<'a>>,
}

impl OwnedRequest {
    pub(super) fn new(req: &RouteRequest<'_>) -> Self {
        let h = &req.hints;
        OwnedRequest {
            tokens: req.tokens.to_vec(),
            lora_name: h.lora_name.map(str::to_owned),
            cache_salt: h.cache_salt.map(str::to_owned),
            allowed: h.allowed.map(<[WorkerId]>::to_vec),
            required: h
                .required
                .iter()
                .map(|l| (l.key.to_owned(), l.value.to_owned()))
                .collect(),
            preferred: h
                .preferred
                .iter()
                .map(|p| (p.label.key.to_owned(), p.label.value.to_owned(), p.weight))
                .collect(),
            pool: match h.pool {
                PoolHits::Hits(r) => Some(r.to_vec()),
                PoolHits::None | PoolHits::Failed => None,
            },
            hints: RouteHints {
                required: &[],
                preferred: &[],
                pool: PoolHits::None,
                session: h.session,
                session_close: h.session_close,
                phase: h.phase,
                pinned: h.pinned,
                mode: h.mode,
                lora_name: None,
                cache_salt: None,
                priority_jump: h.priority_jump,
                priority_class: h.priority_class,
                expected_output_tokens: h.expected_output_tokens,
                prompt_len: h.prompt_len,
                allowed: None,
                overrides: h.overrides,
                evidence: h.evidence,
            },
            eligibility: Eligibility::of(req),
        }
    }

    pub(super) fn request<'a>(
        &'a self,
        id: RequestId,
        bufs: &'a mut LabelBufs<'a>,
    ) -> RouteRequest<'a> {
        bufs.required.extend(
            self.required
                .iter()
                .map(|(k, v)| Label { key: k, value: v }),
        );
        bufs.preferred
            .extend(self.preferred.iter().map(|(k, v, w)| PreferredLabel {
                label: Label { key: k, value: v },
                weight: *w,
            }));
        RouteRequest {
            id,
            tokens: &self.tokens,
            hints: RouteHints {
                lora_name: self.lora_name.as_deref(),
                cache_salt: self.cache_salt.as_deref(),
                allowed: self.allowed.as_deref(),
                required: &bufs.required,
                preferred: &bufs.preferred,
                pool: self.pool.as_deref().map_or(PoolHits::None, PoolHits::Hits),
                ..self.hints
            },
        }
    }
}

/// Queue depth, waits and outcomes ([`Router::queue_stats`]).
#[derive(Debug, Clone)]
pub struct QueueStats {
    /// Requests waiting now.
    pub depth: usize,
    /// Their prompt tokens.
    pub queued_tokens: u64,
    /// The cap on queued prompt tokens ([`Queueing::On`](crate::Queueing::On)).
    pub cap_tokens: u64,
    /// Released decisions not yet taken.
    pub released_untaken: usize,
    /// Requests that entered the queue.
    pub enqueued: u64,
    /// Left the queue with a decision (booked) or an error.
    pub released: u64,
    /// Of those, released with an error (e.g. no eligible worker any more).
    pub released_failed: u64,
    /// Refused at the cap ([`RouteError::ResourceExhausted`]).
    pub rejected: u64,
    /// Cancels that took a waiting request out of the queue ([`Cancelled::Waiting`]).
    pub cancelled_waiting: u64,
    /// Cancels of a released request whose decision was not taken; its booking freed
    /// ([`Cancelled::Released`]).
    pub cancelled_released: u64,
    /// Time from submit to release, µs, for every released request.
    pub wait_us: Histogram<u64>,
}

#[derive(Debug)]
pub(super) struct QueueState {
    pub(super) queue: AdmissionQueue<OwnedRequest>,
    pub(super) released: HashMap<RequestId, Result<Decision, RouteError>>,
    pub(super) wakers: HashMap<RequestId, Waker>,
    pub(super) wait_us: Histogram<u64>,
    pub(super) enqueued: u64,
    pub(super) released_n: u64,
    pub(super) released_failed: u64,
    pub(super) rejected: u64,
    pub(super) cancelled_waiting: u64,
    pub(super) cancelled_released: u64,
    /// The queue's lanes: one per eligibility with a request waiting.
    pub(super) lanes: HashMap<Eligibility, usize>,
    /// By lane: its eligibility's phase (`None`: a free lane).
    pub(super) lane_phase: Vec<Option<Phase>>,
    /// By lane: its eligibility, to forget it when the lane empties.
    pub(super) lane_keys: Vec<Option<Eligibility>>,
    pub(super) free_lanes: Vec<usize>,
    /// By lane, for one release pass: found waiting.
    pub(super) blocked: Vec<bool>,
}

impl QueueState {
    pub(super) fn new(order: crate::config::QueueOrder, cap: u64) -> Self {
        QueueState {
            queue: AdmissionQueue::new(order, cap),
            released: HashMap::new(),
            wakers: HashMap::new(),
            wait_us: histogram_upto(1 << 26),
            enqueued: 0,
            released_n: 0,
            released_failed: 0,
            rejected: 0,
            cancelled_waiting: 0,
            cancelled_released: 0,
            lanes: HashMap::new(),
            lane_phase: Vec::new(),
            lane_keys: Vec::new(),
            free_lanes: Vec::new(),
            blocked: Vec::new(),
        }
    }

    /// The lane of requests of eligibility `e`.
    pub(super) fn lane_for(&mut self, e: &Eligibility) -> usize {
        if let Some(&lane) = self.lanes.get(e) {
            return lane;
        }
        let lane = self.free_lanes.pop().unwrap_or(self.lane_phase.len());
        if lane == self.lane_phase.len() {
            self.lane_phase.push(None);
            self.lane_keys.push(None);
        }
        self.lane_phase[lane] = Some(e.phase);
        self.lane_keys[lane] = Some(e.clone());
        self.lanes.insert(e.clone(), lane);
        lane
    }

    /// Forgets `lane` once nothing waits in it.
    pub(super) fn lane_left(&mut self, lane: usize) {
        if self.queue.lane_len(lane) > 0 {
            return;
        }
        if let Some(e) = self.lane_keys.get_mut(lane).and_then(Option::take) {
            self.lanes.remove(&e);
            self.lane_phase[lane] = None;
            self.free_lanes.push(lane);
        }
    }

    /// Hands a released request's outcome to whoever waits for it.
    pub(super) fn deliver(&mut self, request: RequestId, outcome: Result<Decision, RouteError>) {
        self.released_n += 1;
        if outcome.is_err() {
            self.released_failed += 1;
        }
        self.released.insert(request, outcome);
        if let Some(w) = self.wakers.remove(&request) {
            w.wake();
        }
    }
}

/// The admission queue and its waiters.
#[derive(Debug)]
pub(super) struct Queue {
    pub(super) state: Mutex<QueueState>,
    /// Requests waiting, readable without the lock (lifecycle calls release only when > 0).
    pub(super) depth: AtomicUsize,
    /// Released outcomes not yet taken, readable without the lock.
    pub(super) untaken: AtomicUsize,
    /// Arrival times are seconds since this instant.
    pub(super) epoch: Instant,
}

impl Router {
    /// Admits `req`: routes and books it now when an eligible rank is free (or the request is
    /// pinned, query-only, or queueing is off); otherwise, with
    /// [`Queueing::On`](crate::Queueing::On), queues it
    /// behind the requests already waiting, in the configured order. Past the cap of queued
    /// prompt tokens it is rejected with the retryable [`RouteError::ResourceExhausted`].
    pub fn submit(&self, req: &RouteRequest<'_>) -> Result<Admission, RouteError> {
        let now = self.clock.now();
        let Some(q) = &self.queue else {
            return match self.route_gated(req, &Now::at(&self.clock, now), Gate::Immediate)? {
                Routed::Decided(d) => Ok(Admission::Routed(d)),
                // `Gate::Immediate` always decides.
                Routed::Wait { .. } => Err(RouteError::NoWorkers { request: req.id }),
            };
        };
        if !req.hints.priority_jump.is_finite() {
            bump(&self.counters.invalid_hints);
            return Err(RouteError::InvalidHint {
                request: req.id,
                field: "priority_jump",
                reason: "must be finite",
            });
        }
        // Nothing waits and no outcome is untaken: route without the queue's lock (a booked
        // duplicate id is refused by the ledger), and take the lock only to wait.
        let mut waits = None;
        if q.depth.load(Ordering::Relaxed) == 0 && q.untaken.load(Ordering::Relaxed) == 0 {
            match self.route_gated(req, &Now::at(&self.clock, now), Gate::IfFree)? {
                Routed::Decided(d) => return Ok(Admission::Routed(d)),
                Routed::Wait { new_prefill_tokens } => waits = Some(new_prefill_tokens),
            }
        }
        let mut st = lock(&q.state);
        if st.queue.contains(req.id)
            || st.released.contains_key(&req.id)
            || self.ledger.rank_of(req.id).is_some()
        {
            bump(&self.counters.duplicate_admissions);
            return Err(RouteError::Load(LoadError::DuplicateRequest {
                request: req.id,
            }));
        }
        let new_prefill_tokens = match waits {
            Some(n) => n,
            None => {
                let gate = if st.queue.is_empty() {
                    Gate::IfFree
                } else {
                    Gate::Behind
                };
                match self.route_gated(req, &Now::at(&self.clock, now), gate)? {
                    Routed::Decided(d) => return Ok(Admission::Routed(d)),
                    Routed::Wait { new_prefill_tokens } => new_prefill_tokens,
                }
            }
        };
        let tokens = req.prompt_tokens();
        let item = OwnedRequest::new(req);
        let lane = st.lane_for(&item.eligibility);
        let waiting = Waiting {
            request: req.id,
            tokens,
            enqueued_at: now,
            lane,
            item,
        };
        let order = OrderInput {
            class: req.hints.priority_class,
            priority_jump: req.hints.priority_jump,
            arrival_secs: now.saturating_duration_since(q.epoch).as_secs_f64(),
            new_prefill_tokens,
        };
        let pushed = st.queue.push(waiting, order);
        if pushed.is_err() {
            st.lane_left(lane);
        }
        match pushed {
            Ok(()) => {
                st.enqueued += 1;
                q.depth.store(st.queue.len(), Ordering::Relaxed);
            }
            Err(Refused::OverCap(over, _)) => {
                st.rejected += 1;
                return Err(RouteError::ResourceExhausted {
                    request: req.id,
                    request_tokens: tokens,
                    queued_tokens: over.queued_tokens,
                    cap_tokens: over.cap_tokens,
                });
            }
            Err(Refused::Duplicate(_)) => {
                return Err(RouteError::Load(LoadError::DuplicateRequest {
                    request: req.id,
                }));
            }
        }
        // Capacity may have freed between the check and the push.
        self.release_locked(q, &mut st, now);
        Ok(Admission::Queued(Ticket { request: req.id }))
    }

    /// Releases queued requests in order: each that can be booked on a free eligible rank (or
    /// fails outright) leaves the queue; one that must still wait keeps its place, and the
    /// requests behind it that no free rank could serve either (the same eligibility, or its
    /// whole phase busy) are passed over untried. Returns how many left the queue. Frees, prefill
    /// completions,
    /// joins, leaves and health changes call this themselves; call it to drive the queue from
    /// a timer as well.
    pub fn release_queued(&self) -> usize {
        match &self.queue {
            Some(q) if q.depth.load(Ordering::Relaxed) > 0 => {
                let mut st = lock(&q.state);
                self.release_locked(q, &mut st, self.clock.now())
            }
            _ => 0,
        }
    }

    pub(super) fn release_locked(&self, q: &Queue, st: &mut QueueState, now: Instant) -> usize {
        let mut n = 0;
        // The lanes this pass found waiting; it ends once every lane with a request is one.
        // Each step tries the first request of the lanes not found waiting: it is either
        // taken or its lane is, so the pass never steps over a waiting lane's requests.
        st.blocked.clear();
        st.blocked.resize(st.lane_phase.len(), false);
        let mut blocked = 0;
        while blocked < st.queue.nonempty_lanes() {
            let Some((place, w)) = st.queue.first_head(|lane| st.blocked[lane]) else {
                break;
            };
            let lane = w.lane;
            let (phase, whole_phase) = (w.item.eligibility.phase, w.item.eligibility.whole_phase());
            let mut bufs = LabelBufs::default();
            let req = w.item.request(w.request, &mut bufs);
            let outcome = match self.route_gated(&req, &Now::at(&self.clock, now), Gate::IfFree) {
                Ok(Routed::Wait { .. }) => {
                    // Every request of a lane whose ranks are all busy waits too; so does
                    // every request of the phase when one that admits all of it waits.
                    st.blocked[lane] = true;
                    blocked += 1;
                    if whole_phase {
                        for l in 0..st.lane_phase.len() {
                            if !st.blocked[l]
                                && st.lane_phase[l] == Some(phase)
                                && st.queue.lane_len(l) > 0
                            {
                                st.blocked[l] = true;
                                blocked += 1;
                            }
                        }
                    }
                    continue;
                }
                Ok(Routed::Decided(d)) => Ok(d),
                Err(e) => Err(e),
            };
            let Some(w) = st.queue.take(place) else {
                // Not reached: the place was a lane head under this lock.
                break;
            };
            st.lane_left(w.lane);
            let waited = now.saturating_duration_since(w.enqueued_at);
            record(
                &mut st.wait_us,
                u64::try_from(waited.as_micros()).unwrap_or(u64::MAX),
            );
            st.deliver(w.request, outcome);
            n += 1;
        }
        q.depth.store(st.queue.len(), Ordering::Relaxed);
        q.untaken.store(st.released.len(), Ordering::Relaxed);
        n
    }

    /// The released outcome of a queued request, if it has one; registers `waker` to be woken
    /// at release otherwise. An outcome is handed out once; after that (or for a request that
    /// never queued, or was cancelled) the answer is [`RouteError::NotQueued`].
    pub fn poll_released(
        &self,
        request: RequestId,
        waker: Option<&Waker>,
    ) -> Poll<Result<Decision, RouteError>> {
        let Some(q) = &self.queue else {
            return Poll::Ready(Err(RouteError::NotQueued { request }));
        };
        let mut st = lock(&q.state);
        if let Some(outcome) = st.released.remove(&request) {
            q.untaken.store(st.released.len(), Ordering::Relaxed);
            return Poll::Ready(outcome);
        }
        if !st.queue.contains(request) {
            return Poll::Ready(Err(RouteError::NotQueued { request }));
        }
        if let Some(w) = waker {
            match st.wakers.get_mut(&request) {
                Some(old) if old.will_wake(w) => {}
                Some(old) => old.clone_from(w),
                None => {
                    st.wakers.insert(request, w.clone());
                }
            }
        }
        Poll::Pending
    }

    /// Where `request` stands, without taking anything.
    pub fn ticket_state(&self, request: RequestId) -> TicketState {
        let Some(q) = &self.queue else {
            return TicketState::Unknown;
        };
        let st = lock(&q.state);
        if st.queue.contains(request) {
            TicketState::Waiting
        } else if st.released.contains_key(&request) {
            TicketState::Released
        } else {
            TicketState::Unknown
        }
    }

    /// The released outcome of a queued request, once; `None` while it waits.
    pub fn take_released(&self, request: RequestId) -> Option<Result<Decision, RouteError>> {
        match self.poll_released(request, None) {
            Poll::Ready(r) => Some(r),
            Poll::Pending => None,
        }
    }

    /// Hands every released, untaken outcome to `f`; returns how many.
    pub fn drain_released(
        &self,
        mut f: impl FnMut(RequestId, Result<Decision, RouteError>),
    ) -> usize {
        let Some(q) = &self.queue else { return 0 };
        let taken: Vec<_> = {
            let mut st = lock(&q.state);
            q.untaken.store(0, Ordering::Relaxed);
            st.released.drain().collect()
        };
        let n = taken.len();
        for (id, outcome) in taken {
            f(id, outcome);
        }
        n
    }

    /// Withdraws a queued request exactly once: a waiting request leaves the queue; a released
    /// one whose decision was not taken has its booking freed. A second cancel (or one for a
    /// request whose decision was taken: free it instead) is [`RouteError::NotQueued`].
    pub fn cancel_queued(&self, request: RequestId) -> Result<Cancelled, RouteError> {
        let Some(q) = &self.queue else {
            return Err(RouteError::NotQueued { request });
        };
        let mut st = lock(&q.state);
        st.wakers.remove(&request);
        if let Some(w) = st.queue.remove(request) {
            st.lane_left(w.lane);
            st.cancelled_waiting += 1;
            q.depth.store(st.queue.len(), Ordering::Relaxed);
            return Ok(Cancelled::Waiting);
        }
        match st.released.remove(&request) {
            Some(outcome) => {
                st.cancelled_released += 1;
                q.untaken.store(st.released.len(), Ordering::Relaxed);
                drop(st);
                if let Ok(d) = outcome {
                    if d.bookkeeping == Bookkeeping::Booked {
                        // An error means the booking already went (its worker left, or it
                        // expired); the ledger counted it, and the cancel stands.
                        let _ = self.free(request);
                    }
                }
                Ok(Cancelled::Released)
            }
            None => Err(RouteError::NotQueued { request }),
        }
    }

    /// A future of a queued request's outcome, for async embedders (any executor: it only
    /// registers the task's waker). Dropping it before it resolves cancels the request.
    pub fn wait<R: Deref<Target = Router>>(router: R, ticket: Ticket) -> Released<R> {
        Released {
            router,
            request: ticket.request,
            done: false,
        }
    }

    /// Requests waiting in the queue now (one relaxed load; 0 without a queue).
    pub fn queue_depth(&self) -> usize {
        self.queue
            .as_ref()
            .map_or(0, |q| q.depth.load(Ordering::Relaxed))
    }

    /// Queue depth, waits and outcomes (`None` unless [`Queueing::On`](crate::Queueing::On)).
    pub fn queue_stats(&self) -> Option<QueueStats> {
        let q = self.queue.as_ref()?;
        let st = lock(&q.state);
        Some(QueueStats {
            depth: st.queue.len(),
            queued_tokens: st.queue.queued_tokens(),
            cap_tokens: st.queue.cap_tokens(),
            released_untaken: st.released.len(),
            enqueued: st.enqueued,
            released: st.released_n,
            released_failed: st.released_failed,
            rejected: st.rejected,
            cancelled_waiting: st.cancelled_waiting,
            cancelled_released: st.cancelled_released,
            wait_us: st.wait_us.clone(),
        })
    }

    /// Lets queued requests go after load freed (cheap when nothing waits).
    pub(super) fn load_freed(&self) {
        if self
            .queue
            .as_ref()
            .is_some_and(|q| q.depth.load(Ordering::Relaxed) > 0)
        {
            self.release_queued();
        }
    }
}

/// The outcome of a queued request, as a future ([`Router::wait`]). Resolves once; dropped
/// unresolved, it cancels the request (and frees it if it was already released).
#[derive(Debug)]
pub struct Released<R: Deref<Target = Router>> {
    router: R,
    request: RequestId,
    done: bool,
}

impl<R: Deref<Target = Router> + Unpin> Future for Released<R> {
    type Output = Result<Decision, RouteError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let out = self.router.poll_released(self.request, Some(cx.waker()));
        if out.is_ready() {
            self.done = true;
        }
        out
    }
}

impl<R: Deref<Target = Router>> Drop for Released<R> {
    fn drop(&mut self) {
        if !self.done {
            // NotQueued here means it was already taken or cancelled elsewhere.
            let _ = self.router.cancel_queued(self.request);
        }
    }
}
