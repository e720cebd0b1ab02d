//! `kvroute serve`: the router in front of OpenAI-compatible engines (vLLM, SGLang, or
//! `kvroute worker`), fed by their ZeroMQ KV events.
//!
//! ```text
//!  client ──HTTP──▶ proxy: prompt tokens ──▶ core Router (index + load) ──▶ chosen engine
//!                      ◀────────────── the engine's answer, unchanged ◀──────┘
//!  engines' publishers ──ZeroMQ──▶ transport::Subscription per rank ──▶ the Router's index
//! ```
//!
//! Module map:
//!
//! * `handlers.rs`: `/v1/completions` and `/v1/chat/completions`: read, then served whole or
//!   split.
//! * `proxy.rs`: a request's way to an engine: the prompt's tokens (chat rendered by the
//!   model's template), routing, forwarding, retries, the request lifecycle.
//! * `disagg/`: disaggregated prefill and decode, in vLLM's protocol and SGLang's (`sglang.rs`).
//! * `admin.rs`: `/v1/route`, `/v1/workers`, `/v1/models`, `/metrics`, `/ready`.
//! * `backends.rs`: [`BackendSpec`] and the registry of engines and their subscriptions.
//! * `upstream.rs`: the HTTP client to the engines (hyper's pooled client).
//! * `config.rs`: [`ServeConfig`], every key of the file, the environment and the flags.
//! * `metrics.rs`: the Prometheus registry.
//! * `headers.rs`: the header names the gateway reads and sets.
//! * `openai.rs`: OpenAI's request and response shapes (also the worker's and replay's).
//! * `replicas.rs`: several replicas, one fleet: bookings shared over NATS.
//! * `registry.rs`: the fleet's workers, shared by its replicas in NATS JetStream's KV store.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod admin;
mod auth;
mod backends;
mod config;
pub mod disagg;
mod engine_load;
mod handlers;
pub mod headers;
mod listener;
mod metrics;
mod networks;
pub mod openai;
mod proxy;
mod registry;
mod replicas;
mod upstream;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::routing::{delete, get, post};
use kvroute_core::{Health, IndexConfig, PrefixIndex, Router, RouterConfig, RouterError, WorkerId};
use tokio::net::TcpListener;

use kvroute_text::ModelText;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

pub use backends::{BackendError, BackendSpec, Role, MAX_DP_SIZE};
pub use config::{parse_worker_flag, ConfigError, ServeConfig};
pub use networks::{BadNetwork, Network};
pub use replicas::{
    nats_server_program, ReplicaError, ReplicaOptions, SYNC_BATCH, SYNC_BATCH_RANGE,
};
pub use upstream::with_causes;

