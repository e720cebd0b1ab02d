use crate::common::*;

const BS: u32 = 16;

fn router(config: RouterConfig) -> Router {
    on_manual_clock(config, PrefixIndex::new(IndexConfig::default()))
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + 1).collect()
}

fn req(id: u64, tokens: &[u32]) -> RouteRequest<'_> {
    RouteRequest {
        id: RequestId(id),
        tokens,
        hints: RouteHints::default(),
    }
}

/// The booked-prefill floor that joins left at 0 rises by routing alone, within four
/// routes per rank, though no load is read in vain.
#[test]
fn routing_raises_a_floor_left_low() {
    let r = router(RouterConfig::default());
    for w in 1..=4 {
        r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
    }
    let own: Vec<u32> = (0..320u32).map(|i| i * 13 + 5).collect();
    for w in 1..=4u64 {
        let mut q = req(100 + w, &own);
        q.hints.pinned.backend_instance = Some(WorkerId(w));
        r.route(&q).unwrap();
    }
    assert_eq!(r.prefill_floor(), 0, "bookings do not raise the floor");
    // On a thread of its own: the count that triggers a refresh is the thread's.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let t = tokens(160);
            let mut q = req(1, &t);
            q.hints.mode = Mode::QueryOnly;
            for _ in 0..4 * 4 {
                r.route(&q).unwrap();
            }
            assert_eq!(r.prefill_floor(), 0);
            r.route(&q).unwrap();
            assert_eq!(r.prefill_floor(), 320);
        });
    });
}

/// A pinned or session-bound route walks the index for its rank alone: the rank's
/// overlap, tiers, load and cost are what an unpinned route's full evidence gives it,
/// whatever the other ranks hold.
#[test]
fn a_pinned_route_scores_its_rank_as_the_full_match_does() {
    let r = router(RouterConfig::default());
    for w in 1..=5 {
        r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
    }
    let mut two = WorkerConfig::simple(6, 1000, BS);
    two.dp_size = 2;
    r.join_worker(two).unwrap();
    // 100 blocks: more than one run of the index.
    let t = tokens(1600);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    let rank = |w: u64, dp: u32| WorkerRank::new(w, dp);
    let (device, host) = (StorageTier::Device, StorageTier::HostPinned);
    store(&r, rank(1, 0), device, &locals, 1);
    store(&r, rank(2, 0), device, &locals[..30], 2);
    store(&r, rank(2, 0), host, &locals[..70], 3);
    store(&r, rank(3, 0), host, &locals[..5], 4);
    store(&r, rank(4, 0), device, &locals[..66], 5);
    store(&r, rank(6, 0), device, &locals[..80], 6);
    store(&r, rank(6, 1), device, &locals[..64], 7);
    // Load on some ranks (of a prompt sharing no block with `t`), so that costs differ
    // by more than the overlap.
    let other: Vec<u32> = (0..96u32).map(|i| i * 13 + 5).collect();
    for (id, w) in [(100u64, 1u64), (101, 2), (102, 6)] {
        let mut q = req(id, &other);
        q.hints.pinned.backend_instance = Some(WorkerId(w));
        q.hints.pinned.dp_rank = Some(DpRank(0));
        r.route(&q).unwrap();
    }
    let mut q = req(1, &t);
    q.hints.mode = Mode::QueryOnly;
    q.hints.evidence = EvidenceLevel::Full;
    let full = r.route(&q).unwrap().evidence.unwrap();
    assert_eq!(full.len(), 7);
    let of = |rank: WorkerRank| *full.iter().find(|c| c.rank == rank).unwrap();
    for (w, dp) in [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (6, 1)] {
        let mut p = q;
        p.hints.pinned.backend_instance = Some(WorkerId(w));
        p.hints.pinned.dp_rank = Some(DpRank(dp));
        let ev = r.route(&p).unwrap().evidence.unwrap();
        assert_eq!(ev, vec![of(rank(w, dp))], "worker {w}, dp rank {dp}");
    }
    // A worker of two dp ranks pinned without one: its first rank's.
    let mut p = q;
    p.hints.pinned.backend_instance = Some(WorkerId(6));
    assert_eq!(r.route(&p).unwrap().evidence.unwrap(), vec![of(rank(6, 0))]);
    // Bound to a session: its rank's, as pinned.
    let mut first = req(2, &t);
    first.hints.session = Some(SessionId(9));
    first.hints.pinned.backend_instance = Some(WorkerId(2));
    first.hints.pinned.dp_rank = Some(DpRank(0));
    r.route(&first).unwrap();
    let mut again = q;
    again.hints.session = Some(SessionId(9));
    let d = r.route(&again).unwrap();
    assert_eq!(d.session, Some(SessionRouting::Sticky));
    assert_eq!(d.worker, rank(2, 0));
    assert_eq!(d.overlap, of(rank(2, 0)).overlap);
}

/// The reference's tier-weighted estimate, through the index and the router.
#[test]
fn tier_weighted_overlap_through_the_router() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
    let t = tokens(160);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    let w1 = WorkerRank::new(1, 0);
    let w2 = WorkerRank::new(2, 0);
    // Worker 1: blocks 0-1 on device, 0-2 in host memory, 0-4 on disk; worker 2: block 0
    // in host memory. Fastest tier per block: w1 = 2 device, 1 host, 2 disk; w2 = 1 host.
    store(&r, w1, StorageTier::Device, &locals[..2], 0);
    store(&r, w1, StorageTier::HostPinned, &locals[..3], 1);
    store(&r, w1, StorageTier::Disk, &locals[..5], 2);
    store(&r, w2, StorageTier::HostPinned, &locals[..1], 0);
    let mut q = req(1, &t);
    q.hints.mode = Mode::QueryOnly;
    q.hints.evidence = EvidenceLevel::Full;
    let d = r.route(&q).unwrap();
    let ev = d.evidence.unwrap();
    let of = |rank| ev.iter().find(|c| c.rank == rank).unwrap().overlap;
    assert_eq!(of(w1).per_tier, [2, 1, 2, 0]);
    assert_eq!(of(w1).effective_blocks, 3.25);
    assert_eq!(of(w1).cached_tokens, 52);
    assert_eq!(of(w2).effective_blocks, 0.75);
    assert_eq!(of(w2).cached_tokens, 12);
    assert_eq!(d.worker, w1, "the better cached worker wins at equal load");
    assert_eq!(d.decided_by, DecidedBy::Cost);
}

/// Overlaps, read by index id, never go to another rank: not after a leave shifts fleet
/// indices and a join reuses the leaver's index id, and not between two routers on one
/// thread whose ids name different ranks.
#[test]
fn overlaps_follow_their_ranks_across_leaves_joins_and_routers() {
    let t = tokens(160);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    let overlaps = |r: &Router| -> Vec<(u64, u32)> {
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        q.hints.evidence = EvidenceLevel::Full;
        let mut v: Vec<(u64, u32)> = r
            .route(&q)
            .unwrap()
            .evidence
            .unwrap()
            .iter()
            .map(|c| (c.rank.worker.0, c.overlap.blocks))
            .collect();
        v.sort();
        v
    };
    // A worker joins, holding the first `n` blocks.
    let join = |r: &Router, w: u64, n: usize| {
        r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
        let rank = WorkerRank::new(w, 0);
        store(r, rank, StorageTier::Device, &locals[..n], 0);
    };
    let a = router(RouterConfig::default());
    for (w, n) in [(1u64, 2usize), (2, 4), (3, 6)] {
        join(&a, w, n);
    }
    assert_eq!(overlaps(&a), [(1, 2), (2, 4), (3, 6)]);
    // Worker 1 leaves (worker 2 and 3 move down one fleet index); worker 0 joins first in
    // fleet order and takes worker 1's index id.
    a.leave_worker(WorkerId(1)).unwrap();
    assert_eq!(overlaps(&a), [(2, 4), (3, 6)]);
    join(&a, 0, 9);
    assert_eq!(overlaps(&a), [(0, 9), (2, 4), (3, 6)]);
    // A second router on the same thread, its ids in another order.
    let b = router(RouterConfig::default());
    for (w, n) in [(3u64, 1usize), (2, 3), (0, 5)] {
        join(&b, w, n);
    }
    assert_eq!(overlaps(&b), [(0, 5), (2, 3), (3, 1)]);
    assert_eq!(overlaps(&a), [(0, 9), (2, 4), (3, 6)]);
}

