//! Disaggregated serving, the engine's side: a worker computes a prompt for another worker to
//! decode (the prefill half of a request), or decodes a prompt whose KV cache another worker
//! computed (the decode half), in vLLM's protocol or SGLang's, as `kvroute serve` (or either
//! engine's own proxy) sends them.
//!
//! ```text
//!  vLLM    prefill worker ◀─ kv_transfer_params {do_remote_decode: true}
//!            prompt computed ─▶ hand-over kept under a request id ─▶ its answer's
//!            kv_transfer_params {do_remote_prefill: true, remote_host, remote_port,
//!                                remote_request_id, remote_block_ids, remote_engine_id}
//!          decode worker ◀─ those params ─▶ POST remote_host:remote_port/kv/pull {request_id}
//!            the pull is held open for the transfer's time ─▶ admit_transferred ─▶ answer
//!  SGLang  prefill worker ◀─ bootstrap_room R: computes the prompt (one token) ─▶ room R ready
//!          decode worker  ◀─ bootstrap_host, bootstrap_port, R ─▶ POST host:port/kv/pull {room R}
//!            (the prefill worker's bootstrap server) waits until R is ready, held for the
//!            transfer's time ─▶ admit_transferred ─▶ answer (the client's)
//! ```
//!
//! Nothing moves but time: a hand-over is a record on the prefill worker ([`Handoffs`]) that a
//! decode worker takes once, or that is dropped unpulled after a timeout. The decode worker
//! reads, as NIXL's and SGLang's decode sides do: it times the transfer by its own link
//! ([`KvTransfer`]) over the prompt's full blocks that its cache lacks, and the prefill worker
//! holds the pull open that long, so a prefill worker that dies mid-transfer fails it. A failed
//! transfer fails the decode half with a 503 (the decode worker is sound; the request cannot
//! be served here). The transferred blocks are placed in the decode engine's cache and
//! published as Stored events (`Engine::admit_transferred`). On the prefill side the prompt's
//! blocks stay in the prefix cache as a finished request's do: the engine has no hook to pin
//! them until the pull, so memory pressure may evict them first (the pull still succeeds).
//!
//! What a worker of each role takes: `prefill` the prefill halves of both protocols, `decode`
//! the decode halves, `both` vLLM's halves either way (its `kv_both`) and SGLang's bootstrap
//! fields ignored (SGLang's mode `null`); every role serves requests that carry neither whole.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvroute_serve::openai::ErrorBody;
use kvroute_sim::{Finish, KvTransfer, RequestOutput};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// The part a worker plays when prefill and decode are split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Role {
    /// Whole requests, and either half of vLLM's protocol.
    #[default]
    Both,
    /// Computes prompts for decode workers (and serves whole requests).
    Prefill,
    /// Decodes prompts computed by prefill workers (and serves whole requests).
    Decode,
}

impl Role {
    /// As the flag spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "both" => Ok(Role::Both),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(format!("role {other:?}: both, prefill or decode")),
        }
    }
}

/// How a worker takes part in disaggregated serving.
#[derive(Clone, Debug, PartialEq)]
pub struct DisaggOptions {
    /// Its role.
    pub role: Role,
    /// Where its bootstrap server listens (SGLang's protocol; a prefill worker's); none: no
    /// bootstrap server.
    pub bootstrap: Option<SocketAddr>,
    /// The model's KV shape and the link a decode half pulls its prompt's KV over.
    pub transfer: KvTransfer,
    /// How long a prefill worker keeps a computed prompt for its decode worker (then it is
    /// dropped, and a late pull fails), and how long a decode worker's pull waits for a
    /// bootstrap room to be ready.
    pub timeout: Duration,
}

impl Default for DisaggOptions {
    fn default() -> Self {
        DisaggOptions {
            role: Role::Both,
            bootstrap: None,
            transfer: KvTransfer::default(),
            timeout: Duration::from_secs(60),
        }
    }
}

/// Where a decode half pulls its prompt's KV from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Source {
    /// `http://host:port`: the prefill worker's HTTP (vLLM) or its bootstrap server (SGLang).
    base: String,
    /// What names the hand-over there.
    key: HandoffKey,
}

