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
mod tests {
    use super::*;

    fn w(id: u64, tokens: u64, t0: Instant) -> Waiting<()> {
        Waiting {
            request: RequestId(id),
            tokens,
            enqueued_at: t0,
            lane: (id % 3) as usize,
            item: (),
        }
    }

    fn order(class: u8, jump: f64, arrival: f64, new: u64) -> OrderInput {
        OrderInput {
            class: PriorityClass(class),
            priority_jump: jump,
            arrival_secs: arrival,
            new_prefill_tokens: new,
        }
    }

    fn ids<T>(q: &AdmissionQueue<T>) -> Vec<u64> {
        q.iter().map(|w| w.request.0).collect()
    }

    #[test]
    fn fcfs_orders_by_arrival_minus_jump_under_strict_classes() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(QueueOrder::Fcfs, 1_000);
        q.push(w(1, 10, t0), order(0, 0.0, 1.0, 10)).unwrap();
        q.push(w(2, 10, t0), order(0, 0.0, 2.0, 10)).unwrap();
        // Arrived at 3.0 with a 1.5 s jump: key 1.5, ahead of 2 (2.0), behind 1 (1.0).
        q.push(w(3, 10, t0), order(0, 1.5, 3.0, 10)).unwrap();
        // A higher class goes first whatever its arrival.
        q.push(w(4, 10, t0), order(1, 0.0, 9.0, 10)).unwrap();
        // Equal keys keep arrival order.
        q.push(w(5, 10, t0), order(0, 0.0, 2.0, 10)).unwrap();
        assert_eq!(ids(&q), vec![4, 1, 3, 2, 5]);
        assert_eq!(q.queued_tokens(), 50);
        assert_eq!(q.pop().unwrap().request, RequestId(4));
        assert_eq!(q.remove(RequestId(3)).unwrap().request, RequestId(3));
        assert!(q.remove(RequestId(3)).is_none(), "removed once");
        assert_eq!(ids(&q), vec![1, 2, 5]);
        assert_eq!(q.queued_tokens(), 30);
    }

    /// Lanes count their requests through every way in and out, and a walk over lane heads
    /// that skips a lane never visits its requests.
    #[test]
    fn lanes_count_and_a_walk_over_heads_takes_in_order() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(QueueOrder::Fcfs, 1_000);
        for id in 1..=7u64 {
            // Lanes 1, 2, 0, 1, 2, 0, 1 (id % 3).
            q.push(w(id, 10, t0), order(0, 0.0, id as f64, 10)).unwrap();
        }
        assert_eq!((q.lane_len(0), q.lane_len(1), q.lane_len(2)), (2, 3, 2));
        assert_eq!((q.nonempty_lanes(), q.lane_len(9)), (3, 0));
        // Lane 2 given up on; lanes 0 and 1 taken head by head, in release order.
        let mut seen = Vec::new();
        while let Some((place, w)) = q.first_head(|lane| lane == 2) {
            seen.push(w.request.0);
            assert!(q.take(place).is_some());
            assert!(q.take(place).is_none(), "taken once");
        }
        assert_eq!(seen, vec![1, 3, 4, 6, 7]);
        assert_eq!(ids(&q), vec![2, 5]);
        assert_eq!(
            (q.lane_len(0), q.lane_len(1), q.nonempty_lanes()),
            (0, 0, 1)
        );
        // A request that jumps ahead of its lane's head becomes the head.
        q.push(w(8, 10, t0), order(0, 0.0, 0.5, 10)).unwrap();
        assert_eq!(q.first_head(|_| false).unwrap().1.request, RequestId(8));
        assert!(q.first_head(|lane| lane == 2).is_none());
        assert_eq!(q.pop().unwrap().request, RequestId(8));
        assert!(q.remove(RequestId(2)).is_some());
        assert_eq!(q.first_head(|_| false).unwrap().1.request, RequestId(5));
        assert!(q.remove(RequestId(5)).is_some());
        assert_eq!((q.lane_len(2), q.nonempty_lanes()), (0, 0));
        assert_eq!(q.queued_tokens(), 0);
        assert!(q.first_head(|_| false).is_none());
    }

    #[test]
    fn wspt_orders_by_weight_over_new_prefill_tokens() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(QueueOrder::Wspt, 1_000_000);
        q.push(w(1, 4000, t0), order(0, 0.0, 1.0, 4000)).unwrap(); // 1/4000
        q.push(w(2, 4000, t0), order(0, 0.0, 2.0, 100)).unwrap(); // 1/100: mostly cached
        q.push(w(3, 1000, t0), order(0, 3.0, 3.0, 1000)).unwrap(); // 4/1000 = 1/250
        q.push(w(4, 50, t0), order(0, 0.0, 4.0, 0)).unwrap(); // fully cached: 1/1
        q.push(w(5, 10, t0), order(2, 0.0, 5.0, 9000)).unwrap(); // higher class
        assert_eq!(ids(&q), vec![5, 4, 2, 3, 1]);
    }

    #[test]
    fn the_cap_refuses_with_the_numbers_and_hands_the_request_back() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(QueueOrder::Fcfs, 100);
        q.push(w(1, 60, t0), order(0, 0.0, 0.0, 60)).unwrap();
        q.push(w(2, 40, t0), order(0, 0.0, 0.0, 40)).unwrap();
        match q.push(w(3, 1, t0), order(0, 0.0, 0.0, 1)) {
            Err(Refused::OverCap(over, back)) => {
                assert_eq!(
                    over,
                    OverCap {
                        queued_tokens: 100,
                        cap_tokens: 100
                    }
                );
                assert_eq!(back.request, RequestId(3));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            q.push(w(2, 1, t0), order(0, 0.0, 0.0, 1)),
            Err(Refused::Duplicate(_))
        ));
        q.pop().unwrap();
        q.push(w(3, 60, t0), order(0, 0.0, 0.0, 60)).unwrap();
        assert_eq!(q.len(), 2);
        let mut big = AdmissionQueue::new(QueueOrder::Fcfs, 10);
        assert!(matches!(
            big.push(w(9, 11, t0), order(0, 0.0, 0.0, 11)),
            Err(Refused::OverCap(
                OverCap {
                    queued_tokens: 0,
                    cap_tokens: 10
                },
                _
            ))
        ));
    }
}
