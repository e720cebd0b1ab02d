//! The router's lifecycle against a naive model: random interleavings of route (with and
//! without an expected output length), dispatch, prefill done, output block, tokens
//! generated, free, guard drop,
//! worker leave and expiry keep the load counters (output and unshared-prompt decay included) equal to what the
//! active requests hold, return them to exactly zero, never free anything twice, and record
//! request metrics for exactly the dispatched requests that end by a free. Plus routes from
//! several threads at once, with a worker leaving and rejoining underneath.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::testing::{decayed, generated_at_block, output_decay, remaining_fraction};
use kvroute_core::{
    IndexConfig, LoadError, LoadView, Metrics, PrefixIndex, RequestGuard, RequestId, RouteError,
    RouteHints, RouteRequest, Router, RouterConfig, WorkerConfig, WorkerId, WorkerRank,
};
use proptest::prelude::*;

use crate::common::{on_manual_clock, At};

const BS: usize = 16;
const WORKERS: u64 = 3;

fn router() -> Router {
    let config = RouterConfig {
        metrics: Metrics::On,
        ..RouterConfig::default()
    };
    let r = on_manual_clock(config, PrefixIndex::new(IndexConfig::default()));
    for w in 0..WORKERS {
        r.join_worker(WorkerConfig::simple(w, 10_000, BS as u32))
            .unwrap();
    }
    r
}

/// A prompt: `shared` tokens of system prompt `sys`, then `own` tokens of its own.
fn prompt(sys: u32, shared: usize, own: usize, seed: u32) -> Vec<u32> {
    (0..shared)
        .map(|i| sys * 7919 + i as u32)
        .chain((0..own).map(|i| 1_000_000 + seed * 131 + i as u32))
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    Route {
        id: u64,
        sys: u32,
        shared: usize,
        own: usize,
        expected: Option<u32>,
    },
    Dispatch(u64),
    PrefillDone(u64),
    OutputBlock(u64),
    Tokens(u64, u64),
    Free(u64),
    GuardDrop(u64),
    Leave(u64),
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..12u64, 0..2u32, 0..80usize, 0..60usize, proptest::option::of(0..100u32))
            .prop_map(|(id, sys, shared, own, expected)| Op::Route { id, sys, shared, own, expected }),
        2 => (0..12u64).prop_map(Op::Dispatch),
        2 => (0..12u64).prop_map(Op::PrefillDone),
        2 => (0..12u64).prop_map(Op::OutputBlock),
        2 => (0..12u64, 0..40u64).prop_map(|(id, n)| Op::Tokens(id, n)),
        2 => (0..12u64).prop_map(Op::Free),
        2 => (0..12u64).prop_map(Op::GuardDrop),
        1 => (0..WORKERS).prop_map(Op::Leave),
        1 => Just(Op::Expire),
    ]
}

#[derive(Debug, Default)]
struct Active {
    rank: WorkerRank,
    tokens: Vec<u32>,
    prefill: u64,
    output: u64,
    expected: Option<u32>,
    dispatched: bool,
    /// Output tokens counted (at least the one opening the latest output block).
    generated: u64,
    /// Output decay as of its latest output block.
    output_decay: u64,
    /// Prompt decay as of its last output block: its prompt blocks no other request on the
    /// rank held then (and its tail), weighted by what was left of its expected output.
    prompt_decay: u64,
}

/// The decay of request `id`'s unshared prompt blocks after its latest output block.
fn prompt_decay(model: &HashMap<u64, Active>, id: u64) -> u64 {
    let a = &model[&id];
    let Some(e) = a.expected else { return 0 };
    let full = a.tokens.len() / BS;
    let shared = (1..=full)
        .filter(|&j| {
            let p = &a.tokens[..j * BS];
            model
                .iter()
                .any(|(o, b)| *o != id && b.rank == a.rank && b.tokens.starts_with(p))
        })
        .count();
    let unshared = (full - shared) as u64 + u64::from(a.tokens.len() % BS != 0);
    decayed(unshared, remaining_fraction(a.generated, e))
}

