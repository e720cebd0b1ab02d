//! The demo: a small built-in workload through every policy, its figures' invariants, its
//! JSON schema, its table and its picture.

use std::time::Duration;

use kvroute::demo::{self, DemoConfig, DemoPolicy, DemoReport};
use kvroute_core::RouterConfig;
use kvroute_sim::workload::{ChatConfig, Workload};
use kvroute_sim::EngineConfig;

/// Held by the in-process demos while they run and by the live demo's fault test: that test
/// holds its live hit rate to the in-process one, and on two cores a demo of every policy
/// beside it slows its processes enough to move its figures.
static TWO_CORES: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(crate) fn two_cores() -> std::sync::MutexGuard<'static, ()> {
    TWO_CORES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// 150 turns of chats at 20 requests/s (a busy fleet), on 4 small workers that must evict.
fn small_demo(policies: Vec<DemoPolicy>) -> DemoReport {
    let _cores = two_cores();
    let workload = Workload::chat(ChatConfig {
        requests: 150,
        seed: 11,
        documents: 40,
        document_tokens: (500, 2_000),
        open_conversations: 12,
        reply_tokens: (20, 120),
        rate: 20.0,
        ..ChatConfig::default()
    });
    let config = DemoConfig {
        workers: 4,
        engine: EngineConfig {
            kv_blocks: 2_048,
            ..EngineConfig::default()
        },
        router: RouterConfig::default(),
        policies,
        threads: 2,
        load_sample_every: Duration::from_millis(100),
        seed: 3,
    };
    demo::run(&workload, &config, &|_| {}).unwrap()
}

/// Runs `kvroute demo` with `args` and `--json` into a file named for `name`, checks that it
/// succeeded, and returns the report (the file removed).
fn demo_json(name: &str, args: &[&str]) -> serde_json::Value {
    let json = std::env::temp_dir().join(format!("kvroute-{name}-{}.json", std::process::id()));
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .arg("demo")
        .args(args)
        .arg("--json")
        .arg(&json)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "kvroute demo {args:?}");
    let report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    report
}

#[test]
fn every_policy_serves_every_request_and_hands_back_all_load() {
    let report = small_demo(DemoPolicy::ALL.to_vec());
    let names: Vec<&str> = report.policies.iter().map(|p| p.name.as_str()).collect();
    let expected: Vec<&str> = DemoPolicy::ALL.iter().map(|p| p.name()).collect();
    assert_eq!(names, expected, "in the order asked");
    for p in &report.policies {
        assert_eq!(p.requests, 150, "{}", p.name);
        assert_eq!(p.finished, 150, "{}", p.name);
        assert_eq!(p.active_at_end, 0, "{}: load left booked", p.name);
        assert!(p.hit_rate <= report.ceiling_hit_rate + 1e-12, "{}", p.name);
        assert!(p.ttft_mean_ms > 0.0 && p.ttft_p99_ms >= p.ttft_p50_ms);
        assert!(p.imbalance >= 1.0, "{}", p.name);
        assert!(p.route_p99_us > 0.0);
        assert!(!p.load.samples.is_empty());
        assert_eq!(p.ttft_sorted_ms.len(), 150);
    }
    assert!(report.oracle_hit_rate <= report.ceiling_hit_rate + 1e-12);
    assert!(report.fleet_lru_hit_rate > 0.0);
    let kv = report.policy("kv-aware").unwrap();
    let rr = report.policy("round-robin").unwrap();
    assert!(
        kv.hit_rate > rr.hit_rate,
        "kv-aware {} vs round-robin {}",
        kv.hit_rate,
        rr.hit_rate
    );
    assert!(kv.prediction_accuracy > 0.9, "{}", kv.prediction_accuracy);
}

#[test]
fn a_run_is_the_same_every_time() {
    let policies = vec![DemoPolicy::KvAware, DemoPolicy::DynamoDefault];
    let a = small_demo(policies.clone());
    let b = small_demo(policies);
    for (x, y) in a.policies.iter().zip(&b.policies) {
        assert_eq!(x.hit_rate, y.hit_rate);
        assert_eq!(x.ttft_sorted_ms, y.ttft_sorted_ms);
        assert_eq!(x.load, y.load);
    }
    assert_eq!(a.ceiling_hit_rate, b.ceiling_hit_rate);
}

