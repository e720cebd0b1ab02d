//! An OpenAI request on its way to an engine: read only for what routing needs (the prompt's tokens,
//! the expected output length), routed by the core, and sent to the chosen engine unchanged;
//! the engine's answer (status, SSE chunks as they come, usage, errors) comes back unchanged.
//!
//! ```text
//!  body ──prompt tokens──▶ Router::route (books load) ──▶ RequestGuard
//!    └──────────unchanged──────────▶ engine ──▶ first chunk: prefill_done ──▶ end: finish
//!                                       connection refused / 5xx before a byte: mark the
//!                                       worker down, free, route again without it (the
//!                                       prober drops its blocks if it stays unreachable)
//!  a client that goes away drops the body stream: the guard frees, the upstream connection
//!  closes, and the engine stops the request
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use kvroute_core::{
    Admission, Label, Phase, Pinned, RequestGuard, RequestId, RouteError, RouteHints, RouteRequest,
    Router, WorkerId,
};
use serde_json::Value;

use super::backends::{mark_unreachable, EngineUrls, Role};
use super::AppState;
use crate::headers;
use crate::upstream::{is_event_stream, next_chunk, read_all, Answer, UpstreamError};
use kvroute_text::{ModelText, ModelTextError, Partial};

/// An error in OpenAI's shape, counted under `route`.
pub(crate) fn error(
    state: &AppState,
    route: &str,
    status: StatusCode,
    message: impl Into<String>,
) -> Response {
    let outcome = if status.is_client_error() {
        "client_error"
    } else {
        "server_error"
    };
    state
        .metrics
        .requests
        .with_label_values(&[route, outcome])
        .inc();
    let body = super::openai::ErrorBody::new(status.as_u16(), message);
    (status, axum::Json(body)).into_response()
}

/// What routing reads of a request body.
#[derive(Clone, Debug)]
pub(crate) struct Routed {
    /// The prompt's ids, or of a text prompt the first of them: as far as they could matter
    /// to the decision (see [`Routed::with_text`]).
    pub tokens: Vec<u32>,
    /// The prompt's whole length in tokens: more than `tokens` holds when a text was tokenized
    /// only in part (the rest estimated from its bytes).
    pub prompt_len: u64,
    /// Whether the ids come from tokenizing text (else the client sent them).
    pub from_text: bool,
    pub expected_output: Option<u32>,
    /// The LoRA adapter the request names (its blocks are hashed under it).
    pub lora: Option<String>,
    /// The request's cache salt (vLLM's `cache_salt`): its blocks are hashed under it, as the
    /// engine's are.
    pub cache_salt: Option<String>,
}

/// A request refused before routing: its status and why.
#[derive(Debug)]
pub(crate) struct Refusal {
    status: StatusCode,
    message: String,
}

impl Refusal {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Refusal {
            status,
            message: message.into(),
        }
    }

    /// Its status.
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    /// The refusal as an error response, counted under `route`.
    pub(crate) fn respond(self, state: &AppState, route: &str) -> Response {
        error(state, route, self.status, self.message)
    }
}

/// Bodies past this many bytes are read and tokenized on a blocking thread, so that a long
/// text's tokenization does not hold up the runtime thread other requests are on.
const BLOCKING_BODY_BYTES: usize = 16 << 10;

/// [`read_completion`], on a blocking thread when the body is long and may need tokenizing.
pub(crate) async fn read_completion_async(
    state: &AppState,
    body: &Bytes,
) -> Result<Routed, Refusal> {
    read_off_thread(state, body, read_completion).await
}

/// [`read_prompt`], on a blocking thread when the body is long and may need tokenizing.
pub(crate) async fn read_prompt_async(
    state: &AppState,
    body: &Bytes,
    chat: bool,
) -> Result<(Value, Routed), Refusal> {
    read_off_thread(state, body, move |state, body| {
        read_prompt(state, body, chat)
    })
    .await
}

