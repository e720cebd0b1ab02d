use super::policy::{CacheThreshold, KvAware, PowerOfTwo, PrefixHash, RandomPick, RoundRobin};
use super::*;
use crate::config::Affinity;
use crate::config::BusyThresholds;
use crate::config::Policy;
use crate::config::RouterConfig;
use crate::event::WorkerRank;
use crate::health::Health;
use crate::load::LoadView;
use crate::registry::RankEntry;
use crate::registry::WorkerConfig;
use crate::rng::Rng;

/// The reference router's weights (overlap credit 1, prefill load scale 1), which the
/// arithmetic below is worked out in.
fn weights() -> Weights {
    let reference = RouterConfig {
        overlap_credit: 1.0,
        prefill_load_scale: 1.0,
        ..RouterConfig::default()
    };
    Weights::new(&reference, &Overrides::default())
}

fn shape(tokens: u64) -> RequestShape {
    RequestShape {
        tokens,
        blocks: tokens.div_ceil(16),
        full_blocks: (tokens / 16) as u32,
        prefix_key: Some(42),
    }
}

/// Ranks `i/0` for `i` in `0..8`, where the candidates' fleet indices point.
fn ranks() -> &'static [RankEntry] {
    static RANKS: std::sync::OnceLock<Vec<RankEntry>> = std::sync::OnceLock::new();
    RANKS.get_or_init(|| {
        (0..8)
            .map(|i| RankEntry {
                rank: WorkerRank::new(i, 0),
                worker: i as usize,
                role: crate::registry::WorkerRole::Aggregated,
                label_bits: 0,
                index_key: None,
                state: std::sync::Arc::new(crate::load::RankState::new(WorkerRank::new(i, 0))),
            })
            .collect()
    })
}

fn cand(i: usize, load: LoadView, per_tier: [u32; 4], s: &RequestShape) -> Scored {
    Scored {
        fleet_index: i as u32,
        overlap_blocks: per_tier.iter().sum(),
        busy: Busy::Free,
        health: Health::Healthy,
        shared_blocks: 0,
        cost: CostTerms::total_of(
            &weights(),
            s,
            &load,
            CostTerms::credit_of(&weights(), &per_tier),
            0,
        ),
        load,
    }
}

#[test]
fn count_conversion_is_the_plain_cast_below_two_to_the_63() {
    let mut rng = Rng::new(5);
    let edge = [0, 1, (1 << 53) + 1, i64::MAX as u64 - 1, i64::MAX as u64];
    for x in edge
        .into_iter()
        .chain((0..10_000).map(|_| (rng.next_u64() >> 1) >> rng.below(63)))
    {
        assert_eq!(count_f64(x).to_bits(), (x as f64).to_bits(), "{x}");
    }
    // Past every count the router can reach, it saturates at 2⁶³.
    for x in [i64::MAX as u64 + 1, u64::MAX] {
        assert_eq!(count_f64(x), 2f64.powi(63), "{x}");
    }
}

