//! The demo's runs side by side: independent, deterministic runs of one workload, a few
//! threads at a time, each result in its place whatever order they end in.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// A run's result, in its item's place: none when its thread did not finish it.
pub(super) type Slot<R, E> = Option<Result<R, E>>;

/// Runs `job` on every item, `threads` at a time (at least 1, at most one per item), while
/// the calling thread runs `alongside`; `done` is told of each run that succeeds as it ends.
/// Returns the results in the items' order, and what `alongside` returned.
pub(super) fn run_each<T: Sync, R: Send, E: Send, B>(
    items: &[T],
    threads: usize,
    job: &(dyn Fn(&T) -> Result<R, E> + Sync),
    done: &(dyn Fn(&R) + Sync),
    alongside: impl FnOnce() -> B,
) -> (Vec<Slot<R, E>>, B) {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Slot<R, E>>> = Mutex::new(items.iter().map(|_| None).collect());
    let beside = std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, items.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else {
                    break;
                };
                let result = job(item);
                if let Ok(report) = &result {
                    done(report);
                }
                if let Ok(mut slots) = results.lock() {
                    slots[i] = Some(result);
                }
            });
        }
        alongside()
    });
    let slots = results.into_inner().unwrap_or_else(|e| e.into_inner());
    (slots, beside)
}
