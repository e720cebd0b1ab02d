//! Disaggregated serving: in a fleet with prefill and decode workers, a request's prompt is
//! computed on a prefill worker chosen by its cache, its output generated on a decode worker
//! chosen by its load (no credit for cached blocks, no prefill booked), and the KV cache is
//! handed between them by the engines' own connector, in vLLM's protocol or SGLang's:
//!
//! ```text
//!  vLLM    client ─▶ prefill worker: max_tokens 1, not streamed, kv_transfer_params asking
//!                    │               for a remote decode
//!                    └─ its answer's kv_transfer_params ─▶ decode worker: the client's request
//!                                                           └─ answer ─▶ client
//!  SGLang  client ─▶ prefill worker ┐ at once, both with bootstrap_host and bootstrap_port
//!                 ─▶ decode worker  ┘ (the prefill worker's) and one random bootstrap_room;
//!                                     the decode worker's answer is the client's
//! ```
//!
//! The rules, the reference's:
//! - With no prefill worker ready (none joined, or all down, not ready or draining), requests
//!   are served whole, by aggregated workers or else decode workers; serving is disaggregated
//!   again as soon as one is ready. With `disaggregation = "enforced"` they get a retryable 503
//!   instead.
//! - A prefill worker that fails (5xx, broken connection, no answer in time) fails the request
//!   with a 502, or with `prefill_error_fallback` has it served whole on a decode worker. One
//!   that refuses the connection is marked down and the next prefill worker is tried.
//! - Backpressure while choosing the prefill worker (the admission queue full) is a 429 with
//!   `Retry-After`; the request does not fall back into the decode workers' queue.
//! - Once the prefill is done, the decode request is sent whatever the client does: the KV
//!   transfer must complete for the prefill worker to free its blocks. A client gone by then
//!   closes the decode answer after its first byte.
//! - `x-kvroute-prefill-worker` and `x-kvroute-decode-worker` pin the halves (an external
//!   scheduler's choice).
//! - `kv_transfer_labels`: label keys a decode worker must share with the chosen prefill worker
//!   (the KV transfer's topology: a rack, a NVLink domain).
//! - Conditional disaggregation (`conditional_max_new_tokens`; the core's rule,
//!   [`Router::whole_on_decode`]): when the decode worker's cache leaves at most that many
//!   prompt tokens to compute, and at most `conditional_max_new_share` of the prompt, the
//!   decode worker serves the request whole; with `conditional_prefill_busy_tokens`, also when
//!   every prefill worker has that many tokens booked for prefill; with
//!   `conditional_decode_busy_tokens`, never on a decode worker with more than that booked.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
pub use kvroute_core::Conditional;
use kvroute_core::{
    Admission, Decision, Disaggregation, Fleet, Label, Mode, Phase, Pinned, RequestGuard,
    RequestId, RouteHints, RouteRequest, Router, Whole, WorkerId, WorkerRank, WorkerRole,
};
use serde_json::{json, Value};

use crate::backends::{mark_unreachable, Backend, Role};
use crate::proxy::{self, Api, Asked, Leg, Pool, Routed};
use crate::upstream::{read_all, Answer, UpstreamError};
use crate::AppState;

mod sglang;
use sglang::sglang;

/// Pins the prefill half of a request to a worker (its id).
pub const PREFILL_WORKER: &str = "x-kvroute-prefill-worker";
/// Pins the decode half of a request to a worker (its id).
pub const DECODE_WORKER: &str = "x-kvroute-decode-worker";

/// The port SGLang's prefill servers take bootstrap connections on unless told otherwise.
pub const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// How the engines hand a prompt's KV cache from prefill to decode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Protocol {
    /// vLLM's `kv_transfer_params` (NixlConnector and the like): prefill first, then decode
    /// with what the prefill answered.
    #[default]
    Vllm,
    /// SGLang's bootstrap: both halves at once, meeting at the prefill worker's bootstrap
    /// server under one room number.
    Sglang,
}

impl Protocol {
    /// As the config spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Vllm => "vllm",
            Protocol::Sglang => "sglang",
        }
    }
}

impl std::str::FromStr for Protocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "vllm" => Ok(Protocol::Vllm),
            "sglang" => Ok(Protocol::Sglang),
            other => Err(format!("pd_protocol {other:?}: vllm or sglang")),
        }
    }
}

