//! A fleet of simulated engines and the core's [`Router`] on one virtual clock, in one
//! process: the heart of `kvroute demo`.
//!
//! ```text
//!  arrivals ──route (book)──▶ Engine w ──pass──▶ outputs ──▶ guard: prefill_done, finish
//!     ▲                          │
//!     │                          └─▶ KV events ──apply──▶ router's index
//!     └───────── one virtual clock: the earliest of the next arrival and the next pass end
//! ```
//!
//! A discrete-event loop. Two kinds of event move time: an arrival, and the end of an engine's
//! pass. A pass starts as soon as its engine has work; its outputs and KV events stay inside
//! the engine until virtual time reaches the pass's end, so the router never learns of a
//! block before the pass that stored it has ended (as with a live engine, whose events come
//! after its step). At equal times a pass's end comes before an arrival. An arrival is routed
//! (which books its load), admitted to the chosen engine, and held by a [`RequestGuard`] that
//! the engine's outputs drive: the first token reports the prefill done, the finish frees it.
//!
//! **Disaggregated** ([`FleetConfig::split`], `disagg.rs`): the first engines compute prompts,
//! the others decode. An arrival is routed to a prefill engine (the router's prefill phase)
//! and generates one token there; the prompt's KV then crosses the link ([`KvTransfer`]), a
//! third kind of event, and the request is routed to a decode engine (no credit for cached
//! blocks, no prefill booked), admitted with its KV handed over, and answers from there.
//!
//! **Several routers** ([`Fleet::with_replicas`], `replicas.rs`): arrivals are routed by each
//! router in turn, every engine's KV events reach all of them, and each one's booking changes
//! reach the others after a delay (a fourth kind of event), or never. A request's lifecycle
//! goes to the router that routed it.
//!
//! The router's prediction can miss the engine's truth. A request routed while an earlier one
//! with the same prefix is still in its prefill on that worker is predicted to find those
//! blocks (the router knows the rank's active prompts), though they are not published yet;
//! it misses if both are scheduled in the same pass. And the engine evicts blocks the router
//! still counts until the eviction's pass ends.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::{
    seq_hashes, BlockHasher, Clock, Conditional, Decision, EventId, IndexConfig, IndexError,
    LoadError, ManualClock, Pinned, PrefixIndex, RemoteError, RequestGuard, RequestId, RouteError,
    RouteHints, RouteRequest, Router, RouterConfig, RouterError, WorkerConfig, WorkerRank,
    WorkerRole,
};

use super::config::EngineConfig;
use super::engine::Engine;
use super::error::SimError;
use super::request::{EngineRequest, RequestOutput};
use super::transfer::KvTransfer;

mod disagg;
mod replicas;

pub use replicas::{BookingSync, Replicas};

/// How a fleet is built.
#[derive(Clone, Debug)]
pub struct FleetConfig {
    /// Engines, worker ids `0..workers`, each one data-parallel rank (rank 0).
    pub workers: usize,
    /// Every engine's configuration.
    pub engine: EngineConfig,
    /// The router's configuration; its block size must be the engines'. Several routers
    /// ([`Fleet::with_replicas`]) each take it with their own seed: this one plus their index.
    pub router: RouterConfig,
    /// Disaggregated serving (none: every engine serves whole requests).
    pub split: Option<Split>,
}

/// Disaggregated serving: engines `0..prefill_workers` compute prompts, the others decode.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Split {
    /// Prefill engines, at least 1 and fewer than the fleet's.
    pub prefill_workers: usize,
    /// How long a prompt's KV takes to reach its decode engine.
    pub transfer: KvTransfer,
    /// Conditional disaggregation: when a request is served whole on its decode engine
    /// instead ([`Router::whole_on_decode`]; none: every request is split).
    pub conditional: Option<Conditional>,
}

/// Chooses the rank for each request in place of the router's policy: a peer's selection
/// logic run on the same fleet. The router then books the request on that rank (a pin), so its
/// load, lifecycle and predicted overlap are kept exactly as for the router's own choices.
/// With several routers, one picker reads the router that routes each arrival.
pub trait Picker: Send + fmt::Debug {
    /// The rank that serves request `id` with these prompt tokens, from the router's index
    /// and loads as they stand.
    fn pick(
        &mut self,
        router: &Router,
        id: RequestId,
        tokens: &[u32],
    ) -> Result<WorkerRank, RouteError>;
}

