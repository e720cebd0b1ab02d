//! What a tokenizer adds around and finds before its model: the added tokens it matches in
//! a text first (`<|im_start|>`, `<｜User｜>`, ...), and the special tokens its post-processor
//! puts around a text (a BOS).
//!
//! The tokenizer finds its added tokens in two passes: those matched on the raw text, then, in
//! the text between them, those matched on the normalized text. Both passes are leftmost-
//! longest. Here the second pass is taken only when the tokenizer's normalizer changes nothing
//! (DeepSeek V3's empty sequence), so the normalized text is the raw text. Tokens that strip
//! white space around them or match single words only are left in the pieces, where the
//! tokenizer itself handles them.

use aho_corasick::{AhoCorasick, BuildError, MatchKind};
use tokenizers::{AddedToken, PostProcessor, Tokenizer};

/// One pass's tokens: a leftmost-longest matcher and each pattern's id.
#[derive(Debug)]
struct Pass {
    matcher: AhoCorasick,
    ids: Vec<u32>,
    texts: Vec<String>,
}

impl Pass {
    /// The pass over the added tokens `keep` takes (`None`: none).
    fn of(
        tokenizer: &Tokenizer,
        keep: impl Fn(&AddedToken) -> bool,
    ) -> Result<Option<Self>, BuildError> {
        let mut tokens: Vec<(String, u32)> = tokenizer
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| keep(t) && !t.lstrip && !t.rstrip && !t.single_word)
            .filter(|(_, t)| !t.content.is_empty())
            .map(|(&id, t)| (t.content.clone(), id))
            .collect();
        // One id per text: the lowest.
        tokens.sort();
        tokens.dedup_by(|b, a| a.0 == b.0);
        if tokens.is_empty() {
            return Ok(None);
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(text, _)| text))?;
        let (texts, ids) = tokens.into_iter().unzip();
        Ok(Some(Pass {
            matcher,
            ids,
            texts,
        }))
    }

    /// The matches in `text[from..to]`, appended as (offset in `text`, length, id).
    fn find(&self, text: &str, from: usize, to: usize, out: &mut Vec<(usize, usize, u32)>) {
        for m in self.matcher.find_iter(&text[from..to]) {
            out.push((from + m.start(), m.len(), self.ids[m.pattern().as_usize()]));
        }
    }
}

/// The added tokens a text is split at before tokenizing its pieces.
#[derive(Debug)]
pub(crate) struct AddedTokens {
    raw: Option<Pass>,
    normalized: Option<Pass>,
}

/// True when `tokenizer` has no normalizer, or one that changes nothing.
pub(crate) fn identity_normalizer(tokenizer: &Tokenizer) -> bool {
    match tokenizer
        .get_normalizer()
        .and_then(|n| serde_json::to_value(n).ok())
    {
        None => true,
        Some(n) => {
            n["type"] == "Sequence" && n["normalizers"].as_array().is_some_and(Vec::is_empty)
        }
    }
}

impl AddedTokens {
    /// `tokenizer`'s added tokens that split texts exactly where it splits them.
    pub(crate) fn new(tokenizer: &Tokenizer) -> Result<Self, BuildError> {
        let normalized = if identity_normalizer(tokenizer) {
            Pass::of(tokenizer, |t| t.normalized)?
        } else {
            None
        };
        Ok(AddedTokens {
            raw: Pass::of(tokenizer, |t| !t.normalized)?,
            normalized,
        })
    }

    /// How many there are.
    pub(crate) fn len(&self) -> usize {
        self.passes().map(|p| p.ids.len()).sum()
    }

    /// Their texts.
    pub(crate) fn texts(&self) -> Vec<String> {
        self.passes()
            .flat_map(|p| p.texts.iter().cloned())
            .collect()
    }

    fn passes(&self) -> impl Iterator<Item = &Pass> {
        self.raw.iter().chain(self.normalized.iter())
    }

    /// Where they occur in `text`, in order, none overlapping: (byte offset, length, id).
    pub(crate) fn find(&self, text: &str) -> Vec<(usize, usize, u32)> {
        let mut raw = Vec::new();
        if let Some(pass) = &self.raw {
            pass.find(text, 0, text.len(), &mut raw);
        }
        let Some(second) = &self.normalized else {
            return raw;
        };
        let mut out = Vec::with_capacity(raw.len());
        let mut at = 0;
        for found in raw {
            second.find(text, at, found.0, &mut out);
            at = found.0 + found.1;
            out.push(found);
        }
        second.find(text, at, text.len(), &mut out);
        out
    }
}

/// The special tokens the tokenizer's post-processor puts around a single text: a text's
/// ids with them are `before`, its ids without, `after`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Around {
    pub(crate) before: Vec<u32>,
    pub(crate) after: Vec<u32>,
}

impl Around {
    /// What `tokenizer` adds around a text, read off its ids with and without the special
    /// tokens on probe texts, and kept only when every probe agrees (`None`: it adds something
    /// that is not the same tokens around every text).
    pub(crate) fn of(tokenizer: &Tokenizer) -> Option<Self> {
        if tokenizer
            .get_post_processor()
            .is_none_or(|p| p.added_tokens(false) == 0)
        {
            return Some(Around::default());
        }
        let ids = |text: &str, special: bool| {
            tokenizer
                .encode(text, special)
                .ok()
                .map(|e| e.get_ids().to_vec())
        };
        let mut found: Option<Around> = None;
        for probe in ["a", "Hello, world!\n", " two  words ", "x"] {
            let (with, without) = (ids(probe, true)?, ids(probe, false)?);
            let at = with.windows(without.len()).position(|w| w == without)?;
            let around = Around {
                before: with[..at].to_vec(),
                after: with[at + without.len()..].to_vec(),
            };
            if found.as_ref().is_some_and(|f| *f != around) {
                return None;
            }
            found = Some(around);
        }
        found
    }
}
