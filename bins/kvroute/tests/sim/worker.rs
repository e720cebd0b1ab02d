//! `kvroute worker` through its real interfaces: an HTTP client (reqwest) on loopback, a
//! ZeroMQ SUB on its KV-event stream and a DEALER on its replay socket, decoded with the
//! transport's engine-event decoder (the router's own).

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use kvroute::worker::{PublisherConfig, RunningWorker, WorkerOptions};
use kvroute_sim::EngineConfig;
use kvroute_transport::engine::{decode_batch, parse_live, parse_replay, EngineEvent, ReplayReply};
use serde_json::{json, Value};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// A worker on loopback ports the system picks, with KV events and replay, passes 100 times
/// faster than the timing model.
async fn worker() -> RunningWorker {
    worker_of_rank(0).await
}

/// A worker whose KV-event batches name dp rank `dp_rank`.
async fn worker_of_rank(dp_rank: u32) -> RunningWorker {
    RunningWorker::start(WorkerOptions {
        http: "127.0.0.1:0".parse().unwrap(),
        engine: EngineConfig {
            kv_blocks: 256,
            speedup: 100.0,
            ..EngineConfig::default()
        },
        max_model_len: 4_096,
        kv_events: Some(PublisherConfig {
            endpoint: "tcp://127.0.0.1:0".to_owned(),
            replay_endpoint: Some("tcp://127.0.0.1:0".to_owned()),
            topic: "kv@test".to_owned(),
            buffer_batches: 100,
            dp_rank,
        }),
        max_body: 1 << 16,
        ..WorkerOptions::default()
    })
    .await
    .unwrap()
}

fn url(w: &RunningWorker, path: &str) -> String {
    format!("http://{}{path}", w.http)
}

