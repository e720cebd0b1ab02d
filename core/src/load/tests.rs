use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::keys::prefix_keys_extend;
use super::prefix_refs::{PrefixRefs, KEPT_FREE_SLOTS, KEPT_SLOT_CAPACITY};
use super::rank::lock;
use super::*;
use crate::config::PromptDecay;
use crate::event::{WorkerId, WorkerRank};
use crate::hash::LocalHash;
use crate::rng::mix64;

/// The block hashes of a prompt whose blocks hash to `locals`.
fn blocks(locals: &[u64]) -> Vec<LocalHash> {
    locals.iter().map(|&x| LocalHash(x)).collect()
}

/// The prefix keys of a prompt whose blocks hash to `locals`: equal keys, equal prefixes.
fn keys(locals: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    prefix_keys_into(&blocks(locals), &mut out);
    out
}

fn spec<'a>(
    id: u64,
    state: &'a Arc<RankState>,
    tokens: u64,
    block_hashes: &'a [LocalHash],
    now: Instant,
) -> BookingSpec<'a> {
    BookingSpec {
        request: RequestId(id),
        state,
        prefill_tokens: tokens,
        block_hashes,
        tail_blocks: 0,
        prompt_tokens: tokens,
        cached_tokens: 0,
        block_size: 16,
        expected_output_tokens: None,
        session: None,
        now,
    }
}

#[test]
fn prefix_keys_name_prefixes_not_blocks() {
    let a = keys(&[1, 2, 3]);
    let b = keys(&[1, 2, 4]);
    let c = keys(&[9, 2, 3]);
    assert_eq!(a[..2], b[..2]);
    assert_ne!(a[2], b[2]);
    assert_ne!(
        a[1], c[1],
        "same block after a different prefix is a different key"
    );
}

#[test]
fn shared_prefix_blocks_count_once() {
    let ledger = Ledger::new();
    let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let now = Instant::now();
    let a = blocks(&[1, 2, 3, 4]);
    let b = blocks(&[1, 2, 7, 8, 9]);
    ledger.book(spec(1, &s, 64, &a, now)).unwrap();
    ledger.book(spec(2, &s, 80, &b, now)).unwrap();
    let l = s.load();
    assert_eq!(l.prompt_blocks, 4 + 3, "blocks 1, 2 shared");
    assert_eq!(l.prefill_tokens, 144);
    assert_eq!(l.requests, 2);
    ledger.free(RequestId(1)).unwrap();
    assert_eq!(
        s.load().prompt_blocks,
        5,
        "shared blocks stay while request 2 holds them"
    );
    ledger.free(RequestId(2)).unwrap();
    assert!(s.load().is_idle());
    assert_eq!(s.distinct_prefix_blocks(), 0);
}

#[test]
fn prefill_done_releases_tokens_once_and_output_blocks_grow() {
    let ledger = Ledger::new();
    let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let k = blocks(&[1, 2]);
    ledger
        .book(BookingSpec {
            tail_blocks: 1,
            ..spec(5, &s, 40, &k, Instant::now())
        })
        .unwrap();
    assert_eq!(s.load().prompt_blocks, 3);
    ledger.prefill_done(RequestId(5), None).unwrap();
    ledger.prefill_done(RequestId(5), None).unwrap();
    assert_eq!(s.load().prefill_tokens, 0);
    ledger.output_block(RequestId(5), None).unwrap();
    ledger.output_block(RequestId(5), None).unwrap();
    assert_eq!(s.load().decode_blocks(), 5);
    let freed = ledger.free(RequestId(5)).unwrap();
    assert_eq!(freed.output_blocks, 2);
    assert_eq!(freed.prefill_tokens, 0);
    assert!(s.load().is_idle());
}

