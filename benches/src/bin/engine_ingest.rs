//! KV events from an engine's ZeroMQ publisher into a router: blocks per second decoded and
//! applied from one SUB socket, in vLLM's map encoding and in the older array encoding.
//!
//! ```text
//! cargo run --release -p kvroute-benches --bin engine-ingest
//! cargo run --release -p kvroute-benches --bin engine-ingest -- --batches 20000 --rounds 5
//! cargo run --release -p kvroute-benches --bin engine-ingest -- --life 20 --batches 10000
//! ```
//!
//! With `--life DOWN_S`, an engine's life instead: a subscription started after the batches were
//! published, caught up from a replay socket holding them all (vLLM's layout), then the engine
//! gone for DOWN_S seconds and back as a new process that publishes one batch (kept for its
//! replay); the figures are the catch-up's time and the reconnection's, from the new process's
//! bind to its first batch applied.
//!
//! A PUB socket sends pre-encoded batches `[ts, [BlockStored of 64 blocks with their 1,024
//! token ids], dp_rank]` on loopback as fast as it can; a `transport::Subscription` decodes
//! each batch, re-hashes the tokens into the router's block hashes, and applies it to a
//! `Router`. A round's time runs from the first send to the subscription having applied the
//! last batch; the sequence check must find no gap (a gap would be replayed, and is reported).
//! Each figure is the median over rounds; encodings alternate from round to round.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use bytes::Bytes;
use kvroute_benches::median;
use kvroute_core::{
    DpRank, IndexConfig, PrefixIndex, Router, RouterConfig, WorkerConfig, WorkerId,
};
use kvroute_transport::{SubscriberConfig, Subscription};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const BLOCKS: usize = 64;
const BLOCK_SIZE: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Encoding {
    Map,
    Array,
}

/// One batch: a BlockStored of 64 fresh blocks chained from the previous batch's last.
fn batch(i: u64, encoding: Encoding) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 * 1024);
    let hashes: Vec<u64> = (0..BLOCKS as u64).map(|b| (i << 8 | b) + 1).collect();
    let parent = (i > 0).then(|| ((i - 1) << 8 | (BLOCKS as u64 - 1)) + 1);
    let tokens = |out: &mut Vec<u8>| {
        let _ = rmp::encode::write_array_len(out, (BLOCKS * BLOCK_SIZE) as u32);
        for t in 0..(BLOCKS * BLOCK_SIZE) as u64 {
            let _ = rmp::encode::write_uint(out, (i * 7919 + t * 31) % 150_000);
        }
    };
    let _ = rmp::encode::write_array_len(&mut out, 3);
    let _ = rmp::encode::write_f64(&mut out, 1.7e9);
    let _ = rmp::encode::write_array_len(&mut out, 1);
    match encoding {
        Encoding::Map => {
            let _ = rmp::encode::write_map_len(&mut out, 8);
            let _ = rmp::encode::write_str(&mut out, "type");
            let _ = rmp::encode::write_str(&mut out, "BlockStored");
            let _ = rmp::encode::write_str(&mut out, "block_hashes");
            let _ = rmp::encode::write_array_len(&mut out, BLOCKS as u32);
            for h in &hashes {
                let _ = rmp::encode::write_uint(&mut out, *h);
            }
            let _ = rmp::encode::write_str(&mut out, "parent_block_hash");
            match parent {
                Some(p) => {
                    let _ = rmp::encode::write_uint(&mut out, p);
                }
                None => {
                    let _ = rmp::encode::write_nil(&mut out);
                }
            }
            let _ = rmp::encode::write_str(&mut out, "token_ids");
            tokens(&mut out);
            let _ = rmp::encode::write_str(&mut out, "block_size");
            let _ = rmp::encode::write_uint(&mut out, BLOCK_SIZE as u64);
            let _ = rmp::encode::write_str(&mut out, "lora_id");
            let _ = rmp::encode::write_nil(&mut out);
            let _ = rmp::encode::write_str(&mut out, "medium");
            let _ = rmp::encode::write_str(&mut out, "GPU");
            let _ = rmp::encode::write_str(&mut out, "lora_name");
            let _ = rmp::encode::write_nil(&mut out);
        }
        Encoding::Array => {
            // ["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium]
            let _ = rmp::encode::write_array_len(&mut out, 7);
            let _ = rmp::encode::write_str(&mut out, "BlockStored");
            let _ = rmp::encode::write_array_len(&mut out, BLOCKS as u32);
            for h in &hashes {
                let _ = rmp::encode::write_uint(&mut out, *h);
            }
            match parent {
                Some(p) => {
                    let _ = rmp::encode::write_uint(&mut out, p);
                }
                None => {
                    let _ = rmp::encode::write_nil(&mut out);
                }
            }
            tokens(&mut out);
            let _ = rmp::encode::write_uint(&mut out, BLOCK_SIZE as u64);
            let _ = rmp::encode::write_nil(&mut out);
            let _ = rmp::encode::write_str(&mut out, "GPU");
        }
    }
    let _ = rmp::encode::write_uint(&mut out, 0);
    out
}