/// `read` on the body: here when it is short or nothing needs tokenizing, else on a blocking
/// thread, in its turn ([`Offload`]).
async fn read_off_thread<T, F>(state: &AppState, body: &Bytes, read: F) -> Result<T, Refusal>
where
    T: Send + 'static,
    F: FnOnce(&AppState, &[u8]) -> Result<T, Refusal> + Send + 'static,
{
    if state.text.is_none() || body.len() <= BLOCKING_BODY_BYTES {
        return read(state, body);
    }
    // Never closed, so a permit always comes. It goes with the work: a request dropped while
    // its prompt is tokenized still holds its turn until the tokenizing ends.
    let Ok(turn) = Arc::clone(&state.offload.prompts).acquire_owned().await else {
        return read(state, body);
    };
    let (state, body) = (state.clone(), body.clone());
    tokio::task::spawn_blocking(move || {
        let read = read(&state, &body);
        drop(turn);
        read
    })
    .await
    .unwrap_or_else(|e| {
        Err(Refusal::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading the prompt failed: {e}"),
        ))
    })
}

/// A completion's token ids and output length, or the client's error: its routing fields
/// read straight from the body where they have the usual shapes, else by [`read_prompt`].
pub(crate) fn read_completion(state: &AppState, body: &[u8]) -> Result<Routed, Refusal> {
    let Some(fields) = super::openai::completion_fields(body) else {
        return read_prompt(state, body, false).map(|(_, routed)| routed);
    };
    let lora = model_lora(state, fields.model.as_deref(), fields.model.is_some())?;
    let cache_salt = match fields.cache_salt {
        Some(salt) => Some(checked_salt(&salt)?.to_owned()),
        None => None,
    };
    let expected_output = fields
        .max_tokens
        .or(fields.max_completion_tokens)
        .and_then(|n| u32::try_from(n).ok());
    let routed = Routed::new(expected_output, lora, cache_salt);
    match fields.prompt {
        Some(super::openai::Prompt::Ids(ids)) => routed.with_client_ids(state, ids),
        Some(super::openai::Prompt::Text(text)) => {
            routed.with_text(state, |text_ids, more| text_ids.text_ids_while(&text, more))
        }
        None => Err(Refusal::new(StatusCode::BAD_REQUEST, "no prompt")),
    }
}

/// A cache salt as vLLM takes it: a non-empty string.
fn checked_salt(salt: &str) -> Result<&str, Refusal> {
    if salt.is_empty() {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "cache_salt must be a non-empty string",
        ));
    }
    Ok(salt)
}

/// The LoRA adapter a request's `model` names (`named`, when it is a string; `present`, when
/// the field is there at all), or a 404 when it names neither the served model nor an adapter.
fn model_lora(
    state: &AppState,
    named: Option<&str>,
    present: bool,
) -> Result<Option<String>, Refusal> {
    let lora = named
        .filter(|m| state.options.lora_adapters.iter().any(|a| a == m))
        .map(str::to_owned);
    if let Some(served) = &state.options.model {
        if present && named != Some(served.as_str()) && lora.is_none() {
            return Err(Refusal::new(
                StatusCode::NOT_FOUND,
                format!("The model `{}` does not exist.", named.unwrap_or("?")),
            ));
        }
    }
    Ok(lora)
}

impl Routed {
    /// The fields read besides the prompt; the prompt's ids come next ([`Routed::with_ids`],
    /// [`Routed::with_text`]).
    fn new(expected_output: Option<u32>, lora: Option<String>, cache_salt: Option<String>) -> Self {
        Routed {
            tokens: Vec::new(),
            prompt_len: 0,
            from_text: false,
            expected_output,
            lora,
            cache_salt,
        }
    }

    /// With the ids the client sent, unless they are none or more than the model takes.
    fn with_client_ids(self, state: &AppState, ids: Vec<u32>) -> Result<Routed, Refusal> {
        match state.max_prompt_tokens() {
            Some(max) if ids.len() as u64 > max => Err(too_long(max)),
            _ => self.with_ids(ids),
        }
    }

