//! Tokenizing by pieces. A tokenizer extracts its added tokens (`<|im_start|>`, `<|im_end|>`,
//! ...) before anything else and tokenizes the text between them independently, so a chat's
//! ids are the ids of its pieces put end to end. The pieces of a conversation repeat from
//! turn to turn (every earlier message is a piece already seen), so a cache of piece → ids
//! makes a follow-up turn tokenize only its new messages.
//!
//! Only added tokens found exactly where the tokenizer finds them split pieces here
//! (`added.rs`). A long piece (a text prompt is one) is cut further into chunks where the
//! pre-tokenizer cuts too (`chunks.rs`). Tests check the ids against a fresh tokenization.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokenizers::Tokenizer;

use crate::added::{AddedTokens, Around};
use crate::bpe::FastBpe;
use crate::chunks::{chunk_ends, chunkable, Cuts};

/// A tokenizer with a cache of its pieces' ids.
pub struct PieceTokenizer {
    tokenizer: Tokenizer,
    /// The added tokens texts are split at.
    added: AddedTokens,
    /// Where pieces are cut into chunks.
    cuts: Cuts,
    /// What the tokenizer puts around a text when asked for its special tokens (`None`: not
    /// the same tokens around every text, so such texts are tokenized whole by it).
    around: Option<Around>,
    /// The exact fast path, for byte-level BPE tokenizers.
    fast: Option<FastBpe>,
    cache: Mutex<PieceCache>,
}

/// [`PieceTokenizer::encode_while`] first asks whether to go on once this many bytes are
/// tokenized, then each time the tokenized part has doubled (and grown by this much): each
/// question hashes and matches the ids so far, so asking at a fixed spacing would cost a long
/// text's prefix (a long conversation's every turn) many times over, while the doubling keeps
/// all questions together within twice the cost of the last, at the price of tokenizing at
/// most about as much again as some rank holds.
pub(crate) const ASK_BYTES: usize = 512;

impl std::fmt::Debug for PieceTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PieceTokenizer")
            .field("splits", &self.added.len())
            .field("cuts", &self.cuts)
            .field("fast", &self.fast.is_some())
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

/// A text's first ids, as far as [`PieceTokenizer::encode_while`] was asked to go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partial {
    /// The ids of the text's first bytes.
    pub ids: Vec<u32>,
    /// The bytes tokenized.
    pub done_bytes: usize,
    /// The bytes left untokenized (0: the ids are the whole text's).
    pub rest_bytes: usize,
    /// The whole text, when the ids are not all of it: what [`PieceTokenizer::warm`] takes
    /// to tokenize the rest into the piece cache later, off the request's path, so that a
    /// follow-up turn finds it there.
    pub unfinished: Option<String>,
}

impl Partial {
    fn of(ids: Vec<u32>, text: &str, done: usize) -> Self {
        Partial {
            ids,
            done_bytes: done,
            rest_bytes: text.len() - done,
            unfinished: (done < text.len()).then(|| text.to_owned()),
        }
    }

    /// True when the ids are the whole text's.
    pub fn complete(&self) -> bool {
        self.rest_bytes == 0
    }

    /// The whole text's length in tokens: the ids', and the bytes left at the rate of the
    /// bytes tokenized (rounded up), an estimate.
    pub fn estimated_tokens(&self) -> u64 {
        let ids = self.ids.len() as u64;
        if self.rest_bytes == 0 {
            return ids;
        }
        let rest = self.rest_bytes as u64;
        ids + (rest * ids.max(1)).div_ceil(self.done_bytes.max(1) as u64)
    }
}

/// The tokenizer failed.
#[derive(Debug, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct TokenizeError(pub String);

/// Most tokens the cache holds before it starts over.
const CACHE_TOKENS: usize = 4 << 20;

impl PieceTokenizer {
    /// Wraps `tokenizer`, splitting at its added tokens where it splits (`added.rs`).
    pub fn new(tokenizer: Tokenizer) -> Result<Self, TokenizeError> {
        let added = AddedTokens::new(&tokenizer)
            .map_err(|e| TokenizeError(format!("the added tokens' matcher: {e}")))?;
        let fast = FastBpe::of(&tokenizer, &added.texts());
        let cuts = if fast.is_some() {
            Cuts::WordEnds
        } else if chunkable(&tokenizer) {
            Cuts::LineEnds
        } else {
            Cuts::Whole
        };
        let around = Around::of(&tokenizer);
        Ok(PieceTokenizer {
            tokenizer,
            added,
            cuts,
            around,
            fast,
            cache: Mutex::new(PieceCache::default()),
        })
    }

