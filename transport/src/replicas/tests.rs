//! The booking sync end to end without I/O: one router's outbox into another's inbox, with
//! messages lost, repeated, split, and forged.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::{
    BookingDelta, IndexConfig, LoadView, LocalHash, OwnedDelta, PrefixIndex, RemoteBooking,
    ReplicaId, RequestId, RouteHints, RouteRequest, Router, RouterConfig, WorkerConfig, WorkerRank,
};

use super::*;

const BS: u32 = 16;
const WORKERS: u64 = 3;

fn router() -> Router {
    let r = Router::new(
        RouterConfig::default(),
        PrefixIndex::new(IndexConfig::default()),
    )
    .unwrap();
    for w in 0..WORKERS {
        r.join_worker(WorkerConfig::simple(w, 1_000_000, BS))
            .unwrap();
    }
    r
}

/// A router telling its deltas to a queue, with its outbox.
struct Sender {
    router: Router,
    queue: Arc<Mutex<Vec<OwnedDelta>>>,
    outbox: Outbox,
}

impl Sender {
    fn new(id: u64) -> Self {
        let router = router();
        let queue = Arc::new(Mutex::new(Vec::new()));
        let q = Arc::clone(&queue);
        router.on_booking(move |d| q.lock().unwrap().push(OwnedDelta::from(d)));
        Sender {
            router,
            queue,
            outbox: Outbox::new(ReplicaId(id), BS),
        }
    }

    fn route(&self, id: u64, len: usize) -> WorkerRank {
        let tokens: Vec<u32> = (0..len as u32).map(|i| i + 7 * id as u32).collect();
        self.router
            .route(&RouteRequest {
                id: RequestId(id),
                tokens: &tokens,
                hints: RouteHints::default(),
            })
            .unwrap()
            .worker
    }

    /// The messages for what happened since the last call.
    fn flush(&mut self) -> Vec<Vec<u8>> {
        for d in self.queue.lock().unwrap().drain(..) {
            self.outbox.push(&d.as_delta());
        }
        self.outbox.flush(1)
    }
}

fn loads(r: &Router) -> Vec<LoadView> {
    (0..WORKERS)
        .map(|w| r.load(WorkerRank::new(w, 0)).unwrap())
        .collect()
}

fn deliver_at(inbox: &mut Inbox, to: &Router, msgs: &[Vec<u8>], at: Instant) -> Vec<Received> {
    msgs.iter()
        .map(|m| inbox.receive(to, m, at, 2).unwrap())
        .collect()
}

fn deliver(inbox: &mut Inbox, to: &Router, msgs: &[Vec<u8>]) -> Vec<Received> {
    deliver_at(inbox, to, msgs, Instant::now())
}

#[test]
fn a_peer_follows_the_sender_through_a_lost_message_and_a_snapshot() {
    let mut a = Sender::new(1);
    let b = router();
    let mut inbox = Inbox::new(ReplicaId(2), BS);

    // A new peer's first deltas are not taken: its snapshot is asked for.
    a.route(1, 100);
    let r = deliver(&mut inbox, &b, &a.flush());
    assert_eq!(r[0].ask_resync, Some(ReplicaId(1)));
    assert_eq!(b.remote_requests(), 0);
    deliver(&mut inbox, &b, &a.outbox.snapshot(1));
    assert_eq!(loads(&a.router), loads(&b));

    for id in 2..10 {
        a.route(id, 50 + 10 * id as usize);
    }
    a.router.prefill_done(RequestId(3)).unwrap();
    a.router.tokens_generated(RequestId(4), 40).unwrap();
    a.router.free(RequestId(1)).unwrap();
    let msgs = a.flush();
    deliver(&mut inbox, &b, &msgs);
    assert_eq!(loads(&a.router), loads(&b));
    assert_eq!(b.remote_requests(), 8);
    // A repeat changes nothing.
    let r = deliver(&mut inbox, &b, &msgs);
    assert_eq!(r[0].applied, 0);
    assert_eq!(loads(&a.router), loads(&b));

    // A message lost: the next one shows the gap; A's bookings go until its snapshot.
    let later = Instant::now() + RESYNC_EVERY;
    a.router.free(RequestId(2)).unwrap();
    let lost = a.flush();
    assert_eq!(lost.len(), 1);
    a.router.free(RequestId(5)).unwrap();
    let r = deliver_at(&mut inbox, &b, &a.flush(), later);
    assert_eq!(r[0].ask_resync, Some(ReplicaId(1)));
    assert_eq!(r[0].dropped, 8);
    assert_eq!(b.remote_requests(), 0);
    assert_eq!(inbox.counts().gaps, 1);
    let r = deliver_at(&mut inbox, &b, &a.outbox.snapshot(1), later);
    assert_eq!(r[0].applied, 6);
    assert_eq!(loads(&a.router), loads(&b));

    // A lost last message shows at the next heartbeat.
    a.router.free(RequestId(6)).unwrap();
    let _lost = a.flush();
    let r = deliver_at(&mut inbox, &b, &[a.outbox.heartbeat(1)], later);
    assert_eq!(r[0].ask_resync, None, "asked less than a second ago");
    assert_eq!(b.remote_requests(), 0);
    assert_eq!(inbox.synced_peers(), 0);

    // Goodbye.
    deliver(&mut inbox, &b, &a.outbox.snapshot(1));
    assert_eq!(b.remote_requests(), 5);
    let r = deliver(&mut inbox, &b, &[a.outbox.bye(1)]);
    assert_eq!(r[0].dropped, 5);
    assert_eq!((inbox.peers(), b.remote_requests()), (0, 0));
    assert_eq!(loads(&b), vec![LoadView::default(); WORKERS as usize]);
}

