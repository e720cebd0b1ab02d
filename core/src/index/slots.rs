//! A growable array of published runs whose elements never move.
//!
//! Readers index it from any thread while the single writer grows it. Segments double in size
//! (1 Ki, 2 Ki, 4 Ki, ... slots) and are allocated once, on first use, behind a `OnceLock`, so
//! that a reference to a slot stays valid for the array's whole life without any locking.
//!
//! Each slot is an epoch-protected pointer (`crossbeam_epoch::Atomic`) to an array of words (a
//! run's published form, see `run.rs`), allocated with its length in one block. The writer
//! publishes a new array with one `Release` store and retires the old one to the epoch
//! collector; a reader pins the epoch once per walk and then reads any number of slots with
//! plain `Acquire` loads, so a walk pays one fence in all instead of reference-count traffic
//! on every run it visits.
//!
//! Beside its pointer, a slot keeps a hint: the slot of the child most recently linked to its
//! run. A conversation's chain grows turn by turn, each turn a child of the last, so a walk
//! reads the next run's slot from the line it already has and fetches that run while it
//! compares the current one, instead of after a child-table lookup. The hint is never
//! trusted: the walk checks the run it names as it checks any child it finds. A second hint
//! names the slot after that (the hinted slot's own hint when it was linked, kept up when the
//! hinted slot gets a child), so that a walk fetches the slot two runs ahead while the next
//! one's line is already on its way. A slot no child was ever linked to (since it was last
//! cleared) has no hint, and its run no children: every child link sets the hint.
//!
//! An array also carries, in a word before the run, the address of the array two runs ahead
//! on the hinted path (the array in the slot's second hint): a walk reads it from the line it
//! already has and fetches that array while the next one is still on its way, so that on a
//! long chain each run's lines are asked for two runs before they are compared. It is the
//! one word of a published array that changes: the writer stores it in place when the run two
//! ahead gets a new array, or the hints change, and everyone reads it atomically.
//!
//! All of the module's `unsafe` rests on two rules: only the single writer calls
//! [`Slots::publish`], [`Slots::clear`] and [`Slots::set_ahead`], and a published array has
//! every word written.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;

use crossbeam_epoch::{Atomic, Guard, Owned, Pointer, Shared};

const FIRST_BITS: u32 = 10;
pub(super) const SEGMENTS: usize = 22;

/// A published array: the address of the array two runs ahead (atomic: the writer updates it
/// in place), then the run's words, which never change once published.
type Words = [MaybeUninit<AtomicU64>];
type Segment = OnceLock<Box<[Cell]>>;

/// No next slot hinted.
pub(crate) const NO_NEXT: u32 = u32::MAX;

/// A slot: its run, and a hint of the slot a walk through the run most likely goes on to.
struct Cell {
    run: Atomic<Words>,
    /// The child most recently linked to the run, or [`NO_NEXT`] when no child was linked
    /// since the slot was last cleared (the run has none). Only a hint: a reader checks the
    /// run it leads to as it checks every child it finds.
    next: AtomicU32,
    /// The hinted slot's own hint, or [`NO_NEXT`]; a hint too.
    next2: AtomicU32,
}

impl Cell {
    fn empty() -> Self {
        Cell {
            run: Atomic::null(),
            next: AtomicU32::new(NO_NEXT),
            next2: AtomicU32::new(NO_NEXT),
        }
    }
}

pub(crate) struct Slots {
    segs: Box<[Segment]>,
}

/// Segment and offset of slot `i`: segment k covers `[1024 * (2^k - 1), 1024 * (2^(k+1) - 1))`.
#[inline]
pub(super) fn locate(i: u32) -> (usize, usize) {
    let x = (i as u64 >> FIRST_BITS) + 1;
    let k = 63 - x.leading_zeros() as usize;
    let start = ((1u64 << k) - 1) << FIRST_BITS;
    (k, (i as u64 - start) as usize)
}

/// Slots in segment `k`.
#[inline]
pub(super) fn segment_len(k: usize) -> usize {
    1usize << (k as u32 + FIRST_BITS)
}