/// The selection's cost total and the full cost terms agree to the bit, at a power-of-two
/// block size (multiplied by its reciprocal) and at another (divided), and the full record
/// rebuilt from a scored rank carries the same numbers.
#[test]
fn scored_total_equals_the_full_cost_terms() {
    let mut rng = Rng::new(11);
    let configs = [
        Overrides::default(),
        Overrides {
            overlap_credit: Some(0.3),
            prefill_load_scale: Some(1.7),
            temperature: None,
        },
    ];
    for (o, bs) in configs.into_iter().zip([16, 24]) {
        let w = Weights {
            block_size: bs,
            ..Weights::new(&RouterConfig::default(), &o)
        };
        for _ in 0..10_000 {
            let s = shape(1 + rng.below(20_000));
            let output_blocks = rng.below(500);
            let load = LoadView {
                prefill_tokens: rng.below(50_000),
                prompt_blocks: rng.below(3_000),
                output_blocks,
                output_decay: if rng.below(2) == 0 {
                    0
                } else {
                    rng.below(output_blocks * crate::load::DECAY_SCALE + 1)
                },
                prompt_decay: 0,
                requests: rng.below(40),
                context_blocks: rng.below(6_000),
            };
            let per_tier = std::array::from_fn(|_| rng.below(400) as u32);
            let shared = rng.below(u64::from(s.full_blocks) + 1) as u32;
            let full = CostTerms::new(&w, &s, &load, &per_tier, shared);
            let total =
                CostTerms::total_of(&w, &s, &load, CostTerms::credit_of(&w, &per_tier), shared);
            assert_eq!(full.total.to_bits(), total.to_bits());
            let scored = Scored {
                fleet_index: 3,
                overlap_blocks: per_tier.iter().sum(),
                busy: Busy::Free,
                health: Health::Healthy,
                shared_blocks: shared,
                cost: total,
                load,
            };
            let c = Candidate::from_scored(&scored, WorkerRank::new(3, 0), per_tier, &w, &s);
            assert_eq!(c.cost, full);
            assert_eq!(c.overlap, Overlap::new(per_tier, &w, &s));
            assert_eq!((c.load, c.fleet_index), (load, 3));
        }
    }
}

/// The reference's tier-weighted estimate.
#[test]
fn tier_weighted_estimate_matches_the_reference() {
    let s = shape(160);
    let w = weights();
    let first = Overlap::new([2, 1, 2, 0], &w, &s);
    let second = Overlap::new([0, 1, 0, 0], &w, &s);
    assert_eq!(first.effective_blocks, 3.25);
    assert_eq!(first.cached_tokens, 52);
    assert_eq!(first.blocks, 5);
    assert_eq!(second.effective_blocks, 0.75);
    assert_eq!(second.cached_tokens, 12);
}

#[test]
fn cost_is_prefill_after_credit_plus_decode() {
    let s = shape(160); // 10 blocks
    let load = LoadView {
        prefill_tokens: 32,
        prompt_blocks: 5,
        output_blocks: 1,
        requests: 1,
        ..LoadView::default()
    };
    let c = CostTerms::new(&weights(), &s, &load, &[4, 2, 0, 0], 0);
    assert_eq!(c.prefill_blocks, 12.0);
    assert_eq!(c.credit_blocks, 5.5);
    assert_eq!(c.prefill_cost, 6.5);
    assert_eq!(c.decode_cost, 16.0);
    assert_eq!(c.total, 22.5);
    // Credit never makes prefill negative.
    let c = CostTerms::new(
        &weights(),
        &shape(16),
        &LoadView::default(),
        &[10, 0, 0, 0],
        0,
    );
    assert_eq!(c.prefill_cost, 0.0);
}

#[test]
fn overrides_change_credit_and_scale_and_bad_ones_are_dropped() {
    let o = Overrides {
        overlap_credit: Some(0.0),
        prefill_load_scale: Some(2.0),
        temperature: Some(f64::NAN),
    }
    .sanitized();
    assert_eq!(o.temperature, None);
    let w = Weights::new(&RouterConfig::default(), &o);
    let c = CostTerms::new(&w, &shape(160), &LoadView::default(), &[4, 0, 0, 0], 0);
    assert_eq!(c.credit_blocks, 0.0);
    assert_eq!(c.prefill_cost, 20.0);
}

#[test]
fn kv_aware_picks_the_cheapest_and_breaks_ties_at_random() {
    let s = shape(160);
    let idle = LoadView::default();
    let cands = [
        cand(0, idle, [0; 4], &s),
        cand(1, idle, [6, 0, 0, 0], &s),
        cand(2, idle, [0; 4], &s),
    ];
    let input = SelectInput {
        candidates: &cands,
        ranks: ranks(),
        shape: &s,
        block_size: 16,
        temperature: 0.0,
        near_tie: 0.0,
    };
    let mut rng = Rng::new(1);
    for _ in 0..20 {
        assert_eq!(KvAware.select(&input, &mut rng), 1);
    }
    // Without overlap all three tie: each must be chosen sometimes.
    let cands = [
        cand(0, idle, [0; 4], &s),
        cand(1, idle, [0; 4], &s),
        cand(2, idle, [0; 4], &s),
    ];
    let input = SelectInput {
        candidates: &cands,
        ..input
    };
    let mut seen = [0; 3];
    for _ in 0..3000 {
        seen[KvAware.select(&input, &mut rng)] += 1;
    }
    for n in seen {
        assert!((800..1200).contains(&n), "{seen:?}");
    }
}