/// A rank whose prompt load is decayed can win on a cost below the floor that ignores
/// decay; pruned selection bounds it with the decay and still picks it. Worker 0 holds
/// the query's first 2 blocks and sets the cheapest cost first; worker 1 holds nothing,
/// but has the query's first 10 blocks active in a request past its expected output.
#[test]
fn a_decayed_rank_is_not_pruned_on_a_floor_that_ignores_decay() {
    let r = router(reference_weights());
    let t = tokens(20 * BS as usize);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    for w in 0..2 {
        r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
    }
    store(
        &r,
        WorkerRank::new(0, 0),
        StorageTier::Device,
        &locals[..2],
        0,
    );
    let mut active = req(7, &t[..10 * BS as usize]);
    active.hints.pinned.backend_instance = Some(WorkerId(1));
    active.hints.expected_output_tokens = Some(1);
    r.route(&active).unwrap();
    r.prefill_done(RequestId(7)).unwrap();
    r.output_block(RequestId(7)).unwrap();
    assert!(r.load(WorkerRank::new(1, 0)).unwrap().prompt_decay > 0);
    let mut q = req(1, &t);
    q.hints.mode = Mode::QueryOnly;
    q.hints.evidence = EvidenceLevel::Full;
    assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(1, 0));
    q.hints.evidence = EvidenceLevel::Off;
    assert_eq!(r.route(&q).unwrap().worker, WorkerRank::new(1, 0));
}

/// A rank holding most of the prompt keeps it under prefill load that the plain credit would
/// send elsewhere: worker 0 holds 36 of the prompt's 40 blocks and is prefilling another
/// prompt of 2,000 tokens; worker 1 is idle. With affinity off, the plain credit (72 blocks)
/// leaves worker 0 about 93 prefill blocks to do and worker 1 wins; with the default
/// (0.7, 8) the 36 blocks earn 6.33 times as much and cover the queued prefill. Worker 0
/// holding only 24 blocks (60%) earns the plain credit and loses either way.
#[test]
fn affinity_keeps_a_mostly_held_prompt_on_its_holder() {
    let pick = |affinity: Affinity, held: usize| {
        let r = router(RouterConfig {
            affinity,
            ..RouterConfig::default()
        });
        let t = tokens(40 * BS as usize);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        for w in 0..2u64 {
            r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
        }
        store(
            &r,
            WorkerRank::new(0, 0),
            StorageTier::Device,
            &locals[..held],
            0,
        );
        let other: Vec<u32> = (0..2000u32).map(|i| 5_000_000 + i).collect();
        let mut busy = req(7, &other);
        busy.hints.pinned.backend_instance = Some(WorkerId(0));
        r.route(&busy).unwrap();
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        q.hints.evidence = EvidenceLevel::Full;
        let d = r.route(&q).unwrap();
        let ev = d.evidence.unwrap();
        let holder = ev.iter().find(|c| c.rank.worker.0 == 0).unwrap();
        (d.worker.worker.0, holder.cost.credit_blocks)
    };
    assert_eq!(pick(Affinity::OFF, 36), (1, 72.0));
    let (w, credit) = pick(Affinity::default(), 36);
    assert_eq!(w, 0);
    assert!(
        (credit - 72.0 * (1.0 + 8.0 * 8.0 / 12.0)).abs() < 1e-9,
        "{credit}"
    );
    assert_eq!(pick(Affinity::default(), 24), (1, 48.0));
}

/// Preferred labels and pool hits lower a rank's cost below the floor of its own overlap;
/// pruned selection takes both into its floors. Worker 0 holds all 20 of the query's
/// blocks and is scored first; worker 1 holds 18 and carries the preferred label, and
/// wins; worker 2 holds 16 and finds the other 4 in the pool, and ties with worker 0 (as
/// does worker 1, with 2 from the pool).
#[test]
fn preferences_and_pool_hits_lower_the_floors_pruning_uses() {
    let r = router(RouterConfig {
        pool_credit: 1.0,
        ..RouterConfig::default()
    });
    let t = tokens(20 * BS as usize);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    for (w, depth) in [(0u64, 20usize), (1, 18), (2, 16)] {
        let mut c = WorkerConfig::simple(w, 1000, BS);
        if w == 1 {
            c.labels = vec![("gpu".to_string(), "fast".to_string())];
        }
        r.join_worker(c).unwrap();
        store(
            &r,
            WorkerRank::new(w, 0),
            StorageTier::Device,
            &locals[..depth],
            0,
        );
    }
    let picks = |q: &RouteRequest<'_>| {
        (0..200)
            .map(|_| r.route(q).unwrap().worker.worker.0)
            .collect::<std::collections::BTreeSet<u64>>()
    };
    let preferred = [PreferredLabel {
        label: Label {
            key: "gpu",
            value: "fast",
        },
        weight: 3.0,
    }];
    let pool = [16..18u32, 18..20];
    let mut q = req(1, &t);
    q.hints.mode = Mode::QueryOnly;
    q.hints.preferred = &preferred;
    assert_eq!(picks(&q), [1].into());
    q.hints.preferred = &[];
    q.hints.pool = PoolHits::Hits(&pool);
    assert_eq!(picks(&q), [0, 1, 2].into());
}

/// Cost weights the selection tests draw from, (overlap credit, prefill load scale): the
/// reference router's, the defaults, and two others.
const WEIGHTS: [(f64, f64); 5] = [(1.0, 1.0), (2.0, 8.0), (2.0, 32.0), (0.5, 3.0), (4.0, 0.7)];

/// Affinities the selection tests take in turn: off, the default, growth from the first
/// block held, and a steep one from a third.
const AFFINITIES: [Affinity; 4] = [
    Affinity::OFF,
    Affinity {
        from_share: 0.7,
        boost: 8.0,
    },
    Affinity {
        from_share: 0.0,
        boost: 1.0,
    },
    Affinity {
        from_share: 0.3,
        boost: 8.0,
    },
];

/// Selection that reads only the ranks the match gave enough blocks to win, and only the
/// records deep enough to matter, picks what the full evidence says: 48 workers with
/// overlaps spread over every depth (so the least winning depth falls among them), tier
/// weights, background prefill on every worker (a booked-prefill floor above 0), some
/// prompts active, and requests with preferred labels, pool hits, both or neither; in
/// half the rounds, records of finished requests on workers with and without events,
/// beside heavily loaded deep ones. Each round's pick set over repeated routes equals the
/// set of cheapest free candidates. (Reading records from two blocks above the least
/// winning depth fails it.)
#[test]
fn selection_from_the_deep_ranks_picks_what_the_full_evidence_says() {
    let mut rng = kvroute_core::Rng::new(29);
    for round in 0..64u64 {
        // Half the rounds record every route (speculation), and some workers publish no
        // events: records then raise overlaps, the shallow ones unread where pruning
        // finds them unable to win.
        let records = round % 8 >= 4;
        let (overlap_credit, prefill_load_scale) =
            WEIGHTS[rng.below(WEIGHTS.len() as u64) as usize];
        let r = router(RouterConfig {
            overlap_credit,
            prefill_load_scale,
            affinity: AFFINITIES[(round / 2) as usize % AFFINITIES.len()],
            pool_credit: [0.5, 1.0, 0.9][round as usize % 3],
            approximate: Approximate {
                speculative: if records {
                    Speculative::On {
                        ttl: std::time::Duration::from_secs(600),
                    }
                } else {
                    Speculative::Off
                },
                ..Approximate::default()
            },
            ..RouterConfig::default()
        });
        let t = tokens(40 * BS as usize);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        for w in 0..48u64 {
            let mut c = WorkerConfig::simple(w, 1000, BS);
            if rng.below(3) == 0 {
                c.labels = vec![("gpu".to_string(), "fast".to_string())];
            }
            let events = if records && rng.below(4) == 0 {
                KvEvents::Absent
            } else {
                KvEvents::Published
            };
            r.join_worker(WorkerConfig {
                kv_events: events,
                ..c
            })
            .unwrap();
            let depth = rng.below(41) as usize;
            if depth > 0 {
                let tier = if rng.below(4) == 0 {
                    StorageTier::HostPinned
                } else {
                    StorageTier::Device
                };
                store(&r, WorkerRank::new(w, 0), tier, &locals[..depth], 0);
            }
            // Background prefill everywhere, of several sizes; some of the query's own
            // blocks active on a few.
            let own = rng.below(if records { 2 } else { 4 }) == 0;
            let body: Vec<u32> = if own {
                t[..BS as usize * (1 + rng.below(40) as usize)].to_vec()
            } else {
                // With records, the index's deep ranks carry heavy loads, so that ranks
                // known by their records alone win near the least winning depth.
                let most = if records { 60 } else { 6 };
                let n = BS * (1 + rng.below(most) as u32);
                (0..n).map(|i| 700_000 + i + 1000 * (w as u32)).collect()
            };
            let id = 1_000_000 * (round + 1) + w;
            let mut q = req(id, &body);
            q.hints.pinned.backend_instance = Some(WorkerId(w));
            r.route(&q).unwrap();
            // A finished request leaves its record and no load.
            if records && own {
                r.free(RequestId(id)).unwrap();
            }
        }
        r.refresh_prefill_floor();
        let preferred = [PreferredLabel {
            label: Label {
                key: "gpu",
                value: "fast",
            },
            weight: [1.0, 3.0, 7.5][rng.below(3) as usize],
        }];
        let start = rng.below(20) as u32;
        let mid = start + 3 + rng.below(15) as u32;
        let pool = [start..mid, mid + 2..mid + 2 + rng.below(9) as u32];
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        if round % 4 >= 2 {
            q.hints.preferred = &preferred;
        }
        if round % 2 == 1 {
            q.hints.pool = PoolHits::Hits(&pool);
        }
        q.hints.evidence = EvidenceLevel::Full;
        let ev = r.route(&q).unwrap().evidence.unwrap();
        let min = ev
            .iter()
            .map(|c| c.cost.total)
            .fold(f64::INFINITY, f64::min);
        let want: std::collections::BTreeSet<WorkerRank> = ev
            .iter()
            .filter(|c| c.cost.total == min)
            .map(|c| c.rank)
            .collect();
        q.hints.evidence = EvidenceLevel::Off;
        let picked: std::collections::BTreeSet<WorkerRank> =
            (0..200).map(|_| r.route(&q).unwrap().worker).collect();
        assert_eq!(picked, want, "round {round}");
    }
}

