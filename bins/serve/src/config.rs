//! `kvroute serve`'s configuration file (TOML), which flags and `KVROUTE_*` variables
//! override. An example with every key: `kvroute.example.toml` at the repository's root.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use super::backends::BackendSpec;
use super::ServeOptions;
use kvroute_core::{Policy, PolicyKind, UnknownPolicy};

/// The file's keys; every one optional.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeFile {
    /// Where HTTP listens.
    pub listen: Option<SocketAddr>,
    /// The model served (requests naming another get a 404).
    pub model: Option<String>,
    /// LoRA adapters the engines serve, by the names requests give as `model`.
    pub lora_adapters: Option<Vec<String>>,
    /// The key clients must send.
    pub api_key: Option<String>,
    /// The key the admin routes need (workers, bookings, metrics); distinct from `api_key`.
    pub admin_key: Option<String>,
    /// `/metrics` answers without a key.
    pub public_metrics: Option<bool>,
    /// Further workers tried when one fails before answering.
    pub retries: Option<u32>,
    /// The routing policy, by the demo's names (`kv-aware`, `round-robin`, ...).
    pub policy: Option<String>,
    /// Tokens per KV block (the engines').
    pub block_size: Option<u32>,
    /// The KV-aware cost's credit per cached block.
    pub overlap_credit: Option<f64>,
    /// The KV-aware cost's weight of prefill blocks.
    pub prefill_load_scale: Option<f64>,
    /// How much more credit per cached block a rank holding the whole prompt earns (0: off).
    pub affinity_boost: Option<f64>,
    /// The share of the prompt held past which a rank's credit grows.
    pub affinity_from_share: Option<f64>,
    /// Softmax temperature of the KV-aware choice (0: the cheapest).
    pub temperature: Option<f64>,
    /// Seconds a KV-event replay may take.
    pub replay_timeout_s: Option<f64>,
    /// Seconds a removed worker's requests may take to end.
    pub drain_timeout_s: Option<f64>,
    /// Seconds after which a booking is freed though nothing ended it (a `/v1/route` booking
    /// nobody freed; a request that outlived it).
    pub request_expiry_s: Option<f64>,
    /// Largest request body, in bytes.
    pub max_body_bytes: Option<usize>,
    /// Seconds a request's body may take to arrive whole.
    pub body_timeout_s: Option<f64>,
    /// Seconds a connection may wait for a request's head (also the idle timeout).
    pub header_timeout_s: Option<f64>,
    /// Most client connections open at once.
    pub max_connections: Option<usize>,
    /// Seconds a connection to an engine may take to open.
    pub connect_timeout_s: Option<f64>,
    /// Seconds an engine may take to start its answer before the request goes elsewhere.
    pub first_byte_timeout_s: Option<f64>,
    /// Failures in a row that mark an engine down.
    pub breaker_failures: Option<u32>,
    /// Most KV blocks a worker's rank may declare.
    pub max_kv_blocks: Option<u64>,
    /// The longest prompt the engines take, in tokens.
    pub max_model_len: Option<u64>,
    /// Address ranges worker URLs and event endpoints must lie in.
    pub worker_networks: Option<Vec<crate::Network>>,
    /// The directory of the model's `tokenizer.json` and `tokenizer_config.json`.
    pub tokenizer: Option<std::path::PathBuf>,
    /// A worker is busy past this fraction of its KV blocks held by active requests.
    pub busy_decode_fraction: Option<f64>,
    /// A worker is busy past this fraction of its batch's tokens waiting for prefill.
    pub busy_prefill_fraction: Option<f64>,
    /// With a busy threshold: requests wait in the router's admission queue while every worker
    /// is busy, up to this many prompt tokens queued; past it they get a 429 with
    /// `Retry-After`.
    pub queue_max_tokens: Option<u64>,
    /// Seconds each routing decision counts as cached on its worker, until the worker's own KV
    /// events arrive (speculative records; 0 or absent: off).
    pub speculative_s: Option<f64>,
    /// Tokenize every text prompt and chat whole, instead of only as far as some worker may
    /// hold it (the default; see `tokenize_whole` in [`ServeOptions`]).
    pub tokenize_whole: Option<bool>,
    /// The engines.
    #[serde(default)]
    pub workers: Vec<BackendSpec>,
}

/// The file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// It could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// It is not valid TOML for this file.
    #[error("{path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// Where and why.
        source: Box<toml::de::Error>,
    },
    /// A value cannot be used.
    #[error("{0}")]
    Invalid(String),
}

