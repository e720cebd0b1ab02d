//! `kvroute serve`'s configuration: one set of keys, named alike in the TOML file
//! (`max_kv_blocks`), the environment (`KVROUTE_MAX_KV_BLOCKS`) and the flags
//! (`--max-kv-blocks`), laid in that order (a flag wins over its variable, which wins over the
//! file), and checked once ([`ServeConfig::apply`]). `kvroute serve --print-config` prints
//! the result ([`ServeConfig::effective`]). An example with every key: `kvroute.example.toml`
//! at the repository's root.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::builder::BoolishValueParser;
use serde::{Deserialize, Serialize};

use super::backends::BackendSpec;
use super::networks::Network;
use super::ServeOptions;
use crate::disagg::Conditional;
use kvroute_core::{Disaggregation, Policy, PolicyKind, Queueing, Speculative, UnknownPolicy};

/// Every key of `kvroute serve`'s configuration, each optional: a key left out keeps the
/// default (`--print-config` shows them all).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Address and port HTTP listens on.
    #[arg(long, env = "KVROUTE_LISTEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// The model served: requests naming another get a 404.
    #[arg(long, env = "KVROUTE_MODEL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// LoRA adapters the engines serve (vLLM's `--lora-modules` names), comma-separated: a
    /// request naming one as its model is routed by the adapter's KV blocks.
    #[arg(
        long,
        alias = "lora-adapter",
        value_name = "NAMES",
        value_delimiter = ',',
        env = "KVROUTE_LORA_ADAPTERS"
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora_adapters: Option<Vec<String>>,
    /// The key clients send as `Authorization: Bearer KEY` (never forwarded to engines).
    #[arg(long, env = "KVROUTE_API_KEY", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// The key the admin routes need (`/v1/workers`, bookings, `/metrics`), distinct from
    /// the client key. With a client key and no admin key, the admin routes are closed.
    #[arg(long, env = "KVROUTE_ADMIN_KEY", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_key: Option<String>,
    /// `/metrics` answers without a key.
    #[arg(long, env = "KVROUTE_PUBLIC_METRICS", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub public_metrics: Option<bool>,
    /// Further engines tried when one refuses the connection, fails with a 5xx before
    /// answering, or sends nothing within `first_byte_timeout_s`.
    #[arg(long, env = "KVROUTE_RETRIES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retries: Option<u32>,
    /// The routing policy: kv-aware, cache-threshold, prefix-hash, least-loaded,
    /// power-of-two, round-robin, random.
    #[arg(long, env = "KVROUTE_POLICY")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// Tokens per KV block (the engines' `--block-size`).
    #[arg(long, env = "KVROUTE_BLOCK_SIZE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// The KV-aware cost's credit per cached block.
    #[arg(long, env = "KVROUTE_OVERLAP_CREDIT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlap_credit: Option<f64>,
    /// The KV-aware cost's weight of prefill blocks (higher favours cache hits over balance).
    #[arg(long, env = "KVROUTE_PREFILL_LOAD_SCALE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_load_scale: Option<f64>,
    /// How much more credit per cached block a rank holding the whole prompt earns (0: off).
    #[arg(long, env = "KVROUTE_AFFINITY_BOOST")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_boost: Option<f64>,
    /// The share of the prompt held past which a rank's credit grows, in [0, 1).
    #[arg(long, env = "KVROUTE_AFFINITY_FROM_SHARE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_from_share: Option<f64>,
    /// A worker whose context (its requests' prompt and output blocks) runs past this many
    /// times the fleet's mean pays for each block beyond (0: off).
    #[arg(long, env = "KVROUTE_HOT_LOAD_SHARE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hot_load_share: Option<f64>,
    /// What each block of context past that costs, in blocks of decode load.
    #[arg(long, env = "KVROUTE_HOT_LOAD_WEIGHT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hot_load_weight: Option<f64>,
    /// Softmax temperature of the KV-aware choice (0: the cheapest).
    #[arg(long, env = "KVROUTE_TEMPERATURE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// The KV-aware choice is drawn among the workers whose cost is within this share of the
    /// cheapest's, so that replicas routing at once spread their choices (default: 0 alone,
    /// 0.05 with `nats`).
    #[arg(long, value_name = "SHARE", env = "KVROUTE_NEAR_TIE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub near_tie: Option<f64>,
    /// Seconds a KV-event replay may take before its gap counts as lost.
    #[arg(long, env = "KVROUTE_REPLAY_TIMEOUT_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay_timeout_s: Option<f64>,
    /// Seconds a removed worker's requests may take to end before it leaves anyway.
    #[arg(long, env = "KVROUTE_DRAIN_TIMEOUT_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drain_timeout_s: Option<f64>,
    /// Seconds requests in flight may take to finish after SIGTERM or SIGINT.
    #[arg(long, env = "KVROUTE_GRACE_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grace_s: Option<f64>,
    /// Seconds after which a booking nothing ended is freed (a `/v1/route` booking nobody
    /// freed, a request that outlived it).
    #[arg(long, env = "KVROUTE_REQUEST_EXPIRY_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_expiry_s: Option<f64>,
    /// Largest request body, in bytes (larger: 413).
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<usize>,
    /// Seconds a request's body may take to arrive whole (slower: 408).
    #[arg(long, env = "KVROUTE_BODY_TIMEOUT_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_timeout_s: Option<f64>,
    /// Seconds a connection may wait for a request's head, its first or its next on a
    /// kept-alive connection (so also the idle timeout); then it is closed.
    #[arg(long, env = "KVROUTE_HEADER_TIMEOUT_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header_timeout_s: Option<f64>,
    /// Most client connections open at once; more are closed at once (counted).
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Seconds a connection to an engine may take to open.
    #[arg(long, env = "KVROUTE_CONNECT_TIMEOUT_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connect_timeout_s: Option<f64>,
    /// Seconds an engine may take to start its answer (a stream's first token, a whole
    /// answer's end) before the request goes to the next best engine.
    #[arg(long, env = "KVROUTE_FIRST_BYTE_TIMEOUT_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_byte_timeout_s: Option<f64>,
    /// Failures in a row (5xx, no answer in time) that mark an engine down until it answers
    /// the prober again; one bad request never does.
    #[arg(long, env = "KVROUTE_BREAKER_FAILURES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker_failures: Option<u32>,
    /// Most KV blocks a worker may declare over its ranks, `kv_blocks × dp_size` (the index
    /// reserves about 20 bytes a block).
    #[arg(long, env = "KVROUTE_MAX_KV_BLOCKS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_kv_blocks: Option<u64>,
    /// The longest prompt the engines take, in tokens (vLLM's `--max-model-len`); a longer
    /// one gets a 400. Default: the tokenizer config's `model_max_length`.
    #[arg(long, env = "KVROUTE_MAX_MODEL_LEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u64>,
    /// Address ranges (`10.0.0.0/8`, `127.0.0.1`) worker URLs and event endpoints must lie
    /// in, comma-separated (default: anywhere).
    #[arg(
        long,
        value_name = "CIDRS",
        value_delimiter = ',',
        env = "KVROUTE_WORKER_NETWORKS"
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_networks: Option<Vec<Network>>,
    /// The directory of the model's `tokenizer.json` and `tokenizer_config.json`: needed to
    /// route chats and text prompts.
    #[arg(long, value_name = "DIR", env = "KVROUTE_TOKENIZER")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Tokenize every text prompt and chat whole, instead of only as far as some worker may
    /// hold it.
    #[arg(long, env = "KVROUTE_TOKENIZE_WHOLE", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenize_whole: Option<bool>,
    /// Tokenize the rest of a prompt tokenized only in part afterwards, off the request's
    /// path, so that a conversation's next turn tokenizes only its new text (default true).
    #[arg(long, env = "KVROUTE_TOKENIZE_RESTS", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenize_rests: Option<bool>,
    /// A worker is busy past this fraction of its KV blocks held by active requests.
    #[arg(long, value_name = "X", env = "KVROUTE_BUSY_DECODE_FRACTION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub busy_decode_fraction: Option<f64>,
    /// A worker is busy past this fraction of its batch's tokens waiting for prefill.
    #[arg(long, value_name = "X", env = "KVROUTE_BUSY_PREFILL_FRACTION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub busy_prefill_fraction: Option<f64>,
    /// With a busy threshold: requests wait in the admission queue while every worker is
    /// busy, up to this many prompt tokens queued; past it they get a 429 with `Retry-After`.
    #[arg(long, value_name = "N", env = "KVROUTE_QUEUE_MAX_TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_max_tokens: Option<u64>,
    /// Seconds each routing decision counts as cached on its worker until the worker's own
    /// KV events arrive (0: off).
    #[arg(long, value_name = "S", env = "KVROUTE_SPECULATIVE_S")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative_s: Option<f64>,
    /// With prefill and decode workers and none of them ready for prefill: `optional` serves
    /// requests whole on the others, `enforced` refuses them (a retryable 503).
    #[arg(long, env = "KVROUTE_DISAGGREGATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disaggregation: Option<String>,
    /// How prefill workers hand the KV cache to decode workers: `vllm` (kv_transfer_params)
    /// or `sglang` (bootstrap host, port and room).
    #[arg(long, env = "KVROUTE_PD_PROTOCOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd_protocol: Option<String>,
    /// A failed prefill has its request served whole on a decode worker (else a 502).
    #[arg(long, env = "KVROUTE_PREFILL_ERROR_FALLBACK", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_error_fallback: Option<bool>,
    /// Conditional disaggregation: a decode worker whose cache leaves at most this many
    /// prompt tokens to compute serves the request whole (absent: off).
    #[arg(long, env = "KVROUTE_CONDITIONAL_MAX_NEW_TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conditional_max_new_tokens: Option<u64>,
    /// ... and at most this share of the prompt, in (0, 1] (default 1).
    #[arg(long, env = "KVROUTE_CONDITIONAL_MAX_NEW_SHARE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conditional_max_new_share: Option<f64>,
    /// With conditional disaggregation: once every prefill worker has at least this many
    /// prompt tokens booked for prefill, decode workers serve requests whole (absent: never).
    #[arg(long, env = "KVROUTE_CONDITIONAL_PREFILL_BUSY_TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conditional_prefill_busy_tokens: Option<u64>,
    /// With conditional disaggregation: a decode worker with more than this many prompt tokens
    /// booked for prefill serves nothing whole (absent: no limit).
    #[arg(long, env = "KVROUTE_CONDITIONAL_DECODE_BUSY_TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conditional_decode_busy_tokens: Option<u64>,
    /// Label keys a decode worker must share with its request's prefill worker (the KV
    /// transfer's topology), comma-separated.
    #[arg(long, value_delimiter = ',', env = "KVROUTE_KV_TRANSFER_LABELS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_labels: Option<Vec<String>>,
    /// The NATS server (`nats://host:4222`) through which this replica shares its bookings
    /// with the fleet's other replicas (default: none, a router alone).
    #[arg(long, value_name = "URL", env = "KVROUTE_NATS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats: Option<String>,
    /// The fleet's name: replicas on one NATS server with the same name share their bookings
    /// (default `default`; letters, digits, `-` and `_`).
    #[arg(long, value_name = "NAME", env = "KVROUTE_FLEET")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<String>,
    /// With `nats`: how often, while bookings change, their changes are sent to the other
    /// replicas as one message, in µs (default 500; 50 to 100,000). Longer costs less CPU
    /// (fewer messages) and delivers later.
    #[arg(long, value_name = "MICROSECONDS", env = "KVROUTE_SYNC_BATCH_US")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_batch_us: Option<u64>,
    /// The engines, as `[[workers]]` tables in the file.
    #[arg(skip)]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<BackendSpec>,
    /// An engine, on the command line: `url=http://HOST:PORT[,kv_events=tcp://HOST:PORT]
    /// [,kv_replay=tcp://HOST:PORT][,kv_blocks=N][,block_size=N][,dp_size=N][,topic=T]
    /// [,api_key=K][,id=N][,role=both|prefill|decode][,bootstrap_port=N]`, the keys of a
    /// `[[workers]]` table. Repeat it; these join after the file's.
    #[arg(long = "worker", value_name = "SPEC")]
    #[serde(skip)]
    pub worker_flags: Vec<String>,
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

