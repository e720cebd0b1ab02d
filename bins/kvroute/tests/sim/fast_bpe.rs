//! The exact fast path for byte-level BPE tokenizers against the tokenizer's own pipeline, on
//! real models' files (Qwen3's, Llama 3.1's, DeepSeek V3's, GPT-OSS's; `scripts/fixtures.sh`):
//! the same
//! ids on prose in many scripts, code, runs of white space, numbers in many scripts, special
//! tokens, text that is not NFC, and random text drawn from all of Unicode.

use kvroute_core::Rng;
use kvroute_text::ModelText;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use crate::chat::{fragments, model_of};

/// Texts that reach every alternative of the split patterns.
const CORPUS: &[&str] = &[
    "The router's cache isn't cold; we'll see if they've REALLY gone. I'd say 'S and 'Re, 'ſ, x'ſabc y'ſt z'Sx 'tEe, 'LL'D.",
    "Der Zwischenspeicher wäre größer, aber äußerst träge. Ça coûte très cher à l'hôpital, n'est-ce pas?",
    "Маршрутизатор держит кэш префиксов. Ο δρομολογητής κρατά την κρυφή μνήμη. Ünïcödé façade.",
    "الموجه يحتفظ بذاكرة التخزين المؤقت. मार्गदर्शक कैश रखता है। เราเตอร์เก็บแคชไว้ ภาษาไทย",
    "路由器保存前缀缓存，以减少预填充时间。ルーターはプレフィックスキャッシュを保持します。라우터는 캐시를 유지합니다.",
    "fn main() {\n    let x: Vec<u32> = vec![1, 2, 3];\n\tprintln!(\"{x:?}\");\n}\n\n// done\r\n",
    "def f(a, b=2):\n    return {'k': [a, b]}  # comment\n\n\n    \n\t\t\n",
    "{\"model\": \"qwen3\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n\": 12345678}",
    "   leading spaces\n  \n \r\n\r\n\t \t trailing   \u{a0}nbsp\u{3000}ideographic\u{2028}line\u{85}nel  ",
    "Numbers: 1 12 123 1234 12345 3.14159 ¹²³ Ⅻ ٣٤٥ ४५६ 1,000,000 0x1F 2025-11-29T07:41:45Z",
    "Special <|im_start|>user\nhello<|im_end|> and <|begin_of_text|> <|eot_id|> <｜begin▁of▁sentence｜> end",
    "Not NFC: e\u{301}te\u{301}, A\u{30a}ngstro\u{308}m, \u{1100}\u{1161}\u{11a8}, \u{212b} \u{37e} \u{f900}",
    "Emoji 🚀🔥 👩\u{200d}💻 flags 🇩🇪 zero\u{200b}width \u{feff}bom \u{e000}private \u{0}\u{7f}\u{1b}[0m",
    "..., !!! ??? ----- ===== ~~~ @user #tag $100 %50 ^_^ &amp; *bold* (x) [y] {z} <a> |b| \\c/ `d`",
    "Mixed:word.word,word;word'word\"word—word–word…word«word»word„word“word”",
    "CamelCase HTTPServer iPhone McDonald's DON'T they'RE ǅemal ÀÉÎõü ΣΊΣΥΦΟΣ a/b\n/c .\n/d x'/y",
    "A\nB\n\nC\r\nD \nE\n F\t\nG  \n  H",
];

/// A random text of `n` characters from a pool that mixes every class the patterns read.
fn random_text(rng: &mut Rng, n: usize) -> String {
    const POOL: &[char] = &[
        'a', 'Z', 'é', 'ß', 'ж', 'Ω', '路', 'の', '한', 'ก', 'ع', '0', '7', '٣', '¹', 'Ⅻ', ' ',
        ' ', '\t', '\n', '\r', '\u{a0}', '\u{3000}', '\u{85}', '\u{2028}', '\'', 's', 't', 'l',
        'L', 'D', 'r', 'e', 'v', 'm', '.', ',', '!', '-', '=', '(', '}', '"', '$', '€', '🚀',
        '\u{301}', '\u{308}', '\u{200b}', '\u{200d}', '\u{0}', '\u{1b}', '\u{e000}', '<', '|', '>',
        'ſ', 'A', 'É', '\u{1c5}', '\u{2b0}', '/', 'Q',
    ];
    (0..n)
        .map(|_| {
            if rng.below(8) == 0 {
                // Anywhere in Unicode.
                char::from_u32(rng.below(0x3_0000) as u32).unwrap_or('x')
            } else {
                POOL[rng.below(POOL.len() as u64) as usize]
            }
        })
        .collect()
}

