use super::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The scheme written out literally: build every byte string, hash it in one call.
mod reference {
    use super::super::XXH3_SEED;
    use xxhash_rust::xxh3::xxh3_64_with_seed;

    pub(super) fn block_hashes(
        tokens: &[u32],
        block_size: usize,
        seed: u64,
        eagle: bool,
        mm: &[Vec<u64>],
    ) -> Vec<u64> {
        let mut hashes = Vec::new();
        if block_size == 0 {
            return hashes;
        }
        let window = if eagle { block_size + 1 } else { block_size };
        let mut start = 0;
        let mut block = 0;
        while start + window <= tokens.len() {
            let mut bytes = Vec::new();
            for token in &tokens[start..start + window] {
                bytes.extend_from_slice(&token.to_le_bytes());
            }
            let mut mm_hashes = mm.get(block).cloned().unwrap_or_default();
            mm_hashes.sort();
            for mm_hash in mm_hashes {
                bytes.extend_from_slice(&mm_hash.to_le_bytes());
            }
            hashes.push(xxh3_64_with_seed(&bytes, seed));
            start += block_size;
            block += 1;
        }
        hashes
    }

    pub(super) fn seq_hashes(locals: &[u64]) -> Vec<u64> {
        let mut seqs: Vec<u64> = Vec::new();
        for &local in locals {
            let seq = match seqs.last() {
                None => local,
                Some(&parent) => {
                    let mut bytes = parent.to_le_bytes().to_vec();
                    bytes.extend_from_slice(&local.to_le_bytes());
                    xxh3_64_with_seed(&bytes, XXH3_SEED)
                }
            };
            seqs.push(seq);
        }
        seqs
    }
}

fn raw(locals: &[LocalHash]) -> Vec<u64> {
    locals.iter().map(|h| h.0).collect()
}

// Known answers, computed with xxhash-rust directly from hand-built byte strings.
const L_1_4: u64 = 14_643_705_804_678_351_452; // tokens [1, 2, 3, 4], seed 1337
const L_5_8: u64 = 16_777_012_769_546_811_212; // tokens [5, 6, 7, 8], seed 1337
const S_5_8: u64 = 4_945_711_292_740_353_085; // chain of the two above
const SEED_LORA: u64 = 15_027_594_411_539_222_757; // lora "llama-lora"
const SEED_SALT: u64 = 16_574_661_553_112_729_674; // salt "tenant-7"
const SEED_BOTH: u64 = 13_155_511_890_942_399_478; // both
const L_1_4_BOTH: u64 = 2_437_768_551_476_636_910; // tokens [1, 2, 3, 4], SEED_BOTH
const L_1_4_MM: u64 = 3_230_850_727_472_481_959; // tokens [1, 2, 3, 4] ++ mm 10, 20, 30
const L_EAGLE_0: u64 = 15_024_015_205_894_559_313; // tokens [1, 2, 3]
const L_EAGLE_1: u64 = 12_796_124_156_123_117_667; // tokens [3, 4, 5]

