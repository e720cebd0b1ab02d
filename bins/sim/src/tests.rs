//! Unit tests of the block pool and the timing models.

use std::time::Duration;

use kvroute_core::SeqHash;

use super::blocks::{BlockId, BlockPool};
use super::events::{EngineBlockHash, EngineEvent, EventLog};
use super::timing::{LinearFit, PassShape, TimingModel};

fn removed(log: &mut EventLog) -> Vec<u64> {
    let Some(batch) = log.take_batch(Duration::ZERO) else {
        return Vec::new();
    };
    batch
        .events
        .iter()
        .flat_map(|e| match e {
            EngineEvent::Removed { block_hashes, .. } => block_hashes.clone(),
            _ => Vec::new(),
        })
        .map(|h: EngineBlockHash| h.0)
        .collect()
}

/// Allocates `n` blocks, caches them under hashes `first..first + n` and frees them in
/// the order given by `order` (indices into the allocated blocks).
fn cache_and_free(pool: &mut BlockPool, log: &mut EventLog, first: u64, order: &[usize]) {
    let ids: Vec<BlockId> = (0..order.len())
        .map(|_| pool.allocate(log).unwrap())
        .collect();
    for (i, &id) in ids.iter().enumerate() {
        pool.cache(id, SeqHash(first + i as u64));
    }
    for &i in order {
        pool.free(ids[i]);
    }
}

#[test]
fn empty_blocks_go_before_any_eviction() {
    let mut pool = BlockPool::new(4);
    let mut log = EventLog::default();
    cache_and_free(&mut pool, &mut log, 100, &[1, 0]);
    assert_eq!(pool.available(), 4);
    // Two empty blocks are left: taking them evicts nothing.
    let a = pool.allocate(&mut log).unwrap();
    let b = pool.allocate(&mut log).unwrap();
    assert!(removed(&mut log).is_empty());
    assert!(pool.contains(SeqHash(100)) && pool.contains(SeqHash(101)));
    // The third evicts the least recently freed: block 101, freed first.
    pool.allocate(&mut log).unwrap();
    assert_eq!(removed(&mut log), vec![101]);
    assert!(pool.contains(SeqHash(100)) && !pool.contains(SeqHash(101)));
    pool.free(a);
    pool.free(b);
    assert_eq!(pool.counts().double_frees, 0);
}

#[test]
fn a_touched_idle_block_is_not_evictable() {
    let mut pool = BlockPool::new(2);
    let mut log = EventLog::default();
    cache_and_free(&mut pool, &mut log, 7, &[0, 1]);
    let hit = pool.lookup(SeqHash(7)).unwrap();
    assert!(pool.is_idle(hit));
    pool.touch(hit);
    assert_eq!(pool.refs(hit), 1);
    assert_eq!(pool.available(), 1);
    pool.allocate(&mut log).unwrap();
    assert_eq!(removed(&mut log), vec![8]);
    assert!(pool.allocate(&mut log).is_none(), "every block is in use");
}

#[test]
fn a_double_free_is_counted_not_applied() {
    let mut pool = BlockPool::new(1);
    let mut log = EventLog::default();
    let id = pool.allocate(&mut log).unwrap();
    pool.free(id);
    pool.free(id);
    assert_eq!(pool.refs(id), 0);
    assert_eq!(pool.counts().double_frees, 1);
    assert_eq!(pool.available(), 1);
}

#[test]
fn copies_of_one_hash_are_evicted_one_by_one() {
    let mut pool = BlockPool::new(2);
    let mut log = EventLog::default();
    let a = pool.allocate(&mut log).unwrap();
    let b = pool.allocate(&mut log).unwrap();
    pool.cache(a, SeqHash(5));
    pool.cache(b, SeqHash(5));
    pool.free(a);
    pool.free(b);
    let counts = pool.counts();
    assert_eq!((counts.cached, counts.cached_copies), (1, 2));
    pool.allocate(&mut log).unwrap();
    assert_eq!(removed(&mut log), vec![5]);
    assert!(pool.contains(SeqHash(5)), "one copy is left");
    pool.allocate(&mut log).unwrap();
    assert_eq!(removed(&mut log), vec![5]);
    assert!(!pool.contains(SeqHash(5)));
}

#[test]
fn clearing_refuses_while_blocks_are_held() {
    let mut pool = BlockPool::new(3);
    let mut log = EventLog::default();
    let held = pool.allocate(&mut log).unwrap();
    pool.cache(held, SeqHash(1));
    assert_eq!(pool.clear(), Err(1));
    assert!(pool.contains(SeqHash(1)));
    pool.free(held);
    assert_eq!(pool.clear(), Ok(()));
    assert!(!pool.contains(SeqHash(1)));
    assert_eq!(pool.available(), 3);
    assert_eq!(pool.counts().idle, 0);
}

fn prefill(tokens: u64) -> PassShape {
    PassShape {
        prefill_tokens: tokens,
        prefill_requests: 1,
        ..PassShape::default()
    }
}

fn ms(model: TimingModel, shape: PassShape) -> f64 {
    model.pass_duration(&shape).as_secs_f64() * 1e3
}