/// A request to come: when, what, and how many tokens it generates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// Virtual time of its arrival.
    pub at: Duration,
    /// Its identity, unique in the run.
    pub id: RequestId,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens it generates.
    pub max_output_tokens: u32,
}

/// Why the fleet could not be built or could not run on.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum FleetError {
    /// The configuration cannot run (no worker, block sizes that differ).
    #[error("invalid fleet config: {reason}")]
    Config {
        /// What is wrong.
        reason: &'static str,
    },
    /// An engine refused a call.
    #[error(transparent)]
    Engine(#[from] SimError),
    /// The router could not be built or a worker could not join.
    #[error(transparent)]
    Router(#[from] RouterError),
    /// A request could not be routed.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// The router's index rejected an engine's event.
    #[error(transparent)]
    Index(#[from] IndexError),
    /// The router rejected a lifecycle call.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A router refused another's booking change (other than one about a booking gone).
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// A request id was submitted twice.
    #[error("request {id:?} was already submitted")]
    Duplicate {
        /// The request.
        id: RequestId,
    },
    /// An arrival before the fleet's present.
    #[error("request {id:?} arrives at {at:?}, before the fleet's time {now:?}")]
    InThePast {
        /// The request.
        id: RequestId,
        /// Its arrival.
        at: Duration,
        /// The fleet's time.
        now: Duration,
    },
}

/// What happened to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestRecord {
    /// The request.
    pub id: RequestId,
    /// The rank the router chose.
    pub worker: WorkerRank,
    /// When it arrived.
    pub arrival: Duration,
    /// When its first token came, once it has.
    pub first_token: Option<Duration>,
    /// When its latest token came, once one has.
    pub last_token: Option<Duration>,
    /// The longest wait between two of its tokens (zero until two came): the stall a client
    /// sees when its decode shares a pass with a long prefill chunk, which a mean hides.
    pub longest_gap: Duration,
    /// When it ended, once it has.
    pub finished: Option<Duration>,
    /// Its prompt's length.
    pub prompt_tokens: u32,
    /// Tokens it generated so far.
    pub output_tokens: u32,
    /// Prompt tokens the router predicted cached on the chosen rank
    /// (`Decision::predicted_cached_tokens`).
    pub predicted_cached: u64,
    /// Prompt tokens the engine found cached (0 until it is scheduled); split, the prefill
    /// engine's.
    pub cached: u32,
    /// Split: the prefill engine that computed the prompt (`worker` is then its decode
    /// engine, once the KV has reached it).
    pub prefill_worker: Option<WorkerRank>,
    /// The most prompt tokens any engine held at arrival, leaving the last token to compute
    /// as admission does: what an oracle placing this one request would have found.
    pub oracle_cached: u32,
}

/// The run in figures.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetReport {
    /// Requests routed.
    pub requests: usize,
    /// Of those, requests that ended.
    pub finished: usize,
    /// Prompt tokens the engines found cached ÷ prompt tokens routed.
    pub hit_rate: f64,
    /// The most prompt tokens any engine held at each arrival ÷ prompt tokens routed: the hit
    /// rate of an oracle that sees every cache, request by request.
    pub oracle_hit_rate: f64,
    /// Mean time from arrival to first token, in milliseconds.
    pub ttft_mean_ms: f64,
    /// 99th percentile (nearest rank) of the same, in milliseconds.
    pub ttft_p99_ms: f64,
    /// Output tokens ÷ virtual seconds from the first arrival to the last finish.
    pub throughput: f64,
    /// Mean time between a request's output tokens after its first, in milliseconds (per
    /// request, then averaged over requests with two tokens or more).
    pub itl_mean_ms: f64,
    /// 99th percentile (nearest rank) of the same per-request figure, in milliseconds.
    pub itl_p99_ms: f64,
    /// By worker id: the 99th percentile of the per-request figure over the requests that
    /// worker decoded (0 for a worker that decoded none). A worker whose decode batches run
    /// far above the others' shows here while the fleet's mean hides it.
    pub worker_itl_p99_ms: Vec<f64>,
    /// Share of decisions whose predicted cached tokens equal the engine's.
    pub prediction_accuracy: f64,
    /// Load imbalance: the busiest worker's active tokens (prompt and generated tokens of the
    /// requests it holds), averaged over virtual time from zero to the fleet's present, ÷ the
    /// mean over workers
    /// (1 is even).
    pub load_imbalance: f64,
    /// Each worker's active tokens averaged over virtual time, by worker id.
    pub mean_active_tokens: Vec<f64>,
    /// Prompt tokens routed to each worker over the run, by worker id (cache hits not
    /// subtracted: the load the router handed out).
    pub prompt_tokens_per_worker: Vec<u64>,
    /// Requests the router still counts as active (several routers: summed over them, each
    /// counting its own and the others' it holds).
    pub active_requests: usize,
}