/// The fast path's pre-tokens of `text` are the tokenizer's pre-tokenizer's.
fn same_pre_tokens_on(model: &ModelText, text: &str) {
    let tokenizer = model.tokenizer.tokenizer();
    let mut reference = PreTokenizedString::from(text);
    tokenizer
        .get_pre_tokenizer()
        .unwrap()
        .pre_tokenize(&mut reference)
        .unwrap();
    let reference: Vec<(usize, usize)> = reference
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(_, span, _)| span)
        .collect();
    let fast = model.tokenizer.fast_pre_tokens(text).unwrap();
    assert_eq!(fast, reference, "pre-tokens of {text:?}");
}

fn same_ids_on(model: &ModelText, text: &str) {
    same_pre_tokens_on(model, text);
    let fast = model.tokenizer.encode_uncached(text).unwrap();
    let reference = model.tokenizer.encode_fresh(text).unwrap();
    assert_eq!(fast, reference, "on {text:?}");
}

fn fast_path_equals_the_tokenizer(family: &str) {
    let Some(model) = model_of(family) else {
        return;
    };
    assert!(model.tokenizer.fast(), "{family} has the fast path");
    for text in CORPUS {
        same_ids_on(&model, text);
        same_ids_on(&model, &text.repeat(3));
    }
    // Long pre-tokens: merged with the heap.
    for text in [
        "=".repeat(5000),
        " ".repeat(3000),
        "ab".repeat(2000),
        "\n".repeat(700),
    ] {
        same_ids_on(&model, &text);
    }
    let mut rng = Rng::new(0x05ee_db9e);
    for _ in 0..1500 {
        let n = rng.below(120) as usize;
        same_ids_on(&model, &random_text(&mut rng, n));
    }
}

#[test]
fn qwen3_fast_path_gives_the_tokenizers_ids() {
    fast_path_equals_the_tokenizer("qwen3");
}

#[test]
fn llama3_1_fast_path_gives_the_tokenizers_ids() {
    fast_path_equals_the_tokenizer("llama3_1");
}

#[test]
fn deepseek_v3_fast_path_gives_the_tokenizers_ids() {
    fast_path_equals_the_tokenizer("deepseek_v3");
}

#[test]
fn gptoss_fast_path_gives_the_tokenizers_ids() {
    fast_path_equals_the_tokenizer("gptoss");
}

#[test]
fn a_tokenizer_that_is_not_byte_level_bpe_keeps_its_own_pipeline() {
    let Some(model) = model_of("gemma3") else {
        return;
    };
    assert!(!model.tokenizer.fast());
    assert_eq!(
        model.tokenizer.encode_uncached(CORPUS[0]).unwrap(),
        model.tokenizer.encode_fresh(CORPUS[0]).unwrap()
    );
}

/// A text of `n` fragments on one line (no line break), words and punctuation among them.
fn one_line(rng: &mut Rng, n: usize) -> String {
    fragments(rng, n).replace(['\n', '\r'], " ")
}

/// The ids the tokenizer gives `text` with its special tokens (a BOS, for Llama 3.1).
fn with_special(model: &ModelText, text: &str) -> Vec<u32> {
    let encoding = model.tokenizer.tokenizer().encode(text, true).unwrap();
    encoding.get_ids().to_vec()
}

/// One-line texts are cut into chunks at word ends (the first time a long one is tokenized,
/// more than one chunk is new), and the ids are the tokenizer's, from the cache as fresh,
/// with the special tokens the tokenizer adds as without.
fn one_line_text_is_cut_at_word_ends(family: &str) {
    let Some(model) = model_of(family) else {
        return;
    };
    assert!(model.tokenizer.chunked());
    let mut rng = Rng::new(17);
    for round in 0..40 {
        let text = one_line(&mut rng, 100 + 30 * round);
        let before = model.tokenizer.stats();
        for _ in 0..2 {
            assert_eq!(
                model.tokenizer.encode(&text).unwrap(),
                model.tokenizer.encode_fresh(&text).unwrap(),
                "{family}: {text:?}"
            );
        }
        assert_eq!(model.text_ids(&text).unwrap(), with_special(&model, &text));
        let after = model.tokenizer.stats();
        if text.len() > 1_000 {
            assert!(
                after.misses - before.misses > 2,
                "{family}: {before:?} -> {after:?}"
            );
        }
    }
}

#[test]
fn qwen3_one_line_text_is_cut_at_word_ends() {
    one_line_text_is_cut_at_word_ends("qwen3");
}

#[test]
fn llama3_1_one_line_text_is_cut_at_word_ends() {
    one_line_text_is_cut_at_word_ends("llama3_1");
}

#[test]
fn deepseek_v3_one_line_text_is_cut_at_word_ends() {
    one_line_text_is_cut_at_word_ends("deepseek_v3");
}

