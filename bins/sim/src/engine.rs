//! The facade: what a driver calls. A live worker calls [`Engine::step`] in a loop and sleeps
//! for each pass's duration; the demo calls [`Engine::advance_to`] on a virtual clock. Both
//! admit requests, read outputs and events, and use the same fault hooks.

use std::collections::HashSet;
use std::time::Duration;

use kvroute_core::{RequestId, SeqHash};

use super::blocks::PoolCounts;
use super::config::EngineConfig;
use super::error::SimError;
use super::events::EventBatch;
use super::request::{EngineRequest, Finish, RequestOutput, Sequence};
use super::scheduler::{Admission, Limits, Scheduler};
use super::timing::PassShape;

/// What a cache reset does to requests that hold blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ClearMode {
    /// Refuse while any block is held (vLLM's `reset_prefix_cache()`).
    #[default]
    RefuseIfInUse,
    /// Preempt every running request first; they recompute later (vLLM's
    /// `reset_prefix_cache(reset_running_requests=True)`). Blocks held for transfers are
    /// freed too.
    PreemptRunning,
}

/// What one pass did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pass {
    /// Engine time at which it started.
    pub started: Duration,
    /// How long it took, after the speed-up.
    pub duration: Duration,
    /// What it computed.
    pub shape: PassShape,
    /// Requests it computed tokens for.
    pub scheduled: u32,
    /// Requests it preempted.
    pub preempted: u32,
}

/// The engine's state in numbers (vLLM's metrics are derived from these).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Requests running (vLLM's `num_requests_running`).
    pub running: u32,
    /// Requests waiting (vLLM's `num_requests_waiting`).
    pub waiting: u32,
    /// The block pool.
    pub blocks: PoolCounts,
    /// Passes run.
    pub passes: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Tokens looked up in the prefix cache at admissions (vLLM's `prefix_cache_queries`).
    pub prefix_query_tokens: u64,
    /// Of those, tokens found cached (vLLM's `prefix_cache_hits`).
    pub prefix_hit_tokens: u64,
}

/// How busy the engine is: its requests and its blocks in use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    /// Requests running.
    pub running: u32,
    /// Requests waiting.
    pub waiting: u32,
    /// Blocks held by at least one request.
    pub blocks_in_use: u32,
    /// Blocks in the cache.
    pub blocks_total: u32,
}

/// The simulated engine: vLLM's scheduler over a block pool, on a clock that moves only
/// when passes run.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    scheduler: Scheduler,
    /// Ids of the requests waiting or running.
    known: HashSet<RequestId>,
    now: Duration,
    passes: u64,
    outputs: Vec<RequestOutput>,
    batches: Vec<EventBatch>,
}

