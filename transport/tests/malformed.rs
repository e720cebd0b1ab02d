//! Every way a frame can be wrong gives its own typed error, is counted, and never panics.

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

mod common;

use bytes::{BufMut, BytesMut};
use kvroute_transport::frame::{
    encode, frame_len, FrameDecoder, FrameError, HEADER_LEN, MAGIC, MAX_PAYLOAD,
};
use kvroute_transport::wire::{Message, MessageKind, PROTOCOL_VERSION};
use proptest::prelude::*;

fn encoded(msg: &Message) -> BytesMut {
    let mut buf = BytesMut::new();
    encode(msg, &mut buf).expect("encodes");
    buf
}

fn header(version: u16, kind: u8, flags: u8, len: u32, reserved: u32) -> BytesMut {
    let mut b = BytesMut::new();
    b.put_slice(&MAGIC);
    b.put_u16_le(version);
    b.put_u8(kind);
    b.put_u8(flags);
    b.put_u32_le(len);
    b.put_u32_le(reserved);
    b
}

#[test]
fn truncated_at_every_byte_boundary() {
    for msg in common::samples() {
        let full = encoded(&msg);
        for cut in 0..full.len() {
            let mut dec = FrameDecoder::default();
            let mut buf = BytesMut::from(&full[..cut]);
            assert_eq!(
                dec.decode(&mut buf),
                Ok(None),
                "{:?} cut at {cut}",
                msg.kind()
            );
            assert_eq!(buf.len(), cut, "a partial frame stays in the buffer");
            let end = dec.decode_eof(&mut buf);
            if cut == 0 {
                assert_eq!(end, Ok(None));
                continue;
            }
            let need = if cut < 12 { HEADER_LEN } else { full.len() };
            assert_eq!(end, Err(FrameError::Truncated { have: cut, need }));
            assert_eq!(dec.stats().truncated, 1);
            assert_eq!(dec.stats().frames, 0);
        }
        // And the whole frame decodes.
        let mut dec = FrameDecoder::default();
        let mut buf = full.clone();
        let frame = dec
            .decode_eof(&mut buf)
            .expect("decodes")
            .expect("complete");
        assert!(dec.validate(&frame).is_ok());
    }
}

#[test]
fn wrong_magic_is_seen_from_the_fourth_byte() {
    let full = encoded(&common::samples()[0]);
    for i in 0..4 {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut bad = full.clone();
            bad[i] ^= flip;
            for cut in [4, 7, HEADER_LEN, bad.len()] {
                let mut dec = FrameDecoder::default();
                let mut buf = BytesMut::from(&bad[..cut]);
                let found = [bad[0], bad[1], bad[2], bad[3]];
                assert_eq!(dec.decode(&mut buf), Err(FrameError::BadMagic { found }));
                assert_eq!(buf.len(), cut, "nothing consumed on error");
                assert_eq!(dec.stats().bad_magic, 1);
            }
        }
    }
    // Fewer than four bytes cannot be judged yet.
    let mut dec = FrameDecoder::default();
    assert_eq!(dec.decode(&mut BytesMut::from(&b"KVX"[..])), Ok(None));
    // Plain text is not a frame.
    let mut text = BytesMut::from(&b"GET / HTTP/1.1\r\n\r\n"[..]);
    assert!(matches!(
        dec.decode(&mut text),
        Err(FrameError::BadMagic { .. })
    ));
}

#[test]
fn wrong_version() {
    for version in [0u16, PROTOCOL_VERSION + 1, 0x0100, u16::MAX] {
        let mut dec = FrameDecoder::default();
        let mut buf = header(version, MessageKind::Cancel.code(), 0, 8, 0);
        assert_eq!(
            dec.decode(&mut buf),
            Err(FrameError::UnsupportedVersion {
                found: version,
                supported: PROTOCOL_VERSION
            })
        );
        assert_eq!(dec.stats().unsupported_version, 1);
    }
}

