//! The block pool: the engine's KV cache as fixed-size blocks with reference counts and a
//! prefix cache.
//!
//! ```text
//!  block: refs > 0 ─────────── in use by requests (a shared prefix block has one ref per user)
//!         refs = 0, no hash ── empty: taken first when a block is needed
//!         refs = 0, hash ───── idle: still cached, found by its chained hash; evicted least
//!                              recently freed first, only when no empty block is left
//! ```
//!
//! A block gets its hash when it is full (only full blocks are cached, and only they are
//! published). One hash can name several physical copies (two requests computed the same
//! block before either was cached, or a fully cached prompt recomputed its last block, as
//! vLLM does); each copy is stored and evicted on its own, as in vLLM's events.
//!
//! Leaves before parents: requests free their blocks last block first (as vLLM does), so in
//! the idle order a chain's tail is older than its head and is evicted first. Every request
//! that uses a block also uses its parent and frees the parent after it, so a parent is never
//! freed earlier than its children.

use std::collections::{BTreeMap, HashMap};

use kvroute_core::SeqHash;

use super::events::{EngineBlockHash, EventLog};

/// Position of a block in the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct BlockId(pub(crate) u32);

/// One block's state.
#[derive(Clone, Copy, Debug, Default)]
struct Block {
    /// Requests holding the block.
    refs: u32,
    /// The chained hash of its tokens once it is full and cached.
    hash: Option<SeqHash>,
    /// Its key in the idle order while it is idle.
    idle_since: Option<u64>,
}

/// Counts of the pool's blocks by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounts {
    /// Blocks in the cache.
    pub total: u32,
    /// Blocks held by at least one request.
    pub in_use: u32,
    /// Distinct hashes cached (in use or idle): what a reader of the events holds.
    pub cached: u32,
    /// Cached physical blocks, copies included.
    pub cached_copies: u32,
    /// Cached blocks no request holds (evictable).
    pub idle: u32,
    /// Frees of a block nobody held: a bug in the engine if ever above zero.
    pub double_frees: u64,
}

/// The pool. All operations are O(log n) in the number of idle blocks or better.
#[derive(Debug)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    /// Free blocks without a hash.
    empty: Vec<BlockId>,
    /// Free cached blocks by the tick they were freed at: the first is the least recently used.
    idle: BTreeMap<u64, BlockId>,
    /// Cached blocks by hash, every copy, oldest first.
    cached: HashMap<SeqHash, Vec<BlockId>>,
    next_tick: u64,
    /// Blocks with at least one holder.
    in_use: u32,
    double_frees: u64,
}

impl BlockPool {
    /// A pool of `capacity` empty blocks.
    pub(crate) fn new(capacity: u32) -> Self {
        BlockPool {
            blocks: vec![Block::default(); capacity as usize],
            empty: (0..capacity).rev().map(BlockId).collect(),
            idle: BTreeMap::new(),
            cached: HashMap::new(),
            next_tick: 0,
            in_use: 0,
            double_frees: 0,
        }
    }

    /// Blocks a request could take now: the empty ones and the idle ones it could evict.
    pub(crate) fn available(&self) -> usize {
        self.empty.len() + self.idle.len()
    }

    /// A cached block with this hash, if any (the oldest copy, as vLLM's lookup returns).
    pub(crate) fn lookup(&self, hash: SeqHash) -> Option<BlockId> {
        self.cached
            .get(&hash)
            .and_then(|copies| copies.first().copied())
    }

    /// Whether a block is idle: cached, held by nobody, so taking it uses up an evictable block.
    pub(crate) fn is_idle(&self, id: BlockId) -> bool {
        self.block(id).is_some_and(|b| b.idle_since.is_some())
    }

    /// One more request holds `id` (a prefix cache hit); an idle block stops being evictable.
    pub(crate) fn touch(&mut self, id: BlockId) {
        let Some(block) = self.blocks.get_mut(id.0 as usize) else {
            return;
        };
        if let Some(tick) = block.idle_since.take() {
            self.idle.remove(&tick);
        }
        if block.refs == 0 {
            self.in_use += 1;
        }
        block.refs += 1;
    }

