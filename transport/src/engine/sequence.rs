//! Sequence numbers of one publisher (one worker's dp rank): which batches to apply, which to
//! skip, when to ask the replay socket, when the engine restarted. A state machine driven by
//! calls, with no sockets and no clock, generic over what the caller keeps of a batch (its
//! payload bytes, a decoded form).
//!
//! ```text
//!  live seq == next                    Apply                     next += 1
//!  live seq  > next  (a gap)           Held { replay: from next } (one replay at a time)
//!  live seq  < next, seq < restart_below   Restart: clear the worker, apply, next = seq + 1
//!                                      (unless a replay fetched it: see below)
//!  live seq  < next, otherwise         Duplicate (skipped)
//!  replayed seq == next                Apply
//!  replayed seq  > next                Lost: the replay buffer no longer reaches back; clear the
//!                                      rank (warm-up), apply, next = seq + 1
//!  replay end                          the held batches that now follow, in order; a new
//!                                      replay request if a gap remains among them
//! ```
//!
//! **Batches ahead of a gap are held, not dropped** (up to [`SequenceConfig::max_held`]; past
//! it they are dropped and counted, and the next replay fetches them). Dropping them would be
//! simpler, but a replay answers with what the publisher held when it was asked: batches
//! published while the answer is on its way arrive live, and a subscriber that dropped them
//! would find a new gap after every replay and never catch up under steady load.
//!
//! **Replays run ahead of the live stream.** A replay answers with everything the publisher
//! holds, so it fetches batches whose live copies are still queued in the SUB socket; those
//! copies then arrive with seqs below the expected one. They are duplicates, even when their
//! seqs are small enough to look like a restart: a live seq at or past the first seq a replay
//! applied (since the live stream last caught up) is never read as a restart.
//!
//! **Restarts.** A publisher numbers its batches from 0 per process, and PUB/SUB never
//! delivers a batch twice, so a live seq that goes back means a new process. A few of its first
//! batches may be lost while the subscription reconnects (ZeroMQ's slow joiner), hence "below
//! `restart_below`" rather than "equal to 0"; a live seq that goes back further is counted as a
//! duplicate and skipped. A restart seen late, when the new process has already numbered past
//! the old one, looks like a gap: seqs alone cannot tell, so the socket side should also treat
//! a publisher that went away and came back as a restart.

use std::collections::BTreeMap;
use std::ops::Range;

/// The limits of a [`SeqTracker`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceConfig {
    /// Most batches held ahead of a gap while the replay fills it.
    pub max_held: usize,
    /// A live seq lower than the expected one and lower than this is an engine restart.
    pub restart_below: u64,
}

impl Default for SequenceConfig {
    /// 1024 batches held; a restart is a seq back below 64.
    fn default() -> Self {
        SequenceConfig {
            max_held: 1024,
            restart_below: 64,
        }
    }
}

/// Batches to ask the replay socket for: send [`replay_request`](super::replay_request)
/// of `from`; the publisher answers with everything from `from` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayRequest {
    /// The first missing seq.
    pub from: u64,
    /// The first seq held after the gap (the gap is `from..until`).
    pub until: u64,
}

/// What to do with one batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<T> {
    /// In order: apply it.
    Apply(T),
    /// Seen already: skip it.
    Duplicate,
    /// Ahead of a gap: kept until the gap is filled (see [`SeqTracker::replay_end`]). When
    /// `replay` is set, ask the replay socket for it (one replay is outstanding at a time).
    Held {
        /// The request to send, if one is not already outstanding.
        replay: Option<ReplayRequest>,
    },
    /// Ahead of a gap, and the hold is full: dropped (a later replay fetches it).
    Dropped {
        /// The request to send, if one is not already outstanding.
        replay: Option<ReplayRequest>,
    },
    /// The engine restarted: clear every rank of the worker (and reset its decoder's cache
    /// groups), then apply this batch. Batches held from before the restart were dropped.
    Restart(T),
    /// The replay no longer holds `missing`: those events are lost. Clear the rank (and hand it
    /// to warm-up), then apply this batch.
    Lost {
        /// The seqs lost.
        missing: Range<u64>,
        /// The batch that follows them.
        batch: T,
    },
}

