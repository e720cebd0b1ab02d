//! The worker side of request dispatch: routers connect, say Hello, send requests, and read
//! each request's response stream back.
//!
//! ```text
//!  router ─TCP─▶ runtime thread (own SO_REUSEPORT listener, io_uring or epoll)
//!                 handshake: router's Hello ─▶ our Hello
//!                 reader task ── Dispatch ─▶ spawn Engine::serve(request, sink) ─┐
//!                             ── Cancel ───▶ abort that task, queue `Cancelled`   │
//!                 writer task ◀── bounded queue of items (ResponseSink::send) ◀───┘
//!                             ── heartbeats with Engine::load every interval
//! ```
//!
//! * The embedder's [`Engine`] produces a request's items through a [`ResponseSink`]; the
//!   future `serve` returns *is* the request: when it ends, so does the request. A future that
//!   ends without a finishing item gets one (finish `Error`) so that the router's stream always
//!   ends.
//! * Exactly one finishing item per request reaches the router: the writer passes an item only
//!   while its request is live, and the first finishing item it writes retires the request. A
//!   Cancel marks the sink closed, aborts the engine's task and queues a `Cancelled` item; an
//!   item the engine queued before it still goes first, and whichever finishes first wins.
//! * Backpressure: items wait in a bounded queue per connection; when the router reads slowly
//!   the writer waits on the socket, the queue fills, and `ResponseSink::send` waits. Requests
//!   above `max_in_flight` on a connection are answered at once with a finishing `Error` item.
//! * Both sides send a heartbeat every interval; a connection silent for `idle_timeout` is
//!   closed. A write held up by a router that reads slowly but still sends heartbeats is
//!   waited for, however long. A connection that ends (peer gone, bad frame, silence) aborts
//!   its requests' tasks.
//! * [`WorkerServer::shutdown`] stops accepting, refuses new requests, lets live ones finish
//!   within the grace period, closes the connections and returns the totals.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use crate::backend::{Backend, BackendChoice, BackendError};
use crate::conn::{FlushError, FrameReader, FrameWriter, ReadEnd};
use crate::frame::{DecodeStats, FrameError, MAX_PAYLOAD};
use crate::net::{self, ConnEvent, Stream};
use crate::wire::{
    Dispatch, FinishReason, Heartbeat, Hello, Message, MessageRef, RankLoad, ResponseItem,
};

/// What serves requests on a worker: a real engine's bridge, or a simulation.
///
/// One engine serves every connection on every runtime thread, so it is `Send + Sync`; the
/// futures it returns run on the thread of the connection that brought the request and need
/// not be `Send`.
pub trait Engine: Send + Sync + 'static {
    /// Serves `request`, sending its items through `sink`, the last one with a finish reason.
    /// The request lasts as long as the returned future: a Cancel, or the loss of the
    /// connection, drops it.
    fn serve(&self, request: Dispatch, sink: ResponseSink) -> impl Future<Output = ()> + 'static;

    /// The load of each rank, for the next heartbeat. Called once per heartbeat interval per
    /// connection; must not block.
    fn load(&self) -> Vec<RankLoad> {
        Vec::new()
    }
}

/// Settings of a [`WorkerServer`].
#[derive(Clone, Debug)]
pub struct WorkerServerConfig {
    /// Where to listen; port 0 picks a free port ([`WorkerServer::local_addr`] tells which).
    pub addr: SocketAddr,
    /// The I/O backend to run on.
    pub backend: BackendChoice,
    /// Runtime threads, each with its own listener; 0 means one per available core.
    pub threads: usize,
    /// Largest payload accepted, in bytes (capped at [`MAX_PAYLOAD`]).
    pub max_payload: u32,
    /// Spare room each read asks for, in bytes.
    pub read_chunk: usize,
    /// Requests served at once on one connection; more are refused with an `Error` item.
    pub max_in_flight: usize,
    /// Items waiting for a connection's writer; a full queue makes the engine's sends wait.
    pub response_queue: usize,
    /// How often each connection sends the router a heartbeat with the engine's load.
    pub heartbeat_interval: Duration,
    /// A connection with nothing received for this long is closed.
    pub idle_timeout: Duration,
    /// How long a new connection has to send its Hello.
    pub handshake_timeout: Duration,
    /// How long [`WorkerServer::shutdown`] lets live requests run before cutting them.
    pub shutdown_grace: Duration,
}