#[test]
fn unknown_kind() {
    let known: Vec<u8> = MessageKind::ALL.iter().map(|k| k.code()).collect();
    for code in (0..=255u8).filter(|c| !known.contains(c)) {
        let mut dec = FrameDecoder::default();
        let mut buf = header(PROTOCOL_VERSION, code, 0, 8, 0);
        assert_eq!(dec.decode(&mut buf), Err(FrameError::UnknownKind { code }));
        assert_eq!(dec.stats().unknown_kind, 1);
    }
}

#[test]
fn reserved_fields_must_be_zero() {
    let mut dec = FrameDecoder::default();
    let mut buf = header(PROTOCOL_VERSION, MessageKind::Cancel.code(), 4, 8, 0);
    assert_eq!(
        dec.decode(&mut buf),
        Err(FrameError::ReservedBits {
            flags: 4,
            reserved: 0
        })
    );
    let mut buf = header(PROTOCOL_VERSION, MessageKind::Cancel.code(), 0, 8, 1 << 31);
    assert_eq!(
        dec.decode(&mut buf),
        Err(FrameError::ReservedBits {
            flags: 0,
            reserved: 1 << 31
        })
    );
    assert_eq!(dec.stats().reserved_bits, 2);
}

#[test]
fn oversized_is_rejected_from_the_header_alone() {
    // The protocol's limit.
    let mut dec = FrameDecoder::default();
    let mut buf = header(
        PROTOCOL_VERSION,
        MessageKind::KvEvents.code(),
        0,
        MAX_PAYLOAD + 1,
        0,
    );
    assert_eq!(
        dec.decode(&mut buf),
        Err(FrameError::Oversized {
            len: MAX_PAYLOAD + 1,
            max: MAX_PAYLOAD
        })
    );
    let mut buf = header(
        PROTOCOL_VERSION,
        MessageKind::KvEvents.code(),
        0,
        u32::MAX,
        0,
    );
    assert!(matches!(
        dec.decode(&mut buf),
        Err(FrameError::Oversized { .. })
    ));
    // A receiver's lower limit; the first 12 bytes are enough to tell.
    let msg = common::samples()
        .into_iter()
        .find(|m| m.kind() == MessageKind::Dispatch)
        .expect("sample");
    let full = encoded(&msg);
    let len = u32::from_le_bytes([full[8], full[9], full[10], full[11]]);
    let mut dec = FrameDecoder::new(len - 1);
    let mut buf = BytesMut::from(&full[..12]);
    assert_eq!(
        dec.decode(&mut buf),
        Err(FrameError::Oversized { len, max: len - 1 })
    );
    assert_eq!(dec.stats().oversized, 1);
    // At exactly the limit it passes.
    let mut dec = FrameDecoder::new(len);
    assert!(dec.decode(&mut full.clone()).expect("ok").is_some());
}

#[test]
fn empty_and_garbage_payloads_fail_validation() {
    for kind in MessageKind::ALL {
        let mut dec = FrameDecoder::default();
        // Empty.
        let mut buf = header(PROTOCOL_VERSION, kind.code(), 0, 0, 0);
        let frame = dec.decode(&mut buf).expect("framed").expect("complete");
        assert!(matches!(
            dec.validate(&frame),
            Err(FrameError::InvalidPayload { kind: k, len: 0, .. }) if k == kind
        ));
        // All ones: enum tags out of range, relative pointers out of bounds, lengths huge.
        let mut buf = header(PROTOCOL_VERSION, kind.code(), 0, 64, 0);
        buf.put_bytes(0xff, 64);
        let frame = dec.decode(&mut buf).expect("framed").expect("complete");
        if kind == MessageKind::Cancel {
            // A Cancel is one u64: any 8 bytes are a request id.
            assert!(dec.validate(&frame).is_ok());
        } else {
            assert!(matches!(
                dec.validate(&frame),
                Err(FrameError::InvalidPayload { len: 64, .. })
            ));
        }
    }
}

