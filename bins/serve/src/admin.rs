//! The operator's routes: the decision alone (`/v1/route`), the workers (`/v1/workers`),
//! metrics, liveness and readiness.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use kvroute_core::{Mode, RequestId, RouteHints, RouteRequest, WorkerId, WorkerRank};
use serde_json::{json, Value};

use super::auth::{refuse, Granted};
use super::backends::BackendSpec;
use super::proxy::{error, read_prompt_async};
use super::AppState;

/// `POST /v1/route`: where a request would go, and what the router predicts it finds there.
/// `"book": true` books its load as a routed request (free it with
/// `DELETE /v1/route/{request_id}`).
pub(crate) async fn route(
    State(state): State<AppState>,
    Extension(granted): Extension<Granted>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    const ROUTE: &str = "route";
    let (value, routed) = match read_prompt_async(&state, &body, value_is_chat(&body)).await {
        Ok(x) => x,
        Err(refusal) => return refusal.respond(&state, ROUTE),
    };
    let book = value.get("book").and_then(Value::as_bool).unwrap_or(false);
    if book && granted != Granted::Admin {
        return refuse(&state, StatusCode::FORBIDDEN);
    }
    let mode = if book { Mode::Book } else { Mode::QueryOnly };
    if state.backends.any_split() {
        // Both halves: the prefill worker (none when the request would be served whole) and
        // the decode worker, each booked with `book`, freed each by its own request id; the
        // headers' pins are the proxy's.
        return match crate::disagg::route_both(&state, &routed, &headers, mode) {
            Ok((prefill, decode)) => {
                ok(&state, ROUTE);
                let main = prefill.as_ref().unwrap_or(&decode);
                let mut v = decision_json(&state, main);
                v["prompt_tokens"] = json!(routed.prompt_len);
                v["tokenized_tokens"] = json!(routed.tokens.len());
                v["booked"] = json!(book);
                v["disaggregated"] = json!(prefill.is_some());
                v["prefill"] = prefill.map_or(Value::Null, |d| decision_json(&state, &d));
                v["decode"] = decision_json(&state, &decode);
                Json(v).into_response()
            }
            Err(refusal) => crate::disagg::refuse(&state, ROUTE, refusal),
        };
    }
    // The workers the proxy would consider now: ready ones first, never a draining one.
    let allowed = crate::proxy::allowed_workers(&state, &[], crate::proxy::Pool::All).flatten();
    let id = state.route_id();
    let request = RouteRequest {
        id,
        tokens: &routed.tokens,
        hints: RouteHints {
            mode,
            allowed: allowed.as_deref(),
            prompt_len: Some(routed.prompt_len),
            expected_output_tokens: routed.expected_output,
            lora_name: routed.lora.as_deref(),
            cache_salt: routed.cache_salt.as_deref(),
            ..RouteHints::default()
        },
    };
    match state.router.route(&request) {
        Ok(d) => {
            ok(&state, ROUTE);
            let mut v = decision_json(&state, &d);
            v["prompt_tokens"] = json!(routed.prompt_len);
            v["tokenized_tokens"] = json!(routed.tokens.len());
            v["booked"] = json!(book);
            Json(v).into_response()
        }
        Err(e) => error(
            &state,
            ROUTE,
            StatusCode::SERVICE_UNAVAILABLE,
            e.to_string(),
        ),
    }
}

fn ok(state: &AppState, route: &str) {
    state
        .metrics
        .requests
        .with_label_values(&[route, "ok"])
        .inc();
}

/// A decision as `/v1/route` reports it.
fn decision_json(state: &AppState, d: &kvroute_core::Decision) -> Value {
    let url = state
        .backends
        .get(d.worker.worker.0)
        .map(|b| b.spec.url.clone());
    json!({
        "request_id": d.request.0,
        "worker": d.worker.worker.0,
        "dp_rank": d.worker.dp_rank.0,
        "url": url,
        "predicted_cached_tokens": d.predicted_cached_tokens,
        "index_cached_tokens": d.overlap.cached_tokens,
        "overlap_blocks": d.overlap.blocks,
        "decided_by": format!("{:?}", d.decided_by),
        "cost": {
            "prefill_blocks": d.cost.prefill_blocks,
            "prefill_cost": d.cost.prefill_cost,
            "decode_cost": d.cost.decode_cost,
            "total": d.cost.total,
        },
    })
}

