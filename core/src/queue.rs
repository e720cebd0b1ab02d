//! The admission queue: requests that arrived while every eligible worker was busy wait here,
//! in a policy's order, until load frees.
//!
//! ```text
//!   submit ──all eligible ranks busy──▶ AdmissionQueue ──release (load freed)──▶ route + book
//!      │                                  │ ordered by (priority class, policy key, arrival)
//!      └─ queued prompt tokens + this > cap: ResourceExhausted { queued, cap }   (retryable)
//! ```
//!
//! The order is strict between priority classes (a higher class always goes first) and, within
//! a class, a policy key ([`QueueOrder`]):
//!
//! * **FCFS with priority jumps**: `arrival − jump` seconds, smallest first. A jump moves a
//!   request ahead of those that arrived less than `jump` seconds before it. Best for tail TTFT.
//! * **Weighted shortest processing time**: `(1 + jump) / new prefill tokens`, largest first,
//!   where the new prefill tokens are the prompt less the best overlap any candidate holds.
//!   Short (or mostly cached) prompts go first; best for mean TTFT.
//!
//! Ties keep arrival order (a sequence number). The queue holds owned copies of the requests
//! (their tokens and hints), so the caller's buffers need not outlive the wait. It is a plain
//! data structure: the router serialises access and decides when the head may go.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use crate::config::QueueOrder;
use crate::load::RequestId;

/// A strict priority class: a request of a higher class always leaves the queue before any of
/// a lower one. Default 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PriorityClass(pub u8);

/// An `f64` ordered by `total_cmp` (the queue's keys are finite: hints are validated).
#[derive(Clone, Copy, Debug, PartialEq)]
struct KeyF64(f64);

impl Eq for KeyF64 {}

impl PartialOrd for KeyF64 {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for KeyF64 {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Where an entry sits: smallest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct QueueKey {
    /// `u8::MAX − class`: higher classes sort first.
    class: u8,
    policy: KeyF64,
    seq: u64,
}

/// What the queue needs to order a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct OrderInput {
    pub class: PriorityClass,
    /// Seconds to move ahead (finite).
    pub priority_jump: f64,
    /// Arrival, in seconds since the router's epoch.
    pub arrival_secs: f64,
    /// Prompt tokens the best candidate would still compute.
    pub new_prefill_tokens: u64,
}

impl OrderInput {
    fn key(&self, order: QueueOrder, seq: u64) -> QueueKey {
        let policy = match order {
            QueueOrder::Fcfs => self.arrival_secs - self.priority_jump,
            QueueOrder::Wspt => {
                let weight = (1.0 + self.priority_jump).max(0.0);
                -(weight / self.new_prefill_tokens.max(1) as f64)
            }
        };
        QueueKey {
            class: u8::MAX - self.class.0,
            policy: KeyF64(policy),
            seq,
        }
    }
}

/// A queued item with its bookkeeping.
#[derive(Debug)]
pub(crate) struct Waiting<T> {
    pub request: RequestId,
    /// Prompt tokens it counts against the cap.
    pub tokens: u64,
    pub enqueued_at: Instant,
    /// The lane it waits in: requests a scan treats alike share one (the router's lane is
    /// the request's eligibility). Each lane keeps its own order, so that a scan steps from
    /// lane head to lane head ([`AdmissionQueue::first_head`]), never over the requests of a
    /// lane it has given up on.
    pub lane: usize,
    pub item: T,
}

/// Where a waiting request stands in the release order ([`AdmissionQueue::first_head`],
/// [`AdmissionQueue::take`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Place(QueueKey);

/// The queue is over its cap of prompt tokens: the request was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OverCap {
    /// Prompt tokens already waiting.
    pub queued_tokens: u64,
    /// The cap.
    pub cap_tokens: u64,
}

/// Why an item was not queued; the item is handed back.
#[derive(Debug)]
pub(crate) enum Refused<T> {
    OverCap(OverCap, Waiting<T>),
    /// The request id is already waiting.
    Duplicate(Waiting<T>),
}

/// A priority queue of waiting requests, with a cap on their prompt tokens.
#[derive(Debug)]
pub(crate) struct AdmissionQueue<T> {
    order: QueueOrder,
    cap_tokens: u64,
    queued_tokens: u64,
    seq: u64,
    entries: BTreeMap<QueueKey, Waiting<T>>,
    by_id: HashMap<RequestId, QueueKey>,
    /// The places of the requests waiting, by lane.
    lanes: Vec<BTreeSet<QueueKey>>,
    /// Each lane with a request waiting, under its first place: release order over lanes.
    heads: BTreeSet<(QueueKey, usize)>,
}

