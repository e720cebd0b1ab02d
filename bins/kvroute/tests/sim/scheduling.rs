//! The scheduler's rules: the admission gate, chunked prefill, preemption.

use kvroute_sim::Finish;

use crate::{engine, request, run_to_idle, tokens, Transcript};

#[test]
fn a_prompt_that_does_not_fit_waits_until_blocks_free_up() {
    // 8 blocks of 16. A: 100 prompt tokens take 7 blocks, its decodes the 8th. B's 40 tokens
    // need 3 blocks: they are there only once A has finished (and its idle blocks are evicted).
    let mut engine = engine(8, 8_192);
    engine.admit(request(1, tokens(0, 100), 20)).unwrap();
    engine.admit(request(2, tokens(1_000, 40), 1)).unwrap();
    let mut t = Transcript::default();
    engine.step().unwrap();
    t.record(engine.take_outputs());
    assert_eq!((engine.stats().running, engine.stats().waiting), (1, 1));
    assert_eq!(engine.stats().blocks.in_use, 7);
    run_to_idle(&mut engine, &mut t);
    assert_eq!(t.count(1), 20);
    assert_eq!(t.count(2), 1);
    assert!(t.first_token[&crate::RequestId(2)] > t.finished_at(1));
    assert_eq!(engine.stats().blocks.in_use, 0);
    let removed = crate::removed_since(&mut engine);
    assert_eq!(
        removed.len(),
        2,
        "B took the one empty block and evicted two of A's"
    );
}

#[test]
fn a_prompt_that_fits_in_evictable_blocks_is_admitted() {
    // A's 7 cached blocks are idle after it finishes: B's 8 blocks fit in 1 empty + 7 idle.
    let mut engine = engine(8, 8_192);
    engine.admit(request(1, tokens(0, 112), 1)).unwrap();
    let mut t = Transcript::default();
    run_to_idle(&mut engine, &mut t);
    assert_eq!(engine.stats().blocks.idle, 7);
    engine.admit(request(2, tokens(5_000, 128), 1)).unwrap();
    engine.step().unwrap();
    t.record(engine.take_outputs());
    assert_eq!(t.count(2), 1, "B ran in the first pass after its admission");
    assert_eq!(crate::removed_since(&mut engine).len(), 7);
}

#[test]
fn a_long_prompt_takes_one_pass_per_budget_chunk() {
    // 200 tokens at 64 a pass: 64, 64, 64, 8 — the first token after the fourth pass.
    let mut engine = engine(100, 64);
    engine.admit(request(1, tokens(0, 200), 3)).unwrap();
    let mut chunks = Vec::new();
    for _ in 0..3 {
        chunks.push(engine.step().unwrap().shape.prefill_tokens);
        assert!(
            engine.take_outputs().is_empty(),
            "no token before the prefill is done"
        );
    }
    let last = engine.step().unwrap();
    chunks.push(last.shape.prefill_tokens);
    assert_eq!(chunks, vec![64, 64, 64, 8]);
    let outputs = engine.take_outputs();
    assert_eq!(outputs.len(), 1);
    assert_eq!(
        outputs[0].first_token_at,
        Some(last.started + last.duration)
    );
    let decode = engine.step().unwrap();
    assert_eq!(
        (decode.shape.prefill_tokens, decode.shape.decode_tokens),
        (0, 1)
    );
}

#[test]
fn chunks_share_the_budget_with_decodes() {
    // A decodes (1 token a pass); B's 100-token prompt gets the remaining 31 tokens a pass.
    let mut engine = engine(100, 32);
    engine.admit(request(1, tokens(0, 16), 50)).unwrap();
    engine.step().unwrap();
    engine.admit(request(2, tokens(1_000, 100), 1)).unwrap();
    let pass = engine.step().unwrap();
    assert_eq!(pass.shape.decode_tokens, 1);
    assert_eq!(pass.shape.prefill_tokens, 31);
}

#[test]
fn the_most_recently_admitted_request_is_preempted_and_completes_later() {
    // 6 blocks; A and B (admitted in that order) each grow to 5 blocks: when A needs its
    // fourth block none is left, and B goes back to the waiting queue.
    let mut engine = engine(6, 8_192);
    engine.admit(request(1, tokens(0, 32), 40)).unwrap();
    engine.admit(request(2, tokens(1_000, 32), 40)).unwrap();
    let mut t = Transcript::default();
    let preempting = loop {
        let pass = engine.step().unwrap();
        t.record(engine.take_outputs());
        if pass.preempted > 0 {
            break pass;
        }
    };
    assert_eq!(preempting.preempted, 1);
    let stats = engine.stats();
    assert_eq!((stats.running, stats.waiting, stats.preemptions), (1, 1, 1));
    assert_eq!(stats.blocks.in_use, 4, "only A's blocks are held");
    let (a, b) = (t.count(1), t.count(2));
    assert_eq!(
        (a, b),
        (18, 17),
        "A decoded in the preempting pass, B did not"
    );
    run_to_idle(&mut engine, &mut t);
    assert_eq!((t.count(1), t.count(2)), (40, 40));
    assert_eq!(t.finished[&crate::RequestId(2)].0, Finish::Length);
    assert!(t.finished_at(2) > t.finished_at(1));
    assert_eq!(engine.stats().blocks.in_use, 0);
    assert_eq!(engine.stats().blocks.double_frees, 0);

    // The recompute changes nothing B generates: alone, it says the same.
    let mut alone = crate::engine(6, 8_192);
    alone.admit(request(2, tokens(1_000, 32), 40)).unwrap();
    let mut solo = Transcript::default();
    run_to_idle(&mut alone, &mut solo);
    assert_eq!(
        solo.tokens[&crate::RequestId(2)],
        t.tokens[&crate::RequestId(2)]
    );
}

