//! The worker's Prometheus metrics, under vLLM's names so that anything that scrapes a vLLM
//! server (a router's load poller, a dashboard) reads the simulated one alike; the event
//! publisher's own counts under `kvroute_worker_`.

use prometheus::{Encoder, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

use super::driver::DriverStats;
use super::publisher::PublisherCounts;

/// The metrics, refreshed from the driver's and the publisher's counts at each scrape.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    registry: Registry,
    running: IntGauge,
    waiting: IntGauge,
    kv_usage_milli: IntGauge,
    kv_usage: prometheus::Gauge,
    prefix_queries: IntCounter,
    prefix_hits: IntCounter,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    success: IntCounterVec,
    preemptions: IntCounter,
    batches: IntCounterVec,
    replays: IntCounter,
    restarts: IntCounter,
}

/// The registry could not be built (a name clash: a bug).
#[derive(Debug, thiserror::Error)]
#[error("metrics: {0}")]
pub(crate) struct MetricsError(#[from] prometheus::Error);

impl Metrics {
    /// Every metric, labelled with the served model's name.
    pub(crate) fn new(model: &str) -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label("model_name", model);
        let gauge = |name: &str, help: &str| -> Result<IntGauge, MetricsError> {
            let g = IntGauge::with_opts(opts(name, help))?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let counter = |name: &str, help: &str| -> Result<IntCounter, MetricsError> {
            let c = IntCounter::with_opts(opts(name, help))?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let running = gauge(
            "vllm:num_requests_running",
            "Requests in the running batch.",
        )?;
        let waiting = gauge(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled.",
        )?;
        let kv_usage_milli = gauge(
            "kvroute_worker_kv_cache_usage_permille",
            "KV blocks held by requests, per thousand of the cache.",
        )?;
        let kv_usage = prometheus::Gauge::with_opts(opts(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: 1 means 100 percent.",
        ))?;
        registry.register(Box::new(kv_usage.clone()))?;
        let prefix_queries = counter(
            "vllm:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
        )?;
        let prefix_hits = counter(
            "vllm:prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache.",
        )?;
        let prompt_tokens = counter("vllm:prompt_tokens_total", "Prompt tokens admitted.")?;
        let generation_tokens = counter("vllm:generation_tokens_total", "Tokens generated.")?;
        let preemptions = counter("vllm:num_preemptions_total", "Preemptions.")?;
        let success = IntCounterVec::new(
            opts(
                "vllm:request_success_total",
                "Requests that ended, by reason.",
            ),
            &["finished_reason"],
        )?;
        registry.register(Box::new(success.clone()))?;
        let batches = IntCounterVec::new(
            opts(
                "kvroute_worker_kv_event_batches_total",
                "KV-event batches, by what became of them on the live stream.",
            ),
            &["outcome"],
        )?;
        registry.register(Box::new(batches.clone()))?;
        let replays = counter(
            "kvroute_worker_kv_event_replays_total",
            "Replay requests answered.",
        )?;
        let restarts = counter(
            "kvroute_worker_kv_event_restarts_total",
            "Publisher restarts (sequence back to 0).",
        )?;
        Ok(Metrics {
            registry,
            running,
            waiting,
            kv_usage_milli,
            kv_usage,
            prefix_queries,
            prefix_hits,
            prompt_tokens,
            generation_tokens,
            success,
            preemptions,
            batches,
            replays,
            restarts,
        })
    }

    /// The text exposition after taking in the latest counts.
    pub(crate) fn render(
        &self,
        driver: &DriverStats,
        publisher: Option<&PublisherCounts>,
    ) -> String {
        let engine = &driver.engine;
        self.running.set(i64::from(engine.running));
        self.waiting.set(i64::from(engine.waiting));
        let usage = if engine.blocks.total == 0 {
            0.0
        } else {
            f64::from(engine.blocks.in_use) / f64::from(engine.blocks.total)
        };
        self.kv_usage.set(usage);
        self.kv_usage_milli.set((usage * 1000.0).round() as i64);
        sync(&self.prefix_queries, engine.prefix_query_tokens);
        sync(&self.prefix_hits, engine.prefix_hit_tokens);
        sync(&self.prompt_tokens, driver.prompt_tokens);
        sync(&self.generation_tokens, driver.generation_tokens);
        sync(&self.preemptions, engine.preemptions);
        sync(
            &self.success.with_label_values(&["length"]),
            driver.finished,
        );
        sync(&self.success.with_label_values(&["abort"]), driver.aborted);
        if let Some(p) = publisher {
            sync(&self.batches.with_label_values(&["sent"]), p.sent);
            sync(&self.batches.with_label_values(&["dropped"]), p.dropped);
            sync(&self.replays, p.replays);
            sync(&self.restarts, p.restarts);
        }
        let mut out = Vec::new();
        // Encoding into a Vec fails only on a malformed family, which the registry refuses.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// Raises a counter to `total` (counts only grow).
fn sync(counter: &IntCounter, total: u64) {
    let now = counter.get();
    if total > now {
        counter.inc_by(total - now);
    }
}
