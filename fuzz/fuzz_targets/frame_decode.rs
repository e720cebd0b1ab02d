//! Arbitrary bytes as a received stream: the frame decoder, the payload validator and the
//! archived-event applier must reject or accept them, never panic.
//!
//! The first bytes choose how the stream arrives (the receiver's payload limit, the chunk size
//! it is read in, and an offset that misaligns the receive buffer); the rest is the stream.
//! Checked:
//!
//! - nothing panics, and every rejection is counted once in `DecodeStats`;
//! - reading the stream in chunks yields the same frames, and the same error, as reading it
//!   whole;
//! - a payload that validates deserializes, and the message re-encodes to a frame that decodes
//!   to the same bytes again (the encoder's output is canonical even when the input was not);
//! - KV event batches and recovery replies apply to a fresh index; every event is either
//!   applied or rejected.

#![no_main]
#![deny(unsafe_code)]

use bytes::{Buf, BytesMut};
use kvroute_core::{IndexConfig, PrefixIndex};
use kvroute_transport::frame::{encode, Frame, FrameDecoder, FrameError};
use kvroute_transport::{BatchApplier, MessageRef};
use libfuzzer_sys::fuzz_target;

/// Decodes `stream` read in chunks of `chunk` bytes (0: all at once) into a buffer that
/// starts `shift` bytes into its allocation.
fn decode_all(
    stream: &[u8],
    chunk: usize,
    shift: usize,
    max_payload: u32,
) -> (Vec<Frame>, Option<FrameError>, FrameDecoder) {
    let mut dec = FrameDecoder::new(max_payload);
    let mut buf = BytesMut::with_capacity(stream.len() + shift);
    buf.extend_from_slice(&vec![0; shift]);
    buf.advance(shift);
    let mut frames = Vec::new();
    let step = if chunk == 0 {
        stream.len().max(1)
    } else {
        chunk
    };
    for piece in stream.chunks(step) {
        buf.extend_from_slice(piece);
        loop {
            match dec.decode(&mut buf) {
                Ok(Some(f)) => frames.push(f),
                Ok(None) => break,
                Err(e) => return (frames, Some(e), dec),
            }
        }
    }
    match dec.decode_eof(&mut buf) {
        Ok(Some(_)) => unreachable!("every complete frame was taken in the loop"),
        Ok(None) => (frames, None, dec),
        Err(e) => (frames, Some(e), dec),
    }
}

fuzz_target!(|data: &[u8]| {
    let [limit, chunk, shift, stream @ ..] = data else {
        return;
    };
    let max_payload = 64u32 << (*limit % 10); // 64 B .. 32 KiB
    let (whole, whole_err, _) = decode_all(stream, 0, 0, max_payload);
    let (frames, err, mut dec) =
        decode_all(stream, *chunk as usize, *shift as usize % 16, max_payload);
    assert_eq!(frames, whole, "chunking changed the frames");
    assert_eq!(err, whole_err, "chunking changed the error");
    assert_eq!(dec.stats().frames as usize, frames.len());
    assert_eq!(dec.stats().rejected(), u64::from(err.is_some()));

    let mut index = PrefixIndex::new(IndexConfig {
        shards: 2,
        ..IndexConfig::default()
    });
    let mut applier = BatchApplier::new();
    let mut invalid = 0;
    for frame in &frames {
        let view = match dec.validate(frame) {
            Ok(v) => v,
            Err(FrameError::InvalidPayload { kind, .. }) => {
                assert_eq!(kind, frame.kind());
                invalid += 1;
                continue;
            }
            Err(e) => panic!("validation gave a framing error: {e}"),
        };
        assert_eq!(view.kind(), frame.kind());
        let owned = view
            .deserialize()
            .expect("a validated payload deserializes");
        let mut first = BytesMut::new();
        encode(&owned, &mut first).expect("re-encodes");
        let mut again = first.clone();
        let mut dec2 = FrameDecoder::default();
        let f2 = dec2.decode(&mut again).expect("framed").expect("complete");
        let back = dec2
            .validate(&f2)
            .expect("valid")
            .deserialize()
            .expect("ok");
        let mut second = BytesMut::new();
        encode(&back, &mut second).expect("re-encodes");
        assert_eq!(first, second, "re-encoding is not stable");

        let out = match view {
            MessageRef::KvEvents(b) => applier.apply_batch(&mut index, b),
            MessageRef::RecoveryReply(r) => applier.apply_recovery(&mut index, r),
            _ => continue,
        };
        assert_eq!(out.applied + out.rejected, out.events);
        assert_eq!(out.first_error.is_some(), out.rejected > 0);
    }
    assert_eq!(dec.stats().invalid_payload, invalid);
});
