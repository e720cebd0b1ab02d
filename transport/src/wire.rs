//! The messages of the wire protocol, as rkyv archives.
//!
//! ```text
//!  worker ──Hello──────────────▶ router      who I am: ranks, capacity, block size, role
//!  worker ──Heartbeat──────────▶ router      load per rank
//!  worker ──KvEventBatch───────▶ router      Stored / Removed / Cleared, per rank, with event ids
//!  router ──Dispatch───────────▶ worker      a request: tokens, sampling, hints, bootstrap
//!  worker ──ResponseItem───────▶ router      tokens as they come, then a finish reason
//!  router ──Cancel─────────────▶ worker
//!  router ──RecoveryRequest────▶ worker      events after id N, or a full snapshot
//!  worker ──RecoveryReply──────▶ router
//!  either ──ErrorMessage───────▶ other
//! ```
//!
//! Each message is its own rkyv root type, named by the frame header's [`MessageKind`], so a
//! receiver reads exactly the type the sender wrote and validates it (bytecheck) before use:
//! [`crate::frame::FrameDecoder::validate`] turns a frame into a [`MessageRef`], a typed view
//! into the received bytes. Nothing is deserialized on that path; [`MessageRef::deserialize`]
//! builds an owned [`Message`] when one is wanted.
//!
//! The wire types are separate from the core's: they are a contract with other processes and
//! change only with [`PROTOCOL_VERSION`], while the core's types are free to change. Identities
//! are plain integers here (an archived `u64` is a little-endian `u64_le`); the conversions at
//! the bottom of this module put the core's newtypes back.

use kvroute_core::{
    BlockHash, DpRank, EventHeader, EventId, KvEvent, KvEventData, LocalHash, StorageTier,
    StoredBlock, WorkerId, WorkerRank,
};
use kvroute_core::{KvEvents, WorkerConfig, WorkerRole};
use rkyv::{Archive, Deserialize, Serialize};

/// The protocol version this build speaks; a frame of any other version is rejected.
pub const PROTOCOL_VERSION: u16 = 1;

/// What a frame carries: the rkyv root type of its payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MessageKind {
    /// [`Hello`]: a worker's first message on a connection.
    Hello = 1,
    /// [`Heartbeat`]: a worker's periodic load report.
    Heartbeat = 2,
    /// [`KvEventBatch`]: a worker's KV events.
    KvEvents = 3,
    /// [`Dispatch`]: a request sent to a worker.
    Dispatch = 4,
    /// [`ResponseItem`]: one item of a request's response stream.
    Response = 5,
    /// [`Cancel`]: stop a request.
    Cancel = 6,
    /// [`RecoveryRequest`]: ask a worker to resend a rank's KV state.
    RecoveryRequest = 7,
    /// [`RecoveryReply`]: the answer to a recovery request.
    RecoveryReply = 8,
    /// [`ErrorMessage`]: an error reported to the peer.
    Error = 9,
}

impl MessageKind {
    /// Every kind, in code order.
    pub const ALL: [MessageKind; 9] = [
        MessageKind::Hello,
        MessageKind::Heartbeat,
        MessageKind::KvEvents,
        MessageKind::Dispatch,
        MessageKind::Response,
        MessageKind::Cancel,
        MessageKind::RecoveryRequest,
        MessageKind::RecoveryReply,
        MessageKind::Error,
    ];

    /// The kind with code `code`, if any.
    pub fn from_code(code: u8) -> Option<MessageKind> {
        MessageKind::ALL.into_iter().find(|k| *k as u8 == code)
    }

    /// The byte the frame header carries.
    pub const fn code(self) -> u8 {
        self as u8
    }
}

// ---- registration and load ----

/// What a worker does with a request.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub enum Role {
    /// Prefill and decode (the core's [`WorkerRole::Aggregated`]).
    Aggregated,
    /// Prompts only ([`WorkerRole::Prefill`]).
    Prefill,
    /// Generation only ([`WorkerRole::Decode`]).
    Decode,
}

/// A free-form label of a worker (zone, GPU type, ...).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct Label {
    /// The label's name.
    pub key: String,
    /// Its value.
    pub value: String,
}