#[test]
fn bad_ids_are_typed_errors_and_counted() {
    let ledger = Ledger::new();
    let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let k = blocks(&[1]);
    ledger.book(spec(1, &s, 10, &k, Instant::now())).unwrap();
    assert_eq!(
        ledger.book(spec(1, &s, 10, &k, Instant::now())),
        Err(LoadError::DuplicateRequest {
            request: RequestId(1)
        })
    );
    assert_eq!(s.load().requests, 1, "a rejected duplicate books nothing");
    ledger.free(RequestId(1)).unwrap();
    let unknown = LoadError::UnknownRequest {
        request: RequestId(1),
    };
    assert_eq!(ledger.free(RequestId(1)), Err(unknown.clone()));
    assert_eq!(
        ledger.prefill_done(RequestId(1), None),
        Err(unknown.clone())
    );
    assert_eq!(
        ledger.output_block(RequestId(1), None),
        Err(unknown.clone())
    );
    assert_eq!(ledger.mark_dispatched(RequestId(1)), Err(unknown));
    let c = ledger.counts();
    assert_eq!((c.duplicate_requests, c.unknown_requests), (1, 4));
    assert!(s.load().is_idle());
}

#[test]
fn expiry_frees_only_old_requests() {
    let ledger = Ledger::new();
    let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let t0 = Instant::now();
    let k = blocks(&[1, 2]);
    ledger.book(spec(1, &s, 10, &k, t0)).unwrap();
    ledger
        .book(spec(2, &s, 10, &k, t0 + Duration::from_secs(10)))
        .unwrap();
    let n = ledger.expire(t0 + Duration::from_secs(15), Duration::from_secs(10));
    assert_eq!(n, 1);
    assert_eq!(ledger.rank_of(RequestId(1)), None);
    assert_eq!(s.load().requests, 1);
    assert_eq!(s.load().prompt_blocks, 2);
    assert_eq!(ledger.counts().expired, 1);
}

#[test]
fn booking_on_a_retired_rank_undoes_itself() {
    let ledger = Ledger::new();
    let s = Arc::new(RankState::new(WorkerRank::new(3, 0)));
    s.retire();
    let k = blocks(&[1, 2]);
    assert!(matches!(
        ledger.book(spec(1, &s, 10, &k, Instant::now())),
        Err(LoadError::RankRetired { .. })
    ));
    assert!(s.load().is_idle());
    assert_eq!(ledger.active(), 0);
}

#[test]
fn purge_drops_only_the_leaving_workers_bookings() {
    let ledger = Ledger::new();
    let a = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let b = Arc::new(RankState::new(WorkerRank::new(2, 0)));
    let k = blocks(&[1, 2]);
    ledger.book(spec(1, &a, 10, &k, Instant::now())).unwrap();
    ledger.book(spec(2, &b, 10, &k, Instant::now())).unwrap();
    a.retire();
    assert_eq!(ledger.purge_worker(WorkerId(1)), 1);
    assert!(a.load().is_idle());
    assert_eq!(b.load().requests, 1);
}

/// Over many prompts branching from shared prefixes (small and structured local hashes
/// included), distinct prefixes get distinct keys and equal prefixes equal keys.
#[test]
fn prefix_keys_tell_prefixes_apart() {
    let mut rng = crate::rng::Rng::new(3);
    let mut by_key: HashMap<u64, Vec<u64>> = HashMap::new();
    for p in 0..2_000u64 {
        // A branch of one of a few trunks, its hashes random or tiny.
        let trunk = p % 7;
        let cut = rng.below(40);
        let locals: Vec<u64> = (0..80u64)
            .map(|i| match (i < cut, p % 2) {
                (true, _) => trunk * 1_000 + i,
                (false, 0) => rng.next_u64(),
                (false, _) => rng.below(4),
            })
            .collect();
        for (i, k) in keys(&locals).into_iter().enumerate() {
            let prefix = locals[..=i].to_vec();
            let seen = by_key.entry(k).or_insert_with(|| prefix.clone());
            assert_eq!(*seen, prefix, "two prefixes share key {k:#x}");
        }
    }
    assert!(by_key.len() > 50_000, "{}", by_key.len());
}

