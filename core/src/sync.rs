//! The synchronisation primitives of load tracking ([`crate::load`]): std's, or loom's when
//! the crate is built with `--cfg loom`, so that the model checker runs the real ledger and
//! the real per-rank counters (the index has its own facade, `index::primitive`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};
