//! The Unicode classes the pre-tokenizers' patterns name (`\p{L}`, `\p{N}`, `\s`,
//! DeepSeek's `\p{M}`, `\p{P}`, `\p{S}`, and o200k's two unions of letter categories), one
//! lookup a character: a flag byte per character, in
//! a table of 256-character blocks where equal blocks are stored once (about 100 KB).
//!
//! The tables come from `regex-syntax`'s Unicode data, the same general categories and
//! `White_Space` property the tokenizer's own regular expressions match; the tests compare the
//! pre-tokens with the tokenizer's on text of many scripts.

use std::collections::HashMap;

use regex_syntax::hir::{Class, HirKind};

/// `\p{L}`: a letter.
pub(crate) const LETTER: u8 = 1;
/// `\p{N}`: a number.
pub(crate) const NUMBER: u8 = 2;
/// `\s`: white space.
pub(crate) const SPACE: u8 = 4;
/// `\p{M}`: a mark.
pub(crate) const MARK: u8 = 8;
/// `\p{P}`: punctuation.
pub(crate) const PUNCT: u8 = 16;
/// `\p{S}`: a symbol.
pub(crate) const SYMBOL: u8 = 32;
/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`: o200k's letters that may start a word in capitals.
pub(crate) const UPPERISH: u8 = 64;
/// `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`: o200k's letters that may end a word in small letters.
pub(crate) const LOWERISH: u8 = 128;

const BLOCK: usize = 256;
const CHARS: usize = 0x11_0000;

/// A character's class flags.
#[derive(Debug)]
pub(crate) struct Classes {
    /// Block number of each 256-character block.
    blocks: Vec<u16>,
    /// The distinct blocks.
    flags: Vec<[u8; BLOCK]>,
    /// The first block, kept apart so ASCII costs one load.
    latin: [u8; BLOCK],
}

impl Classes {
    /// The table, built from the Unicode data.
    pub(crate) fn new() -> Option<Self> {
        let mut all = vec![0u8; CHARS];
        for (pattern, flag) in [
            (r"\p{L}", LETTER),
            (r"\p{N}", NUMBER),
            (r"\s", SPACE),
            (r"\p{M}", MARK),
            (r"\p{P}", PUNCT),
            (r"\p{S}", SYMBOL),
            (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", UPPERISH),
            (r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", LOWERISH),
        ] {
            let hir = regex_syntax::parse(pattern).ok()?;
            let HirKind::Class(Class::Unicode(class)) = hir.kind() else {
                return None;
            };
            for range in class.ranges() {
                for c in u32::from(range.start())..=u32::from(range.end()) {
                    all[c as usize] |= flag;
                }
            }
        }
        let mut seen: HashMap<[u8; BLOCK], u16> = HashMap::new();
        let mut flags = Vec::new();
        let mut blocks = Vec::with_capacity(CHARS / BLOCK);
        for chunk in all.chunks_exact(BLOCK) {
            let mut block = [0u8; BLOCK];
            block.copy_from_slice(chunk);
            let n = *seen.entry(block).or_insert_with(|| {
                flags.push(block);
                (flags.len() - 1) as u16
            });
            blocks.push(n);
        }
        let latin = flags[usize::from(blocks[0])];
        Some(Classes {
            blocks,
            flags,
            latin,
        })
    }

    /// `c`'s flags.
    #[inline]
    pub(crate) fn of(&self, c: char) -> u8 {
        let c = c as usize;
        if c < BLOCK {
            return self.latin[c];
        }
        self.flags[usize::from(self.blocks[c / BLOCK])][c % BLOCK]
    }
}