/// The held batches a replay's end released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drain<T> {
    /// Batches now in order, to apply in this order.
    pub apply: Vec<(u64, T)>,
    /// A new request, when a gap remains among the batches still held.
    pub replay: Option<ReplayRequest>,
}

/// Counts of every outcome of one publisher's batches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SequenceCounts {
    /// Batches applied in order as they arrived live.
    pub applied: u64,
    /// Batches applied from the replay socket.
    pub replayed: u64,
    /// Held batches applied once their gap was filled.
    pub released: u64,
    /// Batches skipped as seen already.
    pub duplicates: u64,
    /// Gaps found (each starts a replay request).
    pub gaps: u64,
    /// Replay requests made (a gap may take several).
    pub replay_requests: u64,
    /// Batches held ahead of a gap.
    pub held: u64,
    /// Batches dropped because the hold was full.
    pub dropped: u64,
    /// Engine restarts.
    pub restarts: u64,
    /// Held batches dropped at a restart.
    pub dropped_at_restart: u64,
    /// Gaps the replay could not fill.
    pub lost_gaps: u64,
    /// Batches in those gaps.
    pub lost_batches: u64,
}

/// The sequence state of one publisher.
#[derive(Debug, Clone)]
pub struct SeqTracker<T> {
    config: SequenceConfig,
    /// The seq expected next; `None` before the first batch.
    next: Option<u64>,
    /// Whether a replay request is outstanding.
    replaying: bool,
    /// The lowest seq a replay applied since the live stream last caught up: live copies of
    /// replayed batches arrive after them, and are duplicates, not a restart.
    replayed_from: Option<u64>,
    held: BTreeMap<u64, T>,
    counts: SequenceCounts,
}

impl<T> SeqTracker<T> {
    /// A tracker that has seen nothing yet: the first batch is applied whatever its seq.
    pub fn new(config: SequenceConfig) -> Self {
        SeqTracker {
            config,
            next: None,
            replaying: false,
            replayed_from: None,
            held: BTreeMap::new(),
            counts: SequenceCounts::default(),
        }
    }

    /// The seq expected next (`None` before the first batch).
    pub fn next_expected(&self) -> Option<u64> {
        self.next
    }

    /// Whether a replay request is outstanding.
    pub fn is_replaying(&self) -> bool {
        self.replaying
    }

    /// Batches held ahead of a gap.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Every outcome so far.
    pub fn counts(&self) -> SequenceCounts {
        self.counts
    }

    /// A batch that arrived on the live (SUB) socket.
    pub fn offer_live(&mut self, seq: u64, batch: T) -> Verdict<T> {
        let Some(next) = self.next else {
            self.next = Some(seq.wrapping_add(1));
            self.counts.applied += 1;
            return Verdict::Apply(batch);
        };
        if seq == next {
            self.next = Some(next.wrapping_add(1));
            self.counts.applied += 1;
            // The live stream has caught up with what replays fetched.
            self.replayed_from = None;
            return Verdict::Apply(batch);
        }
        if seq < next {
            let replayed = self.replayed_from.is_some_and(|from| seq >= from);
            if seq < self.config.restart_below && !replayed {
                return self.restart(seq, batch);
            }
            self.counts.duplicates += 1;
            return Verdict::Duplicate;
        }
        self.hold(next, seq, batch)
    }

