//! How long a pass takes: models fitted to real engines, chosen per engine.
//!
//! A pass's cost depends on what it computes, its [`PassShape`]: prefill tokens that were not
//! cached (cached ones cost nothing: their KV is reused), decode tokens (one per running
//! request past its prefill) and the context those decodes attend to. Two families:
//!
//! * [`LinearFit`], the default: inference-sim's (BLIS) fit of real vLLM runs,
//!   `β0 + β1 · prefill tokens + β2 · decode tokens`, plus a term for the KV a decode reads.
//! * [`TimingModel::DynamoPolynomial`]: NVIDIA Dynamo's mocker, prefill quadratic in the
//!   pass's uncached tokens, decode a function of how full the KV cache is.
//!
//! Figures and sources: `shared/sim-calibration.md` of the project.
//!
//! [`TimingModel::from_arg`] picks a model by name ([`TimingModel::NAMES`]) or reads a linear
//! fit of any other engine and GPU from a calibration file ([`Calibration`], TOML; an example
//! is `docs/calibration-a100.toml`).

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

/// What a pass computes, the input of every timing model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassShape {
    /// Prompt tokens computed in the pass (cache hits excluded), recomputed tokens of
    /// preempted requests included.
    pub prefill_tokens: u64,
    /// Requests that computed a prefill chunk.
    pub prefill_requests: u32,
    /// Requests that decoded one token.
    pub decode_tokens: u64,
    /// Tokens of context the decoding requests attend to, summed.
    pub decode_context_tokens: u64,
    /// Tokens held by the running requests' KV blocks after scheduling.
    pub kv_active_tokens: u64,
    /// Tokens the KV cache can hold.
    pub kv_capacity_tokens: u64,
}

/// A linear step-time model, in microseconds: `base + prefill · prefill_tokens +
/// decode · decode_tokens + context · decode_context_tokens`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearFit {
    /// β0: the fixed cost of a pass (weights read, launch, scheduling), µs.
    pub base_us: f64,
    /// β1: per uncached prefill token, µs.
    pub prefill_us_per_token: f64,
    /// β2: per decode token, µs.
    pub decode_us_per_token: f64,
    /// Per token of context a decode reads, µs: KV bytes per token ÷ memory bandwidth.
    pub context_us_per_token: f64,
}

/// KV bytes per token of Llama-3.1-8B in BF16: 32 layers × 8 KV heads × 128 dims × 2 (K, V)
/// × 2 bytes.
const LLAMA_8B_KV_BYTES_PER_TOKEN: f64 = 131_072.0;

/// Microseconds to read one token's KV at `tb_per_s` terabytes per second.
const fn kv_read_us(tb_per_s: f64) -> f64 {
    LLAMA_8B_KV_BYTES_PER_TOKEN / (tb_per_s * 1e12) * 1e6
}

impl LinearFit {
    /// The default: Llama-3.1-8B-Instruct on one H100, inference-sim (BLIS) `defaults.yaml`,
    /// its fit of the golden dataset: β0 = 5,753 µs, β1 = 17.25 µs, β2 = 6.0 µs. A prefill
    /// of 2,048 uncached tokens costs 41 ms, of 8,192 tokens 147 ms. The fit's runs had short
    /// contexts, so the context term is added from physics: 131,072 KV bytes per token at the
    /// H100's 3.35 TB/s is 0.039 µs per token of context per decode.
    pub const LLAMA_8B_H100: LinearFit = LinearFit {
        base_us: 5_753.0,
        prefill_us_per_token: 17.25,
        decode_us_per_token: 6.0,
        context_us_per_token: kv_read_us(3.35),
    };

    /// Llama-3.1-8B-Instruct, one H100, vLLM 0.11.0 (BLIS): β0 = 6,472 µs, β1 = 19.80 µs,
    /// β2 = 304 µs. The decode term is an outlier against every other fit; kept for comparison.
    pub const LLAMA_8B_H100_VLLM_0_11: LinearFit = LinearFit {
        base_us: 6_472.0,
        prefill_us_per_token: 19.80,
        decode_us_per_token: 304.0,
        context_us_per_token: kv_read_us(3.35),
    };

    /// Llama-3.1-8B-Instruct, two H100s (TP 2), vLLM 0.8.4 (BLIS): β0 = 6,910 µs, β1 = 17.67
    /// µs, β2 = 2.84 µs; the KV is split over two GPUs' bandwidth.
    pub const LLAMA_8B_H100_TP2: LinearFit = LinearFit {
        base_us: 6_910.0,
        prefill_us_per_token: 17.67,
        decode_us_per_token: 2.84,
        context_us_per_token: kv_read_us(6.7),
    };

