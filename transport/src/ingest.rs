//! The KV event ingest server: workers' event batches from sockets into the prefix index.
//!
//! ```text
//!  runtime thread 0 ─ listener (SO_REUSEPORT) ─┬─ conn ─ read ▶ BytesMut ─ decode ─ validate ─┐
//!                                              └─ conn ─ ...                                 │
//!  runtime thread 1 ─ listener (same port) ─────── conn ─ ...                                │
//!                                                                                            ▼
//!                     bounded queue of the frames of each read (Bytes, no copy) ─▶ writer thread
//!                                        BatchApplier ─▶ IngestTarget: PrefixIndex, or Router
//! ```
//!
//! * One current-thread runtime per thread, io_uring or epoll ([`crate::backend`]), each
//!   accepting on its own listener; a connection lives on the thread that accepted it.
//! * The index has one writer, so connections do not touch it: they cut frames out of their
//!   receive buffer, validate them, and queue the `KvEvents` and `RecoveryReply` frames for the
//!   writer thread, all the frames one read brought in one message (one hand-off, one wake-up
//!   of the writer, however many frames a large read held). The queue is bounded: when the
//!   index falls behind, connections wait on the queue and stop reading, and TCP pushes back on
//!   the workers. Nothing buffers without bound: a message holds at most one read's bytes.
//! * The writer validates each payload again before reading it in place (bytecheck is a few ns
//!   per event; it keeps the crate free of `unsafe`) and applies it with one [`BatchApplier`],
//!   to an index of the server's own or to a router's index ([`IngestTarget`]). Into a router
//!   it writes through `Router::event_writer`, one read's frames under one hold of the
//!   router's index lock, and the router notes every event (speculation, warm-up).
//! * Any frame error closes that connection alone, with one `warn` line and a count per kind
//!   ([`IngestStats::decode`]); so does a read error. A stream that ends inside a frame is
//!   counted as truncated. Other connections are not affected.
//! * [`IngestServer::shutdown`] stops accepting, gives open connections a grace period to end
//!   (their peers close), cuts those still open, drains the queue into the index and returns
//!   the index with the totals.
//!
//! A Hello binds its connection to the worker it names: from then on an event batch or
//! recovery reply for another worker (or a second Hello naming another) closes the
//! connection, counted ([`ConnectionStats::foreign`]), so a connection cannot write another
//! worker's blocks. A connection that sends no Hello is not bound. Registration from the Hello
//! and load reports from Heartbeats are not done here: the embedder joins workers to its router.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::{mpsc as std_mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::BytesMut;
use kvroute_core::{ApplyEvents, IndexReader, PrefixIndex, Router};
use tokio::sync::{mpsc, watch};

use crate::apply::{BatchApplier, BatchOutcome};
use crate::backend::{Backend, BackendChoice, BackendError};
use crate::frame::{DecodeStats, Frame, FrameDecoder, FrameError, MAX_PAYLOAD};
use crate::net::{self, ConnEvent, Stream};
use crate::wire::{MessageKind, MessageRef};

/// Settings of an [`IngestServer`].
#[derive(Clone, Debug)]
pub struct IngestConfig {
    /// Where to listen; port 0 picks a free port ([`IngestServer::local_addr`] tells which).
    pub addr: SocketAddr,
    /// The I/O backend to run on.
    pub backend: BackendChoice,
    /// Runtime threads, each with its own listener; 0 means one per available core.
    pub threads: usize,
    /// Largest payload accepted, in bytes (capped at [`MAX_PAYLOAD`]).
    pub max_payload: u32,
    /// Messages waiting for the index writer, over all connections; a message holds the
    /// frames of one read (at most `read_chunk` bytes and one frame's remainder). A full queue
    /// makes connections wait.
    pub queue_frames: usize,
    /// Spare room each read asks for, in bytes.
    pub read_chunk: usize,
    /// How long [`IngestServer::shutdown`] lets open connections run before cutting them.
    pub shutdown_grace: Duration,
}

impl IngestConfig {
    /// Defaults, listening on `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        IngestConfig {
            addr,
            backend: BackendChoice::Auto,
            threads: 0,
            max_payload: 16 << 20,
            queue_frames: 256,
            read_chunk: 64 << 10,
            shutdown_grace: Duration::from_secs(2),
        }
    }
}

