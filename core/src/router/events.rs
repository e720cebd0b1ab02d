//! KV events into the router's index, and the router's own bookkeeping of them (warm-up's
//! measure of each worker's cache, speculative records retired on evictions).

use std::sync::MutexGuard;

use super::{lock, Router};
use crate::event::{
    BlockHash, EventHeader, EventSeen, KvEvent, StorageTier, StoredBlock, WorkerRank,
};
use crate::index::{IndexError, PrefixIndex};

/// KV events into a router's index, each noted ([`Router::event_writer`]).
pub struct EventWriter<'a> {
    index: MutexGuard<'a, PrefixIndex>,
    router: &'a Router,
}

impl std::fmt::Debug for EventWriter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventWriter").finish_non_exhaustive()
    }
}

impl EventWriter<'_> {
    pub(super) fn noted(
        &self,
        header: EventHeader,
        seen: EventSeen,
        applied: Result<(), IndexError>,
    ) -> Result<(), IndexError> {
        if applied.is_ok() {
            self.router.note_event(header.source, header.tier, seen);
        }
        applied
    }
}

impl crate::index::ApplyEvents for EventWriter<'_> {
    fn apply_stored(
        &mut self,
        header: EventHeader,
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        let applied = self.index.apply_stored(header, parent, blocks);
        let seen = EventSeen::Stored {
            blocks: blocks.len() as u64,
        };
        self.noted(header, seen, applied)
    }

    fn apply_removed(
        &mut self,
        header: EventHeader,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError> {
        let applied = self.index.apply_removed(header, blocks);
        let seen = EventSeen::Removed {
            blocks: blocks.len() as u64,
        };
        self.noted(header, seen, applied)
    }

    fn apply_cleared(&mut self, header: EventHeader) -> Result<(), IndexError> {
        let applied = self.index.apply_cleared(header);
        self.noted(header, EventSeen::Cleared, applied)
    }
}

impl Router {
    /// Applies a KV event to the index (serialised with other writers), and tells the
    /// router's own bookkeeping of it ([`Router::note_event`]).
    pub fn apply_event(&self, event: &KvEvent) -> Result<(), IndexError> {
        crate::index::ApplyEvents::apply_event(&mut self.event_writer(), event)
    }

    /// A writer of KV events into the router's index for an ingest path that decodes them
    /// itself (the transport's): each event it applies is noted as [`Router::apply_event`]
    /// notes it. It holds the index's lock while it lives: keep it for a batch, not longer
    /// (joins and leaves wait on it; routes do not).
    pub fn event_writer(&self) -> EventWriter<'_> {
        EventWriter {
            index: lock(&self.index),
            router: self,
        }
    }

    /// Tells the router of a KV event applied to the index elsewhere (an ingest path that
    /// writes the index directly): an eviction or clear retires the worker's speculative
    /// records, and device blocks stored and removed feed warm-up's measure of each worker's
    /// cache (a clear warms the worker again). [`Router::apply_event`] calls it itself.
    pub fn note_event(&self, source: WorkerRank, tier: StorageTier, seen: EventSeen) {
        if matches!(seen, EventSeen::Removed { .. } | EventSeen::Cleared) {
            // The worker says its cache shrank: speculation about it stops counting.
            self.approx.retire_rank(source);
        }
        if tier != StorageTier::Device {
            return;
        }
        let fleet = self.registry.load();
        let Some(i) = fleet.rank_index(source) else {
            return;
        };
        let state = &fleet.ranks[i].state;
        match seen {
            EventSeen::Stored { .. } | EventSeen::Removed { .. } => state.report(seen),
            EventSeen::Cleared => {
                // A restart with an empty cache: warm it again.
                state.report(seen);
                self.warm(state, self.clock.now());
            }
        }
    }
}
