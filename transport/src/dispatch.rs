//! The router side of request dispatch: one connection to one worker, kept up, with bounded
//! in-flight requests whose responses come back as streams.
//!
//! ```text
//!  DispatchClient::dispatch ──permit (bounded)──▶ command queue ──▶ driver task ──one write──▶ worker
//!        ▲ ResponseStream ◀── per-request queue ◀── reader task ◀── frames ◀──────────────────┘
//!                                                          └── heartbeats ──▶ WorkerStatus (watch)
//! ```
//!
//! * The client runs on the runtime that starts it ([`DispatchClient::start`] inside
//!   [`crate::backend::block_on`]): a router's shard thread keeps its own connections, one
//!   per worker. The handle and the streams are `Send`, so callers may live anywhere.
//! * Handshake: the router sends a Hello naming the worker it expects, and the worker answers
//!   with its own. A Hello of another protocol version or of another worker ends the attempt
//!   with [`LinkError::WrongVersion`] or [`LinkError::WrongWorker`].
//! * In-flight requests are bounded by a semaphore: [`DispatchClient::dispatch`] waits for a
//!   permit, [`DispatchClient::try_dispatch`] hands the request back when there is none. The
//!   permit is held until the request's finishing item arrives (or the connection is lost), so
//!   a cancelled request counts until the worker confirms it.
//! * Each stream has a small bounded queue; a consumer that does not read makes the reader
//!   wait, and TCP pushes back on the worker (the other streams of the connection wait too:
//!   one connection is one ordered byte stream). That wait is not silence: the idle timeout
//!   does not run while the reader is delivering. Dropping a stream before its end cancels
//!   the request.
//! * A connection that ends (peer gone, bad frame, silence past `idle_timeout`) ends every
//!   in-flight stream with [`StreamError::ConnectionLost`], so the router can free their
//!   load, and the client reconnects with exponential backoff and jitter. While it is not
//!   connected, dispatch fails at once with [`DispatchError::NotConnected`]: the router is
//!   expected to choose another worker rather than wait.
//! * [`DispatchClient::shutdown`] refuses new requests, lets in-flight ones finish within
//!   the grace period, closes the connection and returns the totals.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute_core::rng::mix64;
use kvroute_core::WorkerId;
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit, Semaphore};

use crate::backend::Backend;
use crate::conn::{Backoff, BackoffState, FlushError, FrameReader, FrameWriter, ReadEnd};
use crate::frame::{DecodeStats, FrameError, MAX_PAYLOAD};
use crate::net::Stream;
use crate::wire::{
    Cancel, Dispatch, ErrorCode, Heartbeat, Hello, Message, MessageKind, MessageRef, ResponseItem,
    Role, PROTOCOL_VERSION,
};

/// Settings of a [`DispatchClient`].
#[derive(Clone, Debug)]
pub struct DispatchConfig {
    /// The worker's address.
    pub addr: SocketAddr,
    /// The worker expected there; a worker answering with another id is refused.
    pub worker: WorkerId,
    /// The backend of the runtime the client is started on.
    pub backend: Backend,
    /// Requests in flight at most; `dispatch` waits for a free slot.
    pub max_in_flight: usize,
    /// Items buffered per response stream before the reader waits for its consumer.
    pub stream_buffer: usize,
    pub heartbeat_interval: Duration,
    /// A connection with nothing received for this long is considered lost.
    pub idle_timeout: Duration,
    /// Limit of the TCP connect, and separately of the handshake.
    pub connect_timeout: Duration,
    pub backoff: Backoff,
    /// Largest payload accepted, in bytes (capped at [`MAX_PAYLOAD`]).
    pub max_payload: u32,
    /// Spare room each read asks for, in bytes.
    pub read_chunk: usize,
    /// How long [`DispatchClient::shutdown`] waits for in-flight requests.
    pub shutdown_grace: Duration,
}