/// Which half of a request a worker is asked to serve, read from its body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Half {
    /// The whole request: no transfer.
    Whole,
    /// vLLM's prefill half: compute the prompt and answer the parameters to pull it by.
    VllmPrefill,
    /// SGLang's prefill half: compute the prompt (one token) and make its room ready.
    SglangPrefill(u64),
    /// Either protocol's decode half: pull the prompt's KV, then decode.
    Decode(Source),
}

impl Half {
    /// What `request` asks of a worker of `role`, or why it is refused.
    pub(crate) fn read(request: &Value, role: Role) -> Result<Half, String> {
        let params = request.get("kv_transfer_params").filter(|p| !p.is_null());
        let flag = |name: &str| params.and_then(|p| p.get(name)) == Some(&Value::Bool(true));
        if flag("do_remote_decode") {
            if role == Role::Decode {
                return Err(
                    "this worker decodes (--role decode): it takes no prefill half \
                            (kv_transfer_params.do_remote_decode)"
                        .to_owned(),
                );
            }
            if request.get("stream") == Some(&Value::Bool(true)) {
                return Err(
                    "a prefill half (kv_transfer_params.do_remote_decode) is answered \
                            whole: set stream to false"
                        .to_owned(),
                );
            }
            return Ok(Half::VllmPrefill);
        }
        if flag("do_remote_prefill") {
            if role == Role::Prefill {
                return Err(
                    "this worker prefills (--role prefill): it takes no decode half \
                            (kv_transfer_params.do_remote_prefill)"
                        .to_owned(),
                );
            }
            let p = params.unwrap_or(&Value::Null);
            let field = |name: &str| {
                p.get(name)
                    .filter(|v| !v.is_null())
                    .ok_or_else(|| format!("kv_transfer_params.do_remote_prefill without {name}"))
            };
            let host = field("remote_host")?
                .as_str()
                .ok_or("kv_transfer_params.remote_host must be a string")?;
            let port = port_of(field("remote_port")?)
                .ok_or("kv_transfer_params.remote_port must be a port number")?;
            let id = field("remote_request_id")?
                .as_str()
                .ok_or("kv_transfer_params.remote_request_id must be a string")?;
            return Ok(Half::Decode(Source {
                base: base_url(host, port),
                key: HandoffKey::Request(id.to_owned()),
            }));
        }
        let Some(room) = request.get("bootstrap_room").filter(|r| !r.is_null()) else {
            return Ok(Half::Whole);
        };
        let room = room
            .as_u64()
            .ok_or("bootstrap_room must be a non-negative integer (one prompt per request)")?;
        match role {
            // SGLang's mode null: the bootstrap fields mean nothing to it.
            Role::Both => Ok(Half::Whole),
            Role::Prefill => Ok(Half::SglangPrefill(room)),
            Role::Decode => {
                let host = request
                    .get("bootstrap_host")
                    .and_then(Value::as_str)
                    .ok_or("bootstrap_room without bootstrap_host (a string)")?;
                let port = request
                    .get("bootstrap_port")
                    .and_then(port_of)
                    .ok_or("bootstrap_room without bootstrap_port (a port number)")?;
                Ok(Half::Decode(Source {
                    base: base_url(host, port),
                    key: HandoffKey::Room(room),
                }))
            }
        }
    }
}

fn port_of(v: &Value) -> Option<u16> {
    match v {
        Value::Number(n) => n.as_u64().and_then(|p| u16::try_from(p).ok()),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

fn base_url(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("http://[{host}]:{port}")
    } else {
        format!("http://{host}:{port}")
    }
}

/// The prompt tokens whose KV a prefill worker hands over: every full block but the one
/// holding the last token (which the decode engine computes, as
/// [`kvroute_sim::Engine::admit_transferred`] places them).
pub(crate) fn handed_tokens(prompt_len: usize, block_size: u32) -> u32 {
    let block = block_size.max(1) as usize;
    let tokens = (prompt_len.saturating_sub(1) / block) * block;
    u32::try_from(tokens).unwrap_or(u32::MAX)
}

/// What names a hand-over on its prefill worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum HandoffKey {
    /// vLLM's `remote_request_id`.
    Request(String),
    /// SGLang's `bootstrap_room`.
    Room(u64),
}

impl std::fmt::Display for HandoffKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandoffKey::Request(id) => write!(f, "request {id}"),
            HandoffKey::Room(room) => write!(f, "bootstrap room {room}"),
        }
    }
}