/// How a fleet with prefill and decode workers serves requests.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DisaggOptions {
    /// The engines' protocol.
    pub protocol: Protocol,
    /// A prefill worker's failure has the request served whole on a decode worker (else the
    /// request fails with a 502).
    pub prefill_error_fallback: bool,
    /// Conditional disaggregation (none: every request is split while a prefill worker is
    /// ready).
    pub conditional: Option<Conditional>,
    /// Label keys a decode worker must share with the request's prefill worker.
    pub transfer_labels: Vec<String>,
}

/// Whether disaggregated serving is active: some prefill worker ready. Setting it is
/// idempotent; each change is logged and shown in `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct Activation(AtomicBool);

impl Activation {
    /// Sets it; true when that changed it.
    pub(crate) fn set(&self, active: bool) -> bool {
        self.0.swap(active, Ordering::Relaxed) != active
    }

    #[cfg(test)]
    pub(crate) fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// The workers a request's halves are pinned to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Pins {
    pub prefill: Option<WorkerId>,
    pub decode: Option<WorkerId>,
}

impl Pins {
    /// The pins the request's headers give: each an id of a worker of the right role (a
    /// prefill pin: `prefill`; a decode pin: `decode` or `both`, the latter for a request
    /// served whole or a fleet with no decode worker), else a 400.
    pub(crate) fn read(state: &AppState, headers: &HeaderMap) -> Result<Pins, proxy::Refusal> {
        let pin = |name: &str, roles: &[Role]| -> Result<Option<WorkerId>, proxy::Refusal> {
            let Some(value) = headers.get(name) else {
                return Ok(None);
            };
            let bad = |why: &str| {
                proxy::Refusal::new(
                    StatusCode::BAD_REQUEST,
                    format!("{name}: {:?} {why}", value.to_str().unwrap_or("?")),
                )
            };
            let id: u64 = value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| bad("is not a worker id"))?;
            match state.backends.get(id) {
                None => Err(bad("names no worker")),
                Some(b) if !roles.contains(&b.spec.role) => {
                    Err(bad(&format!("names a {} worker", b.spec.role.as_str())))
                }
                Some(_) => Ok(Some(WorkerId(id))),
            }
        };
        Ok(Pins {
            prefill: pin(PREFILL_WORKER, &[Role::Prefill])?,
            decode: pin(DECODE_WORKER, &[Role::Decode, Role::Both])?,
        })
    }
}

/// The roles a decode half may go to: decode workers, or (the router's fallback when there
/// is none) aggregated ones.
const DECODE_ROLES: &[Role] = &[Role::Decode, Role::Both];

/// The ids of the workers of `roles` that may take a request now: ready (health answered,
/// events flowing), not marked down, not draining.
fn ready(state: &AppState, roles: &[Role]) -> Vec<WorkerId> {
    let draining = state.draining();
    let fleet = state.router.fleet();
    state
        .backends
        .all()
        .iter()
        .filter(|b| roles.contains(&b.spec.role) && b.flowing())
        .map(|b| WorkerId(b.spec.id))
        .filter(|w| !draining.contains(w) && up(&fleet, *w))
        .collect()
}

/// Whether the router counts some rank of `worker` up (not marked down by a refused
/// connection, failures in a row or silent events).
fn up(fleet: &Fleet, worker: WorkerId) -> bool {
    fleet.worker(worker).is_some_and(|w| {
        fleet.ranks[w.ranks.clone()]
            .iter()
            .any(|r| r.state.health().is_healthy())
    })
}

/// Records whether serving is disaggregated now, logging a change.
fn activate(state: &AppState, active: bool) {
    if state.disagg.set(active) {
        state.metrics.disagg_active.set(i64::from(active));
        if active {
            tracing::info!("a prefill worker is ready: requests are served disaggregated");
        } else {
            tracing::warn!("no prefill worker is ready: requests are served whole");
        }
    }
}

/// How a request is served: the one decision [`forward`] and `/v1/route` both follow.
#[derive(Debug, PartialEq, Eq)]
enum Plan {
    /// Whole, on this decode worker's rank (conditional disaggregation) or where the whole
    /// request's choice puts it; `how` is the metric's label.
    Whole {
        rank: Option<WorkerRank>,
        how: &'static str,
    },
    /// Split, the prefill worker chosen among these (each with some decode worker the KV
    /// transfer can reach).
    Split(Vec<WorkerId>),
}

