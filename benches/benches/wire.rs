//! The wire protocol's receive path for KV events: rkyv frames against msgpack as vLLM
//! publishes it, on the same batch, in the same process.
//!
//! `cargo bench -p kvroute-benches --bench wire`
//!
//! The batch is one rank's events as a vLLM engine would emit them in a burst: 32 requests each
//! store a 16-block prompt, then two decode blocks one at a time, then are evicted (128 events,
//! 1152 blocks named, 16 tokens a block). Applied again and again it leaves the index as it
//! found it. Figures are per event (criterion's elements).
//!
//! - `decode/*`: the bytes to something the index can take. `rkyv_validate` is bytecheck over
//!   the frame's payload (what reading in place costs); `rkyv_validate_copy` also copies every
//!   event's blocks to the scratch buffer the index reads (the one copy the receive path makes);
//!   `msgpack_decode` is `rmp-serde` into owned structs of vLLM's layout, token ids included.
//! - `apply/*`: into a `PrefixIndex`. `owned_events` applies prebuilt core events (the index
//!   alone); `rkyv` validates and applies from the archive; `msgpack` decodes, hashes the
//!   token ids into local hashes (vLLM sends tokens, not kvroute's hashes) and applies.

use std::fmt;

use bytes::BytesMut;
use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use kvroute_core::BlockHasher;
use kvroute_core::{
    BlockHash, EventHeader, EventId, IndexConfig, KvEvent, KvEventData, LocalHash, PrefixIndex,
    StorageTier, StoredBlock, WorkerId, WorkerRank,
};
use kvroute_transport::apply::copy_blocks;
use kvroute_transport::frame::{encode, Frame, FrameDecoder};
use kvroute_transport::wire::{ArchivedWireEventData, KvEventBatch, Message, MessageRef};
use kvroute_transport::BatchApplier;
use serde::de::{self, SeqAccess, Visitor};
use serde::ser::SerializeTuple;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

const BLOCK: usize = 16;
const REQUESTS: u64 = 32;
const PROMPT_BLOCKS: u64 = 16;
const DECODE_BLOCKS: u64 = 2;
const WORKER: u64 = 1;

// ---- vLLM's KV event batch, as msgspec encodes it (array_like, tagged events) ----

/// `KVEventBatch`: `[ts, events, data_parallel_rank]`.
#[derive(Serialize, Deserialize)]
struct VllmBatch<'a>(f64, #[serde(borrow)] Vec<VllmEvent<'a>>, Option<i32>);

/// A tagged event: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
/// lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
enum VllmEvent<'a> {
    Stored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<&'a str>,
    },
    Removed {
        block_hashes: Vec<u64>,
        medium: Option<&'a str>,
    },
    Cleared,
}

impl Serialize for VllmEvent<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            VllmEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
            } => {
                let mut t = s.serialize_tuple(7)?;
                t.serialize_element("BlockStored")?;
                t.serialize_element(block_hashes)?;
                t.serialize_element(parent_block_hash)?;
                t.serialize_element(token_ids)?;
                t.serialize_element(block_size)?;
                t.serialize_element(lora_id)?;
                t.serialize_element(medium)?;
                t.end()
            }
            VllmEvent::Removed {
                block_hashes,
                medium,
            } => {
                let mut t = s.serialize_tuple(3)?;
                t.serialize_element("BlockRemoved")?;
                t.serialize_element(block_hashes)?;
                t.serialize_element(medium)?;
                t.end()
            }
            VllmEvent::Cleared => {
                let mut t = s.serialize_tuple(1)?;
                t.serialize_element("AllBlocksCleared")?;
                t.end()
            }
        }
    }
}

struct EventVisitor;

impl<'de> Visitor<'de> for EventVisitor {
    type Value = VllmEvent<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a tagged KV event array")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<VllmEvent<'de>, A::Error> {
        let tag: &str = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        // Trailing fields equal to their defaults may be omitted (msgspec's omit_defaults).
        match tag {
            "BlockStored" => Ok(VllmEvent::Stored {
                block_hashes: seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(1, &self))?,
                parent_block_hash: seq.next_element()?.flatten(),
                token_ids: seq.next_element()?.unwrap_or_default(),
                block_size: seq.next_element()?.unwrap_or_default(),
                lora_id: seq.next_element()?.flatten(),
                medium: seq.next_element()?.flatten(),
            }),
            "BlockRemoved" => Ok(VllmEvent::Removed {
                block_hashes: seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(1, &self))?,
                medium: seq.next_element()?.flatten(),
            }),
            "AllBlocksCleared" => Ok(VllmEvent::Cleared),
            other => Err(de::Error::unknown_variant(
                other,
                &["BlockStored", "BlockRemoved", "AllBlocksCleared"],
            )),
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for VllmEvent<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(EventVisitor)
    }
}

