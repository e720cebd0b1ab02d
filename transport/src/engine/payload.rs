//! The payload's schema: a batch and its events, in either of the engines' two encodings,
//! decoded as the engine published them (its hashes, its token ids, its medium's name).
//!
//! ```text
//!  batch  [ts, events, dp_rank, ...]                     array (msgspec array_like)
//!         {"ts": .., "events": .., "data_parallel_rank" | "attn_dp_rank" | "dp_rank": ..}
//!  event  {"type": "BlockStored", "block_hashes": .., ...}                tagged map
//!         ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//!          lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]
//!         ["BlockRemoved", block_hashes, medium, group_idx, ...]
//!         ["AllBlocksCleared", ...]                                        tagged array
//! ```
//!
//! The positional order is the field order of vLLM's `BlockStored` / `BlockRemoved` structs in
//! `vllm/distributed/kv_events.py` (msgspec encodes `array_like` structs in declaration order,
//! trailing defaulted fields omitted); SGLang's structs are a prefix of it. Unknown keys and
//! trailing positions are skipped. An event that cannot be used is an [`EventError`] in its
//! slot and the rest of the batch still decodes: each event is first measured (skipped whole on
//! a copy of the cursor) and then read, so a bad event never leaves the reader out of step.

use kvroute_core::BlockHash;

use super::error::{EventError, MsgpackError, PayloadError};
use super::msgpack::{Item, Reader};

/// One batch of KV events, as the engine published it.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBatch<'a> {
    /// The engine's timestamp (seconds since the epoch), when it sent one.
    pub ts: Option<f64>,
    /// The data-parallel rank the engine named, when it named one.
    pub dp_rank: Option<u32>,
    /// Each event in order: decoded, or why it could not be.
    pub events: Vec<Result<EngineEvent<'a>, EventError>>,
}

/// One KV event, as the engine published it.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent<'a> {
    /// `BlockStored`.
    Stored(BlockStored<'a>),
    /// `BlockRemoved`.
    Removed(BlockRemoved<'a>),
    /// `AllBlocksCleared`.
    AllCleared,
}

/// A `BlockStored` event's fields that matter to a router.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored<'a> {
    /// The engine's names of the blocks, in prompt order.
    pub block_hashes: Vec<BlockHash>,
    /// The engine's name of the block the chain continues from.
    pub parent: Option<BlockHash>,
    /// The blocks' tokens, `block_size` per block (EAGLE pairs reduced to their first token).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u64,
    /// Where the blocks are stored, as the engine names it (`None`: the GPU).
    pub medium: Option<&'a str>,
    /// The LoRA adapter the blocks were computed under.
    pub lora_name: Option<&'a str>,
    /// The adapter's integer id (deprecated in vLLM for `lora_name`; older engines send only
    /// this).
    pub lora_id: Option<u64>,
    /// vLLM's per-block extra keys (multimodal identifiers, LoRA name, cache salt), as the raw
    /// msgpack of the whole list, for a caller that derives seeds from them.
    pub extra_keys: Option<&'a [u8]>,
    /// The KV cache group (hybrid models have several).
    pub group_idx: Option<u64>,
    /// The kind of the group's cache (`"full_attention"`, `"sliding_window"`, ...).
    pub spec_kind: Option<&'a str>,
}

/// A `BlockRemoved` event's fields that matter to a router.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved<'a> {
    /// The engine's names of the blocks evicted.
    pub block_hashes: Vec<BlockHash>,
    /// Where they were stored (`None`: the GPU).
    pub medium: Option<&'a str>,
    /// The KV cache group.
    pub group_idx: Option<u64>,
}

/// Decodes one payload: a batch in the array or the map encoding.
///
/// An error means nothing of the payload is usable (malformed msgpack, not a batch, bytes
/// after it); a bad event is an error in its own slot of [`EngineBatch::events`].
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch<'_>, PayloadError> {
    let mut r = Reader::new(payload);
    let batch = match r.read()? {
        Item::Array(n) => batch_from_array(&mut r, n)?,
        Item::Map(n) => batch_from_map(&mut r, n)?,
        other => {
            return Err(PayloadError::NotABatch {
                found: other.kind(),
            })
        }
    };
    match r.remaining() {
        0 => Ok(batch),
        extra => Err(PayloadError::TrailingBytes { extra }),
    }
}

fn batch_from_array<'a>(r: &mut Reader<'a>, n: u32) -> Result<EngineBatch<'a>, PayloadError> {
    if n < 2 {
        r.skip_rest(n.into())?;
        return Err(PayloadError::MissingEvents);
    }
    let ts = batch_ts(r.read()?)?;
    let events = batch_events(r)?;
    let dp_rank = if n >= 3 {
        batch_dp_rank(r.read()?)?
    } else {
        None
    };
    r.skip_rest(u64::from(n.saturating_sub(3)))?;
    Ok(EngineBatch {
        ts,
        dp_rank,
        events,
    })
}