#[test]
fn near_ties_are_drawn_evenly_and_nothing_past_the_share_is() {
    let s = shape(160);
    let load = |blocks: u64| LoadView {
        prompt_blocks: blocks,
        ..LoadView::default()
    };
    // Costs c, c + 1 block, and far above: with a share covering one block, the first two
    // are drawn about evenly and the third never; with no share, only the cheapest.
    let cands = [
        cand(0, load(40), [0; 4], &s),
        cand(1, load(41), [0; 4], &s),
        cand(2, load(400), [0; 4], &s),
    ];
    let (c0, c1) = (cands[0].cost, cands[1].cost);
    assert!(c1 > c0);
    let mut input = SelectInput {
        candidates: &cands,
        ranks: ranks(),
        shape: &s,
        block_size: 16,
        temperature: 0.0,
        near_tie: 0.0,
    };
    let mut rng = Rng::new(5);
    for _ in 0..50 {
        assert_eq!(KvAware.select(&input, &mut rng), 0);
    }
    input.near_tie = 1.5 * (c1 - c0) / c0;
    let mut seen = [0; 3];
    for _ in 0..4000 {
        seen[KvAware.select(&input, &mut rng)] += 1;
    }
    assert_eq!(seen[2], 0, "{seen:?}");
    assert!((1700..2300).contains(&seen[0]), "{seen:?}");
}

#[test]
fn softmax_prefers_cheap_and_still_explores() {
    let s = shape(160);
    let busy = LoadView {
        prompt_blocks: 100,
        ..LoadView::default()
    };
    let cands = [
        cand(0, LoadView::default(), [0; 4], &s),
        cand(1, busy, [0; 4], &s),
    ];
    let input = SelectInput {
        candidates: &cands,
        ranks: ranks(),
        shape: &s,
        block_size: 16,
        temperature: 0.5,
        near_tie: 0.0,
    };
    let mut rng = Rng::new(3);
    let mut seen = [0u32; 2];
    for _ in 0..10_000 {
        seen[KvAware.select(&input, &mut rng)] += 1;
    }
    // p(cheap) = 1 / (1 + e^-2) ≈ 0.881.
    assert!((8_600..9_000).contains(&seen[0]), "{seen:?}");
}

#[test]
fn busy_ranks_leave_selection_unless_all_are_busy() {
    let w = WorkerConfig::simple(0, 100, 16);
    let t = BusyThresholds {
        decode_blocks_fraction: Some(0.5),
        prefill_tokens_fraction: Some(0.5),
    };
    let heavy = LoadView {
        prompt_blocks: 51,
        ..LoadView::default()
    };
    let prefill_heavy = LoadView {
        prefill_tokens: 4097,
        ..LoadView::default()
    };
    assert_eq!(Busy::of(&heavy, &w, &t), Busy::Busy);
    assert_eq!(Busy::of(&prefill_heavy, &w, &t), Busy::Busy);
    assert_eq!(Busy::of(&LoadView::default(), &w, &t), Busy::Free);
    assert_eq!(Busy::of(&heavy, &w, &BusyThresholds::default()), Busy::Free);

    let s = shape(16);
    let mut a = cand(0, heavy, [0; 4], &s);
    a.busy = Busy::Busy;
    let b = cand(1, LoadView::default(), [0; 4], &s);
    let mut v = vec![a, b];
    assert_eq!(filter_busy(&mut v), BusyOutcome::Filtered);
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].fleet_index, 1);
    let mut v = vec![a, a];
    assert_eq!(filter_busy(&mut v), BusyOutcome::AllBusy);
    assert_eq!(v.len(), 2);
}