/// Where a hand-over stands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Stage {
    /// The prompt is being computed (or, for a room a decode worker asked about first, not
    /// yet asked for).
    Computing,
    /// Computed: this many prompt tokens' KV wait to be pulled.
    Ready(u32),
    /// The prefill failed; why.
    Failed(String),
}

struct Slot {
    stage: watch::Sender<Stage>,
    /// When it is dropped unpulled.
    expires: Instant,
}

/// Counts of a worker's transfers, both sides.
#[derive(Debug, Default)]
struct Counts {
    /// Prompts computed for a decode worker (prefill side).
    prefilled: AtomicU64,
    /// Transfers sent to the end (prefill side).
    sent: AtomicU64,
    /// Transfers whose puller went away before their end (prefill side).
    cut: AtomicU64,
    /// Hand-overs dropped unpulled after the timeout (prefill side).
    expired: AtomicU64,
    /// Prompt tokens sent (prefill side).
    sent_tokens: AtomicU64,
    /// Transfers received (decode side).
    received: AtomicU64,
    /// Transfers that failed (decode side).
    failed: AtomicU64,
    /// Prompt tokens whose KV came over the link (decode side: the handed-over tokens its
    /// cache lacked).
    received_tokens: AtomicU64,
}

/// The hand-overs a prefill worker keeps for decode workers to pull, and both sides' counts.
pub(crate) struct Handoffs {
    slots: Mutex<HashMap<HandoffKey, Slot>>,
    timeout: Duration,
    next_request: AtomicU64,
    next_block: AtomicU64,
    /// Pulls being held open now.
    active: AtomicU64,
    counts: Counts,
}

impl std::fmt::Debug for Handoffs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoffs")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Why a pull failed on the prefill worker.
#[derive(Debug, PartialEq, Eq)]
enum PullError {
    /// No such hand-over: never made, pulled already, or dropped after the timeout.
    Unknown,
    /// The room was not ready in time.
    NotReady,
    /// The prefill failed.
    Failed(String),
}

