//! A fake engine for the gateway benchmarks: it answers `/v1/completions` and
//! `/v1/chat/completions` at once with a fixed completion (one JSON body, or four SSE chunks
//! and `[DONE]`), so that what is timed is the router in front of it.

use std::net::SocketAddr;

use anyhow::Result;
use axum::body::Bytes;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use serde_json::{json, Value};

/// The one field the fake engine reads (the rest is skipped as it is parsed: the engine
/// should cost the machine as little as it can, since the router shares its cores).
#[derive(serde::Deserialize)]
struct StreamField {
    #[serde(default)]
    stream: bool,
}

async fn fake_completion(body: Bytes) -> axum::response::Response {
    let stream = serde_json::from_slice::<StreamField>(&body).is_ok_and(|f| f.stream);
    let chunk = |text: &str, finish: Value| {
        json!({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]})
    };
    if stream {
        let mut out = String::new();
        for (i, t) in [" a", " b", " c", " d"].iter().enumerate() {
            let finish = if i == 3 { json!("length") } else { Value::Null };
            out.push_str(&format!("data: {}\n\n", chunk(t, finish)));
        }
        out.push_str("data: [DONE]\n\n");
        ([("content-type", "text/event-stream")], out).into_response()
    } else {
        let mut v = chunk(" a b c d", json!("length"));
        v["usage"] = json!({"prompt_tokens": 1024, "completion_tokens": 4, "total_tokens": 1028});
        axum::Json(v).into_response()
    }
}

/// Starts the fake engine on a loopback port of the system's choice, on the current runtime.
pub async fn fake_engine() -> Result<SocketAddr> {
    let app = axum::Router::new()
        .route("/v1/completions", post(fake_completion))
        .route("/v1/chat/completions", post(fake_completion))
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/models",
            get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "fake"}]})) }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    // TCP_NODELAY, as the engines' servers set it (uvicorn's asyncio transports do): a
    // stream's chunks must not wait for the router's delayed ACK.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}
