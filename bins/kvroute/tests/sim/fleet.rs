//! The fleet: engines and the core's router on one virtual clock, on a small workload of
//! shared system prompts.

use std::time::Duration;

use kvroute_core::{Policy, Rng, RouterConfig, WorkerRank};
use kvroute_sim::{Arrival, EngineConfig, Fleet, FleetConfig, FleetReport, RequestId};

const WORKERS: usize = 4;

/// 40 requests: one of 8 system prompts (64 to 256 tokens) then 16 to 63 tokens of its own,
/// 4 to 19 output tokens, arriving about every 15 ms (exponential gaps), from seed 7.
fn workload() -> Vec<Arrival> {
    let mut rng = Rng::new(7);
    let systems: Vec<Vec<u32>> = (0..8u32)
        .map(|s| {
            let len = 64 + rng.below(193) as u32;
            (s * 10_000..s * 10_000 + len).collect()
        })
        .collect();
    let mut at = Duration::ZERO;
    (0..40u64)
        .map(|i| {
            let gap_ms = -15.0 * (1.0 - rng.unit_f64()).ln();
            at += Duration::from_secs_f64(gap_ms / 1e3);
            let mut prompt = systems[rng.below(8) as usize].clone();
            let own = 16 + rng.below(48) as u32;
            let first = 1_000_000 + i as u32 * 1_000;
            prompt.extend(first..first + own);
            Arrival {
                at,
                id: RequestId(i),
                prompt,
                max_output_tokens: 4 + rng.below(16) as u32,
            }
        })
        .collect()
}

/// Runs the workload on 4 engines of 96 blocks under `policy`.
fn run(policy: Policy) -> (Fleet, FleetReport) {
    let mut fleet = Fleet::new(FleetConfig {
        workers: WORKERS,
        engine: EngineConfig {
            kv_blocks: 96,
            ..EngineConfig::default()
        },
        router: RouterConfig {
            policy,
            ..RouterConfig::default()
        },
        split: None,
    })
    .unwrap();
    for arrival in workload() {
        fleet.submit(arrival).unwrap();
    }
    fleet.run_until_idle().unwrap();
    let report = fleet.report();
    (fleet, report)
}

#[test]
fn every_request_finishes_and_load_returns_to_zero() {
    let (fleet, report) = run(Policy::KvAware);
    assert_eq!(report.requests, 40);
    assert_eq!(report.finished, 40);
    assert_eq!(report.active_requests, 0);
    assert_eq!(fleet.router().active_requests(), 0);
    for w in 0..WORKERS as u64 {
        let load = fleet.router().load(WorkerRank::new(w, 0)).unwrap();
        assert_eq!(load.requests, 0, "worker {w}: {load:?}");
        assert_eq!(load.prefill_tokens, 0, "worker {w}: {load:?}");
        assert_eq!(load.decode_blocks(), 0, "worker {w}: {load:?}");
    }
    for record in fleet.records() {
        let first = record.first_token.unwrap();
        let finished = record.finished.unwrap();
        assert!(record.arrival < first && first <= finished, "{record:?}");
    }
    assert!(fleet.engines().iter().all(|e| e.is_idle()));
    assert!(report.ttft_mean_ms > 0.0 && report.ttft_p99_ms >= report.ttft_mean_ms);
    assert!(report.throughput > 0.0 && report.itl_mean_ms > 0.0);
    assert!(report.mean_active_tokens.iter().all(|&t| t > 0.0));
    assert!(report.load_imbalance >= 1.0);
}

#[test]
fn kv_aware_routing_hits_more_cache_than_round_robin() {
    let (_, kv) = run(Policy::KvAware);
    let (_, rr) = run(Policy::RoundRobin);
    println!("kv-aware: {kv:?}\nround-robin: {rr:?}");
    assert!(
        kv.hit_rate > rr.hit_rate,
        "kv-aware hit rate {:.3}, round robin {:.3}",
        kv.hit_rate,
        rr.hit_rate
    );
}

#[test]
fn the_routers_predicted_cached_tokens_match_the_engines() {
    let (fleet, report) = run(Policy::KvAware);
    let misses: Vec<_> = fleet
        .records()
        .iter()
        .filter(|r| r.predicted_cached != u64::from(r.cached))
        .map(|r| (r.id.0, r.predicted_cached, r.cached))
        .collect();
    assert!(
        report.prediction_accuracy >= 0.9,
        "prediction accuracy {:.3}; misses (id, predicted, engine): {misses:?}",
        report.prediction_accuracy
    );
}