impl DispatchConfig {
    /// Defaults, for `worker` at `addr`.
    pub fn new(addr: SocketAddr, worker: WorkerId, backend: Backend) -> Self {
        DispatchConfig {
            addr,
            worker,
            backend,
            max_in_flight: 256,
            stream_buffer: 32,
            heartbeat_interval: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            backoff: Backoff::default(),
            max_payload: 16 << 20,
            read_chunk: 64 << 10,
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// Why a connection attempt failed or a connection ended.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LinkError {
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    #[error("no Hello from {addr} within {waited:?}")]
    HandshakeTimeout { addr: SocketAddr, waited: Duration },
    #[error("expected worker {expected:?}, found worker {found:?}")]
    WrongWorker { expected: WorkerId, found: WorkerId },
    #[error("the worker speaks protocol version {found}, this router {expected}")]
    WrongVersion { expected: u16, found: u16 },
    #[error("the worker's first frame was {kind:?}, not a Hello")]
    NotHello { kind: MessageKind },
    #[error("the worker refused the connection ({code:?}): {message}")]
    Refused { code: ErrorCode, message: String },
    #[error("bad frame from the worker: {error}")]
    Frame { error: FrameError },
    #[error("the worker broke the protocol: {what}")]
    Protocol { what: &'static str },
    #[error("I/O error ({kind:?}): {message}")]
    Io {
        kind: std::io::ErrorKind,
        message: String,
    },
    #[error("the worker closed the connection")]
    Closed,
    #[error("nothing received from the worker for {silent:?}")]
    Idle { silent: Duration },
}

impl LinkError {
    fn io(e: &std::io::Error) -> LinkError {
        LinkError::Io {
            kind: e.kind(),
            message: e.to_string(),
        }
    }

    fn from_read(end: ReadEnd) -> LinkError {
        match end {
            ReadEnd::Closed => LinkError::Closed,
            ReadEnd::Frame(error) => LinkError::Frame { error },
            ReadEnd::Io(e) => LinkError::io(&e),
        }
    }
}

/// Why a request was not dispatched.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DispatchError {
    #[error("worker {worker:?} is not connected (last error: {last_error:?})")]
    NotConnected {
        worker: WorkerId,
        last_error: Option<LinkError>,
    },
    #[error("worker {worker:?} has {max_in_flight} requests in flight")]
    Full {
        worker: WorkerId,
        max_in_flight: usize,
    },
    #[error("the client of worker {worker:?} is shut down")]
    ShutDown { worker: WorkerId },
}

/// A request that was not dispatched, handed back with the reason.
#[derive(Debug, thiserror::Error)]
#[error("request {} not dispatched: {reason}", request.request_id)]
pub struct Rejected {
    pub reason: DispatchError,
    pub request: Box<Dispatch>,
}

/// Why a response stream ended without a finishing item.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum StreamError {
    /// The connection to the worker ended (or had just ended when the request was queued).
    #[error("connection to worker {worker:?} lost: {reason:?}")]
    ConnectionLost {
        worker: WorkerId,
        reason: Option<LinkError>,
    },
    /// The worker reported an error about this request.
    #[error("worker {worker:?} reported {code:?}: {message}")]
    Worker {
        worker: WorkerId,
        code: ErrorCode,
        message: String,
    },
    /// Another request with this id is in flight on this connection.
    #[error("request id {request_id} is already in flight")]
    DuplicateRequest { request_id: u64 },
    /// The request could not be framed (too large).
    #[error("request {request_id} could not be encoded: {reason}")]
    Encode { request_id: u64, reason: String },
    /// The client shut down before the request finished.
    #[error("the client of worker {worker:?} shut down")]
    ShutDown { worker: WorkerId },
}

/// Where the connection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkState {
    Connecting,
    Connected,
    /// Waiting before the next attempt.
    Backoff,
    ShutDown,
}

/// What the router knows of the worker: published on every change.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerStatus {
    pub state: LinkState,
    /// The worker's Hello on the current (or last) connection.
    pub hello: Option<Hello>,
    /// The latest heartbeat, with its load report.
    pub load: Option<Heartbeat>,
    /// Why the last attempt failed or the last connection ended.
    pub last_error: Option<LinkError>,
    /// Connections established so far.
    pub connects: u64,
}