#[test]
fn the_json_report_has_the_documented_fields() {
    let report = small_demo(vec![DemoPolicy::KvAware, DemoPolicy::RoundRobin]);
    let json: serde_json::Value = serde_json::to_value(&report).unwrap();
    for key in [
        "workload",
        "ceiling_hit_rate",
        "fleet_lru_hit_rate",
        "oracle_hit_rate",
        "policies",
    ] {
        assert!(json.get(key).is_some(), "missing {key}");
    }
    assert_eq!(json["workload"], "builtin-chat");
    let policies = json["policies"].as_array().unwrap();
    assert_eq!(policies[0]["name"], "kv-aware");
    assert_eq!(policies[1]["name"], "round-robin");
    for key in [
        "name",
        "hit_rate",
        "ttft_mean_ms",
        "ttft_p99_ms",
        "itl_mean_ms",
        "itl_p99_ms",
        "worker_itl_p99_ms",
        "worst_worker_itl_p99_ms",
        "throughput_tok_s",
        "imbalance",
        "prediction_accuracy",
        "route_p99_us",
    ] {
        assert!(policies[0].get(key).is_some(), "missing policies[].{key}");
    }
    assert!(
        policies[0].get("ttft_sorted_ms").is_none(),
        "plot data stays out"
    );
    // One ITL p99 a worker and the worst of them. With under 100 requests a worker, each p99
    // is its slowest request, so the worst is at least the busiest worker's mean, and so at
    // least the fleet's.
    let per_worker: Vec<f64> = policies[0]["worker_itl_p99_ms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(per_worker.len(), 4);
    let worst = per_worker.iter().copied().fold(0.0, f64::max);
    assert_eq!(policies[0]["worst_worker_itl_p99_ms"].as_f64(), Some(worst));
    assert!(
        worst >= policies[0]["itl_mean_ms"].as_f64().unwrap(),
        "{worst}"
    );
}

#[test]
fn the_table_and_the_picture_name_every_policy() {
    let report = small_demo(vec![
        DemoPolicy::KvAware,
        DemoPolicy::RoundRobin,
        DemoPolicy::PrefixHash,
    ]);
    let table = report.table();
    for name in [
        "kv-aware",
        "round-robin",
        "prefix-hash",
        "ceiling",
        "oracle",
    ] {
        assert!(table.contains(name), "table lacks {name}:\n{table}");
    }
    let path = std::env::temp_dir().join(format!("kvroute-demo-{}.svg", std::process::id()));
    demo::write_svg(&report, &path).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg") || svg.contains("<svg"));
    for name in [
        "kv-aware",
        "round-robin",
        "prefix-hash",
        "time to first token",
    ] {
        assert!(svg.contains(name), "picture lacks {name}");
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn policy_names_parse_back_and_unknown_ones_are_refused() {
    for p in DemoPolicy::ALL {
        assert_eq!(p.name().parse::<DemoPolicy>().unwrap().name(), p.name());
    }
    let err = "fastest".parse::<DemoPolicy>().unwrap_err().to_string();
    assert!(err.contains("fastest") && err.contains("kv-aware"), "{err}");
}

#[test]
fn nothing_to_run_is_an_error_not_a_panic() {
    let workload = Workload::chat(ChatConfig {
        requests: 0,
        ..ChatConfig::default()
    });
    let config = DemoConfig::default();
    assert!(demo::run(&workload, &config, &|_| {}).is_err());
    let workload = Workload::chat(ChatConfig::default());
    let none = DemoConfig {
        policies: Vec::new(),
        ..DemoConfig::default()
    };
    assert!(demo::run(&workload, &none, &|_| {}).is_err());
}

#[test]
fn the_live_demo_survives_its_faults_and_its_index_matches_the_engines() {
    let _cores = two_cores();
    let report = demo_json(
        "live",
        &[
            "--live",
            "--faults",
            "--requests",
            "240",
            "--rate",
            "20",
            "--workers",
            "3",
            "--kv-blocks",
            "4096",
            "--time-scale",
            "5",
        ],
    );
    let live = &report["live"];
    let replay = &live["replay"];
    // Every request was answered, a success or an error; none was left hanging.
    assert_eq!(replay["requests"], 240);
    assert_eq!(
        replay["ok"].as_u64().unwrap() + replay["failed"].as_u64().unwrap(),
        240
    );
    // Only the killed worker's requests failed, and the load returned to zero.
    for failed in live["failed_by_worker"].as_array().unwrap() {
        assert_eq!(
            failed[0], 2,
            "{failed}: {} {}",
            live["first_failures"], live["faults"]
        );
    }
    assert_eq!(live["active_at_end"], 0);
    assert_eq!(live["faults"].as_array().unwrap().len(), 3);
    // Repaired: worker 0's dropped batches were replayed and its index equals its cache; the
    // killed worker left the index. Worker 1, restarted under load, saw its restart; its
    // block count can still drift from the engine's (an open problem: docs/targets.md, "Known limits").
    let caches = live["caches"].as_array().unwrap();
    assert_eq!(
        caches[0]["index_blocks"], caches[0]["engine_blocks"],
        "{}",
        caches[0]
    );
    assert!(
        caches[0]["events"]["replayed"].as_u64().unwrap() >= 1,
        "{}",
        caches[0]
    );
    assert_eq!(caches[1]["events"]["restarts"], 1, "{}", caches[1]);
    assert_eq!(caches[2]["engine_blocks"], serde_json::Value::Null);
    assert_eq!(caches[2]["index_blocks"], 0, "{}", caches[2]);
    let in_process = report["in_process"]["policies"][0]["hit_rate"]
        .as_f64()
        .unwrap();
    // The faults come at random times (0.8 to 1.8 s into a run of about 12), and the caches
    // a restart empties and a kill takes away are missed until refilled: five runs gave 0.80
    // to 0.91 of the in-process hit rate, which has no fault. An index the faults had broken
    // would give far less.
    let hit = replay["hit_rate"].as_f64().unwrap();
    assert!(
        hit > 0.7 * in_process,
        "live {hit} against in process {in_process}"
    );
}

#[test]
fn a_sweep_runs_each_fleet_size_with_arrivals_and_requests_scaled() {
    let report = demo_json(
        "sweep",
        &[
            "--sweep-workers",
            "2,4",
            "--workers",
            "2",
            "--requests",
            "60",
            "--policies",
            "kv-aware,round-robin",
        ],
    );
    let sizes = report["sweep"].as_array().unwrap();
    assert_eq!(sizes.len(), 2);
    // Twice the workers: twice the arrivals a second and twice the requests.
    for (s, (workers, rate, requests)) in sizes.iter().zip([(2, 35.0, 60), (4, 70.0, 120)]) {
        assert_eq!(s["workers"], workers);
        assert_eq!(s["arrivals_per_second"].as_f64(), Some(rate));
        assert_eq!(s["report"]["workers"], workers);
        assert_eq!(s["report"]["requests"], requests);
        let names: Vec<&str> = s["report"]["policies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["kv-aware", "round-robin"]);
    }
    // A size of 0 is refused.
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["demo", "--sweep-workers", "0,4", "--requests", "10"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success());
}

/// `--disagg` on the long mix, 4 GPUs, 60 requests at 2 a second.
const LONG_MIX_ON_4: [&str; 9] = [
    "--disagg",
    "--mix",
    "long",
    "--workers",
    "4",
    "--requests",
    "60",
    "--rate",
    "2",
];

#[test]
fn the_disaggregation_demo_compares_every_split_with_serving_whole_on_the_same_gpus() {
    let report = demo_json("disagg", &LONG_MIX_ON_4);
    assert_eq!(report["workload"], "builtin-long");
    assert_eq!(report["slo_ttft_ms"].as_f64(), Some(2_000.0));
    assert_eq!(report["slo_itl_ms"].as_f64(), Some(25.0));
    let modes = report["modes"].as_array().unwrap();
    let names: Vec<&str> = modes.iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "aggregated",
            "disagg-1p3d",
            "disagg-2p2d",
            "conditional-1p3d",
            "conditional-2p2d"
        ]
    );
    for m in modes {
        let (p, d) = (
            m["prefill_workers"].as_u64().unwrap(),
            m["decode_workers"].as_u64().unwrap(),
        );
        assert_eq!(p + d, 4, "the same GPUs: {m}");
        assert_eq!(m["unfinished"], 0, "{m}");
        for key in [
            "ttft_mean_ms",
            "ttft_p99_ms",
            "itl_mean_ms",
            "itl_p99_ms",
            "gap_p99_ms",
            "goodput_rps",
            "throughput_tok_s",
            "hit_rate",
        ] {
            let v = m[key].as_f64().unwrap();
            assert!(v.is_finite() && v >= 0.0, "{key}: {m}");
        }
        // At 2 requests a second nothing is saturated: every request meets both objectives,
        // so goodput is the arrival rate, about.
        assert!(m["goodput_rps"].as_f64().unwrap() > 1.0, "{m}");
    }
    // Split, the first token waits for the prefill and the KV's transfer.
    assert!(modes[1]["ttft_mean_ms"].as_f64() > modes[0]["ttft_mean_ms"].as_f64());
    assert!(report["slo_gap_ms"].is_null());
    // No request of hundreds of tokens goes without a 1 ms gap between two of them: with
    // that objective no mode has any goodput.
    let strict = demo_json(
        "disagg-gap",
        &[&LONG_MIX_ON_4[..], &["--slo-gap-ms", "1"]].concat(),
    );
    assert_eq!(strict["slo_gap_ms"].as_f64(), Some(1.0));
    // A pass budget without room for one token of every running request is refused, and a
    // gap objective is for --disagg only.
    for args in [
        &["demo", "--max-batched-tokens", "16", "--requests", "10"][..],
        &["demo", "--slo-gap-ms", "50", "--requests", "10"],
    ] {
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(!status.success(), "{args:?}");
    }
    for m in strict["modes"].as_array().unwrap() {
        assert_eq!(m["goodput_rps"].as_f64(), Some(0.0), "{m}");
        assert!(m["gap_p99_ms"].as_f64().unwrap() > 1.0, "{m}");
    }
    // A split of every GPU to prefill is refused.
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "demo",
            "--disagg",
            "--workers",
            "4",
            "--splits",
            "4",
            "--requests",
            "10",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success());
}

#[test]
fn the_live_demo_spreads_requests_over_replicas_that_see_each_others_bookings() {
    if std::process::Command::new(kvroute_serve::nats_server_program())
        .arg("--version")
        .output()
        .is_err()
    {
        super::skip_without_fixtures("no nats-server on PATH: run scripts/fixtures.sh");
        return;
    }
    let _cores = two_cores();
    let report = demo_json(
        "live-replicas",
        &[
            "--live",
            "--replicas",
            "2",
            "--requests",
            "60",
            "--rate",
            "20",
            "--workers",
            "2",
            "--kv-blocks",
            "4096",
            "--time-scale",
            "5",
        ],
    );
    // One router, then two replicas: every request answered by each fleet.
    for fleet in ["one_router", "replicas"] {
        let replay = &report[fleet]["replay"];
        assert_eq!(replay["ok"], 60, "{fleet}: {}", report[fleet]);
        assert_eq!(replay["failed"], 0, "{fleet}: {}", report[fleet]);
        assert_eq!(report[fleet]["active_at_end"], 0, "{fleet}");
    }
    assert_eq!(report["one_router"]["replicas"], serde_json::json!([]));
    // Both replicas served half the requests, and each held the other's bookings.
    let replicas = report["replicas"]["replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 2);
    for r in replicas {
        assert_eq!(r["sent"], 30, "{r}");
        assert_eq!(r["served"], 30.0, "{r}");
        assert_eq!(r["sync_up"], 1.0, "{r}");
        assert_eq!(r["peers"], 1.0, "{r}");
        assert!(r["applied"].as_f64().unwrap() > 0.0, "{r}");
    }
}