/// Without evidence, selection keeps only candidates that can still win; it picks from
/// exactly the ranks the full evidence says it should, each of them over repeated routes:
/// the cheapest healthy, free ones, or the least loaded where the busy or health filter
/// falls back. Fleets with ties, deep and shallow overlaps, prompt blocks already active
/// (some of them decayed), busy workers, the cheapest worker marked wedged, and requests
/// with preferred labels and pool hits.
#[test]
fn pruned_selection_picks_what_the_full_evidence_says() {
    let mut rng = kvroute_core::Rng::new(11);
    let (mut by_cost, mut by_load, mut loaded_floors) = (0, 0, 0);
    for round in 0..32u64 {
        let busy = round % 2 == 1;
        // Every worker loaded and tiny: all busy, so the least loaded serves.
        let all_busy = round % 4 == 3;
        // Prefill booked on every worker: the floors count it (`Ledger::prefill_floor`).
        let loaded_everywhere = round % 8 < 2;
        let (overlap_credit, prefill_load_scale) =
            WEIGHTS[rng.below(WEIGHTS.len() as u64) as usize];
        let r = router(RouterConfig {
            overlap_credit,
            prefill_load_scale,
            affinity: AFFINITIES[(round / 2) as usize % AFFINITIES.len()],
            busy: BusyThresholds {
                // Rounds with every worker busy: past 2 of 20 blocks active.
                decode_blocks_fraction: busy.then_some(if all_busy { 0.1 } else { 0.5 }),
                prefill_tokens_fraction: None,
            },
            ..RouterConfig::default()
        });
        let t = tokens(320);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        let mut deepest = (0, WorkerId(0));
        for w in 0..16u64 {
            // Room for the deepest prefix: the index holds no more than a worker declares.
            let mut c = WorkerConfig::simple(w, 20, BS);
            if rng.below(3) == 0 {
                c.labels = vec![("gpu".to_string(), "fast".to_string())];
            }
            r.join_worker(c).unwrap();
            let depth = [0, 0, 2, 5, 5, 20][rng.below(6) as usize];
            if depth > 0 {
                store(
                    &r,
                    WorkerRank::new(w, 0),
                    StorageTier::Device,
                    &locals[..depth],
                    0,
                );
            }
            if depth > deepest.0 {
                deepest = (depth, WorkerId(w));
            }
            // Load: the query's own first blocks active on some, other prompts on others.
            let requests = if all_busy || loaded_everywhere {
                1 + rng.below(2)
            } else {
                rng.below(3)
            };
            for k in 0..requests {
                // Another prompt's 4 blocks make a worker busy in the all-busy rounds.
                let own = !(all_busy || loaded_everywhere && k == 0) && rng.below(2) == 0;
                let body: Vec<u32> = if own {
                    t[..16 * (1 + rng.below(10) as usize)].to_vec()
                } else {
                    (0..64).map(|i| 900_000 + i + 1000 * (w as u32)).collect()
                };
                let id = 1000 * (round + 1) + 10 * w + k;
                let mut q = req(id, &body);
                q.hints.pinned.backend_instance = Some(WorkerId(w));
                // Some decay their unshared prompt blocks, from their first output block.
                let decays = rng.below(3) == 0;
                if decays {
                    q.hints.expected_output_tokens = Some(40);
                }
                r.route(&q).unwrap();
                if decays {
                    r.output_block(RequestId(id)).unwrap();
                }
            }
        }
        if round % 3 == 2 {
            r.set_health(deepest.1, Health::Wedged).unwrap();
        }
        let mut q = req(1, &t);
        q.hints.mode = Mode::QueryOnly;
        q.hints.evidence = EvidenceLevel::Full;
        // Some rounds prefer a label and bring pool hits: both lower costs.
        let preferred = [PreferredLabel {
            label: Label {
                key: "gpu",
                value: "fast",
            },
            weight: 3.0,
        }];
        let pool = [0..8u32, 12..16];
        if round % 5 >= 3 {
            q.hints.preferred = &preferred;
            q.hints.pool = PoolHits::Hits(&pool);
        }
        let ev = r.route(&q).unwrap().evidence.unwrap();
        let healthy: Vec<&Candidate> = ev.iter().filter(|c| c.health.is_healthy()).collect();
        let pool = if healthy.is_empty() {
            ev.iter().collect()
        } else {
            healthy
        };
        let free: Vec<&Candidate> = pool
            .iter()
            .copied()
            .filter(|c| c.busy == Busy::Free)
            .collect();
        let want: std::collections::BTreeSet<WorkerRank> = if free.is_empty() {
            by_load += 1;
            let least = pool.iter().map(|c| c.load.load_blocks(BS)).min().unwrap();
            pool.iter()
                .filter(|c| c.load.load_blocks(BS) == least)
                .map(|c| c.rank)
                .collect()
        } else {
            by_cost += 1;
            let min = free
                .iter()
                .map(|c| c.cost.total)
                .fold(f64::INFINITY, f64::min);
            free.iter()
                .filter(|c| c.cost.total == min)
                .map(|c| c.rank)
                .collect()
        };
        q.hints.evidence = EvidenceLevel::Off;
        r.refresh_prefill_floor();
        if loaded_everywhere || all_busy {
            assert!(r.prefill_floor() >= 64, "round {round}");
            loaded_floors += 1;
        }
        let mut picked = std::collections::BTreeSet::new();
        for _ in 0..300 {
            let d = r.route(&q).unwrap();
            assert!(want.contains(&d.worker), "round {round}: {d:?}");
            picked.insert(d.worker);
        }
        assert_eq!(picked, want, "round {round}");
    }
    assert!(
        by_cost >= 16 && by_load >= 4 && loaded_floors >= 12,
        "{by_cost} by cost, {by_load} by load, {loaded_floors} floors over booked prefill"
    );
}

#[test]
fn query_only_changes_no_state() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let t = tokens(100);
    r.route(&req(1, &t)).unwrap();
    let before = (r.total_load(), r.active_requests(), r.counts().ledger);
    let mut q = req(2, &t);
    q.hints.mode = Mode::QueryOnly;
    let d = r.route(&q).unwrap();
    assert_eq!(d.bookkeeping, Bookkeeping::QueryOnly);
    assert_eq!(
        (r.total_load(), r.active_requests(), r.counts().ledger),
        before
    );
    assert_eq!(
        r.free(RequestId(2)),
        Err(LoadError::UnknownRequest {
            request: RequestId(2)
        })
    );
}

#[test]
fn pinned_precedence_per_phase() {
    let p = Pinned {
        backend_instance: Some(WorkerId(1)),
        prefill_worker: Some(WorkerId(2)),
        decode_worker: Some(WorkerId(3)),
        dp_rank: Some(DpRank(0)),
        prefill_dp_rank: Some(DpRank(5)),
        decode_dp_rank: None,
    };
    assert_eq!(
        p.for_phase(Phase::Prefill),
        Some((WorkerId(2), Some(DpRank(5))))
    );
    assert_eq!(
        p.for_phase(Phase::Decode),
        Some((WorkerId(3), Some(DpRank(0))))
    );
    assert_eq!(
        p.for_phase(Phase::Aggregated),
        Some((WorkerId(1), Some(DpRank(0))))
    );
    let only_backend = Pinned {
        backend_instance: Some(WorkerId(1)),
        ..Pinned::default()
    };
    assert_eq!(
        only_backend.for_phase(Phase::Prefill),
        Some((WorkerId(1), None))
    );
    assert_eq!(
        only_backend.for_phase(Phase::Decode),
        Some((WorkerId(1), None))
    );
    assert_eq!(Pinned::default().for_phase(Phase::Aggregated), None);
}

