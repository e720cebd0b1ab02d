//! Disaggregated serving through the gateway, against stand-in engines that speak both
//! protocols' fields and record every body they get: what each half is sent, in vLLM's and
//! SGLang's protocol; serving whole when no prefill worker is ready (or a 503 when enforced);
//! a failing prefill worker; pins; transfer labels; conditional disaggregation; a client that
//! leaves after the prefill; and `/v1/route`'s two choices.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::response::IntoResponse;
use axum::routing::{get, post};
use kvroute_serve::disagg::{Conditional, DisaggOptions, Protocol};
use kvroute_serve::ServeOptions;
use reqwest::StatusCode;
use serde_json::{json, Value};

use super::gateway;

/// A stand-in engine's behaviour.
#[derive(Clone, Copy, Default)]
struct Plays {
    /// Answers every completion with a 500.
    fail: bool,
    /// Waits this long before answering a completion.
    delay: Duration,
    /// Answers a 503 to a decode half in SGLang's protocol (its transfer failed), and serves
    /// whole requests.
    fail_split: bool,
    /// Refuses every completion with a 400 (a prompt past its context, say).
    refuse: bool,
}

/// A stand-in engine: records each completion body; a request asking for a remote decode
/// (vLLM's prefill half) is answered with transfer parameters naming the engine, a streamed
/// one with two SSE chunks, any other with a JSON completion naming the engine.
struct Engine {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
    /// Completions fail with a 500 while set (from `Plays::fail`).
    failing: Arc<AtomicBool>,
    /// `/health` answers 503 while set.
    sick: Arc<AtomicBool>,
    /// The bodies of the completions it answered to the end (their connection still open
    /// once its delay was over).
    finished: Arc<Mutex<Vec<Value>>>,
    /// Stops it: no new connection is taken and idle ones are closed (a killed engine).
    kill: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl Engine {
    async fn start(name: &'static str, plays: Plays) -> Engine {
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&bodies);
        let failing = Arc::new(AtomicBool::new(plays.fail));
        let sick = Arc::new(AtomicBool::new(false));
        let (fails, ill) = (Arc::clone(&failing), Arc::clone(&sick));
        let finished = Arc::new(Mutex::new(Vec::new()));
        let done = Arc::clone(&finished);
        let answer = move |axum::Json(body): axum::Json<Value>| {
            let (seen, fails, done) = (Arc::clone(&seen), Arc::clone(&fails), Arc::clone(&done));
            async move {
                seen.lock().unwrap().push(body.clone());
                tokio::time::sleep(plays.delay).await;
                done.lock().unwrap().push(body.clone());
                if fails.load(Ordering::Relaxed) {
                    return (StatusCode::INTERNAL_SERVER_ERROR, "engine failed").into_response();
                }
                if plays.refuse {
                    let refusal = json!({"error": {"message": "the prompt is too long"}});
                    return (StatusCode::BAD_REQUEST, axum::Json(refusal)).into_response();
                }
                if plays.fail_split && body.get("bootstrap_room").is_some() {
                    return (StatusCode::SERVICE_UNAVAILABLE, "the KV transfer failed")
                        .into_response();
                }
                if body["kv_transfer_params"]["do_remote_decode"] == true {
                    let params = json!({"remote_engine_id": name, "remote_block_ids": [1, 2]});
                    return axum::Json(json!({"choices": [], "kv_transfer_params": params}))
                        .into_response();
                }
                if body["stream"] == true {
                    let chunks = format!("data: {{\"engine\":\"{name}\"}}\n\ndata: [DONE]\n\n");
                    return ([("content-type", "text/event-stream")], chunks).into_response();
                }
                axum::Json(json!({"engine": name, "choices": []})).into_response()
            }
        };
        let app = axum::Router::new()
            .route("/v1/completions", post(answer.clone()))
            .route("/v1/chat/completions", post(answer))
            .route(
                "/health",
                get(move || {
                    let sick = ill.load(Ordering::Relaxed);
                    async move {
                        if sick {
                            StatusCode::SERVICE_UNAVAILABLE
                        } else {
                            StatusCode::OK
                        }
                    }
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (kill, killed) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = killed.await;
                })
                .await
        });
        Engine {
            url,
            bodies,
            failing,
            sick,
            finished,
            kill: Mutex::new(Some(kill)),
        }
    }

    /// Kills it: later connections are refused.
    async fn kill(&self) {
        if let Some(kill) = self.kill.lock().unwrap().take() {
            let _ = kill.send(());
        }
        let addr = self.url.trim_start_matches("http://").to_owned();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while tokio::net::TcpStream::connect(&addr).await.is_ok() {
            assert!(std::time::Instant::now() < deadline, "{addr} still listens");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
}

/// A gateway with `options`, and the workers `(id, engine, role, labels)` ready.
async fn fleet(
    options: ServeOptions,
    workers: &[(u64, &Engine, &str, Value)],
) -> (kvroute_serve::RunningServe, String, reqwest::Client) {
    let (serve, url) = gateway(ServeOptions {
        router: kvroute_core::RouterConfig {
            policy: kvroute_core::Policy::RoundRobin,
            ..options.router.clone()
        },
        ..options
    })
    .await;
    let client = reqwest::Client::new();
    for (id, engine, role, labels) in workers {
        let mut spec = json!({
            "id": id, "url": engine.url, "kv_blocks": 1024, "role": role, "labels": labels,
        });
        if *role == "prefill" {
            spec["bootstrap_port"] = json!(9100 + id);
        }
        let r = client
            .post(format!("{url}/v1/workers"))
            .json(&spec)
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            StatusCode::CREATED,
            "{}",
            r.text().await.unwrap()
        );
    }
    let ids: Vec<u64> = workers.iter().map(|w| w.0).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let v = super::get_json(&client, &format!("{url}/v1/workers")).await;
        let all = v["workers"].as_array().unwrap();
        if ids
            .iter()
            .all(|id| all.iter().any(|w| w["id"] == *id && w["ready"] == true))
        {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (serve, url, client)
}

fn options(protocol: Protocol) -> ServeOptions {
    ServeOptions {
        disagg: DisaggOptions {
            protocol,
            ..DisaggOptions::default()
        },
        ..ServeOptions::default()
    }
}

fn prompt(first: u32) -> Vec<u32> {
    (first..first + 40).collect()
}

async fn complete(
    client: &reqwest::Client,
    url: &str,
    body: Value,
    headers: &[(&str, &str)],
) -> (StatusCode, String, Option<String>) {
    let mut request = client.post(format!("{url}/v1/completions")).json(&body);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let r = request.send().await.unwrap();
    let status = r.status();
    let worker = r
        .headers()
        .get("x-kvroute-worker")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, r.text().await.unwrap(), worker)
}

