//! `kvroute worker`: the simulated engine behind vLLM's own interfaces, so that a router drives
//! it exactly as it drives `vllm serve`: OpenAI HTTP, KV events on vLLM's ZeroMQ wire with its
//! replay socket, Prometheus metrics under vLLM's names, and admin routes for faults; and,
//! when asked, behind kvroute's own rkyv request wire (the transport's worker server). With
//! prefill and decode split, it plays either role ([`Role`]) in vLLM's protocol and SGLang's.
//!
//! ```text
//!  HTTP (axum) ──Command──▶ driver task: Engine passes in real time ──▶ outputs ──▶ HTTP / SSE
//!  rkyv wire (WorkerServer) ─┘                 │                       └──────────▶ wire items
//!                                              └──▶ event batches ──▶ Publisher: PUB + ROUTER
//!  decode half ──POST /kv/pull──▶ prefill worker's HTTP or bootstrap server (its hand-overs)
//! ```
//!
//! Module map:
//!
//! * `driver.rs`: the task that owns the engine and paces its passes.
//! * `http.rs`: the routes (OpenAI, metrics, admin).
//! * `disagg.rs`: the halves of a disaggregated request: [`Role`], the hand-overs a prefill
//!   worker keeps, the pull a decode worker makes.
//! * `publisher.rs`: [`Publisher`], vLLM's ZeroMQ event wire, with [`encode_batch`].
//! * `metrics.rs`: the Prometheus registry.
//! * `wire.rs`: the engine behind the transport's worker server.

mod disagg;
mod driver;
mod http;
mod metrics;
mod publisher;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use kvroute_sim::{Engine, EngineConfig, SimError};

pub use disagg::{DisaggOptions, Role};
pub use driver::DriverStats;
pub use publisher::{
    encode_batch, BindError, EventFault, Publisher, PublisherConfig, PublisherCounts,
};