impl ServeConfig {
    /// Reads and parses the TOML file at `path`.
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

    /// `self`'s keys laid over `under`'s: a key set here wins, one left out keeps `under`'s;
    /// workers given as flags join after `under`'s. (The layers: the file, then the
    /// environment and flags, which clap has already laid.)
    pub fn over(self, under: ServeConfig) -> Result<ServeConfig, ConfigError> {
        let invalid = |e: String| ConfigError::Invalid(e);
        let mut table = toml::Table::try_from(&under).map_err(|e| invalid(e.to_string()))?;
        let top = toml::Table::try_from(&self).map_err(|e| invalid(e.to_string()))?;
        table.extend(top);
        let mut merged: ServeConfig = table.try_into().map_err(|e| invalid(e.to_string()))?;
        merged.worker_flags = under.worker_flags;
        merged.worker_flags.extend(self.worker_flags);
        Ok(merged)
    }

    /// The options these keys give, over the defaults: the one place keys are checked.
    pub fn apply(self, mut options: ServeOptions) -> Result<ServeOptions, ConfigError> {
        let secs = |name: &str, s: f64| {
            if s.is_finite() && s >= 0.0 {
                Ok(Duration::from_secs_f64(s))
            } else {
                Err(ConfigError::Invalid(format!("{name} must be ≥ 0 seconds")))
            }
        };
        let positive = |name: &str, v: u64| {
            if v == 0 {
                Err(ConfigError::Invalid(format!("{name} must be ≥ 1")))
            } else {
                Ok(v)
            }
        };
        let o = &mut options;
        set(&mut o.listen, self.listen);
        o.model = self.model.or(o.model.take());
        if let Some(adapters) = self.lora_adapters {
            if adapters.iter().any(|a| a.is_empty()) {
                return Err(ConfigError::Invalid(
                    "a LoRA adapter's name is empty".to_owned(),
                ));
            }
            o.lora_adapters = adapters;
        }
        o.api_key = self.api_key.or(o.api_key.take());
        o.admin_key = self.admin_key.or(o.admin_key.take());
        set(&mut o.public_metrics, self.public_metrics);
        set(&mut o.retries, self.retries);
        set(&mut o.tokenize_whole, self.tokenize_whole);
        set(&mut o.tokenize_rests, self.tokenize_rests);
        set(&mut o.router.block_size, self.block_size);
        if let Some(name) = self.policy {
            let kind: PolicyKind = name
                .parse()
                .map_err(|e: UnknownPolicy| ConfigError::Invalid(e.to_string()))?;
            o.router.policy = Policy::with_defaults(kind, o.router.block_size);
        }
        set(&mut o.router.overlap_credit, self.overlap_credit);
        set(&mut o.router.prefill_load_scale, self.prefill_load_scale);
        set(&mut o.router.affinity.boost, self.affinity_boost);
        set(&mut o.router.affinity.from_share, self.affinity_from_share);
        set(&mut o.router.hot_load.share, self.hot_load_share);
        set(&mut o.router.hot_load.weight, self.hot_load_weight);
        set(&mut o.router.temperature, self.temperature);
        set(&mut o.router.near_tie, self.near_tie);
        let seconds = [
            (
                &mut o.replay_timeout,
                self.replay_timeout_s,
                "replay_timeout_s",
            ),
            (
                &mut o.drain_timeout,
                self.drain_timeout_s,
                "drain_timeout_s",
            ),
            (&mut o.grace, self.grace_s, "grace_s"),
            (
                &mut o.router.request_expiry,
                self.request_expiry_s,
                "request_expiry_s",
            ),
            (&mut o.body_timeout, self.body_timeout_s, "body_timeout_s"),
            (
                &mut o.header_timeout,
                self.header_timeout_s,
                "header_timeout_s",
            ),
            (
                &mut o.connect_timeout,
                self.connect_timeout_s,
                "connect_timeout_s",
            ),
            (
                &mut o.first_byte_timeout,
                self.first_byte_timeout_s,
                "first_byte_timeout_s",
            ),
        ];
        for (field, value, name) in seconds {
            if let Some(v) = value {
                *field = secs(name, v)?;
            }
        }
        set(&mut o.max_body, self.max_body_bytes);
        if let Some(v) = self.max_connections {
            o.max_connections = positive("max_connections", v as u64)? as usize;
        }
        if let Some(v) = self.breaker_failures {
            o.breaker_failures = positive("breaker_failures", u64::from(v))? as u32;
        }
        if let Some(v) = self.max_model_len {
            o.max_model_len = Some(positive("max_model_len", v)?);
        }
        if let Some(v) = self.max_kv_blocks {
            o.max_kv_blocks = positive("max_kv_blocks", v)?;
        }
        set(&mut o.worker_networks, self.worker_networks);
        o.tokenizer = self.tokenizer.or(o.tokenizer.take());
        if self.busy_decode_fraction.is_some() {
            o.router.busy.decode_blocks_fraction = self.busy_decode_fraction;
        }
        if self.busy_prefill_fraction.is_some() {
            o.router.busy.prefill_tokens_fraction = self.busy_prefill_fraction;
        }
        if let Some(cap) = self.queue_max_tokens {
            o.router.queue = Queueing::On {
                max_queued_tokens: cap,
                order: kvroute_core::QueueOrder::Fcfs,
            };
        }
        if let Some(v) = self.speculative_s {
            let ttl = secs("speculative_s", v)?;
            o.router.approximate.speculative = if ttl.is_zero() {
                Speculative::Off
            } else {
                Speculative::On { ttl }
            };
        }
        if let Some(v) = self.disaggregation {
            o.router.disaggregation = match v.as_str() {
                "optional" => Disaggregation::Optional,
                "enforced" => Disaggregation::Enforced,
                other => {
                    return Err(ConfigError::Invalid(format!(
                        "disaggregation {other:?}: optional or enforced"
                    )))
                }
            };
        }
        if let Some(v) = self.pd_protocol {
            o.disagg.protocol = v.parse().map_err(ConfigError::Invalid)?;
        }
        set(
            &mut o.disagg.prefill_error_fallback,
            self.prefill_error_fallback,
        );
        let share = self
            .conditional_max_new_share
            .or(o.disagg.conditional.map(|c| c.max_new_share))
            .unwrap_or(1.0);
        if !(share > 0.0 && share <= 1.0) {
            return Err(ConfigError::Invalid(
                "conditional_max_new_share must be in (0, 1]".to_owned(),
            ));
        }
        let tokens = self
            .conditional_max_new_tokens
            .or(o.disagg.conditional.map(|c| c.max_new_tokens));
        let prefill_busy = self
            .conditional_prefill_busy_tokens
            .or(o.disagg.conditional.and_then(|c| c.prefill_busy_tokens));
        let decode_busy = self
            .conditional_decode_busy_tokens
            .or(o.disagg.conditional.and_then(|c| c.decode_busy_tokens));
        if tokens.is_none()
            && (prefill_busy.is_some()
                || decode_busy.is_some()
                || self.conditional_max_new_share.is_some())
        {
            return Err(ConfigError::Invalid(
                "conditional_max_new_share, conditional_prefill_busy_tokens and \
                 conditional_decode_busy_tokens need conditional_max_new_tokens"
                    .to_owned(),
            ));
        }
        o.disagg.conditional = tokens.map(|max_new_tokens| Conditional {
            max_new_tokens,
            max_new_share: share,
            prefill_busy_tokens: prefill_busy,
            decode_busy_tokens: decode_busy,
        });
        if let Some(labels) = self.kv_transfer_labels {
            if labels.iter().any(|l| l.is_empty()) {
                return Err(ConfigError::Invalid(
                    "a kv_transfer_labels key is empty".to_owned(),
                ));
            }
            o.disagg.transfer_labels = labels;
        }
        let batch = match self.sync_batch_us {
            Some(us) => {
                let batch = std::time::Duration::from_micros(us);
                if !crate::replicas::SYNC_BATCH_RANGE.contains(&batch) {
                    return Err(ConfigError::Invalid(format!(
                        "sync_batch_us {us}: take 50 to 100000"
                    )));
                }
                if self.nats.is_none() && o.replicas.is_none() {
                    return Err(ConfigError::Invalid(
                        "sync_batch_us is the replicas' booking sync's: set nats too".to_owned(),
                    ));
                }
                Some(batch)
            }
            None => None,
        };
        match (self.nats, self.fleet) {
            (Some(nats), fleet) => {
                if nats.split(',').any(|url| url.trim().is_empty()) {
                    return Err(ConfigError::Invalid(format!(
                        "nats {nats:?}: an empty server URL"
                    )));
                }
                let earlier = o.replicas.take();
                let batch = batch
                    .or(earlier.as_ref().map(|r| r.batch))
                    .unwrap_or(crate::replicas::SYNC_BATCH);
                let fleet = fleet
                    .or(earlier.map(|r| r.fleet))
                    .unwrap_or_else(|| "default".to_owned());
                if !crate::replicas::valid_fleet(&fleet) {
                    return Err(ConfigError::Invalid(format!(
                        "fleet {fleet:?}: use 1 to 200 letters, digits, '-' and '_'"
                    )));
                }
                o.replicas = Some(crate::ReplicaOptions { nats, fleet, batch });
            }
            (None, Some(fleet)) => match o.replicas.as_mut() {
                Some(r) => {
                    r.fleet = fleet;
                    if let Some(batch) = batch {
                        r.batch = batch;
                    }
                }
                None => {
                    return Err(ConfigError::Invalid(
                        "fleet names the replicas sharing bookings over NATS: set nats too"
                            .to_owned(),
                    ))
                }
            },
            (None, None) => {
                if let (Some(batch), Some(r)) = (batch, o.replicas.as_mut()) {
                    r.batch = batch;
                }
            }
        }
        if o.replicas.is_some() && self.near_tie.is_none() && o.router.near_tie == 0.0 {
            o.router.near_tie = kvroute_core::REPLICA_NEAR_TIE;
        }
        o.workers.extend(self.workers);
        for flag in &self.worker_flags {
            let spec = parse_worker_flag(flag, o.workers.len() as u64)?;
            o.workers.push(spec);
        }
        o.router
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Ok(options)
    }