#[test]
fn payload_of_another_kind_is_invalid() {
    // A KV batch whose header claims a Hello: the types differ, so bytecheck must object (or,
    // if the bytes happen to fit, the answer is a Hello, never a crash).
    let msg = common::samples()
        .into_iter()
        .find(|m| m.kind() == MessageKind::KvEvents)
        .expect("sample");
    let mut buf = encoded(&msg);
    buf[6] = MessageKind::Dispatch.code();
    let mut dec = FrameDecoder::default();
    let frame = dec.decode(&mut buf).expect("framed").expect("complete");
    assert!(matches!(
        dec.validate(&frame),
        Err(FrameError::InvalidPayload {
            kind: MessageKind::Dispatch,
            ..
        })
    ));
    assert_eq!(dec.stats().invalid_payload, 1);
}

#[test]
fn misaligned_receive_buffer_is_realigned() {
    let msg = common::samples()
        .into_iter()
        .find(|m| m.kind() == MessageKind::KvEvents)
        .expect("sample");
    let full = encoded(&msg);
    for shift in 1..16 {
        let mut buf = BytesMut::with_capacity(full.len() + shift);
        buf.put_bytes(0, shift);
        buf.extend_from_slice(&full);
        let _ = buf.split_to(shift);
        let mut dec = FrameDecoder::default();
        let frame = dec.decode(&mut buf).expect("framed").expect("complete");
        let back = dec
            .validate(&frame)
            .expect("valid")
            .deserialize()
            .expect("ok");
        assert_eq!(back, msg);
        assert_eq!(dec.stats().realigned, 1, "shift {shift}");
    }
    // An aligned one is not copied.
    let mut dec = FrameDecoder::default();
    let mut buf = BytesMut::with_capacity(full.len());
    buf.extend_from_slice(&full);
    let aligned = (buf.as_ptr() as usize).is_multiple_of(16);
    let frame = dec.decode(&mut buf).expect("framed").expect("complete");
    assert_eq!(dec.stats().realigned, u64::from(!aligned));
    assert!(dec.validate(&frame).is_ok());
}

#[test]
fn stats_sum_rejections() {
    let mut dec = FrameDecoder::default();
    let _ = dec.decode(&mut BytesMut::from(&b"nope"[..]));
    let _ = dec.decode(&mut header(9, 1, 0, 0, 0));
    let _ = dec.decode_eof(&mut BytesMut::from(&MAGIC[..]));
    assert_eq!(dec.stats().rejected(), 3);
    assert_eq!(dec.stats().truncated, 1);
}

proptest! {
    /// Arbitrary bytes: an error or frames, never a panic; a frame's payload either validates
    /// and deserializes or is rejected.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut dec = FrameDecoder::new(4096);
        let mut buf = BytesMut::from(&bytes[..]);
        while let Ok(Some(frame)) = dec.decode_eof(&mut buf) {
            if let Ok(view) = dec.validate(&frame) {
                let _ = view.deserialize();
            }
        }
    }

    /// A valid header with a random payload.
    #[test]
    fn garbage_payload_never_panics(
        kind in proptest::sample::select(MessageKind::ALL.to_vec()),
        payload in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut buf = header(PROTOCOL_VERSION, kind.code(), 0, payload.len() as u32, 0);
        buf.extend_from_slice(&payload);
        buf.put_bytes(0, frame_len(payload.len()) - HEADER_LEN - payload.len());
        let mut dec = FrameDecoder::default();
        let frame = dec.decode_eof(&mut buf).expect("framed").expect("complete");
        match dec.validate(&frame) {
            Ok(view) => { let _ = view.deserialize(); }
            Err(e) => prop_assert!(
                matches!(e, FrameError::InvalidPayload { kind: k, .. } if k == kind),
                "{}", e
            ),
        }
    }

    /// A valid frame with one byte of its payload changed: validation decides, no panic.
    #[test]
    fn corrupted_valid_frame_never_panics(
        msg in common::message(),
        at in any::<prop::sample::Index>(),
        xor in 1u8..,
    ) {
        let mut buf = encoded(&msg);
        let payload_len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]) as usize;
        prop_assume!(payload_len > 0);
        let i = HEADER_LEN + at.index(payload_len);
        buf[i] ^= xor;
        let mut dec = FrameDecoder::default();
        let frame = dec.decode_eof(&mut buf).expect("framed").expect("complete");
        if let Ok(view) = dec.validate(&frame) {
            let _ = view.deserialize();
        }
    }
}
