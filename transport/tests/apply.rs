//! A batch applied from its archived form leaves the index exactly as applying the owned core
//! events does: same answers, same counters, same rejections.

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

use bytes::BytesMut;
use kvroute_core::testing::scores_of;
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, KvEvent, KvEventData, LocalHash, MatchOptions,
    PrefixIndex, StorageTier, StoredBlock, WorkerId, WorkerRank,
};
use kvroute_transport::frame::{encode, FrameDecoder};
use kvroute_transport::wire::{KvEventBatch, Message, MessageRef};
use kvroute_transport::{apply_event_batch, BatchApplier};
use proptest::prelude::*;

const WORKER: u64 = 3;

/// (rank, event id step, tier, kind, names, parent).
type Spec = (u32, u64, u8, u8, Vec<u64>, Option<u64>);

/// Events over a small name space, so that parents are often known, sometimes not, and
/// removals hit and miss.
fn event() -> impl Strategy<Value = Spec> {
    (
        0u32..3,                                    // rank
        0u64..4,                                    // event id step (0: reorder, >1: gap)
        0u8..4,                                     // tier
        0u8..10,                                    // kind: 0-5 store, 6-8 remove, 9 clear
        proptest::collection::vec(0u64..48, 0..10), // names
        proptest::option::of(0u64..48),             // parent
    )
}

fn build(spec: &[Spec]) -> Vec<KvEvent> {
    let mut next_id = [0u64; 3];
    spec.iter()
        .map(|(rank, step, tier, kind, names, parent)| {
            next_id[*rank as usize] += step;
            let header = EventHeader {
                source: WorkerRank::new(WORKER, *rank),
                event_id: EventId(next_id[*rank as usize]),
                tier: StorageTier::ALL[*tier as usize],
            };
            let data = match kind {
                0..=5 => KvEventData::Stored {
                    parent: parent.map(BlockHash),
                    blocks: names
                        .iter()
                        .map(|n| StoredBlock {
                            block_hash: BlockHash(*n),
                            // The content follows the name, so chains share prefixes.
                            local_hash: LocalHash(n % 16 + 100),
                        })
                        .collect(),
                },
                6..=8 => KvEventData::Removed {
                    blocks: names.iter().copied().map(BlockHash).collect(),
                },
                _ => KvEventData::Cleared,
            };
            KvEvent { header, data }
        })
        .collect()
}

fn encode_batch(events: &[KvEvent]) -> BytesMut {
    let batch = KvEventBatch::from_core(WorkerId(WORKER), 0, events).expect("one worker");
    let mut buf = BytesMut::new();
    encode(&Message::KvEvents(batch), &mut buf).expect("encodes");
    buf
}

fn queries(events: &[KvEvent]) -> Vec<Vec<LocalHash>> {
    let mut q: Vec<Vec<LocalHash>> = events
        .iter()
        .filter_map(|e| match &e.data {
            KvEventData::Stored { blocks, .. } => {
                Some(blocks.iter().map(|b| b.local_hash).collect())
            }
            _ => None,
        })
        .collect();
    q.push((100..116).map(LocalHash).collect());
    q
}

fn config() -> IndexConfig {
    IndexConfig {
        shards: 2,
        ..IndexConfig::default()
    }
}

proptest! {
    #[test]
    fn archived_apply_equals_owned_apply(
        spec in proptest::collection::vec(event(), 0..60),
        split in 0usize..60,
    ) {
        let events = build(&spec);

        // Owned: the core's own entry point, event by event.
        let mut owned = PrefixIndex::new(config());
        let results: Vec<_> = events.iter().map(|e| owned.apply(e)).collect();

        // Archived: two batches (split anywhere), through the frame decoder, one applier.
        let split = split.min(events.len());
        let mut archived = PrefixIndex::new(config());
        let mut applier = BatchApplier::new();
        let mut dec = FrameDecoder::default();
        let mut rejected = 0;
        let mut first_error = None;
        for (offset, part) in [(0, &events[..split]), (split, &events[split..])] {
            let mut buf = encode_batch(part);
            let frame = dec.decode(&mut buf).expect("framed").expect("complete");
            let MessageRef::KvEvents(batch) = dec.validate(&frame).expect("valid") else {
                panic!("kind");
            };
            let out = applier.apply_batch(&mut archived, batch);
            prop_assert_eq!(out.events as usize, part.len());
            prop_assert_eq!((out.applied + out.rejected) as usize, part.len());
            rejected += out.rejected;
            if first_error.is_none() {
                first_error = out.first_error.map(|r| (r.position as usize + offset, r.error));
            }
        }

        let expected_rejected = results.iter().filter(|r| r.is_err()).count();
        prop_assert_eq!(rejected as usize, expected_rejected);
        let expected_first = results
            .iter()
            .enumerate()
            .find_map(|(i, r)| r.clone().err().map(|e| (i, e)));
        prop_assert_eq!(first_error, expected_first);

        let (a, b) = (owned.stats(), archived.stats());
        prop_assert_eq!(a.stored_pairs, b.stored_pairs);
        prop_assert_eq!(a.duplicate_copies, b.duplicate_copies);
        prop_assert_eq!(a.blocks, b.blocks);
        prop_assert_eq!(a.names, b.names);
        prop_assert_eq!(a.errors, b.errors);
        prop_assert_eq!(a.events, b.events);
        prop_assert_eq!(owned.rank_status(), archived.rank_status());
        for q in queries(&events) {
            let mut sa = scores_of(&owned.reader(), &q, MatchOptions::default()).scores;
            let mut sb = scores_of(&archived.reader(), &q, MatchOptions::default()).scores;
            sa.sort();
            sb.sort();
            prop_assert_eq!(sa, sb);
        }
    }
}