impl WorkerServerConfig {
    /// Defaults, listening on `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        WorkerServerConfig {
            addr,
            backend: BackendChoice::Auto,
            threads: 0,
            max_payload: 16 << 20,
            read_chunk: 64 << 10,
            max_in_flight: 1024,
            response_queue: 1024,
            heartbeat_interval: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// Errors of starting and stopping the server.
#[derive(Debug, thiserror::Error)]
pub enum WorkerServerError {
    /// The backend could not be chosen or its runtime built.
    #[error(transparent)]
    Backend {
        /// Why.
        #[from]
        source: BackendError,
    },
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The bind's error.
        #[source]
        source: std::io::Error,
    },
    /// A thread could not be started.
    #[error("cannot start thread {thread}: {source}")]
    Spawn {
        /// The thread's name.
        thread: String,
        /// The spawn's error.
        #[source]
        source: std::io::Error,
    },
    /// A thread of the server panicked (found while starting or at shutdown).
    #[error("worker server thread {thread} panicked")]
    Panicked {
        /// The thread's name.
        thread: String,
    },
}

/// The engine's side of one request's response stream.
#[derive(Debug)]
pub struct ResponseSink {
    request_id: u64,
    tx: mpsc::Sender<Outbound>,
    state: Arc<SinkState>,
}

/// The request behind a sink has ended (cancelled, connection gone); nothing more is sent.
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
#[error("request {request_id} has ended: its items are no longer sent")]
pub struct SinkClosed {
    /// The request.
    pub request_id: u64,
}

#[derive(Debug, Default)]
struct SinkState {
    /// Set by the connection (Cancel, connection end). Relaxed: it only stops further sends
    /// early; the writer's live table is what keeps a closed request's items off the wire.
    closed: AtomicBool,
    /// Set by the sink when it queues a finishing item. Relaxed: read on the same thread
    /// after the engine's future has returned.
    finished: AtomicBool,
}

impl ResponseSink {
    /// The id of the request it answers.
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// Whether the request has ended (sends would fail).
    pub fn is_closed(&self) -> bool {
        self.state.closed.load(Ordering::Relaxed)
    }

    /// Sends tokens generated since the last item. Waits while the connection's queue is full.
    pub async fn send(&mut self, tokens: Vec<u32>) -> Result<(), SinkClosed> {
        self.push(tokens, None, None).await
    }

    /// Sends the last item: `tokens` (may be empty) and why the request ended.
    pub async fn finish(
        mut self,
        tokens: Vec<u32>,
        reason: FinishReason,
    ) -> Result<(), SinkClosed> {
        self.state.finished.store(true, Ordering::Relaxed);
        self.push(tokens, Some(reason), None).await
    }

    /// Ends the request with an error the router's stream reports.
    pub async fn fail(mut self, message: impl Into<String>) -> Result<(), SinkClosed> {
        self.state.finished.store(true, Ordering::Relaxed);
        self.push(Vec::new(), Some(FinishReason::Error), Some(message.into()))
            .await
    }

    async fn push(
        &mut self,
        tokens: Vec<u32>,
        finish: Option<FinishReason>,
        error: Option<String>,
    ) -> Result<(), SinkClosed> {
        let closed = SinkClosed {
            request_id: self.request_id,
        };
        if self.is_closed() {
            return Err(closed);
        }
        let item = ResponseItem {
            request_id: self.request_id,
            tokens,
            finish,
            error,
        };
        self.tx.send(Outbound::item(item)).await.map_err(|_| closed)
    }
}

