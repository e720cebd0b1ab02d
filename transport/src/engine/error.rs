//! What can go wrong decoding an engine's KV-event messages, from the frames inward: a message
//! of the wrong shape ([`FrameLayoutError`]), a payload that is not a batch ([`PayloadError`],
//! whose malformed msgpack is a [`MsgpackError`]), and one event of a good batch that cannot be
//! used ([`EventError`]: the batch goes on without it).

/// The multipart message does not have the layout of the engine's publisher.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum FrameLayoutError {
    /// Not as many frames as the layout has.
    #[error("a {layout} message has {expected} frames, this one has {found}")]
    WrongFrameCount {
        /// Which layout was expected: `"live"` or `"replay"`.
        layout: &'static str,
        /// How many frames that layout has.
        expected: &'static str,
        /// How many frames arrived.
        found: usize,
    },
    /// The sequence number frame is not 8 bytes (a big-endian u64).
    #[error("the sequence frame has {len} bytes instead of 8")]
    SeqLength {
        /// Its length in bytes.
        len: usize,
    },
    /// A replay reply whose first frame, the empty delimiter, is not empty.
    #[error("a replay reply starts with a {len}-byte frame instead of the empty delimiter")]
    MissingDelimiter {
        /// The first frame's length in bytes.
        len: usize,
    },
}

/// The msgpack itself is malformed.
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
pub enum MsgpackError {
    /// The bytes end inside a value.
    #[error("the msgpack ends inside a value (at byte {at})")]
    Truncated {
        /// Where the bytes ran out.
        at: usize,
    },
    /// The one marker byte msgpack reserves, `0xc1`.
    #[error("reserved msgpack marker 0xc1 at byte {at}")]
    ReservedMarker {
        /// Where it sits.
        at: usize,
    },
}

/// The payload is not a batch of KV events. Nothing of it is used.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PayloadError {
    /// Malformed msgpack (truncated, a reserved marker).
    #[error("malformed msgpack: {source}")]
    Malformed {
        /// What is wrong with it.
        #[from]
        source: MsgpackError,
    },
    /// The payload is neither an array `[ts, events, dp_rank]` nor a map.
    #[error("a batch is an array or a map, not {found}")]
    NotABatch {
        /// The kind of value found.
        found: &'static str,
    },
    /// The batch has no events (array shorter than 2, or a map without `events`).
    #[error("the batch has no events field")]
    MissingEvents,
    /// A field of the batch has the wrong type.
    #[error("the batch's {field} is {found}")]
    BatchField {
        /// `"ts"`, `"events"` or `"dp_rank"`.
        field: &'static str,
        /// The kind of value found.
        found: &'static str,
    },
    /// Bytes follow the batch.
    #[error("{extra} bytes follow the batch")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
}

/// One event of a batch cannot be used; the rest of the batch still is.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum EventError {
    /// The event is neither a map nor an array.
    #[error("an event is a map or an array, not {found}")]
    NotAnEvent {
        /// The kind of value found.
        found: &'static str,
    },
    /// The event has no type tag (a map without `"type"`, an empty array, a tag that is not
    /// a string).
    #[error("the event has no type tag")]
    NoType,
    /// A type this decoder does not know (counted, not an error for the batch).
    #[error("unknown event type {name:?}")]
    UnknownType {
        /// The tag, lossily as UTF-8.
        name: String,
    },
    /// A field the event cannot do without is absent or nil.
    #[error("{event} without {field}")]
    MissingField {
        /// The event's type.
        event: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A field holds a value of the wrong kind.
    #[error("{field} is {found}")]
    WrongType {
        /// The field.
        field: &'static str,
        /// The kind of value found.
        found: &'static str,
    },
    /// A token id that is not a u32 (or a pair whose first element is not).
    #[error("token {index} is not a u32 token id or a pair of them")]
    BadToken {
        /// Its position in `token_ids`.
        index: usize,
    },
    /// A block hash that is empty bytes.
    #[error("an empty byte string as a block hash in {field}")]
    EmptyHash {
        /// The field.
        field: &'static str,
    },
    /// A Stored event whose token count is not `block_size` × blocks.
    #[error("{tokens} tokens for {blocks} blocks of {block_size}")]
    TokenCount {
        /// Tokens in the event.
        tokens: usize,
        /// Block hashes in the event.
        blocks: usize,
        /// The event's block size.
        block_size: u64,
    },
    /// A Stored event of a block size other than the worker's.
    #[error("block size {found}, the worker's is {expected}")]
    BlockSize {
        /// The event's.
        found: u64,
        /// The decoder's configuration.
        expected: u32,
    },
    /// A storage medium outside the known set.
    #[error("unknown storage medium {medium:?}")]
    UnknownMedium {
        /// The medium as the engine named it.
        medium: String,
    },
}
