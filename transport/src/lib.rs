//! kvroute's transport: the wire protocol between frontends and GPU workers and the
//! shard-per-core I/O loops that drive the core. It depends on `kvroute-core` and nothing here
//! is needed by the core itself.
//!
//! ```text
//!  socket bytes ──▶ BytesMut ──FrameDecoder::decode──▶ Frame (kind, payload: Bytes, no copy)
//!                                 ──FrameDecoder::validate (bytecheck)──▶ MessageRef (archived view)
//!                                 ──BatchApplier──▶ PrefixIndex          (KV events, no owned copy)
//!  Message ──frame::encode──▶ BytesMut ──▶ socket
//! ```
//!
//! * [`wire`]: the messages (rkyv archives) and their conversions to the core's types.
//! * [`frame`]: the frame header, the encoder, and the decoder with its rejection counters.
//! * [`apply`]: KV event batches applied to the index from their archived form.
//! * [`backend`]: io_uring (tokio-uring) where the kernel allows it, else tokio's epoll.
//! * [`ingest`]: the KV event ingest server: runtime threads reading sockets, one index writer.
//! * [`client`]: the sending side of ingest.
//! * [`engine`]: KV events from vLLM's and SGLang's own ZeroMQ publishers (msgpack), decoded
//!   into the core's events, with per-publisher sequence tracking; no I/O.
//! * [`replicas`]: the booking sync between the routers of one fleet (messages, outbox, inbox;
//!   the embedder carries them).
//! * [`subscriber`]: the ZeroMQ sockets that follow an engine's publisher (SUB, and DEALER for
//!   replays) and feed [`engine`]'s decoder into a router.
//! * [`worker`]: the worker side of request dispatch: routers' requests to an [`Engine`],
//!   its response streams back.
//! * [`dispatch`]: the router side: one connection per worker, bounded in-flight requests,
//!   response streams, heartbeats, reconnects.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod apply;
pub mod backend;
pub mod client;
mod conn;
pub mod dispatch;
pub mod engine;
pub mod frame;
pub mod ingest;
mod net;
pub mod replicas;
pub mod subscriber;
// Every item written in `wire` is documented; rkyv 0.8's `Archive` derive leaves the fields of
// a resolver's struct-like variants without docs (`WireEventDataResolver`, `RecoveryFromResolver`).
#[allow(missing_docs)]
pub mod wire;
pub mod worker;

pub use apply::{apply_event_batch, BatchApplier, BatchOutcome, EventRejection};
pub use backend::{Backend, BackendChoice, BackendError, UringSubmit};
pub use client::{ClientError, IngestClient};
pub use conn::Backoff;
pub use dispatch::{
    DispatchClient, DispatchConfig, DispatchError, DispatchStats, LinkState, Rejected,
    ResponseStream, StreamError, WorkerStatus,
};
pub use frame::{
    encode, encode_kv_events, encode_to_bytes, DecodeStats, EncodeError, Frame, FrameDecoder,
    FrameError,
};
pub use ingest::{
    IngestConfig, IngestError, IngestReport, IngestServer, IngestStats, IngestTarget,
};
pub use subscriber::{RankState, SubscriberConfig, SubscriberStats, Subscription};
pub use wire::{Message, MessageKind, MessageRef, PROTOCOL_VERSION};
pub use worker::{
    Engine, ResponseSink, SinkClosed, WorkerServer, WorkerServerConfig, WorkerServerError,
    WorkerStats,
};