#[test]
fn pinned_routes_book_the_pinned_rank_or_report_untracked() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.join_worker(WorkerConfig {
        dp_size: 2,
        ..WorkerConfig::simple(2, 1000, BS)
    })
    .unwrap();
    let t = tokens(64);
    let mut q = req(1, &t);
    q.hints.pinned.backend_instance = Some(WorkerId(2));
    q.hints.pinned.dp_rank = Some(DpRank(1));
    let d = r.route(&q).unwrap();
    assert_eq!(
        (d.worker, d.decided_by),
        (WorkerRank::new(2, 1), DecidedBy::Pinned)
    );
    assert_eq!(r.load(WorkerRank::new(2, 1)).unwrap().requests, 1);
    // No dp rank on a two-rank worker: dispatched without bookkeeping.
    let mut q = req(2, &t);
    q.hints.pinned.backend_instance = Some(WorkerId(2));
    let d = r.route(&q).unwrap();
    assert_eq!(d.bookkeeping, Bookkeeping::UntrackedDpRankUnresolved);
    assert_eq!(r.active_requests(), 1);
    assert_eq!(r.counts().untracked, 1);
    // A single-rank worker resolves without a dp rank.
    let mut q = req(3, &t);
    q.hints.pinned.backend_instance = Some(WorkerId(1));
    assert_eq!(r.route(&q).unwrap().bookkeeping, Bookkeeping::Booked);
    // Unknown and disallowed pins are errors.
    let mut q = req(4, &t);
    q.hints.pinned.backend_instance = Some(WorkerId(9));
    assert_eq!(
        r.route(&q),
        Err(RouteError::UnknownWorker {
            request: RequestId(4),
            worker: WorkerId(9)
        })
    );
    q.hints.pinned.backend_instance = Some(WorkerId(1));
    q.hints.allowed = Some(&[WorkerId(2)]);
    assert!(matches!(
        r.route(&q),
        Err(RouteError::PinnedNotAllowed { .. })
    ));
}

#[test]
fn bad_requests_are_typed_errors_and_counted() {
    // Enforced disaggregation: a prefill request without prefill workers is an error (see
    // `prefill_falls_back_to_aggregated_unless_enforced` for the default).
    let r = router(RouterConfig {
        min_workers: 1,
        disaggregation: Disaggregation::Enforced,
        ..RouterConfig::default()
    });
    let t = tokens(32);
    assert_eq!(
        r.route(&req(1, &t)),
        Err(RouteError::NotReady {
            joined: 0,
            needed: 1
        })
    );
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    assert_eq!(
        r.route(&req(1, &[])),
        Err(RouteError::NoTokens {
            request: RequestId(1)
        })
    );
    let mut q = req(1, &t);
    q.hints.allowed = Some(&[WorkerId(5)]);
    assert_eq!(
        r.route(&q),
        Err(RouteError::NoWorkers {
            request: RequestId(1)
        })
    );
    q.hints.allowed = None;
    q.hints.phase = Phase::Prefill;
    assert_eq!(
        r.route(&q),
        Err(RouteError::NoWorkers {
            request: RequestId(1)
        })
    );
    r.route(&req(1, &t)).unwrap();
    let load = r.total_load();
    assert_eq!(
        r.route(&req(1, &t)),
        Err(RouteError::Load(LoadError::DuplicateRequest {
            request: RequestId(1)
        }))
    );
    assert_eq!(r.total_load(), load, "a rejected duplicate books nothing");
    let c = r.counts();
    assert_eq!((c.not_ready, c.no_tokens, c.no_workers), (1, 1, 2));
    assert_eq!(c.ledger.duplicate_requests, 1);
}

#[test]
fn lifecycle_by_id_returns_load_to_zero() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let t = tokens(40); // 2 full blocks + a tail
    let d = r.route(&req(1, &t)).unwrap();
    let l = r.load(d.worker).unwrap();
    assert_eq!((l.prefill_tokens, l.prompt_blocks, l.requests), (40, 3, 1));
    r.prefill_done(RequestId(1)).unwrap();
    r.output_block(RequestId(1)).unwrap();
    assert_eq!(r.load(d.worker).unwrap().decode_blocks(), 4);
    r.free(RequestId(1)).unwrap();
    assert!(r.total_load().is_idle());
}

#[test]
fn guard_frees_exactly_once_and_counts_only_dispatched() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let t = tokens(64);
    r.route(&req(1, &t)).unwrap();
    {
        let g = RequestGuard::new(&r, RequestId(1));
        g.prefill_done().unwrap();
        // Dropped before dispatch: freed, not counted as completed.
    }
    assert!(r.total_load().is_idle());
    assert_eq!(r.counts().completed, 0);
    r.route(&req(2, &t)).unwrap();
    let mut g = RequestGuard::new(&r, RequestId(2));
    g.mark_dispatched().unwrap();
    g.finish().unwrap();
    assert_eq!(r.counts().completed, 1);
    // Freed by id first: the guard's drop finds nothing and frees nothing else.
    r.route(&req(3, &t)).unwrap();
    r.route(&req(4, &t)).unwrap();
    let g = RequestGuard::new(&r, RequestId(3));
    r.free(RequestId(3)).unwrap();
    drop(g);
    assert_eq!(r.total_load().requests, 1);
    assert_eq!(r.counts().ledger.freed, 3);
    // An Arc'd router works too.
    let a = std::sync::Arc::new(router(RouterConfig::default()));
    a.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    a.route(&req(1, &t)).unwrap();
    drop(RequestGuard::new(std::sync::Arc::clone(&a), RequestId(1)));
    assert!(a.total_load().is_idle());
}

#[test]
fn lora_name_changes_the_hash_and_so_the_match() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let t = tokens(64);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    store(&r, WorkerRank::new(1, 0), StorageTier::Device, &locals, 0);
    let mut q = req(1, &t);
    q.hints.mode = Mode::QueryOnly;
    assert_eq!(r.route(&q).unwrap().overlap.blocks, 4);
    q.hints.lora_name = Some("adapter-a");
    assert_eq!(r.route(&q).unwrap().overlap.blocks, 0);
}

#[test]
fn load_steers_choices_and_busy_ranks_are_skipped() {
    let r = router(RouterConfig {
        busy: BusyThresholds {
            decode_blocks_fraction: Some(0.5),
            prefill_tokens_fraction: None,
        },
        ..RouterConfig::default()
    });
    r.join_worker(WorkerConfig::simple(1, 10, BS)).unwrap();
    r.join_worker(WorkerConfig::simple(2, 10, BS)).unwrap();
    let t = tokens(16 * 6); // 6 blocks: over half the capacity of a 10-block rank
    let a = r.route(&req(1, &t)).unwrap().worker;
    let b = r.route(&req(2, &tokens(16 * 6 + 1))).unwrap();
    assert_ne!(a, b.worker, "the first rank is busy");
    let c = r.route(&req(3, &tokens(17))).unwrap();
    assert_eq!(c.decided_by, DecidedBy::FallbackAllBusy);
    assert_eq!(r.counts().all_busy, 1);
}

#[test]
fn leaving_worker_loses_its_load_and_blocks() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
    let t = tokens(64);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    store(&r, WorkerRank::new(1, 0), StorageTier::Device, &locals, 0);
    let mut q = req(1, &t);
    q.hints.pinned.backend_instance = Some(WorkerId(1));
    r.route(&q).unwrap();
    assert_eq!(r.leave_worker(WorkerId(1)).unwrap(), 1);
    assert!(r.total_load().is_idle());
    assert_eq!(
        r.free(RequestId(1)),
        Err(LoadError::UnknownRequest {
            request: RequestId(1)
        })
    );
    assert_eq!(
        scores_of(&r.index_reader(), &locals, MatchOptions::default()).max_blocks(),
        0
    );
    assert!(matches!(
        r.leave_worker(WorkerId(1)),
        Err(RouterError::Registry(_))
    ));
}

#[test]
fn expiry_frees_forgotten_requests() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.route(&req(1, &tokens(64))).unwrap();
    assert_eq!(r.at(Instant::now()).expire(), 0);
    let later = Instant::now() + r.config().request_expiry;
    assert_eq!(r.at(later).expire(), 1);
    assert!(r.total_load().is_idle());
    assert_eq!(r.counts().ledger.expired, 1);
}