/// Errors of starting and stopping the server.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
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
    #[error("ingest thread {thread} panicked")]
    Panicked {
        /// The thread's name.
        thread: String,
    },
}

/// How connections ended, and the accept loop's errors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectionStats {
    /// Connections accepted.
    pub accepted: u64,
    /// The peer closed between frames.
    pub closed: u64,
    /// Closed by us after a frame error other than truncation (see `IngestStats::decode`).
    pub rejected: u64,
    /// The stream ended inside a frame.
    pub truncated: u64,
    /// A read failed (reset by the peer, ...).
    pub io_errors: u64,
    /// Still open when the shutdown grace period ran out. Their decode counts are lost.
    pub cut_at_shutdown: u64,
    /// The index writer had stopped (it only does after a panic).
    pub writer_gone: u64,
    /// Closed by us for a frame naming a worker other than the connection's Hello.
    pub foreign: u64,
    /// Accepts that failed.
    pub accept_errors: u64,
}

/// What the index writer did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Frames applied: `KvEvents` batches and `RecoveryReply`s.
    pub batches: u64,
    /// Events in those frames.
    pub events: u64,
    /// Events applied without error.
    pub applied: u64,
    /// Events the index rejected (it keeps the details in its own stats).
    pub rejected: u64,
    /// Blocks named by Stored events.
    pub blocks_stored: u64,
    /// Blocks named by Removed events.
    pub blocks_removed: u64,
    /// Frames the writer could not read (cannot happen: connections validate first).
    pub unreadable: u64,
}

impl ApplyStats {
    fn add(&mut self, o: &BatchOutcome) {
        self.batches += 1;
        self.events += u64::from(o.events);
        self.applied += u64::from(o.applied);
        self.rejected += u64::from(o.rejected);
        self.blocks_stored += o.blocks_stored;
        self.blocks_removed += o.blocks_removed;
    }
}

/// The server's totals. Connection and decode figures include connections that have ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IngestStats {
    /// How connections ended, and the accept loop's errors.
    pub connections: ConnectionStats,
    /// Frames cut and rejected, per kind, summed over ended connections.
    pub decode: DecodeStats,
    /// Frames queued for the index writer.
    pub queued: u64,
    /// Valid frames of other kinds (Hello, Heartbeat, ...): counted (a Hello also binds its
    /// connection to its worker).
    pub ignored: u64,
    /// What the index writer did.
    pub apply: ApplyStats,
}

/// Where an [`IngestServer`] applies the events it receives.
#[derive(Debug)]
pub enum IngestTarget {
    /// An index of its own, handed back at shutdown.
    Index(Box<PrefixIndex>),
    /// A router's index, through [`Router::event_writer`], so that the router notes every
    /// event (an eviction retires its speculative records, stored blocks feed warm-up). The
    /// writer holds the router's index lock for one received read's frames at a time.
    Router(Arc<Router>),
}

impl From<PrefixIndex> for IngestTarget {
    fn from(index: PrefixIndex) -> Self {
        IngestTarget::Index(Box::new(index))
    }
}

impl From<Arc<Router>> for IngestTarget {
    fn from(router: Arc<Router>) -> Self {
        IngestTarget::Router(router)
    }
}

impl IngestTarget {
    /// The index, when the target is one of its own.
    pub fn index(&self) -> Option<&PrefixIndex> {
        match self {
            IngestTarget::Index(index) => Some(index),
            IngestTarget::Router(_) => None,
        }
    }

    /// The index, when the target is one of its own.
    pub fn into_index(self) -> Option<PrefixIndex> {
        match self {
            IngestTarget::Index(index) => Some(*index),
            IngestTarget::Router(_) => None,
        }
    }

    fn reader(&self) -> IndexReader {
        match self {
            IngestTarget::Index(index) => index.reader(),
            IngestTarget::Router(router) => router.index_reader(),
        }
    }
}

/// What [`IngestServer::shutdown`] hands back.
#[derive(Debug)]
pub struct IngestReport {
    /// The target, with every received event applied.
    pub target: IngestTarget,
    /// The server's totals at shutdown.
    pub stats: IngestStats,
}

