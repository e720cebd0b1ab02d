//! A growable array of published runs whose elements never move.
//!
//! Readers index it from any thread while the single writer grows it. Segments double in size
//! (1 Ki, 2 Ki, 4 Ki, ... slots) and are allocated once, on first use, behind a `OnceLock`, so
//! that a reference to a slot stays valid for the array's whole life without any locking.
//! Each slot is an `ArcSwapOption`: the writer replaces a run by storing a new `Arc`, readers
//! `load` it lock-free.

use std::sync::OnceLock;

use arc_swap::ArcSwapOption;

const FIRST_BITS: u32 = 10;
const SEGMENTS: usize = 22;

type Segment<T> = OnceLock<Box<[ArcSwapOption<T>]>>;

pub(crate) struct Slots<T> {
    segs: Box<[Segment<T>]>,
}

/// Segment and offset of slot `i`: segment k covers `[1024 * (2^k - 1), 1024 * (2^(k+1) - 1))`.
#[inline]
fn locate(i: u32) -> (usize, usize) {
    let x = (i as u64 >> FIRST_BITS) + 1;
    let k = 63 - x.leading_zeros() as usize;
    let start = ((1u64 << k) - 1) << FIRST_BITS;
    (k, (i as u64 - start) as usize)
}

impl<T> Slots<T> {
    /// Number of slots the array can hold.
    #[cfg(test)]
    pub(crate) const CAPACITY: u64 = ((1u64 << SEGMENTS) - 1) << FIRST_BITS;

    pub(crate) fn new() -> Self {
        Slots {
            segs: (0..SEGMENTS).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The slot, if its segment exists. Cheap; any thread.
    #[inline]
    pub(crate) fn get(&self, i: u32) -> Option<&ArcSwapOption<T>> {
        let (k, off) = locate(i);
        self.segs.get(k)?.get()?.get(off)
    }

    /// The slot, allocating its segment if needed. Writer only (callers guarantee a single
    /// writer; a racing second caller would only allocate a segment that is then dropped).
    pub(crate) fn ensure(&self, i: u32) -> &ArcSwapOption<T> {
        let (k, off) = locate(i);
        let seg = self.segs[k].get_or_init(|| {
            (0..(1usize << (k as u32 + FIRST_BITS)))
                .map(|_| ArcSwapOption::empty())
                .collect()
        });
        &seg[off]
    }

    /// Bytes of the allocated segments.
    pub(crate) fn bytes(&self) -> usize {
        let slot = std::mem::size_of::<ArcSwapOption<T>>();
        self.segs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.get().is_some())
            .map(|(k, _)| (1usize << (k as u32 + FIRST_BITS)) * slot)
            .sum::<usize>()
            + self.segs.len() * std::mem::size_of::<Segment<T>>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn locate_covers_segments_contiguously() {
        assert_eq!(locate(0), (0, 0));
        assert_eq!(locate(1023), (0, 1023));
        assert_eq!(locate(1024), (1, 0));
        assert_eq!(locate(3071), (1, 2047));
        assert_eq!(locate(3072), (2, 0));
        let last = (Slots::<u8>::CAPACITY - 1) as u32;
        assert_eq!(locate(last).0, SEGMENTS - 1);
    }

    #[test]
    fn slots_keep_values_across_growth() {
        let s = Slots::<u32>::new();
        assert!(s.get(5000).is_none());
        for i in [0u32, 1, 1023, 1024, 5000, 70_000] {
            s.ensure(i).store(Some(Arc::new(i)));
        }
        for i in [0u32, 1, 1023, 1024, 5000, 70_000] {
            assert_eq!(s.get(i).and_then(|x| x.load_full()).map(|a| *a), Some(i));
        }
        assert!(s.get(2).and_then(|x| x.load_full()).is_none());
    }
}
