//! KV events from an engine's ZeroMQ publisher into a router: blocks per second decoded and
//! applied from one SUB socket, in vLLM's map encoding and in the older array encoding.
//!
//! ```text
//! cargo run --release -p kvroute-benches --bin engine-ingest
//! cargo run --release -p kvroute-benches --bin engine-ingest -- --batches 20000 --rounds 5
//! ```
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
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

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

fn main() -> Result<()> {
    let mut batches_n = 16_384usize;
    let mut rounds = 3usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--batches" => batches_n = args.next().unwrap_or_default().parse()?,
            "--rounds" => rounds = args.next().unwrap_or_default().parse()?,
            other => bail!("unknown argument {other}; --batches N, --rounds N"),
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
