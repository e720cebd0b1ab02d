//! The sockets that feed [`engine`](crate::engine) from a live engine: a ZeroMQ SUB on each
//! (worker, dp rank)'s publisher and a DEALER on its replay socket, driving the sequence
//! tracker and the decoder, and writing into a [`Router`].
//!
//! ```text
//!  SUB ──parse_live──▶ SeqTracker::offer_live ──Apply──▶ EngineDecoder ──▶ Router::apply_event
//!                                  ├─Held/Dropped + request──▶ DEALER [empty, from] ──▶ replies
//!                                  │        ──offer_replayed / replay_end──▶ Apply / Lost
//!                                  ├─Restart──▶ clear every rank of the worker, then apply
//!                                  └─Lost (or no replay socket, or no answer)──▶ clear the rank
//! ```
//!
//! One task per (worker, rank). A replay is served inline: live messages wait in the SUB
//! socket's queue meanwhile, and the tracker holds what arrives ahead of the gap. A replay that
//! does not end within [`SubscriberConfig::replay_timeout`] is abandoned: its gap counts as
//! lost and the rank is cleared, as when the replay no longer reaches back.
//!
//! Every outcome is counted in [`SubscriberStats`], which the task publishes after each message.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::{
    DpRank, EventHeader, EventId, KvEvent, KvEventData, Router, StorageTier, WorkerId, WorkerRank,
};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::engine::{
    parse_live, parse_replay, replay_request, DecodeCounts, DecoderConfig, EngineDecoder,
    ReplayReply, ReplayRequest, SeqTracker, SequenceConfig, SequenceCounts, Verdict,
};

/// One publisher to follow.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// The worker whose events these are.
    pub worker: WorkerId,
    /// Its data-parallel rank (dp rank r publishes on the base port + r).
    pub dp_rank: DpRank,
    /// The publisher's live endpoint (`tcp://host:port`).
    pub endpoint: String,
    /// Its replay endpoint, when it has one.
    pub replay: Option<String>,
    /// The topic prefix subscribed to (empty: every message).
    pub topic: String,
    /// The worker's block size, when known (events with another are refused).
    pub block_size: Option<u32>,
    /// How long a replay may take before its gap counts as lost.
    pub replay_timeout: Duration,
    /// The sequence tracker's limits.
    pub sequence: SequenceConfig,
}

/// What one subscription has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubscriberStats {
    /// Live messages received.
    pub received: u64,
    /// Messages whose frames were not a publisher's layout.
    pub bad_frames: u64,
    /// Batches applied (live, replayed or released from the hold).
    pub applied_batches: u64,
    /// Core events written into the router.
    pub applied_events: u64,
    /// Events the router's index refused.
    pub rejected_events: u64,
    /// Replays that did not end in time.
    pub replay_timeouts: u64,
    /// Ranks cleared: for lost events (gaps the replay could not fill), or on request
    /// ([`Subscription::clear_index`]).
    pub ranks_cleared: u64,
    /// The sequence tracker's counts (gaps, replays, duplicates, restarts, lost).
    pub sequence: SequenceCounts,
    /// The decoder's counts (events by kind, decode errors by kind).
    pub decode: DecodeCounts,
    /// Whether the subscription is connected (it has received a message).
    pub live: bool,
}

/// A running subscription; dropping it does not stop it, [`Subscription::stop`] does.
#[derive(Debug)]
pub struct Subscription {
    stats: Arc<Mutex<SubscriberStats>>,
    clear: Arc<Notify>,
    task: JoinHandle<()>,
}

