//! The OpenAI-compatible shapes the worker reads and writes, as vLLM serves them (the
//! completions' and chats' own bodies are built in `http.rs`).

use serde::{Deserialize, Serialize};

/// A prompt: text, or token ids (vLLM takes both; batches of prompts are refused here).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum Prompt {
    /// Text, tokenized by the model's tokenizer.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Several prompts (texts or token lists): not served by one request here.
    Batch(Vec<serde_json::Value>),
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct PromptTokensDetails {
    /// Prompt tokens found in the prefix cache.
    pub cached_tokens: u32,
}

/// `usage`.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    pub(crate) fn new(prompt: u32, completion: u32, cached: u32) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }
}

/// The error body, OpenAI's shape.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ErrorBody {
    pub error: ErrorDetail,
}

/// The error itself.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: u16,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

/// One model.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: u32,
}
