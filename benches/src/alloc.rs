//! A counting global allocator: the system allocator with a ledger of live heap bytes.
//!
//! The peer benchmark installs [`CountingAlloc`] as its `#[global_allocator]` and reads
//! [`live_bytes`] before an indexer is built and again after its replay, while the indexer is
//! still alive: the difference is what the indexer holds on the heap, whatever its own
//! accounting says. [`thread_allocations`] counts the allocation calls made by the calling thread
//! only, so a read path can be checked for allocations while other threads (a peer's event lanes)
//! allocate freely.
//!
//! Every counter is a plain tally read at quiet points, so every update is `Relaxed`. Memory
//! that a library maps directly from the kernel (`mmap`) bypasses the allocator and is not seen;
//! none of the measured indexers does that.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes currently allocated through [`CountingAlloc`], by every thread.
static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Allocation calls (alloc, alloc_zeroed, realloc) made by this thread. A `const`
    /// initialiser and no destructor: touching it never allocates, so the allocator may use it.
    static THREAD_ALLOCS: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting live bytes and per-thread allocation calls.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAlloc;

impl CountingAlloc {
    #[inline]
    fn count_call() {
        // `try_with` fails only while the thread's locals are being torn down; a call then is
        // simply not counted.
        let _ = THREAD_ALLOCS.try_with(|calls| calls.set(calls.get() + 1));
    }
}

// SAFETY:
// - Every method forwards to `System` with the caller's arguments unchanged, so `System`'s
//   guarantees are ours; the counters never touch the memory handed out.
// - Nothing here allocates (atomics and a const thread-local `Cell`), so there is no reentry.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller meets `GlobalAlloc::alloc`'s contract (non-zero size layout),
        // which is `System::alloc`'s.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
            Self::count_call();
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
            Self::count_call();
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller passes a block this allocator (hence `System`) handed out, with the
        // layout it was allocated with.
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller passes a block of ours with its layout and a valid new size, which
        // is `System::realloc`'s contract.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            // On failure the old block stays allocated and the ledger stays as it was.
            LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
            LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
            Self::count_call();
        }
        new
    }
}

/// Live heap bytes allocated through [`CountingAlloc`] (0 when it is not the global allocator).
pub fn live_bytes() -> usize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

/// Allocation calls made so far by the calling thread (0 when [`CountingAlloc`] is not the
/// global allocator).
pub fn thread_allocations() -> u64 {
    THREAD_ALLOCS.with(Cell::get)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
extern "C" {
    /// glibc: consolidates the allocator's free lists and returns what it can to the kernel.
    fn malloc_trim(pad: usize) -> i32;
}

/// Settles the system allocator after an indexer is dropped: glibc keeps the freed chunks of
/// a large structure in lists that the next allocations sort through, a cost that would
/// otherwise fall on whichever indexer is replayed next. A no-op off glibc.
pub fn settle_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes no pointers and may be called at any time; it only
    // reorganises glibc's own free memory.
    unsafe {
        malloc_trim(0);
    }
}

/// The process's resident set (`VmRSS` in `/proc/self/status`), in bytes; `None` where the
/// system does not report it.
pub fn resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
