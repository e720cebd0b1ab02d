//! Output decay arithmetic: where a request's output blocks begin, what is left of its
//! expected output, and how much decay takes off a count of blocks, in `DECAY_SCALE` units
//! (see the module comment of [`crate::load`]).

/// One output block in [`LoadView::output_decay`](super::LoadView::output_decay)'s fixed point.
pub(crate) const DECAY_SCALE: u64 = 1 << 16;

/// Tokens generated when a request's `k`-th output block begins (`k ≥ 1`): the sequence first
/// needs `ceil(isl / bs) + k` blocks at its `bs · (ceil(isl / bs) + k − 1) + 1`-th token, the
/// reference's "generation crossed a block boundary". 0 for `k = 0`.
pub fn generated_at_block(prompt_tokens: u64, block_size: u32, k: u64) -> u64 {
    if k == 0 {
        return 0;
    }
    let bs = u64::from(block_size.max(1));
    (bs * (prompt_tokens.div_ceil(bs) + k - 1) + 1).saturating_sub(prompt_tokens)
}

/// The reference's decay fraction: what is left of the expected output after `generated`
/// tokens, `max(0, 1 − generated / max(expected, 1))`.
pub fn remaining_fraction(generated: u64, expected_output_tokens: u32) -> f64 {
    (1.0 - generated as f64 / f64::from(expected_output_tokens.max(1))).max(0.0)
}

/// How much of `k` output blocks decay has taken off, in `DECAY_SCALE` units:
/// `k − k · remaining_fraction(g_k, E)`, rounded. Never decreases with `k`.
pub fn output_decay(
    prompt_tokens: u64,
    block_size: u32,
    expected_output_tokens: u32,
    k: u64,
) -> u64 {
    let g = generated_at_block(prompt_tokens, block_size, k);
    decayed(k, remaining_fraction(g, expected_output_tokens))
}

/// What weighing `blocks` by `left` (in [0, 1]) takes off them, in `DECAY_SCALE` units:
/// `blocks − blocks · left`, rounded.
pub fn decayed(blocks: u64, left: f64) -> u64 {
    let full = blocks * DECAY_SCALE;
    let weighted = (full as f64 * left).round() as u64;
    full - weighted.min(full)
}
