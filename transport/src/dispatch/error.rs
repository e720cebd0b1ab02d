//! Why a connection failed ([`LinkError`]), why a request was not dispatched
//! ([`DispatchError`], [`Rejected`]), and why a response stream ended early ([`StreamError`]).

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_core::WorkerId;

use crate::conn::ReadEnd;
use crate::frame::FrameError;
use crate::wire::{Dispatch, ErrorCode, MessageKind};

/// Why a connection attempt failed or a connection ended.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LinkError {
    /// The TCP connect failed or timed out.
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// The worker's address.
        addr: SocketAddr,
        /// What the connect reported.
        reason: String,
    },
    /// The worker sent no Hello within the connect timeout.
    #[error("no Hello from {addr} within {waited:?}")]
    HandshakeTimeout {
        /// The worker's address.
        addr: SocketAddr,
        /// How long the handshake waited.
        waited: Duration,
    },
    /// The worker at the address is not the one configured.
    #[error("expected worker {expected:?}, found worker {found:?}")]
    WrongWorker {
        /// The worker configured.
        expected: WorkerId,
        /// The worker its Hello named.
        found: WorkerId,
    },
    /// The worker speaks another protocol version.
    #[error("the worker speaks protocol version {found}, this router {expected}")]
    WrongVersion {
        /// This build's [`PROTOCOL_VERSION`](crate::PROTOCOL_VERSION).
        expected: u16,
        /// The worker's.
        found: u16,
    },
    /// The worker's first message was not a Hello.
    #[error("the worker's first frame was {kind:?}, not a Hello")]
    NotHello {
        /// The kind it sent.
        kind: MessageKind,
    },
    /// The worker answered the handshake with an error message.
    #[error("the worker refused the connection ({code:?}): {message}")]
    Refused {
        /// Its error code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// A frame from the worker did not decode or validate.
    #[error("bad frame from the worker: {error}")]
    Frame {
        /// Why.
        error: FrameError,
    },
    /// The worker sent something the protocol does not allow there.
    #[error("the worker broke the protocol: {what}")]
    Protocol {
        /// What.
        what: &'static str,
    },
    /// A read or write failed.
    #[error("I/O error ({kind:?}): {message}")]
    Io {
        /// The error's kind.
        kind: std::io::ErrorKind,
        /// The error, as text.
        message: String,
    },
    /// The worker closed the connection.
    #[error("the worker closed the connection")]
    Closed,
    /// Nothing arrived from the worker for longer than the idle timeout.
    #[error("nothing received from the worker for {silent:?}")]
    Idle {
        /// How long it had been silent.
        silent: Duration,
    },
}

impl LinkError {
    pub(super) fn io(e: &std::io::Error) -> LinkError {
        LinkError::Io {
            kind: e.kind(),
            message: e.to_string(),
        }
    }

    pub(super) fn from_read(end: ReadEnd) -> LinkError {
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
    /// The worker is not connected now.
    #[error("worker {worker:?} is not connected (last error: {last_error:?})")]
    NotConnected {
        /// The worker.
        worker: WorkerId,
        /// Why its last connection failed or ended, if one did.
        last_error: Option<LinkError>,
    },
    /// Every in-flight slot is taken (only from `try_dispatch`).
    #[error("worker {worker:?} has {max_in_flight} requests in flight")]
    Full {
        /// The worker.
        worker: WorkerId,
        /// Its slots.
        max_in_flight: usize,
    },
    /// The client is shut down.
    #[error("the client of worker {worker:?} is shut down")]
    ShutDown {
        /// The worker.
        worker: WorkerId,
    },
}

/// A request that was not dispatched, handed back with the reason.
#[derive(Debug, thiserror::Error)]
#[error("request {} not dispatched: {reason}", request.request_id)]
pub struct Rejected {
    /// Why it was not dispatched.
    pub reason: DispatchError,
    /// The request, unchanged.
    pub request: Box<Dispatch>,
}

/// Why a response stream ended without a finishing item.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum StreamError {
    /// The connection to the worker ended (or had just ended when the request was queued).
    #[error("connection to worker {worker:?} lost: {reason:?}")]
    ConnectionLost {
        /// The worker.
        worker: WorkerId,
        /// Why the connection ended, if known.
        reason: Option<LinkError>,
    },
    /// The worker reported an error about this request.
    #[error("worker {worker:?} reported {code:?}: {message}")]
    Worker {
        /// The worker.
        worker: WorkerId,
        /// Its error code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// Another request with this id is in flight on this connection.
    #[error("request id {request_id} is already in flight")]
    DuplicateRequest {
        /// The request's id.
        request_id: u64,
    },
    /// The request could not be framed (too large).
    #[error("request {request_id} could not be encoded: {reason}")]
    Encode {
        /// The request's id.
        request_id: u64,
        /// What the encoder reported.
        reason: String,
    },
    /// The client shut down before the request finished.
    #[error("the client of worker {worker:?} shut down")]
    ShutDown {
        /// The worker.
        worker: WorkerId,
    },
}
