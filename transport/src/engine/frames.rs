//! The ZeroMQ multipart layouts of the engines' publishers (vLLM's and SGLang's
//! `ZmqEventPublisher`, which share them):
//!
//! ```text
//!  live (SUB)          [topic, seq (u64 big-endian), payload]
//!  replay (DEALER)     [empty, topic, seq, payload]        vLLM 0.33 and later
//!                      [empty, seq, payload]               older engines: no topic frame
//!  end of the replay   [empty, empty, 0xFF x 8, empty]     or [empty, 0xFF x 8, empty]
//! ```
//!
//! A replay request is `[empty, start seq (u64 big-endian)]` on the DEALER; the publisher answers
//! with every batch it still holds from that seq on, then the end marker (seq `-1` as a signed
//! big-endian 8 bytes, hence all `0xFF`). The frames are borrowed: nothing is copied.

use super::error::FrameLayoutError;

/// The sequence frame that ends a replay.
pub const END_SEQ: [u8; 8] = [0xFF; 8];

/// One batch as a message carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineMessage<'a> {
    /// The publisher's topic (empty when it has none, or the replay layout carries none).
    pub topic: &'a [u8],
    /// The batch's sequence number (per publisher process, from 0).
    pub seq: u64,
    /// The msgpack batch.
    pub payload: &'a [u8],
}

/// One message of a replay socket's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A batch the publisher still held.
    Batch(EngineMessage<'a>),
    /// The end marker: the publisher has sent everything it holds.
    End,
}

/// Reads a live message `[topic, seq, payload]`.
pub fn parse_live<F: AsRef<[u8]>>(frames: &[F]) -> Result<EngineMessage<'_>, FrameLayoutError> {
    match frames {
        [topic, seq, payload] => Ok(EngineMessage {
            topic: topic.as_ref(),
            seq: seq_of(seq.as_ref())?,
            payload: payload.as_ref(),
        }),
        _ => Err(FrameLayoutError::WrongFrameCount {
            layout: "live",
            expected: "3",
            found: frames.len(),
        }),
    }
}

/// Reads a message of a replay answer, with or without its topic frame, or the end marker.
/// A sequence frame of all `0xFF` is the end marker whatever else the message holds.
pub fn parse_replay<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayReply<'_>, FrameLayoutError> {
    let (empty, topic, seq, payload): (&[u8], &[u8], &[u8], &[u8]) = match frames {
        [empty, topic, seq, payload] => (
            empty.as_ref(),
            topic.as_ref(),
            seq.as_ref(),
            payload.as_ref(),
        ),
        [empty, seq, payload] => (empty.as_ref(), &[], seq.as_ref(), payload.as_ref()),
        _ => {
            return Err(FrameLayoutError::WrongFrameCount {
                layout: "replay",
                expected: "3 or 4",
                found: frames.len(),
            })
        }
    };
    if !empty.is_empty() {
        return Err(FrameLayoutError::MissingDelimiter { len: empty.len() });
    }
    if seq == END_SEQ {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch(EngineMessage {
        topic,
        seq: seq_of(seq)?,
        payload,
    }))
}

/// The second frame of a replay request `[empty, start]`, asking for every batch the
/// publisher still holds from seq `start` on.
pub fn replay_request(start: u64) -> [u8; 8] {
    start.to_be_bytes()
}

fn seq_of(frame: &[u8]) -> Result<u64, FrameLayoutError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| FrameLayoutError::SeqLength { len: frame.len() })
}
