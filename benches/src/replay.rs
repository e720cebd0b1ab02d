//! One timed replay of an op stream into one indexer, and the figures it yields.
//!
//! ```text
//!  live heap ─ before ─▶ build ─▶ [ops: apply / query (timed each) ...] ─▶ flush ─▶ live heap ─ after
//!                                 └───────────────── wall clock ──────────────────┘
//! ```
//!
//! Everything the replay itself needs (the op stream, the latency histogram, the answer buffer)
//! is allocated before the "before" reading, so the heap difference is the indexer's alone (plus
//! its adapter's few reused buffers). Each query's answer is sorted and compared with the ground
//! truth inside the wall clock but outside the query's own latency; that costs every indexer the
//! same.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::alloc;
use crate::peers::Indexer;
use crate::workload::{Op, OpStream, Overlap};

/// Latencies above this are recorded as this (one minute).
const MAX_LATENCY_NS: u64 = 60_000_000_000;

/// The figures of one replay; `benches/README.md` defines each.
#[derive(Clone, Debug)]
pub struct Measurement {
    pub name: String,
    /// Wall time of the whole replay, final flush included.
    pub wall: Duration,
    pub queries: u64,
    pub events: u64,
    pub block_ops: u64,
    pub match_p50_ns: u64,
    pub match_p99_ns: u64,
    pub match_p999_ns: u64,
    /// Live heap after the replay minus live heap before the indexer was built.
    pub heap_bytes: i64,
    /// (worker, block) pairs cached at the end of the simulation.
    pub resident_pairs: u64,
    /// Queries whose answer equalled the ground truth.
    pub agreeing_queries: u64,
    /// Queries where some worker was reported with fewer leading blocks than it held (or not
    /// at all).
    pub under_reporting: u64,
    /// Queries where some worker was reported with more leading blocks than it held.
    pub over_reporting: u64,
    pub apply_errors: u64,
    /// The indexer's own memory account after the replay, where it keeps one.
    pub accounted_bytes: Option<usize>,
    /// Allocation calls made on the querying thread during queries.
    pub query_allocations: u64,
}

impl Measurement {
    fn per_second(&self, count: u64) -> f64 {
        count as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    pub fn block_ops_per_s(&self) -> f64 {
        self.per_second(self.block_ops)
    }

    pub fn events_per_s(&self) -> f64 {
        self.per_second(self.events)
    }

    fn per_pair(&self, bytes: f64) -> f64 {
        if self.resident_pairs == 0 {
            0.0
        } else {
            bytes / self.resident_pairs as f64
        }
    }

    pub fn bytes_per_block(&self) -> f64 {
        self.per_pair(self.heap_bytes as f64)
    }

    pub fn accounted_bytes_per_block(&self) -> Option<f64> {
        self.accounted_bytes
            .map(|bytes| self.per_pair(bytes as f64))
    }

    pub fn agreement(&self) -> f64 {
        if self.queries == 0 {
            1.0
        } else {
            self.agreeing_queries as f64 / self.queries as f64
        }
    }

    /// Fraction of queries with some worker under-reported.
    pub fn under_reporting_share(&self) -> f64 {
        self.per_query(self.under_reporting)
    }

    /// Fraction of queries with some worker over-reported.
    pub fn over_reporting_share(&self) -> f64 {
        self.per_query(self.over_reporting)
    }

    fn per_query(&self, count: u64) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            count as f64 / self.queries as f64
        }
    }

    pub fn allocations_per_query(&self) -> f64 {
        self.per_query(self.query_allocations)
    }
}

/// Replay `stream` into the indexer `build` makes, and measure.
pub fn replay(
    name: &str,
    stream: &OpStream,
    build: impl FnOnce() -> Box<dyn Indexer>,
) -> Measurement {
    let mut latencies = Histogram::<u64>::new_with_bounds(1, MAX_LATENCY_NS, 3)
        .expect("static histogram bounds are valid");
    let mut answer: Vec<Overlap> = Vec::with_capacity(stream.workers + 1);
    let mut queries = 0u64;
    let mut agreeing = 0u64;
    let mut under_reporting = 0u64;
    let mut over_reporting = 0u64;
    let mut query_allocations = 0u64;

    let before = alloc::live_bytes();
    let mut indexer = build();

    let start = Instant::now();
    for op in &stream.ops {
        match op {
            Op::Stored(event) => indexer.apply_stored(event),
            Op::Removed(event) => indexer.apply_removed(event),
            Op::Query(query) => {
                let allocations = alloc::thread_allocations();
                let began = Instant::now();
                indexer.query(&query.hashes, &mut answer);
                let took = began.elapsed();
                query_allocations += alloc::thread_allocations() - allocations;
                latencies.saturating_record(took.as_nanos().min(u128::from(MAX_LATENCY_NS)) as u64);
                queries += 1;
                answer.sort_unstable();
                if answer == query.truth {
                    agreeing += 1;
                } else {
                    let (under, over) = compare(&answer, &query.truth);
                    under_reporting += u64::from(under);
                    over_reporting += u64::from(over);
                }
            }
        }
    }
    indexer.flush();
    let wall = start.elapsed();

    let after = alloc::live_bytes();
    let accounted_bytes = indexer.accounted_bytes();
    let apply_errors = indexer.apply_errors();
    drop(indexer);

    let stats = &stream.stats;
    Measurement {
        name: name.to_owned(),
        wall,
        queries,
        events: stats.events(),
        block_ops: stats.block_ops(),
        match_p50_ns: latencies.value_at_quantile(0.5),
        match_p99_ns: latencies.value_at_quantile(0.99),
        match_p999_ns: latencies.value_at_quantile(0.999),
        heap_bytes: after as i64 - before as i64,
        resident_pairs: stats.resident_pairs,
        agreeing_queries: agreeing,
        under_reporting,
        over_reporting,
        apply_errors,
        accounted_bytes,
        query_allocations,
    }
}

/// Whether `answer` (sorted by worker) reports some worker below its ground truth, and whether
/// it reports some worker above it.
fn compare(answer: &[Overlap], truth: &[Overlap]) -> (bool, bool) {
    let reported = |worker: u32, list: &[Overlap]| {
        list.binary_search_by_key(&worker, |o| o.worker)
            .map_or(0, |i| list[i].blocks)
    };
    let under = truth.iter().any(|t| reported(t.worker, answer) < t.blocks);
    let over = answer.iter().any(|a| reported(a.worker, truth) < a.blocks);
    (under, over)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_tells_under_from_over() {
        let o = |worker, blocks| Overlap { worker, blocks };
        let truth = [o(0, 3), o(2, 5)];
        assert_eq!(compare(&[o(0, 3), o(2, 5)], &truth), (false, false));
        assert_eq!(compare(&[o(0, 3)], &truth), (true, false));
        assert_eq!(compare(&[o(0, 4), o(2, 5)], &truth), (false, true));
        assert_eq!(compare(&[o(0, 2), o(1, 1), o(2, 5)], &truth), (true, true));
    }
}
