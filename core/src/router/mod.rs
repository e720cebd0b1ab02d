//! The router facade: `route(request) -> Decision`, and the calls that keep load true for the
//! rest of the request's life.
//!
//! ```text
//!   route(&RouteRequest)
//!     1. hash      tokens ──BlockHasher(seed: LoRA, salt)──▶ LocalHash[]        (thread scratch)
//!     2. match     IndexReader::find_depths_into ──▶ overlap per rank id, per tier (lock-free)
//!     3. select    Fleet snapshot × load counters ──▶ candidates ──Selector──▶ rank
//!     4. book      Ledger: prefill tokens, distinct prompt blocks, one request
//!   mark_dispatched / prefill_done / output_block / free
//!                                        by request id, or through a RequestGuard whose
//!                                        drop frees exactly once
//! ```
//!
//! **Under load and churn.** [`Router::submit`] admits through the admission queue
//! ([`crate::queue`]) when every eligible rank is busy; health marks ([`Router::set_health`])
//! steer around workers; required and preferred labels ([`RouteHints::required`],
//! [`RouteHints::preferred`]) constrain and bias the choice; a session id
//! ([`RouteHints::session`], [`crate::session`]) sticks to its rank; the router's own records
//! ([`crate::approx`]) stand in for the KV events of workers that publish none; warming workers
//! ([`crate::config::WarmUp`]) take a share of cache misses; and a shared pool's hits
//! ([`RouteHints::pool`]) earn credit beyond a worker's own overlap.
//!
//! **Phases.** A prefill-phase request goes to prefill workers; when none has joined it falls
//! back to aggregated workers (reported as [`Fallback::PrefillToAggregated`]) unless the config
//! enforces disaggregation ([`Disaggregation::Enforced`]). A whole request in a fleet of prefill
//! and decode workers only is served by a decode worker ([`Fallback::AggregatedToDecode`]), and
//! a decode-phase request in a fleet with no decode worker by an aggregated one
//! ([`Fallback::DecodeToAggregated`]).
//!
//! **Request metrics** ([`Metrics::On`]; [`Router::request_metrics`]) are recorded only for
//! requests marked as having reached their worker ([`Router::mark_dispatched`], or the guard's
//! [`RequestGuard::mark_dispatched`]) and only through the calls that follow:
//!
//! | metric | unit | recorded |
//! |---|---|---|
//! | TTFT | µs | at the first `prefill_done`: time since the route booked the request |
//! | ITL | µs per token | at each `output_block`: time since the previous token event (the first token or the previous block boundary), over the tokens generated in between (a block's worth, or for the first block the tokens after the first one up to the boundary; a boundary at the first token itself gives no sample) |
//! | ISL | tokens | at `free`: prompt tokens |
//! | OSL | blocks | at `free`: output blocks generated (the router sees block boundaries, not tokens) |
//! | KV hit rate | basis points | at `free`: 10,000 × predicted cached tokens / prompt tokens |
//!
//! Requests that expire or lose their worker record nothing at their end. With metrics off
//! the lifecycle calls read no clock; routing reads one only to stamp a booking (for expiry),
//! metrics on or off.
//!
//! The router is driven entirely by calls and is `Sync`: route from any number of threads.
//! Per-thread scratch buffers make a steady-state `route` allocation-free (the full evidence
//! record, opt-in, allocates). It owns the prefix index's single writer behind a mutex
//! ([`Router::apply_event`]) and hands out lock-free readers.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | the `Router` itself: construction, joins, leaves, health marks, load views |
//! | `request.rs` | what a caller hands over: `RouteRequest`, `RouteHints`, `RouteError` |
//! | `decision.rs` | what a route answers: `Decision` and why it was made |
//! | `route.rs` | the route as named steps: check, hash, weigh, constraints, pin or session, match, raise from records |
//! | `held.rs` | `held_blocks`: how far a prompt's beginning matches anywhere, for callers that tokenize in pieces |
//! | `plan.rs` | what a route settles before it selects: its gate, time, eligibility, pin, plan |
//! | `scratch.rs` | one thread's reused buffers |
//! | `choose.rs` | the selection step: the pinned rank, or gather, probe, veto, pick (or wait) |
//! | `book.rs` | the booking step: the ledger, the router's records, the session |
//! | `admission.rs` | `submit`, the admission queue's lanes, release, tickets, cancels |
//! | `lifecycle.rs` | a booked request's calls after its route, and expiry |
//! | `guard.rs` | `RequestGuard`: frees exactly once |
//! | `replicas.rs` | several routers, one fleet: own booking changes out, the others' in |
//! | `events.rs` | KV events into the index, noted by the router |
//! | `sessions.rs` | sticky sessions' end handler, expiry and closes |
//! | `warm_up.rs` | warming workers' share of cache misses |
//! | `metrics.rs` | counters, the overhead split, per-request metrics |
//! | `tests.rs` | unit tests of what the public API cannot reach (behaviour: `core/tests/router/`) |

