//! Every message survives encode → decode → validate → deserialize unchanged, alone and in a
//! stream cut into arbitrary chunks.

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

mod common;

use bytes::BytesMut;
use kvroute_transport::frame::{encode, encode_kv_events, frame_len, FrameDecoder, PAYLOAD_ALIGN};
use kvroute_transport::wire::Message;
use proptest::prelude::*;

/// Encodes `msg`, decodes it back and checks everything the round trip should keep.
fn round_trip(msg: Message) -> Result<(), TestCaseError> {
    let mut buf = BytesMut::new();
    let n = encode(&msg, &mut buf).expect("encodes");
    prop_assert_eq!(n, buf.len());
    prop_assert_eq!(n % PAYLOAD_ALIGN, 0);
    let wire = buf.clone().freeze();

    let mut dec = FrameDecoder::default();
    let frame = dec.decode(&mut buf).expect("decodes").expect("complete");
    prop_assert!(buf.is_empty());
    prop_assert_eq!(frame.kind(), msg.kind());
    prop_assert_eq!(frame_len(frame.payload().len()), n);
    let view = dec.validate(&frame).expect("validates");
    prop_assert_eq!(view.kind(), msg.kind());
    let back = view.deserialize().expect("deserializes");
    prop_assert_eq!(&back, &msg);

    // Encoding is deterministic: the decoded message encodes to the same bytes.
    let mut again = BytesMut::new();
    encode(&back, &mut again).expect("encodes");
    prop_assert_eq!(&again[..], &wire[..]);
    prop_assert_eq!(dec.stats().frames, 1);
    prop_assert_eq!(dec.stats().validated, 1);
    prop_assert_eq!(dec.stats().rejected(), 0);
    Ok(())
}

proptest! {
    #[test]
    fn hello(m in common::hello()) { round_trip(Message::Hello(m))?; }

    #[test]
    fn heartbeat(m in common::heartbeat()) { round_trip(Message::Heartbeat(m))?; }

    #[test]
    fn kv_events(m in common::kv_events()) { round_trip(Message::KvEvents(m))?; }

    #[test]
    fn kv_events_encode_without_a_message(m in common::kv_events()) {
        let mut direct = BytesMut::new();
        let n = encode_kv_events(&m, &mut direct).expect("encodes");
        let mut via_message = BytesMut::new();
        encode(&Message::KvEvents(m), &mut via_message).expect("encodes");
        prop_assert_eq!(n, direct.len());
        prop_assert_eq!(&direct[..], &via_message[..]);
    }

    #[test]
    fn dispatch(m in common::dispatch()) { round_trip(Message::Dispatch(m))?; }

    #[test]
    fn response(m in common::response()) { round_trip(Message::Response(m))?; }

    #[test]
    fn cancel(request_id in any::<u64>()) {
        round_trip(Message::Cancel(kvroute_transport::wire::Cancel { request_id }))?;
    }

    #[test]
    fn recovery_request(m in common::recovery_request()) { round_trip(Message::RecoveryRequest(m))?; }

    #[test]
    fn recovery_reply(m in common::recovery_reply()) { round_trip(Message::RecoveryReply(m))?; }

    #[test]
    fn error(m in common::error_message()) { round_trip(Message::Error(m))?; }

    /// A stream of messages fed to the decoder in chunks of any size comes out whole, in order.
    #[test]
    fn chunked_stream(
        msgs in proptest::collection::vec(common::message(), 1..8),
        chunks in proptest::collection::vec(1usize..200, 1..64),
    ) {
        let mut wire = BytesMut::new();
        for m in &msgs {
            encode(m, &mut wire).expect("encodes");
        }
        let mut dec = FrameDecoder::default();
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        let mut sizes = chunks.iter().cycle();
        while !wire.is_empty() {
            let n = (*sizes.next().expect("cycle")).min(wire.len());
            buf.extend_from_slice(&wire.split_to(n));
            while let Some(frame) = dec.decode(&mut buf).expect("decodes") {
                got.push(dec.validate(&frame).expect("validates").deserialize().expect("deserializes"));
            }
        }
        prop_assert!(dec.decode_eof(&mut buf).expect("clean end").is_none());
        prop_assert_eq!(got, msgs);
    }
}

/// Floats travel bit for bit, NaN included.
#[test]
fn nan_temperature_keeps_its_bits() {
    let mut d = kvroute_transport::wire::Dispatch {
        request_id: 1,
        tokens: vec![1, 2, 3],
        sampling: kvroute_transport::wire::Sampling {
            max_tokens: 16,
            min_tokens: 0,
            temperature: f32::from_bits(0x7fc0_1234),
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: vec![],
            stop_strings: vec![],
            ignore_eos: false,
        },
        hints: kvroute_transport::wire::DispatchHints {
            dp_rank: 0,
            overlap_blocks: 0,
            lora_name: None,
            priority: 0,
            expected_output_tokens: None,
        },
        bootstrap: None,
    };
    let mut buf = BytesMut::new();
    encode(&Message::Dispatch(d.clone()), &mut buf).expect("encodes");
    let mut dec = FrameDecoder::default();
    let frame = dec.decode(&mut buf).expect("decodes").expect("complete");
    let Message::Dispatch(back) = dec
        .validate(&frame)
        .expect("validates")
        .deserialize()
        .expect("ok")
    else {
        panic!("wrong kind");
    };
    assert_eq!(back.sampling.temperature.to_bits(), 0x7fc0_1234);
    d.sampling.temperature = 0.0;
    let mut b2 = back.clone();
    b2.sampling.temperature = 0.0;
    assert_eq!(b2, d);
}

/// A worker's configuration survives Hello both ways.
#[test]
fn hello_carries_a_worker_config() {
    let mut config = kvroute_core::WorkerConfig::simple(42, 1000, 16);
    config.dp_start = 2;
    config.dp_size = 4;
    config.role = kvroute_core::WorkerRole::Prefill;
    config.labels = vec![("zone".into(), "eu-west-1a".into())];
    let hello = kvroute_transport::wire::Hello::from(&config);
    assert_eq!(hello.protocol_version, kvroute_transport::PROTOCOL_VERSION);
    assert_eq!(kvroute_core::WorkerConfig::from(&hello), config);
}
