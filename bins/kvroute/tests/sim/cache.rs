//! The prefix cache: eviction order and the cached tokens each request really found.

use kvroute_core::{seq_hashes, BlockHasher};
use kvroute_sim::RequestId;

use crate::{engine, removed_since, request, run_to_idle, tokens, Transcript};

/// The engine's names of the full blocks of `prompt` (its chained hashes).
fn names(prompt: &[u32]) -> Vec<u64> {
    seq_hashes(&BlockHasher::new(16).local_hashes(prompt))
        .iter()
        .map(|h| h.0)
        .collect()
}

#[test]
fn eviction_takes_empty_blocks_first_then_least_recently_used_leaves_first() {
    let mut engine = engine(6, 8_192);
    let mut t = Transcript::default();
    let a = tokens(0, 64);
    let b = tokens(1_000, 32);
    let (na, nb) = (names(&a), names(&b));

    // A caches 4 blocks and frees them last first: idle A3 A2 A1 A0 (oldest first).
    engine.admit(request(1, a.clone(), 1)).unwrap();
    run_to_idle(&mut engine, &mut t);
    // B fits in the 2 empty blocks: nothing cached leaves.
    engine.admit(request(2, b, 1)).unwrap();
    run_to_idle(&mut engine, &mut t);
    assert!(removed_since(&mut engine).is_empty());

    // C reuses A's first two blocks and needs one more: A3, the least recent, a leaf, goes.
    let mut c = a[..32].to_vec();
    c.push(9_999);
    engine.admit(request(3, c, 1)).unwrap();
    run_to_idle(&mut engine, &mut t);
    assert_eq!(removed_since(&mut engine), vec![na[3]]);

    // D needs 4 blocks: the empty one (C's partial block), then A2, B1, B0. A1 and A0, used
    // by C most recently, stay.
    engine.admit(request(4, tokens(5_000, 64), 1)).unwrap();
    run_to_idle(&mut engine, &mut t);
    assert_eq!(removed_since(&mut engine), vec![na[2], nb[1], nb[0]]);
    assert_eq!(engine.cached_prefix_blocks(&a), 2);
}

#[test]
fn cached_tokens_are_the_shared_full_blocks() {
    let mut engine = engine(1_000, 8_192);
    let mut t = Transcript::default();
    let a = tokens(0, 100);
    engine.admit(request(1, a.clone(), 2)).unwrap();
    run_to_idle(&mut engine, &mut t);

    // B shares A's first 90 tokens: 5 full blocks (80 tokens); the partial sixth is not
    // counted, and the block it diverges in is not either.
    let mut b = a[..90].to_vec();
    b.extend(tokens(7_000, 40));
    engine.admit(request(2, b, 2)).unwrap();
    // C is exactly A's first 96 tokens, all cached: its last block is recomputed, as vLLM
    // caps a hit one token short of the prompt.
    engine.admit(request(3, a[..96].to_vec(), 2)).unwrap();
    // D shares nothing.
    engine.admit(request(4, tokens(20_000, 50), 2)).unwrap();
    run_to_idle(&mut engine, &mut t);

    assert_eq!(t.cached[&RequestId(1)], 0);
    assert_eq!(t.cached[&RequestId(2)], 80);
    assert_eq!(t.cached[&RequestId(3)], 80);
    assert_eq!(t.cached[&RequestId(4)], 0);
    let stats = engine.stats();
    assert_eq!(stats.prefix_hit_tokens, 160);
    assert_eq!(stats.prefix_query_tokens, 100 + 130 + 96 + 50);
}

#[test]
fn a_request_reuses_a_prefix_that_another_is_still_decoding() {
    let mut engine = engine(1_000, 8_192);
    let mut t = Transcript::default();
    let a = tokens(0, 64);
    engine.admit(request(1, a.clone(), 50)).unwrap();
    engine.step().unwrap();
    let mut b = a.clone();
    b.extend(tokens(3_000, 10));
    engine.admit(request(2, b, 1)).unwrap();
    let pass = engine.step().unwrap();
    assert_eq!(
        pass.shape.prefill_tokens, 10,
        "only B's own tokens are computed"
    );
    run_to_idle(&mut engine, &mut t);
    assert_eq!(t.cached[&RequestId(2)], 64);
}

#[test]
fn generated_blocks_are_cached_and_published() {
    let mut engine = engine(1_000, 8_192);
    let mut t = Transcript::default();
    engine.admit(request(1, tokens(0, 16), 33)).unwrap();
    run_to_idle(&mut engine, &mut t);
    // 16 prompt + 33 outputs = 49 tokens; 48 computed: 3 full blocks.
    assert_eq!(engine.stats().blocks.cached, 3);
    let mut whole = tokens(0, 16);
    whole.extend(&t.tokens[&RequestId(1)]);
    assert_eq!(engine.cached_prefix_blocks(&whole), 3);
    let stored: usize = engine
        .take_events()
        .iter()
        .flat_map(|batch| &batch.events)
        .map(|e| e.stored_blocks().count())
        .sum();
    assert_eq!(stored, 3);
}