#[test]
fn timing_on_records_the_overhead_split() {
    let r = router(RouterConfig {
        timing: Timing::On,
        ..RouterConfig::default()
    });
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.route(&req(1, &tokens(64))).unwrap();
    let t = r.timings().unwrap();
    assert_eq!((t.hash.len(), t.matching.len(), t.select.len()), (1, 1, 1));
    assert!(router(RouterConfig::default()).timings().is_none());
}

#[test]
fn decode_phase_gets_no_overlap_credit_and_books_no_prefill() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig {
        role: WorkerRole::Decode,
        ..WorkerConfig::simple(1, 1000, BS)
    })
    .unwrap();
    let t = tokens(64);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    store(&r, WorkerRank::new(1, 0), StorageTier::Device, &locals, 0);
    let mut q = req(1, &t);
    q.hints.phase = Phase::Decode;
    let d = r.route(&q).unwrap();
    assert_eq!(d.cost.credit_blocks, 0.0);
    assert_eq!(r.load(d.worker).unwrap().prefill_tokens, 0);
}

#[test]
fn prefill_falls_back_to_aggregated_unless_enforced() {
    let t = tokens(64);
    let mut q = req(1, &t);
    q.hints.phase = Phase::Prefill;
    // Default: no prefill worker, so an aggregated worker serves, and the decision says so.
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let d = r.route(&q).unwrap();
    assert_eq!(d.worker, WorkerRank::new(1, 0));
    assert_eq!(d.fallback, Some(Fallback::PrefillToAggregated));
    assert_eq!(d.decided_by, DecidedBy::Cost);
    assert_eq!(
        r.load(d.worker).unwrap().prefill_tokens,
        64,
        "prefill is booked"
    );
    assert_eq!(r.counts().prefill_fallbacks, 1);
    // Once a prefill worker joins, prefill goes there and nothing falls back.
    r.join_worker(WorkerConfig {
        role: WorkerRole::Prefill,
        ..WorkerConfig::simple(2, 1000, BS)
    })
    .unwrap();
    let d = r.route(&req(2, &t)).unwrap();
    assert_eq!(
        d.fallback, None,
        "an aggregated request is never a fallback"
    );
    let mut q2 = req(3, &t);
    q2.hints.phase = Phase::Prefill;
    let d = r.route(&q2).unwrap();
    assert_eq!((d.worker, d.fallback), (WorkerRank::new(2, 0), None));
    // A prefill worker outside the allowed set is still a prefill worker: no fallback.
    let mut q3 = req(4, &t);
    q3.hints.phase = Phase::Prefill;
    q3.hints.allowed = Some(&[WorkerId(1)]);
    assert_eq!(
        r.route(&q3),
        Err(RouteError::NoWorkers {
            request: RequestId(4)
        })
    );
    assert_eq!(r.counts().prefill_fallbacks, 1);
    // Enforced: no fallback, a typed error.
    let r = router(RouterConfig {
        disaggregation: Disaggregation::Enforced,
        ..RouterConfig::default()
    });
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    assert_eq!(
        r.route(&q),
        Err(RouteError::NoWorkers {
            request: RequestId(1)
        })
    );
    assert!(r.total_load().is_idle());
    // Decode falls back to an aggregated worker only when the fleet has no decode worker.
    let mut qd = req(5, &t);
    qd.hints.phase = Phase::Decode;
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let d = r.route(&qd).unwrap();
    assert_eq!(d.fallback, Some(Fallback::DecodeToAggregated));
    r.join_worker(WorkerConfig {
        role: WorkerRole::Decode,
        ..WorkerConfig::simple(2, 1000, BS)
    })
    .unwrap();
    qd.id = RequestId(6);
    qd.hints.allowed = Some(&[WorkerId(1)]);
    assert!(matches!(r.route(&qd), Err(RouteError::NoWorkers { .. })));
}

#[test]
fn a_whole_request_in_a_fleet_without_aggregated_workers_goes_to_a_decode_worker() {
    let t = tokens(64);
    let r = router(RouterConfig::default());
    for (id, role) in [(1, WorkerRole::Prefill), (2, WorkerRole::Decode)] {
        r.join_worker(WorkerConfig {
            role,
            ..WorkerConfig::simple(id, 1000, BS)
        })
        .unwrap();
    }
    // Aggregated: a decode worker computes the prompt itself, booked as a whole request.
    let d = r.route(&req(1, &t)).unwrap();
    assert_eq!(
        (d.worker, d.fallback),
        (WorkerRank::new(2, 0), Some(Fallback::AggregatedToDecode))
    );
    assert_eq!(r.load(d.worker).unwrap().prefill_tokens, 64);
    // Prefill with the prefill worker outside the allowed set: no fallback (it has joined).
    let mut q = req(2, &t);
    q.hints.phase = Phase::Prefill;
    let d = r.route(&q).unwrap();
    assert_eq!((d.worker, d.fallback), (WorkerRank::new(1, 0), None));
    let c = r.counts();
    assert_eq!((c.whole_on_decode, c.prefill_fallbacks), (1, 0));
    // With no prefill worker, a prefill-phase request is a whole one on a decode worker.
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig {
        role: WorkerRole::Decode,
        ..WorkerConfig::simple(2, 1000, BS)
    })
    .unwrap();
    let mut q = req(3, &t);
    q.hints.phase = Phase::Prefill;
    let d = r.route(&q).unwrap();
    assert_eq!(d.fallback, Some(Fallback::AggregatedToDecode));
    let c = r.counts();
    assert_eq!((c.whole_on_decode, c.prefill_fallbacks), (1, 1));
    // An aggregated worker, when there is one, serves whole requests.
    r.join_worker(WorkerConfig::simple(3, 1000, BS)).unwrap();
    let d = r.route(&req(4, &t)).unwrap();
    assert_eq!((d.worker, d.fallback), (WorkerRank::new(3, 0), None));
    // With no decode worker, an aggregated one takes a decode-phase request, booked as a
    // decode (no prompt tokens to compute).
    let r = router(RouterConfig::default());
    for (id, role) in [(1, WorkerRole::Prefill), (3, WorkerRole::Aggregated)] {
        r.join_worker(WorkerConfig {
            role,
            ..WorkerConfig::simple(id, 1000, BS)
        })
        .unwrap();
    }
    let mut q = req(5, &t);
    q.hints.phase = Phase::Decode;
    let d = r.route(&q).unwrap();
    assert_eq!(
        (d.worker, d.fallback),
        (WorkerRank::new(3, 0), Some(Fallback::DecodeToAggregated))
    );
    assert_eq!(r.load(d.worker).unwrap().prefill_tokens, 0);
}

/// Two workers, equal but for one running a request with the same 8-block system prompt:
/// with the prompt counted once, that worker is cheaper by the shared blocks and wins,
/// where charging the whole prompt again would make it the dearer one.
#[test]
fn decode_term_counts_prompt_blocks_active_on_the_worker_once() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
    let sys: Vec<u32> = (0..128).map(|i| i * 3 + 5).collect();
    let with = |tail: u32| -> Vec<u32> {
        sys.iter()
            .copied()
            .chain((0..32).map(|i| i + tail))
            .collect()
    };
    // Worker 1 runs a request with the system prompt; worker 2 one of the same size
    // without it. Prefill done on both, so only decode load differs by what is shared.
    let running = with(10_000);
    let other: Vec<u32> = (0..160).map(|i| i + 50_000).collect();
    let mut q = req(1, &running);
    q.hints.pinned.backend_instance = Some(WorkerId(1));
    r.route(&q).unwrap();
    let mut q = req(2, &other);
    q.hints.pinned.backend_instance = Some(WorkerId(2));
    r.route(&q).unwrap();
    r.prefill_done(RequestId(1)).unwrap();
    r.prefill_done(RequestId(2)).unwrap();
    // Equal load: only the shared blocks separate them.
    let probes_before = r.counts().shared_probes;
    let incoming = with(20_000);
    let mut q = req(3, &incoming);
    q.hints.mode = Mode::QueryOnly;
    q.hints.evidence = EvidenceLevel::Full;
    for _ in 0..20 {
        let d = r.route(&q).unwrap();
        assert_eq!(d.worker, WorkerRank::new(1, 0), "{d:?}");
        assert_eq!(d.cost.shared_blocks, 8);
        assert_eq!(d.cost.decode_cost, 10.0 + 10.0 - 8.0);
        // No event has stored the system prompt yet: the index predicts nothing, but the
        // engine will find the running request's 8 blocks.
        assert_eq!(d.overlap.cached_tokens, 0);
        assert_eq!(d.predicted_cached_tokens, 8 * u64::from(BS));
        let ev = d.evidence.unwrap();
        let w2 = ev.iter().find(|c| c.rank == WorkerRank::new(2, 0)).unwrap();
        assert_eq!(w2.cost.shared_blocks, 0);
        assert_eq!(w2.cost.decode_cost, 20.0);
    }
    assert!(r.counts().shared_probes > probes_before);
    // Booking agrees with the prediction: 8 blocks were shared.
    let mut q = req(4, &incoming);
    q.hints.pinned.backend_instance = Some(WorkerId(1));
    r.route(&q).unwrap();
    assert_eq!(r.load(WorkerRank::new(1, 0)).unwrap().prompt_blocks, 10 + 2);
}