    /// A block for a request: an empty one if any is left, else the least recently used idle
    /// block, whose eviction is logged. `None` when every block is in use.
    pub(crate) fn allocate(&mut self, log: &mut EventLog) -> Option<BlockId> {
        let id = match self.empty.pop() {
            Some(id) => id,
            None => self.evict_oldest(log)?,
        };
        let block = self.blocks.get_mut(id.0 as usize)?;
        block.refs = 1;
        self.in_use += 1;
        Some(id)
    }

    /// Evicts the least recently used idle block and hands it out empty.
    fn evict_oldest(&mut self, log: &mut EventLog) -> Option<BlockId> {
        let (_, id) = self.idle.pop_first()?;
        let block = self.blocks.get_mut(id.0 as usize)?;
        block.idle_since = None;
        if let Some(hash) = block.hash.take() {
            self.forget_copy(hash, id);
            log.removed(EngineBlockHash(hash.0));
        }
        Some(id)
    }

    /// Drops `id` from the copies of `hash`.
    fn forget_copy(&mut self, hash: SeqHash, id: BlockId) {
        if let Some(copies) = self.cached.get_mut(&hash) {
            copies.retain(|&c| c != id);
            if copies.is_empty() {
                self.cached.remove(&hash);
            }
        }
    }

    /// Caches the full block `id` under `hash` (the caller logs the store with its tokens).
    pub(crate) fn cache(&mut self, id: BlockId, hash: SeqHash) {
        if let Some(block) = self.blocks.get_mut(id.0 as usize) {
            block.hash = Some(hash);
            self.cached.entry(hash).or_default().push(id);
        }
    }

    /// A request lets go of `id`. With its last holder gone a cached block turns idle (the
    /// most recently used) and an uncached one empty. A free of a block nobody holds is
    /// counted, not applied.
    pub(crate) fn free(&mut self, id: BlockId) {
        let Some(block) = self.blocks.get_mut(id.0 as usize) else {
            self.double_frees += 1;
            return;
        };
        if block.refs == 0 {
            self.double_frees += 1;
            return;
        }
        block.refs -= 1;
        if block.refs > 0 {
            return;
        }
        self.in_use -= 1;
        if block.hash.is_some() {
            let tick = self.next_tick;
            self.next_tick += 1;
            block.idle_since = Some(tick);
            self.idle.insert(tick, id);
        } else {
            self.empty.push(id);
        }
    }

    /// Drops every cached hash, as vLLM's prefix-cache reset does. Refuses, changing nothing,
    /// when requests hold blocks: returns how many.
    pub(crate) fn clear(&mut self) -> Result<(), u32> {
        if self.in_use > 0 {
            return Err(self.in_use);
        }
        let capacity = self.blocks.len() as u32;
        *self = BlockPool {
            double_frees: self.double_frees,
            ..BlockPool::new(capacity)
        };
        Ok(())
    }

    /// Blocks in the pool.
    pub(crate) fn capacity(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks held by at least one request.
    pub(crate) fn in_use(&self) -> u32 {
        self.in_use
    }

    /// Holders of `id` (0 for a block that does not exist).
    #[cfg(test)]
    pub(crate) fn refs(&self, id: BlockId) -> u32 {
        self.block(id).map_or(0, |b| b.refs)
    }

    /// Whether a block with this hash is cached.
    pub(crate) fn contains(&self, hash: SeqHash) -> bool {
        self.cached.contains_key(&hash)
    }

    /// The pool's blocks counted by state.
    pub(crate) fn counts(&self) -> PoolCounts {
        PoolCounts {
            total: self.blocks.len() as u32,
            in_use: self.in_use,
            cached: self.cached.len() as u32,
            cached_copies: self.cached.values().map(Vec::len).sum::<usize>() as u32,
            idle: self.idle.len() as u32,
            double_frees: self.double_frees,
        }
    }

    fn block(&self, id: BlockId) -> Option<&Block> {
        self.blocks.get(id.0 as usize)
    }
}