/// A message queued for a connection's writer.
#[derive(Debug)]
struct Outbound {
    msg: Message,
    /// `Some(id)`: a response item, written only while request `id` is live.
    request: Option<u64>,
    finishes: bool,
}

impl Outbound {
    fn item(item: ResponseItem) -> Outbound {
        Outbound {
            request: Some(item.request_id),
            finishes: item.finish.is_some(),
            msg: Message::Response(item),
        }
    }

    /// A finishing item for a request that never became live (refused): always written.
    fn refusal(request_id: u64, message: &str) -> Outbound {
        Outbound {
            msg: Message::Response(ResponseItem {
                request_id,
                tokens: Vec::new(),
                finish: Some(FinishReason::Error),
                error: Some(message.to_owned()),
            }),
            request: None,
            finishes: false,
        }
    }
}

/// How connections ended, and the accept loop's errors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerConnectionStats {
    /// Connections accepted.
    pub accepted: u64,
    /// The router closed between frames.
    pub closed: u64,
    /// Closed by us after a frame error other than truncation (see `WorkerStats::decode`).
    pub rejected: u64,
    /// The stream ended inside a frame.
    pub truncated: u64,
    /// A read or write failed.
    pub io_errors: u64,
    /// No Hello in time, or a first frame that was not a Hello.
    pub handshake_failed: u64,
    /// A valid frame that breaks the protocol (a second Hello, a request id already live).
    pub protocol_errors: u64,
    /// Nothing received for `idle_timeout`.
    pub idle_timeouts: u64,
    /// Ended by shutdown once their requests were done.
    pub drained: u64,
    /// Still open when the shutdown grace period ran out.
    pub cut_at_shutdown: u64,
    /// Accepts that failed.
    pub accept_errors: u64,
}

/// What happened to requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerRequestStats {
    /// Requests handed to the engine.
    pub served: u64,
    /// Finishing items written (any reason, `Cancelled` included).
    pub finished: u64,
    /// Cancels that stopped a live request.
    pub cancelled: u64,
    /// Cancels of requests not live (already finished: a normal race).
    pub unknown_cancels: u64,
    /// Refused: `max_in_flight` reached.
    pub overloaded: u64,
    /// Refused: the server is shutting down.
    pub refused_shutting_down: u64,
    /// Engine futures that ended without a finishing item (an `Error` item was sent for them).
    pub unfinished: u64,
    /// Live when their connection ended: their tasks were aborted.
    pub abandoned: u64,
    /// Items dropped because their request had already ended.
    pub late_items: u64,
    /// Items that could not be encoded (over the payload limit); the request was failed.
    pub unencodable: u64,
}

/// The server's totals. Connection and decode figures include connections that have ended;
/// request figures are live.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// How connections ended, and the accept loop's errors.
    pub connections: WorkerConnectionStats,
    /// What happened to requests.
    pub requests: WorkerRequestStats,
    /// Frames cut and rejected, per kind, summed over ended connections.
    pub decode: DecodeStats,
    /// Valid frames of kinds a worker does not act on (KV events, recovery replies, ...).
    pub ignored: u64,
}

#[derive(Debug, Default)]
struct Shared {
    stats: Mutex<WorkerStats>,
}

impl Shared {
    fn with(&self, f: impl FnOnce(&mut WorkerStats)) {
        f(&mut self.stats.lock().unwrap_or_else(PoisonError::into_inner));
    }

    fn requests(&self, f: impl FnOnce(&mut WorkerRequestStats)) {
        self.with(|s| f(&mut s.requests));
    }

