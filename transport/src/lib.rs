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
//!
//! Request dispatch and response streams over the same sockets are the next increment.
#![forbid(unsafe_code)]

pub mod apply;
pub mod backend;
pub mod client;
pub mod frame;
pub mod ingest;
mod net;
pub mod wire;

pub use apply::{apply_event_batch, BatchApplier, BatchOutcome, EventRejection};
pub use backend::{Backend, BackendChoice, BackendError};
pub use client::{ClientError, IngestClient};
pub use frame::{
    encode, encode_kv_events, encode_to_bytes, DecodeStats, EncodeError, Frame, FrameDecoder,
    FrameError,
};
pub use ingest::{IngestConfig, IngestError, IngestReport, IngestServer, IngestStats};
pub use kvroute_core as core;
pub use wire::{Message, MessageKind, MessageRef, PROTOCOL_VERSION};