/// The client's totals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DispatchStats {
    pub connects: u64,
    /// Attempts whose TCP connect failed.
    pub connect_failures: u64,
    /// Attempts whose handshake failed (wrong worker or version, timeout, bad frame).
    pub handshake_failures: u64,
    /// Established connections that ended other than by shutdown.
    pub disconnects: u64,
    /// Requests written to the worker.
    pub dispatched: u64,
    /// Finishing items received.
    pub finished: u64,
    /// Streams ended by a lost connection.
    pub lost: u64,
    /// Streams ended by the worker's error message.
    pub worker_errors: u64,
    /// Streams ended by shutdown.
    pub shut_down: u64,
    pub cancels_sent: u64,
    /// Items of requests not in flight (after a cancel, say).
    pub late_items: u64,
    pub heartbeats: u64,
    /// Valid frames of kinds the router side does not act on here.
    pub ignored: u64,
    /// Frames cut and rejected, summed over ended connections.
    pub decode: DecodeStats,
}

/// A command from the handle and the streams to the driver.
// Dispatches are the common command: boxing them would add an allocation to each.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Command {
    Dispatch {
        request: Dispatch,
        tx: mpsc::Sender<Result<ResponseItem, StreamError>>,
        permit: OwnedSemaphorePermit,
    },
    Cancel {
        request_id: u64,
    },
}

/// A request's response items, in order, ending with a finishing item or an error.
///
/// An engine that fails a request ends it with an item whose `finish` is
/// `FinishReason::Error` and whose `error` says why (so does a worker that refuses a request
/// as overloaded or shutting down); `Err` items are for what went wrong between the two
/// sides: a lost connection, a worker's error message, a duplicate id, shutdown.
#[derive(Debug)]
pub struct ResponseStream {
    request_id: u64,
    worker: WorkerId,
    rx: mpsc::Receiver<Result<ResponseItem, StreamError>>,
    commands: mpsc::UnboundedSender<Command>,
    done: bool,
    cancel_sent: bool,
}

impl ResponseStream {
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// The next item; `None` after the finishing item or an error.
    pub async fn next(&mut self) -> Option<Result<ResponseItem, StreamError>> {
        if self.done {
            return None;
        }
        let got = match self.rx.recv().await {
            Some(Ok(item)) => {
                self.done = item.finish.is_some();
                Ok(item)
            }
            Some(Err(e)) => {
                self.done = true;
                Err(e)
            }
            // The driver dropped the request without a word: its connection went away.
            None => {
                self.done = true;
                Err(StreamError::ConnectionLost {
                    worker: self.worker,
                    reason: None,
                })
            }
        };
        Some(got)
    }

    /// Asks the worker to stop. The stream goes on to its end: a `Cancelled` item, or
    /// whatever finishing item was already on its way.
    pub fn cancel(&mut self) {
        if !self.done && !self.cancel_sent {
            self.cancel_sent = true;
            // A closed queue means the driver has gone, and the request with it.
            let _ = self.commands.send(Command::Cancel {
                request_id: self.request_id,
            });
        }
    }
}

impl Drop for ResponseStream {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// The router's handle on one worker connection.
#[derive(Debug)]
pub struct DispatchClient {
    worker: WorkerId,
    max_in_flight: usize,
    stream_buffer: usize,
    commands: mpsc::UnboundedSender<Command>,
    permits: Arc<Semaphore>,
    status: watch::Receiver<WorkerStatus>,
    stats: Arc<Mutex<DispatchStats>>,
    stop: watch::Sender<bool>,
    driver: tokio::task::JoinHandle<()>,
}

impl DispatchClient {
    /// Starts connecting to the worker in the background. Call inside a runtime of
    /// `config.backend` with a `LocalSet` ([`crate::backend::block_on`] builds one).
    pub fn start(config: DispatchConfig) -> DispatchClient {
        let (commands, commands_rx) = mpsc::unbounded_channel();
        let permits = Arc::new(Semaphore::new(config.max_in_flight.max(1)));
        let (status_tx, status) = watch::channel(WorkerStatus {
            state: LinkState::Connecting,
            hello: None,
            load: None,
            last_error: None,
            connects: 0,
        });
        let stats = Arc::new(Mutex::new(DispatchStats::default()));
        let (stop, stop_rx) = watch::channel(false);
        let driver = Driver {
            config: Arc::new(config.clone()),
            commands: commands_rx,
            status: Rc::new(status_tx),
            stats: Arc::clone(&stats),
            stop: stop_rx,
            permits: Arc::clone(&permits),
        };
        let driver = tokio::task::spawn_local(driver.run());
        DispatchClient {
            worker: config.worker,
            max_in_flight: config.max_in_flight.max(1),
            stream_buffer: config.stream_buffer.max(1),
            commands,
            permits,
            status,
            stats,
            stop,
            driver,
        }
    }

    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// The worker's status now.
    pub fn status(&self) -> WorkerStatus {
        self.status.borrow().clone()
    }

