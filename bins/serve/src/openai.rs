//! OpenAI's request and response shapes, as vLLM and SGLang serve them, in one place: the
//! gateway reads requests with them, the simulated worker answers with them, and the replay
//! client sends them.
//!
//! A completion's body is read for routing without building a JSON tree
//! ([`completion_fields`]): only the fields routing needs (`model`, `prompt`, `max_tokens`,
//! `cache_salt`), every other one skipped as it is parsed. A body this cannot read (not an
//! object, a prompt of another shape, a number out of range) goes to the gateway's general
//! reader, which says what is wrong.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

/// The fields of a completion's body that routing reads (serde skips the others).
#[derive(Debug, Deserialize)]
pub struct CompletionFields<'a> {
    /// The model (or LoRA adapter) named.
    #[serde(borrow, default)]
    pub model: Option<Cow<'a, str>>,
    /// The prompt.
    #[serde(borrow, default)]
    pub prompt: Option<Prompt<'a>>,
    /// The output's length limit.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// The output's length limit, by its newer name.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// vLLM's per-request cache salt: only a string here; other shapes go to the general
    /// reader, which refuses them.
    #[serde(borrow, default)]
    pub cache_salt: Option<Cow<'a, str>>,
}

/// One prompt: token ids, or text (a list of prompts is not one: it does not deserialize).
/// Read from a [`serde_json::Value`] with `Prompt::deserialize(&value)`, it borrows its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// Token ids.
    Ids(Vec<u32>),
    /// Text, tokenized by the model's tokenizer.
    Text(Cow<'a, str>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Prompt<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor(std::marker::PhantomData))
    }
}

struct PromptVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for PromptVisitor<'a> {
    type Value = Prompt<'a>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or a list of token ids")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Prompt::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Prompt::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Prompt::Text(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        while let Some(id) = seq.next_element::<u32>()? {
            ids.push(id);
        }
        Ok(Prompt::Ids(ids))
    }
}

/// [`CompletionFields`] with the prompt left as its JSON text, to be read by [`prompt_of`].
#[derive(Deserialize)]
struct RawFields<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt: Option<&'a serde_json::value::RawValue>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
}

/// The body's routing fields, or `None` when the general reader must look at it.
pub fn completion_fields(body: &[u8]) -> Option<CompletionFields<'_>> {
    let raw: RawFields<'_> = serde_json::from_slice(body).ok()?;
    let prompt = match raw.prompt {
        None => None,
        Some(p) => Some(prompt_of(p.get())?),
    };
    Some(CompletionFields {
        model: raw.model,
        prompt,
        max_tokens: raw.max_tokens,
        max_completion_tokens: raw.max_completion_tokens,
        cache_salt: raw.cache_salt,
    })
}

/// A prompt from its JSON text: a list of plain integers by a loop over its bytes (most of a
/// token-id body, read several times faster than through serde's general path), anything
/// else through [`Prompt`]'s deserializer.
fn prompt_of(json: &str) -> Option<Prompt<'_>> {
    if let Some(ids) = plain_ids(json.as_bytes()) {
        return Some(Prompt::Ids(ids));
    }
    let mut de = serde_json::Deserializer::from_str(json);
    let prompt = Prompt::deserialize(&mut de).ok()?;
    de.end().ok()?;
    Some(prompt)
}

/// The ids of a JSON list of integers in `u32`'s range written plainly (digits, no sign,
/// fraction, exponent or leading zero), or `None` for anything else.
fn plain_ids(json: &[u8]) -> Option<Vec<u32>> {
    let ws = |b: &u8| matches!(b, b' ' | b'\n' | b'\r' | b'\t');
    let mut i = 0;
    let skip = |i: &mut usize| {
        while json.get(*i).is_some_and(ws) {
            *i += 1;
        }
    };
    skip(&mut i);
    if json.get(i) != Some(&b'[') {
        return None;
    }
    i += 1;
    let mut ids = Vec::with_capacity(json.len() / 4);
    skip(&mut i);
    if json.get(i) == Some(&b']') {
        i += 1;
    } else {
        loop {
            skip(&mut i);
            let start = i;
            let mut value: u64 = 0;
            while let Some(d) = json.get(i).filter(|d| d.is_ascii_digit()) {
                value = value * 10 + u64::from(d - b'0');
                if value > u64::from(u32::MAX) {
                    return None;
                }
                i += 1;
            }
            let digits = i - start;
            if digits == 0 || (digits > 1 && json[start] == b'0') {
                return None;
            }
            ids.push(value as u32);
            skip(&mut i);
            match json.get(i) {
                Some(b',') => i += 1,
                Some(b']') => {
                    i += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    skip(&mut i);
    (i == json.len()).then_some(ids)
}

/// A completion request as the replay client sends it (streamed, with its usage at the end).
#[derive(Debug, Clone, Serialize)]
pub struct CompletionRequest<'a> {
    /// The model, when the router or engine checks it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<&'a str>,
    /// The prompt: text or token ids.
    pub prompt: PromptOut<'a>,
    /// The output's length.
    pub max_tokens: u32,
    /// Generate all `max_tokens` (vLLM's and SGLang's extension).
    pub ignore_eos: bool,
    /// Stream the answer as server-sent events.
    pub stream: bool,
    /// `{"include_usage": true}`: the last event carries the usage.
    pub stream_options: StreamOptions,
}

/// A prompt as sent.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum PromptOut<'a> {
    /// Token ids.
    Ids(&'a [u32]),
    /// Text.
    Text(&'a str),
}

/// `stream_options`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StreamOptions {
    /// The last event carries the usage.
    pub include_usage: bool,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens found in the prefix cache.
    pub cached_tokens: u32,
}

/// `usage`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the prompt.
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
    /// Both.
    pub total_tokens: u32,
    /// Of the prompt, what was cached.
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    /// The usage of `prompt` tokens (`cached` of them found cached) and `completion` made.
    pub fn new(prompt: u32, completion: u32, cached: u32) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt.saturating_add(completion),
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }
}

/// An error body, in OpenAI's shape (`{"error": {...}}`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The error itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// What went wrong, for people.
    pub message: String,
    /// Its kind, by the name vLLM uses for the status ([`error_kind`]).
    #[serde(rename = "type")]
    pub kind: String,
    /// The request's field at fault, when one is.
    pub param: Option<String>,
    /// The HTTP status.
    pub code: u16,
}

/// The error kind vLLM names for an HTTP status.
pub fn error_kind(status: u16) -> &'static str {
    match status {
        400 | 413 => "BadRequestError",
        401 => "AuthenticationError",
        403 => "PermissionDeniedError",
        404 => "NotFoundError",
        408 => "TimeoutError",
        429 => "RateLimitError",
        500 => "InternalServerError",
        _ => "ServiceUnavailableError",
    }
}

impl ErrorBody {
    /// The body of an error with `status` saying `message`: every error the gateway and the
    /// worker answer is made here.
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                message: message.into(),
                kind: error_kind(status).to_owned(),
                param: None,
                code: status,
            },
        }
    }
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// `"list"`.
    pub object: &'static str,
    /// The models.
    pub data: Vec<ModelCard>,
}

/// One model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// Its name.
    pub id: String,
    /// `"model"`.
    pub object: &'static str,
    /// When it was loaded (Unix seconds).
    pub created: u64,
    /// Who serves it.
    pub owned_by: &'static str,
    /// Its longest input and output, in tokens.
    pub max_model_len: u32,
}

#[cfg(test)]
mod tests;
