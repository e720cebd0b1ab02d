//! Request dispatch over loopback sockets, on both backends: a worker server with a simulated
//! engine, router clients dispatching requests and reading their response streams, KV event
//! batches flowing the other way into an ingest server; a worker killed mid-stream, a worker
//! of the wrong id, garbage frames, cancels, reconnects and shutdown. io_uring cases are
//! skipped, with a message, where the kernel or a seccomp filter refuses io_uring.

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

use std::future::Future;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::rc::Rc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use kvroute_core::testing::scores_of;
use kvroute_core::{
    BlockHash, DpRank, EventHeader, EventId, IndexConfig, KvEvent, KvEventData, LocalHash,
    MatchOptions, PrefixIndex, StorageTier, StoredBlock, WorkerId, WorkerRank,
};
use kvroute_transport::backend::{self, uring_support, Backend, BackendChoice};
use kvroute_transport::dispatch::LinkError;
use kvroute_transport::frame::{encode, HEADER_LEN, MAGIC};
use kvroute_transport::wire::{
    Dispatch, DispatchHints, FinishReason, Hello, KvEventBatch, Message, RankLoad, ResponseItem,
    Role, Sampling, PROTOCOL_VERSION,
};
use kvroute_transport::{
    Backoff, DispatchClient, DispatchConfig, DispatchError, Engine, IngestClient, IngestConfig,
    IngestServer, LinkState, ResponseSink, StreamError, WorkerServer, WorkerServerConfig,
    WorkerStats,
};

/// Every wait in these tests gives up after this long.
const PATIENCE: Duration = Duration::from_secs(10);
const WORKER: WorkerId = WorkerId(17);
/// A request whose first token is this sends its items, then never finishes.
const HANG: u32 = u32::MAX;
/// A request whose first token is this sends its items, then its future ends unfinished.
const UNFINISHED: u32 = u32::MAX - 1;

fn backends() -> Vec<Backend> {
    let mut out = vec![Backend::Epoll];
    match uring_support() {
        Ok(()) => out.push(Backend::IoUring),
        Err(reason) => eprintln!("skipping the io_uring backend: {reason}"),
    }
    out
}

fn choice(backend: Backend) -> BackendChoice {
    match backend {
        Backend::IoUring => BackendChoice::IoUring,
        Backend::Epoll => BackendChoice::Epoll,
    }
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().expect("loopback address")
}

// ---- the simulated engine ----

/// Echoes a request's tokens back one per item, `max_tokens` items, then finishes `Length`
/// (or hangs, for requests that start with [`HANG`]).
#[derive(Debug)]
struct Echo;

impl Engine for Echo {
    // Not an `async fn`: that would borrow `self`, and the request's future must not.
    #[allow(clippy::manual_async_fn)]
    fn serve(
        &self,
        request: Dispatch,
        mut sink: ResponseSink,
    ) -> impl Future<Output = ()> + 'static {
        async move {
            let tokens = request.tokens;
            for i in 0..request.sampling.max_tokens as usize {
                let token = tokens.get(i % tokens.len().max(1)).copied().unwrap_or(0);
                if sink.send(vec![token]).await.is_err() {
                    return;
                }
                tokio::task::yield_now().await;
            }
            match tokens.first() {
                Some(&HANG) => std::future::pending::<()>().await,
                Some(&UNFINISHED) => return,
                _ => {}
            }
            let _ = sink.finish(Vec::new(), FinishReason::Length).await;
        }
    }

    fn load(&self) -> Vec<RankLoad> {
        vec![RankLoad {
            dp_rank: 0,
            active_blocks: 7,
            total_blocks: 100,
            running: 3,
            waiting: 1,
        }]
    }
}

fn hello(worker: WorkerId) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        worker_id: worker.0,
        dp_start: 0,
        dp_size: 1,
        kv_blocks: 100,
        block_size: 16,
        role: Role::Aggregated,
        max_batched_tokens: 8192,
        labels: Vec::new(),
    }
}