#[test]
fn one_shot_apply_and_recovery_reply() {
    let chain: Vec<StoredBlock> = (0..8)
        .map(|i| StoredBlock {
            block_hash: BlockHash(500 + i),
            local_hash: LocalHash(i + 1),
        })
        .collect();
    let header = |id| EventHeader {
        source: WorkerRank::new(WORKER, 1),
        event_id: EventId(id),
        tier: StorageTier::Device,
    };
    let events = vec![
        KvEvent {
            header: header(0),
            data: KvEventData::Stored {
                parent: None,
                blocks: chain[..4].to_vec(),
            },
        },
        KvEvent {
            header: header(1),
            data: KvEventData::Stored {
                parent: Some(BlockHash(503)),
                blocks: chain[4..].to_vec(),
            },
        },
        // Unknown parent: rejected, counted, the rest goes on.
        KvEvent {
            header: header(2),
            data: KvEventData::Stored {
                parent: Some(BlockHash(9999)),
                blocks: chain[..1].to_vec(),
            },
        },
        KvEvent {
            header: header(3),
            data: KvEventData::Removed {
                blocks: vec![BlockHash(507)],
            },
        },
    ];
    let mut buf = encode_batch(&events);
    let mut dec = FrameDecoder::default();
    let frame = dec.decode(&mut buf).expect("framed").expect("complete");
    let MessageRef::KvEvents(batch) = dec.validate(&frame).expect("valid") else {
        panic!("kind");
    };
    let mut index = PrefixIndex::new(config());
    let out = apply_event_batch(&mut index, batch);
    assert_eq!(out.events, 4);
    assert_eq!(out.applied, 3);
    assert_eq!(out.rejected, 1);
    assert_eq!(out.blocks_stored, 9);
    assert_eq!(out.blocks_removed, 1);
    assert_eq!(out.first_error.expect("one").position, 2);
    let q: Vec<LocalHash> = chain.iter().map(|b| b.local_hash).collect();
    let scores = scores_of(&index.reader(), &q, MatchOptions::default());
    assert_eq!(scores.blocks(WorkerRank::new(WORKER, 1)), 7);

    // A snapshot reply: Cleared, then the chain again.
    let snapshot = kvroute_transport::wire::RecoveryReply {
        worker_id: WORKER,
        dp_rank: 1,
        mode: kvroute_transport::wire::RecoveryMode::Snapshot,
        last_event_id: Some(5),
        events: [
            KvEvent {
                header: header(4),
                data: KvEventData::Cleared,
            },
            KvEvent {
                header: header(5),
                data: KvEventData::Stored {
                    parent: None,
                    blocks: chain.clone(),
                },
            },
        ]
        .iter()
        .map(kvroute_transport::wire::WireEvent::from_core)
        .collect(),
    };
    let mut buf = BytesMut::new();
    encode(&Message::RecoveryReply(snapshot), &mut buf).expect("encodes");
    let frame = dec.decode(&mut buf).expect("framed").expect("complete");
    let MessageRef::RecoveryReply(reply) = dec.validate(&frame).expect("valid") else {
        panic!("kind");
    };
    let out = BatchApplier::new().apply_recovery(&mut index, reply);
    assert_eq!((out.applied, out.rejected), (2, 0));
    let scores = scores_of(&index.reader(), &q, MatchOptions::default());
    assert_eq!(scores.blocks(WorkerRank::new(WORKER, 1)), 8);
    assert!(index.ranks_needing_resync().is_empty());
}

#[test]
fn batch_of_a_foreign_worker_is_refused() {
    let e = KvEvent {
        header: EventHeader {
            source: WorkerRank::new(WORKER + 1, 0),
            event_id: EventId(0),
            tier: StorageTier::Device,
        },
        data: KvEventData::Cleared,
    };
    assert_eq!(
        KvEventBatch::from_core(WorkerId(WORKER), 0, [&e]),
        Err(kvroute_transport::wire::ConversionError::ForeignWorker {
            expected: WorkerId(WORKER),
            found: WorkerId(WORKER + 1)
        })
    );
    let batch = KvEventBatch::from_core(WorkerId(WORKER + 1), 0, [&e]).expect("same worker");
    assert_eq!(batch.to_core(), vec![e]);
}
