//! [`Outbox`]: one router's side of the booking sync: its book as the others should see it,
//! and the messages that tell them.

use std::collections::HashMap;

use kvroute_core::{BookingDelta, ReplicaId};

use super::wire::{
    encode, Body, Envelope, WireBooking, WireDelta, MAX_MESSAGE_BYTES, SYNC_VERSION,
};

/// This router's bookings, kept from its own deltas, and the messages that carry them.
#[derive(Debug)]
pub struct Outbox {
    replica: ReplicaId,
    block_size: u32,
    /// The last sequence number taken.
    seq: u64,
    /// Every booking active now, as far as it got: what a snapshot sends.
    book: HashMap<u64, WireBooking>,
    /// Deltas not sent yet.
    pending: Vec<WireDelta>,
    /// Some deltas never reached the outbox: the next flush sends a snapshot instead.
    lost: bool,
    /// Largest message built, about (batches and snapshots are split to fit).
    max_bytes: usize,
}

impl Outbox {
    /// The outbox of router `replica`, whose blocks are `block_size` tokens.
    pub fn new(replica: ReplicaId, block_size: u32) -> Self {
        Outbox {
            replica,
            block_size,
            seq: 0,
            book: HashMap::new(),
            pending: Vec::new(),
            lost: false,
            max_bytes: MAX_MESSAGE_BYTES,
        }
    }

    /// Builds messages of at most about `bytes` (at least 1 KiB, at most
    /// [`MAX_MESSAGE_BYTES`]): what the NATS server takes, which tells its `max_payload`.
    pub fn set_max_bytes(&mut self, bytes: usize) {
        self.max_bytes = bytes.clamp(1 << 10, MAX_MESSAGE_BYTES);
        // What was booked under a larger limit fits the new one too (a snapshot NATS refused
        // would be asked for again and again).
        let fits = self.hashes_that_fit();
        for b in self.book.values_mut() {
            b.hashes.truncate(fits);
        }
        for d in &mut self.pending {
            if let WireDelta::Booked(b) = d {
                b.hashes.truncate(fits);
            }
        }
    }

    /// Most block hashes one booking carries: a message of one booking stays within the
    /// limit.
    fn hashes_that_fit(&self) -> usize {
        self.max_bytes.saturating_sub(256) / 8
    }

    /// The router it speaks for.
    pub fn replica(&self) -> ReplicaId {
        self.replica
    }

    /// Its block size.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Bookings active now.
    pub fn active(&self) -> usize {
        self.book.len()
    }

    /// The last sequence number taken.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Takes one of the router's own deltas: into the book, and to send.
    pub fn push(&mut self, delta: &BookingDelta<'_>) {
        let wire = match *delta {
            BookingDelta::Booked(b) => {
                // A prompt whose hashes alone pass the message size keeps its leading blocks
                // (the rest of its load stands in its token counts): a message NATS refuses
                // would be asked for again and again.
                let fits = self.hashes_that_fit();
                let hashes = &b.block_hashes[..b.block_hashes.len().min(fits)];
                let w = WireBooking {
                    request: b.request.0,
                    worker: b.rank.worker.0,
                    dp_rank: b.rank.dp_rank.0,
                    prefill_tokens: b.prefill_tokens,
                    prompt_tokens: b.prompt_tokens,
                    cached_tokens: b.cached_tokens,
                    expected_output_tokens: b.expected_output_tokens,
                    hashes: hashes.iter().map(|h| h.0).collect(),
                    prefill_done: false,
                    output_blocks: 0,
                    generated: 0,
                };
                self.book.insert(w.request, w.clone());
                WireDelta::Booked(w)
            }
            BookingDelta::PrefillDone(r) => {
                if let Some(b) = self.book.get_mut(&r.0) {
                    b.prefill_done = true;
                }
                WireDelta::PrefillDone(r.0)
            }
            BookingDelta::OutputBlocks {
                request,
                blocks,
                generated,
            } => {
                if let Some(b) = self.book.get_mut(&request.0) {
                    b.output_blocks += blocks;
                    b.generated = b.generated.max(generated);
                }
                WireDelta::OutputBlocks {
                    request: request.0,
                    blocks,
                    generated,
                }
            }
            BookingDelta::Freed(r) => {
                self.book.remove(&r.0);
                WireDelta::Freed(r.0)
            }
        };
        self.pending.push(wire);
    }