    fn snapshot(&self) -> WorkerStats {
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A running worker-side dispatch server.
#[derive(Debug)]
pub struct WorkerServer {
    local_addr: SocketAddr,
    backend: Backend,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    threads: Vec<JoinHandle<()>>,
}

impl WorkerServer {
    /// Binds, starts the runtime threads, and returns once every thread accepts. `hello` is
    /// what the worker answers every router's Hello with.
    pub fn start<E: Engine>(
        config: WorkerServerConfig,
        hello: Hello,
        engine: Arc<E>,
    ) -> Result<WorkerServer, WorkerServerError> {
        let resolved = config.backend.resolve()?;
        resolved.log("worker", config.backend);
        let backend = resolved.backend;
        let threads = match config.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let bind_err = |source| WorkerServerError::Bind {
            addr: config.addr,
            source,
        };
        let listeners = net::bind_reuseport(config.addr, threads).map_err(bind_err)?;
        let local_addr = listeners[0].local_addr().map_err(bind_err)?;
        let shared = Arc::new(Shared::default());
        let (stop, stop_rx) = watch::channel(false);
        let (ready_tx, ready_rx) = std_mpsc::channel::<Result<(), BackendError>>();
        let settings = Arc::new(Settings {
            hello,
            max_payload: config.max_payload.min(MAX_PAYLOAD),
            read_chunk: config.read_chunk.max(4096),
            max_in_flight: config.max_in_flight.max(1),
            response_queue: config.response_queue.max(1),
            heartbeat_interval: config.heartbeat_interval.max(Duration::from_millis(1)),
            idle_timeout: config.idle_timeout,
            handshake_timeout: config.handshake_timeout,
            grace: config.shutdown_grace,
        });
        let mut handles = Vec::with_capacity(threads);
        for (i, listener) in listeners.into_iter().enumerate() {
            let ctx = ThreadStart {
                backend,
                listener,
                engine: Arc::clone(&engine),
                settings: Arc::clone(&settings),
                shared: Arc::clone(&shared),
                stop: stop_rx.clone(),
                ready: ready_tx.clone(),
            };
            let name = format!("kvroute-worker-{i}");
            let handle = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || run_thread(ctx))
                .map_err(|source| WorkerServerError::Spawn {
                    thread: name,
                    source,
                })?;
            handles.push(handle);
        }
        drop(ready_tx);
        let server = WorkerServer {
            local_addr,
            backend,
            shared,
            stop,
            threads: handles,
        };
        for _ in 0..threads {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => {
                    return Err(WorkerServerError::Panicked {
                        thread: "kvroute-worker (starting)".into(),
                    })
                }
            }
        }
        Ok(server)
    }

    /// The address it listens on (the port chosen, when the configured one was 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The backend it runs on.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The totals so far.
    pub fn stats(&self) -> WorkerStats {
        self.shared.snapshot()
    }

    /// Stops accepting and refuses new requests; lets live requests finish within the grace
    /// period (cutting the rest), closes every connection, and returns the totals.
    pub fn shutdown(mut self) -> Result<WorkerStats, WorkerServerError> {
        self.stop_threads()?;
        Ok(self.shared.snapshot())
    }

    fn stop_threads(&mut self) -> Result<(), WorkerServerError> {
        // A send error only means every thread has already gone.
        let _ = self.stop.send(true);
        for (i, h) in self.threads.drain(..).enumerate() {
            h.join().map_err(|_| WorkerServerError::Panicked {
                thread: format!("kvroute-worker-{i}"),
            })?;
        }
        Ok(())
    }
}

impl Drop for WorkerServer {
    fn drop(&mut self) {
        // Stopping is what `shutdown` does; here its errors have nowhere to go.
        let _ = self.stop_threads();
    }
}

// ---- the runtime threads ----

/// Settings every connection reads.
#[derive(Debug)]
struct Settings {
    hello: Hello,
    max_payload: u32,
    read_chunk: usize,
    max_in_flight: usize,
    response_queue: usize,
    heartbeat_interval: Duration,
    idle_timeout: Duration,
    handshake_timeout: Duration,
    grace: Duration,
}

struct ThreadStart<E> {
    backend: Backend,
    listener: std::net::TcpListener,
    engine: Arc<E>,
    settings: Arc<Settings>,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
    ready: std_mpsc::Sender<Result<(), BackendError>>,
}