#[test]
fn a_large_book_travels_in_parts_that_fit_a_message() {
    let mut a = Sender::new(1);
    let b = router();
    let mut inbox = Inbox::new(ReplicaId(2), BS);
    for id in 1..=300 {
        a.route(id, 16 * 600);
    }
    let msgs = a.flush();
    assert!(msgs.len() > 1, "{} messages", msgs.len());
    assert!(msgs
        .iter()
        .all(|m| m.len() <= wire::MAX_MESSAGE_BYTES + 4096));
    let parts = a.outbox.snapshot(1);
    assert!(parts.len() > 1);
    assert!(parts
        .iter()
        .all(|m| m.len() <= wire::MAX_MESSAGE_BYTES + 4096));
    deliver(&mut inbox, &b, &parts);
    assert_eq!(b.remote_requests(), 300);
    assert_eq!(loads(&a.router), loads(&b));
    // Parts out of order are a gap.
    let mut again = a.outbox.snapshot(1);
    again.swap(1, 2);
    let r = deliver(&mut inbox, &b, &again);
    assert!(r.iter().any(|r| r.ask_resync.is_some() || r.dropped > 0));
}

/// A server with a small `max_payload`: batches and snapshots fit it, and a prompt whose
/// hashes alone would not keeps its leading blocks, so that every message is one NATS takes.
#[test]
fn messages_fit_a_small_server_and_a_long_prompt_keeps_its_leading_blocks() {
    let mut a = Sender::new(1);
    // Booked before the server's limit is known (its first connection), then told it.
    a.route(21, 16 * 300);
    for d in a.queue.lock().unwrap().drain(..) {
        a.outbox.push(&d.as_delta());
    }
    a.outbox.set_max_bytes(1024);
    let b = router();
    let mut inbox = Inbox::new(ReplicaId(2), BS);
    // 250 blocks: 2,000 bytes of hashes alone.
    a.route(1, 16 * 250);
    for id in 2..=20 {
        a.route(id, 16 * 20);
    }
    let msgs = a.flush();
    assert!(msgs.len() > 1, "{} messages", msgs.len());
    assert!(
        msgs.iter().all(|m| m.len() <= 2048),
        "{:?}",
        msgs.iter().map(Vec::len).collect::<Vec<_>>()
    );
    let parts = a.outbox.snapshot(1);
    assert!(parts.iter().all(|m| m.len() <= 2048));
    deliver(&mut inbox, &b, &parts);
    assert_eq!(b.remote_requests(), 21);
    // The long prompt's load is the same on both: its blocks count from its tokens, the
    // hashes that fit only name the leading ones.
    let rank = a.router.fleet().ranks.iter().map(|r| r.rank).find(|r| {
        a.router
            .load(*r)
            .is_some_and(|l| l.prefill_tokens >= 16 * 250)
    });
    let rank = rank.unwrap();
    let (mine, theirs) = (a.router.load(rank).unwrap(), b.load(rank).unwrap());
    assert_eq!(theirs.prefill_tokens, mine.prefill_tokens);
    assert_eq!(theirs, mine, "its blocks count from its tokens");
}

#[test]
fn quiet_peers_are_dropped_and_own_messages_ignored() {
    let mut a = Sender::new(1);
    let b = router();
    let mut inbox = Inbox::new(ReplicaId(2), BS);
    a.route(1, 64);
    a.flush();
    deliver(&mut inbox, &b, &a.outbox.snapshot(1));
    assert_eq!(b.remote_requests(), 1);
    let t = Instant::now();
    assert!(inbox.sweep(&b, t, Duration::from_secs(60)).is_empty());
    let gone = inbox.sweep(&b, t + Duration::from_secs(61), Duration::from_secs(60));
    assert_eq!(gone, vec![(ReplicaId(1), 1)]);
    assert_eq!(b.remote_requests(), 0);

    let mut own = Inbox::new(ReplicaId(1), BS);
    let r = deliver(&mut own, &b, &a.outbox.snapshot(1));
    assert_eq!(r[0], Received::default());
    assert_eq!(b.remote_requests(), 0);
}

