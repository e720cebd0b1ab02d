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
//! - [`affinity`]: pinning a thread to a CPU.
//! - [`cpu`]: CPU time from /proc.
//! - [`fake_engine`]: an engine that answers at once, for the gateway benchmarks.
//! - [`nats`]: a real `nats-server` on loopback, for the replica benchmarks.
//!
//! Figures are defined in `benches/README.md`.
#![deny(unsafe_code)]

pub mod affinity;
pub mod alloc;
pub mod cpu;
pub mod fake_engine;
pub mod nats;
pub mod peers;
pub mod replay;
pub mod trace;
pub mod workload;

/// The median of `values` (the upper of the middle two for an even count); `None` for none.
pub fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    Some(values[values.len() / 2])
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_median_of_an_even_count_is_the_upper_middle() {
        assert_eq!(super::median(vec![4.0, 1.0, 3.0, 2.0]), Some(3.0));
        assert_eq!(super::median(vec![2.0, 9.0, 1.0]), Some(2.0));
        assert_eq!(super::median(vec![]), None);
    }
}
