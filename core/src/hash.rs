//! Block hashing: how a request's tokens become the keys of the prefix index.
//!
//! ```text
//!  tokens   [t0 .. t15][t16 .. t31][t32 .. t40]     block size 16
//!                │           │          └─ partial block: dropped
//!              xxh3        xxh3             (an engine caches only full blocks)
//!                ▼           ▼
//!  LocalHash    L0          L1           xxh3-64 of the block's tokens as u32 LE bytes,
//!                │           │           seeded by the request's HashSeed
//!  SeqHash      S0 ───────▶ S1           S0 = L0, Si = xxh3(le(S(i-1)) ++ le(Li), 1337)
//! ```
//!
//! * **Full blocks only.** Engines store and evict KV cache in whole blocks, so a trailing
//!   partial block can never match anything and is not hashed.
//! * **The seed isolates caches.** Blocks computed under a LoRA adapter, or under a cache salt
//!   (a tenant's isolation key), hold different KV values for the same tokens, so the seed
//!   starts at [`XXH3_SEED`] and each non-empty name is hashed into it ([`HashSeed::new`]).
//!   Empty names count as absent.
//! * **Multimodal blocks** append the hashes of the objects (images, audio) overlapping the
//!   block, sorted ascending, to the token bytes, so equal placeholder tokens standing for
//!   different images do not collide.
//! * **Eagle** (speculative decoding) windows are one token longer than the block size and still
//!   step by the block size.
//! * **Chaining.** A [`LocalHash`] names a block's content; a [`SeqHash`] names the block *and
//!   its whole prefix*. The chain always uses seed 1337: the request's seed already lives in
//!   every local hash.
//!
//! The scheme is bit-for-bit that of dynamo-kv-router 1.6.1 (`compute_block_hash_for_seq`,
//! `compute_seq_hash_for_block`), so our hashes agree with events published by its workers;
//! `benches/tests/hash_compat.rs` checks this on random inputs.
//!
//! **Cost.** Hashing never allocates (except for a block overlapping more than
//! [`MM_INLINE`] multimodal objects). On little-endian targets a token slice is hashed in
//! place, reinterpreted as its bytes, because that measured fastest: about 30 ns per 64-token
//! block, against about 36 ns when copying the tokens into a stack buffer first and 43 ns with
//! the streaming hasher fed from a stack buffer (the gap is 2× for 16-token blocks). Big-endian
//! targets take the safe copying path.

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// The xxh3 seed of block hashing without LoRA or salt, and always the seed of chaining.
pub const XXH3_SEED: u64 = 1337;

/// The most multimodal hashes a block may carry and still be sorted on the stack.
pub const MM_INLINE: usize = 16;

/// Hash of one block's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct LocalHash(pub u64);

/// A block hash as its 64-bit word: stored runs keep plain words, queries keep [`LocalHash`]es.
pub(crate) trait HashWord: Copy {
    fn word(self) -> u64;
}

impl HashWord for u64 {
    #[inline(always)]
    fn word(self) -> u64 {
        self
    }
}

impl HashWord for LocalHash {
    #[inline(always)]
    fn word(self) -> u64 {
        self.0
    }
}

/// How many leading hashes `a` and `b` share: eight compared at a time while all eight agree,
/// then one at a time.
#[inline]
pub(crate) fn common_prefix<A: HashWord, B: HashWord>(a: &[A], b: &[B]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while i + 8 <= n {
        let diff = a[i..i + 8]
            .iter()
            .zip(&b[i..i + 8])
            .fold(0, |d, (x, y)| d | (x.word() ^ y.word()));
        if diff != 0 {
            break;
        }
        i += 8;
    }
    while i < n && a[i].word() == b[i].word() {
        i += 1;
    }
    i
}
/// Chained hash of a block and every block before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SeqHash(pub u64);

/// The seed of block hashing for a request: 1337 adjusted for LoRA name and cache salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HashSeed(pub u64);

impl HashSeed {
    /// The seed for a request run under `lora_name` with cache salt `cache_salt` (dynamo
    /// calls the salt `cache_namespace`). `None` and `Some("")` mean the same: absent.
    ///
    /// The LoRA name is hashed with inner seed 0 and the salt with inner seed 1, each added
    /// (wrapping) to [`XXH3_SEED`], so a salt equal to some adapter's name still yields a
    /// different seed than that adapter.
    pub fn new(lora_name: Option<&str>, cache_salt: Option<&str>) -> Self {
        let mut seed = XXH3_SEED;
        if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
        }
        if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
        }
        Self(seed)
    }
}