/// The run's words of a published array (all but the first word).
///
/// # Safety
/// `p` is null or points to an array that `publish` filled, and stays allocated for `'a`.
#[inline]
#[allow(unsafe_code)]
unsafe fn words<'a>(p: Shared<'a, Words>) -> Option<&'a [u64]> {
    // SAFETY: the caller vouches that the array is alive for 'a.
    let w: &'a Words = unsafe { p.as_ref() }?;
    let run = w.get(1..)?;
    // SAFETY: `MaybeUninit<AtomicU64>` has the layout of `u64`; `publish` wrote every word
    // before the array became reachable, and nothing writes these words (all but the first)
    // after that, so plain shared reads of them race with nothing.
    Some(unsafe { &*(run as *const Words as *const [u64]) })
}

/// The first word of a published array: the address of the array two runs ahead.
///
/// # Safety
/// As for [`words`].
#[inline]
#[allow(unsafe_code)]
unsafe fn ahead_word<'a>(p: Shared<'a, Words>) -> Option<&'a AtomicU64> {
    // SAFETY: the caller vouches that the array is alive for 'a.
    let w: &'a Words = unsafe { p.as_ref() }?;
    // SAFETY: `publish` wrote the word before the array became reachable.
    w.first().map(|x| unsafe { x.assume_init_ref() })
}

impl Slots {
    /// Number of slots the array can hold.
    #[cfg(test)]
    pub(crate) const CAPACITY: u64 = ((1u64 << SEGMENTS) - 1) << FIRST_BITS;

    pub(crate) fn new() -> Self {
        Slots {
            segs: (0..SEGMENTS).map(|_| OnceLock::new()).collect(),
        }
    }

    #[inline]
    fn cell(&self, i: u32) -> Option<&Cell> {
        let (k, off) = locate(i);
        self.segs.get(k)?.get()?.get(off)
    }

