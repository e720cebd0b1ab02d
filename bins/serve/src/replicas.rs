//! Several `kvroute serve` replicas, one fleet: each replica's bookings shared with the others
//! over NATS core, on one subject per fleet (`kvroute.<fleet>.bookings`).
//!
//! ```text
//!  Router::on_booking ──▶ DeltaLog ──collector thread, every 500 µs──▶ publisher task: Outbox
//!  publisher task ──publish──▶ NATS subject   (heartbeat every 500 ms, snapshot when asked)
//!  NATS subject ──▶ subscriber task: Inbox::receive ──▶ Router::apply_remote
//!                    quiet peers dropped after 2 s; NATS lost ──▶ every peer dropped (local view)
//! ```
//!
//! Every replica follows every engine's KV events itself, so caches are the engines' word and
//! the sync carries only in-flight load. It is best effort: with NATS down a replica routes on
//! its own bookings and the engines' reported load (`kvroute_replica_sync_up` 0, and a log
//! line); when NATS is back it asks every replica for its book. A replica that dies leaves
//! nothing behind: the others drop its bookings once it has been quiet for 2 s.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use kvroute_core::{ReplicaId, Router};
use kvroute_transport::replicas::{resync, DeltaLog, Inbox, InboxCounts, Outbox, Replayer, Taken};
use prometheus::{Histogram, HistogramOpts, IntGauge, IntGaugeVec, Opts, Registry};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// How often a replica says it is alive (and checks who went quiet).
pub(crate) const HEARTBEAT: Duration = Duration::from_millis(500);
/// A replica not heard for this long is dropped with its bookings.
pub(crate) const SILENT_AFTER: Duration = Duration::from_secs(2);
/// How often, by default, the collector takes the routing threads' changes while they come
/// ([`ReplicaOptions::batch`]).
pub const SYNC_BATCH: Duration = Duration::from_micros(500);
/// The shortest and longest batch window taken.
pub const SYNC_BATCH_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_micros(50)..=Duration::from_millis(100);
/// How long the collector polls without finding a change before it parks until the next.
const IDLE_AFTER: Duration = Duration::from_millis(10);

/// Where the replicas meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaOptions {
    /// The NATS server (`nats://host:4222`; several, comma-separated).
    pub nats: String,
    /// The fleet's name: replicas with the same name share their bookings.
    pub fleet: String,
    /// While bookings change, how often their changes are taken and sent, as one message
    /// ([`SYNC_BATCH`] by default, within [`SYNC_BATCH_RANGE`]): longer sends fewer messages
    /// (each costs every replica a wake-up and a system call or two) for later delivery. The
    /// first change after 10 ms (or a window, if longer) without one is sent at once.
    pub batch: Duration,
}

impl ReplicaOptions {
    /// Replicas of `fleet` meeting at `nats`, with the default batch window.
    pub fn new(nats: impl Into<String>, fleet: impl Into<String>) -> Self {
        ReplicaOptions {
            nats: nats.into(),
            fleet: fleet.into(),
            batch: SYNC_BATCH,
        }
    }
}

/// Why the sync could not start.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    /// The fleet's name cannot be part of a NATS subject.
    #[error("fleet name {0:?}: use 1 to 200 letters, digits, '-' and '_'")]
    FleetName(String),
    /// The NATS client could not be set up (a bad URL).
    #[error("NATS at {url}: {reason}")]
    Nats {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
}

/// The sync's metrics.
#[derive(Debug, Clone)]
pub(crate) struct SyncMetrics {
    up: IntGauge,
    peers: IntGauge,
    remote_requests: IntGauge,
    counts: IntGaugeVec,
    delay: Histogram,
}

