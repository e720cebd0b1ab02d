//! A burst of 10,000 requests against 8 saturated workers, through the admission queue.
//!
//! Every worker starts saturated (busy over half its KV blocks with long background requests).
//! The burst arrives at once (virtual time 0) through `Router::submit`: each request is routed
//! at once, queued, or rejected with `ResourceExhausted` past the cap of queued prompt tokens.
//! A simple service model then plays the fleet in virtual time — prefill at 20,000 tokens/s on
//! the prompt's uncached part, one output token every 20 ms, an output block per 16 tokens —
//! calling `prefill_done`, `output_block` and `free` as a transport would; queued requests are
//! released as load frees and their queue wait is measured in virtual time, from arrival to
//! release. The run checks that no request is lost (routed + queued + rejected = 10,000, every
//! queued one released, the load back to zero) and prints the counts, the queue wait's
//! quantiles and the wall-clock cost of the admission calls, for both queue orders.
//!
//! A third run splits the fleet in two zones (workers labelled `zone=a` and `zone=b`, FCFS):
//! every request requires one zone, and zone a carries twice the background load, so its
//! requests wait longer. A waiting zone-a request does not hold back the zone-b requests
//! queued behind it: the run prints the queue wait per zone.
//!
//! `cargo run --release -p kvroute-benches --bin burst`

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use hdrhistogram::Histogram;
use kvroute_core::RequestId;
use kvroute_core::Rng;
use kvroute_core::WorkerConfig;
use kvroute_core::{Admission, Label, RouteError, RouteHints, RouteRequest, Router};
use kvroute_core::{BusyThresholds, QueueOrder, Queueing, RouterConfig};
use kvroute_core::{IndexConfig, PrefixIndex, WorkerId};

const BS: u32 = 16;
const WORKERS: u64 = 8;
const KV_BLOCKS: u64 = 8192;
const REQUESTS: u64 = 10_000;
const CAP_TOKENS: u64 = 16_000_000;
const PREFILL_TOKENS_PER_S: f64 = 20_000.0;
const TOKEN_INTERVAL_US: u64 = 20_000;
/// Background requests per worker: 9 × 512 blocks = 4,608 > half of 8,192.
const BACKGROUND: u64 = 9;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    PrefillDone(u64),
    OutputBlock(u64),
    Finish(u64),
}

struct Sim {
    router: Router,
    /// (time µs, sequence) → event, earliest first.
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    /// Request id → (prompt tokens, output tokens).
    shapes: HashMap<u64, (usize, u32)>,
}

impl Sim {
    fn schedule(&mut self, at: u64, e: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, e)));
    }

    /// A booked request starts at `now`: its prefill, output blocks and end.
    fn start(&mut self, id: u64, new_prefill_tokens: u64, now: u64) {
        let (_, out) = self.shapes[&id];
        let prefill_us = (new_prefill_tokens as f64 / PREFILL_TOKENS_PER_S * 1e6) as u64 + 1;
        let first = now + prefill_us;
        self.schedule(first, Event::PrefillDone(id));
        let blocks = u64::from(out) / u64::from(BS);
        for k in 1..=blocks {
            self.schedule(
                first + k * u64::from(BS) * TOKEN_INTERVAL_US,
                Event::OutputBlock(id),
            );
        }
        self.schedule(
            first + u64::from(out) * TOKEN_INTERVAL_US,
            Event::Finish(id),
        );
    }
}

fn prompt(id: u64, len: usize) -> Vec<u32> {
    // A quarter of the requests share one of 16 system prompts of 512 tokens.
    let sys = id.is_multiple_of(4).then_some((id / 4) % 16);
    (0..len as u32)
        .map(|i| match sys {
            Some(s) if i < 512 => (s as u32) << 20 | i,
            _ => ((id as u32) << 12) ^ i.wrapping_mul(2_654_435_761),
        })
        .collect()
}

/// A histogram of 3 significant digits up to 2^40 (recording never clamps in range).
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 1 << 40, 3).unwrap()
}