#[test]
fn prefix_keys_extend_continues_the_same_chain() {
    let locals: Vec<LocalHash> = (0..40).map(|i| LocalHash(i * 31 + 7)).collect();
    let mut all = Vec::new();
    prefix_keys_into(&locals, &mut all);
    let mut part = Vec::new();
    prefix_keys_into(&locals[..3], &mut part);
    prefix_keys_extend(&locals, &mut part, 17);
    assert_eq!(part, all[..17]);
    prefix_keys_extend(&locals, &mut part, 10);
    assert_eq!(part.len(), 17, "never shrinks");
    prefix_keys_extend(&locals, &mut part, 99);
    assert_eq!(part, all);
    let mut fresh = Vec::new();
    prefix_keys_extend(&locals, &mut fresh, 5);
    assert_eq!(fresh, all[..5]);
}

/// The search over held prompts equals a linear count of the query's leading prefix keys
/// held, for prompts sharing prefixes of every length with the active requests, and for
/// blocks that recur at other positions.
#[test]
fn shared_prefix_equals_a_linear_scan() {
    let ledger = Ledger::new();
    let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let active = [vec![1, 2, 3, 4, 5, 6], vec![1, 2, 9], vec![7, 8]];
    for (i, k) in active.iter().enumerate() {
        ledger
            .book(spec(i as u64, &s, 1, &blocks(k), Instant::now()))
            .unwrap();
    }
    let linear = |q: &[u64]| {
        let held: std::collections::HashSet<u64> = active.iter().flat_map(|a| keys(a)).collect();
        keys(q).iter().take_while(|k| held.contains(k)).count()
    };
    let queries = [
        vec![1, 2, 3, 4, 5, 6, 7, 8],
        vec![1, 2, 3],
        vec![1, 2, 9, 9],
        vec![1, 5],
        vec![7, 8, 9],
        vec![3],
        vec![2, 3, 4],
        vec![],
    ];
    for q in queries {
        let got = s.try_shared_prefix_blocks(&blocks(&q));
        assert_eq!(got, Some(linear(&q)), "{q:?}");
    }
    assert_eq!(
        s.try_shared_prefix_blocks(&blocks(&[1, 2, 3, 4, 5, 6, 7])),
        Some(6)
    );
    // A held table is skipped, not waited for.
    let held = lock(&s.refs);
    assert_eq!(s.try_shared_prefix_blocks(&blocks(&[1])), None);
    drop(held);
}

/// The sorted-prompt table against per-key refcounts: random prompts over a small
/// alphabet (so that they share prefixes of every length, and some are equal) acquired
/// and released in random order give the same distinct count, shared prefix of any query
/// and unshared suffix of every held prompt as counting each prefix key's holders.
#[test]
fn free_slots_keep_few_vectors_and_booking_reuses_them() {
    let mut refs = PrefixRefs::default();
    let prompt = |p: u64, len: u64| blocks(&(0..len).map(|i| p * 100_000 + i).collect::<Vec<_>>());
    let slots: Vec<u32> = (0..40).map(|p| refs.acquire(&prompt(p, 100)).0).collect();
    for &slot in &slots {
        refs.release(slot);
    }
    let holding = || refs.slots.iter().filter(|v| v.capacity() > 0).count();
    assert_eq!(
        holding(),
        KEPT_FREE_SLOTS,
        "only the latest free slots keep vectors"
    );
    assert!(refs.slots.iter().all(|v| v.is_empty()));
    // Booking takes the latest free slot first: those with a vector, none allocated.
    for p in 0..KEPT_FREE_SLOTS as u64 {
        let next = *refs.free.last().unwrap();
        assert!(refs.slots[next as usize].capacity() >= 100);
        let (slot, _) = refs.acquire(&prompt(100 + p, 100));
        assert_eq!(slot, next);
        assert_eq!(refs.keys(slot), prompt(100 + p, 100).as_slice());
    }
    // A prompt longer than a kept vector may be gives its vector up when released.
    let (long, _) = refs.acquire(&prompt(999, KEPT_SLOT_CAPACITY as u64 + 1));
    refs.release(long);
    assert_eq!(refs.slots[long as usize].capacity(), 0);
}

