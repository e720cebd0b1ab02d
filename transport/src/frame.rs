//! Framing: how messages are cut out of a byte stream, checked, and read in place.
//!
//! ```text
//!  byte  0        4         6      7       8             12           16
//!        ┌────────┬─────────┬──────┬───────┬─────────────┬────────────┐
//!        │ magic  │ version │ kind │ flags │ payload len │  reserved  │ payload ... │ pad │
//!        │ "KVRT" │  u16 LE │  u8  │ u8 =0 │   u32 LE    │  u32 LE =0 │  rkyv root  │ 0-15│
//!        └────────┴─────────┴──────┴───────┴─────────────┴────────────┘
//!        ◀──────────────── header: 16 bytes ──────────────────────────▶
//! ```
//!
//! * The payload is one rkyv archive of the root type `kind` names, `payload len` bytes long
//!   (at most [`MAX_PAYLOAD`], or the receiver's lower limit). It is followed by zero padding to
//!   a multiple of [`PAYLOAD_ALIGN`], so that every payload of a stream starts at a multiple of
//!   16 bytes from the stream's start: received into an aligned buffer, payloads are read in
//!   place. One received elsewhere is copied to an aligned buffer first, and counted.
//! * The header is checked as soon as its bytes arrive (a stream that does not start with the
//!   magic is rejected after 4 bytes, not after 16); `flags` and `reserved` must be zero, so a
//!   later version may give them meaning.
//! * [`FrameDecoder::decode`] splits complete frames off a `BytesMut` without copying: the
//!   payload is a `Bytes` sharing the receive buffer. [`FrameDecoder::validate`] checks a
//!   payload with bytecheck and hands out a [`MessageRef`] into it.
//! * Any error means the stream can no longer be trusted: the connection should be closed.
//!   Every rejection is counted in [`DecodeStats`].

use bytes::{Buf, BufMut, Bytes, BytesMut};
use rkyv::util::AlignedVec;

use crate::wire::{self, KvEventBatch, Message, MessageKind, MessageRef, PROTOCOL_VERSION};

/// The first four bytes of every frame: "KVRT".
pub const MAGIC: [u8; 4] = *b"KVRT";
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 16;
/// Payloads start, and frames end, at multiples of this many bytes.
pub const PAYLOAD_ALIGN: usize = 16;
/// The protocol's largest payload, in bytes. A receiver may set a lower limit.
pub const MAX_PAYLOAD: u32 = 64 << 20;
/// Most bytes [`FrameDecoder::decode`] reserves in the buffer for the rest of a frame: a peer
/// announcing a large frame does not get the memory before it sends the bytes.
pub const MAX_RESERVE: usize = 1 << 20;

/// The bytes a frame with a payload of `payload_len` bytes takes on the wire.
pub const fn frame_len(payload_len: usize) -> usize {
    HEADER_LEN + payload_len.next_multiple_of(PAYLOAD_ALIGN)
}

/// Why a frame was rejected. After any of these the stream is out of step: close it.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The stream does not start with [`MAGIC`].
    #[error("bad magic {found:02x?}: the peer does not speak kvroute's protocol")]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// The header names a protocol version other than this build's.
    #[error("protocol version {found} is not supported (this side speaks {supported})")]
    UnsupportedVersion {
        /// The version in the header.
        found: u16,
        /// [`PROTOCOL_VERSION`].
        supported: u16,
    },
    /// The header's kind byte names no [`MessageKind`].
    #[error("unknown message kind {code}")]
    UnknownKind {
        /// The byte.
        code: u8,
    },
    /// The header's `flags` or `reserved` field is not zero.
    #[error("reserved header fields are set (flags {flags:#04x}, reserved {reserved:#010x})")]
    ReservedBits {
        /// The flags byte.
        flags: u8,
        /// The reserved word.
        reserved: u32,
    },
    /// The header announces a payload over the decoder's limit.
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    Oversized {
        /// The payload length announced, in bytes.
        len: u32,
        /// The decoder's limit, in bytes.
        max: u32,
    },
    /// The stream ended partway through a frame ([`FrameDecoder::decode_eof`]).
    #[error("stream ended inside a frame: {have} of {need} bytes")]
    Truncated {
        /// Bytes of the frame received.
        have: usize,
        /// Bytes the frame needs, as far as its header says.
        need: usize,
    },
    /// The payload is not a valid archive of the root type its kind names.
    #[error("{kind:?} payload of {len} bytes failed validation: {reason}")]
    InvalidPayload {
        /// The frame's kind.
        kind: MessageKind,
        /// The payload's length, in bytes.
        len: usize,
        /// What bytecheck reported.
        reason: String,
    },
}

