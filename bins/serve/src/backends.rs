//! The engines behind the router: each one's HTTP address, its KV-event subscriptions, and its
//! health as the proxy sees it. Joining a backend joins the core's router and starts one
//! subscription per data-parallel rank (rank r on the event port + r); removing it stops them
//! and leaves the router, whose index drops its blocks.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvroute_core::{
    DpRank, Health, KvEvents, Router, RouterError, WorkerConfig, WorkerId, WorkerRole,
};
use kvroute_transport::{SubscriberConfig, SubscriberStats, Subscription};
use serde::{Deserialize, Serialize};

/// One engine as the operator describes it (a `[[workers]]` table, or `POST /v1/workers`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendSpec {
    /// Its id, unique among the backends.
    pub id: u64,
    /// Its OpenAI-compatible HTTP base URL (`http://host:port`).
    pub url: String,
    /// Its KV-event publisher (`tcp://host:port`): vLLM's `--kv-events-config` endpoint, or
    /// SGLang's; rank r publishes on port + r. None: the router learns nothing of its cache.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its replay endpoint (`tcp://host:port`), rank r on port + r.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// The topic its publisher sends (empty: any).
    #[serde(default)]
    pub topic: String,
    /// Data-parallel ranks it serves.
    #[serde(default = "one")]
    pub dp_size: u32,
    /// KV blocks per rank.
    pub kv_blocks: u64,
    /// Tokens per KV block (must be the router's).
    #[serde(default = "sixteen")]
    pub block_size: u32,
    /// The bearer key sent to it (the client's is never forwarded).
    #[serde(default)]
    pub api_key: Option<String>,
    /// Labels for routing constraints.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

fn one() -> u32 {
    1
}

fn sixteen() -> u32 {
    16
}

/// A backend that joined.
#[derive(Debug)]
pub(crate) struct Backend {
    pub spec: BackendSpec,
    /// Its OpenAI routes, parsed once: `/v1/completions` and `/v1/chat/completions`.
    pub urls: EngineUrls,
    /// `Bearer <api_key>`, when it has a key.
    pub authorization: Option<reqwest::header::HeaderValue>,
    pub subscriptions: Vec<Subscription>,
    /// Whether its blocks were dropped from the index since it was last seen up.
    pub forgotten: std::sync::atomic::AtomicBool,
}

/// An engine's OpenAI routes, parsed when it joins rather than per request.
#[derive(Debug)]
pub(crate) struct EngineUrls {
    pub completions: reqwest::Url,
    pub chat: reqwest::Url,
}

impl EngineUrls {
    fn new(base: &str) -> Result<Self, BackendError> {
        let parse = |path: &str| {
            reqwest::Url::parse(&format!("{}{path}", base.trim_end_matches('/')))
                .map_err(|e| BackendError::Invalid(format!("url {base:?}: {e}")))
        };
        Ok(EngineUrls {
            completions: parse("/v1/completions")?,
            chat: parse("/v1/chat/completions")?,
        })
    }
}

/// Why a backend could not be added.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The id is taken.
    #[error("worker {0} already exists")]
    Exists(u64),
    /// No such backend.
    #[error("worker {0} does not exist")]
    Unknown(u64),
    /// The spec cannot be used.
    #[error("invalid worker: {0}")]
    Invalid(String),
    /// The router refused it.
    #[error(transparent)]
    Router(#[from] RouterError),
    /// A subscription could not start.
    #[error("cannot subscribe to {endpoint}: {reason}")]
    Subscribe {
        /// The endpoint.
        endpoint: String,
        /// Why.
        reason: String,
    },
}

/// Every backend, by id.
#[derive(Debug, Default)]
pub(crate) struct Backends {
    by_id: RwLock<BTreeMap<u64, Arc<Backend>>>,
}

/// `tcp://host:port` with the port moved by `offset`.
fn offset_endpoint(endpoint: &str, offset: u32) -> Result<String, BackendError> {
    if offset == 0 {
        return Ok(endpoint.to_owned());
    }
    let (head, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| BackendError::Invalid(format!("no port in {endpoint:?}")))?;
    let port: u32 = port
        .parse()
        .map_err(|_| BackendError::Invalid(format!("bad port in {endpoint:?}")))?;
    Ok(format!("{head}:{}", port + offset))
}