fn batch_from_map<'a>(r: &mut Reader<'a>, n: u32) -> Result<EngineBatch<'a>, PayloadError> {
    let (mut ts, mut dp_rank, mut events) = (None, None, None);
    for _ in 0..n {
        match r.read()? {
            Item::Str(b"ts") => ts = batch_ts(r.read()?)?,
            Item::Str(b"events") => events = Some(batch_events(r)?),
            Item::Str(b"data_parallel_rank" | b"attn_dp_rank" | b"dp_rank") => {
                dp_rank = batch_dp_rank(r.read()?)?;
            }
            Item::Array(k) => {
                r.skip_rest(k.into())?;
                r.skip()?;
            }
            Item::Map(k) => {
                r.skip_rest(2 * u64::from(k))?;
                r.skip()?;
            }
            _ => r.skip()?,
        }
    }
    Ok(EngineBatch {
        ts,
        dp_rank,
        events: events.ok_or(PayloadError::MissingEvents)?,
    })
}

fn batch_ts(item: Item<'_>) -> Result<Option<f64>, PayloadError> {
    match item {
        Item::Nil => Ok(None),
        Item::Float(f) => Ok(Some(f)),
        Item::Uint(u) => Ok(Some(u as f64)),
        Item::Int(i) => Ok(Some(i as f64)),
        other => Err(PayloadError::BatchField {
            field: "ts",
            found: other.kind(),
        }),
    }
}

fn batch_dp_rank(item: Item<'_>) -> Result<Option<u32>, PayloadError> {
    match item {
        Item::Nil => Ok(None),
        Item::Uint(u) => u32::try_from(u)
            .map(Some)
            .map_err(|_| PayloadError::BatchField {
                field: "dp_rank",
                found: "an integer over u32",
            }),
        other => Err(PayloadError::BatchField {
            field: "dp_rank",
            found: other.kind(),
        }),
    }
}

fn batch_events<'a>(
    r: &mut Reader<'a>,
) -> Result<Vec<Result<EngineEvent<'a>, EventError>>, PayloadError> {
    let n = match r.read()? {
        Item::Array(n) => n,
        other => {
            return Err(PayloadError::BatchField {
                field: "events",
                found: other.kind(),
            })
        }
    };
    let mut events = Vec::with_capacity(r.capacity_for(n));
    for _ in 0..n {
        // Measure the event on a copy (a malformed one fails the batch here), read it from
        // another, then continue after it whatever the reading made of it.
        let mut after = r.clone();
        after.skip()?;
        events.push(read_event(&mut r.clone()));
        *r = after;
    }
    Ok(events)
}

/// The fields an event may carry, filled from either encoding.
#[derive(Default)]
struct Fields<'a> {
    block_hashes: Option<Vec<BlockHash>>,
    parent: Option<BlockHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u64>,
    medium: Option<&'a str>,
    lora_name: Option<&'a str>,
    lora_id: Option<u64>,
    extra_keys: Option<&'a [u8]>,
    group_idx: Option<u64>,
    spec_kind: Option<&'a str>,
}

/// The fields the decoder reads; anything else is skipped.
#[derive(Clone, Copy)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    Medium,
    LoraName,
    LoraId,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    Skip,
}

/// The positions of `BlockStored`'s fields after its tag (vLLM's declaration order).
const STORED_POSITIONS: [Field; 10] = [
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::SpecKind,
];

/// The positions of `BlockRemoved`'s fields after its tag.
const REMOVED_POSITIONS: [Field; 3] = [Field::BlockHashes, Field::Medium, Field::GroupIdx];

fn field_of_key(key: &[u8]) -> Field {
    match key {
        b"block_hashes" => Field::BlockHashes,
        b"parent_block_hash" => Field::Parent,
        b"token_ids" => Field::TokenIds,
        b"block_size" => Field::BlockSize,
        b"medium" => Field::Medium,
        b"lora_name" => Field::LoraName,
        b"lora_id" => Field::LoraId,
        b"extra_keys" => Field::ExtraKeys,
        b"group_idx" => Field::GroupIdx,
        b"kv_cache_spec_kind" => Field::SpecKind,
        _ => Field::Skip,
    }
}

/// The event types, by tag.
#[derive(Clone, Copy)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

