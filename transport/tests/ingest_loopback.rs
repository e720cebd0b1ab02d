//! KV event ingest over loopback sockets, on both backends: batches sent by clients land in
//! the index exactly as if applied directly; broken peers are cut and counted without
//! disturbing the others; shutdown returns. io_uring cases are skipped, with a message, where
//! the kernel or a seccomp filter refuses io_uring.

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

use bytes::BytesMut;
use kvroute_core::testing::scores_of;
use kvroute_core::{
    BlockHash, DpRank, EventHeader, EventId, IndexConfig, KvEvent, KvEventData, LocalHash,
    MatchOptions, PrefixIndex, StorageTier, StoredBlock, WorkerId, WorkerRank,
};
use kvroute_transport::backend::{self, uring_support, Backend, BackendChoice};
use kvroute_transport::frame::{encode_kv_events, HEADER_LEN, MAGIC};
use kvroute_transport::wire::{KvEventBatch, MessageKind, PROTOCOL_VERSION};
use kvroute_transport::{IngestClient, IngestConfig, IngestServer, IngestStats};

/// Every wait in these tests gives up after this long.
const PATIENCE: Duration = Duration::from_secs(10);

const GROUPS: u64 = 4;
const PROMPTS: u64 = 32;
const SHARED: u64 = 4;
const OWN: u64 = 4;

// ---- workload ----

fn backends() -> Vec<Backend> {
    let mut out = vec![Backend::Epoll];
    match uring_support() {
        Ok(()) => out.push(Backend::IoUring),
        Err(reason) => eprintln!("skipping the io_uring backend: {reason}"),
    }
    out
}

fn local(group: u64, prompt: Option<u64>, j: u64) -> LocalHash {
    LocalHash(match prompt {
        None => 1_000 * (group + 1) + j,
        Some(p) => 1_000_000 * (p + 1) + j,
    })
}

