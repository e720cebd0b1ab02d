//! Sticky sessions: a session id binds to the (worker, dp rank) that served its first request,
//! so that a conversation's later turns find their KV cache where they left it.
//!
//! ```text
//!   route(session s) ──s unbound──▶ choose as usual ──book──▶ bind s → rank      (Bound)
//!                    ──s bound, rank present and eligible──▶ that rank           (Sticky)
//!                    ──s bound, rank gone or ineligible──▶ choose, rebind        (Rerouted)
//!   expire_sessions(): idle ≥ TTL and its last request ended ──▶ SessionEnd::Expired
//!   free(request carrying "close after this request") ──▶ SessionEnd::Closed
//! ```
//!
//! A binding remembers when it was last used and its last request. It expires once it has been
//! idle for the configured TTL and that request has ended (a long generation keeps its session).
//! A request may ask to close its session when it ends: the close waits for that request's
//! generation to end (its free, or its expiry or loss, found by the next sweep), then the
//! binding goes and the embedder hears of it through the session callback, as for an expiry,
//! to close the session on the worker.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::event::WorkerRank;
use crate::load::RequestId;

/// A session's identity, chosen by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SessionId(pub u64);

/// What a request asks of its session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum SessionClose {
    /// Keep the session after this request.
    #[default]
    Keep,
    /// Close it once this request's generation has ended.
    AfterThisRequest,
}

/// How a session request was routed (reported in the decision).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionRouting {
    /// First dispatch: the session is now bound to the chosen rank.
    Bound,
    /// Sent to the rank the session is bound to.
    Sticky,
    /// The bound rank's worker left (or may not serve this request): chosen afresh and rebound.
    Rerouted {
        /// The rank the session was bound to.
        previous: WorkerRank,
    },
}

/// Why a session ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionEndReason {
    /// Idle past the TTL.
    Expired,
    /// Closed after its request, or by [`Router::close_session`](crate::Router::close_session).
    Closed,
}

/// A session that ended: the embedder closes it on `worker`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionEnd {
    /// The session.
    pub session: SessionId,
    /// The rank it was bound to.
    pub worker: WorkerRank,
    /// Why it ended.
    pub reason: SessionEndReason,
}

#[derive(Clone, Copy, Debug)]
struct Binding {
    rank: WorkerRank,
    last_used: Instant,
    last_request: RequestId,
    close_after: Option<RequestId>,
}

/// The session table.
#[derive(Debug, Default)]
pub(crate) struct Sessions {
    map: Mutex<HashMap<SessionId, Binding>>,
    /// Bindings held, readable without the lock.
    len: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Sessions {
    /// Bindings held.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// True when no session is bound.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The rank `session` is bound to.
    pub(crate) fn bound(&self, session: SessionId) -> Option<WorkerRank> {
        lock(&self.map).get(&session).map(|b| b.rank)
    }

    /// `request` was booked on `rank` for `session` at `now`: binds (or rebinds) the session
    /// and marks it used.
    pub(crate) fn record(
        &self,
        session: SessionId,
        rank: WorkerRank,
        request: RequestId,
        now: Instant,
        close: SessionClose,
    ) {
        let mut map = lock(&self.map);
        let b = map.entry(session).or_insert(Binding {
            rank,
            last_used: now,
            last_request: request,
            close_after: None,
        });
        b.rank = rank;
        b.last_used = b.last_used.max(now);
        b.last_request = request;
        if close == SessionClose::AfterThisRequest {
            b.close_after = Some(request);
        }
        self.len.store(map.len(), Ordering::Relaxed);
    }

    /// `request` of `session` ended at `now`: the session is used, and closed when it asked
    /// to close after this request.
    pub(crate) fn request_ended(
        &self,
        session: SessionId,
        request: RequestId,
        now: Instant,
    ) -> Option<SessionEnd> {
        let mut map = lock(&self.map);
        let b = map.get_mut(&session)?;
        b.last_used = b.last_used.max(now);
        if b.close_after != Some(request) {
            return None;
        }
        let rank = b.rank;
        map.remove(&session);
        self.len.store(map.len(), Ordering::Relaxed);
        Some(SessionEnd {
            session,
            worker: rank,
            reason: SessionEndReason::Closed,
        })
    }

    /// Closes `session` now.
    pub(crate) fn close(&self, session: SessionId) -> Option<SessionEnd> {
        let mut map = lock(&self.map);
        let b = map.remove(&session)?;
        self.len.store(map.len(), Ordering::Relaxed);
        Some(SessionEnd {
            session,
            worker: b.rank,
            reason: SessionEndReason::Closed,
        })
    }

    /// Removes the sessions idle for `ttl` at `now` whose last request has ended, and those
    /// whose requested close is due (its request has ended); `active` says whether a request
    /// is still booked. Appends what ended to `out`.
    pub(crate) fn sweep(
        &self,
        now: Instant,
        ttl: Duration,
        active: impl Fn(RequestId) -> bool,
        out: &mut Vec<SessionEnd>,
    ) {
        let mut map = lock(&self.map);
        map.retain(|&session, b| {
            let reason = if b.close_after.is_some_and(|r| !active(r)) {
                SessionEndReason::Closed
            } else if now.saturating_duration_since(b.last_used) >= ttl && !active(b.last_request) {
                SessionEndReason::Expired
            } else {
                return true;
            };
            out.push(SessionEnd {
                session,
                worker: b.rank,
                reason,
            });
            false
        });
        self.len.store(map.len(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