impl SyncMetrics {
    pub(crate) fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let up = IntGauge::new(
            "kvroute_replica_sync_up",
            "1 while this replica shares bookings with the fleet's other replicas over NATS; 0 \
             while its view of the load is its own (NATS down, or no NATS configured).",
        )?;
        let peers = IntGauge::new(
            "kvroute_replica_peers",
            "Other replicas whose bookings this one holds, in step with their sequence.",
        )?;
        let remote_requests = IntGauge::new(
            "kvroute_remote_requests",
            "Requests booked by the fleet's other replicas, counted in this one's load.",
        )?;
        let counts = IntGaugeVec::new(
            Opts::new(
                "kvroute_replica_sync",
                "The booking sync since the start: messages sent and heard, deltas applied and \
                 refused, malformed and foreign messages, gaps, snapshots sent and taken, \
                 replicas lost, own deltas lost, messages NATS would not take.",
            ),
            &["kind"],
        )?;
        let delay = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_replica_delay_seconds",
                "From the booking change another replica made (the oldest of its message) to \
                 this replica receiving it, by the two wall clocks (meaningful on one host, or \
                 with synchronised clocks).",
            )
            .buckets(vec![
                5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2,
                5e-2, 0.1, 0.2, 0.5, 1.0,
            ]),
        )?;
        registry.register(Box::new(up.clone()))?;
        registry.register(Box::new(peers.clone()))?;
        registry.register(Box::new(remote_requests.clone()))?;
        registry.register(Box::new(counts.clone()))?;
        registry.register(Box::new(delay.clone()))?;
        Ok(SyncMetrics {
            up,
            peers,
            remote_requests,
            counts,
            delay,
        })
    }

    fn set(&self, kind: &str, value: u64) {
        self.counts
            .with_label_values(&[kind])
            .set(i64::try_from(value).unwrap_or(i64::MAX));
    }

    fn inbox(&self, c: InboxCounts, inbox: &Inbox, router: &Router) {
        for (kind, v) in [
            ("heard", c.messages),
            ("malformed", c.malformed),
            ("foreign", c.foreign),
            ("applied", c.applied),
            ("refused", c.refused),
            ("gaps", c.gaps),
            ("snapshots_taken", c.snapshots),
            ("replicas_lost", c.peers_lost),
        ] {
            self.set(kind, v);
        }
        self.peers.set(inbox.synced_peers() as i64);
        self.scrape(router);
    }

    /// Whether this replica hears the fleet's other replicas now (NATS connected).
    pub(crate) fn is_up(&self) -> bool {
        self.up.get() == 1
    }

    /// What is read at each scrape.
    pub(crate) fn scrape(&self, router: &Router) {
        self.remote_requests.set(router.remote_requests() as i64);
    }
}

/// Whether `name` can name a fleet: one NATS subject token of letters, digits, `-` and `_`.
pub(crate) fn valid_fleet(name: &str) -> bool {
    // JetStream names the registry's stream after it, and takes at most 255 characters.
    (1..=MAX_FLEET_NAME).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// The `nats-server` program to start (the tests, the live demo and the benches start one):
/// the one on `PATH`, else Debian's `/usr/sbin/nats-server`, which a user's `PATH` may lack.
pub fn nats_server_program() -> std::path::PathBuf {
    let debian = std::path::Path::new("/usr/sbin/nats-server");
    let on_path = std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| dir.join("nats-server").is_file())
    });
    if !on_path && debian.is_file() {
        debian.to_path_buf()
    } else {
        std::path::PathBuf::from("nats-server")
    }
}

/// Longest fleet name.
pub(crate) const MAX_FLEET_NAME: usize = 200;

/// A new replica's id: random, nonzero.
pub(crate) fn new_replica_id() -> ReplicaId {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let salt = std::collections::hash_map::RandomState::new();
    let id = kvroute_core::mix64(
        nanos ^ u64::from(std::process::id()).rotate_left(32) ^ salt_bits(&salt),
    );
    ReplicaId(id.max(1))
}

