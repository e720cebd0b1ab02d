//! What every router test shares: the crate's public surface and a way to store a chain.

pub use kvroute_core::*;

/// Stores `locals` as one chain on `rank` (block names by position and tier).
pub fn store(r: &Router, rank: WorkerRank, tier: StorageTier, locals: &[LocalHash], id: u64) {
    let blocks: Vec<StoredBlock> = locals
        .iter()
        .enumerate()
        .map(|(i, h)| StoredBlock {
            block_hash: BlockHash(1000 * (tier as u64 + 1) + i as u64),
            local_hash: *h,
        })
        .collect();
    let header = EventHeader {
        source: rank,
        event_id: EventId(id),
        tier,
    };
    r.apply_event(&KvEvent {
        header,
        data: KvEventData::Stored {
            parent: None,
            blocks,
        },
    })
    .unwrap();
}

pub use std::sync::atomic::{AtomicU64, Ordering};
pub use std::sync::{Arc, Mutex, MutexGuard};
pub use std::time::{Duration, Instant};

/// The guard of `m`, poisoned or not.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