/// The engines, the router (or routers) and the clock they share.
#[derive(Debug)]
pub struct Fleet {
    /// The routers, by replica index: one, unless built [`Fleet::with_replicas`].
    routers: Vec<Arc<Router>>,
    /// The replica that routes the next arrival.
    turn: usize,
    /// The routers' booking changes on their way to each other, when they sync.
    mail: Option<replicas::Mailbox>,
    clock: ManualClock,
    /// The clock's reading at virtual time zero.
    origin: Instant,
    engines: Vec<Engine>,
    /// Per engine: whether a pass is under way (it ends at the engine's `now()`).
    in_pass: Vec<bool>,
    /// Per engine: the id of its next KV event.
    next_event: Vec<u64>,
    /// Arrivals to come, by time then submission order.
    pending: BTreeMap<(Duration, u64), Arrival>,
    /// Every id submitted, to refuse a second use.
    ids: HashSet<RequestId>,
    submitted: u64,
    guards: HashMap<RequestId, RequestGuard<Arc<Router>>>,
    records: Vec<RequestRecord>,
    record_of: HashMap<RequestId, usize>,
    /// Per engine: prompt and generated tokens of the requests it holds.
    active_tokens: Vec<u64>,
    /// Per engine: `active_tokens` integrated over virtual time, in token-seconds.
    active_token_seconds: Vec<f64>,
    now: Duration,
    /// Chooses ranks instead of the router's policy, when set.
    picker: Option<Box<dyn Picker>>,
    /// Hashes prompts for the oracle, as the engines do.
    hasher: BlockHasher,
    /// Wall-clock nanoseconds of each routing decision (the picker's included), in order.
    route_ns: Vec<u64>,
    /// Each worker's active tokens every `sample_every` of virtual time, when set.
    load: LoadSeries,
    /// Disaggregated serving, when set.
    split: Option<Split>,
    /// Split requests in their prefill, by id.
    prefilling: HashMap<RequestId, disagg::Handoff>,
    /// KV transfers under way, by the time they end then start order.
    transfers: BTreeMap<(Duration, u64), disagg::Handoff>,
    transfers_started: u64,
}

/// Each worker's active tokens sampled at a fixed step of virtual time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadSeries {
    /// The step (zero: not sampled).
    pub every: Duration,
    /// Samples: at `every × (i + 1)`, every worker's active tokens, by worker id.
    pub samples: Vec<Vec<u64>>,
}

impl Fleet {
    /// A fleet of `config.workers` idle engines with empty caches, each joined to a router
    /// on a manual clock at virtual time zero.
    pub fn new(config: FleetConfig) -> Result<Self, FleetError> {
        Fleet::with_replicas(config, Replicas::ONE)
    }