fn salt_bits(s: &std::collections::hash_map::RandomState) -> u64 {
    use std::hash::BuildHasher;
    s.hash_one(0x006b_7672_6f75_7465_u64)
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// What the NATS client's events tell the tasks.
#[derive(Clone, Copy, Debug)]
enum Link {
    Up,
    Down,
}

/// The running sync: its two tasks and the client.
#[derive(Debug)]
pub(crate) struct ReplicaSync {
    pub id: ReplicaId,
    /// The routing threads' changes; closed when the replica leaves.
    log: Arc<DeltaLog>,
    client: async_nats::Client,
    subject: String,
    block_size: u32,
    tasks: Vec<JoinHandle<()>>,
}

impl ReplicaSync {
    /// Connects (in the background: serve starts with NATS down too) and starts sharing
    /// `router`'s bookings as replica `id`.
    pub(crate) async fn start(
        router: &Arc<Router>,
        options: &ReplicaOptions,
        id: ReplicaId,
        metrics: SyncMetrics,
    ) -> Result<Self, ReplicaError> {
        let fleet = &options.fleet;
        if !valid_fleet(fleet) {
            return Err(ReplicaError::FleetName(fleet.clone()));
        }
        let subject = format!("kvroute.{fleet}.bookings");
        let (to_pub, pub_links) = mpsc::unbounded_channel::<Link>();
        let (to_sub, sub_links) = mpsc::unbounded_channel::<Link>();
        let client = async_nats::ConnectOptions::new()
            .name(format!("kvroute serve {:016x}", id.0))
            // A replica's own messages are not sent back to it: it would read and drop a third
            // of what a fleet of three hears.
            .no_echo()
            .retry_on_initial_connect()
            .max_reconnects(None)
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((100 * attempts as u64).min(2_000))
            })
            .event_callback(move |event| {
                let (to_pub, to_sub) = (to_pub.clone(), to_sub.clone());
                async move {
                    let link = match event {
                        async_nats::Event::Connected => Link::Up,
                        async_nats::Event::Disconnected => Link::Down,
                        other => {
                            tracing::warn!(event = %other, "NATS (booking sync)");
                            return;
                        }
                    };
                    let _ = to_pub.send(link);
                    let _ = to_sub.send(link);
                }
            })
            .connect(options.nats.as_str())
            .await
            .map_err(|e| ReplicaError::Nats {
                url: options.nats.clone(),
                reason: e.to_string(),
            })?;
        let subscriber =
            client
                .subscribe(subject.clone())
                .await
                .map_err(|e| ReplicaError::Nats {
                    url: options.nats.clone(),
                    reason: e.to_string(),
                })?;
        let log = Arc::new(DeltaLog::new());
        let (sink, collected) = (Arc::clone(&log), Arc::clone(&log));
        router.on_booking(move |d| sink.append(d));
        let (batches, queue) = mpsc::channel::<Taken>(64);
        let batch = options
            .batch
            .clamp(*SYNC_BATCH_RANGE.start(), *SYNC_BATCH_RANGE.end());
        std::thread::Builder::new()
            .name("kvroute-sync".into())
            .spawn(move || collect(&collected, &batches, batch))
            .map_err(|e| ReplicaError::Nats {
                url: options.nats.clone(),
                reason: format!("cannot start the collector thread: {e}"),
            })?;
        let block_size = router.config().block_size;
        let (snapshots, wanted) = mpsc::unbounded_channel::<()>();
        let publisher = Publisher {
            client: client.clone(),
            subject: subject.clone(),
            outbox: Outbox::new(id, block_size),
            replayer: Replayer::new(),
            metrics: metrics.clone(),
            sent: 0,
            lost_deltas: 0,
            snapshots_sent: 0,
            failed: 0,
            warned: None,
        };
        let listener = Listener {
            router: Arc::clone(router),
            client: client.clone(),
            subject: subject.clone(),
            inbox: Inbox::new(id, block_size),
            id,
            block_size,
            metrics,
            snapshots,
        };
        let tasks = vec![
            tokio::spawn(publisher.run(queue, Arc::clone(&log), pub_links, wanted)),
            tokio::spawn(listener.run(subscriber, sub_links)),
        ];
        tracing::info!(
            replica = format_args!("{:016x}", id.0),
            nats = %options.nats,
            %subject,
            "booking sync started"
        );
        Ok(ReplicaSync {
            id,
            log,
            client,
            subject,
            block_size,
            tasks,
        })
    }

    /// The NATS client (the worker registry shares it).
    pub(crate) fn client(&self) -> async_nats::Client {
        self.client.clone()
    }

    /// Says goodbye, so that the others drop this replica's bookings at once, and stops.
    pub(crate) async fn leave(self) {
        self.log.close();
        for t in &self.tasks {
            t.abort();
        }
        let bye = Outbox::new(self.id, self.block_size).bye(unix_ns());
        let said = async {
            let _ = self.client.publish(self.subject, bye.into()).await;
            let _ = self.client.flush().await;
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), said).await;
    }
}

