//! [`Inbox`]: one router's side of the booking sync that hears the others: each peer's
//! sequence followed, its deltas applied to the router, its snapshots taken whole, and the
//! peers that went quiet dropped.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvroute_core::{
    BookingDelta, DpRank, LocalHash, RemoteBooking, ReplicaId, RequestId, Router, WorkerId,
    WorkerRank,
};

use rkyv::util::AlignedVec;

use super::wire::{access, ArchivedBody, ArchivedWireBooking, ArchivedWireDelta, WireError};

/// Least time between two requests for the same peer's snapshot.
pub const RESYNC_EVERY: Duration = Duration::from_secs(1);

/// What the inbox knows of one peer.
#[derive(Debug)]
struct Peer {
    /// Its bookings held here follow its sequence up to `last_seq`.
    synced: bool,
    last_seq: u64,
    last_heard: Instant,
    /// When its snapshot was last asked for.
    asked_at: Option<Instant>,
}

/// What one message did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Received {
    /// The peer it came from (none: this router's own, or refused).
    pub from: Option<ReplicaId>,
    /// Deltas (and snapshot bookings) applied to the router.
    pub applied: u64,
    /// Deltas the router refused (late, repeated, for a rank it does not know).
    pub refused: u64,
    /// Ask this peer for a snapshot: its sequence has a gap, or it is new here.
    pub ask_resync: Option<ReplicaId>,
    /// Some router asked for this router's snapshot.
    pub snapshot_wanted: bool,
    /// Bookings dropped (a peer that left, or a gap).
    pub dropped: u64,
    /// From the sender's clock to this router's (same-host clocks only mean anything).
    pub delay: Option<Duration>,
}

/// Counts of what the inbox heard, since it started.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct InboxCounts {
    /// Messages from other routers.
    pub messages: u64,
    /// Messages that could not be read.
    pub malformed: u64,
    /// Messages of another version or block size.
    pub foreign: u64,
    /// Deltas and snapshot bookings applied.
    pub applied: u64,
    /// Deltas refused by the router.
    pub refused: u64,
    /// Gaps found in a peer's sequence.
    pub gaps: u64,
    /// Snapshots begun.
    pub snapshots: u64,
    /// Peers dropped because they went quiet or said goodbye.
    pub peers_lost: u64,
}

/// The other routers as this one hears them.
///
/// Messages are read where they lie (rkyv's validated access): one copy into an aligned
/// buffer the inbox keeps, and nothing allocated per message or per booking once its buffers
/// have grown.
#[derive(Debug)]
pub struct Inbox {
    me: ReplicaId,
    block_size: u32,
    peers: HashMap<ReplicaId, Peer>,
    counts: InboxCounts,
    /// The message being read, aligned for access (kept between messages).
    aligned: AlignedVec<16>,
    /// A booking's hashes as the router takes them (kept between bookings).
    hashes: Vec<LocalHash>,
}

impl Inbox {
    /// The inbox of router `me`, whose blocks are `block_size` tokens.
    pub fn new(me: ReplicaId, block_size: u32) -> Self {
        Inbox {
            me,
            block_size,
            peers: HashMap::new(),
            counts: InboxCounts::default(),
            aligned: AlignedVec::new(),
            hashes: Vec::new(),
        }
    }

    /// What it heard so far.
    pub fn counts(&self) -> InboxCounts {
        self.counts
    }

    /// Peers heard (and not dropped since).
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Peers whose bookings this router holds in step with their sequence.
    pub fn synced_peers(&self) -> usize {
        self.peers.values().filter(|p| p.synced).count()
    }

    /// Takes one message: applies what it says to `router` and says what to do next.
    pub fn receive(
        &mut self,
        router: &Router,
        bytes: &[u8],
        now: Instant,
        now_unix_ns: u64,
    ) -> Result<Received, WireError> {
        let mut aligned = std::mem::take(&mut self.aligned);
        aligned.clear();
        aligned.extend_from_slice(bytes);
        let out = self.receive_aligned(router, &aligned, now, now_unix_ns);
        self.aligned = aligned;
        out
    }

