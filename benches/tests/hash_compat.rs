//! Our block hashing must equal dynamo-kv-router 1.6.1's bit for bit, or the index would never
//! match the blocks its workers announce. Random requests (seeded, so every run is the same)
//! go through both implementations: plain and multimodal blocks, every kind of LoRA name and
//! cache salt, Eagle windows on and off.

use dynamo_kv_router::compute_block_hash_for_seq;
use dynamo_kv_router::protocols::{
    compute_seq_hash_for_block, BlockExtraInfo, BlockHashOptions, BlockMmObjectInfo,
};
use kvroute_core::{next_seq_hash, seq_hashes, BlockHasher, HashSeed, SeqHash};
use rand::distributions::Alphanumeric;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const CASES: usize = 400;
const BLOCK_SIZES: [usize; 5] = [1, 16, 32, 64, 100];

/// One random request, in the shape both implementations take.
#[derive(Debug)]
struct Case {
    tokens: Vec<u32>,
    block_size: usize,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    eagle: bool,
    /// Dynamo's per-block multimodal info: `None` for most blocks.
    mm_infos: Option<Vec<Option<BlockExtraInfo>>>,
}

impl Case {
    fn random(rng: &mut SmallRng) -> Self {
        let block_size = BLOCK_SIZES[rng.gen_range(0..BLOCK_SIZES.len())];
        let len = if rng.gen_bool(0.2) {
            // A whole number of blocks, give or take one token.
            let blocks = rng.gen_range(0..=2000 / block_size);
            (blocks * block_size + rng.gen_range(0..=2)).saturating_sub(1)
        } else {
            rng.gen_range(0..2000)
        };
        let tokens = (0..len).map(|_| rng.gen_range(0..200_000)).collect();
        let mm_infos = rng.gen_bool(0.4).then(|| {
            // Sometimes shorter than the block list, sometimes longer.
            let n = rng.gen_range(0..=len / block_size + 3);
            (0..n)
                .map(|_| {
                    rng.gen_bool(0.25)
                        .then(|| random_extra_info(rng, block_size))
                })
                .collect()
        });
        Self {
            tokens,
            block_size,
            lora_name: random_name(rng),
            cache_salt: random_name(rng),
            eagle: rng.gen_bool(0.3),
            mm_infos,
        }
    }

    fn options(&self) -> BlockHashOptions<'_> {
        BlockHashOptions {
            block_mm_infos: self.mm_infos.as_deref(),
            lora_name: self.lora_name.as_deref(),
            cache_namespace: self.cache_salt.as_deref(),
            is_eagle: Some(self.eagle),
        }
    }

    /// Everything but the tokens, for assert messages.
    fn describe(&self, index: usize) -> String {
        let mm_blocks = self
            .mm_infos
            .as_ref()
            .map(|infos| infos.iter().filter(|info| info.is_some()).count());
        format!(
            "case {index}: {} tokens, block size {}, lora {:?}, salt {:?}, eagle {}, \
             multimodal blocks {mm_blocks:?}",
            self.tokens.len(),
            self.block_size,
            self.lora_name,
            self.cache_salt,
            self.eagle,
        )
    }
}

/// `None`, `Some("")`, an ASCII name or a name with arbitrary Unicode.
fn random_name(rng: &mut SmallRng) -> Option<String> {
    match rng.gen_range(0..4) {
        0 => None,
        1 => Some(String::new()),
        2 => {
            let len = rng.gen_range(1..24);
            Some(
                (0..len)
                    .map(|_| char::from(rng.sample(Alphanumeric)))
                    .collect(),
            )
        }
        _ => {
            let len = rng.gen_range(1..8);
            Some((0..len).map(|_| rng.gen::<char>()).collect())
        }
    }
}

