//! Pre-tokenizing by hand: the split patterns of the byte-level BPE tokenizers, each written as
//! the few comparisons its regular expression makes, so a text is cut in one pass without a
//! backtracking regex engine.
//!
//! Each pattern is matched as the tokenizer's regex engine matches it: at each position the
//! alternatives are tried in order and the first that matches wins (with its own greedy
//! repetitions backtracking), and the tokenizer's split keeps the matches and the text between
//! them ("Isolated") as pre-tokens. The pattern strings are in [`Pattern::of`]; the tests
//! compare every pre-token with the tokenizer's own on text of many scripts.

use super::classes::{Classes, LETTER, LOWERISH, MARK, NUMBER, PUNCT, SPACE, SYMBOL, UPPERISH};

/// A split pattern this module matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pattern {
    /// Llama 3's (`digits` 3) and Qwen 2's and 3's (`digits` 1):
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,digits}|
    /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
    Words {
        /// The most digits in one pre-token.
        digits: usize,
    },
    /// GPT-2's, byte-level's own: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
    /// ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2,
    /// o200k's (GPT-4o, GPT-OSS): words as capitals then small letters, each with an
    /// optional contraction; see [`O200K`].
    O200k,
    /// DeepSeek V3's three splits in turn: `\p{N}{1,3}`; `[一-龥぀-ゟ゠-ヿ]+`; and
    /// ``[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
    /// ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+``.
    DeepSeek,
}

