//! Arbitrary messages round-trip through the frame encoder and decoder.
//!
//! Checked: a message encodes to one frame of its kind; the frame, read in chunks of any size,
//! decodes, validates and deserializes to a message that encodes to the very same bytes
//! (byte equality also covers floats, NaN included); and equals the original when it holds no
//! NaN.

#![no_main]
#![deny(unsafe_code)]

use arbitrary::{Arbitrary, Unstructured};
use bytes::BytesMut;
use kvroute_transport::frame::{encode, frame_len, FrameDecoder};
use kvroute_transport::wire::Message;
use libfuzzer_sys::fuzz_target;

fn has_nan(m: &Message) -> bool {
    match m {
        Message::Dispatch(d) => d.sampling.temperature.is_nan() || d.sampling.top_p.is_nan(),
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(chunk) = u.int_in_range(1usize..=64) else {
        return;
    };
    let Ok(msg) = Message::arbitrary(&mut u) else {
        return;
    };
    let mut wire = BytesMut::new();
    let n = encode(&msg, &mut wire).expect("encodes");
    assert_eq!(n, wire.len());
    let bytes = wire.clone();

    let mut dec = FrameDecoder::default();
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    while !wire.is_empty() {
        buf.extend_from_slice(&wire.split_to(chunk.min(wire.len())));
        if let Some(f) = dec.decode(&mut buf).expect("decodes") {
            frames.push(f);
        }
    }
    assert_eq!(frames.len(), 1);
    assert!(buf.is_empty());
    let frame = &frames[0];
    assert_eq!(frame.kind(), msg.kind());
    assert_eq!(frame_len(frame.payload().len()), n);
    let back = dec
        .validate(frame)
        .expect("validates")
        .deserialize()
        .expect("deserializes");
    let mut again = BytesMut::new();
    encode(&back, &mut again).expect("encodes");
    assert_eq!(again, bytes);
    if !has_nan(&msg) {
        assert_eq!(back, msg);
    }
});