    /// With the prompt's ids, unless there are none.
    fn with_ids(mut self, ids: Vec<u32>) -> Result<Routed, Refusal> {
        if ids.is_empty() {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                "the prompt has no tokens",
            ));
        }
        self.prompt_len = ids.len() as u64;
        self.tokens = ids;
        Ok(self)
    }

    /// With the ids of a text prompt or a chat, from `tokenize` (given the model's text and
    /// when to stop), tokenized only as far as they could matter to the decision: while some
    /// worker may hold every full block so far ([`Router::needs_more_tokens`], under the
    /// request's LoRA adapter and salt), unless the service tokenizes whole prompts. A prompt
    /// that is mostly new is then tokenized only to its first chunk not held anywhere; the
    /// rest counts by its length, estimated from its bytes at the rate of the part tokenized.
    fn with_text(
        self,
        state: &AppState,
        tokenize: impl FnOnce(
            &ModelText,
            &mut dyn FnMut(&[u32]) -> bool,
        ) -> Result<Partial, ModelTextError>,
    ) -> Result<Routed, Refusal> {
        let Some(text) = &state.text else {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                "text prompts and chats are routed by the model's tokenizer (and chat \
                 template): start kvroute serve with --tokenizer DIR, or send token ids",
            ));
        };
        let hints = RouteHints {
            lora_name: self.lora.as_deref(),
            cache_salt: self.cache_salt.as_deref(),
            ..RouteHints::default()
        };
        let block_size = state.router.config().block_size.max(1) as usize;
        // Full blocks at the last question: a step that adds none asks nothing.
        let mut checked = 0;
        let whole = state.options.tokenize_whole;
        let limit = state.max_prompt_tokens();
        let mut over = false;
        let mut more = |ids: &[u32]| {
            if limit.is_some_and(|max| ids.len() as u64 > max) {
                over = true;
                return false;
            }
            if whole {
                return true;
            }
            let full = ids.len() / block_size;
            if full <= checked {
                return true;
            }
            checked = full;
            state.router.needs_more_tokens(ids, &hints)
        };
        let mut part = tokenize(text, &mut more)
            .map_err(|e| Refusal::new(StatusCode::BAD_REQUEST, e.to_string()))?;
        let mut prompt_len = part.estimated_tokens();
        if let Some(max) = limit {
            // The text's tokenizer counted it past the limit (ModelText::max_length), or its
            // ids so far are: refused. Otherwise it fits, and an estimate past the limit is
            // only the estimate's error.
            if over {
                return Err(too_long(max));
            }
            prompt_len = prompt_len.min(max);
        }
        if let Some(whole) = part
            .unfinished
            .take()
            .filter(|_| state.options.tokenize_rests)
        {
            tokenize_rest_later(state, text, whole);
        }
        let mut routed = self.with_ids(part.ids)?;
        routed.prompt_len = prompt_len.max(routed.prompt_len);
        routed.from_text = true;
        Ok(routed)
    }
}

/// Tokenizing off the runtime's threads, bounded by the machine's cores: long prompts on the
/// request path, at most one a core at once (more wait their turn without holding a thread),
/// and the rests of prompts tokenized in part, at most one for every two cores at once (more
/// are skipped: the request path keeps the rest of the machine).
#[derive(Debug)]
pub(crate) struct Offload {
    prompts: Arc<tokio::sync::Semaphore>,
    rests_busy: AtomicUsize,
    rests_limit: usize,
}

impl Offload {
    pub(crate) fn new() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Offload {
            prompts: Arc::new(tokio::sync::Semaphore::new(cores)),
            rests_busy: AtomicUsize::new(0),
            rests_limit: cores.div_ceil(2),
        }
    }
}