#[test]
fn prefix_table_equals_per_key_refcounts() {
    let mut x = 0x5eed_u64;
    let mut next = |n: u64| {
        x = mix64(x.wrapping_add(0x9e37_79b9_7f4a_7c15));
        x % n
    };
    for _ in 0..200 {
        let mut refs = PrefixRefs::default();
        let mut held: Vec<(u32, Vec<u64>)> = Vec::new();
        for _ in 0..40 {
            if held.is_empty() || next(3) > 0 {
                let len = next(9) as usize;
                let locals: Vec<u64> = (0..len).map(|_| next(3)).collect();
                let k = keys(&locals);
                let (slot, new) = refs.acquire(&blocks(&locals));
                let before: std::collections::HashSet<u64> =
                    held.iter().flat_map(|(_, k)| k.iter().copied()).collect();
                assert_eq!(new, k.iter().filter(|k| !before.contains(k)).count() as u64);
                held.push((slot, k));
            } else {
                let i = next(held.len() as u64) as usize;
                let (slot, k) = held.swap_remove(i);
                let after: std::collections::HashSet<u64> =
                    held.iter().flat_map(|(_, k)| k.iter().copied()).collect();
                let held_keys: Vec<u64> = refs.keys(slot).iter().map(|b| b.0).collect();
                assert_eq!(keys(&held_keys), k);
                let gone = refs.release(slot);
                assert!(refs.keys(slot).is_empty());
                assert_eq!(gone, k.iter().filter(|k| !after.contains(k)).count() as u64);
            }
            let mut counts: HashMap<u64, usize> = HashMap::new();
            for (_, k) in &held {
                for key in k {
                    *counts.entry(*key).or_default() += 1;
                }
            }
            assert_eq!(refs.len(), counts.len());
            for (slot, k) in &held {
                let unshared = k.iter().filter(|key| counts[key] == 1).count();
                assert_eq!(refs.unshared(*slot), unshared);
            }
            let q: Vec<u64> = (0..next(10)).map(|_| next(3)).collect();
            let linear = keys(&q)
                .iter()
                .take_while(|k| counts.contains_key(k))
                .count();
            assert_eq!(refs.shared_prefix(&blocks(&q)), linear);
        }
    }
}

#[test]
fn generated_tokens_at_each_block_boundary() {
    // A 40-token prompt fills 3 blocks of 16 (48 slots): output token 9 opens block 4.
    assert_eq!(generated_at_block(40, 16, 0), 0);
    assert_eq!(generated_at_block(40, 16, 1), 9);
    assert_eq!(generated_at_block(40, 16, 2), 25);
    // A prompt of whole blocks: the first output token opens a block.
    assert_eq!(generated_at_block(32, 16, 1), 1);
    assert_eq!(generated_at_block(32, 16, 3), 33);
    assert_eq!(remaining_fraction(25, 100), 0.75);
    assert_eq!(remaining_fraction(250, 100), 0.0);
    assert_eq!(
        remaining_fraction(1, 0),
        0.0,
        "an expected length of 0 counts as 1"
    );
}

/// The documented formula: after k blocks a request weighs `k · max(0, 1 − g_k / E)`
/// blocks, its decay never decreases, and it is whole-block exact at the ends.
#[test]
fn output_decay_follows_the_remaining_fraction() {
    // Prompt 32 tokens, E = 64: g_k = 16(k − 1) + 1.
    for k in 1..10u64 {
        let g = 16 * (k - 1) + 1;
        let weighted = k as f64 * (1.0 - g as f64 / 64.0).max(0.0);
        let d = output_decay(32, 16, 64, k);
        let expect = k * DECAY_SCALE - (weighted * DECAY_SCALE as f64).round() as u64;
        assert_eq!(d, expect, "k = {k}");
        assert!(d >= output_decay(32, 16, 64, k - 1));
    }
    assert_eq!(output_decay(32, 16, 64, 0), 0);
    assert_eq!(
        output_decay(32, 16, 64, 6),
        6 * DECAY_SCALE,
        "past E: no load"
    );
    for (isl, e) in [(0, 1), (17, 5), (1000, 100_000), (5, u32::MAX)] {
        let mut last = 0;
        for k in 0..200 {
            let d = output_decay(isl, 16, e, k);
            assert!(d >= last && d <= k * DECAY_SCALE, "{isl} {e} {k}");
            last = d;
        }
    }
}

