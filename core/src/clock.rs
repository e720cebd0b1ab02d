//! Time, as the router reads it: the system's monotonic clock, or a clock the embedder moves
//! (a simulation on a virtual clock, a test). The router reads its clock only where a decision
//! or a record needs the time, and nowhere else: time enters one way.
//!
//! ```
//! use std::time::Duration;
//! use kvroute_core::{Clock, ManualClock};
//!
//! let clock = ManualClock::new();
//! let router_clock = Clock::Manual(clock.clone()); // hand this to `Router::with_clock`
//! let t0 = router_clock.now();
//! clock.advance(Duration::from_secs(5));
//! assert_eq!(router_clock.now() - t0, Duration::from_secs(5));
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where the router's time comes from.
#[derive(Clone, Debug, Default)]
pub enum Clock {
    /// The system's monotonic clock ([`Instant::now`]).
    #[default]
    System,
    /// A clock that moves only when told ([`ManualClock`]).
    Manual(ManualClock),
}

impl Clock {
    /// The time now.
    #[inline]
    pub fn now(&self) -> Instant {
        match self {
            Clock::System => Instant::now(),
            Clock::Manual(m) => m.now(),
        }
    }
}

/// A clock that stands still until it is set or advanced; its clones share one time. It
/// starts at the system time of its creation and never goes back before it.
#[derive(Clone, Debug)]
pub struct ManualClock {
    base: Instant,
    /// Nanoseconds past `base`.
    offset_ns: Arc<AtomicU64>,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl ManualClock {
    /// A clock standing at the system time now.
    pub fn new() -> Self {
        ManualClock {
            base: Instant::now(),
            offset_ns: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The time it stands at.
    #[inline]
    pub fn now(&self) -> Instant {
        // Relaxed: the time is a value of its own; nothing else is published through it.
        self.base + Duration::from_nanos(self.offset_ns.load(Ordering::Relaxed))
    }

    /// Sets the time to `t` (to the clock's start, if `t` is earlier).
    pub fn set(&self, t: Instant) {
        let ns = t.saturating_duration_since(self.base).as_nanos();
        self.offset_ns
            .store(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Moves the time forward by `d`.
    pub fn advance(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let mut cur = self.offset_ns.load(Ordering::Relaxed);
        loop {
            let next = cur.saturating_add(ns);
            match self.offset_ns.compare_exchange_weak(
                cur,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(seen) => cur = seen,
            }
        }
    }
}
