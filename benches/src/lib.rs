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

/// The number after `flag` in `args` (`--rounds 5`), or `default` when it is absent or not a
/// number.
pub fn flag_value(args: &[String], flag: &str, default: f64) -> f64 {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

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
    fn a_flags_value_is_the_number_after_it() {
        let args: Vec<String> = ["bench", "--rounds", "7", "--quota", "x"]
            .map(str::to_owned)
            .to_vec();
        assert_eq!(super::flag_value(&args, "--rounds", 3.0), 7.0);
        assert_eq!(
            super::flag_value(&args, "--quota", 0.25),
            0.25,
            "not a number"
        );
        assert_eq!(super::flag_value(&args, "--seconds", 5.0), 5.0, "absent");
    }

    #[test]
    fn the_median_of_an_even_count_is_the_upper_middle() {
        assert_eq!(super::median(vec![4.0, 1.0, 3.0, 2.0]), Some(3.0));
        assert_eq!(super::median(vec![2.0, 9.0, 1.0]), Some(2.0));
        assert_eq!(super::median(vec![]), None);
    }
}
