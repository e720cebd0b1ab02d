//! What every router test shares: the crate's public surface and a way to store a chain.

pub use kvroute_core::testing::scores_of;
pub use kvroute_core::*;

/// The default configuration with the reference router's cost weights (overlap credit 1,
/// prefill load scale 1), which the tests of the cost's arithmetic are worked out in.
pub fn reference_weights() -> RouterConfig {
    RouterConfig {
        overlap_credit: 1.0,
        prefill_load_scale: 1.0,
        ..RouterConfig::default()
    }
}

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

/// A router on a manual clock: `r.at(t)` moves it.
pub fn on_manual_clock(config: RouterConfig, index: PrefixIndex) -> Router {
    Router::with_clock(config, index, Clock::Manual(ManualClock::new())).unwrap()
}

/// Moving a test router's manual clock.
pub trait At {
    /// Sets the router's clock to `t`, and returns the router.
    fn at(&self, t: Instant) -> &Self;

    /// Moves the router's clock forward by `d`, and returns the router.
    fn after(&self, d: Duration) -> &Self;
}

impl At for Router {
    fn at(&self, t: Instant) -> &Self {
        match self.clock() {
            Clock::Manual(m) => m.set(t),
            Clock::System => panic!("a test that sets the time needs a router on a manual clock"),
        }
        self
    }

    fn after(&self, d: Duration) -> &Self {
        match self.clock() {
            Clock::Manual(m) => m.advance(d),
            Clock::System => panic!("a test that moves the time needs a router on a manual clock"),
        }
        self
    }
}
