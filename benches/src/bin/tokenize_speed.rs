//! Tokenizing speed on one core: the exact fast path for byte-level BPE against the
//! tokenizer's own pipeline (Hugging Face `tokenizers`), on the same texts, in one run.
//!
//! ```text
//! bash scripts/fixtures.sh        # the models' tokenizer files, into target/fixtures/
//! taskset -c 1 cargo run --release -p kvroute-benches --bin tokenize-speed
//! taskset -c 1 cargo run --release -p kvroute-benches --bin tokenize-speed -- \
//!     --model-dir DIR --runs 7
//! ```
//!
//! Texts, each cut into prompts of about 8 KB at line ends: `prose`, this repository's
//! documentation (English with code spans and tables); `code`, its Rust sources;
//! `multilingual`, sentences in eleven scripts, numbers, emoji and white-space runs. Each run
//! tokenizes every prompt once with each tokenizer (`encode(text, add_special_tokens=False)`
//! and kvroute's [`PieceTokenizer::encode_uncached`], which uses no piece cache) and the ids
//! must be equal. The figures are medians over runs of tokens per second, and their ratio.
//!
//! [`PieceTokenizer::encode_uncached`]: kvroute_text::PieceTokenizer::encode_uncached

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Result};
use kvroute_benches::median;
use kvroute_text::ModelText;

const MULTILINGUAL: &[&str] = &[
    "The router keeps the prefix cache of every worker, and it isn't cheap to rebuild: we'll measure it.",
    "Der Router hält den Präfix-Zwischenspeicher jedes Arbeiters; größere Anfragen kosten mehr Zeit.",
    "Le routeur garde le cache des préfixes ; ça coûte moins cher que de tout recalculer à l'arrivée.",
    "Маршрутизатор хранит кэш префиксов каждого рабочего узла и направляет запросы туда, где он есть.",
    "Ο δρομολογητής κρατά την κρυφή μνήμη προθεμάτων κάθε εργάτη και στέλνει εκεί τα αιτήματα.",
    "الموجه يحتفظ بذاكرة التخزين المؤقت للبادئات لكل عامل ويرسل الطلبات إلى حيث توجد.",
    "राउटर हर कार्यकर्ता के उपसर्ग कैश को रखता है और अनुरोधों को वहीं भेजता है जहाँ वह मौजूद है।",
    "เราเตอร์เก็บแคชคำนำหน้าของผู้ปฏิบัติงานทุกคนและส่งคำขอไปยังที่ที่มีแคชอยู่",
    "路由器保存每个工作节点的前缀缓存，并把请求发送到已有缓存的节点，以减少预填充时间。",
    "ルーターは各ワーカーのプレフィックスキャッシュを保持し、キャッシュがある場所へリクエストを送ります。",
    "라우터는 각 작업자의 접두사 캐시를 유지하고 캐시가 있는 곳으로 요청을 보냅니다.",
    "Figures: 1 12 123 1234 12345 3.14159 2026-11-29T07:41:45Z 🚀🔥 \t\t  indented\n\n\n    block",
];

/// The files under `dir` (recursively) whose names end with `ext`, concatenated.
fn files_of(dir: &Path, ext: &str, out: &mut String) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.path());
    for entry in entries {
        let path = entry.path();
        if path.is_dir() {
            files_of(&path, ext, out)?;
        } else if path.to_string_lossy().ends_with(ext) {
            out.push_str(&std::fs::read_to_string(&path)?);
        }
    }
    Ok(())
}

/// `text` cut into prompts of about `size` bytes, each ending at a line end.
fn prompts(text: &str, size: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.split_inclusive('\n') {
        current.push_str(line);
        if current.len() >= size {
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// Tokens per second of `encode` over `prompts`, one pass.
fn rate(
    prompts: &[String],
    mut encode: impl FnMut(&str) -> Result<Vec<u32>>,
) -> Result<(f64, usize)> {
    let t = Instant::now();
    let mut tokens = 0;
    for p in prompts {
        tokens += encode(p)?.len();
    }
    Ok((tokens as f64 / t.elapsed().as_secs_f64(), tokens))
}

fn main() -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut dirs = Vec::new();
    let mut runs = 5usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model-dir" => dirs.push(PathBuf::from(args.next().unwrap_or_default())),
            "--runs" => runs = args.next().unwrap_or_default().parse()?,
            other => bail!("unknown argument {other}; --model-dir DIR (repeatable), --runs N"),
        }
    }
    if dirs.is_empty() {
        for family in ["qwen3", "llama3_1", "deepseek_v3", "gptoss"] {
            dirs.push(root.join("target/fixtures").join(family));
        }
    }
    let mut prose = String::new();
    files_of(&root.join("docs"), ".md", &mut prose)?;
    let mut code = String::new();
    files_of(&root.join("core/src"), ".rs", &mut code)?;
    let multilingual = MULTILINGUAL
        .iter()
        .map(|s| format!("{s}\n"))
        .collect::<String>()
        .repeat(60);
    let texts = [
        ("prose", prompts(&prose, 8 << 10)),
        ("code", prompts(&code, 8 << 10)),
        ("multilingual", prompts(&multilingual, 8 << 10)),
    ];
    println!("tokenize-speed: {runs} runs, medians of tokens/s on one thread");
    println!(
        "  {:<12} {:<13} {:>8} {:>14} {:>14} {:>7}",
        "model", "text", "tokens", "tokenizers", "kvroute", "ratio"
    );
    for dir in &dirs {
        if !dir.join("tokenizer.json").exists() {
            bail!(
                "no {} (run scripts/fixtures.sh)",
                dir.join("tokenizer.json").display()
            );
        }
        let t = Instant::now();
        let model = ModelText::load(dir)?;
        let loaded = t.elapsed();
        let name = dir
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        println!(
            "  {name}: loaded in {:.0} ms, fast path {}",
            loaded.as_secs_f64() * 1e3,
            if model.tokenizer.fast() { "on" } else { "off" }
        );
        let tokenizer = &model.tokenizer;
        for (label, prompts) in &texts {
            for p in prompts {
                if tokenizer.encode_uncached(p)? != tokenizer.encode_fresh(p)? {
                    bail!("{name}: the fast path's ids differ from the tokenizer's on {label}");
                }
            }
            let (mut reference, mut fast, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            let mut tokens = 0;
            for _ in 0..runs {
                let (r, n) = rate(prompts, |p| Ok(tokenizer.encode_fresh(p)?))?;
                let (f, _) = rate(prompts, |p| Ok(tokenizer.encode_uncached(p)?))?;
                reference.push(r);
                fast.push(f);
                ratios.push(f / r);
                tokens = n;
            }
            println!(
                "  {:<12} {:<13} {:>8} {:>12.0}/s {:>12.0}/s {:>6.2}×",
                name,
                label,
                tokens,
                median(reference).unwrap_or(0.0),
                median(fast).unwrap_or(0.0),
                median(ratios).unwrap_or(0.0)
            );
        }
    }
    Ok(())
}
