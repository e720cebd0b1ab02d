//! Prefix keys: a cheap 64-bit chain over a prompt's block hashes, so that equal keys mean
//! equal prefixes, and the pass-through hasher for tables keyed by already-mixed hashes.

use std::hash::{BuildHasherDefault, Hasher};

use crate::hash::LocalHash;

/// A hasher for keys that are already well-mixed 64-bit hashes: it passes them through.
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) ^ u64::from(b) ^ (self.0 >> 56);
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

pub(super) type PassThrough = BuildHasherDefault<PassThroughHasher>;

/// The key before the first block.
const PREFIX_KEY_SEED: u64 = 0x243f_6a88_85a3_08d3;

/// One step of the prefix key chain: `k[i] = (k[i-1] ^ Li) · M`, M odd. For a given previous
/// key the step is a bijection of the block's hash, and for a given block a bijection of the
/// previous key, so two different prefixes share a key only by a 2⁻⁶⁴ accident of their
/// (already well mixed) local hashes. Its low bits mix poorly: tables hash the keys again.
/// Two operations on the chain, which a long prompt walks block by block.
#[inline(always)]
fn prefix_step(k: u64, l: LocalHash) -> u64 {
    (k ^ l.0).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The prefix key of each block of `locals` (each chained to the last from a constant seed).
/// Replaces `out`'s contents; allocation-free when `out` has the capacity. Internal to the
/// router (never compared with engine hashes), so it need only be cheap and collision-free.
pub(crate) fn prefix_keys_into(locals: &[LocalHash], out: &mut Vec<u64>) {
    out.clear();
    prefix_keys_extend(locals, out, locals.len());
}

/// Continues `out` (the prefix keys of `locals[..out.len()]`) up to `locals[..upto]`; the
/// same keys [`prefix_keys_into`] gives.
pub(crate) fn prefix_keys_extend(locals: &[LocalHash], out: &mut Vec<u64>, upto: usize) {
    let upto = upto.min(locals.len());
    let from = out.len().min(upto);
    let mut k = out.last().copied().unwrap_or(PREFIX_KEY_SEED);
    out.extend(locals[from..upto].iter().map(|&l| {
        k = prefix_step(k, l);
        k
    }));
}