impl Default for HashSeed {
    /// [`XXH3_SEED`]: no LoRA, no salt.
    fn default() -> Self {
        Self(XXH3_SEED)
    }
}

/// Splits token sequences into blocks and hashes each: a small `Copy` configuration.
///
/// The block size must be positive to be useful: with a block size of 0 there are no full
/// blocks, and every `local_hashes*` method yields nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHasher {
    block_size: usize,
    seed: HashSeed,
    eagle: bool,
}

impl BlockHasher {
    /// A hasher of `block_size`-token blocks with the default seed, Eagle windows off.
    /// `block_size` should be > 0; a block size of 0 yields no blocks.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            seed: HashSeed::default(),
            eagle: false,
        }
    }

    /// The same hasher with the request's seed (see [`HashSeed::new`]).
    #[must_use]
    pub fn with_seed(self, seed: HashSeed) -> Self {
        Self { seed, ..self }
    }

    /// The same hasher with Eagle windows on or off: each block is hashed together with the
    /// first token of the next block (`block_size + 1` tokens), blocks still `block_size` apart.
    #[must_use]
    pub fn with_eagle(self, eagle: bool) -> Self {
        Self { eagle, ..self }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of full blocks in `n_tokens` tokens. With Eagle windows the last block also needs
    /// the token after it, so this is `(n_tokens - 1) / block_size`. Zero for block size 0.
    pub fn block_count(&self, n_tokens: usize) -> usize {
        if self.block_size == 0 {
            0
        } else if self.eagle {
            n_tokens.saturating_sub(1) / self.block_size
        } else {
            n_tokens / self.block_size
        }
    }

    /// The local hash of exactly `block_tokens` under this hasher's seed, whatever its length
    /// (pass `block_size + 1` tokens for an Eagle window). Does not allocate.
    #[inline]
    pub fn local_hash(&self, block_tokens: &[u32]) -> LocalHash {
        LocalHash(hash_tokens(block_tokens, self.seed.0))
    }

    /// The local hash of `block_tokens` together with the hashes of the multimodal objects
    /// overlapping the block, in any order (they are sorted here). With no hashes this is
    /// [`local_hash`](Self::local_hash). Allocates only beyond [`MM_INLINE`] hashes.
    pub fn local_hash_mm(&self, block_tokens: &[u32], mm_hashes: &[u64]) -> LocalHash {
        if mm_hashes.is_empty() {
            return self.local_hash(block_tokens);
        }
        let mut state = Xxh3::with_seed(self.seed.0);
        update_tokens(&mut state, block_tokens);
        if mm_hashes.len() <= MM_INLINE {
            let mut inline = [0_u64; MM_INLINE];
            let sorted = &mut inline[..mm_hashes.len()];
            sorted.copy_from_slice(mm_hashes);
            sorted.sort_unstable();
            update_u64s(&mut state, sorted);
        } else {
            let mut sorted = mm_hashes.to_vec();
            sorted.sort_unstable();
            update_u64s(&mut state, &sorted);
        }
        LocalHash(state.digest())
    }

    /// Replaces the contents of `out` with the local hashes of every full block of `tokens`.
    /// Allocation-free when `out` already has the capacity.
    pub fn local_hashes_into(&self, tokens: &[u32], out: &mut Vec<LocalHash>) {
        out.clear();
        out.extend(self.blocks(tokens).map(|block| self.local_hash(block)));
    }

    /// The local hashes of every full block of `tokens`, in a new `Vec`.
    pub fn local_hashes(&self, tokens: &[u32]) -> Vec<LocalHash> {
        let mut out = Vec::new();
        self.local_hashes_into(tokens, &mut out);
        out
    }

    /// Like [`local_hashes_into`](Self::local_hashes_into), with multimodal hashes: `mm[i]`
    /// holds the hashes of the objects overlapping block `i`, in any order. A block with no
    /// entry in `mm`, or an empty one, is hashed from its tokens alone.
    pub fn local_hashes_mm_into(&self, tokens: &[u32], mm: &[&[u64]], out: &mut Vec<LocalHash>) {
        out.clear();
        out.extend(self.blocks(tokens).enumerate().map(|(i, block)| {
            let mm_hashes = mm.get(i).copied().unwrap_or_default();
            self.local_hash_mm(block, mm_hashes)
        }));
    }

    /// The token window of each full block, in order.
    fn blocks<'t>(&self, tokens: &'t [u32]) -> impl ExactSizeIterator<Item = &'t [u32]> {
        let stride = self.block_size;
        let window = stride + usize::from(self.eagle);
        (0..self.block_count(tokens.len())).map(move |i| &tokens[i * stride..i * stride + window])
    }
}

