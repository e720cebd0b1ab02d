//! The sockets that feed [`engine`](crate::engine) from a live engine: a ZeroMQ SUB on each
//! (worker, dp rank)'s publisher and a DEALER on its replay socket, driving the sequence
//! tracker and the decoder, and writing into a [`Router`].
//!
//! ```text
//!  connect (backoff) ──▶ catch up from the replay ──▶ follow the live stream ──▶ (publisher gone)
//!        ▲                                                                          │
//!        └──────────────────────────────────────────────────────────────────────────┘
//!  SUB ──parse_live──▶ SeqTracker::offer_live ──Apply──▶ EngineDecoder ──▶ Router::apply_event
//!                                  ├─Held/Dropped + request──▶ DEALER [empty, from] ──▶ replies
//!                                  │        ──offer_replayed / replay_end──▶ Apply / Lost
//!                                  ├─Restart──▶ clear every rank of the worker, then apply
//!                                  └─Lost (or no replay socket, or no answer)──▶ clear the rank
//! ```
//!
//! One task per (worker, rank), which owns its connection: nothing waits for a publisher that
//! is not up ([`Subscription::start`] returns at once). The task connects with backoff (50 ms
//! doubling to 250 ms between attempts of 500 ms), and drops and remakes both sockets when the
//! SUB's peer goes away, so a restarted engine is reached within about 0.4 s of its return and
//! its replay socket with it.
//!
//! **Every connection starts with a catch-up**, before any live batch: a publisher that went
//! away and came back is a new process unless the replay proves otherwise. The subscription
//! asks the replay for the last batch it applied and everything after: the same bytes at the
//! same seq prove the same process, and what follows fills the gap. Anything else (no such
//! batch, other bytes, no answer, no replay socket) is a new epoch: the rank is cleared and
//! rebuilt from the oldest batch the replay holds. A new subscriber does the same from the
//! start. A rank rebuilt from a replay that no longer reached back to its publisher's first
//! batch, or cleared for a gap it could not fill, is `Partial` until its cache turns over: the
//! index holds only what was stored since, and never a block the engine dropped. A Stored
//! event continuing a block the index never saw shows the engine still holds part of that
//! history (the index places the chain under another rank's block of that name where it can,
//! see [`IndexError::UnknownParent`]); the cache has turned over once the rank has stored its
//! whole capacity ([`SubscriberConfig::capacity_blocks`]) with no such event since. Without a
//! capacity, it stays partial until the engine clears its cache.
//!
//! [`IndexError::UnknownParent`]: kvroute_core::IndexError::UnknownParent
//!
//! A replay is served inline: live messages wait in the SUB socket's queue meanwhile, and the
//! tracker holds what arrives ahead of the gap. A replay that does not end within
//! [`SubscriberConfig::replay_timeout`] is abandoned: its gap counts as lost and the rank is
//! cleared, as when the replay no longer reaches back.
//!
//! Every outcome is counted in [`SubscriberStats`], which the task publishes after each message;
//! each change of [`RankState`] is logged.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use kvroute_core::{
    DpRank, EventHeader, EventId, IndexError, KvEvent, KvEventData, Router, StorageTier, WorkerId,
    WorkerRank,
};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use zeromq::{
    DealerSocket, Endpoint, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

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
    /// The rank's KV cache, in blocks, when known: a partial rank is live again once it has
    /// stored this many blocks with no sign of an older one (see [`RankState::Partial`]).
    pub capacity_blocks: Option<u64>,
    /// A count, shared by any number of subscriptions, of those whose stream does not flow
    /// (see [`Subscription::flowing`]): a subscription counts itself from its start until it
    /// flows, again while it does not, and never once stopped. A router's front reads one
    /// number to know that every stream flows.
    pub not_flowing: Option<Arc<AtomicUsize>>,
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
    /// Batches refused whole for naming another dp rank than the one subscribed to.
    pub foreign_rank_batches: u64,
    /// Replays that did not end in time.
    pub replay_timeouts: u64,
    /// Ranks cleared: for lost events (gaps the replay could not fill), or on request
    /// ([`Subscription::clear_index`]).
    pub ranks_cleared: u64,
    /// The sequence tracker's counts (gaps, replays, duplicates, restarts, lost).
    pub sequence: SequenceCounts,
    /// The decoder's counts (events by kind, decode errors by kind).
    pub decode: DecodeCounts,
    /// Whether the subscription has received a live message.
    pub live: bool,
    /// Where it stands now.
    pub state: RankState,
    /// Connections made to the publisher (the first, then one per return).
    pub connects: u64,
    /// Catch-ups from the replay (one per connection with a replay socket that answered).
    pub catch_ups: u64,
    /// Batches applied by those catch-ups.
    pub caught_up_batches: u64,
    /// Reconnections whose publisher the replay proved the same process (the gap filled).
    pub continued: u64,
    /// Reconnections to a new process (or one the replay could not prove the same): the rank
    /// cleared and rebuilt.
    pub new_epochs: u64,
    /// Stored events continuing a block the index did not hold for the rank (what a partial
    /// rank's engine kept from before): placed under another rank's block of that name, or
    /// refused.
    pub unrooted_stores: u64,
    /// Of those, the ones placed under another rank's block.
    pub placed_under_peer: u64,
    /// Blocks stored since the index was last shown to lack part of the rank's cache (a
    /// partial rank is live again once they reach its capacity).
    pub turnover_blocks: u64,
    /// The seq of the last batch applied.
    pub last_seq: Option<u64>,
    /// Batches held ahead of a gap while the replay fills it: how far the index lags what
    /// arrived.
    pub held_batches: u64,
}