    /// A receiver that sees every status change (connects, heartbeats, losses).
    pub fn watch_status(&self) -> watch::Receiver<WorkerStatus> {
        self.status.clone()
    }

    /// The totals so far.
    pub fn stats(&self) -> DispatchStats {
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Requests that may still be dispatched before `dispatch` waits.
    pub fn free_slots(&self) -> usize {
        self.permits.available_permits()
    }

    /// Waits until the client is connected (returning the worker's Hello), for at most
    /// `timeout`; else the last error.
    pub async fn wait_connected(&self, timeout: Duration) -> Result<Hello, DispatchError> {
        let mut status = self.status.clone();
        let connected = tokio::time::timeout(
            timeout,
            status.wait_for(|s| s.state == LinkState::Connected || s.state == LinkState::ShutDown),
        )
        .await
        // Drop the guard at once: it holds the status lock.
        .map(|r| r.is_ok());
        let s = self.status.borrow().clone();
        match (connected, s.state, s.hello) {
            (Ok(true), LinkState::Connected, Some(hello)) => Ok(hello),
            (_, LinkState::ShutDown, _) => Err(DispatchError::ShutDown {
                worker: self.worker,
            }),
            _ => Err(DispatchError::NotConnected {
                worker: self.worker,
                last_error: s.last_error,
            }),
        }
    }

    /// Dispatches `request`, waiting for an in-flight slot; fails at once if the worker is
    /// not connected.
    pub async fn dispatch(&self, request: Dispatch) -> Result<ResponseStream, Rejected> {
        let request = self.check_connected(request)?;
        match Arc::clone(&self.permits).acquire_owned().await {
            Ok(permit) => self.send(request, permit),
            Err(_) => Err(self.rejected(
                DispatchError::ShutDown {
                    worker: self.worker,
                },
                request,
            )),
        }
    }

    /// Dispatches `request` if a slot is free now; else hands it back with
    /// [`DispatchError::Full`].
    pub fn try_dispatch(&self, request: Dispatch) -> Result<ResponseStream, Rejected> {
        let request = self.check_connected(request)?;
        match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(permit) => self.send(request, permit),
            Err(tokio::sync::TryAcquireError::NoPermits) => Err(self.rejected(
                DispatchError::Full {
                    worker: self.worker,
                    max_in_flight: self.max_in_flight,
                },
                request,
            )),
            Err(tokio::sync::TryAcquireError::Closed) => Err(self.rejected(
                DispatchError::ShutDown {
                    worker: self.worker,
                },
                request,
            )),
        }
    }

    /// Refuses new requests, lets in-flight ones finish within the grace period, closes the
    /// connection and returns the totals.
    pub async fn shutdown(self) -> DispatchStats {
        // A send error only means the driver has already gone.
        let _ = self.stop.send(true);
        self.permits.close();
        // The driver never panics on input; a panic elsewhere leaves the totals as they are.
        let _ = self.driver.await;
        let stats = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        stats.clone()
    }

    fn rejected(&self, reason: DispatchError, request: Dispatch) -> Rejected {
        Rejected {
            reason,
            request: Box::new(request),
        }
    }

    fn check_connected(&self, request: Dispatch) -> Result<Dispatch, Rejected> {
        let s = self.status.borrow();
        match s.state {
            LinkState::Connected => Ok(request),
            LinkState::ShutDown => {
                drop(s);
                Err(self.rejected(
                    DispatchError::ShutDown {
                        worker: self.worker,
                    },
                    request,
                ))
            }
            _ => {
                let last_error = s.last_error.clone();
                drop(s);
                Err(self.rejected(
                    DispatchError::NotConnected {
                        worker: self.worker,
                        last_error,
                    },
                    request,
                ))
            }
        }
    }

