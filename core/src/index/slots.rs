//! A growable array of published runs whose elements never move.
//!
//! Readers index it from any thread while the single writer grows it. Segments double in size
//! (1 Ki, 2 Ki, 4 Ki, ... slots) and are allocated once, on first use, behind a `OnceLock`, so
//! that a reference to a slot stays valid for the array's whole life without any locking.
//!
//! Each slot is an epoch-protected pointer (`crossbeam_epoch::Atomic`). The writer publishes a
//! new value with one `Release` swap and retires the old one to the epoch collector; a reader
//! pins the epoch once per walk and then reads any number of slots with plain `Acquire` loads,
//! so a walk pays one fence in all instead of reference-count traffic on every run it visits.
//!
//! All of the module's `unsafe` rests on one rule: only the single writer calls
//! [`Slots::publish`], and a value leaves a slot only through it.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use crossbeam_epoch::{Atomic, Guard, Owned, Shared};

const FIRST_BITS: u32 = 10;
const SEGMENTS: usize = 22;

type Segment<T> = OnceLock<Box<[Atomic<T>]>>;

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

    #[inline]
    fn cell(&self, i: u32) -> Option<&Atomic<T>> {
        let (k, off) = locate(i);
        self.segs.get(k)?.get()?.get(off)
    }

    /// The value in slot `i`, for as long as `guard` stays pinned. Any thread.
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) fn load<'g>(&self, i: u32, guard: &'g Guard) -> Option<&'g T> {
        // Acquire: pairs with the Release swap in `publish`, so the value's contents are
        // visible.
        let p = self.cell(i)?.load(Ordering::Acquire, guard);
        // SAFETY:
        // - `p` is null or was made from an `Owned` in `publish`, so it is aligned and points
        //   to an initialised `T`.
        // - A value is freed only after `publish` unlinks it and retires it with
        //   `defer_destroy`, which waits until every guard pinned before the unlink is gone;
        //   `guard` is one of them for as long as the returned reference lives ('g).
        unsafe { p.as_ref() }
    }

    /// The value in slot `i`, as the writer sees it.
    ///
    /// # Safety
    /// The caller is the single writer, and does not call [`Slots::publish`] for slot `i`
    /// while the returned reference lives.
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) unsafe fn current(&self, i: u32) -> Option<&T> {
        // SAFETY:
        // - `unprotected` is sound here because nothing frees the value but `publish`, which
        //   the caller promises not to call for this slot while the reference lives.
        // - Relaxed: the writer itself stored the pointer.
        let p = self
            .cell(i)?
            .load(Ordering::Relaxed, unsafe { crossbeam_epoch::unprotected() });
        // SAFETY: as in `load`, a non-null pointer came from an `Owned`.
        unsafe { p.as_ref() }
    }

    /// Replaces the value of slot `i` (allocating its segment if needed) and retires the old
    /// one, which is freed once every reader pinned before now has moved on. Writer only.
    #[allow(unsafe_code)]
    pub(crate) fn publish(&self, i: u32, value: Option<T>, guard: &Guard) {
        let cell = self.ensure(i);
        let new = value.map_or(Shared::null(), |v| Owned::new(v).into_shared(guard));
        // Release: readers that load the new pointer see the value's contents.
        let old = cell.swap(new, Ordering::Release, guard);
        if !old.is_null() {
            // SAFETY:
            // - `old` is no longer reachable from the slot, and no other slot holds it (each
            //   value is published once), so no reader can load it from now on.
            // - Readers that loaded it before the swap are pinned; the collector frees it only
            //   after they unpin.
            unsafe { guard.defer_destroy(old) };
        }
    }

    /// The slot, allocating its segment if needed. Writer only (callers guarantee a single
    /// writer; a racing second caller would only allocate a segment that is then dropped).
    pub(crate) fn ensure(&self, i: u32) -> &Atomic<T> {
        let (k, off) = locate(i);
        let seg = self.segs[k].get_or_init(|| {
            (0..(1usize << (k as u32 + FIRST_BITS)))
                .map(|_| Atomic::null())
                .collect()
        });
        &seg[off]
    }

    /// Bytes of the allocated segments.
    pub(crate) fn bytes(&self) -> usize {
        let slot = std::mem::size_of::<Atomic<T>>();
        self.segs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.get().is_some())
            .map(|(k, _)| (1usize << (k as u32 + FIRST_BITS)) * slot)
            .sum::<usize>()
            + self.segs.len() * std::mem::size_of::<Segment<T>>()
    }
}

impl<T> Drop for Slots<T> {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        for seg in self.segs.iter_mut().filter_map(|s| s.get_mut()) {
            for cell in seg.iter() {
                // SAFETY:
                // - `&mut self`: no reader can reach the array any more, so no guard is needed
                //   and nothing else frees these values.
                // - A non-null pointer came from an `Owned` and was retired by nobody (a
                //   retired value is unlinked first).
                unsafe {
                    let p = cell.load(Ordering::Relaxed, crossbeam_epoch::unprotected());
                    if !p.is_null() {
                        drop(p.into_owned());
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
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
        let guard = crossbeam_epoch::pin();
        assert!(s.load(5000, &guard).is_none());
        for i in [0u32, 1, 1023, 1024, 5000, 70_000] {
            s.publish(i, Some(i), &guard);
        }
        for i in [0u32, 1, 1023, 1024, 5000, 70_000] {
            assert_eq!(s.load(i, &guard), Some(&i));
        }
        assert!(s.load(2, &guard).is_none());
        s.publish(5000, None, &guard);
        assert!(s.load(5000, &guard).is_none());
    }

    /// Counts its drops.
    struct Tracked(Arc<AtomicUsize>);

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn every_published_value_is_freed_exactly_once() {
        let drops = Arc::new(AtomicUsize::new(0));
        let s = Slots::<Tracked>::new();
        for round in 0..100 {
            let guard = crossbeam_epoch::pin();
            s.publish(round % 7, Some(Tracked(Arc::clone(&drops))), &guard);
        }
        {
            let guard = crossbeam_epoch::pin();
            s.publish(3, None, &guard);
        }
        drop(s);
        // Retired values are freed by the collector; flushing from fresh pins drives it.
        for _ in 0..10_000 {
            if drops.load(Ordering::Relaxed) == 100 {
                break;
            }
            crossbeam_epoch::pin().flush();
        }
        assert_eq!(drops.load(Ordering::Relaxed), 100);
    }
}