    /// The same with `replicas.count` routers, each with every engine joined, its own index
    /// and its own seed (`config.router.seed` plus its index), syncing their bookings as
    /// `replicas.sync` says.
    pub fn with_replicas(config: FleetConfig, replicas: Replicas) -> Result<Self, FleetError> {
        if replicas.count == 0 {
            return Err(FleetError::Config {
                reason: "a fleet needs a router",
            });
        }
        if config.workers == 0 {
            return Err(FleetError::Config {
                reason: "a fleet needs a worker",
            });
        }
        if config.router.block_size != config.engine.block_size {
            return Err(FleetError::Config {
                reason: "the router's block size must be the engines'",
            });
        }
        if let Some(split) = config.split {
            if split.prefill_workers == 0 || split.prefill_workers >= config.workers {
                return Err(FleetError::Config {
                    reason: "a split fleet needs a prefill worker and a decode worker",
                });
            }
        }
        let clock = ManualClock::new();
        let origin = clock.now();
        let mut engines = Vec::with_capacity(config.workers);
        for _ in 0..config.workers {
            engines.push(Engine::new(config.engine)?);
        }
        let mut routers = Vec::with_capacity(replicas.count);
        for replica in 0..replicas.count {
            routers.push(Arc::new(joined_router(&config, replica, &clock)?));
        }
        Ok(Fleet {
            mail: replicas::Mailbox::connect(&routers, replicas.sync)?,
            routers,
            turn: 0,
            clock,
            origin,
            in_pass: vec![false; config.workers],
            next_event: vec![0; config.workers],
            engines,
            pending: BTreeMap::new(),
            ids: HashSet::new(),
            submitted: 0,
            guards: HashMap::new(),
            records: Vec::new(),
            record_of: HashMap::new(),
            active_tokens: vec![0; config.workers],
            active_token_seconds: vec![0.0; config.workers],
            now: Duration::ZERO,
            picker: None,
            hasher: BlockHasher::new(config.engine.block_size as usize),
            route_ns: Vec::new(),
            load: LoadSeries::default(),
            split: config.split,
            prefilling: HashMap::new(),
            transfers: BTreeMap::new(),
            transfers_started: 0,
        })
    }

    /// Ranks are chosen by `picker` from now on, and booked through the router as pins.
    pub fn set_picker(&mut self, picker: Box<dyn Picker>) {
        self.picker = Some(picker);
    }

    /// Samples every worker's active tokens each `every` of virtual time from now on (zero
    /// stops sampling).
    pub fn sample_load_every(&mut self, every: Duration) {
        self.load.every = every;
    }

    /// The load samples taken so far.
    pub fn load_series(&self) -> &LoadSeries {
        &self.load
    }

    /// Wall-clock nanoseconds each routing decision took, in routing order: the router's
    /// `route` call, with the picker's own work when one is set.
    pub fn route_times_ns(&self) -> &[u64] {
        &self.route_ns
    }

    /// Queues an arrival. Ids must be unique in the run and arrivals not in the past.
    pub fn submit(&mut self, arrival: Arrival) -> Result<(), FleetError> {
        if arrival.at < self.now {
            return Err(FleetError::InThePast {
                id: arrival.id,
                at: arrival.at,
                now: self.now,
            });
        }
        if !self.ids.insert(arrival.id) {
            return Err(FleetError::Duplicate { id: arrival.id });
        }
        self.pending.insert((arrival.at, self.submitted), arrival);
        self.submitted += 1;
        Ok(())
    }

    /// Runs until every arrival has come and every engine is idle.
    pub fn run_until_idle(&mut self) -> Result<(), FleetError> {
        self.run_to(Duration::MAX)
    }

    /// Runs every arrival and pass end at or before `until`, in time order.
    pub fn run_to(&mut self, until: Duration) -> Result<(), FleetError> {
        while let Some(next) = self.next_event().filter(|n| n.at() <= until) {
            match next {
                Next::Delivery(at) => self.deliver_booking(at)?,
                Next::PassEnd(worker, end) => self.end_pass(worker, end)?,
                Next::Transfer(at) => self.hand_over(at)?,
                Next::Arrival(at) => self.arrive(at)?,
            }
            self.post_bookings()?;
        }
        if until != Duration::MAX && until > self.now {
            self.set_time(until);
        }
        Ok(())
    }

    /// The router (for its load, counters and index); with several, the first.
    pub fn router(&self) -> &Router {
        &self.routers[0]
    }

    /// The engines, by worker id.
    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// The virtual time of the last event run.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// Every routed request, in routing order.
    pub fn records(&self) -> &[RequestRecord] {
        &self.records
    }