/// Tokenizes the rest of a prompt tokenized only in part (`whole` is all of its text) off the
/// request path, into the piece cache, so that the conversation's next turn, which the
/// workers will hold this far, tokenizes only its new text; skipped while [`Offload`]'s
/// limit of rests are under way (the request path comes first).
fn tokenize_rest_later(state: &AppState, model: &Arc<ModelText>, whole: String) {
    let offload = Arc::clone(&state.offload);
    let outcome = &state.metrics.prompt_rests;
    // Relaxed: a count, not a guard of other memory; a race only lets one more through.
    if offload.rests_busy.fetch_add(1, Ordering::Relaxed) >= offload.rests_limit {
        offload.rests_busy.fetch_sub(1, Ordering::Relaxed);
        outcome.with_label_values(&["skipped"]).inc();
        return;
    }
    let model = Arc::clone(model);
    let outcome = outcome.clone();
    tokio::task::spawn_blocking(move || {
        let done = model.tokenizer.warm(&whole).is_ok();
        offload.rests_busy.fetch_sub(1, Ordering::Relaxed);
        outcome
            .with_label_values(&[if done { "done" } else { "failed" }])
            .inc();
    });
}

/// The refusal of a prompt past the model's maximum length, in vLLM's words.
fn too_long(max: u64) -> Refusal {
    Refusal::new(
        StatusCode::BAD_REQUEST,
        format!(
            "This model's maximum context length is {max} tokens. However, your prompt is \
             longer than that."
        ),
    )
}

/// Reads the prompt's token ids and the output length, or the client's error.
pub(crate) fn read_prompt(
    state: &AppState,
    body: &[u8],
    chat: bool,
) -> Result<(Value, Routed), Refusal> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| Refusal::new(StatusCode::BAD_REQUEST, format!("malformed JSON: {e}")))?;
    let Some(object) = value.as_object() else {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object",
        ));
    };
    let model = object.get("model");
    let lora = model_lora(state, model.and_then(Value::as_str), model.is_some())?;
    let expected_output = object
        .get("max_tokens")
        .or_else(|| object.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok());
    let cache_salt = match object.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(salt)) => Some(checked_salt(salt)?.to_owned()),
        Some(_) => {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                "cache_salt must be a non-empty string",
            ))
        }
    };
    let routed = Routed::new(expected_output, lora, cache_salt);
    let routed = if chat {
        routed.with_text(state, |text, more| text.chat_ids_while(&value, more))?
    } else {
        match object.get("prompt") {
            Some(Value::Array(items)) if items.iter().all(Value::is_u64) => routed
                .with_client_ids(
                    state,
                    items
                        .iter()
                        .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
                        .collect::<Option<Vec<u32>>>()
                        .ok_or_else(|| {
                            Refusal::new(StatusCode::BAD_REQUEST, "token ids must fit in 32 bits")
                        })?,
                )?,
            Some(Value::String(prompt)) => {
                routed.with_text(state, |text, more| text.text_ids_while(prompt, more))?
            }
            Some(_) => {
                return Err(Refusal::new(
                    StatusCode::BAD_REQUEST,
                    "prompt must be a string or a list of token ids (one prompt per request)",
                ))
            }
            None => return Err(Refusal::new(StatusCode::BAD_REQUEST, "no prompt")),
        }
    };
    Ok((value, routed))
}

