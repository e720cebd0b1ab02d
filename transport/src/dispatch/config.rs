//! The settings of a [`DispatchClient`](super::DispatchClient) ([`DispatchConfig`]).

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_core::WorkerId;

use crate::backend::Backend;
use crate::conn::Backoff;

/// Settings of a [`DispatchClient`](super::DispatchClient).
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
    /// How often the client sends the worker a heartbeat, and checks for silence.
    pub heartbeat_interval: Duration,
    /// A connection with nothing received for this long is considered lost.
    pub idle_timeout: Duration,
    /// Limit of the TCP connect, and separately of the handshake.
    pub connect_timeout: Duration,
    /// Delays between reconnect attempts.
    pub backoff: Backoff,
    /// Largest payload accepted, in bytes (capped at [`MAX_PAYLOAD`](crate::frame::MAX_PAYLOAD)).
    pub max_payload: u32,
    /// Spare room each read asks for, in bytes.
    pub read_chunk: usize,
    /// How long [`DispatchClient::shutdown`] waits for in-flight requests.
    ///
    /// [`DispatchClient::shutdown`]: super::DispatchClient::shutdown
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
