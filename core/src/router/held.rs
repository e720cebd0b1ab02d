//! How far a prompt's beginning can match anywhere: what a caller that tokenizes a long prompt
//! piece by piece asks to know when the rest of it can no longer matter to the choice.

use super::route::SCRATCH;
use super::scratch::Prompt;
use super::{RouteHints, Router};
use crate::approx::Overlaps;
use crate::event::WorkerRank;
use crate::hash::{BlockHasher, HashSeed};
use crate::index::{MatchOptions, RankKey};

/// The deepest depth a lookup of the router's records reports.
struct Deepest(u32);

impl Overlaps for Deepest {
    fn raise(&mut self, _: WorkerRank, _: RankKey, depth: u32) -> bool {
        let raised = depth > self.0;
        self.0 = self.0.max(depth);
        raised
    }
}

impl Router {
    /// How many of the full blocks of `tokens` (hashed under `hints`' LoRA adapter and cache
    /// salt) some rank may already hold: the deepest of the index's overlaps (any tier), the
    /// router's own records, and the prompts active on one rank. No rank can hold a block past
    /// it, so a caller tokenizing a long prompt piece by piece may stop once this falls short
    /// of the blocks it has, and route what it has with the prompt's whole length in
    /// [`RouteHints::prompt_len`]: the choice is the one the whole prompt would get, but for
    /// the active blocks it books, which are the ones tokenized. Reads only; lock-free but for
    /// the active prompts' tables, which it skips when they are busy.
    pub fn held_blocks(&self, tokens: &[u32], hints: &RouteHints<'_>) -> u32 {
        SCRATCH.with(|s| match s.try_borrow_mut() {
            Ok(mut s) => {
                let s = &mut *s;
                self.held_with(tokens, hints, &mut s.prompt, &mut s.depths)
            }
            Err(_) => self.held_with(
                tokens,
                hints,
                &mut Prompt::default(),
                &mut Default::default(),
            ),
        })
    }

    /// Whether tokens after `tokens`, the beginning of a prompt, could change its decision:
    /// while some rank may hold every full block of them ([`Router::held_blocks`]), or while
    /// they are fewer than the blocks the policy keys on (prefix-hash's first blocks). A
    /// caller tokenizing a long prompt piece by piece stops when this is false, and routes
    /// what it has with the whole length in [`RouteHints::prompt_len`].
    pub fn needs_more_tokens(&self, tokens: &[u32], hints: &RouteHints<'_>) -> bool {
        let full = tokens.len() / self.config.block_size.max(1) as usize;
        full < self.prefix_key_blocks() || self.held_blocks(tokens, hints) as usize >= full
    }

    fn held_with(
        &self,
        tokens: &[u32],
        hints: &RouteHints<'_>,
        prompt: &mut Prompt,
        depths: &mut crate::index::RankDepths,
    ) -> u32 {
        let hasher = BlockHasher::new(self.config.block_size as usize)
            .with_seed(HashSeed::new(hints.lora_name, hints.cache_salt));
        hasher.local_hashes_into(tokens, &mut prompt.locals);
        // Checkpoint keys are computed from these hashes as the records' lookup needs them.
        prompt.marks.clear();
        let locals = &prompt.locals;
        let full = locals.len() as u32;
        if full == 0 {
            return 0;
        }
        depths.set_eager(true);
        self.reader
            .find_depths_into(locals, MatchOptions { early_exit: false }, depths);
        let mut deepest = depths
            .deepest_ids()
            .next()
            .and_then(|id| depths.get(id))
            .map_or(0, |d| d.blocks);
        if deepest < full && !self.approx.is_empty() {
            let mut records = Deepest(deepest);
            let now = self.clock.now();
            self.approx
                .lookup_over(locals, &mut prompt.marks, now, deepest + 1, &mut records);
            deepest = records.0;
        }
        if deepest < full {
            for entry in self.registry.load().ranks.iter() {
                if let Some(active) = entry.state.try_shared_prefix_blocks(locals) {
                    deepest = deepest.max(active as u32);
                    if deepest >= full {
                        break;
                    }
                }
            }
        }
        deepest.min(full)
    }
}