/// Waits until the router holds no load (every booking freed).
async fn idle(client: &reqwest::Client, url: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let v = super::get_json(client, &format!("{url}/v1/workers")).await;
        let busy = v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|w| w["ranks"].as_array().unwrap().clone())
            .any(|r| r["load"]["requests"] != 0);
        if !busy {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "load left: {v}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Asserts that the gateway's `/metrics` has each of `lines`.
async fn metrics_have(client: &reqwest::Client, url: &str, lines: &[&str]) {
    let metrics = super::get_text(client, &format!("{url}/metrics")).await;
    for line in lines {
        assert!(metrics.contains(line), "{line}: {metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefill_then_decode_with_the_parameters_the_prefill_answered() {
    let p = [
        Engine::start("p1", Plays::default()).await,
        Engine::start("p2", Plays::default()).await,
    ];
    let d = [
        Engine::start("d1", Plays::default()).await,
        Engine::start("d2", Plays::default()).await,
    ];
    let (serve, url, client) = fleet(
        options(Protocol::Vllm),
        &[
            (1, &p[0], "prefill", json!({})),
            (2, &p[1], "prefill", json!({})),
            (3, &d[0], "decode", json!({})),
            (4, &d[1], "decode", json!({})),
        ],
    )
    .await;
    for (i, stream) in [false, true].into_iter().enumerate() {
        let body = json!({"prompt": prompt(i as u32 * 100), "max_tokens": 50, "stream": stream,
                          "stream_options": {"include_usage": true}, "temperature": 0.3});
        let (status, text, worker) = complete(&client, &url, body, &[]).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        // The prefill half: one token, not streamed, asking for a remote decode.
        let firsts: Vec<Value> = p.iter().flat_map(Engine::bodies).collect();
        assert_eq!(firsts.len(), i + 1);
        let first = &firsts[i];
        assert_eq!(first["max_tokens"], 1);
        assert_eq!(first["stream"], false);
        assert!(first.get("stream_options").is_none());
        assert_eq!(first["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(first["temperature"], 0.3);
        // The decode half: the client's request with what the prefill answered.
        let seconds: Vec<(usize, Value)> = d
            .iter()
            .enumerate()
            .flat_map(|(k, e)| e.bodies().into_iter().map(move |b| (k, b)))
            .collect();
        assert_eq!(seconds.len(), i + 1);
        let (k, second) = &seconds
            .iter()
            .find(|(_, b)| b["prompt"][0] == i * 100)
            .unwrap();
        assert_eq!(second["max_tokens"], 50);
        assert_eq!(second["stream"], stream);
        assert_eq!(second["stream_options"]["include_usage"], true);
        assert!(
            ["p1", "p2"].contains(
                &second["kv_transfer_params"]["remote_engine_id"]
                    .as_str()
                    .unwrap()
            ),
            "{second}"
        );
        assert_eq!(worker.as_deref(), Some(["3", "4"][*k]));
        assert!(
            text.contains(["d1", "d2"][*k]),
            "the decode worker answers: {text}"
        );
    }
    idle(&client, &url).await;
    metrics_have(
        &client,
        &url,
        &[
            "kvroute_disagg_requests_total{how=\"disaggregated\"} 2",
            "kvroute_disagg_active 1",
        ],
    )
    .await;
    serve.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_sends_both_halves_at_once_with_one_bootstrap_room() {
    let p = Engine::start("p1", Plays::default()).await;
    let d = Engine::start("d1", Plays::default()).await;
    let (serve, url, client) = fleet(
        options(Protocol::Sglang),
        &[(1, &p, "prefill", json!({})), (2, &d, "decode", json!({}))],
    )
    .await;
    let body = json!({"prompt": prompt(0), "max_tokens": 20, "stream": true});
    let (status, text, worker) = complete(&client, &url, body, &[]).await;
    assert_eq!(
        (status, worker.as_deref()),
        (StatusCode::OK, Some("2")),
        "{text}"
    );
    assert!(text.contains("d1"));
    // The prefill half runs in the background: wait for it.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while p.bodies().is_empty() {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (first, second) = (&p.bodies()[0], &d.bodies()[0]);
    for half in [first, second] {
        assert_eq!(half["bootstrap_host"], "127.0.0.1");
        assert_eq!(half["bootstrap_port"], 9101, "the prefill worker's port");
        assert_eq!(
            half["max_tokens"], 20,
            "the client's request, unchanged but for these"
        );
        assert_eq!(half["stream"], true);
    }
    assert_eq!(first["bootstrap_room"], second["bootstrap_room"]);
    assert!(first["bootstrap_room"].as_u64().unwrap() < 1 << 63);
    // Another request: another room.
    let (status, _, _) = complete(&client, &url, json!({"prompt": prompt(500)}), &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_ne!(d.bodies()[1]["bootstrap_room"], second["bootstrap_room"]);
    idle(&client, &url).await;
    serve.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_prefill_worker_requests_are_served_whole_or_refused_when_enforced() {
    let p = Engine::start("p1", Plays::default()).await;
    let d = Engine::start("d1", Plays::default()).await;
    let (serve, url, client) =
        fleet(options(Protocol::Vllm), &[(2, &d, "decode", json!({}))]).await;
    // Not activated: the decode worker serves the request whole.
    let (status, text, worker) = complete(&client, &url, json!({"prompt": prompt(0)}), &[]).await;
    assert_eq!(
        (status, worker.as_deref()),
        (StatusCode::OK, Some("2")),
        "{text}"
    );
    assert!(d.bodies()[0].get("kv_transfer_params").is_none());
    // A prefill worker joins: split from then on.
    client
        .post(format!("{url}/v1/workers"))
        .json(&json!({"id": 1, "url": p.url, "kv_blocks": 1024, "role": "prefill"}))
        .send()
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (status, _, _) = complete(&client, &url, json!({"prompt": prompt(100)}), &[]).await;
        assert_eq!(status, StatusCode::OK);
        if !p.bodies().is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never split");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // It leaves: whole again.
    let r = client
        .delete(format!("{url}/v1/workers/1"))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    let before = p.bodies().len();
    let (status, _, worker) = complete(&client, &url, json!({"prompt": prompt(200)}), &[]).await;
    assert_eq!((status, worker.as_deref()), (StatusCode::OK, Some("2")));
    assert_eq!(p.bodies().len(), before);
    idle(&client, &url).await;
    serve.stop();
    // Enforced: refused, retryably, before any prefill worker is there.
    let mut enforced = options(Protocol::Vllm);
    enforced.router.disaggregation = kvroute_core::Disaggregation::Enforced;
    let (serve, url, client) = fleet(enforced, &[(2, &d, "decode", json!({}))]).await;
    let r = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": prompt(0)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers()["retry-after"], "1");
    assert!(r.text().await.unwrap().contains("enforced"));
    idle(&client, &url).await;
    serve.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefill_fails_the_request_or_falls_back_when_configured() {
    let p = Engine::start(
        "p1",
        Plays {
            fail: true,
            ..Plays::default()
        },
    )
    .await;
    let d = Engine::start("d1", Plays::default()).await;
    let workers = [(1, &p, "prefill", json!({})), (2, &d, "decode", json!({}))];
    let (serve, url, client) = fleet(options(Protocol::Vllm), &workers).await;
    let (status, text, _) = complete(&client, &url, json!({"prompt": prompt(0)}), &[]).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{text}");
    assert!(text.contains("prefill worker failed"), "{text}");
    assert!(d.bodies().is_empty(), "no decode without a prefill");
    idle(&client, &url).await;
    serve.stop();
    let mut fallback = options(Protocol::Vllm);
    fallback.disagg.prefill_error_fallback = true;
    let (serve, url, client) = fleet(fallback, &workers).await;
    let (status, text, worker) = complete(&client, &url, json!({"prompt": prompt(0)}), &[]).await;
    assert_eq!(
        (status, worker.as_deref()),
        (StatusCode::OK, Some("2")),
        "{text}"
    );
    assert!(
        d.bodies()[0].get("kv_transfer_params").is_none(),
        "served whole"
    );
    idle(&client, &url).await;
    let fallback = "kvroute_disagg_requests_total{how=\"prefill_fallback\"} 1";
    metrics_have(&client, &url, &[fallback]).await;
    serve.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_transfer_labels_and_conditional_disaggregation_choose_the_workers() {
    let p = [
        Engine::start("pa", Plays::default()).await,
        Engine::start("pb", Plays::default()).await,
    ];
    let d = [
        Engine::start("da", Plays::default()).await,
        Engine::start("db", Plays::default()).await,
    ];
    let mut labelled = options(Protocol::Vllm);
    labelled.disagg.transfer_labels = vec!["rack".to_owned()];
    let workers = [
        (1, &p[0], "prefill", json!({"rack": "a"})),
        (2, &p[1], "prefill", json!({"rack": "b"})),
        (3, &d[0], "decode", json!({"rack": "a"})),
        (4, &d[1], "decode", json!({"rack": "b"})),
    ];
    let (serve, url, client) = fleet(labelled, &workers).await;
    // Pinned to prefill worker 2 (rack b): the decode worker is rack b's, every time.
    for i in 0..4 {
        let pin = [("x-kvroute-prefill-worker", "2")];
        let (status, _, worker) =
            complete(&client, &url, json!({"prompt": prompt(i * 100)}), &pin).await;
        assert_eq!((status, worker.as_deref()), (StatusCode::OK, Some("4")));
    }
    assert!(p[0].bodies().is_empty());
    assert_eq!(p[1].bodies().len(), 4);
    // Both pinned.
    let pins = [
        ("x-kvroute-prefill-worker", "1"),
        ("x-kvroute-decode-worker", "3"),
    ];
    let (_, _, worker) = complete(&client, &url, json!({"prompt": prompt(900)}), &pins).await;
    assert_eq!(worker.as_deref(), Some("3"));
    // A pin naming no worker, or a worker of the other role: the client's error.
    for pin in [
        ("x-kvroute-prefill-worker", "9"),
        ("x-kvroute-prefill-worker", "3"),
        ("x-kvroute-decode-worker", "x"),
    ] {
        let (status, text, _) = complete(&client, &url, json!({"prompt": prompt(0)}), &[pin]).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{pin:?}: {text}");
    }
    idle(&client, &url).await;
    serve.stop();
    // Conditional: any prompt of at most 64 new tokens is served whole by a decode worker.
    let mut conditional = options(Protocol::Vllm);
    conditional.disagg.conditional = Some(Conditional::new_tokens_at_most(64));
    let (serve, url, client) = fleet(conditional, &workers).await;
    let before = (
        p[0].bodies().len() + p[1].bodies().len(),
        d[0].bodies().len() + d[1].bodies().len(),
    );
    let (status, _, worker) = complete(&client, &url, json!({"prompt": prompt(5000)}), &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert!(["3", "4"].contains(&worker.as_deref().unwrap()));
    assert_eq!(
        p[0].bodies().len() + p[1].bodies().len(),
        before.0,
        "no prefill half"
    );
    // A longer one is split.
    let long: Vec<u32> = (0..100).collect();
    let (status, _, _) = complete(&client, &url, json!({"prompt": long}), &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(p[0].bodies().len() + p[1].bodies().len(), before.0 + 1);
    idle(&client, &url).await;
    serve.stop();
}

/// With `conditional_prefill_busy_tokens`, a request that would be split is served whole by a
/// decode worker while every prefill worker is busy computing prompts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturated_prefill_workers_have_a_decode_worker_serve_whole() {
    let slow = Plays {
        delay: Duration::from_millis(800),
        ..Plays::default()
    };
    let p = [
        Engine::start("p1", slow).await,
        Engine::start("p2", slow).await,
    ];
    let d = Engine::start("d1", Plays::default()).await;
    let mut o = options(Protocol::Vllm);
    o.disagg.conditional = Some(Conditional {
        prefill_busy_tokens: Some(1),
        ..Conditional::new_tokens_at_most(0)
    });
    let workers = [
        (1, &p[0], "prefill", json!({})),
        (2, &p[1], "prefill", json!({})),
        (3, &d, "decode", json!({})),
    ];
    let (serve, url, client) = fleet(o, &workers).await;
    // Two split requests, one pinned to each prefill worker, still computing.
    let split: Vec<_> = [(0, "1"), (1000, "2")]
        .into_iter()
        .map(|(first, pin)| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let pin = [("x-kvroute-prefill-worker", pin)];
                complete(&client, &url, json!({"prompt": prompt(first)}), &pin).await
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while p.iter().any(|e| e.bodies().is_empty()) {
        assert!(
            std::time::Instant::now() < deadline,
            "both prefills started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Both busy: the next one is served whole on the decode worker, with no prefill half.
    let (status, _, worker) = complete(&client, &url, json!({"prompt": prompt(2000)}), &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(worker.as_deref(), Some("3"));
    assert_eq!(p[0].bodies().len() + p[1].bodies().len(), 2);
    for s in split {
        assert_eq!(s.await.unwrap().0, StatusCode::OK);
    }
    // Prefill workers free again: split.
    let (status, _, _) = complete(&client, &url, json!({"prompt": prompt(3000)}), &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(p[0].bodies().len() + p[1].bodies().len(), 3);
    metrics_have(
        &client,
        &url,
        &[
            "kvroute_disagg_requests_total{how=\"local_prefill_busy\"} 1",
            "kvroute_disagg_requests_total{how=\"disaggregated\"} 3",
        ],
    )
    .await;
    idle(&client, &url).await;
    serve.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_after_the_prefill_does_not_stop_the_decode_half() {
    let p = Engine::start("p1", Plays::default()).await;
    let slow = Plays {
        delay: Duration::from_millis(600),
        ..Plays::default()
    };
    let d = Engine::start("d1", slow).await;
    let (serve, url, client) = fleet(
        options(Protocol::Vllm),
        &[(1, &p, "prefill", json!({})), (2, &d, "decode", json!({}))],
    )
    .await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let r = impatient
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": prompt(0), "stream": true}))
        .send()
        .await;
    assert!(r.is_err(), "the client gave up first");
    assert_eq!(p.bodies().len(), 1);
    // The decode half went out all the same, and nothing stays booked once it answered.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while d.bodies().is_empty() {
        assert!(std::time::Instant::now() < deadline, "no decode half");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        d.bodies()[0]["kv_transfer_params"]["remote_engine_id"],
        "p1"
    );
    // ...and was answered to its end, its connection kept open after the client left.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while d.finished.lock().unwrap().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the decode half was cut off"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    idle(&client, &url).await;
    serve.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decision_alone_names_both_workers() {
    let p = Engine::start("p1", Plays::default()).await;
    let d = Engine::start("d1", Plays::default()).await;
    let (serve, url, client) = fleet(
        options(Protocol::Vllm),
        &[(1, &p, "prefill", json!({})), (2, &d, "decode", json!({}))],
    )
    .await;
    let (status, v) = super::post_json(
        &client,
        &format!("{url}/v1/route"),
        &json!({"prompt": prompt(0)}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(
        (
            v["prefill"]["worker"].as_u64(),
            v["decode"]["worker"].as_u64()
        ),
        (Some(1), Some(2)),
        "{v}"
    );
    assert_eq!(v["disaggregated"], true);
    assert_eq!(v["worker"], 1, "the prefill choice, by the cache");
    assert!(
        p.bodies().is_empty() && d.bodies().is_empty(),
        "nothing sent"
    );
    // The workers list shows the roles.
    let w = super::get_json(&client, &format!("{url}/v1/workers")).await;
    assert_eq!(w["workers"][0]["role"], "prefill");
    assert_eq!(w["workers"][1]["role"], "decode");
    serve.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_decode_half_failing_for_its_failed_prefill_is_the_prefills_failure() {
    let p = Engine::start(
        "p1",
        Plays {
            fail: true,
            ..Plays::default()
        },
    )
    .await;
    let d = Engine::start(
        "d1",
        Plays {
            fail_split: true,
            ..Plays::default()
        },
    )
    .await;
    let workers = [(1, &p, "prefill", json!({})), (2, &d, "decode", json!({}))];
    let (serve, url, client) = fleet(options(Protocol::Sglang), &workers).await;
    let (status, text, _) = complete(&client, &url, json!({"prompt": prompt(0)}), &[]).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{text}");
    assert!(text.contains("prefill worker failed"), "{text}");
    idle(&client, &url).await;
    serve.stop();
    let mut fallback = options(Protocol::Sglang);
    fallback.disagg.prefill_error_fallback = true;
    let (serve, url, client) = fleet(fallback, &workers).await;
    let (status, text, worker) = complete(&client, &url, json!({"prompt": prompt(100)}), &[]).await;
    assert_eq!(
        (status, worker.as_deref()),
        (StatusCode::OK, Some("2")),
        "{text}"
    );
    let last = d.bodies().last().unwrap().clone();
    assert!(last.get("bootstrap_room").is_none(), "served whole: {last}");
    idle(&client, &url).await;
    let fallback = "kvroute_disagg_requests_total{how=\"prefill_fallback\"} 1";
    metrics_have(&client, &url, &[fallback]).await;
    serve.stop();
}

/// A prefill worker the router marks down (its failures, here one in a row) is not ready:
/// disaggregation deactivates and requests are served whole, until the prober sees it again.
/// This holds for workers that publish no KV events too, whose events never stop "flowing".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_marked_down_deactivates_disaggregation() {
    let failing = Plays {
        fail: true,
        ..Plays::default()
    };
    let p = Engine::start("p1", failing).await;
    let d = Engine::start("d1", Plays::default()).await;
    let o = ServeOptions {
        breaker_failures: 1,
        probe_every: Duration::from_millis(100),
        ..options(Protocol::Vllm)
    };
    let workers = [(1, &p, "prefill", json!({})), (2, &d, "decode", json!({}))];
    let (serve, url, client) = fleet(o.clone(), &workers).await;
    // Down, and its health says so: the prober does not bring it back.
    p.sick.store(true, Ordering::Relaxed);
    let (status, text, _) = complete(&client, &url, json!({"prompt": prompt(0)}), &[]).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{text}");
    // Marked down: served whole on the decode worker, and /v1/route says so.
    let (status, text, worker) = complete(&client, &url, json!({"prompt": prompt(100)}), &[]).await;
    assert_eq!(
        (status, worker.as_deref()),
        (StatusCode::OK, Some("2")),
        "{text}"
    );
    assert_eq!(p.bodies().len(), 1, "no second prefill");
    assert!(d.bodies()[0].get("kv_transfer_params").is_none());
    let (status, v) = super::post_json(
        &client,
        &format!("{url}/v1/route"),
        &json!({"prompt": prompt(200)}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(
        (v["disaggregated"].as_bool(), v["prefill"].is_null()),
        (Some(false), true)
    );
    metrics_have(
        &client,
        &url,
        &[
            "kvroute_disagg_active 0",
            "kvroute_disagg_requests_total{how=\"whole\"} 1",
        ],
    )
    .await;
    // Back: once the prober sees it answer, requests are split again.
    p.failing.store(false, Ordering::Relaxed);
    p.sick.store(false, Ordering::Relaxed);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (_, v) = super::post_json(
            &client,
            &format!("{url}/v1/route"),
            &json!({"prompt": prompt(300)}),
        )
        .await;
        if v["disaggregated"] == true {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never reactivated: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, text, _) = complete(&client, &url, json!({"prompt": prompt(400)}), &[]).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(p.bodies().len(), 2, "split again");
    metrics_have(&client, &url, &["kvroute_disagg_active 1"]).await;
    idle(&client, &url).await;
    serve.stop();
    // Enforced: a fleet whose prefill workers are all down refuses, retryably.
    p.failing.store(true, Ordering::Relaxed);
    let enforced = ServeOptions {
        router: kvroute_core::RouterConfig {
            disaggregation: kvroute_core::Disaggregation::Enforced,
            ..o.router.clone()
        },
        ..o
    };
    let (serve, url, client) = fleet(enforced, &workers).await;
    p.sick.store(true, Ordering::Relaxed);
    let (status, _, _) = complete(&client, &url, json!({"prompt": prompt(500)}), &[]).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let r = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": prompt(600)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers().contains_key("retry-after"));
    idle(&client, &url).await;
    serve.stop();
}

/// The decode half's worker is settled before a prefill is sent: pins that cannot meet are
/// the client's error, no decode worker for any prefill worker a retryable 503, and nothing
/// is prefilled for a cache nobody can take. Aggregated workers take decode halves too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_prefill_is_sent_for_a_cache_no_decode_worker_can_take() {
    let p = Engine::start("pa", Plays::default()).await;
    let d = Engine::start("db", Plays::default()).await;
    let mut labelled = options(Protocol::Vllm);
    labelled.disagg.transfer_labels = vec!["rack".to_owned()];
    let workers = [
        (1, &p, "prefill", json!({"rack": "a"})),
        (2, &d, "decode", json!({"rack": "b"})),
    ];
    let (serve, url, client) = fleet(labelled, &workers).await;
    let r = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": prompt(0)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers().contains_key("retry-after"));
    let pins = [
        ("x-kvroute-prefill-worker", "1"),
        ("x-kvroute-decode-worker", "2"),
    ];
    let (status, text, _) = complete(&client, &url, json!({"prompt": prompt(0)}), &pins).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("kv_transfer_labels"), "{text}");
    let (status, _) = super::post_json(
        &client,
        &format!("{url}/v1/route"),
        &json!({"prompt": prompt(0)}),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        p.bodies().is_empty() && d.bodies().is_empty(),
        "nothing sent"
    );
    idle(&client, &url).await;
    serve.stop();
    // An aggregated worker sharing the prefill worker's rack is no partner while the fleet
    // has decode workers: decode halves go to those.
    let both = Engine::start("aa", Plays::default()).await;
    let mut labelled = options(Protocol::Vllm);
    labelled.disagg.transfer_labels = vec!["rack".to_owned()];
    let workers = [
        (1, &p, "prefill", json!({"rack": "a"})),
        (2, &d, "decode", json!({"rack": "b"})),
        (4, &both, "both", json!({"rack": "a"})),
    ];
    let (serve, url, client) = fleet(labelled, &workers).await;
    let (status, text, _) = complete(&client, &url, json!({"prompt": prompt(0)}), &[]).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert!(p.bodies().is_empty(), "no prefill for a cache nobody takes");
    idle(&client, &url).await;
    serve.stop();
    // Prefill workers and aggregated ones only: the aggregated worker decodes, pinned or not.
    let a = Engine::start("ab", Plays::default()).await;
    let workers = [(1, &p, "prefill", json!({})), (3, &a, "both", json!({}))];
    let (serve, url, client) = fleet(options(Protocol::Vllm), &workers).await;
    for pins in [&[][..], &[("x-kvroute-decode-worker", "3")][..]] {
        let (status, text, worker) =
            complete(&client, &url, json!({"prompt": prompt(500)}), pins).await;
        assert_eq!(
            (status, worker.as_deref()),
            (StatusCode::OK, Some("3")),
            "{text}"
        );
        let last = a.bodies().last().unwrap().clone();
        assert_eq!(
            last["kv_transfer_params"]["remote_engine_id"], "pa",
            "{last}"
        );
    }
    idle(&client, &url).await;
    serve.stop();
}

/// SGLang's prefill half refused by its engine (a 4xx): that answer is the client's at
/// once, not a decode half's timeout, and the decode half waiting for the cache is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_prefill_refused_by_its_engine_is_the_clients_answer() {
    let refuse = Plays {
        refuse: true,
        ..Plays::default()
    };
    let waits = Plays {
        delay: Duration::from_secs(30),
        ..Plays::default()
    };
    let p = Engine::start("p1", refuse).await;
    let d = Engine::start("d1", waits).await;
    let workers = [(1, &p, "prefill", json!({})), (2, &d, "decode", json!({}))];
    let (serve, url, client) = fleet(options(Protocol::Sglang), &workers).await;
    let started = std::time::Instant::now();
    let (status, text, _) = complete(&client, &url, json!({"prompt": prompt(0)}), &[]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("too long"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    idle(&client, &url).await;
    serve.stop();
}

/// SGLang's protocol, a prefill worker killed: a request that picks it has both halves sent
/// again with the next prefill worker, as vLLM's does, and it is not picked again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_prefill_worker_killed_has_the_next_one_take_the_request() {
    let p = [
        Engine::start("p1", Plays::default()).await,
        Engine::start("p2", Plays::default()).await,
    ];
    let d = Engine::start("d1", Plays::default()).await;
    let workers = [
        (1, &p[0], "prefill", json!({})),
        (2, &p[1], "prefill", json!({})),
        (3, &d, "decode", json!({})),
    ];
    let (serve, url, client) = fleet(options(Protocol::Sglang), &workers).await;
    p[0].kill().await;
    // Round robin among the prefill workers: one of the two requests picks the killed one.
    for first in [0, 1000] {
        let (status, text, worker) =
            complete(&client, &url, json!({"prompt": prompt(first)}), &[]).await;
        assert_eq!(
            (status, worker.as_deref()),
            (StatusCode::OK, Some("3")),
            "{text}"
        );
    }
    assert_eq!(p[1].bodies().len(), 2, "the live prefill worker took both");
    // The decode half of the failed attempt may have gone out before the prefill's refusal
    // stopped it; the ones answered met worker 2's bootstrap server.
    let halves = d.bodies();
    assert!((2..=3).contains(&halves.len()), "{halves:?}");
    assert_eq!(halves.last().unwrap()["bootstrap_port"], 9102);
    metrics_have(
        &client,
        &url,
        &[
            "kvroute_upstream_failures_total{kind=\"connect\"} 1",
            "kvroute_disagg_requests_total{how=\"disaggregated\"} 2",
        ],
    )
    .await;
    idle(&client, &url).await;
    serve.stop();
}

/// Backpressure while the prefill worker is chosen: with every prefill worker busy and the
/// admission queue full, the request is a 429 with `Retry-After` and the queue's figures, not
/// a fallback that serves it whole on a decode worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_for_the_prefill_workers_is_a_429_not_a_fallback() {
    let slow = Plays {
        delay: Duration::from_millis(800),
        ..Plays::default()
    };
    let p = Engine::start("p1", slow).await;
    let d = Engine::start("d1", Plays::default()).await;
    let mut o = options(Protocol::Vllm);
    o.disagg.prefill_error_fallback = true;
    o.router.busy.prefill_tokens_fraction = Some(0.001);
    o.router.queue = kvroute_core::Queueing::On {
        max_queued_tokens: 1,
        order: kvroute_core::QueueOrder::Fcfs,
    };
    let workers = [(1, &p, "prefill", json!({})), (2, &d, "decode", json!({}))];
    let (serve, url, client) = fleet(o, &workers).await;
    // One request in prefill makes the prefill worker busy.
    let first = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(
            async move { complete(&client, &url, json!({"prompt": prompt(0)}), &[]).await },
        )
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while p.bodies().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the first prefill started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = client
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": prompt(1000)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(r.headers().contains_key("retry-after"));
    let text = r.text().await.unwrap();
    assert!(
        text.contains("already queued") && text.contains("cap 1"),
        "{text}"
    );
    assert_eq!(first.await.unwrap().0, StatusCode::OK);
    assert_eq!(d.bodies().len(), 1, "only the first request's decode half");
    assert_eq!(p.bodies().len(), 1);
    idle(&client, &url).await;
    serve.stop();
}