/// The first message of a worker on a connection: who it is and what it holds.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct Hello {
    /// The version the worker speaks (also in every frame header; here so that a router can
    /// log it with the worker's identity).
    pub protocol_version: u16,
    /// The worker's id (the core's [`WorkerId`]).
    pub worker_id: u64,
    /// The worker's data-parallel ranks are `dp_start .. dp_start + dp_size`.
    pub dp_start: u32,
    /// How many data-parallel ranks it has (≥ 1).
    pub dp_size: u32,
    /// KV cache capacity of each rank, in blocks.
    pub kv_blocks: u64,
    /// Tokens per KV block.
    pub block_size: u32,
    /// What it does with a request.
    pub role: Role,
    /// Most tokens the engine batches in one step.
    pub max_batched_tokens: u64,
    /// Its labels, for routing constraints.
    pub labels: Vec<Label>,
}

/// The load of one rank, as the worker measures it.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct RankLoad {
    /// The rank.
    pub dp_rank: u32,
    /// KV blocks in use.
    pub active_blocks: u64,
    /// KV blocks the rank has.
    pub total_blocks: u64,
    /// Requests running.
    pub running: u32,
    /// Requests waiting in the engine's own queue.
    pub waiting: u32,
}

/// A periodic liveness and load report.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct Heartbeat {
    /// The worker reporting.
    pub worker_id: u64,
    /// Grows by one per heartbeat of the connection.
    pub seq: u64,
    /// The load of each of its ranks.
    pub ranks: Vec<RankLoad>,
}

// ---- KV events ----

/// Where a cached block lives (the core's [`StorageTier`]).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub enum WireTier {
    /// GPU memory.
    Device,
    /// Pinned host memory.
    HostPinned,
    /// Local disk.
    Disk,
    /// A store outside the worker.
    External,
}

/// One block of a Stored event: the engine's name for it and the hash of its tokens.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct WireBlock {
    /// The engine's name for the block (the core's [`BlockHash`]).
    pub block_hash: u64,
    /// The hash of the block's tokens (the core's [`LocalHash`]).
    pub local_hash: u64,
}

/// The payload of a KV event (the core's [`KvEventData`]).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub enum WireEventData {
    /// Blocks stored in prompt order, continuing the chain after `parent`.
    Stored {
        /// The engine's name of the block the chain continues from (`None`: a prompt's start).
        parent: Option<u64>,
        /// The blocks, in prompt order.
        blocks: Vec<WireBlock>,
    },
    /// Blocks evicted, by engine name.
    Removed {
        /// The engine's names of the blocks.
        hashes: Vec<u64>,
    },
    /// The rank dropped its whole cache.
    Cleared,
}

/// One KV event of one rank of the batch's worker.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct WireEvent {
    /// The rank the event comes from.
    pub dp_rank: u32,
    /// The rank's event sequence number.
    pub event_id: u64,
    /// The tier the event is about.
    pub tier: WireTier,
    /// What happened.
    pub data: WireEventData,
}

/// KV events of one worker, in the order they happened on each rank.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct KvEventBatch {
    /// The worker whose ranks the events come from.
    pub worker_id: u64,
    /// When the batch was sent, in microseconds since the Unix epoch by the worker's clock
    /// (0 when unknown); for measuring event lag only.
    pub sent_at_us: u64,
    /// The events.
    pub events: Vec<WireEvent>,
}

// ---- requests ----

/// The sampling and stopping essentials of a request.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct Sampling {
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Fewest tokens to generate before a stop counts.
    pub min_tokens: u32,
    /// Sampling temperature (0: greedy).
    pub temperature: f32,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches this.
    pub top_p: f32,
    /// 0: off.
    pub top_k: u32,
    /// Seed of the sampler, for reproducible output.
    pub seed: Option<u64>,
    /// Tokens that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation.
    pub stop_strings: Vec<String>,
    /// Keep generating past the end-of-sequence token.
    pub ignore_eos: bool,
}

/// What the router decided and knows about a request, for the worker.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct DispatchHints {
    /// The data-parallel rank chosen.
    pub dp_rank: u32,
    /// Leading blocks of the prompt the router believes the rank holds.
    pub overlap_blocks: u32,
    /// The LoRA adapter to serve the request with.
    pub lora_name: Option<String>,
    /// Higher goes first in the engine's queue.
    pub priority: i32,
    /// Generated tokens expected, when the caller said.
    pub expected_output_tokens: Option<u32>,
}