    fn send(
        &self,
        request: Dispatch,
        permit: OwnedSemaphorePermit,
    ) -> Result<ResponseStream, Rejected> {
        // The connection may have dropped while we waited for the permit.
        let request = self.check_connected(request)?;
        let (tx, rx) = mpsc::channel(self.stream_buffer);
        let request_id = request.request_id;
        let sent = self.commands.send(Command::Dispatch {
            request,
            tx,
            permit,
        });
        if let Err(mpsc::error::SendError(cmd)) = sent {
            let Command::Dispatch { request, .. } = cmd else {
                unreachable!("the command just built is a dispatch")
            };
            return Err(self.rejected(
                DispatchError::ShutDown {
                    worker: self.worker,
                },
                request,
            ));
        }
        Ok(ResponseStream {
            request_id,
            worker: self.worker,
            rx,
            commands: self.commands.clone(),
            done: false,
            cancel_sent: false,
        })
    }
}

// ---- the driver ----

struct Driver {
    config: Arc<DispatchConfig>,
    commands: mpsc::UnboundedReceiver<Command>,
    status: Rc<watch::Sender<WorkerStatus>>,
    stats: Arc<Mutex<DispatchStats>>,
    stop: watch::Receiver<bool>,
    permits: Arc<Semaphore>,
}

/// A request in flight: where its items go, and its slot.
struct Pending {
    tx: mpsc::Sender<Result<ResponseItem, StreamError>>,
    _permit: OwnedSemaphorePermit,
}

/// What one connection's reader and writer share (same thread).
struct Link {
    pending: RefCell<HashMap<u64, Pending>>,
    last_rx: Cell<Instant>,
    /// The reader waits for a consumer to make room in its stream: the worker may well be
    /// sending, so silence on the socket says nothing about it then.
    delivering: Cell<bool>,
    /// Signalled when `pending` becomes empty (shutdown waits on it).
    drained: Notify,
    decode: Cell<DecodeStats>,
}

/// How a connection ended.
enum LinkEnd {
    Lost(LinkError),
    Shutdown,
}

impl Driver {
    fn stats(&self, f: impl FnOnce(&mut DispatchStats)) {
        f(&mut self.stats.lock().unwrap_or_else(PoisonError::into_inner));
    }

    fn stopping(&self) -> bool {
        // A dropped handle counts as a stop.
        *self.stop.borrow() || self.stop.has_changed().is_err()
    }