/// What the connections of one thread share.
struct ThreadCtx<E> {
    engine: Arc<E>,
    settings: Arc<Settings>,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
}

fn run_thread<E: Engine>(start: ThreadStart<E>) {
    let ThreadStart {
        backend,
        listener,
        engine,
        settings,
        shared,
        stop,
        ready,
    } = start;
    let grace = settings.grace;
    let ctx = Rc::new(ThreadCtx {
        engine,
        settings,
        shared: Arc::clone(&shared),
        stop: stop.clone(),
    });
    let thread = net::ServerThread {
        backend,
        listener,
        ready,
        stop,
        grace,
        server: "worker",
    };
    net::run_server_thread(
        thread,
        |event| {
            shared.with(|s| match event {
                ConnEvent::Accepted => s.connections.accepted += 1,
                ConnEvent::AcceptFailed => s.connections.accept_errors += 1,
                ConnEvent::CutAtShutdown(n) => s.connections.cut_at_shutdown += n,
            })
        },
        move |stream, peer| serve(stream, peer, Rc::clone(&ctx)),
    );
}

/// A request being served.
struct Live {
    task: AbortHandle,
    sink: Arc<SinkState>,
    /// A Cancel arrived: its `Cancelled` item is queued.
    cancelling: bool,
}

/// The state the reader and the writer of one connection share (same thread).
struct Conn {
    live: RefCell<HashMap<u64, Live>>,
    last_rx: Cell<Instant>,
    /// The reader waits for room in the writer's queue (the router is reading slowly): it
    /// reads no heartbeats meanwhile, so silence then says nothing about the router.
    queueing: Cell<bool>,
    draining: Cell<bool>,
    /// The reader's decode counts, kept here so that they survive an aborted reader.
    decode: Cell<DecodeStats>,
    /// Valid frames of kinds the worker does not act on.
    ignored: Cell<u64>,
}

impl Conn {
    /// Ends every live request: marks its sink closed and aborts its task.
    fn abandon_all(&self) -> u64 {
        let live = std::mem::take(&mut *self.live.borrow_mut());
        for l in live.values() {
            l.sink.closed.store(true, Ordering::Relaxed);
            l.task.abort();
        }
        live.len() as u64
    }
}