#[test]
fn marked_ranks_leave_selection_unless_all_are_marked() {
    let s = shape(16);
    let mk = |i: usize, h: Health| Scored {
        health: h,
        ..cand(i, LoadView::default(), [0; 4], &s)
    };
    let mut v = vec![
        mk(0, Health::Unreachable),
        mk(1, Health::Healthy),
        mk(2, Health::Wedged),
        mk(3, Health::Wedged),
    ];
    assert_eq!(
        filter_unhealthy(&mut v),
        HealthOutcome::Filtered {
            unreachable: 1,
            wedged: 2
        }
    );
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].fleet_index, 1);
    let mut v = vec![mk(0, Health::Unreachable), mk(1, Health::Wedged)];
    assert_eq!(filter_unhealthy(&mut v), HealthOutcome::AllVetoed);
    assert_eq!(v.len(), 2);
    let mut empty = Vec::new();
    assert_eq!(
        filter_unhealthy(&mut empty),
        HealthOutcome::Filtered {
            unreachable: 0,
            wedged: 0
        }
    );
}

fn loads(ls: &[u64]) -> Vec<Scored> {
    let s = shape(160);
    ls.iter()
        .enumerate()
        .map(|(i, &l)| {
            cand(
                i,
                LoadView {
                    prompt_blocks: l,
                    ..LoadView::default()
                },
                [0; 4],
                &s,
            )
        })
        .collect()
}

fn input<'a>(c: &'a [Scored], s: &'a RequestShape) -> SelectInput<'a> {
    SelectInput {
        candidates: c,
        ranks: ranks(),
        shape: s,
        block_size: 16,
        temperature: 0.0,
        near_tie: 0.0,
    }
}

#[test]
fn round_robin_random_least_loaded_power_of_two() {
    let s = shape(160);
    let c = loads(&[5, 1, 3]);
    let mut rng = Rng::new(9);
    let rr = RoundRobin::default();
    let picks: Vec<usize> = (0..6)
        .map(|_| rr.select(&input(&c, &s), &mut rng))
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    assert_eq!(LeastLoaded.select(&input(&c, &s), &mut rng), 1);
    let mut seen = [0; 3];
    for _ in 0..3000 {
        seen[RandomPick.select(&input(&c, &s), &mut rng)] += 1;
        // Power of two never picks the most loaded of three (it always loses its pair).
        assert_ne!(PowerOfTwo.select(&input(&c, &s), &mut rng), 0);
    }
    assert!(seen.iter().all(|&n| n > 800), "{seen:?}");
    let one = loads(&[7]);
    assert_eq!(PowerOfTwo.select(&input(&one, &s), &mut rng), 0);
}

#[test]
fn prefix_hash_is_sticky_and_spills_over_its_load_bound() {
    let s = shape(160);
    let c = loads(&[0, 0, 0, 0]);
    let p = PrefixHash { load_factor: 1.25 };
    let mut rng = Rng::new(1);
    let home = p.select(&input(&c, &s), &mut rng);
    for _ in 0..10 {
        assert_eq!(p.select(&input(&c, &s), &mut rng), home);
    }
    // Removing another rank does not move the prefix.
    let fewer: Vec<Scored> = c
        .iter()
        .copied()
        .filter(|x| x.fleet_index as usize != (home + 1) % 4)
        .collect();
    let at = p.select(&input(&fewer, &s), &mut rng);
    assert_eq!(fewer[at].fleet_index as usize, home);
    // Overloading the home rank moves the prefix elsewhere.
    let mut hot = c.clone();
    hot[home].load.prompt_blocks = 100;
    assert_ne!(p.select(&input(&hot, &s), &mut rng), home);
}

