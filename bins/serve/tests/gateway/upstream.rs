//! Engines that stop answering or fail one request: stand-in engines on loopback (axum), one
//! that takes connections and then answers nothing (as a paused process does), one that
//! answers 500 to one prompt, one that breaks before its first chunk.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::response::IntoResponse;
use axum::routing::{get, post};
use kvroute_serve::ServeOptions;
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::gateway;

/// A stand-in engine: its `/v1/completions` answers at once (a 500 to `fail_prompt`), and
/// counts what it got; once `paused` is set, it and its health answer nothing for an hour (as
/// a paused process).
async fn engine(fail_prompt: Option<u32>) -> (String, Arc<AtomicU64>, Arc<AtomicBool>) {
    let got = Arc::new(AtomicU64::new(0));
    let count = Arc::clone(&got);
    let paused = Arc::new(AtomicBool::new(false));
    let (pause, pause_health) = (Arc::clone(&paused), Arc::clone(&paused));
    let stall = |paused: Arc<AtomicBool>| async move {
        if paused.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
    };
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            post(move |axum::Json(body): axum::Json<Value>| {
                let count = Arc::clone(&count);
                let pause = Arc::clone(&pause);
                async move {
                    count.fetch_add(1, Ordering::Relaxed);
                    stall(pause).await;
                    let first = body["prompt"][0].as_u64().map(|t| t as u32);
                    if first.is_some() && first == fail_prompt {
                        return (StatusCode::INTERNAL_SERVER_ERROR, "cannot take it")
                            .into_response();
                    }
                    (
                        StatusCode::OK,
                        r#"{"object":"text_completion","choices":[]}"#,
                    )
                        .into_response()
                }
            }),
        )
        .route(
            "/health",
            get(move || {
                let pause = Arc::clone(&pause_health);
                async move {
                    stall(pause).await;
                    "ok"
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, got, paused)
}

/// Waits until serve takes requests for every worker of `ids` (their health answered).
async fn ready(client: &reqwest::Client, url: &str, ids: &[u64]) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let v = super::get_json(client, &format!("{url}/v1/workers")).await;
        let workers = v["workers"].as_array().unwrap();
        let up = |id: &u64| workers.iter().any(|w| w["id"] == *id && w["ready"] == true);
        if ids.iter().all(up) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn add(client: &reqwest::Client, url: &str, id: u64, engine: &str) {
    let r = client
        .post(format!("{url}/v1/workers"))
        .json(&json!({"id": id, "url": engine, "kv_blocks": 1024}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
}

async fn health(client: &reqwest::Client, url: &str, id: u64) -> String {
    let v = super::get_json(client, &format!("{url}/v1/workers")).await;
    let w = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["id"] == id)
        .unwrap()
        .clone();
    w["ranks"][0]["health"].as_str().unwrap().to_owned()
}

async fn complete(client: &reqwest::Client, url: &str, first: u32) -> StatusCode {
    client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": (0..40).map(|t| first + t).collect::<Vec<u32>>(), "max_tokens": 1}))
        .send()
        .await
        .unwrap()
        .status()
}

/// The worker `/v1/route` names for a prompt from `first`.
async fn routed_to(client: &reqwest::Client, url: &str, first: u32) -> u64 {
    let v: Value = client
        .post(format!("{url}/v1/route"))
        .json(&json!({"prompt": (0..40).map(|t| first + t).collect::<Vec<u32>>()}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["worker"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_engine_is_routed_around_and_marked_down() {
    let (hung, hung_got, pause) = engine(None).await;
    let (live, live_got, _) = engine(None).await;
    let (serve, url) = gateway(ServeOptions {
        first_byte_timeout: Duration::from_millis(300),
        breaker_failures: 2,
        probe_every: Duration::from_millis(100),
        retries: 1,
        router: kvroute_core::RouterConfig {
            policy: kvroute_core::Policy::RoundRobin,
            ..kvroute_core::RouterConfig::default()
        },
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    add(&client, &url, 1, &hung).await;
    add(&client, &url, 2, &live).await;
    ready(&client, &url, &[1, 2]).await;
    // Paused after it was seen up: every request is answered, by the live engine, within
    // about one timeout.
    pause.store(true, Ordering::Relaxed);
    for i in 0..8 {
        let start = std::time::Instant::now();
        assert_eq!(complete(&client, &url, i * 1000).await, StatusCode::OK);
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
    }
    assert_eq!(live_got.load(Ordering::Relaxed), 8);
    // Two timeouts in a row marked the paused engine down; its prober gets no answer either,
    // so it stays down and takes no more requests.
    assert_ne!(health(&client, &url, 1).await, "Healthy");
    let tried = hung_got.load(Ordering::Relaxed);
    assert!((2..=3).contains(&tried), "{tried}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_ne!(health(&client, &url, 1).await, "Healthy");
    serve.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prompt_that_makes_an_engine_fail_does_not_take_it_down() {
    let (flaky, flaky_got, _) = engine(Some(999_999)).await;
    let (serve, url) = gateway(ServeOptions {
        breaker_failures: 3,
        retries: 2,
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    add(&client, &url, 1, &flaky).await;
    // The one bad prompt fails (its 500 reaches the client), the engine stays up...
    assert_eq!(
        complete(&client, &url, 999_999).await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(health(&client, &url, 1).await, "Healthy");
    // ...and serves the next requests.
    for i in 0..4 {
        assert_eq!(complete(&client, &url, i * 1000).await, StatusCode::OK);
    }
    assert_eq!(flaky_got.load(Ordering::Relaxed), 5);
    // Failures in a row do mark it down.
    for _ in 0..3 {
        complete(&client, &url, 999_999).await;
    }
    assert_ne!(health(&client, &url, 1).await, "Healthy");
    serve.stop();
}

/// A stand-in engine that streams: its answer's head goes out, then, with `dies`, the
/// connection breaks before the first chunk (an engine killed during prefill); else one chunk
/// and `[DONE]`.
async fn streaming_engine(dies: bool) -> (String, Arc<AtomicU64>) {
    let got = Arc::new(AtomicU64::new(0));
    let count = Arc::clone(&got);
    let app = axum::Router::new().route(
        "/v1/completions",
        post(move || {
            let count = Arc::clone(&count);
            async move {
                count.fetch_add(1, Ordering::Relaxed);
                let chunks = futures_util::stream::unfold(0, move |n| async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let chunk = match (dies, n) {
                        (true, _) => Err(std::io::Error::other("killed")),
                        (false, 0) => Ok("data: {\"choices\":[{\"text\":\"a\"}]}\n\n"),
                        (false, 1) => Ok("data: [DONE]\n\n"),
                        _ => return None,
                    };
                    Some((chunk, n + 1))
                });
                (
                    [(axum::http::header::CONTENT_TYPE, "text/event-stream")],
                    axum::body::Body::from_stream(chunks),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_fails_before_its_first_chunk_is_retried_elsewhere() {
    let (dying, dying_got) = streaming_engine(true).await;
    let (live, live_got) = streaming_engine(false).await;
    let (serve, url) = gateway(ServeOptions {
        retries: 1,
        // The prober must not take the dying engine out first: it answers nothing else.
        probe_every: Duration::from_secs(3600),
        router: kvroute_core::RouterConfig {
            policy: kvroute_core::Policy::RoundRobin,
            ..kvroute_core::RouterConfig::default()
        },
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    add(&client, &url, 1, &dying).await;
    add(&client, &url, 2, &live).await;
    ready(&client, &url, &[1, 2]).await;
    // The client never sees the broken answers: nothing of them had reached it, so each went
    // to the other engine.
    for i in 0..4 {
        let r = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": (0..40).map(|t| i * 1000 + t).collect::<Vec<u32>>(), "max_tokens": 1, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["x-kvroute-worker"], "2");
        let body = r.text().await.unwrap();
        assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    }
    assert!(dying_got.load(Ordering::Relaxed) >= 1);
    assert_eq!(live_got.load(Ordering::Relaxed), 4);
    serve.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_gets_no_request_until_its_health_answers() {
    let (silent, silent_got, pause) = engine(None).await;
    pause.store(true, Ordering::Relaxed);
    let (live, live_got, _) = engine(None).await;
    let (serve, url) = gateway(ServeOptions {
        router: kvroute_core::RouterConfig {
            policy: kvroute_core::Policy::RoundRobin,
            ..kvroute_core::RouterConfig::default()
        },
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    add(&client, &url, 1, &silent).await;
    add(&client, &url, 2, &live).await;
    ready(&client, &url, &[2]).await;
    // Round robin would alternate: the engine that never answered its health gets nothing.
    for i in 0..6 {
        assert_eq!(complete(&client, &url, i * 1000).await, StatusCode::OK);
    }
    assert_eq!(silent_got.load(Ordering::Relaxed), 0);
    assert_eq!(live_got.load(Ordering::Relaxed), 6);
    // The decision alone says what the proxy does.
    for i in 0..4 {
        assert_eq!(routed_to(&client, &url, 50_000 + i * 1000).await, 2);
    }
    // It answers: from then on it takes its share.
    pause.store(false, Ordering::Relaxed);
    ready(&client, &url, &[1, 2]).await;
    for i in 0..6 {
        assert_eq!(
            complete(&client, &url, 100_000 + i * 1000).await,
            StatusCode::OK
        );
    }
    assert!(silent_got.load(Ordering::Relaxed) >= 2);
    serve.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_redirect_is_its_answer_not_followed_with_the_body() {
    // The redirect's target counts what reaches it.
    let (elsewhere, elsewhere_got, _) = engine(None).await;
    let target = format!("{elsewhere}/v1/completions");
    let app = axum::Router::new()
        .route(
            "/v1/completions",
            post(move || {
                let target = target.clone();
                async move {
                    (
                        StatusCode::TEMPORARY_REDIRECT,
                        [(reqwest::header::LOCATION, target)],
                    )
                        .into_response()
                }
            }),
        )
        .route("/health", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let redirecting = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let (serve, url) = gateway(ServeOptions::default()).await;
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    add(&client, &url, 1, &redirecting).await;
    ready(&client, &url, &[1]).await;
    assert_eq!(
        complete(&client, &url, 0).await,
        StatusCode::TEMPORARY_REDIRECT
    );
    assert_eq!(elsewhere_got.load(Ordering::Relaxed), 0);
    serve.stop();
}