/// The engine's name of a block: the same content has the same name on every worker, as with
/// chained sequence hashes.
fn name(l: LocalHash) -> BlockHash {
    BlockHash(l.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
}

fn block(l: LocalHash) -> StoredBlock {
    StoredBlock {
        block_hash: name(l),
        local_hash: l,
    }
}

/// The local hashes of a prompt: its group's shared prefix, then its own blocks.
fn prompt_hashes(p: u64) -> Vec<LocalHash> {
    let g = p % GROUPS;
    (0..SHARED)
        .map(|j| local(g, None, j))
        .chain((0..OWN).map(|j| local(g, Some(p), j)))
        .collect()
}

/// One rank of `worker` stores every prompt (the first of a group brings the shared prefix),
/// then evicts the last block of every third prompt.
fn worker_events(worker: u64) -> Vec<KvEvent> {
    let source = WorkerRank {
        worker: WorkerId(worker),
        dp_rank: DpRank(0),
    };
    let mut id = 0;
    let mut header = || {
        id += 1;
        EventHeader {
            source,
            event_id: EventId(id),
            tier: StorageTier::Device,
        }
    };
    let mut events = Vec::new();
    for p in 0..PROMPTS {
        let hashes = prompt_hashes(p);
        let (parent, blocks) = if p < GROUPS {
            (None, &hashes[..])
        } else {
            (
                Some(name(hashes[SHARED as usize - 1])),
                &hashes[SHARED as usize..],
            )
        };
        events.push(KvEvent {
            header: header(),
            data: KvEventData::Stored {
                parent,
                blocks: blocks.iter().copied().map(block).collect(),
            },
        });
    }
    for p in (0..PROMPTS).step_by(3) {
        let last = prompt_hashes(p)[(SHARED + OWN) as usize - 1];
        events.push(KvEvent {
            header: header(),
            data: KvEventData::Removed {
                blocks: vec![name(last)],
            },
        });
    }
    events
}

fn worker_batches(worker: u64) -> Vec<KvEventBatch> {
    worker_events(worker)
        .chunks(5)
        .map(|c| KvEventBatch::from_core(WorkerId(worker), 0, c).expect("one worker"))
        .collect()
}

fn new_index() -> PrefixIndex {
    PrefixIndex::new(IndexConfig {
        shards: 2,
        ..IndexConfig::default()
    })
}

/// The index the batches give when applied directly, in process.
fn applied_directly(batches: &[&[KvEventBatch]]) -> PrefixIndex {
    let mut index = new_index();
    for batch in batches.iter().flat_map(|b| b.iter()) {
        for e in batch.to_core() {
            // Rejections are part of the state being compared.
            let _ = index.apply(&e);
        }
    }
    index
}

fn assert_same_index(got: &PrefixIndex, want: &PrefixIndex) {
    let (g, w) = (got.stats(), want.stats());
    assert_eq!(g.ranks, w.ranks, "ranks");
    assert_eq!(g.blocks, w.blocks, "blocks");
    assert_eq!(g.stored_pairs, w.stored_pairs, "stored pairs");
    assert_eq!(g.errors, w.errors, "errors");
    assert_eq!(g.events, w.events, "event counts");
    for p in 0..PROMPTS {
        let q = prompt_hashes(p);
        let mut gs = scores_of(&got.reader(), &q, MatchOptions::default()).scores;
        let mut ws = scores_of(&want.reader(), &q, MatchOptions::default()).scores;
        gs.sort();
        ws.sort();
        assert_eq!(gs, ws, "scores of prompt {p}");
    }
}

// ---- harness ----

fn config(backend: Backend) -> IngestConfig {
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("loopback address");
    IngestConfig {
        backend: match backend {
            Backend::IoUring => BackendChoice::IoUring,
            Backend::Epoll => BackendChoice::Epoll,
        },
        threads: 2,
        // Small, so that connections wait on the writer now and then.
        queue_frames: 4,
        max_payload: 1 << 20,
        shutdown_grace: Duration::from_secs(5),
        ..IngestConfig::new(addr)
    }
}

/// Runs `f` with a client connected to `addr`, on a thread and runtime of its own.
fn client<F, Fut>(backend: Backend, addr: SocketAddr, f: F) -> thread::JoinHandle<()>
where
    F: FnOnce(IngestClient) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    thread::spawn(move || {
        backend::block_on(backend, async move {
            let c = IngestClient::connect(addr, backend)
                .await
                .expect("connects");
            assert_eq!(c.backend(), backend);
            f(c).await;
        })
        .expect("client runtime");
    })
}

/// A client that sends `batches` and closes.
fn good_client(
    backend: Backend,
    addr: SocketAddr,
    batches: Vec<KvEventBatch>,
) -> thread::JoinHandle<()> {
    client(backend, addr, move |mut c| async move {
        for b in &batches {
            c.send_batch(b).await.expect("sends");
        }
        c.close().await.expect("closes");
    })
}

/// A client that sends `bytes` and expects the server to hang up.
fn bad_client(backend: Backend, addr: SocketAddr, bytes: Vec<u8>) -> thread::JoinHandle<()> {
    client(backend, addr, move |mut c| async move {
        c.send_raw(&bytes).await.expect("sends");
        c.wait_closed_by_peer(PATIENCE)
            .await
            .expect("the server closes the connection");
    })
}

/// Polls the server's stats until `done` holds; fails the test after [`PATIENCE`].
fn wait_for(server: &IngestServer, done: impl Fn(&IngestStats) -> bool) -> IngestStats {
    let start = Instant::now();
    loop {
        let s = server.stats();
        if done(&s) {
            return s;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "timed out; stats so far: {s:#?}"
        );
        thread::sleep(Duration::from_millis(5));
    }
}

fn total_batches(sets: &[&[KvEventBatch]]) -> u64 {
    sets.iter().map(|s| s.len() as u64).sum()
}

fn frame_bytes(batch: &KvEventBatch) -> Vec<u8> {
    let mut out = BytesMut::new();
    encode_kv_events(batch, &mut out).expect("encodes");
    out.to_vec()
}

// ---- tests ----

