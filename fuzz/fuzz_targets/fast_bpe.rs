//! Arbitrary text through kvroute's tokenizer against the model's own: the exact fast path for
//! byte-level BPE must give the tokenizer's ids on any text.
//!
//! The tokenizer is read once from `KVROUTE_FUZZ_TOKENIZER` (a folder with `tokenizer.json`),
//! else `../target/fixtures/qwen3` (`scripts/fixtures.sh`); without one the target checks
//! nothing. The input's bytes, as UTF-8 with invalid sequences replaced, are the text. Checked:
//!
//! - the ids piece by piece without the cache (`encode_uncached`), through the cache twice
//!   (`encode`: chunks cut where the pre-tokenizer provably cuts, then found in the cache) and
//!   with the special tokens (`text_ids`), equal the tokenizer's `encode(text, false)` and
//!   `encode(text, true)`;
//! - tokenized in part (stopped at the first question), the ids are the first of the whole's.

#![no_main]
#![deny(unsafe_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_text::ModelText;
use libfuzzer_sys::fuzz_target;

fn model() -> Option<&'static ModelText> {
    static MODEL: OnceLock<Option<ModelText>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let dir = std::env::var_os("KVROUTE_FUZZ_TOKENIZER")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("../target/fixtures/qwen3"));
            ModelText::load(&dir).ok()
        })
        .as_ref()
}

fuzz_target!(|data: &[u8]| {
    let Some(model) = model() else { return };
    let text = String::from_utf8_lossy(data);
    let tokenizer = &model.tokenizer;
    let reference = tokenizer.encode_fresh(&text).expect("the tokenizer encodes any text");
    assert_eq!(tokenizer.encode_uncached(&text).expect("encodes"), reference);
    for _ in 0..2 {
        assert_eq!(tokenizer.encode(&text).expect("encodes"), reference);
    }
    let special = tokenizer
        .tokenizer()
        .encode(text.as_ref(), true)
        .expect("the tokenizer encodes any text");
    let whole = model.text_ids(&text).expect("no length limit is set");
    assert_eq!(whole, special.get_ids());
    let part = model.text_ids_while(&text, |_| false).expect("encodes");
    assert!(whole.starts_with(&part.ids));
});