impl Backends {
    /// Joins `spec` to `router` and subscribes to its events.
    pub(crate) async fn add(
        &self,
        router: &Arc<Router>,
        spec: BackendSpec,
        replay_timeout: Duration,
    ) -> Result<Arc<Backend>, BackendError> {
        if spec.dp_size == 0 || spec.kv_blocks == 0 {
            return Err(BackendError::Invalid(
                "dp_size and kv_blocks must be positive".to_owned(),
            ));
        }
        if !(spec.url.starts_with("http://") || spec.url.starts_with("https://")) {
            return Err(BackendError::Invalid(format!(
                "url {:?} is not http(s)",
                spec.url
            )));
        }
        let urls = EngineUrls::new(&spec.url)?;
        let authorization = match &spec.api_key {
            Some(key) => {
                let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| {
                        BackendError::Invalid("the api_key is not a valid header value".into())
                    })?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        if self.get(spec.id).is_some() {
            return Err(BackendError::Exists(spec.id));
        }
        let mut subscriptions = Vec::new();
        if let Some(events) = &spec.kv_events {
            for r in 0..spec.dp_size {
                let config = SubscriberConfig {
                    worker: WorkerId(spec.id),
                    dp_rank: DpRank(r),
                    endpoint: offset_endpoint(events, r)?,
                    replay: spec
                        .kv_replay
                        .as_deref()
                        .map(|e| offset_endpoint(e, r))
                        .transpose()?,
                    topic: spec.topic.clone(),
                    block_size: Some(spec.block_size),
                    replay_timeout,
                    sequence: Default::default(),
                };
                let endpoint = config.endpoint.clone();
                let subscription = Subscription::start(Arc::clone(router), config)
                    .await
                    .map_err(|e| BackendError::Subscribe {
                        endpoint,
                        reason: e.to_string(),
                    })?;
                subscriptions.push(subscription);
            }
        }
        router.join_worker(WorkerConfig {
            id: WorkerId(spec.id),
            dp_start: 0,
            dp_size: spec.dp_size,
            kv_blocks: spec.kv_blocks,
            block_size: spec.block_size,
            role: WorkerRole::default(),
            max_batched_tokens: WorkerConfig::simple(0, 1, 1).max_batched_tokens,
            labels: spec
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            kv_events: if spec.kv_events.is_some() {
                KvEvents::Published
            } else {
                KvEvents::Absent
            },
        })?;
        let backend = Arc::new(Backend {
            spec,
            urls,
            authorization,
            subscriptions,
            forgotten: std::sync::atomic::AtomicBool::new(false),
        });
        if let Ok(mut map) = self.by_id.write() {
            map.insert(backend.spec.id, Arc::clone(&backend));
        }
        tracing::info!(worker = backend.spec.id, url = %backend.spec.url, "worker joined");
        Ok(backend)
    }

    /// Stops following `id` and removes it from the router (its blocks leave the index).
    pub(crate) fn remove(&self, router: &Router, id: u64) -> Result<usize, BackendError> {
        let removed = self.by_id.write().ok().and_then(|mut m| m.remove(&id));
        let Some(backend) = removed else {
            return Err(BackendError::Unknown(id));
        };
        for s in &backend.subscriptions {
            s.stop();
        }
        let blocks = router.leave_worker(WorkerId(id))?;
        tracing::info!(worker = id, blocks, "worker left");
        Ok(blocks)
    }

    pub(crate) fn get(&self, id: u64) -> Option<Arc<Backend>> {
        self.by_id.read().ok().and_then(|m| m.get(&id).cloned())
    }

    pub(crate) fn all(&self) -> Vec<Arc<Backend>> {
        self.by_id
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }
}

impl Backend {
    /// Each rank's subscription counts, by rank.
    pub(crate) fn event_stats(&self) -> Vec<SubscriberStats> {
        self.subscriptions.iter().map(Subscription::stats).collect()
    }
}

/// Marks a worker down after a failed request; the prober brings it back, or, if it cannot
/// connect either, drops the worker's blocks from the index ([`Backend::forget`]).
pub(crate) fn mark_unreachable(router: &Router, id: u64) {
    if let Ok(before) = router.set_health(WorkerId(id), Health::Unreachable) {
        if before != Health::Unreachable {
            tracing::warn!(worker = id, "worker unreachable: marked down");
        }
    }
}

impl Backend {
    /// Drops what the index holds of this worker, once per time it is down: a worker the
    /// prober cannot even connect to has most likely lost its cache, and one that comes back
    /// publishes what it stores from then on (a restarted engine's sequence clears it anyway).
    pub(crate) fn forget(&self) {
        use std::sync::atomic::Ordering;
        if !self.forgotten.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                worker = self.spec.id,
                "worker still unreachable: its blocks dropped"
            );
            for s in &self.subscriptions {
                s.clear_index();
            }
        }
    }

    /// It answers again: a later outage may drop its blocks again.
    pub(crate) fn remembered(&self) {
        self.forgotten
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }
}