struct Round {
    seconds: f64,
    blocks: u64,
    gaps: u64,
    rejected: u64,
}

async fn round(batches: &[Bytes], port: u16) -> Result<Round> {
    let router = Arc::new(Router::new(
        RouterConfig::default(),
        PrefixIndex::new(IndexConfig::default()),
    )?);
    router.join_worker(WorkerConfig::simple(0, 4 << 20, BLOCK_SIZE as u32))?;
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let mut publisher = PubSocket::new();
    publisher.bind(&endpoint).await?;
    let subscription = Subscription::start(
        Arc::clone(&router),
        SubscriberConfig {
            worker: WorkerId(0),
            dp_rank: DpRank(0),
            endpoint: endpoint.clone(),
            replay: None,
            topic: String::new(),
            block_size: Some(BLOCK_SIZE as u32),
            replay_timeout: Duration::from_secs(1),
            sequence: Default::default(),
            not_flowing: None,
            capacity_blocks: None,
        },
    )
    .await?;
    // Warm-up: a throwaway topic until the subscription is connected (the slow joiner).
    let deadline = Instant::now() + Duration::from_secs(10);
    while subscription.stats().received == 0 {
        if Instant::now() > deadline {
            bail!("the subscription never connected");
        }
        let frames = vec![
            Bytes::from_static(b"warm"),
            Bytes::copy_from_slice(&0u64.to_be_bytes()),
            batches[0].clone(),
        ];
        publisher
            .send(ZmqMessage::try_from(frames).map_err(|_| anyhow::anyhow!("empty message"))?)
            .await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = subscription.stats();
    // The warm-up batch (seq 0, possibly sent several times) was applied once; go on from 1.
    let started = Instant::now();
    for (i, payload) in batches.iter().enumerate() {
        let seq = i as u64 + 1;
        let frames = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        publisher
            .send(ZmqMessage::try_from(frames).map_err(|_| anyhow::anyhow!("empty message"))?)
            .await?;
    }
    let target = before.applied_batches + batches.len() as u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = subscription.stats();
        if s.applied_batches >= target {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "only {} of {} batches applied (gaps {}, lost {})",
                s.applied_batches - before.applied_batches,
                batches.len(),
                s.sequence.gaps,
                s.sequence.lost_batches
            );
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let s = subscription.stats();
    Ok(Round {
        seconds,
        blocks: s.decode.stored_blocks - before.decode.stored_blocks,
        gaps: s.sequence.gaps - before.sequence.gaps,
        rejected: s.rejected_events,
    })
}

/// A publisher's replay socket, as vLLM's serves it: a request names the first seq wanted; the
/// answer is every batch held from there, `[empty, topic, seq, payload]` each, then the end
/// marker `[empty, empty, -1, empty]`.
async fn serve_replay(mut router: RouterSocket, held: Arc<Vec<Bytes>>) {
    while let Ok(request) = router.recv().await {
        let frames = request.into_vec();
        let (Some(peer), Some(from)) = (frames.first(), frames.last()) else {
            continue;
        };
        let from = <[u8; 8]>::try_from(from.as_ref()).map_or(0, u64::from_be_bytes);
        for (seq, payload) in held.iter().enumerate().skip(from as usize) {
            let reply = vec![
                peer.clone(),
                Bytes::new(),
                Bytes::new(),
                Bytes::copy_from_slice(&(seq as u64).to_be_bytes()),
                payload.clone(),
            ];
            if let Ok(m) = ZmqMessage::try_from(reply) {
                if router.send(m).await.is_err() {
                    return;
                }
            }
        }
        let end = vec![
            peer.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
            Bytes::new(),
        ];
        if let Ok(m) = ZmqMessage::try_from(end) {
            let _ = router.send(m).await;
        }
    }
}

/// The times of an engine's life, in seconds: a subscription started after `batches` were
/// published catching up from the replay, and, after the engine was gone for `down`, its
/// reconnection to the new process (the time from the new process's bind to its first batch
/// applied).
async fn life(batches: &[Bytes], port: u16, down: Duration) -> Result<(f64, f64)> {
    let router = Arc::new(Router::new(
        RouterConfig::default(),
        PrefixIndex::new(IndexConfig::default()),
    )?);
    router.join_worker(WorkerConfig::simple(0, 4 << 20, BLOCK_SIZE as u32))?;
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let replay = format!("tcp://127.0.0.1:{}", port + 1);
    let publisher = {
        let mut p = PubSocket::new();
        p.bind(&endpoint).await?;
        p
    };
    let mut replay_socket = RouterSocket::new();
    replay_socket.bind(&replay).await?;
    let server = tokio::spawn(serve_replay(replay_socket, Arc::new(batches.to_vec())));
    let started = Instant::now();
    let subscription = Subscription::start(
        Arc::clone(&router),
        SubscriberConfig {
            worker: WorkerId(0),
            dp_rank: DpRank(0),
            endpoint: endpoint.clone(),
            replay: Some(replay.clone()),
            topic: String::new(),
            block_size: Some(BLOCK_SIZE as u32),
            replay_timeout: Duration::from_secs(10),
            sequence: Default::default(),
            not_flowing: None,
            capacity_blocks: None,
        },
    )
    .await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while subscription.stats().applied_batches < batches.len() as u64 {
        if Instant::now() > deadline {
            bail!("the catch-up never ended: {:?}", subscription.stats());
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let caught_up = started.elapsed().as_secs_f64();
    // The engine goes away, stays away, and comes back as a new process.
    drop(publisher);
    server.abort();
    let _ = server.await;
    tokio::time::sleep(down).await;
    let mut publisher = PubSocket::new();
    publisher.bind(&endpoint).await?;
    let mut replay_socket = RouterSocket::new();
    replay_socket.bind(&replay).await?;
    let back = Instant::now();
    let before = subscription.stats().applied_batches;
    // The new process's first batch, seq 0, published (to no one yet) and kept for its replay.
    let frames = vec![
        Bytes::new(),
        Bytes::copy_from_slice(&0u64.to_be_bytes()),
        batches[0].clone(),
    ];
    publisher
        .send(ZmqMessage::try_from(frames).map_err(|_| anyhow::anyhow!("empty message"))?)
        .await?;
    let server = tokio::spawn(serve_replay(
        replay_socket,
        Arc::new(vec![batches[0].clone()]),
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    while subscription.stats().applied_batches == before {
        if Instant::now() > deadline {
            bail!("never reconnected: {:?}", subscription.stats());
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let reconnected = back.elapsed().as_secs_f64();
    server.abort();
    if subscription.stats().new_epochs != 1 {
        bail!(
            "the new process was not seen as one: {:?}",
            subscription.stats()
        );
    }
    Ok((caught_up, reconnected))
}

fn main() -> Result<()> {
    let mut batches_n = 16_384usize;
    let mut rounds = 3usize;
    let mut life_down = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--batches" => batches_n = args.next().unwrap_or_default().parse()?,
            "--rounds" => rounds = args.next().unwrap_or_default().parse()?,
            "--life" => {
                life_down = Some(Duration::from_secs_f64(
                    args.next().unwrap_or_default().parse()?,
                ))
            }
            other => bail!("unknown argument {other}; --batches N, --rounds N, --life DOWN_S"),
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let encoded = |e: Encoding| -> Vec<Bytes> {
        (0..batches_n as u64)
            .map(|i| Bytes::from(batch(i, e)))
            .collect()
    };
    let map = encoded(Encoding::Map);
    if let Some(down) = life_down {
        println!(
            "engine-ingest --life: catch-up of {batches_n} batches (64 blocks each, map) from the \
             replay; reconnection after {:.1} s down, {rounds} rounds",
            down.as_secs_f64()
        );
        let (mut catch_ups, mut reconnects) = (Vec::new(), Vec::new());
        for r in 0..rounds {
            let port = 41_000 + (r * 2) as u16 + (std::process::id() % 1000) as u16 * 10;
            let (caught_up, reconnected) = runtime.block_on(life(&map, port, down))?;
            println!(
                "  round {r}: caught up in {caught_up:.3} s, reconnected {reconnected:.3} s after the return"
            );
            catch_ups.push(caught_up);
            reconnects.push(reconnected);
        }
        println!(
            "catch-up: median {:.3} s; reconnection: median {:.3} s",
            median(catch_ups).unwrap_or(0.0),
            median(reconnects).unwrap_or(0.0)
        );
        return Ok(());
    }
    let array = encoded(Encoding::Array);
    println!(
        "engine-ingest: {batches_n} batches of one 64-block BlockStored ({} KiB map, {} KiB array each), {rounds} rounds",
        map[0].len() / 1024,
        array[0].len() / 1024
    );
    let mut rates = [Vec::new(), Vec::new()];
    for r in 0..rounds {
        for (k, (name, batches)) in [("map", &map), ("array", &array)].iter().enumerate() {
            let port = 40_000 + (r * 2 + k) as u16 + (std::process::id() % 1000) as u16 * 10;
            let result = runtime.block_on(round(batches, port))?;
            let rate = result.blocks as f64 / result.seconds;
            println!(
                "  round {r} {name:<5}: {:>9.0} blocks/s ({} blocks in {:.3} s, gaps {}, rejected {})",
                rate, result.blocks, result.seconds, result.gaps, result.rejected
            );
            rates[k].push(rate);
        }
    }
    for (k, name) in ["map", "array"].iter().enumerate() {
        println!(
            "{name:<5} encoding: median {:.2} M blocks/s",
            median(rates[k].clone()).unwrap_or(0.0) / 1e6
        );
    }
    Ok(())
}
