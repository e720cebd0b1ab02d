//! Several routers over one simulated fleet (`Fleet::with_replicas`): one router through it is
//! the plain fleet; with their bookings synced at once every router holds the same load after
//! every event, and none once all is done; without the sync they herd onto the worker that
//! holds a prefix; and `demo --replicas` compares the modes.

use std::time::Duration;

use kvroute::demo::{self, DemoConfig, DemoPolicy, ReplicaConfig};
use kvroute_core::{Rng, RouterConfig, WorkerRank};
use kvroute_sim::workload::{ChatConfig, Workload};
use kvroute_sim::{Arrival, BookingSync, EngineConfig, Fleet, FleetConfig, Replicas, RequestId};

use super::demo::two_cores;

const WORKERS: usize = 4;

/// `n` arrivals every 3 ms or so (exponential gaps, seed 5), each one of 4 system prompts of
/// 256 to 1,279 tokens then 128 tokens of its own, 8 to 71 tokens out.
fn stream(n: u64) -> Vec<Arrival> {
    let mut rng = Rng::new(5);
    let mut at = Duration::ZERO;
    (0..n)
        .map(|i| {
            at += Duration::from_secs_f64(-3e-3 * (1.0 - rng.unit_f64()).ln());
            let s = rng.below(4) as u32;
            let len = 256 + 256 * s;
            let mut prompt: Vec<u32> = (s * 100_000..s * 100_000 + len).collect();
            let own = 10_000_000 + i as u32 * 1_000;
            prompt.extend(own..own + 128);
            Arrival {
                at,
                id: RequestId(i),
                prompt,
                max_output_tokens: 8 + rng.below(64) as u32,
            }
        })
        .collect()
}

/// A burst of `BURST` requests sharing a new 512-token prefix (each with 256 tokens of its own,
/// 64 out), every 400 ms, 10 bursts; 100 ms before each, one request alone with that prefix,
/// which leaves it cached on one worker. Request `b × (BURST + 1)` leads burst `b`.
fn bursts() -> Vec<Arrival> {
    let mut out = Vec::new();
    for b in 0..10u32 {
        let start = Duration::from_millis(400 * u64::from(b));
        for k in 0..=BURST {
            let id = u64::from(b * (BURST + 1) + k);
            let mut prompt: Vec<u32> = (b * 100_000..b * 100_000 + 512).collect();
            let own = 10_000_000 + id as u32 * 1_000;
            prompt.extend(own..own + 256);
            out.push(Arrival {
                at: start + Duration::from_millis(if k == 0 { 0 } else { 100 }),
                id: RequestId(id),
                prompt,
                max_output_tokens: 64,
            });
        }
    }
    out
}

const BURST: u32 = 12;

/// 4 engines of 2,048 blocks, routed by `replicas` (router seed `seed`), through `arrivals`
/// until idle.
fn run(replicas: Replicas, seed: u64, arrivals: &[Arrival]) -> Fleet {
    let mut fleet = fleet(replicas, seed);
    for a in arrivals {
        fleet.submit(a.clone()).unwrap();
    }
    fleet.run_until_idle().unwrap();
    fleet
}

fn fleet(replicas: Replicas, seed: u64) -> Fleet {
    Fleet::with_replicas(
        FleetConfig {
            workers: WORKERS,
            engine: EngineConfig {
                kv_blocks: 2_048,
                ..EngineConfig::default()
            },
            router: RouterConfig {
                seed,
                ..RouterConfig::default()
            },
            split: None,
        },
        replicas,
    )
    .unwrap()
}

fn three(sync: BookingSync) -> Replicas {
    Replicas { count: 3, sync }
}

const AT_ONCE: BookingSync = BookingSync::After(Duration::ZERO);

/// Every router's load on every rank, router by router.
fn loads(fleet: &Fleet) -> Vec<Vec<kvroute_core::LoadView>> {
    fleet
        .routers()
        .iter()
        .map(|r| {
            (0..WORKERS as u64)
                .map(|w| r.load(WorkerRank::new(w, 0)).unwrap())
                .collect()
        })
        .collect()
}