/// The collector thread: takes the log every `every` while changes come, parks
/// when none came for [`IDLE_AFTER`] (at least one poll), and hands each batch to the
/// publisher (waiting while the publisher is behind). Ends when the publisher has, or the log
/// is closed.
fn collect(log: &DeltaLog, batches: &mpsc::Sender<Taken>, every: Duration) {
    let idle_polls = (IDLE_AFTER.as_micros() / every.as_micros().max(1)).max(1);
    let mut idle = 0;
    while !log.is_closed() {
        let taken = log.take();
        if taken.words.is_empty() && !taken.lost {
            idle += 1;
            if idle >= idle_polls {
                log.wait();
                idle = 0;
            } else {
                std::thread::sleep(every);
            }
            continue;
        }
        idle = 0;
        if batches.blocking_send(taken).is_err() {
            return;
        }
        std::thread::sleep(every);
    }
}

/// The publishing task's state.
struct Publisher {
    client: async_nats::Client,
    subject: String,
    outbox: Outbox,
    replayer: Replayer,
    metrics: SyncMetrics,
    sent: u64,
    lost_deltas: u64,
    snapshots_sent: u64,
    /// Messages NATS would not take (past the server's `max_payload`, or the client gone).
    failed: u64,
    /// When a failed publish was last logged.
    warned: Option<Instant>,
}

impl Publisher {
    async fn run(
        mut self,
        mut queue: mpsc::Receiver<Taken>,
        log: Arc<DeltaLog>,
        mut links: mpsc::UnboundedReceiver<Link>,
        mut wanted: mpsc::UnboundedReceiver<()>,
    ) {
        let mut beat = tokio::time::interval(HEARTBEAT);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                taken = queue.recv() => {
                    let Some(taken) = taken else { return };
                    if taken.lost {
                        // Some changes never reached the log: the book cannot be trusted;
                        // start over from the changes that follow.
                        self.lost_deltas += 1;
                        self.outbox.reset();
                        tracing::warn!("booking sync: own changes dropped (log full); book resent");
                    }
                    self.replayer.replay(&taken, &mut self.outbox);
                    log.recycle(taken.words);
                    let msgs = self.outbox.flush(taken.oldest_ns);
                    self.publish(msgs).await;
                }
                _ = beat.tick() => {
                    let hb = self.outbox.heartbeat(unix_ns());
                    self.publish(vec![hb]).await;
                    self.metrics.set("sent", self.sent);
                    self.metrics.set("own_deltas_lost", self.lost_deltas);
                }
                Some(()) = wanted.recv() => {
                    // Several asks queued are answered by one snapshot.
                    while wanted.try_recv().is_ok() {}
                    self.snapshot().await;
                }
                Some(link) = links.recv() => {
                    if let Link::Up = link {
                        // Messages the server takes: half its max_payload leaves room for
                        // the sizes' estimates.
                        let max_payload = self.client.server_info().max_payload;
                        self.outbox.set_max_bytes(max_payload / 2);
                        // Others may have dropped this replica meanwhile: its book, then a
                        // request for theirs.
                        self.snapshot().await;
                        let (id, bs) = (self.outbox.replica(), self.outbox.block_size());
                        let ask = resync(id, bs, None, unix_ns());
                        self.publish(vec![ask]).await;
                    }
                }
            }
        }
    }

    async fn snapshot(&mut self) {
        let parts = self.outbox.snapshot(unix_ns());
        self.snapshots_sent += 1;
        self.metrics.set("snapshots_sent", self.snapshots_sent);
        self.publish(parts).await;
    }

    async fn publish(&mut self, msgs: Vec<Vec<u8>>) {
        for m in msgs {
            let bytes = m.len();
            match self.client.publish(self.subject.clone(), m.into()).await {
                Ok(()) => self.sent += 1,
                Err(e) => {
                    self.failed += 1;
                    self.metrics.set("publish_failed", self.failed);
                    // Told at most every 10 s: a server that takes none would flood the log.
                    if self
                        .warned
                        .is_none_or(|t| t.elapsed() >= Duration::from_secs(10))
                    {
                        self.warned = Some(Instant::now());
                        tracing::warn!(
                            error = %e,
                            bytes,
                            failed = self.failed,
                            "booking sync: a message NATS would not take (the other replicas \
                             ask for this one's book when they see the gap)"
                        );
                    }
                }
            }
        }
    }
}

