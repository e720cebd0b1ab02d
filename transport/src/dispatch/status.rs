//! What the router can read of a worker connection: [`LinkState`], [`WorkerStatus`] and the
//! client's totals ([`DispatchStats`]).

use super::error::LinkError;
use crate::frame::DecodeStats;
use crate::wire::{Heartbeat, Hello};

/// Where the connection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkState {
    /// Connecting, or waiting for the worker's Hello.
    Connecting,
    /// Handshake done: requests can be dispatched.
    Connected,
    /// Waiting before the next attempt.
    Backoff,
    /// The client shut down; it will not connect again.
    ShutDown,
}

/// What the router knows of the worker: published on every change.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerStatus {
    /// Where the connection stands.
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
    /// Connections established (handshake done).
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
    /// Cancels written to the worker.
    pub cancels_sent: u64,
    /// Items of requests not in flight (after a cancel, say).
    pub late_items: u64,
    /// Heartbeats received from the worker.
    pub heartbeats: u64,
    /// Valid frames of kinds the router side does not act on here.
    pub ignored: u64,
    /// Frames cut and rejected, summed over ended connections.
    pub decode: DecodeStats,
}
