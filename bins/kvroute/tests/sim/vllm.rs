//! vLLM's own KV-event publisher (its `kv_events.py`, unchanged from the 0.33.0 wheel; see
//! `scripts/fixtures.sh`) publishing to `kvroute serve` through an engine's life: serve started
//! after the engine published, a batch lost on the wire, restarts whose new sequence runs
//! below, equal to and past the old one, and one rank of two restarted.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::publishers::{blocks, predicted, wait_predicted, Publisher};
use super::{free_port, Process};

/// The fixtures' Python and vLLM's module path, when `scripts/fixtures.sh` has run.
fn fixtures() -> Option<(PathBuf, PathBuf)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let fixtures = root.join("target/fixtures");
    let python = fixtures.join("venv/bin/python");
    let module = fixtures.join("vllm/vllm/distributed/kv_events.py");
    (python.exists() && module.exists()).then(|| (python, fixtures.join("vllm")))
}

/// vLLM's publisher for dp rank `rank`, bound on the base ports + `rank`, as vLLM binds them.
fn publisher(events: u16, replay: u16, rank: u32) -> Option<Publisher> {
    let (python, path) = fixtures()?;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/vllm_publisher.py");
    let mut child = Command::new(python)
        .arg(script)
        .arg(format!("tcp://*:{events}"))
        .arg(format!("tcp://*:{replay}"))
        .arg(rank.to_string())
        .env("PYTHONPATH", path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut publisher = Publisher {
        stdin: child.stdin.take().unwrap(),
        stdout: BufReader::new(child.stdout.take().unwrap()),
        child,
    };
    // It answers once bound.
    let mut line = String::new();
    publisher.stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ok", "the publisher said {line:?}");
    Some(publisher)
}

/// `kvroute serve` following a worker with `dp_size` ranks publishing on `events`/`replay`
/// (and + r), answering on the URL returned. The worker's HTTP is never called: the tests
/// ask `/v1/route`.
async fn serve(events: u16, replay: u16, dp_size: u32) -> (Process, String) {
    let http = free_port();
    let process = Process(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--listen", &format!("127.0.0.1:{http}")])
            .arg("--worker")
            .arg(format!(
                "url=http://127.0.0.1:1,events=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay},kv_blocks=4096,dp_size={dp_size}"
            ))
            .env("KVROUTE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = format!("http://127.0.0.1:{http}");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while client.get(format!("{url}/health")).send().await.is_err() {
        assert!(Instant::now() < deadline, "serve never answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (process, url)
}

/// A free port whose next one is free too (dp rank 1 binds the base port + 1).
fn port_pair() -> u16 {
    loop {
        let port = free_port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

/// Serve's event counts of rank `rank`.
async fn events(client: &reqwest::Client, url: &str, rank: usize) -> Value {
    let w: Value = client
        .get(format!("{url}/v1/workers"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    w["workers"][0]["ranks"][rank]["events"].clone()
}

/// Stores `n` chains of one block each, `first..first + n`.
fn store_each(publisher: &mut Publisher, first: u32, n: u32) {
    for b in first..first + n {
        let (hashes, tokens) = blocks(b, 1);
        publisher.send(json!({"op": "store", "hashes": hashes, "parent": null, "tokens": tokens}));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_publisher_is_followed_from_a_late_start_through_loss_and_restarts() {
    let (events_port, replay_port) = (free_port(), free_port());
    let Some(mut publisher) = publisher(events_port, replay_port, 0) else {
        crate::skip_without_fixtures(
            "no vLLM publisher in target/fixtures (run scripts/fixtures.sh)",
        );
        return;
    };
    // The engine publishes before serve is there: a chain of 4 blocks.
    let (a_hashes, a_tokens) = blocks(0, 4);
    publisher.send(json!({"op": "store", "hashes": a_hashes, "parent": null, "tokens": a_tokens}));
    let (_serve, url) = serve(events_port, replay_port, 1).await;
    let client = reqwest::Client::new();
    // Serve's first connection reads the replay: the chain is known with nothing sent again.
    wait_predicted(&client, &url, &a_tokens, 64).await;
    let e = events(&client, &url, 0).await;
    assert_eq!(e["catch_ups"], 1, "{e}");
    assert_eq!(e["state"], "live", "{e}");
    // A batch lost on the wire: fetched from the replay when the next one shows the gap.
    let (b_hashes, b_tokens) = blocks(100, 3);
    let (c_hashes, c_tokens) = blocks(200, 2);
    publisher.send(json!({"op": "drop_next"}));
    publisher.send(json!({"op": "store", "hashes": b_hashes, "parent": null, "tokens": b_tokens}));
    publisher.send(json!({"op": "store", "hashes": c_hashes, "parent": null, "tokens": c_tokens}));
    wait_predicted(&client, &url, &b_tokens, 48).await;
    wait_predicted(&client, &url, &c_tokens, 32).await;
    // The old process numbered 0..=2; a new one publishes 0..=3 at once, so that its seqs run
    // to and past the old next one (3) before serve is back: none of the old blocks may stay.
    publisher.send(json!({"op": "restart"}));
    store_each(&mut publisher, 300, 4);
    for b in 300..304 {
        wait_predicted(&client, &url, &blocks(b, 1).1, 16).await;
    }
    for tokens in [&a_tokens, &b_tokens, &c_tokens] {
        assert_eq!(
            predicted(&client, &url, tokens).await,
            0,
            "a stale block stayed"
        );
    }
    // Another new process that publishes less than the last (its seq below the old next).
    publisher.send(json!({"op": "restart"}));
    store_each(&mut publisher, 400, 1);
    wait_predicted(&client, &url, &blocks(400, 1).1, 16).await;
    for b in 300..304 {
        assert_eq!(
            predicted(&client, &url, &blocks(b, 1).1).await,
            0,
            "a stale block stayed"
        );
    }
    let e = events(&client, &url, 0).await;
    assert_eq!(e["new_epochs"], 2, "{e}");
    assert_eq!(e["lost_batches"], 0, "{e}");
    assert_eq!(e["held_batches"], 0, "{e}");
    assert_eq!(e["decode_errors"], 0, "{e}");
    assert_eq!(e["state"], "live", "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_rank_of_two_restarted_leaves_the_other_ranks_blocks() {
    // Rank 1 binds the base ports + 1.
    let (events_port, replay_port) = (port_pair(), port_pair());
    let Some(mut rank0) = publisher(events_port, replay_port, 0) else {
        crate::skip_without_fixtures(
            "no vLLM publisher in target/fixtures (run scripts/fixtures.sh)",
        );
        return;
    };
    let Some(mut rank1) = publisher(events_port, replay_port, 1) else {
        return;
    };
    let (_serve, url) = serve(events_port, replay_port, 2).await;
    let client = reqwest::Client::new();
    let (a_hashes, a_tokens) = blocks(0, 4);
    let (b_hashes, b_tokens) = blocks(100, 4);
    // Until both subscriptions are live, a store could precede them: the catch-up fetches it.
    rank0.send(json!({"op": "store", "hashes": a_hashes, "parent": null, "tokens": a_tokens}));
    rank1.send(json!({"op": "store", "hashes": b_hashes, "parent": null, "tokens": b_tokens}));
    wait_predicted(&client, &url, &a_tokens, 64).await;
    wait_predicted(&client, &url, &b_tokens, 64).await;
    rank1.send(json!({"op": "restart"}));
    let mut p = b_tokens.clone();
    p.extend([7, 7, 7]);
    let v: Value = client
        .post(format!("{url}/v1/route"))
        .json(&json!({"prompt": p}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    eprintln!("DEBUG route {v}");
    wait_predicted(&client, &url, &b_tokens, 0).await;
    assert_eq!(predicted(&client, &url, &a_tokens).await, 64);
    let (r0, r1) = (
        events(&client, &url, 0).await,
        events(&client, &url, 1).await,
    );
    assert_eq!(r0["new_epochs"], 0, "{r0}");
    assert_eq!(r1["new_epochs"], 1, "{r1}");
}