/// The sequence hash of the block after `parent` whose local hash is `local`. (The first
/// block of a sequence has no parent: its sequence hash is its local hash.)
#[inline]
pub fn next_seq_hash(parent: SeqHash, local: LocalHash) -> SeqHash {
    let mut bytes = [0_u8; 16];
    bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
    bytes[8..].copy_from_slice(&local.0.to_le_bytes());
    SeqHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
}

/// Replaces the contents of `out` with the sequence hashes of the blocks whose local hashes
/// are `locals`. Allocation-free when `out` already has the capacity.
pub fn seq_hashes_into(locals: &[LocalHash], out: &mut Vec<SeqHash>) {
    out.clear();
    out.reserve(locals.len());
    let Some((first, rest)) = locals.split_first() else {
        return;
    };
    let mut seq = SeqHash(first.0);
    out.push(seq);
    for &local in rest {
        seq = next_seq_hash(seq, local);
        out.push(seq);
    }
}

/// The sequence hashes of the blocks whose local hashes are `locals`, in a new `Vec`.
pub fn seq_hashes(locals: &[LocalHash]) -> Vec<SeqHash> {
    let mut out = Vec::new();
    seq_hashes_into(locals, &mut out);
    out
}

/// xxh3-64 of the little-endian bytes of `tokens`.
#[inline]
fn hash_tokens(tokens: &[u32], seed: u64) -> u64 {
    #[cfg(target_endian = "little")]
    {
        xxh3_64_with_seed(le_bytes(tokens), seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let mut state = Xxh3::with_seed(seed);
        update_tokens_copying(&mut state, tokens);
        state.digest()
    }
}

/// Feeds the little-endian bytes of `tokens` to `state`.
#[inline]
fn update_tokens(state: &mut Xxh3, tokens: &[u32]) {
    #[cfg(target_endian = "little")]
    state.update(le_bytes(tokens));
    #[cfg(not(target_endian = "little"))]
    update_tokens_copying(state, tokens);
}

/// `tokens` viewed as the bytes they are made of, which on this target are their
/// little-endian encodings.
#[cfg(target_endian = "little")]
#[allow(unsafe_code)]
#[inline]
fn le_bytes(tokens: &[u32]) -> &[u8] {
    // SAFETY:
    // - Valid for reads: the pointer and length describe exactly the memory of `tokens`, a
    //   live shared borrow, and the returned slice carries the same lifetime, so the memory
    //   stays allocated and unmutated while the slice exists.
    // - Alignment: `u8` needs alignment 1, which every pointer meets.
    // - Initialized, valid values: `u32` has no padding, so all its bytes are initialized,
    //   and every byte pattern is a valid `u8`.
    // - Size: `size_of_val(tokens)` is the size of an existing slice, so it is at most
    //   `isize::MAX`.
    // - Meaning: the `cfg(target_endian = "little")` on this function guarantees each `u32`
    //   is stored as its `to_le_bytes()`, the encoding the hash is defined over.
    unsafe {
        std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens))
    }
}

/// Feeds the little-endian bytes of `tokens` to `state` through a stack buffer: the safe,
/// endian-independent way (used on big-endian targets, tested everywhere).
#[cfg(any(test, not(target_endian = "little")))]
fn update_tokens_copying(state: &mut Xxh3, tokens: &[u32]) {
    const CHUNK: usize = 64;
    let mut buf = [0_u8; CHUNK * 4];
    for chunk in tokens.chunks(CHUNK) {
        for (dst, token) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&token.to_le_bytes());
        }
        state.update(&buf[..chunk.len() * 4]);
    }
}

/// Feeds the little-endian bytes of `values` to `state` through a stack buffer.
fn update_u64s(state: &mut Xxh3, values: &[u64]) {
    const CHUNK: usize = 16;
    let mut buf = [0_u8; CHUNK * 8];
    for chunk in values.chunks(CHUNK) {
        for (dst, value) in buf.chunks_exact_mut(8).zip(chunk) {
            dst.copy_from_slice(&value.to_le_bytes());
        }
        state.update(&buf[..chunk.len() * 8]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    /// The scheme written out literally: build every byte string, hash it in one call.
    mod reference {
        use super::super::XXH3_SEED;
        use xxhash_rust::xxh3::xxh3_64_with_seed;

        pub fn block_hashes(
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

        pub fn seq_hashes(locals: &[u64]) -> Vec<u64> {
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
}