/// Where a decode worker meets the prefill worker that computed a request's KV cache.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct Bootstrap {
    /// Host of the prefill worker's KV transfer endpoint.
    pub host: String,
    /// Its port.
    pub port: u16,
    /// The id both workers use for this request's transfer.
    pub room: u64,
}

/// A request sent to a worker.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct Dispatch {
    /// The request's id, unique among the connection's requests in flight.
    pub request_id: u64,
    /// The prompt's tokens.
    pub tokens: Vec<u32>,
    /// How to sample and when to stop.
    pub sampling: Sampling,
    /// What the router decided and knows.
    pub hints: DispatchHints,
    /// Where to meet the prefill worker, in disaggregated serving.
    pub bootstrap: Option<Bootstrap>,
}

/// Why a response stream ended.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub enum FinishReason {
    /// A stop token or string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by the router ([`Cancel`]).
    Cancelled,
    /// The item's `error` says what went wrong.
    Error,
}

/// One item of a request's response stream; the last one has a finish reason.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct ResponseItem {
    /// The request.
    pub request_id: u64,
    /// Tokens generated since the previous item.
    pub tokens: Vec<u32>,
    /// Set on the last item only.
    pub finish: Option<FinishReason>,
    /// What went wrong, with [`FinishReason::Error`].
    pub error: Option<String>,
}

/// Stop a request; the worker answers with a last item finished `Cancelled`.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct Cancel {
    /// The request to stop.
    pub request_id: u64,
}

// ---- recovery ----

/// What a recovery asks for.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub enum RecoveryFrom {
    /// The events with ids above `event_id`.
    EventsAfter {
        /// The last event id the router applied.
        event_id: u64,
    },
    /// Everything the rank holds.
    Snapshot,
}

/// Ask a worker to resend a rank's KV state (after a gap or an unknown parent).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct RecoveryRequest {
    /// The worker asked.
    pub worker_id: u64,
    /// The rank to resend.
    pub dp_rank: u32,
    /// What to resend.
    pub from: RecoveryFrom,
}

/// How a recovery was answered.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub enum RecoveryMode {
    /// `events` are the events asked for, in order.
    Replay,
    /// `events` start with a Cleared event, then store everything the rank holds.
    Snapshot,
    /// The worker no longer has the events asked for; ask for a snapshot.
    Unavailable,
}

/// The answer to a [`RecoveryRequest`].
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct RecoveryReply {
    /// The worker answering.
    pub worker_id: u64,
    /// The rank resent.
    pub dp_rank: u32,
    /// How the request was answered.
    pub mode: RecoveryMode,
    /// The rank's last event id when the reply was made.
    pub last_event_id: Option<u64>,
    /// The events resent (see `mode`).
    pub events: Vec<WireEvent>,
}

// ---- errors ----

/// What went wrong, for the peer's logs and counters.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub enum ErrorCode {
    /// The peer speaks another protocol version.
    UnsupportedVersion,
    /// A frame did not decode or validate.
    MalformedFrame,
    /// A message named a request the peer does not have.
    UnknownRequest,
    /// Retryable: the peer is over capacity.
    Overloaded,
    /// The peer is shutting down.
    ShuttingDown,
    /// Anything else.
    Internal,
}

/// An error reported to the peer, about one request or the connection.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[rkyv(derive(Debug))]
pub struct ErrorMessage {
    /// What went wrong.
    pub code: ErrorCode,
    /// The request it is about (`None`: the connection).
    pub request_id: Option<u64>,
    /// For the logs.
    pub message: String,
}

// ---- the message sets ----

