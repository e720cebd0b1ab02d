//! A request as the engine receives it, what it reports per pass, and its state inside.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{
    mix64, next_seq_hash, seq_hashes, BlockHasher, HashSeed, LocalHash, RequestId, SeqHash,
};

use super::blocks::BlockId;

/// A request handed to the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineRequest {
    /// Its identity, unique among the engine's requests.
    pub id: RequestId,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate (vLLM's `max_tokens`); the sim always generates exactly this many.
    pub max_output_tokens: u32,
    /// When it arrived, on the engine's clock (for the caller's latency figures; the engine
    /// schedules it from its next pass).
    pub arrival: Duration,
    /// vLLM's `cache_salt`: it enters the first block's hash, so the request shares cached
    /// blocks only with requests of the same salt.
    pub cache_salt: Option<Arc<str>>,
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Finish {
    /// It generated its `max_output_tokens` (vLLM's finish reason `"length"`).
    Length,
    /// It was aborted by the caller.
    Aborted,
}

/// What one pass did for one request: only requests that generated a token or ended appear.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestOutput {
    /// The request.
    pub id: RequestId,
    /// Tokens generated in this pass (at most one; none for an abort).
    pub tokens: Vec<u32>,
    /// When the first token was generated, set only in the pass that generated it.
    pub first_token_at: Option<Duration>,
    /// Set when the request ended in this pass; its blocks are freed.
    pub finish: Option<Finish>,
    /// Engine truth: prompt tokens found in the prefix cache when it was first scheduled,
    /// what vLLM reports as `usage.prompt_tokens_details.cached_tokens` (0 before).
    pub cached_tokens: u32,
    /// Engine time of the report: the end of the pass.
    pub at: Duration,
}

/// A request inside the engine: its tokens so far, its blocks, how far it has computed.
#[derive(Debug)]
pub(crate) struct Sequence {
    pub(crate) id: RequestId,
    /// Prompt, then the outputs generated so far.
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    pub(crate) max_output: u32,
    /// Tokens whose KV is computed (or was found cached).
    pub(crate) computed: usize,
    /// The block table: the blocks holding its tokens, in order.
    pub(crate) blocks: Vec<BlockId>,
    /// Chained hashes of every full block of `tokens`.
    pub(crate) hashes: Vec<SeqHash>,
    /// Leading blocks of the table that are cached under their hash.
    pub(crate) cached_blocks: usize,
    /// Prompt tokens found cached when first scheduled.
    pub(crate) cached_tokens: Option<u32>,
    /// The request's cache salt, named on the Stored events of its blocks.
    pub(crate) cache_salt: Option<Arc<str>>,
    /// Prompt tokens whose KV another engine computed and handed over (disaggregated
    /// serving's decode half): they take blocks but no compute. Lost if it is preempted.
    pub(crate) received: usize,
    /// Seeds the pseudo tokens: a hash of the prompt, so the same prompt yields the same
    /// output, as greedy decoding does.
    output_seed: u64,
}

impl Sequence {
    /// The state of a new request; `hasher` has the engine's block size.
    pub(crate) fn new(request: EngineRequest, hasher: &BlockHasher) -> Self {
        let hashes = seq_hashes(&local_hashes(
            hasher,
            &request.prompt,
            request.cache_salt.as_deref(),
        ));
        let output_seed = BlockHasher::new(request.prompt.len())
            .local_hash(&request.prompt)
            .0;
        Sequence {
            id: request.id,
            prompt_len: request.prompt.len(),
            tokens: request.prompt,
            max_output: request.max_output_tokens,
            computed: 0,
            blocks: Vec::new(),
            hashes,
            cached_blocks: 0,
            cached_tokens: None,
            cache_salt: request.cache_salt,
            received: 0,
            output_seed,
        }
    }

    /// Output tokens generated so far.
    pub(crate) fn outputs(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to compute before the next token can be sampled.
    pub(crate) fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Whether the request is past its prefill: it has sampled a token and computes one
    /// token a pass.
    pub(crate) fn is_decoding(&self) -> bool {
        self.outputs() > 0 && self.pending() == 1
    }

    /// Whether it has generated everything it asked for.
    pub(crate) fn is_done(&self) -> bool {
        self.outputs() >= self.max_output as usize
    }

    /// Samples the next token (a pseudo token, deterministic in the prompt and position)
    /// and extends the block hashes when it completes a block.
    pub(crate) fn sample(&mut self, hasher: &BlockHasher, vocab_size: u32) -> u32 {
        let position = self.outputs() as u64;
        let token = (mix64(self.output_seed ^ mix64(position)) % u64::from(vocab_size)) as u32;
        self.tokens.push(token);
        let size = hasher.block_size();
        if size > 0 && self.tokens.len().is_multiple_of(size) {
            let start = self.tokens.len() - size;
            // A prompt shorter than a block completes its first block here: salted too.
            let local = match (&self.cache_salt, self.hashes.is_empty()) {
                (Some(salt), true) => hasher
                    .with_seed(HashSeed::new(None, Some(salt)))
                    .local_hash(&self.tokens[start..]),
                _ => hasher.local_hash(&self.tokens[start..]),
            };
            self.hashes.push(self.chain(local));
        }
        token
    }

    /// The chained hash of a new last block whose own hash is `local`.
    fn chain(&self, local: LocalHash) -> SeqHash {
        match self.hashes.last() {
            Some(&parent) => next_seq_hash(parent, local),
            None => SeqHash(local.0),
        }
    }

    /// Its report for a pass ending at `at`, in which it generated `token` (if any) and
    /// ended (if `finish`).
    pub(crate) fn output(
        &self,
        at: Duration,
        token: Option<u32>,
        finish: Option<Finish>,
    ) -> RequestOutput {
        let first = token.is_some() && self.outputs() == 1;
        RequestOutput {
            id: self.id,
            tokens: token.into_iter().collect(),
            first_token_at: first.then_some(at),
            finish,
            cached_tokens: self.cached_tokens.unwrap_or(0),
            at,
        }
    }
}

/// The local hashes of `tokens`' full blocks as the engine names its blocks: a cache salt
/// enters the first block's (as vLLM's extra keys do), and the chain carries it on.
pub(crate) fn local_hashes(
    hasher: &BlockHasher,
    tokens: &[u32],
    cache_salt: Option<&str>,
) -> Vec<LocalHash> {
    let mut locals = hasher.local_hashes(tokens);
    if let (Some(salt), Some(first)) = (cache_salt, locals.first_mut()) {
        let size = hasher.block_size();
        *first = hasher
            .with_seed(HashSeed::new(None, Some(salt)))
            .local_hash(&tokens[..size]);
    }
    locals
}
