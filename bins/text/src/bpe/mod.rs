//! An exact fast path for byte-level BPE tokenizers (Llama 3, Qwen 2 and 3, DeepSeek V3,
//! GPT-OSS and GPT-4o's o200k, GPT-2): the same ids as the tokenizer's own `encode`, without
//! its general machinery.
//!
//! ```text
//!  piece ──NFC, when the tokenizer normalizes so──▶ text
//!        ──split (hand-written pattern, one pass)──▶ pre-tokens
//!        ──merges (one lookup when the pre-token is a token)──▶ ids
//! ```
//!
//! * `classes.rs`: the Unicode classes the patterns read, one table lookup a character.
//! * `split.rs`: the split patterns, matched as the tokenizer's regex engine matches them.
//! * `merge.rs`: the BPE merges over a pre-token's bytes.
//!
//! [`FastBpe::of`] takes a tokenizer only when every part of its pipeline is one this module
//! reproduces: a BPE model over bytes (every byte a token, no dropout, no word affixes), one
//! of the known split patterns followed by byte-level mapping without a prefix space, and no
//! normalizer but NFC. Anything else stays with the tokenizer. The caller has taken out the
//! added tokens it splits at; a piece holding another added token goes to the tokenizer too
//! ([`FastBpe::encode`] says so).

mod classes;
mod merge;
mod split;

use std::borrow::Cow;
use std::collections::HashMap;

use aho_corasick::AhoCorasick;
use serde::Deserialize;
use serde_json::Value;
use tokenizers::Tokenizer;
use unicode_normalization_alignments::{is_nfc_quick, IsNormalized, UnicodeNormalization};

use merge::Merges;
pub(crate) use split::{Pattern, Splitter};

/// A byte-level BPE tokenizer's pipeline, reproduced.
#[derive(Debug)]
pub(crate) struct FastBpe {
    splitter: Splitter,
    merges: Merges,
    /// The tokenizer composes to NFC first.
    nfc: bool,
    /// Added tokens the caller does not split at: a piece holding one is the tokenizer's.
    others: Option<AhoCorasick>,
}

/// GPT-2's map from a byte to the character that stands for it in a byte-level vocabulary.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut extra = 0u32;
    for (b, slot) in chars.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            b as u32
        } else {
            extra += 1;
            255 + extra
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    chars
}

/// The byte each character of a byte-level vocabulary stands for, by character (all are
/// below U+0144).
struct ByteOf([Option<u8>; 0x144]);

impl ByteOf {
    fn new() -> Self {
        let mut of = [None; 0x144];
        for (b, c) in byte_chars().into_iter().enumerate() {
            of[c as usize] = Some(b as u8);
        }
        ByteOf(of)
    }

    /// A byte-level token's bytes (`None`: a character that stands for no byte).
    fn bytes(&self, token: &str) -> Option<Vec<u8>> {
        token
            .chars()
            .map(|c| self.0.get(c as usize).copied().flatten())
            .collect()
    }
}

/// A BPE model as `tokenizer.json` writes it, the parts read here.
#[derive(Deserialize)]
struct ModelJson<'a> {
    #[serde(rename = "type")]
    kind: Cow<'a, str>,
    dropout: Option<f64>,
    #[serde(borrow, default)]
    continuing_subword_prefix: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    end_of_word_suffix: Option<Cow<'a, str>>,
    #[serde(default)]
    ignore_merges: bool,
    #[serde(borrow)]
    vocab: HashMap<Cow<'a, str>, u32>,
    #[serde(borrow)]
    merges: Vec<MergeJson<'a>>,
}