impl Handoffs {
    pub(crate) fn new(timeout: Duration) -> Self {
        Handoffs {
            slots: Mutex::new(HashMap::new()),
            timeout,
            next_request: AtomicU64::new(0),
            next_block: AtomicU64::new(0),
            active: AtomicU64::new(0),
            counts: Counts::default(),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<HandoffKey, Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new vLLM `remote_request_id` for a prefill half on the worker named `engine`.
    pub(crate) fn new_request_key(&self, engine: &str) -> HandoffKey {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        HandoffKey::Request(format!("{engine}-xfer-{n}"))
    }

    /// Ids for `n` blocks of a hand-over (vLLM's `remote_block_ids`): this worker's numbering.
    fn block_ids(&self, n: u32) -> Vec<u64> {
        let first = self.next_block.fetch_add(u64::from(n), Ordering::Relaxed);
        (first..first + u64::from(n)).collect()
    }

    /// Sets `key`'s stage, making the slot if there is none (and dropping expired ones).
    fn set(&self, key: &HandoffKey, stage: Stage) {
        let now = Instant::now();
        let mut slots = self.slots();
        self.sweep(&mut slots, now);
        let slot = slots.entry(key.clone()).or_insert_with(|| Slot {
            stage: watch::channel(Stage::Computing).0,
            expires: now + self.timeout,
        });
        // The hold starts once the prompt is computed.
        slot.expires = now + self.timeout;
        slot.stage.send_replace(stage);
    }

    /// Drops the slots past their time, counting the unpulled ones.
    fn sweep(&self, slots: &mut HashMap<HandoffKey, Slot>, now: Instant) {
        slots.retain(|_, slot| {
            let keep = slot.expires > now;
            if !keep && matches!(*slot.stage.borrow(), Stage::Ready(_)) {
                self.counts.expired.fetch_add(1, Ordering::Relaxed);
            }
            keep
        });
    }

    /// A prefill half has begun under `key`.
    fn computing(&self, key: &HandoffKey) {
        self.set(key, Stage::Computing);
    }

    /// The prompt of `key` is computed: `tokens` of its KV wait to be pulled.
    fn ready(&self, key: &HandoffKey, tokens: u32) {
        self.counts.prefilled.fetch_add(1, Ordering::Relaxed);
        self.set(key, Stage::Ready(tokens));
    }

    /// The prefill half of `key` failed: a pull waiting on it fails at once.
    fn failed(&self, key: &HandoffKey, why: &str) {
        self.set(key, Stage::Failed(why.to_owned()));
    }

    /// Every hand-over fails (the engine restarted or the worker stops): waiting pulls are
    /// answered at once.
    pub(crate) fn fail_all(&self, why: &str) {
        let mut slots = self.slots();
        for (_, slot) in slots.drain() {
            slot.stage.send_replace(Stage::Failed(why.to_owned()));
        }
    }

    /// Takes the hand-over `key` once its prompt is computed, waiting at most `wait` for it
    /// (none: it must exist already, as a vLLM pull's does).
    async fn take(&self, key: &HandoffKey, wait: Option<Duration>) -> Result<u32, PullError> {
        let mut stage = {
            let now = Instant::now();
            let mut slots = self.slots();
            self.sweep(&mut slots, now);
            match (slots.get(key), wait) {
                (Some(slot), _) => slot.stage.subscribe(),
                (None, None) => return Err(PullError::Unknown),
                (None, Some(_)) => {
                    // A decode worker asking before the prefill worker heard of the room.
                    let (tx, rx) = watch::channel(Stage::Computing);
                    slots.insert(
                        key.clone(),
                        Slot {
                            stage: tx,
                            expires: now + self.timeout,
                        },
                    );
                    rx
                }
            }
        };
        let wait = wait.unwrap_or(self.timeout);
        let settled = tokio::time::timeout(wait, stage.wait_for(|s| *s != Stage::Computing)).await;
        let outcome = match settled {
            Ok(Ok(s)) => match &*s {
                Stage::Ready(tokens) => Ok(*tokens),
                Stage::Failed(why) => Err(PullError::Failed(why.clone())),
                Stage::Computing => Err(PullError::NotReady),
            },
            // Dropped meanwhile: expired or failed by a restart.
            Ok(Err(_)) => Err(PullError::Unknown),
            Err(_) => Err(PullError::NotReady),
        };
        // Taken once; one that failed or was not ready in time is given up.
        self.slots().remove(key);
        outcome
    }

    /// The counts, and the hand-overs computing and waiting to be pulled now, as
    /// `/admin/stats` shows them.
    pub(crate) fn stats(&self) -> Value {
        let (computing, waiting) = {
            let mut slots = self.slots();
            self.sweep(&mut slots, Instant::now());
            slots
                .values()
                .fold((0, 0), |(c, w), slot| match *slot.stage.borrow() {
                    Stage::Computing => (c + 1, w),
                    Stage::Ready(_) => (c, w + 1),
                    Stage::Failed(_) => (c, w),
                })
        };
        let c = &self.counts;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "computing": computing,
            "waiting": waiting,
            "active": n(&self.active),
            "prefilled": n(&c.prefilled),
            "sent": n(&c.sent),
            "sent_tokens": n(&c.sent_tokens),
            "cut": n(&c.cut),
            "expired": n(&c.expired),
            "received": n(&c.received),
            "received_tokens": n(&c.received_tokens),
            "failed": n(&c.failed),
        })
    }
}

/// A prefill half's hand-over, from its admission until its outputs are watched. Dropped
/// before that (the request refused, the engine stopped), the hand-over fails, so a decode
/// worker waiting on it hears at once.
pub(crate) struct Handoff {
    handoffs: Arc<Handoffs>,
    key: HandoffKey,
    /// The prompt tokens handed over.
    tokens: u32,
    watched: bool,
}

impl Handoff {
    /// A prefill half begins under `key`, to hand over `tokens` prompt tokens' KV.
    pub(crate) fn begin(handoffs: &Arc<Handoffs>, key: HandoffKey, tokens: u32) -> Self {
        handoffs.computing(&key);
        Handoff {
            handoffs: Arc::clone(handoffs),
            key,
            tokens,
            watched: false,
        }
    }

