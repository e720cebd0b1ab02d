//! The booking sync's messages between the routers of one fleet, as rkyv archives.
//!
//! One message is one [`Envelope`]: who sent it, its place in the sender's sequence, when, and
//! a [`Body`]. Deltas and snapshot parts take the next number of the sender's sequence;
//! heartbeats carry the last number taken, so a receiver that missed the sender's latest
//! message learns it within a heartbeat. The types are a contract between routers of possibly
//! different builds: they change only with [`SYNC_VERSION`].

use rkyv::{Archive, Deserialize, Serialize};

/// The booking sync's version; a message of another version is refused.
pub const SYNC_VERSION: u16 = 1;

/// Largest message a sender builds, in bytes (half of NATS' default `max_payload`): larger
/// batches and snapshots are split.
pub const MAX_MESSAGE_BYTES: usize = 512 << 10;

/// One message of the booking sync.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Envelope {
    /// [`SYNC_VERSION`].
    pub version: u16,
    /// The sender's block size: routers of one fleet must agree on it.
    pub block_size: u32,
    /// The sender's replica id (nonzero).
    pub replica: u64,
    /// The sender's sequence number: the message's own for deltas and snapshot parts, the
    /// last one taken for the others.
    pub seq: u64,
    /// The sender's wall clock when it sent the message, in nanoseconds since the Unix epoch.
    pub sent_unix_ns: u64,
    /// What it says.
    pub body: Body,
}

/// What a message says.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum Body {
    /// Changes to the sender's bookings, in order.
    Deltas(Vec<WireDelta>),
    /// The sender is alive; its last sequence number is the envelope's.
    Heartbeat,
    /// The sender's whole book, in parts: the first part replaces whatever a receiver held
    /// of the sender's, the last closes it.
    Snapshot {
        /// The first part.
        first: bool,
        /// The last part.
        last: bool,
        /// The bookings in this part.
        bookings: Vec<WireBooking>,
    },
    /// The replica `target` (0: every replica) is asked for a snapshot.
    Resync {
        /// Whose snapshot is wanted (0: everyone's).
        target: u64,
    },
    /// The sender is leaving: its bookings go with it.
    Bye,
}

/// One change to a router's bookings.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum WireDelta {
    /// A request was booked.
    Booked(WireBooking),
    /// A request's first token arrived.
    PrefillDone(u64),
    /// A request opened output blocks.
    OutputBlocks {
        /// The request.
        request: u64,
        /// Blocks opened.
        blocks: u64,
        /// Output tokens generated so far.
        generated: u64,
    },
    /// A request ended.
    Freed(u64),
}

/// A booking as the sync carries it: as booked, and (in snapshots) as far as it got.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct WireBooking {
    /// The request, as its router names it.
    pub request: u64,
    /// The worker it was booked on.
    pub worker: u64,
    /// The worker's data-parallel rank.
    pub dp_rank: u32,
    /// Prompt tokens the rank computes.
    pub prefill_tokens: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens predicted cached.
    pub cached_tokens: u64,
    /// Expected output length, when known.
    pub expected_output_tokens: Option<u32>,
    /// Local hashes of the prompt's full blocks.
    pub hashes: Vec<u64>,
    /// Its first token arrived (snapshots only; false in a delta).
    pub prefill_done: bool,
    /// Output blocks opened (snapshots only; 0 in a delta).
    pub output_blocks: u64,
    /// Output tokens generated (snapshots only; 0 in a delta).
    pub generated: u64,
}

impl WireBooking {
    /// About how many bytes the booking takes in a message.
    pub fn size_hint(&self) -> usize {
        96 + 8 * self.hashes.len()
    }
}

/// Why a message could not be read.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum WireError {
    /// The bytes are not a valid message.
    #[error("not a booking-sync message: {0}")]
    Malformed(String),
    /// Another version of the sync.
    #[error("booking-sync version {0}, this router speaks {SYNC_VERSION}")]
    Version(u16),
}

/// The message's bytes.
pub fn encode(e: &Envelope) -> Vec<u8> {
    match rkyv::to_bytes::<rkyv::rancor::Error>(e) {
        Ok(bytes) => bytes.into_vec(),
        // Serializing into a growable buffer fails only when allocation does.
        Err(_) => Vec::new(),
    }
}

/// The message in `bytes` as it lies there, validated before use (no copy, nothing
/// allocated); refuses another version. `bytes` must be aligned to 16 (an rkyv `AlignedVec`).
pub fn access(bytes: &[u8]) -> Result<&ArchivedEnvelope, WireError> {
    let e = rkyv::access::<ArchivedEnvelope, rkyv::rancor::Error>(bytes)
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    let version = e.version.to_native();
    if version != SYNC_VERSION {
        return Err(WireError::Version(version));
    }
    Ok(e)
}

/// Reads a message into owned values, validated before use; refuses another version.
pub fn decode(bytes: &[u8]) -> Result<Envelope, WireError> {
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    let e = rkyv::from_bytes::<Envelope, rkyv::rancor::Error>(&aligned)
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    if e.version != SYNC_VERSION {
        return Err(WireError::Version(e.version));
    }
    Ok(e)
}
