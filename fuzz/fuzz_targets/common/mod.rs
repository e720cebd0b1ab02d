//! What both index targets decode their input with.

use arbitrary::{Arbitrary, Unstructured};
use kvroute_core::StorageTier;

/// Operations until the input runs out (at most `max`), rather than `Vec`'s one continue-byte
/// per element: the script's length follows the input's, and random bytes make long scripts.
pub fn ops_until_empty<'a, T: Arbitrary<'a>>(
    u: &mut Unstructured<'a>,
    max: usize,
) -> arbitrary::Result<Vec<T>> {
    let mut ops = Vec::new();
    while !u.is_empty() && ops.len() < max {
        ops.push(u.arbitrary()?);
    }
    Ok(ops)
}

/// A storage tier from any byte.
pub fn tier(t: u8) -> StorageTier {
    StorageTier::ALL[usize::from(t) % StorageTier::COUNT]
}
