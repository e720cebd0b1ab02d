//! Tokenizing by pieces. A tokenizer extracts its added tokens (`<|im_start|>`, `<|im_end|>`,
//! ...) before anything else and tokenizes the text between them independently, so a chat's
//! ids are the ids of its pieces put end to end. The pieces of a conversation repeat from
//! turn to turn (every earlier message is a piece already seen), so a cache of piece → ids
//! makes a follow-up turn tokenize only its new messages.
//!
//! Only added tokens the tokenizer matches on the raw text and strips nothing around
//! (`normalized`, `lstrip`, `rstrip` and `single_word` all false) split pieces here: exactly
//! where the tokenizer itself splits. Tests check the ids against a fresh tokenization.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokenizers::Tokenizer;

/// A tokenizer with a cache of its pieces' ids.
pub struct PieceTokenizer {
    tokenizer: Tokenizer,
    /// Split tokens, longest first (the leftmost-longest match wins).
    splits: Vec<(String, u32)>,
    cache: Mutex<PieceCache>,
}

impl std::fmt::Debug for PieceTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PieceTokenizer")
            .field("splits", &self.splits.len())
            .finish_non_exhaustive()
    }
}

/// Pieces' ids, bounded in total tokens: when full, it is emptied (a conversation's pieces are
/// back after one turn).
#[derive(Debug, Default)]
struct PieceCache {
    ids: HashMap<String, Arc<[u32]>>,
    tokens: usize,
    hits: u64,
    misses: u64,
}

/// What the piece cache has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PieceStats {
    /// Pieces found in the cache.
    pub hits: u64,
    /// Pieces tokenized.
    pub misses: u64,
    /// Pieces held.
    pub pieces: usize,
}

/// The tokenizer failed.
#[derive(Debug, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct TokenizeError(pub String);

/// Most tokens the cache holds before it starts over.
const CACHE_TOKENS: usize = 4 << 20;

impl PieceTokenizer {
    /// Wraps `tokenizer`, splitting at its added tokens that match raw text and strip nothing.
    pub fn new(tokenizer: Tokenizer) -> Self {
        let mut splits: Vec<(String, u32)> = tokenizer
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| !t.normalized && !t.lstrip && !t.rstrip && !t.single_word)
            .filter(|(_, t)| !t.content.is_empty())
            .map(|(&id, t)| (t.content.clone(), id))
            .collect();
        splits.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        PieceTokenizer {
            tokenizer,
            splits,
            cache: Mutex::new(PieceCache::default()),
        }
    }

    /// The wrapped tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// `text`'s ids, without added special tokens (`add_special_tokens=False`, as
    /// `apply_chat_template` tokenizes), through the piece cache.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        for (start, len, id) in self.splits_in(text) {
            self.piece(&text[at..start], &mut ids)?;
            ids.push(id);
            at = start + len;
        }
        self.piece(&text[at..], &mut ids)?;
        Ok(ids)
    }

    /// Where the split tokens occur in `text`, leftmost first, the longest where several
    /// start at one place, none overlapping: (byte offset, length, id). One scan per token.
    fn splits_in(&self, text: &str) -> Vec<(usize, usize, u32)> {
        let mut found: Vec<(usize, usize, u32)> = Vec::new();
        for (token, id) in &self.splits {
            found.extend(
                text.match_indices(token.as_str())
                    .map(|(at, _)| (at, token.len(), *id)),
            );
        }
        // By offset, then longest first.
        found.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut kept = Vec::with_capacity(found.len());
        let mut end = 0;
        for (at, len, id) in found {
            if at >= end {
                kept.push((at, len, id));
                end = at + len;
            }
        }
        kept
    }

    /// `text`'s ids from the tokenizer alone (no cache): what [`PieceTokenizer::encode`] must
    /// equal.
    pub fn encode_fresh(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError(e.to_string()))
    }

    /// Text of `ids` (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| TokenizeError(e.to_string()))
    }

    /// What the cache has done.
    pub fn stats(&self) -> PieceStats {
        self.cache.lock().map_or_else(
            |_| PieceStats::default(),
            |c| PieceStats {
                hits: c.hits,
                misses: c.misses,
                pieces: c.ids.len(),
            },
        )
    }

    /// Appends the ids of one piece (text with no split token), from the cache when it is
    /// there.
    fn piece(&self, piece: &str, out: &mut Vec<u32>) -> Result<(), TokenizeError> {
        if piece.is_empty() {
            return Ok(());
        }
        if let Ok(mut cache) = self.cache.lock() {
            if let Some(ids) = cache.ids.get(piece).cloned() {
                cache.hits += 1;
                out.extend_from_slice(&ids);
                return Ok(());
            }
        }
        let ids: Arc<[u32]> = self.encode_fresh(piece)?.into();
        out.extend_from_slice(&ids);
        if let Ok(mut cache) = self.cache.lock() {
            cache.misses += 1;
            if cache.tokens + ids.len() > CACHE_TOKENS {
                cache.ids.clear();
                cache.tokens = 0;
            }
            cache.tokens += ids.len();
            cache.ids.insert(piece.to_owned(), ids);
        }
        Ok(())
    }
}
