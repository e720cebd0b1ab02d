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
//!
//! The I/O loops (io_uring, with an epoll fallback) are the next increment.
#![forbid(unsafe_code)]

pub mod apply;
pub mod frame;
pub mod wire;

pub use apply::{apply_event_batch, BatchApplier, BatchOutcome, EventRejection};
pub use frame::{
    encode, encode_to_bytes, DecodeStats, EncodeError, Frame, FrameDecoder, FrameError,
};
pub use kvroute_core as core;
pub use wire::{Message, MessageKind, MessageRef, PROTOCOL_VERSION};