/// Probes are bounded per request, whatever the fleet size, and skip ranks that cannot win.
#[test]
fn shared_probes_are_bounded_per_route() {
    let r = router(RouterConfig::default());
    for w in 0..40 {
        r.join_worker(WorkerConfig::simple(w, 100_000, BS)).unwrap();
    }
    let t = tokens(320);
    for w in 0..40 {
        let mut q = req(100 + w, &t);
        q.hints.pinned.backend_instance = Some(WorkerId(w));
        r.route(&q).unwrap();
    }
    let before = r.counts().shared_probes;
    let mut q = req(1, &t);
    q.hints.mode = Mode::QueryOnly;
    let d = r.route(&q).unwrap();
    let probes = r.counts().shared_probes - before;
    assert!(
        probes as usize <= kvroute_core::testing::SHARED_PROBES,
        "{probes}"
    );
    assert!(probes > 0);
    assert_eq!(
        d.cost.shared_blocks, 20,
        "every worker runs the same prompt"
    );
    // The whole prompt is active, but its last token is always computed: 19 blocks.
    assert_eq!(d.predicted_cached_tokens, 19 * u64::from(BS));
    // Other policies never probe.
    let rr = router(RouterConfig {
        policy: Policy::LeastLoaded,
        ..RouterConfig::default()
    });
    rr.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    rr.route(&req(1, &t)).unwrap();
    rr.route(&q).unwrap();
    assert_eq!(rr.counts().shared_probes, 0);
}

/// Expected output length decays the chosen rank's output load, and the decay steers the
/// next choice: of two ranks with equal output blocks, the one whose request is nearly
/// done is cheaper.
#[test]
fn expected_output_decays_output_load_in_the_cost() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    r.join_worker(WorkerConfig::simple(2, 1000, BS)).unwrap();
    let a: Vec<u32> = (0..64).map(|i| i + 70_000).collect();
    let b: Vec<u32> = (0..64).map(|i| i + 80_000).collect();
    let mut q = req(1, &a);
    q.hints.pinned.backend_instance = Some(WorkerId(1));
    q.hints.expected_output_tokens = Some(100);
    r.route(&q).unwrap();
    let mut q = req(2, &b);
    q.hints.pinned.backend_instance = Some(WorkerId(2));
    r.route(&q).unwrap();
    for id in [1, 2] {
        r.prefill_done(RequestId(id)).unwrap();
        for _ in 0..4 {
            r.output_block(RequestId(id)).unwrap();
        }
    }
    // Request 1: 64-token prompt, 4th block opens at output token 49: r = 0.51.
    let l1 = r.load(WorkerRank::new(1, 0)).unwrap();
    assert_eq!(l1.output_blocks, 4);
    let expect = 4.0 * (1.0 - 49.0 / 100.0);
    assert!(
        (l1.weighted_output_blocks() - expect).abs() < 1e-4,
        "{l1:?}"
    );
    assert_eq!(r.load(WorkerRank::new(2, 0)).unwrap().output_decay, 0);
    let t: Vec<u32> = (0..64).map(|i| i + 90_000).collect();
    let mut q = req(3, &t);
    q.hints.mode = Mode::QueryOnly;
    let d = r.route(&q).unwrap();
    assert_eq!(d.worker, WorkerRank::new(1, 0));
    // Its 4 prompt blocks, unshared, weigh what is left of its output too.
    let prompt = 4.0 * (1.0 - 49.0 / 100.0);
    assert!((l1.weighted_prompt_blocks() - prompt).abs() < 1e-4);
    assert!((d.cost.decode_cost - (prompt + expect + 4.0)).abs() < 1e-4);
    r.free(RequestId(1)).unwrap();
    r.free(RequestId(2)).unwrap();
    assert!(r.total_load().is_idle());
}

/// Output blocks follow token counts: one token at a time they open where
/// `output_block` would, with the same load and decay; the first call completes the
/// prefill and records the TTFT, later ones the ITL per token; by guard and by id.
#[test]
fn tokens_generated_advances_blocks_and_records_itl_per_token() {
    let config = RouterConfig {
        metrics: Metrics::On,
        ..RouterConfig::default()
    };
    let by_tokens = router(config.clone());
    let by_blocks = router(config);
    for r in [&by_tokens, &by_blocks] {
        r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    }
    let t: Vec<u32> = (0..64).map(|i| i + 70_000).collect();
    let mut q = req(1, &t);
    q.hints.expected_output_tokens = Some(100);
    by_tokens.route(&q).unwrap();
    by_blocks.route(&q).unwrap();
    let rank = WorkerRank::new(1, 0);
    let mut g = RequestGuard::new(&by_tokens, RequestId(1));
    g.mark_dispatched().unwrap();
    assert_eq!(g.tokens_generated(0), Ok(rank), "no tokens, no change");
    assert_eq!(by_tokens.load(rank).unwrap().prefill_tokens, 64);
    by_blocks.prefill_done(RequestId(1)).unwrap();
    for generated in 1..=40u64 {
        g.tokens_generated(1).unwrap();
        if generated == 1 {
            assert_eq!(by_tokens.load(rank).unwrap().prefill_tokens, 0);
        }
        // A 64-token prompt fills 4 blocks: tokens 1, 17 and 33 open blocks.
        if generated % 16 == 1 {
            by_blocks.output_block(RequestId(1)).unwrap();
        }
        assert_eq!(by_tokens.load(rank), by_blocks.load(rank), "{generated}");
    }
    let l = by_tokens.load(rank).unwrap();
    assert_eq!(l.output_blocks, 3);
    assert_eq!(
        l.output_decay,
        kvroute_core::testing::output_decay(64, BS, 100, 3)
    );
    let m = by_tokens.request_metrics().unwrap();
    assert_eq!((m.ttft_us.len(), m.itl_us.len()), (1, 39));
    g.finish().unwrap();

    // By id, in chunks: 40 tokens at once open 3 blocks, weighed at 40 generated.
    let mut q = req(2, &t);
    q.hints.expected_output_tokens = Some(100);
    by_tokens.route(&q).unwrap();
    by_tokens.mark_dispatched(RequestId(2)).unwrap();
    by_tokens.tokens_generated(RequestId(2), 40).unwrap();
    let l = by_tokens.load(rank).unwrap();
    assert_eq!(l.output_blocks, 3);
    assert_eq!(
        l.output_decay,
        kvroute_core::testing::decayed(3, kvroute_core::testing::remaining_fraction(40, 100))
    );
    by_tokens.tokens_generated(RequestId(2), 8).unwrap();
    assert_eq!(
        by_tokens.load(rank).unwrap().output_blocks,
        3,
        "48: still 3"
    );
    by_tokens.tokens_generated(RequestId(2), 1).unwrap();
    assert_eq!(
        by_tokens.load(rank).unwrap().output_blocks,
        4,
        "49 opens a 4th"
    );
    let m = by_tokens.request_metrics().unwrap();
    assert_eq!((m.ttft_us.len(), m.itl_us.len()), (2, 39 + 9));
    by_tokens.free(RequestId(2)).unwrap();
    assert_eq!(
        by_tokens.tokens_generated(RequestId(2), 1),
        Err(LoadError::UnknownRequest {
            request: RequestId(2)
        })
    );
    by_blocks.free(RequestId(1)).unwrap();
    assert!(by_tokens.total_load().is_idle());
    assert_eq!(by_tokens.request_metrics().unwrap().osl_blocks.max(), 4);
}

/// `PromptDecay::Off` keeps prompt blocks whole; only the output decays.
#[test]
fn prompt_decay_off_keeps_prompt_blocks_whole() {
    let r = router(RouterConfig {
        prompt_decay: PromptDecay::Off,
        ..RouterConfig::default()
    });
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let a: Vec<u32> = (0..64).map(|i| i + 70_000).collect();
    let mut q = req(1, &a);
    q.hints.expected_output_tokens = Some(100);
    r.route(&q).unwrap();
    for _ in 0..4 {
        r.output_block(RequestId(1)).unwrap();
    }
    let l = r.load(WorkerRank::new(1, 0)).unwrap();
    assert_eq!((l.prompt_decay, l.weighted_prompt_blocks()), (0, 4.0));
    assert!(l.output_decay > 0);
    r.free(RequestId(1)).unwrap();
    assert!(r.total_load().is_idle());
}

