//! Which blocks of a prompt are checkpoints (the first [`DENSE_BLOCKS`], then every
//! [`STRIDE`]-th, and the last) and their keys ([`checkpoint_keys_extend`]): a chain over the
//! checkpoints, each step digesting the run of blocks since the previous one.

use crate::hash::LocalHash;

/// Blocks recorded one by one at the start of a prompt.
pub(crate) const DENSE_BLOCKS: usize = 16;

/// Past [`DENSE_BLOCKS`], one block in this many is recorded.
pub(crate) const STRIDE: usize = 16;

/// Whether block `i` of a prompt of `n` full blocks is a checkpoint.
#[cfg(test)]
pub(super) fn is_checkpoint(i: usize, n: usize) -> bool {
    i < DENSE_BLOCKS || (i + 1) % STRIDE == 0 || i + 1 == n
}

/// The checkpoint positions of a prompt of `n` full blocks, in order.
#[cfg(test)]
pub(super) fn checkpoints(n: usize) -> impl Iterator<Item = usize> + Clone {
    let dense = 0..n.min(DENSE_BLOCKS);
    let strided = (DENSE_BLOCKS..n).filter(move |&i| is_checkpoint(i, n));
    dense.chain(strided)
}

/// The key before a prompt's first checkpoint.
const MARK_SEED: u64 = 0x243f_6a88_85a3_08d3;

/// One step of a key chain: `(k ^ x) · M`, M odd; for a given `k` a bijection of `x` and for
/// a given `x` a bijection of `k` (see [`crate::load::prefix_keys_into`]).
#[inline(always)]
fn chain(k: u64, x: u64) -> u64 {
    (k ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A digest of the local hashes of a run of blocks, in four independent multiply chains folded
/// together. Each step of a chain takes a pair of blocks, the second rotated by an odd amount
/// first (so a pair and its swap differ unless the two hashes are equal or complements), and
/// a chain's step is its pair's position in the run mod 4: one multiply per two blocks, four
/// in flight, where one chain over the run would wait on each multiply in turn. The run's
/// length seeds the first chain, so runs of different lengths never meet by construction (a
/// lone last block chained alone would otherwise equal a pair ending in a zero hash).
#[inline(always)]
fn digest(run: &[LocalHash]) -> u64 {
    const SEEDS: [u64; 4] = [
        0x1319_8a2e_0370_7344,
        0xa409_3822_299f_31d0,
        0x082e_fa98_ec4e_6c89,
        0x4528_21e6_38d0_1377,
    ];
    #[inline(always)]
    fn pair(a: LocalHash, b: LocalHash) -> u64 {
        a.0 ^ b.0.rotate_left(23)
    }
    let mut lanes = SEEDS;
    lanes[0] ^= run.len() as u64;
    let mut eights = run.chunks_exact(8);
    for eight in &mut eights {
        for (lane, two) in lanes.iter_mut().zip(eight.chunks_exact(2)) {
            *lane = chain(*lane, pair(two[0], two[1]));
        }
    }
    let rest = eights.remainder();
    let mut twos = rest.chunks_exact(2);
    for (lane, two) in lanes.iter_mut().zip(&mut twos) {
        *lane = chain(*lane, pair(two[0], two[1]));
    }
    if let [last] = twos.remainder() {
        // A lone last block is chained alone, into a lane no pair of a run this short uses.
        lanes[3] = chain(lanes[3], last.0);
    }
    lanes[0] ^ lanes[1].rotate_left(16) ^ lanes[2].rotate_left(32) ^ lanes[3].rotate_left(48)
}

/// Continues `marks` (the checkpoint keys of the prompt `locals`, in checkpoint order) up to
/// checkpoint `upto` (exclusive; at most the prompt's checkpoints). The key of a checkpoint
/// chains the previous one with its run of blocks: the block itself in the dense part, a
/// digest of the blocks since the previous checkpoint past it. It names the prefix up to
/// that block: two prompts share it exactly when they share the prefix (a 2⁻⁶⁴ accident
/// aside), whatever their lengths, as the runs before a prompt's last block do not depend on
/// its length.
pub fn checkpoint_keys_extend(locals: &[LocalHash], marks: &mut Vec<u64>, upto: usize) {
    let n = locals.len();
    let upto = upto.min(checkpoint_count(n));
    let mut k = marks.last().copied().unwrap_or(MARK_SEED);
    let mut j = marks.len();
    marks.reserve(upto.saturating_sub(j));
    // The dense checkpoints are the blocks themselves.
    while j < upto.min(DENSE_BLOCKS) {
        k = chain(k, locals[j].0);
        marks.push(k);
        j += 1;
    }
    if j >= upto {
        return;
    }
    // Then runs of STRIDE blocks, the last one cut at the prompt's end.
    let mut start = checkpoint_at(j - 1, n) + 1;
    while j < upto {
        let end = checkpoint_at(j, n);
        let run = &locals[start..=end];
        // Every run but the last is a full stride: digested with its length known.
        let d = match <&[LocalHash; STRIDE]>::try_from(run) {
            Ok(full) => digest(full),
            Err(_) => digest(run),
        };
        k = chain(k, d);
        marks.push(k);
        start = end + 1;
        j += 1;
    }
}

/// Checkpoints of a prompt of `n` full blocks.
pub(super) fn checkpoint_count(n: usize) -> usize {
    if n <= DENSE_BLOCKS {
        return n;
    }
    // Blocks i past the dense ones with (i + 1) a multiple of STRIDE.
    let strided = n / STRIDE - DENSE_BLOCKS / STRIDE;
    let last_extra = usize::from(n % STRIDE != 0);
    DENSE_BLOCKS + strided + last_extra
}

/// The index of the first checkpoint at or past block `i` of a prompt of `n` full blocks,
/// which has `count` of them (`count` when there is none).
pub(super) fn first_checkpoint_from(i: usize, n: usize, count: usize) -> usize {
    let (mut lo, mut hi) = (0usize, count);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if checkpoint_at(mid, n) < i {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The `j`-th checkpoint of a prompt of `n` full blocks.
pub(super) fn checkpoint_at(j: usize, n: usize) -> usize {
    if j < DENSE_BLOCKS.min(n) {
        return j;
    }
    // Strided checkpoints are the blocks i with (i + 1) % STRIDE == 0 past the dense ones.
    let first_strided = DENSE_BLOCKS.div_ceil(STRIDE) * STRIDE;
    let first_strided = if first_strided == DENSE_BLOCKS {
        first_strided + STRIDE
    } else {
        first_strided
    };
    let i = first_strided + (j - DENSE_BLOCKS) * STRIDE - 1;
    i.min(n - 1)
}
