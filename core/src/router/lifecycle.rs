//! A booked request's life after its route: dispatched, first token, output blocks, free;
//! and expiry of requests that were never freed.

use std::time::Instant;

use hdrhistogram::Histogram;

use super::{bump, record, record_n, us_per, BookingDelta, RequestMetrics, Router};
use crate::event::WorkerRank;
use crate::load::DispatchState;
use crate::load::{Freed, Generated, LoadError, RequestId, Step};

impl Router {
    /// The clock reading lifecycle calls pass on: only when metrics are on.
    pub(super) fn metrics_now(&self) -> Option<Instant> {
        self.metrics.as_ref().map(|_| self.clock.now())
    }

    /// The request reached its worker: from now on it records metrics and, when freed,
    /// counts as completed.
    pub fn mark_dispatched(&self, request: RequestId) -> Result<WorkerRank, LoadError> {
        self.ledger.mark_dispatched(request)
    }

    /// The request's first token arrived.
    pub fn prefill_done(&self, request: RequestId) -> Result<WorkerRank, LoadError> {
        let step = self.ledger.prefill_done(request, self.metrics_now())?;
        self.tell(|| BookingDelta::PrefillDone(request));
        self.record_step(request, &step, |m| &mut m.ttft_us, 1);
        self.load_freed();
        Ok(step.rank)
    }

    /// The request's generation crossed into a new block.
    pub fn output_block(&self, request: RequestId) -> Result<WorkerRank, LoadError> {
        let step = self.ledger.output_block(request, self.metrics_now())?;
        self.tell(|| BookingDelta::OutputBlocks {
            request,
            blocks: 1,
            generated: step.decayed_at,
        });
        if step.tokens > 0 {
            self.record_step(request, &step, |m| &mut m.itl_us, step.tokens);
        }
        Ok(step.rank)
    }

    /// `tokens` more output tokens of the request arrived (the first included): output blocks
    /// advance from the count, the first call completes the prefill and records the TTFT,
    /// later calls record the ITL once per token (the time since the previous call over its
    /// tokens; the other tokens of the first call have no interval of their own). Use either
    /// this or [`Router::output_block`] per request; they mix, but the latter samples the ITL
    /// only at block boundaries.
    pub fn tokens_generated(
        &self,
        request: RequestId,
        tokens: u64,
    ) -> Result<WorkerRank, LoadError> {
        let g: Generated = self
            .ledger
            .tokens_generated(request, tokens, self.metrics_now())?;
        if g.prefill_released {
            self.tell(|| BookingDelta::PrefillDone(request));
        }
        if g.new_blocks > 0 {
            self.tell(|| BookingDelta::OutputBlocks {
                request,
                blocks: g.new_blocks,
                generated: g.generated,
            });
        }
        if let (Some(m), DispatchState::Reached) = (&self.metrics, g.dispatch) {
            let mut m = m.shard(request);
            if let Some(t) = g.ttft {
                record(&mut m.ttft_us, us_per(t, 1));
            }
            if let Some(t) = g.itl {
                record_n(&mut m.itl_us, us_per(t, g.itl_tokens), g.itl_tokens);
            }
        }
        if g.prefill_released {
            self.load_freed();
        }
        Ok(g.rank)
    }

    /// Records a step's elapsed time over `per` units, in µs (rounded), when metrics are on
    /// and the request reached its worker.
    pub(super) fn record_step(
        &self,
        request: RequestId,
        step: &Step,
        histogram: impl FnOnce(&mut RequestMetrics) -> &mut Histogram<u64>,
        per: u64,
    ) {
        if let (Some(m), Some(elapsed), DispatchState::Reached) =
            (&self.metrics, step.elapsed, step.dispatch)
        {
            record(histogram(&mut m.shard(request)), us_per(elapsed, per));
        }
    }

    /// The request ended (completed, cancelled, failed): its load is released, and when it
    /// had reached its worker, it counts as completed and records its ISL, OSL and hit rate.
    pub fn free(&self, request: RequestId) -> Result<Freed, LoadError> {
        let now = self.clock.now();
        let freed = self.ledger.free_at(request, now)?;
        self.tell(|| BookingDelta::Freed(request));
        if freed.dispatch == DispatchState::Reached {
            bump(&self.counters.completed);
            if let Some(m) = &self.metrics {
                let hit_bp = (u128::from(freed.cached_tokens) * 10_000)
                    .checked_div(u128::from(freed.prompt_tokens))
                    .unwrap_or(0);
                let mut m = m.shard(request);
                record(&mut m.isl_tokens, freed.prompt_tokens);
                record(&mut m.osl_blocks, freed.output_blocks);
                record(&mut m.kv_hit_bp, u64::try_from(hit_bp).unwrap_or(u64::MAX));
            }
        }
        if let Some(sid) = freed.session {
            if let Some(end) = self.sessions.request_ended(sid, request, now) {
                self.session_ended(end);
            }
        }
        self.load_freed();
        Ok(freed)
    }

    /// Frees requests booked more than `request_expiry` before `now` (returns how many), drops
    /// the cache records that expired, warms ranks whose reported cache fell far below the
    /// fleet's (with warm-up on), and lets queued requests go if that freed room. Call it
    /// periodically (every second or so).
    pub fn expire(&self) -> usize {
        let now = self.clock.now();
        let n = self.ledger.expire(now, self.config.request_expiry);
        self.approx.sweep(now);
        self.rewarm_low_ranks(now);
        self.release_queued();
        n
    }
}
