//! Applying received KV events to the prefix index straight from their archived form.
//!
//! ```text
//!  Frame payload (Bytes) ──validate──▶ &ArchivedKvEventBatch ──per event──▶ ApplyEvents
//!                                        events[i].data.blocks ──copy──▶ scratch Vec<StoredBlock>
//! ```
//!
//! Events go to anything that applies them ([`ApplyEvents`]): a [`PrefixIndex`] of the
//! caller's, or a router's event writer (`Router::event_writer`), which also notes each event
//! for the router's own bookkeeping (speculative records, warm-up).
//!
//! No owned event is built: each event's header is read from the archive, and its blocks are
//! copied into one scratch vector that lives as long as the [`BatchApplier`] and is reused by
//! every event. That copy is the one the layout forces: the archive holds `u64_le` pairs while
//! the index takes `&[StoredBlock]`, a Rust-layout struct of newtypes, and reading one as the
//! other would need `unsafe` and a `#[repr(C)]` promise from the core. It costs about as much as
//! a `memcpy` of the batch (the `wire` bench measures it apart from the rest).
//!
//! Bad events never stop a batch: each one the index rejects is counted, the first rejection
//! is kept, and the rest of the batch is applied.

use kvroute_core::{
    ApplyEvents, BlockHash, DpRank, EventHeader, EventId, IndexError, LocalHash, PrefixIndex,
    StoredBlock, WorkerId, WorkerRank,
};
use rkyv::option::ArchivedOption;

use crate::wire::{ArchivedKvEventBatch, ArchivedRecoveryReply, ArchivedWireEvent};
use crate::wire::{ArchivedWireBlock, ArchivedWireEventData};

/// An event the index rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventRejection {
    /// Position of the event in its batch.
    pub position: u32,
    /// Why the index rejected it.
    pub error: IndexError,
}

/// What applying a batch did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Events in the batch.
    pub events: u32,
    /// Events applied without error.
    pub applied: u32,
    /// Events the index rejected (a removal naming some unknown blocks counts here, though it
    /// removed the others).
    pub rejected: u32,
    /// Blocks named by Stored events.
    pub blocks_stored: u64,
    /// Blocks named by Removed events.
    pub blocks_removed: u64,
    /// The first rejection.
    pub first_error: Option<EventRejection>,
}

/// Applies archived event batches, reusing its scratch buffers from batch to batch. Keep one
/// per ingest loop.
#[derive(Debug, Default)]
pub struct BatchApplier {
    stored: Vec<StoredBlock>,
    removed: Vec<BlockHash>,
}

impl BatchApplier {
    /// An applier with empty scratch buffers.
    pub fn new() -> Self {
        BatchApplier::default()
    }

    /// Applies every event of `batch`, in order, as events of the batch's worker.
    ///
    /// The worker id is the batch's own: a transport that knows its peer's identity from its
    /// `Hello` checks that they agree before calling this.
    pub fn apply_batch(
        &mut self,
        index: &mut impl ApplyEvents,
        batch: &ArchivedKvEventBatch,
    ) -> BatchOutcome {
        self.apply_events(index, WorkerId(batch.worker_id.to_native()), &batch.events)
    }

    /// Applies the events of a recovery reply (a replay, or a snapshot: Cleared, then Stored).
    pub fn apply_recovery(
        &mut self,
        index: &mut impl ApplyEvents,
        reply: &ArchivedRecoveryReply,
    ) -> BatchOutcome {
        self.apply_events(index, WorkerId(reply.worker_id.to_native()), &reply.events)
    }

    /// Applies `events` as events of `worker`'s ranks.
    pub fn apply_events(
        &mut self,
        index: &mut impl ApplyEvents,
        worker: WorkerId,
        events: &[ArchivedWireEvent],
    ) -> BatchOutcome {
        let mut out = BatchOutcome {
            events: u32::try_from(events.len()).unwrap_or(u32::MAX),
            ..BatchOutcome::default()
        };
        for (i, e) in events.iter().enumerate() {
            let header = EventHeader {
                source: WorkerRank {
                    worker,
                    dp_rank: DpRank(e.dp_rank.to_native()),
                },
                event_id: EventId(e.event_id.to_native()),
                tier: (&e.tier).into(),
            };
            let result = match &e.data {
                ArchivedWireEventData::Stored { parent, blocks } => {
                    out.blocks_stored += blocks.len() as u64;
                    copy_blocks(blocks, &mut self.stored);
                    let parent = match parent {
                        ArchivedOption::Some(p) => Some(BlockHash(p.to_native())),
                        ArchivedOption::None => None,
                    };
                    index.apply_stored(header, parent, &self.stored)
                }
                ArchivedWireEventData::Removed { hashes } => {
                    out.blocks_removed += hashes.len() as u64;
                    self.removed.clear();
                    self.removed
                        .extend(hashes.iter().map(|h| BlockHash(h.to_native())));
                    index.apply_removed(header, &self.removed)
                }
                ArchivedWireEventData::Cleared => index.apply_cleared(header),
            };
            match result {
                Ok(()) => out.applied += 1,
                Err(error) => {
                    out.rejected += 1;
                    out.first_error.get_or_insert(EventRejection {
                        position: u32::try_from(i).unwrap_or(u32::MAX),
                        error,
                    });
                }
            }
        }
        out
    }
}

/// Copies archived blocks into `out` (cleared first), in the index's layout.
pub fn copy_blocks(blocks: &[ArchivedWireBlock], out: &mut Vec<StoredBlock>) {
    out.clear();
    out.extend(blocks.iter().map(|b| StoredBlock {
        block_hash: BlockHash(b.block_hash.to_native()),
        local_hash: LocalHash(b.local_hash.to_native()),
    }));
}

/// Applies every event of `batch` with scratch buffers of its own (allocated once per call);
/// an ingest loop keeps a [`BatchApplier`] instead.
pub fn apply_event_batch(index: &mut PrefixIndex, batch: &ArchivedKvEventBatch) -> BatchOutcome {
    BatchApplier::new().apply_batch(index, batch)
}
