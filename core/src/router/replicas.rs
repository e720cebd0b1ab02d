//! Several routers, one fleet: this router's bookings told to the fleet's other routers
//! ([`Router::on_booking`]), and theirs applied to its load ([`Router::apply_remote`]).
//!
//! ```text
//!   route / prefill_done / output_block / tokens_generated / free
//!        │ (after the ledger moved)
//!        ▼
//!   on_booking sink ──BookingDelta──▶ the embedder's transport (serve: NATS) ──▶ other routers
//!   other routers ──▶ transport ──▶ apply_remote(from, delta) ──▶ Ledger (origin = from)
//!                                   drop_replica(from)  ◀── the transport saw `from` go quiet
//! ```
//!
//! * **One load, two origins.** A remote booking lives in the same ledger as a local one, keyed
//!   by its router's [`ReplicaId`] beside its id, and moves the same rank counters: its
//!   prefill tokens until its first token, its prompt blocks (deduplicated against every other
//!   active prompt on the rank, local or remote), its output blocks. Selection cannot tell
//!   the two apart, so several routers see one fleet's load.
//! * **Best effort.** Deltas may be late, lost or repeated: a booking already held is refused
//!   ([`LoadError::DuplicateRequest`]), a step for one unknown is refused and changes nothing,
//!   and every booking, local or remote, expires after the configured
//!   [`RouterConfig::request_expiry`](crate::config::RouterConfig). A router that goes quiet
//!   is dropped whole ([`Router::drop_replica`]), which the transport decides.
//! * **What is not shared.** Sessions stay with the router that bound them; expiry and a
//!   worker's leaving are applied by every router on its own; records of approximate ranks
//!   (workers that publish no KV events) are shared, as the booking itself carries the prompt.

use std::sync::Arc;

use super::Router;
use crate::approx::checkpoint_keys_extend;
use crate::event::WorkerRank;
use crate::hash::LocalHash;
use crate::load::{BookingSpec, Key, LoadError, RequestId};
use crate::registry::RankEntry;

/// Another router of the same fleet: a nonzero id it chose at its start (a restarted router
/// is a new one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaId(pub u64);

/// One request booked on a rank, as its router tells the fleet's other routers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteBooking<'a> {
    /// The request, as its own router names it.
    pub request: RequestId,
    /// The rank it was booked on.
    pub rank: WorkerRank,
    /// Prompt tokens the rank must compute.
    pub prefill_tokens: u64,
    /// Local hashes of the prompt's full blocks (as far as it was tokenized).
    pub block_hashes: &'a [LocalHash],
    /// Prompt tokens (the ISL).
    pub prompt_tokens: u64,
    /// Prompt tokens predicted cached on the rank.
    pub cached_tokens: u64,
    /// Expected output length, when known.
    pub expected_output_tokens: Option<u32>,
}

/// A change to a router's bookings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BookingDelta<'a> {
    /// A request was booked.
    Booked(RemoteBooking<'a>),
    /// Its first token arrived: its prefill tokens are no longer pending.
    PrefillDone(RequestId),
    /// Its generation opened `blocks` more output blocks.
    OutputBlocks {
        /// The request.
        request: RequestId,
        /// Blocks opened since the last delta.
        blocks: u64,
        /// Output tokens generated, as its router counts them (its blocks' decay follows).
        generated: u64,
    },
    /// It ended: everything it booked is released.
    Freed(RequestId),
}

impl BookingDelta<'_> {
    /// The request the delta is about.
    pub fn request(&self) -> RequestId {
        match *self {
            BookingDelta::Booked(b) => b.request,
            BookingDelta::PrefillDone(r) | BookingDelta::Freed(r) => r,
            BookingDelta::OutputBlocks { request, .. } => request,
        }
    }
}

/// Most output blocks one delta may open (a larger count is refused as malformed).
pub const MAX_DELTA_OUTPUT_BLOCKS: u64 = 1 << 16;