    fn receive_aligned(
        &mut self,
        router: &Router,
        bytes: &[u8],
        now: Instant,
        now_unix_ns: u64,
    ) -> Result<Received, WireError> {
        let e = match access(bytes) {
            Ok(e) => e,
            Err(err) => {
                match err {
                    WireError::Version(_) => self.counts.foreign += 1,
                    WireError::Malformed(_) => self.counts.malformed += 1,
                }
                return Err(err);
            }
        };
        let (replica, block_size) = (e.replica.to_native(), e.block_size.to_native());
        let seq = e.seq.to_native();
        let mut out = Received::default();
        if replica == self.me.0 {
            return Ok(out);
        }
        if replica == 0 || block_size != self.block_size {
            self.counts.foreign += 1;
            return Err(WireError::Malformed(format!(
                "replica {replica} with block size {block_size} (this router's: {})",
                self.block_size
            )));
        }
        self.counts.messages += 1;
        let from = ReplicaId(replica);
        out.from = Some(from);
        out.delay = now_unix_ns
            .checked_sub(e.sent_unix_ns.to_native())
            .map(Duration::from_nanos);
        let peer = self.peers.entry(from).or_insert(Peer {
            synced: false,
            last_seq: 0,
            last_heard: now,
            asked_at: None,
        });
        peer.last_heard = now;
        match &e.body {
            ArchivedBody::Bye => {
                out.dropped = router.drop_replica(from) as u64;
                self.peers.remove(&from);
                self.counts.peers_lost += 1;
                return Ok(out);
            }
            ArchivedBody::Resync { target } => {
                let target = target.to_native();
                out.snapshot_wanted = target == 0 || target == self.me.0;
                if !peer.synced {
                    self.want_resync(from, now, &mut out);
                }
            }
            ArchivedBody::Heartbeat => {
                if !peer.synced || seq != peer.last_seq {
                    self.gap(router, from, now, &mut out);
                }
            }
            ArchivedBody::Snapshot {
                first, bookings, ..
            } => {
                if *first {
                    out.dropped = router.drop_replica(from) as u64;
                    peer.synced = true;
                    peer.last_seq = seq;
                    self.counts.snapshots += 1;
                    for b in bookings.iter() {
                        self.apply_booking(router, from, b, true, &mut out);
                    }
                } else if self.in_step(router, from, seq, now, &mut out) {
                    for b in bookings.iter() {
                        self.apply_booking(router, from, b, true, &mut out);
                    }
                }
            }
            ArchivedBody::Deltas(deltas) => {
                if self.in_step(router, from, seq, now, &mut out) {
                    for d in deltas.iter() {
                        self.apply_delta(router, from, d, &mut out);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Whether message `seq` of `from` comes next: then it is taken as the peer's latest. A
    /// repeat is skipped; a gap drops the peer's bookings and asks for its snapshot.
    fn in_step(
        &mut self,
        router: &Router,
        from: ReplicaId,
        seq: u64,
        now: Instant,
        out: &mut Received,
    ) -> bool {
        let Some(peer) = self.peers.get_mut(&from) else {
            return false;
        };
        if peer.synced && seq == peer.last_seq.wrapping_add(1) {
            peer.last_seq = seq;
            return true;
        }
        if peer.synced && seq <= peer.last_seq {
            return false;
        }
        self.gap(router, from, now, out);
        false
    }

    /// The peer's bookings here no longer follow its sequence: drop them, ask for its snapshot.
    fn gap(&mut self, router: &Router, from: ReplicaId, now: Instant, out: &mut Received) {
        if let Some(peer) = self.peers.get_mut(&from) {
            if peer.synced {
                self.counts.gaps += 1;
                peer.synced = false;
                out.dropped += router.drop_replica(from) as u64;
            }
        }
        self.want_resync(from, now, out);
    }

    fn want_resync(&mut self, from: ReplicaId, now: Instant, out: &mut Received) {
        if let Some(peer) = self.peers.get_mut(&from) {
            if peer
                .asked_at
                .is_none_or(|t| now.saturating_duration_since(t) >= RESYNC_EVERY)
            {
                peer.asked_at = Some(now);
                out.ask_resync = Some(from);
            }
        }
    }

    fn apply_delta(
        &mut self,
        router: &Router,
        from: ReplicaId,
        d: &ArchivedWireDelta,
        out: &mut Received,
    ) {
        let delta = match d {
            ArchivedWireDelta::Booked(b) => return self.apply_booking(router, from, b, false, out),
            ArchivedWireDelta::PrefillDone(r) => {
                BookingDelta::PrefillDone(RequestId(r.to_native()))
            }
            ArchivedWireDelta::OutputBlocks {
                request,
                blocks,
                generated,
            } => BookingDelta::OutputBlocks {
                request: RequestId(request.to_native()),
                blocks: blocks.to_native(),
                generated: generated.to_native(),
            },
            ArchivedWireDelta::Freed(r) => BookingDelta::Freed(RequestId(r.to_native())),
        };
        self.count(router.apply_remote(from, &delta).is_ok(), out);
    }

    /// Books `b` for `from`; from a snapshot, also as far as it got.
    fn apply_booking(
        &mut self,
        router: &Router,
        from: ReplicaId,
        b: &ArchivedWireBooking,
        with_progress: bool,
        out: &mut Received,
    ) {
        let mut hashes = std::mem::take(&mut self.hashes);
        hashes.clear();
        hashes.extend(b.hashes.iter().map(|h| LocalHash(h.to_native())));
        let request = RequestId(b.request.to_native());
        let booked = BookingDelta::Booked(RemoteBooking {
            request,
            rank: WorkerRank {
                worker: WorkerId(b.worker.to_native()),
                dp_rank: DpRank(b.dp_rank.to_native()),
            },
            prefill_tokens: b.prefill_tokens.to_native(),
            block_hashes: &hashes,
            prompt_tokens: b.prompt_tokens.to_native(),
            cached_tokens: b.cached_tokens.to_native(),
            expected_output_tokens: b.expected_output_tokens.as_ref().map(|t| t.to_native()),
        });
        let ok = router.apply_remote(from, &booked).is_ok();
        self.hashes = hashes;
        self.count(ok, out);
        if !(ok && with_progress) {
            return;
        }
        if b.prefill_done {
            let _ = router.apply_remote(from, &BookingDelta::PrefillDone(request));
        }
        if b.output_blocks > 0 {
            let _ = router.apply_remote(
                from,
                &BookingDelta::OutputBlocks {
                    request,
                    blocks: b.output_blocks.to_native(),
                    generated: b.generated.to_native(),
                },
            );
        }
    }

    fn count(&mut self, ok: bool, out: &mut Received) {
        if ok {
            self.counts.applied += 1;
            out.applied += 1;
        } else {
            self.counts.refused += 1;
            out.refused += 1;
        }
    }

    /// Drops the peers not heard for `silent_after`, and their bookings; returns each with
    /// how many bookings it held.
    pub fn sweep(
        &mut self,
        router: &Router,
        now: Instant,
        silent_after: Duration,
    ) -> Vec<(ReplicaId, usize)> {
        let quiet: Vec<ReplicaId> = self
            .peers
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.last_heard) >= silent_after)
            .map(|(id, _)| *id)
            .collect();
        quiet
            .into_iter()
            .map(|id| {
                self.peers.remove(&id);
                self.counts.peers_lost += 1;
                (id, router.drop_replica(id))
            })
            .collect()
    }

    /// Forgets every peer and drops their bookings (the sync is down: the view is local);
    /// returns how many bookings went.
    pub fn forget_all(&mut self, router: &Router) -> usize {
        self.peers
            .drain()
            .map(|(id, _)| router.drop_replica(id))
            .sum()
    }
}