    /// Every key with the value `options` gives it, as `--print-config` prints them; the
    /// keys (secrets) are left out. Applied over the defaults, it gives `options` back.
    pub fn effective(options: &ServeOptions) -> ServeConfig {
        let r = &options.router;
        let s = |d: Duration| Some(d.as_secs_f64());
        ServeConfig {
            listen: Some(options.listen),
            model: options.model.clone(),
            lora_adapters: Some(options.lora_adapters.clone()),
            api_key: None,
            admin_key: None,
            public_metrics: Some(options.public_metrics),
            retries: Some(options.retries),
            policy: Some(r.policy.kind().name().to_owned()),
            block_size: Some(r.block_size),
            overlap_credit: Some(r.overlap_credit),
            prefill_load_scale: Some(r.prefill_load_scale),
            affinity_boost: Some(r.affinity.boost),
            affinity_from_share: Some(r.affinity.from_share),
            hot_load_share: Some(r.hot_load.share),
            hot_load_weight: Some(r.hot_load.weight),
            temperature: Some(r.temperature),
            near_tie: Some(r.near_tie),
            replay_timeout_s: s(options.replay_timeout),
            drain_timeout_s: s(options.drain_timeout),
            grace_s: s(options.grace),
            request_expiry_s: s(r.request_expiry),
            max_body_bytes: Some(options.max_body),
            body_timeout_s: s(options.body_timeout),
            header_timeout_s: s(options.header_timeout),
            max_connections: Some(options.max_connections),
            connect_timeout_s: s(options.connect_timeout),
            first_byte_timeout_s: s(options.first_byte_timeout),
            breaker_failures: Some(options.breaker_failures),
            max_kv_blocks: Some(options.max_kv_blocks),
            max_model_len: options.max_model_len,
            worker_networks: Some(options.worker_networks.clone()),
            tokenizer: options.tokenizer.clone(),
            tokenize_whole: Some(options.tokenize_whole),
            tokenize_rests: Some(options.tokenize_rests),
            busy_decode_fraction: r.busy.decode_blocks_fraction,
            busy_prefill_fraction: r.busy.prefill_tokens_fraction,
            queue_max_tokens: match r.queue {
                Queueing::On {
                    max_queued_tokens, ..
                } => Some(max_queued_tokens),
                Queueing::Off => None,
            },
            speculative_s: match r.approximate.speculative {
                Speculative::On { ttl } => s(ttl),
                Speculative::Off => Some(0.0),
            },
            disaggregation: Some(
                match r.disaggregation {
                    Disaggregation::Optional => "optional",
                    Disaggregation::Enforced => "enforced",
                }
                .to_owned(),
            ),
            pd_protocol: Some(options.disagg.protocol.as_str().to_owned()),
            prefill_error_fallback: Some(options.disagg.prefill_error_fallback),
            conditional_max_new_tokens: options.disagg.conditional.map(|c| c.max_new_tokens),
            conditional_max_new_share: options.disagg.conditional.map(|c| c.max_new_share),
            conditional_prefill_busy_tokens: options
                .disagg
                .conditional
                .and_then(|c| c.prefill_busy_tokens),
            conditional_decode_busy_tokens: options
                .disagg
                .conditional
                .and_then(|c| c.decode_busy_tokens),
            kv_transfer_labels: Some(options.disagg.transfer_labels.clone()),
            nats: options.replicas.as_ref().map(|r| r.nats.clone()),
            fleet: options.replicas.as_ref().map(|r| r.fleet.clone()),
            sync_batch_us: options.replicas.as_ref().map(|r| {
                let range = &crate::replicas::SYNC_BATCH_RANGE;
                r.batch.clamp(*range.start(), *range.end()).as_micros() as u64
            }),
            workers: options
                .workers
                .iter()
                .map(|w| BackendSpec {
                    api_key: None,
                    ..w.clone()
                })
                .collect(),
            worker_flags: Vec::new(),
        }
    }
}

