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
