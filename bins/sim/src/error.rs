//! Why the engine refused a call.

use kvroute_core::RequestId;

/// Why the engine refused a call. Nothing changed in the engine when one is returned.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SimError {
    /// The configuration cannot run (a zero limit, a speed-up that is not a positive number).
    #[error("invalid engine config: {reason}")]
    Config {
        /// What is wrong.
        reason: &'static str,
    },
    /// A request without prompt tokens: vLLM rejects it too, there is nothing to prefill.
    #[error("request {id:?} has no prompt tokens")]
    EmptyPrompt {
        /// The request.
        id: RequestId,
    },
    /// A request that asks for no output token (vLLM's `max_tokens` is at least 1).
    #[error("request {id:?} asks for no output tokens")]
    NoOutput {
        /// The request.
        id: RequestId,
    },
    /// A request whose id is already waiting or running in the engine.
    #[error("request {id:?} is already in the engine")]
    Duplicate {
        /// The request.
        id: RequestId,
    },
    /// A request that could not run even alone on the engine: its prompt and output need more
    /// blocks than the KV cache has (vLLM bounds `max_model_len` by the cache for the same
    /// reason).
    #[error("request {id:?} needs {needed} KV blocks, the cache has {capacity}")]
    TooLong {
        /// The request.
        id: RequestId,
        /// Blocks its prompt and output need.
        needed: u64,
        /// Blocks in the cache.
        capacity: u32,
    },
    /// No request with this id is waiting or running.
    #[error("no request {id:?} in the engine")]
    UnknownRequest {
        /// The request.
        id: RequestId,
    },
    /// The cache was not cleared because requests hold blocks (vLLM's `reset_prefix_cache`
    /// refuses in the same case unless asked to preempt running requests).
    #[error("the cache was not cleared: {blocks} blocks are in use")]
    CacheInUse {
        /// Blocks with a reference.
        blocks: u32,
    },
}