    /// The run so far in figures.
    pub fn report(&self) -> FleetReport {
        let seconds = self.now.as_secs_f64();
        let mean_active_tokens = self
            .active_token_seconds
            .iter()
            .map(|&ts| ratio(ts, seconds))
            .collect();
        let active = self
            .routers
            .iter()
            .map(|r| r.active_requests() + r.remote_requests())
            .sum();
        report(&self.records, mean_active_tokens, active)
    }

    /// The next event, earliest first; at equal times a booking change's delivery, then a
    /// pass's end (the lowest worker id first), then a transfer's, then an arrival.
    fn next_event(&self) -> Option<Next> {
        [
            self.mail
                .as_ref()
                .and_then(replicas::Mailbox::next_due)
                .map(Next::Delivery),
            self.next_pass_end().map(|(w, end)| Next::PassEnd(w, end)),
            self.transfers
                .keys()
                .next()
                .map(|&(at, _)| Next::Transfer(at)),
            self.pending.keys().next().map(|&(at, _)| Next::Arrival(at)),
        ]
        .into_iter()
        .flatten()
        .min_by_key(Next::at)
    }

    /// The engine whose pass under way ends first, and when (lowest worker id on ties).
    fn next_pass_end(&self) -> Option<(usize, Duration)> {
        self.engines
            .iter()
            .enumerate()
            .filter(|&(w, _)| self.in_pass[w])
            .map(|(w, e)| (w, e.now()))
            .min_by_key(|&(w, end)| (end, w))
    }

    /// Moves virtual time to `t`, on the fleet and the router's clock.
    fn set_time(&mut self, t: Duration) {
        if !self.load.every.is_zero() {
            let every = self.load.every;
            let mut next = every * (self.load.samples.len() as u32 + 1);
            while next <= t {
                self.load.samples.push(self.active_tokens.clone());
                next += every;
            }
        }
        let dt = t.saturating_sub(self.now).as_secs_f64();
        for (sum, &tokens) in self
            .active_token_seconds
            .iter_mut()
            .zip(&self.active_tokens)
        {
            *sum += tokens as f64 * dt;
        }
        self.now = t;
        self.clock.set(self.origin + t);
    }

    /// Worker `worker`'s pass ends at `end`: its events reach the router, its outputs the
    /// requests' guards, and its next pass starts if it has work.
    fn end_pass(&mut self, worker: usize, end: Duration) -> Result<(), FleetError> {
        self.set_time(end);
        self.in_pass[worker] = false;
        self.publish_events(worker)?;
        let outputs = self.engines[worker].take_outputs();
        for output in outputs {
            self.record_output(&output)?;
        }
        self.start_pass(worker);
        Ok(())
    }

    /// Starts a pass on `worker` if it has something to compute.
    fn start_pass(&mut self, worker: usize) {
        self.in_pass[worker] = self.engines[worker].step().is_some();
    }

    /// Applies the engine's event batches to every router's index, numbered per worker.
    fn publish_events(&mut self, worker: usize) -> Result<(), FleetError> {
        let source = WorkerRank::new(worker as u64, 0);
        for batch in self.engines[worker].take_events() {
            for event in &batch.events {
                let id = EventId(self.next_event[worker]);
                self.next_event[worker] += 1;
                let event = event.to_kv_event(source, id);
                for router in &self.routers {
                    router.apply_event(&event)?;
                }
            }
        }
        Ok(())
    }

