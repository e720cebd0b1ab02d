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

use crate::networks::Network;
use crate::upstream::{engine_uri, Answer, Upstream, UpstreamError};
use axum::body::Bytes;
use axum::http::{header, HeaderName, HeaderValue, Uri};

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
    /// KV blocks per rank (vLLM logs it as "GPU KV cache size" ÷ block size).
    #[serde(default = "default_kv_blocks")]
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
    /// Its part in serving: whole requests (`both`, the default), or one half of
    /// disaggregated serving (`prefill`, `decode`).
    #[serde(default)]
    pub role: Role,
    /// A prefill worker's KV bootstrap port (SGLang's `--disaggregation-bootstrap-port`, 8998
    /// when not given): what both workers of a request are told in SGLang's protocol.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

/// A worker's part in serving.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Whole requests: prefill and decode on one engine.
    #[default]
    Both,
    /// Prefill only: computes prompts and hands their KV cache to a decode worker.
    Prefill,
    /// Decode only: generates from a cache a prefill worker handed it (and serves whole
    /// requests when no prefill worker is there).
    Decode,
}

impl Role {
    /// The core's name for it.
    pub fn worker_role(self) -> WorkerRole {
        match self {
            Role::Both => WorkerRole::Aggregated,
            Role::Prefill => WorkerRole::Prefill,
            Role::Decode => WorkerRole::Decode,
        }
    }

