//! Sticky sessions as the router drives them: the end handler, idle expiry and closes.

use super::{bump, Router};
use crate::event::WorkerRank;
use crate::session::{SessionEnd, SessionEndReason, SessionId};

impl Router {
    /// Sets the handler told of every session that ends (expired or closed), so that the
    /// embedder can close it on its worker. Called outside the router's locks, but under the
    /// handler's own: it must not set a new handler itself.
    pub fn on_session_end(&self, f: impl Fn(SessionEnd) + Send + Sync + 'static) {
        *self
            .on_session_end
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Some(Box::new(f));
    }

    pub(super) fn session_ended(&self, end: SessionEnd) {
        bump(match end.reason {
            SessionEndReason::Expired => &self.counters.sessions_expired,
            SessionEndReason::Closed => &self.counters.sessions_closed,
        });
        if let Some(f) = &*self
            .on_session_end
            .read()
            .unwrap_or_else(|p| p.into_inner())
        {
            f(end);
        }
    }

    /// Ends the sessions idle for `session_idle_ttl` at `now` (whose last request has ended),
    /// and those whose close-after-request is due; tells the session handler of each. Returns
    /// how many ended.
    pub fn expire_sessions(&self) -> usize {
        let now = self.clock.now();
        if self.sessions.is_empty() {
            return 0;
        }
        let mut ended = Vec::new();
        self.sessions.sweep(
            now,
            self.config.session_idle_ttl,
            |r| self.ledger.rank_of(r).is_some(),
            &mut ended,
        );
        for &end in &ended {
            self.session_ended(end);
        }
        ended.len()
    }

    /// Closes a session now (the handler is told); `None` if it was not bound.
    pub fn close_session(&self, session: SessionId) -> Option<SessionEnd> {
        let end = self.sessions.close(session)?;
        self.session_ended(end);
        Some(end)
    }

    /// The rank a session is bound to.
    pub fn session_rank(&self, session: SessionId) -> Option<WorkerRank> {
        self.sessions.bound(session)
    }
}
