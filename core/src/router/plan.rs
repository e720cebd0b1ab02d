//! What a route settles before it selects: when it may book ([`Gate`]), its time ([`Now`]),
//! who may serve it ([`Eligible`]), its pinned rank, and how it selects ([`Plan`]).

use std::time::Instant;

use super::{DecidedBy, EvidenceLevel, Fallback, Mode};
use crate::clock::Clock;
use crate::event::WorkerId;
use crate::load::RequestId;
use crate::registry::WorkerRole;

/// When a request may be booked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gate {
    /// Now, on the least loaded busy rank if every one is busy (`route`).
    Immediate,
    /// Now if some eligible rank is free; else wait (an admission with an empty queue, or the
    /// queue's head on release).
    IfFree,
    /// Wait behind the requests already queued (unless pinned).
    Behind,
}

/// The time of one call, read from the router's clock once and only when needed.
#[derive(Debug)]
pub(super) struct Now<'a> {
    clock: &'a Clock,
    read: std::cell::Cell<Option<Instant>>,
}

impl<'a> Now<'a> {
    /// The time, to be read when first needed.
    pub(super) fn lazy(clock: &'a Clock) -> Self {
        Now {
            clock,
            read: std::cell::Cell::new(None),
        }
    }

    /// The time `t`, already read.
    pub(super) fn at(clock: &'a Clock, t: Instant) -> Self {
        Now {
            clock,
            read: std::cell::Cell::new(Some(t)),
        }
    }

    /// The time; on the system clock, a reading the caller already took stands in for it.
    pub(super) fn get_or(&self, reading: Option<Instant>) -> Instant {
        match self.read.get() {
            Some(t) => t,
            None => {
                let t = match (self.clock, reading) {
                    (Clock::System, Some(r)) => r,
                    _ => self.clock.now(),
                };
                self.read.set(Some(t));
                t
            }
        }
    }
}

/// A pinned route's rank, checked before the match.
#[derive(Clone, Copy)]
pub(super) struct PinnedRank {
    /// The rank scored (in the fleet's table).
    pub(super) index: usize,
    /// False when the pin named a worker with several dp ranks and none of them.
    pub(super) resolved: bool,
    pub(super) by: DecidedBy,
}

/// Who may serve the request: its role, the workers it allows and the labels it requires
/// (as one mask).
#[derive(Clone, Copy)]
pub(super) struct Eligible<'a> {
    pub(super) role: WorkerRole,
    pub(super) allowed: Option<&'a [WorkerId]>,
    pub(super) required: u64,
}

/// How one route selects, settled before the match.
#[derive(Clone, Copy)]
pub(super) struct Plan<'a> {
    pub(super) request: RequestId,
    pub(super) eligible: Eligible<'a>,
    /// The pinned (or session-bound) rank: the only one scored.
    pub(super) pinned: Option<PinnedRank>,
    /// Candidates that cannot win are not kept: only the winner matters (the cheapest is
    /// taken, ties at random, and nothing reads the whole list: no evidence, no wait to
    /// estimate).
    pub(super) prune: bool,
    /// Probe candidates for the prompt blocks already active on them (the KV-aware policy).
    pub(super) probe: bool,
    pub(super) gate: Gate,
    pub(super) temperature: f64,
    pub(super) evidence: EvidenceLevel,
    pub(super) mode: Mode,
    /// The role the fleet lacked and the one that serves instead (a prefill request with no
    /// prefill worker), for a choice among the fleet's ranks.
    pub(super) fallback: Option<Fallback>,
    pub(super) now: &'a Now<'a>,
}
