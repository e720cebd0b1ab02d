//! The worker's HTTP face: vLLM's OpenAI-compatible routes, its metrics, and the admin routes
//! through which tests inject faults.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/completions` | token-id or text prompts; streaming (SSE) or not; `usage` with `prompt_tokens_details.cached_tokens` |
//! | `POST /v1/chat/completions` | messages rendered by the model's chat template; the same answers in chat's shape |
//! | `GET /v1/models`, `GET /health` | as vLLM |
//! | `GET /metrics` | Prometheus text, vLLM's names |
//! | `POST /reset_prefix_cache` | as vLLM: drop the prefix cache (`AllBlocksCleared`) |
//! | `POST /admin/events/drop?batches=N`, `/admin/events/delay?ms=N`, `/admin/events/restart` | faults of the KV-event stream |
//! | `POST /admin/restart` | the engine as a restarted process: cache emptied, event sequence from 0 |
//! | `POST /admin/pause`, `/admin/resume`, `/admin/exit`; `GET /admin/stats` | the engine |
//! | `POST /admin/cached` | a completion's or chat's body → the prompt tokens cached here now (a replay's oracle) |
//! | `POST /kv/pull` | a decode worker takes a prompt's KV computed here (vLLM's protocol; see `disagg.rs`) |
//!
//! A prefill worker's bootstrap server (SGLang's protocol) answers `POST /kv/pull` for rooms
//! and `GET /health` on its own port.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRef, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use serde::Deserialize;
use tokio::sync::{mpsc, oneshot, Notify};

use kvroute_sim::{Admission, Finish, RequestId, RequestOutput};

use super::disagg::{self, DisaggOptions, Half, Handoff, HandoffKey, Handoffs};
use super::driver::{Command, Driver, DriverStats, PromptKv};
use super::metrics::Metrics;
use super::publisher::{EventFault, Publisher};
use kvroute_serve::openai::{ErrorBody, ModelCard, ModelList, Prompt, Usage};
use kvroute_text::ModelText;
use serde_json::Value;

/// What every handler shares.
#[derive(Debug, Clone)]
pub(crate) struct AppState {
    pub driver: Driver,
    pub publisher: Option<Publisher>,
    pub metrics: Metrics,
    pub model: Arc<str>,
    pub max_model_len: u32,
    pub shutdown: Arc<Notify>,
    pub text: Option<Arc<ModelText>>,
    /// Where HTTP listens (a prefill half's `remote_port`).
    pub http: std::net::SocketAddr,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Its role and transfer link.
    pub disagg: Arc<DisaggOptions>,
    /// The hand-overs kept for decode workers, and the transfer counts.
    pub handoffs: Arc<Handoffs>,
    /// Names this worker in a prefill half's answer (`remote_engine_id`).
    pub engine_id: Arc<str>,
    /// Pulls prompts' KV from prefill workers.
    pub client: reqwest::Client,
}

impl FromRef<AppState> for Arc<Handoffs> {
    fn from_ref(state: &AppState) -> Self {
        Arc::clone(&state.handoffs)
    }
}

/// The routes, with a body limit of `max_body` bytes.
pub(crate) fn router(state: AppState, max_body: usize) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/admin/events/drop", post(drop_events))
        .route("/admin/events/delay", post(delay_events))
        .route("/admin/events/restart", post(restart_events))
        .route("/admin/restart", post(restart_engine))
        .route("/admin/pause", post(pause))
        .route("/admin/resume", post(resume))
        .route("/admin/exit", post(exit))
        .route("/admin/stats", get(admin_stats))
        .route("/admin/cached", post(admin_cached))
        .route("/kv/pull", post(disagg::pull))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

/// A prefill worker's bootstrap server: where SGLang's decode workers pull a room's KV.
pub(crate) fn bootstrap_router(handoffs: Arc<Handoffs>) -> Router {
    Router::new()
        .route("/kv/pull", post(disagg::pull))
        .route("/health", get(|| async { StatusCode::OK }))
        .with_state(handoffs)
}

/// An error in OpenAI's shape.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(ErrorBody::new(status.as_u16(), message))).into_response()
}