    /// vLLM's `kv_transfer_params` answering this prefill half, for a decode worker to pull
    /// it from `host:port` (none for an SGLang room, which needs no answer).
    pub(crate) fn vllm_params(
        &self,
        engine: &str,
        host: &str,
        port: u16,
        block: u32,
    ) -> Option<Value> {
        let HandoffKey::Request(id) = &self.key else {
            return None;
        };
        Some(json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": engine,
            "remote_block_ids": self.handoffs.block_ids(self.tokens / block.max(1)),
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": id,
            "tp_size": 1,
        }))
    }

    /// Watches the prefill's outputs on their way to its answer: once the prompt is computed
    /// (the first token), the hand-over is ready; an abort before that fails it. It is
    /// settled whatever the answer's reader does.
    pub(crate) fn watch(
        mut self,
        mut outputs: mpsc::UnboundedReceiver<RequestOutput>,
    ) -> mpsc::UnboundedReceiver<RequestOutput> {
        self.watched = true;
        let (handoffs, key, tokens) = (Arc::clone(&self.handoffs), self.key.clone(), self.tokens);
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut settled = false;
            while let Some(output) = outputs.recv().await {
                if !settled {
                    if output.first_token_at.is_some() && output.finish != Some(Finish::Aborted) {
                        handoffs.ready(&key, tokens);
                        settled = true;
                    } else if output.finish.is_some() {
                        handoffs.failed(&key, "the prefill was aborted");
                        settled = true;
                    }
                }
                // The answer's reader may have left; the engine is told by its abort guard.
                let _ = tx.send(output);
            }
            if !settled {
                handoffs.failed(&key, "the prefill engine stopped");
            }
        });
        rx
    }
}

impl Drop for Handoff {
    fn drop(&mut self) {
        if !self.watched {
            self.handoffs
                .failed(&self.key, "the prefill half was not admitted");
        }
    }
}

/// A decode worker's pull, as `POST /kv/pull` takes it.
#[derive(Debug, Serialize, Deserialize)]
struct Pull {
    /// vLLM's `remote_request_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    request_id: Option<String>,
    /// SGLang's `bootstrap_room`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    room: Option<u64>,
    /// How long the transfer takes by the decode worker's link, in microseconds: the pull
    /// is held open that long.
    hold_us: u64,
}

/// What a pull answers.
#[derive(Debug, Serialize, Deserialize)]
struct Pulled {
    /// The prompt tokens whose KV was handed over.
    tokens: u32,
}

/// Counts a held pull; one dropped before its end (its puller left or broke) is cut.
struct Holding<'a> {
    handoffs: &'a Handoffs,
    done: bool,
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        self.handoffs.active.fetch_sub(1, Ordering::Relaxed);
        if !self.done {
            self.handoffs.counts.cut.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(ErrorBody::new(status.as_u16(), message))).into_response()
}

/// `POST /kv/pull`, on a worker's HTTP (vLLM's pulls) and its bootstrap server (SGLang's):
/// takes the hand-over (a room's waits until it is ready, at most the timeout) and answers
/// once the transfer's time has passed.
pub(crate) async fn pull(State(handoffs): State<Arc<Handoffs>>, body: Bytes) -> Response {
    let pull: Pull = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("malformed pull: {e}")),
    };
    let (key, wait) = match (pull.request_id, pull.room) {
        (Some(id), None) => (HandoffKey::Request(id), None),
        (None, Some(room)) => (HandoffKey::Room(room), Some(handoffs.timeout)),
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "a pull names one request_id or one room",
            )
        }
    };
    let tokens = match handoffs.take(&key, wait).await {
        Ok(tokens) => tokens,
        Err(PullError::Unknown) => {
            return error(
                StatusCode::NOT_FOUND,
                format!("no hand-over of {key} here (never made, pulled, or past its time)"),
            )
        }
        Err(PullError::NotReady) => {
            return error(
                StatusCode::GATEWAY_TIMEOUT,
                format!("{key} was not prefilled within {:?}", handoffs.timeout),
            )
        }
        Err(PullError::Failed(why)) => {
            return error(StatusCode::CONFLICT, format!("{key}: {why}"));
        }
    };
    handoffs.active.fetch_add(1, Ordering::Relaxed);
    let mut holding = Holding {
        handoffs: &handoffs,
        done: false,
    };
    let hold = Duration::from_micros(pull.hold_us).min(handoffs.timeout);
    tokio::time::sleep(hold).await;
    holding.done = true;
    drop(holding);
    let c = &handoffs.counts;
    c.sent.fetch_add(1, Ordering::Relaxed);
    c.sent_tokens
        .fetch_add(u64::from(tokens), Ordering::Relaxed);
    Json(Pulled { tokens }).into_response()
}