#[test]
fn cache_threshold_takes_the_match_only_when_good_and_balanced() {
    let s = shape(160); // 10 blocks
    let mk = |loads: [u64; 2], overlap: [u32; 2]| -> Vec<Scored> {
        (0..2)
            .map(|i| {
                cand(
                    i,
                    LoadView {
                        prompt_blocks: loads[i],
                        ..LoadView::default()
                    },
                    [overlap[i], 0, 0, 0],
                    &s,
                )
            })
            .collect()
    };
    let p = CacheThreshold {
        min_match_ratio: 0.5,
        balance_abs: 4,
        balance_rel: 1.5,
    };
    let mut rng = Rng::new(2);
    assert_eq!(p.select(&input(&mk([3, 0], [8, 0]), &s), &mut rng), 0);
    // Match ratio too low: least loaded.
    assert_eq!(p.select(&input(&mk([3, 0], [2, 0]), &s), &mut rng), 1);
    // Unbalanced: least loaded.
    assert_eq!(p.select(&input(&mk([30, 0], [8, 0]), &s), &mut rng), 1);
}

#[test]
fn every_policy_has_a_selector() {
    let kinds = [
        (Policy::KvAware, PolicyKind::KvAware),
        (Policy::RoundRobin, PolicyKind::RoundRobin),
        (Policy::Random, PolicyKind::Random),
        (Policy::LeastLoaded, PolicyKind::LeastLoaded),
        (Policy::PowerOfTwo, PolicyKind::PowerOfTwo),
        (
            Policy::PrefixHash {
                prefix_blocks: 2,
                load_factor: 1.25,
            },
            PolicyKind::PrefixHash,
        ),
        (
            Policy::CacheThreshold {
                min_match_ratio: 0.5,
                balance_abs: 1,
                balance_rel: 1.5,
            },
            PolicyKind::CacheThreshold,
        ),
    ];
    for (p, k) in kinds {
        assert_eq!(selector_for(p).kind(), k);
    }
}

/// Decode load counts the prompt blocks already active on the rank once, and output
/// blocks at their decayed weight; capacity (`decode_blocks`) still counts every block.
#[test]
fn decode_term_subtracts_shared_blocks_and_weighs_decayed_output() {
    let s = shape(160); // 10 blocks, all full
    let load = LoadView {
        prompt_blocks: 6,
        output_blocks: 4,
        output_decay: 3 * crate::load::DECAY_SCALE / 2,
        ..LoadView::default()
    };
    let c = CostTerms::new(&weights(), &s, &load, &[0; 4], 6);
    assert_eq!(c.shared_blocks, 6);
    assert_eq!(c.decode_cost, 6.0 + 2.5 + (10.0 - 6.0));
    assert_eq!(load.decode_blocks(), 10);
    let undecayed = LoadView {
        output_decay: 0,
        ..load
    };
    assert_eq!(
        CostTerms::new(&weights(), &s, &undecayed, &[0; 4], 0).decode_cost,
        20.0
    );
}

fn scored(i: u32, cost: f64, prompt_blocks: u64, busy: Busy) -> Scored {
    Scored {
        fleet_index: i,
        overlap_blocks: 0,
        busy,
        health: Health::Healthy,
        shared_blocks: 0,
        cost,
        load: LoadView {
            prompt_blocks,
            ..LoadView::default()
        },
    }
}

