//! `kvroute replay`: its figures on records computed by hand, and a replay of a small trace
//! against a live worker over HTTP.

use std::time::Duration;

use kvroute::replay::{figures, run, ReplayOptions, ReplayRecord};
use kvroute::worker::{RunningWorker, WorkerOptions};
use kvroute_sim::workload::{TraceRow, Workload};
use kvroute_sim::EngineConfig;

fn record(
    prompt: u32,
    cached: u32,
    ttft: f64,
    latency: f64,
    chunks: u32,
    worker: u64,
    predicted: u64,
) -> ReplayRecord {
    ReplayRecord {
        prompt_tokens: prompt,
        cached_tokens: cached,
        ttft_ms: Some(ttft),
        latency_ms: Some(latency),
        chunks,
        output_tokens: chunks,
        worker: Some(worker),
        predicted_cached_tokens: Some(predicted),
        status: 200,
        ..ReplayRecord::default()
    }
}

#[test]
fn the_figures_of_four_requests_are_what_a_hand_count_gives() {
    let records = vec![
        record(100, 0, 10.0, 30.0, 3, 0, 0),
        record(100, 96, 20.0, 60.0, 5, 1, 96),
        record(200, 0, 40.0, 40.0, 1, 1, 64),
        ReplayRecord {
            prompt_tokens: 50,
            status: 500,
            error: Some("boom".into()),
            ..ReplayRecord::default()
        },
    ];
    let r = figures(&records, 2.0);
    assert_eq!((r.requests, r.ok, r.failed), (4, 3, 1));
    // Failed requests count in neither the hit rate nor the latencies.
    assert!((r.hit_rate - 96.0 / 400.0).abs() < 1e-12);
    assert!((r.ttft_mean_ms - 70.0 / 3.0).abs() < 1e-9);
    assert_eq!((r.ttft_p50_ms, r.ttft_p99_ms), (20.0, 40.0));
    // (30 - 10) / 2 and (60 - 20) / 4; one chunk has no inter-token gap.
    assert!((r.itl_mean_ms - 10.0).abs() < 1e-12);
    assert!((r.latency_mean_ms - 130.0 / 3.0).abs() < 1e-9);
    assert!((r.throughput_tok_s - 9.0 / 2.0).abs() < 1e-12);
    assert!((r.prediction_accuracy - 2.0 / 3.0).abs() < 1e-12);
    // Token-milliseconds: worker 0 103 × 30; worker 1 105 × 60 + 201 × 40.
    let (w0, w1) = (103.0 * 30.0, 105.0 * 60.0 + 201.0 * 40.0);
    assert!((r.imbalance - w1 / ((w0 + w1) / 2.0)).abs() < 1e-12);
    // No oracle asked: no oracle figures.
    assert_eq!((r.oracle_hit_rate, r.hit_over_oracle), (0.0, 0.0));
}