impl FrameError {
    /// A short, stable name of the rejection (the [`DecodeStats`] field that counts it), for
    /// logs and metrics.
    pub fn kind_name(&self) -> &'static str {
        match self {
            FrameError::BadMagic { .. } => "bad_magic",
            FrameError::UnsupportedVersion { .. } => "unsupported_version",
            FrameError::UnknownKind { .. } => "unknown_kind",
            FrameError::ReservedBits { .. } => "reserved_bits",
            FrameError::Oversized { .. } => "oversized",
            FrameError::Truncated { .. } => "truncated",
            FrameError::InvalidPayload { .. } => "invalid_payload",
        }
    }
}

/// Why a message could not be framed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum EncodeError {
    /// The serialized message is over [`MAX_PAYLOAD`].
    #[error("payload of {len} bytes exceeds the protocol's limit of {max}")]
    Oversized {
        /// The payload's length, in bytes.
        len: usize,
        /// [`MAX_PAYLOAD`].
        max: u32,
    },
    /// rkyv could not serialize the message.
    #[error("serialization failed: {reason}")]
    Serialize {
        /// What rkyv reported.
        reason: String,
    },
}

/// A complete frame: its kind and its payload, sharing the receive buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    kind: MessageKind,
    payload: Bytes,
}

impl Frame {
    /// The message kind its header names.
    pub fn kind(&self) -> MessageKind {
        self.kind
    }

    /// The payload bytes (an rkyv archive, not yet validated).
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }
}

/// Frames decoded and rejections, per kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Complete frames split off.
    pub frames: u64,
    /// Bytes of those frames, headers and padding included.
    pub bytes: u64,
    /// Payloads that arrived misaligned and were copied to an aligned buffer.
    pub realigned: u64,
    /// Payloads that passed validation.
    pub validated: u64,
    /// Streams rejected for a bad magic ([`FrameError::BadMagic`]).
    pub bad_magic: u64,
    /// Frames of another protocol version ([`FrameError::UnsupportedVersion`]).
    pub unsupported_version: u64,
    /// Frames of an unknown kind ([`FrameError::UnknownKind`]).
    pub unknown_kind: u64,
    /// Frames with reserved header bits set ([`FrameError::ReservedBits`]).
    pub reserved_bits: u64,
    /// Frames over the payload limit ([`FrameError::Oversized`]).
    pub oversized: u64,
    /// Streams that ended inside a frame ([`FrameError::Truncated`]).
    pub truncated: u64,
    /// Payloads that failed validation ([`FrameError::InvalidPayload`]).
    pub invalid_payload: u64,
}

impl DecodeStats {
    /// All rejections.
    pub fn rejected(&self) -> u64 {
        self.bad_magic
            + self.unsupported_version
            + self.unknown_kind
            + self.reserved_bits
            + self.oversized
            + self.truncated
            + self.invalid_payload
    }

    /// Adds `other`'s counts to these (totals over connections).
    pub fn merge(&mut self, other: &DecodeStats) {
        self.frames += other.frames;
        self.bytes += other.bytes;
        self.realigned += other.realigned;
        self.validated += other.validated;
        self.bad_magic += other.bad_magic;
        self.unsupported_version += other.unsupported_version;
        self.unknown_kind += other.unknown_kind;
        self.reserved_bits += other.reserved_bits;
        self.oversized += other.oversized;
        self.truncated += other.truncated;
        self.invalid_payload += other.invalid_payload;
    }

    fn count(&mut self, e: &FrameError) {
        let c = match e {
            FrameError::BadMagic { .. } => &mut self.bad_magic,
            FrameError::UnsupportedVersion { .. } => &mut self.unsupported_version,
            FrameError::UnknownKind { .. } => &mut self.unknown_kind,
            FrameError::ReservedBits { .. } => &mut self.reserved_bits,
            FrameError::Oversized { .. } => &mut self.oversized,
            FrameError::Truncated { .. } => &mut self.truncated,
            FrameError::InvalidPayload { .. } => &mut self.invalid_payload,
        };
        *c += 1;
    }
}