#[test]
fn shared_probes_go_only_where_the_cost_could_reach_the_cheapest() {
    let mut out = [0; SHARED_PROBES];
    let c = [
        scored(0, 100.0, 0, Busy::Free),  // nothing active: nothing to share
        scored(1, 130.0, 40, Busy::Free), // bound 130 - 10 = 120 > 100
        scored(2, 105.0, 40, Busy::Free), // bound 95
        scored(3, 101.0, 3, Busy::Free),  // bound 98
        scored(4, 50.0, 40, Busy::Busy),  // busy: leaves selection
    ];
    let n = shared_probe_targets(&c, 10, &mut out);
    assert_eq!(&out[..n], &[2, 3], "lowest bound first");
    assert_eq!(shared_probe_targets(&c, 0, &mut out), 0, "no full block");
    let all_busy = [scored(0, 10.0, 40, Busy::Busy)];
    assert_eq!(shared_probe_targets(&all_busy, 10, &mut out), 0);
    // Many qualify: the SHARED_PROBES lowest bounds are kept.
    let many: Vec<Scored> = (0..40)
        .map(|i| scored(i, 100.0 + f64::from(i % 20), 50, Busy::Free))
        .collect();
    let n = shared_probe_targets(&many, 30, &mut out);
    assert_eq!(n, SHARED_PROBES);
    let mut picked: Vec<f64> = out.iter().map(|&i| many[i as usize].cost).collect();
    assert!(picked.windows(2).all(|w| w[0] <= w[1]), "{picked:?}");
    picked.dedup();
    assert_eq!(picked, vec![100.0, 101.0, 102.0, 103.0]);
}

/// A floor above the bar over the cheapest cost clears it by the margin, whatever the
/// signs and sizes (preferences make costs negative), and the bar refuses nothing while
/// pruning is off or before a cost is seen.
#[test]
fn the_bar_keeps_the_margin() {
    let mut rng = Rng::new(9);
    let value = |rng: &mut Rng| {
        let scale = [1e-3, 0.5, 1.0, 3.0, 1e3, 1e7][rng.below(6) as usize];
        (rng.unit_f64() * 2.0 - 1.0) * scale
    };
    for _ in 0..200_000 {
        let c = value(&mut rng);
        let mut t = ProbeTargets::new(64).pruning(true);
        assert!(!t.cannot_win(f64::MAX));
        t.offer(0, &scored(0, c, 0, Busy::Free));
        for f in [
            value(&mut rng),
            c + value(&mut rng) * 1e-8,
            c + 1e-12 * c.abs(),
        ] {
            if t.cannot_win(f) {
                assert!(f - 1e-9 * f.abs().max(1.0) > c, "{f} against {c}");
            }
        }
        let mut off = ProbeTargets::new(64);
        off.offer(0, &scored(0, c, 0, Busy::Free));
        assert!(!off.cannot_win(f64::MAX));
    }
}

