//! The engine's events, applied to the router's prefix index, describe exactly the engine's
//! cache after every pass, whatever the request stream (random streams on a small cache, so
//! that evictions, preemptions, duplicate copies, aborts and resets all happen, and requests
//! with and without cache salts). Two indexes are fed: one from the events as the in-process
//! fleet converts them, one from the same events encoded on vLLM's wire and decoded by the
//! transport's decoder, as serve receives them.

use std::sync::Arc;

use kvroute::worker::encode_batch;
use kvroute_core::testing::scores_of;
use kvroute_core::{
    BlockHasher, EventId, HashSeed, IndexConfig, MatchOptions, PrefixIndex, WorkerRank,
};
use kvroute_sim::{Admission, ClearMode, Engine, EngineConfig, EngineRequest, RequestId};
use kvroute_transport::engine::{DecoderConfig, EngineDecoder};
use proptest::prelude::*;

const BLOCK: u32 = 4;
const RANK: WorkerRank = WorkerRank::new(0, 0);

#[derive(Clone, Debug)]
enum Op {
    /// A request: one of three shared prefixes cut to a length, then a suffix from a small
    /// alphabet (so suffixes collide too).
    Admit {
        prefix: u32,
        prefix_len: u32,
        suffix: Vec<u32>,
        max_out: u32,
        /// No salt, or one of two.
        salt: u8,
    },
    /// A prompt seen before, again (a fully cached prompt recomputes its last block: a
    /// second copy of a cached block).
    Repeat(usize),
    Step,
    Abort(usize),
    Clear,
    Pause,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..3, 0u32..24, prop::collection::vec(0u32..3, 1..12), 1u32..10, 0u8..3)
            .prop_map(|(prefix, prefix_len, suffix, max_out, salt)| Op::Admit {
                prefix,
                prefix_len,
                suffix,
                max_out,
                salt,
            }),
        2 => any::<usize>().prop_map(Op::Repeat),
        6 => Just(Op::Step),
        1 => any::<usize>().prop_map(Op::Abort),
        1 => Just(Op::Clear),
        1 => Just(Op::Pause),
    ]
}

/// A prompt and its cache salt.
type Prompt = (Vec<u32>, Option<Arc<str>>);

/// The engine and two indexes fed from its events.
struct Model {
    engine: Engine,
    index: PrefixIndex,
    /// Fed from vLLM's wire through the transport's decoder.
    wire_index: PrefixIndex,
    decoder: EngineDecoder,
    next_event: u64,
    next_wire_event: EventId,
    prompts: Vec<Prompt>,
    admitted: Vec<RequestId>,
}

impl Model {
    fn new(kv_blocks: u32, budget: u32, seats: u32) -> Self {
        let config = EngineConfig {
            block_size: BLOCK,
            kv_blocks,
            max_num_batched_tokens: budget,
            max_num_seqs: seats,
            ..EngineConfig::default()
        };
        Model {
            engine: Engine::new(config).unwrap(),
            index: PrefixIndex::new(IndexConfig::default()),
            wire_index: PrefixIndex::new(IndexConfig::default()),
            decoder: EngineDecoder::new(DecoderConfig {
                block_size: Some(BLOCK),
                ..DecoderConfig::default()
            }),
            next_event: 0,
            next_wire_event: EventId(0),
            prompts: Vec::new(),
            admitted: Vec::new(),
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Admit {
                prefix,
                prefix_len,
                suffix,
                max_out,
                salt,
            } => {
                let mut prompt: Vec<u32> = (prefix * 1_000..prefix * 1_000 + prefix_len).collect();
                prompt.extend(suffix);
                let salt = [None, Some("tenant-a"), Some("tenant-b")][usize::from(salt)];
                self.admit((prompt, salt.map(Arc::from)), max_out);
            }
            Op::Repeat(pick) if !self.prompts.is_empty() => {
                let prompt = self.prompts[pick % self.prompts.len()].clone();
                self.admit(prompt, 3);
            }
            Op::Repeat(_) => {}
            Op::Step => {
                self.engine.step();
            }
            Op::Abort(pick) if !self.admitted.is_empty() => {
                let id = self.admitted[pick % self.admitted.len()];
                let _ = self.engine.abort(id); // it may have finished already
            }
            Op::Abort(_) => {}
            Op::Clear => self.engine.clear_cache(ClearMode::PreemptRunning).unwrap(),
            Op::Pause => {
                let next = match self.engine.admission() {
                    Admission::Open => Admission::Paused,
                    Admission::Paused => Admission::Open,
                };
                self.engine.set_admission(next);
            }
        }
        self.feed_index();
    }