/// Every router holds no booking, its own or another's, and no load.
fn assert_all_freed(fleet: &Fleet) {
    for (i, router) in fleet.routers().iter().enumerate() {
        assert_eq!(router.active_requests(), 0, "router {i}");
        assert_eq!(router.remote_requests(), 0, "router {i}");
        assert!(
            router.total_load().is_idle(),
            "router {i}: {:?}",
            router.total_load()
        );
    }
    assert_eq!(fleet.report().active_requests, 0);
    assert_eq!(fleet.refused_bookings(), 0, "changes arrive in order");
}

#[test]
fn one_router_through_replicas_is_the_plain_fleet() {
    let arrivals = stream(120);
    let mut plain = Fleet::new(FleetConfig {
        workers: WORKERS,
        engine: EngineConfig {
            kv_blocks: 2_048,
            ..EngineConfig::default()
        },
        router: RouterConfig::default(),
        split: None,
    })
    .unwrap();
    for a in &arrivals {
        plain.submit(a.clone()).unwrap();
    }
    plain.run_until_idle().unwrap();
    let seed = RouterConfig::default().seed;
    // A sync with one router has no one to tell: nothing changes.
    for sync in [
        BookingSync::Off,
        AT_ONCE,
        BookingSync::After(Duration::from_millis(5)),
    ] {
        let one = run(Replicas { count: 1, sync }, seed, &arrivals);
        assert_eq!(one.records(), plain.records(), "{sync:?}");
        assert_eq!(one.report(), plain.report(), "{sync:?}");
        assert_eq!(one.routers().len(), 1);
    }
    assert_eq!(plain.report().finished, 120);
}

#[test]
fn synced_at_once_every_router_holds_the_same_load_after_every_event() {
    let arrivals = stream(150);
    let mut fleet = fleet(three(AT_ONCE), 1);
    for a in &arrivals {
        fleet.submit(a.clone()).unwrap();
    }
    let (mut busy, mut remote) = (0, [false; 3]);
    let mut t = Duration::ZERO;
    while fleet.report().finished < arrivals.len() {
        t += Duration::from_micros(500);
        fleet.run_to(t).unwrap();
        let loads = loads(&fleet);
        for (i, l) in loads.iter().enumerate().skip(1) {
            assert_eq!(l, &loads[0], "router {i} at {t:?}");
        }
        busy += usize::from(loads[0].iter().any(|l| l.requests > 0));
        for (seen, r) in remote.iter_mut().zip(fleet.routers()) {
            *seen |= r.remote_requests() > 0 && r.active_requests() > 0;
        }
        assert!(t < Duration::from_secs(60), "the run does not end");
    }
    assert!(
        busy > 100,
        "checked while requests were active: {busy} times"
    );
    assert_eq!(
        remote, [true; 3],
        "every router routed and held the others' bookings"
    );
    // Each routed a third, in turn.
    let by_router = fleet.records().iter().filter(|r| r.id.0 % 3 == 1).count();
    assert_eq!(by_router, 50);
    assert_all_freed(&fleet);
}

#[test]
fn a_delayed_sync_lags_then_lands_and_no_sync_keeps_each_router_to_its_own() {
    let arrivals = stream(150);
    for sync in [
        BookingSync::After(Duration::from_millis(10)),
        BookingSync::Off,
    ] {
        let mut fleet = fleet(three(sync), 1);
        for a in &arrivals {
            fleet.submit(a.clone()).unwrap();
        }
        let (mut differ, mut t) = (0, Duration::ZERO);
        let mut most_remote = 0;
        while fleet.report().finished < arrivals.len() {
            t += Duration::from_millis(1);
            fleet.run_to(t).unwrap();
            let loads = loads(&fleet);
            differ += usize::from(loads.iter().any(|l| l != &loads[0]));
            most_remote = fleet
                .routers()
                .iter()
                .map(|r| r.remote_requests())
                .fold(most_remote, usize::max);
        }
        assert!(
            differ > 10,
            "{sync:?}: the routers' loads differed {differ} times"
        );
        match sync {
            BookingSync::Off => assert_eq!(most_remote, 0, "no sync: no remote booking"),
            BookingSync::After(_) => assert!(most_remote > 0),
        }
        // The last changes land after the last finish: run until idle delivers them.
        fleet.run_until_idle().unwrap();
        assert_all_freed(&fleet);
    }
}