#[test]
fn expected_output_decays_the_ranks_output_load_and_free_restores_it() {
    let ledger = Ledger::new();
    let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let k = blocks(&[1, 2]);
    ledger
        .book(BookingSpec {
            expected_output_tokens: Some(64),
            ..spec(1, &s, 32, &k, Instant::now())
        })
        .unwrap();
    ledger.book(spec(2, &s, 32, &k, Instant::now())).unwrap();
    for _ in 0..2 {
        ledger.output_block(RequestId(1), None).unwrap();
        ledger.output_block(RequestId(2), None).unwrap();
    }
    // Request 1 at k = 2: g = 17, r = 47/64, weight 2 · 47/64; request 2 undecayed.
    let l = s.load();
    assert_eq!(l.output_blocks, 4);
    assert_eq!(l.output_decay, output_decay(32, 16, 64, 2));
    assert_eq!(l.weighted_output_blocks(), 2.0 + 2.0 * 47.0 / 64.0);
    assert_eq!(l.decode_blocks(), 2 + 4, "capacity counts every block held");
    ledger.free(RequestId(2)).unwrap();
    for _ in 0..6 {
        ledger.output_block(RequestId(1), None).unwrap();
    }
    assert_eq!(
        s.load().weighted_output_blocks(),
        0.0,
        "past its expected output"
    );
    ledger.free(RequestId(1)).unwrap();
    assert!(s.load().is_idle());
}

/// With an expected output, a request's prompt blocks that no other request holds (and its
/// partial tail) weigh what is left of its output, as its output blocks do; blocks it
/// shares stay whole; the count follows sharing at each output block; a free undoes it.
#[test]
fn unshared_prompt_blocks_decay_and_shared_ones_do_not() {
    let ledger = Ledger::with_prompt_decay(PromptDecay::Unshared);
    let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let a = blocks(&[1, 2, 3, 4]);
    let b = blocks(&[1, 2, 9]);
    let now = Instant::now();
    // Request 1: 4 full blocks and a tail (70 tokens), E = 100.
    ledger
        .book(BookingSpec {
            tail_blocks: 1,
            prompt_tokens: 70,
            expected_output_tokens: Some(100),
            ..spec(1, &s, 70, &a, now)
        })
        .unwrap();
    ledger.book(spec(2, &s, 48, &b, now)).unwrap();
    assert_eq!(s.load().prompt_blocks, 5 + 1);
    assert!(!ledger.prompt_decay_anywhere());
    // First output block of request 1 opens at output token 11 (80 slots): r = 0.89.
    ledger.output_block(RequestId(1), None).unwrap();
    assert!(ledger.prompt_decay_anywhere());
    let left = remaining_fraction(11, 100);
    let l = s.load();
    assert_eq!(
        l.prompt_decay,
        decayed(2 + 1, left),
        "blocks 3, 4 and the tail"
    );
    assert!((l.weighted_prompt_blocks() - (6.0 - 3.0 * (1.0 - left))).abs() < 1e-4);
    // Request 3 shares all of request 1's full blocks: at the next output block, only
    // the tail is unshared.
    ledger.book(spec(3, &s, 64, &a, now)).unwrap();
    ledger.output_block(RequestId(1), None).unwrap();
    assert_eq!(
        s.load().prompt_decay,
        decayed(1, remaining_fraction(27, 100))
    );
    // Request 3 leaves: at the next block, blocks 3 and 4 are its own again.
    ledger.free(RequestId(3)).unwrap();
    ledger.output_block(RequestId(1), None).unwrap();
    assert_eq!(
        s.load().prompt_decay,
        decayed(3, remaining_fraction(43, 100))
    );
    // Request 2 (no expected output) never decays; freeing 1 takes its decay away.
    ledger.output_block(RequestId(2), None).unwrap();
    assert!(ledger.prompt_decay_anywhere());
    ledger.free(RequestId(1)).unwrap();
    assert!(!ledger.prompt_decay_anywhere());
    assert_eq!((s.load().prompt_decay, s.load().output_decay), (0, 0));
    ledger.free(RequestId(2)).unwrap();
    assert!(s.load().is_idle());
}