fn worker_config(backend: Backend, addr: SocketAddr) -> WorkerServerConfig {
    WorkerServerConfig {
        backend: choice(backend),
        threads: 2,
        heartbeat_interval: Duration::from_millis(50),
        idle_timeout: Duration::from_secs(5),
        shutdown_grace: Duration::from_secs(5),
        ..WorkerServerConfig::new(addr)
    }
}

fn start_worker(backend: Backend) -> WorkerServer {
    WorkerServer::start(
        worker_config(backend, loopback()),
        hello(WORKER),
        Arc::new(Echo),
    )
    .expect("worker starts")
}

fn client_config(backend: Backend, addr: SocketAddr, worker: WorkerId) -> DispatchConfig {
    DispatchConfig {
        max_in_flight: 8,
        stream_buffer: 4,
        heartbeat_interval: Duration::from_millis(50),
        idle_timeout: Duration::from_secs(5),
        backoff: Backoff {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
        },
        shutdown_grace: Duration::from_secs(5),
        ..DispatchConfig::new(addr, worker, backend)
    }
}

fn request(id: u64, tokens: Vec<u32>, max_tokens: u32) -> Dispatch {
    Dispatch {
        request_id: id,
        tokens,
        sampling: Sampling {
            max_tokens,
            min_tokens: 0,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
        },
        hints: DispatchHints {
            dp_rank: 0,
            overlap_blocks: 0,
            lora_name: None,
            priority: 0,
            expected_output_tokens: None,
        },
        bootstrap: None,
    }
}

/// Reads a stream to its end: the items, and the error if it ended with one.
async fn drain(
    stream: &mut kvroute_transport::ResponseStream,
) -> (Vec<ResponseItem>, Option<StreamError>) {
    let mut items = Vec::new();
    while let Some(next) = tokio::time::timeout(PATIENCE, stream.next())
        .await
        .expect("the stream moves")
    {
        match next {
            Ok(item) => items.push(item),
            Err(e) => return (items, Some(e)),
        }
    }
    (items, None)
}

