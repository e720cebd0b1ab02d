//! A completion's body read for routing without building a JSON tree: only the fields routing
//! needs (`model`, `prompt`, `max_tokens`, `cache_salt`), every other one skipped as it is parsed. A body this
//! cannot read (not an object, a prompt of another shape, a number out of range) goes to the
//! general reader, which says what is wrong.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

/// The fields of a completion's body that routing reads (serde skips the others).
#[derive(Deserialize)]
pub(crate) struct CompletionFields<'a> {
    #[serde(borrow, default)]
    pub model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub prompt: Option<Prompt<'a>>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// vLLM's per-request cache salt: only a string here; other shapes go to the general
    /// reader, which refuses them.
    #[serde(borrow, default)]
    pub cache_salt: Option<Cow<'a, str>>,
}

/// A prompt: token ids, or text.
pub(crate) enum Prompt<'a> {
    Ids(Vec<u32>),
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

/// The body's routing fields, or `None` when the general reader must look at it.
pub(crate) fn completion_fields(body: &[u8]) -> Option<CompletionFields<'_>> {
    serde_json::from_slice(body).ok()
}

#[cfg(test)]
mod tests;
