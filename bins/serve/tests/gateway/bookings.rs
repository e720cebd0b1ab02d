//! Bookings made through `/v1/route`: freed by `DELETE`, or by expiry when nobody frees them.

use std::time::Duration;

use kvroute_core::{RouterConfig, WorkerId, WorkerRank};
use kvroute_serve::ServeOptions;
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::gateway;

#[tokio::test]
async fn a_booking_nobody_frees_expires_and_its_load_returns() {
    let (serve, url) = gateway(ServeOptions {
        router: RouterConfig {
            request_expiry: Duration::from_millis(300),
            ..RouterConfig::default()
        },
        expire_every: Duration::from_millis(50),
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    let added = client
        .post(format!("{url}/v1/workers"))
        .json(&json!({"id": 1, "url": "http://127.0.0.1:9", "kv_blocks": 64}))
        .send()
        .await
        .unwrap();
    assert_eq!(added.status(), StatusCode::CREATED);
    let rank = WorkerRank::new(1, 0);
    let book = |id: u32| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let r = client
                .post(format!("{url}/v1/route"))
                .json(&json!({"prompt": (0..64).map(|t| t + id * 100).collect::<Vec<u32>>(), "book": true}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            r.json::<Value>().await.unwrap()["request_id"]
                .as_u64()
                .unwrap()
        }
    };
    // One booking freed by its owner, one left behind.
    let freed = book(1).await;
    let _left = book(2).await;
    assert_eq!(serve.router().load(rank).unwrap().requests, 2);
    assert!((1 << 52..1 << 53).contains(&freed), "{freed}");
    let delete = client
        .delete(format!("{url}/v1/route/{freed}"))
        .send()
        .await
        .unwrap();
    assert_eq!(delete.status(), StatusCode::NO_CONTENT);
    assert_eq!(serve.router().load(rank).unwrap().requests, 1);
    // The one left behind is freed by expiry, and counted.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while serve.router().load(rank).unwrap().requests > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the booking never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let load = serve.router().load(rank).unwrap();
    assert_eq!((load.prefill_tokens, load.decode_blocks()), (0, 0));
    let metrics = super::get_text(&client, &format!("{url}/metrics")).await;
    assert!(
        metrics.contains("kvroute_bookings_expired_total 1"),
        "{metrics}"
    );
    assert!(serve.router().fleet().worker(WorkerId(1)).is_some());
    serve.stop();
}

/// `DELETE /v1/route/{id}` frees `/v1/route`'s bookings only: a proxied request in flight
/// (whose id is the gateway's count, without the route's mark) keeps its booking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_route_frees_its_own_bookings_not_a_proxied_requests() {
    let slow = axum::Router::new().route(
        "/v1/completions",
        axum::routing::post(|| async {
            tokio::time::sleep(Duration::from_millis(800)).await;
            axum::Json(json!({"choices": []}))
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, slow).await });
    let (serve, url) = gateway(ServeOptions::default()).await;
    let client = reqwest::Client::new();
    let added = client
        .post(format!("{url}/v1/workers"))
        .json(&json!({"id": 1, "url": engine, "kv_blocks": 64}))
        .send()
        .await
        .unwrap();
    assert_eq!(added.status(), StatusCode::CREATED);
    let rank = WorkerRank::new(1, 0);
    let in_flight = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            client
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": (0..64).collect::<Vec<u32>>()}))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while serve.router().load(rank).unwrap().requests == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never booked");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The gateway's first request is number 0.
    let refused = client
        .delete(format!("{url}/v1/route/0"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::NOT_FOUND);
    assert_eq!(serve.router().load(rank).unwrap().requests, 1);
    assert_eq!(in_flight.await.unwrap(), StatusCode::OK);
    assert_eq!(serve.router().load(rank).unwrap().requests, 0);
    serve.stop();
}