/// Cuts frames out of a receive buffer and validates their payloads.
#[derive(Clone, Debug)]
pub struct FrameDecoder {
    max_payload: u32,
    stats: DecodeStats,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        FrameDecoder::new(MAX_PAYLOAD)
    }
}

/// A header parsed so far: `None` fields have not arrived yet.
struct Header {
    kind: Option<MessageKind>,
    len: Option<u32>,
}

impl FrameDecoder {
    /// A decoder that rejects payloads above `max_payload` bytes (capped at [`MAX_PAYLOAD`]).
    pub fn new(max_payload: u32) -> Self {
        FrameDecoder {
            max_payload: max_payload.min(MAX_PAYLOAD),
            stats: DecodeStats::default(),
        }
    }

    /// The largest payload it accepts, in bytes.
    pub fn max_payload(&self) -> u32 {
        self.max_payload
    }

    /// Its counts of frames decoded and rejected.
    pub fn stats(&self) -> &DecodeStats {
        &self.stats
    }

    /// Splits the next complete frame off the front of `buf`. `Ok(None)`: more bytes are
    /// needed (and `buf` has room reserved for the rest of the frame, up to [`MAX_RESERVE`]).
    /// On error `buf` is left as it was.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        self.decode_inner(buf).inspect_err(|e| self.stats.count(e))
    }

    /// As [`decode`](Self::decode), at the end of the stream: a partial frame left in `buf` is
    /// an error.
    pub fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        match self.decode(buf)? {
            Some(frame) => Ok(Some(frame)),
            None if buf.is_empty() => Ok(None),
            None => {
                let e = FrameError::Truncated {
                    have: buf.len(),
                    need: self.needed(buf),
                };
                self.stats.count(&e);
                Err(e)
            }
        }
    }

    /// Validates a frame's payload (bytecheck) and returns a view into it.
    pub fn validate<'f>(&mut self, frame: &'f Frame) -> Result<MessageRef<'f>, FrameError> {
        match wire::access(frame.kind, &frame.payload) {
            Ok(m) => {
                self.stats.validated += 1;
                Ok(m)
            }
            Err(e) => {
                let e = FrameError::InvalidPayload {
                    kind: frame.kind,
                    len: frame.payload.len(),
                    reason: e.to_string(),
                };
                self.stats.count(&e);
                Err(e)
            }
        }
    }

    /// Bytes the frame at the front of `buf` needs in all (the header alone while its length
    /// has not arrived).
    fn needed(&self, buf: &[u8]) -> usize {
        match self.parse_header(buf) {
            Ok(Header { len: Some(len), .. }) => frame_len(len as usize),
            _ => HEADER_LEN,
        }
    }

    /// Checks whatever part of the header `buf` holds.
    fn parse_header(&self, buf: &[u8]) -> Result<Header, FrameError> {
        let mut h = Header {
            kind: None,
            len: None,
        };
        if buf.len() >= 4 && buf[..4] != MAGIC {
            let mut found = [0; 4];
            found.copy_from_slice(&buf[..4]);
            return Err(FrameError::BadMagic { found });
        }
        if buf.len() >= 6 {
            let version = u16::from_le_bytes([buf[4], buf[5]]);
            if version != PROTOCOL_VERSION {
                return Err(FrameError::UnsupportedVersion {
                    found: version,
                    supported: PROTOCOL_VERSION,
                });
            }
        }
        if buf.len() >= 7 {
            let code = buf[6];
            h.kind = Some(MessageKind::from_code(code).ok_or(FrameError::UnknownKind { code })?);
        }
        if buf.len() >= 8 && buf[7] != 0 {
            return Err(FrameError::ReservedBits {
                flags: buf[7],
                reserved: 0,
            });
        }
        if buf.len() >= 12 {
            let len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
            if len > self.max_payload {
                return Err(FrameError::Oversized {
                    len,
                    max: self.max_payload,
                });
            }
            h.len = Some(len);
        }
        if buf.len() >= HEADER_LEN {
            let reserved = u32::from_le_bytes([buf[12], buf[13], buf[14], buf[15]]);
            if reserved != 0 {
                return Err(FrameError::ReservedBits { flags: 0, reserved });
            }
        }
        Ok(h)
    }

    fn decode_inner(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let header = self.parse_header(buf)?;
        let (Some(kind), Some(len), true) = (header.kind, header.len, buf.len() >= HEADER_LEN)
        else {
            buf.reserve(HEADER_LEN);
            return Ok(None);
        };
        let len = len as usize;
        let total = frame_len(len);
        if buf.len() < total {
            buf.reserve((total - buf.len()).min(MAX_RESERVE));
            return Ok(None);
        }
        let mut frame = buf.split_to(total);
        frame.advance(HEADER_LEN);
        frame.truncate(len);
        let mut payload = frame.freeze();
        if !(payload.as_ptr() as usize).is_multiple_of(PAYLOAD_ALIGN) {
            let mut aligned = AlignedVec::<PAYLOAD_ALIGN>::with_capacity(len);
            aligned.extend_from_slice(&payload);
            payload = Bytes::from_owner(aligned);
            self.stats.realigned += 1;
        }
        self.stats.frames += 1;
        self.stats.bytes += total as u64;
        Ok(Some(Frame { kind, payload }))
    }
}

