//! From the engine's events to the core's: the router's own block hashes, tiers, event ids.
//!
//! * **Hashes.** An engine's block hash is an opaque name (vLLM seeds its hashes at random per
//!   process), kept as [`StoredBlock::block_hash`] so later events can name the block; the
//!   router finds blocks by the [`LocalHash`](kvroute_core::LocalHash) of their tokens, computed
//!   here with [`BlockHasher`] at the event's block size, seeded by [`HashSeed::new`] from the
//!   event's LoRA name and the worker's cache salt ([`DecoderConfig::cache_salt`]). An event
//!   with a LoRA id but no name (older engines) is seeded by `lora-id:<id>`: its blocks then
//!   match no request, rather than the base model's. A Stored event whose token count is not
//!   `block_size` × blocks is rejected.
//! * **Tiers.** `medium` is an open set: see [`tier_of_medium`]; an unknown one skips the event.
//! * **Groups.** Only full-attention KV cache groups route (a sliding window's or a Mamba
//!   state's blocks say nothing about a prompt's prefix). vLLM names a group's kind on its
//!   Stored events only, so the decoder learns each `group_idx`'s kind from them and filters
//!   Removed events by what it learned; a group never described routes only if it is group 0.
//! * **Event ids.** The core wants one id per event, consecutive per rank; the engine numbers
//!   batches. The caller hands in the rank's next id and the decoder numbers the events it
//!   produces from it, so events skipped here leave no gap.
//! * **Extra keys.** vLLM's per-block `extra_keys` (multimodal identifiers, cache salt) are not
//!   hashed in: the request side cannot yet derive the same keys. Blocks that carry them are
//!   counted ([`DecodeCounts::extra_keys_blocks`]), and [`decode_batch`] hands the raw keys
//!   to a caller that wants them.

use std::collections::HashMap;

use kvroute_core::{
    BlockHasher, DpRank, EventHeader, EventId, HashSeed, KvEvent, KvEventData, StorageTier,
    StoredBlock, WorkerId, WorkerRank,
};

use super::error::{EventError, PayloadError};
use super::msgpack::{Item, Reader};
use super::payload::{decode_batch, BlockRemoved, BlockStored, EngineBatch, EngineEvent};

/// The storage tier of an engine's `medium`, compared without regard to ASCII case:
/// absent or `GPU` → device; `CPU`, `CPU_PINNED` → host; `DISK`, `STORAGE`, `FS` → disk;
/// `EXTERNAL`, `OBJ` → external. `None` for any other name.
pub fn tier_of_medium(medium: Option<&str>) -> Option<StorageTier> {
    let Some(medium) = medium else {
        return Some(StorageTier::Device);
    };
    let is = |name: &str| medium.eq_ignore_ascii_case(name);
    if is("GPU") {
        Some(StorageTier::Device)
    } else if is("CPU") || is("CPU_PINNED") {
        Some(StorageTier::HostPinned)
    } else if is("DISK") || is("STORAGE") || is("FS") {
        Some(StorageTier::Disk)
    } else if is("EXTERNAL") || is("OBJ") {
        Some(StorageTier::External)
    } else {
        None
    }
}

/// The cache kinds whose blocks are a prompt's prefix: vLLM's `KVCacheSpecKind` values for full
/// attention (MLA and attention with sink tokens are full attention too).
fn is_full_attention(kind: &str) -> bool {
    matches!(
        kind,
        "full_attention" | "mla_attention" | "sink_full_attention"
    )
}

/// What a decoder needs to know about the worker whose messages it decodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecoderConfig {
    /// The worker.
    pub worker: WorkerId,
    /// The rank of events whose batch names none (older engines): the rank of the socket the
    /// batch came from. A batch that names its rank is believed.
    pub dp_rank: DpRank,
    /// The worker's block size: when set, a Stored event of another block size is rejected
    /// (the router could never match its hashes).
    pub block_size: Option<u32>,
    /// The cache salt that the worker's requests are hashed under, if any.
    pub cache_salt: Option<String>,
}