    /// Notes what a pass did for one request and moves its lifecycle on.
    fn record_output(&mut self, output: &RequestOutput) -> Result<(), FleetError> {
        if self.prefilling.contains_key(&output.id) {
            return self.prefill_output(output);
        }
        if let Some(&i) = self.record_of.get(&output.id) {
            let record = &mut self.records[i];
            let worker = record.worker.worker.0 as usize;
            if let Some(active) = self.active_tokens.get_mut(worker) {
                *active += output.tokens.len() as u64;
                if output.finish.is_some() {
                    let held = u64::from(record.prompt_tokens)
                        + u64::from(record.output_tokens)
                        + output.tokens.len() as u64;
                    *active = active.saturating_sub(held);
                }
            }
            record.output_tokens += output.tokens.len() as u32;
            if record.prefill_worker.is_none() {
                record.cached = output.cached_tokens;
            }
            if output.first_token_at.is_some() {
                record.first_token = output.first_token_at;
            }
            if !output.tokens.is_empty() {
                if let Some(last) = record.last_token {
                    record.longest_gap = record.longest_gap.max(output.at.saturating_sub(last));
                }
                record.last_token = Some(output.at);
            }
            if output.finish.is_some() {
                record.finished = Some(output.at);
            }
        }
        if output.first_token_at.is_some() {
            if let Some(guard) = self.guards.get(&output.id) {
                guard.prefill_done()?;
            }
        }
        if output.finish.is_some() {
            if let Some(guard) = self.guards.remove(&output.id) {
                guard.finish()?;
            }
        }
        Ok(())
    }

    /// The first arrival due at `at`: routed, booked, admitted to the chosen engine.
    fn arrive(&mut self, at: Duration) -> Result<(), FleetError> {
        let Some((_, arrival)) = self.pending.pop_first() else {
            return Ok(());
        };
        self.set_time(at);
        let replica = self.take_turn();
        let router = Arc::clone(&self.routers[replica]);
        let oracle_cached = self.oracle_cached(&arrival.prompt);
        let started = Instant::now();
        let mut request = RouteRequest {
            id: arrival.id,
            tokens: &arrival.prompt,
            hints: RouteHints::default(),
        };
        if let Some(split) = self.split {
            match self.local_decode(&router, &arrival, split) {
                // Served whole where its decode would go: pinned there.
                Some(rank) => request.hints.pinned.backend_instance = Some(rank.worker),
                None => return self.arrive_split(replica, arrival, oracle_cached, started),
            }
        }
        if let Some(picker) = self.picker.as_mut() {
            let rank = picker.pick(&router, arrival.id, &arrival.prompt)?;
            request.hints.pinned = Pinned {
                backend_instance: Some(rank.worker),
                dp_rank: Some(rank.dp_rank),
                ..Pinned::default()
            };
        }
        let (decision, guard) = self.route_dispatched(router, &request, Some(started))?;
        self.admit_arrival(decision.worker, &arrival, disagg::Admit::Whole)?;
        self.record(&arrival, &decision, oracle_cached, None);
        self.guards.insert(arrival.id, guard);
        Ok(())
    }
}

impl Fleet {
    /// Routes `request` through `router` (which books it) and marks it dispatched, timing
    /// the decision from `started` when given: the decision and the request's guard.
    fn route_dispatched(
        &mut self,
        router: Arc<Router>,
        request: &RouteRequest<'_>,
        started: Option<Instant>,
    ) -> Result<(Decision, RequestGuard<Arc<Router>>), FleetError> {
        let decision = router.route(request)?;
        if let Some(started) = started {
            self.route_ns
                .push(started.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64);
        }
        let mut guard = RequestGuard::new(router, decision.request);
        guard.mark_dispatched()?;
        Ok((decision, guard))
    }

    /// Admits `arrival`, arrived now, to the engine of `rank`: whole, for its output, or as a
    /// split request's prefill, for one token.
    fn admit_arrival(
        &mut self,
        rank: WorkerRank,
        arrival: &Arrival,
        how: disagg::Admit,
    ) -> Result<(), FleetError> {
        let max_output_tokens = match how {
            disagg::Admit::Prefill => 1,
            _ => arrival.max_output_tokens,
        };
        let request = EngineRequest {
            id: arrival.id,
            prompt: arrival.prompt.clone(),
            max_output_tokens,
            arrival: self.now,
            cache_salt: None,
        };
        self.admit_on(rank.worker.0 as usize, request, how)
    }

