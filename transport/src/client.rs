//! The sending side of KV event ingest: what a worker (or a test, a bench, the simulated
//! worker) uses to stream event batches to the router.
//!
//! ```text
//!  send_batch ──encode──▶ outbox (one BytesMut) ──writer task: take all, one write──▶ socket
//!                            ▲ waits here when more than `max_pending` bytes are queued
//! ```
//!
//! An [`IngestClient`] is one TCP connection on either backend. Its methods are `async` and
//! must run inside a runtime of the same backend with a `LocalSet`
//! ([`crate::backend::block_on`] builds one). Batches are encoded straight into an outbox and
//! a writer task writes whatever has gathered there in one `write_all`: while one write is in
//! flight the next batches gather, so a fast sender makes few large writes and a slow one
//! loses no latency. This matters most on io_uring, where tokio-uring submits only when its
//! runtime goes idle and every write costs an idle/wake cycle. The outbox is bounded: past
//! `max_pending` bytes, `send_batch` waits for the writer.
//!
//! Reconnection with backoff and bounded in-flight requests belong to the dispatch client
//! ([`crate::dispatch`]).

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::sync::Notify;

use crate::backend::Backend;
use crate::frame::{encode_kv_events, EncodeError};
use crate::net::{ReadHalf, Stream, WriteHalf};
use crate::wire::KvEventBatch;

/// Bytes queued before `send_batch` waits for the writer, by default.
pub const DEFAULT_MAX_PENDING: usize = 1 << 20;

/// Errors of the ingest client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection could not be made.
    #[error("cannot connect to {addr} over {backend}: {source}")]
    Connect {
        /// The server's address.
        addr: SocketAddr,
        /// The backend the client runs on.
        backend: Backend,
        /// The connect's error.
        #[source]
        source: std::io::Error,
    },
    /// A write to the server failed; the connection is unusable.
    #[error("write to {addr} failed ({kind:?}): {message}")]
    Write {
        /// The server's address.
        addr: SocketAddr,
        /// The error's kind.
        kind: std::io::ErrorKind,
        /// The error, as text.
        message: String,
    },
    /// A batch could not be framed.
    #[error(transparent)]
    Encode {
        /// Why.
        #[from]
        source: EncodeError,
    },
    /// The server did not close the connection in time ([`IngestClient::wait_closed_by_peer`]).
    #[error("{addr} did not close the connection within {waited:?}")]
    StillOpen {
        /// The server's address.
        addr: SocketAddr,
        /// How long the client waited.
        waited: Duration,
    },
}

/// What the client and its writer task share (same thread).
#[derive(Debug, Default)]
struct Outbox {
    /// Frames encoded and not yet taken by the writer.
    queued: RefCell<BytesMut>,
    /// The writer holds bytes it has not finished writing.
    writing: Cell<bool>,
    /// No more frames: the writer writes what is queued, shuts the write side and ends.
    closing: Cell<bool>,
    /// The first write error; every later call returns it.
    failed: RefCell<Option<(std::io::ErrorKind, String)>>,
    /// Frames were queued (or closing was set).
    to_writer: Notify,
    /// A write finished (or failed).
    from_writer: Notify,
}

impl Outbox {
    fn error(&self, addr: SocketAddr) -> Option<ClientError> {
        self.failed
            .borrow()
            .as_ref()
            .map(|(kind, message)| ClientError::Write {
                addr,
                kind: *kind,
                message: message.clone(),
            })
    }

    fn idle(&self) -> bool {
        self.queued.borrow().is_empty() && !self.writing.get()
    }
}

/// One connection to an ingest server.
pub struct IngestClient {
    addr: SocketAddr,
    backend: Backend,
    outbox: Rc<Outbox>,
    max_pending: usize,
    reader: ReadHalf,
    writer: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for IngestClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestClient")
            .field("addr", &self.addr)
            .field("backend", &self.backend)
            .field("queued", &self.outbox.queued.borrow().len())
            .finish()
    }
}