/// What every rank should show: summed from the active requests, prompt blocks deduplicated
/// by their whole token prefix.
fn expected(model: &HashMap<u64, Active>, rank: WorkerRank) -> LoadView {
    let mut prefixes: HashSet<&[u32]> = HashSet::new();
    let mut v = LoadView::default();
    for a in model.values().filter(|a| a.rank == rank) {
        let full = a.tokens.len() / BS;
        for j in 0..full {
            prefixes.insert(&a.tokens[..(j + 1) * BS]);
        }
        v.prompt_blocks += u64::from(a.tokens.len() % BS != 0);
        v.context_blocks += a.tokens.len().div_ceil(BS) as u64;
        v.prefill_tokens += a.prefill;
        v.output_blocks += a.output;
        v.output_decay += a.output_decay;
        v.prompt_decay += a.prompt_decay;
        v.requests += 1;
    }
    v.prompt_blocks += prefixes.len() as u64;
    v
}

fn check(r: &Router, model: &HashMap<u64, Active>) {
    assert_eq!(r.active_requests(), model.len());
    for w in 0..WORKERS {
        let rank = WorkerRank::new(w, 0);
        assert_eq!(r.load(rank).unwrap(), expected(model, rank), "rank {rank}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn load_matches_the_model_and_returns_to_zero(ops in proptest::collection::vec(op(), 1..80)) {
        let r = router();
        let mut model: HashMap<u64, Active> = HashMap::new();
        // Dispatched requests ended by a free: the only ones whose end is recorded.
        let mut completed = 0u64;
        for op in ops {
            match op {
                Op::Route { id, sys, shared, own, expected } => {
                    let tokens = prompt(sys, shared, own, id as u32);
                    let mut q = RouteRequest { id: RequestId(id), tokens: &tokens, hints: RouteHints::default() };
                    q.hints.expected_output_tokens = expected;
                    match r.route(&q) {
                        Ok(d) => {
                            prop_assert!(!model.contains_key(&id));
                            let prefill = tokens.len() as u64 - d.overlap.cached_tokens;
                            let a = Active { rank: d.worker, tokens, prefill, output: 0, expected, dispatched: false, generated: 0, output_decay: 0, prompt_decay: 0 };
                            model.insert(id, a);
                        }
                        Err(RouteError::NoTokens { .. }) => prop_assert!(tokens.is_empty()),
                        Err(RouteError::Load(LoadError::DuplicateRequest { .. })) => {
                            prop_assert!(model.contains_key(&id))
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Dispatch(id) => {
                    prop_assert_eq!(r.mark_dispatched(RequestId(id)).is_ok(), model.contains_key(&id));
                    if let Some(a) = model.get_mut(&id) { a.dispatched = true; }
                }
                Op::PrefillDone(id) => {
                    prop_assert_eq!(r.prefill_done(RequestId(id)).is_ok(), model.contains_key(&id));
                    if let Some(a) = model.get_mut(&id) { a.prefill = 0; }
                }
                Op::OutputBlock(id) => {
                    prop_assert_eq!(r.output_block(RequestId(id)).is_ok(), model.contains_key(&id));
                    if let Some(a) = model.get_mut(&id) {
                        a.output += 1;
                        let g_k = generated_at_block(a.tokens.len() as u64, BS as u32, a.output);
                        a.generated = a.generated.max(g_k);
                        if let Some(e) = a.expected {
                            a.output_decay = a.output_decay.max(output_decay(a.tokens.len() as u64, BS as u32, e, a.output));
                        }
                        // The ledger weighs the prompt at the block's opening token.
                        let g = a.generated;
                        a.generated = g_k;
                        let d = prompt_decay(&model, id);
                        let a = model.get_mut(&id).unwrap();
                        a.generated = g;
                        a.prompt_decay = d;
                    }
                }
                Op::Tokens(id, n) => {
                    prop_assert_eq!(r.tokens_generated(RequestId(id), n).is_ok(), model.contains_key(&id));
                    if let Some(a) = model.get_mut(&id) {
                        if n > 0 {
                            a.prefill = 0;
                            a.generated += n;
                            let len = a.tokens.len() as u64;
                            let held = (len + a.generated).div_ceil(BS as u64) - len.div_ceil(BS as u64);
                            if held > a.output {
                                a.output = held;
                                if let Some(e) = a.expected {
                                    a.output_decay = a.output_decay.max(decayed(held, remaining_fraction(a.generated, e)));
                                }
                                let d = prompt_decay(&model, id);
                                model.get_mut(&id).unwrap().prompt_decay = d;
                            }
                        }
                    }
                }
                Op::Free(id) => {
                    let a = model.remove(&id);
                    completed += u64::from(a.as_ref().is_some_and(|a| a.dispatched));
                    prop_assert_eq!(r.free(RequestId(id)).is_ok(), a.is_some());
                }
                Op::GuardDrop(id) => {
                    drop(RequestGuard::new(&r, RequestId(id)));
                    let a = model.remove(&id);
                    completed += u64::from(a.is_some_and(|a| a.dispatched));
                }
                Op::Leave(w) => {
                    let before = model.len();
                    model.retain(|_, a| a.rank.worker != WorkerId(w));
                    prop_assert_eq!(r.leave_worker(WorkerId(w)).unwrap(), before - model.len());
                    r.join_worker(WorkerConfig::simple(w, 10_000, BS as u32)).unwrap();
                }
                Op::Expire => {
                    let n = r.after(r.config().request_expiry + Duration::from_secs(1))
                        .expire();
                    prop_assert_eq!(n, model.len());
                    model.clear();
                }
            }
            check(&r, &model);
            prop_assert_eq!(r.counts().completed, completed);
            prop_assert_eq!(r.request_metrics().unwrap().isl_tokens.len(), completed);
        }
        for (id, a) in &model {
            r.free(RequestId(*id)).unwrap();
            completed += u64::from(a.dispatched);
        }
        prop_assert_eq!(r.counts().completed, completed);
        let m = r.request_metrics().unwrap();
        prop_assert_eq!((m.isl_tokens.len(), m.osl_blocks.len(), m.kv_hit_bp.len()), (completed, completed, completed));
        prop_assert!(r.total_load().is_idle());
        prop_assert_eq!(r.active_requests(), 0);
        let c = r.counts().ledger;
        prop_assert_eq!(c.booked, c.freed + c.expired + c.purged);
    }
}

#[test]
fn routes_from_several_threads_keep_load_exact() {
    let r = Arc::new(router());
    const THREADS: u64 = 4;
    const PER: u64 = 400;
    let churn = {
        let r = Arc::clone(&r);
        std::thread::spawn(move || {
            for _ in 0..20 {
                r.leave_worker(WorkerId(2)).unwrap();
                r.join_worker(WorkerConfig::simple(2, 10_000, BS as u32))
                    .unwrap();
                std::thread::yield_now();
            }
        })
    };
    // The booked-prefill floor refreshed all along, racing every release.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let refresher = {
        let (r, done) = (Arc::clone(&r), Arc::clone(&done));
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                r.refresh_prefill_floor();
                std::thread::yield_now();
            }
        })
    };
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let r = Arc::clone(&r);
            std::thread::spawn(move || {
                let mut kept = Vec::new();
                for i in 0..PER {
                    let id = t * 1_000_000 + i;
                    let tokens = prompt((i % 3) as u32, 64, (i % 50) as usize, id as u32);
                    let mut q = RouteRequest {
                        id: RequestId(id),
                        tokens: &tokens,
                        hints: RouteHints::default(),
                    };
                    q.hints.expected_output_tokens = (i % 3 == 0).then_some(40);
                    match r.route(&q) {
                        Ok(_) => {}
                        // The churned worker left while this request was booked on it.
                        Err(RouteError::Load(LoadError::RankRetired { .. })) => continue,
                        Err(e) => panic!("unexpected {e}"),
                    }
                    let mut g = RequestGuard::new(&*r, RequestId(id));
                    let _ = g.mark_dispatched();
                    // Some kept requests keep their prefill booked.
                    if i % 4 != 1 {
                        let _ = g.prefill_done();
                    }
                    let _ = g.output_block();
                    if i % 2 == 0 {
                        drop(g);
                    } else {
                        std::mem::forget(g);
                        kept.push(id);
                    }
                }
                kept
            })
        })
        .collect();
    let kept: Vec<u64> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    churn.join().unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    refresher.join().unwrap();
    // Quiet now: the floor is under every rank's booked prefill, and a refresh lifts it to
    // the least of them.
    let least = (0..WORKERS)
        .map(|w| r.load(WorkerRank::new(w, 0)).unwrap().prefill_tokens)
        .min()
        .unwrap();
    assert!(
        r.prefill_floor() <= least,
        "{} > {least}",
        r.prefill_floor()
    );
    r.refresh_prefill_floor();
    assert_eq!(r.prefill_floor(), least);
    for id in kept {
        // Requests on the churned worker were purged when it left: freeing them is an error,
        // and frees nothing.
        let _ = r.free(RequestId(id));
    }
    assert!(r.total_load().is_idle(), "{:?}", r.total_load());
    assert_eq!(r.prefill_floor(), 0, "every release lowered it");
    assert_eq!(r.active_requests(), 0);
    let c = r.counts().ledger;
    assert_eq!(c.booked, c.freed + c.expired + c.purged + c.retired_races);
}