    /// Some of the router's deltas were dropped before reaching the outbox (its queue was
    /// full): the book is no longer what the others can rebuild from deltas, so the next
    /// [`Outbox::flush`] sends a snapshot. The book itself stays right only if what was lost
    /// is pushed again; the caller resets it with [`Outbox::reset`] otherwise.
    pub fn mark_lost(&mut self) {
        self.lost = true;
    }

    /// Forgets the book (its deltas were lost): the next flush sends an empty snapshot, and
    /// the book fills again from the deltas that follow.
    pub fn reset(&mut self) {
        self.book.clear();
        self.pending.clear();
        self.lost = true;
    }

    /// The messages that carry what is pending: deltas in order, split to fit, or a snapshot
    /// when something was lost. Empty when nothing is pending.
    pub fn flush(&mut self, now_unix_ns: u64) -> Vec<Vec<u8>> {
        if std::mem::take(&mut self.lost) {
            self.pending.clear();
            return self.snapshot(now_unix_ns);
        }
        let mut batches: Vec<Vec<WireDelta>> = Vec::new();
        let mut bytes = 0;
        for d in std::mem::take(&mut self.pending) {
            let size = match &d {
                WireDelta::Booked(b) => b.size_hint(),
                _ => 32,
            };
            match batches.last_mut() {
                Some(batch) if bytes + size <= self.max_bytes => batch.push(d),
                _ => {
                    batches.push(vec![d]);
                    bytes = 0;
                }
            }
            bytes += size;
        }
        batches
            .into_iter()
            .map(|batch| {
                self.seq += 1;
                let body = Body::Deltas(batch);
                envelope(self.replica, self.block_size, self.seq, now_unix_ns, body)
            })
            .collect()
    }

    /// The whole book, in parts that fit a message (one empty part when the book is).
    /// Deltas pending are covered by it and dropped.
    pub fn snapshot(&mut self, now_unix_ns: u64) -> Vec<Vec<u8>> {
        self.pending.clear();
        let mut parts: Vec<Vec<WireBooking>> = vec![Vec::new()];
        let mut bytes = 0;
        for b in self.book.values() {
            let size = b.size_hint();
            if bytes + size > self.max_bytes && parts.last().is_some_and(|p| !p.is_empty()) {
                parts.push(Vec::new());
                bytes = 0;
            }
            bytes += size;
            if let Some(p) = parts.last_mut() {
                p.push(b.clone());
            }
        }
        let n = parts.len();
        parts
            .into_iter()
            .enumerate()
            .map(|(i, bookings)| {
                self.seq += 1;
                let body = Body::Snapshot {
                    first: i == 0,
                    last: i + 1 == n,
                    bookings,
                };
                envelope(self.replica, self.block_size, self.seq, now_unix_ns, body)
            })
            .collect()
    }

    /// A heartbeat: alive, and the last sequence number taken.
    pub fn heartbeat(&self, now_unix_ns: u64) -> Vec<u8> {
        envelope(
            self.replica,
            self.block_size,
            self.seq,
            now_unix_ns,
            Body::Heartbeat,
        )
    }

    /// A goodbye: the others drop this router's bookings at once.
    pub fn bye(&self, now_unix_ns: u64) -> Vec<u8> {
        envelope(
            self.replica,
            self.block_size,
            self.seq,
            now_unix_ns,
            Body::Bye,
        )
    }
}

/// Router `replica`'s request for `target`'s snapshot (none: every router's). It takes no
/// sequence number, so any task of the router may send one.
pub fn resync(
    replica: ReplicaId,
    block_size: u32,
    target: Option<ReplicaId>,
    now_unix_ns: u64,
) -> Vec<u8> {
    let body = Body::Resync {
        target: target.map_or(0, |t| t.0),
    };
    envelope(replica, block_size, 0, now_unix_ns, body)
}

fn envelope(
    replica: ReplicaId,
    block_size: u32,
    seq: u64,
    sent_unix_ns: u64,
    body: Body,
) -> Vec<u8> {
    encode(&Envelope {
        version: SYNC_VERSION,
        block_size,
        replica: replica.0,
        seq,
        sent_unix_ns,
        body,
    })
}