#[test]
fn a_run_is_deterministic() {
    let (first, a) = run(Policy::KvAware);
    let (second, b) = run(Policy::KvAware);
    assert_eq!(a, b);
    assert_eq!(first.records(), second.records());
}

/// A fleet of one engine of 1,000 blocks.
fn one_engine() -> Fleet {
    Fleet::new(FleetConfig {
        workers: 1,
        engine: EngineConfig {
            kv_blocks: 1_000,
            ..EngineConfig::default()
        },
        router: RouterConfig::default(),
        split: None,
    })
    .unwrap()
}

/// The longest gap between request 0's tokens when request 1, a 16,384-token prompt, arrives
/// while 0 decodes, on one engine that computes at most `budget` tokens a pass.
fn gap_under_a_long_prefill(budget: u32) -> (Duration, f64) {
    let mut fleet = Fleet::new(FleetConfig {
        workers: 1,
        engine: EngineConfig {
            kv_blocks: 2_000,
            max_num_batched_tokens: budget,
            ..EngineConfig::default()
        },
        router: RouterConfig::default(),
        split: None,
    })
    .unwrap();
    for (i, at, prompt, output) in [
        (0, 0, (0..64).collect::<Vec<u32>>(), 200),
        (1, 300, (100_000..116_384).collect(), 1),
    ] {
        fleet
            .submit(Arrival {
                at: Duration::from_millis(at),
                id: RequestId(i),
                prompt,
                max_output_tokens: output,
            })
            .unwrap();
    }
    fleet.run_until_idle().unwrap();
    let decoding = fleet.records()[0];
    let mean = (decoding.finished.unwrap() - decoding.first_token.unwrap()).as_secs_f64()
        / f64::from(decoding.output_tokens - 1);
    (decoding.longest_gap, mean)
}

#[test]
fn a_decode_sharing_passes_with_a_long_prefill_records_the_stall_its_mean_hides() {
    let (whole, mean) = gap_under_a_long_prefill(8_192);
    // The prompt takes two passes of nearly 8,192 tokens each: at about 17 µs a token, each is
    // a stall of well over 100 ms, where the request's mean stays near a decode pass's.
    assert!(whole > Duration::from_millis(100), "{whole:?}");
    assert!(mean < 0.03, "{mean}");
    // Chunks of 1,024 bound it to a fraction of that, still above the request's own mean.
    let (chunked, chunked_mean) = gap_under_a_long_prefill(1_024);
    assert!(chunked < Duration::from_millis(40), "{chunked:?}");
    assert!(
        chunked.as_secs_f64() > chunked_mean,
        "{chunked:?} {chunked_mean}"
    );
}

/// A 256-token system prompt then 32 tokens of request `i`'s own.
fn shared_prompt(i: u32) -> Vec<u32> {
    (0..256)
        .chain(10_000 * (i + 1)..10_000 * (i + 1) + 32)
        .collect()
}

#[test]
fn the_router_learns_of_blocks_when_the_pass_that_stored_them_ends() {
    let mut fleet = one_engine();
    fleet
        .submit(Arrival {
            at: Duration::ZERO,
            id: RequestId(1),
            prompt: shared_prompt(1),
            max_output_tokens: 4,
        })
        .unwrap();
    // Request 2 comes while request 1's prefill is under way: the blocks are not published
    // yet, so the index holds none of them, but the router knows request 1's prompt is
    // active there and predicts the hit the engine then finds (its prefill starts after
    // request 1's ended). Request 3 comes after request 1 ended, from the index.
    fleet.run_to(Duration::from_micros(1)).unwrap();
    assert!(fleet.engines()[0].now() > Duration::from_micros(1));
    for (id, at_ms) in [(2, 0), (3, 1_000)] {
        fleet
            .submit(Arrival {
                at: Duration::from_micros(1) + Duration::from_millis(at_ms),
                id: RequestId(id),
                prompt: shared_prompt(id as u32),
                max_output_tokens: 4,
            })
            .unwrap();
    }
    fleet.run_until_idle().unwrap();
    let seen: Vec<_> = fleet
        .records()
        .iter()
        .map(|r| (r.id.0, r.predicted_cached, r.cached))
        .collect();
    assert_eq!(seen, vec![(1, 0, 0), (2, 256, 256), (3, 256, 256)]);
    assert_eq!(fleet.report().prediction_accuracy, 1.0);
}