// ---- the batch ----

fn tokens(request: u64, block: u64) -> Vec<u32> {
    (0..BLOCK as u64)
        .map(|t| ((request * 7919 + block * 131 + t * 17) % 128_000) as u32)
        .collect()
}

/// The same batch three ways: core events, rkyv frame, vLLM msgpack.
fn batch() -> (Vec<KvEvent>, BytesMut, Vec<u8>) {
    let hasher = BlockHasher::new(BLOCK);
    let mut core = Vec::new();
    let mut vllm = Vec::new();
    let mut id = 0;
    let mut header = || {
        id += 1;
        EventHeader {
            source: WorkerRank::new(WORKER, 0),
            event_id: EventId(id),
            tier: StorageTier::Device,
        }
    };
    let name = |r: u64, b: u64| (r << 32) | (b + 1);
    let mut stored = |parent: Option<u64>, r: u64, blocks: std::ops::Range<u64>| {
        let toks: Vec<u32> = blocks.clone().flat_map(|b| tokens(r, b)).collect();
        let locals = hasher.local_hashes(&toks);
        core.push(KvEvent {
            header: header(),
            data: KvEventData::Stored {
                parent: parent.map(BlockHash),
                blocks: blocks
                    .clone()
                    .zip(&locals)
                    .map(|(b, l)| StoredBlock {
                        block_hash: BlockHash(name(r, b)),
                        local_hash: *l,
                    })
                    .collect(),
            },
        });
        vllm.push(VllmEvent::Stored {
            block_hashes: blocks.map(|b| name(r, b)).collect(),
            parent_block_hash: parent,
            token_ids: toks,
            block_size: BLOCK as u32,
            lora_id: None,
            medium: Some("GPU"),
        });
    };
    for r in 0..REQUESTS {
        stored(None, r, 0..PROMPT_BLOCKS);
    }
    for d in 0..DECODE_BLOCKS {
        for r in 0..REQUESTS {
            let b = PROMPT_BLOCKS + d;
            stored(Some(name(r, b - 1)), r, b..b + 1);
        }
    }
    let mut events = core;
    for r in 0..REQUESTS {
        let names: Vec<u64> = (0..PROMPT_BLOCKS + DECODE_BLOCKS)
            .map(|b| name(r, b))
            .collect();
        events.push(KvEvent {
            header: EventHeader {
                source: WorkerRank::new(WORKER, 0),
                event_id: EventId(events.len() as u64 + 1),
                tier: StorageTier::Device,
            },
            data: KvEventData::Removed {
                blocks: names.iter().copied().map(BlockHash).collect(),
            },
        });
        vllm.push(VllmEvent::Removed {
            block_hashes: names,
            medium: Some("GPU"),
        });
    }
    let wire = KvEventBatch::from_core(WorkerId(WORKER), 0, &events).expect("one worker");
    let mut frame = BytesMut::new();
    encode(&Message::KvEvents(wire), &mut frame).expect("encodes");
    let msgpack = rmp_serde::to_vec(&VllmBatch(1.7e9, vllm, Some(0))).expect("encodes");
    (events, frame, msgpack)
}

fn frame_of(bytes: &BytesMut) -> (FrameDecoder, Frame) {
    let mut dec = FrameDecoder::default();
    let mut buf = bytes.clone();
    let frame = dec.decode(&mut buf).expect("framed").expect("complete");
    (dec, frame)
}

fn index() -> PrefixIndex {
    PrefixIndex::new(IndexConfig {
        shards: 1,
        ..IndexConfig::default()
    })
}

/// Applies a vLLM batch: tokens hashed into local hashes, then the index's entry points.
struct VllmApplier {
    hasher: BlockHasher,
    locals: Vec<LocalHash>,
    blocks: Vec<StoredBlock>,
    names: Vec<BlockHash>,
    next_id: u64,
}