    async fn run(mut self) {
        let cfg = Arc::clone(&self.config);
        let seed = mix64(
            cfg.worker.0
                ^ u64::from(cfg.addr.port())
                ^ SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.subsec_nanos().into()),
        );
        let mut backoff = BackoffState::new(cfg.backoff, seed);
        'outer: while !self.stopping() {
            self.status.send_modify(|s| s.state = LinkState::Connecting);
            let attempt = tokio::select! {
                a = handshake(&cfg) => a,
                _ = self.stop.changed() => break 'outer,
            };
            match attempt {
                Ok((reader, writer, hello)) => {
                    backoff.reset();
                    self.stats(|s| s.connects += 1);
                    tracing::info!(worker = ?cfg.worker, addr = %cfg.addr, "connected to worker");
                    self.status.send_modify(|s| {
                        s.state = LinkState::Connected;
                        s.hello = Some(hello);
                        s.last_error = None;
                        s.connects += 1;
                    });
                    match self.serve(reader, writer).await {
                        LinkEnd::Shutdown => break 'outer,
                        LinkEnd::Lost(error) => {
                            self.stats(|s| s.disconnects += 1);
                            tracing::warn!(worker = ?cfg.worker, addr = %cfg.addr, %error, "worker connection lost");
                            self.status.send_modify(|s| s.last_error = Some(error));
                        }
                    }
                }
                Err(error) => {
                    self.stats(|s| match error {
                        LinkError::Connect { .. } => s.connect_failures += 1,
                        _ => s.handshake_failures += 1,
                    });
                    tracing::warn!(worker = ?cfg.worker, addr = %cfg.addr, %error, "cannot reach worker");
                    self.status.send_modify(|s| s.last_error = Some(error));
                }
            }
            self.status.send_modify(|s| s.state = LinkState::Backoff);
            let until = tokio::time::Instant::now() + backoff.next_delay();
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => break,
                    _ = self.stop.changed() => break 'outer,
                    cmd = self.commands.recv() => match cmd {
                        Some(cmd) => self.refuse(cmd, false),
                        None => break 'outer,
                    },
                }
            }
        }
        self.status.send_modify(|s| s.state = LinkState::ShutDown);
        self.permits.close();
        self.commands.close();
        while let Ok(cmd) = self.commands.try_recv() {
            self.refuse(cmd, true);
        }
    }

    /// A command that arrives while no connection can take it.
    fn refuse(&self, cmd: Command, shutting_down: bool) {
        if let Command::Dispatch { tx, .. } = cmd {
            let worker = self.config.worker;
            let e = if shutting_down {
                StreamError::ShutDown { worker }
            } else {
                StreamError::ConnectionLost {
                    worker,
                    reason: self.status.borrow().last_error.clone(),
                }
            };
            // The stream's queue is new and empty: this cannot fail for want of room, and if
            // the stream is gone nobody is waiting.
            let _ = tx.try_send(Err(e));
        }
    }

    /// Runs one established connection until it ends.
    async fn serve(&mut self, reader: FrameReader, mut writer: FrameWriter) -> LinkEnd {
        let cfg = Arc::clone(&self.config);
        let link = Rc::new(Link {
            pending: RefCell::new(HashMap::new()),
            last_rx: Cell::new(Instant::now()),
            delivering: Cell::new(false),
            drained: Notify::new(),
            decode: Cell::new(DecodeStats::default()),
        });
        let mut reader_task = tokio::task::spawn_local(read_loop(
            reader,
            Rc::clone(&link),
            Rc::clone(&self.status),
            Arc::clone(&self.stats),
            cfg.worker,
        ));
        let mut ticker =
            tokio::time::interval(cfg.heartbeat_interval.max(Duration::from_millis(1)));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut batch = Vec::with_capacity(128);
        let mut seq = 0u64;
        let mut draining: Option<tokio::time::Instant> = None;
        let far = tokio::time::Instant::now() + Duration::from_secs(365 * 86_400);
        let end = loop {
            if draining.is_some() && link.pending.borrow().is_empty() {
                break LinkEnd::Shutdown;
            }
            tokio::select! {
                biased;
                ended = &mut reader_task => {
                    break LinkEnd::Lost(ended.unwrap_or(LinkError::Protocol { what: "reader task failed" }));
                }
                n = self.commands.recv_many(&mut batch, 128) => {
                    if n == 0 {
                        // Every sender is gone, the handle's too: nothing more can come.
                        draining.get_or_insert(tokio::time::Instant::now() + cfg.shutdown_grace);
                        continue;
                    }
                    for cmd in batch.drain(..) {
                        self.queue(cmd, &link, &mut writer, draining.is_some());
                    }
                    if let Err(e) = flush(&mut writer, &link, cfg.idle_timeout).await {
                        break LinkEnd::Lost(e);
                    }
                }
                _ = ticker.tick() => {
                    let silent = link.last_rx.get().elapsed();
                    if silent > cfg.idle_timeout && !link.delivering.get() {
                        break LinkEnd::Lost(LinkError::Idle { silent });
                    }
                    seq += 1;
                    let hb = Heartbeat { worker_id: cfg.worker.0, seq, ranks: Vec::new() };
                    if writer.push(&Message::Heartbeat(hb)).is_err() {
                        tracing::warn!("heartbeat does not encode; skipped");
                    }
                    if let Err(e) = flush(&mut writer, &link, cfg.idle_timeout).await {
                        break LinkEnd::Lost(e);
                    }
                }
                _ = self.stop.changed(), if draining.is_none() => {
                    draining = Some(tokio::time::Instant::now() + cfg.shutdown_grace);
                }
                _ = link.drained.notified(), if draining.is_some() => {}
                _ = tokio::time::sleep_until(draining.unwrap_or(far)), if draining.is_some() => {
                    break LinkEnd::Shutdown;
                }
            }
        };
        reader_task.abort();
        let pending = std::mem::take(&mut *link.pending.borrow_mut());
        let worker = cfg.worker;
        let error = match &end {
            LinkEnd::Lost(reason) => StreamError::ConnectionLost {
                worker,
                reason: Some(reason.clone()),
            },
            LinkEnd::Shutdown => StreamError::ShutDown { worker },
        };
        for p in pending.values() {
            // A full queue: the stream sees its end as a lost connection all the same.
            let _ = p.tx.try_send(Err(error.clone()));
        }
        let ended = pending.len() as u64;
        let decode = link.decode.get();
        self.stats(|s| {
            match &end {
                LinkEnd::Lost(_) => s.lost += ended,
                LinkEnd::Shutdown => s.shut_down += ended,
            }
            s.decode.merge(&decode);
        });
        if let LinkEnd::Shutdown = end {
            // Best effort: the worker sees end of stream when the socket drops anyway.
            let _ = writer.close().await;
        }
        end
    }

    /// Encodes one command for the worker.
    fn queue(&self, cmd: Command, link: &Link, writer: &mut FrameWriter, draining: bool) {
        match cmd {
            Command::Dispatch { tx, .. } if draining => {
                let _ = tx.try_send(Err(StreamError::ShutDown {
                    worker: self.config.worker,
                }));
            }
            Command::Dispatch {
                request,
                tx,
                permit,
            } => {
                let request_id = request.request_id;
                if link.pending.borrow().contains_key(&request_id) {
                    let _ = tx.try_send(Err(StreamError::DuplicateRequest { request_id }));
                    return;
                }
                if let Err(e) = writer.push(&Message::Dispatch(request)) {
                    let _ = tx.try_send(Err(StreamError::Encode {
                        request_id,
                        reason: e.to_string(),
                    }));
                    return;
                }
                link.pending.borrow_mut().insert(
                    request_id,
                    Pending {
                        tx,
                        _permit: permit,
                    },
                );
                self.stats(|s| s.dispatched += 1);
            }
            Command::Cancel { request_id } => {
                if link.pending.borrow().contains_key(&request_id)
                    && writer.push(&Message::Cancel(Cancel { request_id })).is_ok()
                {
                    self.stats(|s| s.cancels_sent += 1);
                }
            }
        }
    }
}

