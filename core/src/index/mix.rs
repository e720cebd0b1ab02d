//! A fast hasher for maps keyed by integers that are mostly hashes already.
//!
//! Engine block hashes can also be small counters (tests, some engines), so keys are still
//! mixed: one multiply and a fold, enough to spread sequential keys over a table.

use std::hash::{BuildHasherDefault, Hasher};

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    #[inline]
    fn finish(&self) -> u64 {
        let x = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^ (x >> 29)
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.write_u64(i as u64);
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.write_u64(i as u64);
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(23) ^ i).wrapping_mul(0xA076_1D64_78BD_642F);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
}

pub(crate) type MixState = BuildHasherDefault<MixHasher>;

/// Heap bytes of a `HashMap`/`HashSet` with `capacity` usable entries of `T` (hashbrown keeps
/// a power-of-two bucket count at most 7/8 full, one control byte per bucket plus a group).
pub(crate) fn set_bytes<T>(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (std::mem::size_of::<T>() + 1) + 16
}

/// A read prefetch of the cache line of `x`.
#[inline]
#[allow(unsafe_code)]
pub(crate) fn prefetch_read<T>(x: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY:
    // - `_mm_prefetch` only needs SSE, which every x86_64 target has.
    // - A prefetch is a hint: it reads nothing into the program and never faults, and the
    //   pointer comes from a live reference anyway.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
            (x as *const T).cast(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// A read prefetch of the cache line at address `p`, which need not point into anything: a
/// prefetch never faults, so a caller may aim it at a computed address without proving it in
/// bounds (one that is not is a wasted hint).
#[inline]
pub(crate) fn prefetch_addr<T>(p: *const T) {
    prefetch_hinted::<T, { HINT_L1 }>(p);
}

/// [`prefetch_addr`] into the second-level cache only. A first-level miss waits in one of the
/// few buffers the core has for them, and a fetch that holds one stalls every later miss when
/// they run out; a line fetched into the second level holds one of its many more, and costs a
/// few cycles more when it is read. For bursts of fetches (an event's names, a run's lines)
/// issued well before they are read.
#[inline]
pub(crate) fn prefetch_addr_l2<T>(p: *const T) {
    prefetch_hinted::<T, { HINT_L2 }>(p);
}

#[cfg(target_arch = "x86_64")]
const HINT_L1: i32 = core::arch::x86_64::_MM_HINT_T0;
#[cfg(target_arch = "x86_64")]
const HINT_L2: i32 = core::arch::x86_64::_MM_HINT_T1;
#[cfg(not(target_arch = "x86_64"))]
const HINT_L1: i32 = 0;
#[cfg(not(target_arch = "x86_64"))]
const HINT_L2: i32 = 0;

#[inline(always)]
#[allow(unsafe_code)]
fn prefetch_hinted<T, const HINT: i32>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY:
    // - `_mm_prefetch` only needs SSE, which every x86_64 target has.
    // - A prefetch is a hint: it reads nothing into the program and never faults, whatever
    //   the address, so `p` need not be valid.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<HINT>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