macro_rules! messages {
    ($($variant:ident($ty:ident, $archived:ident)),* $(,)?) => {
        /// Any message, owned.
        #[derive(Clone, Debug, PartialEq)]
        #[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
        pub enum Message {
            $(#[doc = concat!("A [`", stringify!($ty), "`].")] $variant($ty),)*
        }

        /// Any message, read in place from a validated frame.
        #[derive(Clone, Copy, Debug)]
        pub enum MessageRef<'a> {
            $(#[doc = concat!("An archived [`", stringify!($ty), "`], in the frame's bytes.")] $variant(&'a $archived),)*
        }

        impl Message {
            /// The kind the frame header names.
            pub fn kind(&self) -> MessageKind {
                match self {
                    $(Message::$variant(_) => MessageKind::$variant,)*
                }
            }
        }

        impl MessageRef<'_> {
            /// The kind the frame header named.
            pub fn kind(&self) -> MessageKind {
                match self {
                    $(MessageRef::$variant(_) => MessageKind::$variant,)*
                }
            }

            /// Deserializes the message (allocates).
            pub fn deserialize(&self) -> Result<Message, rkyv::rancor::Error> {
                Ok(match self {
                    $(MessageRef::$variant(m) => {
                        Message::$variant(rkyv::deserialize::<$ty, rkyv::rancor::Error>(*m)?)
                    })*
                })
            }
        }

        $(
            impl From<$ty> for Message {
                fn from(m: $ty) -> Message {
                    Message::$variant(m)
                }
            }
        )*

        /// Serializes `msg` with `writer` (used by the frame encoder).
        pub(crate) fn serialize_into<W>(
            msg: &Message,
            writer: W,
        ) -> Result<W, rkyv::rancor::Error>
        where
            W: rkyv::ser::Writer<rkyv::rancor::Error>,
        {
            match msg {
                $(Message::$variant(m) => rkyv::api::high::to_bytes_in(m, writer),)*
            }
        }

        /// Validates `payload` as the root type of `kind`.
        pub(crate) fn access(
            kind: MessageKind,
            payload: &[u8],
        ) -> Result<MessageRef<'_>, rkyv::rancor::Error> {
            Ok(match kind {
                $(MessageKind::$variant => MessageRef::$variant(
                    rkyv::access::<$archived, rkyv::rancor::Error>(payload)?,
                ),)*
            })
        }
    };
}

messages! {
    Hello(Hello, ArchivedHello),
    Heartbeat(Heartbeat, ArchivedHeartbeat),
    KvEvents(KvEventBatch, ArchivedKvEventBatch),
    Dispatch(Dispatch, ArchivedDispatch),
    Response(ResponseItem, ArchivedResponseItem),
    Cancel(Cancel, ArchivedCancel),
    RecoveryRequest(RecoveryRequest, ArchivedRecoveryRequest),
    RecoveryReply(RecoveryReply, ArchivedRecoveryReply),
    Error(ErrorMessage, ArchivedErrorMessage),
}

// ---- conversions to and from the core's types ----

/// A core value that has no wire form.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ConversionError {
    /// An event of one worker put in another worker's batch.
    #[error("event of worker {found:?} in a batch of worker {expected:?}")]
    ForeignWorker {
        /// The batch's worker.
        expected: WorkerId,
        /// The event's.
        found: WorkerId,
    },
}

impl From<StorageTier> for WireTier {
    fn from(t: StorageTier) -> WireTier {
        match t {
            StorageTier::Device => WireTier::Device,
            StorageTier::HostPinned => WireTier::HostPinned,
            StorageTier::Disk => WireTier::Disk,
            StorageTier::External => WireTier::External,
        }
    }
}

impl From<WireTier> for StorageTier {
    fn from(t: WireTier) -> StorageTier {
        match t {
            WireTier::Device => StorageTier::Device,
            WireTier::HostPinned => StorageTier::HostPinned,
            WireTier::Disk => StorageTier::Disk,
            WireTier::External => StorageTier::External,
        }
    }
}

impl From<&ArchivedWireTier> for StorageTier {
    fn from(t: &ArchivedWireTier) -> StorageTier {
        match t {
            ArchivedWireTier::Device => StorageTier::Device,
            ArchivedWireTier::HostPinned => StorageTier::HostPinned,
            ArchivedWireTier::Disk => StorageTier::Disk,
            ArchivedWireTier::External => StorageTier::External,
        }
    }
}

impl From<WorkerRole> for Role {
    fn from(r: WorkerRole) -> Role {
        match r {
            WorkerRole::Aggregated => Role::Aggregated,
            WorkerRole::Prefill => Role::Prefill,
            WorkerRole::Decode => Role::Decode,
        }
    }
}

