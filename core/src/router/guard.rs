//! [`RequestGuard`]: frees a booked request exactly once, whatever ends it.

use std::ops::Deref;

use super::Router;
use crate::event::WorkerRank;
use crate::load::{Freed, LoadError, RequestId};

/// Frees a booked request exactly once: on [`RequestGuard::finish`] or, whatever ends the
/// request otherwise (cancel, error, a dropped stream), on drop. `R` is `&Router` or
/// `Arc<Router>` (for guards that outlive a borrow, e.g. in async streams).
#[derive(Debug)]
pub struct RequestGuard<R: Deref<Target = Router>> {
    router: R,
    request: RequestId,
    armed: bool,
}

impl<R: Deref<Target = Router>> RequestGuard<R> {
    /// Guards the booked request `request`.
    pub fn new(router: R, request: RequestId) -> Self {
        RequestGuard {
            router,
            request,
            armed: true,
        }
    }

    /// The request guarded.
    pub fn request(&self) -> RequestId {
        self.request
    }

    /// The request reached its worker ([`Router::mark_dispatched`]).
    pub fn mark_dispatched(&mut self) -> Result<WorkerRank, LoadError> {
        self.router.mark_dispatched(self.request)
    }

    /// The request's first token arrived ([`Router::prefill_done`]).
    pub fn prefill_done(&self) -> Result<WorkerRank, LoadError> {
        self.router.prefill_done(self.request)
    }

    /// The request's generation crossed into a new block ([`Router::output_block`]).
    pub fn output_block(&self) -> Result<WorkerRank, LoadError> {
        self.router.output_block(self.request)
    }

    /// `tokens` more output tokens arrived ([`Router::tokens_generated`]).
    pub fn tokens_generated(&self, tokens: u64) -> Result<WorkerRank, LoadError> {
        self.router.tokens_generated(self.request, tokens)
    }

    /// Frees now and reports what was freed.
    pub fn finish(mut self) -> Result<Freed, LoadError> {
        self.release()
    }

    pub(super) fn release(&mut self) -> Result<Freed, LoadError> {
        if !self.armed {
            return Err(LoadError::UnknownRequest {
                request: self.request,
            });
        }
        self.armed = false;
        self.router.free(self.request)
    }
}

impl<R: Deref<Target = Router>> Drop for RequestGuard<R> {
    fn drop(&mut self) {
        if self.armed {
            // An error here means the request was already freed elsewhere (by id, expiry or
            // its worker leaving); the ledger counted it.
            let _ = self.release();
        }
    }
}