impl<T> AdmissionQueue<T> {
    /// An empty queue ordered by `order`, holding at most `cap_tokens` prompt tokens.
    pub(crate) fn new(order: QueueOrder, cap_tokens: u64) -> Self {
        AdmissionQueue {
            order,
            cap_tokens,
            queued_tokens: 0,
            seq: 0,
            entries: BTreeMap::new(),
            by_id: HashMap::new(),
            lanes: Vec::new(),
            heads: BTreeSet::new(),
        }
    }

    /// Waiting requests.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Prompt tokens waiting.
    pub(crate) fn queued_tokens(&self) -> u64 {
        self.queued_tokens
    }

    /// The cap of waiting prompt tokens.
    pub(crate) fn cap_tokens(&self) -> u64 {
        self.cap_tokens
    }

    /// Requests waiting in `lane`.
    pub(crate) fn lane_len(&self, lane: usize) -> usize {
        self.lanes.get(lane).map_or(0, BTreeSet::len)
    }

    /// Lanes with at least one request waiting.
    pub(crate) fn nonempty_lanes(&self) -> usize {
        self.heads.len()
    }

    /// True when `request` waits.
    pub(crate) fn contains(&self, request: RequestId) -> bool {
        self.by_id.contains_key(&request)
    }

    /// Queues `w` in its place, unless its tokens would take the queue past its cap (a request
    /// alone larger than the cap is never queued) or its id already waits.
    pub(crate) fn push(&mut self, w: Waiting<T>, order: OrderInput) -> Result<(), Refused<T>> {
        if self.by_id.contains_key(&w.request) {
            return Err(Refused::Duplicate(w));
        }
        if self.queued_tokens.saturating_add(w.tokens) > self.cap_tokens {
            let over = OverCap {
                queued_tokens: self.queued_tokens,
                cap_tokens: self.cap_tokens,
            };
            return Err(Refused::OverCap(over, w));
        }
        let key = order.key(self.order, self.seq);
        self.seq += 1;
        self.queued_tokens += w.tokens;
        if w.lane >= self.lanes.len() {
            self.lanes.resize_with(w.lane + 1, BTreeSet::new);
        }
        let lane = &mut self.lanes[w.lane];
        match lane.first() {
            Some(&head) if head < key => {}
            Some(&head) => {
                self.heads.remove(&(head, w.lane));
                self.heads.insert((key, w.lane));
            }
            None => {
                self.heads.insert((key, w.lane));
            }
        }
        lane.insert(key);
        self.by_id.insert(w.request, key);
        self.entries.insert(key, w);
        Ok(())
    }

    #[cfg(test)]
    /// Takes the request that goes next.
    pub(crate) fn pop(&mut self) -> Option<Waiting<T>> {
        let (key, w) = self.entries.pop_first()?;
        self.by_id.remove(&w.request);
        self.left(key, &w);
        Some(w)
    }

    /// The first request in release order among the lanes `skip` does not name: a walk over
    /// lane heads, so a lane skipped costs one step however many requests wait in it.
    pub(crate) fn first_head(&self, skip: impl Fn(usize) -> bool) -> Option<(Place, &Waiting<T>)> {
        let &(key, _) = self.heads.iter().find(|&&(_, lane)| !skip(lane))?;
        Some((Place(key), &self.entries[&key]))
    }

    /// Takes the request at `place`, if it still waits there.
    pub(crate) fn take(&mut self, place: Place) -> Option<Waiting<T>> {
        let w = self.entries.remove(&place.0)?;
        self.by_id.remove(&w.request);
        self.left(place.0, &w);
        Some(w)
    }

    fn left(&mut self, key: QueueKey, w: &Waiting<T>) {
        self.queued_tokens -= w.tokens;
        let lane = &mut self.lanes[w.lane];
        lane.remove(&key);
        if self.heads.remove(&(key, w.lane)) {
            if let Some(&next) = lane.first() {
                self.heads.insert((next, w.lane));
            }
        }
    }

    /// Takes `request` out of the queue wherever it is (a cancel).
    pub(crate) fn remove(&mut self, request: RequestId) -> Option<Waiting<T>> {
        let key = self.by_id.remove(&request)?;
        let w = self.entries.remove(&key)?;
        self.left(key, &w);
        Some(w)
    }

    #[cfg(test)]
    /// The waiting requests, in release order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Waiting<T>> {
        self.entries.values()
    }
}

#[cfg(test)]
mod tests;
