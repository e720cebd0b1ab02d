//! The atomics the lock-free parts of the index are built on: std's, or loom's when the crate
//! is built with `--cfg loom`, so that the model checker runs the real code.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