/// The regular expressions of [`Pattern::Words`] with one and three digits, GPT-2's, and
/// DeepSeek V3's three, as `tokenizer.json` spells them.
pub(crate) const QWEN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(crate) const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(crate) const GPT2: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
pub(crate) const O200K: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(crate) const DEEPSEEK: [&str; 3] = [
    r"\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

impl Pattern {
    /// The pattern of a split's regular expressions, in order.
    pub(crate) fn of(regexes: &[&str]) -> Option<Pattern> {
        match regexes {
            [r] if *r == QWEN => Some(Pattern::Words { digits: 1 }),
            [r] if *r == LLAMA3 => Some(Pattern::Words { digits: 3 }),
            [r] if *r == GPT2 => Some(Pattern::Gpt2),
            [r] if *r == O200K => Some(Pattern::O200k),
            [a, b, c] if [*a, *b, *c] == DEEPSEEK => Some(Pattern::DeepSeek),
            _ => None,
        }
    }
}

/// A pre-tokenizer: a pattern and the character classes it reads.
#[derive(Debug)]
pub(crate) struct Splitter {
    pattern: Pattern,
    classes: Classes,
}

/// The character at byte `i` of `s` and its length in bytes (`None` at the end).
#[inline]
fn at(s: &str, i: usize) -> Option<(char, usize)> {
    let b = *s.as_bytes().get(i)?;
    if b < 0x80 {
        return Some((char::from(b), 1));
    }
    s[i..].chars().next().map(|c| (c, c.len_utf8()))
}

/// The length of the contraction after an apostrophe at `i` (`'s`, `'t`, `'re`, `'ve`, `'m`,
/// `'ll`, `'d`; any case when `fold`), apostrophe included.
fn contraction(s: &str, i: usize, fold: bool) -> Option<usize> {
    let rest = &s.as_bytes()[i + 1..];
    let low = |b: u8| if fold { b.to_ascii_lowercase() } else { b };
    match rest {
        [a, b, ..]
            if matches!(
                (low(*a), low(*b)),
                (b'r', b'e') | (b'v', b'e') | (b'l', b'l')
            ) =>
        {
            Some(3)
        }
        [a, ..] if matches!(low(*a), b's' | b't' | b'm' | b'd') => Some(2),
        // U+017F LATIN SMALL LETTER LONG S folds to `s`.
        [0xC5, 0xBF, ..] if fold => Some(3),
        _ => None,
    }
}

impl Splitter {
    /// A pre-tokenizer for `pattern`.
    pub(crate) fn new(pattern: Pattern) -> Option<Self> {
        Some(Splitter {
            pattern,
            classes: Classes::new()?,
        })
    }

    /// Calls `each` with every pre-token of `text`, in order; together they are `text`.
    pub(crate) fn split(&self, text: &str, mut each: impl FnMut(&str)) {
        match self.pattern {
            Pattern::Words { digits } => {
                self.matches(text, &mut each, |s, i| self.words(s, i, digits))
            }
            Pattern::Gpt2 => self.matches(text, &mut each, |s, i| self.gpt2(s, i)),
            Pattern::O200k => self.matches(text, &mut each, |s, i| self.o200k(s, i)),
            Pattern::DeepSeek => self.deepseek(text, &mut each),
        }
    }

    /// The pre-tokens of `text` under a pattern whose match (the end of the match at a
    /// position, `None` where none starts) is `end`: the matches and the text between them.
    fn matches(
        &self,
        text: &str,
        each: &mut impl FnMut(&str),
        end: impl Fn(&str, usize) -> Option<usize>,
    ) {
        // The end of the last pre-token, and the position tried.
        let (mut done, mut i) = (0, 0);
        while let Some((_, n)) = at(text, i) {
            match end(text, i) {
                Some(e) => {
                    if done < i {
                        each(&text[done..i]);
                    }
                    each(&text[i..e]);
                    (done, i) = (e, e);
                }
                None => i += n,
            }
        }
        if done < text.len() {
            each(&text[done..]);
        }
    }

    /// True when `c` is a letter (`\p{L}`).
    pub(crate) fn is_letter(&self, c: char) -> bool {
        self.is(c, LETTER)
    }

    fn is(&self, c: char, flags: u8) -> bool {
        self.classes.of(c) & flags != 0
    }

    /// The end of the run of characters from `i` that `keep` accepts.
    fn run(&self, s: &str, mut i: usize, keep: impl Fn(char) -> bool) -> usize {
        while let Some((c, n)) = at(s, i) {
            if !keep(c) {
                break;
            }
            i += n;
        }
        i
    }

    /// The whitespace alternatives at `i`, where a white space character starts:
    /// `\s*[\r\n]+` (when `newlines`), `\s+(?!\S)`, `\s+`.
    fn spaces(&self, s: &str, i: usize, newlines: bool) -> usize {
        // The run's end, the end of its last line break, the start of its last character.
        let (mut j, mut newline_end, mut last) = (i, None, i);
        while let Some((c, n)) = at(s, j) {
            if !self.is(c, SPACE) {
                break;
            }
            last = j;
            j += n;
            if c == '\r' || c == '\n' {
                newline_end = Some(j);
            }
        }
        match newline_end {
            Some(e) if newlines => e,
            _ if j == s.len() || last == i => j,
            _ => last,
        }
    }

    /// [`Pattern::Words`]' match at `i`.
    fn words(&self, s: &str, i: usize, digits: usize) -> Option<usize> {
        let (c, n) = at(s, i)?;
        let letter = |c| self.is(c, LETTER);
        let other = |c| !self.is(c, LETTER | NUMBER | SPACE);
        if c == '\'' {
            if let Some(len) = contraction(s, i, true) {
                return Some(i + len);
            }
        }
        if letter(c) {
            return Some(self.run(s, i, letter));
        }
        if !self.is(c, NUMBER)
            && c != '\r'
            && c != '\n'
            && at(s, i + n).is_some_and(|(d, _)| letter(d))
        {
            return Some(self.run(s, i + n, letter));
        }
        if self.is(c, NUMBER) {
            let mut j = i;
            for _ in 0..digits {
                match at(s, j) {
                    Some((d, m)) if self.is(d, NUMBER) => j += m,
                    _ => break,
                }
            }
            return Some(j);
        }
        let j = if c == ' ' { i + 1 } else { i };
        if at(s, j).is_some_and(|(d, _)| other(d)) {
            let e = self.run(s, j, other);
            return Some(self.run(s, e, |d| d == '\r' || d == '\n'));
        }
        Some(self.spaces(s, i, true))
    }

    /// [`Pattern::O200k`]'s match at `i`. Its two word alternatives are tried as a
    /// backtracking engine tries them: with the optional leading character, then without; the
    /// capitals' run at its longest, then shorter, until small letters can follow.
    fn o200k(&self, s: &str, i: usize) -> Option<usize> {
        let (c, n) = at(s, i)?;
        let lead = !self.is(c, LETTER | NUMBER) && c != '\r' && c != '\n';
        let starts: &[usize] = if lead { &[i + n, i] } else { &[i] };
        let upper = |d| self.is(d, UPPERISH);
        let lower = |d| self.is(d, LOWERISH);
        let with_contraction = |e: usize| match at(s, e) {
            Some(('\'', _)) => contraction(s, e, true).map_or(e, |len| e + len),
            _ => e,
        };
        // `[U]*[W]+'?`: the capitals' run, then back off it until small letters follow.
        for &start in starts {
            let run = self.run(s, start, upper);
            let backed_off = s[start..run].char_indices().rev().map(|(k, _)| start + k);
            for k in std::iter::once(run).chain(backed_off) {
                if at(s, k).is_some_and(|(d, _)| lower(d)) {
                    return Some(with_contraction(self.run(s, k, lower)));
                }
            }
        }
        // `[U]+[W]*'?`.
        for &start in starts {
            let run = self.run(s, start, upper);
            if run > start {
                return Some(with_contraction(self.run(s, run, lower)));
            }
        }
        if self.is(c, NUMBER) {
            let mut j = i;
            for _ in 0..3 {
                match at(s, j) {
                    Some((d, m)) if self.is(d, NUMBER) => j += m,
                    _ => break,
                }
            }
            return Some(j);
        }
        let other = |d| !self.is(d, LETTER | NUMBER | SPACE);
        let j = if c == ' ' { i + 1 } else { i };
        if at(s, j).is_some_and(|(d, _)| other(d)) {
            let e = self.run(s, j, other);
            return Some(self.run(s, e, |d| matches!(d, '\r' | '\n' | '/')));
        }
        Some(self.spaces(s, i, true))
    }

    /// [`Pattern::Gpt2`]'s match at `i`.
    fn gpt2(&self, s: &str, i: usize) -> Option<usize> {
        let (c, _) = at(s, i)?;
        if c == '\'' {
            if let Some(len) = contraction(s, i, false) {
                return Some(i + len);
            }
        }
        let j = match at(s, i + 1) {
            Some((d, _)) if c == ' ' && !self.is(d, SPACE) => i + 1,
            _ => i,
        };
        let (d, _) = at(s, j)?;
        let class = self.classes.of(d) & (LETTER | NUMBER | SPACE);
        if class == SPACE {
            return Some(self.spaces(s, i, false));
        }
        Some(self.run(s, j, |e| {
            self.classes.of(e) & (LETTER | NUMBER | SPACE) == class
        }))
    }

    /// [`Pattern::DeepSeek`]: numbers in threes, then runs of CJK ideographs and kana, then
    /// the rest by its third pattern; each split applied to each pre-token of the last.
    fn deepseek(&self, text: &str, each: &mut impl FnMut(&str)) {
        let numbers = |s: &str, i: usize| {
            let mut j = i;
            for _ in 0..3 {
                match at(s, j) {
                    Some((d, m)) if self.is(d, NUMBER) => j += m,
                    _ => break,
                }
            }
            (j > i).then_some(j)
        };
        let cjk = |c: char| matches!(c, '\u{4e00}'..='\u{9fa5}' | '\u{3040}'..='\u{309f}' | '\u{30a0}'..='\u{30ff}');
        self.matches(
            text,
            &mut |piece: &str| {
                self.matches(
                    piece,
                    &mut |piece: &str| {
                        self.matches(piece, each, |s, i| self.deepseek_rest(s, i));
                    },
                    |s, i| {
                        let e = self.run(s, i, cjk);
                        (e > i).then_some(e)
                    },
                );
            },
            numbers,
        );
    }

    /// DeepSeek V3's third pattern's match at `i`.
    fn deepseek_rest(&self, s: &str, i: usize) -> Option<usize> {
        let (c, n) = at(s, i)?;
        let ascii_letter = |d: char| d.is_ascii_alphabetic();
        if c.is_ascii_punctuation() && at(s, i + n).is_some_and(|(d, _)| ascii_letter(d)) {
            return Some(self.run(s, i + n, ascii_letter));
        }
        let word = |d| self.is(d, LETTER | MARK);
        if word(c) {
            return Some(self.run(s, i, word));
        }
        if !self.is(c, LETTER | PUNCT | SYMBOL)
            && c != '\r'
            && c != '\n'
            && at(s, i + n).is_some_and(|(d, _)| word(d))
        {
            return Some(self.run(s, i + n, word));
        }
        let mark = |d| self.is(d, PUNCT | SYMBOL);
        let j = if c == ' ' { i + 1 } else { i };
        if at(s, j).is_some_and(|(d, _)| mark(d)) {
            let e = self.run(s, j, mark);
            return Some(self.run(s, e, |d| d == '\r' || d == '\n'));
        }
        self.is(c, SPACE).then(|| self.spaces(s, i, true))
    }
}
