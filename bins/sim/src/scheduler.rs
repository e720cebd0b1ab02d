//! One pass of vLLM V1's scheduler: which requests compute how many tokens, with which blocks.
//!
//! ```text
//!  budget = max_num_batched_tokens
//!  1. running, in admission order: next chunk (prefill) or one token (decode), within budget;
//!     blocks short → preempt the most recently admitted (free its blocks, front of waiting)
//!  2. no preemption in this pass: waiting, first come first served, while seats and budget
//!     last: find its cached prefix (chained hashes), admit only if the blocks this pass needs
//!     fit in empty plus evictable blocks, else stop (the head of the queue blocks the rest)
//!  3. after the pass: computed += scheduled; a request whose tokens are all computed samples
//!     one; a request with all its output ends and frees its blocks, last block first
//! ```
//!
//! As in vLLM, a request's blocks are allocated for the tokens of the pass only (a long
//! prompt takes blocks chunk by chunk), and blocks are cached, with their Stored events, when
//! the pass that fills them is scheduled. A fully cached prompt still computes its last
//! token, so its last block is recomputed (vLLM caps a hit at `prompt length − 1` tokens).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use kvroute_core::{BlockHasher, RequestId, SeqHash};

use super::blocks::{BlockId, BlockPool};
use super::events::{EngineBlockHash, EngineEvent, EventLog, Medium};
use super::request::{Finish, RequestOutput, Sequence};
use super::timing::PassShape;

/// Whether waiting requests may start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Admission {
    /// Waiting requests are admitted as room allows.
    #[default]
    Open,
    /// No request starts; running ones go on (a fault hook: a stalled engine).
    Paused,
}

/// The scheduler's limits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) block_size: usize,
    pub(crate) token_budget: usize,
    pub(crate) max_seqs: usize,
    pub(crate) vocab_size: u32,
}

/// Tokens a running request computes in the pass.
#[derive(Clone, Copy, Debug)]
struct Scheduled {
    /// Its position in the running list (stable until the pass completes).
    index: usize,
    tokens: usize,
}

/// What one pass will compute.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    work: Vec<Scheduled>,
    pub(crate) shape: PassShape,
    pub(crate) preempted: u32,
}

impl Plan {
    /// Requests scheduled in the pass.
    pub(crate) fn scheduled(&self) -> usize {
        self.work.len()
    }
}

/// Counters since the engine started.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counters {
    pub(crate) preemptions: u64,
    pub(crate) prefix_query_tokens: u64,
    pub(crate) prefix_hit_tokens: u64,
}

/// The scheduler's state: the queues and the block pool.
#[derive(Debug)]
pub(crate) struct Scheduler {
    pub(crate) limits: Limits,
    hasher: BlockHasher,
    pub(crate) pool: BlockPool,
    pub(crate) waiting: VecDeque<Sequence>,
    /// In admission order.
    pub(crate) running: Vec<Sequence>,
    pub(crate) log: EventLog,
    pub(crate) admission: Admission,
    pub(crate) counters: Counters,
    /// Requests whose blocks stay in use when they finish, until released.
    pub(crate) hold_when_finished: HashSet<RequestId>,
    /// Finished requests' blocks kept in use, by request: a prefill's KV until its transfer
    /// ends.
    pub(crate) held: HashMap<RequestId, Vec<BlockId>>,
}