#[test]
fn the_seat_limit_holds_requests_back() {
    let mut engine = kvroute_sim::Engine::new(kvroute_sim::EngineConfig {
        max_num_seqs: 2,
        ..kvroute_sim::EngineConfig::default()
    })
    .unwrap();
    for id in 0..3 {
        engine
            .admit(request(id, tokens(id as u32 * 100, 20), 5))
            .unwrap();
    }
    let pass = engine.step().unwrap();
    assert_eq!(pass.scheduled, 2);
    assert_eq!(engine.stats().waiting, 1);
}

#[test]
fn a_transferred_prompt_computes_only_its_tail_and_publishes_the_blocks_it_received() {
    // 200 tokens: 12 full blocks handed over; the 13th block's 8 tokens are computed.
    let mut engine = engine(100, 64);
    engine.admit(request(9, tokens(9_000, 40), 30)).unwrap();
    engine.step().unwrap();
    engine.take_events();
    engine
        .admit_transferred(request(1, tokens(0, 200), 3))
        .unwrap();
    // It goes first: scheduled in the next pass, ahead of nothing waiting but before any
    // later arrival, with the running request's decode.
    engine.admit(request(2, tokens(5_000, 64), 1)).unwrap();
    let pass = engine.step().unwrap();
    // Its tail, then B's first chunk: the budget less the running request's decode token.
    assert_eq!(pass.shape.prefill_tokens, 8 + 55);
    let outputs = engine.take_outputs();
    let one = outputs
        .iter()
        .find(|o| o.id == crate::RequestId(1))
        .unwrap();
    assert!(
        one.first_token_at.is_some(),
        "its first token after one pass"
    );
    assert_eq!(
        one.cached_tokens, 0,
        "received blocks are not prefix-cache hits"
    );
    let stored: usize = engine
        .take_events()
        .iter()
        .flat_map(|b| &b.events)
        .map(|e| e.stored_blocks().count())
        .sum();
    assert!(
        stored >= 12,
        "the received blocks are published as stored: {stored}"
    );
    // A later request with the same prompt finds them cached.
    let mut t = Transcript::default();
    run_to_idle(&mut engine, &mut t);
    engine.admit(request(3, tokens(0, 200), 1)).unwrap();
    run_to_idle(&mut engine, &mut t);
    assert_eq!(engine.stats().prefix_hit_tokens, 192);
    assert_eq!(engine.stats().blocks.in_use, 0);
}

#[test]
fn a_finished_prefills_blocks_stay_in_use_until_released() {
    // As the test above, but A's 7 blocks are held for its transfer once it finishes: B's 8
    // blocks do not fit in the one empty block until they are released.
    let mut engine = engine(8, 8_192);
    engine.admit(request(1, tokens(0, 112), 1)).unwrap();
    engine.hold_when_finished(crate::RequestId(1)).unwrap();
    let mut t = Transcript::default();
    run_to_idle(&mut engine, &mut t);
    assert_eq!(t.count(1), 1, "A finished");
    assert_eq!(engine.stats().blocks.in_use, 7);
    assert_eq!(engine.held_requests(), 1);
    engine.admit(request(2, tokens(5_000, 128), 1)).unwrap();
    assert!(
        engine.step().is_none(),
        "B cannot start while A's KV is held"
    );
    assert!(engine.release_held(crate::RequestId(1)));
    assert!(!engine.release_held(crate::RequestId(1)), "released once");
    assert_eq!(engine.stats().blocks.idle, 7, "still cached once released");
    engine.step().unwrap();
    t.record(engine.take_outputs());
    assert_eq!(t.count(2), 1);
    // A request aborted before it finishes holds nothing; an unknown one cannot be held.
    engine.admit(request(3, tokens(9_000, 40), 4)).unwrap();
    engine.hold_when_finished(crate::RequestId(3)).unwrap();
    engine.abort(crate::RequestId(3)).unwrap();
    run_to_idle(&mut engine, &mut t);
    assert_eq!(engine.held_requests(), 0);
    assert_eq!(engine.stats().blocks.in_use, 0);
    assert!(engine.hold_when_finished(crate::RequestId(42)).is_err());
}