/// Counts of everything a decoder saw, by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeCounts {
    /// Payloads decoded into a batch.
    pub batches: u64,
    /// Payloads rejected whole ([`PayloadError`]).
    pub bad_payloads: u64,
    /// Core events produced.
    pub events: u64,
    /// Blocks in the Stored events produced.
    pub stored_blocks: u64,
    /// Blocks in the Removed events produced.
    pub removed_blocks: u64,
    /// Cleared events produced.
    pub cleared: u64,
    /// Events of an unknown type, skipped.
    pub unknown_types: u64,
    /// Events of an unknown storage medium, skipped.
    pub unknown_media: u64,
    /// Events of a cache group that is not full attention, skipped.
    pub other_groups: u64,
    /// Stored events whose token count is not `block_size` × blocks, skipped.
    pub token_count: u64,
    /// Stored events of a block size other than the worker's, skipped.
    pub block_size: u64,
    /// Other events that could not be read (missing fields, wrong types, bad tokens).
    pub malformed_events: u64,
    /// Blocks stored with extra keys that were not hashed in.
    pub extra_keys_blocks: u64,
}

impl DecodeCounts {
    /// Events skipped for any reason.
    pub fn skipped(&self) -> u64 {
        self.unknown_types
            + self.unknown_media
            + self.other_groups
            + self.token_count
            + self.block_size
            + self.malformed_events
    }
}

/// What one batch became.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOutcome {
    /// The rank the events were attributed to.
    pub source: WorkerRank,
    /// Core events appended.
    pub produced: usize,
    /// Engine events skipped (each counted by kind in [`DecodeCounts`]).
    pub skipped: usize,
}

/// Decodes one worker's payloads into core events, learning its cache groups as it goes.
#[derive(Debug, Clone)]
pub struct EngineDecoder {
    config: DecoderConfig,
    /// Whether each cache group seen on a Stored event is full attention.
    groups: HashMap<u64, bool>,
    counts: DecodeCounts,
}

