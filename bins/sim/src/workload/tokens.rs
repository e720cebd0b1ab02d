//! Deterministic pseudo-tokens: the content of every synthetic prompt.

/// A pseudo-token: a deterministic 17-bit value (a vocabulary of 131,072) of a content stream,
/// an item of it and a position in the item. Distinct items give unrelated token runs.
pub fn pseudo_token(stream: u64, item: u64, position: u64) -> u32 {
    let mixed = splitmix64(splitmix64(stream.wrapping_shl(56) ^ item) ^ position);
    (mixed >> 47) as u32
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
