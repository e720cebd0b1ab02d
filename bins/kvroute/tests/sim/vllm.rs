//! vLLM's own KV-event publisher (its `kv_events.py`, unchanged from the 0.33.0 wheel; see
//! `scripts/fixtures.sh`) publishing to `kvroute serve` through an engine's life: serve started
//! after the engine published, a batch lost on the wire, restarts whose new sequence runs
//! below, equal to and past the old one, and one rank of two restarted.

use std::time::{Duration, Instant};

use serde_json::json;

use super::publishers::{
    blocks, events, fixtures, predicted, serve_sized, wait_predicted, Publisher,
};
use super::{free_port, Process};

/// vLLM's publisher for dp rank `rank`, bound on the base ports + `rank`, as vLLM binds them.
fn publisher(events: u16, replay: u16, rank: u32) -> Option<Publisher> {
    publisher_buffering(events, replay, rank, 10_000)
}

/// [`publisher`] whose replay buffer keeps the last `buffer_steps` batches.
fn publisher_buffering(
    events: u16,
    replay: u16,
    rank: u32,
    buffer_steps: u32,
) -> Option<Publisher> {
    let (python, path) = fixtures("vllm", "vllm/distributed/kv_events.py")?;
    let args = [
        format!("tcp://*:{events}"),
        format!("tcp://*:{replay}"),
        rank.to_string(),
        buffer_steps.to_string(),
    ];
    Some(Publisher::start(&python, &path, "vllm_publisher.py", &args))
}

/// Serve following vLLM's publisher on the base ports `events` and `replay`.
async fn serve_on(events: u16, replay: u16, dp_size: u32) -> (Process, String) {
    serve_on_sized(events, replay, dp_size, 4096).await
}

/// [`serve_on`], the worker declared with `kv_blocks` blocks per rank.
async fn serve_on_sized(
    events: u16,
    replay: u16,
    dp_size: u32,
    kv_blocks: u64,
) -> (Process, String) {
    let (events, replay) = (
        format!("tcp://127.0.0.1:{events}"),
        format!("tcp://127.0.0.1:{replay}"),
    );
    serve_sized(&events, &replay, dp_size, kv_blocks).await
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
    let (_serve, url) = serve_on(events_port, replay_port, 1).await;
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
    let (_serve, url) = serve_on(events_port, replay_port, 2).await;
    let client = reqwest::Client::new();
    let (a_hashes, a_tokens) = blocks(0, 4);
    let (b_hashes, b_tokens) = blocks(100, 4);
    // Until both subscriptions are live, a store could precede them: the catch-up fetches it.
    rank0.send(json!({"op": "store", "hashes": a_hashes, "parent": null, "tokens": a_tokens}));
    rank1.send(json!({"op": "store", "hashes": b_hashes, "parent": null, "tokens": b_tokens}));
    wait_predicted(&client, &url, &a_tokens, 64).await;
    wait_predicted(&client, &url, &b_tokens, 64).await;
    rank1.send(json!({"op": "restart"}));
    wait_predicted(&client, &url, &b_tokens, 0).await;
    assert_eq!(predicted(&client, &url, &a_tokens).await, 64);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r1 = events(&client, &url, 1).await;
        if r1["state"] == "live" {
            assert_eq!(r1["new_epochs"], 1, "{r1}");
            break;
        }
        assert!(Instant::now() < deadline, "{r1}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r0 = events(&client, &url, 0).await;
    assert_eq!(r0["new_epochs"], 0, "{r0}");
    assert_eq!(r0["state"], "live", "{r0}");
    // The restarted rank goes on: a new store on it is followed.
    let (c_hashes, c_tokens) = blocks(200, 2);
    rank1.send(json!({"op": "store", "hashes": c_hashes, "parent": null, "tokens": c_tokens}));
    wait_predicted(&client, &url, &c_tokens, 32).await;
}

/// Waits until serve's events of rank 0 meet `done`; returns them.
async fn wait_events(
    client: &reqwest::Client,
    url: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let e = events(client, url, 0).await;
        if done(&e) {
            return e;
        }
        assert!(Instant::now() < deadline, "never came: {e}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_met_after_its_replay_turned_over_is_partial_until_its_cache_turns_over() {
    let (events_port, replay_port) = (free_port(), free_port());
    // A replay buffer of 3 batches, and a cache of 16 blocks.
    let Some(mut publisher) = publisher_buffering(events_port, replay_port, 0, 3) else {
        crate::skip_without_fixtures(
            "no vLLM publisher in target/fixtures (run scripts/fixtures.sh)",
        );
        return;
    };
    // Before serve is there: a chain of 4 blocks (seq 0), then four of one block (1..=4); the
    // replay keeps 2..=4 only.
    let (a_hashes, a_tokens) = blocks(0, 4);
    publisher.send(json!({"op": "store", "hashes": a_hashes, "parent": null, "tokens": a_tokens}));
    store_each(&mut publisher, 100, 4);
    let (_serve, url) = serve_on_sized(events_port, replay_port, 1, 16).await;
    let client = reqwest::Client::new();
    let e = wait_events(&client, &url, |e| e["state"] == "partial").await;
    assert_eq!(e["caught_up_batches"], 3, "{e}");
    let (_, known) = blocks(103, 1);
    wait_predicted(&client, &url, &known, 16).await;
    assert_eq!(
        predicted(&client, &url, &a_tokens).await,
        0,
        "never seen stored"
    );
    // The engine continues the chain it stored before serve came: the parent is unknown to
    // the index (and to every other rank), so nothing is placed, and the rank stays partial.
    let (b_hashes, b_tokens) = blocks(4, 2);
    publisher.send(json!({
        "op": "store", "hashes": b_hashes, "parent": a_hashes[3], "tokens": b_tokens,
    }));
    let e = wait_events(&client, &url, |e| e["unrooted_stores"] == 1).await;
    assert_eq!(e["state"], "partial", "{e}");
    assert_eq!(e["placed_under_peer"], 0, "{e}");
    assert_eq!(e["turnover_blocks"], 0, "{e}");
    let whole: Vec<u32> = a_tokens.iter().chain(&b_tokens).copied().collect();
    assert_eq!(predicted(&client, &url, &whole).await, 0, "never credited");
    // The engine evicts its 10 blocks (those the index never saw are counted, the others
    // removed) and stores 15 new ones: not yet its whole cache.
    let old: Vec<i64> = (100..104)
        .flat_map(|b| blocks(b, 1).0)
        .chain(a_hashes.iter().chain(&b_hashes).copied())
        .collect();
    publisher.send(json!({"op": "remove", "hashes": old}));
    store_each(&mut publisher, 300, 15);
    let e = wait_events(&client, &url, |e| e["turnover_blocks"] == 15).await;
    assert_eq!(e["state"], "partial", "{e}");
    // The 16th: the engine has stored its whole cache since the last sign of an older
    // block, so what the index lacked is gone from the engine too.
    store_each(&mut publisher, 315, 1);
    let e = wait_events(&client, &url, |e| e["state"] == "live").await;
    assert_eq!(e["turnover_blocks"], 16, "{e}");
    let (_, newest) = blocks(315, 1);
    assert_eq!(predicted(&client, &url, &newest).await, 16, "{e}");
}