#[test]
fn a_worker_whose_ranks_do_not_all_fit_leaves_the_router_as_it_was() {
    let r = on_manual_clock(
        RouterConfig::default(),
        PrefixIndex::new(IndexConfig {
            max_ranks: 4,
            ..IndexConfig::default()
        }),
    );
    r.join_worker(WorkerConfig {
        dp_size: 2,
        ..WorkerConfig::simple(0, 64, 16)
    })
    .unwrap();
    let before = r.fleet().ranks.len();
    // Three more ranks do not fit in four: refused, and nothing of it stays.
    let refused = r.join_worker(WorkerConfig {
        dp_size: 3,
        ..WorkerConfig::simple(1, 64, 16)
    });
    assert!(refused.is_err());
    assert_eq!(r.fleet().ranks.len(), before);
    assert!(r.fleet().worker(WorkerId(1)).is_none());
    // The same id with ranks that fit joins afterwards, and so does a later worker.
    r.join_worker(WorkerConfig {
        dp_size: 2,
        ..WorkerConfig::simple(1, 64, 16)
    })
    .unwrap();
    assert_eq!(r.fleet().ranks.len(), 4);
    assert!(r.join_worker(WorkerConfig::simple(2, 64, 16)).is_err());
    r.leave_worker(WorkerId(0)).unwrap();
    r.join_worker(WorkerConfig::simple(2, 64, 16)).unwrap();
}