fn kind_of_tag(tag: &[u8]) -> Result<Kind, EventError> {
    match tag {
        b"BlockStored" => Ok(Kind::Stored),
        b"BlockRemoved" => Ok(Kind::Removed),
        b"AllBlocksCleared" => Ok(Kind::Cleared),
        other => Err(EventError::UnknownType {
            name: String::from_utf8_lossy(other).into_owned(),
        }),
    }
}

/// Reads one event. Its bytes are known to be well-formed msgpack (measured first), so a
/// msgpack error cannot happen here; were it to, the event would be reported as not an event.
fn read_event<'a>(r: &mut Reader<'a>) -> Result<EngineEvent<'a>, EventError> {
    let mut fields = Fields::default();
    let kind = match next_item(r)? {
        Item::Array(n) => fields_from_array(r, n, &mut fields)?,
        Item::Map(n) => fields_from_map(r, n, &mut fields)?,
        other => {
            return Err(EventError::NotAnEvent {
                found: other.kind(),
            })
        }
    };
    build_event(kind, fields)
}

/// A tagged array: the tag, then the type's fields by position (positions past the known ones
/// are left unread).
fn fields_from_array<'a>(
    r: &mut Reader<'a>,
    n: u32,
    fields: &mut Fields<'a>,
) -> Result<Kind, EventError> {
    if n == 0 {
        return Err(EventError::NoType);
    }
    let kind = match next_item(r)? {
        Item::Str(tag) => kind_of_tag(tag)?,
        _ => return Err(EventError::NoType),
    };
    let positions: &[Field] = match kind {
        Kind::Stored => &STORED_POSITIONS,
        Kind::Removed => &REMOVED_POSITIONS,
        Kind::Cleared => &[],
    };
    for &field in positions.iter().take(n as usize - 1) {
        read_field(r, field, fields)?;
    }
    Ok(kind)
}

/// A tagged map: `"type"` anywhere among the fields, unknown keys skipped.
fn fields_from_map<'a>(
    r: &mut Reader<'a>,
    n: u32,
    fields: &mut Fields<'a>,
) -> Result<Kind, EventError> {
    let mut kind = None;
    for _ in 0..n {
        match next_item(r)? {
            Item::Str(b"type") => match next_item(r)? {
                Item::Str(tag) => kind = Some(kind_of_tag(tag)?),
                _ => return Err(EventError::NoType),
            },
            Item::Str(key) => read_field(r, field_of_key(key), fields)?,
            other => {
                return Err(EventError::WrongType {
                    field: "a map key",
                    found: other.kind(),
                })
            }
        }
    }
    kind.ok_or(EventError::NoType)
}

fn build_event(kind: Kind, f: Fields<'_>) -> Result<EngineEvent<'_>, EventError> {
    match kind {
        Kind::Stored => {
            let missing = |field| EventError::MissingField {
                event: "BlockStored",
                field,
            };
            Ok(EngineEvent::Stored(BlockStored {
                block_hashes: f.block_hashes.ok_or(missing("block_hashes"))?,
                parent: f.parent,
                token_ids: f.token_ids.ok_or(missing("token_ids"))?,
                block_size: f.block_size.ok_or(missing("block_size"))?,
                medium: f.medium,
                lora_name: f.lora_name,
                lora_id: f.lora_id,
                extra_keys: f.extra_keys,
                group_idx: f.group_idx,
                spec_kind: f.spec_kind,
            }))
        }
        Kind::Removed => Ok(EngineEvent::Removed(BlockRemoved {
            block_hashes: f.block_hashes.ok_or(EventError::MissingField {
                event: "BlockRemoved",
                field: "block_hashes",
            })?,
            medium: f.medium,
            group_idx: f.group_idx,
        })),
        Kind::Cleared => Ok(EngineEvent::AllCleared),
    }
}

fn wrong(field: &'static str, item: Item<'_>) -> EventError {
    EventError::WrongType {
        field,
        found: item.kind(),
    }
}

fn malformed(_: MsgpackError) -> EventError {
    EventError::NotAnEvent {
        found: "malformed msgpack",
    }
}

fn next_item<'a>(r: &mut Reader<'a>) -> Result<Item<'a>, EventError> {
    r.read().map_err(malformed)
}

