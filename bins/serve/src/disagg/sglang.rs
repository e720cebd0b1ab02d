//! SGLang's protocol: both halves of a request at once, meeting at the prefill worker's
//! bootstrap server under one random room ([`sglang`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvroute_core::WorkerId;
use serde_json::{json, Value};

use super::{
    choose_prefill, count, decoded, engine_request, prefill_failed, relay_refusal, spawn_decode,
    Pins, SGLANG_BOOTSTRAP_PORT,
};
use crate::backends::mark_unreachable;
use crate::proxy::Asked;
use crate::upstream::{read_all, UpstreamError};
use crate::AppState;

/// How an SGLang prefill half ended badly (it answered 2xx otherwise: the cache is on its
/// way).
enum PrefillEnd {
    /// The engine refused the request (a 4xx): its answer is the client's.
    Refused(StatusCode, Bytes),
    /// Its connection was refused: the next prefill worker may be tried.
    Unreachable(String),
    /// It failed otherwise (5xx, a broken answer, nothing in time).
    Failed(String),
}

/// SGLang's protocol: both halves at once, meeting at the prefill worker's bootstrap server.
/// A decode answer is the client's unless it is a 5xx and the prefill failed: then the
/// prefill's failure is the request's (a 502, or served whole with `prefill_error_fallback`).
/// A prefill refused by its engine (its 4xx is the client's answer) or never reached (both
/// halves go again with the next prefill worker) stops the decode half at once, which would
/// wait for a cache that will not come.
pub(super) async fn sglang(
    state: &AppState,
    asked: Asked<'_>,
    request: serde_json::Map<String, Value>,
    original: Bytes,
    pins: Pins,
    mut pool: Vec<WorkerId>,
) -> Response {
    let timeout = state.options.first_byte_timeout;
    loop {
        let prefill = match choose_prefill(state, asked, pins, &pool).await {
            Ok(p) => p,
            Err(refusal) => return refusal,
        };
        let host = prefill
            .backend
            .urls
            .completions
            .host()
            .unwrap_or("127.0.0.1")
            .to_owned();
        let port = prefill
            .backend
            .spec
            .bootstrap_port
            .unwrap_or(SGLANG_BOOTSTRAP_PORT);
        let mut halves = request.clone();
        halves.insert("bootstrap_host".to_owned(), json!(host));
        halves.insert("bootstrap_port".to_owned(), json!(port));
        halves.insert("bootstrap_room".to_owned(), json!(bootstrap_room()));
        let body = Value::Object(halves).to_string().into_bytes();
        let sent = engine_request(
            state,
            &prefill.backend,
            asked.api,
            &prefill.decision,
            body.clone(),
        );
        // The prefill half in the background, whatever the client does: its answer is read
        // to the end and frees its booking.
        let (router, breaker) = (Arc::clone(&state.router), state.options.breaker_failures);
        let backend = Arc::clone(&prefill.backend);
        let guard = prefill.guard;
        let worker = prefill.decision.worker.worker;
        let (outcome, mut prefilled) = tokio::sync::oneshot::channel::<Result<(), PrefillEnd>>();
        tokio::spawn(async move {
            let answered = tokio::time::timeout(timeout, async {
                let response = sent.await?;
                let status = response.status();
                let bytes = read_all(response.into_body()).await?;
                Ok::<_, UpstreamError>((status, bytes))
            })
            .await;
            let end = match answered {
                Ok(Ok((status, _))) if status.is_success() => {
                    backend.answered();
                    let _ = guard.prefill_done();
                    let _ = guard.finish();
                    Ok(())
                }
                Ok(Ok((status, bytes))) if status.is_client_error() => {
                    backend.answered();
                    Err(PrefillEnd::Refused(status, bytes))
                }
                Ok(Err(e)) if e.is_connect() => {
                    mark_unreachable(&router, worker.0);
                    Err(PrefillEnd::Unreachable(format!(
                        "worker {} refused the connection",
                        worker.0
                    )))
                }
                failed => {
                    backend.failed(&router, breaker);
                    Err(PrefillEnd::Failed(match failed {
                        Ok(Ok((status, _))) => format!("worker {} answered {status}", worker.0),
                        Ok(Err(e)) => format!("worker {}: {e}", worker.0),
                        Err(_) => format!("worker {} sent nothing in time", worker.0),
                    }))
                }
            };
            if let Err(PrefillEnd::Unreachable(why) | PrefillEnd::Failed(why)) = &end {
                tracing::debug!(worker = worker.0, error = %why, "SGLang prefill failed");
            }
            let _ = outcome.send(end);
        });
        let mut decoding = spawn_decode(state, asked, Bytes::from(body), pins, &prefill.backend);
        let end = tokio::select! {
            // A decode answer ready at once is taken first: it is the client's.
            biased;
            joined = &mut decoding => {
                let answer = joined.unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
                if !answer.status().is_server_error() {
                    count(state, "disaggregated");
                    return answer;
                }
                // The decode half waited for a cache that never came?
                match tokio::time::timeout(timeout, &mut prefilled).await {
                    Ok(Ok(Err(end))) => end,
                    _ => {
                        count(state, "decode_failed");
                        return answer;
                    }
                }
            }
            end = &mut prefilled => match end {
                // Refused, or never reached: no cache will come, and the decode half waiting
                // for it is stopped.
                Ok(Err(end @ (PrefillEnd::Refused(..) | PrefillEnd::Unreachable(_)))) => {
                    decoding.abort();
                    end
                }
                // Failed after it was reached: the cache may have been handed over already,
                // so the decode half decides, as when it answers first.
                Ok(Err(end @ PrefillEnd::Failed(_))) => {
                    let answer = decoding
                        .await
                        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
                    if !answer.status().is_server_error() {
                        count(state, "disaggregated");
                        return answer;
                    }
                    end
                }
                // Done (or its task gone): the decode half goes on.
                _ => return decoded(state, decoding.await, "disaggregated"),
            },
        };
        match end {
            PrefillEnd::Refused(status, bytes) => {
                return relay_refusal(state, asked.route, status, bytes);
            }
            PrefillEnd::Unreachable(why) if pins.prefill.is_none() => {
                state.metrics.retries.with_label_values(&["connect"]).inc();
                pool.retain(|w| *w != worker);
                if pool.is_empty() {
                    return prefill_failed(state, asked, original, pins, why).await;
                }
            }
            PrefillEnd::Unreachable(why) | PrefillEnd::Failed(why) => {
                return prefill_failed(state, asked, original, pins, why).await;
            }
        }
    }
}

/// A random bootstrap room (SGLang's are 63-bit): the process's random hasher keys, new for
/// each call, over a count.
fn bootstrap_room() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNT.fetch_add(1, Ordering::Relaxed));
    h.finish() >> 1
}