/// `*field = value` when there is a value.
fn set<T>(field: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *field = v;
    }
}

/// Reads a worker from a flag: `key=value` pairs separated by commas, with the keys of a
/// `[[workers]]` table and its defaults (`url` required; `id`: its position among the
/// workers), for example
/// `url=http://10.0.0.5:8000,kv_events=tcp://10.0.0.5:5557,kv_replay=tcp://10.0.0.5:5558`.
/// `events` and `replay` are read as `kv_events` and `kv_replay`.
pub fn parse_worker_flag(flag: &str, position: u64) -> Result<BackendSpec, ConfigError> {
    let mut table = toml::Table::new();
    table.insert("id".to_owned(), toml::Value::Integer(position as i64));
    for pair in flag.split(',').filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| ConfigError::Invalid(format!("worker: {pair:?} is not key=value")))?;
        let key = match key {
            "events" => "kv_events",
            "replay" => "kv_replay",
            k => k,
        };
        let value = match key {
            "id" | "dp_size" | "kv_blocks" | "block_size" | "bootstrap_port" => value
                .parse::<i64>()
                .map(toml::Value::Integer)
                .map_err(|_| {
                    ConfigError::Invalid(format!("worker {key}={value:?}: not a number"))
                })?,
            _ => toml::Value::String(value.to_owned()),
        };
        table.insert(key.to_owned(), value);
    }
    if !table.contains_key("url") {
        return Err(ConfigError::Invalid(format!("worker {flag:?}: no url=")));
    }
    table
        .try_into()
        .map_err(|e: toml::de::Error| ConfigError::Invalid(format!("worker {flag:?}: {e}")))
}