/// The placement imbalance of the bursts: per burst (its leader left out), the requests the
/// busiest worker took ÷ the burst's mean per worker, averaged over bursts (1: even; 4: the
/// whole burst on one of 4 workers).
fn burst_imbalance(fleet: &Fleet) -> f64 {
    let per = u64::from(BURST + 1);
    let mut counts = [[0u32; WORKERS]; 10];
    for r in fleet.records().iter().filter(|r| r.id.0 % per != 0) {
        counts[(r.id.0 / per) as usize][r.worker.worker.0 as usize] += 1;
    }
    let mean = f64::from(BURST) / WORKERS as f64;
    counts
        .iter()
        .map(|c| f64::from(*c.iter().max().unwrap()) / mean)
        .sum::<f64>()
        / counts.len() as f64
}

#[test]
fn without_the_sync_routers_herd_onto_the_worker_that_holds_the_prefix() {
    let _cores = two_cores();
    let arrivals = bursts();
    for seed in [1, 2, 3] {
        let one = run(Replicas::ONE, seed, &arrivals);
        let synced = run(three(AT_ONCE), seed, &arrivals);
        let off = run(three(BookingSync::Off), seed, &arrivals);
        // A delay longer than a burst takes to arrive (all at once) is no sync for it.
        let late = run(
            three(BookingSync::After(Duration::from_millis(1))),
            seed,
            &arrivals,
        );
        let (o, s, f, l) = (
            burst_imbalance(&one),
            burst_imbalance(&synced),
            burst_imbalance(&off),
            burst_imbalance(&late),
        );
        // One router, or three that tell each other at once, see the burst's load grow on
        // the worker holding its prefix and spread it; three that do not each send their
        // share there, each seeing a third of its load.
        assert!(
            s <= o + 0.25,
            "seed {seed}: synced {s:.2}, one router {o:.2}"
        );
        assert!(
            f >= s + 1.5,
            "seed {seed}: sync off {f:.2} against synced {s:.2}"
        );
        assert!(l >= s + 1.5, "seed {seed}: delayed {l:.2}, synced {s:.2}");
        let (ttft_synced, ttft_off) = (synced.report().ttft_mean_ms, off.report().ttft_mean_ms);
        assert!(
            ttft_off > 1.3 * ttft_synced,
            "seed {seed}: TTFT {ttft_off:.1} ms off, {ttft_synced:.1} ms synced"
        );
        for fleet in [&one, &synced, &off, &late] {
            assert_eq!(fleet.report().finished, arrivals.len());
            assert_all_freed(fleet);
        }
    }
}

/// 120 turns of chats at 16 requests/s on 4 workers of 2,048 blocks.
fn small_workload() -> (Workload, DemoConfig) {
    let workload = Workload::chat(ChatConfig {
        requests: 120,
        seed: 13,
        documents: 30,
        document_tokens: (400, 1_600),
        open_conversations: 10,
        reply_tokens: (16, 96),
        rate: 16.0,
        ..ChatConfig::default()
    });
    let config = DemoConfig {
        workers: WORKERS,
        engine: EngineConfig {
            kv_blocks: 2_048,
            ..EngineConfig::default()
        },
        router: RouterConfig::default(),
        policies: vec![DemoPolicy::KvAware],
        threads: 2,
        load_sample_every: Duration::from_millis(100),
        seed: 3,
    };
    (workload, config)
}