#[test]
fn forged_and_foreign_messages_are_refused_and_counted() {
    let b = router();
    let mut inbox = Inbox::new(ReplicaId(2), BS);
    let now = Instant::now();
    for junk in [&b""[..], b"\x00\x01\x02", &[0xff; 64][..]] {
        assert!(inbox.receive(&b, junk, now, 0).is_err());
    }
    let mut other_bs = Outbox::new(ReplicaId(3), 32);
    assert!(inbox.receive(&b, &other_bs.snapshot(0)[0], now, 0).is_err());
    let mut env = decode(&Outbox::new(ReplicaId(3), BS).heartbeat(0)).unwrap();
    env.version = 99;
    assert_eq!(
        inbox.receive(&b, &encode(&env), now, 0),
        Err(WireError::Version(99))
    );
    // A booking on a rank the router does not know, or that contradicts itself.
    let bad = |worker: u64, prompt: u64| Envelope {
        version: wire::SYNC_VERSION,
        block_size: BS,
        replica: 3,
        seq: 1,
        sent_unix_ns: 0,
        body: Body::Snapshot {
            first: true,
            last: true,
            bookings: vec![WireBooking {
                request: 1,
                worker,
                dp_rank: 0,
                prefill_tokens: 10,
                prompt_tokens: prompt,
                cached_tokens: 0,
                expected_output_tokens: None,
                hashes: vec![1, 2, 3],
                prefill_done: true,
                output_blocks: u64::MAX,
                generated: 0,
            }],
        },
    };
    let r = inbox.receive(&b, &encode(&bad(99, 48)), now, 0).unwrap();
    assert_eq!((r.applied, r.refused), (0, 1));
    let r = inbox.receive(&b, &encode(&bad(0, 20)), now, 0).unwrap();
    assert_eq!((r.applied, r.refused), (0, 1));
    let c = inbox.counts();
    assert_eq!((c.malformed, c.foreign, c.refused), (3, 2, 2));
    assert_eq!(loads(&b), vec![LoadView::default(); WORKERS as usize]);
    // Output blocks past the limit are refused, the booking itself kept.
    let r = inbox.receive(&b, &encode(&bad(0, 48)), now, 0).unwrap();
    assert_eq!(r.applied, 1);
    assert_eq!(b.load(WorkerRank::new(0, 0)).unwrap().output_blocks, 0);
}

