//! proptest strategies for every wire message.
#![allow(dead_code)]

use kvroute_transport::wire::*;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;

pub fn text() -> impl Strategy<Value = String> {
    // Short and long strings: rkyv stores up to 8 bytes inline, longer ones out of line.
    prop_oneof!["[a-z0-9=_-]{0,8}", ".{0,40}"]
}

pub fn role() -> impl Strategy<Value = Role> {
    prop_oneof![
        Just(Role::Aggregated),
        Just(Role::Prefill),
        Just(Role::Decode)
    ]
}

pub fn tier() -> impl Strategy<Value = WireTier> {
    prop_oneof![
        Just(WireTier::Device),
        Just(WireTier::HostPinned),
        Just(WireTier::Disk),
        Just(WireTier::External)
    ]
}

pub fn hello() -> impl Strategy<Value = Hello> {
    (
        any::<u16>(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<u32>(),
        role(),
        any::<u64>(),
        vec(
            (text(), text()).prop_map(|(key, value)| Label { key, value }),
            0..4,
        ),
    )
        .prop_map(
            |(
                protocol_version,
                worker_id,
                dp_start,
                dp_size,
                kv_blocks,
                block_size,
                role,
                mbt,
                labels,
            )| {
                Hello {
                    protocol_version,
                    worker_id,
                    dp_start,
                    dp_size,
                    kv_blocks,
                    block_size,
                    role,
                    max_batched_tokens: mbt,
                    labels,
                }
            },
        )
}

pub fn heartbeat() -> impl Strategy<Value = Heartbeat> {
    let load = (
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(
            |(dp_rank, active_blocks, total_blocks, running, waiting)| RankLoad {
                dp_rank,
                active_blocks,
                total_blocks,
                running,
                waiting,
            },
        );
    (any::<u64>(), any::<u64>(), vec(load, 0..8)).prop_map(|(worker_id, seq, ranks)| Heartbeat {
        worker_id,
        seq,
        ranks,
    })
}

pub fn event_data() -> impl Strategy<Value = WireEventData> {
    let block = (any::<u64>(), any::<u64>()).prop_map(|(block_hash, local_hash)| WireBlock {
        block_hash,
        local_hash,
    });
    prop_oneof![
        (option::of(any::<u64>()), vec(block, 0..20))
            .prop_map(|(parent, blocks)| WireEventData::Stored { parent, blocks }),
        vec(any::<u64>(), 0..20).prop_map(|hashes| WireEventData::Removed { hashes }),
        Just(WireEventData::Cleared),
    ]
}

pub fn wire_event() -> impl Strategy<Value = WireEvent> {
    (any::<u32>(), any::<u64>(), tier(), event_data()).prop_map(
        |(dp_rank, event_id, tier, data)| WireEvent {
            dp_rank,
            event_id,
            tier,
            data,
        },
    )
}

pub fn kv_events() -> impl Strategy<Value = KvEventBatch> {
    (any::<u64>(), any::<u64>(), vec(wire_event(), 0..12)).prop_map(
        |(worker_id, sent_at_us, events)| KvEventBatch {
            worker_id,
            sent_at_us,
            events,
        },
    )
}

pub fn dispatch() -> impl Strategy<Value = Dispatch> {
    let sampling = (
        (
            any::<u32>(),
            any::<u32>(),
            -1e6f32..1e6,
            0f32..1.0,
            any::<u32>(),
        ),
        (
            option::of(any::<u64>()),
            vec(any::<u32>(), 0..6),
            vec(text(), 0..3),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (max_tokens, min_tokens, temperature, top_p, top_k),
                (seed, ids, strings, ignore_eos),
            )| {
                Sampling {
                    max_tokens,
                    min_tokens,
                    temperature,
                    top_p,
                    top_k,
                    seed,
                    stop_token_ids: ids,
                    stop_strings: strings,
                    ignore_eos,
                }
            },
        );
    let hints = (
        any::<u32>(),
        any::<u32>(),
        option::of(text()),
        any::<i32>(),
        option::of(any::<u32>()),
    )
        .prop_map(
            |(dp_rank, overlap_blocks, lora_name, priority, expected_output_tokens)| {
                DispatchHints {
                    dp_rank,
                    overlap_blocks,
                    lora_name,
                    priority,
                    expected_output_tokens,
                }
            },
        );
    let bootstrap = (text(), any::<u16>(), any::<u64>()).prop_map(|(host, port, room)| Bootstrap {
        host,
        port,
        room,
    });
    (
        any::<u64>(),
        vec(any::<u32>(), 0..300),
        sampling,
        hints,
        option::of(bootstrap),
    )
        .prop_map(
            |(request_id, tokens, sampling, hints, bootstrap)| Dispatch {
                request_id,
                tokens,
                sampling,
                hints,
                bootstrap,
            },
        )
}

pub fn response() -> impl Strategy<Value = ResponseItem> {
    let finish = prop_oneof![
        Just(FinishReason::Stop),
        Just(FinishReason::Length),
        Just(FinishReason::Cancelled),
        Just(FinishReason::Error)
    ];
    (
        any::<u64>(),
        vec(any::<u32>(), 0..16),
        option::of(finish),
        option::of(text()),
    )
        .prop_map(|(request_id, tokens, finish, error)| ResponseItem {
            request_id,
            tokens,
            finish,
            error,
        })
}

pub fn recovery_request() -> impl Strategy<Value = RecoveryRequest> {
    let from = prop_oneof![
        any::<u64>().prop_map(|event_id| RecoveryFrom::EventsAfter { event_id }),
        Just(RecoveryFrom::Snapshot)
    ];
    (any::<u64>(), any::<u32>(), from).prop_map(|(worker_id, dp_rank, from)| RecoveryRequest {
        worker_id,
        dp_rank,
        from,
    })
}

pub fn recovery_reply() -> impl Strategy<Value = RecoveryReply> {
    let mode = prop_oneof![
        Just(RecoveryMode::Replay),
        Just(RecoveryMode::Snapshot),
        Just(RecoveryMode::Unavailable)
    ];
    (
        any::<u64>(),
        any::<u32>(),
        mode,
        option::of(any::<u64>()),
        vec(wire_event(), 0..6),
    )
        .prop_map(
            |(worker_id, dp_rank, mode, last_event_id, events)| RecoveryReply {
                worker_id,
                dp_rank,
                mode,
                last_event_id,
                events,
            },
        )
}

pub fn error_message() -> impl Strategy<Value = ErrorMessage> {
    let code = prop_oneof![
        Just(ErrorCode::UnsupportedVersion),
        Just(ErrorCode::MalformedFrame),
        Just(ErrorCode::UnknownRequest),
        Just(ErrorCode::Overloaded),
        Just(ErrorCode::ShuttingDown),
        Just(ErrorCode::Internal)
    ];
    (code, option::of(any::<u64>()), text()).prop_map(|(code, request_id, message)| ErrorMessage {
        code,
        request_id,
        message,
    })
}

/// Any message, every kind equally likely.
pub fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        hello().prop_map(Message::Hello),
        heartbeat().prop_map(Message::Heartbeat),
        kv_events().prop_map(Message::KvEvents),
        dispatch().prop_map(Message::Dispatch),
        response().prop_map(Message::Response),
        any::<u64>().prop_map(|request_id| Message::Cancel(Cancel { request_id })),
        recovery_request().prop_map(Message::RecoveryRequest),
        recovery_reply().prop_map(Message::RecoveryReply),
        error_message().prop_map(Message::Error),
    ]
}

/// One message of every kind, with some of everything in it, from a fixed seed.
pub fn samples() -> Vec<Message> {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let mut out: Vec<Message> = Vec::new();
    for kind in kvroute_transport::MessageKind::ALL {
        // Draw until a message of this kind with a non-trivial payload comes up.
        loop {
            let m = message().new_tree(&mut runner).expect("tree").current();
            if m.kind() == kind {
                out.push(m);
                break;
            }
        }
    }
    out
}
