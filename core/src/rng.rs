//! A tiny seeded random number generator for routing decisions (wyrand).
//!
//! Routing needs randomness in three places: breaking cost ties (routers that broke ties by
//! index order herded every cache miss onto one worker), softmax sampling at a positive
//! temperature, and the random and power-of-two policies. None of them needs cryptographic
//! quality; all of them must be cheap, seedable for tests, and shareable between routing
//! threads without a lock.
//!
//! wyrand is a counter plus a mixer: the state advances by a constant and the output is a
//! 128-bit multiply of the state with itself folded to 64 bits. Because the step is a plain
//! add, a shared generator ([`SharedRng`]) is one `fetch_add` on an atomic: lock-free, and two
//! threads never see the same state.

use std::sync::atomic::{AtomicU64, Ordering};

const WY_INC: u64 = 0xa076_1d64_78bd_642f;
const WY_XOR: u64 = 0xe703_7ed1_a0b4_28db;

#[inline]
fn mix(state: u64) -> u64 {
    let t = u128::from(state) * u128::from(state ^ WY_XOR);
    (t as u64) ^ ((t >> 64) as u64)
}

/// A 64-bit mixer (one 128-bit multiply, folded): a cheap hash of an integer that is already
/// spread or must be spread, for internal keys and rendezvous weights.
#[inline]
pub fn mix64(x: u64) -> u64 {
    let t = u128::from(x ^ 0x9e37_79b9_7f4a_7c15) * u128::from(0xbf58_476d_1ce4_e5b9u64);
    (t as u64) ^ ((t >> 64) as u64)
}

/// A single-owner wyrand generator.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator starting from `seed`.
    pub const fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(WY_INC);
        mix(self.state)
    }

    /// A uniform integer in `0..n` (0 when `n` is 0), by multiply-high (Lemire), without the
    /// rejection step: the bias is below `n / 2^64`.
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        below(self.next_u64(), n)
    }

    /// A uniform float in `[0, 1)`.
    #[inline]
    pub fn unit_f64(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }
}

/// A wyrand generator shared between threads: each draw is one relaxed `fetch_add`.
#[derive(Debug)]
pub(crate) struct SharedRng {
    state: AtomicU64,
}

impl SharedRng {
    /// A generator starting from `seed`.
    pub(crate) const fn new(seed: u64) -> Self {
        SharedRng {
            state: AtomicU64::new(seed),
        }
    }

    /// The next 64 random bits. Relaxed is enough: the only requirement is that every draw
    /// sees a distinct state, which the atomic read-modify-write guarantees under any ordering.
    #[inline]
    pub(crate) fn next_u64(&self) -> u64 {
        let old = self.state.fetch_add(WY_INC, Ordering::Relaxed);
        mix(old.wrapping_add(WY_INC))
    }

    /// A single-owner generator seeded from this one, for a burst of draws without atomics.
    #[inline]
    pub(crate) fn fork(&self) -> Rng {
        Rng::new(self.next_u64())
    }
}

#[inline]
fn below(x: u64, n: u64) -> u64 {
    ((u128::from(x) * u128::from(n)) >> 64) as u64
}

#[inline]
fn unit_f64(x: u64) -> f64 {
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests;