pub(crate) fn route_error(state: &AppState, route: &str, e: &RouteError) -> Response {
    match e {
        RouteError::NoTokens { .. } | RouteError::InvalidHint { .. } => {
            error(state, route, StatusCode::BAD_REQUEST, e.to_string())
        }
        RouteError::ResourceExhausted { .. } => {
            let mut r = error(state, route, StatusCode::TOO_MANY_REQUESTS, e.to_string());
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        }
        _ => error(state, route, StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// Which of an engine's OpenAI routes a request goes to.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Api {
    Completions,
    Chat,
}

impl Api {
    /// The engine's route for this API.
    pub(crate) fn uri(self, urls: &EngineUrls) -> &axum::http::Uri {
        match self {
            Api::Completions => &urls.completions,
            Api::Chat => &urls.chat,
        }
    }
}

/// A request as the client sent it: which route, and the routing fields read from it.
#[derive(Clone, Copy)]
pub(crate) struct Asked<'a> {
    /// The route's name in the metrics.
    pub route: &'static str,
    pub api: Api,
    pub routed: &'a Routed,
    /// How long reading the body's routing fields (and tokenizing) took.
    pub read_in: std::time::Duration,
}

/// What one engine request of a client's request is: the body sent, the phase it is routed
/// for, the workers it may go to, and what pins or constrains the choice.
pub(crate) struct Leg {
    pub body: Bytes,
    pub phase: Phase,
    pub pool: Pool,
    pub pinned: Pinned,
    /// Labels (key, value) the worker must carry.
    pub required: Vec<(String, String)>,
}

impl Leg {
    /// The whole request, as the client sent it, to any worker.
    pub(crate) fn whole(body: Bytes) -> Self {
        Leg {
            body,
            phase: Phase::Aggregated,
            pool: Pool::All,
            pinned: Pinned::default(),
            required: Vec::new(),
        }
    }
}

/// The workers a leg may go to, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pool {
    /// Any worker.
    All,
    /// Workers of these roles.
    Roles(&'static [Role]),
}

impl Pool {
    fn holds(self, role: Role) -> bool {
        match self {
            Pool::All => true,
            Pool::Roles(roles) => roles.contains(&role),
        }
    }
}

/// Routes and sends a leg to the chosen engine's route, retrying on another worker when the
/// chosen one fails before answering; relays the answer.
pub(crate) async fn dispatch(state: &AppState, asked: Asked<'_>, leg: Leg) -> Response {
    let Asked {
        route,
        api,
        routed,
        read_in,
    } = asked;
    let body = leg.body;
    let required: Vec<Label<'_>> = leg
        .required
        .iter()
        .map(|(key, value)| Label { key, value })
        .collect();
    state
        .metrics
        .prompt_read_seconds
        .observe(read_in.as_secs_f64());
    if routed.from_text {
        let tokenized = routed.tokens.len() as u64;
        let m = &state.metrics.prompt_tokens;
        m.with_label_values(&["tokenized"]).inc_by(tokenized);
        m.with_label_values(&["estimated"])
            .inc_by(routed.prompt_len.saturating_sub(tokenized));
    }
    let mut excluded: Vec<WorkerId> = Vec::new();
    let attempts = state.options.retries + 1;
    for attempt in 0..attempts {
        let Some(allowed) = allowed_workers(state, &excluded, leg.pool) else {
            break;
        };
        let id = RequestId(state.next_id.fetch_add(1, Ordering::Relaxed));
        let request = RouteRequest {
            id,
            tokens: &routed.tokens,
            hints: RouteHints {
                phase: leg.phase,
                pinned: leg.pinned,
                prompt_len: Some(routed.prompt_len),
                expected_output_tokens: routed.expected_output,
                lora_name: routed.lora.as_deref(),
                cache_salt: routed.cache_salt.as_deref(),
                allowed: allowed.as_deref(),
                required: &required,
                ..RouteHints::default()
            },
        };
        let started = Instant::now();
        let mut decided_in = None;
        let decision = match state.router.submit(&request) {
            Ok(Admission::Routed(d)) => {
                let took = started.elapsed();
                state.metrics.decision_seconds.observe(took.as_secs_f64());
                decided_in = Some(took);
                d
            }
            // Every eligible worker is busy: wait in the admission queue (dropping this
            // future, when the client goes away, takes the request out of it).
            Ok(Admission::Queued(ticket)) => {
                match Router::wait(Arc::clone(&state.router), ticket).await {
                    Ok(d) => {
                        state
                            .metrics
                            .queue_wait_seconds
                            .observe(started.elapsed().as_secs_f64());
                        d
                    }
                    Err(e) => return route_error(state, route, &e),
                }
            }
            Err(e) => return route_error(state, route, &e),
        };
        state
            .metrics
            .predicted_cached_tokens
            .observe(decision.predicted_cached_tokens as f64);
        let mut guard = RequestGuard::new(Arc::clone(&state.router), decision.request);
        let worker = decision.worker.worker;
        let Some(backend) = state.backends.get(worker.0) else {
            excluded.push(worker);
            continue;
        };
        // One timer over the answer's head and, when it streams, its first chunk: until the
        // client has seen a byte, a failed engine's request can still go elsewhere.
        let sent = tokio::time::timeout(state.options.first_byte_timeout, async {
            let uri = api.uri(&backend.urls);
            let mut response = backend
                .post(&state.client, uri, decision.worker.dp_rank.0, body.clone())
                .await?;
            let first = if response.status().is_success() && is_event_stream(&response) {
                Some(next_chunk(response.body_mut()).await?)
            } else {
                None
            };
            Ok::<_, UpstreamError>((response, first))
        })
        .await;
        let (response, first) = match sent {
            Ok(Ok(r)) => r,
            // Nothing listens, or the connection broke: the engine is down.
            Ok(Err(e)) if e.is_connect() => {
                tracing::debug!(worker = worker.0, attempt, error = %e, "upstream refused");
                state.metrics.retries.with_label_values(&["connect"]).inc();
                mark_unreachable(&state.router, worker.0);
                excluded.push(worker);
                continue;
            }
            // The connection broke before the client saw a byte (an engine killed mid-prefill):
            // tried elsewhere.
            Ok(Err(e)) => {
                tracing::debug!(worker = worker.0, attempt, error = %e, "upstream failed");
                state.metrics.retries.with_label_values(&["failed"]).inc();
                backend.failed(&state.router, state.options.breaker_failures);
                excluded.push(worker);
                continue;
            }
            // It took the connection and said nothing in time (paused, hung, overloaded):
            // the request goes to the next best engine, and the engine is marked down after
            // enough of these in a row.
            Err(_) => {
                tracing::debug!(worker = worker.0, attempt, "upstream sent nothing in time");
                state.metrics.retries.with_label_values(&["timeout"]).inc();
                if backend.failed(&state.router, state.options.breaker_failures) {
                    tracing::warn!(worker = worker.0, "worker does not answer: marked down");
                }
                excluded.push(worker);
                continue;
            }
        };
        let status = response.status();
        if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
            // One request can make an engine fail (a prompt it cannot take): the engine is
            // marked down only after several in a row.
            backend.failed(&state.router, state.options.breaker_failures);
            let elsewhere = state
                .backends
                .all()
                .iter()
                .any(|b| b.spec.id != worker.0 && !excluded.contains(&WorkerId(b.spec.id)));
            // Tried again elsewhere while there is an elsewhere; else its answer is the one.
            if attempt + 1 < attempts && elsewhere {
                state
                    .metrics
                    .retries
                    .with_label_values(&["server_error"])
                    .inc();
                excluded.push(worker);
                continue;
            }
        } else {
            backend.answered();
        }
        let _ = guard.mark_dispatched();
        let placed = Placement {
            worker,
            predicted: decision.predicted_cached_tokens,
            decided_in,
            read_in,
        };
        return relay(state, route, (response, first), guard, placed).await;
    }
    error(
        state,
        route,
        StatusCode::SERVICE_UNAVAILABLE,
        "no worker could take the request",
    )
}