impl EngineDecoder {
    /// A decoder for the worker `config` describes.
    pub fn new(config: DecoderConfig) -> Self {
        EngineDecoder {
            config,
            groups: HashMap::new(),
            counts: DecodeCounts::default(),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// What it has seen so far.
    pub fn counts(&self) -> DecodeCounts {
        self.counts
    }

    /// Forgets the cache groups learned (after the engine restarted).
    pub fn reset_groups(&mut self) {
        self.groups.clear();
    }

    /// Decodes one payload and appends its core events to `out`, numbered from `next_id`
    /// (advanced past them). A payload error appends nothing.
    pub fn decode(
        &mut self,
        payload: &[u8],
        next_id: &mut EventId,
        out: &mut Vec<KvEvent>,
    ) -> Result<BatchOutcome, PayloadError> {
        match decode_batch(payload) {
            Ok(batch) => Ok(self.convert(&batch, next_id, out)),
            Err(e) => {
                self.counts.bad_payloads += 1;
                Err(e)
            }
        }
    }

    /// Converts a decoded batch (see [`decode_batch`]), as [`decode`](Self::decode) does.
    pub fn convert(
        &mut self,
        batch: &EngineBatch<'_>,
        next_id: &mut EventId,
        out: &mut Vec<KvEvent>,
    ) -> BatchOutcome {
        self.counts.batches += 1;
        let source = WorkerRank {
            worker: self.config.worker,
            dp_rank: batch.dp_rank.map_or(self.config.dp_rank, DpRank),
        };
        let mut outcome = BatchOutcome {
            source,
            produced: 0,
            skipped: 0,
        };
        for event in &batch.events {
            let converted = match event {
                Ok(event) => self.convert_event(event),
                Err(e) => Err(e.clone()),
            };
            match converted {
                Ok(Some((tier, data))) => {
                    self.count_produced(&data);
                    out.push(KvEvent {
                        header: EventHeader {
                            source,
                            event_id: *next_id,
                            tier,
                        },
                        data,
                    });
                    next_id.0 = next_id.0.wrapping_add(1);
                    outcome.produced += 1;
                }
                Ok(None) => {
                    self.counts.other_groups += 1;
                    outcome.skipped += 1;
                }
                Err(e) => {
                    self.count_rejected(&e);
                    outcome.skipped += 1;
                }
            }
        }
        outcome
    }

    fn count_produced(&mut self, data: &KvEventData) {
        self.counts.events += 1;
        match data {
            KvEventData::Stored { blocks, .. } => self.counts.stored_blocks += blocks.len() as u64,
            KvEventData::Removed { blocks } => self.counts.removed_blocks += blocks.len() as u64,
            KvEventData::Cleared => self.counts.cleared += 1,
        }
    }

    fn count_rejected(&mut self, e: &EventError) {
        let counter = match e {
            EventError::UnknownType { .. } => &mut self.counts.unknown_types,
            EventError::UnknownMedium { .. } => &mut self.counts.unknown_media,
            EventError::TokenCount { .. } => &mut self.counts.token_count,
            EventError::BlockSize { .. } => &mut self.counts.block_size,
            EventError::NotAnEvent { .. }
            | EventError::NoType
            | EventError::MissingField { .. }
            | EventError::WrongType { .. }
            | EventError::BadToken { .. }
            | EventError::EmptyHash { .. } => &mut self.counts.malformed_events,
        };
        *counter += 1;
    }

    /// One event: its tier and payload, `None` for a group that does not route, or why not.
    fn convert_event(
        &mut self,
        event: &EngineEvent<'_>,
    ) -> Result<Option<(StorageTier, KvEventData)>, EventError> {
        match event {
            EngineEvent::Stored(stored) => self.convert_stored(stored),
            EngineEvent::Removed(removed) => self.convert_removed(removed),
            EngineEvent::AllCleared => Ok(Some((StorageTier::Device, KvEventData::Cleared))),
        }
    }

    fn convert_stored(
        &mut self,
        s: &BlockStored<'_>,
    ) -> Result<Option<(StorageTier, KvEventData)>, EventError> {
        let tier = tier(s.medium)?;
        let routes = match s.spec_kind {
            Some(kind) => {
                let full = is_full_attention(kind);
                self.groups.insert(s.group_idx.unwrap_or(0), full);
                full
            }
            None => self.group_routes(s.group_idx),
        };
        if !routes {
            return Ok(None);
        }
        if let Some(expected) = self.config.block_size {
            if s.block_size != u64::from(expected) {
                return Err(EventError::BlockSize {
                    found: s.block_size,
                    expected,
                });
            }
        }
        let block_size = usize::try_from(s.block_size).unwrap_or(usize::MAX);
        let fits = block_size > 0
            && block_size
                .checked_mul(s.block_hashes.len())
                .is_some_and(|n| n == s.token_ids.len());
        if !fits {
            return Err(EventError::TokenCount {
                tokens: s.token_ids.len(),
                blocks: s.block_hashes.len(),
                block_size: s.block_size,
            });
        }
        self.counts.extra_keys_blocks += blocks_with_extra_keys(s.extra_keys);
        let unnamed_lora = match (s.lora_name, s.lora_id) {
            (None, Some(id)) => Some(format!("lora-id:{id}")),
            _ => None,
        };
        let lora = s.lora_name.or(unnamed_lora.as_deref());
        let seed = HashSeed::new(lora, self.config.cache_salt.as_deref());
        let hasher = BlockHasher::new(block_size).with_seed(seed);
        let blocks = s
            .block_hashes
            .iter()
            .zip(s.token_ids.chunks_exact(block_size))
            .map(|(&block_hash, tokens)| StoredBlock {
                block_hash,
                local_hash: hasher.local_hash(tokens),
            })
            .collect();
        Ok(Some((
            tier,
            KvEventData::Stored {
                parent: s.parent,
                blocks,
            },
        )))
    }

    fn convert_removed(
        &mut self,
        r: &BlockRemoved<'_>,
    ) -> Result<Option<(StorageTier, KvEventData)>, EventError> {
        let tier = tier(r.medium)?;
        if !self.group_routes(r.group_idx) {
            return Ok(None);
        }
        Ok(Some((
            tier,
            KvEventData::Removed {
                blocks: r.block_hashes.clone(),
            },
        )))
    }

    /// Whether a group routes, from what its Stored events said (group 0 when none did).
    fn group_routes(&self, group_idx: Option<u64>) -> bool {
        let group = group_idx.unwrap_or(0);
        self.groups.get(&group).copied().unwrap_or(group == 0)
    }
}

fn tier(medium: Option<&str>) -> Result<StorageTier, EventError> {
    tier_of_medium(medium).ok_or_else(|| EventError::UnknownMedium {
        medium: medium.unwrap_or_default().to_owned(),
    })
}

/// How many entries of a raw `extra_keys` list are not nil.
fn blocks_with_extra_keys(raw: Option<&[u8]>) -> u64 {
    let Some(raw) = raw else { return 0 };
    let mut r = Reader::new(raw);
    let Ok(Item::Array(n)) = r.read() else {
        return 0;
    };
    let mut with_keys = 0;
    for _ in 0..n {
        let before = r.clone();
        match r.read() {
            Ok(Item::Nil) => {}
            Ok(_) => {
                with_keys += 1;
                r = before;
                if r.skip().is_err() {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    with_keys
}