/// Tokens open blocks where the count crosses a boundary, however they are chunked, and
/// mix with `output_block`; the first tokens release the prefill and give the TTFT.
#[test]
fn tokens_generated_open_blocks_at_boundaries() {
    let ledger = Ledger::new();
    let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let k = blocks(&[1, 2]);
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    // 40 prompt tokens in 3 blocks (48 slots): output token 9 opens the first block.
    ledger.book(spec(1, &s, 40, &k, t0)).unwrap();
    let first = ledger
        .tokens_generated(RequestId(1), 8, Some(at(20)))
        .unwrap();
    assert!(first.prefill_released);
    assert_eq!(
        (first.ttft, first.itl, first.new_blocks),
        (Some(Duration::from_millis(20)), None, 0)
    );
    assert_eq!(s.load().prefill_tokens, 0);
    let next = ledger
        .tokens_generated(RequestId(1), 1, Some(at(30)))
        .unwrap();
    assert_eq!(
        (next.ttft, next.itl, next.itl_tokens, next.new_blocks),
        (None, Some(Duration::from_millis(10)), 1, 1)
    );
    // 9 + 40 = 49 tokens: blocks open at 9, 25 and 41.
    assert_eq!(
        ledger
            .tokens_generated(RequestId(1), 40, None)
            .unwrap()
            .new_blocks,
        2
    );
    assert_eq!(s.load().output_blocks, 3);
    // An output block call counts on from there; tokens then continue past it.
    ledger.output_block(RequestId(1), None).unwrap();
    assert_eq!(s.load().output_blocks, 4);
    assert_eq!(
        ledger
            .tokens_generated(RequestId(1), 8, None)
            .unwrap()
            .new_blocks,
        0,
        "57 + 8 = 65 < 73"
    );
    assert_eq!(
        ledger
            .tokens_generated(RequestId(1), 8, None)
            .unwrap()
            .new_blocks,
        1
    );
    assert_eq!(
        ledger
            .tokens_generated(RequestId(1), 0, None)
            .unwrap()
            .new_blocks,
        0
    );
    assert_eq!(ledger.free(RequestId(1)).unwrap().output_blocks, 5);
    assert!(s.load().is_idle());
    assert_eq!(
        ledger.tokens_generated(RequestId(1), 1, None),
        Err(LoadError::UnknownRequest {
            request: RequestId(1)
        })
    );
}

#[test]
fn prompt_decay_off_decays_only_output_blocks() {
    let ledger = Ledger::with_prompt_decay(PromptDecay::Off);
    let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let a = blocks(&[1, 2, 3]);
    ledger
        .book(BookingSpec {
            expected_output_tokens: Some(10),
            ..spec(1, &s, 48, &a, Instant::now())
        })
        .unwrap();
    ledger.output_block(RequestId(1), None).unwrap();
    assert_eq!(s.load().prompt_decay, 0);
    assert!(s.load().output_decay > 0);
    ledger.free(RequestId(1)).unwrap();
    assert!(s.load().is_idle());
}