fn bad_request(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, message)
}

fn unavailable() -> Response {
    error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")
}

fn now_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What a request asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

async fn completions(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    generate(state, Kind::Completion, &headers, body).await
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(state, Kind::Chat, &headers, body).await
}

/// The prompt's token ids: a completion's token ids or text, a chat's rendered messages.
fn prompt_ids(state: &AppState, kind: Kind, request: &Value) -> Result<Vec<u32>, String> {
    let text = state.text.as_deref();
    let no_tokenizer = |what: &str| {
        format!("{what} need the model's tokenizer: start the worker with --tokenizer DIR")
    };
    let ids = match kind {
        Kind::Chat => {
            let Some(text) = text else {
                return Err(no_tokenizer("chat requests"));
            };
            text.chat_ids(request).map_err(|e| e.to_string())?
        }
        Kind::Completion => {
            let prompt = match request.get("prompt") {
                Some(p) => Prompt::deserialize(p).map_err(|_| {
                    "prompt must be a string or a list of token ids (one prompt per request)"
                        .to_owned()
                })?,
                None => return Err("no prompt".to_owned()),
            };
            match prompt {
                Prompt::Ids(tokens) => tokens,
                Prompt::Text(prompt) => {
                    let Some(text) = text else {
                        return Err(no_tokenizer("text prompts"));
                    };
                    text.text_ids(&prompt).map_err(|e| e.to_string())?
                }
            }
        }
    };
    if ids.is_empty() {
        return Err("the prompt has no tokens".to_owned());
    }
    Ok(ids)
}

/// The body as a JSON object, or why it is refused.
fn request_object(body: &[u8]) -> Result<Value, String> {
    match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err("the body must be a JSON object".to_owned()),
        Err(e) => Err(format!("malformed request: {e}")),
    }
}

/// The prompt's token ids and the request's cache salt, or why the request is refused.
fn prompt_and_salt(
    state: &AppState,
    kind: Kind,
    request: &Value,
) -> Result<(Vec<u32>, Option<Arc<str>>), String> {
    Ok((prompt_ids(state, kind, request)?, cache_salt(request)?))
}

/// The request's `cache_salt`, which vLLM takes as a non-empty string.
fn cache_salt(request: &Value) -> Result<Option<Arc<str>>, String> {
    match request.get("cache_salt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(salt)) if !salt.is_empty() => Ok(Some(Arc::from(salt.as_str()))),
        Some(_) => Err("Parameter 'cache_salt' must be a non-empty string if provided.".to_owned()),
    }
}