/// Polls `done` until it holds; fails the test after [`PATIENCE`].
async fn eventually<T: std::fmt::Debug>(
    what: &str,
    mut probe: impl FnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let start = Instant::now();
    loop {
        let v = probe();
        if done(&v) {
            return v;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "timed out waiting for {what}: {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn wait_stats(server: &WorkerServer, done: impl Fn(&WorkerStats) -> bool) -> WorkerStats {
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

fn kv_batch(worker: WorkerId) -> KvEventBatch {
    let source = WorkerRank {
        worker,
        dp_rank: DpRank(0),
    };
    let blocks: Vec<StoredBlock> = (1..=4)
        .map(|i| StoredBlock {
            block_hash: BlockHash(1000 + i),
            local_hash: LocalHash(i),
        })
        .collect();
    let event = KvEvent {
        header: EventHeader {
            source,
            event_id: EventId(1),
            tier: StorageTier::Device,
        },
        data: KvEventData::Stored {
            parent: None,
            blocks,
        },
    };
    KvEventBatch::from_core(worker, 0, [&event]).expect("one worker")
}

// ---- tests ----

#[test]
fn requests_stream_back_with_backpressure_and_events_reach_the_index() {
    for backend in backends() {
        let worker = start_worker(backend);
        assert_eq!(worker.backend(), backend);
        let ingest = IngestServer::start(
            IngestConfig {
                backend: choice(backend),
                threads: 1,
                ..IngestConfig::new(loopback())
            },
            PrefixIndex::new(IndexConfig::default()),
        )
        .expect("ingest starts");
        let (waddr, iaddr) = (worker.local_addr(), ingest.local_addr());
        backend::block_on(backend, async move {
            let client = Rc::new(DispatchClient::start(client_config(backend, waddr, WORKER)));
            let their_hello = client.wait_connected(PATIENCE).await.expect("connects");
            assert_eq!(their_hello, hello(WORKER), "{backend}");

            // 64 requests through 8 slots: dispatch waits for free slots.
            let mut tasks = Vec::new();
            for id in 0..64u64 {
                let client = Rc::clone(&client);
                tasks.push(tokio::task::spawn_local(async move {
                    let tokens: Vec<u32> = (0..5).map(|t| (id as u32) * 10 + t).collect();
                    let mut stream = client
                        .dispatch(request(id, tokens.clone(), 5))
                        .await
                        .expect("dispatches");
                    assert!(client.free_slots() < 8);
                    let (items, error) = drain(&mut stream).await;
                    assert_eq!(error, None, "request {id}");
                    let got: Vec<u32> = items.iter().flat_map(|i| i.tokens.clone()).collect();
                    assert_eq!(got, tokens, "request {id}");
                    assert_eq!(
                        items.last().and_then(|i| i.finish),
                        Some(FinishReason::Length)
                    );
                    assert!(items.iter().all(|i| i.request_id == id));
                }));
            }
            for t in tasks {
                t.await.expect("request task");
            }
            assert_eq!(client.free_slots(), 8, "{backend}: every slot back");

            // The worker's heartbeats carry its engine's load.
            let status = eventually("a heartbeat", || client.status(), |s| s.load.is_some()).await;
            let load = status.load.expect("a heartbeat");
            assert_eq!(load.worker_id, WORKER.0);
            assert_eq!(load.ranks, Echo.load());

            // KV events the other way, into the router's index.
            let mut events = IngestClient::connect(iaddr, backend)
                .await
                .expect("ingest connects");
            events.send_batch(&kv_batch(WORKER)).await.expect("sends");
            events.close().await.expect("closes");

            let client = Rc::try_unwrap(client).expect("sole owner");
            let stats = client.shutdown().await;
            assert_eq!(
                (stats.dispatched, stats.finished, stats.lost),
                (64, 64, 0),
                "{backend}: {stats:?}"
            );
            assert!(stats.heartbeats > 0);
            assert_eq!(stats.decode.rejected(), 0);
        })
        .expect("runtime");
        let deadline = Instant::now() + PATIENCE;
        while ingest.stats().apply.batches < 1 {
            assert!(Instant::now() < deadline, "the batch never landed");
            thread::sleep(Duration::from_millis(5));
        }
        let report = ingest.shutdown().expect("ingest shuts down");
        let index = report.target.index().expect("its own index");
        let query = [LocalHash(1), LocalHash(2), LocalHash(3), LocalHash(4)];
        let scores = scores_of(&index.reader(), &query, MatchOptions::default()).scores;
        assert_eq!(scores.len(), 1, "{backend}: {scores:?}");
        let w = worker.shutdown().expect("worker shuts down");
        assert_eq!(
            (w.requests.served, w.requests.finished),
            (64, 64),
            "{backend}: {w:?}"
        );
        assert_eq!(
            w.connections.drained + w.connections.closed,
            1,
            "{backend}: {w:?}"
        );
    }
}

#[test]
fn cancel_and_dropped_streams_stop_the_request_and_free_the_slot() {
    for backend in backends() {
        let worker = start_worker(backend);
        let addr = worker.local_addr();
        backend::block_on(backend, async move {
            let client = DispatchClient::start(client_config(backend, addr, WORKER));
            client.wait_connected(PATIENCE).await.expect("connects");

            let mut stream = client
                .dispatch(request(1, vec![HANG, 2], 2))
                .await
                .expect("dispatches");
            for _ in 0..2 {
                let item = stream.next().await.expect("an item").expect("not an error");
                assert_eq!(item.finish, None);
            }
            stream.cancel();
            let (items, error) = drain(&mut stream).await;
            assert_eq!(error, None, "{backend}");
            assert_eq!(
                items.last().and_then(|i| i.finish),
                Some(FinishReason::Cancelled)
            );

            // Dropping a stream before its end cancels the request.
            let mut dropped = client
                .dispatch(request(2, vec![HANG], 1))
                .await
                .expect("dispatches");
            dropped
                .next()
                .await
                .expect("an item")
                .expect("not an error");
            drop(dropped);
            eventually("the slots back", || client.free_slots(), |n| *n == 8).await;
            let stats = client.shutdown().await;
            assert_eq!(stats.cancels_sent, 2, "{backend}: {stats:?}");
        })
        .expect("runtime");
        let w = wait_stats(&worker, |s| s.requests.cancelled == 2);
        assert_eq!(w.requests.finished, 2, "{backend}: {w:?}");
        worker.shutdown().expect("worker shuts down");
    }
}

/// A worker that answers the handshake, streams one item of request 1, then dies with half a
/// frame on the wire.
fn fake_worker_dying_mid_frame() -> (SocketAddr, thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let addr = listener.local_addr().expect("an address");
    let handle = thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accepts");
        s.set_read_timeout(Some(PATIENCE)).expect("timeout");
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).expect("the router's Hello");
        assert!(n >= HEADER_LEN && buf[..4] == MAGIC);
        let mut out = BytesMut::new();
        encode(&Message::Hello(hello(WORKER)), &mut out).expect("encodes");
        s.write_all(&out).expect("writes");
        // Wait for the three dispatches (each a frame of a few hundred bytes at most).
        let mut got = 0;
        while got < 3 * HEADER_LEN {
            got += s.read(&mut buf).expect("dispatches");
        }
        thread::sleep(Duration::from_millis(50));
        let mut out = BytesMut::new();
        let item = ResponseItem {
            request_id: 1,
            tokens: vec![42],
            finish: None,
            error: None,
        };
        encode(&Message::Response(item.clone()), &mut out).expect("encodes");
        let whole = out.len();
        encode(&Message::Response(item), &mut out).expect("encodes");
        s.write_all(&out[..whole + (out.len() - whole) / 2])
            .expect("writes");
        // Killed: our side ends inside a frame. Read until the router hangs up, so that
        // nothing unread turns the close into a reset.
        s.shutdown(std::net::Shutdown::Write).expect("shuts down");
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    (addr, handle)
}

#[test]
fn a_worker_killed_mid_stream_ends_every_in_flight_stream_with_an_error() {
    for backend in backends() {
        let (addr, fake) = fake_worker_dying_mid_frame();
        backend::block_on(backend, async move {
            let client = DispatchClient::start(client_config(backend, addr, WORKER));
            client.wait_connected(PATIENCE).await.expect("connects");
            let mut streams = Vec::new();
            for id in 1..=3 {
                streams.push(
                    client
                        .dispatch(request(id, vec![1, 2, 3], 10))
                        .await
                        .expect("dispatches"),
                );
            }
            let mut first = streams.remove(0);
            let item = first.next().await.expect("an item").expect("not an error");
            assert_eq!(item.tokens, vec![42]);
            for s in std::iter::once(&mut first).chain(streams.iter_mut()) {
                let (_, error) = drain(s).await;
                match error {
                    Some(StreamError::ConnectionLost { worker, .. }) => assert_eq!(worker, WORKER),
                    other => panic!("{backend}: expected a lost connection, got {other:?}"),
                }
            }
            assert_eq!(client.free_slots(), 8, "{backend}: the slots are freed");
            let status =
                eventually("the loss", || client.status(), |s| s.last_error.is_some()).await;
            assert!(
                matches!(
                    status.last_error,
                    Some(LinkError::Frame { .. })
                        | Some(LinkError::Closed)
                        | Some(LinkError::Io { .. })
                ),
                "{backend}: {status:?}"
            );
            // Nothing listens any more: dispatch refuses at once instead of queueing.
            eventually(
                "a disconnected state",
                || client.status().state,
                |s| *s != LinkState::Connected,
            )
            .await;
            let refused = client
                .try_dispatch(request(9, vec![1], 1))
                .expect_err("refused");
            assert!(
                matches!(refused.reason, DispatchError::NotConnected { .. }),
                "{refused}"
            );
            assert_eq!(refused.request.request_id, 9, "the request is handed back");
            let stats = client.shutdown().await;
            assert_eq!(stats.lost, 3, "{backend}: {stats:?}");
            assert_eq!(stats.decode.truncated, 1, "{backend}: {stats:?}");
        })
        .expect("runtime");
        fake.join().expect("fake worker");
    }
}

#[test]
fn a_restarted_worker_is_reconnected_and_its_lost_requests_end_with_errors() {
    for backend in backends() {
        let mut config = worker_config(backend, loopback());
        config.shutdown_grace = Duration::ZERO;
        let worker =
            WorkerServer::start(config.clone(), hello(WORKER), Arc::new(Echo)).expect("starts");
        let addr = worker.local_addr();
        let (kill_tx, kill_rx) = std::sync::mpsc::channel::<()>();
        let (killed_tx, killed_rx) = std::sync::mpsc::channel::<WorkerServer>();
        let killer = thread::spawn(move || {
            kill_rx.recv().expect("the signal");
            let stats = worker.shutdown().expect("worker stops");
            assert!(
                stats.connections.cut_at_shutdown + stats.requests.abandoned > 0,
                "{stats:?}"
            );
            let mut config = config;
            config.addr = addr;
            let again =
                WorkerServer::start(config, hello(WORKER), Arc::new(Echo)).expect("restarts");
            killed_tx.send(again).expect("hand over");
        });
        backend::block_on(backend, async move {
            let client = DispatchClient::start(client_config(backend, addr, WORKER));
            client.wait_connected(PATIENCE).await.expect("connects");
            let mut hanging = Vec::new();
            for id in 0..4 {
                let mut s = client
                    .dispatch(request(id, vec![HANG], 1))
                    .await
                    .expect("dispatches");
                s.next().await.expect("an item").expect("not an error");
                hanging.push(s);
            }
            kill_tx.send(()).expect("kill");
            for s in &mut hanging {
                let (_, error) = drain(s).await;
                assert!(
                    matches!(error, Some(StreamError::ConnectionLost { .. })),
                    "{backend}: {error:?}"
                );
            }
            assert_eq!(client.free_slots(), 8);
            let mut status = client.watch_status();
            tokio::time::timeout(
                PATIENCE,
                status.wait_for(|s| s.connects == 2 && s.state == LinkState::Connected),
            )
            .await
            .expect("reconnects in time")
            .expect("client alive");
            let mut s = client
                .dispatch(request(10, vec![5, 6], 2))
                .await
                .expect("dispatches again");
            let (items, error) = drain(&mut s).await;
            assert_eq!(error, None);
            assert_eq!(items.len(), 3, "two tokens, then the finishing item");
            let stats = client.shutdown().await;
            assert_eq!((stats.connects, stats.lost), (2, 4), "{backend}: {stats:?}");
        })
        .expect("runtime");
        killer.join().expect("killer");
        killed_rx
            .recv()
            .expect("the restarted worker")
            .shutdown()
            .expect("stops");
    }
}

#[test]
fn a_worker_of_another_id_is_refused_with_a_clear_error() {
    for backend in backends() {
        let worker = start_worker(backend);
        let addr = worker.local_addr();
        backend::block_on(backend, async move {
            let client = DispatchClient::start(client_config(backend, addr, WorkerId(99)));
            let err = client
                .wait_connected(Duration::from_millis(300))
                .await
                .expect_err("refused");
            let expected = LinkError::WrongWorker {
                expected: WorkerId(99),
                found: WORKER,
            };
            let status = eventually(
                "the refusal",
                || client.status(),
                |s| s.last_error.is_some(),
            )
            .await;
            assert_eq!(
                status.last_error,
                Some(expected.clone()),
                "{backend}: {err}"
            );
            let refused = client
                .dispatch(request(1, vec![1], 1))
                .await
                .expect_err("not connected");
            assert!(matches!(refused.reason, DispatchError::NotConnected { .. }));
            let stats = client.shutdown().await;
            assert!(stats.handshake_failures >= 1, "{backend}: {stats:?}");
            assert_eq!(stats.connects, 0);
        })
        .expect("runtime");
        worker.shutdown().expect("worker shuts down");
    }
}

#[test]
fn garbage_frames_close_only_their_connection_and_are_counted() {
    for backend in backends() {
        let worker = start_worker(backend);
        let addr = worker.local_addr();
        let hello_frame = {
            let mut out = BytesMut::new();
            encode(&Message::Hello(hello(WorkerId(0))), &mut out).expect("encodes");
            out.to_vec()
        };
        let raw = |bytes: Vec<u8>| {
            thread::spawn(move || {
                let mut s = TcpStream::connect(addr).expect("connects");
                s.set_read_timeout(Some(PATIENCE)).expect("timeout");
                s.write_all(&bytes).expect("writes");
                // The server hangs up: read to end of stream (or a reset).
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink);
            })
        };
        let garbage = raw(b"GET / HTTP/1.1\r\nHost: kvroute\r\n\r\n".to_vec());
        let mut wrong_version = hello_frame.clone();
        let mut second = hello_frame.clone();
        second[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
        wrong_version.extend_from_slice(&second);
        let after_hello = raw(wrong_version);
        backend::block_on(backend, async move {
            let client = DispatchClient::start(client_config(backend, addr, WORKER));
            client.wait_connected(PATIENCE).await.expect("connects");
            for id in 0..16 {
                let mut s = client
                    .dispatch(request(id, vec![1, 2], 3))
                    .await
                    .expect("dispatches");
                let (items, error) = drain(&mut s).await;
                assert_eq!(
                    (items.len(), error),
                    (4, None),
                    "{backend}: 3 tokens and the end"
                );
            }
            client.shutdown().await;
        })
        .expect("runtime");
        garbage.join().expect("raw client");
        after_hello.join().expect("raw client");
        let s = wait_stats(&worker, |s| s.connections.rejected == 2);
        assert_eq!(
            (s.decode.bad_magic, s.decode.unsupported_version),
            (1, 1),
            "{backend}: {s:?}"
        );
        assert_eq!(s.requests.finished, 16, "{backend}");
        worker.shutdown().expect("worker shuts down");
    }
}

#[test]
fn shutdown_lets_in_flight_requests_finish_then_refuses() {
    for backend in backends() {
        let worker = start_worker(backend);
        let addr = worker.local_addr();
        backend::block_on(backend, async move {
            let client = DispatchClient::start(client_config(backend, addr, WORKER));
            client.wait_connected(PATIENCE).await.expect("connects");
            let mut s = client
                .dispatch(request(1, vec![3, 4], 50))
                .await
                .expect("dispatches");
            let reader = tokio::task::spawn_local(async move { drain(&mut s).await });
            let stats = client.shutdown().await;
            let (items, error) = reader.await.expect("reader");
            assert_eq!((items.len(), error), (51, None), "{backend}: {stats:?}");
            assert_eq!((stats.finished, stats.shut_down), (1, 0));
        })
        .expect("runtime");
        let w = worker.shutdown().expect("worker shuts down");
        assert_eq!(w.requests.finished, 1, "{backend}");
    }
}

#[test]
fn a_silent_worker_is_declared_lost_after_the_idle_timeout() {
    for backend in backends() {
        // Answers the handshake, then neither reads nor writes: a peer gone without a FIN.
        let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
        let addr = listener.local_addr().expect("an address");
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let fake = thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accepts");
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).expect("the router's Hello");
            let mut out = BytesMut::new();
            encode(&Message::Hello(hello(WORKER)), &mut out).expect("encodes");
            s.write_all(&out).expect("writes");
            let _ = release_rx.recv_timeout(PATIENCE);
        });
        backend::block_on(backend, async move {
            let client = DispatchClient::start(DispatchConfig {
                idle_timeout: Duration::from_millis(300),
                heartbeat_interval: Duration::from_millis(20),
                ..client_config(backend, addr, WORKER)
            });
            client.wait_connected(PATIENCE).await.expect("connects");
            let mut s = client
                .dispatch(request(1, vec![1], 1))
                .await
                .expect("dispatches");
            let started = Instant::now();
            let (items, error) = drain(&mut s).await;
            assert!(items.is_empty());
            match error {
                Some(StreamError::ConnectionLost {
                    reason: Some(LinkError::Idle { .. }),
                    ..
                }) => {}
                other => panic!("{backend}: expected an idle loss, got {other:?}"),
            }
            assert!(started.elapsed() >= Duration::from_millis(250), "{backend}");
            assert_eq!(client.free_slots(), 8);
            client.shutdown().await;
        })
        .expect("runtime");
        let _ = release_tx.send(());
        fake.join().expect("fake worker");
    }
}