impl Subscription {
    /// Connects and starts following the publisher, writing into `router` (on the current
    /// tokio runtime). Connection is lazy: a publisher that is not up yet is reached when it is.
    pub async fn start(
        router: Arc<Router>,
        config: SubscriberConfig,
    ) -> Result<Self, zeromq::ZmqError> {
        let mut sub = SubSocket::new();
        sub.connect(&config.endpoint).await?;
        sub.subscribe(&config.topic).await?;
        let dealer = match &config.replay {
            Some(endpoint) => {
                let mut dealer = DealerSocket::new();
                dealer.connect(endpoint).await?;
                Some(dealer)
            }
            None => None,
        };
        let stats = Arc::new(Mutex::new(SubscriberStats::default()));
        let clear = Arc::new(Notify::new());
        let follower = Follower {
            clear: Arc::clone(&clear),
            decoder: EngineDecoder::new(DecoderConfig {
                worker: config.worker,
                dp_rank: config.dp_rank,
                block_size: config.block_size,
                cache_salt: None,
            }),
            tracker: SeqTracker::new(config.sequence),
            router,
            next_id: EventId(0),
            events: Vec::new(),
            stats: SubscriberStats::default(),
            shared: Arc::clone(&stats),
            config,
        };
        let task = tokio::spawn(follower.run(sub, dealer));
        Ok(Subscription { stats, clear, task })
    }

    /// What it has seen so far.
    pub fn stats(&self) -> SubscriberStats {
        self.stats.lock().map_or_else(|e| *e.into_inner(), |s| *s)
    }

    /// Drops what the router's index holds of this rank, in the order of the stream (the
    /// worker is gone, or its cache is; later events are applied as they come).
    pub fn clear_index(&self) {
        self.clear.notify_one();
    }

    /// Stops following (the sockets close).
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Follower {
    config: SubscriberConfig,
    clear: Arc<Notify>,
    decoder: EngineDecoder,
    tracker: SeqTracker<Bytes>,
    router: Arc<Router>,
    next_id: EventId,
    events: Vec<KvEvent>,
    stats: SubscriberStats,
    shared: Arc<Mutex<SubscriberStats>>,
}

impl Follower {
    async fn run(mut self, mut sub: SubSocket, mut dealer: Option<DealerSocket>) {
        loop {
            let received = tokio::select! {
                received = sub.recv() => received,
                () = self.clear.notified() => {
                    self.clear_rank();
                    self.publish();
                    continue;
                }
            };
            let Ok(message) = received else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            self.stats.received += 1;
            self.stats.live = true;
            let frames = message.into_vec();
            // The payload frame is kept by reference count, not copied.
            let (seq, payload) = match parse_live(&frames) {
                Ok(m) => (m.seq, frames[2].clone()),
                Err(_) => {
                    self.stats.bad_frames += 1;
                    self.publish();
                    continue;
                }
            };
            match self.tracker.offer_live(seq, payload) {
                Verdict::Apply(batch) => self.apply(&batch),
                Verdict::Duplicate => {}
                Verdict::Held { replay } | Verdict::Dropped { replay } => {
                    if let Some(request) = replay {
                        self.replay(dealer.as_mut(), request).await;
                    }
                }
                Verdict::Restart(batch) => {
                    self.clear_worker();
                    self.decoder.reset();
                    self.apply(&batch);
                }
                Verdict::Lost { batch, .. } => {
                    self.clear_rank();
                    self.apply(&batch);
                }
            }
            self.publish();
        }
    }

    /// Fills a gap from the replay socket; without one, or without an answer in time, the gap
    /// is lost and the rank cleared.
    async fn replay(&mut self, mut dealer: Option<&mut DealerSocket>, mut request: ReplayRequest) {
        loop {
            let answered = match dealer.as_deref_mut() {
                Some(dealer) => {
                    let timeout = self.config.replay_timeout;
                    tokio::time::timeout(timeout, self.ask(dealer, request.from))
                        .await
                        .unwrap_or(false)
                }
                None => false,
            };
            let next = if answered {
                let drain = self.tracker.replay_end();
                for (_, batch) in &drain.apply {
                    self.apply(batch);
                }
                drain.replay
            } else {
                if dealer.is_some() {
                    self.stats.replay_timeouts += 1;
                }
                let (_missing, drain) = self.tracker.abandon_replay();
                self.clear_rank();
                for (_, batch) in &drain.apply {
                    self.apply(batch);
                }
                drain.replay
            };
            match next {
                Some(again) => request = again,
                None => return,
            }
        }
    }