async fn generate(state: AppState, kind: Kind, headers: &HeaderMap, body: Bytes) -> Response {
    let request = match request_object(&body) {
        Ok(v) => v,
        Err(message) => return bad_request(message),
    };
    if let Some(model) = request.get("model").and_then(Value::as_str) {
        if model != &*state.model {
            return error(
                StatusCode::NOT_FOUND,
                format!("The model `{model}` does not exist."),
            );
        }
    }
    if request
        .get("n")
        .and_then(Value::as_u64)
        .is_some_and(|n| n != 1)
    {
        return bad_request("only n = 1 is served");
    }
    let (prompt, cache_salt) = match prompt_and_salt(&state, kind, &request) {
        Ok(x) => x,
        Err(message) => return bad_request(message),
    };
    let max_tokens = request
        .get("max_tokens")
        .or_else(|| request.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .map_or(16, |n| n.min(u64::from(u32::MAX)) as u32);
    if max_tokens == 0 {
        return bad_request("max_tokens must be at least 1");
    }
    let total = prompt.len() as u64 + u64::from(max_tokens);
    if total > u64::from(state.max_model_len) {
        return bad_request(format!(
            "This model's maximum context length is {} tokens; the request asks for {total} \
             ({} in the prompt, {max_tokens} to generate).",
            state.max_model_len,
            prompt.len()
        ));
    }
    let half = match Half::read(&request, state.disagg.role) {
        Ok(half) => half,
        Err(message) => return bad_request(message),
    };
    let prompt_tokens = prompt.len() as u32;
    let (kv, max_tokens, handoff) =
        match begin_half(&state, half, &prompt, &cache_salt, max_tokens).await {
            Ok(begun) => begun,
            Err(response) => return response,
        };
    let (sink, outputs) = mpsc::unbounded_channel();
    let (reply, admitted) = oneshot::channel();
    if !state.driver.send(Command::Admit {
        prompt,
        cache_salt,
        max_output_tokens: max_tokens,
        kv,
        sink,
        reply,
    }) {
        return unavailable();
    }
    let id = match admitted.await {
        Ok(Ok(id)) => id,
        Ok(Err(e)) => return bad_request(e.to_string()),
        Err(_) => return unavailable(),
    };
    let guard = AbortOnDrop {
        driver: state.driver.clone(),
        id,
    };
    // A prefill half's hand-over is ready once its prompt is computed; vLLM's answers the
    // parameters its decode worker pulls the prompt by.
    let (outputs, transfer) = match handoff {
        Some(handoff) => {
            let host = advertised_host(&state, headers);
            let port = state.http.port();
            let params = handoff.vllm_params(&state.engine_id, &host, port, state.block_size);
            (handoff.watch(outputs), params)
        }
        None => (outputs, None),
    };
    let meta = Meta {
        kind,
        id: match kind {
            Kind::Completion => format!("cmpl-{}", id.0),
            Kind::Chat => format!("chatcmpl-{}", id.0),
        },
        created: now_seconds(),
        model: state.model.to_string(),
        prompt_tokens,
        text: state.text.clone(),
    };
    let stream = request
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if stream {
        let include_usage = request
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        stream_completion(meta, outputs, include_usage, guard).into_response()
    } else {
        whole_completion(meta, outputs, guard, transfer).await
    }
}

/// What serving `half` of a request takes before its admission: a decode half's transfer (a
/// failed one is the request's answer), a prefill half's hand-over begun (SGLang's computes
/// one token). Returns where the prompt's KV comes from, the tokens to generate and the
/// hand-over.
async fn begin_half(
    state: &AppState,
    half: Half,
    prompt: &[u32],
    cache_salt: &Option<Arc<str>>,
    max_tokens: u32,
) -> Result<(PromptKv, u32, Option<Handoff>), Response> {
    let handed = disagg::handed_tokens(prompt.len(), state.block_size);
    match half {
        Half::Whole => Ok((PromptKv::Computed, max_tokens, None)),
        Half::Decode(source) => match receive(state, source, prompt, cache_salt.clone()).await {
            Ok(()) => Ok((PromptKv::Transferred, max_tokens, None)),
            Err(why) => Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the KV transfer failed: {why}"),
            )),
        },
        Half::VllmPrefill => {
            let key = state.handoffs.new_request_key(&state.engine_id);
            let handoff = Handoff::begin(&state.handoffs, key, handed);
            Ok((PromptKv::Computed, max_tokens, Some(handoff)))
        }
        Half::SglangPrefill(room) => {
            let handoff = Handoff::begin(&state.handoffs, HandoffKey::Room(room), handed);
            Ok((PromptKv::Computed, 1, Some(handoff)))
        }
    }
}

/// The decode half's transfer: the prompt's full blocks pulled from `source`, timed over those
/// this worker's cache lacks.
async fn receive(
    state: &AppState,
    source: disagg::Source,
    prompt: &[u32],
    cache_salt: Option<Arc<str>>,
) -> Result<(), String> {
    let expected = disagg::handed_tokens(prompt.len(), state.block_size);
    let (reply, cached) = oneshot::channel();
    if !state.driver.send(Command::Cached {
        prompt: prompt.to_vec(),
        cache_salt,
        reply,
    }) {
        return Err("the engine has stopped".to_owned());
    }
    let cached = cached
        .await
        .map_err(|_| "the engine has stopped".to_owned())?;
    disagg::receive(
        state.client.clone(),
        Arc::clone(&state.handoffs),
        source,
        state.disagg.transfer,
        expected,
        expected.saturating_sub(cached),
    )
    .await
}

