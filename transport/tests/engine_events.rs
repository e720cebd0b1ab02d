//! Engines' KV-event messages decode to exactly the events they were made from: golden bytes
//! captured from vLLM 0.33.0's and SGLang 0.5.23's own publishers (`../shared/engine-wire/`),
//! and hand-built msgpack for every other encoding and every way a message can be wrong.

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::path::PathBuf;

use kvroute_core::{
    BlockHash, BlockHasher, DpRank, EventHeader, EventId, HashSeed, KvEvent, KvEventData,
    StorageTier, StoredBlock, WorkerId, WorkerRank,
};
use kvroute_transport::engine::{
    decode_batch, parse_live, parse_replay, DecodeCounts, DecoderConfig, EngineDecoder,
    EngineEvent, EventError, FrameLayoutError, PayloadError, ReplayReply, END_SEQ,
};
use serde_json::Value as Json;

// ---------------------------------------------------------------------------------------------
// Golden bytes

fn golden(name: &str) -> Json {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/engine-wire")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "golden file {} is missing ({e}): these tests need the shared engine-wire captures \
             beside the checkout (../shared/engine-wire/)",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

fn hex(s: &Json) -> Vec<u8> {
    let s = s.as_str().expect("a hex string");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

const WORKER: u64 = 7;

fn decoder() -> EngineDecoder {
    EngineDecoder::new(DecoderConfig {
        worker: WorkerId(WORKER),
        block_size: Some(4),
        ..DecoderConfig::default()
    })
}

fn local(tokens: &[u32]) -> kvroute_core::LocalHash {
    BlockHasher::new(4).local_hash(tokens)
}

fn event(id: u64, tier: StorageTier, data: KvEventData) -> KvEvent {
    KvEvent {
        header: EventHeader {
            source: WorkerRank::new(WORKER, 0),
            event_id: EventId(id),
            tier,
        },
        data,
    }
}

fn stored(parent: Option<u64>, blocks: &[(u64, &[u32])]) -> KvEventData {
    KvEventData::Stored {
        parent: parent.map(BlockHash),
        blocks: blocks
            .iter()
            .map(|&(hash, tokens)| StoredBlock {
                block_hash: BlockHash(hash),
                local_hash: local(tokens),
            })
            .collect(),
    }
}

fn removed(hashes: &[u64]) -> KvEventData {
    KvEventData::Removed {
        blocks: hashes.iter().copied().map(BlockHash).collect(),
    }
}

/// What vLLM 0.33.0 published, per the capture's `batches_as_sent`, numbered from event id 0.
fn vllm_published() -> Vec<Vec<KvEvent>> {
    let device = StorageTier::Device;
    vec![
        vec![event(
            0,
            device,
            stored(
                None,
                &[
                    (0x1111_1111_1111_1111, &[0, 1, 2, 3]),
                    (0xF222_2222_2222_2222, &[4, 5, 6, 7]),
                ],
            ),
        )],
        vec![
            event(
                1,
                device,
                stored(
                    Some(0xF222_2222_2222_2222),
                    &[(0x3333_3333_3333_3333, &[8, 9, 10, 11])],
                ),
            ),
            event(2, device, removed(&[0x1111_1111_1111_1111])),
        ],
        vec![event(3, device, KvEventData::Cleared)],
    ]
}

fn frames_of(message: &Json, keys: &[&str]) -> Vec<Vec<u8>> {
    keys.iter().map(|k| hex(&message[*k])).collect()
}

#[test]
fn vllm_live_frames_decode_to_the_published_events() {
    let capture = golden("vllm-0.33.0.json");
    let live = capture["live_frames"].as_array().unwrap();
    assert_eq!(live.len(), 3);
    let mut decoder = decoder();
    let mut next_id = EventId(0);
    for (i, (message, expected)) in live.iter().zip(vllm_published()).enumerate() {
        let frames = frames_of(message, &["topic", "seq", "payload"]);
        let parsed = parse_live(&frames).unwrap();
        assert_eq!(parsed.topic, b"kv@127.0.0.1:8000@demo-model");
        assert_eq!(parsed.seq, i as u64);
        let mut out = Vec::new();
        let outcome = decoder
            .decode(parsed.payload, &mut next_id, &mut out)
            .unwrap();
        assert_eq!(out, expected, "batch {i}");
        assert_eq!(outcome.skipped, 0);
        assert_eq!(outcome.source, WorkerRank::new(WORKER, 0));
    }
    assert_eq!(next_id, EventId(4));
    let counts = decoder.counts();
    assert_eq!(
        counts,
        DecodeCounts {
            batches: 3,
            events: 4,
            stored_blocks: 3,
            removed_blocks: 1,
            cleared: 1,
            ..DecodeCounts::default()
        }
    );
}

#[test]
fn vllm_batches_carry_their_timestamp_rank_and_the_hash_over_2_pow_63() {
    let capture = golden("vllm-0.33.0.json");
    let payload = hex(&capture["live_frames"][0]["payload"]);
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.dp_rank, Some(0));
    assert!(batch.ts.unwrap() > 1.6e9);
    let Ok(EngineEvent::Stored(s)) = &batch.events[0] else {
        panic!("a BlockStored: {:?}", batch.events)
    };
    assert_eq!(s.block_hashes[1], BlockHash(0xF222_2222_2222_2222));
    assert_eq!(s.medium, Some("GPU"));
    assert_eq!((s.lora_name, s.group_idx, s.spec_kind), (None, None, None));
    let payload = hex(&capture["live_frames"][1]["payload"]);
    let batch = decode_batch(&payload).unwrap();
    let Ok(EngineEvent::Stored(s)) = &batch.events[0] else {
        panic!("a BlockStored: {:?}", batch.events)
    };
    assert_eq!(
        (s.group_idx, s.spec_kind),
        (Some(0), Some("full_attention"))
    );
}

#[test]
fn vllm_replay_reply_decodes_like_the_live_stream_and_ends_with_the_marker() {
    let capture = golden("vllm-0.33.0.json");
    let replies = capture["replay_frames_as_dealer_receives"]
        .as_array()
        .unwrap();
    assert_eq!(replies.len(), 3);
    let published = vllm_published();
    let mut decoder = decoder();
    let mut next_id = EventId(1);
    for (i, message) in replies.iter().enumerate() {
        let frames = frames_of(message, &["empty", "topic", "seq", "payload"]);
        match parse_replay(&frames).unwrap() {
            ReplayReply::Batch(m) => {
                assert_eq!(m.seq, 1 + i as u64);
                assert_eq!(m.topic, b"kv@127.0.0.1:8000@demo-model");
                let mut out = Vec::new();
                decoder.decode(m.payload, &mut next_id, &mut out).unwrap();
                assert_eq!(out, published[1 + i]);
            }
            ReplayReply::End => assert_eq!(i, 2, "the end marker comes last"),
        }
    }
    // The older layout without the topic frame, and its end marker.
    let old = [Vec::new(), 1_u64.to_be_bytes().to_vec(), b"x".to_vec()];
    let ReplayReply::Batch(m) = parse_replay(&old).unwrap() else {
        panic!("a batch")
    };
    assert_eq!((m.topic, m.seq, m.payload), (&b""[..], 1, &b"x"[..]));
    let old_end = [Vec::new(), END_SEQ.to_vec(), Vec::new()];
    assert_eq!(parse_replay(&old_end).unwrap(), ReplayReply::End);
}

#[test]
fn sglang_payload_with_a_negative_hash_decodes_to_the_published_events() {
    let capture = golden("sglang-0.5.23.json");
    let payload = hex(&capture["payload"]);
    let mut out = Vec::new();
    let outcome = decoder()
        .decode(&payload, &mut EventId(0), &mut out)
        .unwrap();
    // -0x0DDDDDDDDDDDDDDE as 64 bits is 0xF222222222222222: the same name as vLLM's.
    let expected = vec![
        event(
            0,
            StorageTier::Device,
            stored(
                None,
                &[
                    (0x1111_1111_1111_1111, &[0, 1, 2, 3]),
                    (0xF222_2222_2222_2222, &[4, 5, 6, 7]),
                ],
            ),
        ),
        event(1, StorageTier::Device, removed(&[5])),
    ];
    assert_eq!(out, expected);
    assert_eq!(outcome.produced, 2);
}

#[test]
fn every_prefix_of_a_golden_payload_is_an_error_and_no_byte_flip_panics() {
    let vllm = golden("vllm-0.33.0.json");
    let sglang = golden("sglang-0.5.23.json");
    let mut payloads: Vec<Vec<u8>> = vllm["live_frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| hex(&m["payload"]))
        .collect();
    payloads.push(hex(&sglang["payload"]));
    for payload in &payloads {
        for len in 0..payload.len() {
            let mut out = Vec::new();
            let mut next_id = EventId(0);
            let result = decoder().decode(&payload[..len], &mut next_id, &mut out);
            assert!(result.is_err(), "prefix of {len} bytes decoded");
            assert!(
                out.is_empty() && next_id == EventId(0),
                "a failed payload appends nothing"
            );
        }
        for at in 0..payload.len() {
            for byte in [
                0x00, 0x7f, 0x80, 0x90, 0xc0, 0xc1, 0xcf, 0xd3, 0xdd, 0xdf, 0xff,
            ] {
                let mut mutated = payload.clone();
                mutated[at] = byte;
                let _ = decoder().decode(&mutated, &mut EventId(0), &mut Vec::new());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-built msgpack

/// A msgpack value, written with rmp's encoders.
#[derive(Clone)]
enum V {
    Nil,
    U(u64),
    I(i64),
    F(f64),
    S(&'static str),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(&'static str, V)>),
}

fn enc(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => rmp::encode::write_nil(out).unwrap(),
        V::U(u) => {
            rmp::encode::write_uint(out, *u).unwrap();
        }
        V::I(i) => {
            rmp::encode::write_sint(out, *i).unwrap();
        }
        V::F(f) => rmp::encode::write_f64(out, *f).unwrap(),
        V::S(s) => rmp::encode::write_str(out, s).unwrap(),
        V::B(b) => rmp::encode::write_bin(out, b).unwrap(),
        V::A(items) => {
            rmp::encode::write_array_len(out, items.len() as u32).unwrap();
            items.iter().for_each(|item| enc(item, out));
        }
        V::M(entries) => {
            rmp::encode::write_map_len(out, entries.len() as u32).unwrap();
            for (key, value) in entries {
                rmp::encode::write_str(out, key).unwrap();
                enc(value, out);
            }
        }
    }
}

fn bytes(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    enc(v, &mut out);
    out
}

fn uints(values: &[u64]) -> V {
    V::A(values.iter().map(|&u| V::U(u)).collect())
}

fn tokens(range: std::ops::Range<u64>) -> V {
    uints(&range.collect::<Vec<_>>())
}

/// A batch `[ts, events, dp_rank]`.
fn batch(events: Vec<V>) -> Vec<u8> {
    bytes(&V::A(vec![V::F(1.5), V::A(events), V::U(0)]))
}

fn stored_map(hashes: &[u64], parent: Option<u64>, tokens: V, extra: Vec<(&'static str, V)>) -> V {
    let mut fields = vec![
        ("type", V::S("BlockStored")),
        ("block_hashes", uints(hashes)),
        ("parent_block_hash", parent.map_or(V::Nil, V::U)),
        ("token_ids", tokens),
        ("block_size", V::U(4)),
        ("lora_id", V::Nil),
        ("medium", V::S("GPU")),
    ];
    fields.extend(extra);
    V::M(fields)
}

/// Decodes a payload with a fresh decoder: its events and counts.
fn run(payload: &[u8]) -> (Vec<KvEvent>, DecodeCounts) {
    let mut decoder = decoder();
    let mut out = Vec::new();
    decoder.decode(payload, &mut EventId(0), &mut out).unwrap();
    (out, decoder.counts())
}

#[test]
fn the_positional_array_encoding_decodes_like_the_map_one() {
    let arrays = batch(vec![
        // Older vLLM / llm-d's simulator: tag, then the fields in declaration order, plus
        // positions this decoder does not know.
        V::A(vec![
            V::S("BlockStored"),
            uints(&[1, 2]),
            V::Nil,
            tokens(0..8),
            V::U(4),
            V::Nil,
            V::S("GPU"),
            V::Nil,
            V::Nil,
            V::U(0),
            V::S("full_attention"),
            V::Nil,
            V::S("a future field"),
        ]),
        // Older SGLang: no medium at all.
        V::A(vec![
            V::S("BlockStored"),
            uints(&[3]),
            V::U(2),
            tokens(8..12),
            V::U(4),
            V::Nil,
        ]),
        V::A(vec![V::S("BlockRemoved"), uints(&[1]), V::S("GPU")]),
        V::A(vec![V::S("BlockRemoved"), uints(&[2])]),
        V::A(vec![V::S("AllBlocksCleared")]),
    ]);
    let maps = batch(vec![
        stored_map(&[1, 2], None, tokens(0..8), vec![]),
        V::M(vec![
            ("type", V::S("BlockStored")),
            ("block_hashes", uints(&[3])),
            ("parent_block_hash", V::U(2)),
            ("token_ids", tokens(8..12)),
            ("block_size", V::U(4)),
        ]),
        V::M(vec![
            ("type", V::S("BlockRemoved")),
            ("block_hashes", uints(&[1])),
            ("medium", V::S("GPU")),
        ]),
        V::M(vec![
            ("block_hashes", uints(&[2])),
            ("type", V::S("BlockRemoved")),
        ]),
        V::M(vec![("type", V::S("AllBlocksCleared"))]),
    ]);
    let (from_arrays, counts) = run(&arrays);
    let (from_maps, _) = run(&maps);
    let expected = vec![
        event(
            0,
            StorageTier::Device,
            stored(None, &[(1, &[0, 1, 2, 3]), (2, &[4, 5, 6, 7])]),
        ),
        event(
            1,
            StorageTier::Device,
            stored(Some(2), &[(3, &[8, 9, 10, 11])]),
        ),
        event(2, StorageTier::Device, removed(&[1])),
        event(3, StorageTier::Device, removed(&[2])),
        event(4, StorageTier::Device, KvEventData::Cleared),
    ];
    assert_eq!(from_arrays, expected);
    assert_eq!(from_maps, expected);
    assert_eq!(counts.skipped(), 0);
}

#[test]
fn a_map_batch_names_its_rank_under_either_engines_key_and_a_missing_rank_is_the_sockets() {
    let event = V::M(vec![("type", V::S("AllBlocksCleared"))]);
    for key in ["data_parallel_rank", "attn_dp_rank", "dp_rank"] {
        let payload = bytes(&V::M(vec![
            ("ts", V::F(2.0)),
            ("unknown", V::A(vec![V::U(1), V::M(vec![("x", V::Nil)])])),
            ("events", V::A(vec![event.clone()])),
            (key, V::U(3)),
        ]));
        let batch = decode_batch(&payload).unwrap();
        assert_eq!((batch.ts, batch.dp_rank), (Some(2.0), Some(3)), "{key}");
    }
    // No rank in the batch (nil, or an array of two): the socket's rank from the config.
    let mut decoder = EngineDecoder::new(DecoderConfig {
        worker: WorkerId(WORKER),
        dp_rank: DpRank(5),
        ..DecoderConfig::default()
    });
    for payload in [
        bytes(&V::A(vec![V::F(1.0), V::A(vec![event.clone()]), V::Nil])),
        bytes(&V::A(vec![V::F(1.0), V::A(vec![event.clone()])])),
        bytes(&V::M(vec![("events", V::A(vec![event.clone()]))])),
    ] {
        let outcome = decoder
            .decode(&payload, &mut EventId(0), &mut Vec::new())
            .unwrap();
        assert_eq!(outcome.source, WorkerRank::new(WORKER, 5));
    }
}

#[test]
fn unknown_event_types_are_counted_and_the_rest_of_the_batch_applies() {
    let payload = batch(vec![
        V::M(vec![
            ("type", V::S("BlockPinned")),
            ("block_hashes", uints(&[1])),
        ]),
        V::A(vec![V::S("SomethingNew"), V::U(1)]),
        V::M(vec![
            ("type", V::S("AllBlocksCleared")),
            ("reason", V::S("reset")),
        ]),
        V::U(12),
        V::M(vec![("block_hashes", uints(&[1]))]),
    ]);
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(
        batch.events[0],
        Err(EventError::UnknownType {
            name: "BlockPinned".into()
        })
    );
    let (out, counts) = run(&payload);
    assert_eq!(
        out,
        vec![event(0, StorageTier::Device, KvEventData::Cleared)]
    );
    assert_eq!((counts.unknown_types, counts.malformed_events), (2, 2));
}

#[test]
fn media_map_to_tiers_and_an_unknown_one_skips_its_event() {
    let cases = [
        ("GPU", Some(StorageTier::Device)),
        ("cpu", Some(StorageTier::HostPinned)),
        ("CPU_PINNED", Some(StorageTier::HostPinned)),
        ("DISK", Some(StorageTier::Disk)),
        ("STORAGE", Some(StorageTier::Disk)),
        ("FS", Some(StorageTier::Disk)),
        ("EXTERNAL", Some(StorageTier::External)),
        ("OBJ", Some(StorageTier::External)),
        ("TAPE", None),
    ];
    for (medium, tier) in cases {
        let payload = batch(vec![V::M(vec![
            ("type", V::S("BlockRemoved")),
            ("block_hashes", uints(&[9])),
            ("medium", V::S(medium)),
        ])]);
        let (out, counts) = run(&payload);
        match tier {
            Some(tier) => assert_eq!(out, vec![event(0, tier, removed(&[9]))], "{medium}"),
            None => {
                assert!(out.is_empty());
                assert_eq!(counts.unknown_media, 1);
            }
        }
    }
}

#[test]
fn only_full_attention_groups_route_and_removals_follow_what_stores_taught() {
    let payload = batch(vec![
        stored_map(
            &[1],
            None,
            tokens(0..4),
            vec![
                ("group_idx", V::U(0)),
                ("kv_cache_spec_kind", V::S("mla_attention")),
            ],
        ),
        stored_map(
            &[2],
            None,
            tokens(0..4),
            vec![
                ("group_idx", V::U(1)),
                ("kv_cache_spec_kind", V::S("sliding_window")),
            ],
        ),
        V::M(vec![
            ("type", V::S("BlockRemoved")),
            ("block_hashes", uints(&[2])),
            ("group_idx", V::U(1)),
        ]),
        V::M(vec![
            ("type", V::S("BlockRemoved")),
            ("block_hashes", uints(&[1])),
            ("group_idx", V::U(0)),
        ]),
        // A group never described: only group 0 routes.
        V::M(vec![
            ("type", V::S("BlockRemoved")),
            ("block_hashes", uints(&[3])),
            ("group_idx", V::U(2)),
        ]),
    ]);
    let (out, counts) = run(&payload);
    assert_eq!(
        out,
        vec![
            event(0, StorageTier::Device, stored(None, &[(1, &[0, 1, 2, 3])])),
            event(1, StorageTier::Device, removed(&[1])),
        ]
    );
    assert_eq!(counts.other_groups, 3);
}

#[test]
fn eagle_token_pairs_hash_like_their_first_tokens() {
    // SGLang under EAGLE keys by bigrams: [(0,1), (1,2), (2,3), (3,4)] for tokens 0..4.
    let pairs = V::A((0..4).map(|t| V::A(vec![V::U(t), V::U(t + 1)])).collect());
    let (out, _) = run(&batch(vec![stored_map(&[1], None, pairs, vec![])]));
    assert_eq!(
        out,
        vec![event(
            0,
            StorageTier::Device,
            stored(None, &[(1, &[0, 1, 2, 3])])
        )]
    );
    // A pair of the wrong arity, or a token over u32, is a bad token.
    for bad in [
        V::A(vec![
            V::A(vec![V::U(1), V::U(2), V::U(3)]),
            V::U(1),
            V::U(2),
            V::U(3),
        ]),
        V::A(vec![V::U(1 << 32), V::U(1), V::U(2), V::U(3)]),
        V::A(vec![V::I(-1), V::U(1), V::U(2), V::U(3)]),
    ] {
        let payload = batch(vec![stored_map(&[1], None, bad, vec![])]);
        let decoded = decode_batch(&payload).unwrap();
        assert_eq!(decoded.events[0], Err(EventError::BadToken { index: 0 }));
    }
}

#[test]
fn byte_hashes_are_named_by_their_last_eight_bytes_big_endian() {
    let sha: Vec<u8> = (1..=32).collect(); // a 32-byte sha256-style hash
    let payload = batch(vec![
        V::M(vec![
            ("type", V::S("BlockRemoved")),
            (
                "block_hashes",
                V::A(vec![V::B(sha), V::B(vec![0xab, 0xcd]), V::I(-2)]),
            ),
        ]),
        V::M(vec![
            ("type", V::S("BlockRemoved")),
            ("block_hashes", V::A(vec![V::B(vec![])])),
        ]),
        V::M(vec![
            ("type", V::S("BlockRemoved")),
            ("block_hashes", V::A(vec![V::S("0x12")])),
        ]),
    ]);
    let (out, counts) = run(&payload);
    assert_eq!(
        out,
        vec![event(
            0,
            StorageTier::Device,
            removed(&[0x191a_1b1c_1d1e_1f20, 0xabcd, u64::MAX - 1])
        )]
    );
    assert_eq!(counts.malformed_events, 2);
}

#[test]
fn a_stored_event_with_the_wrong_token_count_or_block_size_is_skipped_and_counted() {
    let payload = batch(vec![
        stored_map(&[1, 2], None, tokens(0..7), vec![]),
        stored_map(&[1], None, tokens(0..8), vec![]),
        V::M(vec![
            ("type", V::S("BlockStored")),
            ("block_hashes", uints(&[1])),
            ("token_ids", tokens(0..8)),
            ("block_size", V::U(8)),
        ]),
        V::M(vec![
            ("type", V::S("BlockStored")),
            ("block_hashes", uints(&[])),
            ("token_ids", tokens(0..0)),
            ("block_size", V::U(0)),
        ]),
        stored_map(&[3], Some(2), tokens(0..4), vec![]),
    ]);
    let (out, counts) = run(&payload);
    // Ids are consecutive over the events produced: the skipped ones leave no gap.
    assert_eq!(
        out,
        vec![event(
            0,
            StorageTier::Device,
            stored(Some(2), &[(3, &[0, 1, 2, 3])])
        )]
    );
    assert_eq!((counts.token_count, counts.block_size), (2, 2));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.events.len(), 5);
    let mut decoder = EngineDecoder::new(DecoderConfig::default());
    let mut out = Vec::new();
    decoder.convert(&batch, &mut EventId(0), &mut out);
    assert_eq!(
        decoder.counts().token_count,
        3,
        "without a configured block size, a block size of 0 and 7 tokens for 2 blocks of 4 fail"
    );
}

#[test]
fn lora_names_seed_the_hashes_and_multimodal_keys_make_blocks_opaque() {
    let extra = V::A(vec![V::A(vec![V::S("mm-hash"), V::U(0)]), V::Nil]);
    let payload = batch(vec![stored_map(
        &[1, 2],
        None,
        tokens(0..8),
        vec![
            ("lora_name", V::S("adapter")),
            ("extra_keys", extra.clone()),
        ],
    )]);
    let decoded = decode_batch(&payload).unwrap();
    let Ok(EngineEvent::Stored(s)) = &decoded.events[0] else {
        panic!("a BlockStored")
    };
    assert_eq!(s.lora_name, Some("adapter"));
    assert_eq!(s.extra_keys, Some(&bytes(&extra)[..]));
    let (out, counts) = run(&payload);
    let hasher = BlockHasher::new(4).with_seed(HashSeed::new(Some("adapter"), None));
    let KvEventData::Stored { blocks, .. } = &out[0].data else {
        panic!("a Stored")
    };
    // The first block holds an image: no request's hash may match it (another image of the
    // same size has the same placeholder tokens). The second is the adapter's as usual; it
    // lies below the opaque one in the index, out of every request's reach.
    assert_ne!(blocks[0].local_hash, hasher.local_hash(&[0, 1, 2, 3]));
    assert_ne!(blocks[0].local_hash, local(&[0, 1, 2, 3]));
    assert_eq!(blocks[1].local_hash, hasher.local_hash(&[4, 5, 6, 7]));
    assert_eq!((counts.opaque_blocks, counts.salted_blocks), (1, 0));
    // Older engines name the adapter by id only: its blocks must not pass for the base model's.
    let by_id = batch(vec![V::A(vec![
        V::S("BlockStored"),
        uints(&[1]),
        V::Nil,
        tokens(0..4),
        V::U(4),
        V::U(3),
    ])]);
    let (out, _) = run(&by_id);
    let KvEventData::Stored { blocks, .. } = &out[0].data else {
        panic!("a Stored")
    };
    let by_id_hasher = BlockHasher::new(4).with_seed(HashSeed::new(Some("lora-id:3"), None));
    assert_eq!(blocks[0].local_hash, by_id_hasher.local_hash(&[0, 1, 2, 3]));
}

/// The local hashes of a Stored event's blocks.
fn locals(event: &KvEvent) -> Vec<kvroute_core::LocalHash> {
    let KvEventData::Stored { blocks, .. } = &event.data else {
        panic!("a Stored: {event:?}")
    };
    blocks.iter().map(|b| b.local_hash).collect()
}

fn decode_one(decoder: &mut EngineDecoder, event: V) -> KvEvent {
    let mut out = Vec::new();
    decoder
        .decode(&batch(vec![event]), &mut EventId(0), &mut out)
        .unwrap();
    assert_eq!(out.len(), 1, "{out:?}");
    out.remove(0)
}

#[test]
fn a_cache_salt_on_a_chains_first_block_seeds_the_chain_as_a_salted_request_is_hashed() {
    let salted = BlockHasher::new(4).with_seed(HashSeed::new(None, Some("tenant-a")));
    let mut decoder = decoder();
    // vLLM puts the salt in the first block's extra keys only.
    let first = stored_map(
        &[1, 2],
        None,
        tokens(0..8),
        vec![(
            "extra_keys",
            V::A(vec![V::A(vec![V::S("tenant-a")]), V::Nil]),
        )],
    );
    let e = decode_one(&mut decoder, first);
    assert_eq!(
        locals(&e),
        [
            salted.local_hash(&[0, 1, 2, 3]),
            salted.local_hash(&[4, 5, 6, 7])
        ]
    );
    assert_eq!(decoder.salted_blocks_held(), 2);
    // A later event continuing the chain carries no keys: it is seeded from its parent.
    let next = stored_map(&[3], Some(2), tokens(8..12), vec![]);
    assert_eq!(
        locals(&decode_one(&mut decoder, next)),
        [salted.local_hash(&[8, 9, 10, 11])]
    );
    // One continuing an unsalted block, or a block the decoder never saw, is unsalted.
    let other = stored_map(&[9], Some(77), tokens(8..12), vec![]);
    assert_eq!(
        locals(&decode_one(&mut decoder, other)),
        [local(&[8, 9, 10, 11])]
    );
    // A second copy of block 3; removing one copy keeps it, removing the last forgets it:
    // what continues it then is unsalted.
    let again = stored_map(&[3], Some(2), tokens(8..12), vec![]);
    decode_one(&mut decoder, again);
    let removed = V::M(vec![
        ("type", V::S("BlockRemoved")),
        ("block_hashes", uints(&[3])),
        ("medium", V::S("GPU")),
    ]);
    decode_one(&mut decoder, removed.clone());
    assert_eq!(decoder.salted_blocks_held(), 3);
    decode_one(&mut decoder, removed);
    assert_eq!(decoder.salted_blocks_held(), 2);
    let after = stored_map(&[4], Some(3), tokens(12..16), vec![]);
    assert_eq!(
        locals(&decode_one(&mut decoder, after)),
        [local(&[12, 13, 14, 15])]
    );
    // A salted block's copy on another tier is kept apart: removing the host copy leaves the
    // device's, and the chain below it stays salted.
    let host = stored_map(&[2], None, tokens(4..8), vec![("medium", V::S("CPU"))]);
    decode_one(&mut decoder, host);
    let host_removed = V::M(vec![
        ("type", V::S("BlockRemoved")),
        ("block_hashes", uints(&[2])),
        ("medium", V::S("CPU")),
    ]);
    decode_one(&mut decoder, host_removed);
    let below = stored_map(&[5], Some(2), tokens(16..20), vec![]);
    assert_eq!(
        locals(&decode_one(&mut decoder, below)),
        [salted.local_hash(&[16, 17, 18, 19])]
    );
    // A clear forgets the rank's salted blocks.
    decode_one(&mut decoder, V::M(vec![("type", V::S("AllBlocksCleared"))]));
    assert_eq!(decoder.salted_blocks_held(), 0);
    assert_eq!(decoder.counts().salted_blocks, 5);
    assert_eq!(decoder.counts().opaque_blocks, 0);
}

#[test]
fn a_salt_under_an_adapter_seeds_with_both_and_keys_elsewhere_are_opaque() {
    let both = BlockHasher::new(4).with_seed(HashSeed::new(Some("adapter"), Some("s")));
    let mut decoder = decoder();
    // vLLM's order: multimodal keys, the LoRA name, the salt.
    let e = decode_one(
        &mut decoder,
        stored_map(
            &[1],
            None,
            tokens(0..4),
            vec![
                ("lora_name", V::S("adapter")),
                (
                    "extra_keys",
                    V::A(vec![V::A(vec![V::S("adapter"), V::S("s")])]),
                ),
            ],
        ),
    );
    assert_eq!(locals(&e), [both.local_hash(&[0, 1, 2, 3])]);
    // A salt past a chain's first block is not a salt the router could hash: opaque, as are
    // an image identifier with its offset and two strings on a first block.
    let plain = |t: &[u32]| local(t);
    for (parent, keys) in [
        (Some(5), V::A(vec![V::S("s")])),
        (None, V::A(vec![V::A(vec![V::S("img"), V::U(3)])])),
        (None, V::A(vec![V::S("img"), V::S("s")])),
        (None, V::S("not an array")),
    ] {
        let e = decode_one(
            &mut decoder,
            stored_map(
                &[2],
                parent,
                tokens(0..4),
                vec![("extra_keys", V::A(vec![keys]))],
            ),
        );
        assert_ne!(locals(&e), [plain(&[0, 1, 2, 3])]);
    }
    assert_eq!(decoder.counts().opaque_blocks, 4);
    // An image's identifier alone on a prompt's first block reads as a salt (the wire cannot
    // tell them apart): matched only by a request salted with it.
    let image = decode_one(
        &mut decoder,
        stored_map(
            &[9],
            None,
            tokens(0..4),
            vec![("extra_keys", V::A(vec![V::A(vec![V::S("img-hash")])]))],
        ),
    );
    let by_image = BlockHasher::new(4).with_seed(HashSeed::new(None, Some("img-hash")));
    assert_eq!(locals(&image), [by_image.local_hash(&[0, 1, 2, 3])]);
    // A list of keys that does not have one entry per block is applied and counted.
    let short = stored_map(
        &[4, 5],
        None,
        tokens(0..8),
        vec![("extra_keys", V::A(vec![V::Nil]))],
    );
    decode_one(&mut decoder, short);
    assert_eq!(decoder.counts().extra_keys_mismatch, 1);
    // Keys that are not a list are a malformed event: skipped and counted.
    let mut out = Vec::new();
    let bad = stored_map(&[3], None, tokens(0..4), vec![("extra_keys", V::U(7))]);
    decoder
        .decode(&batch(vec![bad]), &mut EventId(0), &mut out)
        .unwrap();
    assert!(out.is_empty());
    assert_eq!(decoder.counts().malformed_events, 1);
}

#[test]
fn event_ids_continue_across_batches() {
    let mut decoder = decoder();
    let mut next_id = EventId(10);
    let mut out = Vec::new();
    let clear = V::M(vec![("type", V::S("AllBlocksCleared"))]);
    for _ in 0..3 {
        decoder
            .decode(
                &batch(vec![clear.clone(), clear.clone()]),
                &mut next_id,
                &mut out,
            )
            .unwrap();
    }
    let ids: Vec<u64> = out.iter().map(|e| e.header.event_id.0).collect();
    assert_eq!(ids, (10..16).collect::<Vec<_>>());
    assert_eq!(next_id, EventId(16));
}

#[test]
fn payloads_that_are_not_batches_are_rejected_whole() {
    let cases: Vec<(Vec<u8>, PayloadError)> = vec![
        (
            bytes(&V::S("hello")),
            PayloadError::NotABatch { found: "a string" },
        ),
        (bytes(&V::A(vec![V::F(1.0)])), PayloadError::MissingEvents),
        (
            bytes(&V::M(vec![("ts", V::F(1.0))])),
            PayloadError::MissingEvents,
        ),
        (
            bytes(&V::A(vec![V::S("t"), V::A(vec![])])),
            PayloadError::BatchField {
                field: "ts",
                found: "a string",
            },
        ),
        (
            bytes(&V::A(vec![V::F(1.0), V::U(3)])),
            PayloadError::BatchField {
                field: "events",
                found: "an unsigned integer",
            },
        ),
        (
            bytes(&V::A(vec![V::F(1.0), V::A(vec![]), V::I(-1)])),
            PayloadError::BatchField {
                field: "dp_rank",
                found: "a negative integer",
            },
        ),
        (
            {
                let mut b = batch(vec![]);
                b.push(0xc0);
                b
            },
            PayloadError::TrailingBytes { extra: 1 },
        ),
    ];
    for (payload, expected) in cases {
        assert_eq!(decode_batch(&payload), Err(expected));
    }
    let mut decoder = decoder();
    assert!(decoder
        .decode(&[0xc1], &mut EventId(0), &mut Vec::new())
        .is_err());
    assert_eq!(decoder.counts().bad_payloads, 1);
}

#[test]
fn every_prefix_of_a_hand_built_payload_is_an_error() {
    let payload = batch(vec![
        stored_map(
            &[1, 2],
            None,
            tokens(0..8),
            vec![("extra_keys", V::A(vec![V::Nil, V::Nil]))],
        ),
        V::A(vec![
            V::S("BlockRemoved"),
            V::A(vec![V::B(vec![1; 32])]),
            V::S("CPU"),
        ]),
        V::A(vec![V::S("AllBlocksCleared")]),
    ]);
    assert_eq!(run(&payload).0.len(), 3);
    for len in 0..payload.len() {
        assert!(
            decode_batch(&payload[..len]).is_err(),
            "prefix of {len} bytes"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Frames

#[test]
fn frame_layouts_that_are_wrong_get_typed_errors() {
    let seq = 5_u64.to_be_bytes().to_vec();
    assert_eq!(
        parse_live(&[b"t".to_vec(), seq.clone()]),
        Err(FrameLayoutError::WrongFrameCount {
            layout: "live",
            expected: "3",
            found: 2
        })
    );
    assert_eq!(
        parse_live(&[b"t".to_vec(), vec![0; 4], b"p".to_vec()]),
        Err(FrameLayoutError::SeqLength { len: 4 })
    );
    let frames = [b"t".to_vec(), seq.clone(), b"p".to_vec()];
    let live = parse_live(&frames).unwrap();
    assert_eq!(
        (live.topic, live.seq, live.payload),
        (&b"t"[..], 5, &b"p"[..])
    );
    assert_eq!(
        parse_replay(&[b"x".to_vec(), b"t".to_vec(), seq.clone(), b"p".to_vec()]),
        Err(FrameLayoutError::MissingDelimiter { len: 1 })
    );
    assert_eq!(
        parse_replay(&[Vec::new(), seq.clone()]),
        Err(FrameLayoutError::WrongFrameCount {
            layout: "replay",
            expected: "3 or 4",
            found: 2
        })
    );
    assert_eq!(
        parse_replay(&[Vec::new(), Vec::new(), vec![0xff; 7], Vec::new()]),
        Err(FrameLayoutError::SeqLength { len: 7 })
    );
    let frames: [&[u8]; 4] = [b"", b"", &END_SEQ, b""];
    assert_eq!(parse_replay(&frames), Ok(ReplayReply::End));
}
