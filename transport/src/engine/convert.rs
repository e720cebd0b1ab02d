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
//! * **Extra keys.** vLLM names, per block, what else entered its hash (`extra_keys`): the LoRA
//!   name, a request's `cache_salt` (on its first block only: the engine's chained hashes carry
//!   it on), multimodal identifiers, prompt-embedding hashes. The LoRA name seeds every block
//!   already. A salt on a chain's first block seeds that block and every block stored below it,
//!   as a salted request's hashes are seeded ([`HashSeed::new`]); the decoder remembers the
//!   salted blocks of each rank by engine hash, so that a later event continuing one (its
//!   `parent_block_hash`) is seeded alike, and forgets each when its last copy is removed. Any other key
//!   (an image's identifier, a salt past the first block) makes the block *opaque*: hashed
//!   with a seed drawn from its keys, so that no request the router can hash matches it or
//!   anything below it, rather than matching a different image's blocks by their placeholder
//!   tokens. Opaque blocks are counted ([`DecodeCounts::opaque_blocks`]). One string alone on
//!   a chain's first block is taken for a salt: vLLM writes a salt and an image's identifier
//!   alike as a bare string, so a prompt that opens with an image, with no salt, is seeded by
//!   the image's identifier; its blocks then match only a request whose `cache_salt` is that
//!   identifier. Salted blocks are kept per rank and tier: a copy removed from one tier leaves
//!   the other's.

use std::collections::HashMap;

use kvroute_core::{
    BlockHash, BlockHasher, DpRank, EventHeader, EventId, HashSeed, KvEvent, KvEventData,
    StorageTier, StoredBlock, WorkerId, WorkerRank,
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
    /// Blocks stored with extra keys other than the LoRA name and a chain's cache salt: hashed
    /// so that no request matches them (multimodal inputs).
    pub opaque_blocks: u64,
    /// Blocks stored under a request's cache salt.
    pub salted_blocks: u64,
    /// Stored events whose `extra_keys` list does not have one entry per block (applied, blocks
    /// without an entry taking no keys).
    pub extra_keys_mismatch: u64,
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
    /// The seed of each stored block hashed under a request's cache salt, by rank and engine
    /// hash: what a Stored event continuing it is seeded with; and the copies stored (an
    /// engine may hold a block twice and remove each copy on its own).
    salted: HashMap<(DpRank, StorageTier, BlockHash), (HashSeed, u32)>,
    counts: DecodeCounts,
}

