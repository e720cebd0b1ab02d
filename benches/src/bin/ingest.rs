//! KV event ingest over loopback: events per second from one client connection into the
//! index, io_uring against epoll, on the same batches in the same run.
//!
//! ```text
//! cargo run --release -p kvroute-benches --bin ingest                 # both shapes, 3 rounds
//! cargo run --release -p kvroute-benches --bin ingest -- --batches 40000 --rounds 5
//! cargo run --release -p kvroute-benches --bin ingest -- --client epoll   # server side only
//! cargo run --release -p kvroute-benches --bin ingest -- --write coalesced
//! cargo run --release -p kvroute-benches --bin ingest -- --sqpoll-idle 50  # polled rings
//! ```
//!
//! One server (one runtime thread, the index writer on its own thread) and one client thread
//! of the same backend. The client sends pre-encoded frames, then closes; a run's time is from
//! its first send to the writer having applied the last batch. Two ways of writing, each a
//! row: `per-frame` waits for each frame's write before the next (`send_raw` then `flush`),
//! `coalesced` only queues frames and lets the client's writer send whatever has gathered in
//! one write (`send_raw` alone). Rounds alternate the backends (io_uring, epoll, io_uring,
//! ...) so that drift hits both alike; each figure is the median over rounds.
//!
//! Two batch shapes, both leaving the index as they found it once applied:
//! - `burst`: 32 requests each store a 16-block prompt, then two decode blocks one at a time,
//!   then are evicted: 128 events, 1,152 blocks named (the `wire` bench's batch).
//! - `step`: one such request: 4 events, 36 blocks. Per-frame costs weigh more here.
//!
//! `in-process` is the ceiling: the same frames decoded, validated and applied on one thread,
//! no sockets.

use std::net::SocketAddr;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::BytesMut;
use kvroute_benches::median;
use kvroute_core::{
    BlockHash, DpRank, EventHeader, EventId, IndexConfig, KvEvent, KvEventData, LocalHash,
    PrefixIndex, StorageTier, StoredBlock, WorkerId, WorkerRank,
};
use kvroute_transport::backend::{
    self, set_uring_submit, uring_submit, uring_support, Backend, BackendChoice, UringSubmit,
};
use kvroute_transport::frame::{encode_to_bytes, FrameDecoder};
use kvroute_transport::wire::{KvEventBatch, Message, MessageRef};
use kvroute_transport::{BatchApplier, IngestClient, IngestConfig, IngestServer};

const WORKER: u64 = 1;
const PROMPT_BLOCKS: u64 = 16;
const DECODE_BLOCKS: u64 = 2;
/// Distinct batches cycled through (distinct names and event ids within a cycle).
const RING: u64 = 64;

#[derive(Clone, Copy, Debug)]
struct Shape {
    name: &'static str,
    requests: u64,
}

const SHAPES: [Shape; 2] = [
    Shape {
        name: "burst",
        requests: 32,
    },
    Shape {
        name: "step",
        requests: 1,
    },
];

/// How the client writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Write {
    PerFrame,
    Coalesced,
}

impl Write {
    fn name(self) -> &'static str {
        match self {
            Write::PerFrame => "per-frame",
            Write::Coalesced => "coalesced",
        }
    }
}

struct Args {
    batches: u64,
    rounds: usize,
    shapes: Vec<Shape>,
    writes: Vec<Write>,
    /// The client's backend: `None`, the server's.
    client: Option<Backend>,
    /// io_uring submissions polled by a kernel thread that sleeps after this long idle.
    sqpoll_idle: Option<Duration>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        batches: 20_000,
        rounds: 3,
        shapes: SHAPES.to_vec(),
        writes: vec![Write::PerFrame, Write::Coalesced],
        client: None,
        sqpoll_idle: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--batches" => args.batches = value()?.parse().context("--batches")?,
            "--rounds" => args.rounds = value()?.parse().context("--rounds")?,
            "--shape" => {
                let v = value()?;
                args.shapes = SHAPES.iter().copied().filter(|s| s.name == v).collect();
                if args.shapes.is_empty() {
                    bail!("--shape is burst or step, not {v}");
                }
            }
            "--write" => {
                args.writes = match value()?.as_str() {
                    "both" => vec![Write::PerFrame, Write::Coalesced],
                    "per-frame" => vec![Write::PerFrame],
                    "coalesced" => vec![Write::Coalesced],
                    v => bail!("--write is both, per-frame or coalesced, not {v}"),
                }
            }
            "--sqpoll-idle" => {
                let ms: u64 = value()?.parse().context("--sqpoll-idle")?;
                args.sqpoll_idle = (ms > 0).then(|| Duration::from_millis(ms));
            }
            "--client" => {
                args.client = match value()?.as_str() {
                    "same" => None,
                    "epoll" => Some(Backend::Epoll),
                    "io_uring" => Some(Backend::IoUring),
                    v => bail!("--client is same, epoll or io_uring, not {v}"),
                }
            }
            "--help" | "-h" => {
                println!(
                    "ingest [--batches N (20000)] [--rounds R (3)] [--shape burst|step (both)] \
                     [--write both|per-frame|coalesced (both)] [--client same|epoll|io_uring (same)] \
                     [--sqpoll-idle MS (0: off)]"
                );
                std::process::exit(0);
            }
            _ => bail!("unknown flag {flag} (try --help)"),
        }
    }
    if args.batches == 0 || args.rounds == 0 {
        bail!("--batches and --rounds must be positive");
    }
    Ok(args)
}