    /// As the config and `/v1/workers` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

fn one() -> u32 {
    1
}

fn sixteen() -> u32 {
    16
}

/// An 8B model's cache on one 80 GB GPU, in 16-token blocks, about.
fn default_kv_blocks() -> u64 {
    24_576
}

/// A backend that joined.
#[derive(Debug)]
pub(crate) struct Backend {
    pub spec: BackendSpec,
    /// Its OpenAI routes, parsed once: `/v1/completions` and `/v1/chat/completions`.
    pub urls: EngineUrls,
    /// `Bearer <api_key>`, when it has a key.
    pub authorization: Option<HeaderValue>,
    pub subscriptions: Vec<Subscription>,
    /// Whether its blocks were dropped from the index since it was last seen up.
    pub forgotten: std::sync::atomic::AtomicBool,
    /// Failures in a row (5xx before the first byte, no answer in time): past the breaker's
    /// threshold the engine is marked down; any answer resets it.
    pub failures: std::sync::atomic::AtomicU32,
    /// Whether its `/health` has answered since it joined (any answer: the engine is there).
    answered: std::sync::atomic::AtomicBool,
    /// The fleet's count of what is not ready (see [`Backends::any_not_flowing`]): this one
    /// counts in it until its health answers.
    not_flowing: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        if !self.answered.load(Ordering::Relaxed) {
            self.not_flowing.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// An engine's routes, parsed when it joins rather than per request.
#[derive(Debug)]
pub(crate) struct EngineUrls {
    pub completions: Uri,
    pub chat: Uri,
    pub health: Uri,
    pub models: Uri,
    pub metrics: Uri,
}

impl EngineUrls {
    fn new(base: &str) -> Result<Self, BackendError> {
        let parse = |path: &str| engine_uri(base, path).map_err(BackendError::Invalid);
        Ok(EngineUrls {
            completions: parse("/v1/completions")?,
            chat: parse("/v1/chat/completions")?,
            health: parse("/health")?,
            models: parse("/v1/models")?,
            metrics: parse("/metrics")?,
        })
    }
}

const DATA_PARALLEL_RANK: HeaderName = HeaderName::from_static(crate::headers::DATA_PARALLEL_RANK);

impl Backend {
    /// POSTs a JSON `body` to `uri`, one of this engine's routes, with its key and, on a
    /// data-parallel engine, the rank chosen (for the engine's own balancer: vLLM and SGLang
    /// both take it).
    pub(crate) async fn post(
        &self,
        client: &Upstream,
        uri: &Uri,
        dp_rank: u32,
        body: Bytes,
    ) -> Result<Answer, UpstreamError> {
        let key = self
            .authorization
            .iter()
            .map(|a| (header::AUTHORIZATION, a.clone()));
        let rank =
            (self.spec.dp_size > 1).then(|| (DATA_PARALLEL_RANK, HeaderValue::from(dp_rank)));
        client.post_json(uri, key.chain(rank), body).await
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
    /// Workers whose health has not answered yet, and subscriptions whose events do not flow
    /// (not reached yet, catching up, or gone).
    not_flowing: Arc<std::sync::atomic::AtomicUsize>,
    /// Workers with a part in disaggregated serving (role `prefill` or `decode`).
    split: std::sync::atomic::AtomicUsize,
}

/// `tcp://host:port` with the port moved by `offset`; an error when the port does not fit.
fn offset_endpoint(endpoint: &str, offset: u32) -> Result<String, BackendError> {
    if offset == 0 {
        return Ok(endpoint.to_owned());
    }
    let (head, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| BackendError::Invalid(format!("no port in {endpoint:?}")))?;
    let port: u16 = port
        .parse()
        .map_err(|_| BackendError::Invalid(format!("bad port in {endpoint:?}")))?;
    let moved = u32::from(port) + offset;
    if moved > u32::from(u16::MAX) {
        return Err(BackendError::Invalid(format!(
            "rank {offset} of {endpoint:?} would publish on port {moved}, past 65535"
        )));
    }
    Ok(format!("{head}:{moved}"))
}

/// Most data-parallel ranks one worker may declare: beyond any engine's, and a bound on what
/// one add can cost the router (every rank is a candidate in every decision).
pub const MAX_DP_SIZE: u32 = 1_024;

/// What a worker must keep to join.
#[derive(Clone, Debug)]
pub(crate) struct Limits {
    /// Most KV blocks per worker, over its ranks (the index reserves room by them).
    pub max_kv_blocks: u64,
    /// Where its URL and endpoints may point (empty: anywhere).
    pub networks: Vec<Network>,
    /// How long a KV-event replay may take.
    pub replay_timeout: Duration,
}

/// A spec that passed every check: what joining it needs, computed before anything changes.
struct Checked {
    urls: EngineUrls,
    authorization: Option<HeaderValue>,
    /// Per rank: its event endpoint and its replay endpoint.
    endpoints: Vec<(String, Option<String>)>,
}

/// Checks `spec` whole, changing nothing.
async fn check(spec: &BackendSpec, limits: &Limits) -> Result<Checked, BackendError> {
    let invalid = |why: String| Err(BackendError::Invalid(why));
    if spec.dp_size == 0 || spec.dp_size > MAX_DP_SIZE {
        return invalid(format!("dp_size must be in 1..={MAX_DP_SIZE}"));
    }
    let blocks = spec.kv_blocks.saturating_mul(u64::from(spec.dp_size));
    if spec.kv_blocks == 0 || blocks > limits.max_kv_blocks {
        return invalid(format!(
            "kv_blocks × dp_size must be in 1..={} (the gateway's max_kv_blocks)",
            limits.max_kv_blocks
        ));
    }
    if spec.bootstrap_port.is_some() && spec.role != Role::Prefill {
        return invalid(format!(
            "bootstrap_port is a prefill worker's (this one's role is {})",
            spec.role.as_str()
        ));
    }
    let urls = EngineUrls::new(&spec.url)?;
    let authorization = match &spec.api_key {
        Some(key) => {
            let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                BackendError::Invalid("the api_key is not a valid header value".into())
            })?;
            value.set_sensitive(true);
            Some(value)
        }
        None => None,
    };
    let mut endpoints = Vec::new();
    if let Some(events) = &spec.kv_events {
        for r in 0..spec.dp_size {
            let replay = spec
                .kv_replay
                .as_deref()
                .map(|e| offset_endpoint(e, r))
                .transpose()?;
            endpoints.push((offset_endpoint(events, r)?, replay));
        }
    }
    if !limits.networks.is_empty() {
        let host = urls.completions.host().unwrap_or_default().to_owned();
        let port = urls.completions.port_u16().unwrap_or(80);
        within(&limits.networks, &host, port).await?;
        for endpoint in [&spec.kv_events, &spec.kv_replay].into_iter().flatten() {
            let rest = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
            let (host, port) = rest.rsplit_once(':').unwrap_or((rest, "0"));
            within(&limits.networks, host, port.parse().unwrap_or(0)).await?;
        }
    }
    Ok(Checked {
        urls,
        authorization,
        endpoints,
    })
}

/// Whether every address `host` names lies in one of `networks`.
async fn within(networks: &[Network], host: &str, port: u16) -> Result<(), BackendError> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<std::net::IpAddr> = match bare.parse() {
        Ok(ip) => vec![ip],
        Err(_) => tokio::net::lookup_host((bare, port))
            .await
            .map_err(|e| BackendError::Invalid(format!("cannot resolve {host:?}: {e}")))?
            .map(|a| a.ip())
            .collect(),
    };
    match addrs
        .iter()
        .find(|ip| !networks.iter().any(|n| n.contains(**ip)))
    {
        None if !addrs.is_empty() => Ok(()),
        _ => Err(BackendError::Invalid(format!(
            "{host:?} is outside the worker networks ({})",
            networks
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

impl Backends {
    /// Joins `spec` to `router` and subscribes to its events: all or nothing. Every check
    /// runs before anything changes; a subscription that cannot start undoes the join.
    pub(crate) async fn add(
        &self,
        router: &Arc<Router>,
        client: &Upstream,
        spec: BackendSpec,
        limits: &Limits,
    ) -> Result<Arc<Backend>, BackendError> {
        let checked = check(&spec, limits).await?;
        if self.get(spec.id).is_some() {
            return Err(BackendError::Exists(spec.id));
        }
        router.join_worker(WorkerConfig {
            id: WorkerId(spec.id),
            dp_start: 0,
            dp_size: spec.dp_size,
            kv_blocks: spec.kv_blocks,
            block_size: spec.block_size,
            role: spec.role.worker_role(),
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
        let mut subscriptions: Vec<Subscription> = Vec::new();
        for (r, (endpoint, replay)) in checked.endpoints.into_iter().enumerate() {
            let config = SubscriberConfig {
                worker: WorkerId(spec.id),
                dp_rank: DpRank(r as u32),
                endpoint: endpoint.clone(),
                replay,
                topic: spec.topic.clone(),
                block_size: Some(spec.block_size),
                replay_timeout: limits.replay_timeout,
                sequence: Default::default(),
                not_flowing: Some(Arc::clone(&self.not_flowing)),
                capacity_blocks: Some(spec.kv_blocks),
            };
            match Subscription::start(Arc::clone(router), config).await {
                Ok(subscription) => subscriptions.push(subscription),
                Err(e) => {
                    for s in &subscriptions {
                        s.stop();
                    }
                    let _ = router.leave_worker(WorkerId(spec.id));
                    return Err(BackendError::Subscribe {
                        endpoint,
                        reason: e.to_string(),
                    });
                }
            }
        }
        self.not_flowing
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let backend = Arc::new(Backend {
            spec,
            urls: checked.urls,
            authorization: checked.authorization,
            subscriptions,
            forgotten: std::sync::atomic::AtomicBool::new(false),
            failures: std::sync::atomic::AtomicU32::new(0),
            answered: std::sync::atomic::AtomicBool::new(false),
            not_flowing: Arc::clone(&self.not_flowing),
        });
        tokio::spawn(bring_up(Arc::downgrade(&backend), client.clone()));
        if let Ok(mut map) = self.by_id.write() {
            if backend.spec.role != Role::Both {
                self.split
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            map.insert(backend.spec.id, Arc::clone(&backend));
        }
        tracing::info!(
            worker = backend.spec.id,
            url = %backend.spec.url,
            role = backend.spec.role.as_str(),
            "worker joined"
        );
        Ok(backend)
    }

    /// Stops following `id` and removes it from the router (its blocks leave the index).
    pub(crate) fn remove(&self, router: &Router, id: u64) -> Result<usize, BackendError> {
        let removed = self.by_id.write().ok().and_then(|mut m| m.remove(&id));
        let Some(backend) = removed else {
            return Err(BackendError::Unknown(id));
        };
        if backend.spec.role != Role::Both {
            self.split
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
        for s in &backend.subscriptions {
            s.stop();
        }
        let blocks = router.leave_worker(WorkerId(id))?;
        tracing::info!(worker = id, blocks, "worker left");
        Ok(blocks)
    }

    /// Whether some worker has a part in disaggregated serving (role `prefill` or `decode`).
    pub(crate) fn any_split(&self) -> bool {
        self.split.load(std::sync::atomic::Ordering::Relaxed) > 0
    }

    /// Whether some worker's events do not flow: then [`Backend::flowing`] tells which.
    pub(crate) fn any_not_flowing(&self) -> bool {
        self.not_flowing.load(std::sync::atomic::Ordering::Relaxed) > 0
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
    /// Whether requests may go to it: its health has answered since it joined, and its KV
    /// events flow on some rank (or it publishes none). Until then it may not be there, the
    /// index knows nothing true of it (not reached yet), or may hold what it no longer does
    /// (catching up after a return, or gone).
    pub(crate) fn flowing(&self) -> bool {
        self.answered.load(std::sync::atomic::Ordering::Relaxed)
            && (self.spec.kv_events.is_none()
                || self.subscriptions.iter().any(Subscription::flowing))
    }

    /// Its health answered: it counts as there from now on.
    fn health_answered(&self) {
        use std::sync::atomic::Ordering;
        if !self.answered.swap(true, Ordering::Relaxed) {
            self.not_flowing.fetch_sub(1, Ordering::Relaxed);
            tracing::info!(worker = self.spec.id, "worker answers its health");
        }
    }

    /// Each rank's subscription counts, by rank.
    pub(crate) fn event_stats(&self) -> Vec<SubscriberStats> {
        self.subscriptions.iter().map(Subscription::stats).collect()
    }
}

/// Asks a joined worker's `/health` until it answers (any answer: it is there), every 50 ms
/// at first, at most every second; stops once it has, or once the worker left.
async fn bring_up(backend: std::sync::Weak<Backend>, client: Upstream) {
    let mut wait = std::time::Duration::from_millis(50);
    loop {
        let Some(b) = backend.upgrade() else {
            return;
        };
        let asked = client.get(b.urls.health.clone());
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), asked).await {
            b.health_answered();
            return;
        }
        drop(b);
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(std::time::Duration::from_secs(1));
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

    /// A request failed on it in a way one request can cause (a 5xx, no answer in time):
    /// counted, and the engine marked down once `threshold` failed in a row. Returns whether
    /// this failure marked it down.
    pub(crate) fn failed(&self, router: &Router, threshold: u32) -> bool {
        use std::sync::atomic::Ordering;
        let n = self
            .failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if n < threshold.max(1) {
            return false;
        }
        self.failures.store(0, Ordering::Relaxed);
        mark_unreachable(router, self.spec.id);
        true
    }

    /// It answered: the breaker's count starts over.
    pub(crate) fn answered(&self) {
        self.failures.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// It answers again: a later outage may drop its blocks again.
    pub(crate) fn remembered(&self) {
        self.forgotten
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }
}