#[test]
fn the_log_carries_every_change_and_wakes_its_collector() {
    let log = Arc::new(DeltaLog::new());
    let r = router();
    let sink = Arc::clone(&log);
    r.on_booking(move |d| sink.append(d));
    let a = Sender {
        router: r,
        queue: Arc::new(Mutex::new(Vec::new())),
        outbox: Outbox::new(ReplicaId(1), BS),
    };
    for id in 1..=5 {
        a.route(id, 40 * id as usize);
    }
    a.router.prefill_done(RequestId(2)).unwrap();
    a.router.tokens_generated(RequestId(3), 50).unwrap();
    a.router.free(RequestId(4)).unwrap();
    let taken = log.take();
    assert!(!taken.lost && taken.oldest_ns > 0);
    let mut via_log = Outbox::new(ReplicaId(1), BS);
    assert_eq!(Replayer::new().replay(&taken, &mut via_log), 9);
    assert_eq!(via_log.active(), 4);
    // What the log carried rebuilds A's load on another router.
    let b = router();
    let mut inbox = Inbox::new(ReplicaId(2), BS);
    deliver(&mut inbox, &b, &via_log.snapshot(1));
    assert_eq!(loads(&a.router), loads(&b));
    // Truncated words end the batch, never panic.
    for cut in 0..taken.words.len() {
        let mut o = Outbox::new(ReplicaId(1), BS);
        assert!(Replayer::new().replay_words(&taken.words[..cut], &mut o) <= 9);
    }
    let mut o = Outbox::new(ReplicaId(1), BS);
    assert!(Replayer::new().replay_words(&[99, 1, 2], &mut o) == 0);
    // An empty log gives nothing; a parked collector wakes on the next change.
    log.recycle(taken.words);
    let again = log.take();
    assert!(again.words.is_empty() && !again.lost);
    let waiter = {
        let log = Arc::clone(&log);
        std::thread::spawn(move || {
            log.wait();
            log.take().words.len()
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    a.router.free(RequestId(5)).unwrap();
    let start = Instant::now();
    while !waiter.is_finished() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the collector never woke"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(waiter.join().unwrap(), 2);
    // Closing the log wakes a parked collector for good.
    let waiter = {
        let log = Arc::clone(&log);
        std::thread::spawn(move || {
            while !log.is_closed() {
                log.wait();
            }
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    log.close();
    let start = Instant::now();
    while !waiter.is_finished() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the collector never stopped"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    log.wait();
}

/// A booking's change for the log tests: `hashes` on worker 0.
fn booked(request: u64, hashes: &[LocalHash]) -> BookingDelta<'_> {
    BookingDelta::Booked(RemoteBooking {
        request: RequestId(request),
        rank: WorkerRank::new(0, 0),
        prefill_tokens: 16 * hashes.len() as u64,
        block_hashes: hashes,
        prompt_tokens: 16 * hashes.len() as u64 + 3,
        cached_tokens: 0,
        expected_output_tokens: None,
    })
}

proptest::proptest! {
    /// Bookings sharing prefixes in every way (a new chain under a root shared with others,
    /// an earlier booking's chain cut, extended or repeated as a conversation's turns are,
    /// chains with no block, chains past what a slot keeps) reach the outbox through the log
    /// exactly as pushed directly, batch after batch.
    #[test]
    fn the_log_rebuilds_every_booking_from_the_hashes_it_did_not_repeat(
        batches in proptest::collection::vec(
            proptest::collection::vec(
                (0u64..4, 0usize..6, 0usize..40, 0usize..64, proptest::bool::ANY, proptest::bool::ANY),
                1..30,
            ),
            1..6,
        ),
    ) {
        let log = DeltaLog::new();
        let mut replayer = Replayer::new();
        let (mut direct, mut via) = (Outbox::new(ReplicaId(1), BS), Outbox::new(ReplicaId(1), BS));
        let mut sent: Vec<Vec<LocalHash>> = Vec::new();
        for bookings in batches {
            for (root, branch, len, earlier, follow, long) in bookings {
                let request = sent.len() as u64 + 1;
                let fresh = |i: usize| LocalHash(request * 1_000_000 + i as u64);
                let len = if long { 4090 + len } else { len };
                let hashes: Vec<LocalHash> = match sent.get(earlier % sent.len().max(1)) {
                    // An earlier chain, its first `len` blocks, then `branch` of its own.
                    Some(prior) if follow => prior
                        .iter()
                        .copied()
                        .take(len)
                        .chain((0..branch).map(|i| fresh(len + i)))
                        .collect(),
                    // A chain under `root`, sharing its first `branch` blocks with the root's.
                    _ => (0..len)
                        .map(|i| if i < branch.max(1) { LocalHash(root * 1_000_000 + i as u64) } else { fresh(i) })
                        .collect(),
                };
                let d = booked(request, &hashes);
                direct.push(&d);
                log.append(&d);
                if request.is_multiple_of(3) {
                    let f = BookingDelta::Freed(RequestId(request - 1));
                    direct.push(&f);
                    log.append(&f);
                }
                sent.push(hashes);
            }
            let taken = log.take();
            replayer.replay(&taken, &mut via);
            proptest::prop_assert_eq!(direct.flush(1), via.flush(1));
        }
    }
}

#[test]
fn a_booking_repeating_a_recent_prompt_writes_none_of_its_hashes_again() {
    let log = DeltaLog::new();
    let hashes: Vec<LocalHash> = (0..61).map(LocalHash).collect();
    log.append(&booked(1, &hashes));
    log.append(&booked(2, &hashes));
    log.append(&booked(3, &hashes[..40]));
    let taken = log.take();
    assert_eq!(taken.words.len(), (10 + 61) + 10 + 10);
    let (mut direct, mut via) = (Outbox::new(ReplicaId(1), BS), Outbox::new(ReplicaId(1), BS));
    for (id, h) in [(1, &hashes[..]), (2, &hashes[..]), (3, &hashes[..40])] {
        direct.push(&booked(id, h));
    }
    assert_eq!(Replayer::new().replay(&taken, &mut via), 3);
    assert_eq!(direct.flush(1), via.flush(1));
}

#[test]
fn a_buffer_handed_back_is_written_again_only_after_as_many_others() {
    let log = DeltaLog::new();
    let mut buffers = Vec::new();
    for i in 0..4 * RECYCLE_AFTER as u64 {
        log.append(&BookingDelta::Freed(RequestId(i)));
        let taken = log.take();
        assert_eq!(taken.words.len(), 2);
        buffers.push(taken.words.as_ptr());
        log.recycle(taken.words);
    }
    for (i, p) in buffers.iter().enumerate() {
        if let Some(j) = buffers[i + 1..].iter().position(|q| q == p) {
            assert!(j >= RECYCLE_AFTER, "reused after {j} takes");
        }
    }
    // They do come back: the log keeps a bounded set.
    let mut distinct = buffers.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() <= RECYCLE_AFTER + 3,
        "{} buffers",
        distinct.len()
    );
}