/// A merge, as a pair or as one string with a space between its parts.
#[derive(Deserialize)]
#[serde(untagged)]
enum MergeJson<'a> {
    Pair(#[serde(borrow)] Cow<'a, str>, #[serde(borrow)] Cow<'a, str>),
    Joined(#[serde(borrow)] Cow<'a, str>),
}

impl FastBpe {
    /// The fast path for `tokenizer`, when it has one; `splits` are the added tokens the
    /// caller takes out of a text before tokenizing its pieces.
    pub(crate) fn of(tokenizer: &Tokenizer, splits: &[String]) -> Option<Self> {
        let pattern = pattern_of(tokenizer)?;
        let nfc = match tokenizer
            .get_normalizer()
            .and_then(|n| serde_json::to_value(n).ok())
        {
            None => false,
            Some(n) if n["type"] == "NFC" => true,
            Some(n)
                if n["type"] == "Sequence"
                    && n["normalizers"].as_array().is_some_and(Vec::is_empty) =>
            {
                false
            }
            Some(_) => return None,
        };
        let model = serde_json::to_string(tokenizer.get_model()).ok()?;
        let merges = merges_of(&serde_json::from_str(&model).ok()?)?;
        let others: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .values()
            .map(|t| t.content.clone())
            .filter(|t| !t.is_empty() && !splits.contains(t))
            .collect();
        let others = if others.is_empty() {
            None
        } else {
            Some(AhoCorasick::new(&others).ok()?)
        };
        Some(FastBpe {
            splitter: Splitter::new(pattern)?,
            merges,
            nfc,
            others,
        })
    }

    /// Appends `piece`'s ids, as the tokenizer's `encode(piece, add_special_tokens=False)`
    /// gives them; `false` (nothing appended) when the piece holds an added token that only
    /// the tokenizer handles.
    pub(crate) fn encode(&self, piece: &str, out: &mut Vec<u32>) -> bool {
        if self.others.as_ref().is_some_and(|o| o.is_match(piece)) {
            return false;
        }
        let composed;
        let text = if self.nfc && is_nfc_quick(piece.chars()) != IsNormalized::Yes {
            composed = piece.nfc().map(|(c, _)| c).collect::<String>();
            composed.as_str()
        } else {
            piece
        };
        self.splitter
            .split(text, |pre| self.merges.encode(pre.as_bytes(), out));
        true
    }
}

impl FastBpe {
    /// True when `c` is a letter (`\p{L}`).
    pub(crate) fn is_letter(&self, c: char) -> bool {
        self.splitter.is_letter(c)
    }

    /// The pre-tokens of `text` (taken as normalized), as byte spans.
    pub(crate) fn pre_tokens(&self, text: &str) -> Vec<(usize, usize)> {
        let mut spans = Vec::new();
        let base = text.as_ptr() as usize;
        self.splitter.split(text, |pre| {
            let start = pre.as_ptr() as usize - base;
            spans.push((start, start + pre.len()));
        });
        spans
    }
}

/// The split pattern of `tokenizer`'s pre-tokenizer, when it is byte-level BPE's as this
/// module reproduces it.
fn pattern_of(tokenizer: &Tokenizer) -> Option<Pattern> {
    let pre = serde_json::to_value(tokenizer.get_pre_tokenizer()?).ok()?;
    let byte_level = |v: &Value, regex: bool| {
        v["type"] == "ByteLevel" && v["add_prefix_space"] == false && v["use_regex"] == regex
    };
    if byte_level(&pre, true) {
        return Some(Pattern::Gpt2);
    }
    if pre["type"] != "Sequence" {
        return None;
    }
    let steps = pre["pretokenizers"].as_array()?;
    let (last, splits) = steps.split_last()?;
    if !byte_level(last, false) {
        return None;
    }
    let regexes = splits
        .iter()
        .map(|s| {
            let isolated =
                s["type"] == "Split" && s["behavior"] == "Isolated" && s["invert"] == false;
            isolated.then(|| s["pattern"]["Regex"].as_str()).flatten()
        })
        .collect::<Option<Vec<&str>>>()?;
    Pattern::of(&regexes)
}

/// The merges of a byte-level BPE `model`, when it has no dropout, no word affixes, and a
/// token for every byte.
fn merges_of(model: &ModelJson<'_>) -> Option<Merges> {
    let empty = |v: &Option<Cow<'_, str>>| v.as_deref().is_none_or(str::is_empty);
    let plain = model.kind == "BPE"
        && model.dropout.is_none()
        && empty(&model.continuing_subword_prefix)
        && empty(&model.end_of_word_suffix);
    if !plain {
        return None;
    }
    let byte_of = ByteOf::new();
    // A token spelled with characters that stand for no byte (an added token the vocabulary
    // also lists) is never the result of merging bytes: left out, with the merges naming it.
    let vocab: Vec<(Vec<u8>, u32)> = model
        .vocab
        .iter()
        .filter_map(|(token, &id)| Some((byte_of.bytes(token)?, id)))
        .collect();
    let merges: Vec<(Vec<u8>, Vec<u8>)> = model
        .merges
        .iter()
        .filter_map(|m| {
            let (a, b) = match m {
                MergeJson::Pair(a, b) => (a.as_ref(), b.as_ref()),
                MergeJson::Joined(s) => s.split_once(' ')?,
            };
            Some((byte_of.bytes(a)?, byte_of.bytes(b)?))
        })
        .collect();
    Merges::new(&vocab, &merges, model.ignore_merges)
}