/// The listening task's state.
struct Listener {
    router: Arc<Router>,
    client: async_nats::Client,
    subject: String,
    inbox: Inbox,
    id: ReplicaId,
    block_size: u32,
    metrics: SyncMetrics,
    snapshots: mpsc::UnboundedSender<()>,
}

impl Listener {
    async fn run(
        mut self,
        mut subscriber: async_nats::Subscriber,
        mut links: mpsc::UnboundedReceiver<Link>,
    ) {
        let mut sweep = tokio::time::interval(HEARTBEAT);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // NATS unreachable from the start is said as a link lost later is.
        let first_link = tokio::time::sleep(SILENT_AFTER);
        tokio::pin!(first_link);
        let mut linked = false;
        loop {
            tokio::select! {
                () = &mut first_link, if !linked => {
                    linked = true;
                    if self.metrics.up.get() == 0 {
                        tracing::warn!(
                            "booking sync not connected (NATS unreachable): routing on this \
                             replica's own bookings until it is"
                        );
                    }
                }
                msg = subscriber.next() => {
                    let Some(msg) = msg else { return };
                    self.take(&msg.payload).await;
                }
                _ = sweep.tick() => {
                    for (peer, bookings) in self.inbox.sweep(&self.router, Instant::now(), SILENT_AFTER) {
                        tracing::warn!(
                            replica = format_args!("{:016x}", peer.0),
                            bookings,
                            "replica went quiet: its bookings dropped"
                        );
                    }
                    self.metrics.inbox(self.inbox.counts(), &self.inbox, &self.router);
                }
                Some(link) = links.recv() => match link {
                    Link::Down => {
                        let dropped = self.inbox.forget_all(&self.router);
                        self.metrics.up.set(0);
                        tracing::warn!(
                            dropped,
                            "booking sync lost (NATS down): routing on this replica's own bookings"
                        );
                    }
                    Link::Up => {
                        self.metrics.up.set(1);
                        tracing::info!("booking sync up: sharing bookings with the fleet");
                    }
                },
            }
        }
    }

    async fn take(&mut self, payload: &[u8]) {
        match self
            .inbox
            .receive(&self.router, payload, Instant::now(), unix_ns())
        {
            Ok(r) => {
                if let Some(d) = r.delay {
                    self.metrics.delay.observe(d.as_secs_f64());
                }
                if r.snapshot_wanted {
                    let _ = self.snapshots.send(());
                }
                if let Some(peer) = r.ask_resync {
                    let ask = resync(self.id, self.block_size, Some(peer), unix_ns());
                    let _ = self.client.publish(self.subject.clone(), ask.into()).await;
                }
            }
            Err(e) => tracing::debug!(error = %e, "booking sync: message refused"),
        }
    }
}