#[test]
fn the_replica_demo_starts_from_the_plain_demos_figures_and_compares_each_sync() {
    let _cores = two_cores();
    let (workload, config) = small_workload();
    let plain = demo::run(&workload, &config, &|_| {}).unwrap();
    let report = demo::run_replicas(
        &workload,
        &ReplicaConfig {
            demo: config.clone(),
            policy: DemoPolicy::KvAware,
            replicas: 3,
            syncs: vec![BookingSync::Off, AT_ONCE],
            near_tie: 0.0,
        },
        &|_| {},
    )
    .unwrap();
    let names: Vec<&str> = report.modes.iter().map(|m| m.mode.as_str()).collect();
    assert_eq!(
        names,
        ["1 router", "3 replicas, sync off", "3 replicas, delay 0 ms"]
    );
    let one = &report.modes[0];
    let p = &plain.policies[0];
    assert_eq!(
        (
            one.figures.hit_rate,
            one.figures.ttft_mean_ms,
            one.figures.imbalance
        ),
        (p.hit_rate, p.ttft_mean_ms, p.imbalance),
        "one router is the plain demo's run"
    );
    assert_eq!((one.hit_rate_vs_one, one.ttft_mean_vs_one), (1.0, 1.0));
    for m in &report.modes {
        assert_eq!(m.figures.finished, 120, "{}", m.mode);
        assert_eq!(m.figures.active_at_end, 0, "{}", m.mode);
        assert_eq!(m.refused_bookings, 0, "{}", m.mode);
        let hit = m.figures.hit_rate / one.figures.hit_rate;
        assert!((m.hit_rate_vs_one - hit).abs() < 1e-12, "{}", m.mode);
    }
    assert_eq!(report.modes[1].delay_ms, None);
    assert!(!report.modes[1].sync);
    assert_eq!(report.modes[2].delay_ms, Some(0.0));
    let table = report.table();
    for name in names {
        assert!(table.contains(name), "{table}");
    }
    // The peers' pickers route for one router.
    let peer = demo::run_replicas(
        &workload,
        &ReplicaConfig {
            demo: config,
            policy: DemoPolicy::DynamoDefault,
            replicas: 3,
            syncs: vec![AT_ONCE],
            near_tie: 0.0,
        },
        &|_| {},
    );
    assert!(peer.is_err());
}

#[test]
fn demo_replicas_writes_a_row_per_mode_and_refuses_what_it_cannot_run() {
    let _cores = two_cores();
    let json = std::env::temp_dir().join(format!("kvroute-replicas-{}.json", std::process::id()));
    let demo = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["demo", "--workers", "4", "--requests", "60"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap()
    };
    let path = json.to_str().unwrap();
    assert!(demo(&[
        "--replicas",
        "3",
        "--replica-delay-ms",
        "off,0,2.5",
        "--json",
        path
    ])
    .success());
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["policy"], "kv-aware");
    assert_eq!(report["replicas"], 3);
    let modes = report["modes"].as_array().unwrap();
    let names: Vec<&str> = modes.iter().map(|m| m["mode"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "1 router",
            "3 replicas, sync off",
            "3 replicas, delay 0 ms",
            "3 replicas, delay 2.5 ms"
        ]
    );
    for m in modes {
        for key in [
            "hit_rate",
            "hit_rate_vs_one",
            "ttft_mean_ms",
            "ttft_mean_vs_one",
            "ttft_p99_ms",
            "itl_mean_ms",
            "imbalance",
        ] {
            let v = m[key].as_f64().unwrap();
            assert!(v.is_finite() && v > 0.0, "{key}: {m}");
        }
        assert_eq!(m["active_at_end"], 0, "{m}");
    }
    assert_eq!(modes[3]["delay_ms"].as_f64(), Some(2.5));
    std::fs::remove_file(&json).unwrap();
    // A peer's policy, a delay that is not one, a modelled delay on a live run (whose delay
    // is NATS's), one router, or another comparison beside.
    assert!(!demo(&["--replicas", "3", "--policies", "sglang-cache-aware"]).success());
    assert!(!demo(&["--replicas", "3", "--replica-delay-ms", "soon"]).success());
    assert!(!demo(&["--replicas", "3", "--live", "--replica-delay-ms", "0"]).success());
    assert!(!demo(&["--replicas", "0"]).success());
    assert!(!demo(&["--replicas", "100000"]).success());
    assert!(!demo(&["--replica-delay-ms", "5"]).success());
    assert!(!demo(&["--replicas", "3", "--disagg"]).success());
}