impl From<Role> for WorkerRole {
    fn from(r: Role) -> WorkerRole {
        match r {
            Role::Aggregated => WorkerRole::Aggregated,
            Role::Prefill => WorkerRole::Prefill,
            Role::Decode => WorkerRole::Decode,
        }
    }
}

impl From<&WorkerConfig> for Hello {
    fn from(c: &WorkerConfig) -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            worker_id: c.id.0,
            dp_start: c.dp_start,
            dp_size: c.dp_size,
            kv_blocks: c.kv_blocks,
            block_size: c.block_size,
            role: c.role.into(),
            max_batched_tokens: c.max_batched_tokens,
            labels: c
                .labels
                .iter()
                .map(|(k, v)| Label {
                    key: k.clone(),
                    value: v.clone(),
                })
                .collect(),
        }
    }
}

impl From<&Hello> for WorkerConfig {
    /// The announced configuration, unchecked: the registry validates it.
    fn from(h: &Hello) -> WorkerConfig {
        WorkerConfig {
            id: WorkerId(h.worker_id),
            dp_start: h.dp_start,
            dp_size: h.dp_size,
            kv_blocks: h.kv_blocks,
            block_size: h.block_size,
            role: h.role.into(),
            max_batched_tokens: h.max_batched_tokens,
            labels: h
                .labels
                .iter()
                .map(|l| (l.key.clone(), l.value.clone()))
                .collect(),
            // A native worker sends its KV events over its own connection.
            kv_events: KvEvents::Published,
        }
    }
}

impl WireEvent {
    /// The wire form of a core event (its worker goes in the batch).
    pub fn from_core(event: &KvEvent) -> WireEvent {
        let data = match &event.data {
            KvEventData::Stored { parent, blocks } => WireEventData::Stored {
                parent: parent.map(|p| p.0),
                blocks: blocks
                    .iter()
                    .map(|b| WireBlock {
                        block_hash: b.block_hash.0,
                        local_hash: b.local_hash.0,
                    })
                    .collect(),
            },
            KvEventData::Removed { blocks } => WireEventData::Removed {
                hashes: blocks.iter().map(|b| b.0).collect(),
            },
            KvEventData::Cleared => WireEventData::Cleared,
        };
        WireEvent {
            dp_rank: event.header.source.dp_rank.0,
            event_id: event.header.event_id.0,
            tier: event.header.tier.into(),
            data,
        }
    }

    /// The core event, as sent by a rank of `worker`.
    pub fn to_core(&self, worker: WorkerId) -> KvEvent {
        let data = match &self.data {
            WireEventData::Stored { parent, blocks } => KvEventData::Stored {
                parent: parent.map(BlockHash),
                blocks: blocks
                    .iter()
                    .map(|b| StoredBlock {
                        block_hash: BlockHash(b.block_hash),
                        local_hash: LocalHash(b.local_hash),
                    })
                    .collect(),
            },
            WireEventData::Removed { hashes } => KvEventData::Removed {
                blocks: hashes.iter().copied().map(BlockHash).collect(),
            },
            WireEventData::Cleared => KvEventData::Cleared,
        };
        KvEvent {
            header: EventHeader {
                source: WorkerRank {
                    worker,
                    dp_rank: DpRank(self.dp_rank),
                },
                event_id: EventId(self.event_id),
                tier: self.tier.into(),
            },
            data,
        }
    }
}

impl KvEventBatch {
    /// A batch of `worker`'s events; an event of another worker is an error.
    pub fn from_core<'e>(
        worker: WorkerId,
        sent_at_us: u64,
        events: impl IntoIterator<Item = &'e KvEvent>,
    ) -> Result<KvEventBatch, ConversionError> {
        let events = events
            .into_iter()
            .map(|e| match e.header.source.worker {
                w if w == worker => Ok(WireEvent::from_core(e)),
                found => Err(ConversionError::ForeignWorker {
                    expected: worker,
                    found,
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(KvEventBatch {
            worker_id: worker.0,
            sent_at_us,
            events,
        })
    }

    /// The core events of the batch (allocates; the receive path applies the archived form
    /// instead, see [`crate::apply`]).
    pub fn to_core(&self) -> Vec<KvEvent> {
        let worker = WorkerId(self.worker_id);
        self.events.iter().map(|e| e.to_core(worker)).collect()
    }
}