/// Where a request went, as its answer's headers tell the client.
struct Placement {
    worker: WorkerId,
    /// Prompt tokens the router predicted cached there.
    predicted: u64,
    /// How long the decision took (none: it waited in the admission queue).
    decided_in: Option<std::time::Duration>,
    /// How long reading the body's routing fields and tokenizing its prompt took.
    read_in: std::time::Duration,
}

/// The workers of `pool` a request may go to now, past those `excluded` (tried already):
/// `Some(None)` any, `Some(Some(list))` those, `None` none left to try. A worker whose events do not flow
/// (not reached yet, catching up after a return, gone) or whose health has not answered is
/// passed over while another can take the request; a draining worker never gets one.
pub(crate) fn allowed_workers(
    state: &AppState,
    excluded: &[WorkerId],
    pool: Pool,
) -> Option<Option<Vec<WorkerId>>> {
    let any = pool == Pool::All && excluded.is_empty() && !state.backends.any_not_flowing();
    let allowed = if any {
        None
    } else {
        let all = state.backends.all();
        let rest = |flowing_only: bool| -> Vec<WorkerId> {
            all.iter()
                .filter(|b| pool.holds(b.spec.role))
                .filter(|b| !flowing_only || b.flowing())
                .map(|b| WorkerId(b.spec.id))
                .filter(|w| !excluded.contains(w))
                .collect()
        };
        let flowing = rest(true);
        let rest = if flowing.is_empty() {
            rest(false)
        } else {
            flowing
        };
        if rest.is_empty() {
            return None;
        }
        Some(rest)
    };
    let draining = state.draining();
    Some(match (allowed, draining.is_empty()) {
        (a, true) => a,
        (Some(a), false) => Some(a.into_iter().filter(|w| !draining.contains(w)).collect()),
        (None, false) => Some(
            state
                .backends
                .all()
                .iter()
                .map(|b| WorkerId(b.spec.id))
                .filter(|w| !draining.contains(w))
                .collect(),
        ),
    })
}