#[test]
fn a_request_id_is_submitted_once_and_never_in_the_past() {
    let mut fleet = one_engine();
    let arrival = Arrival {
        at: Duration::from_millis(5),
        id: RequestId(1),
        prompt: shared_prompt(1),
        max_output_tokens: 1,
    };
    fleet.submit(arrival.clone()).unwrap();
    assert!(fleet.submit(arrival.clone()).is_err());
    fleet.run_until_idle().unwrap();
    let late = Arrival {
        at: Duration::ZERO,
        id: RequestId(2),
        ..arrival
    };
    assert!(fleet.submit(late).is_err());
    assert_eq!(fleet.report().finished, 1);
    assert_eq!(fleet.router().active_requests(), 0);
}

/// The workload on 4 engines of 96 blocks, one computing prompts and three decoding.
fn run_split(local_max_new_tokens: Option<u64>) -> Fleet {
    let mut fleet = Fleet::new(FleetConfig {
        workers: WORKERS,
        engine: EngineConfig {
            kv_blocks: 96,
            ..EngineConfig::default()
        },
        router: RouterConfig::default(),
        split: Some(kvroute_sim::Split {
            prefill_workers: 1,
            transfer: kvroute_sim::KvTransfer::default(),
            conditional: local_max_new_tokens.map(kvroute_core::Conditional::new_tokens_at_most),
        }),
    })
    .unwrap();
    for arrival in workload() {
        fleet.submit(arrival).unwrap();
    }
    fleet.run_until_idle().unwrap();
    fleet
}

#[test]
fn a_split_fleet_computes_prompts_on_its_prefill_engine_and_decodes_after_the_transfer() {
    let fleet = run_split(None);
    let transfer = kvroute_sim::KvTransfer::default();
    let prefill = WorkerRank::new(0, 0);
    for r in fleet.records() {
        assert_eq!(r.prefill_worker, Some(prefill), "{r:?}");
        assert_ne!(r.worker, prefill, "decoded elsewhere: {r:?}");
        assert!(r.finished.is_some(), "{r:?}");
        // Its first token came after the prompt's KV crossed the link.
        let full = u64::from((r.prompt_tokens - 1) / 16 * 16);
        assert!(
            r.first_token.unwrap() >= r.arrival + transfer.duration(full),
            "{r:?}"
        );
    }
    // Every decode ran on a decode engine, every prompt on the prefill engine, and the
    // prefill engine's cache served the shared system prompts.
    let decoded: u64 = fleet.engines()[1..]
        .iter()
        .map(|e| e.stats().prefix_query_tokens)
        .sum();
    assert!(decoded > 0);
    let report = fleet.report();
    assert_eq!(report.finished, 40);
    assert!(report.hit_rate > 0.3, "{report:?}");
    assert_eq!(report.active_requests, 0, "nothing left booked");
    assert!(fleet.router().total_load().is_idle());
    // The prefill engine held each prompt's blocks until its transfer ended, and released
    // every one.
    assert_eq!(fleet.engines()[0].held_requests(), 0);
    assert_eq!(fleet.engines()[0].stats().blocks.in_use, 0);
    // The decode engines published the blocks they received: the router's index has them.
    let last = fleet.records().last().unwrap();
    let engine = &fleet.engines()[last.worker.worker.0 as usize];
    assert!(engine.stats().blocks.cached > 0);
}

#[test]
fn conditional_disaggregation_serves_whole_what_the_decode_engine_would_compute_little_of() {
    // Every prompt here is under 320 tokens: a cap of 400 new tokens serves all whole.
    let fleet = run_split(Some(400));
    assert!(fleet.records().iter().all(|r| r.prefill_worker.is_none()));
    assert!(fleet.records().iter().all(|r| r.worker.worker.0 != 0));
    assert_eq!(
        fleet.engines()[0].stats().passes,
        0,
        "the prefill engine idles"
    );
    // A cap of 0 splits every request whose decode engine holds nothing of it.
    let fleet = run_split(Some(0));
    assert!(fleet.records().iter().any(|r| r.prefill_worker.is_some()));
    assert_eq!(fleet.report().active_requests, 0);
}