impl VllmApplier {
    fn apply(&mut self, index: &mut PrefixIndex, bytes: &[u8]) -> usize {
        let batch: VllmBatch = rmp_serde::from_slice(bytes).expect("decodes");
        let rank = WorkerRank::new(WORKER, batch.2.unwrap_or(0) as u32);
        let n = batch.1.len();
        for e in batch.1 {
            self.next_id += 1;
            let header = EventHeader {
                source: rank,
                event_id: EventId(self.next_id),
                tier: StorageTier::Device,
            };
            let r =
                match e {
                    VllmEvent::Stored {
                        block_hashes,
                        parent_block_hash,
                        token_ids,
                        ..
                    } => {
                        self.hasher.local_hashes_into(&token_ids, &mut self.locals);
                        self.blocks.clear();
                        self.blocks
                            .extend(block_hashes.iter().zip(&self.locals).map(|(h, l)| {
                                StoredBlock {
                                    block_hash: BlockHash(*h),
                                    local_hash: *l,
                                }
                            }));
                        index.apply_stored(header, parent_block_hash.map(BlockHash), &self.blocks)
                    }
                    VllmEvent::Removed { block_hashes, .. } => {
                        self.names.clear();
                        self.names
                            .extend(block_hashes.iter().copied().map(BlockHash));
                        index.apply_removed(header, &self.names)
                    }
                    VllmEvent::Cleared => index.apply_cleared(header),
                };
            r.expect("valid event");
        }
        n
    }
}

fn wire(c: &mut Criterion) {
    let (events, frame_bytes, msgpack) = batch();
    let n = events.len() as u64;
    let (mut dec, frame) = frame_of(&frame_bytes);
    eprintln!(
        "batch: {n} events, {} blocks; rkyv frame {} bytes, vLLM msgpack {} bytes",
        events
            .iter()
            .map(|e| match &e.data {
                KvEventData::Stored { blocks, .. } => blocks.len(),
                KvEventData::Removed { blocks } => blocks.len(),
                KvEventData::Cleared => 0,
            })
            .sum::<usize>(),
        frame_bytes.len(),
        msgpack.len()
    );

    let mut g = c.benchmark_group("wire/decode");
    g.throughput(Throughput::Elements(n));
    g.bench_function("rkyv_validate", |b| {
        b.iter(|| {
            let m = dec.validate(black_box(&frame)).expect("valid");
            black_box(m.kind())
        })
    });
    let mut scratch = Vec::new();
    g.bench_function("rkyv_validate_copy", |b| {
        b.iter(|| {
            let MessageRef::KvEvents(batch) = dec.validate(black_box(&frame)).expect("valid")
            else {
                unreachable!()
            };
            let mut total = 0;
            for e in batch.events.iter() {
                if let ArchivedWireEventData::Stored { blocks, .. } = &e.data {
                    copy_blocks(blocks, &mut scratch);
                    total += scratch.len();
                }
            }
            black_box(total)
        })
    });
    g.bench_function("msgpack_decode", |b| {
        b.iter(|| {
            let batch: VllmBatch = rmp_serde::from_slice(black_box(&msgpack)).expect("decodes");
            black_box(batch.1.len())
        })
    });
    g.finish();

    let mut g = c.benchmark_group("wire/apply");
    g.throughput(Throughput::Elements(n));
    let mut idx = index();
    g.bench_function("owned_events", |b| {
        b.iter(|| {
            for e in &events {
                idx.apply(e).expect("valid event");
            }
        })
    });
    let mut idx = index();
    let mut applier = BatchApplier::new();
    g.bench_function("rkyv", |b| {
        b.iter(|| {
            let MessageRef::KvEvents(batch) = dec.validate(black_box(&frame)).expect("valid")
            else {
                unreachable!()
            };
            let out = applier.apply_batch(&mut idx, batch);
            assert_eq!(out.rejected, 0);
        })
    });
    let mut idx = index();
    let mut vllm = VllmApplier {
        hasher: BlockHasher::new(BLOCK),
        locals: Vec::new(),
        blocks: Vec::new(),
        names: Vec::new(),
        next_id: 0,
    };
    g.bench_function("msgpack", |b| {
        b.iter(|| black_box(vllm.apply(&mut idx, black_box(&msgpack))))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(3));
    targets = wire
}
criterion_main!(benches);