/// The host a decode worker reaches this one at: the address HTTP listens on, or, when that
/// is every interface, the host the request was sent to.
fn advertised_host(state: &AppState, headers: &HeaderMap) -> String {
    let ip = state.http.ip();
    if !ip.is_unspecified() {
        return ip.to_string();
    }
    headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.parse::<axum::http::uri::Authority>().ok())
        .map_or_else(|| "127.0.0.1".to_owned(), |a| a.host().to_owned())
}

/// Aborts its request in the engine when dropped: a client that goes away (the handler's
/// future or the response stream dropped) stops the engine's work at once, as vLLM does. A
/// request that already finished is unknown to the engine by then, and the abort is a no-op.
#[derive(Debug)]
struct AbortOnDrop {
    driver: Driver,
    id: RequestId,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.driver.send(Command::Abort(self.id));
    }
}

/// What every chunk of one completion repeats.
#[derive(Debug, Clone)]
struct Meta {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
    text: Option<Arc<ModelText>>,
}

impl Meta {
    /// The text of generated ids: the tokenizer's, or (without one) a word per id, so that
    /// lengths and streams behave like real ones.
    fn text_of(&self, ids: &[u32]) -> String {
        if let Some(text) = &self.text {
            if let Ok(decoded) = text.tokenizer.decode(ids) {
                return decoded;
            }
        }
        ids.iter().map(|id| format!(" t{id}")).collect()
    }

    fn envelope(&self, object: &str, choices: Value, usage: Option<Usage>) -> Value {
        let mut v = serde_json::json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let (Some(usage), Some(map)) = (usage, v.as_object_mut()) {
            map.insert(
                "usage".to_owned(),
                serde_json::to_value(usage).unwrap_or(Value::Null),
            );
        }
        v
    }

    /// The whole answer.
    fn whole(&self, text: String, finish: Option<&str>, usage: Usage) -> Value {
        match self.kind {
            Kind::Completion => self.envelope(
                "text_completion",
                serde_json::json!([{"index": 0, "text": text, "logprobs": null,
                    "finish_reason": finish, "stop_reason": null}]),
                Some(usage),
            ),
            Kind::Chat => self.envelope(
                "chat.completion",
                serde_json::json!([{"index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null, "finish_reason": finish, "stop_reason": null}]),
                Some(usage),
            ),
        }
    }

    /// One streamed chunk (`first`: the chat's opening delta carries the role).
    fn chunk(&self, text: String, finish: Option<&str>, first: bool) -> Value {
        match self.kind {
            Kind::Completion => self.envelope(
                "text_completion",
                serde_json::json!([{"index": 0, "text": text, "logprobs": null,
                    "finish_reason": finish, "stop_reason": null}]),
                None,
            ),
            Kind::Chat => {
                let delta = if first {
                    serde_json::json!({"role": "assistant", "content": text})
                } else {
                    serde_json::json!({"content": text})
                };
                self.envelope(
                    "chat.completion.chunk",
                    serde_json::json!([{"index": 0, "delta": delta, "logprobs": null,
                        "finish_reason": finish}]),
                    None,
                )
            }
        }
    }

    /// The last streamed chunk: the usage alone.
    fn usage_chunk(&self, usage: Usage) -> Value {
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        self.envelope(object, serde_json::json!([]), Some(usage))
    }
}

fn finish_reason(finish: Option<Finish>) -> Option<&'static str> {
    match finish {
        Some(Finish::Length) => Some("length"),
        Some(Finish::Aborted) => Some("abort"),
        None => None,
    }
}

/// The whole answer, with `transfer` as its `kv_transfer_params` when given.
async fn whole_completion(
    meta: Meta,
    mut outputs: mpsc::UnboundedReceiver<RequestOutput>,
    guard: AbortOnDrop,
    transfer: Option<Value>,
) -> Response {
    let id = guard.id;
    let mut ids = Vec::new();
    let mut cached = 0u32;
    let mut finish = None;
    while let Some(output) = outputs.recv().await {
        ids.extend_from_slice(&output.tokens);
        cached = output.cached_tokens;
        if output.finish.is_some() {
            finish = output.finish;
            break;
        }
    }
    if finish.is_none() {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("request {} ended without finishing", id.0),
        );
    }
    let usage = Usage::new(meta.prompt_tokens, ids.len() as u32, cached);
    let text = meta.text_of(&ids);
    let mut answer = meta.whole(text, finish_reason(finish), usage);
    if let (Some(transfer), Some(map)) = (transfer, answer.as_object_mut()) {
        map.insert("kv_transfer_params".to_owned(), transfer);
    }
    Json(answer).into_response()
}

/// Where a streamed completion stands.
struct Streaming {
    meta: Meta,
    outputs: mpsc::UnboundedReceiver<RequestOutput>,
    include_usage: bool,
    generated: u32,
    cached: u32,
    /// Aborts the request if the client leaves before the end.
    _guard: AbortOnDrop,
    /// Chunks ready to go out, in order.
    queue: std::collections::VecDeque<String>,
    done: bool,
}

fn stream_completion(
    meta: Meta,
    outputs: mpsc::UnboundedReceiver<RequestOutput>,
    include_usage: bool,
    guard: AbortOnDrop,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let start = Streaming {
        meta,
        outputs,
        include_usage,
        generated: 0,
        cached: 0,
        _guard: guard,
        queue: std::collections::VecDeque::new(),
        done: false,
    };
    let events = stream::unfold(start, |mut s| async move {
        loop {
            if let Some(data) = s.queue.pop_front() {
                return Some((Ok(Event::default().data(data)), s));
            }
            if s.done {
                return None;
            }
            match s.outputs.recv().await {
                Some(output) => s.take(output),
                None => {
                    // The engine went away mid-stream: end the stream without [DONE].
                    s.done = true;
                }
            }
        }
    });
    Sse::new(events)
}

impl Streaming {
    fn take(&mut self, output: RequestOutput) {
        let first = self.generated == 0;
        self.generated += output.tokens.len() as u32;
        self.cached = output.cached_tokens;
        let text = if output.tokens.is_empty() {
            String::new()
        } else {
            self.meta.text_of(&output.tokens)
        };
        let finish = finish_reason(output.finish);
        if !text.is_empty() || finish.is_some() {
            let chunk = self.meta.chunk(text, finish, first);
            self.push(&chunk);
        }
        if output.finish.is_some() {
            if self.include_usage {
                let usage = Usage::new(self.meta.prompt_tokens, self.generated, self.cached);
                let chunk = self.meta.usage_chunk(usage);
                self.push(&chunk);
            }
            self.queue.push_back("[DONE]".to_owned());
            self.done = true;
        }
    }