/// Whether a `/v1/route` body is a chat (it has `messages`).
fn value_is_chat(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body).is_ok_and(|v| v.get("messages").is_some())
}

/// `DELETE /v1/route/{request_id}`: frees a booking made by `/v1/route`.
pub(crate) async fn free_route(State(state): State<AppState>, Path(id): Path<u64>) -> Response {
    if id & crate::ROUTE_BOOKING == 0 {
        return error(
            &state,
            "route",
            StatusCode::NOT_FOUND,
            format!("request {id} is not a booking of /v1/route"),
        );
    }
    match state.router.free(RequestId(id)) {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => error(&state, "route", StatusCode::NOT_FOUND, e.to_string()),
    }
}

/// `GET /v1/workers`.
pub(crate) async fn list_workers(State(state): State<AppState>) -> Json<Value> {
    let fleet = state.router.fleet();
    let draining = state.draining();
    let workers: Vec<Value> = state
        .backends
        .all()
        .iter()
        .map(|b| {
            let events = b.event_stats();
            let ranks: Vec<Value> = (0..b.spec.dp_size)
                .map(|r| {
                    let rank = WorkerRank::new(b.spec.id, r);
                    let entry = fleet.rank_index(rank).map(|i| &fleet.ranks[i]);
                    let load = state.router.load(rank);
                    let stream = events.get(r as usize);
                    json!({
                        "dp_rank": r,
                        "health": entry.map(|e| format!("{:?}", e.state.health())),
                        "index_blocks": entry.map(|e| e.state.reported_blocks()),
                        // KV blocks the engine says are in use, while they count (the booking
                        // sync down); 0 otherwise.
                        "engine_blocks": entry.map(|e| e.state.engine_blocks()),
                        "load": load.map(|l| json!({
                            "requests": l.requests,
                            "prefill_tokens": l.prefill_tokens,
                            "decode_blocks": l.decode_blocks(),
                        })),
                        "events": stream.map(|s| json!({
                            "state": s.state.as_str(),
                            "connected": s.live,
                            "last_seq": s.last_seq,
                            "held_batches": s.held_batches,
                            "connects": s.connects,
                            "catch_ups": s.catch_ups,
                            "caught_up_batches": s.caught_up_batches,
                            "continued": s.continued,
                            "new_epochs": s.new_epochs,
                            "unrooted_stores": s.unrooted_stores,
                            "placed_under_peer": s.placed_under_peer,
                            "turnover_blocks": s.turnover_blocks,
                            "received": s.received,
                            "applied_batches": s.applied_batches,
                            "gaps": s.sequence.gaps,
                            "replayed": s.sequence.replayed,
                            "duplicates": s.sequence.duplicates,
                            "restarts": s.sequence.restarts,
                            "lost_batches": s.sequence.lost_batches,
                            "ranks_cleared": s.ranks_cleared,
                            "decode_errors": s.decode.bad_payloads + s.decode.malformed_events,
                            "rejected_events": s.rejected_events,
                            "foreign_rank_batches": s.foreign_rank_batches,
                            "salted_blocks": s.decode.salted_blocks,
                            "opaque_blocks": s.decode.opaque_blocks,
                        })),
                    })
                })
                .collect();
            json!({
                "id": b.spec.id,
                "url": b.spec.url,
                "draining": draining.contains(&WorkerId(b.spec.id)),
                "ready": b.flowing(),
                "kv_events": b.spec.kv_events,
                "kv_blocks": b.spec.kv_blocks,
                "block_size": b.spec.block_size,
                "labels": b.spec.labels,
                "role": b.spec.role.as_str(),
                "bootstrap_port": b.spec.bootstrap_port,
                "ranks": ranks,
            })
        })
        .collect();
    // Whether workers added or removed here reach the fleet's other replicas.
    let registry = match &state.registry {
        None => "none",
        Some(r) => r.state(),
    };
    Json(json!({ "workers": workers, "registry": registry }))
}

