//! Arbitrary bytes as an engine's KV-event message: the frame layouts, the msgpack payload
//! decoder and the conversion to core events must accept or reject them, never panic.
//!
//! The first byte chooses how the rest is split into frames (1 to 4 of them, at positions taken
//! from the next bytes); the whole of the rest is also decoded as one payload. Checked:
//!
//! - nothing panics;
//! - a rejected payload appends no event and consumes no event id; an accepted one appends
//!   exactly the events it reports produced, numbered consecutively, and counts every engine
//!   event once, produced or skipped;
//! - the first 64 prefixes of an accepted payload are rejected (a payload is exactly one
//!   msgpack value).

#![no_main]
#![deny(unsafe_code)]

use kvroute_core::{EventId, WorkerId};
use kvroute_transport::engine::{
    decode_batch, parse_live, parse_replay, DecoderConfig, EngineDecoder,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    frames(split, rest);
    payload(rest);
});

/// Splits `bytes` into 1 to 4 frames and parses them in both layouts.
fn frames(split: u8, bytes: &[u8]) {
    let count = usize::from(split % 4) + 1;
    let mut cuts: Vec<usize> = bytes
        .iter()
        .take(count - 1)
        .map(|&b| usize::from(b) % (bytes.len() + 1))
        .collect();
    cuts.sort_unstable();
    let mut frames = Vec::with_capacity(count);
    let mut start = 0;
    for cut in cuts {
        frames.push(&bytes[start..cut.max(start)]);
        start = cut.max(start);
    }
    frames.push(&bytes[start..]);
    if let Ok(message) = parse_live(&frames) {
        assert_eq!(message.seq.to_be_bytes().as_slice(), frames[1]);
        payload(message.payload);
    }
    let _ = parse_replay(&frames);
}

fn payload(bytes: &[u8]) {
    for block_size in [None, Some(4)] {
        let mut decoder = EngineDecoder::new(DecoderConfig {
            worker: WorkerId(1),
            block_size,
            ..DecoderConfig::default()
        });
        let mut out = Vec::new();
        let mut next_id = EventId(100);
        match decoder.decode(bytes, &mut next_id, &mut out) {
            Err(_) => {
                assert!(out.is_empty());
                assert_eq!(next_id, EventId(100));
                assert_eq!(decoder.counts().bad_payloads, 1);
            }
            Ok(outcome) => {
                assert_eq!(out.len(), outcome.produced);
                assert_eq!(next_id.0, 100 + outcome.produced as u64);
                for (i, event) in out.iter().enumerate() {
                    assert_eq!(event.header.event_id, EventId(100 + i as u64));
                }
                let batch = decode_batch(bytes).unwrap();
                assert_eq!(batch.events.len(), outcome.produced + outcome.skipped);
                let counts = decoder.counts();
                assert_eq!(counts.events as usize, outcome.produced);
                assert_eq!(counts.skipped() as usize, outcome.skipped);
                for len in 0..bytes.len().min(64) {
                    assert!(decode_batch(&bytes[..len]).is_err());
                }
            }
        }
    }
}