/// Decides how the request is served (the module's rules), before anything is sent.
fn plan(state: &AppState, routed: &Routed, pins: Pins) -> Result<Plan, proxy::Refusal> {
    let prefill_pool = ready(state, &[Role::Prefill]);
    let active = pins.prefill.is_some() || !prefill_pool.is_empty();
    activate(state, active);
    if !active {
        if state.options.router.disaggregation == Disaggregation::Enforced {
            return Err(proxy::Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "disaggregated serving is enforced and no prefill worker is ready",
            ));
        }
        return Ok(Plan::Whole {
            rank: None,
            how: "whole",
        });
    }
    // A pinned prefill worker is the client's choice: never overridden by the cache rule.
    if let (Some(conditional), None) = (state.options.disagg.conditional, pins.prefill) {
        if let Some((rank, why)) = local_decode(state, routed, pins, &conditional) {
            let how = match why {
                Whole::Cached => "local",
                Whole::PrefillBusy => "local_prefill_busy",
            };
            return Ok(Plan::Whole {
                rank: Some(rank),
                how,
            });
        }
    }
    partnered(state, pins, prefill_pool).map(Plan::Split)
}

/// The prefill workers of `pool` (or the pinned one) whose KV cache some decode worker can
/// take: the pinned decode worker, or any decode worker not marked down or draining, sharing
/// the prefill worker's `kv_transfer_labels`. Checked before the prefill is sent, so that a
/// prefill is never computed for a cache nobody can take. Pins that cannot meet are the
/// client's error (400); no decode worker for any prefill worker is a retryable 503.
fn partnered(
    state: &AppState,
    pins: Pins,
    pool: Vec<WorkerId>,
) -> Result<Vec<WorkerId>, proxy::Refusal> {
    let fleet = state.router.fleet();
    let draining = state.draining();
    if let Some(pin) = pins.decode {
        let aggregated = state
            .backends
            .get(pin.0)
            .is_some_and(|b| b.spec.role == Role::Both);
        if aggregated && fleet.ranks_of(WorkerRole::Decode) > 0 {
            return Err(proxy::Refusal::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "{DECODE_WORKER}: worker {} is an aggregated worker; split requests decode on \
                     decode workers while there are some",
                    pin.0
                ),
            ));
        }
    }
    // The roles the router sends a decode half to: decode workers, or `both` ones in a fleet
    // with none (the core's `DecodeToAggregated`).
    let decode_role = if fleet.ranks_of(WorkerRole::Decode) > 0 {
        Role::Decode
    } else {
        Role::Both
    };
    let decoders: Vec<Arc<Backend>> = match pins.decode {
        Some(pin) => state.backends.get(pin.0).into_iter().collect(),
        None => state
            .backends
            .all()
            .iter()
            .filter(|b| b.spec.role == decode_role)
            .filter(|b| {
                let w = WorkerId(b.spec.id);
                !draining.contains(&w) && up(&fleet, w)
            })
            .cloned()
            .collect(),
    };
    let reaches = |prefill: WorkerId| {
        state.backends.get(prefill.0).is_some_and(|p| {
            let required = required_labels(state, &p);
            decoders.iter().any(|d| shares(&required, d))
        })
    };
    let candidates = match pins.prefill {
        Some(pin) => vec![pin],
        None => pool,
    };
    let partnered: Vec<WorkerId> = candidates.iter().copied().filter(|w| reaches(*w)).collect();
    if !partnered.is_empty() {
        return Ok(partnered);
    }
    Err(match (pins.prefill, pins.decode) {
        (Some(p), Some(d)) => proxy::Refusal::new(
            StatusCode::BAD_REQUEST,
            format!(
                "{DECODE_WORKER}: worker {} cannot take worker {}'s KV cache (kv_transfer_labels differ)",
                d.0, p.0
            ),
        ),
        (None, Some(d)) => proxy::Refusal::new(
            StatusCode::BAD_REQUEST,
            format!(
                "{DECODE_WORKER}: worker {} shares the kv_transfer_labels of no ready prefill worker",
                d.0
            ),
        ),
        (_, None) => proxy::Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no decode worker is ready to take a prefill worker's KV cache",
        ),
    })
}