/// How the service is set up.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Where HTTP listens (port 0: the system picks).
    pub listen: SocketAddr,
    /// The model served: requests naming another get a 404 (none: any name passes).
    pub model: Option<String>,
    /// LoRA adapters the engines serve (vLLM's `--lora-modules` names): a request naming one
    /// is routed by the adapter's KV blocks, which the engines publish under its name.
    pub lora_adapters: Vec<String>,
    /// The key clients must send as `Authorization: Bearer …` (none: no check). It is never
    /// forwarded; each worker gets its own `api_key`.
    pub api_key: Option<String>,
    /// The key the admin routes need (`/v1/workers`, bookings, and `/metrics` unless
    /// `public_metrics`); distinct from `api_key`. None: with an `api_key` the admin routes
    /// are closed, without one they are open.
    pub admin_key: Option<String>,
    /// `/metrics` answers without a key.
    pub public_metrics: bool,
    /// The engines to start with.
    pub workers: Vec<BackendSpec>,
    /// The router's configuration (policy, weights, block size).
    pub router: RouterConfig,
    /// Further workers tried when one fails before answering.
    pub retries: u32,
    /// How long a KV-event replay may take before its gap counts as lost.
    pub replay_timeout: Duration,
    /// How long a removed worker's requests may take to end before it leaves anyway.
    pub drain_timeout: Duration,
    /// How long requests in flight may take to finish once the program is told to stop
    /// (the program's to apply: [`RunningServe::stop`] then wait this long).
    pub grace: Duration,
    /// How often workers marked down are probed (`GET /health`).
    pub probe_every: Duration,
    /// How often bookings past the router's `request_expiry` are freed, and idle sessions
    /// and expired cache records dropped.
    pub expire_every: Duration,
    /// Largest request body, in bytes.
    pub max_body: usize,
    /// Longest a request's body may take to arrive whole.
    pub body_timeout: Duration,
    /// Longest a connection may wait for a request's head: a new connection's first, or a
    /// kept-alive connection's next (so also the idle timeout).
    pub header_timeout: Duration,
    /// Most client connections open at once; more are closed at once (counted).
    pub max_connections: usize,
    /// Longest a connection to an engine may take to open.
    pub connect_timeout: Duration,
    /// Longest an engine may take to start its answer (its status and headers: for a
    /// streamed answer, about its time to first token; for a whole one, all of it). Past it
    /// the request goes to the next best engine, if it has retries left.
    pub first_byte_timeout: Duration,
    /// Failures in a row (5xx before the answer, no answer in time) that mark an engine down
    /// until the prober sees it answer.
    pub breaker_failures: u32,
    /// Most KV blocks a worker may declare over its ranks (`kv_blocks × dp_size`): the index
    /// reserves room for their names (about 20 bytes a block), so this bounds what one add
    /// can take. The room is freed when the worker leaves (the allocator hands it back to
    /// the system lazily, when its thread next allocates).
    pub max_kv_blocks: u64,
    /// Address ranges worker URLs and event endpoints must lie in (empty: anywhere).
    pub worker_networks: Vec<Network>,
    /// The model's tokenizer and chat template (a directory with `tokenizer.json` and
    /// `tokenizer_config.json`): needed to route chat requests and text prompts.
    pub tokenizer: Option<std::path::PathBuf>,
    /// Tokenize every text prompt and chat whole. By default one is tokenized only as far as
    /// some worker may hold it, the rest counted by a length estimated from its bytes: the
    /// same choice, for much less tokenizing of mostly new prompts, except that a request
    /// with the same new text arriving while this one is in prefill sees only its tokenized
    /// part active.
    pub tokenize_whole: bool,
    /// Tokenize the rest of a prompt tokenized only in part afterwards, off the request's
    /// path, into the piece cache, so that the conversation's next turn tokenizes only its
    /// new text (at most one at a time for every two cores; skipped when busier).
    pub tokenize_rests: bool,
    /// How a fleet with prefill and decode workers serves requests (the protocol, fallbacks,
    /// conditional disaggregation; `router.disaggregation` says whether it is enforced).
    pub disagg: disagg::DisaggOptions,
    /// The longest prompt the engines take, in tokens (vLLM's `--max-model-len`): a longer
    /// one is refused with a 400 after at most about this many tokens of work. None: the
    /// tokenizer config's `model_max_length`, when it has a real one.
    pub max_model_len: Option<u64>,
    /// Share bookings with the fleet's other replicas over NATS (none: this replica alone).
    pub replicas: Option<ReplicaOptions>,
}

impl ServeOptions {
    /// What a worker must keep to join.
    pub(crate) fn limits(&self) -> backends::Limits {
        backends::Limits {
            max_kv_blocks: self.max_kv_blocks,
            networks: self.worker_networks.clone(),
            replay_timeout: self.replay_timeout,
        }
    }
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            model: None,
            lora_adapters: Vec::new(),
            api_key: None,
            admin_key: None,
            public_metrics: false,
            workers: Vec::new(),
            router: RouterConfig::default(),
            retries: 1,
            replay_timeout: Duration::from_secs(2),
            drain_timeout: Duration::from_secs(30),
            grace: Duration::from_secs(30),
            probe_every: Duration::from_secs(1),
            expire_every: Duration::from_secs(1),
            max_body: 32 << 20,
            body_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(30),
            max_connections: 4_096,
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout: Duration::from_secs(60),
            breaker_failures: 3,
            max_kv_blocks: 1 << 23,
            worker_networks: Vec::new(),
            tokenizer: None,
            tokenize_whole: false,
            tokenize_rests: true,
            disagg: disagg::DisaggOptions::default(),
            max_model_len: None,
            replicas: None,
        }
    }
}

