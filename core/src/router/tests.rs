//! The router's internals that its public API cannot reach: the match read per rank, the
//! metrics' recording, the count of marked ranks. Behaviour tests are in `core/tests/router`.

use std::sync::atomic::Ordering;

use super::*;
use crate::event::{BlockHash, EventHeader, EventId, StorageTier, StoredBlock};
use crate::hash::{BlockHasher, LocalHash};
use crate::index::{IndexConfig, MatchOptions, RankDepths};
use crate::load::{DispatchState, RequestId, Step};
use crate::registry::RankEntry;
use crate::select::rank_depth;

const BS: u32 = 16;

fn router(config: RouterConfig) -> Router {
    Router::new(config, PrefixIndex::new(IndexConfig::default())).unwrap()
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + 1).collect()
}

/// Stores `locals` as one chain on `rank` (block names by position and tier).
fn store(r: &Router, rank: WorkerRank, tier: StorageTier, locals: &[LocalHash], id: u64) {
    let blocks: Vec<StoredBlock> = locals
        .iter()
        .enumerate()
        .map(|(i, h)| StoredBlock {
            block_hash: BlockHash(1000 * (tier as u64 + 1) + i as u64),
            local_hash: *h,
        })
        .collect();
    let header = EventHeader {
        source: rank,
        event_id: EventId(id),
        tier,
    };
    lock(&r.index).apply_stored(header, None, &blocks).unwrap();
}

/// An index id changes hands through a leave and a join, and no match credits one owner's
/// blocks to the other: whichever of the two fleets (before, after) reads whichever of the
/// two matches, and a rank that left takes nothing even from a match of its own blocks.
#[test]
fn a_reused_index_id_never_credits_one_owner_with_the_others_blocks() {
    let t = tokens(160);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    let r = router(RouterConfig::default());
    let mut before = RankDepths::default();
    let mut after = RankDepths::default();
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    store(
        &r,
        WorkerRank::new(1, 0),
        StorageTier::Device,
        &locals[..2],
        0,
    );
    let stale = r.fleet();
    let old = &stale.ranks[0];
    r.reader
        .find_depths_into(&locals, MatchOptions::default(), &mut before);
    assert_eq!(rank_depth(old, &before).map(|(_, d)| d.blocks), Some(2));
    r.leave_worker(WorkerId(1)).unwrap();
    r.join_worker(WorkerConfig::simple(0, 1000, BS)).unwrap();
    store(
        &r,
        WorkerRank::new(0, 0),
        StorageTier::Device,
        &locals[..9],
        0,
    );
    let fresh = r.fleet();
    let new = &fresh.ranks[0];
    assert_eq!(
        (old.rank, new.rank),
        (WorkerRank::new(1, 0), WorkerRank::new(0, 0))
    );
    let id = |r: &RankEntry| r.state.index_key().map(|k| k.id);
    assert_eq!(id(old), id(new), "the id was reused");
    r.reader
        .find_depths_into(&locals, MatchOptions::default(), &mut after);
    assert_eq!(rank_depth(new, &after).map(|(_, d)| d.blocks), Some(9));
    assert_eq!(rank_depth(new, &before), None, "the leaver's blocks");
    assert_eq!(rank_depth(old, &after), None, "the newcomer's blocks");
    assert_eq!(rank_depth(old, &before), None, "it left");
}

/// The overhead histograms once clamped every value to their initial 1..2 ns range
/// (`saturating_record` never resizes): a 3 µs select step read back as 2 ns.
#[test]
fn timing_histograms_keep_microseconds() {
    let mut t = Timings::new();
    t.record(1_500, 2_000, 3_000);
    t.record(900_000, 1, 7);
    assert_eq!(
        t.hash.value_at_quantile(0.0),
        t.hash.lowest_equivalent(1_500)
    );
    assert_eq!(t.matching.value_at_quantile(0.0), 1);
    assert_eq!(
        t.select.value_at_quantile(1.0),
        t.select.highest_equivalent(3_000)
    );
    assert!(t.hash.max() >= 899_000, "{}", t.hash.max());
}

#[test]
fn itl_is_microseconds_per_token() {
    let r = router(RouterConfig {
        metrics: Metrics::On,
        ..RouterConfig::default()
    });
    let step = Step {
        rank: WorkerRank::new(1, 0),
        dispatch: DispatchState::Reached,
        elapsed: Some(std::time::Duration::from_micros(1_600)),
        tokens: 16,
        decayed_at: 0,
    };
    r.record_step(RequestId(1), &step, |m| &mut m.itl_us, step.tokens);
    let not_dispatched = Step {
        dispatch: DispatchState::NotYet,
        ..step
    };
    r.record_step(RequestId(1), &not_dispatched, |m| &mut m.itl_us, 16);
    let m = r.request_metrics().unwrap();
    assert_eq!((m.itl_us.len(), m.itl_us.max()), (1, 100));
}