/// Where one rank's event stream stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RankState {
    /// Not connected yet: the publisher has not been reached since the subscription started.
    #[default]
    Connecting,
    /// Connected, asking the replay for what the index lacks; live batches wait.
    CatchingUp,
    /// Following the live stream; the index holds the rank's cache.
    Live,
    /// Following the live stream, but the index knows part of the rank's cache only (a gap
    /// the replay no longer held, a publisher met after its replay buffer turned over, a
    /// chain whose parent it never saw): it holds what was stored since, never a block the
    /// engine dropped, until the cache turns over.
    Partial,
    /// The publisher went away; reconnecting. What the index holds stays until the catch-up
    /// proves it or clears it.
    Down,
}

impl RankState {
    /// Every state, in the order of a stream's life.
    pub const ALL: [RankState; 5] = [
        RankState::Connecting,
        RankState::CatchingUp,
        RankState::Live,
        RankState::Partial,
        RankState::Down,
    ];

    /// Whether events flow: the index follows the rank (`Live` or `Partial`).
    pub fn flows(self) -> bool {
        matches!(self, RankState::Live | RankState::Partial)
    }

    /// The state's name, as `/v1/workers` and the logs give it.
    pub fn as_str(self) -> &'static str {
        match self {
            RankState::Connecting => "connecting",
            RankState::CatchingUp => "catching_up",
            RankState::Live => "live",
            RankState::Partial => "partial",
            RankState::Down => "down",
        }
    }
}

/// A running subscription; dropping it does not stop it, [`Subscription::stop`] does.
#[derive(Debug)]
pub struct Subscription {
    stats: Arc<Mutex<SubscriberStats>>,
    flowing: Arc<AtomicBool>,
    clear: Arc<Notify>,
    task: JoinHandle<()>,
}

impl Subscription {
    /// Starts following the publisher, writing into `router` (on the current tokio runtime).
    /// Returns at once: the task connects when the publisher is up, and again whenever it
    /// comes back. Fails only for an endpoint that is not one.
    pub async fn start(
        router: Arc<Router>,
        config: SubscriberConfig,
    ) -> Result<Self, zeromq::ZmqError> {
        config.endpoint.parse::<Endpoint>()?;
        if let Some(replay) = &config.replay {
            replay.parse::<Endpoint>()?;
        }
        let stats = Arc::new(Mutex::new(SubscriberStats::default()));
        let clear = Arc::new(Notify::new());
        let flowing = Arc::new(AtomicBool::new(false));
        if let Some(count) = &config.not_flowing {
            count.fetch_add(1, Ordering::Relaxed);
        }
        let follower = Follower {
            flowing: Arc::clone(&flowing),
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
            dealer: None,
            last: None,
            partial: false,
            turnover: 0,
            config,
        };
        let task = tokio::spawn(follower.run());
        Ok(Subscription {
            stats,
            flowing,
            clear,
            task,
        })
    }