    /// Records an arrival routed by `decision` (split: `prefill_worker` is the prefill engine)
    /// and counts its prompt active on the chosen engine.
    fn record(
        &mut self,
        arrival: &Arrival,
        decision: &Decision,
        oracle_cached: u32,
        prefill_worker: Option<WorkerRank>,
    ) {
        self.record_of.insert(arrival.id, self.records.len());
        self.records.push(RequestRecord {
            id: arrival.id,
            worker: decision.worker,
            arrival: self.now,
            first_token: None,
            last_token: None,
            longest_gap: Duration::ZERO,
            finished: None,
            prompt_tokens: arrival.prompt.len() as u32,
            output_tokens: 0,
            predicted_cached: decision.predicted_cached_tokens,
            cached: 0,
            prefill_worker,
            oracle_cached,
        });
        if let Some(active) = self
            .active_tokens
            .get_mut(decision.worker.worker.0 as usize)
        {
            *active += arrival.prompt.len() as u64;
        }
    }

    /// The most prompt tokens of `prompt` any engine holds now, leaving the last token to
    /// compute as admission does.
    fn oracle_cached(&self, prompt: &[u32]) -> u32 {
        let hashes = seq_hashes(&self.hasher.local_hashes(prompt));
        let block_size = self.hasher.block_size();
        let cap = prompt.len().saturating_sub(1) / block_size;
        let best = self
            .engines
            .iter()
            .map(|e| e.cached_prefix_of(&hashes[..cap.min(hashes.len())]))
            .max()
            .unwrap_or(0);
        (best * block_size) as u32
    }
}

/// The next event of the loop, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    /// A router's booking change reaches the others.
    Delivery(Duration),
    /// A worker's pass ends.
    PassEnd(usize, Duration),
    /// A KV transfer ends.
    Transfer(Duration),
    /// A request arrives.
    Arrival(Duration),
}

impl Next {
    fn at(&self) -> Duration {
        match *self {
            Next::Delivery(t) | Next::PassEnd(_, t) | Next::Transfer(t) | Next::Arrival(t) => t,
        }
    }
}

/// Router `replica` of the fleet `config` builds (its own index, its seed moved on by its
/// index), on `clock`, with every engine joined.
fn joined_router(
    config: &FleetConfig,
    replica: usize,
    clock: &ManualClock,
) -> Result<Router, FleetError> {
    let router_config = RouterConfig {
        seed: config.router.seed.wrapping_add(replica as u64),
        ..config.router.clone()
    };
    let index = PrefixIndex::new(IndexConfig::default());
    let router = Router::with_clock(router_config, index, Clock::Manual(clock.clone()))?;
    for id in 0..config.workers {
        let role = match config.split {
            Some(s) if id < s.prefill_workers => WorkerRole::Prefill,
            Some(_) => WorkerRole::Decode,
            None => WorkerRole::Aggregated,
        };
        router.join_worker(WorkerConfig {
            role,
            // The router's busy threshold reads the engines' own budget.
            max_batched_tokens: u64::from(config.engine.max_num_batched_tokens),
            ..WorkerConfig::simple(
                id as u64,
                u64::from(config.engine.kv_blocks),
                config.engine.block_size,
            )
        })?;
    }
    Ok(router)
}

