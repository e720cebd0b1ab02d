//! The sending side of KV event ingest: what a worker (or a test, a bench, the simulated
//! worker) uses to stream event batches to the router.
//!
//! An [`IngestClient`] is one TCP connection on either backend. Its methods are `async` and
//! must run inside a runtime of the same backend: [`crate::backend::block_on`] builds one.
//! Each batch is encoded into one reused buffer and written with one `write_all`.
//!
//! Reconnection with backoff and bounded in-flight requests belong to the dispatch client
//! ([`crate::dispatch`]).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;

use crate::backend::Backend;
use crate::frame::{encode_kv_events, EncodeError};
use crate::net::Stream;
use crate::wire::KvEventBatch;

/// Errors of the ingest client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {addr} over {backend}: {source}")]
    Connect {
        addr: SocketAddr,
        backend: Backend,
        #[source]
        source: std::io::Error,
    },
    #[error("write to {addr} failed: {source}")]
    Write {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Encode {
        #[from]
        source: EncodeError,
    },
    #[error("{addr} did not close the connection within {waited:?}")]
    StillOpen { addr: SocketAddr, waited: Duration },
}

/// One connection to an ingest server.
pub struct IngestClient {
    stream: Stream,
    addr: SocketAddr,
    backend: Backend,
    /// The frame being written, reused from batch to batch.
    out: BytesMut,
}

impl std::fmt::Debug for IngestClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestClient")
            .field("addr", &self.addr)
            .field("backend", &self.backend)
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
        Ok(IngestClient {
            stream,
            addr,
            backend,
            out: BytesMut::with_capacity(64 << 10),
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Sends `batch` as one frame.
    pub async fn send_batch(&mut self, batch: &KvEventBatch) -> Result<(), ClientError> {
        self.out.clear();
        encode_kv_events(batch, &mut self.out)?;
        self.write_out().await
    }

    /// Sends `bytes` as they are: for tests that play a broken peer.
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.out.clear();
        self.out.extend_from_slice(bytes);
        self.write_out().await
    }

    /// Closes the connection after everything sent so far (the server reads end of stream).
    pub async fn close(mut self) -> Result<(), ClientError> {
        let addr = self.addr;
        self.stream
            .shutdown_write()
            .await
            .map_err(|source| ClientError::Write { addr, source })
    }

    /// Waits until the server closes the connection (a read returns end of stream or fails),
    /// for at most `timeout`. The ingest server never writes, so any read result means that.
    pub async fn wait_closed_by_peer(&mut self, timeout: Duration) -> Result<(), ClientError> {
        let buf = BytesMut::with_capacity(4096);
        match tokio::time::timeout(timeout, self.stream.read(buf)).await {
            Ok(_) => Ok(()),
            Err(_) => Err(ClientError::StillOpen {
                addr: self.addr,
                waited: timeout,
            }),
        }
    }

    async fn write_out(&mut self) -> Result<(), ClientError> {
        let (res, out) = self.stream.write_all(std::mem::take(&mut self.out)).await;
        self.out = out;
        res.map_err(|source| ClientError::Write {
            addr: self.addr,
            source,
        })
    }
}