#[test]
fn merged_metrics_keep_every_shards_samples() {
    let mut a = RequestMetrics::new();
    let mut b = RequestMetrics::new();
    record(&mut a.ttft_us, 5);
    record(&mut b.ttft_us, 5_000_000);
    a.merge(&b);
    assert_eq!(a.ttft_us.len(), 2);
    assert!(a.ttft_us.max() >= 4_990_000);
    let q = Quantiles::of(&a.ttft_us);
    assert_eq!((q.count, q.p50), (2, 5));
    assert_eq!(Quantiles::of(&RequestMetrics::new().itl_us).count, 0);
}

/// The count of marked ranks, which lets selection skip reading marks, stays exact across
/// repeated marks and a marked worker leaving.
#[test]
fn marked_rank_count_follows_marks_and_leaves() {
    let r = router(RouterConfig::default());
    for w in 1..=3 {
        r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
    }
    r.join_worker(WorkerConfig {
        dp_size: 4,
        ..WorkerConfig::simple(7, 1000, BS)
    })
    .unwrap();
    r.set_health(WorkerId(7), Health::Wedged).unwrap();
    r.set_health(WorkerId(7), Health::Unreachable).unwrap();
    r.set_health(WorkerId(1), Health::Unreachable).unwrap();
    assert_eq!(r.marked_ranks.load(Ordering::Relaxed), 5);
    r.leave_worker(WorkerId(7)).unwrap();
    assert_eq!(r.marked_ranks.load(Ordering::Relaxed), 1);
    r.set_health(WorkerId(1), Health::Healthy).unwrap();
    assert_eq!(r.marked_ranks.load(Ordering::Relaxed), 0);
}

/// Each role's running context total equals the sum of its ranks' contexts after every
/// booking, generated token, free and leave, so the hot-load term's mean needs no scan.
mod role_context {
    use proptest::prelude::*;

    use super::*;
    use crate::registry::WorkerRole;

    #[derive(Clone, Debug)]
    enum Op {
        Join(u8),
        Route(u8, usize),
        Tokens(usize, u64),
        Free(usize),
        Leave(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..3).prop_map(Op::Join),
            (0u8..3, 1usize..300).prop_map(|(p, n)| Op::Route(p, n)),
            (0usize..64, 1u64..80).prop_map(|(i, t)| Op::Tokens(i, t)),
            (0usize..64).prop_map(Op::Free),
            (0usize..8).prop_map(Op::Leave),
        ]
    }

    const ROLES: [WorkerRole; 3] = [
        WorkerRole::Prefill,
        WorkerRole::Decode,
        WorkerRole::Aggregated,
    ];
    const PHASES: [Phase; 3] = [Phase::Prefill, Phase::Decode, Phase::Aggregated];

    proptest! {
        #[test]
        fn each_roles_total_is_the_sum_of_its_ranks_contexts(ops in prop::collection::vec(op(), 1..80)) {
            let r = router(RouterConfig::default());
            let (mut next_worker, mut next_request) = (1u64, 1u64);
            let mut booked: Vec<RequestId> = Vec::new();
            for op in ops {
                match op {
                    Op::Join(role) => {
                        let mut c = WorkerConfig::simple(next_worker, 100_000, BS);
                        c.role = ROLES[role as usize];
                        c.dp_size = 1 + (next_worker % 2) as u32;
                        r.join_worker(c).unwrap();
                        next_worker += 1;
                    }
                    Op::Route(phase, n) => {
                        let id = RequestId(next_request);
                        next_request += 1;
                        let t = tokens(n);
                        let mut req = RouteRequest {
                            id,
                            tokens: &t,
                            hints: RouteHints::default(),
                        };
                        req.hints.phase = PHASES[phase as usize];
                        if r.route(&req).is_ok() {
                            booked.push(id);
                        }
                    }
                    Op::Tokens(i, t) => {
                        if let Some(&id) = booked.get(i) {
                            let _ = r.tokens_generated(id, t);
                        }
                    }
                    Op::Free(i) => {
                        if i < booked.len() {
                            let _ = r.free(booked.swap_remove(i));
                        }
                    }
                    Op::Leave(i) => {
                        let fleet = r.fleet();
                        if let Some(w) = fleet.workers.get(i) {
                            r.leave_worker(w.config.id).unwrap();
                        }
                    }
                }
                let fleet = r.fleet();
                for role in ROLES {
                    let sum: u64 = fleet
                        .ranks
                        .iter()
                        .filter(|e| e.role == role)
                        .map(|e| e.state.context_load())
                        .sum();
                    prop_assert_eq!(r.registry.role_context(role), sum, "{:?}", role);
                    let n = fleet.ranks.iter().filter(|e| e.role == role).count();
                    prop_assert_eq!(fleet.ranks_of(role), n);
                }
            }
        }
    }
}