impl ServeFile {
    /// Reads and parses `path`.
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.display().to_string(),
            source: Box::new(source),
        })
    }

    /// Lays the file's values over `options`.
    pub fn apply(self, mut options: ServeOptions) -> Result<ServeOptions, ConfigError> {
        let secs = |name: &str, s: f64| {
            if s.is_finite() && s >= 0.0 {
                Ok(Duration::from_secs_f64(s))
            } else {
                Err(ConfigError::Invalid(format!("{name} must be ≥ 0 seconds")))
            }
        };
        if let Some(v) = self.listen {
            options.listen = v;
        }
        if self.model.is_some() {
            options.model = self.model;
        }
        if self.api_key.is_some() {
            options.api_key = self.api_key;
        }
        if self.admin_key.is_some() {
            options.admin_key = self.admin_key;
        }
        if let Some(v) = self.public_metrics {
            options.public_metrics = v;
        }
        if let Some(adapters) = self.lora_adapters {
            if adapters.iter().any(|a| a.is_empty()) {
                return Err(ConfigError::Invalid(
                    "a LoRA adapter's name is empty".to_owned(),
                ));
            }
            options.lora_adapters = adapters;
        }
        if let Some(v) = self.retries {
            options.retries = v;
        }
        if let Some(v) = self.tokenize_whole {
            options.tokenize_whole = v;
        }
        if let Some(v) = self.block_size {
            options.router.block_size = v;
        }
        if let Some(name) = self.policy {
            let kind: PolicyKind = name
                .parse()
                .map_err(|e: UnknownPolicy| ConfigError::Invalid(e.to_string()))?;
            options.router.policy = Policy::with_defaults(kind, options.router.block_size);
        }
        if let Some(v) = self.overlap_credit {
            options.router.overlap_credit = v;
        }
        if let Some(v) = self.prefill_load_scale {
            options.router.prefill_load_scale = v;
        }
        if let Some(v) = self.affinity_boost {
            options.router.affinity.boost = v;
        }
        if let Some(v) = self.affinity_from_share {
            options.router.affinity.from_share = v;
        }
        if let Some(v) = self.temperature {
            options.router.temperature = v;
        }
        if let Some(v) = self.replay_timeout_s {
            options.replay_timeout = secs("replay_timeout_s", v)?;
        }
        if let Some(v) = self.request_expiry_s {
            options.router.request_expiry = secs("request_expiry_s", v)?;
        }
        if let Some(v) = self.drain_timeout_s {
            options.drain_timeout = secs("drain_timeout_s", v)?;
        }
        if let Some(v) = self.max_body_bytes {
            options.max_body = v;
        }
        if let Some(v) = self.body_timeout_s {
            options.body_timeout = secs("body_timeout_s", v)?;
        }
        if let Some(v) = self.header_timeout_s {
            options.header_timeout = secs("header_timeout_s", v)?;
        }
        if let Some(v) = self.max_connections {
            if v == 0 {
                return Err(ConfigError::Invalid(
                    "max_connections must be ≥ 1".to_owned(),
                ));
            }
            options.max_connections = v;
        }
        if let Some(v) = self.connect_timeout_s {
            options.connect_timeout = secs("connect_timeout_s", v)?;
        }
        if let Some(v) = self.first_byte_timeout_s {
            options.first_byte_timeout = secs("first_byte_timeout_s", v)?;
        }
        if let Some(v) = self.breaker_failures {
            if v == 0 {
                return Err(ConfigError::Invalid(
                    "breaker_failures must be ≥ 1".to_owned(),
                ));
            }
            options.breaker_failures = v;
        }
        if let Some(v) = self.max_model_len {
            if v == 0 {
                return Err(ConfigError::Invalid("max_model_len must be ≥ 1".to_owned()));
            }
            options.max_model_len = Some(v);
        }
        if let Some(v) = self.max_kv_blocks {
            if v == 0 {
                return Err(ConfigError::Invalid("max_kv_blocks must be ≥ 1".to_owned()));
            }
            options.max_kv_blocks = v;
        }
        if let Some(v) = self.worker_networks {
            options.worker_networks = v;
        }
        if self.tokenizer.is_some() {
            options.tokenizer = self.tokenizer;
        }
        if self.busy_decode_fraction.is_some() {
            options.router.busy.decode_blocks_fraction = self.busy_decode_fraction;
        }
        if self.busy_prefill_fraction.is_some() {
            options.router.busy.prefill_tokens_fraction = self.busy_prefill_fraction;
        }
        if let Some(cap) = self.queue_max_tokens {
            options.router.queue = kvroute_core::Queueing::On {
                max_queued_tokens: cap,
                order: kvroute_core::QueueOrder::Fcfs,
            };
        }
        if let Some(v) = self.speculative_s {
            let ttl = secs("speculative_s", v)?;
            options.router.approximate.speculative = if ttl.is_zero() {
                kvroute_core::Speculative::Off
            } else {
                kvroute_core::Speculative::On { ttl }
            };
        }
        options.workers.extend(self.workers);
        options
            .router
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(options)
    }
}

/// Reads a worker from a flag: `key=value` pairs separated by commas, `url` required
/// (`url=http://10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,kv_blocks=24576`).
/// Keys: `url`, `events`, `replay`, `topic`, `dp_size`, `kv_blocks`, `block_size`, `api_key`,
/// `id` (default: its position among the workers).
pub fn parse_worker_flag(flag: &str, position: u64) -> Result<BackendSpec, ConfigError> {
    let mut spec = BackendSpec {
        id: position,
        url: String::new(),
        kv_events: None,
        kv_replay: None,
        topic: String::new(),
        dp_size: 1,
        kv_blocks: 24_576,
        block_size: 16,
        api_key: None,
        labels: Default::default(),
    };
    let number = |key: &str, value: &str| {
        value
            .parse::<u64>()
            .map_err(|_| ConfigError::Invalid(format!("worker {key}={value:?}: not a number")))
    };
    for pair in flag.split(',').filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| ConfigError::Invalid(format!("worker: {pair:?} is not key=value")))?;
        match key {
            "url" => spec.url = value.to_owned(),
            "events" => spec.kv_events = Some(value.to_owned()),
            "replay" => spec.kv_replay = Some(value.to_owned()),
            "topic" => spec.topic = value.to_owned(),
            "dp_size" => spec.dp_size = number(key, value)? as u32,
            "kv_blocks" => spec.kv_blocks = number(key, value)?,
            "block_size" => spec.block_size = number(key, value)? as u32,
            "api_key" => spec.api_key = Some(value.to_owned()),
            "id" => spec.id = number(key, value)?,
            other => {
                return Err(ConfigError::Invalid(format!(
                    "worker: unknown key {other:?}"
                )))
            }
        }
    }
    if spec.url.is_empty() {
        return Err(ConfigError::Invalid(format!("worker {flag:?}: no url=")));
    }
    Ok(spec)
}