/// A deterministic local hash for block `b` of request `r`.
fn local(r: u64, b: u64) -> LocalHash {
    LocalHash(
        (r << 20 | b)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(17),
    )
}

/// Batch `k` of the ring: `shape.requests` requests stored, grown and evicted.
fn batch(shape: Shape, k: u64) -> KvEventBatch {
    let rank = WorkerRank {
        worker: WorkerId(WORKER),
        dp_rank: DpRank(0),
    };
    let per_batch = shape.requests * 4;
    let mut id = k * per_batch;
    let mut header = || {
        id += 1;
        EventHeader {
            source: rank,
            event_id: EventId(id),
            tier: StorageTier::Device,
        }
    };
    let name = |r: u64, b: u64| BlockHash((r << 32) | (b + 1));
    let block = |r: u64, b: u64| StoredBlock {
        block_hash: name(r, b),
        local_hash: local(r, b),
    };
    let mut events = Vec::new();
    for i in 0..shape.requests {
        let r = k * shape.requests + i;
        events.push(KvEvent {
            header: header(),
            data: KvEventData::Stored {
                parent: None,
                blocks: (0..PROMPT_BLOCKS).map(|b| block(r, b)).collect(),
            },
        });
        for b in PROMPT_BLOCKS..PROMPT_BLOCKS + DECODE_BLOCKS {
            events.push(KvEvent {
                header: header(),
                data: KvEventData::Stored {
                    parent: Some(name(r, b - 1)),
                    blocks: vec![block(r, b)],
                },
            });
        }
        events.push(KvEvent {
            header: header(),
            data: KvEventData::Removed {
                blocks: (0..PROMPT_BLOCKS + DECODE_BLOCKS)
                    .rev()
                    .map(|b| name(r, b))
                    .collect(),
            },
        });
    }
    KvEventBatch::from_core(WorkerId(WORKER), 0, &events).expect("one worker's events")
}

fn frames(shape: Shape) -> Result<Vec<Vec<u8>>> {
    (0..RING)
        .map(|k| {
            let bytes = encode_to_bytes(&Message::KvEvents(batch(shape, k)))?;
            Ok(bytes.to_vec())
        })
        .collect()
}

fn new_index() -> PrefixIndex {
    PrefixIndex::new(IndexConfig::default())
}

/// One run over sockets; returns the seconds from the first write to the last batch applied.
fn run_sockets(
    backend: Backend,
    client_backend: Backend,
    write: Write,
    frames: &[Vec<u8>],
    batches: u64,
) -> Result<f64> {
    let addr: SocketAddr = "127.0.0.1:0".parse()?;
    let server = IngestServer::start(
        IngestConfig {
            backend: match backend {
                Backend::IoUring => BackendChoice::IoUring,
                Backend::Epoll => BackendChoice::Epoll,
            },
            threads: 1,
            ..IngestConfig::new(addr)
        },
        new_index(),
    )?;
    let addr = server.local_addr();
    let frames = frames.to_vec();
    let (started_tx, started_rx) = mpsc::channel();
    let client = thread::spawn(move || -> Result<()> {
        backend::block_on(client_backend, async move {
            let mut c = IngestClient::connect(addr, client_backend).await?;
            started_tx.send(Instant::now())?;
            for i in 0..batches {
                c.send_raw(&frames[(i % RING) as usize]).await?;
                if write == Write::PerFrame {
                    c.flush().await?;
                }
            }
            c.close().await?;
            Ok(())
        })?
    });
    let started = started_rx
        .recv()
        .context("the client failed before its first write")?;
    let mut client = Some(client);
    let deadline = Instant::now() + Duration::from_secs(300);
    while server.stats().apply.batches < batches {
        // A client that failed ends the run now, not at the deadline.
        if client.as_ref().is_some_and(|c| c.is_finished()) {
            join(client.take())?;
        }
        if Instant::now() > deadline {
            bail!("{backend}: the run stalled: {:?}", server.stats());
        }
        thread::sleep(Duration::from_micros(200));
    }
    let secs = started.elapsed().as_secs_f64();
    join(client)?;
    let report = server.shutdown()?;
    let s = report.stats;
    if s.decode.rejected() != 0 || s.apply.applied != s.apply.events {
        bail!("{backend}: rejections in the run: {s:?}");
    }
    Ok(secs)
}

