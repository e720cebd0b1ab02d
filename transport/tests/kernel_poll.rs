//! io_uring rings whose submissions a kernel thread polls ([`UringSubmit::KernelPoll`]). The
//! mode is process-wide, so it has this test binary to itself: it is fixed once, and rings on
//! several runtimes (the server's threads, each client's) then share one poller and carry
//! events into the index exactly as the default mode does. Skipped, with a message, where the
//! kernel refuses io_uring or its polled mode.

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

use kvroute_core::testing::scores_of;
use kvroute_core::{
    BlockHash, DpRank, EventHeader, EventId, IndexConfig, KvEvent, KvEventData, LocalHash,
    MatchOptions, PrefixIndex, StorageTier, StoredBlock, WorkerId, WorkerRank,
};
use kvroute_transport::backend::{
    self, set_uring_submit, uring_submit, uring_support, Backend, BackendChoice, UringSubmit,
};
use kvroute_transport::wire::KvEventBatch;
use kvroute_transport::{IngestClient, IngestConfig, IngestServer};

const PATIENCE: Duration = Duration::from_secs(10);

/// Worker `w` stores one chain of eight blocks (the first four shared by every worker), then
/// evicts its last block.
fn events(w: u64) -> Vec<KvEvent> {
    let header = |id| EventHeader {
        source: WorkerRank {
            worker: WorkerId(w),
            dp_rank: DpRank(0),
        },
        event_id: EventId(id),
        tier: StorageTier::Device,
    };
    let local = |j: u64| LocalHash(if j < 4 { 100 + j } else { 1_000 * w + j });
    let name = |j: u64| BlockHash(local(j).0.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    vec![
        KvEvent {
            header: header(1),
            data: KvEventData::Stored {
                parent: None,
                blocks: (0..8)
                    .map(|j| StoredBlock {
                        block_hash: name(j),
                        local_hash: local(j),
                    })
                    .collect(),
            },
        },
        KvEvent {
            header: header(2),
            data: KvEventData::Removed {
                blocks: vec![name(7)],
            },
        },
    ]
}

fn query(w: u64) -> Vec<LocalHash> {
    (0..8)
        .map(|j| LocalHash(if j < 4 { 100 + j } else { 1_000 * w + j }))
        .collect()
}

fn new_index() -> PrefixIndex {
    PrefixIndex::new(IndexConfig {
        shards: 2,
        ..IndexConfig::default()
    })
}

/// The process's submission-queue poller threads (the kernel names them `iou-sqp-<pid>`).
fn poller_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("iou-sqp"))
        .count()
}

#[test]
fn kernel_polled_rings_carry_events_into_the_index() {
    if let Err(reason) = uring_support() {
        eprintln!("skipping: no io_uring here: {reason}");
        return;
    }
    let mode = UringSubmit::KernelPoll {
        idle: Duration::from_millis(10),
    };
    assert_eq!(set_uring_submit(mode), Ok(()));
    assert_eq!(set_uring_submit(mode), Ok(()), "the same mode again");
    assert_eq!(
        set_uring_submit(UringSubmit::OnIdle),
        Err(mode),
        "the first mode stays"
    );
    assert_eq!(uring_submit(), mode);
    if let Err(e) = backend::block_on(Backend::IoUring, async {}) {
        eprintln!("skipping: the kernel refuses a polled ring: {e}");
        return;
    }

    let addr: SocketAddr = "127.0.0.1:0".parse().expect("loopback address");
    let server = IngestServer::start(
        IngestConfig {
            backend: BackendChoice::IoUring,
            threads: 2,
            ..IngestConfig::new(addr)
        },
        new_index(),
    )
    .expect("starts on polled rings");
    let addr = server.local_addr();
    assert_eq!(
        poller_threads(),
        1,
        "one kernel thread polls the server's two rings and the first ring's"
    );
    let workers = [1u64, 2, 3];
    let clients: Vec<_> = workers
        .iter()
        .map(|&w| {
            thread::spawn(move || {
                backend::block_on(Backend::IoUring, async move {
                    let mut c = IngestClient::connect(addr, Backend::IoUring)
                        .await
                        .expect("connects");
                    assert_eq!(poller_threads(), 1, "client {w}'s ring shares it too");
                    let batch =
                        KvEventBatch::from_core(WorkerId(w), 0, &events(w)).expect("one worker");
                    c.send_batch(&batch).await.expect("sends");
                    c.close().await.expect("closes");
                })
                .expect("client runtime");
            })
        })
        .collect();
    for c in clients {
        c.join().expect("client thread");
    }
    let start = Instant::now();
    while server.stats().apply.batches < workers.len() as u64 {
        assert!(start.elapsed() < PATIENCE, "{:#?}", server.stats());
        thread::sleep(Duration::from_millis(5));
    }
    let report = server.shutdown().expect("shuts down");
    assert_eq!(report.stats.decode.rejected(), 0);

    let mut want = new_index();
    for w in workers {
        for e in events(w) {
            want.apply(&e).expect("valid events");
        }
    }
    let got = report.target.index().expect("its own index");
    assert_eq!(got.stats().stored_pairs, want.stats().stored_pairs);
    assert_eq!(got.stats().stored_pairs, 3 * 7);
    for w in workers {
        let mut g = scores_of(&got.reader(), &query(w), MatchOptions::default()).scores;
        let mut x = scores_of(&want.reader(), &query(w), MatchOptions::default()).scores;
        g.sort();
        x.sort();
        assert_eq!(g, x, "worker {w}'s chain");
    }
}