    fn admit(&mut self, prompt: Prompt, max_out: u32) {
        let id = RequestId(self.prompts.len() as u64);
        let request = EngineRequest {
            id,
            prompt: prompt.0.clone(),
            max_output_tokens: max_out,
            arrival: self.engine.now(),
            cache_salt: prompt.1.clone(),
        };
        if self.engine.admit(request).is_ok() {
            self.admitted.push(id);
        }
        self.prompts.push(prompt);
    }

    fn feed_index(&mut self) {
        for batch in self.engine.take_events() {
            for event in &batch.events {
                let kv = event.to_kv_event(RANK, EventId(self.next_event));
                self.next_event += 1;
                self.index.apply(&kv).unwrap();
            }
            let mut decoded = Vec::new();
            let payload = encode_batch(&batch, 0, 0.0);
            let outcome = self
                .decoder
                .decode(&payload, &mut self.next_wire_event, &mut decoded)
                .unwrap();
            assert_eq!(outcome.skipped, 0);
            for kv in &decoded {
                self.wire_index.apply(kv).unwrap();
            }
        }
    }

    /// The index and the engine agree on every block and on every prompt seen.
    fn check(&self) -> Result<(), TestCaseError> {
        let engine = self.engine.stats().blocks;
        let index = self.index.stats();
        prop_assert_eq!(engine.double_frees, 0);
        prop_assert_eq!(index.stored_pairs, u64::from(engine.cached));
        prop_assert_eq!(
            index.duplicate_copies,
            u64::from(engine.cached_copies - engine.cached)
        );
        prop_assert_eq!(self.wire_index.stats().stored_pairs, index.stored_pairs);
        let (reader, wire_reader) = (self.index.reader(), self.wire_index.reader());
        for (prompt, salt) in &self.prompts {
            // As the router hashes a request with this salt.
            let hasher =
                BlockHasher::new(BLOCK as usize).with_seed(HashSeed::new(None, salt.as_deref()));
            let locals = hasher.local_hashes(prompt);
            let cached = self
                .engine
                .cached_prefix_blocks_salted(prompt, salt.as_deref());
            let scores = scores_of(&reader, &locals, MatchOptions::default());
            prop_assert_eq!(
                scores.blocks(RANK) as usize,
                cached,
                "prompt {:?} {:?}",
                prompt,
                salt
            );
            let wire = scores_of(&wire_reader, &locals, MatchOptions::default());
            prop_assert_eq!(
                wire.blocks(RANK) as usize,
                cached,
                "wire: prompt {:?} {:?}",
                prompt,
                salt
            );
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn the_index_built_from_events_equals_the_engine_cache(
        kv_blocks in 8u32..40,
        budget in 4u32..48,
        seats in 1u32..6,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut model = Model::new(kv_blocks, budget, seats);
        for op in ops {
            model.apply(op);
            model.check()?;
        }
        model.engine.set_admission(Admission::Open);
        while model.engine.step().is_some() {
            model.feed_index();
            model.check()?;
        }
        prop_assert!(model.engine.is_idle());
        let stats = model.engine.stats();
        prop_assert_eq!(stats.blocks.in_use, 0, "every block is freed");
        prop_assert_eq!(stats.blocks.idle, stats.blocks.cached_copies);
    }
}
