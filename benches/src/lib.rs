//! Benchmark support for kvroute: workloads, a simulated fleet, and the side-by-side peer
//! benchmark's harness.
//!
//! ```text
//!  workload / trace ──▶ Simulator ──▶ OpStream ──replay──▶ each Indexer (kvroute and peers)
//!                                        │                      │
//!                                   ground truth ── agreement ──┘   alloc: live heap ledger
//! ```
//!
//! - [`workload`]: the built-in chat workload, the simulated fleet and the op stream.
//! - [`trace`]: Mooncake-format traces turned into prompts.
//! - [`peers`]: kvroute and the peer indexers behind one trait.
//! - [`replay`]: one timed replay and its figures.
//! - [`alloc`]: the counting global allocator the benchmark binary installs.
//!
//! Figures are defined in `benches/README.md`.
#![deny(unsafe_code)]

pub mod alloc;
pub mod peers;
pub mod replay;
pub mod trace;
pub mod workload;