    /// The words in slot `i`, for as long as `guard` stays pinned. Any thread.
    #[cfg(test)]
    #[allow(unsafe_code)]
    pub(crate) fn load<'g>(&self, i: u32, guard: &'g Guard) -> Option<&'g [u64]> {
        let (address, _, _) = self.address_with_hints(i, guard);
        // SAFETY: the address was read from the slot under `guard`.
        unsafe { self.words_at(address, guard) }
    }

    /// The address of slot `i`'s array (0 for none, see [`Slots::words_at`]) and its two
    /// hints, without reading the array: a walk fetches the array's lines by address and reads
    /// them a run later. Any thread.
    #[inline]
    pub(crate) fn address_with_hints(&self, i: u32, guard: &Guard) -> (u64, u32, u32) {
        self.cell(i).map_or((0, NO_NEXT, NO_NEXT), |cell| {
            // Acquire: pairs with the Release store in `publish`, so that the words are visible
            // to whoever reads them through this address. Relaxed for the hints: a hint only
            // names a slot, which is then loaded with Acquire.
            let p = cell.run.load(Ordering::Acquire, guard);
            (
                p.into_usize() as u64,
                cell.next.load(Ordering::Relaxed),
                cell.next2.load(Ordering::Relaxed),
            )
        })
    }

    /// Hints the CPU to fetch slot `i`'s cell.
    #[inline]
    pub(crate) fn prefetch(&self, i: u32) {
        if let Some(cell) = self.cell(i) {
            super::mix::prefetch_read(cell);
        }
    }

    /// Hints that walks through slot `i`'s run go on to slot `next`, and then to `next`'s own
    /// hint; `grandparent`, the slot of the run before `i`'s, if any, is told of `next` as its
    /// second hint when its first is `i`. Writer only; every child linked to a run must be
    /// hinted here (a slot without a hint is read as having no children).
    pub(crate) fn set_next(&self, i: u32, next: u32, grandparent: Option<u32>) {
        let after = self.ensure(next).next.load(Ordering::Relaxed);
        let cell = self.ensure(i);
        cell.next.store(next, Ordering::Relaxed);
        cell.next2.store(after, Ordering::Relaxed);
        if let Some(g) = grandparent {
            let gc = self.ensure(g);
            if gc.next.load(Ordering::Relaxed) == i {
                gc.next2.store(next, Ordering::Relaxed);
            }
        }
    }

    /// The words in slot `i`, as the writer sees them.
    ///
    /// # Safety
    /// The caller is the single writer, and does not call [`Slots::publish`] or
    /// [`Slots::clear`] for slot `i` while the returned slice lives.
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) unsafe fn current(&self, i: u32) -> Option<&[u64]> {
        // SAFETY: `unprotected` is sound here because nothing frees the array but `publish`
        // and `clear`, which the caller promises not to call for this slot meanwhile.
        // Relaxed: the writer itself stored the pointer.
        let guard = unsafe { crossbeam_epoch::unprotected() };
        let p = self.cell(i)?.run.load(Ordering::Relaxed, guard);
        // SAFETY: as above, the array outlives the borrow of `self`.
        unsafe { words(p) }
    }

    /// Publishes in slot `i` (allocating its segment if needed) an array of `len` words whose
    /// first words `fill` writes (it returns how many), behind the address `ahead` of the
    /// array two runs ahead (see [`Slots::set_ahead`]), tells `link` the new array's address
    /// (for the other places that name the slot's array), and then retires the previous
    /// array, which is freed once every reader pinned before now has moved on. Writer only.
    pub(crate) fn publish(
        &self,
        i: u32,
        len: usize,
        ahead: u64,
        fill: impl FnOnce(&mut [MaybeUninit<u64>]) -> usize,
        link: impl FnOnce(u64),
        guard: &Guard,
    ) {
        let mut array = Owned::<Words>::init(len + 1);
        let (first, run) = array.split_at_mut(1);
        first[0].write(AtomicU64::new(ahead));
        // SAFETY: `MaybeUninit<AtomicU64>` has the layout of `MaybeUninit<u64>`, and the
        // array is not shared yet.
        #[allow(unsafe_code)]
        let run = unsafe { &mut *(run as *mut Words as *mut [MaybeUninit<u64>]) };
        let written = fill(run).min(len);
        // Words `fill` left would be read as garbage: zeros instead.
        for w in &mut run[written..] {
            w.write(0);
        }
        let new = array.into_shared(guard);
        self.swap(i, new, || link(new.into_usize() as u64), guard);
    }

    /// The address of slot `i`'s array, as [`Slots::publish`] tells it (0 for none). Writer
    /// only.
    #[allow(unsafe_code)]
    pub(crate) fn address(&self, i: u32) -> u64 {
        self.cell(i).map_or(0, |cell| {
            // SAFETY: only the pointer's bits are read, nothing behind it.
            let guard = unsafe { crossbeam_epoch::unprotected() };
            cell.run.load(Ordering::Relaxed, guard).into_usize() as u64
        })
    }

    /// The address of the array in the slot that slot `i`'s second hint names (0 for none).
    /// Writer only.
    pub(crate) fn address_of_next2(&self, i: u32) -> u64 {
        match self.hints(i).1 {
            NO_NEXT => 0,
            n2 => self.address(n2),
        }
    }

    /// The address of the array two runs ahead of slot `i`'s on the hinted path: the array
    /// of the slot its second hint names (0 for none). Stored into slot `i`'s current array,
    /// in place; a walk through slot `i`'s run fetches that array's first lines. Only a hint
    /// of where to fetch: a walk reads nothing through it. Writer only.
    #[allow(unsafe_code)]
    pub(crate) fn set_ahead(&self, i: u32, address: u64) {
        let Some(cell) = self.cell(i) else {
            return;
        };
        // SAFETY: only the writer frees arrays, so the slot's array outlives this call.
        let guard = unsafe { crossbeam_epoch::unprotected() };
        // SAFETY: as above.
        if let Some(word) = unsafe { ahead_word(cell.run.load(Ordering::Relaxed, guard)) } {
            word.store(address, Ordering::Relaxed);
        }
    }

    /// The address [`Slots::set_ahead`] last stored into slot `i`'s array (0 for none).
    /// Writer only.
    #[allow(unsafe_code)]
    pub(crate) fn ahead(&self, i: u32) -> u64 {
        let Some(cell) = self.cell(i) else {
            return 0;
        };
        // SAFETY: only the writer frees arrays, so the slot's array outlives this call.
        let guard = unsafe { crossbeam_epoch::unprotected() };
        // SAFETY: as above.
        let word = unsafe { ahead_word(cell.run.load(Ordering::Relaxed, guard)) };
        word.map_or(0, |w| w.load(Ordering::Relaxed))
    }

    /// The address stored by [`Slots::set_ahead`] into the array at `address` (0 for none).
    ///
    /// # Safety
    /// As for [`Slots::words_at`].
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) unsafe fn ahead_at(&self, address: u64, _guard: &Guard) -> u64 {
        // SAFETY: as for `words_at`.
        let word = unsafe { ahead_word(Shared::<'_, Words>::from_usize(address as usize)) };
        // Relaxed: the value is only an address to fetch, never read through.
        word.map_or(0, |w| w.load(Ordering::Relaxed))
    }

    /// The words of the array at `address`, as [`Slots::publish`] told it, for as long as
    /// `guard` stays pinned.
    ///
    /// # Safety
    /// `address` is 0 or was read under `guard` from a place the writer updates before it
    /// retires an array (as it updates the slot), and that place was reached after `guard`
    /// was pinned.
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) unsafe fn words_at<'g>(&self, address: u64, _guard: &'g Guard) -> Option<&'g [u64]> {
        // SAFETY: an array is freed only after `publish` or `clear` has unlinked it from its
        // slot and told `link` (which unlinks it from the child table), and has retired it
        // with `defer_destroy`, which waits until every guard pinned before the unlink is
        // gone. The caller read the address after pinning `guard`, from one of those places,
        // so the array is alive while `guard` is (or the address is 0, which `words` reads
        // as none).
        unsafe { words(Shared::<'g, Words>::from_usize(address as usize)) }
    }

    /// The hints of slot `i` (see [`Slots::address_with_hints`]). Any thread.
    #[inline]
    pub(crate) fn hints(&self, i: u32) -> (u32, u32) {
        self.cell(i).map_or((NO_NEXT, NO_NEXT), |cell| {
            (
                cell.next.load(Ordering::Relaxed),
                cell.next2.load(Ordering::Relaxed),
            )
        })
    }

    /// Empties slot `i`, forgets its hints and retires its array, after `link` has been told
    /// (address 0). Writer only.
    pub(crate) fn clear(&self, i: u32, link: impl FnOnce(u64), guard: &Guard) {
        if let Some(cell) = self.cell(i) {
            cell.next.store(NO_NEXT, Ordering::Relaxed);
            cell.next2.store(NO_NEXT, Ordering::Relaxed);
            self.swap(i, Shared::null(), || link(0), guard);
        }
    }

    #[allow(unsafe_code)]
    fn swap(&self, i: u32, new: Shared<'_, Words>, link: impl FnOnce(), guard: &Guard) {
        let cell = self.ensure(i);
        // A load and a store, not an atomic swap: only this writer stores here, and a swap is
        // a locked instruction that waits for every store before it (the new array's words)
        // to drain. Relaxed: the writer stored the old pointer itself.
        let old = cell.run.load(Ordering::Relaxed, guard);
        // Release: readers that load the new pointer see its words.
        cell.run.store(new, Ordering::Release);
        link();
        if !old.is_null() {
            // SAFETY:
            // - `old` is no longer reachable from the slot, and no other slot holds it (each
            //   array is published once), so no reader can load it from now on.
            // - Readers that loaded it before the swap are pinned; the collector frees it only
            //   after they unpin.
            unsafe { guard.defer_destroy(old) };
        }
    }

    /// The slot, allocating its segment if needed. Writer only (callers guarantee a single
    /// writer; a racing second caller would only allocate a segment that is then dropped).
    fn ensure(&self, i: u32) -> &Cell {
        let (k, off) = locate(i);
        let seg = self.segs[k].get_or_init(|| (0..segment_len(k)).map(|_| Cell::empty()).collect());
        &seg[off]
    }

    /// Allocates the segment of slot `i`. Writer only.
    pub(crate) fn reserve(&self, i: u32) {
        self.ensure(i);
    }

    /// Bytes of the allocated segments.
    pub(crate) fn bytes(&self) -> usize {
        let slot = std::mem::size_of::<Cell>();
        self.segs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.get().is_some())
            .map(|(k, _)| segment_len(k) * slot)
            .sum::<usize>()
            + self.segs.len() * std::mem::size_of::<Segment>()
    }
}

impl Drop for Slots {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        for seg in self.segs.iter_mut().filter_map(|s| s.get_mut()) {
            for cell in seg.iter() {
                // SAFETY:
                // - `&mut self`: no reader can reach the array any more, so no guard is needed
                //   and nothing else frees these arrays.
                // - A non-null pointer came from an `Owned` and was retired by nobody (a
                //   retired array is unlinked first).
                unsafe {
                    let p = cell
                        .run
                        .load(Ordering::Relaxed, crossbeam_epoch::unprotected());
                    if !p.is_null() {
                        drop(p.into_owned());
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
