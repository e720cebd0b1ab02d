//! SGLang's own KV-event publisher (its `kv_events.py`, unchanged from the 0.5.23 wheel; see
//! `scripts/fixtures.sh`) publishing to `kvroute serve`: stores, removes and clears land in the
//! index; a batch lost on the wire is repaired through the replay socket; a restarted
//! publisher clears the worker.

use std::time::{Duration, Instant};

use serde_json::json;

use super::free_port;
use super::publishers::{blocks, events, fixtures, predicted, serve, wait_predicted, Publisher};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglangs_own_publisher_feeds_the_index_through_loss_and_restart() {
    let Some((python, path)) = fixtures("sglang", "sglang/srt/disaggregation/kv_events.py") else {
        crate::skip_without_fixtures(
            "no SGLang publisher in target/fixtures (run scripts/fixtures.sh)",
        );
        return;
    };
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let replay = format!("tcp://127.0.0.1:{}", free_port());
    let args = [endpoint.clone(), replay.clone()];
    let mut publisher = Publisher::start(&python, &path, "sglang_publisher.py", &args);
    let (_serve, url) = serve(&endpoint, &replay, 1).await;
    let client = reqwest::Client::new();
    // Until the subscription is connected, stores are lost to the slow joiner: repeat one.
    let (warm_hashes, warm_tokens) = blocks(900, 2);
    let deadline = Instant::now() + Duration::from_secs(20);
    while predicted(&client, &url, &warm_tokens).await != 32 {
        assert!(Instant::now() < deadline, "no event reached the router");
        publisher.send(
            json!({"op": "store", "hashes": warm_hashes, "parent": null, "tokens": warm_tokens}),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A stored chain of 4 blocks, then 2 more continuing it.
    let (a_hashes, a_tokens) = blocks(0, 6);
    publisher.send(
        json!({"op": "store", "hashes": a_hashes[..4], "parent": null, "tokens": a_tokens[..64]}),
    );
    publisher.send(json!({"op": "store", "hashes": a_hashes[4..], "parent": a_hashes[3], "tokens": a_tokens[64..]}));
    wait_predicted(&client, &url, &a_tokens, 96).await;
    // The last block evicted.
    publisher.send(json!({"op": "remove", "hashes": [a_hashes[5]]}));
    wait_predicted(&client, &url, &a_tokens, 80).await;
    // A batch lost on the wire: seen as a gap when the next arrives, fetched from the replay.
    let (b_hashes, b_tokens) = blocks(100, 3);
    let (c_hashes, c_tokens) = blocks(200, 2);
    publisher.send(json!({"op": "drop_next"}));
    publisher.send(json!({"op": "store", "hashes": b_hashes, "parent": null, "tokens": b_tokens}));
    publisher.send(json!({"op": "store", "hashes": c_hashes, "parent": null, "tokens": c_tokens}));
    wait_predicted(&client, &url, &c_tokens, 32).await;
    wait_predicted(&client, &url, &b_tokens, 48).await;
    let e = events(&client, &url, 0).await;
    assert_eq!(e["gaps"], 1, "{e}");
    assert_eq!(e["ranks_cleared"], 0, "{e}");
    assert!(e["replayed"].as_u64().unwrap() >= 1, "{e}");
    // AllBlocksCleared empties the worker.
    publisher.send(json!({"op": "clear"}));
    wait_predicted(&client, &url, &a_tokens, 0).await;
    wait_predicted(&client, &url, &b_tokens, 0).await;
    // Stored again, then the engine restarts: its sequence goes back to 0 and the worker is
    // cleared before the new process's first batch applies.
    publisher.send(
        json!({"op": "store", "hashes": a_hashes[..4], "parent": null, "tokens": a_tokens[..64]}),
    );
    wait_predicted(&client, &url, &a_tokens, 64).await;
    publisher.send(json!({"op": "restart"}));
    let (d_hashes, d_tokens) = blocks(300, 2);
    let deadline = Instant::now() + Duration::from_secs(20);
    while predicted(&client, &url, &d_tokens).await != 32 {
        assert!(
            Instant::now() < deadline,
            "the restarted publisher was never heard"
        );
        publisher
            .send(json!({"op": "store", "hashes": d_hashes, "parent": null, "tokens": d_tokens}));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        predicted(&client, &url, &a_tokens).await,
        0,
        "cleared at the restart"
    );
    let e = events(&client, &url, 0).await;
    assert_eq!(e["restarts"], 1, "{e}");
    assert_eq!(e["decode_errors"], 0, "{e}");
}