#[test]
fn request_metrics_record_only_dispatched_requests() {
    let r = router(RouterConfig {
        metrics: Metrics::On,
        ..RouterConfig::default()
    });
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let t = tokens(64);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    store(
        &r,
        WorkerRank::new(1, 0),
        StorageTier::Device,
        &locals[..1],
        0,
    );
    // Never dispatched: freed by its guard, records nothing.
    r.route(&req(1, &t)).unwrap();
    {
        let g = RequestGuard::new(&r, RequestId(1));
        g.prefill_done().unwrap();
        g.output_block().unwrap();
    }
    let m = r.request_metrics().unwrap();
    assert!(m.quantiles().iter().all(|(_, q)| q.count == 0), "{m}");
    assert_eq!(r.counts().completed, 0);
    // Dispatched through the guard: TTFT once, no ITL sample for the block that opens at
    // the first token (a 64-token prompt), one per later block, the rest when it ends.
    r.route(&req(2, &t)).unwrap();
    let mut g = RequestGuard::new(&r, RequestId(2));
    g.mark_dispatched().unwrap();
    g.prefill_done().unwrap();
    g.prefill_done().unwrap();
    for _ in 0..3 {
        g.output_block().unwrap();
    }
    g.finish().unwrap();
    // Dispatched by id (the engine-side contract), freed by id.
    r.route(&req(3, &t)).unwrap();
    r.mark_dispatched(RequestId(3)).unwrap();
    r.prefill_done(RequestId(3)).unwrap();
    r.free(RequestId(3)).unwrap();
    // Dispatched but expired: its end records nothing.
    r.route(&req(4, &t)).unwrap();
    r.mark_dispatched(RequestId(4)).unwrap();
    r.at(Instant::now() + r.config().request_expiry).expire();
    let m = r.request_metrics().unwrap();
    assert_eq!(m.ttft_us.len(), 2);
    assert_eq!(m.itl_us.len(), 2);
    assert_eq!(m.isl_tokens.len(), 2);
    assert_eq!(m.isl_tokens.max(), 64);
    assert_eq!(m.osl_blocks.max(), 3);
    assert_eq!(m.osl_blocks.min(), 0);
    // One of four blocks cached: 25 % = 2,500 basis points.
    assert_eq!(m.kv_hit_bp.min(), 2_500);
    assert!(m.kv_hit_bp.equivalent(m.kv_hit_bp.max(), 2_500));
    assert_eq!(r.counts().completed, 2);
    let table = m.to_string();
    assert!(
        table.contains("ttft_us") && table.contains("kv_hit_bp"),
        "{table}"
    );
    assert_eq!(m.quantiles()[2].1.p50, 64);
    // Off: nothing to read, and lifecycle calls still work.
    let off = router(RouterConfig::default());
    assert!(off.request_metrics().is_none());
}

/// The predicted cached tokens are what an engine reports: every held block whatever its
/// tier, less the prompt's last token, which is always computed.
#[test]
fn predicted_cached_tokens_count_held_blocks_and_leave_the_last_token() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let t = tokens(64);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    // Three blocks on the device, the fourth on the host.
    store(
        &r,
        WorkerRank::new(1, 0),
        StorageTier::Device,
        &locals[..3],
        0,
    );
    let mut q = req(1, &t);
    q.hints.mode = Mode::QueryOnly;
    let d = r.route(&q).unwrap();
    assert_eq!(d.overlap.blocks, 3);
    assert_eq!(d.predicted_cached_tokens, 48);
    // All four held: the index's overlap is the whole prompt, the engine computes its last
    // token again, so it reports three blocks.
    let parent = BlockHash(1000 * (StorageTier::Device as u64 + 1) + 2);
    r.apply_event(&KvEvent {
        header: EventHeader {
            source: WorkerRank::new(1, 0),
            event_id: EventId(1),
            tier: StorageTier::HostPinned,
        },
        data: KvEventData::Stored {
            parent: Some(parent),
            blocks: vec![StoredBlock {
                block_hash: BlockHash(9_000),
                local_hash: locals[3],
            }],
        },
    })
    .unwrap();
    let d = r.route(&q).unwrap();
    assert_eq!(d.overlap.blocks, 4);
    assert!(
        d.overlap.cached_tokens < 64,
        "the host block is weighted: {d:?}"
    );
    assert_eq!(d.predicted_cached_tokens, 48);
    // A one-token prompt predicts nothing.
    let one = [7];
    let mut q = req(2, &one);
    q.hints.mode = Mode::QueryOnly;
    assert_eq!(r.route(&q).unwrap().predicted_cached_tokens, 0);
}

/// `held_blocks` is the deepest of the index's overlaps (any tier, any rank) and the prompts
/// active on one rank, in whole blocks of the tokens given, under the request's seed.
#[test]
fn held_blocks_is_the_deepest_match_anywhere() {
    let r = router(RouterConfig::default());
    for w in 1..=3 {
        r.join_worker(WorkerConfig::simple(w, 1000, BS)).unwrap();
    }
    let t = tokens(10 * BS as usize + 5);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    let none = RouteHints::default();
    assert_eq!(r.held_blocks(&t, &none), 0);
    assert_eq!(r.held_blocks(&[], &none), 0);
    store(
        &r,
        WorkerRank::new(1, 0),
        StorageTier::Device,
        &locals[..3],
        1,
    );
    store(
        &r,
        WorkerRank::new(2, 0),
        StorageTier::HostPinned,
        &locals[..4],
        2,
    );
    assert_eq!(r.held_blocks(&t, &none), 4);
    // Fewer full blocks given than held: those.
    assert_eq!(r.held_blocks(&t[..2 * BS as usize + 3], &none), 2);
    // Another seed names other blocks.
    let salted = RouteHints {
        cache_salt: Some("tenant"),
        ..RouteHints::default()
    };
    assert_eq!(r.held_blocks(&t, &salted), 0);
    // A prompt active on worker 3 (routed there, not yet stored) holds its blocks.
    let mut q = req(1, &t[..7 * BS as usize]);
    q.hints.pinned.backend_instance = Some(WorkerId(3));
    r.route(&q).unwrap();
    assert_eq!(r.held_blocks(&t, &none), 7);
    r.free(RequestId(1)).unwrap();
    assert_eq!(r.held_blocks(&t, &none), 4);
}

/// A prompt given in part with its whole length books the whole length's prefill and
/// blocks, predicts no more than the whole length allows, and frees it all.
#[test]
fn a_prompt_given_in_part_books_its_whole_length() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let t = tokens(3 * BS as usize + 4);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    store(
        &r,
        WorkerRank::new(1, 0),
        StorageTier::Device,
        &locals[..2],
        1,
    );
    let whole = 40 * u64::from(BS) + 9;
    let mut q = req(1, &t);
    q.hints.prompt_len = Some(whole);
    assert_eq!(q.prompt_tokens(), whole);
    let d = r.route(&q).unwrap();
    assert_eq!(d.overlap.blocks, 2);
    assert_eq!(d.overlap.cached_tokens, 2 * u64::from(BS));
    // Predicted: the overlap (nothing of it was active before this route).
    assert_eq!(d.predicted_cached_tokens, 2 * u64::from(BS));
    let load = r.load(WorkerRank::new(1, 0)).unwrap();
    assert_eq!(load.prefill_tokens, whole - 2 * u64::from(BS));
    assert_eq!(load.prompt_blocks, whole.div_ceil(u64::from(BS)));
    assert_eq!(load.requests, 1);
    r.free(RequestId(1)).unwrap();
    assert_eq!(r.load(WorkerRank::new(1, 0)).unwrap(), LoadView::default());

    // A length below the tokens given is ignored.
    let mut q = req(2, &t);
    q.hints.prompt_len = Some(5);
    assert_eq!(q.prompt_tokens(), t.len() as u64);
    r.route(&q).unwrap();
    let load = r.load(WorkerRank::new(1, 0)).unwrap();
    assert_eq!(load.prefill_tokens, t.len() as u64 - 2 * u64::from(BS));
    assert_eq!(load.prompt_blocks, 4);
    r.free(RequestId(2)).unwrap();
    assert_eq!(r.load(WorkerRank::new(1, 0)).unwrap(), LoadView::default());

    // A length past any model's is refused and counted, and books nothing.
    let mut q = req(3, &t);
    q.hints.prompt_len = Some((1 << 32) + 1);
    assert!(matches!(
        r.route(&q),
        Err(RouteError::InvalidHint {
            field: "prompt_len",
            ..
        })
    ));
    assert!(r.submit(&q).is_err());
    assert_eq!(r.counts().invalid_hints, 2);
    assert_eq!(r.load(WorkerRank::new(1, 0)).unwrap(), LoadView::default());
}