/// Up to 20 objects (past the stack-sorted limit), hashes sometimes repeated or extreme.
fn random_extra_info(rng: &mut SmallRng, block_size: usize) -> BlockExtraInfo {
    let count = if rng.gen_bool(0.1) {
        rng.gen_range(17..=20)
    } else {
        rng.gen_range(0..5)
    };
    let mut mm_objects: Vec<BlockMmObjectInfo> = (0..count)
        .map(|_| {
            let start = rng.gen_range(0..block_size);
            BlockMmObjectInfo {
                mm_hash: match rng.gen_range(0..8) {
                    0 => 0,
                    1 => u64::MAX,
                    _ => rng.gen(),
                },
                offsets: vec![(start, rng.gen_range(start..=block_size))],
            }
        })
        .collect();
    if mm_objects.len() > 1 && rng.gen_bool(0.3) {
        let repeated = mm_objects[0].clone();
        mm_objects.push(repeated);
    }
    BlockExtraInfo { mm_objects }
}

#[test]
fn hashes_match_dynamo_on_random_requests() {
    let mut rng = SmallRng::seed_from_u64(0x6b76_726f_7574_6531);
    let mut checked_blocks = 0;
    for index in 0..CASES {
        let case = Case::random(&mut rng);
        let what = case.describe(index);

        let expected_locals: Vec<u64> =
            compute_block_hash_for_seq(&case.tokens, case.block_size as u32, case.options())
                .iter()
                .map(|hash| hash.0)
                .collect();
        let expected_seqs = compute_seq_hash_for_block(
            &expected_locals
                .iter()
                .map(|&hash| dynamo_kv_router::LocalBlockHash(hash))
                .collect::<Vec<_>>(),
        );

        let hasher = BlockHasher::new(case.block_size)
            .with_seed(HashSeed::new(
                case.lora_name.as_deref(),
                case.cache_salt.as_deref(),
            ))
            .with_eagle(case.eagle);
        assert_eq!(
            hasher.block_count(case.tokens.len()),
            expected_locals.len(),
            "{what}: block count"
        );

        let mut locals = Vec::new();
        match &case.mm_infos {
            None => hasher.local_hashes_into(&case.tokens, &mut locals),
            Some(infos) => {
                let per_block: Vec<Vec<u64>> = infos
                    .iter()
                    .map(|info| match info {
                        None => Vec::new(),
                        Some(info) => info.mm_objects.iter().map(|obj| obj.mm_hash).collect(),
                    })
                    .collect();
                let per_block: Vec<&[u64]> = per_block.iter().map(Vec::as_slice).collect();
                hasher.local_hashes_mm_into(&case.tokens, &per_block, &mut locals);
            }
        }
        let actual_locals: Vec<u64> = locals.iter().map(|hash| hash.0).collect();
        assert_eq!(actual_locals, expected_locals, "{what}: local hashes");

        let actual_seqs: Vec<u64> = seq_hashes(&locals).iter().map(|hash| hash.0).collect();
        assert_eq!(actual_seqs, expected_seqs, "{what}: sequence hashes");

        // The incremental form agrees with the batch form.
        let mut parent: Option<SeqHash> = None;
        for (block, (&local, &expected)) in locals.iter().zip(&expected_seqs).enumerate() {
            let seq = parent.map_or(SeqHash(local.0), |parent| next_seq_hash(parent, local));
            assert_eq!(seq.0, expected, "{what}: next_seq_hash at block {block}");
            parent = Some(seq);
        }
        checked_blocks += locals.len();
    }
    // Guard against a generator that silently stopped producing blocks.
    assert!(
        checked_blocks > 10 * CASES,
        "only {checked_blocks} blocks checked"
    );
}

#[test]
fn block_size_zero_matches_dynamo() {
    let tokens: Vec<u32> = (0..50).collect();
    for eagle in [false, true] {
        let options = BlockHashOptions {
            is_eagle: Some(eagle),
            ..BlockHashOptions::default()
        };
        assert!(compute_block_hash_for_seq(&tokens, 0, options).is_empty());
        assert!(BlockHasher::new(0)
            .with_eagle(eagle)
            .local_hashes(&tokens)
            .is_empty());
    }
}