#[test]
fn the_timeline_reports_ttft_block_intervals_and_dispatch() {
    let ledger = Ledger::new();
    let s = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let k = blocks(&[1, 2]);
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    // 40 prompt tokens: the first output block opens at output token 9.
    ledger
        .book(BookingSpec {
            cached_tokens: 16,
            ..spec(1, &s, 40, &k, t0)
        })
        .unwrap();
    let step = ledger.output_block(RequestId(1), None).unwrap();
    assert_eq!((step.dispatch, step.elapsed), (DispatchState::NotYet, None));
    ledger.free(RequestId(1)).unwrap();

    ledger
        .book(BookingSpec {
            cached_tokens: 16,
            ..spec(2, &s, 40, &k, t0)
        })
        .unwrap();
    ledger.mark_dispatched(RequestId(2)).unwrap();
    let first = ledger.prefill_done(RequestId(2), Some(at(30))).unwrap();
    assert_eq!(first.elapsed, Some(Duration::from_millis(30)));
    assert_eq!(first.dispatch, DispatchState::Reached);
    let again = ledger.prefill_done(RequestId(2), Some(at(31))).unwrap();
    assert_eq!(again.elapsed, None, "TTFT once");
    let b1 = ledger.output_block(RequestId(2), Some(at(46))).unwrap();
    assert_eq!(
        (b1.elapsed, b1.tokens),
        (Some(Duration::from_millis(16)), 8)
    );
    let b2 = ledger.output_block(RequestId(2), Some(at(78))).unwrap();
    assert_eq!(
        (b2.elapsed, b2.tokens),
        (Some(Duration::from_millis(32)), 16)
    );
    let freed = ledger.free(RequestId(2)).unwrap();
    assert_eq!(
        (
            freed.prompt_tokens,
            freed.cached_tokens,
            freed.output_blocks,
            freed.dispatch
        ),
        (40, 16, 2, DispatchState::Reached)
    );
}

/// The booked-prefill floor follows every release down at once, and a refresh raises it
/// to the least booked prefill of the ranks it is given, never above any of them.
#[test]
fn the_prefill_floor_follows_releases_down_and_refreshes_up() {
    let ledger = Ledger::new();
    let now = Instant::now();
    let a = Arc::new(RankState::new(WorkerRank::new(1, 0)));
    let b = Arc::new(RankState::new(WorkerRank::new(2, 0)));
    let k = blocks(&[1, 2]);
    ledger.book(spec(1, &a, 300, &k, now)).unwrap();
    ledger.book(spec(2, &a, 200, &k, now)).unwrap();
    ledger.book(spec(3, &b, 700, &k, now)).unwrap();
    assert_eq!(ledger.prefill_floor(), 0, "nothing known before a refresh");
    let ranks = [&*a, &*b];
    ledger.refresh_prefill_floor(ranks);
    assert_eq!(ledger.prefill_floor(), 500);
    // Each way prefill is released lowers it to the rank's new count at once.
    ledger.prefill_done(RequestId(2), None).unwrap();
    assert_eq!(ledger.prefill_floor(), 300);
    ledger.tokens_generated(RequestId(3), 5, None).unwrap();
    assert_eq!(ledger.prefill_floor(), 0);
    ledger.refresh_prefill_floor(ranks);
    assert_eq!(ledger.prefill_floor(), 0, "rank b has nothing booked now");
    ledger.book(spec(4, &b, 100, &k, now)).unwrap();
    ledger.refresh_prefill_floor(ranks);
    assert_eq!(ledger.prefill_floor(), 100);
    ledger.free(RequestId(1)).unwrap();
    assert_eq!(ledger.prefill_floor(), 0);
    ledger.refresh_prefill_floor(ranks);
    assert_eq!(ledger.prefill_floor(), 0);
    ledger.lower_prefill_floor(7);
    assert_eq!(ledger.prefill_floor(), 0, "lowering never raises");
    ledger.refresh_prefill_floor([]);
    assert_eq!(ledger.prefill_floor(), 0, "no ranks: nothing known");
}