    /// Whether its events flow (its state is live or partial): read without a lock, for
    /// choosing where a request may go.
    pub fn flowing(&self) -> bool {
        self.flowing.load(Ordering::Relaxed)
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

/// The first wait between connection attempts, doubled after each failure up to
/// [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(50);
/// The longest wait between connection attempts. Within an attempt, zeromq tries again after
/// 50, 100 and 200 ms, so an engine back up is reached within about 0.4 s.
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// How long one connection attempt may take (TCP connects and ZeroMQ's greeting).
const CONNECT_ATTEMPT: Duration = Duration::from_millis(500);

struct Follower {
    config: SubscriberConfig,
    /// Shared with the [`Subscription`]: whether its state flows.
    flowing: Arc<AtomicBool>,
    clear: Arc<Notify>,
    decoder: EngineDecoder,
    tracker: SeqTracker<Bytes>,
    router: Arc<Router>,
    next_id: EventId,
    events: Vec<KvEvent>,
    stats: SubscriberStats,
    shared: Arc<Mutex<SubscriberStats>>,
    /// The replay socket, made on demand and dropped when it fails (zeromq's DEALER does not
    /// reconnect by itself).
    dealer: Option<DealerSocket>,
    /// The last batch applied, by seq and bytes: what a catch-up checks continuity against.
    last: Option<(u64, Bytes)>,
    /// Whether the index lacks part of the rank's history (see [`RankState::Partial`]).
    partial: bool,
    /// Blocks stored since the index was last shown to lack part of the rank's cache.
    turnover: u64,
}

impl Drop for Follower {
    /// A stopped subscription no longer counts as one that does not flow.
    fn drop(&mut self) {
        if let (false, Some(count)) = (self.stats.state.flows(), &self.config.not_flowing) {
            count.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Why the live stream stopped.
enum Stop {
    /// The publisher went away: reconnect.
    Gone,
}

impl Follower {
    async fn run(mut self) {
        let mut backoff = MIN_BACKOFF;
        loop {
            let Some((sub, monitor)) = self.connect_sub().await else {
                self.pause(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            };
            backoff = MIN_BACKOFF;
            self.stats.connects += 1;
            self.catch_up().await;
            let Stop::Gone = self.follow(sub, monitor).await;
            // Both sockets go: the next connection makes new ones.
            self.dealer = None;
            self.set_state(RankState::Down);
            self.publish();
        }
    }

    /// Waits `wait`, clearing the rank if asked meanwhile.
    async fn pause(&mut self, wait: Duration) {
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = self.clear.notified() => {
                self.clear_rank();
                self.publish();
            }
        }
    }

    /// One attempt at the live socket, subscribed, with its monitor.
    async fn connect_sub(
        &mut self,
    ) -> Option<(SubSocket, impl Stream<Item = SocketEvent> + Unpin + use<>)> {
        let mut sub = SubSocket::new();
        let monitor = sub.monitor();
        let connected = tokio::time::timeout(CONNECT_ATTEMPT, sub.connect(&self.config.endpoint));
        match connected.await {
            Ok(Ok(())) => {}
            _ => return None,
        }
        sub.subscribe(&self.config.topic).await.ok()?;
        Some((sub, monitor))
    }

    /// The replay socket, connected now if it is not yet (`None`: there is none, or it is not
    /// up).
    async fn dealer(&mut self) -> Option<&mut DealerSocket> {
        if self.dealer.is_none() {
            let endpoint = self.config.replay.as_deref()?;
            let mut dealer = DealerSocket::new();
            let connected = tokio::time::timeout(CONNECT_ATTEMPT, dealer.connect(endpoint));
            if let Ok(Ok(())) = connected.await {
                self.dealer = Some(dealer);
            }
        }
        self.dealer.as_mut()
    }

    /// Brings the index up to the publisher before any live batch: the gap since the last
    /// batch applied, when the replay proves the publisher the same process; else a new
    /// epoch, rebuilt from the oldest batch the replay holds.
    async fn catch_up(&mut self) {
        self.set_state(RankState::CatchingUp);
        self.publish();
        let last = self.last.clone();
        let answer = match &last {
            Some((seq, _)) => self.ask_all(*seq).await,
            None => self.ask_all(0).await,
        };
        let batches = match (last, answer) {
            // A new subscriber: the whole buffer, oldest first.
            (None, Some(batches)) => {
                self.stats.catch_ups += 1;
                if batches.first().map_or(0, |b| b.0) > 0 {
                    // The publisher had numbered past what its buffer holds: what was stored
                    // before is unknown.
                    self.set_partial();
                }
                batches
            }
            // Nothing to ask, or no answer: the live stream is all there is.
            (None, None) => {
                self.follow_state();
                return;
            }
            (Some((seq, bytes)), Some(batches))
                if batches.first().is_some_and(|b| b.0 == seq && b.1 == bytes) =>
            {
                // The same process: what follows fills the gap.
                self.stats.catch_ups += 1;
                self.stats.continued += 1;
                batches.into_iter().skip(1).collect()
            }
            (Some(_), answered) => {
                // A new process, or one the replay cannot prove the same.
                self.new_epoch();
                self.publish();
                let batches = match answered {
                    Some(_) => self.ask_all(0).await,
                    None => None,
                };
                match batches {
                    Some(batches) => {
                        self.stats.catch_ups += 1;
                        if batches.first().map_or(0, |b| b.0) > 0 {
                            self.set_partial();
                        }
                        batches
                    }
                    None => {
                        // Nothing proves what the engine holds: start partial.
                        self.set_partial();
                        self.follow_state();
                        return;
                    }
                }
            }
        };
        if batches.is_empty() && self.tracker.next_expected().is_none() {
            // A publisher with nothing buffered numbers its next batch from 0.
            self.tracker.expect(0);
        }
        for (seq, payload) in batches {
            self.stats.caught_up_batches += 1;
            self.offer_replayed(seq, payload);
        }
        // Live batches fetched by the catch-up arrive again: duplicates.
        let _ = self.tracker.replay_end();
        self.follow_state();
    }

    /// Live, or partial when the index lacks part of the rank's history.
    fn follow_state(&mut self) {
        let state = if self.partial {
            RankState::Partial
        } else {
            RankState::Live
        };
        self.set_state(state);
        self.publish();
    }

    /// A new epoch of the publisher: the rank cleared, the tracker and the decoder afresh.
    fn new_epoch(&mut self) {
        self.stats.new_epochs += 1;
        tracing::warn!(
            worker = self.config.worker.0,
            dp_rank = self.config.dp_rank.0,
            "KV events: the publisher came back as a new process; its rank is rebuilt"
        );
        self.tracker.new_epoch();
        self.decoder.reset();
        self.clear_rank();
        self.last = None;
        self.partial = false;
    }

    /// Asks the replay for everything from `from` on and collects it, within the replay
    /// timeout (`None`: no replay socket, or no whole answer; the socket is dropped then).
    async fn ask_all(&mut self, from: u64) -> Option<Vec<(u64, Bytes)>> {
        let timeout = self.config.replay_timeout;
        let dealer = self.dealer().await?;
        let answer = tokio::time::timeout(timeout, collect_replay(dealer, from)).await;
        match answer {
            Ok(Ok((batches, bad))) => {
                self.stats.bad_frames += bad;
                Some(batches)
            }
            _ => {
                self.stats.replay_timeouts += 1;
                self.dealer = None;
                None
            }
        }
    }

    /// Follows the live stream until the publisher goes away.
    async fn follow(
        &mut self,
        mut sub: SubSocket,
        mut monitor: impl Stream<Item = SocketEvent> + Unpin,
    ) -> Stop {
        loop {
            let received = tokio::select! {
                received = sub.recv() => received,
                event = monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) | None => return Stop::Gone,
                    Some(_) => continue,
                },
                () = self.clear.notified() => {
                    self.clear_rank();
                    self.publish();
                    continue;
                }
            };
            let Ok(message) = received else {
                return Stop::Gone;
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
                Verdict::Apply(batch) => self.apply(seq, batch),
                Verdict::Duplicate => {}
                Verdict::Held { replay } | Verdict::Dropped { replay } => {
                    if let Some(request) = replay {
                        self.replay(request).await;
                    }
                }
                Verdict::Restart(batch) => {
                    self.clear_worker();
                    self.decoder.reset();
                    self.partial = false;
                    self.apply(seq, batch);
                }
                Verdict::Lost { batch, .. } => {
                    self.clear_rank();
                    self.set_partial();
                    self.apply(seq, batch);
                }
            }
            self.follow_state_quietly();
            self.publish();
        }
    }

    /// The state after a live batch, without publishing twice.
    fn follow_state_quietly(&mut self) {
        let state = if self.partial {
            RankState::Partial
        } else {
            RankState::Live
        };
        self.set_state(state);
    }

    fn set_state(&mut self, state: RankState) {
        if self.stats.state.flows() != state.flows() {
            self.flowing.store(state.flows(), Ordering::Relaxed);
            if let Some(count) = &self.config.not_flowing {
                if state.flows() {
                    count.fetch_sub(1, Ordering::Relaxed);
                } else {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if self.stats.state != state {
            tracing::info!(
                worker = self.config.worker.0,
                dp_rank = self.config.dp_rank.0,
                from = self.stats.state.as_str(),
                to = state.as_str(),
                "KV events"
            );
            self.stats.state = state;
        }
    }

    /// One replayed batch through the tracker.
    fn offer_replayed(&mut self, seq: u64, payload: Bytes) {
        match self.tracker.offer_replayed(seq, payload) {
            Verdict::Apply(batch) => self.apply(seq, batch),
            Verdict::Lost { batch, .. } => {
                self.clear_rank();
                self.set_partial();
                self.apply(seq, batch);
            }
            Verdict::Restart(batch) => {
                self.clear_worker();
                self.decoder.reset();
                self.apply(seq, batch);
            }
            Verdict::Duplicate | Verdict::Held { .. } | Verdict::Dropped { .. } => {}
        }
    }

    /// Fills a gap from the replay socket; without one, or without an answer in time, the gap
    /// is lost and the rank cleared.
    async fn replay(&mut self, mut request: ReplayRequest) {
        loop {
            let timeout = self.config.replay_timeout;
            let has_socket = self.dealer().await.is_some();
            let answered = match has_socket {
                true => tokio::time::timeout(timeout, self.ask(request.from))
                    .await
                    .unwrap_or(false),
                false => false,
            };
            let next = if answered {
                let drain = self.tracker.replay_end();
                for (seq, batch) in drain.apply {
                    self.apply(seq, batch);
                }
                drain.replay
            } else {
                if has_socket {
                    self.stats.replay_timeouts += 1;
                    // Remade for the next gap: the engine may be another process by then.
                    self.dealer = None;
                }
                let (_missing, drain) = self.tracker.abandon_replay();
                self.clear_rank();
                self.set_partial();
                for (seq, batch) in drain.apply {
                    self.apply(seq, batch);
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
    async fn ask(&mut self, from: u64) -> bool {
        let Some(dealer) = self.dealer.as_mut() else {
            return false;
        };
        if send_replay_request(dealer, from).await.is_err() {
            return false;
        }
        loop {
            let Some(dealer) = self.dealer.as_mut() else {
                return false;
            };
            let Ok(reply) = dealer.recv().await else {
                return false;
            };
            let frames = reply.into_vec();
            match parse_replay(&frames) {
                Ok(ReplayReply::Batch(m)) => {
                    // The payload is the last frame in both layouts: kept, not copied.
                    let payload = frames.last().cloned().unwrap_or_default();
                    self.offer_replayed(m.seq, payload);
                }
                Ok(ReplayReply::End) => return true,
                Err(_) => self.stats.bad_frames += 1,
            }
        }
    }

    /// Decodes one batch and writes its events into the router.
    fn apply(&mut self, seq: u64, payload: Bytes) {
        self.events.clear();
        let decoded = self
            .decoder
            .decode(&payload, &mut self.next_id, &mut self.events);
        self.stats.last_seq = Some(seq);
        self.last = Some((seq, payload));
        let Ok(outcome) = decoded else {
            return;
        };
        if outcome.source.dp_rank != self.config.dp_rank {
            // A batch that names a rank this publisher was not declared for (vLLM's external
            // load balancing, a worker declared with too few ranks): its events would land on
            // a rank that is not this one. Refused, counted, logged once.
            self.stats.foreign_rank_batches += 1;
            if self.stats.foreign_rank_batches == 1 {
                tracing::warn!(
                    worker = self.config.worker.0,
                    dp_rank = self.config.dp_rank.0,
                    batch_dp_rank = outcome.source.dp_rank.0,
                    "KV events of a dp rank this endpoint was not declared for: refused \
                     (declare the worker with its dp ranks)"
                );
            }
            return;
        }
        self.stats.applied_batches += 1;
        for event in &self.events {
            if matches!(event.data, KvEventData::Cleared) {
                // The engine emptied its cache: from here the index knows all of it.
                self.partial = false;
            }
            let result = self.router.apply_event(event);
            match (&event.data, &result) {
                (KvEventData::Stored { blocks, .. }, Ok(())) => {
                    self.turnover += blocks.len() as u64;
                }
                (_, Err(IndexError::UnknownParent { placed, .. })) => {
                    // The engine holds a block the index never saw stored.
                    self.stats.unrooted_stores += 1;
                    self.stats.placed_under_peer += u64::from(*placed);
                    self.partial = true;
                    self.turnover = 0;
                }
                _ => {}
            }
            match result {
                // A chain placed under another rank's block is stored all the same.
                Ok(()) | Err(IndexError::UnknownParent { placed: true, .. }) => {
                    self.stats.applied_events += 1;
                }
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
        self.stats.turnover_blocks = self.turnover;
        let capacity = self.config.capacity_blocks;
        if self.partial && capacity.is_some_and(|c| self.turnover >= c) {
            // The engine stored its whole cache's worth since the last sign of an older
            // block: what the index lacked has been evicted.
            self.partial = false;
            tracing::info!(
                worker = self.config.worker.0,
                dp_rank = self.config.dp_rank.0,
                stored = self.turnover,
                "KV events: the rank's cache turned over; the index knows all of it again"
            );
        }
    }

    /// The index lacks part of the rank's cache: partial until it turns over.
    fn set_partial(&mut self) {
        self.partial = true;
        self.turnover = 0;
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
        self.stats.held_batches = self.tracker.held() as u64;
        self.stats.decode = self.decoder.counts();
        if let Ok(mut shared) = self.shared.lock() {
            *shared = self.stats;
        }
    }
}

/// Sends a replay request for everything from `from` on.
async fn send_replay_request(dealer: &mut DealerSocket, from: u64) -> Result<(), ()> {
    let frames = vec![Bytes::new(), Bytes::copy_from_slice(&replay_request(from))];
    let message = ZmqMessage::try_from(frames).map_err(|_| ())?;
    dealer.send(message).await.map_err(|_| ())
}

/// Asks for everything from `from` on and takes the answers up to the end marker: the
/// batches by seq, and how many frames were not a replay's layout.
async fn collect_replay(
    dealer: &mut DealerSocket,
    from: u64,
) -> Result<(Vec<(u64, Bytes)>, u64), ()> {
    send_replay_request(dealer, from).await?;
    let mut batches = Vec::new();
    let mut bad = 0;
    loop {
        let frames = dealer.recv().await.map_err(|_| ())?.into_vec();
        match parse_replay(&frames) {
            Ok(ReplayReply::Batch(m)) => {
                batches.push((m.seq, frames.last().cloned().unwrap_or_default()));
            }
            Ok(ReplayReply::End) => return Ok((batches, bad)),
            Err(_) => bad += 1,
        }
    }
}