#[test]
fn the_default_fit_matches_the_published_cross_checks() {
    // sim-calibration.md: BLIS H100 prefill of 2,048 / 8,192 / 16,384 tokens: 41 / 147 / 288 ms.
    let model = TimingModel::default();
    for (tokens, expected) in [(2_048, 41.0), (8_192, 147.0), (16_384, 288.0)] {
        let got = ms(model, prefill(tokens));
        assert!((got - expected).abs() < 1.0, "{tokens} tokens: {got} ms");
    }
    let idle_decode = PassShape {
        decode_tokens: 1,
        decode_context_tokens: 1,
        ..PassShape::default()
    };
    assert!((ms(model, idle_decode) - 5.759).abs() < 0.01);
}

#[test]
fn decode_cost_grows_with_batch_and_context() {
    let model = TimingModel::Linear(LinearFit::LLAMA_8B_H100);
    let decode = |seqs: u64, context: u64| PassShape {
        decode_tokens: seqs,
        decode_context_tokens: seqs * context,
        ..PassShape::default()
    };
    let small = ms(model, decode(8, 1_000));
    let wide = ms(model, decode(256, 1_000));
    let long = ms(model, decode(256, 12_000));
    assert!(small < wide && wide < long, "{small} {wide} {long}");
    // 256 × 12,000 tokens of KV read at 3.35 TB/s: about 120 ms on top of the fit.
    assert!((long - wide - 11_000.0 * 256.0 * 131_072.0 / 3.35e12 * 1e3).abs() < 0.1);
}

#[test]
fn the_dynamo_polynomial_matches_the_published_cross_checks() {
    // sim-calibration.md: Dynamo's polynomial for 2,048 / 8,192 / 16,384 tokens: 49 / 169 /
    // 378 ms; a fully cached prompt costs nothing.
    for (tokens, expected) in [(2_048, 49.0), (8_192, 169.0), (16_384, 378.0)] {
        let got = ms(TimingModel::DynamoPolynomial, prefill(tokens));
        assert!((got - expected).abs() < 1.0, "{tokens} tokens: {got} ms");
    }
    assert_eq!(ms(TimingModel::DynamoPolynomial, PassShape::default()), 0.0);
    let half_full = PassShape {
        decode_tokens: 4,
        kv_active_tokens: 500,
        kv_capacity_tokens: 1_000,
        ..PassShape::default()
    };
    let expected = -25.74 * 0.25 + 54.01 * 0.5 + 5.74;
    assert!((ms(TimingModel::DynamoPolynomial, half_full) - expected).abs() < 1e-6);
}

#[test]
fn timing_models_are_had_by_name_or_from_a_calibration_file() {
    for name in TimingModel::NAMES {
        assert!(TimingModel::from_arg(name).is_ok(), "{name}");
    }
    assert_eq!(
        TimingModel::from_arg("blis-a100").unwrap(),
        TimingModel::Linear(LinearFit::LLAMA_8B_A100)
    );
    // The example file in the repository is the A100 fit, its context term from bandwidth.
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/calibration-a100.toml"
    );
    let TimingModel::Linear(fit) = TimingModel::from_arg(example).unwrap() else {
        panic!("a linear fit")
    };
    let a100 = LinearFit::LLAMA_8B_A100;
    assert_eq!(
        (
            fit.base_us,
            fit.prefill_us_per_token,
            fit.decode_us_per_token
        ),
        (
            a100.base_us,
            a100.prefill_us_per_token,
            a100.decode_us_per_token
        )
    );
    assert!((fit.context_us_per_token - a100.context_us_per_token).abs() < 1e-12);
    // A pass of 1,000 uncached prompt tokens under a hand-written fit.
    let dir = std::env::temp_dir().join(format!("kvroute-timing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    };
    let own = write(
        "own.toml",
        "base_us = 1000\nprefill_us_per_token = 2\ndecode_us_per_token = 3\n\
         context_us_per_token = 0.5\n",
    );
    let model = TimingModel::from_arg(&own).unwrap();
    assert_eq!(ms(model, prefill(1_000)), 3.0);
    // Bad files are refused with the reason.
    for (name, text, words) in [
        ("typo.toml", "base_us = 1\nprefill_us = 2\ndecode_us_per_token = 3\n", "prefill_us"),
        ("neg.toml", "base_us = -1\nprefill_us_per_token = 2\ndecode_us_per_token = 3\n", "base_us"),
        (
            "both.toml",
            "base_us = 1\nprefill_us_per_token = 2\ndecode_us_per_token = 3\n\
             context_us_per_token = 1\nmemory_tb_per_s = 2\n",
            "not both",
        ),
        (
            "half.toml",
            "base_us = 1\nprefill_us_per_token = 2\ndecode_us_per_token = 3\nkv_bytes_per_token = 8\n",
            "memory_tb_per_s",
        ),
        ("junk.toml", "base_us = [", "not a timing calibration"),
    ] {
        let e = TimingModel::from_arg(&write(name, text)).unwrap_err().to_string();
        assert!(e.contains(words), "{name}: {e}");
    }
    let missing = dir.join("missing.toml");
    let e = TimingModel::from_arg(&missing.to_string_lossy()).unwrap_err();
    assert!(e.to_string().starts_with("reading "), "{e}");
    let e = TimingModel::from_arg("h100-fast").unwrap_err().to_string();
    assert!(
        e.contains("blis-h100") && e.contains("calibration file"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
