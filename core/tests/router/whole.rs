//! Conditional disaggregation's rule ([`Router::whole_on_decode`]): a decode worker serves a
//! request whole when its cache leaves little to compute, or when every prefill worker is
//! saturated; never when the decode worker is busy with prefills itself.

use crate::common::*;

const BS: u32 = 16;

/// Prefill workers 1 and 2, decode workers 3 and 4.
fn router() -> Router {
    let r = Router::new(
        RouterConfig::default(),
        PrefixIndex::new(IndexConfig::default()),
    )
    .unwrap();
    for (id, role) in [
        (1, WorkerRole::Prefill),
        (2, WorkerRole::Prefill),
        (3, WorkerRole::Decode),
        (4, WorkerRole::Decode),
    ] {
        r.join_worker(WorkerConfig {
            role,
            ..WorkerConfig::simple(id, 10_000, BS)
        })
        .unwrap();
    }
    r
}

fn req(id: u64, tokens: &[u32]) -> RouteRequest<'_> {
    RouteRequest {
        id: RequestId(id),
        tokens,
        hints: RouteHints::default(),
    }
}

/// Books a prefill of `n` fresh tokens on prefill worker `worker`.
fn prefill_on(r: &Router, id: u64, worker: u64, n: usize) {
    let t: Vec<u32> = (0..n as u32).map(|i| i + 1_000_000 * id as u32).collect();
    let mut q = req(id, &t);
    q.hints.phase = Phase::Prefill;
    q.hints.pinned.backend_instance = Some(WorkerId(worker));
    assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(worker, 0));
}

#[test]
fn a_decode_worker_holding_most_of_the_prompt_serves_it_whole() {
    let r = router();
    let t: Vec<u32> = (0..640).collect();
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    // Worker 4 holds all but the last 64 tokens. The decode choice goes by load alone (no
    // credit for the cache), so the request allows worker 4 only.
    store(
        &r,
        WorkerRank::new(4, 0),
        StorageTier::Device,
        &locals[..36],
        0,
    );
    let only_4 = [WorkerId(4)];
    let mut q = req(1, &t);
    q.hints.allowed = Some(&only_4);
    let c = Conditional::new_tokens_at_most(64);
    assert_eq!(
        r.whole_on_decode(&q, &c),
        Some((WorkerRank::new(4, 0), Whole::Cached))
    );
    // Asked, not booked.
    assert_eq!(r.active_requests(), 0);
    // 64 tokens to compute is over a cap of 63, and over a share of 5% of 640.
    assert_eq!(
        r.whole_on_decode(&q, &Conditional::new_tokens_at_most(63)),
        None
    );
    let share = Conditional {
        max_new_share: 0.05,
        ..c
    };
    assert_eq!(r.whole_on_decode(&q, &share), None);
    // A decode worker already computing 480 fresh tokens serves nothing whole.
    let fresh: Vec<u32> = (0..480).map(|i| i + 5_000_000).collect();
    let mut busy = req(2, &fresh);
    busy.hints.pinned.backend_instance = Some(WorkerId(4));
    r.route(&busy).unwrap();
    assert_eq!(r.load(WorkerRank::new(4, 0)).unwrap().prefill_tokens, 480);
    let gated = Conditional {
        decode_busy_tokens: Some(479),
        ..c
    };
    assert_eq!(r.whole_on_decode(&q, &gated), None);
    let roomy = Conditional {
        decode_busy_tokens: Some(480),
        ..c
    };
    assert_eq!(
        r.whole_on_decode(&q, &roomy),
        Some((WorkerRank::new(4, 0), Whole::Cached))
    );
}

#[test]
fn saturated_prefill_workers_have_the_decode_worker_serve_whole() {
    let r = router();
    let t: Vec<u32> = (0..640).collect();
    let c = Conditional {
        prefill_busy_tokens: Some(1_000),
        ..Conditional::new_tokens_at_most(64)
    };
    // Nothing cached, prefill workers idle: split.
    assert_eq!(r.whole_on_decode(&req(1, &t), &c), None);
    // One prefill worker saturated, the other not: split (there is room).
    prefill_on(&r, 10, 1, 1_200);
    assert_eq!(r.whole_on_decode(&req(1, &t), &c), None);
    // Both saturated: whole on the decode worker the cost picks.
    prefill_on(&r, 11, 2, 1_000);
    let (rank, why) = r.whole_on_decode(&req(1, &t), &c).unwrap();
    assert_eq!(why, Whole::PrefillBusy);
    assert!(rank.worker == WorkerId(3) || rank.worker == WorkerId(4));
    // Without the gate, the same fleet splits.
    assert_eq!(
        r.whole_on_decode(&req(1, &t), &Conditional::new_tokens_at_most(64)),
        None
    );
    // A prefill worker marked unreachable is not counted: the other one's room is not there.
    r.free(RequestId(11)).unwrap();
    assert_eq!(r.whole_on_decode(&req(1, &t), &c), None);
    r.set_health(WorkerId(2), Health::Unreachable).unwrap();
    assert_eq!(
        r.whole_on_decode(&req(1, &t), &c).map(|(_, why)| why),
        Some(Whole::PrefillBusy)
    );
    // With every prefill worker gone, none is saturated: the fleet's fallbacks apply.
    r.leave_worker(WorkerId(1)).unwrap();
    r.leave_worker(WorkerId(2)).unwrap();
    assert_eq!(r.whole_on_decode(&req(1, &t), &c), None);
}
