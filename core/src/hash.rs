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
//!   starts at `XXH3_SEED` and each non-empty name is hashed into it ([`HashSeed::new`]).
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
//! `MM_INLINE` multimodal objects). On little-endian targets a token slice is hashed in
//! place, reinterpreted as its bytes, because that measured fastest: about 30 ns per 64-token
//! block, against about 36 ns when copying the tokens into a stack buffer first and 43 ns with
//! the streaming hasher fed from a stack buffer (the gap is 2× for 16-token blocks). Big-endian
//! targets take the safe copying path.

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// The xxh3 seed of block hashing without LoRA or salt, and always the seed of chaining.
pub(crate) const XXH3_SEED: u64 = 1337;

/// The most multimodal hashes a block may carry and still be sorted on the stack.
pub(crate) const MM_INLINE: usize = 16;

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
    /// (wrapping) to `XXH3_SEED`, so a salt equal to some adapter's name still yields a
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
    /// `XXH3_SEED`: no LoRA, no salt.
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
    /// [`local_hash`](Self::local_hash). Allocates only beyond `MM_INLINE` hashes.
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
mod tests;