fn quantile_ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// The zone label a request of the zoned run requires.
const ZONES: [[Label<'static>; 1]; 2] = [
    [Label {
        key: "zone",
        value: "a",
    }],
    [Label {
        key: "zone",
        value: "b",
    }],
];

fn run(order: QueueOrder, zoned: bool) {
    let config = RouterConfig {
        busy: BusyThresholds {
            decode_blocks_fraction: Some(0.5),
            prefill_tokens_fraction: None,
        },
        queue: Queueing::On {
            max_queued_tokens: CAP_TOKENS,
            order,
        },
        ..RouterConfig::default()
    };
    let router = Router::new(config, PrefixIndex::new(IndexConfig::default())).unwrap();
    // Zone a: the first half of the workers.
    let zone_of = |w: u64| usize::from(w >= WORKERS / 2);
    for w in 0..WORKERS {
        let mut c = WorkerConfig::simple(w, KV_BLOCKS, BS);
        if zoned {
            c.labels = vec![("zone".into(), ["a", "b"][zone_of(w)].into())];
        }
        router.join_worker(c).unwrap();
    }
    let mut sim = Sim {
        router,
        events: BinaryHeap::new(),
        seq: 0,
        shapes: HashMap::new(),
    };
    let mut rng = Rng::new(0x0062_7572_7374);

    // Saturate every worker with long background requests (zone a twice over).
    for w in 0..WORKERS {
        let background = if zoned && zone_of(w) == 0 {
            2 * BACKGROUND
        } else {
            BACKGROUND
        };
        for b in 0..background {
            let id = 1 << 40 | w << 8 | b;
            let tokens = prompt(id, 8192);
            let mut q = RouteRequest {
                id: RequestId(id),
                tokens: &tokens,
                hints: RouteHints::default(),
            };
            q.hints.pinned.backend_instance = Some(WorkerId(w));
            let d = sim.router.route(&q).unwrap();
            sim.shapes.insert(id, (8192, 1024 + 64 * b as u32));
            sim.start(id, 8192 - d.overlap.cached_tokens, 0);
        }
    }

    // The burst: every request at virtual time 0.
    let (mut routed, mut queued, mut rejected) = (0u64, 0u64, 0u64);
    let mut arrival: HashMap<u64, u64> = HashMap::new();
    let mut submit_ns = histogram();
    let t_burst = Instant::now();
    for id in 0..REQUESTS {
        let len = 1024 + rng.below(3073) as usize;
        let out = 64 + rng.below(193) as u32;
        let tokens = prompt(id, len);
        let mut q = RouteRequest {
            id: RequestId(id),
            tokens: &tokens,
            hints: RouteHints::default(),
        };
        q.hints.priority_jump = if id % 10 == 0 { 5.0 } else { 0.0 };
        if zoned {
            q.hints.required = &ZONES[(id % 2) as usize];
        }
        sim.shapes.insert(id, (len, out));
        let t = Instant::now();
        let outcome = sim.router.submit(&q);
        submit_ns.saturating_record(t.elapsed().as_nanos().max(1) as u64);
        match outcome {
            Ok(Admission::Routed(d)) => {
                routed += 1;
                sim.start(id, len as u64 - d.overlap.cached_tokens, 0);
            }
            Ok(Admission::Queued(_)) => {
                queued += 1;
                arrival.insert(id, 0);
            }
            Err(RouteError::ResourceExhausted { .. }) => rejected += 1,
            Err(e) => panic!("request {id}: unexpected {e}"),
        }
    }
    let burst = t_burst.elapsed();
    let depth_after_burst = sim.router.queue_stats().unwrap().depth;

    // Play the fleet until every event ran.
    let mut wait_us = histogram();
    let mut zone_wait_us = [histogram(), histogram()];
    let (mut released, mut released_failed, mut max_depth) = (0u64, 0u64, depth_after_burst);
    let mut lifecycle_ns = 0u128;
    let mut lifecycle_calls = 0u64;
    let t_play = Instant::now();
    while let Some(Reverse((now, _, e))) = sim.events.pop() {
        let t = Instant::now();
        let r = &sim.router;
        match e {
            Event::PrefillDone(id) => {
                r.prefill_done(RequestId(id)).unwrap();
            }
            Event::OutputBlock(id) => {
                r.output_block(RequestId(id)).unwrap();
            }
            Event::Finish(id) => {
                r.free(RequestId(id)).unwrap();
            }
        }
        lifecycle_ns += t.elapsed().as_nanos();
        lifecycle_calls += 1;
        let mut started = Vec::new();
        r.drain_released(|id, outcome| match outcome {
            Ok(d) => started.push((id.0, d.overlap.cached_tokens)),
            Err(e) => {
                eprintln!("request {id:?} failed at release: {e}");
                released_failed += 1;
            }
        });
        for (id, cached) in started {
            released += 1;
            let waited = now - arrival.remove(&id).expect("released once, after queueing");
            wait_us.saturating_record(waited.max(1));
            zone_wait_us[(id % 2) as usize].saturating_record(waited.max(1));
            let (len, _) = sim.shapes[&id];
            sim.start(id, len as u64 - cached, now);
        }
        max_depth = max_depth.max(sim.router.queue_depth());
    }
    let play = t_play.elapsed();

    let stats = sim.router.queue_stats().unwrap();
    let lost = REQUESTS - routed - queued - rejected;
    assert_eq!(lost, 0, "every request routed, queued or rejected");
    assert_eq!(
        released + released_failed,
        queued,
        "every queued request released"
    );
    assert!(arrival.is_empty());
    assert_eq!(stats.depth, 0);
    assert_eq!(
        (stats.enqueued, stats.rejected, stats.released),
        (queued, rejected, queued)
    );
    assert!(sim.router.total_load().is_idle(), "load back to zero");
    assert_eq!(sim.router.active_requests(), 0);

    if zoned {
        println!("order {order:?}, two zones: {REQUESTS} requests, each requiring zone a or b (alternately); {WORKERS} workers, zone a saturated by {} background requests each, zone b by {BACKGROUND}", 2 * BACKGROUND);
    } else {
        println!("order {order:?}: {REQUESTS} requests, {WORKERS} workers saturated by {BACKGROUND} background requests each");
    }
    println!(
        "  routed at once {routed}, queued {queued}, rejected (ResourceExhausted) {rejected}, lost {lost}; released {released}, failed at release {released_failed}"
    );
    println!(
        "  queue: cap {} tokens, depth after the burst {depth_after_burst}, max depth {max_depth}",
        stats.cap_tokens
    );
    println!(
        "  queue wait (virtual, arrival to release) ms: p50 {:.0}, p90 {:.0}, p99 {:.0}, max {:.0}, mean {:.0}",
        quantile_ms(&wait_us, 0.5),
        quantile_ms(&wait_us, 0.9),
        quantile_ms(&wait_us, 0.99),
        wait_us.max() as f64 / 1000.0,
        wait_us.mean() / 1000.0
    );
    if zoned {
        for (zone, h) in ["a", "b"].iter().zip(&zone_wait_us) {
            println!(
                "  zone {zone}: {} released, queue wait ms p50 {:.0}, p99 {:.0}, max {:.0}",
                h.len(),
                quantile_ms(h, 0.5),
                quantile_ms(h, 0.99),
                h.max() as f64 / 1000.0
            );
        }
    }
    println!(
        "  wall: burst of submits {:.1} ms (submit p50 {} ns, p99 {} ns, max {} ns); playing {} lifecycle calls {:.1} ms ({:.0} ns per call, releases included)",
        burst.as_secs_f64() * 1e3,
        submit_ns.value_at_quantile(0.5),
        submit_ns.value_at_quantile(0.99),
        submit_ns.max(),
        lifecycle_calls,
        play.as_secs_f64() * 1e3,
        lifecycle_ns as f64 / lifecycle_calls.max(1) as f64
    );
}

fn main() {
    run(QueueOrder::Fcfs, false);
    run(QueueOrder::Wspt, false);
    run(QueueOrder::Fcfs, true);
}