/// What every handler shares.
#[derive(Debug, Clone)]
pub(crate) struct AppState {
    pub router: Arc<Router>,
    pub backends: Arc<backends::Backends>,
    pub client: upstream::Upstream,
    /// Behind one `Arc`: the state is cloned for every request, and the metrics are many
    /// handles.
    pub metrics: Arc<metrics::Metrics>,
    pub options: Arc<ServeOptions>,
    pub next_id: Arc<AtomicU64>,
    pub text: Option<Arc<ModelText>>,
    draining: Arc<RwLock<HashSet<WorkerId>>>,
    /// Whether disaggregated serving is active now.
    pub disagg: Arc<disagg::Activation>,
    /// Tokenizing off the runtime's threads: long prompts, and rests of prompts tokenized
    /// in part.
    pub offload: Arc<proxy::Offload>,
    /// The worker registry shared with the fleet's other replicas (none: no NATS).
    pub registry: Option<Arc<registry::SharedRegistry>>,
}

/// Bit 52 of a request id marks a `/v1/route` booking: only those can be freed through its
/// `DELETE` (a proxied request's booking is its own to free).
pub(crate) const ROUTE_BOOKING: u64 = 1 << 52;

impl AppState {
    /// A new id for a decision of `/v1/route` (marked with [`ROUTE_BOOKING`]).
    pub(crate) fn route_id(&self) -> kvroute_core::RequestId {
        kvroute_core::RequestId(
            self.next_id
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                | ROUTE_BOOKING,
        )
    }

    /// The longest prompt the engines take, in tokens: `max_model_len`, else the tokenizer
    /// config's `model_max_length`.
    pub(crate) fn max_prompt_tokens(&self) -> Option<u64> {
        self.options
            .max_model_len
            .or_else(|| self.text.as_ref().and_then(|t| t.max_length))
    }