fn join(client: Option<thread::JoinHandle<Result<()>>>) -> Result<()> {
    match client {
        Some(c) => c
            .join()
            .map_err(|_| anyhow::anyhow!("client thread panicked"))?,
        None => Ok(()),
    }
}

/// The ceiling: decode, validate and apply the same frames on one thread.
fn run_in_process(frames: &[Vec<u8>], batches: u64) -> Result<f64> {
    let mut index = new_index();
    let mut applier = BatchApplier::new();
    let mut decoder = FrameDecoder::default();
    let started = Instant::now();
    for i in 0..batches {
        let mut buf = BytesMut::from(&frames[(i % RING) as usize][..]);
        let frame = decoder.decode(&mut buf)?.context("a whole frame")?;
        match decoder.validate(&frame)? {
            MessageRef::KvEvents(b) => {
                let o = applier.apply_batch(&mut index, b);
                if o.rejected != 0 {
                    bail!("in-process: {o:?}");
                }
            }
            other => bail!("unexpected {:?}", other.kind()),
        }
    }
    Ok(started.elapsed().as_secs_f64())
}

fn main() -> Result<()> {
    let args = parse_args()?;
    if let Some(idle) = args.sqpoll_idle {
        if let Err(mode) = set_uring_submit(UringSubmit::KernelPoll { idle }) {
            bail!("io_uring submission already fixed: {mode}");
        }
    }
    let uring = uring_support();
    let mut backends = Vec::new();
    match &uring {
        Ok(()) => backends.push(Backend::IoUring),
        Err(reason) => println!("io_uring unavailable ({reason}): epoll only"),
    }
    backends.push(Backend::Epoll);

    println!(
        "{} batches per run, {} rounds, median events/s (one connection, loopback, client on {}); \
         io_uring {}",
        args.batches,
        args.rounds,
        args.client.map_or("the server's backend", Backend::name),
        uring_submit()
    );
    println!(
        "{:<6} {:>7} {:<10} {:>14} {:>14} {:>14} {:>8}",
        "shape", "events", "write", "in-process", "io_uring", "epoll", "ratio"
    );
    for shape in &args.shapes {
        let frames = frames(*shape)?;
        let events = (shape.requests * 4 * args.batches) as f64;
        // [write][backend] -> seconds per round
        let mut times: Vec<Vec<Vec<f64>>> =
            vec![vec![Vec::new(); backends.len()]; args.writes.len()];
        let mut local = Vec::new();
        for _ in 0..args.rounds {
            local.push(run_in_process(&frames, args.batches)?);
            for (w, write) in args.writes.iter().enumerate() {
                for (i, b) in backends.iter().enumerate() {
                    let client = args.client.unwrap_or(*b);
                    times[w][i].push(run_sockets(*b, client, *write, &frames, args.batches)?);
                }
            }
        }
        // At least one round ran (`--rounds` is positive).
        let rate = |t: Vec<f64>| events / median(t).unwrap_or(f64::NAN);
        let local = rate(local);
        for (w, write) in args.writes.iter().enumerate() {
            let rates: Vec<f64> = times[w].drain(..).map(rate).collect();
            let (uring_rate, epoll_rate) = match rates.as_slice() {
                [u, e] => (Some(*u), *e),
                [e] => (None, *e),
                _ => bail!("no backend ran"),
            };
            println!(
                "{:<6} {:>7} {:<10} {:>14.0} {:>14} {:>14.0} {:>8}",
                shape.name,
                shape.requests * 4,
                write.name(),
                local,
                uring_rate.map_or("-".into(), |u| format!("{u:.0}")),
                epoll_rate,
                uring_rate.map_or("-".into(), |u| format!("{:.3}", u / epoll_rate)),
            );
        }
    }
    Ok(())
}