    /// Llama-3.1-8B-Instruct, one A100-80GB, vLLM 0.8.4 (BLIS): β0 = 16,442 µs, β1 = 47.84
    /// µs, β2 = 18.2 µs; context read at the A100's 2.04 TB/s.
    pub const LLAMA_8B_A100: LinearFit = LinearFit {
        base_us: 16_442.0,
        prefill_us_per_token: 47.84,
        decode_us_per_token: 18.2,
        context_us_per_token: kv_read_us(2.04),
    };

    /// The pass's duration in microseconds.
    fn pass_us(&self, shape: &PassShape) -> f64 {
        self.base_us
            + self.prefill_us_per_token * shape.prefill_tokens as f64
            + self.decode_us_per_token * shape.decode_tokens as f64
            + self.context_us_per_token * shape.decode_context_tokens as f64
    }
}

impl Default for LinearFit {
    /// [`LinearFit::LLAMA_8B_H100`].
    fn default() -> Self {
        LinearFit::LLAMA_8B_H100
    }
}

/// A pass-duration model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TimingModel {
    /// A linear fit ([`LinearFit`]); the default is Llama-3.1-8B on one H100.
    Linear(LinearFit),
    /// NVIDIA Dynamo's mocker (`lib/mocker/src/common/perf_model.rs`, "polynomial"):
    /// prefill `4.209989e-7·T² + 1.518344e-2·T + 16.50142` ms for the pass's T uncached
    /// tokens (none when T = 0), decode `max(1, −25.74·u² + 54.01·u + 5.74)` ms for a KV
    /// cache a fraction u full (when anything decodes); a pass with both costs the sum. The
    /// fit's model and hardware are not documented; SMG's mock worker quotes 48.5% TTFT and
    /// 28.9% TPOT error for it, measured with prefix caching off.
    DynamoPolynomial,
}

impl Default for TimingModel {
    /// [`LinearFit::LLAMA_8B_H100`].
    fn default() -> Self {
        TimingModel::Linear(LinearFit::default())
    }
}

impl TimingModel {
    /// How long a pass of this shape takes on the modelled GPU (before any speed-up).
    pub fn pass_duration(&self, shape: &PassShape) -> Duration {
        let us = match self {
            TimingModel::Linear(fit) => fit.pass_us(shape),
            TimingModel::DynamoPolynomial => dynamo_pass_ms(shape) * 1e3,
        };
        Duration::from_secs_f64(us.max(0.0) / 1e6)
    }
}

/// A linear fit as a calibration file gives it (TOML, every time in microseconds):
///
/// ```toml
/// base_us = 16442.0             # β0: a pass's fixed cost
/// prefill_us_per_token = 47.84  # β1: per uncached prefill token
/// decode_us_per_token = 18.2    # β2: per decode token
/// # Per token of context a decode reads, given outright ...
/// context_us_per_token = 0.064
/// # ... or from the KV bytes per token and the memory bandwidth (TB/s):
/// # kv_bytes_per_token = 131072
/// # memory_tb_per_s = 2.04
/// ```
///
/// Unknown keys are refused, as are negative or non-finite numbers and a context term given
/// both ways or half of one way. Without any context term, decodes read their KV for free.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// β0, µs.
    pub base_us: f64,
    /// β1, µs per uncached prefill token.
    pub prefill_us_per_token: f64,
    /// β2, µs per decode token.
    pub decode_us_per_token: f64,
    /// µs per token of context a decode reads.
    #[serde(default)]
    pub context_us_per_token: Option<f64>,
    /// KV bytes per token (with `memory_tb_per_s`, instead of `context_us_per_token`).
    #[serde(default)]
    pub kv_bytes_per_token: Option<f64>,
    /// Memory bandwidth, TB/s.
    #[serde(default)]
    pub memory_tb_per_s: Option<f64>,
}

