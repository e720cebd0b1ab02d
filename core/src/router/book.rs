//! The route's last step: the decision booked on its rank, recorded as the rank's cache where
//! the router keeps records, and its session bound.

use std::time::Instant;

use super::scratch::Prompt;
use super::{
    bump, BookingDelta, Bookkeeping, Decision, Fallback, Phase, RemoteBooking, RouteError,
    RouteRequest, Router,
};
use crate::approx::checkpoint_keys_extend;
use crate::config::Speculative;
use crate::event::WorkerRank;
use crate::load::BookingSpec;
use crate::registry::{KvEvents, RankEntry};
use crate::session::SessionRouting;

impl Router {
    /// Books the decision on its rank (unless query-only or untracked), records it as the
    /// rank's cache where the router keeps records, and binds the request's session.
    /// `stamp` is the route's time, read when first needed.
    #[inline(always)]
    pub(super) fn book(
        &self,
        req: &RouteRequest<'_>,
        entry: &RankEntry,
        d: &Decision,
        prompt: &mut Prompt,
        stamp: impl Fn() -> Instant,
    ) -> Result<(), RouteError> {
        match d.bookkeeping {
            Bookkeeping::QueryOnly => bump(&self.counters.query_only),
            Bookkeeping::UntrackedDpRankUnresolved => bump(&self.counters.untracked),
            Bookkeeping::Booked => {
                let (hints, bs) = (&req.hints, self.config.block_size);
                let tokens = req.prompt_tokens();
                let prefill_tokens = match hints.phase {
                    Phase::Decode => 0,
                    _ => tokens - d.overlap.cached_tokens,
                };
                self.ledger.book(BookingSpec {
                    request: req.id,
                    state: &entry.state,
                    prefill_tokens,
                    block_hashes: &prompt.locals,
                    // The partial last block, and the blocks of a prompt given only in part.
                    tail_blocks: tokens.div_ceil(u64::from(bs)) - prompt.locals.len() as u64,
                    prompt_tokens: tokens,
                    cached_tokens: d.overlap.cached_tokens,
                    block_size: bs,
                    expected_output_tokens: hints.expected_output_tokens,
                    session: hints.session,
                    now: stamp(),
                })?;
                bump(&self.counters.routed);
                self.tell(|| {
                    BookingDelta::Booked(RemoteBooking {
                        request: req.id,
                        rank: d.worker,
                        prefill_tokens,
                        block_hashes: &prompt.locals,
                        prompt_tokens: tokens,
                        cached_tokens: d.overlap.cached_tokens,
                        expected_output_tokens: hints.expected_output_tokens,
                    })
                });
                self.record_as_cache(entry, d.worker, prompt, &stamp);
                if let Some(sid) = hints.session {
                    let close = hints.session_close;
                    self.sessions.record(sid, d.worker, req.id, stamp(), close);
                    match d.session {
                        Some(SessionRouting::Bound) => bump(&self.counters.sessions_bound),
                        Some(SessionRouting::Rerouted { .. }) => {
                            bump(&self.counters.sessions_rerouted)
                        }
                        _ => {}
                    }
                }
                if d.fallback.is_some() && hints.phase == Phase::Prefill {
                    bump(&self.counters.prefill_fallbacks);
                }
                if d.fallback == Some(Fallback::AggregatedToDecode) {
                    bump(&self.counters.whole_on_decode);
                }
            }
        }
        Ok(())
    }

    /// How long a booked prompt stands as its rank's cache in the router's records: always
    /// for a worker that publishes no KV events (approximate mode), and for the others while
    /// speculation is on.
    pub(super) fn record_ttl(&self, entry: &RankEntry) -> Option<std::time::Duration> {
        match entry.state.kv_events() {
            KvEvents::Absent => Some(self.config.approximate.ttl),
            KvEvents::Published => match self.config.approximate.speculative {
                Speculative::On { ttl } => Some(ttl),
                Speculative::Off => None,
            },
        }
    }

    /// Records a booked prompt as the chosen rank's cache for a TTL: always for a worker that
    /// publishes no KV events (approximate mode), and for the others while speculation is on.
    #[inline(always)]
    fn record_as_cache(
        &self,
        entry: &RankEntry,
        rank: WorkerRank,
        prompt: &mut Prompt,
        stamp: &impl Fn() -> Instant,
    ) {
        if let (Some(ttl), Some(key)) = (self.record_ttl(entry), entry.index_key) {
            checkpoint_keys_extend(&prompt.locals, &mut prompt.marks, usize::MAX);
            self.approx
                .record(&prompt.marks, rank, key, stamp() + ttl, || {
                    !entry.state.is_retired()
                });
        }
    }
}
