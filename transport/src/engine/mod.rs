//! KV events from engines' own publishers (vLLM, SGLang, llm-d's simulator): one ZeroMQ message
//! in, the core's [`KvEvent`](kvroute_core::KvEvent)s out, with per-publisher sequence tracking.
//! I/O-free, so that it can be fuzzed and golden-tested; the sockets (SUB for the live stream,
//! DEALER for replays) drive it from elsewhere.
//!
//! ```text
//!  SUB frames ──parse_live──▶ EngineMessage { topic, seq, payload }
//!        ──SeqTracker::offer_live──▶ Apply / Duplicate / Held + ReplayRequest / Restart
//!  DEALER frames ──parse_replay──▶ Batch | End ──offer_replayed / replay_end──▶ Apply / Lost
//!  payload ──decode_batch──▶ EngineBatch (engine's hashes, tokens, media; both encodings)
//!        ──EngineDecoder──▶ KvEvent { rank, event id, tier, Stored / Removed / Cleared }
//! ```
//!
//! The msgpack is read with `rmp`'s low-level markers and a cursor of our own rather than
//! `rmpv`'s value tree: the events are read straight from the payload into the few fields a
//! router needs, without building a tree per message, and both encodings (maps and positional
//! arrays) share one field reader.
//!
//! What the wire leaves open, and how it is read here:
//!
//! * **Hashes** arrive as unsigned integers (vLLM, possibly >= 2^63), signed ones (SGLang: the
//!   same 64 bits, two's complement) or bytes (vLLM without integer hashes): bytes are named by
//!   their *last* 8 bytes, big-endian, which is the integer vLLM sends when asked for integers.
//! * **Token ids** arrive as u32s or, from SGLang under EAGLE, as bigrams `(t[i], t[i+1])`:
//!   a pair stands for its first token.
//! * **A gap** in the sequence is filled from the replay socket while the batches ahead of it
//!   are held (bounded), not dropped; see `sequence.rs`.
//! * **A restart** (a live seq back below a small bound) clears the worker; the caller also
//!   forgets the decoder's learned cache groups ([`EngineDecoder::reset`]).
//!
//! Module map:
//!
//! * `frames.rs`: the multipart layouts, live and replay ([`parse_live`], [`parse_replay`]).
//! * `payload.rs`: the batch and event schema in both encodings ([`decode_batch`]).
//! * `convert.rs`: engine events to core events ([`EngineDecoder`]): the router's block hashes,
//!   media to tiers, full-attention groups only, event ids.
//! * `sequence.rs`: [`SeqTracker`], the per-publisher sequence state machine.
//! * `msgpack.rs`: the pull reader over the payload's bytes.
//! * `error.rs`: [`FrameLayoutError`], [`PayloadError`], [`MsgpackError`], [`EventError`].
//! * `tests.rs`: unit tests of the sequence state machine; the golden and decoding tests are
//!   in `transport/tests/engine_events.rs`.

mod convert;
mod error;
mod frames;
mod msgpack;
mod payload;
mod sequence;

pub use convert::{tier_of_medium, BatchOutcome, DecodeCounts, DecoderConfig, EngineDecoder};
pub use error::{EventError, FrameLayoutError, MsgpackError, PayloadError};
pub use frames::{parse_live, parse_replay, replay_request, EngineMessage, ReplayReply, END_SEQ};
pub use payload::{decode_batch, BlockRemoved, BlockStored, EngineBatch, EngineEvent};
pub use sequence::{Drain, ReplayRequest, SeqTracker, SequenceConfig, SequenceCounts, Verdict};

#[cfg(test)]
mod tests;