#[test]
fn requests_over_the_workers_limit_are_refused_at_once() {
    for backend in backends() {
        let config = WorkerServerConfig {
            max_in_flight: 2,
            ..worker_config(backend, loopback())
        };
        let worker =
            WorkerServer::start(config, hello(WORKER), Arc::new(Echo)).expect("worker starts");
        let addr = worker.local_addr();
        backend::block_on(backend, async move {
            let client = DispatchClient::start(client_config(backend, addr, WORKER));
            client.wait_connected(PATIENCE).await.expect("connects");
            let mut held = Vec::new();
            for id in 0..2 {
                let mut s = client
                    .dispatch(request(id, vec![HANG], 1))
                    .await
                    .expect("dispatches");
                s.next().await.expect("an item").expect("not an error");
                held.push(s);
            }
            let mut third = client
                .dispatch(request(2, vec![1], 1))
                .await
                .expect("dispatches");
            let (items, error) = drain(&mut third).await;
            assert_eq!(error, None, "{backend}");
            let last = items.last().expect("a finishing item");
            assert_eq!(last.finish, Some(FinishReason::Error));
            assert!(last
                .error
                .as_deref()
                .is_some_and(|e| e.contains("overloaded")));
            drop(held);
            client.shutdown().await;
        })
        .expect("runtime");
        let s = wait_stats(&worker, |s| s.requests.cancelled == 2);
        assert_eq!(s.requests.overloaded, 1, "{backend}: {s:?}");
        worker.shutdown().expect("worker shuts down");
    }
}