#[test]
fn two_clients_land_as_if_applied_directly() {
    for backend in backends() {
        let server = IngestServer::start(config(backend), new_index()).expect("starts");
        assert_eq!(server.backend(), backend);
        let addr = server.local_addr();
        let (a, b) = (worker_batches(1), worker_batches(2));
        let clients = [
            good_client(backend, addr, a.clone()),
            good_client(backend, addr, b.clone()),
        ];
        for c in clients {
            c.join().expect("client thread");
        }
        let want = total_batches(&[&a, &b]);
        wait_for(&server, |s| {
            s.connections.closed == 2 && s.apply.batches == want
        });
        let report = server.shutdown().expect("shuts down");
        let s = &report.stats;
        assert_eq!(s.connections.accepted, 2, "{backend}");
        assert_eq!(s.decode.rejected(), 0, "{backend}");
        assert_eq!(s.queued, want, "{backend}");
        assert_eq!(s.apply.unreadable, 0, "{backend}");
        assert_same_index(
            report.target.index().expect("its own index"),
            &applied_directly(&[&a, &b]),
        );
    }
}

#[test]
fn bad_frames_close_only_their_connection() {
    for backend in backends() {
        let server = IngestServer::start(config(backend), new_index()).expect("starts");
        let addr = server.local_addr();
        let good = worker_batches(7);
        let frame = frame_bytes(&worker_batches(9)[0]);

        let garbage = b"GET / HTTP/1.1\r\nHost: kvroute\r\n\r\n".to_vec();
        let mut wrong_version = frame.clone();
        wrong_version[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
        let mut oversized = frame[..HEADER_LEN].to_vec();
        oversized[8..12].copy_from_slice(&(2u32 << 20).to_le_bytes());
        let mut invalid = Vec::new();
        invalid.extend_from_slice(&MAGIC);
        invalid.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        invalid.extend_from_slice(&[MessageKind::KvEvents.code(), 0]);
        invalid.extend_from_slice(&32u32.to_le_bytes());
        invalid.extend_from_slice(&0u32.to_le_bytes());
        invalid.extend_from_slice(&[0xff; 32]);

        let clients = [
            good_client(backend, addr, good.clone()),
            bad_client(backend, addr, garbage),
            bad_client(backend, addr, wrong_version),
            bad_client(backend, addr, oversized),
            bad_client(backend, addr, invalid),
        ];
        for c in clients {
            c.join().expect("client thread");
        }
        let want = good.len() as u64;
        wait_for(&server, |s| {
            s.connections.rejected == 4 && s.connections.closed == 1 && s.apply.batches == want
        });
        let report = server.shutdown().expect("shuts down");
        let d = report.stats.decode;
        assert_eq!(
            (
                d.bad_magic,
                d.unsupported_version,
                d.oversized,
                d.invalid_payload
            ),
            (1, 1, 1, 1),
            "{backend}: {d:?}"
        );
        assert_eq!(d.rejected(), 4, "{backend}");
        assert_same_index(
            report.target.index().expect("its own index"),
            &applied_directly(&[&good]),
        );
    }
}

#[test]
fn peer_killed_mid_frame_is_counted_and_harmless() {
    for backend in backends() {
        let server = IngestServer::start(config(backend), new_index()).expect("starts");
        let addr = server.local_addr();
        let good = worker_batches(3);
        let killed = worker_batches(4);
        let sent_whole = killed[..3].to_vec();
        let half = {
            let f = frame_bytes(&killed[3]);
            f[..f.len() / 2].to_vec()
        };
        let clients = [
            good_client(backend, addr, good.clone()),
            client(backend, addr, move |mut c| async move {
                for b in &sent_whole {
                    c.send_batch(b).await.expect("sends");
                }
                c.send_raw(&half).await.expect("sends");
                c.flush().await.expect("written");
                // Killed: the socket goes away with half a frame sent.
                drop(c);
            }),
        ];
        for c in clients {
            c.join().expect("client thread");
        }
        let want = good.len() as u64 + 3;
        wait_for(&server, |s| {
            s.connections.truncated == 1 && s.connections.closed == 1 && s.apply.batches == want
        });
        let report = server.shutdown().expect("shuts down");
        assert_eq!(report.stats.decode.truncated, 1, "{backend}");
        assert_eq!(report.stats.decode.rejected(), 1, "{backend}");
        assert_same_index(
            report.target.index().expect("its own index"),
            &applied_directly(&[&good, &killed[..3]]),
        );
    }
}

#[test]
fn shutdown_returns_and_cuts_idle_connections_after_the_grace_period() {
    for backend in backends() {
        let server = IngestServer::start(
            IngestConfig {
                shutdown_grace: Duration::from_millis(200),
                ..config(backend)
            },
            new_index(),
        )
        .expect("starts");
        let addr = server.local_addr();
        let batches = worker_batches(5);
        let first = batches[0].clone();
        // Sends one batch, then stays connected until the server hangs up.
        let idle = client(backend, addr, move |mut c| async move {
            c.send_batch(&first).await.expect("sends");
            c.wait_closed_by_peer(PATIENCE)
                .await
                .expect("shutdown closes the connection");
        });
        wait_for(&server, |s| {
            s.connections.accepted == 1 && s.apply.batches == 1
        });
        let started = Instant::now();
        let report = server.shutdown().expect("shuts down");
        assert!(
            started.elapsed() < PATIENCE,
            "{backend}: shutdown took too long"
        );
        assert_eq!(report.stats.connections.cut_at_shutdown, 1, "{backend}");
        assert_eq!(report.stats.apply.batches, 1, "{backend}");
        idle.join().expect("client thread");
    }
}

#[test]
fn shutdown_of_an_idle_server_returns_an_empty_report() {
    for backend in backends() {
        let server = IngestServer::start(config(backend), new_index()).expect("starts");
        let report = server.shutdown().expect("shuts down");
        assert_eq!(report.stats, IngestStats::default(), "{backend}");
        assert_eq!(
            report
                .target
                .index()
                .expect("its own index")
                .stats()
                .stored_pairs,
            0
        );
    }
}

#[test]
fn forcing_io_uring_where_it_is_missing_is_an_error_not_a_panic() {
    if uring_support().is_ok() {
        // Nothing to check here: it is available.
        return;
    }
    let err = IngestServer::start(config(Backend::IoUring), new_index());
    assert!(err.is_err());
}

/// Into a router: the events land in the router's index (its matches see them, exactly as
/// applied directly) and the router notes each one: stored blocks feed its measure of each
/// worker's cache, and an eviction retires the worker's speculative records.
#[test]
fn events_into_a_router_land_in_its_index_and_are_noted() {
    use kvroute_core::RequestId;
    use kvroute_core::{Approximate, Speculative};
    use kvroute_core::{EvidenceLevel, Mode};
    use kvroute_core::{RouteHints, RouteRequest, Router, RouterConfig, WorkerConfig};
    use std::sync::Arc;

    const BS: u32 = 16;
    for backend in backends() {
        let router = Arc::new(
            Router::new(
                RouterConfig {
                    approximate: Approximate {
                        speculative: Speculative::On {
                            ttl: Duration::from_secs(600),
                        },
                        ..Approximate::default()
                    },
                    ..RouterConfig::default()
                },
                new_index(),
            )
            .expect("a router"),
        );
        for w in [1, 2] {
            router
                .join_worker(WorkerConfig::simple(w, 100_000, BS))
                .expect("joins");
        }
        // A booked route on worker 1 leaves a speculative record there.
        let tokens: Vec<u32> = (0..128).collect();
        let mut q = RouteRequest {
            id: RequestId(1),
            tokens: &tokens,
            hints: RouteHints::default(),
        };
        q.hints.pinned.backend_instance = Some(WorkerId(1));
        router.route(&q).expect("routes");
        let overlap_on = |worker: u64| {
            let mut q = RouteRequest {
                id: RequestId(2),
                tokens: &tokens,
                hints: RouteHints::default(),
            };
            q.hints.mode = Mode::QueryOnly;
            q.hints.evidence = EvidenceLevel::Full;
            let d = router.route(&q).expect("routes");
            d.evidence
                .expect("full evidence")
                .iter()
                .find(|c| c.rank.worker == WorkerId(worker))
                .map_or(0, |c| c.overlap.blocks)
        };
        assert_eq!(overlap_on(1), 8, "{backend}: the speculative record");

        let server = IngestServer::start(config(backend), Arc::clone(&router)).expect("starts");
        let (a, b) = (worker_batches(1), worker_batches(2));
        for c in [
            good_client(backend, server.local_addr(), a.clone()),
            good_client(backend, server.local_addr(), b.clone()),
        ] {
            c.join().expect("client thread");
        }
        let want = total_batches(&[&a, &b]);
        wait_for(&server, |s| s.apply.batches == want);
        let report = server.shutdown().expect("shuts down");
        assert!(report.target.index().is_none());
        assert_eq!(report.stats.apply.rejected, 0, "{backend}");

        // The router's matches see exactly what direct application gives.
        let direct = applied_directly(&[&a, &b]);
        let reader = router.index_reader();
        for p in 0..PROMPTS {
            let q = prompt_hashes(p);
            let mut got = scores_of(&reader, &q, MatchOptions::default()).scores;
            let mut want = scores_of(&direct.reader(), &q, MatchOptions::default()).scores;
            got.sort();
            want.sort();
            assert_eq!(got, want, "{backend}: prompt {p}");
        }
        // Noted: each worker's stored blocks less its evictions, and worker 1's evictions
        // retired its speculative record.
        let fleet = router.fleet();
        let stored: u64 = worker_events(1)
            .iter()
            .map(|e| match &e.data {
                KvEventData::Stored { blocks, .. } => blocks.len() as i64,
                KvEventData::Removed { blocks } => -(blocks.len() as i64),
                KvEventData::Cleared => 0,
            })
            .sum::<i64>() as u64;
        for r in fleet.ranks.iter() {
            assert_eq!(r.state.reported_blocks(), stored, "{backend}: {:?}", r.rank);
        }
        assert_eq!(overlap_on(1), 0, "{backend}: speculation retired");
    }
}

/// A Hello binds its connection to its worker: that worker's batches land, and a batch for
/// another worker closes the connection, counted, before anything of it is applied. Another
/// connection, with no Hello, is not bound.
#[test]
fn a_hello_binds_its_connection_to_its_worker() {
    use kvroute_transport::frame::encode;
    use kvroute_transport::wire::{Hello, Role};
    use kvroute_transport::Message;

    for backend in backends() {
        let server = IngestServer::start(config(backend), new_index()).expect("starts");
        let addr = server.local_addr();
        let hello = |worker: u64| {
            let mut out = BytesMut::new();
            let h = Hello {
                protocol_version: PROTOCOL_VERSION,
                worker_id: worker,
                dp_start: 0,
                dp_size: 1,
                kv_blocks: 1 << 14,
                block_size: 16,
                role: Role::Aggregated,
                max_batched_tokens: 8192,
                labels: Vec::new(),
            };
            encode(&Message::Hello(h), &mut out).expect("encodes");
            out.to_vec()
        };
        let (mine, theirs) = (worker_batches(3), worker_batches(4));
        // Hello as worker 3, its first batch, then worker 4's: cut after the first.
        let mut bytes = hello(3);
        bytes.extend(frame_bytes(&mine[0]));
        bytes.extend(frame_bytes(&theirs[0]));
        bytes.extend(frame_bytes(&mine[1]));
        let spoofer = bad_client(backend, addr, bytes);
        // The same Hello again is fine; unbound, worker 4's batches land.
        let mut again = hello(3);
        again.extend(frame_bytes(&mine[0]));
        let repeat = client(backend, addr, move |mut c| async move {
            c.send_raw(&again).await.expect("sends");
            c.close().await.expect("closes");
        });
        let unbound = good_client(backend, addr, theirs.clone());
        for c in [spoofer, repeat, unbound] {
            c.join().expect("client thread");
        }
        let want = 2 + theirs.len() as u64;
        let s = wait_for(&server, |s| {
            s.apply.batches == want && s.connections.foreign + s.connections.closed == 3
        });
        assert_eq!(s.connections.foreign, 1, "{backend}: {s:?}");
        assert_eq!(s.ignored, 2, "{backend}: two Hellos");
        let report = server.shutdown().expect("shuts down");
        let index = report.target.index().expect("its own index");
        assert_same_index(index, &applied_directly(&[&mine[..1], &mine[..1], &theirs]));
    }
}