    /// A batch that arrived from the replay (DEALER) socket.
    pub fn offer_replayed(&mut self, seq: u64, batch: T) -> Verdict<T> {
        let next = self.next.unwrap_or(seq);
        if seq < next {
            self.counts.duplicates += 1;
            return Verdict::Duplicate;
        }
        self.next = Some(seq.wrapping_add(1));
        self.replayed_from = Some(self.replayed_from.map_or(seq, |from| from.min(seq)));
        if seq == next {
            self.counts.replayed += 1;
            return Verdict::Apply(batch);
        }
        self.counts.lost_gaps += 1;
        self.counts.lost_batches = self.counts.lost_batches.saturating_add(seq - next);
        Verdict::Lost {
            missing: next..seq,
            batch,
        }
    }

    /// The replay's end marker arrived: releases the held batches that now follow in order.
    pub fn replay_end(&mut self) -> Drain<T> {
        self.replaying = false;
        let mut apply = Vec::new();
        while let Some((seq, batch)) = self.held.pop_first() {
            let next = *self.next.get_or_insert(seq);
            if seq < next {
                self.counts.duplicates += 1;
            } else if seq == next {
                self.next = Some(seq.wrapping_add(1));
                self.counts.released += 1;
                apply.push((seq, batch));
            } else {
                self.held.insert(seq, batch);
                let replay = self.request(next, seq);
                return Drain { apply, replay };
            }
        }
        Drain {
            apply,
            replay: None,
        }
    }

    /// The replay did not answer (the caller's timeout): the gap is lost. Returns the seqs
    /// lost (clear the rank and hand it to warm-up) and the held batches that follow them.
    pub fn abandon_replay(&mut self) -> (Range<u64>, Drain<T>) {
        let next = self.next.unwrap_or(0);
        let first_held = self.held.keys().next().copied().unwrap_or(next);
        let missing = next..first_held.max(next);
        if !missing.is_empty() {
            self.counts.lost_gaps += 1;
            self.counts.lost_batches =
                (self.counts.lost_batches).saturating_add(missing.end - missing.start);
            self.next = Some(missing.end);
        }
        (missing, self.replay_end())
    }

    /// The publisher is a new process (it went away and came back, and the replay could not
    /// prove it the same one): everything held is dropped and the next batch offered is
    /// applied whatever its seq. Counted as a restart.
    pub fn new_epoch(&mut self) {
        self.replayed_from = None;
        self.counts.restarts += 1;
        self.counts.dropped_at_restart += self.held.len() as u64;
        self.held.clear();
        self.replaying = false;
        self.next = None;
    }

    /// Expects `seq` next: a publisher whose replay buffer was empty numbers its next batch
    /// from here, and a later one is a gap to fill, not a first batch to take as it is.
    pub fn expect(&mut self, seq: u64) {
        if self.next.is_none() {
            self.next = Some(seq);
        }
    }

    fn restart(&mut self, seq: u64, batch: T) -> Verdict<T> {
        self.replayed_from = None;
        self.counts.restarts += 1;
        self.counts.dropped_at_restart += self.held.len() as u64;
        self.held.clear();
        self.replaying = false;
        self.next = Some(seq.wrapping_add(1));
        Verdict::Restart(batch)
    }

    fn hold(&mut self, next: u64, seq: u64, batch: T) -> Verdict<T> {
        if self.held.contains_key(&seq) {
            self.counts.duplicates += 1;
            return Verdict::Duplicate;
        }
        let replay = if self.replaying {
            None
        } else {
            self.counts.gaps += 1;
            self.request(next, seq)
        };
        if self.held.len() >= self.config.max_held {
            self.counts.dropped += 1;
            return Verdict::Dropped { replay };
        }
        self.held.insert(seq, batch);
        self.counts.held += 1;
        Verdict::Held { replay }
    }

    fn request(&mut self, from: u64, until: u64) -> Option<ReplayRequest> {
        self.replaying = true;
        self.counts.replay_requests += 1;
        Some(ReplayRequest { from, until })
    }
}

impl<T> Default for SeqTracker<T> {
    fn default() -> Self {
        SeqTracker::new(SequenceConfig::default())
    }
}