/// How a connection ended.
#[derive(Debug)]
enum End {
    Read(ReadEnd),
    Handshake(&'static str),
    Protocol(&'static str),
    WriteFailed(std::io::Error),
    Idle,
    Drained,
}

async fn serve<E: Engine>(stream: Stream, peer: SocketAddr, ctx: Rc<ThreadCtx<E>>) {
    // Best effort: without it small items wait for Nagle.
    let _ = stream.set_nodelay();
    let (r, w) = stream.into_split();
    let s = &ctx.settings;
    let mut reader = FrameReader::new(r, s.max_payload, s.read_chunk);
    let mut writer = FrameWriter::new(w);
    let conn = Rc::new(Conn {
        live: RefCell::new(HashMap::new()),
        last_rx: Cell::new(Instant::now()),
        queueing: Cell::new(false),
        draining: Cell::new(false),
        decode: Cell::new(DecodeStats::default()),
        ignored: Cell::new(0),
    });
    let end = match handshake(&mut reader, &mut writer, &ctx, peer).await {
        Err(end) => {
            conn.decode.set(*reader.stats());
            end
        }
        Ok(()) => {
            let (tx, rx) = mpsc::channel(s.response_queue);
            let mut reader_task =
                tokio::task::spawn_local(read_loop(reader, Rc::clone(&conn), Rc::clone(&ctx), tx));
            let end = write_loop(writer, rx, &conn, &ctx, &mut reader_task).await;
            reader_task.abort();
            let abandoned = conn.abandon_all();
            ctx.shared.requests(|r| r.abandoned += abandoned);
            end
        }
    };
    let (decode, ignored) = (conn.decode.get(), conn.ignored.get());
    ctx.shared.with(|s| {
        s.decode.merge(&decode);
        s.ignored += ignored;
        let c = &mut s.connections;
        match &end {
            End::Read(ReadEnd::Closed) => c.closed += 1,
            End::Read(ReadEnd::Frame(FrameError::Truncated { .. })) => c.truncated += 1,
            End::Read(ReadEnd::Frame(_)) => c.rejected += 1,
            End::Read(ReadEnd::Io(_)) | End::WriteFailed(_) => c.io_errors += 1,
            End::Handshake(_) => c.handshake_failed += 1,
            End::Protocol(_) => c.protocol_errors += 1,
            End::Idle => c.idle_timeouts += 1,
            End::Drained => c.drained += 1,
        }
    });
    match end {
        End::Read(ReadEnd::Closed) | End::Drained => {
            tracing::debug!(%peer, frames = decode.frames, "worker connection closed")
        }
        End::Read(ReadEnd::Frame(error)) => tracing::warn!(
            %peer,
            kind = error.kind_name(),
            %error,
            "worker connection closed: bad frame"
        ),
        End::Read(ReadEnd::Io(error)) | End::WriteFailed(error) => {
            tracing::warn!(%peer, %error, "worker connection closed: I/O error")
        }
        End::Handshake(why) | End::Protocol(why) => {
            tracing::warn!(%peer, why, "worker connection closed: protocol error")
        }
        End::Idle => tracing::warn!(%peer, "worker connection closed: router silent"),
    }
}

/// Reads the router's Hello and answers with ours.
async fn handshake<E: Engine>(
    reader: &mut FrameReader,
    writer: &mut FrameWriter,
    ctx: &ThreadCtx<E>,
    peer: SocketAddr,
) -> Result<(), End> {
    let frame =
        match tokio::time::timeout(ctx.settings.handshake_timeout, reader.next_frame()).await {
            Err(_) => return Err(End::Handshake("no Hello in time")),
            Ok(Err(end)) => return Err(End::Read(end)),
            Ok(Ok(frame)) => frame,
        };
    match reader.validate(&frame) {
        Err(e) => return Err(End::Read(ReadEnd::Frame(e))),
        Ok(MessageRef::Hello(h)) => tracing::debug!(
            %peer,
            router_version = h.protocol_version.to_native(),
            expects_worker = h.worker_id.to_native(),
            "router connected"
        ),
        Ok(_) => return Err(End::Handshake("first frame is not a Hello")),
    }
    let pushed = writer.push(&Message::Hello(ctx.settings.hello.clone()));
    if pushed.is_err() {
        return Err(End::Handshake("our Hello does not encode"));
    }
    writer.flush().await.map_err(End::WriteFailed)
}

/// Reads requests and cancels until the connection ends, and returns why.
async fn read_loop<E: Engine>(
    mut reader: FrameReader,
    conn: Rc<Conn>,
    ctx: Rc<ThreadCtx<E>>,
    tx: mpsc::Sender<Outbound>,
) -> End {
    loop {
        let end = read_one(&mut reader, &conn, &ctx, &tx).await;
        conn.decode.set(*reader.stats());
        if let Err(end) = end {
            return end;
        }
    }
}

/// Reads and acts on one frame.
async fn read_one<E: Engine>(
    reader: &mut FrameReader,
    conn: &Rc<Conn>,
    ctx: &Rc<ThreadCtx<E>>,
    tx: &mpsc::Sender<Outbound>,
) -> Result<(), End> {
    {
        let frame = reader.next_frame().await.map_err(End::Read)?;
        conn.last_rx.set(Instant::now());
        let msg = reader
            .validate(&frame)
            .map_err(|e| End::Read(ReadEnd::Frame(e)))?;
        let queued = match msg {
            MessageRef::Dispatch(d) => {
                let id = d.request_id.to_native();
                if conn.live.borrow().contains_key(&id) {
                    return Err(End::Protocol("request id already live"));
                }
                if conn.draining.get() {
                    ctx.shared.requests(|r| r.refused_shutting_down += 1);
                    Some(Outbound::refusal(id, "the worker is shutting down"))
                } else if conn.live.borrow().len() >= ctx.settings.max_in_flight {
                    ctx.shared.requests(|r| r.overloaded += 1);
                    Some(Outbound::refusal(id, "the worker is overloaded"))
                } else {
                    let Ok(Message::Dispatch(request)) = msg.deserialize() else {
                        return Err(End::Protocol("a validated Dispatch did not deserialize"));
                    };
                    start_request(request, conn, ctx, tx);
                    None
                }
            }
            MessageRef::Cancel(c) => cancel(c.request_id.to_native(), conn, ctx),
            // Liveness only: `last_rx` is already updated.
            MessageRef::Heartbeat(_) => None,
            MessageRef::Hello(_) => return Err(End::Protocol("a second Hello")),
            _ => {
                conn.ignored.set(conn.ignored.get() + 1);
                None
            }
        };
        if let Some(out) = queued {
            conn.queueing.set(true);
            let sent = tx.send(out).await;
            conn.queueing.set(false);
            conn.last_rx.set(Instant::now());
            if sent.is_err() {
                // The writer has gone: the connection is ending anyway.
                return Err(End::Read(ReadEnd::Closed));
            }
        }
        Ok(())
    }
}

fn start_request<E: Engine>(
    request: Dispatch,
    conn: &Rc<Conn>,
    ctx: &Rc<ThreadCtx<E>>,
    tx: &mpsc::Sender<Outbound>,
) {
    let id = request.request_id;
    let state = Arc::new(SinkState::default());
    let sink = ResponseSink {
        request_id: id,
        tx: tx.clone(),
        state: Arc::clone(&state),
    };
    let serving = ctx.engine.serve(request, sink);
    let tx = tx.clone();
    let shared = Arc::clone(&ctx.shared);
    let sink_state = Arc::clone(&state);
    let task = tokio::task::spawn_local(async move {
        serving.await;
        if !sink_state.finished.load(Ordering::Relaxed)
            && !sink_state.closed.load(Ordering::Relaxed)
        {
            shared.requests(|r| r.unfinished += 1);
            let item = ResponseItem {
                request_id: id,
                tokens: Vec::new(),
                finish: Some(FinishReason::Error),
                error: Some("the engine ended the request without a finish reason".into()),
            };
            // A closed queue means the connection has ended, and the request with it.
            let _ = tx.send(Outbound::item(item)).await;
        }
    });
    ctx.shared.requests(|r| r.served += 1);
    conn.live.borrow_mut().insert(
        id,
        Live {
            task: task.abort_handle(),
            sink: state,
            cancelling: false,
        },
    );
}

/// Stops a live request and returns its `Cancelled` item to queue.
fn cancel<E: Engine>(id: u64, conn: &Conn, ctx: &ThreadCtx<E>) -> Option<Outbound> {
    let mut live = conn.live.borrow_mut();
    match live.get_mut(&id) {
        Some(l) if !l.cancelling => {
            l.cancelling = true;
            l.sink.closed.store(true, Ordering::Relaxed);
            l.task.abort();
            ctx.shared.requests(|r| r.cancelled += 1);
            Some(Outbound::item(ResponseItem {
                request_id: id,
                tokens: Vec::new(),
                finish: Some(FinishReason::Cancelled),
                error: None,
            }))
        }
        Some(_) => None,
        None => {
            ctx.shared.requests(|r| r.unknown_cancels += 1);
            None
        }
    }
}

/// Writes queued items and heartbeats until the reader ends, the router falls silent, a write
/// fails, or shutdown has drained the live requests.
async fn write_loop<E: Engine>(
    mut writer: FrameWriter,
    mut rx: mpsc::Receiver<Outbound>,
    conn: &Conn,
    ctx: &ThreadCtx<E>,
    reader_task: &mut tokio::task::JoinHandle<End>,
) -> End {
    let s = &ctx.settings;
    let mut stop = ctx.stop.clone();
    let mut ticker = tokio::time::interval(s.heartbeat_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut batch = Vec::with_capacity(64);
    let mut seq = 0u64;
    let end = loop {
        tokio::select! {
            biased;
            ended = &mut *reader_task => break ended.unwrap_or(End::Protocol("reader task failed")),
            n = rx.recv_many(&mut batch, 64) => {
                if n == 0 {
                    break End::Read(ReadEnd::Closed);
                }
                for out in batch.drain(..) {
                    queue_outbound(&mut writer, out, conn, ctx);
                }
                if let Err(e) = flush(&mut writer, conn, s.idle_timeout).await {
                    break e;
                }
                if conn.draining.get() && conn.live.borrow().is_empty() {
                    break End::Drained;
                }
            }
            _ = ticker.tick() => {
                if conn.last_rx.get().elapsed() > s.idle_timeout && !conn.queueing.get() {
                    break End::Idle;
                }
                seq += 1;
                let hb = Heartbeat { worker_id: s.hello.worker_id, seq, ranks: ctx.engine.load() };
                if writer.push(&Message::Heartbeat(hb)).is_err() {
                    tracing::warn!("heartbeat does not encode; skipped");
                }
                if let Err(e) = flush(&mut writer, conn, s.idle_timeout).await {
                    break e;
                }
            }
            _ = stop.changed(), if !conn.draining.get() => {
                conn.draining.set(true);
                if conn.live.borrow().is_empty() {
                    break End::Drained;
                }
            }
        }
    };
    match end {
        End::Drained => {
            // Best effort: the router reads end of stream either way once we drop the socket.
            let _ = writer.close().await;
            End::Drained
        }
        end => end,
    }
}

fn queue_outbound<E: Engine>(
    writer: &mut FrameWriter,
    out: Outbound,
    conn: &Conn,
    ctx: &ThreadCtx<E>,
) {
    if let Some(id) = out.request {
        if !conn.live.borrow().contains_key(&id) {
            ctx.shared.requests(|r| r.late_items += 1);
            return;
        }
    }
    if writer.push(&out.msg).is_err() {
        // Too large to frame: fail the request instead.
        ctx.shared.requests(|r| r.unencodable += 1);
        let Some(id) = out.request else {
            return;
        };
        let failed = Message::Response(ResponseItem {
            request_id: id,
            tokens: Vec::new(),
            finish: Some(FinishReason::Error),
            error: Some("a response item exceeded the frame size limit".into()),
        });
        if writer.push(&failed).is_err() {
            return;
        }
        finish(id, conn, ctx);
        return;
    }
    if out.finishes {
        if let Some(id) = out.request {
            finish(id, conn, ctx);
        }
    }
}

/// A finishing item of `id` was written: retire the request.
fn finish<E: Engine>(id: u64, conn: &Conn, ctx: &ThreadCtx<E>) {
    if let Some(l) = conn.live.borrow_mut().remove(&id) {
        l.sink.closed.store(true, Ordering::Relaxed);
        ctx.shared.requests(|r| r.finished += 1);
    }
}

/// Flushes while the router shows life (see [`FrameWriter::flush_while_alive`]).
async fn flush(writer: &mut FrameWriter, conn: &Conn, limit: Duration) -> Result<(), End> {
    let silent_for = || {
        if conn.queueing.get() {
            Duration::ZERO
        } else {
            conn.last_rx.get().elapsed()
        }
    };
    match writer.flush_while_alive(limit, silent_for).await {
        Ok(()) => Ok(()),
        Err(FlushError::Io(e)) => Err(End::WriteFailed(e)),
        Err(FlushError::PeerSilent { .. }) => Err(End::Idle),
    }
}