fn read_field<'a>(r: &mut Reader<'a>, field: Field, f: &mut Fields<'a>) -> Result<(), EventError> {
    match field {
        Field::BlockHashes => f.block_hashes = Some(read_hashes(r)?),
        Field::Parent => f.parent = read_opt_hash(r, "parent_block_hash")?,
        Field::TokenIds => f.token_ids = Some(read_tokens(r)?),
        Field::BlockSize => f.block_size = read_opt_uint(r, "block_size")?,
        Field::Medium => f.medium = read_opt_str(r, "medium")?,
        Field::LoraName => f.lora_name = read_opt_str(r, "lora_name")?,
        // Deprecated and informational: anything but an integer reads as none.
        Field::LoraId => {
            f.lora_id = match next_item(r)? {
                Item::Uint(u) => Some(u),
                Item::Array(n) => {
                    r.skip_rest(n.into()).map_err(malformed)?;
                    None
                }
                Item::Map(n) => {
                    r.skip_rest(2 * u64::from(n)).map_err(malformed)?;
                    None
                }
                _ => None,
            }
        }
        Field::ExtraKeys => {
            let start = r.pos();
            match next_item(r)? {
                Item::Nil => f.extra_keys = None,
                Item::Array(n) => {
                    r.skip_rest(n.into()).map_err(malformed)?;
                    f.extra_keys = Some(r.since(start));
                }
                other => return Err(wrong("extra_keys", other)),
            }
        }
        Field::GroupIdx => f.group_idx = read_opt_uint(r, "group_idx")?,
        Field::SpecKind => f.spec_kind = read_opt_str(r, "kv_cache_spec_kind")?,
        Field::Skip => r.skip().map_err(malformed)?,
    }
    Ok(())
}

/// A block hash as vLLM and SGLang send it: an unsigned integer (vLLM; may be >= 2^63), a
/// negative integer (SGLang's hashes are signed 64-bit: the same 64 bits, two's complement),
/// or bytes (vLLM without `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`): their last 8 bytes,
/// big-endian, which is the integer vLLM itself sends with that flag on.
fn hash_of(item: Item<'_>, field: &'static str) -> Result<Option<BlockHash>, EventError> {
    match item {
        Item::Nil => Ok(None),
        Item::Uint(u) => Ok(Some(BlockHash(u))),
        Item::Int(i) => Ok(Some(BlockHash(i as u64))),
        Item::Bin([]) => Err(EventError::EmptyHash { field }),
        Item::Bin(b) => {
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(Some(BlockHash(
                tail.iter()
                    .fold(0_u64, |h, &byte| (h << 8) | u64::from(byte)),
            )))
        }
        other => Err(wrong(field, other)),
    }
}

fn read_opt_hash(r: &mut Reader<'_>, field: &'static str) -> Result<Option<BlockHash>, EventError> {
    hash_of(next_item(r)?, field)
}

fn read_hashes(r: &mut Reader<'_>) -> Result<Vec<BlockHash>, EventError> {
    let n = match next_item(r)? {
        Item::Array(n) => n,
        other => return Err(wrong("block_hashes", other)),
    };
    let mut hashes = Vec::with_capacity(r.capacity_for(n));
    for _ in 0..n {
        match hash_of(next_item(r)?, "block_hashes")? {
            Some(h) => hashes.push(h),
            None => return Err(wrong("block_hashes", Item::Nil)),
        }
    }
    Ok(hashes)
}

/// Token ids: u32s, or EAGLE pairs. SGLang's radix cache under EAGLE keys its tree by bigrams,
/// `[t0, t1, t2, ...]` → `[(t0, t1), (t1, t2), ...]`, so a pair's first element is the token at
/// that position; the second (the next token) is skipped.
fn read_tokens(r: &mut Reader<'_>) -> Result<Vec<u32>, EventError> {
    let n = match next_item(r)? {
        Item::Array(n) => n,
        other => return Err(wrong("token_ids", other)),
    };
    let mut tokens = Vec::with_capacity(r.capacity_for(n));
    for index in 0..n as usize {
        let token = match next_item(r)? {
            Item::Uint(u) => u,
            Item::Array(2) => {
                let first = next_item(r)?;
                r.skip().map_err(malformed)?;
                match first {
                    Item::Uint(u) => u,
                    _ => return Err(EventError::BadToken { index }),
                }
            }
            _ => return Err(EventError::BadToken { index }),
        };
        tokens.push(u32::try_from(token).map_err(|_| EventError::BadToken { index })?);
    }
    Ok(tokens)
}

fn read_opt_uint(r: &mut Reader<'_>, field: &'static str) -> Result<Option<u64>, EventError> {
    match next_item(r)? {
        Item::Nil => Ok(None),
        Item::Uint(u) => Ok(Some(u)),
        other => Err(wrong(field, other)),
    }
}

fn read_opt_str<'a>(
    r: &mut Reader<'a>,
    field: &'static str,
) -> Result<Option<&'a str>, EventError> {
    match next_item(r)? {
        Item::Nil => Ok(None),
        Item::Str(s) => std::str::from_utf8(s)
            .map(Some)
            .map_err(|_| EventError::WrongType {
                field,
                found: "a string that is not UTF-8",
            }),
        other => Err(wrong(field, other)),
    }
}
