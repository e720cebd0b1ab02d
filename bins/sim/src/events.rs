//! What the engine publishes about its KV cache, in vLLM's semantics.
//!
//! vLLM's publisher sends, per engine step, a batch of events: `BlockStored` (the blocks that
//! became cached in that step, with the parent of the first, their token ids and the block
//! size), `BlockRemoved` (blocks evicted, one name per physical copy) and `AllBlocksCleared`
//! (the prefix cache was reset). [`EngineEvent`] carries the same fields, so that a ZMQ
//! publisher can encode them as vLLM does and an in-process fleet can feed them to the router
//! through [`EngineEvent::to_kv_event`].
//!
//! Block names: the engine names a block by its chained hash (kvroute_core's sequence hash
//! of the block's tokens and of every block before it), as vLLM names blocks by a hash of the
//! parent's hash and the block's tokens. To the router the name is opaque; it finds blocks by the
//! hash of their tokens, which the conversion computes.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{
    BlockHash, BlockHasher, EventHeader, EventId, HashSeed, KvEvent, KvEventData, StorageTier,
    StoredBlock, WorkerRank,
};

/// The engine's name of a cached block (vLLM's `block_hash` in its events).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EngineBlockHash(pub u64);

/// Where the blocks of an event live. The simulated engine has one tier, the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Medium {
    /// GPU memory (vLLM's `"GPU"`).
    #[default]
    Gpu,
}

impl Medium {
    /// The name vLLM's events carry.
    pub const fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
        }
    }

    /// The router's storage tier for this medium.
    pub const fn tier(self) -> StorageTier {
        match self {
            Medium::Gpu => StorageTier::Device,
        }
    }
}

/// One KV event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    /// Blocks became cached in this pass (blocks found in the cache and reused are not
    /// stored again). They continue the chain after `parent`, each the parent of the next.
    Stored {
        /// The block before the first one, `None` when the first block starts a prompt.
        parent: Option<EngineBlockHash>,
        /// The blocks' names, in chain order.
        block_hashes: Vec<EngineBlockHash>,
        /// The blocks' tokens, `block_size` per block, in the same order.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Where the blocks live.
        medium: Medium,
        /// The cache salt of the request whose blocks these are: every block of its chain is
        /// salted. On vLLM's wire it is named on a chain's first block only (`extra_keys`).
        cache_salt: Option<Arc<str>>,
    },
    /// Cached blocks were evicted: one name per physical copy that left.
    Removed {
        /// The evicted blocks' names.
        block_hashes: Vec<EngineBlockHash>,
        /// Where the blocks lived.
        medium: Medium,
    },
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
}

/// The events of one pass (or of one cache reset), as vLLM batches them per engine step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventBatch {
    /// Engine time at which the batch was published: the end of its pass.
    pub at: Duration,
    /// The events, in the order they happened (an eviction can precede a store of a block
    /// of the same name in one pass).
    pub events: Vec<EngineEvent>,
}

impl EngineEvent {
    /// The stored blocks, each with its tokens. Empty for other events.
    pub fn stored_blocks(&self) -> impl Iterator<Item = (EngineBlockHash, &[u32])> + '_ {
        let (hashes, tokens, size): (&[EngineBlockHash], &[u32], usize) = match self {
            EngineEvent::Stored {
                block_hashes,
                token_ids,
                block_size,
                ..
            } => (block_hashes, token_ids, *block_size as usize),
            _ => (&[], &[], 1),
        };
        hashes.iter().copied().zip(tokens.chunks(size.max(1)))
    }

    /// The event as the router's core models it, from `source` with id `event_id`: the
    /// engine's names become [`BlockHash`]es and every stored block also carries the
    /// [`kvroute_core::LocalHash`] of its tokens, the key the router matches prompts by.
    pub fn to_kv_event(&self, source: WorkerRank, event_id: EventId) -> KvEvent {
        let (tier, data) = match self {
            EngineEvent::Stored {
                parent,
                block_size,
                medium,
                cache_salt,
                ..
            } => {
                let hasher = BlockHasher::new(*block_size as usize)
                    .with_seed(HashSeed::new(None, cache_salt.as_deref()));
                let blocks = self
                    .stored_blocks()
                    .map(|(name, tokens)| StoredBlock {
                        block_hash: BlockHash(name.0),
                        local_hash: hasher.local_hash(tokens),
                    })
                    .collect();
                let parent = parent.map(|p| BlockHash(p.0));
                (medium.tier(), KvEventData::Stored { parent, blocks })
            }
            EngineEvent::Removed {
                block_hashes,
                medium,
            } => {
                let blocks = block_hashes.iter().map(|h| BlockHash(h.0)).collect();
                (medium.tier(), KvEventData::Removed { blocks })
            }
            EngineEvent::AllBlocksCleared => (StorageTier::Device, KvEventData::Cleared),
        };
        KvEvent {
            header: EventHeader {
                source,
                event_id,
                tier,
            },
            data,
        }
    }
}

/// The events of the pass under way, in order. Consecutive evictions share one `Removed`
/// event (vLLM sends one per block; the meaning is the same and the router applies fewer).
#[derive(Debug, Default)]
pub(crate) struct EventLog {
    events: Vec<EngineEvent>,
}

impl EventLog {
    /// A cached block was evicted.
    pub(crate) fn removed(&mut self, name: EngineBlockHash) {
        if let Some(EngineEvent::Removed { block_hashes, .. }) = self.events.last_mut() {
            block_hashes.push(name);
            return;
        }
        self.events.push(EngineEvent::Removed {
            block_hashes: vec![name],
            medium: Medium::Gpu,
        });
    }

    /// Blocks became cached.
    pub(crate) fn stored(&mut self, event: EngineEvent) {
        self.events.push(event);
    }

    /// The prefix cache was reset.
    pub(crate) fn cleared(&mut self) {
        self.events.push(EngineEvent::AllBlocksCleared);
    }

    /// The events so far as a batch stamped `at`, or `None` when nothing happened.
    pub(crate) fn take_batch(&mut self, at: Duration) -> Option<EventBatch> {
        if self.events.is_empty() {
            return None;
        }
        Some(EventBatch {
            at,
            events: std::mem::take(&mut self.events),
        })
    }
}