/// The floor under a rank's probe bound, from its credit alone, is at most the bound that
/// offering the rank computes, for every load (decays, booked prefill, active prompts and
/// output), weight and shape, up to rounding that the margin `cannot_win` leaves covers
/// a thousand times over; and the credit it takes to reach a cheapest cost at or above
/// the bound is never more than the rank's.
#[test]
fn the_bound_floor_never_exceeds_the_bound() {
    let mut rng = Rng::new(5);
    let pick = |rng: &mut Rng, v: &[f64]| v[rng.below(v.len() as u64) as usize];
    for _ in 0..50_000 {
        let bs = [1u32, 3, 16, 64][rng.below(4) as usize];
        let mut w = weights();
        w.block_size = bs;
        w.prefill_load_scale = pick(&mut rng, &[0.0, 0.3, 1.0, 2.7]);
        w.credits = std::array::from_fn(|_| pick(&mut rng, &[0.0, 0.25, 0.75, 1.0, 1.3]));
        let tokens = 1 + rng.below(20_000);
        let s = RequestShape {
            tokens,
            blocks: tokens.div_ceil(u64::from(bs)),
            full_blocks: (tokens / u64::from(bs)) as u32,
            prefix_key: None,
        };
        let affinity = Affinity {
            from_share: pick(&mut rng, &[0.0, 0.3, 0.7, 0.95]),
            boost: pick(&mut rng, &[0.0, 1.0, 4.0, 30.0]),
        };
        let w = w.for_prompt(&affinity, s.full_blocks);
        let per_tier: [u32; 4] =
            std::array::from_fn(|_| rng.below(u64::from(s.full_blocks) / 2 + 1) as u32);
        let credit = CostTerms::credit_of(&w, &per_tier);
        let big = |rng: &mut Rng| {
            if rng.below(3) == 0 {
                0
            } else {
                rng.below(50_000)
            }
        };
        let load = LoadView {
            prefill_tokens: big(&mut rng),
            prompt_blocks: big(&mut rng),
            output_blocks: big(&mut rng),
            output_decay: big(&mut rng) * 64,
            prompt_decay: big(&mut rng) * 64,
            requests: 1,
            context_blocks: big(&mut rng),
        };
        let cost = CostTerms::total_of(&w, &s, &load, credit, 0);
        let room = load.prompt_blocks.min(u64::from(s.full_blocks));
        let bound = cost - count_f64(room);
        // Any floor under the rank's booked prefill: none, all of it, or part.
        let booked = match rng.below(3) {
            0 => 0,
            1 => load.prefill_tokens,
            _ => rng.below(load.prefill_tokens + 1),
        };
        let floor = CostTerms::bound_floor(&w, &s, credit, load.prompt_decay != 0, booked);
        // Above the bound by rounding alone: far inside the margin.
        let slack = 1e-12 * bound.abs().max(1.0);
        assert!(
            floor <= bound + slack,
            "{floor} > {bound}: {w:?} {s:?} {load:?} {per_tier:?}"
        );
        let mut t = ProbeTargets::new(s.full_blocks).pruning(true);
        t.offer(0, &scored(0, bound, 0, Busy::Free));
        assert!(!t.cannot_win(floor), "the bound itself is the cheapest");
        // Nor does the bar on the credit keep it out, at that cheapest cost or above.
        for cheapest in [bound, bound + 1.0, bound * 1.5] {
            let need = CostTerms::credit_needed(&w, &s, cheapest, load.prompt_decay != 0, booked);
            assert!(
                credit >= need,
                "{credit} < {need} at {cheapest}: {w:?} {s:?} {load:?}"
            );
        }
    }
}

/// The one-pass accumulator equals the literal rule: every free candidate with active
/// prompt blocks whose bound is at most the cheapest free cost, sorted by bound, the first
/// SHARED_PROBES kept (bounds compared, as ties may keep either index).
#[test]
fn probe_targets_equal_the_literal_rule() {
    let mut rng = Rng::new(21);
    let mut out = [0; SHARED_PROBES];
    for _ in 0..2_000 {
        let n = 1 + rng.below(40) as usize;
        let full = rng.below(30) as u32;
        let c: Vec<Scored> = (0..n)
            .map(|i| {
                let busy = if rng.below(4) == 0 {
                    Busy::Busy
                } else {
                    Busy::Free
                };
                scored(i as u32, rng.below(60) as f64, rng.below(25), busy)
            })
            .collect();
        let cheapest = c
            .iter()
            .filter(|x| x.busy == Busy::Free)
            .map(|x| x.cost)
            .fold(f64::INFINITY, f64::min);
        let bound = |x: &Scored| x.cost - x.load.prompt_blocks.min(u64::from(full)) as f64;
        let mut literal: Vec<f64> = c
            .iter()
            .filter(|x| x.busy == Busy::Free && x.load.prompt_blocks.min(u64::from(full)) > 0)
            .map(bound)
            .filter(|&b| b <= cheapest)
            .collect();
        literal.sort_by(f64::total_cmp);
        literal.truncate(SHARED_PROBES);
        let k = shared_probe_targets(&c, full, &mut out);
        let got: Vec<f64> = out[..k].iter().map(|&i| bound(&c[i as usize])).collect();
        assert_eq!(got, literal, "{c:?}");
    }
}

#[test]
fn ranges_are_clipped_sorted_and_merged() {
    let mut out = Vec::new();
    merge_pool_ranges(&[5..8, 0..3, 2..6, 9..40, 12..12], 20, &mut out).unwrap();
    assert_eq!(out, vec![(0, 8), (9, 20)]);
    #[allow(clippy::reversed_empty_ranges)]
    let bad = [0..3, 7..4];
    assert!(merge_pool_ranges(&bad, 20, &mut out).is_err());
    assert!(out.is_empty());
}