/// Flushes while the worker shows life (see [`FrameWriter::flush_while_alive`]).
async fn flush(writer: &mut FrameWriter, link: &Link, limit: Duration) -> Result<(), LinkError> {
    let silent_for = || {
        if link.delivering.get() {
            Duration::ZERO
        } else {
            link.last_rx.get().elapsed()
        }
    };
    match writer.flush_while_alive(limit, silent_for).await {
        Ok(()) => Ok(()),
        Err(FlushError::Io(e)) => Err(LinkError::io(&e)),
        Err(FlushError::PeerSilent { silent }) => Err(LinkError::Idle { silent }),
    }
}

/// Connects, sends our Hello, and checks the worker's.
async fn handshake(cfg: &DispatchConfig) -> Result<(FrameReader, FrameWriter, Hello), LinkError> {
    let addr = cfg.addr;
    let stream =
        match tokio::time::timeout(cfg.connect_timeout, Stream::connect(cfg.backend, addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                return Err(LinkError::Connect {
                    addr,
                    reason: e.to_string(),
                })
            }
            Err(_) => {
                return Err(LinkError::Connect {
                    addr,
                    reason: format!("timed out after {:?}", cfg.connect_timeout),
                })
            }
        };
    let (r, w) = stream.into_split();
    let mut reader = FrameReader::new(r, cfg.max_payload.min(MAX_PAYLOAD), cfg.read_chunk);
    let mut writer = FrameWriter::new(w);
    let ours = Hello {
        protocol_version: PROTOCOL_VERSION,
        // The worker we expect; a router has no ranks or cache of its own.
        worker_id: cfg.worker.0,
        dp_start: 0,
        dp_size: 0,
        kv_blocks: 0,
        block_size: 0,
        role: Role::Aggregated,
        max_batched_tokens: 0,
        labels: Vec::new(),
    };
    if writer.push(&Message::Hello(ours)).is_err() {
        return Err(LinkError::Protocol {
            what: "our Hello does not encode",
        });
    }
    writer.flush().await.map_err(|e| LinkError::io(&e))?;
    let frame = match tokio::time::timeout(cfg.connect_timeout, reader.next_frame()).await {
        Err(_) => {
            return Err(LinkError::HandshakeTimeout {
                addr,
                waited: cfg.connect_timeout,
            })
        }
        Ok(Err(end)) => return Err(LinkError::from_read(end)),
        Ok(Ok(frame)) => frame,
    };
    let msg = reader
        .validate(&frame)
        .map_err(|error| LinkError::Frame { error })?;
    let hello = match msg {
        MessageRef::Hello(h) => {
            let found = h.protocol_version.to_native();
            if found != PROTOCOL_VERSION {
                return Err(LinkError::WrongVersion {
                    expected: PROTOCOL_VERSION,
                    found,
                });
            }
            let found = WorkerId(h.worker_id.to_native());
            if found != cfg.worker {
                return Err(LinkError::WrongWorker {
                    expected: cfg.worker,
                    found,
                });
            }
            match msg.deserialize() {
                Ok(Message::Hello(hello)) => hello,
                _ => {
                    return Err(LinkError::Protocol {
                        what: "a validated Hello did not deserialize",
                    })
                }
            }
        }
        MessageRef::Error(e) => {
            return Err(LinkError::Refused {
                code: match msg.deserialize() {
                    Ok(Message::Error(e)) => e.code,
                    _ => ErrorCode::Internal,
                },
                message: e.message.to_string(),
            })
        }
        other => return Err(LinkError::NotHello { kind: other.kind() }),
    };
    Ok((reader, writer, hello))
}