/// More tokens matter while every full block given is held somewhere, and, under
/// prefix-hash, until the blocks its key covers are given.
#[test]
fn more_tokens_are_needed_while_held_or_short_of_the_key() {
    let r = router(RouterConfig::default());
    r.join_worker(WorkerConfig::simple(1, 1000, BS)).unwrap();
    let t = tokens(6 * BS as usize);
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    store(
        &r,
        WorkerRank::new(1, 0),
        StorageTier::Device,
        &locals[..2],
        1,
    );
    let none = RouteHints::default();
    let blocks = |n: usize| &t[..n * BS as usize];
    assert!(r.needs_more_tokens(&t[..5], &none), "no full block yet");
    assert!(r.needs_more_tokens(blocks(2), &none));
    assert!(!r.needs_more_tokens(blocks(3), &none));

    let keyed = router(RouterConfig {
        policy: Policy::PrefixHash {
            prefix_blocks: 4,
            load_factor: 1.25,
        },
        ..RouterConfig::default()
    });
    keyed
        .join_worker(WorkerConfig::simple(1, 1000, BS))
        .unwrap();
    assert!(keyed.needs_more_tokens(blocks(3), &none));
    assert!(!keyed.needs_more_tokens(blocks(4), &none));
}

/// A prefix every rank holds, and one rank holding more past it: the deepest is that rank's,
/// whatever the lengths (a system prompt shared by all, a conversation on one).
#[test]
fn held_blocks_sees_past_a_prefix_every_rank_holds() {
    for (shared, deep) in [(3usize, 9usize), (32, 300), (1, 64), (64, 65)] {
        let r = router(RouterConfig::default());
        for w in 1..=3 {
            r.join_worker(WorkerConfig::simple(w, 10_000, BS)).unwrap();
        }
        let t = tokens((deep + 4) * BS as usize);
        let locals = BlockHasher::new(BS as usize).local_hashes(&t);
        for w in [1u64, 3] {
            store(
                &r,
                WorkerRank::new(w, 0),
                StorageTier::Device,
                &locals[..shared],
                w,
            );
        }
        store(
            &r,
            WorkerRank::new(2, 0),
            StorageTier::Device,
            &locals[..deep],
            10,
        );
        let none = RouteHints::default();
        assert_eq!(r.held_blocks(&t, &none), deep as u32, "{shared}, {deep}");
        assert!(r.needs_more_tokens(&t[..deep * BS as usize], &none));
        assert!(!r.needs_more_tokens(&t[..(deep + 1) * BS as usize], &none));
    }
}

/// `held_blocks` called over and over on one thread, with prompts that share a first run
/// (a system prompt every rank holds) and go on to conversations on one rank each: each
/// answer is that conversation's depth.
#[test]
fn held_blocks_answers_each_prompt_of_a_stream() {
    let r = router(RouterConfig::default());
    for w in 1..=3 {
        r.join_worker(WorkerConfig::simple(w, 100_000, BS)).unwrap();
    }
    let system: Vec<u32> = (0..32 * BS).map(|i| i * 7 + 1).collect();
    let prompt = |c: u32, blocks: u32| -> Vec<u32> {
        let own = (0..blocks * BS).map(move |i| 1_000_000 * (c + 1) + i);
        system.iter().copied().chain(own).collect()
    };
    let hasher = BlockHasher::new(BS as usize);
    let mut id = 0;
    for c in 0..30u32 {
        let t = prompt(c, 5 + c * 3);
        let locals = hasher.local_hashes(&t);
        id += 1;
        // Block names of their own (the engine's), as every chain has.
        let blocks = locals
            .iter()
            .enumerate()
            .map(|(i, h)| StoredBlock {
                block_hash: BlockHash(id * 100_000 + i as u64),
                local_hash: *h,
            })
            .collect();
        r.apply_event(&KvEvent {
            header: EventHeader {
                source: WorkerRank::new(u64::from(c % 3) + 1, 0),
                event_id: EventId(id),
                tier: StorageTier::Device,
            },
            data: KvEventData::Stored {
                parent: None,
                blocks,
            },
        })
        .unwrap();
    }
    let none = RouteHints::default();
    for round in 0..3 {
        for c in 0..30u32 {
            let mut t = prompt(c, 5 + c * 3);
            let held = t.len() as u32 / BS;
            // New blocks after the conversation.
            t.extend((0..4 * BS).map(|i| 7_000_000 + i + round));
            assert_eq!(
                r.held_blocks(&t, &none),
                held,
                "round {round}, conversation {c}"
            );
            assert!(r.needs_more_tokens(&t[..held as usize * BS as usize], &none));
            assert!(!r.needs_more_tokens(&t, &none));
        }
    }
}

/// An embedder's own policy, as a user of the public `Selector` trait writes it: the candidate
/// of the highest worker id (say, the newest machines), counting its calls.
#[derive(Debug, Default)]
struct NewestWorker {
    asked: std::sync::atomic::AtomicU64,
}

impl kvroute_core::Selector for NewestWorker {
    fn select(&self, input: &kvroute_core::SelectInput<'_>, _rng: &mut kvroute_core::Rng) -> usize {
        self.asked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let worker = |i: usize| {
            input.ranks[input.candidates[i].fleet_index as usize]
                .rank
                .worker
        };
        (0..input.candidates.len())
            .max_by_key(|&i| worker(i))
            .unwrap_or(0)
    }
}

#[test]
fn an_embedder_adds_a_policy_through_the_public_selector_trait() {
    use kvroute_core::{DecidedBy, PolicyKind};
    #[derive(Debug)]
    struct Shared(std::sync::Arc<NewestWorker>);
    impl kvroute_core::Selector for Shared {
        fn select(&self, i: &kvroute_core::SelectInput<'_>, rng: &mut kvroute_core::Rng) -> usize {
            self.0.select(i, rng)
        }
    }
    let selector = std::sync::Arc::new(NewestWorker::default());
    let r = router(RouterConfig::default()).with_selector(Box::new(Shared(selector.clone())));
    for w in 0..3u64 {
        r.join_worker(WorkerConfig::simple(w, 400, BS)).unwrap();
    }
    // The KV-aware cost would spread these over the idle workers; the custom policy does not.
    for id in 0..4u32 {
        let t: Vec<u32> = (0..64).map(|i| 10_000 * id + i).collect();
        let d = r.route(&req(u64::from(id), &t)).unwrap();
        assert_eq!(d.worker, WorkerRank::new(2, 0), "request {id}");
        assert_eq!(d.decided_by, DecidedBy::Policy(PolicyKind::Custom));
    }
    assert_eq!(selector.asked.load(std::sync::atomic::Ordering::Relaxed), 4);
}

#[test]
fn the_decode_phase_drops_the_requests_credit_but_keeps_its_temperature() {
    let t = tokens(64);
    let r = router(RouterConfig::default());
    for id in [1, 2] {
        r.join_worker(WorkerConfig {
            role: WorkerRole::Decode,
            ..WorkerConfig::simple(id, 1000, BS)
        })
        .unwrap();
    }
    // Worker 1 holds the prompt and runs a long request: worker 2 is the cheaper decode.
    let locals = BlockHasher::new(BS as usize).local_hashes(&t);
    store(&r, WorkerRank::new(1, 0), StorageTier::Device, &locals, 0);
    let long = tokens(2_000);
    let mut busy = req(100, &long);
    busy.hints.pinned.backend_instance = Some(WorkerId(1));
    busy.hints.phase = Phase::Decode;
    r.route(&busy).unwrap();
    let decode = |id: u64, overrides: Overrides| {
        let mut q = req(id, &t);
        q.hints.phase = Phase::Decode;
        q.hints.mode = Mode::QueryOnly;
        q.hints.overrides = overrides;
        r.route(&q).unwrap()
    };
    // A client's overlap credit earns nothing in decode.
    let credit = Overrides {
        overlap_credit: Some(50.0),
        ..Overrides::default()
    };
    let d = decode(1, credit);
    assert_eq!((d.worker.worker, d.cost.credit_blocks), (WorkerId(2), 0.0));
    // Its temperature is kept: the choice is sampled, and both workers come up.
    let hot = Overrides {
        temperature: Some(1e6),
        ..Overrides::default()
    };
    let chosen: std::collections::HashSet<u64> = (0..64)
        .map(|i| decode(10 + i, hot).worker.worker.0)
        .collect();
    assert_eq!(chosen.len(), 2, "sampled at the client's temperature");
    // At the configured temperature (0), always the cheaper one.
    assert!((0..16).all(|i| decode(200 + i, Overrides::default()).worker.worker == WorkerId(2)));
}