/// Why a remote delta was not applied.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum RemoteError {
    /// Replica id 0 is reserved for this router's own bookings.
    #[error("replica id 0 is reserved")]
    ReservedReplica,
    /// The rank is not in this router's fleet (not joined yet, or gone).
    #[error("rank {0} is not in this router's fleet")]
    UnknownRank(WorkerRank),
    /// The delta contradicts itself.
    #[error("malformed delta: {0}")]
    Malformed(&'static str),
    /// The ledger refused it (a booking already held, a step for one not held).
    #[error(transparent)]
    Load(#[from] LoadError),
}

/// The embedder's handler of this router's booking changes ([`Router::on_booking`]).
pub type BookingSink = Box<dyn Fn(&BookingDelta<'_>) + Send + Sync>;

impl Router {
    /// Tells `sink` of every change to this router's own bookings, right after the ledger
    /// moved: a booked route, a first token, output blocks opened, a free. Remote deltas are
    /// not echoed. Set it once, before routing; returns false (and keeps the first) when one
    /// is set already. The sink runs on the routing thread: it should only queue the delta.
    pub fn on_booking(&self, sink: impl Fn(&BookingDelta<'_>) + Send + Sync + 'static) -> bool {
        self.booking_sink.set(Box::new(sink)).is_ok()
    }

    /// Hands `delta` to the booking sink, if one is set.
    #[inline(always)]
    pub(super) fn tell<'a>(&self, delta: impl FnOnce() -> BookingDelta<'a>) {
        if let Some(sink) = self.booking_sink.get() {
            sink(&delta());
        }
    }

    /// Applies another router's booking change to this router's load.
    pub fn apply_remote(
        &self,
        from: ReplicaId,
        delta: &BookingDelta<'_>,
    ) -> Result<(), RemoteError> {
        if from.0 == Key::LOCAL {
            return Err(RemoteError::ReservedReplica);
        }
        let key = Key::remote(from.0, delta.request());
        match *delta {
            BookingDelta::Booked(b) => self.book_remote(from, &b)?,
            BookingDelta::PrefillDone(_) => {
                self.ledger.prefill_done(key, None)?;
                self.load_freed();
            }
            BookingDelta::OutputBlocks {
                blocks, generated, ..
            } => {
                if blocks > MAX_DELTA_OUTPUT_BLOCKS {
                    return Err(RemoteError::Malformed(
                        "too many output blocks in one delta",
                    ));
                }
                self.ledger.remote_output_blocks(key, blocks, generated)?;
            }
            BookingDelta::Freed(_) => {
                self.ledger.free_at(key, self.clock.now())?;
                self.load_freed();
            }
        }
        Ok(())
    }

    fn book_remote(&self, from: ReplicaId, b: &RemoteBooking<'_>) -> Result<(), RemoteError> {
        let bs = u64::from(self.config.block_size);
        let blocks = b.prompt_tokens.div_ceil(bs);
        if b.block_hashes.len() as u64 > blocks {
            return Err(RemoteError::Malformed(
                "more full blocks than the prompt holds",
            ));
        }
        if b.prefill_tokens > b.prompt_tokens || b.cached_tokens > b.prompt_tokens {
            return Err(RemoteError::Malformed(
                "more prefill or cached tokens than the prompt",
            ));
        }
        let fleet = self.registry.load();
        let entry: &RankEntry = fleet
            .rank_index(b.rank)
            .map(|i| &fleet.ranks[i])
            .ok_or(RemoteError::UnknownRank(b.rank))?;
        let now = self.clock.now();
        self.ledger.book_as(
            from.0,
            BookingSpec {
                request: b.request,
                state: &entry.state,
                prefill_tokens: b.prefill_tokens,
                block_hashes: b.block_hashes,
                tail_blocks: blocks - b.block_hashes.len() as u64,
                prompt_tokens: b.prompt_tokens,
                cached_tokens: b.cached_tokens,
                block_size: self.config.block_size,
                expected_output_tokens: b.expected_output_tokens,
                session: None,
                now,
            },
        )?;
        self.record_remote_as_cache(entry, b.block_hashes, now);
        Ok(())
    }

    /// Records a remote booking's prompt as its rank's cache where this router keeps records
    /// (as [`Router::book`] does for its own).
    fn record_remote_as_cache(
        &self,
        entry: &RankEntry,
        locals: &[LocalHash],
        now: std::time::Instant,
    ) {
        if let (Some(ttl), Some(key)) = (self.record_ttl(entry), entry.index_key) {
            let mut marks = Vec::new();
            checkpoint_keys_extend(locals, &mut marks, usize::MAX);
            let state = Arc::clone(&entry.state);
            self.approx
                .record(&marks, entry.state.rank(), key, now + ttl, || {
                    !state.is_retired()
                });
        }
    }

    /// Drops every booking of the router `replica` (it left, or its deltas were lost and it
    /// will resend its book); returns how many.
    pub fn drop_replica(&self, replica: ReplicaId) -> usize {
        if replica.0 == Key::LOCAL {
            return 0;
        }
        let n = self.ledger.drop_origin(replica.0);
        if n > 0 {
            self.load_freed();
        }
        n
    }

    /// Bookings of the fleet's other routers held now.
    pub fn remote_requests(&self) -> usize {
        self.ledger.active_remote()
    }
}

/// A [`BookingDelta`] that owns its prompt's hashes, to queue or hand on later.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedDelta {
    /// The delta, a booking's hashes left empty.
    delta: BookingDelta<'static>,
    /// A booking's hashes.
    hashes: Vec<LocalHash>,
}

impl OwnedDelta {
    /// The delta, borrowing the hashes it owns.
    pub fn as_delta(&self) -> BookingDelta<'_> {
        match self.delta {
            BookingDelta::Booked(b) => BookingDelta::Booked(RemoteBooking {
                block_hashes: &self.hashes,
                ..b
            }),
            d => d,
        }
    }
}

impl From<&BookingDelta<'_>> for OwnedDelta {
    fn from(d: &BookingDelta<'_>) -> Self {
        match *d {
            BookingDelta::Booked(b) => OwnedDelta {
                delta: BookingDelta::Booked(RemoteBooking {
                    block_hashes: &[],
                    ..b
                }),
                hashes: b.block_hashes.to_vec(),
            },
            BookingDelta::PrefillDone(r) => OwnedDelta {
                delta: BookingDelta::PrefillDone(r),
                hashes: Vec::new(),
            },
            BookingDelta::OutputBlocks {
                request,
                blocks,
                generated,
            } => OwnedDelta {
                delta: BookingDelta::OutputBlocks {
                    request,
                    blocks,
                    generated,
                },
                hashes: Vec::new(),
            },
            BookingDelta::Freed(r) => OwnedDelta {
                delta: BookingDelta::Freed(r),
                hashes: Vec::new(),
            },
        }
    }
}