async fn complete(client: &reqwest::Client, w: &RunningWorker, body: Value) -> (u16, Value) {
    let response = client
        .post(url(w, "/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

async fn stats(client: &reqwest::Client, w: &RunningWorker) -> Value {
    client
        .get(url(w, "/admin/stats"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_reports_the_cached_prompt_tokens_the_engine_found() {
    let w = worker().await;
    let client = reqwest::Client::new();
    let prompt: Vec<u32> = (0..100).collect();
    let (status, first) = complete(
        &client,
        &w,
        json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 5}),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let text = first["choices"][0]["text"].as_str().unwrap();
    assert_eq!(text.split_whitespace().count(), 5);
    // The same prompt again: its 6 full blocks are cached (the last token is always computed).
    let (_, second) = complete(&client, &w, json!({"prompt": prompt, "max_tokens": 1})).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    let models: Value = client
        .get(url(&w, "/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "kvroute-sim");
    let metrics = client
        .get(url(&w, "/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "vllm:prefix_cache_hits_total{model_name=\"kvroute-sim\"} 96",
        "vllm:prefix_cache_queries_total{model_name=\"kvroute-sim\"} 200",
        "vllm:num_requests_running{model_name=\"kvroute-sim\"} 0",
        "vllm:request_success_total{finished_reason=\"length\",model_name=\"kvroute-sim\"} 2",
    ] {
        assert!(metrics.contains(line), "missing {line} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_completion_sends_a_chunk_per_token_then_the_usage_then_done() {
    let w = worker().await;
    let client = reqwest::Client::new();
    let response = client
        .post(url(&w, "/v1/completions"))
        .json(&json!({
            "prompt": (0..40).collect::<Vec<u32>>(),
            "max_tokens": 4,
            "stream": true,
            "stream_options": {"include_usage": true}
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    let data: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.len(), 6, "{body}");
    let chunks: Vec<Value> = data[..5]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    for chunk in &chunks[..3] {
        assert_eq!(chunk["choices"][0]["finish_reason"], Value::Null);
    }
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[4]["choices"], json!([]));
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 4);
    assert_eq!(data[5], "[DONE]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_a_clear_error_and_admit_nothing() {
    let w = worker().await;
    let client = reqwest::Client::new();
    let post = |body: String| {
        client
            .post(url(&w, "/v1/completions"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let cases = [
        ("{not json".to_owned(), 400, "malformed"),
        (json!({"prompt": []}).to_string(), 400, "no tokens"),
        (
            json!({"model": "other", "prompt": [1]}).to_string(),
            404,
            "does not exist",
        ),
        (json!({"prompt": "text"}).to_string(), 400, "tokenizer"),
        (json!({"prompt": [1], "n": 2}).to_string(), 400, "n = 1"),
        (
            json!({"prompt": [1], "max_tokens": 5000}).to_string(),
            400,
            "maximum context length",
        ),
    ];
    for (body, status, words) in cases {
        let response = post(body.clone()).await.unwrap();
        assert_eq!(response.status().as_u16(), status, "{body}");
        let error: Value = response.json().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(words), "{body}: {message}");
    }
    let huge = json!({"prompt": vec![1u32; 40_000]}).to_string();
    assert_eq!(post(huge).await.unwrap().status().as_u16(), 413);
    // The oracle's question is refused alike.
    for (body, words) in [
        ("[1]", "JSON object"),
        (r#"{"prompt": []}"#, "no tokens"),
        (r#"{"messages": []}"#, "tokenizer"),
    ] {
        let response = client
            .post(url(&w, "/admin/cached"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 400, "{body}");
        let text = response.text().await.unwrap();
        assert!(text.contains(words), "{body}: {text}");
    }
    assert_eq!(stats(&client, &w).await["admitted"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_mid_stream_stops_the_engines_work() {
    let w = worker().await;
    let client = reqwest::Client::new();
    let response = client
        .post(url(&w, "/v1/completions"))
        .json(&json!({"prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 3000, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = response.bytes_stream();
    let first: Bytes = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(body);
    let mut s = Value::Null;
    for _ in 0..200 {
        s = stats(&client, &w).await;
        if s["aborted"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(s["aborted"], 1, "{s}");
    assert_eq!(s["running"], 0, "{s}");
    assert_eq!(s["blocks"]["in_use"], 0, "{s}");
    assert!(s["generation_tokens"].as_u64().unwrap() < 3000, "{s}");
}

/// Subscribes to the worker's events (every topic).
async fn subscriber(w: &RunningWorker) -> SubSocket {
    let mut sub = SubSocket::new();
    sub.connect(w.events.as_deref().unwrap()).await.unwrap();
    sub.subscribe("").await.unwrap();
    sub
}

/// Sends prompts until the subscriber has seen a message (a slow joiner misses the first).
async fn first_live(
    client: &reqwest::Client,
    w: &RunningWorker,
    sub: &mut SubSocket,
) -> ZmqMessage {
    for i in 0..50u32 {
        let prompt: Vec<u32> = (i * 1000..i * 1000 + 48).collect();
        complete(client, w, json!({"prompt": prompt, "max_tokens": 1})).await;
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            return m;
        }
    }
    panic!("no KV event reached the subscriber");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_arrive_on_vllms_wire_and_a_dropped_batch_is_replayed() {
    let w = worker().await;
    let client = reqwest::Client::new();
    let mut sub = subscriber(&w).await;
    let message = first_live(&client, &w, &mut sub).await;
    let frames = message.into_vec();
    let live = parse_live(&frames).unwrap();
    assert_eq!(live.topic, b"kv@test");
    let batch = decode_batch(live.payload).unwrap();
    assert_eq!(batch.dp_rank, Some(0));
    match batch.events[0].as_ref().unwrap() {
        EngineEvent::Stored(stored) => {
            assert_eq!(stored.block_hashes.len(), 3, "48 tokens: 3 blocks of 16");
            assert_eq!(stored.block_size, 16);
            assert_eq!(stored.token_ids.len(), 48);
            assert_eq!(stored.medium, Some("GPU"));
            assert_eq!(stored.parent, None);
        }
        other => panic!("expected a store, got {other:?}"),
    }
    let seen = live.seq;
    // The next batch is dropped from the live stream; the one after arrives with a gap.
    client
        .post(url(&w, "/admin/events/drop?batches=1"))
        .send()
        .await
        .unwrap();
    for base in [500_000u32, 600_000] {
        let prompt: Vec<u32> = (base..base + 32).collect();
        complete(&client, &w, json!({"prompt": prompt, "max_tokens": 1})).await;
    }
    let next = sub.recv().await.unwrap().into_vec();
    let after_gap = parse_live(&next).unwrap().seq;
    assert!(
        after_gap >= seen + 2,
        "seq {after_gap} after {seen}: no gap"
    );
    // The replay socket answers from the missing seq on, then the end marker.
    let mut dealer = DealerSocket::new();
    dealer.connect(w.replay.as_deref().unwrap()).await.unwrap();
    let missing = after_gap - 1;
    let request = vec![Bytes::new(), Bytes::copy_from_slice(&missing.to_be_bytes())];
    dealer
        .send(ZmqMessage::try_from(request).unwrap())
        .await
        .unwrap();
    let mut replayed = Vec::new();
    loop {
        let reply = dealer.recv().await.unwrap().into_vec();
        match parse_replay(&reply).unwrap() {
            ReplayReply::Batch(m) => {
                assert_eq!(m.topic, b"kv@test");
                assert!(decode_batch(m.payload).is_ok());
                replayed.push(m.seq);
            }
            ReplayReply::End => break,
        }
    }
    assert_eq!(replayed.first(), Some(&missing), "{replayed:?}");
    let s = stats(&client, &w).await;
    assert_eq!(s["events"]["dropped"], 1, "{s}");
    assert_eq!(s["events"]["replays"], 1, "{s}");
    // A restart starts the sequence again at 0.
    client
        .post(url(&w, "/admin/events/restart"))
        .send()
        .await
        .unwrap();
    complete(
        &client,
        &w,
        json!({"prompt": (700_000..700_032).collect::<Vec<u32>>(), "max_tokens": 1}),
    )
    .await;
    let restarted = sub.recv().await.unwrap().into_vec();
    assert_eq!(parse_live(&restarted).unwrap().seq, 0);
}

/// A router with worker 0 (256 blocks of 16 tokens, one rank) joined, following `w`'s events
/// as that worker's rank 0.
async fn subscribed(
    w: &RunningWorker,
) -> (
    std::sync::Arc<kvroute_core::Router>,
    kvroute_transport::Subscription,
) {
    use kvroute_core::{IndexConfig, PrefixIndex, Router, RouterConfig, WorkerConfig, WorkerId};
    use kvroute_transport::{SubscriberConfig, Subscription};
    let router = std::sync::Arc::new(
        Router::new(
            RouterConfig::default(),
            PrefixIndex::new(IndexConfig::default()),
        )
        .unwrap(),
    );
    router
        .join_worker(WorkerConfig::simple(0, 256, 16))
        .unwrap();
    let subscription = Subscription::start(
        std::sync::Arc::clone(&router),
        SubscriberConfig {
            worker: WorkerId(0),
            dp_rank: kvroute_core::DpRank(0),
            endpoint: w.events.clone().unwrap(),
            replay: w.replay.clone(),
            topic: String::new(),
            block_size: Some(16),
            replay_timeout: Duration::from_secs(2),
            sequence: Default::default(),
            not_flowing: None,
            capacity_blocks: Some(256),
        },
    )
    .await
    .unwrap();
    (router, subscription)
}

/// Blocks of `prompt` the router's index holds on worker 0.
fn known_blocks(router: &kvroute_core::Router, prompt: &[u32]) -> u32 {
    let locals = kvroute_core::BlockHasher::new(16).local_hashes(prompt);
    let scores = kvroute_core::testing::scores_of(
        &router.index_reader(),
        &locals,
        kvroute_core::MatchOptions::default(),
    );
    scores
        .scores
        .iter()
        .find(|s| s.rank.worker.0 == 0)
        .map_or(0, |s| s.blocks)
}

/// Polls until worker 0 holds `blocks` blocks of `prompt` in the router's index.
async fn wait_known(router: &kvroute_core::Router, prompt: &[u32], blocks: u32) -> u32 {
    let mut known = 0;
    for _ in 0..300 {
        known = known_blocks(router, prompt);
        if known == blocks {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    known
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribed_router_follows_the_engine_through_drops_and_restarts() {
    let w = worker().await;
    let client = reqwest::Client::new();
    let (router, subscription) = subscribed(&w).await;
    // Until the subscription is connected, batches are lost to the slow joiner: send prompts
    // until one lands.
    let mut warm = 0u32;
    while subscription.stats().applied_batches == 0 {
        warm += 1;
        assert!(warm < 100, "the subscription never received a batch");
        let prompt: Vec<u32> = (warm * 100..warm * 100 + 32).collect();
        complete(&client, &w, json!({"prompt": prompt, "max_tokens": 1})).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a: Vec<u32> = (900_000..900_080).collect();
    complete(&client, &w, json!({"prompt": a, "max_tokens": 1})).await;
    assert_eq!(wait_known(&router, &a, 5).await, 5, "80 tokens: 5 blocks");
    // A dropped batch is seen as a gap when the next one arrives, and replayed.
    client
        .post(url(&w, "/admin/events/drop?batches=1"))
        .send()
        .await
        .unwrap();
    let b: Vec<u32> = (910_000..910_048).collect();
    let c: Vec<u32> = (920_000..920_064).collect();
    complete(&client, &w, json!({"prompt": b, "max_tokens": 1})).await;
    complete(&client, &w, json!({"prompt": c, "max_tokens": 1})).await;
    assert_eq!(wait_known(&router, &c, 4).await, 4);
    assert_eq!(
        wait_known(&router, &b, 3).await,
        3,
        "the dropped batch was replayed"
    );
    let s = subscription.stats();
    assert_eq!(s.sequence.gaps, 1, "{s:?}");
    assert_eq!(s.ranks_cleared, 0, "{s:?}");
    // A restarted publisher (seq back to 0) clears the worker: what it held before is gone
    // from the index until it is stored again.
    client
        .post(url(&w, "/admin/events/restart"))
        .send()
        .await
        .unwrap();
    let d: Vec<u32> = (930_000..930_032).collect();
    complete(&client, &w, json!({"prompt": d, "max_tokens": 1})).await;
    assert_eq!(wait_known(&router, &d, 2).await, 2);
    assert_eq!(known_blocks(&router, &a), 0, "cleared at the restart");
    assert_eq!(subscription.stats().sequence.restarts, 1);
}

/// A dispatch request on kvroute's wire: `max_tokens` to generate from `tokens`.
fn wire_request(id: u64, tokens: Vec<u32>, max_tokens: u32) -> kvroute_transport::wire::Dispatch {
    use kvroute_transport::wire::{Dispatch, DispatchHints, Sampling};
    Dispatch {
        request_id: id,
        tokens,
        sampling: Sampling {
            max_tokens,
            min_tokens: 0,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
        },
        hints: DispatchHints {
            dp_rank: 0,
            overlap_blocks: 0,
            lora_name: None,
            priority: 0,
            expected_output_tokens: None,
        },
        bootstrap: None,
    }
}

/// kvroute's own request wire in front of the same engine: a router's dispatch client is
/// greeted with the engine's size, gets a request's tokens back as the engine makes them,
/// sees the engine's occupancy in heartbeats, and a request it cancels leaves the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_wire_serves_the_same_engine() {
    use kvroute_core::WorkerId;
    use kvroute_transport::backend::{self, Backend};
    use kvroute_transport::wire::FinishReason;
    use kvroute_transport::{DispatchClient, DispatchConfig};

    let mut w = RunningWorker::start(WorkerOptions {
        http: "127.0.0.1:0".parse().unwrap(),
        wire: Some("127.0.0.1:0".parse().unwrap()),
        worker_id: 7,
        engine: EngineConfig {
            kv_blocks: 256,
            speedup: 100.0,
            ..EngineConfig::default()
        },
        max_model_len: 4_096,
        ..WorkerOptions::default()
    })
    .await
    .unwrap();
    let addr = w.wire.expect("the wire listens");
    let patience = Duration::from_secs(10);
    tokio::task::spawn_blocking(move || {
        backend::block_on(Backend::Epoll, async move {
            let client =
                DispatchClient::start(DispatchConfig::new(addr, WorkerId(7), Backend::Epoll));
            let hello = client.wait_connected(patience).await.unwrap();
            assert_eq!(
                (hello.worker_id, hello.kv_blocks, hello.dp_size),
                (7, 256, 1)
            );
            assert_eq!(hello.block_size, EngineConfig::default().block_size);

            // Five tokens, one a pass, then `Length`.
            let mut stream = client
                .dispatch(wire_request(1, (0..100).collect(), 5))
                .await
                .unwrap();
            let mut tokens = Vec::new();
            let mut finish = None;
            while let Some(item) = tokio::time::timeout(patience, stream.next()).await.unwrap() {
                let item = item.unwrap();
                tokens.extend(item.tokens);
                finish = item.finish;
            }
            assert_eq!(tokens.len(), 5);
            assert_eq!(finish, Some(FinishReason::Length));

            // A long request, cancelled after its first token: the stream ends `Cancelled`.
            let mut stream = client
                .dispatch(wire_request(2, (0..64).collect(), 3_000))
                .await
                .unwrap();
            let first = tokio::time::timeout(patience, stream.next()).await.unwrap();
            assert!(first.unwrap().unwrap().finish.is_none());
            stream.cancel();
            let mut last = None;
            while let Some(item) = tokio::time::timeout(patience, stream.next()).await.unwrap() {
                last = item.unwrap().finish;
            }
            assert_eq!(last, Some(FinishReason::Cancelled));

            // Heartbeats carry the engine's occupancy.
            let deadline = std::time::Instant::now() + patience;
            let load = loop {
                if let Some(load) = client.status().load {
                    break load;
                }
                assert!(std::time::Instant::now() < deadline, "no heartbeat");
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            assert_eq!(load.worker_id, 7);
            assert_eq!(load.ranks.len(), 1);
            assert_eq!(load.ranks[0].total_blocks, 256);
            client.shutdown().await;
        })
        .unwrap();
    })
    .await
    .unwrap();

    // The engine served both and let the cancelled one go: nothing runs, no block is held.
    let client = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        let s = stats(&client, &w).await;
        if s["admitted"] == 2 && s["aborted"] == 1 && s["running"] == 0 {
            assert_eq!(s["finished"], 1, "{s}");
            assert_eq!(s["blocks"]["in_use"], 0, "{s}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.stop();
    w.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_of_a_dp_rank_the_worker_was_not_declared_with_are_refused_and_counted() {
    // An engine that tags its batches dp rank 1 (one rank of an externally balanced
    // data-parallel deployment), declared to the router as a worker of one rank.
    let w = worker_of_rank(1).await;
    let client = reqwest::Client::new();
    let (router, subscription) = subscribed(&w).await;
    let a: Vec<u32> = (900_000..900_080).collect();
    let mut tries = 0;
    while subscription.stats().foreign_rank_batches == 0 {
        tries += 1;
        assert!(tries < 100, "{:?}", subscription.stats());
        complete(&client, &w, json!({"prompt": a, "max_tokens": 1})).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = subscription.stats();
    assert_eq!(s.applied_batches, 0, "{s:?}");
    assert_eq!(known_blocks(&router, &a), 0);
    assert_eq!(router.fleet().ranks.len(), 1);
}
