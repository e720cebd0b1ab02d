//! Conditional disaggregation: when a fleet that splits prefill from decode has the decode
//! worker serve a request whole instead (one rule for every embedder: serve, the simulated
//! fleet).
//!
//! ```text
//!  request ──ask (decode phase, query only)──▶ the decode rank and its cached tokens
//!     │ that rank has more than decode_busy_tokens of prefill booked ──▶ split
//!     │ its cache leaves ≤ max_new_tokens and ≤ max_new_share of the prompt ──▶ whole there
//!     │ every prefill rank has ≥ prefill_busy_tokens booked ──▶ whole there
//!     └ otherwise ──▶ split
//! ```

use super::{Mode, Phase, RouteRequest, Router};
use crate::event::WorkerRank;
use crate::health::Health;
use crate::registry::WorkerRole;

/// When the decode worker serves a request whole instead of taking its prompt's KV from a
/// prefill worker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Conditional {
    /// Most prompt tokens the decode worker's cache may leave to compute.
    pub max_new_tokens: u64,
    /// Most of the prompt, as a share in (0, 1], its cache may leave to compute.
    pub max_new_share: f64,
    /// The prefill workers are saturated once every healthy prefill rank has at least this
    /// many prompt tokens booked for prefill: the decode worker then serves the request whole
    /// whatever its cache holds, rather than queue it behind them (none: never).
    pub prefill_busy_tokens: Option<u64>,
    /// A decode rank with more than this many prompt tokens booked for prefill serves nothing
    /// whole (none: no limit).
    pub decode_busy_tokens: Option<u64>,
}

impl Conditional {
    /// Whole when the cache leaves at most `max_new_tokens`, with no share cap and no gate on
    /// busy workers.
    pub fn new_tokens_at_most(max_new_tokens: u64) -> Self {
        Conditional {
            max_new_tokens,
            max_new_share: 1.0,
            prefill_busy_tokens: None,
            decode_busy_tokens: None,
        }
    }
}

/// Why a request is served whole ([`Router::whole_on_decode`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Whole {
    /// The decode worker's cache leaves little of the prompt to compute.
    Cached,
    /// Every prefill worker is saturated.
    PrefillBusy,
}

impl Router {
    /// The decode rank that serves `req` whole under `c`, and why; `None` when the request is
    /// to be split. `req` is asked in the decode phase and query-only (its hints' phase and
    /// mode are set here; the rest, pins and allowed workers among them, are kept).
    pub fn whole_on_decode(
        &self,
        req: &RouteRequest<'_>,
        c: &Conditional,
    ) -> Option<(WorkerRank, Whole)> {
        let mut ask = *req;
        ask.hints.phase = Phase::Decode;
        ask.hints.mode = Mode::QueryOnly;
        let d = self.route(&ask).ok()?;
        let fleet = self.fleet();
        let decode = fleet.ranks.get(fleet.rank_index(d.worker)?)?;
        if c.decode_busy_tokens
            .is_some_and(|cap| decode.state.load().prefill_tokens > cap)
        {
            return None;
        }
        let prompt = req.prompt_tokens();
        let new = prompt.saturating_sub(d.overlap.cached_tokens);
        let share = new as f64 / prompt.max(1) as f64;
        if new <= c.max_new_tokens && share <= c.max_new_share {
            return Some((d.worker, Whole::Cached));
        }
        let saturated = c.prefill_busy_tokens.is_some_and(|busy| {
            let mut prefill = fleet
                .ranks
                .iter()
                .filter(|r| r.role == WorkerRole::Prefill)
                .filter(|r| !r.state.is_retired() && r.state.health() == Health::Healthy)
                .peekable();
            prefill.peek().is_some() && prefill.all(|r| r.state.load().prefill_tokens >= busy)
        });
        saturated.then_some((d.worker, Whole::PrefillBusy))
    }
}
