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
//!
//! Module map:
//!
//! * `handle.rs`: [`DispatchClient`] and [`ResponseStream`], what callers hold.
//! * `driver.rs`: the driver task: connecting, backoff, writing commands, losing a
//!   connection.
//! * `link.rs`: one connection's handshake, reader loop, flushes and in-flight table.
//! * `config.rs`: [`DispatchConfig`].
//! * `error.rs`: [`LinkError`], [`DispatchError`], [`Rejected`], [`StreamError`].
//! * `status.rs`: [`LinkState`], [`WorkerStatus`], [`DispatchStats`].

mod config;
mod driver;
mod error;
mod handle;
mod link;
mod status;

pub use config::DispatchConfig;
pub use error::{DispatchError, LinkError, Rejected, StreamError};
pub use handle::{DispatchClient, ResponseStream};
pub use status::{DispatchStats, LinkState, WorkerStatus};