    fn push(&mut self, chunk: &Value) {
        self.queue.push_back(chunk.to_string());
    }
}

async fn models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.model.to_string(),
            object: "model",
            created: now_seconds(),
            owned_by: "kvroute",
            max_model_len: state.max_model_len,
        }],
    })
}

async fn driver_stats(state: &AppState) -> Option<DriverStats> {
    let (reply, stats) = oneshot::channel();
    if !state.driver.send(Command::Stats(reply)) {
        return None;
    }
    stats.await.ok()
}

async fn metrics(State(state): State<AppState>) -> Response {
    let Some(stats) = driver_stats(&state).await else {
        return unavailable();
    };
    let publisher = match &state.publisher {
        Some(p) => Some(p.counts().await),
        None => None,
    };
    let text = state.metrics.render(&stats, publisher.as_ref());
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

async fn reset_prefix_cache(State(state): State<AppState>) -> Response {
    let (reply, done) = oneshot::channel();
    if !state.driver.send(Command::ClearCache(reply)) {
        return unavailable();
    }
    match done.await {
        Ok(Ok(())) => StatusCode::OK.into_response(),
        Ok(Err(e)) => bad_request(e.to_string()),
        Err(_) => unavailable(),
    }
}

async fn restart_engine(State(state): State<AppState>) -> Response {
    // A restarted process knows no hand-over: waiting pulls fail at once.
    state.handoffs.fail_all("the engine restarted");
    let (reply, done) = oneshot::channel();
    if !state.driver.send(Command::Restart(reply)) {
        return unavailable();
    }
    match done.await {
        Ok(Ok(())) => StatusCode::OK.into_response(),
        Ok(Err(e)) => bad_request(e.to_string()),
        Err(_) => unavailable(),
    }
}

#[derive(Debug, Deserialize)]
struct DropQuery {
    batches: u32,
}

#[derive(Debug, Deserialize)]
struct DelayQuery {
    ms: u64,
}

async fn event_fault(state: &AppState, fault: EventFault) -> Response {
    match &state.publisher {
        Some(p) => {
            p.fault(fault).await;
            StatusCode::OK.into_response()
        }
        None => bad_request("this worker publishes no KV events"),
    }
}

async fn drop_events(State(state): State<AppState>, Query(q): Query<DropQuery>) -> Response {
    event_fault(&state, EventFault::Drop(q.batches)).await
}

async fn delay_events(State(state): State<AppState>, Query(q): Query<DelayQuery>) -> Response {
    event_fault(&state, EventFault::Delay(Duration::from_millis(q.ms))).await
}

async fn restart_events(State(state): State<AppState>) -> Response {
    event_fault(&state, EventFault::Restart).await
}

async fn pause(State(state): State<AppState>) -> Response {
    set_admission(&state, Admission::Paused)
}

async fn resume(State(state): State<AppState>) -> Response {
    set_admission(&state, Admission::Open)
}

fn set_admission(state: &AppState, admission: Admission) -> Response {
    if state.driver.send(Command::SetAdmission(admission)) {
        StatusCode::OK.into_response()
    } else {
        unavailable()
    }
}

async fn exit(State(state): State<AppState>) -> StatusCode {
    state.shutdown.notify_one();
    StatusCode::OK
}

async fn admin_stats(State(state): State<AppState>) -> Response {
    let Some(stats) = driver_stats(&state).await else {
        return unavailable();
    };
    let publisher = match &state.publisher {
        Some(p) => Some(p.counts().await),
        None => None,
    };
    let e = &stats.engine;
    Json(serde_json::json!({
        "role": state.disagg.role.as_str(),
        "running": e.running,
        "waiting": e.waiting,
        "passes": e.passes,
        "preemptions": e.preemptions,
        "prefix_query_tokens": e.prefix_query_tokens,
        "prefix_hit_tokens": e.prefix_hit_tokens,
        "blocks": {
            "total": e.blocks.total,
            "in_use": e.blocks.in_use,
            "cached": e.blocks.cached,
            "cached_copies": e.blocks.cached_copies,
            "idle": e.blocks.idle,
        },
        "admitted": stats.admitted,
        "transferred": stats.transferred,
        "transfers": state.handoffs.stats(),
        "aborted": stats.aborted,
        "finished": stats.finished,
        "prompt_tokens": stats.prompt_tokens,
        "generation_tokens": stats.generation_tokens,
        "events": publisher.map(|p| serde_json::json!({
            "next_seq": p.next_seq,
            "sent": p.sent,
            "dropped": p.dropped,
            "replays": p.replays,
            "restarts": p.restarts,
        })),
    }))
    .into_response()
}

/// The prompt tokens this engine's prefix cache holds now for a request, given its body (a
/// chat's when it has `messages`, else a completion's), leaving the last token to compute as
/// admission does. Nothing is admitted. A replay asks every worker at each arrival and takes
/// the most: the oracle's hit rate.
async fn admin_cached(State(state): State<AppState>, body: Bytes) -> Response {
    let request = match request_object(&body) {
        Ok(v) => v,
        Err(message) => return bad_request(message),
    };
    let kind = if request.get("messages").is_some() {
        Kind::Chat
    } else {
        Kind::Completion
    };
    let (prompt, cache_salt) = match prompt_and_salt(&state, kind, &request) {
        Ok(x) => x,
        Err(message) => return bad_request(message),
    };
    let prompt_tokens = prompt.len();
    let (reply, cached) = oneshot::channel();
    if !state.driver.send(Command::Cached {
        prompt,
        cache_salt,
        reply,
    }) {
        return unavailable();
    }
    match cached.await {
        Ok(cached_tokens) => Json(serde_json::json!({
            "cached_tokens": cached_tokens,
            "prompt_tokens": prompt_tokens,
        }))
        .into_response(),
        Err(_) => unavailable(),
    }
}
