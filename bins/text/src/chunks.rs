//! Where a long piece is cut into *chunks*, each tokenized (and cached) on its own: only where
//! the tokenizer's pre-tokenizer is known to cut too, in every text that extends this one, so
//! that a prompt that grows from request to request (a conversation sent as text) tokenizes
//! only its new end, and the ids of the chunks end to end are the piece's. BPE works within
//! pre-tokens, so a cut at a pre-token boundary that no continuation moves changes no id.
//!
//! * **Line ends** ([`Cuts::LineEnds`]): after a line break followed by a character that is
//!   not white space. That holds for the byte-level BPE tokenizers whose pre-tokenizer splits
//!   by one of the regular expressions in [`CHUNKED_PATTERNS`] (Qwen 2 and 3, Llama 3, GPT-2):
//!   no alternative of theirs matches a line break followed by a character other than white
//!   space, so a pre-token always starts after such a break; and NFC, the one normalizer
//!   allowed, never composes across a line break.
//! * **Word ends too** ([`Cuts::WordEnds`], with the exact fast path, whose split patterns are
//!   known; DeepSeek V3's and o200k's among them): also after a letter followed by an ASCII
//!   character that is neither a letter nor an apostrophe (a space, punctuation, a digit).
//!   Every alternative of those patterns that holds a letter ends at or before the end of the
//!   letters' run (a contraction after it starts with an apostrophe), so a pre-token ends
//!   there; the chunk before ends in a letter run, which its own end closes the same way; what
//!   follows starts a match of its own; and an ASCII character composes with nothing under
//!   NFC. So one-line prompts are cut too. A line end before `/` is no cut: o200k's punctuation
//!   runs take the line breaks and slashes after them.
//!
//! A chunk ends at the first cut at least [`CHUNK_BYTES`] into it, and whether a place is a cut
//! depends only on the characters on either side, so chunks are cut from the left the same way
//! in a text and in any text that extends it. Other tokenizers keep whole pieces.

use tokenizers::Tokenizer;

/// How a tokenizer's pieces are cut into chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cuts {
    /// Not cut.
    Whole,
    /// After line breaks.
    LineEnds,
    /// After line breaks and at word ends.
    WordEnds,
}

/// The pre-tokenizer patterns after which pieces are cut at line breaks: Qwen2's and Qwen3's,
/// Llama 3's, and GPT-2's byte-level default.
pub(crate) const CHUNKED_PATTERNS: [&str; 3] = [
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
];

/// The fewest bytes of a chunk before a line break may end it.
pub(crate) const CHUNK_BYTES: usize = 128;

/// True when `tokenizer` pre-tokenizes as line-break cuts require (the module comment): byte-level
/// BPE split by one of [`CHUNKED_PATTERNS`] (or byte-level's own, which is GPT-2's), no prefix
/// space, no normalizer but NFC, and no normalized added token holding a line break.
pub(crate) fn chunkable(tokenizer: &Tokenizer) -> bool {
    let json = |v: Option<serde_json::Value>| v.unwrap_or(serde_json::Value::Null);
    let pre = json(
        tokenizer
            .get_pre_tokenizer()
            .and_then(|p| serde_json::to_value(p).ok()),
    );
    let normalizer = json(
        tokenizer
            .get_normalizer()
            .and_then(|n| serde_json::to_value(n).ok()),
    );
    let byte_level = |v: &serde_json::Value, regex: bool| {
        v["type"] == "ByteLevel" && v["add_prefix_space"] == false && v["use_regex"] == regex
    };
    let pre_ok = if byte_level(&pre, true) {
        true
    } else if pre["type"] == "Sequence" {
        match pre["pretokenizers"].as_array().map(Vec::as_slice) {
            Some([split, bytes]) => {
                split["type"] == "Split"
                    && split["behavior"] == "Isolated"
                    && split["invert"] == false
                    && split["pattern"]["Regex"]
                        .as_str()
                        .is_some_and(|r| CHUNKED_PATTERNS.contains(&r))
                    && byte_level(bytes, false)
            }
            _ => false,
        }
    } else {
        false
    };
    let normalizer_ok = normalizer.is_null() || normalizer["type"] == "NFC";
    let added_ok = tokenizer
        .get_added_tokens_decoder()
        .values()
        .all(|t| !t.normalized || !t.content.contains(['\n', '\r']));
    pre_ok && normalizer_ok && added_ok
}

/// Where `piece` is cut into chunks under `cuts` (`letter` tells a letter, for word ends): byte
/// offsets each at least [`CHUNK_BYTES`] after the last, none at the piece's end.
pub(crate) fn chunk_ends<'p>(
    piece: &'p str,
    cuts: Cuts,
    letter: impl Fn(char) -> bool + 'p,
) -> impl Iterator<Item = usize> + 'p {
    let bytes = piece.as_bytes();
    let mut last = 0;
    let long = cuts != Cuts::Whole && piece.len() >= 2 * CHUNK_BYTES;
    // Not before `/` (o200k's punctuation runs take line breaks and slashes after them) nor
    // before an apostrophe (its words take a contraction after them).
    let line_end = move |i: usize| {
        matches!(bytes[i - 1], b'\n' | b'\r')
            && bytes[i] != b'/'
            && (bytes[i].is_ascii_graphic()
                || piece[i..].chars().next().is_some_and(char::is_alphanumeric))
    };
    let word_end = move |i: usize| {
        bytes[i].is_ascii()
            && !bytes[i].is_ascii_alphabetic()
            && bytes[i] != b'\''
            && piece[..i].chars().next_back().is_some_and(&letter)
    };
    (1..if long { bytes.len() } else { 1 }).filter(move |&i| {
        let cut =
            i - last >= CHUNK_BYTES && (line_end(i) || (cuts == Cuts::WordEnds && word_end(i)));
        if cut {
            last = i;
        }
        cut
    })
}