/// The labels (key, value) a decode worker must share with `prefill`: its values of the
/// configured `kv_transfer_labels` keys (the KV transfer's topology).
fn required_labels(state: &AppState, prefill: &Backend) -> Vec<(String, String)> {
    state
        .options
        .disagg
        .transfer_labels
        .iter()
        .filter_map(|key| {
            let value = prefill.spec.labels.get(key)?;
            Some((key.clone(), value.clone()))
        })
        .collect()
}

/// Whether `decode` carries every label of `required`.
fn shares(required: &[(String, String)], decode: &Backend) -> bool {
    required
        .iter()
        .all(|(k, v)| decode.spec.labels.get(k) == Some(v))
}

/// A refusal as the client's answer; a 503 is retryable (`Retry-After`).
pub(crate) fn refuse(state: &AppState, route: &str, refusal: proxy::Refusal) -> Response {
    let retry = refusal.status() == StatusCode::SERVICE_UNAVAILABLE;
    let mut r = refusal.respond(state, route);
    if retry {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// Serves the client's request in a fleet with prefill and decode workers (see the module).
pub(crate) async fn forward(
    state: &AppState,
    asked: Asked<'_>,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    let plan =
        Pins::read(state, headers).and_then(|pins| Ok((pins, plan(state, asked.routed, pins)?)));
    let (pins, pool) = match plan {
        Ok((pins, Plan::Split(pool))) => (pins, pool),
        Ok((pins, Plan::Whole { rank, how })) => {
            count(state, how);
            let mut leg = whole(body, pins);
            if let Some(rank) = rank {
                leg.pinned = Pinned {
                    backend_instance: Some(rank.worker),
                    dp_rank: Some(rank.dp_rank),
                    ..Pinned::default()
                };
            }
            return proxy::dispatch(state, asked, leg).await;
        }
        Err(refusal) => return refuse(state, asked.route, refusal),
    };
    let Ok(Value::Object(request)) = serde_json::from_slice::<Value>(&body) else {
        // The prompt was read from it, so it is a JSON object.
        return proxy::error(
            state,
            asked.route,
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object",
        );
    };
    match state.options.disagg.protocol {
        Protocol::Vllm => vllm(state, asked, request, body, pins, pool).await,
        Protocol::Sglang => sglang(state, asked, request, body, pins, pool).await,
    }
}

/// The whole request, to a decode worker (or an aggregated one): no prefill worker serves it.
fn whole(body: Bytes, pins: Pins) -> Leg {
    Leg {
        pool: Pool::Roles(DECODE_ROLES),
        pinned: Pinned {
            backend_instance: pins.decode,
            ..Pinned::default()
        },
        ..Leg::whole(body)
    }
}

fn count(state: &AppState, how: &str) {
    state.metrics.disagg.with_label_values(&[how]).inc();
}

/// The decode worker that serves the request whole under conditional disaggregation, and
/// why ([`Router::whole_on_decode`], among the ready decode workers).
fn local_decode(
    state: &AppState,
    routed: &Routed,
    pins: Pins,
    conditional: &Conditional,
) -> Option<(WorkerRank, Whole)> {
    let pool = ready(state, DECODE_ROLES);
    let request = RouteRequest {
        id: RequestId(state.next_id.fetch_add(1, Ordering::Relaxed)),
        tokens: &routed.tokens,
        hints: RouteHints {
            pinned: Pinned {
                decode_worker: pins.decode,
                ..Pinned::default()
            },
            prompt_len: Some(routed.prompt_len),
            lora_name: routed.lora.as_deref(),
            cache_salt: routed.cache_salt.as_deref(),
            allowed: (!pool.is_empty()).then_some(pool.as_slice()),
            ..RouteHints::default()
        },
    };
    state.router.whole_on_decode(&request, conditional)
}

/// A prefill worker chosen and booked: its decision and the guard that frees it.
struct Prefill {
    decision: Decision,
    guard: RequestGuard<Arc<Router>>,
    backend: Arc<Backend>,
}

/// Chooses and books a prefill worker among `pool` (or the pinned one), past `excluded`.
async fn choose_prefill(
    state: &AppState,
    asked: Asked<'_>,
    pins: Pins,
    pool: &[WorkerId],
) -> Result<Prefill, Response> {
    let routed = asked.routed;
    let request = RouteRequest {
        id: RequestId(state.next_id.fetch_add(1, Ordering::Relaxed)),
        tokens: &routed.tokens,
        hints: RouteHints {
            phase: Phase::Prefill,
            pinned: Pinned {
                prefill_worker: pins.prefill,
                ..Pinned::default()
            },
            prompt_len: Some(routed.prompt_len),
            // The prefill worker generates one token.
            expected_output_tokens: Some(1),
            lora_name: routed.lora.as_deref(),
            cache_salt: routed.cache_salt.as_deref(),
            allowed: Some(pool),
            ..RouteHints::default()
        },
    };
    let decision = match state.router.submit(&request) {
        Ok(Admission::Routed(d)) => d,
        Ok(Admission::Queued(ticket)) => Router::wait(Arc::clone(&state.router), ticket)
            .await
            .map_err(|e| proxy::route_error(state, asked.route, &e))?,
        Err(e) => return Err(proxy::route_error(state, asked.route, &e)),
    };
    let guard = RequestGuard::new(Arc::clone(&state.router), decision.request);
    let Some(backend) = state.backends.get(decision.worker.worker.0) else {
        return Err(proxy::error(
            state,
            asked.route,
            StatusCode::SERVICE_UNAVAILABLE,
            "the prefill worker left",
        ));
    };
    state
        .metrics
        .predicted_cached_tokens
        .observe(decision.predicted_cached_tokens as f64);
    Ok(Prefill {
        decision,
        guard,
        backend,
    })
}

/// The engine request for one of a worker's routes, with its key and dp rank: sent when
/// awaited, on its own (it may outlive the client's request).
fn engine_request(
    state: &AppState,
    backend: &Arc<Backend>,
    api: Api,
    decision: &Decision,
    body: Vec<u8>,
) -> impl std::future::Future<Output = Result<Answer, UpstreamError>> + Send + 'static {
    let (client, backend) = (state.client.clone(), Arc::clone(backend));
    let rank = decision.worker.dp_rank.0;
    async move {
        let uri = api.uri(&backend.urls);
        backend.post(&client, uri, rank, Bytes::from(body)).await
    }
}

/// The decode half, on its own task: routed among the decode workers sharing the prefill
/// worker's transfer labels, and sent whatever the client does meanwhile (dropping the handle
/// does not stop it; aborting it does). Its answer comes once the decode worker's first byte
/// has, the cache handed over.
fn spawn_decode(
    state: &AppState,
    asked: Asked<'_>,
    body: Bytes,
    pins: Pins,
    prefill: &Backend,
) -> tokio::task::JoinHandle<Response> {
    let leg = Leg {
        body,
        phase: Phase::Decode,
        pool: Pool::Roles(DECODE_ROLES),
        pinned: Pinned {
            decode_worker: pins.decode,
            ..Pinned::default()
        },
        required: required_labels(state, prefill),
    };
    let (state, routed) = (state.clone(), asked.routed.clone());
    let (route, api, read_in) = (asked.route, asked.api, asked.read_in);
    tokio::spawn(async move {
        let asked = Asked {
            route,
            api,
            routed: &routed,
            read_in,
        };
        proxy::dispatch(&state, asked, leg).await
    })
}

/// The decode half's answer, counted under `how`, or as a failed decode.
fn decoded(
    state: &AppState,
    joined: Result<Response, tokio::task::JoinError>,
    how: &str,
) -> Response {
    let answer = joined.unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    let failed = answer.status().is_server_error();
    count(state, if failed { "decode_failed" } else { how });
    answer
}

/// A prefill worker failed: the request fails with a 502, or is served whole on a decode
/// worker with `prefill_error_fallback`.
async fn prefill_failed(
    state: &AppState,
    asked: Asked<'_>,
    body: Bytes,
    pins: Pins,
    why: String,
) -> Response {
    if state.options.disagg.prefill_error_fallback {
        count(state, "prefill_fallback");
        tracing::debug!(error = %why, "prefill failed: served whole");
        return proxy::dispatch(state, asked, whole(body, pins)).await;
    }
    count(state, "prefill_failed");
    proxy::error(
        state,
        asked.route,
        StatusCode::BAD_GATEWAY,
        format!("the prefill worker failed: {why}"),
    )
}

/// vLLM's protocol: the prefill worker computes the prompt and answers with the parameters
/// the decode worker fetches the cache by.
async fn vllm(
    state: &AppState,
    asked: Asked<'_>,
    request: serde_json::Map<String, Value>,
    body: Bytes,
    pins: Pins,
    mut pool: Vec<WorkerId>,
) -> Response {
    let mut first = request.clone();
    first.insert("max_tokens".to_owned(), json!(1));
    if first.contains_key("max_completion_tokens") {
        first.insert("max_completion_tokens".to_owned(), json!(1));
    }
    first.insert("stream".to_owned(), json!(false));
    first.remove("stream_options");
    first.insert(
        "kv_transfer_params".to_owned(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    let first = Value::Object(first).to_string().into_bytes();
    let answer = loop {
        let prefill = match choose_prefill(state, asked, pins, &pool).await {
            Ok(p) => p,
            Err(refusal) => return refusal,
        };
        let worker = prefill.decision.worker.worker;
        let sent = engine_request(
            state,
            &prefill.backend,
            asked.api,
            &prefill.decision,
            first.clone(),
        );
        let answered = tokio::time::timeout(state.options.first_byte_timeout, async {
            let response = sent.await?;
            let status = response.status();
            let bytes = read_all(response.into_body()).await?;
            Ok::<_, UpstreamError>((status, bytes))
        })
        .await;
        match answered {
            Ok(Ok((status, bytes))) if status.is_success() => {
                prefill.backend.answered();
                let _ = prefill.guard.prefill_done();
                let _ = prefill.guard.finish();
                break (prefill.backend, bytes);
            }
            Ok(Ok((status, bytes))) if status.is_client_error() => {
                // The engine refused the request itself: its answer is the client's.
                prefill.backend.answered();
                drop(prefill.guard);
                return relay_refusal(state, asked.route, status, bytes);
            }
            Ok(Ok((status, _))) => {
                prefill
                    .backend
                    .failed(&state.router, state.options.breaker_failures);
                let why = format!("worker {} answered {status}", worker.0);
                return prefill_failed(state, asked, body, pins, why).await;
            }
            Ok(Err(e)) if e.is_connect() && pins.prefill.is_none() => {
                // Down: the next prefill worker, if there is one.
                mark_unreachable(&state.router, worker.0);
                state.metrics.retries.with_label_values(&["connect"]).inc();
                pool.retain(|w| *w != worker);
                if pool.is_empty() {
                    let why = format!("worker {} refused the connection", worker.0);
                    return prefill_failed(state, asked, body, pins, why).await;
                }
            }
            Ok(Err(e)) => {
                prefill
                    .backend
                    .failed(&state.router, state.options.breaker_failures);
                let why = format!("worker {}: {e}", worker.0);
                return prefill_failed(state, asked, body, pins, why).await;
            }
            Err(_) => {
                prefill
                    .backend
                    .failed(&state.router, state.options.breaker_failures);
                let why = format!("worker {} sent nothing in time", worker.0);
                return prefill_failed(state, asked, body, pins, why).await;
            }
        }
    };
    let (prefill, bytes) = answer;
    let params = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v.get("kv_transfer_params").cloned())
        .filter(|p| !p.is_null());
    let Some(params) = params else {
        // An engine without a KV connector: the decode worker would compute the whole
        // prompt again. Served, but counted and told.
        tracing::warn!(
            worker = prefill.spec.id,
            "the prefill worker answered no kv_transfer_params: is its KV connector set?"
        );
        let second = Bytes::from(Value::Object(request).to_string());
        let joined = spawn_decode(state, asked, second, pins, &prefill).await;
        return decoded(state, joined, "no_transfer_params");
    };
    let mut second = request;
    second.insert("kv_transfer_params".to_owned(), params);
    let second = Bytes::from(Value::Object(second).to_string());
    let joined = spawn_decode(state, asked, second, pins, &prefill).await;
    decoded(state, joined, "disaggregated")
}

/// An engine's refusal of a request (a 4xx), passed on as it is.
fn relay_refusal(state: &AppState, route: &str, status: StatusCode, body: Bytes) -> Response {
    state
        .metrics
        .requests
        .with_label_values(&[route, "upstream_client_error"])
        .inc();
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

/// The choices `/v1/route` reports in a fleet with prefill and decode workers, by the rules
/// the proxy follows ([`plan`]): the prefill worker (none when the request would be served
/// whole) and the decode worker, each booked or not by `mode`.
pub(crate) fn route_both(
    state: &AppState,
    routed: &Routed,
    headers: &HeaderMap,
    mode: Mode,
) -> Result<(Option<Decision>, Decision), proxy::Refusal> {
    let pins = Pins::read(state, headers)?;
    let unavailable = |e: kvroute_core::RouteError| {
        proxy::Refusal::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
    };
    let hints = RouteHints {
        mode,
        prompt_len: Some(routed.prompt_len),
        expected_output_tokens: routed.expected_output,
        lora_name: routed.lora.as_deref(),
        cache_salt: routed.cache_salt.as_deref(),
        ..RouteHints::default()
    };
    let id = || state.route_id();
    let pool = match plan(state, routed, pins)? {
        Plan::Split(pool) => pool,
        Plan::Whole { rank, .. } => {
            let allowed = proxy::allowed_workers(state, &[], Pool::Roles(DECODE_ROLES)).flatten();
            let pinned = match rank {
                Some(rank) => Pinned {
                    backend_instance: Some(rank.worker),
                    dp_rank: Some(rank.dp_rank),
                    ..Pinned::default()
                },
                None => Pinned {
                    backend_instance: pins.decode,
                    ..Pinned::default()
                },
            };
            let request = RouteRequest {
                id: id(),
                tokens: &routed.tokens,
                hints: RouteHints {
                    allowed: allowed.as_deref(),
                    pinned,
                    ..hints
                },
            };
            return state
                .router
                .route(&request)
                .map(|d| (None, d))
                .map_err(unavailable);
        }
    };
    let prefill = state
        .router
        .route(&RouteRequest {
            id: id(),
            tokens: &routed.tokens,
            hints: RouteHints {
                phase: Phase::Prefill,
                allowed: Some(&pool),
                pinned: Pinned {
                    prefill_worker: pins.prefill,
                    ..Pinned::default()
                },
                expected_output_tokens: Some(1),
                ..hints
            },
        })
        .map_err(unavailable)?;
    let required = state
        .backends
        .get(prefill.worker.worker.0)
        .map(|p| required_labels(state, &p))
        .unwrap_or_default();
    let labels: Vec<Label<'_>> = required
        .iter()
        .map(|(k, v)| Label { key: k, value: v })
        .collect();
    let decode_pool = proxy::allowed_workers(state, &[], Pool::Roles(DECODE_ROLES)).flatten();
    let decode = state.router.route(&RouteRequest {
        id: id(),
        tokens: &routed.tokens,
        hints: RouteHints {
            phase: Phase::Decode,
            allowed: decode_pool.as_deref(),
            required: &labels,
            pinned: Pinned {
                decode_worker: pins.decode,
                ..Pinned::default()
            },
            ..hints
        },
    });
    match decode {
        Ok(decode) => Ok((Some(prefill), decode)),
        Err(e) => {
            if mode == Mode::Book {
                let _ = state.router.free(prefill.request);
            }
            Err(unavailable(e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_changes_once_per_transition() {
        let a = Activation::default();
        assert!(!a.get());
        // Deactivating what is not active changes nothing, however often.
        assert!(!a.set(false));
        assert!(!a.set(false));
        assert!(a.set(true), "activated");
        assert!(!a.set(true), "activating again is no change");
        assert!(a.set(false), "deactivated");
        assert!(!a.set(false), "deactivation is idempotent");
        assert!(a.set(true), "reactivated");
        assert!(a.get());
    }

    #[test]
    fn protocols_parse_by_name() {
        assert_eq!("vllm".parse(), Ok(Protocol::Vllm));
        assert_eq!("sglang".parse(), Ok(Protocol::Sglang));
        assert!("trtllm"
            .parse::<Protocol>()
            .unwrap_err()
            .contains("vllm or sglang"));
        for p in [Protocol::Vllm, Protocol::Sglang] {
            assert_eq!(p.as_str().parse(), Ok(p));
        }
    }
}