/// The affinity multiplier is exactly 1 when off and up to its share, grows to `1 + boost`
/// at the whole prompt, and `blocks_for_credit` inverts `b · affinity(b)`: every whole
/// number of blocks whose credit falls short of a target lies below the inverse (so the
/// pruning bar built on it keeps every rank that can win), and the inverse is at most one
/// block above the first that reaches it.
#[test]
fn the_affinity_multiplier_and_its_inverse() {
    let w = weights();
    assert_eq!(w.affinity(0), 1.0);
    assert_eq!(w.affinity(u32::MAX), 1.0);
    let off = w.for_prompt(&Affinity::OFF, 40);
    assert_eq!(off.affinity(40), 1.0);
    assert_eq!(off.blocks_for_credit(123.5), 123.5);
    let on = w.for_prompt(
        &Affinity {
            from_share: 0.7,
            boost: 4.0,
        },
        40,
    );
    assert_eq!(on.affinity(28), 1.0);
    assert!((on.affinity(40) - 5.0).abs() < 1e-12);
    assert!((on.affinity(34) - 3.0).abs() < 1e-12);
    let mut rng = Rng::new(9);
    for _ in 0..20_000 {
        let full = 1 + rng.below(5_000) as u32;
        let affinity = Affinity {
            from_share: [0.0, 0.3, 0.7, 0.99][rng.below(4) as usize],
            boost: [0.0, 0.5, 4.0, 100.0][rng.below(4) as usize],
        };
        let w = w.for_prompt(&affinity, full);
        let units = rng.unit_f64() * 6.0 * f64::from(full);
        let inverse = w.blocks_for_credit(units);
        let credit = |b: u32| f64::from(b) * w.affinity(b);
        // The first whole block count that reaches `units`, by search.
        let (mut lo, mut hi) = (0u32, 600 * full + 1);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if credit(mid) >= units {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        assert!(
            f64::from(lo) >= inverse - 1e-6 * inverse.max(1.0),
            "{lo} < {inverse}: {affinity:?} {full} {units}"
        );
        assert!(f64::from(lo) <= inverse + 1.0, "{lo} ≫ {inverse}");
    }
}

#[test]
fn a_rank_hot_against_the_fleet_pays_past_its_share_of_the_mean() {
    let config = RouterConfig::default();
    let s = shape(1_600);
    let w =
        Weights::new(&config, &Overrides::default()).with_fleet_load(&config.hot_load, 1_000.0, &s);
    // 1.4 × the mean plus the request's 100 blocks.
    assert_eq!(w.hot_from, 1_500.0);
    let load = |context_blocks| LoadView {
        context_blocks,
        output_blocks: 100,
        ..LoadView::default()
    };
    assert_eq!(CostTerms::hot_cost(&w, &load(1_400)), 0.0);
    assert_eq!(
        CostTerms::hot_cost(&w, &load(1_500)),
        config.hot_load.weight * 100.0
    );
    // The full terms and selection's total agree to the bit, and stay above the floor.
    let per_tier = [50, 0, 0, 0];
    let hot = load(3_000);
    let full = CostTerms::new(&w, &s, &hot, &per_tier, 0);
    let credit = CostTerms::credit_of(&w, &per_tier);
    let total = CostTerms::total_of(&w, &s, &hot, credit, 0);
    assert_eq!(full.total.to_bits(), total.to_bits());
    assert_eq!(full.hot_cost, config.hot_load.weight * 1_600.0);
    assert!(CostTerms::bound_floor(&w, &s, credit, false, 0) <= total);
    // Off: no cost, however hot.
    let off = Weights::new(&config, &Overrides::default()).with_fleet_load(
        &crate::config::HotLoad::OFF,
        1_000.0,
        &s,
    );
    assert_eq!(CostTerms::hot_cost(&off, &hot), 0.0);
}