/// Totals shared by the threads; each connection adds its figures once, when it ends, and the
/// writer once per batch.
#[derive(Debug, Default)]
struct Shared {
    conns: Mutex<IngestStats>,
    apply: Mutex<ApplyStats>,
}

impl Shared {
    fn with_conns(&self, f: impl FnOnce(&mut IngestStats)) {
        f(&mut self.conns.lock().unwrap_or_else(PoisonError::into_inner));
    }

    fn snapshot(&self) -> IngestStats {
        let mut s = self
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        s.apply = *self.apply.lock().unwrap_or_else(PoisonError::into_inner);
        s
    }
}

/// A running ingest server. Dropping it without [`shutdown`](Self::shutdown) stops it too, in
/// the background.
#[derive(Debug)]
pub struct IngestServer {
    local_addr: SocketAddr,
    backend: Backend,
    reader: IndexReader,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    threads: Vec<JoinHandle<()>>,
    writer: JoinHandle<IngestTarget>,
}

impl IngestServer {
    /// Binds, starts the runtime threads and the index writer, and returns once every thread
    /// accepts. `target` moves to the writer; [`reader`](Self::reader) queries its index
    /// meanwhile. A [`PrefixIndex`] converts into a target of its own.
    pub fn start(
        config: IngestConfig,
        target: impl Into<IngestTarget>,
    ) -> Result<IngestServer, IngestError> {
        let target = target.into();
        let resolved = config.backend.resolve()?;
        resolved.log("ingest", config.backend);
        let backend = resolved.backend;
        let threads = match config.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let listeners =
            net::bind_reuseport(config.addr, threads).map_err(|source| IngestError::Bind {
                addr: config.addr,
                source,
            })?;
        let local_addr = listeners[0]
            .local_addr()
            .map_err(|source| IngestError::Bind {
                addr: config.addr,
                source,
            })?;

        let shared = Arc::new(Shared::default());
        let reader = target.reader();
        let max_payload = config.max_payload.min(MAX_PAYLOAD);
        let (queue, rx) = mpsc::channel::<Vec<Frame>>(config.queue_frames.max(1));
        let writer = {
            let shared = Arc::clone(&shared);
            spawn("kvroute-ingest-writer".into(), move || {
                run_writer(target, rx, &shared, max_payload)
            })?
        };

        let (stop, stop_rx) = watch::channel(false);
        let (ready_tx, ready_rx) = std_mpsc::channel::<Result<(), BackendError>>();
        let mut handles = Vec::with_capacity(threads);
        for (i, listener) in listeners.into_iter().enumerate() {
            let ctx = ThreadConfig {
                backend,
                listener,
                queue: queue.clone(),
                shared: Arc::clone(&shared),
                stop: stop_rx.clone(),
                ready: ready_tx.clone(),
                max_payload,
                read_chunk: config.read_chunk.max(4096),
                grace: config.shutdown_grace,
            };
            handles.push(spawn(format!("kvroute-ingest-{i}"), move || {
                run_thread(ctx)
            })?);
        }
        drop((queue, ready_tx));
        let server = IngestServer {
            local_addr,
            backend,
            reader,
            shared,
            stop,
            threads: handles,
            writer,
        };
        for _ in 0..threads {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    // The threads that did start stop when `server` drops.
                    return Err(e.into());
                }
                Err(_) => {
                    return Err(IngestError::Panicked {
                        thread: "kvroute-ingest (starting)".into(),
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

    /// The backend the server runs on.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// A handle that queries the index while the server feeds it.
    pub fn reader(&self) -> IndexReader {
        self.reader.clone()
    }

    /// The totals so far (connection and decode figures of ended connections only).
    pub fn stats(&self) -> IngestStats {
        self.shared.snapshot()
    }

    /// Stops accepting, lets open connections end within the grace period (cutting the rest),
    /// applies every queued frame and returns the target and the totals.
    pub fn shutdown(self) -> Result<IngestReport, IngestError> {
        // Receivers see the change even if they subscribed after it; a send error only means
        // every thread has already gone.
        let _ = self.stop.send(true);
        for (i, h) in self.threads.into_iter().enumerate() {
            h.join().map_err(|_| IngestError::Panicked {
                thread: format!("kvroute-ingest-{i}"),
            })?;
        }
        // Every queue sender lived on those threads: the writer now drains and ends.
        let target = self.writer.join().map_err(|_| IngestError::Panicked {
            thread: "kvroute-ingest-writer".into(),
        })?;
        Ok(IngestReport {
            target,
            stats: self.shared.snapshot(),
        })
    }
}

fn spawn<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<T>, IngestError> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(f)
        .map_err(|source| IngestError::Spawn {
            thread: name,
            source,
        })
}

// ---- the index writer ----

fn run_writer(
    mut target: IngestTarget,
    mut rx: mpsc::Receiver<Vec<Frame>>,
    shared: &Shared,
    max_payload: u32,
) -> IngestTarget {
    let mut applier = BatchApplier::new();
    let mut decoder = FrameDecoder::new(max_payload);
    let mut done = ApplyStats::default();
    while let Some(frames) = rx.blocking_recv() {
        match &mut target {
            IngestTarget::Index(index) => {
                apply_frames(&frames, &mut decoder, &mut applier, &mut **index, &mut done)
            }
            IngestTarget::Router(router) => {
                let mut writer = router.event_writer();
                apply_frames(&frames, &mut decoder, &mut applier, &mut writer, &mut done)
            }
        }
        let mut apply = shared.apply.lock().unwrap_or_else(PoisonError::into_inner);
        *apply = done;
    }
    target
}

/// Applies the event frames of one read to `index`, counting into `done`.
fn apply_frames(
    frames: &[Frame],
    decoder: &mut FrameDecoder,
    applier: &mut BatchApplier,
    index: &mut impl ApplyEvents,
    done: &mut ApplyStats,
) {
    for frame in frames {
        match decoder.validate(frame) {
            Ok(MessageRef::KvEvents(batch)) => done.add(&applier.apply_batch(index, batch)),
            Ok(MessageRef::RecoveryReply(reply)) => done.add(&applier.apply_recovery(index, reply)),
            Ok(_) | Err(_) => done.unreadable += 1,
        }
    }
}

// ---- the runtime threads ----

struct ThreadConfig {
    backend: Backend,
    listener: std::net::TcpListener,
    queue: mpsc::Sender<Vec<Frame>>,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
    ready: std_mpsc::Sender<Result<(), BackendError>>,
    max_payload: u32,
    read_chunk: usize,
    grace: Duration,
}

/// What the connections of one thread share.
struct ConnContext {
    queue: mpsc::Sender<Vec<Frame>>,
    shared: Arc<Shared>,
    /// Receive buffers of ended connections, for the next ones.
    pool: RefCell<Vec<BytesMut>>,
    max_payload: u32,
    read_chunk: usize,
}

/// Receive buffers kept per thread.
const POOLED_BUFFERS: usize = 64;

impl ConnContext {
    fn take_buffer(&self) -> BytesMut {
        self.pool
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| BytesMut::with_capacity(self.read_chunk))
    }

    fn give_buffer(&self, mut buf: BytesMut) {
        buf.clear();
        let mut pool = self.pool.borrow_mut();
        if pool.len() < POOLED_BUFFERS {
            pool.push(buf);
        }
    }
}

fn run_thread(cfg: ThreadConfig) {
    let ThreadConfig {
        backend,
        listener,
        queue,
        shared,
        stop,
        ready,
        max_payload,
        read_chunk,
        grace,
    } = cfg;
    let ctx = Rc::new(ConnContext {
        queue,
        shared: Arc::clone(&shared),
        pool: RefCell::new(Vec::new()),
        max_payload,
        read_chunk,
    });
    let thread = net::ServerThread {
        backend,
        listener,
        ready,
        stop,
        grace,
        server: "ingest",
    };
    net::run_server_thread(
        thread,
        |event| {
            shared.with_conns(|s| match event {
                ConnEvent::Accepted => s.connections.accepted += 1,
                ConnEvent::AcceptFailed => s.connections.accept_errors += 1,
                ConnEvent::CutAtShutdown(n) => s.connections.cut_at_shutdown += n,
            })
        },
        move |stream, peer| serve(stream, peer, Rc::clone(&ctx)),
    );
}

/// How a connection ended.
enum End {
    Closed,
    Frame(FrameError),
    Io(std::io::Error),
    WriterGone,
    /// A frame for `named`, on a connection whose Hello said `bound`.
    Foreign {
        bound: u64,
        named: u64,
    },
}

/// One connection: read, cut frames, validate, queue event batches, until the peer closes or
/// sends something wrong.
async fn serve(mut stream: Stream, peer: SocketAddr, ctx: Rc<ConnContext>) {
    // Best effort: Nagle only delays our (absent) replies.
    let _ = stream.set_nodelay();
    let mut buf = ctx.take_buffer();
    let mut decoder = FrameDecoder::new(ctx.max_payload);
    let (mut queued, mut ignored) = (0u64, 0u64);
    // The worker a Hello bound this connection to.
    let mut bound: Option<u64> = None;
    let mut eof = false;
    let mut frames = Vec::new();
    let end = loop {
        let ended = loop {
            let next = if eof {
                decoder.decode_eof(&mut buf)
            } else {
                decoder.decode(&mut buf)
            };
            let frame = match next {
                Ok(Some(frame)) => frame,
                Ok(None) if eof => break Some(End::Closed),
                Ok(None) => break None,
                Err(e) => break Some(End::Frame(e)),
            };
            let named = match decoder.validate(&frame) {
                Err(e) => break Some(End::Frame(e)),
                Ok(MessageRef::Hello(h)) => {
                    ignored += 1;
                    let named = h.worker_id.to_native();
                    bound.get_or_insert(named);
                    named
                }
                Ok(MessageRef::KvEvents(b)) => b.worker_id.to_native(),
                Ok(MessageRef::RecoveryReply(r)) => r.worker_id.to_native(),
                Ok(_) => {
                    ignored += 1;
                    continue;
                }
            };
            if let Some(bound) = bound.filter(|&b| b != named) {
                break Some(End::Foreign { bound, named });
            }
            if matches!(
                frame.kind(),
                MessageKind::KvEvents | MessageKind::RecoveryReply
            ) {
                frames.push(frame);
            }
        };
        // The frames this read completed, good ones before a bad one included.
        if !frames.is_empty() {
            let n = frames.len() as u64;
            if ctx.queue.send(std::mem::take(&mut frames)).await.is_err() {
                break End::WriterGone;
            }
            queued += n;
        }
        if let Some(end) = ended {
            break end;
        }
        if buf.capacity() - buf.len() < ctx.read_chunk / 2 {
            buf.reserve(ctx.read_chunk);
        }
        let (res, b) = stream.read(buf).await;
        buf = b;
        match res {
            Ok(0) => eof = true,
            Ok(_) => {}
            Err(e) => break End::Io(e),
        }
    };
    let stats = *decoder.stats();
    ctx.shared.with_conns(|s| {
        s.decode.merge(&stats);
        s.queued += queued;
        s.ignored += ignored;
        let c = &mut s.connections;
        match &end {
            End::Closed => c.closed += 1,
            End::Frame(FrameError::Truncated { .. }) => c.truncated += 1,
            End::Frame(_) => c.rejected += 1,
            End::Io(_) => c.io_errors += 1,
            End::WriterGone => c.writer_gone += 1,
            End::Foreign { .. } => c.foreign += 1,
        }
    });
    match end {
        End::Closed => tracing::debug!(%peer, frames = stats.frames, "ingest connection closed"),
        End::Frame(error) => tracing::warn!(
            %peer,
            kind = error.kind_name(),
            %error,
            frames = stats.frames,
            "ingest connection closed: bad frame"
        ),
        End::Io(error) => tracing::warn!(%peer, %error, "ingest connection closed: read failed"),
        End::WriterGone => tracing::warn!(%peer, "ingest connection closed: index writer gone"),
        End::Foreign { bound, named } => tracing::warn!(
            %peer,
            hello_worker = bound,
            frame_worker = named,
            "ingest connection closed: a frame for another worker than its Hello's"
        ),
    }
    ctx.give_buffer(buf);
}