    /// True when pieces are tokenized by the exact fast path for byte-level BPE rather than
    /// by the tokenizer's own pipeline (the ids are the same).
    pub fn fast(&self) -> bool {
        self.fast.is_some()
    }

    /// True when long pieces are cut into chunks (`chunks.rs`).
    pub fn chunked(&self) -> bool {
        self.cuts != Cuts::Whole
    }

    /// `text`'s ids as the tokenizer gives them with its special tokens added (as vLLM
    /// tokenizes a completion's text): through the cache, with what the tokenizer adds around
    /// a text (a BOS) put around.
    pub fn encode_with_special(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.encode_with_special_while(text, |_| true)?.ids)
    }

    /// [`PieceTokenizer::encode_with_special`], as far as `more` wants
    /// ([`PieceTokenizer::encode_while`], with `more` seeing the added tokens before the text);
    /// whole, by the tokenizer, when it adds something else than the same tokens around
    /// every text.
    pub fn encode_with_special_while(
        &self,
        text: &str,
        more: impl FnMut(&[u32]) -> bool,
    ) -> Result<Partial, TokenizeError> {
        if let Some(around) = &self.around {
            let mut part = self.encode_after(&around.before, text, more)?;
            if part.complete() {
                part.ids.extend_from_slice(&around.after);
            }
            return Ok(part);
        }
        let ids = self
            .tokenizer
            .encode(text, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError(e.to_string()))?;
        Ok(Partial::of(ids, text, text.len()))
    }

    /// The wrapped tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// `text`'s ids, without added special tokens (`add_special_tokens=False`, as
    /// `apply_chat_template` tokenizes), through the piece cache.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.encode_while(text, |_| true)?.ids)
    }

    /// [`PieceTokenizer::encode`], piece by piece and chunk by chunk, asking `more` with the
    /// ids so far whether to go on, after a chunk or split token: first past [`ASK_BYTES`],
    /// then each time the bytes tokenized have doubled. Where it says no, the ids so far (the
    /// first ids of `encode`'s, those of a prefix of `text` cut where the tokenizer cuts) and
    /// the bytes left untokenized.
    pub fn encode_while(
        &self,
        text: &str,
        more: impl FnMut(&[u32]) -> bool,
    ) -> Result<Partial, TokenizeError> {
        self.encode_after(&[], text, more)
    }

    /// [`PieceTokenizer::encode_while`] with the ids starting with `before`.
    fn encode_after(
        &self,
        before: &[u32],
        text: &str,
        mut more: impl FnMut(&[u32]) -> bool,
    ) -> Result<Partial, TokenizeError> {
        let mut ids = Vec::with_capacity(before.len() + text.len() / 3);
        ids.extend_from_slice(before);
        // The start of the piece at hand, and the end of what is tokenized.
        let (mut at, mut done) = (0, 0);
        // Where `more` is next asked: the first chunk or split token ending there or after.
        let mut ask_at = ASK_BYTES;
        let mut ask = |end: usize, ids: &[u32]| {
            if end >= text.len() || end < ask_at {
                return true;
            }
            ask_at = (2 * end).max(end + ASK_BYTES);
            more(ids)
        };
        let splits = self.splits_in(text);
        let ends = splits
            .iter()
            .map(|&(start, len, id)| (start, Some((start + len, id))))
            .chain(std::iter::once((text.len(), None)));
        for (start, split) in ends {
            for end in self.chunk_ends_of(&text[at..start]).map(|end| at + end) {
                self.chunk(&text[done..end], &mut ids)?;
                done = end;
                if !ask(end, &ids) {
                    return Ok(Partial::of(ids, text, end));
                }
            }
            if let Some((end, id)) = split {
                ids.push(id);
                (at, done) = (end, end);
                if !ask(end, &ids) {
                    return Ok(Partial::of(ids, text, end));
                }
            }
        }
        Ok(Partial::of(ids, text, text.len()))
    }

    /// Tokenizes `text` into the piece cache: the rest of a text tokenized in part
    /// ([`Partial::unfinished`]), whose first chunks are found there.
    pub fn warm(&self, text: &str) -> Result<(), TokenizeError> {
        self.encode(text).map(drop)
    }

    /// Whether `text` has more than `max` tokens, after tokenizing no more of it than takes
    /// about `2·max` tokens: a text of at most `max` bytes cannot (every token covers a byte,
    /// give or take the special tokens a tokenizer adds); a longer one is tokenized by
    /// prefixes from `4·(max + 1)` bytes, doubling, cut at whitespace, until a prefix has
    /// clearly more (past a margin for the cut) or the prefix is the whole text. `false`
    /// therefore means the whole text was counted, or is short in bytes.
    pub fn exceeds(&self, text: &str, max: u64) -> Result<bool, TokenizeError> {
        // Special tokens a tokenizer may add (BOS, EOS), and what a cut may add.
        const ADDED: u64 = 8;
        const CUT_MARGIN: u64 = 64;
        if text.len() as u64 + ADDED <= max {
            return Ok(false);
        }
        let mut budget =
            usize::try_from(max.saturating_add(1).saturating_mul(4)).unwrap_or(usize::MAX);
        loop {
            if budget >= text.len() {
                return Ok(self.encode(text)?.len() as u64 > max);
            }
            let mut cut = budget;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            if let Some(space) = text[..cut]
                .rfind(char::is_whitespace)
                .filter(|&c| c > cut / 2)
            {
                cut = space;
            }
            if self.encode(&text[..cut])?.len() as u64 > max.saturating_add(CUT_MARGIN) {
                return Ok(true);
            }
            budget = budget.saturating_mul(2);
        }
    }

    /// Where one piece (text with no split token) is cut into chunks, as offsets of the ends
    /// of its chunks (the piece's own end last; none for an empty piece).
    fn chunk_ends_of<'p>(&'p self, piece: &'p str) -> impl Iterator<Item = usize> + 'p {
        let letter = |c| self.fast.as_ref().is_some_and(|f| f.is_letter(c));
        chunk_ends(piece, self.cuts, letter).chain((!piece.is_empty()).then_some(piece.len()))
    }

    /// Where the split tokens occur in `text`, leftmost first, the longest where several
    /// start at one place, none overlapping: (byte offset, length, id). One pass.
    fn splits_in(&self, text: &str) -> Vec<(usize, usize, u32)> {
        self.added.find(text)
    }

    /// `text`'s ids from the tokenizer alone (no cache): what [`PieceTokenizer::encode`] must
    /// equal.
    pub fn encode_fresh(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError(e.to_string()))
    }

    /// `text`'s ids as [`PieceTokenizer::encode`] makes them, piece by piece, without the
    /// cache: what a text costs when none of it was seen before.
    pub fn encode_uncached(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
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

    /// The fast path's pre-tokens of `text` as byte spans (`None` without a fast path), for
    /// the tests that compare them with the tokenizer's pre-tokenizer.
    #[doc(hidden)]
    pub fn fast_pre_tokens(&self, text: &str) -> Option<Vec<(usize, usize)>> {
        Some(self.fast.as_ref()?.pre_tokens(text))
    }

    /// Appends the ids of a piece (text with no split token): by the fast path when the
    /// tokenizer has one and the piece is its, else by the tokenizer.
    fn piece(&self, piece: &str, out: &mut Vec<u32>) -> Result<(), TokenizeError> {
        if piece.is_empty() || self.fast.as_ref().is_some_and(|f| f.encode(piece, out)) {
            return Ok(());
        }
        out.extend(self.encode_fresh(piece)?);
        Ok(())
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

    /// Appends the ids of one chunk, from the cache when it is there.
    fn chunk(&self, piece: &str, out: &mut Vec<u32>) -> Result<(), TokenizeError> {
        if piece.is_empty() {
            return Ok(());
        }
        if let Ok(mut guard) = self.cache.lock() {
            let cache = &mut *guard;
            if let Some(ids) = cache.ids.get(piece) {
                out.extend_from_slice(ids);
                cache.hits += 1;
                return Ok(());
            }
        }
        let mut fresh = Vec::new();
        self.piece(piece, &mut fresh)?;
        let ids: Arc<[u32]> = fresh.into();
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