impl Engine {
    /// An engine with an empty cache at time zero.
    pub fn new(config: EngineConfig) -> Result<Self, SimError> {
        config.validate()?;
        let limits = Limits {
            block_size: config.block_size as usize,
            token_budget: config.max_num_batched_tokens as usize,
            max_seqs: config.max_num_seqs as usize,
            vocab_size: config.vocab_size,
        };
        Ok(Engine {
            config,
            scheduler: Scheduler::new(limits, config.kv_blocks),
            known: HashSet::new(),
            now: Duration::ZERO,
            passes: 0,
            outputs: Vec::new(),
            batches: Vec::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The engine's clock: the end of the last pass (or the time it was advanced to).
    pub fn now(&self) -> Duration {
        self.now
    }

    /// Whether no request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.known.is_empty()
    }

    /// Queues the decode half of a disaggregated request: its prompt's KV, every full block
    /// but the one holding its last token, was computed by a prefill engine and handed over.
    /// It goes to the front of the waiting queue (its blocks were promised when the transfer
    /// began); when scheduled, the handed blocks take blocks of the cache, are cached and
    /// published as stored, and only the prompt's tail is computed. Preempted, it computes
    /// its prompt itself.
    pub fn admit_transferred(&mut self, request: EngineRequest) -> Result<(), SimError> {
        let block = self.config.block_size as usize;
        let received = (request.prompt.len().saturating_sub(1) / block) * block;
        self.admit(request)?;
        if let Some(mut seq) = self.scheduler.waiting.pop_back() {
            seq.received = received;
            self.scheduler.waiting.push_front(seq);
        }
        Ok(())
    }

    /// Queues a request at the back of the waiting queue; it is scheduled from the next pass.
    pub fn admit(&mut self, request: EngineRequest) -> Result<(), SimError> {
        let id = request.id;
        if request.prompt.is_empty() {
            return Err(SimError::EmptyPrompt { id });
        }
        if request.max_output_tokens == 0 {
            return Err(SimError::NoOutput { id });
        }
        if self.known.contains(&id) {
            return Err(SimError::Duplicate { id });
        }
        // The last output token is sampled, never computed: it needs no slot.
        let slots = request.prompt.len() as u64 + u64::from(request.max_output_tokens) - 1;
        let needed = slots.div_ceil(u64::from(self.config.block_size));
        if needed > u64::from(self.config.kv_blocks) {
            return Err(SimError::TooLong {
                id,
                needed,
                capacity: self.config.kv_blocks,
            });
        }
        let seq = Sequence::new(request, self.scheduler.hasher());
        self.scheduler.waiting.push_back(seq);
        self.known.insert(id);
        Ok(())
    }

    /// Keeps request `id`'s blocks in use once it finishes, until [`Engine::release_held`]:
    /// a prefill engine's KV waiting for the decode side to read it (vLLM's NixlConnector
    /// frees a finished prefill's blocks only once they are pulled). They count as in use
    /// and cannot be evicted meanwhile.
    pub fn hold_when_finished(&mut self, id: RequestId) -> Result<(), SimError> {
        if !self.known.contains(&id) {
            return Err(SimError::UnknownRequest { id });
        }
        self.scheduler.hold_when_finished.insert(id);
        Ok(())
    }

    /// Frees the blocks held for finished request `id` (last block first; they stay cached,
    /// evictable); false if none are held.
    pub fn release_held(&mut self, id: RequestId) -> bool {
        self.scheduler.release_held(id)
    }

    /// Requests whose blocks are held after they finished.
    pub fn held_requests(&self) -> usize {
        self.scheduler.held.len()
    }

    /// Ends a request now (a client went away): its blocks are freed and its output reports
    /// [`Finish::Aborted`].
    pub fn abort(&mut self, id: RequestId) -> Result<(), SimError> {
        let seq = self
            .scheduler
            .remove(id)
            .ok_or(SimError::UnknownRequest { id })?;
        self.known.remove(&id);
        self.outputs
            .push(seq.output(self.now, None, Some(Finish::Aborted)));
        Ok(())
    }

    /// Runs one pass from the current time, or returns `None`, changing nothing, when there
    /// is nothing to compute (no request, or only waiting ones while admission is paused).
    pub fn step(&mut self) -> Option<Pass> {
        let plan = self.scheduler.schedule();
        if plan.scheduled() == 0 {
            return None;
        }
        let started = self.now;
        let modelled = self.config.timing.pass_duration(&plan.shape);
        let duration = Duration::from_secs_f64(modelled.as_secs_f64() / self.config.speedup);
        self.now += duration;
        self.passes += 1;
        let outputs = self.scheduler.complete(&plan, self.now);
        for output in &outputs {
            if output.finish.is_some() {
                self.known.remove(&output.id);
            }
        }
        self.outputs.extend(outputs);
        self.publish();
        Some(Pass {
            started,
            duration,
            shape: plan.shape,
            scheduled: plan.scheduled() as u32,
            preempted: plan.preempted,
        })
    }

    /// Runs passes until the clock reaches `until` (the last pass may end after it: a pass is
    /// never cut short), or moves the clock to `until` when there is nothing to compute.
    /// Returns the passes run.
    pub fn advance_to(&mut self, until: Duration) -> u64 {
        let before = self.passes;
        while self.now < until {
            if self.step().is_none() {
                self.now = until;
            }
        }
        self.passes - before
    }

    /// The reports of the passes (and aborts) since the last call, oldest first.
    pub fn take_outputs(&mut self) -> Vec<RequestOutput> {
        std::mem::take(&mut self.outputs)
    }

    /// The KV event batches since the last call, oldest first: one per pass that changed the
    /// cache, and one per reset.
    pub fn take_events(&mut self) -> Vec<EventBatch> {
        std::mem::take(&mut self.batches)
    }

    /// Opens or pauses admission (a fault hook: the engine stalls without dying).
    pub fn set_admission(&mut self, admission: Admission) {
        self.scheduler.admission = admission;
    }

    /// Whether admission is open.
    pub fn admission(&self) -> Admission {
        self.scheduler.admission
    }

    /// Drops the whole prefix cache and publishes `AllBlocksCleared` (a fault hook, and
    /// vLLM's `/reset_prefix_cache`).
    pub fn clear_cache(&mut self, mode: ClearMode) -> Result<(), SimError> {
        if mode == ClearMode::PreemptRunning {
            self.scheduler.preempt_all();
            self.scheduler.release_all_held();
        }
        self.scheduler
            .pool
            .clear()
            .map_err(|blocks| SimError::CacheInUse { blocks })?;
        self.scheduler.log.cleared();
        self.publish();
        Ok(())
    }

    /// Blocks of the longest prefix of `tokens` the cache holds, counting every full block
    /// (unlike admission, which leaves the last token to compute).
    pub fn cached_prefix_blocks(&self, tokens: &[u32]) -> usize {
        self.scheduler.cached_prefix_blocks(tokens, None)
    }

    /// [`cached_prefix_blocks`](Self::cached_prefix_blocks) for a request with a cache salt.
    pub fn cached_prefix_blocks_salted(&self, tokens: &[u32], cache_salt: Option<&str>) -> usize {
        self.scheduler.cached_prefix_blocks(tokens, cache_salt)
    }

    /// How many of `hashes` (a prompt's chained block hashes, from its first block) the cache
    /// holds as a prefix: the hashing done once for many engines.
    pub fn cached_prefix_of(&self, hashes: &[SeqHash]) -> usize {
        self.scheduler.cached_prefix_of(hashes)
    }

    /// What a heartbeat reports of the engine: cheap enough for every pass.
    pub fn occupancy(&self) -> Occupancy {
        Occupancy {
            running: self.scheduler.running.len() as u32,
            waiting: self.scheduler.waiting.len() as u32,
            blocks_in_use: self.scheduler.pool.in_use(),
            blocks_total: self.scheduler.pool.capacity(),
        }
    }

    /// The state in numbers.
    pub fn stats(&self) -> EngineStats {
        let counters = self.scheduler.counters;
        EngineStats {
            running: self.scheduler.running.len() as u32,
            waiting: self.scheduler.waiting.len() as u32,
            blocks: self.scheduler.pool.counts(),
            passes: self.passes,
            preemptions: counters.preemptions,
            prefix_query_tokens: counters.prefix_query_tokens,
            prefix_hit_tokens: counters.prefix_hit_tokens,
        }
    }

    /// Moves the events logged so far into a batch stamped now.
    fn publish(&mut self) {
        if let Some(batch) = self.scheduler.log.take_batch(self.now) {
            self.batches.push(batch);
        }
    }
}