/// Sends the engine's answer back as it comes (a stream's first chunk, when it streams,
/// already read: `None` for an empty stream), moving the request's lifecycle along.
async fn relay(
    state: &AppState,
    route: &'static str,
    (response, first): (Answer, Option<Option<Bytes>>),
    guard: RequestGuard<Arc<Router>>,
    placed: Placement,
) -> Response {
    let Placement {
        worker,
        predicted,
        decided_in,
        read_in,
    } = placed;
    let status = response.status();
    let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
    let streaming = is_event_stream(&response);
    let outcome = if status.is_success() {
        "ok"
    } else if status.is_client_error() {
        "upstream_client_error"
    } else {
        "upstream_error"
    };
    state
        .metrics
        .requests
        .with_label_values(&[route, outcome])
        .inc();
    // Where the request went and what the router expected there: for clients that measure
    // (kvroute replay), and for logs.
    let mut builder = Response::builder()
        .status(status)
        .header(headers::WORKER, worker.0)
        .header(headers::PREDICTED_CACHED_TOKENS, predicted);
    if let Some(took) = decided_in {
        let micros = format!("{:.1}", took.as_secs_f64() * 1e6);
        builder = builder.header(headers::DECISION_US, micros);
    }
    let micros = format!("{:.1}", read_in.as_secs_f64() * 1e6);
    builder = builder.header(headers::PROMPT_READ_US, micros);
    if let Some(ct) = content_type {
        builder = builder.header(header::CONTENT_TYPE, ct);
    }
    let body = response.into_body();
    if !streaming {
        let bytes = read_all(body).await;
        let body = match bytes {
            Ok(b) => {
                let _ = guard.prefill_done();
                let _ = guard.finish();
                b
            }
            Err(_) => {
                mark_unreachable(&state.router, worker.0);
                drop(guard);
                return error(
                    state,
                    route,
                    StatusCode::BAD_GATEWAY,
                    "the worker failed while answering",
                );
            }
        };
        return builder
            .body(Body::from(body))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    let router = Arc::clone(&state.router);
    // The first chunk, read before the answer was committed to, goes out first.
    let first = first.flatten();
    let started = first.is_some();
    if started {
        let _ = guard.prefill_done();
    }
    let chunks = futures_util::stream::iter(first.map(Ok)).chain(futures_util::stream::unfold(
        body,
        |mut body| async move {
            next_chunk(&mut body)
                .await
                .transpose()
                .map(|chunk| (chunk, body))
        },
    ));
    let body = futures_util::stream::unfold(
        (Box::pin(chunks), Some(guard), started),
        move |(mut chunks, mut guard, mut started)| {
            let router = Arc::clone(&router);
            async move {
                match chunks.next().await {
                    Some(Ok(chunk)) => {
                        if !started {
                            started = true;
                            if let Some(g) = &guard {
                                let _ = g.prefill_done();
                            }
                        }
                        Some((Ok::<Bytes, std::io::Error>(chunk), (chunks, guard, started)))
                    }
                    Some(Err(e)) => {
                        // The worker went away mid-stream: only this request fails.
                        mark_unreachable(&router, worker.0);
                        drop(guard.take());
                        Some((Err(std::io::Error::other(e)), (chunks, None, started)))
                    }
                    None => {
                        if let Some(g) = guard.take() {
                            let _ = g.finish();
                        }
                        None
                    }
                }
            }
        },
    );
    builder
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