#[test]
fn a_rank_never_holds_more_blocks_than_its_worker_declared() {
    use kvroute_core::{
        BlockHash, EventHeader, EventId, IndexError, KvEvent, KvEventData, LocalHash, StorageTier,
        StoredBlock,
    };
    let r = on_manual_clock(
        RouterConfig::default(),
        PrefixIndex::new(IndexConfig::default()),
    );
    r.join_worker(WorkerConfig::simple(0, 8, 16)).unwrap();
    let rank = WorkerRank::new(0, 0);
    let stored = |id: u64, first: u64, n: u64| {
        r.apply_event(&KvEvent {
            header: EventHeader {
                source: rank,
                event_id: EventId(id),
                tier: StorageTier::Device,
            },
            data: KvEventData::Stored {
                parent: None,
                blocks: (first..first + n)
                    .map(|i| StoredBlock {
                        block_hash: BlockHash(i),
                        local_hash: LocalHash(i * 7 + 1),
                    })
                    .collect(),
            },
        })
    };
    stored(1, 100, 6).unwrap();
    stored(2, 200, 2).unwrap();
    assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 8);
    // A ninth block is refused whole (the stream lost a removal, or the size is wrong).
    let refused = stored(3, 300, 2);
    assert!(
        matches!(refused, Err(IndexError::OverCapacity { capacity: 8, .. })),
        "{refused:?}"
    );
    assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 8);
    // Blocks removed make room again.
    r.apply_event(&KvEvent {
        header: EventHeader {
            source: rank,
            event_id: EventId(4),
            tier: StorageTier::Device,
        },
        data: KvEventData::Removed {
            blocks: vec![BlockHash(200), BlockHash(201)],
        },
    })
    .unwrap();
    stored(5, 300, 2).unwrap();
    assert_eq!(r.fleet().ranks[0].state.reported_blocks(), 8);
}