#[test]
fn the_oracle_figures_count_only_the_requests_every_worker_answered_for() {
    let mut records = vec![
        record(100, 0, 10.0, 30.0, 3, 0, 0),
        record(100, 48, 20.0, 60.0, 5, 1, 96),
        record(200, 64, 40.0, 40.0, 1, 1, 64),
    ];
    records[0].oracle_cached_tokens = Some(32);
    records[1].oracle_cached_tokens = Some(96);
    // The third has no oracle figure (a worker did not answer): left out of both ratios.
    let r = figures(&records, 1.0);
    assert!((r.hit_rate - 112.0 / 400.0).abs() < 1e-12);
    assert!((r.oracle_hit_rate - 128.0 / 200.0).abs() < 1e-12);
    assert!((r.hit_over_oracle - 48.0 / 128.0).abs() < 1e-12);
    assert_eq!((r.oracle_missing, r.oracle_unreachable), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_trace_replayed_against_a_worker_finds_its_shared_blocks() {
    let worker = RunningWorker::start(WorkerOptions {
        http: "127.0.0.1:0".parse().unwrap(),
        engine: EngineConfig {
            kv_blocks: 1_024,
            speedup: 50.0,
            ..EngineConfig::default()
        },
        ..WorkerOptions::default()
    })
    .await
    .unwrap();
    // Three requests 200 ms apart: the second shares its first 512-token block with the first,
    // the third its first two blocks.
    let rows = vec![
        TraceRow {
            timestamp: 0,
            input_length: 1_024,
            output_length: 4,
            hash_ids: vec![0, 1],
        },
        TraceRow {
            timestamp: 200,
            input_length: 1_024,
            output_length: 4,
            hash_ids: vec![0, 2],
        },
        TraceRow {
            timestamp: 400,
            input_length: 1_300,
            output_length: 4,
            hash_ids: vec![0, 1, 3],
        },
    ];
    let options = ReplayOptions {
        url: format!("http://{}", worker.http),
        model: Some("kvroute-sim".into()),
        concurrency: None,
        timeout: Duration::from_secs(30),
        api_key: None,
        text: None,
        // The worker, and a port nothing listens on (a killed worker, or a wrong URL).
        oracle: vec![
            format!("http://{}", worker.http),
            format!("http://{}", closed_port()),
        ],
    };
    let (records, report) = run(&Workload::trace("small", rows), &options, &|_, _| {})
        .await
        .unwrap();
    assert_eq!((report.ok, report.failed), (3, 0), "{records:?}");
    let cached: Vec<u32> = records.iter().map(|r| r.cached_tokens).collect();
    assert_eq!(cached, [0, 512, 1_024]);
    assert!((report.hit_rate - 1_536.0 / 3_348.0).abs() < 1e-12);
    // The one worker is the oracle: asked just before each sending, it held what the request
    // then found.
    let oracle: Vec<Option<u32>> = records.iter().map(|r| r.oracle_cached_tokens).collect();
    assert_eq!(oracle, [Some(0), Some(512), Some(1_024)]);
    assert!((report.oracle_hit_rate - report.hit_rate).abs() < 1e-12);
    assert_eq!(report.hit_over_oracle, 1.0);
    assert_eq!((report.oracle_missing, report.oracle_unreachable), (0, 3));
    assert!(records
        .iter()
        .all(|r| r.output_tokens == 4 && r.chunks == 4));
    // Open loop: sent at the trace's times.
    assert!(
        records[2].sent_ms >= 400.0 && records[2].sent_ms < 1_000.0,
        "{records:?}"
    );
    // A worker sets no routing headers: no prediction to score.
    assert_eq!(report.prediction_accuracy, 0.0);
}

#[test]
fn the_load_over_time_is_what_a_hand_count_gives() {
    // Worker 7 holds 100 tokens from 0 to 1,000 ms, worker 3 holds 300 from 500 to 1,000 ms;
    // two windows of 500 ms.
    let mut a = record(90, 0, 10.0, 1_000.0, 10, 7, 0);
    a.sent_ms = 0.0;
    let mut b = record(290, 0, 10.0, 500.0, 10, 3, 0);
    b.sent_ms = 500.0;
    let windows = kvroute::replay::load_windows(&[a.clone(), b.clone()], 2);
    // Decision times (µs) as the headers gave them; a request without one is left out.
    let (mut c, mut d) = (a.clone(), b.clone());
    c.decision_us = Some(4.0);
    d.decision_us = Some(9.0);
    c.prompt_read_us = Some(30.0);
    d.prompt_read_us = Some(70.0);
    let report = kvroute::replay::figures(&[c, d, a.clone()], 1.0);
    assert_eq!((report.decision_p50_us, report.decision_p99_us), (4.0, 9.0));
    assert_eq!(
        (report.prompt_read_p50_us, report.prompt_read_p99_us),
        (30.0, 70.0)
    );
    // Workers in id order: 3, then 7.
    assert_eq!(
        windows,
        [(0.5, vec![0.0, 100.0]), (1.0, vec![300.0, 100.0])]
    );
    // Without worker headers there is nothing to draw.
    let mut c = a.clone();
    c.worker = None;
    assert!(kvroute::replay::load_windows(&[c], 2).is_empty());
    // The plot names every run, and a run read back from replay's JSON is the same run.
    let run = kvroute::replay::PlottedRun {
        label: "through kvroute".into(),
        records: vec![a.clone(), b.clone()],
        report: kvroute::replay::figures(&[a, b], 1.0),
    };
    let json =
        serde_json::json!({"label": "earlier", "requests": run.records, "report": run.report});
    let earlier = kvroute::replay::PlottedRun::from_json(&json, "file").unwrap();
    assert_eq!(earlier.label, "earlier");
    assert_eq!(earlier.records.len(), 2);
    assert_eq!(earlier.report.hit_rate, run.report.hit_rate);
    let path = std::env::temp_dir().join(format!("kvroute-replay-{}.svg", std::process::id()));
    kvroute::replay::write_plot(&[run, earlier], &path).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.contains("through kvroute") && svg.contains("earlier"));
    assert!(svg.contains("wall time (s)"));
    std::fs::remove_file(&path).unwrap();
}

/// A loopback address nothing listens on.
fn closed_port() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}