/// `POST /v1/workers`: adds a worker (a [`BackendSpec`] in JSON).
pub(crate) async fn add_worker(State(state): State<AppState>, body: Bytes) -> Response {
    let spec: BackendSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => {
            return error(
                &state,
                "workers",
                StatusCode::BAD_REQUEST,
                format!("not a worker: {e}"),
            )
        }
    };
    let store = state.registry.as_ref().and_then(|r| r.store());
    if let Some(store) = store {
        if let Err(conflict) = crate::registry::check_add(store, &spec).await {
            return error(
                &state,
                "workers",
                StatusCode::CONFLICT,
                conflict.to_string(),
            );
        }
    }
    let id = spec.id;
    match state
        .backends
        .add(
            &state.router,
            &state.client,
            spec.clone(),
            &state.options.limits(),
        )
        .await
    {
        Ok(_) => {
            // Then the fleet's other replicas, through the shared registry (reached now, or
            // later: the bucket is read again, as it may have been reached meanwhile).
            let shared = match &state.registry {
                Some(registry) => match crate::registry::share_join(registry, &spec).await {
                    Ok(shared) => shared,
                    Err(conflict) => {
                        // Another replica wrote another spec meanwhile: it wins. Ours leaves,
                        // unless the registry's watch has already put that one in its place.
                        if state.backends.get(id).is_some_and(|b| b.spec == spec) {
                            let _ = state.backends.remove(&state.router, id);
                        }
                        return error(
                            &state,
                            "workers",
                            StatusCode::CONFLICT,
                            conflict.to_string(),
                        );
                    }
                },
                None => crate::registry::Shared::No,
            };
            let (shared, pending) = shared.json();
            (
                StatusCode::CREATED,
                Json(json!({"id": id, "shared": shared, "pending": pending})),
            )
                .into_response()
        }
        Err(e) => error(&state, "workers", StatusCode::BAD_REQUEST, e.to_string()),
    }
}

/// `DELETE /v1/workers/{id}`: no new request goes to it; once its requests have ended (or the
/// drain timeout passed) it leaves, and its blocks leave the index.
pub(crate) async fn remove_worker(State(state): State<AppState>, Path(id): Path<u64>) -> Response {
    let Some(backend) = state.backends.get(id) else {
        return error(
            &state,
            "workers",
            StatusCode::NOT_FOUND,
            format!("worker {id} does not exist"),
        );
    };
    // Marked draining first, so that this replica's own registry watch leaves it to us.
    state.set_draining(WorkerId(id), true);
    // The fleet's other replicas drain it too, through the shared registry.
    let shared = match &state.registry {
        Some(registry) => crate::registry::share_removal(registry, &backend.spec).await,
        None => crate::registry::Shared::No,
    };
    let (shared, pending) = shared.json();
    match crate::registry::drain_and_remove(&state, &backend).await {
        Ok(blocks) => Json(json!({
            "id": id, "blocks_removed": blocks, "shared": shared, "pending": pending,
        }))
        .into_response(),
        Err(e) => error(&state, "workers", StatusCode::NOT_FOUND, e.to_string()),
    }
}

/// `GET /metrics`.
pub(crate) async fn metrics(State(state): State<AppState>) -> Response {
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        state
            .metrics
            .render(&state.router, &state.backends, state.text.as_deref()),
    )
        .into_response()
}

/// `GET /ready`: once a worker has been heard from (its events, or it publishes none).
pub(crate) async fn ready(State(state): State<AppState>) -> StatusCode {
    let heard = state
        .backends
        .all()
        .iter()
        .any(|b| b.spec.kv_events.is_none() || b.event_stats().iter().any(|s| s.live));
    if heard {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// `GET /v1/models`: the served model, when one is configured; else the first worker's list.
pub(crate) async fn models(State(state): State<AppState>) -> Response {
    if let Some(model) = &state.options.model {
        // The adapters as vLLM lists them: each with the base model as its parent.
        let adapters = state.options.lora_adapters.iter().map(|a| {
            json!({"id": a, "object": "model", "owned_by": "kvroute", "root": a, "parent": model})
        });
        let base = json!({"id": model, "object": "model", "owned_by": "kvroute", "root": model,
            "parent": null});
        return Json(json!({
            "object": "list",
            "data": std::iter::once(base).chain(adapters).collect::<Vec<_>>(),
        }))
        .into_response();
    }
    for b in state.backends.all() {
        let asked = async {
            let answer = state.client.get(b.urls.models.clone()).await?;
            crate::upstream::read_all(answer.into_body()).await
        };
        if let Ok(Ok(bytes)) = tokio::time::timeout(state.options.first_byte_timeout, asked).await {
            if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
                return Json(v).into_response();
            }
        }
    }
    error(
        &state,
        "models",
        StatusCode::SERVICE_UNAVAILABLE,
        "no worker answered",
    )
}