/// How a worker is set up.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Where HTTP listens (port 0: the system picks).
    pub http: SocketAddr,
    /// The model name served (requests naming another get a 404).
    pub model: String,
    /// The engine's model: cache size, limits, timing, speed-up.
    pub engine: EngineConfig,
    /// Longest prompt plus output a request may ask for.
    pub max_model_len: u32,
    /// The KV-event publisher; none, no events.
    pub kv_events: Option<PublisherConfig>,
    /// Largest request body accepted, in bytes.
    pub max_body: usize,
    /// The model's tokenizer files (`tokenizer.json`, `tokenizer_config.json`): text prompts
    /// and chat requests need them.
    pub tokenizer: Option<std::path::PathBuf>,
    /// Where kvroute's own request wire listens (rkyv frames over io_uring or epoll; port 0:
    /// the system picks); none, HTTP only.
    pub wire: Option<SocketAddr>,
    /// The worker's id in the wire's handshake.
    pub worker_id: u64,
    /// Its role when prefill and decode are split, its bootstrap server and transfer link.
    pub disagg: DisaggOptions,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        WorkerOptions {
            http: SocketAddr::from(([127, 0, 0, 1], 8000)),
            model: "kvroute-sim".to_owned(),
            engine: EngineConfig::default(),
            max_model_len: 131_072,
            kv_events: None,
            max_body: 32 << 20,
            tokenizer: None,
            wire: None,
            worker_id: 0,
            disagg: DisaggOptions::default(),
        }
    }
}

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The engine's configuration cannot run.
    #[error(transparent)]
    Engine(#[from] SimError),
    /// The HTTP listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The event publisher could not bind.
    #[error(transparent)]
    Events(#[from] BindError),
    /// The tokenizer or chat template could not be loaded.
    #[error(transparent)]
    Text(#[from] kvroute_text::ModelTextError),
    /// The metrics could not be registered.
    #[error("{0}")]
    Metrics(String),
    /// The HTTP client that pulls KV from prefill workers could not be built.
    #[error("the transfer client: {0}")]
    Client(String),
    /// The request wire's server could not start.
    #[error("the request wire: {0}")]
    Wire(#[from] kvroute_transport::worker::WorkerServerError),
}

/// A worker that is serving.
#[derive(Debug)]
pub struct RunningWorker {
    /// Where its HTTP listens.
    pub http: SocketAddr,
    /// Where its live KV events are published, if they are.
    pub events: Option<String>,
    /// Where its replay socket listens, if it has one.
    pub replay: Option<String>,
    /// Where kvroute's request wire listens, if it does.
    pub wire: Option<SocketAddr>,
    /// Where its bootstrap server (SGLang's protocol) listens, if it has one.
    pub bootstrap: Option<SocketAddr>,
    shutdown: Arc<Notify>,
    server: JoinHandle<std::io::Result<()>>,
}

impl RunningWorker {
    /// Binds everything and starts serving on the current tokio runtime.
    pub async fn start(options: WorkerOptions) -> Result<Self, WorkerError> {
        let engine = Engine::new(options.engine)?;
        let text = match &options.tokenizer {
            Some(dir) => Some(Arc::new(kvroute_text::ModelText::load(dir)?)),
            None => None,
        };
        let (publisher, events, replay) = match options.kv_events.clone() {
            Some(config) => {
                let (p, live, replay) = Publisher::start(config).await?;
                (Some(p), Some(live), replay)
            }
            None => (None, None, None),
        };
        let listener =
            TcpListener::bind(options.http)
                .await
                .map_err(|source| WorkerError::Listen {
                    addr: options.http,
                    source,
                })?;
        let http = listener
            .local_addr()
            .map_err(|source| WorkerError::Listen {
                addr: options.http,
                source,
            })?;
        let bootstrap = match options.disagg.bootstrap {
            Some(addr) => {
                let listener = TcpListener::bind(addr)
                    .await
                    .map_err(|source| WorkerError::Listen { addr, source })?;
                let local = listener
                    .local_addr()
                    .map_err(|source| WorkerError::Listen { addr, source })?;
                Some((listener, local))
            }
            None => None,
        };
        let metrics = metrics::Metrics::new(&options.model)
            .map_err(|e| WorkerError::Metrics(e.to_string()))?;
        let shutdown = Arc::new(Notify::new());
        let config = options.engine;
        let driver = driver::Driver::start(engine, publisher.clone());
        let wire_server = match options.wire {
            Some(addr) => Some(wire::start(
                addr,
                options.worker_id,
                &config,
                driver.clone(),
            )?),
            None => None,
        };
        let wire = wire_server.as_ref().map(|w| w.local_addr());
        let handoffs = Arc::new(disagg::Handoffs::new(options.disagg.timeout));
        let client = reqwest::Client::builder()
            .tcp_nodelay(true)
            .no_proxy()
            .build()
            .map_err(|e| WorkerError::Client(e.to_string()))?;
        let state = http::AppState {
            driver,
            publisher,
            metrics,
            model: options.model.as_str().into(),
            max_model_len: options.max_model_len,
            shutdown: Arc::clone(&shutdown),
            text,
            http,
            block_size: config.block_size,
            disagg: Arc::new(options.disagg.clone()),
            handoffs: Arc::clone(&handoffs),
            engine_id: format!("kvroute-worker-{http}").into(),
            client,
        };
        let app = http::router(state, options.max_body);
        let stop = Arc::clone(&shutdown);
        let (stopping, stopped) = tokio::sync::watch::channel(false);
        let bootstrap_addr = bootstrap.as_ref().map(|(_, addr)| *addr);
        let bootstrap_server = bootstrap.map(|(listener, _)| {
            let app = http::bootstrap_router(Arc::clone(&handoffs));
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    })
                    .await
            })
        });
        let server = tokio::spawn(async move {
            // Small writes (SSE chunks, a response's head) go out at once: with Nagle's
            // algorithm a chunk waits for the peer's delayed ACK, some 40 ms.
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    stop.notified().await;
                    // Pulls waiting for a prompt are answered now, not at their timeout.
                    handoffs.fail_all("the worker is stopping");
                    let _ = stopping.send(true);
                })
                .await;
            if let Some(b) = bootstrap_server {
                let _ = b.await;
            }
            if let Some(w) = wire_server {
                // Live wire requests get the server's grace period; it blocks, so off the
                // runtime's threads.
                let _ = tokio::task::spawn_blocking(move || w.shutdown()).await;
            }
            served
        });
        Ok(RunningWorker {
            http,
            events,
            replay,
            wire,
            bootstrap: bootstrap_addr,
            shutdown,
            server,
        })
    }

    /// Asks the server to stop (as `POST /admin/exit` does).
    pub fn stop(&self) {
        self.shutdown.notify_one();
    }

    /// Waits until the server has stopped (after [`RunningWorker::stop`], an exit request, or a
    /// failure). Call it until it returns once, not again after.
    pub async fn wait(&mut self) -> std::io::Result<()> {
        match (&mut self.server).await {
            Ok(result) => result,
            Err(e) => Err(std::io::Error::other(e)),
        }
    }
}