mod admission;
mod book;
mod choose;
mod decision;
mod events;
mod guard;
mod held;
mod lifecycle;
mod metrics;
mod plan;
mod replicas;
mod request;
mod route;
mod scratch;
mod sessions;
mod warm_up;
mod whole;

pub use self::admission::*;
pub use self::decision::*;
pub use self::events::*;
pub use self::guard::*;
pub use self::metrics::*;
pub use self::replicas::*;
pub use self::request::*;
pub use self::whole::*;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use crate::approx::ApproxCache;
use crate::clock::Clock;
use crate::config::{ConfigError, Metrics, Queueing, RouterConfig, Timing};
use crate::event::{DpRank, WorkerId, WorkerRank};
use crate::health::Health;
use crate::index::{IndexError, IndexReader, PrefixIndex};
use crate::load::{Ledger, LoadView};
use crate::registry::{Fleet, Readiness, Registry, RegistryError, WorkerConfig};
use crate::rng::SharedRng;
use crate::select::{selector_for, Selector};
use crate::session::{SessionEnd, Sessions};

/// Why a router could not be built or a worker could not join or leave.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum RouterError {
    /// The configuration failed validation.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The registry refused the join or leave (a duplicate or unknown worker, a bad worker config).
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The index could not register the worker's ranks: it already tracks its limit of ranks.
    #[error(transparent)]
    Index(#[from] IndexError),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The router.
pub struct Router {
    config: RouterConfig,
    registry: Registry,
    ledger: Ledger,
    index: Mutex<PrefixIndex>,
    reader: IndexReader,
    selector: Box<dyn Selector>,
    rng: SharedRng,
    counters: Counters,
    timings: Option<Mutex<Timings>>,
    metrics: Option<MetricsShards>,
    queue: Option<Queue>,
    /// Ranks whose worker is marked unhealthy; selection reads no mark while 0.
    marked_ranks: AtomicUsize,
    /// Serialises health marks with leaves, so that `marked_ranks` stays exact.
    health_writer: Mutex<()>,
    sessions: Sessions,
    approx: ApproxCache,
    /// Warm-up deadlines are nanoseconds past this instant.
    epoch: Instant,
    /// Where the time comes from.
    clock: Clock,
    /// The latest warm-up deadline of any rank: no rank warms past it.
    warm_horizon_ns: AtomicU64,
    /// Told of every session that ends (expired or closed).
    on_session_end: std::sync::RwLock<Option<SessionCallback>>,
    /// Told of every change to this router's own bookings ([`Router::on_booking`]).
    booking_sink: std::sync::OnceLock<BookingSink>,
}

/// The embedder's handler of ended sessions ([`Router::on_session_end`]).
pub type SessionCallback = Box<dyn Fn(SessionEnd) + Send + Sync>;

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("config", &self.config)
            .field("workers", &self.registry.load().len())
            .field("active_requests", &self.ledger.active())
            .finish()
    }
}

impl Router {
    /// The router with `selector` choosing among the candidates in place of the configured
    /// policy's: an embedder's own policy ([`Selector`]). Call it before routing.
    pub fn with_selector(mut self, selector: Box<dyn Selector>) -> Self {
        self.selector = selector;
        self
    }

    /// A router over `index` (whose block size must be `config.block_size`), on the system's
    /// clock.
    pub fn new(config: RouterConfig, index: PrefixIndex) -> Result<Self, RouterError> {
        Self::with_clock(config, index, Clock::System)
    }

