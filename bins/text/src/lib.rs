//! A model's chat template and tokenizer, from its own files (`tokenizer.json`,
//! `tokenizer_config.json`; no hub download): what turns an OpenAI request into the token ids
//! the engine will see, for routing (serve) and for the simulated engine (worker).
//!
//! ```text
//!  messages ──ChatTemplate::render (minijinja, Python-compatible)──▶ text
//!  text ──PieceTokenizer::encode: split at added tokens, each piece from the cache or the
//!         tokenizer──▶ ids (equal to tokenizing the text at once)
//! ```
//!
//! Before rendering, the request's messages and tools are made what the engine (vLLM, with
//! transformers) passes to the template: content as one string or as a list of parts, as the
//! template wants it ([`ContentFormat`]), a tool-call turn's null content as empty, tool-call
//! arguments parsed ([`conversation`]).
//!
//! * `template.rs`: [`ChatTemplate`].
//! * `format.rs`: [`ContentFormat`], which form of content a template wants.
//! * `messages.rs`: [`conversation`] and [`tools`], the messages and tools as the engine passes
//!   them.
//! * `pieces.rs`: [`PieceTokenizer`], the piece cache.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod added;
mod bpe;
mod chunks;
mod format;
mod messages;
mod pieces;
mod template;

use std::path::Path;

use serde_json::Value;

pub use format::ContentFormat;
pub use messages::{conversation, tools};
pub use pieces::{Partial, PieceStats, PieceTokenizer, TokenizeError};
pub use template::{ChatTemplate, RenderInput, TemplateError};

/// A model's tokenizer and chat template.
#[derive(Debug)]
pub struct ModelText {
    /// The tokenizer, with its piece cache.
    pub tokenizer: PieceTokenizer,
    /// The chat template, when the model has one.
    pub template: Option<ChatTemplate>,
    /// The model's longest input in tokens: a longer prompt is refused
    /// ([`ModelTextError::TooLong`]) after at most about twice that many tokens of work. Loaded
    /// from `tokenizer_config.json` (`model_max_length`) when it gives a real one (not
    /// transformers' stand-in for "unbounded", about 1e30); an engine's `--max-model-len`
    /// may be set in its place.
    pub max_length: Option<u64>,
}

/// A `model_max_length` past this is transformers' stand-in for "no limit".
const UNBOUNDED_LENGTH: f64 = 1e12;

/// The model's files could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelTextError {
    /// A file could not be read or parsed.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The template does not parse.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// Tokenizing failed.
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    /// The request cannot be rendered.
    #[error("{0}")]
    Request(String),
    /// The prompt has more tokens than the model takes ([`ModelText::max_length`]).
    #[error(
        "This model's maximum context length is {max} tokens. However, your prompt is longer \
         than that."
    )]
    TooLong {
        /// The model's maximum.
        max: u64,
    },
}

impl ModelText {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json`'s template.
    pub fn load(dir: &Path) -> Result<Self, ModelTextError> {
        let file = |name: &str| dir.join(name);
        let tokenizer_path = file("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path).map_err(|e| {
            ModelTextError::File {
                path: tokenizer_path.display().to_string(),
                reason: e.to_string(),
            }
        })?;
        let config_path = file("tokenizer_config.json");
        let mut max_length = None;
        let template = match std::fs::read_to_string(&config_path) {
            Ok(text) => {
                let config: Value =
                    serde_json::from_str(&text).map_err(|e| ModelTextError::File {
                        path: config_path.display().to_string(),
                        reason: e.to_string(),
                    })?;
                max_length = config
                    .get("model_max_length")
                    .and_then(Value::as_f64)
                    .filter(|n| (1.0..UNBOUNDED_LENGTH).contains(n))
                    .map(|n| n as u64);
                match ChatTemplate::from_config(&config) {
                    Ok(t) => Some(t),
                    Err(TemplateError::Missing) => None,
                    Err(e) => return Err(e.into()),
                }
            }
            Err(_) => None,
        };
        Ok(ModelText {
            tokenizer: PieceTokenizer::new(tokenizer)?,
            template,
            max_length,
        })
    }

    /// The ids of a chat request's conversation (`messages`, `tools`, and
    /// `add_generation_prompt`, true unless the request says otherwise), as the engine's
    /// template and tokenizer make them: the messages and tools as the engine passes them
    /// ([`conversation`], [`tools`]), rendered, tokenized. A request the engine refuses, or
    /// whose rendering raises, is an error.
    pub fn chat_ids(&self, request: &Value) -> Result<Vec<u32>, ModelTextError> {
        Ok(self.chat_ids_while(request, |_| true)?.ids)
    }

    /// [`ModelText::chat_ids`], tokenized only as far as `more` wants
    /// ([`PieceTokenizer::encode_while`]).
    pub fn chat_ids_while(
        &self,
        request: &Value,
        more: impl FnMut(&[u32]) -> bool,
    ) -> Result<Partial, ModelTextError> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| ModelTextError::Request("the model has no chat template".to_owned()))?;
        let messages = request
            .get("messages")
            .and_then(Value::as_array)
            .filter(|m| !m.is_empty())
            .ok_or_else(|| {
                ModelTextError::Request("messages must be a non-empty list".to_owned())
            })?;
        let messages =
            conversation(messages, template.content_format()).map_err(ModelTextError::Request)?;
        let tools = match request.get("tools") {
            None | Some(Value::Null) => None,
            Some(given) => Some(tools(given).map_err(ModelTextError::Request)?),
        };
        let add_generation_prompt = request
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let text = template.render(&RenderInput {
            messages: &messages,
            tools: tools.as_ref(),
            add_generation_prompt,
        })?;
        self.within_length(&text)?;
        Ok(self.tokenizer.encode_while(&text, more)?)
    }

    /// An error when `text` has more tokens than [`ModelText::max_length`].
    fn within_length(&self, text: &str) -> Result<(), ModelTextError> {
        match self.max_length {
            Some(max) if self.tokenizer.exceeds(text, max)? => Err(ModelTextError::TooLong { max }),
            _ => Ok(()),
        }
    }

    /// The ids of a text prompt, with the special tokens the tokenizer adds (a BOS, where it
    /// has one), as vLLM's completions tokenize it; through the piece cache when it adds none.
    pub fn text_ids(&self, text: &str) -> Result<Vec<u32>, ModelTextError> {
        self.within_length(text)?;
        Ok(self.tokenizer.encode_with_special(text)?)
    }

    /// [`ModelText::text_ids`], tokenized only as far as `more` wants
    /// ([`PieceTokenizer::encode_with_special_while`]).
    pub fn text_ids_while(
        &self,
        text: &str,
        more: impl FnMut(&[u32]) -> bool,
    ) -> Result<Partial, ModelTextError> {
        self.within_length(text)?;
        Ok(self.tokenizer.encode_with_special_while(text, more)?)
    }
}