#[test]
fn an_engine_that_ends_a_request_without_finishing_it_still_ends_the_stream() {
    for backend in backends() {
        let worker = start_worker(backend);
        let addr = worker.local_addr();
        backend::block_on(backend, async move {
            let client = DispatchClient::start(client_config(backend, addr, WORKER));
            client.wait_connected(PATIENCE).await.expect("connects");
            let mut s = client
                .dispatch(request(1, vec![UNFINISHED, 8], 2))
                .await
                .expect("dispatches");
            let (items, error) = drain(&mut s).await;
            assert_eq!(error, None, "{backend}");
            assert_eq!(items.len(), 3, "{backend}: two tokens, then the end");
            let last = items.last().expect("an item");
            assert_eq!(last.finish, Some(FinishReason::Error));
            assert!(last.error.is_some());
            assert_eq!(client.free_slots(), 8);
            client.shutdown().await;
        })
        .expect("runtime");
        let s = worker.shutdown().expect("worker shuts down");
        assert_eq!(
            (s.requests.unfinished, s.requests.finished),
            (1, 1),
            "{backend}: {s:?}"
        );
    }
}

#[test]
fn a_consumer_that_stops_reading_for_a_while_holds_the_worker_back_without_losing_it() {
    for backend in backends() {
        let config = WorkerServerConfig {
            idle_timeout: Duration::from_millis(500),
            heartbeat_interval: Duration::from_millis(20),
            ..worker_config(backend, loopback())
        };
        let worker =
            WorkerServer::start(config, hello(WORKER), Arc::new(Echo)).expect("worker starts");
        let addr = worker.local_addr();
        backend::block_on(backend, async move {
            let client = DispatchClient::start(DispatchConfig {
                idle_timeout: Duration::from_millis(500),
                heartbeat_interval: Duration::from_millis(20),
                ..client_config(backend, addr, WORKER)
            });
            client.wait_connected(PATIENCE).await.expect("connects");
            // Megabytes of items: more than the sockets hold, so the worker's writes block.
            let mut s = client
                .dispatch(request(1, vec![1, 2, 3], 200_000))
                .await
                .expect("dispatches");
            // The stream's queue holds 4 items: the rest wait in the sockets and the worker,
            // for three idle timeouts (the timeout leaves room for a loaded machine's stalls).
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            let (items, error) = drain(&mut s).await;
            assert_eq!((items.len(), error), (200_001, None), "{backend}");
            let stats = client.shutdown().await;
            assert_eq!(
                (stats.disconnects, stats.lost),
                (0, 0),
                "{backend}: {stats:?}"
            );
        })
        .expect("runtime");
        worker.shutdown().expect("worker shuts down");
    }
}
