//! The router service's Prometheus metrics (`kvroute_*`): requests by outcome, decision time,
//! predicted overlap, and per worker its load, index blocks and event-stream counts, read
//! from the router and the subscriptions at each scrape.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

use kvroute_core::{Router, WorkerRank};
use kvroute_text::ModelText;
use kvroute_transport::RankState;

use super::backends::Backends;

/// The service's metrics.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub decision_seconds: Histogram,
    pub prompt_read_seconds: Histogram,
    pub prompt_tokens: IntCounterVec,
    /// Rests of prompts tokenized in part, by what became of them.
    pub prompt_rests: IntCounterVec,
    pub predicted_cached_tokens: Histogram,
    pub retries: IntCounterVec,
    /// Requests in a fleet with prefill and decode workers, by the way they were served.
    pub disagg: IntCounterVec,
    /// 1 while disaggregated serving is active (a prefill worker is ready), else 0.
    pub disagg_active: prometheus::IntGauge,
    pub queue_wait_seconds: Histogram,
    pub expired: prometheus::IntCounter,
    pub refused_connections: prometheus::IntCounter,
    queue_depth: prometheus::IntGauge,
    piece_cache: IntGaugeVec,
    load: IntGaugeVec,
    events: IntGaugeVec,
    event_state: IntGaugeVec,
    /// The booking sync with the fleet's other replicas.
    pub replica: super::replicas::SyncMetrics,
}

