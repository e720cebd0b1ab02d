//! The engine's configuration: vLLM's scheduler limits and the timing model.

use super::error::SimError;
use super::timing::TimingModel;

/// How the engine is sized and timed. Chunked prefill and prefix caching are always on, as in
/// vLLM V1's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block (vLLM's `--block-size`, default 16).
    pub block_size: u32,
    /// Blocks in the KV cache. Default 24,576 blocks of 16 tokens (393,216 tokens): an 80 GB
    /// H100 holding Llama-3.1-8B's 16 GB of weights keeps about 50–60 GB for KV cache at
    /// 131,072 bytes per token, about 400k tokens (`shared/sim-calibration.md`).
    pub kv_blocks: u32,
    /// Tokens one pass may compute, prefill chunks and decodes together (vLLM's
    /// `max_num_batched_tokens`, default 8,192).
    pub max_num_batched_tokens: u32,
    /// Requests running at once (vLLM's `max_num_seqs`, default 256).
    pub max_num_seqs: u32,
    /// How long a pass takes.
    pub timing: TimingModel,
    /// Passes run this many times faster than the model says (Dynamo's mocker calls it
    /// `speedup_ratio`): 10 turns a 50 ms pass into 5 ms. Default 1.
    pub speedup: f64,
    /// Output tokens are drawn below this id. Default 128,256, Llama 3's vocabulary.
    pub vocab_size: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_blocks: 24_576,
            max_num_batched_tokens: 8_192,
            max_num_seqs: 256,
            timing: TimingModel::default(),
            speedup: 1.0,
            vocab_size: 128_256,
        }
    }
}

impl EngineConfig {
    /// Checks that an engine with this configuration can run.
    pub fn validate(&self) -> Result<(), SimError> {
        let reason = if self.block_size == 0 {
            "block_size must be positive"
        } else if self.kv_blocks == 0 {
            "kv_blocks must be positive"
        } else if self.max_num_batched_tokens == 0 {
            "max_num_batched_tokens must be positive"
        } else if self.max_num_seqs == 0 {
            "max_num_seqs must be positive"
        } else if !(self.speedup.is_finite() && self.speedup > 0.0) {
            "speedup must be a positive number"
        } else if self.vocab_size == 0 {
            "vocab_size must be positive"
        } else {
            return Ok(());
        };
        Err(SimError::Config { reason })
    }
}