#[test]
fn hash_known_answers() {
    let hasher = BlockHasher::new(4);
    let locals = hasher.local_hashes(&[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(raw(&locals), [L_1_4, L_5_8]);
    assert_eq!(seq_hashes(&locals), [SeqHash(L_1_4), SeqHash(S_5_8)]);
    assert_eq!(
        next_seq_hash(SeqHash(L_1_4), LocalHash(L_5_8)),
        SeqHash(S_5_8)
    );
}

#[test]
fn hash_seed_known_answers() {
    assert_eq!(HashSeed::default(), HashSeed(XXH3_SEED));
    assert_eq!(HashSeed::new(None, None), HashSeed(XXH3_SEED));
    assert_eq!(HashSeed::new(Some("llama-lora"), None), HashSeed(SEED_LORA));
    assert_eq!(HashSeed::new(None, Some("tenant-7")), HashSeed(SEED_SALT));
    assert_eq!(
        HashSeed::new(Some("llama-lora"), Some("tenant-7")),
        HashSeed(SEED_BOTH)
    );
    let hasher = BlockHasher::new(4).with_seed(HashSeed(SEED_BOTH));
    assert_eq!(hasher.local_hash(&[1, 2, 3, 4]), LocalHash(L_1_4_BOTH));
}

#[test]
fn hash_mm_known_answer_any_order() {
    let hasher = BlockHasher::new(4);
    for order in [[10, 20, 30], [30, 10, 20], [20, 30, 10]] {
        assert_eq!(
            hasher.local_hash_mm(&[1, 2, 3, 4], &order),
            LocalHash(L_1_4_MM)
        );
    }
}

#[test]
fn hash_eagle_window_known_answers() {
    let hasher = BlockHasher::new(2).with_eagle(true);
    assert_eq!(
        raw(&hasher.local_hashes(&[1, 2, 3, 4, 5])),
        [L_EAGLE_0, L_EAGLE_1]
    );
    // The second window would need a sixth token for a third block.
    assert_eq!(hasher.block_count(5), 2);
    assert_eq!(hasher.block_count(6), 2);
    assert_eq!(hasher.block_count(7), 3);
    assert_eq!(hasher.block_count(0), 0);
}

#[test]
fn hash_drops_partial_block() {
    let hasher = BlockHasher::new(4);
    let full = hasher.local_hashes(&[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(
        hasher.local_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]),
        full
    );
    assert_eq!(raw(&hasher.local_hashes(&[1, 2, 3, 4, 5, 6, 7])), [L_1_4]);
    assert!(hasher.local_hashes(&[1, 2, 3]).is_empty());
    assert!(hasher.local_hashes(&[]).is_empty());
    assert_eq!(hasher.block_count(11), 2);
}

#[test]
fn hash_zero_block_size_yields_nothing() {
    let hasher = BlockHasher::new(0);
    assert_eq!(hasher.block_count(100), 0);
    assert!(hasher.local_hashes(&[1, 2, 3]).is_empty());
    assert!(hasher.with_eagle(true).local_hashes(&[1, 2, 3]).is_empty());
    let mut out = vec![LocalHash(7)];
    hasher.local_hashes_mm_into(&[1, 2, 3], &[&[1]], &mut out);
    assert!(out.is_empty());
}

#[test]
fn hash_lora_and_salt_change_hashes() {
    let tokens: Vec<u32> = (0..64).collect();
    let hash = |lora, salt| {
        BlockHasher::new(16)
            .with_seed(HashSeed::new(lora, salt))
            .local_hashes(&tokens)
    };
    let plain = hash(None, None);
    let variants = [
        hash(Some("a"), None),
        hash(Some("b"), None),
        hash(None, Some("a")),
        hash(None, Some("b")),
        hash(Some("a"), Some("b")),
        hash(Some("b"), Some("a")),
    ];
    for (i, v) in variants.iter().enumerate() {
        assert_ne!(*v, plain, "variant {i} equals the plain hashes");
        for (j, w) in variants.iter().enumerate().skip(i + 1) {
            assert_ne!(v, w, "variants {i} and {j} collide");
        }
    }
}

#[test]
fn hash_empty_names_count_as_absent() {
    assert_eq!(HashSeed::new(Some(""), Some("")), HashSeed::default());
    assert_eq!(HashSeed::new(Some(""), None), HashSeed::default());
    assert_eq!(HashSeed::new(None, Some("")), HashSeed::default());
    assert_eq!(
        HashSeed::new(Some("x"), Some("")),
        HashSeed::new(Some("x"), None)
    );
    assert_eq!(
        HashSeed::new(Some(""), Some("x")),
        HashSeed::new(None, Some("x"))
    );
}

#[test]
fn hash_mm_empty_or_missing_is_plain() {
    let hasher = BlockHasher::new(4);
    let tokens: Vec<u32> = (0..12).collect();
    let plain = hasher.local_hashes(&tokens);
    let mut out = Vec::new();
    hasher.local_hashes_mm_into(&tokens, &[], &mut out);
    assert_eq!(out, plain);
    hasher.local_hashes_mm_into(&tokens, &[&[], &[]], &mut out);
    assert_eq!(out, plain);
    hasher.local_hashes_mm_into(&tokens, &[&[], &[9]], &mut out);
    assert_eq!(out[0], plain[0]);
    assert_ne!(out[1], plain[1]);
    assert_eq!(out[2], plain[2]);
    assert_eq!(out[1], hasher.local_hash_mm(&tokens[4..8], &[9]));
}

#[test]
fn hash_mm_beyond_inline_sorts_on_heap() {
    let hasher = BlockHasher::new(4);
    let mut mm: Vec<u64> = (0..(MM_INLINE as u64 + 5))
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let expected = reference::block_hashes(&[1, 2, 3, 4], 4, XXH3_SEED, false, &[mm.clone()]);
    assert_eq!(hasher.local_hash_mm(&[1, 2, 3, 4], &mm).0, expected[0]);
    mm.reverse();
    assert_eq!(hasher.local_hash_mm(&[1, 2, 3, 4], &mm).0, expected[0]);
}

#[test]
fn hash_into_reuses_buffer() {
    let hasher = BlockHasher::new(4);
    let mut out = Vec::with_capacity(8);
    let capacity = out.capacity();
    hasher.local_hashes_into(&(0..32).collect::<Vec<u32>>(), &mut out);
    hasher.local_hashes_into(&[1, 2, 3, 4], &mut out);
    assert_eq!(raw(&out), [L_1_4]);
    assert_eq!(out.capacity(), capacity);
    let mut seqs = vec![SeqHash(1), SeqHash(2)];
    seq_hashes_into(&[], &mut seqs);
    assert!(seqs.is_empty());
}

#[test]
fn hash_copying_path_matches_in_place_path() {
    let mut rng = SmallRng::seed_from_u64(7);
    for len in [0, 1, 3, 4, 16, 59, 60, 61, 63, 64, 65, 128, 129, 200, 1000] {
        let tokens: Vec<u32> = (0..len).map(|_| rng.gen()).collect();
        let seed = rng.gen();
        let mut state = Xxh3::with_seed(seed);
        update_tokens_copying(&mut state, &tokens);
        assert_eq!(state.digest(), hash_tokens(&tokens, seed), "len {len}");
    }
}

#[test]
fn hash_matches_reference_on_random_inputs() {
    let mut rng = SmallRng::seed_from_u64(0x006b_7672_6f75_7465);
    for case in 0..300 {
        let block_size = [1, 2, 3, 16, 17, 64, 100][rng.gen_range(0..7)];
        let len = rng.gen_range(0..700);
        let tokens: Vec<u32> = (0..len).map(|_| rng.gen_range(0..200_000)).collect();
        let eagle = rng.gen_bool(0.3);
        let seed = if rng.gen_bool(0.5) {
            XXH3_SEED
        } else {
            rng.gen()
        };
        let mm: Vec<Vec<u64>> = (0..rng.gen_range(0..8))
            .map(|_| {
                (0..rng.gen_range(0..20))
                    .map(|_| rng.gen_range(0..50))
                    .collect()
            })
            .collect();
        let mm_refs: Vec<&[u64]> = mm.iter().map(Vec::as_slice).collect();

        let hasher = BlockHasher::new(block_size)
            .with_seed(HashSeed(seed))
            .with_eagle(eagle);
        let what = format!("case {case}: len {len}, block size {block_size}, eagle {eagle}");
        let expected_plain = reference::block_hashes(&tokens, block_size, seed, eagle, &[]);
        let plain = hasher.local_hashes(&tokens);
        assert_eq!(raw(&plain), expected_plain, "{what}: plain");
        assert_eq!(plain.len(), hasher.block_count(len), "{what}: block count");

        let mut with_mm = Vec::new();
        hasher.local_hashes_mm_into(&tokens, &mm_refs, &mut with_mm);
        let expected_mm = reference::block_hashes(&tokens, block_size, seed, eagle, &mm);
        assert_eq!(raw(&with_mm), expected_mm, "{what}: multimodal");

        let seqs: Vec<u64> = seq_hashes(&with_mm).iter().map(|s| s.0).collect();
        assert_eq!(
            seqs,
            reference::seq_hashes(&expected_mm),
            "{what}: sequence"
        );
    }
}