/// Why a timing model could not be had.
#[derive(Debug, thiserror::Error)]
pub enum TimingError {
    /// Neither a known name nor a readable file.
    #[error("unknown timing model {given:?}: one of {} or a calibration file (.toml)", TimingModel::NAMES.join(", "))]
    Unknown {
        /// What was given.
        given: String,
    },
    /// The calibration file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a calibration (bad TOML, a missing or unknown key, a bad number).
    #[error("{path} is not a timing calibration: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

impl Calibration {
    /// The fit it describes, or what is wrong with it.
    pub fn fit(&self) -> Result<LinearFit, String> {
        let context = match (
            self.context_us_per_token,
            self.kv_bytes_per_token,
            self.memory_tb_per_s,
        ) {
            (Some(c), None, None) => c,
            (None, Some(bytes), Some(tb)) if tb > 0.0 => bytes / (tb * 1e12) * 1e6,
            (None, None, None) => 0.0,
            (Some(_), _, _) => {
                return Err("give context_us_per_token, or kv_bytes_per_token and \
                            memory_tb_per_s, not both"
                    .to_owned())
            }
            _ => {
                return Err(
                    "kv_bytes_per_token needs memory_tb_per_s (> 0), and the reverse".to_owned(),
                )
            }
        };
        let fit = LinearFit {
            base_us: self.base_us,
            prefill_us_per_token: self.prefill_us_per_token,
            decode_us_per_token: self.decode_us_per_token,
            context_us_per_token: context,
        };
        let terms = [
            ("base_us", fit.base_us),
            ("prefill_us_per_token", fit.prefill_us_per_token),
            ("decode_us_per_token", fit.decode_us_per_token),
            ("the context term", fit.context_us_per_token),
        ];
        for (name, value) in terms {
            if !value.is_finite() || value < 0.0 {
                return Err(format!("{name} must be a finite number ≥ 0, not {value}"));
            }
        }
        Ok(fit)
    }
}

impl TimingModel {
    /// The models known by name: BLIS's fits of real vLLM runs of Llama-3.1-8B-Instruct
    /// (`blis-h100`, the default; `blis-h100-vllm-0.11`; `blis-h100-tp2`; `blis-a100`) and
    /// Dynamo's mocker polynomial (`dynamo`).
    pub const NAMES: [&'static str; 5] = [
        "blis-h100",
        "blis-h100-vllm-0.11",
        "blis-h100-tp2",
        "blis-a100",
        "dynamo",
    ];

    /// The model named `arg` ([`NAMES`](Self::NAMES)), or the linear fit of the calibration
    /// file at that path.
    pub fn from_arg(arg: &str) -> Result<Self, TimingError> {
        let named = match arg {
            "blis-h100" => Some(TimingModel::Linear(LinearFit::LLAMA_8B_H100)),
            "blis-h100-vllm-0.11" => Some(TimingModel::Linear(LinearFit::LLAMA_8B_H100_VLLM_0_11)),
            "blis-h100-tp2" => Some(TimingModel::Linear(LinearFit::LLAMA_8B_H100_TP2)),
            "blis-a100" => Some(TimingModel::Linear(LinearFit::LLAMA_8B_A100)),
            "dynamo" => Some(TimingModel::DynamoPolynomial),
            _ => None,
        };
        match named {
            Some(model) => Ok(model),
            None if Path::new(arg).is_file() || arg.ends_with(".toml") => {
                Self::from_file(Path::new(arg))
            }
            None => Err(TimingError::Unknown {
                given: arg.to_owned(),
            }),
        }
    }

    /// The linear fit of a calibration file ([`Calibration`]).
    pub fn from_file(path: &Path) -> Result<Self, TimingError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TimingError::Read {
            path: shown.clone(),
            source,
        })?;
        let calibration: Calibration = toml::from_str(&text).map_err(|e| TimingError::Invalid {
            path: shown.clone(),
            reason: e.message().to_owned(),
        })?;
        let fit = calibration.fit().map_err(|reason| TimingError::Invalid {
            path: shown,
            reason,
        })?;
        Ok(TimingModel::Linear(fit))
    }
}

/// Dynamo's mocker polynomial for a whole pass, in milliseconds.
fn dynamo_pass_ms(shape: &PassShape) -> f64 {
    let prefill = if shape.prefill_tokens == 0 {
        0.0
    } else {
        let t = shape.prefill_tokens as f64;
        4.209_989e-7 * t * t + 1.518_344e-2 * t + 16.501_42
    };
    let decode = if shape.decode_tokens == 0 {
        0.0
    } else {
        let u = if shape.kv_capacity_tokens == 0 {
            1.0
        } else {
            (shape.kv_active_tokens as f64 / shape.kv_capacity_tokens as f64).min(1.0)
        };
        (-25.74 * u * u + 54.01 * u + 5.74).max(1.0)
    };
    prefill + decode
}
