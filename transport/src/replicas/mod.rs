//! The booking sync between the routers of one fleet, with no I/O of its own: the embedder
//! carries the messages (serve: over NATS core, one subject per fleet).
//!
//! ```text
//!  Router::on_booking ──▶ DeltaLog (words) ──taken by a collector every batch window──▶ Outbox
//!  Outbox ──flush: Deltas (seq n, n+1, …)──────────────────────▶ every other router
//!         ──heartbeat (last seq)───────────────────────────────▶
//!         ──snapshot (its whole book) on a Resync, or after loss─▶
//!  every other router ──▶ Inbox::receive ──▶ Router::apply_remote (in sequence)
//!                              │ a gap, or a new peer: drop its bookings, ask it to Resync
//!                              └ a peer quiet too long, or saying Bye: drop its bookings
//! ```
//!
//! Best effort by design: the engines stay the source of truth for caches (every router
//! follows every engine's KV events), so the sync carries only in-flight load, and a router
//! that loses the sync routes on its own bookings until it is back.
//!
//! * [`wire`]: the messages (rkyv archives).
//! * [`log`]: the routing threads' changes, appended as words, taken by one collector.
//! * [`outbox`]: this router's book and the messages that tell it.
//! * [`inbox`]: the other routers' messages applied to this one.

pub mod inbox;
pub mod log;
pub mod outbox;
// Every item written in `wire` is documented; rkyv 0.8's `Archive` derive leaves the fields of
// the resolvers of struct-like variants (`BodyResolver`, `WireDeltaResolver`) without docs.
#[allow(missing_docs)]
pub mod wire;

pub use inbox::{Inbox, InboxCounts, Received, RESYNC_EVERY};
pub use log::{DeltaLog, Replayer, Taken, LOG_ROOM, MAX_LOG_WORDS, RECYCLE_AFTER};
pub use outbox::{resync, Outbox};
pub use wire::{access, decode, encode, Body, Envelope, WireBooking, WireDelta, WireError};

#[cfg(test)]
mod tests;