impl Metrics {
    pub(crate) fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("kvroute_requests_total", "Requests by route and outcome."),
            &["route", "outcome"],
        )?;
        let decision_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_decision_seconds",
                "Time to decide where a request goes (hashing included).",
            )
            .buckets(vec![1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 1e-3, 1e-2]),
        )?;
        let prompt_read_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_prompt_read_seconds",
                "Time to read a request's routing fields and tokenize its prompt, when it has text.",
            )
            .buckets(vec![1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 1e-1, 1.0]),
        )?;
        let prompt_tokens = IntCounterVec::new(
            Opts::new(
                "kvroute_prompt_tokens_total",
                "Tokens of text prompts and chats: tokenized for routing, or past the point where \
                 no worker could hold more of the prompt, counted by an estimate from their bytes.",
            ),
            &["how"],
        )?;
        let prompt_rests = IntCounterVec::new(
            Opts::new(
                "kvroute_prompt_rests_total",
                "Rests of text prompts and chats tokenized only in part for routing, tokenized \
                 afterwards off the request path so that a follow-up finds them in the piece \
                 cache: done, skipped (one for every two cores under way already), failed.",
            ),
            &["outcome"],
        )?;
        let predicted_cached_tokens = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_predicted_cached_tokens",
                "Prompt tokens the chosen worker was predicted to hold.",
            )
            .buckets(vec![0.0, 16.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0]),
        )?;
        let retries = IntCounterVec::new(
            Opts::new(
                "kvroute_upstream_failures_total",
                "Upstream attempts that failed before the first byte, by kind.",
            ),
            &["kind"],
        )?;
        let disagg = IntCounterVec::new(
            Opts::new(
                "kvroute_disagg_requests_total",
                "Requests in a fleet with prefill and decode workers, by the way they were \
                 served: disaggregated, local (conditional: the decode worker's cache left \
                 little to compute), local_prefill_busy (conditional: every prefill worker \
                 saturated), whole (no prefill worker ready), prefill_failed, \
                 prefill_fallback (served whole after a prefill failure).",
            ),
            &["how"],
        )?;
        let disagg_active = prometheus::IntGauge::new(
            "kvroute_disagg_active",
            "1 while disaggregated serving is active (some prefill worker is ready), else 0.",
        )?;
        let load = IntGaugeVec::new(
            Opts::new(
                "kvroute_worker_load",
                "Per worker rank: the router's load view.",
            ),
            &["worker", "dp_rank", "kind"],
        )?;
        let events = IntGaugeVec::new(
            Opts::new(
                "kvroute_worker_kv_events",
                "Per worker rank: KV-event stream counts (received, applied, gaps, replays, \
                 lost, restarts, duplicates, decode errors).",
            ),
            &["worker", "dp_rank", "kind"],
        )?;
        let event_state = IntGaugeVec::new(
            Opts::new(
                "kvroute_worker_kv_event_state",
                "Per worker rank: 1 for the state its KV-event stream is in (connecting, \
                 catching_up, live, partial, down), 0 for the others.",
            ),
            &["worker", "dp_rank", "state"],
        )?;
        let queue_wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_queue_wait_seconds",
                "Time queued requests waited for a worker.",
            )
            .buckets(vec![1e-3, 1e-2, 0.1, 0.5, 1.0, 5.0, 30.0]),
        )?;
        let piece_cache = IntGaugeVec::new(
            Opts::new(
                "kvroute_piece_cache",
                "The tokenizer's cache of pieces and chunks: hits and misses since the start, \
                 pieces held.",
            ),
            &["kind"],
        )?;
        registry.register(Box::new(piece_cache.clone()))?;
        let queue_depth = prometheus::IntGauge::new(
            "kvroute_queue_depth",
            "Requests waiting in the admission queue.",
        )?;
        let expired = prometheus::IntCounter::new(
            "kvroute_bookings_expired_total",
            "Bookings freed because they outlived request_expiry_s (a /v1/route booking never \
             freed, or a request that never ended).",
        )?;
        registry.register(Box::new(expired.clone()))?;
        let refused_connections = prometheus::IntCounter::new(
            "kvroute_connections_refused_total",
            "Connections closed at once because max_connections were open.",
        )?;
        registry.register(Box::new(refused_connections.clone()))?;
        registry.register(Box::new(queue_wait_seconds.clone()))?;
        registry.register(Box::new(queue_depth.clone()))?;
        registry.register(Box::new(disagg_active.clone()))?;
        for m in [&requests, &retries, &prompt_tokens, &prompt_rests, &disagg] {
            registry.register(Box::new(m.clone()))?;
        }
        registry.register(Box::new(decision_seconds.clone()))?;
        registry.register(Box::new(prompt_read_seconds.clone()))?;
        registry.register(Box::new(predicted_cached_tokens.clone()))?;
        registry.register(Box::new(load.clone()))?;
        registry.register(Box::new(events.clone()))?;
        registry.register(Box::new(event_state.clone()))?;
        let replica = super::replicas::SyncMetrics::new(&registry)?;
        Ok(Metrics {
            registry,
            requests,
            decision_seconds,
            prompt_read_seconds,
            prompt_tokens,
            prompt_rests,
            predicted_cached_tokens,
            retries,
            disagg,
            disagg_active,
            queue_wait_seconds,
            expired,
            refused_connections,
            queue_depth,
            piece_cache,
            load,
            events,
            event_state,
            replica,
        })
    }

    /// The text exposition, per-worker gauges refreshed first.
    pub(crate) fn render(
        &self,
        router: &Router,
        backends: &Backends,
        text: Option<&ModelText>,
    ) -> String {
        if let Some(text) = text {
            let stats = text.tokenizer.stats();
            for (kind, value) in [
                ("hits", stats.hits),
                ("misses", stats.misses),
                ("pieces", stats.pieces as u64),
            ] {
                self.piece_cache
                    .with_label_values(&[kind])
                    .set(gauge(value));
            }
        }
        self.load.reset();
        self.events.reset();
        self.event_state.reset();
        self.queue_depth.set(gauge(router.queue_depth() as u64));
        self.replica.scrape(router);
        let fleet = router.fleet();
        for entry in &fleet.ranks {
            let WorkerRank { worker, dp_rank } = entry.rank;
            let (w, r) = (worker.0.to_string(), dp_rank.0.to_string());
            if let Some(load) = router.load(entry.rank) {
                for (kind, value) in [
                    ("requests", load.requests),
                    ("prefill_tokens", load.prefill_tokens),
                    ("decode_blocks", load.decode_blocks()),
                ] {
                    self.load
                        .with_label_values(&[&w, &r, kind])
                        .set(gauge(value));
                }
            }
        }
        for backend in backends.all() {
            let w = backend.spec.id.to_string();
            for (rank, s) in backend.event_stats().iter().enumerate() {
                let r = rank.to_string();
                for (kind, value) in [
                    ("received", s.received),
                    ("applied_batches", s.applied_batches),
                    ("applied_events", s.applied_events),
                    ("rejected_events", s.rejected_events),
                    ("foreign_rank_batches", s.foreign_rank_batches),
                    ("bad_frames", s.bad_frames),
                    ("gaps", s.sequence.gaps),
                    ("replay_requests", s.sequence.replay_requests),
                    ("replayed", s.sequence.replayed),
                    ("duplicates", s.sequence.duplicates),
                    ("restarts", s.sequence.restarts),
                    ("lost_batches", s.sequence.lost_batches),
                    ("replay_timeouts", s.replay_timeouts),
                    ("ranks_cleared", s.ranks_cleared),
                    ("connects", s.connects),
                    ("catch_ups", s.catch_ups),
                    ("caught_up_batches", s.caught_up_batches),
                    ("continued", s.continued),
                    ("new_epochs", s.new_epochs),
                    ("held_batches", s.held_batches),
                    ("unrooted_stores", s.unrooted_stores),
                    ("placed_under_peer", s.placed_under_peer),
                    ("turnover_blocks", s.turnover_blocks),
                    ("bad_payloads", s.decode.bad_payloads),
                    ("unknown_types", s.decode.unknown_types),
                    ("malformed_events", s.decode.malformed_events),
                    ("unknown_media", s.decode.unknown_media),
                    ("other_groups", s.decode.other_groups),
                    ("salted_blocks", s.decode.salted_blocks),
                    ("opaque_blocks", s.decode.opaque_blocks),
                    ("extra_keys_mismatch", s.decode.extra_keys_mismatch),
                ] {
                    self.events
                        .with_label_values(&[&w, &r, kind])
                        .set(gauge(value));
                }
                for state in RankState::ALL {
                    self.event_state
                        .with_label_values(&[&w, &r, state.as_str()])
                        .set(i64::from(s.state == state));
                }
            }
        }
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// A count as a gauge's value, saturating rather than wrapping past `i64::MAX`.
fn gauge(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