    /// Sends one replay request and takes its answers up to the end marker. False when the
    /// socket failed.
    async fn ask(&mut self, dealer: &mut DealerSocket, from: u64) -> bool {
        let frames = vec![Bytes::new(), Bytes::copy_from_slice(&replay_request(from))];
        let Ok(message) = ZmqMessage::try_from(frames) else {
            return false;
        };
        if dealer.send(message).await.is_err() {
            return false;
        }
        loop {
            let Ok(reply) = dealer.recv().await else {
                return false;
            };
            let frames = reply.into_vec();
            match parse_replay(&frames) {
                Ok(ReplayReply::Batch(m)) => {
                    // The payload is the last frame in both layouts: kept, not copied.
                    let payload = frames.last().cloned().unwrap_or_default();
                    match self.tracker.offer_replayed(m.seq, payload) {
                        Verdict::Apply(batch) => self.apply(&batch),
                        Verdict::Lost { batch, .. } => {
                            self.clear_rank();
                            self.apply(&batch);
                        }
                        Verdict::Restart(batch) => {
                            self.clear_worker();
                            self.decoder.reset();
                            self.apply(&batch);
                        }
                        Verdict::Duplicate | Verdict::Held { .. } | Verdict::Dropped { .. } => {}
                    }
                }
                Ok(ReplayReply::End) => return true,
                Err(_) => self.stats.bad_frames += 1,
            }
        }
    }

    /// Decodes one batch and writes its events into the router.
    fn apply(&mut self, payload: &[u8]) {
        self.events.clear();
        if self
            .decoder
            .decode(payload, &mut self.next_id, &mut self.events)
            .is_err()
        {
            return;
        }
        self.stats.applied_batches += 1;
        for event in &self.events {
            match self.router.apply_event(event) {
                Ok(()) => self.stats.applied_events += 1,
                Err(e) => {
                    self.stats.rejected_events += 1;
                    // The first rejection of a stream, then one in 1,024: counted always,
                    // logged without flooding.
                    if self.stats.rejected_events % 1_024 == 1 {
                        tracing::warn!(
                            worker = self.config.worker.0,
                            dp_rank = self.config.dp_rank.0,
                            rejected = self.stats.rejected_events,
                            error = %e,
                            "KV event rejected"
                        );
                    }
                }
            }
        }
    }

    /// Drops what the index holds of this rank.
    fn clear_rank(&mut self) {
        self.stats.ranks_cleared += 1;
        let rank = WorkerRank {
            worker: self.config.worker,
            dp_rank: self.config.dp_rank,
        };
        self.decoder.forget_rank(rank.dp_rank);
        self.clear(rank);
    }

    /// Drops what the index holds of every rank of the worker (an engine restart).
    fn clear_worker(&mut self) {
        let fleet = self.router.fleet();
        let ranks: Vec<WorkerRank> = fleet
            .ranks
            .iter()
            .map(|r| r.rank)
            .filter(|r| r.worker == self.config.worker)
            .collect();
        for rank in ranks {
            self.clear(rank);
        }
    }

    fn clear(&mut self, rank: WorkerRank) {
        let event = KvEvent {
            header: EventHeader {
                source: rank,
                event_id: self.next_id,
                tier: StorageTier::Device,
            },
            data: KvEventData::Cleared,
        };
        self.next_id = EventId(self.next_id.0 + 1);
        match self.router.apply_event(&event) {
            Ok(()) => self.stats.applied_events += 1,
            Err(_) => self.stats.rejected_events += 1,
        }
    }

    fn publish(&mut self) {
        self.stats.sequence = self.tracker.counts();
        self.stats.decode = self.decoder.counts();
        if let Ok(mut shared) = self.shared.lock() {
            *shared = self.stats;
        }
    }
}