impl EngineDecoder {
    /// A decoder for the worker `config` describes.
    pub fn new(config: DecoderConfig) -> Self {
        EngineDecoder {
            config,
            groups: HashMap::new(),
            salted: HashMap::new(),
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

    /// Forgets what it learned of the engine: its cache groups and its salted blocks (after
    /// the engine restarted).
    pub fn reset(&mut self) {
        self.groups.clear();
        self.salted.clear();
    }

    /// Forgets the salted blocks of one rank (its blocks left the index).
    pub fn forget_rank(&mut self, dp_rank: DpRank) {
        if !self.salted.is_empty() {
            self.salted.retain(|&(rank, _, _), _| rank != dp_rank);
        }
    }

    /// Salted blocks remembered (each once, whatever its copies), over all ranks.
    pub fn salted_blocks_held(&self) -> usize {
        self.salted.len()
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
                Ok(event) => self.convert_event(source.dp_rank, event),
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
        rank: DpRank,
        event: &EngineEvent<'_>,
    ) -> Result<Option<(StorageTier, KvEventData)>, EventError> {
        match event {
            EngineEvent::Stored(stored) => self.convert_stored(rank, stored),
            EngineEvent::Removed(removed) => self.convert_removed(rank, removed),
            EngineEvent::AllCleared => {
                self.forget_rank(rank);
                Ok(Some((StorageTier::Device, KvEventData::Cleared)))
            }
        }
    }

    fn convert_stored(
        &mut self,
        rank: DpRank,
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
        let unnamed_lora = match (s.lora_name, s.lora_id) {
            (None, Some(id)) => Some(format!("lora-id:{id}")),
            _ => None,
        };
        let lora = s.lora_name.or(unnamed_lora.as_deref());
        let base = HashSeed::new(lora, self.config.cache_salt.as_deref());
        let keys = match s.extra_keys {
            Some(raw) => block_keys(raw, s.lora_name)?,
            None => Vec::new(),
        };
        if !keys.is_empty() && keys.len() != s.block_hashes.len() {
            // vLLM sends one entry per block; blocks past a short list take no keys.
            self.counts.extra_keys_mismatch += 1;
        }
        // The seed the chain carries: a salted parent's (on this tier, else on the device),
        // else the worker's.
        let mut chain = match s.parent {
            Some(parent) if !self.salted.is_empty() => self
                .salted
                .get(&(rank, tier, parent))
                .or_else(|| self.salted.get(&(rank, StorageTier::Device, parent)))
                .map_or(base, |&(seed, _)| seed),
            _ => base,
        };
        let mut blocks = Vec::with_capacity(s.block_hashes.len());
        for (i, (&block_hash, tokens)) in s
            .block_hashes
            .iter()
            .zip(s.token_ids.chunks_exact(block_size))
            .enumerate()
        {
            let seed = match keys.get(i).copied().unwrap_or(BlockKeys::Plain) {
                BlockKeys::Plain => chain,
                BlockKeys::Salt(salt) if i == 0 && s.parent.is_none() => {
                    chain = HashSeed::new(lora, Some(salt));
                    chain
                }
                BlockKeys::Salt(salt) => opaque_seed(chain, salt.as_bytes()),
                BlockKeys::Opaque(raw) => opaque_seed(chain, raw),
            };
            if seed == chain && chain != base {
                let held = self
                    .salted
                    .entry((rank, tier, block_hash))
                    .or_insert((chain, 0));
                held.1 = held.1.saturating_add(1);
                self.counts.salted_blocks += 1;
            } else if seed != chain {
                self.counts.opaque_blocks += 1;
            }
            blocks.push(StoredBlock {
                block_hash,
                local_hash: BlockHasher::new(block_size)
                    .with_seed(seed)
                    .local_hash(tokens),
            });
        }
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
        rank: DpRank,
        r: &BlockRemoved<'_>,
    ) -> Result<Option<(StorageTier, KvEventData)>, EventError> {
        let tier = tier(r.medium)?;
        if !self.group_routes(r.group_idx) {
            return Ok(None);
        }
        if !self.salted.is_empty() {
            for &hash in &r.block_hashes {
                let key = (rank, tier, hash);
                if let Some(entry) = self.salted.get_mut(&key) {
                    entry.1 = entry.1.saturating_sub(1);
                    if entry.1 == 0 {
                        self.salted.remove(&key);
                    }
                }
            }
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

/// What one block's extra keys add to its hash, beyond the LoRA name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKeys<'a> {
    /// Nothing.
    Plain,
    /// One string: a cache salt where it opens a chain.
    Salt(&'a str),
    /// Anything else (multimodal identifiers, embeddings), as its msgpack bytes.
    Opaque(&'a [u8]),
}

/// Each block's [`BlockKeys`] from a raw `extra_keys` list (one entry per block, nil or an
/// array), the event's `lora_name` taken out of each entry once.
fn block_keys<'a>(raw: &'a [u8], lora: Option<&str>) -> Result<Vec<BlockKeys<'a>>, EventError> {
    let malformed = |found: &'static str| EventError::WrongType {
        field: "extra_keys",
        found,
    };
    let mut r = Reader::new(raw);
    let n = match r.read() {
        Ok(Item::Array(n)) => n,
        Ok(Item::Nil) => return Ok(Vec::new()),
        Ok(other) => return Err(malformed(other.kind())),
        Err(_) => return Err(malformed("bad msgpack")),
    };
    let mut keys = Vec::with_capacity(r.capacity_for(n));
    for _ in 0..n {
        let start = r.pos();
        let at_start = r.clone();
        let entry = match r.read() {
            Ok(Item::Nil) => BlockKeys::Plain,
            Ok(Item::Array(m)) => {
                let mut lora_seen = false;
                let (mut strings, mut others) = (Vec::new(), 0u32);
                for _ in 0..m {
                    let before = r.clone();
                    match r.read() {
                        Ok(Item::Str(s))
                            if !lora_seen && lora.is_some_and(|l| l.as_bytes() == s) =>
                        {
                            lora_seen = true;
                        }
                        Ok(Item::Str(s)) => strings.push(s),
                        Ok(_) => {
                            r = before;
                            r.skip().map_err(|_| malformed("bad msgpack"))?;
                            others += 1;
                        }
                        Err(_) => return Err(malformed("bad msgpack")),
                    }
                }
                match (strings.as_slice(), others) {
                    ([], 0) => BlockKeys::Plain,
                    ([salt], 0) => match std::str::from_utf8(salt) {
                        Ok(salt) if !salt.is_empty() => BlockKeys::Salt(salt),
                        _ => BlockKeys::Opaque(r.since(start)),
                    },
                    _ => BlockKeys::Opaque(r.since(start)),
                }
            }
            Ok(_) => {
                r = at_start;
                r.skip().map_err(|_| malformed("bad msgpack"))?;
                BlockKeys::Opaque(r.since(start))
            }
            Err(_) => return Err(malformed("bad msgpack")),
        };
        keys.push(entry);
    }
    Ok(keys)
}

/// The seed of an opaque block: the chain's, moved by its keys' bytes (FNV-1a, then mixed),
/// so that it equals no seed a request is hashed with.
fn opaque_seed(chain: HashSeed, keys: &[u8]) -> HashSeed {
    let fnv = keys.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    HashSeed(kvroute_core::mix64(chain.0 ^ fnv ^ 0x6f70_6171_7565))
}