/// Reads the worker's frames until the connection ends, and returns why.
async fn read_loop(
    mut reader: FrameReader,
    link: Rc<Link>,
    status: Rc<watch::Sender<WorkerStatus>>,
    stats: Arc<Mutex<DispatchStats>>,
    worker: WorkerId,
) -> LinkError {
    let count = |f: &dyn Fn(&mut DispatchStats)| {
        f(&mut stats.lock().unwrap_or_else(PoisonError::into_inner));
    };
    loop {
        let frame = match reader.next_frame().await {
            Ok(f) => f,
            Err(end) => {
                link.decode.set(*reader.stats());
                return LinkError::from_read(end);
            }
        };
        link.last_rx.set(Instant::now());
        let msg = match reader.validate(&frame) {
            Ok(m) => m,
            Err(error) => {
                link.decode.set(*reader.stats());
                return LinkError::Frame { error };
            }
        };
        link.decode.set(*reader.stats());
        match msg {
            MessageRef::Response(r) => {
                let request_id = r.request_id.to_native();
                let finishes = r.finish.is_some();
                let tx = match link.pending.borrow().get(&request_id) {
                    Some(p) => p.tx.clone(),
                    None => {
                        count(&|s| s.late_items += 1);
                        continue;
                    }
                };
                let Ok(Message::Response(item)) = msg.deserialize() else {
                    return LinkError::Protocol {
                        what: "a validated response item did not deserialize",
                    };
                };
                // Waits while the consumer's queue is full: backpressure on this connection.
                // A consumer that has gone already sent a Cancel when its stream dropped.
                link.delivering.set(true);
                let _ = tx.send(Ok(item)).await;
                link.delivering.set(false);
                link.last_rx.set(Instant::now());
                // Retired only once delivered: a draining shutdown ends the connection as
                // soon as nothing is pending, and must not cut a last item on its way.
                if finishes {
                    retire(&link, request_id);
                    count(&|s| s.finished += 1);
                }
            }
            MessageRef::Heartbeat(_) => {
                if let Ok(Message::Heartbeat(hb)) = msg.deserialize() {
                    status.send_modify(|s| s.load = Some(hb));
                }
                count(&|s| s.heartbeats += 1);
            }
            MessageRef::Error(e) => {
                let message = e.message.to_string();
                let code = match msg.deserialize() {
                    Ok(Message::Error(e)) => e.code,
                    _ => ErrorCode::Internal,
                };
                let request = e.request_id.as_ref().map(|id| id.to_native());
                match request.and_then(|id| retire(&link, id)) {
                    Some(p) => {
                        count(&|s| s.worker_errors += 1);
                        let _ = p.tx.try_send(Err(StreamError::Worker {
                            worker,
                            code,
                            message,
                        }));
                    }
                    None => {
                        tracing::warn!(?worker, ?code, %message, "worker reported an error");
                        count(&|s| s.ignored += 1);
                    }
                }
            }
            MessageRef::Hello(_) => {
                return LinkError::Protocol {
                    what: "a second Hello",
                }
            }
            _ => count(&|s| s.ignored += 1),
        }
    }
}

/// Removes a request from the in-flight table (freeing its slot) and wakes a draining
/// shutdown when it was the last.
fn retire(link: &Link, request_id: u64) -> Option<Pending> {
    let mut pending = link.pending.borrow_mut();
    let p = pending.remove(&request_id);
    if pending.is_empty() {
        link.drained.notify_one();
    }
    p
}
