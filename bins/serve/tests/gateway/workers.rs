//! Adding workers through the API: a refused add changes nothing, and the bounds hold.

use kvroute_serve::{ServeOptions, MAX_DP_SIZE};
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::gateway;

async fn add(client: &reqwest::Client, url: &str, body: Value) -> (StatusCode, Value) {
    super::post_json(client, &format!("{url}/v1/workers"), &body).await
}

async fn worker_ids(client: &reqwest::Client, url: &str) -> Vec<u64> {
    let v = super::get_json(client, &format!("{url}/v1/workers")).await;
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_u64().unwrap())
        .collect()
}

#[tokio::test]
async fn a_refused_add_leaves_the_registry_and_the_router_as_they_were() {
    let (serve, url) = gateway(ServeOptions {
        max_kv_blocks: 100_000,
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    let (status, _) = add(
        &client,
        &url,
        json!({"id": 1, "url": "http://127.0.0.1:9", "kv_blocks": 64}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let ranks_before = serve.router().fleet().ranks.len();
    let refused = [
        // Far more ranks than any engine runs (this once registered 65,536 ghost ranks).
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": 64, "dp_size": 70_000}),
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": 64, "dp_size": MAX_DP_SIZE + 1}),
        // A cache past the ceiling (this once took 338 MB of index up front).
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": i64::MAX}),
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": 100_001}),
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": 0}),
        // Within the ceiling per rank, past it over the ranks.
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": 60_000, "dp_size": 2}),
        // Rank 1 would publish past port 65535.
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": 64, "dp_size": 2,
               "kv_events": "tcp://127.0.0.1:65535"}),
        // Not the router's block size.
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": 64, "block_size": 32}),
        json!({"id": 2, "url": "ftp://127.0.0.1:9", "kv_blocks": 64}),
        // Engines are reached over plain HTTP: a TLS URL is refused when it joins, not on
        // every request sent to it.
        json!({"id": 2, "url": "https://127.0.0.1:9", "kv_blocks": 64}),
        json!({"id": 2, "url": "http://", "kv_blocks": 64}),
        // A bootstrap port on a worker that does not prefill (SGLang's decode servers take
        // none).
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": 64, "role": "decode",
               "bootstrap_port": 8998}),
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": 64, "bootstrap_port": 8998}),
        // The id is taken.
        json!({"id": 1, "url": "http://127.0.0.1:10", "kv_blocks": 64}),
    ];
    for body in refused {
        let (status, answer) = add(&client, &url, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert!(answer["error"]["message"].is_string(), "{answer}");
        assert_eq!(serve.router().fleet().ranks.len(), ranks_before, "{body}");
        assert_eq!(worker_ids(&client, &url).await, [1], "{body}");
    }
    // Nothing of them stayed: the same id joins with a valid spec, and /metrics stays small.
    let (status, _) = add(
        &client,
        &url,
        json!({"id": 2, "url": "http://127.0.0.1:9", "kv_blocks": 64, "dp_size": 4}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(serve.router().fleet().ranks.len(), ranks_before + 4);
    let metrics = super::get_text(&client, &format!("{url}/metrics")).await;
    assert!(
        metrics.len() < 200_000,
        "{} bytes of metrics",
        metrics.len()
    );
    serve.stop();
}

#[tokio::test]
async fn worker_urls_and_endpoints_must_lie_in_the_configured_networks() {
    let (serve, url) = gateway(ServeOptions {
        worker_networks: vec!["127.0.0.0/8".parse().unwrap(), "::1".parse().unwrap()],
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    for body in [
        json!({"id": 1, "url": "http://192.0.2.7:8000", "kv_blocks": 64}),
        json!({"id": 1, "url": "http://[2001:db8::1]:8000", "kv_blocks": 64}),
        json!({"id": 1, "url": "http://127.0.0.1:8000", "kv_blocks": 64,
               "kv_events": "tcp://192.0.2.7:5557"}),
    ] {
        let (status, answer) = add(&client, &url, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert!(worker_ids(&client, &url).await.is_empty());
    }
    // A name is resolved, and each of its addresses must lie inside.
    let (status, answer) = add(
        &client,
        &url,
        json!({"id": 1, "url": "http://localhost:8000", "kv_blocks": 64}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{answer}");
    serve.stop();
}