/// The decode side of a transfer: pulls `source`'s hand-over of `expected` prompt tokens,
/// `missing` of them not in this worker's cache, timed by `transfer`. Runs to its end
/// whatever the caller does (the prefill worker frees its blocks once the transfer ends).
pub(crate) async fn receive(
    client: reqwest::Client,
    handoffs: Arc<Handoffs>,
    source: Source,
    transfer: KvTransfer,
    expected: u32,
    missing: u32,
) -> Result<(), String> {
    let hold = transfer.duration(u64::from(missing));
    let (request_id, room) = match source.key {
        HandoffKey::Request(id) => (Some(id), None),
        HandoffKey::Room(room) => (None, Some(room)),
    };
    let pull = Pull {
        request_id,
        room,
        hold_us: u64::try_from(hold.as_micros()).unwrap_or(u64::MAX),
    };
    let url = format!("{}/kv/pull", source.base);
    let task = tokio::spawn(async move {
        let result = pull_from(&client, &url, &pull, handoffs.timeout + hold, expected).await;
        let c = &handoffs.counts;
        match &result {
            Ok(()) => {
                c.received.fetch_add(1, Ordering::Relaxed);
                c.received_tokens
                    .fetch_add(u64::from(missing), Ordering::Relaxed);
            }
            Err(_) => {
                c.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    });
    match task.await {
        Ok(result) => result,
        Err(e) => Err(format!("the transfer task failed: {e}")),
    }
}

/// One pull over HTTP, answered within `within` (plus a margin): the hand-over's tokens
/// must be `expected`.
async fn pull_from(
    client: &reqwest::Client,
    url: &str,
    pull: &Pull,
    within: Duration,
    expected: u32,
) -> Result<(), String> {
    let response = client
        .post(url)
        .timeout(within + Duration::from_secs(5))
        .json(pull)
        .send()
        .await
        .map_err(|e| format!("pulling from {url}: {e}"))?;
    let status = response.status();
    if !status.is_success() {
        let why = response
            .json::<Value>()
            .await
            .ok()
            .and_then(|v| v.pointer("/error/message")?.as_str().map(str::to_owned))
            .unwrap_or_default();
        return Err(format!("{url} answered {status}: {why}"));
    }
    let pulled: Pulled = response
        .json()
        .await
        .map_err(|e| format!("pulling from {url}: {e}"))?;
    if pulled.tokens != expected {
        return Err(format!(
            "{url} handed over {} prompt tokens of KV, this worker expected {expected} \
             (do both workers have the same --block-size?)",
            pulled.tokens
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: Value, role: Role) -> Result<Half, String> {
        Half::read(&body, role)
    }

    #[test]
    fn each_role_takes_its_halves_of_each_protocol() {
        let prefill = json!({"kv_transfer_params": {"do_remote_decode": true,
            "do_remote_prefill": false, "remote_host": null}});
        assert_eq!(read(prefill.clone(), Role::Prefill), Ok(Half::VllmPrefill));
        assert_eq!(read(prefill.clone(), Role::Both), Ok(Half::VllmPrefill));
        assert!(read(prefill, Role::Decode)
            .unwrap_err()
            .contains("--role decode"));
        let decode = json!({"kv_transfer_params": {"do_remote_prefill": true,
            "do_remote_decode": false, "remote_host": "10.0.0.5", "remote_port": 8000,
            "remote_request_id": "p-1", "remote_block_ids": [1, 2]}});
        let pulled = Half::Decode(Source {
            base: "http://10.0.0.5:8000".to_owned(),
            key: HandoffKey::Request("p-1".to_owned()),
        });
        assert_eq!(read(decode.clone(), Role::Decode), Ok(pulled.clone()));
        assert_eq!(read(decode.clone(), Role::Both), Ok(pulled));
        assert!(read(decode, Role::Prefill)
            .unwrap_err()
            .contains("--role prefill"));
        let sglang = json!({"bootstrap_host": "::1", "bootstrap_port": 8998, "bootstrap_room": 7});
        assert_eq!(
            read(sglang.clone(), Role::Prefill),
            Ok(Half::SglangPrefill(7))
        );
        assert_eq!(
            read(sglang.clone(), Role::Decode),
            Ok(Half::Decode(Source {
                base: "http://[::1]:8998".to_owned(),
                key: HandoffKey::Room(7),
            }))
        );
        // SGLang's mode null: the bootstrap fields mean nothing to a worker of both roles.
        assert_eq!(read(sglang, Role::Both), Ok(Half::Whole));
        // Neither protocol's fields, or vLLM's asking for neither: whole.
        for role in [Role::Both, Role::Prefill, Role::Decode] {
            assert_eq!(read(json!({"prompt": [1]}), role), Ok(Half::Whole));
            let neither = json!({"kv_transfer_params": {"do_remote_decode": false}});
            assert_eq!(read(neither, role), Ok(Half::Whole));
        }
    }

    #[test]
    fn incomplete_transfer_fields_are_refused_with_the_field_named() {
        let no_port = json!({"kv_transfer_params": {"do_remote_prefill": true,
            "remote_host": "h", "remote_request_id": "r"}});
        assert!(read(no_port, Role::Decode)
            .unwrap_err()
            .contains("remote_port"));
        let no_host = json!({"bootstrap_port": 1, "bootstrap_room": 2});
        assert!(read(no_host, Role::Decode)
            .unwrap_err()
            .contains("bootstrap_host"));
        let streamed = json!({"stream": true, "kv_transfer_params": {"do_remote_decode": true}});
        assert!(read(streamed, Role::Prefill)
            .unwrap_err()
            .contains("stream"));
        for role in ["both", "prefill", "decode"] {
            assert_eq!(role.parse::<Role>().unwrap().as_str(), role);
        }
        assert!("mixed".parse::<Role>().is_err());
    }

    #[test]
    fn a_prompt_hands_over_every_full_block_but_the_last_tokens() {
        assert_eq!(handed_tokens(552, 16), 544);
        assert_eq!(handed_tokens(545, 16), 544);
        assert_eq!(handed_tokens(544, 16), 528);
        assert_eq!(handed_tokens(16, 16), 0);
        assert_eq!(handed_tokens(0, 16), 0);
    }

    #[tokio::test]
    async fn a_room_asked_before_its_prefill_waits_until_it_is_ready_and_is_taken_once() {
        let h = Arc::new(Handoffs::new(Duration::from_secs(5)));
        let room = HandoffKey::Room(9);
        let early = {
            let h = Arc::clone(&h);
            let room = room.clone();
            tokio::spawn(async move { h.take(&room, Some(Duration::from_secs(5))).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        h.computing(&room);
        h.ready(&room, 544);
        assert_eq!(early.await.unwrap(), Ok(544));
        assert_eq!(h.take(&room, None).await, Err(PullError::Unknown));
        // A failed prefill answers its waiting pull at once.
        let failing = HandoffKey::Room(10);
        h.computing(&failing);
        h.failed(&failing, "the prefill was aborted");
        assert_eq!(
            h.take(&failing, Some(Duration::from_secs(5))).await,
            Err(PullError::Failed("the prefill was aborted".to_owned()))
        );
        // A room never prefilled: not ready in time, and given up.
        let never = HandoffKey::Room(11);
        assert_eq!(
            h.take(&never, Some(Duration::from_millis(30))).await,
            Err(PullError::NotReady)
        );
        assert_eq!(h.stats()["computing"], 0);
        // A vLLM pull of a request id never handed over does not wait.
        let unknown = HandoffKey::Request("nobody".to_owned());
        assert_eq!(h.take(&unknown, None).await, Err(PullError::Unknown));
    }

    #[tokio::test]
    async fn an_unpulled_hand_over_is_dropped_after_the_timeout() {
        let h = Handoffs::new(Duration::from_millis(30));
        let key = h.new_request_key("w");
        h.computing(&key);
        h.ready(&key, 32);
        assert_eq!(h.stats()["waiting"], 1);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(h.stats()["waiting"], 0);
        assert_eq!(h.stats()["expired"], 1);
        assert_eq!(h.take(&key, None).await, Err(PullError::Unknown));
        // A restart fails every hand-over.
        let other = h.new_request_key("w");
        h.ready(&other, 32);
        h.fail_all("the engine restarted");
        assert_eq!(h.take(&other, None).await, Err(PullError::Unknown));
    }
}