/// rkyv's view of the tail of an output buffer: positions count from the payload's start.
struct PayloadWriter<'a> {
    buf: &'a mut BytesMut,
    start: usize,
}

impl rkyv::ser::Positional for PayloadWriter<'_> {
    fn pos(&self) -> usize {
        self.buf.len() - self.start
    }
}

impl<E> rkyv::ser::Writer<E> for PayloadWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> Result<(), E> {
        self.buf.extend_from_slice(bytes);
        Ok(())
    }
}

/// Appends `msg` as one frame to `out`; returns the frame's length. On error `out` is left as
/// it was.
pub fn encode(msg: &Message, out: &mut BytesMut) -> Result<usize, EncodeError> {
    encode_root(msg.kind(), out, |w| wire::serialize_into(msg, w))
}

/// Appends `batch` as one `KvEvents` frame to `out`, as [`encode`] would
/// `Message::KvEvents(batch.clone())`, without the clone.
pub fn encode_kv_events(batch: &KvEventBatch, out: &mut BytesMut) -> Result<usize, EncodeError> {
    encode_root(MessageKind::KvEvents, out, |w| {
        rkyv::api::high::to_bytes_in(batch, w)
    })
}

/// Appends a frame of `kind` whose payload `serialize` writes.
fn encode_root(
    kind: MessageKind,
    out: &mut BytesMut,
    serialize: impl FnOnce(PayloadWriter<'_>) -> Result<PayloadWriter<'_>, rkyv::rancor::Error>,
) -> Result<usize, EncodeError> {
    let start = out.len();
    out.reserve(HEADER_LEN + 64);
    out.put_slice(&MAGIC);
    out.put_u16_le(PROTOCOL_VERSION);
    out.put_u8(kind.code());
    out.put_u8(0);
    out.put_u32_le(0); // payload length, patched below
    out.put_u32_le(0);
    let payload_start = out.len();
    let written = serialize(PayloadWriter {
        buf: out,
        start: payload_start,
    });
    if let Err(e) = written {
        out.truncate(start);
        return Err(EncodeError::Serialize {
            reason: e.to_string(),
        });
    }
    let len = out.len() - payload_start;
    let Some(len32) = u32::try_from(len).ok().filter(|l| *l <= MAX_PAYLOAD) else {
        out.truncate(start);
        return Err(EncodeError::Oversized {
            len,
            max: MAX_PAYLOAD,
        });
    };
    out[start + 8..start + 12].copy_from_slice(&len32.to_le_bytes());
    out.put_bytes(0, len.next_multiple_of(PAYLOAD_ALIGN) - len);
    Ok(out.len() - start)
}

/// `msg` as one frame in a buffer of its own.
pub fn encode_to_bytes(msg: &Message) -> Result<Bytes, EncodeError> {
    let mut out = BytesMut::new();
    encode(msg, &mut out)?;
    Ok(out.freeze())
}