    /// A router over `index` that reads the time from `clock` (a simulation's, a test's).
    pub fn with_clock(
        config: RouterConfig,
        index: PrefixIndex,
        clock: Clock,
    ) -> Result<Self, RouterError> {
        config.validate()?;
        let start = clock.now();
        let reader = index.reader();
        Ok(Router {
            registry: Registry::new(config.block_size, config.min_workers),
            ledger: Ledger::with_prompt_decay(config.prompt_decay),
            index: Mutex::new(index),
            reader,
            selector: selector_for(config.policy),
            rng: SharedRng::new(config.seed),
            counters: Counters::default(),
            timings: (config.timing == Timing::On).then(|| Mutex::new(Timings::new())),
            metrics: (config.metrics == Metrics::On).then(MetricsShards::new),
            queue: match config.queue {
                Queueing::Off => None,
                Queueing::On {
                    max_queued_tokens,
                    order,
                } => Some(Queue {
                    state: Mutex::new(QueueState::new(order, max_queued_tokens)),
                    depth: AtomicUsize::new(0),
                    untaken: AtomicUsize::new(0),
                    epoch: start,
                }),
            },
            marked_ranks: AtomicUsize::new(0),
            health_writer: Mutex::new(()),
            sessions: Sessions::default(),
            approx: ApproxCache::new(config.approximate.max_records),
            epoch: start,
            clock,
            warm_horizon_ns: AtomicU64::new(0),
            on_session_end: std::sync::RwLock::new(None),
            booking_sink: std::sync::OnceLock::new(),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The clock the router reads.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// A lock-free reader of the index.
    pub fn index_reader(&self) -> IndexReader {
        self.reader.clone()
    }

    /// Raises the ledger's booked-prefill floor to the least prefill booked on any rank of
    /// the fleet (the ledger's `refresh_prefill_floor`). A rank published while the refresh read
    /// an older fleet is fresh (nothing booked): its join lowers the floor after publishing,
    /// and if the refresh comes after that, the fleet it reads again below has the rank.
    pub fn refresh_prefill_floor(&self) {
        let fleet = self.registry.load();
        self.ledger
            .refresh_prefill_floor(fleet.ranks.iter().map(|r| &*r.state));
        let latest = self.registry.load();
        if latest.generation != fleet.generation {
            for r in latest.ranks.iter() {
                self.ledger.lower_prefill_floor(r.state.booked_prefill());
            }
        }
    }

    /// Prefill tokens every rank has booked at least, as selection's floors count them
    /// (the ledger's `prefill_floor`).
    pub fn prefill_floor(&self) -> u64 {
        self.ledger.prefill_floor()
    }

    /// The fleet snapshot.
    pub fn fleet(&self) -> std::sync::Arc<Fleet> {
        self.registry.load_full()
    }

    /// Ready once the configured minimum of workers joined.
    pub fn readiness(&self) -> Readiness {
        self.registry.readiness()
    }

    /// A worker joins; its ranks are registered with the index, and warm up from now (with
    /// warm-up on). A worker without KV events ([`KvEvents::Absent`](crate::KvEvents::Absent) in
    /// its config) has the
    /// router record its own decisions as its cache: approximate mode.
    ///
    /// All or nothing: a worker whose ranks do not all fit in the index, or that the registry
    /// refuses, leaves the router as it was.
    pub fn join_worker(&self, config: WorkerConfig) -> Result<(), RouterError> {
        let now = self.clock.now();
        let events = config.kv_events;
        let (id, kv_blocks) = (config.id, config.kv_blocks);
        let first = WorkerRank {
            worker: id,
            dp_rank: DpRank(config.dp_start),
        };
        lock(&self.index).check_rank_room(first, config.dp_size)?;
        let fleet = self.registry.join(config)?;
        // Fresh ranks have booked nothing: published first, then the floor follows (see
        // `refresh_prefill_floor`).
        self.ledger.lower_prefill_floor(0);
        if let Some(w) = fleet.worker(id) {
            let mut index = lock(&self.index);
            for r in &fleet.ranks[w.ranks.clone()] {
                r.state.set_kv_events(events);
                self.warm(&r.state, now);
                // Registered with room for the names of a full cache: the rank's name map is
                // not rebuilt while the worker warms up.
                let joined = index
                    .reserve_blocks(r.rank, kv_blocks)
                    .and_then(|()| index.set_capacity(r.rank, kv_blocks));
                if let Err(e) = joined {
                    // Another join took the room since the check: undo this one.
                    let _ = index.remove_worker(id);
                    drop(index);
                    let _ = self.registry.leave(id);
                    return Err(e.into());
                }
                if let Some(key) = index.rank_key(r.rank) {
                    r.state.set_index_key(key);
                }
            }
            // The ranks' entries take their keys.
            self.registry.republish();
        }
        self.load_freed();
        Ok(())
    }

    /// A worker leaves: its bookings are dropped (returns how many) and its blocks leave the
    /// index.
    pub fn leave_worker(&self, worker: WorkerId) -> Result<usize, RouterError> {
        {
            let _w = lock(&self.health_writer);
            let retired = self.registry.leave(worker)?;
            let marked = retired.iter().filter(|r| !r.health().is_healthy()).count();
            self.marked_ranks.fetch_sub(marked, Ordering::Relaxed);
        }
        let purged = self.ledger.purge_worker(worker);
        self.approx.remove_worker(worker);
        let removed = lock(&self.index).remove_worker(worker);
        // A queued request whose only eligible workers left now fails instead of waiting.
        self.load_freed();
        match removed {
            Ok(()) | Err(IndexError::UnknownWorker { .. }) => Ok(purged),
            Err(e) => Err(e.into()),
        }
    }

    /// Marks a worker's health (see [`Health`]); returns its previous mark. Marking a
    /// worker healthy again may release queued requests.
    pub fn set_health(&self, worker: WorkerId, health: Health) -> Result<Health, RouterError> {
        let previous = {
            let _w = lock(&self.health_writer);
            let fleet = self.registry.load();
            let Some(w) = fleet.worker(worker) else {
                return Err(RegistryError::UnknownWorker { worker }.into());
            };
            let mut previous = Health::Healthy;
            for r in &fleet.ranks[w.ranks.clone()] {
                previous = r.state.set_health(health);
                match (previous.is_healthy(), health.is_healthy()) {
                    (true, false) => {
                        self.marked_ranks.fetch_add(1, Ordering::Relaxed);
                    }
                    (false, true) => {
                        self.marked_ranks.fetch_sub(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
            }
            previous
        };
        self.load_freed();
        Ok(previous)
    }

    /// Tells the router how many KV blocks `rank`'s engine says its requests hold, from the
    /// engine's own metrics: past this router's bookings on the rank, they weigh in its
    /// selection as unshared prompt blocks (0 forgets them). For a router that cannot hear
    /// the fleet's other routers (the booking sync down); false for an unknown rank.
    pub fn set_engine_blocks(&self, rank: WorkerRank, blocks: u64) -> bool {
        let fleet = self.registry.load();
        let Some(i) = fleet.rank_index(rank) else {
            return false;
        };
        if fleet.ranks[i].state.set_engine_blocks(blocks) > blocks {
            // Less load: a request queued for a busy rank may fit now.
            self.load_freed();
        }
        true
    }

    /// Forgets every rank's engine-reported blocks ([`Router::set_engine_blocks`]).
    pub fn clear_engine_blocks(&self) {
        let mut fell = false;
        for r in &self.registry.load().ranks {
            fell |= r.state.set_engine_blocks(0) > 0;
        }
        if fell {
            self.load_freed();
        }
    }

    /// A rank's load, if the rank exists.
    pub fn load(&self, rank: WorkerRank) -> Option<LoadView> {
        let fleet = self.registry.load();
        fleet.rank_index(rank).map(|i| fleet.ranks[i].state.load())
    }

    /// The summed load of every rank.
    pub fn total_load(&self) -> LoadView {
        let fleet = self.registry.load();
        fleet.ranks.iter().fold(LoadView::default(), |a, r| {
            let l = r.state.load();
            LoadView {
                prefill_tokens: a.prefill_tokens + l.prefill_tokens,
                prompt_blocks: a.prompt_blocks + l.prompt_blocks,
                output_blocks: a.output_blocks + l.output_blocks,
                output_decay: a.output_decay + l.output_decay,
                prompt_decay: a.prompt_decay + l.prompt_decay,
                requests: a.requests + l.requests,
                context_blocks: a.context_blocks + l.context_blocks,
            }
        })
    }

    /// Requests currently booked.
    pub fn active_requests(&self) -> usize {
        self.ledger.active()
    }
}

#[cfg(test)]
mod tests;
