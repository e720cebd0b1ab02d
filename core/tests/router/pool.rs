// Pool answers are lists of ranges; a one-range list is the common case.
#![allow(clippy::single_range_in_vec_init)]

use crate::common::*;

const BS: u32 = 16;

fn setup() -> (Router, Vec<u32>) {
    let r = Router::new(
        reference_weights(),
        PrefixIndex::new(IndexConfig::default()),
    )
    .unwrap();
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
    let t: Vec<u32> = (0..160).map(|i| i * 3 + 1).collect(); // 10 blocks
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    let first = WorkerRank::new(1, 0);
    store(&r, first, StorageTier::Device, &locals[..4], 0);
    (r, t)
}

fn evidence<'a>(r: &Router, t: &'a [u32], pool: PoolHits<'a>) -> (Decision, Vec<Candidate>) {
    let mut q = RouteRequest {
        id: RequestId(1),
        tokens: t,
        hints: RouteHints::default(),
    };
    q.hints.mode = Mode::QueryOnly;
    q.hints.evidence = EvidenceLevel::Full;
    q.hints.pool = pool;
    let mut d = r.route(&q).unwrap();
    let mut ev = d.evidence.take().unwrap();
    ev.sort_by_key(|c| c.rank);
    (d, ev)
}

/// Worker 1 holds blocks 0-3, worker 2 nothing; the pool holds 0-9. Each is credited the
/// pool's blocks beyond its own overlap, at 0.25.
#[test]
fn pool_hits_beyond_the_own_overlap_are_credited_at_the_multiplier() {
    let (r, t) = setup();
    let hits = [0..10];
    let (d, ev) = evidence(&r, &t, PoolHits::Hits(&hits));
    assert_eq!(
        (ev[0].cost.pool_blocks, ev[0].cost.credit_blocks),
        (6, 4.0 + 1.5)
    );
    assert_eq!(
        (ev[1].cost.pool_blocks, ev[1].cost.credit_blocks),
        (10, 2.5)
    );
    assert_eq!(ev[0].cost.total, (10.0 - 5.5) + 10.0);
    assert_eq!(d.worker, WorkerRank::new(1, 0));
    assert_eq!(
        d.cost, ev[0].cost,
        "the decision's terms are the evidence's"
    );
    // A pool run that does not continue the worker's own prefix earns nothing.
    let gap = [6..10];
    let (_, ev) = evidence(&r, &t, PoolHits::Hits(&gap));
    assert_eq!((ev[0].cost.pool_blocks, ev[1].cost.pool_blocks), (0, 0));
    // Credit enough to change the choice: at 1.0, worker 2 ties worker 1 on credit and
    // the tie is broken at random; both are chosen over many draws.
    let r2 = Router::new(
        RouterConfig {
            pool_credit: 1.0,
            ..RouterConfig::default()
        },
        PrefixIndex::new(IndexConfig::default()),
    )
    .unwrap();
    r2.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r2.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..50 {
        seen.insert(evidence(&r2, &t, PoolHits::Hits(&hits)).0.worker);
    }
    assert_eq!(seen.len(), 2);
}

#[test]
fn a_failed_or_malformed_pool_answer_is_counted_and_ignored() {
    let (r, t) = setup();
    let (plain, _) = evidence(&r, &t, PoolHits::None);
    let (failed, _) = evidence(&r, &t, PoolHits::Failed);
    #[allow(clippy::reversed_empty_ranges)]
    let bad = [3..1];
    let (malformed, _) = evidence(&r, &t, PoolHits::Hits(&bad));
    assert_eq!(plain.cost, failed.cost);
    assert_eq!(plain.cost, malformed.cost);
    assert_eq!(r.counts().pool_failed, 2);
}