#[test]
fn gptoss_one_line_text_is_cut_at_word_ends() {
    one_line_text_is_cut_at_word_ends("gptoss");
}

/// A one-line prompt that grows from request to request tokenizes only its new end, also
/// under a tokenizer that adds a BOS (Llama 3.1); the ids are the tokenizer's.
#[test]
fn a_growing_one_line_prompt_tokenizes_only_its_new_end() {
    for family in ["qwen3", "llama3_1", "deepseek_v3", "gptoss"] {
        let Some(model) = model_of(family) else {
            return;
        };
        let mut rng = Rng::new(23);
        let mut text = String::new();
        let mut before = model.tokenizer.stats();
        for turn in 0..6 {
            let added = one_line(&mut rng, 1_500);
            text.push_str(&added);
            assert_eq!(model.text_ids(&text).unwrap(), with_special(&model, &text));
            let after = model.tokenizer.stats();
            if turn > 0 {
                let new_chunks = 2 + added.len() / 128;
                assert!(
                    after.misses - before.misses <= new_chunks as u64,
                    "{family}: {before:?} -> {after:?}"
                );
                assert!(
                    after.hits - before.hits >= 4 * turn as u64,
                    "{family}: {before:?} -> {after:?}"
                );
            }
            before = after;
        }
    }
}

/// Under a tokenizer that adds a BOS, a text tokenized as far as asked gives the first ids of
/// the whole text's, BOS first, stopped after any chunk; asked with the BOS in the ids.
#[test]
fn a_text_under_a_bos_adding_tokenizer_is_tokenized_in_part() {
    let Some(model) = model_of("llama3_1") else {
        return;
    };
    let bos = with_special(&model, "x")[0];
    let mut rng = Rng::new(29);
    for round in 0..30 {
        let text = if round % 2 == 0 {
            one_line(&mut rng, 300 + 60 * round)
        } else {
            fragments(&mut rng, 300 + 60 * round)
        };
        let whole = with_special(&model, &text);
        let stop_after = rng.below(6) as usize;
        let mut asked = 0;
        let part = model
            .text_ids_while(&text, |ids| {
                assert_eq!(ids[0], bos);
                asked += 1;
                asked <= stop_after
            })
            .unwrap();
        assert!(whole.starts_with(&part.ids), "{text:?}");
        assert_eq!(part.ids[0], bos);
        assert_eq!(part.complete(), part.ids == whole);
        if !part.complete() {
            assert_eq!(
                part.ids[1..],
                model
                    .tokenizer
                    .encode_fresh(&text[..part.done_bytes])
                    .unwrap()
            );
        }
    }
}

/// The rest of a text tokenized in part, tokenized later ([`Partial::unfinished`] into
/// `warm`), leaves all of it in the cache: the next turn tokenizes only its new text.
///
/// [`Partial::unfinished`]: kvroute_text::Partial::unfinished
#[test]
fn a_rest_tokenized_later_leaves_the_next_turn_only_its_new_text() {
    for family in ["qwen3", "llama3_1", "deepseek_v3", "gptoss"] {
        let Some(model) = model_of(family) else {
            return;
        };
        let mut rng = Rng::new(31);
        let text = one_line(&mut rng, 3_000);
        let part = model.text_ids_while(&text, |_| false).unwrap();
        assert!(!part.complete());
        let whole = part.unfinished.unwrap();
        assert_eq!(whole, text);
        model.tokenizer.warm(&whole).unwrap();
        let added = one_line(&mut rng, 300);
        let follow = format!("{text}{added}");
        let before = model.tokenizer.stats();
        assert_eq!(
            model.text_ids(&follow).unwrap(),
            with_special(&model, &follow)
        );
        let after = model.tokenizer.stats();
        let new_chunks = 2 + added.len() / 128;
        assert!(
            after.misses - before.misses <= new_chunks as u64,
            "{family}: {before:?} -> {after:?}"
        );
    }
}

/// A tokenizer off the fast path that adds a BOS (Gemma 3's) gives a text's ids with the BOS
/// through the piece cache exactly as it gives them itself, whole or in part.
#[test]
fn a_bos_adding_tokenizer_off_the_fast_path_gives_its_own_ids_with_special_tokens() {
    let Some(model) = model_of("gemma3") else {
        return;
    };
    let mut rng = Rng::new(37);
    let mut texts: Vec<String> = CORPUS.iter().map(|t| t.to_string()).collect();
    texts.extend((0..20).map(|i| fragments(&mut rng, 50 + 40 * i)));
    for text in &texts {
        let whole = with_special(&model, text);
        assert_eq!(model.text_ids(text).unwrap(), whole, "{text:?}");
        let part = model.text_ids_while(text, |_| false).unwrap();
        assert!(whole.starts_with(&part.ids), "{text:?}");
    }
}
