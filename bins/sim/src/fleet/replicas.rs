//! Several routers over one fleet, as `kvroute serve` replicas behind a load balancer: each
//! arrival is routed by one of them in turn, every engine's KV events reach all of them, and
//! each router's booking changes reach the others after a delay on the virtual clock, or never.
//!
//! ```text
//!  arrival i ──▶ router i mod N ──route (book)──▶ engine ──KV events──▶ every router's index
//!                    │ on_booking sink
//!                    ▼
//!                 told ──post (after the event)──▶ in flight until now + delay ──deliver──▶
//!                                                  apply_remote on every other router
//! ```
//!
//! * **In order.** A router's changes are told in the order its ledger moved and all take the
//!   same delay, so each other router applies them in that order: a free never comes before
//!   its booking.
//! * **At once.** With no delay, changes are applied as soon as the event that made them has
//!   run (a route, a pass's end, a transfer's end), before anything else is routed: every
//!   router then holds the same load after every event. With a delay, however short, arrivals
//!   at the same instant are routed blind to each other's bookings (a trace whose times are
//!   rounded comes in such bursts), and changes due at the same time as another event come
//!   first.
//! * **Off.** No sink is set: each router books, and sees, only its own requests (while the
//!   engines' caches it sees are the same), which is how routers that do not share their
//!   bookings herd onto the same workers.
//! * **One router.** No sink, no mailbox: the plain fleet, at the plain fleet's cost.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvroute_core::{LoadError, OwnedDelta, RemoteError, ReplicaId, Router};

use super::{Fleet, FleetError};

/// Several routers (replicas) over one fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replicas {
    /// Routers, at least 1: arrivals go to them in turn, as a load balancer spreads them.
    pub count: usize,
    /// How each router's booking changes reach the others.
    pub sync: BookingSync,
}

impl Replicas {
    /// One router: the plain fleet.
    pub const ONE: Replicas = Replicas {
        count: 1,
        sync: BookingSync::Off,
    };
}

/// How a router's booking changes reach the fleet's other routers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BookingSync {
    /// Never: each router sees only its own bookings (and every engine's KV events).
    Off,
    /// After this much virtual time (zero: before anything else is routed).
    After(Duration),
}

/// The id router `replica` (an index from 0) goes by with the others; 0 is reserved.
pub(super) fn replica_id(replica: usize) -> ReplicaId {
    ReplicaId(replica as u64 + 1)
}

/// Changes told by the routers' sinks, to be posted with their delay.
type Told = Arc<Mutex<Vec<(usize, OwnedDelta)>>>;

/// The routers' booking changes on their way to each other.
#[derive(Debug)]
pub(super) struct Mailbox {
    delay: Duration,
    /// Told since the last post, with the index of the router that told each.
    told: Told,
    /// Taken from `told` to post (kept to reuse its room).
    posting: Vec<(usize, OwnedDelta)>,
    /// Posted and not yet due, by due time then order posted.
    in_flight: BTreeMap<(Duration, u64), (usize, OwnedDelta)>,
    posted: u64,
    /// Changes a router refused as about a booking it does not hold.
    refused: u64,
}

impl Mailbox {
    /// Sets every router's sink to tell this mailbox; none when the routers do not sync.
    pub(super) fn connect(
        routers: &[Arc<Router>],
        sync: BookingSync,
    ) -> Result<Option<Mailbox>, FleetError> {
        let BookingSync::After(delay) = sync else {
            return Ok(None);
        };
        if routers.len() < 2 {
            return Ok(None);
        }
        let told: Told = Arc::default();
        for (i, router) in routers.iter().enumerate() {
            let to = Arc::clone(&told);
            let set = router.on_booking(move |delta| {
                to.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((i, OwnedDelta::from(delta)));
            });
            if !set {
                return Err(FleetError::Config {
                    reason: "a router's booking sink was set already",
                });
            }
        }
        Ok(Some(Mailbox {
            delay,
            told,
            posting: Vec::new(),
            in_flight: BTreeMap::new(),
            posted: 0,
            refused: 0,
        }))
    }

    /// When the first change in flight is due.
    pub(super) fn next_due(&self) -> Option<Duration> {
        self.in_flight.keys().next().map(|&(at, _)| at)
    }

    /// Hands `delta`, told by router `from`, to every other router.
    fn deliver(
        &mut self,
        routers: &[Arc<Router>],
        from: usize,
        delta: &OwnedDelta,
    ) -> Result<(), FleetError> {
        let delta = delta.as_delta();
        for (i, router) in routers.iter().enumerate() {
            if i == from {
                continue;
            }
            match router.apply_remote(replica_id(from), &delta) {
                Ok(()) => {}
                // About a booking already gone: harmless, counted.
                Err(RemoteError::Load(LoadError::UnknownRequest { .. })) => self.refused += 1,
                Err(e) => return Err(FleetError::Remote(e)),
            }
        }
        Ok(())
    }
}

impl Fleet {
    /// Sends the booking changes the last event made: at once without a delay, else in
    /// flight until `now + delay`.
    pub(super) fn post_bookings(&mut self) -> Result<(), FleetError> {
        let Some(mail) = self.mail.as_mut() else {
            return Ok(());
        };
        std::mem::swap(
            &mut *mail.told.lock().unwrap_or_else(PoisonError::into_inner),
            &mut mail.posting,
        );
        let mut posting = std::mem::take(&mut mail.posting);
        let due = self.now + mail.delay;
        for (from, delta) in posting.drain(..) {
            if mail.delay.is_zero() {
                mail.deliver(&self.routers, from, &delta)?;
            } else {
                mail.in_flight.insert((due, mail.posted), (from, delta));
                mail.posted += 1;
            }
        }
        mail.posting = posting;
        Ok(())
    }

    /// The first change in flight, due at `at`: applied by every router but its own.
    pub(super) fn deliver_booking(&mut self, at: Duration) -> Result<(), FleetError> {
        self.set_time(at);
        let Some(mail) = self.mail.as_mut() else {
            return Ok(());
        };
        let Some((_, (from, delta))) = mail.in_flight.pop_first() else {
            return Ok(());
        };
        mail.deliver(&self.routers, from, &delta)
    }

    /// Booking changes a router refused as about a booking it did not hold (0 when every
    /// change arrives in order, as here).
    pub fn refused_bookings(&self) -> u64 {
        self.mail.as_ref().map_or(0, |m| m.refused)
    }

    /// The fleet's routers, by replica index (one unless built [`Fleet::with_replicas`]).
    pub fn routers(&self) -> &[Arc<Router>] {
        &self.routers
    }

    /// The replica that routes the next arrival, moved on to the next in turn.
    pub(super) fn take_turn(&mut self) -> usize {
        let replica = self.turn;
        self.turn = (self.turn + 1) % self.routers.len();
        replica
    }
}