/// The figures of `records`, with each worker's time-averaged active tokens.
fn report(
    records: &[RequestRecord],
    mean_active_tokens: Vec<f64>,
    active_requests: usize,
) -> FleetReport {
    let workers = mean_active_tokens.len();
    let prompt: u64 = records.iter().map(|r| u64::from(r.prompt_tokens)).sum();
    let cached: u64 = records.iter().map(|r| u64::from(r.cached)).sum();
    let oracle: u64 = records.iter().map(|r| u64::from(r.oracle_cached)).sum();
    let mut ttft_ms: Vec<f64> = records
        .iter()
        .filter_map(|r| r.first_token.map(|t| (t - r.arrival).as_secs_f64() * 1e3))
        .collect();
    ttft_ms.sort_by(f64::total_cmp);
    let first = records.iter().map(|r| r.arrival).min();
    let last = records.iter().filter_map(|r| r.finished).max();
    let output: u64 = records.iter().map(|r| u64::from(r.output_tokens)).sum();
    let span = match (first, last) {
        (Some(first), Some(last)) => last.saturating_sub(first).as_secs_f64(),
        _ => 0.0,
    };
    let exact = records
        .iter()
        .filter(|r| r.predicted_cached == u64::from(r.cached))
        .count();
    // Each request's mean gap between output tokens, with the worker that decoded it.
    let itl: Vec<(usize, f64)> = records
        .iter()
        .filter(|r| r.output_tokens >= 2)
        .filter_map(|r| {
            let gaps = f64::from(r.output_tokens - 1);
            let ms = (r.finished? - r.first_token?).as_secs_f64() * 1e3 / gaps;
            Some((r.worker.worker.0 as usize, ms))
        })
        .collect();
    let itl_sum: f64 = itl.iter().map(|&(_, ms)| ms).sum();
    let mut itl_ms: Vec<f64> = itl.iter().map(|&(_, ms)| ms).collect();
    itl_ms.sort_by(f64::total_cmp);
    let mut by_worker = vec![Vec::new(); workers];
    for &(w, ms) in &itl {
        if let Some(list) = by_worker.get_mut(w) {
            list.push(ms);
        }
    }
    let worker_itl_p99_ms = by_worker
        .into_iter()
        .map(|mut list| {
            list.sort_by(f64::total_cmp);
            nearest_rank(&list, 0.99)
        })
        .collect();
    let mut per_worker = vec![0u64; workers];
    for r in records {
        if let Some(slot) = per_worker.get_mut(r.worker.worker.0 as usize) {
            *slot += u64::from(r.prompt_tokens);
        }
    }
    let mean = mean_active_tokens.iter().sum::<f64>() / workers.max(1) as f64;
    let max = mean_active_tokens.iter().copied().fold(0.0, f64::max);
    FleetReport {
        requests: records.len(),
        finished: records.iter().filter(|r| r.finished.is_some()).count(),
        hit_rate: ratio(cached as f64, prompt as f64),
        oracle_hit_rate: ratio(oracle as f64, prompt as f64),
        ttft_mean_ms: ratio(ttft_ms.iter().sum(), ttft_ms.len() as f64),
        ttft_p99_ms: nearest_rank(&ttft_ms, 0.99),
        throughput: ratio(output as f64, span),
        itl_mean_ms: ratio(itl_sum, itl_ms.len() as f64),
        itl_p99_ms: nearest_rank(&itl_ms, 0.99),
        worker_itl_p99_ms,
        prediction_accuracy: ratio(exact as f64, records.len() as f64),
        load_imbalance: ratio(max, mean),
        mean_active_tokens,
        prompt_tokens_per_worker: per_worker,
        active_requests,
    }
}

/// `a ÷ b`, 0 when `b` is 0.
fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// The `q` quantile of sorted `values` by nearest rank, 0 when empty.
fn nearest_rank(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let rank = (q * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A finished request on `worker` whose `tokens` came `gap_ms` apart after the first.
    fn record(id: u64, worker: u64, tokens: u32, gap_ms: u64) -> RequestRecord {
        let first = Duration::from_millis(100);
        let gaps = u64::from(tokens.saturating_sub(1));
        RequestRecord {
            id: RequestId(id),
            worker: WorkerRank::new(worker, 0),
            arrival: Duration::ZERO,
            first_token: Some(first),
            last_token: None,
            longest_gap: Duration::from_millis(gap_ms),
            finished: Some(first + Duration::from_millis(gap_ms * gaps)),
            prompt_tokens: 64,
            output_tokens: tokens,
            predicted_cached: 0,
            cached: 0,
            prefill_worker: None,
            oracle_cached: 0,
        }
    }

    #[test]
    fn inter_token_latency_is_reported_per_worker_and_for_the_fleet() {
        let records = [
            record(0, 0, 5, 10),
            record(1, 0, 3, 30),
            record(2, 1, 9, 20),
            // One token: no gap to measure.
            record(3, 1, 1, 0),
        ];
        let r = report(&records, vec![1.0; 3], 0);
        assert_eq!(r.worker_itl_p99_ms, [30.0, 20.0, 0.0]);
        assert_eq!(r.itl_p99_ms, 30.0);
        assert!((r.itl_mean_ms - 20.0).abs() < 1e-9, "{}", r.itl_mean_ms);
    }
}