    /// The keys the auth layer checks.
    pub(crate) fn keys(&self) -> auth::Keys<'_> {
        auth::Keys {
            client: self.options.api_key.as_deref(),
            admin: self.options.admin_key.as_deref(),
            public_metrics: self.options.public_metrics,
        }
    }

    /// Workers no new request may go to.
    pub(crate) fn draining(&self) -> HashSet<WorkerId> {
        self.draining.read().map(|d| d.clone()).unwrap_or_default()
    }

    pub(crate) fn set_draining(&self, worker: WorkerId, on: bool) {
        if let Ok(mut d) = self.draining.write() {
            if on {
                d.insert(worker);
            } else {
                d.remove(&worker);
            }
        }
    }
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The router could not be built.
    #[error(transparent)]
    Router(#[from] RouterError),
    /// A configured worker could not join.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The tokenizer or chat template could not be loaded.
    #[error(transparent)]
    Text(#[from] kvroute_text::ModelTextError),
    /// The metrics or the configuration could not be set up.
    #[error("{0}")]
    Setup(String),
    /// The booking sync could not start.
    #[error(transparent)]
    Replicas(#[from] ReplicaError),
}

/// A service that is serving.
#[derive(Debug)]
pub struct RunningServe {
    /// Where HTTP listens.
    pub listen: SocketAddr,
    router: Arc<Router>,
    shutdown: Arc<Notify>,
    server: JoinHandle<std::io::Result<()>>,
    prober: JoinHandle<()>,
    expirer: JoinHandle<()>,
    /// The engines' reported load, read while the booking sync is down (replicas only).
    engine_load: Option<JoinHandle<()>>,
    sync: Option<replicas::ReplicaSync>,
    /// The registry's watch, and what its changes started.
    registry: Option<(JoinHandle<()>, Arc<registry::SharedRegistry>)>,
}

impl RunningServe {
    /// Builds the router, joins the configured workers, and serves on the current runtime.
    pub async fn start(options: ServeOptions) -> Result<Self, ServeError> {
        check_keys(&options)?;
        let replica = options
            .replicas
            .as_ref()
            .map(|_| replicas::new_replica_id());
        let mut config = options.router.clone();
        if let Some(id) = replica {
            // Replicas break near-ties each its own way, so they do not herd.
            config.seed ^= id.0;
        }
        let router = Arc::new(Router::new(
            config,
            PrefixIndex::new(IndexConfig::default()),
        )?);
        let text = match &options.tokenizer {
            Some(dir) => {
                let mut text = ModelText::load(dir)?;
                if options.max_model_len.is_some() {
                    text.max_length = options.max_model_len;
                }
                tracing::info!(
                    dir = %dir.display(),
                    fast_path = text.tokenizer.fast(),
                    chunked = text.tokenizer.chunked(),
                    chat_template = text.template.is_some(),
                    "tokenizer loaded"
                );
                Some(Arc::new(text))
            }
            None => None,
        };
        // Engines are reached directly (no proxy from the environment: HTTP_PROXY is for a
        // host's way out, not its own fleet), and a redirect is the engine's answer, passed
        // back as it is rather than followed with the client's body.
        let client = upstream::Upstream::new(options.connect_timeout, 256);
        let backends = Arc::new(backends::Backends::default());
        for spec in &options.workers {
            backends
                .add(&router, &client, spec.clone(), &options.limits())
                .await?;
        }
        let listener =
            TcpListener::bind(options.listen)
                .await
                .map_err(|source| ServeError::Listen {
                    addr: options.listen,
                    source,
                })?;
        let listen = listener.local_addr().map_err(|source| ServeError::Listen {
            addr: options.listen,
            source,
        })?;
        let state_metrics =
            Arc::new(metrics::Metrics::new().map_err(|e| ServeError::Setup(e.to_string()))?);
        let sync = match (&options.replicas, replica) {
            (Some(r), Some(id)) => Some(
                replicas::ReplicaSync::start(&router, r, id, state_metrics.replica.clone()).await?,
            ),
            _ => None,
        };
        let state = AppState {
            router: Arc::clone(&router),
            backends: Arc::clone(&backends),
            client: client.clone(),
            metrics: Arc::clone(&state_metrics),
            options: Arc::new(options.clone()),
            // A replica's request ids start at a base of its own (19 bits of its id, then
            // 32 of count: under bit 52, which marks `/v1/route`'s bookings, and 2⁵³ for JSON
            // clients), so that an id booked by `/v1/route` on one replica names nothing of
            // another's (but for replicas whose ids share their 19 low bits).
            next_id: Arc::new(AtomicU64::new(
                replica.map_or(0, |r| (r.0 & 0x7_ffff).max(1) << 32),
            )),
            text,
            draining: Arc::default(),
            disagg: Arc::default(),
            offload: Arc::new(proxy::Offload::new()),
            registry: sync.as_ref().map(|_| Arc::default()),
        };
        let registry = match (&sync, &state.registry, &options.replicas) {
            (Some(sync), Some(shared), Some(r)) => Some((
                registry::start(state.clone(), sync.client(), &r.fleet, Arc::clone(shared)),
                Arc::clone(shared),
            )),
            _ => None,
        };
        let app = axum::Router::new()
            .route("/v1/completions", post(handlers::completions))
            .route("/v1/chat/completions", post(handlers::chat_completions))
            .route("/v1/models", get(admin::models))
            .route("/v1/route", post(admin::route))
            .route("/v1/route/{id}", delete(admin::free_route))
            .route(
                "/v1/workers",
                get(admin::list_workers).post(admin::add_worker),
            )
            .route("/v1/workers/{id}", delete(admin::remove_worker))
            .route("/metrics", get(admin::metrics))
            .route("/health", get(|| async { StatusCode::OK }))
            .route("/ready", get(admin::ready))
            .layer(DefaultBodyLimit::max(options.max_body))
            .layer(axum::middleware::from_fn_with_state(
                Arc::new(state.clone()),
                listener::edge,
            ))
            .with_state(state);
        let shutdown = Arc::new(Notify::new());
        let bounds = listener::Bounds {
            max_connections: options.max_connections,
            header_timeout: options.header_timeout,
        };
        let server = tokio::spawn(listener::serve(
            listener,
            app,
            bounds,
            Arc::clone(&shutdown),
            state_metrics.refused_connections.clone(),
        ));
        let expirer = tokio::spawn(expire(
            Arc::clone(&router),
            Arc::clone(&state_metrics),
            options.expire_every,
        ));
        let engine_load = sync.as_ref().map(|_| {
            let sync_metrics = state_metrics.replica.clone();
            engine_load::start(
                Arc::clone(&router),
                Arc::clone(&backends),
                client.clone(),
                move || !sync_metrics.is_up(),
            )
        });
        let prober = tokio::spawn(probe(
            Arc::clone(&router),
            backends,
            client,
            options.probe_every,
        ));
        Ok(RunningServe {
            listen,
            router,
            shutdown,
            server,
            prober,
            expirer,
            engine_load,
            sync,
            registry,
        })
    }

    /// The router (its load, index and counters).
    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// Stops accepting; requests in flight finish (graceful shutdown).
    pub fn stop(&self) {
        self.shutdown.notify_one();
    }

    /// Waits until the server has stopped. Call it until it returns once, not again after.
    pub async fn wait(&mut self) -> std::io::Result<()> {
        let result = match (&mut self.server).await {
            Ok(result) => result,
            Err(e) => Err(std::io::Error::other(e)),
        };
        self.prober.abort();
        self.expirer.abort();
        if let Some(engine_load) = self.engine_load.take() {
            engine_load.abort();
        }
        if let Some((watch, shared)) = self.registry.take() {
            // The watch stopped first: a change it was applying cannot start a task after.
            watch.abort();
            let _ = watch.await;
            shared.abort_tasks();
        }
        if let Some(sync) = self.sync.take() {
            sync.leave().await;
        }
        result
    }
}

/// Frees bookings past the router's `request_expiry` (a `/v1/route` booking nobody freed, a
/// request that never ended), ends idle sessions and drops expired cache records, every
/// `every`.
async fn expire(router: Arc<Router>, metrics: Arc<metrics::Metrics>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let freed = router.expire();
        router.expire_sessions();
        if freed > 0 {
            metrics.expired.inc_by(freed as u64);
            tracing::warn!(freed, "bookings expired: freed");
        }
    }
}

/// Keys that are empty, or one key for both roles, are refused.
fn check_keys(options: &ServeOptions) -> Result<(), ServeError> {
    let bad = |why: &str| Err(ServeError::Setup(why.to_owned()));
    if options.api_key.as_deref() == Some("") || options.admin_key.as_deref() == Some("") {
        return bad("an API key is empty");
    }
    if options.api_key.is_some() && options.api_key == options.admin_key {
        return bad("the admin key must differ from the client key (api_key)");
    }
    Ok(())
}

/// Brings workers marked down back once their `/health` answers.
async fn probe(
    router: Arc<Router>,
    backends: Arc<backends::Backends>,
    client: upstream::Upstream,
    every: Duration,
) {
    loop {
        tokio::time::sleep(every).await;
        let fleet = router.fleet();
        for backend in backends.all() {
            let id = WorkerId(backend.spec.id);
            let down = fleet
                .ranks
                .iter()
                .any(|r| r.rank.worker == id && r.state.health() != Health::Healthy);
            if !down {
                continue;
            }
            let answer = tokio::time::timeout(
                Duration::from_secs(2),
                client.get(backend.urls.health.clone()),
            )
            .await;
            match answer {
                Ok(Ok(r)) if r.status().is_success() => {
                    if router.set_health(id, Health::Healthy).is_ok() {
                        backend.remembered();
                        tracing::info!(worker = id.0, "worker answers again: marked up");
                    }
                }
                // It answers, but not well: alive, its cache likely kept.
                Ok(Ok(_)) => {}
                // No connection, or no answer in time: its blocks leave the index.
                Ok(Err(_)) | Err(_) => backend.forget(),
            }
        }
    }
}