impl IngestClient {
    /// Connects to `addr`. Call inside a runtime of `backend`.
    pub async fn connect(addr: SocketAddr, backend: Backend) -> Result<IngestClient, ClientError> {
        let stream =
            Stream::connect(backend, addr)
                .await
                .map_err(|source| ClientError::Connect {
                    addr,
                    backend,
                    source,
                })?;
        let (reader, half) = stream.into_split();
        let outbox = Rc::new(Outbox::default());
        let writer = tokio::task::spawn_local(write_loop(half, Rc::clone(&outbox)));
        Ok(IngestClient {
            addr,
            backend,
            outbox,
            max_pending: DEFAULT_MAX_PENDING,
            reader,
            writer: Some(writer),
        })
    }

    /// The backend it runs on.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Sets how many bytes may wait for the writer before `send_batch` waits.
    pub fn set_max_pending(&mut self, bytes: usize) {
        self.max_pending = bytes.max(1);
    }

    /// Queues `batch` as one frame; the writer sends it with whatever else has gathered.
    /// Waits only while the outbox is over its bound.
    pub async fn send_batch(&mut self, batch: &KvEventBatch) -> Result<(), ClientError> {
        self.wait_for_room().await?;
        encode_kv_events(batch, &mut self.outbox.queued.borrow_mut())?;
        self.outbox.to_writer.notify_one();
        Ok(())
    }

    /// Queues `bytes` as they are: for tests and benches that play a broken peer or send
    /// frames encoded in advance.
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.wait_for_room().await?;
        self.outbox.queued.borrow_mut().extend_from_slice(bytes);
        self.outbox.to_writer.notify_one();
        Ok(())
    }

    /// Waits until everything queued so far has been written to the socket.
    pub async fn flush(&mut self) -> Result<(), ClientError> {
        loop {
            if let Some(e) = self.outbox.error(self.addr) {
                return Err(e);
            }
            if self.outbox.idle() {
                return Ok(());
            }
            self.outbox.from_writer.notified().await;
        }
    }

    /// Writes everything queued, then closes the write side (the server reads end of stream).
    pub async fn close(mut self) -> Result<(), ClientError> {
        self.outbox.closing.set(true);
        self.outbox.to_writer.notify_one();
        if let Some(writer) = self.writer.take() {
            // The writer task does not panic; a join error would mean it was aborted.
            let _ = writer.await;
        }
        match self.outbox.error(self.addr) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Waits until the server closes the connection (a read returns end of stream or fails),
    /// for at most `timeout`. The ingest server never writes, so any read result means that.
    pub async fn wait_closed_by_peer(&mut self, timeout: Duration) -> Result<(), ClientError> {
        let buf = BytesMut::with_capacity(4096);
        match tokio::time::timeout(timeout, self.reader.read(buf)).await {
            Ok(_) => Ok(()),
            Err(_) => Err(ClientError::StillOpen {
                addr: self.addr,
                waited: timeout,
            }),
        }
    }

    async fn wait_for_room(&mut self) -> Result<(), ClientError> {
        loop {
            if let Some(e) = self.outbox.error(self.addr) {
                return Err(e);
            }
            if self.outbox.queued.borrow().len() < self.max_pending {
                return Ok(());
            }
            self.outbox.from_writer.notified().await;
        }
    }
}

impl Drop for IngestClient {
    fn drop(&mut self) {
        // The socket goes now, written or not: a dropped client is a killed one.
        if let Some(writer) = self.writer.take() {
            writer.abort();
        }
    }
}

/// Takes everything queued and writes it in one go, until closing and drained, or an error.
async fn write_loop(mut half: WriteHalf, outbox: Rc<Outbox>) {
    let mut spare = BytesMut::with_capacity(64 << 10);
    loop {
        if outbox.queued.borrow().is_empty() {
            if outbox.closing.get() {
                if let Err(e) = half.shutdown_write().await {
                    *outbox.failed.borrow_mut() = Some((e.kind(), e.to_string()));
                }
                outbox.from_writer.notify_one();
                return;
            }
            outbox.to_writer.notified().await;
            continue;
        }
        std::mem::swap(&mut *outbox.queued.borrow_mut(), &mut spare);
        outbox.writing.set(true);
        // The sender may queue more while this write is in flight.
        outbox.from_writer.notify_one();
        let (res, mut out) = half.write_all(spare).await;
        out.clear();
        spare = out;
        outbox.writing.set(false);
        let failed = res.err();
        if let Some(e) = &failed {
            *outbox.failed.borrow_mut() = Some((e.kind(), e.to_string()));
        }
        outbox.from_writer.notify_one();
        if failed.is_some() {
            return;
        }
    }
}