impl Scheduler {
    pub(crate) fn new(limits: Limits, kv_blocks: u32) -> Self {
        Scheduler {
            limits,
            hasher: BlockHasher::new(limits.block_size),
            pool: BlockPool::new(kv_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            log: EventLog::default(),
            admission: Admission::Open,
            counters: Counters::default(),
            hold_when_finished: HashSet::new(),
            held: HashMap::new(),
        }
    }

    /// The hasher of the engine's blocks.
    pub(crate) fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Plans one pass: running requests first, then admissions.
    pub(crate) fn schedule(&mut self) -> Plan {
        let mut plan = Plan::default();
        let mut budget = self.limits.token_budget;
        self.schedule_running(&mut budget, &mut plan);
        if plan.preempted == 0 && self.admission == Admission::Open {
            self.schedule_waiting(&mut budget, &mut plan);
        }
        self.measure(&mut plan);
        plan
    }

    /// Step 1: each running request's next tokens, in admission order.
    fn schedule_running(&mut self, budget: &mut usize, plan: &mut Plan) {
        let mut index = 0;
        while index < self.running.len() && *budget > 0 {
            let tokens = self.running[index].pending().min(*budget);
            if tokens == 0 {
                index += 1;
                continue;
            }
            if !self.make_room(index, tokens, plan) {
                break;
            }
            *budget -= tokens;
            plan.work.push(Scheduled { index, tokens });
            index += 1;
        }
    }

    /// Gives the running request at `index` blocks for `tokens` more tokens, preempting the
    /// most recently admitted requests until they fit. False when the request itself had to
    /// go (it was the most recent).
    fn make_room(&mut self, index: usize, tokens: usize, plan: &mut Plan) -> bool {
        loop {
            let Some(seq) = self.running.get_mut(index) else {
                return false;
            };
            let target = seq.computed + tokens;
            if grow(
                seq,
                target,
                &mut self.pool,
                &mut self.log,
                self.limits.block_size,
            ) {
                return true;
            }
            let Some(victim) = self.running.pop() else {
                return false;
            };
            self.preempt(victim);
            plan.preempted += 1;
            if self.running.len() == index {
                return false;
            }
        }
    }

    /// Sends a request back to the front of the waiting queue; its blocks are freed (the
    /// cached ones stay idle, so its recompute will likely find them) and it computes again
    /// from its first uncached block.
    fn preempt(&mut self, mut seq: Sequence) {
        release(&mut seq, &mut self.pool);
        self.counters.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Step 2: admissions, first come first served, while seats, budget and blocks last.
    fn schedule_waiting(&mut self, budget: &mut usize, plan: &mut Plan) {
        while *budget > 0 && self.running.len() < self.limits.max_seqs {
            let Some(seq) = self.waiting.front() else {
                return;
            };
            let hits = self.cached_prefix(seq);
            // Tokens with their KV at hand: found cached, or handed over by another engine.
            let ready = (hits.len() * self.limits.block_size).max(seq.received);
            let tokens = (seq.tokens.len() - ready).min(*budget);
            let needed = (ready + tokens).div_ceil(self.limits.block_size) - hits.len();
            let idle_hits = hits.iter().filter(|&&b| self.pool.is_idle(b)).count();
            if needed + idle_hits > self.pool.available() {
                return;
            }
            let Some(seq) = self.waiting.pop_front() else {
                return;
            };
            let Some(index) = self.start(seq, hits, tokens) else {
                return;
            };
            *budget -= tokens;
            plan.work.push(Scheduled { index, tokens });
        }
    }

    /// The blocks of `seq`'s longest cached prefix, at most up to its last token.
    fn cached_prefix(&self, seq: &Sequence) -> Vec<BlockId> {
        let max_blocks = (seq.tokens.len() - 1) / self.limits.block_size;
        seq.hashes
            .iter()
            .take(max_blocks)
            .map_while(|&h| self.pool.lookup(h))
            .collect()
    }

    /// Moves an admitted request to the running list: pins its cached prefix, takes blocks
    /// for its first `tokens`. Its position in the running list, or `None` (it went back to
    /// the waiting queue's front) if the blocks were not there after all.
    fn start(&mut self, mut seq: Sequence, hits: Vec<BlockId>, tokens: usize) -> Option<usize> {
        for &block in &hits {
            self.pool.touch(block);
        }
        let hit_tokens = hits.len() * self.limits.block_size;
        seq.cached_blocks = hits.len();
        seq.blocks = hits;
        // Received blocks are cached (and published) as they are placed, as computed ones.
        seq.computed = hit_tokens.max(seq.received);
        let target = seq.computed + tokens;
        if !grow(
            &mut seq,
            target,
            &mut self.pool,
            &mut self.log,
            self.limits.block_size,
        ) {
            release(&mut seq, &mut self.pool);
            self.waiting.push_front(seq);
            return None;
        }
        seq.cached_tokens.get_or_insert(hit_tokens as u32);
        self.counters.prefix_query_tokens += seq.tokens.len() as u64;
        self.counters.prefix_hit_tokens += hit_tokens as u64;
        self.running.push(seq);
        Some(self.running.len() - 1)
    }

    /// What the planned pass computes, for the timing model.
    fn measure(&self, plan: &mut Plan) {
        let mut shape = PassShape::default();
        for work in &plan.work {
            let Some(seq) = self.running.get(work.index) else {
                continue;
            };
            if seq.is_decoding() {
                shape.decode_tokens += 1;
                shape.decode_context_tokens += seq.tokens.len() as u64;
            } else {
                shape.prefill_tokens += work.tokens as u64;
                shape.prefill_requests += 1;
            }
        }
        let block = self.limits.block_size as u64;
        shape.kv_active_tokens = u64::from(self.pool.in_use()) * block;
        shape.kv_capacity_tokens = u64::from(self.pool.capacity()) * block;
        plan.shape = shape;
    }

    /// Step 3, once the pass has run (ending at `at`): advances every scheduled request,
    /// samples tokens, ends the requests that are done. Returns the reports.
    pub(crate) fn complete(&mut self, plan: &Plan, at: Duration) -> Vec<RequestOutput> {
        let mut outputs = Vec::new();
        for work in &plan.work {
            let Some(seq) = self.running.get_mut(work.index) else {
                continue;
            };
            seq.computed += work.tokens;
            if seq.pending() > 0 {
                continue;
            }
            let token = seq.sample(&self.hasher, self.limits.vocab_size);
            let finish = seq.is_done().then_some(Finish::Length);
            outputs.push(seq.output(at, Some(token), finish));
        }
        self.retire_finished();
        outputs
    }

    /// Frees the blocks of every finished request and drops it, keeping the others in order.
    fn retire_finished(&mut self) {
        let running = std::mem::take(&mut self.running);
        for mut seq in running {
            if seq.is_done() {
                if self.hold_when_finished.remove(&seq.id) {
                    self.held.insert(seq.id, std::mem::take(&mut seq.blocks));
                }
                release(&mut seq, &mut self.pool);
            } else {
                self.running.push(seq);
            }
        }
    }

    /// Removes a request wherever it is, freeing its blocks. `None` if it is not here.
    pub(crate) fn remove(&mut self, id: RequestId) -> Option<Sequence> {
        let mut seq = if let Some(pos) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(pos)?
        } else {
            let pos = self.running.iter().position(|s| s.id == id)?;
            self.running.remove(pos)
        };
        release(&mut seq, &mut self.pool);
        self.hold_when_finished.remove(&id);
        Some(seq)
    }

    /// Frees the blocks held for `id`, last block first; false if none are held.
    pub(crate) fn release_held(&mut self, id: RequestId) -> bool {
        let Some(blocks) = self.held.remove(&id) else {
            return false;
        };
        for &block in blocks.iter().rev() {
            self.pool.free(block);
        }
        true
    }

    /// Frees every held block.
    pub(crate) fn release_all_held(&mut self) {
        let ids: Vec<RequestId> = self.held.keys().copied().collect();
        for id in ids {
            self.release_held(id);
        }
    }

    /// Preempts every running request, most recent first (a cache reset that does not wait).
    pub(crate) fn preempt_all(&mut self) {
        while let Some(seq) = self.running.pop() {
            self.preempt(seq);
        }
    }

    /// Blocks of the longest cached prefix of `tokens` under `cache_salt` (whole prompt, no
    /// cap).
    pub(crate) fn cached_prefix_blocks(&self, tokens: &[u32], cache_salt: Option<&str>) -> usize {
        let locals = super::request::local_hashes(&self.hasher, tokens, cache_salt);
        let hashes = kvroute_core::seq_hashes(&locals);
        self.cached_prefix_of(&hashes)
    }

    /// How many of the chained block hashes `hashes` the pool holds as a prefix.
    pub(crate) fn cached_prefix_of(&self, hashes: &[SeqHash]) -> usize {
        hashes
            .iter()
            .take_while(|&&h| self.pool.contains(h))
            .count()
    }
}

/// Gives `seq` blocks up to `target` tokens and caches its blocks that `target` fills,
/// logging them as stored. False, changing nothing, when the pool has too few blocks.
fn grow(
    seq: &mut Sequence,
    target: usize,
    pool: &mut BlockPool,
    log: &mut EventLog,
    block_size: usize,
) -> bool {
    let needed = target.div_ceil(block_size).saturating_sub(seq.blocks.len());
    if needed > pool.available() {
        return false;
    }
    for _ in 0..needed {
        match pool.allocate(log) {
            Some(block) => seq.blocks.push(block),
            None => return false,
        }
    }
    cache_full_blocks(seq, target.min(seq.tokens.len()), pool, log, block_size);
    true
}

/// Caches the blocks of `seq` that its first `tokens` tokens fill and are not cached yet, and
/// logs them as one Stored event continuing its last cached block.
fn cache_full_blocks(
    seq: &mut Sequence,
    tokens: usize,
    pool: &mut BlockPool,
    log: &mut EventLog,
    block_size: usize,
) {
    let from = seq.cached_blocks;
    let to = (tokens / block_size)
        .min(seq.blocks.len())
        .min(seq.hashes.len());
    if to <= from {
        return;
    }
    for (&block, &hash) in seq.blocks[from..to].iter().zip(&seq.hashes[from..to]) {
        pool.cache(block, hash);
    }
    log.stored(EngineEvent::Stored {
        parent: from
            .checked_sub(1)
            .and_then(|i| seq.hashes.get(i))
            .map(|h| EngineBlockHash(h.0)),
        block_hashes: seq.hashes[from..to]
            .iter()
            .map(|h| EngineBlockHash(h.0))
            .collect(),
        token_ids: seq.tokens[from * block_size..to * block_size].to_vec(),
        block_size: block_size as u32,
        medium: Medium::Gpu,
        cache_salt: seq.cache_salt.clone(),
    });
    seq.cached_blocks = to;
}

/// Frees a request's blocks, last block first so that a chain's tail is evicted before its
/// head, and resets it to compute from scratch.
fn release(seq: &mut Sequence, pool: &mut BlockPool) {
    for &block in seq.blocks.iter().rev() {
        pool.free(block);
    }
    seq.blocks.clear();
    seq.cached_blocks = 0;
    seq.computed = 0;
    seq.received = 0;
}
