//! KV events on vLLM's ZeroMQ wire: a PUB socket for the live stream and a ROUTER socket that
//! replays what the publisher still holds, as vLLM's `ZmqEventPublisher` does.
//!
//! ```text
//!  EventBatch ──encode (msgpack, tagged maps)──▶ seq n ──▶ ring of the last N batches
//!                                                   └──▶ PUB [topic, seq (u64 BE), payload]
//!  DEALER [empty, start seq] ──▶ ROUTER ──▶ [empty, topic, seq, payload] … [empty, empty, 0xFF×8, empty]
//! ```
//!
//! Sequence numbers start at 0 when the publisher starts (or restarts, a fault hook) and grow
//! by one per batch. Fault hooks act here: dropped batches skip the live stream but stay in the
//! ring, so a subscriber can replay them; a delay holds batches back; a restart begins again at
//! 0 with an empty ring, as a restarted engine process does.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, Mutex};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use kvroute_sim::{EngineEvent, EventBatch};

/// The sequence frame that ends a replay (seq −1, signed big-endian).
const END_SEQ: [u8; 8] = [0xFF; 8];

/// How the publisher is set up.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// Where the live stream binds (vLLM's `endpoint`, e.g. `tcp://127.0.0.1:5557`).
    pub endpoint: String,
    /// Where the replay socket binds (vLLM's `replay_endpoint`); none, no replay.
    pub replay_endpoint: Option<String>,
    /// The topic frame of every live message.
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer_batches: usize,
    /// The data-parallel rank written into every batch.
    pub dp_rank: u32,
}

/// Encodes one batch as vLLM does since it tags events as maps: `[ts, [events], dp_rank]`,
/// each event a map keyed by field name with its `"type"`, fields without a default present
/// even when null.
pub fn encode_batch(batch: &EventBatch, dp_rank: u32, wall_ts: f64) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    // Writes into a Vec cannot fail; `let _` keeps the encoder infallible.
    let _ = rmp::encode::write_array_len(&mut out, 3);
    let _ = rmp::encode::write_f64(&mut out, wall_ts);
    let _ = rmp::encode::write_array_len(&mut out, batch.events.len() as u32);
    for event in &batch.events {
        encode_event(&mut out, event);
    }
    let _ = rmp::encode::write_uint(&mut out, u64::from(dp_rank));
    out
}

fn encode_event(out: &mut Vec<u8>, event: &EngineEvent) {
    match event {
        EngineEvent::Stored {
            parent,
            block_hashes,
            token_ids,
            block_size,
            medium,
            cache_salt,
        } => {
            // vLLM names a request's salt in the extra keys of its chain's first block only,
            // and leaves `extra_keys` out when no block has any.
            let salt = cache_salt
                .as_deref()
                .filter(|_| parent.is_none() && !block_hashes.is_empty());
            let _ = rmp::encode::write_map_len(out, if salt.is_some() { 9 } else { 8 });
            let _ = rmp::encode::write_str(out, "type");
            let _ = rmp::encode::write_str(out, "BlockStored");
            let _ = rmp::encode::write_str(out, "block_hashes");
            let _ = rmp::encode::write_array_len(out, block_hashes.len() as u32);
            for h in block_hashes {
                let _ = rmp::encode::write_uint(out, h.0);
            }
            let _ = rmp::encode::write_str(out, "parent_block_hash");
            match parent {
                Some(p) => {
                    let _ = rmp::encode::write_uint(out, p.0);
                }
                None => {
                    let _ = rmp::encode::write_nil(out);
                }
            }
            let _ = rmp::encode::write_str(out, "token_ids");
            let _ = rmp::encode::write_array_len(out, token_ids.len() as u32);
            for &t in token_ids {
                let _ = rmp::encode::write_uint(out, u64::from(t));
            }
            let _ = rmp::encode::write_str(out, "block_size");
            let _ = rmp::encode::write_uint(out, u64::from(*block_size));
            let _ = rmp::encode::write_str(out, "lora_id");
            let _ = rmp::encode::write_nil(out);
            let _ = rmp::encode::write_str(out, "medium");
            let _ = rmp::encode::write_str(out, medium.as_str());
            let _ = rmp::encode::write_str(out, "lora_name");
            let _ = rmp::encode::write_nil(out);
            if let Some(salt) = salt {
                let _ = rmp::encode::write_str(out, "extra_keys");
                let _ = rmp::encode::write_array_len(out, block_hashes.len() as u32);
                let _ = rmp::encode::write_array_len(out, 1);
                let _ = rmp::encode::write_str(out, salt);
                for _ in 1..block_hashes.len() {
                    let _ = rmp::encode::write_nil(out);
                }
            }
        }
        EngineEvent::Removed {
            block_hashes,
            medium,
        } => {
            let _ = rmp::encode::write_map_len(out, 3);
            let _ = rmp::encode::write_str(out, "type");
            let _ = rmp::encode::write_str(out, "BlockRemoved");
            let _ = rmp::encode::write_str(out, "block_hashes");
            let _ = rmp::encode::write_array_len(out, block_hashes.len() as u32);
            for h in block_hashes {
                let _ = rmp::encode::write_uint(out, h.0);
            }
            let _ = rmp::encode::write_str(out, "medium");
            let _ = rmp::encode::write_str(out, medium.as_str());
        }
        EngineEvent::AllBlocksCleared => {
            let _ = rmp::encode::write_map_len(out, 1);
            let _ = rmp::encode::write_str(out, "type");
            let _ = rmp::encode::write_str(out, "AllBlocksCleared");
        }
    }
}

/// A fault to inject into the event stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventFault {
    /// The next `n` batches skip the live stream (they stay in the replay ring).
    Drop(u32),
    /// Every batch waits this long before it is sent (zero: no delay).
    Delay(Duration),
    /// The publisher starts over: sequence back to 0, replay ring emptied.
    Restart,
}

/// What the publisher has done, for the worker's metrics and admin view.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublisherCounts {
    /// Batches numbered (the next sequence number).
    pub next_seq: u64,
    /// Batches sent on the live stream.
    pub sent: u64,
    /// Batches kept off the live stream by a drop fault.
    pub dropped: u64,
    /// Replay requests answered.
    pub replays: u64,
    /// Restarts.
    pub restarts: u64,
}

/// The ring and the counters, shared by the live task and the replay task.
#[derive(Debug, Default)]
struct State {
    ring: VecDeque<(u64, Bytes)>,
    counts: PublisherCounts,
    drop_next: u32,
    delay: Duration,
}

/// What the live task takes, in stream order.
#[derive(Debug)]
enum Item {
    Batch(EventBatch),
    /// The engine process restarted: numbering starts again at 0, the ring empties, before
    /// the next batch.
    Restart,
}

/// A running publisher: send it batches and faults.
#[derive(Debug, Clone)]
pub struct Publisher {
    batches: mpsc::UnboundedSender<Item>,
    state: Arc<Mutex<State>>,
}

/// The publisher could not bind its sockets.
#[derive(Debug, thiserror::Error)]
#[error("cannot bind the KV-event {which} socket at {endpoint}: {source}")]
pub struct BindError {
    /// `live` or `replay`.
    pub which: &'static str,
    /// The endpoint asked for.
    pub endpoint: String,
    /// The socket's error.
    pub source: zeromq::ZmqError,
}

impl Publisher {
    /// Binds the sockets and starts the tasks that serve them (on the current tokio runtime).
    /// Returns the publisher and the endpoints actually bound (a port 0 becomes the port the
    /// system chose): live, then replay.
    pub async fn start(
        config: PublisherConfig,
    ) -> Result<(Self, String, Option<String>), BindError> {
        let mut live = PubSocket::new();
        let bound = live
            .bind(&config.endpoint)
            .await
            .map_err(|source| BindError {
                which: "live",
                endpoint: config.endpoint.clone(),
                source,
            })?
            .to_string();
        let state = Arc::new(Mutex::new(State::default()));
        let replay_bound = match &config.replay_endpoint {
            Some(endpoint) => {
                let mut router = RouterSocket::new();
                let bound = router.bind(endpoint).await.map_err(|source| BindError {
                    which: "replay",
                    endpoint: endpoint.clone(),
                    source,
                })?;
                tokio::spawn(serve_replays(
                    router,
                    Arc::clone(&state),
                    config.topic.clone(),
                ));
                Some(bound.to_string())
            }
            None => None,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(serve_live(live, rx, Arc::clone(&state), config));
        Ok((Publisher { batches: tx, state }, bound, replay_bound))
    }

    /// Queues a batch for publication (a closed publisher drops it).
    pub fn publish(&self, batch: EventBatch) {
        let _ = self.batches.send(Item::Batch(batch));
    }

    /// A restart of the engine process, in stream order: every batch published before this
    /// call keeps its old numbering, every batch after it is numbered from 0 again.
    pub fn restart_in_stream(&self) {
        let _ = self.batches.send(Item::Restart);
    }

    /// Injects a fault.
    pub async fn fault(&self, fault: EventFault) {
        let mut state = self.state.lock().await;
        match fault {
            EventFault::Drop(n) => state.drop_next = state.drop_next.saturating_add(n),
            EventFault::Delay(d) => state.delay = d,
            EventFault::Restart => {
                state.ring.clear();
                state.counts.next_seq = 0;
                state.counts.restarts += 1;
            }
        }
    }

    /// What it has done so far.
    pub async fn counts(&self) -> PublisherCounts {
        self.state.lock().await.counts
    }
}

async fn serve_live(
    mut socket: PubSocket,
    mut batches: mpsc::UnboundedReceiver<Item>,
    state: Arc<Mutex<State>>,
    config: PublisherConfig,
) {
    let topic = Bytes::from(config.topic.clone().into_bytes());
    while let Some(item) = batches.recv().await {
        let batch = match item {
            Item::Batch(batch) => batch,
            Item::Restart => {
                let mut state = state.lock().await;
                state.ring.clear();
                state.counts.next_seq = 0;
                state.counts.restarts += 1;
                continue;
            }
        };
        let payload = Bytes::from(encode_batch(&batch, config.dp_rank, wall_seconds()));
        let (seq, delay, send) = {
            let mut state = state.lock().await;
            let seq = state.counts.next_seq;
            state.counts.next_seq += 1;
            state.ring.push_back((seq, payload.clone()));
            while state.ring.len() > config.buffer_batches.max(1) {
                state.ring.pop_front();
            }
            let send = if state.drop_next > 0 {
                state.drop_next -= 1;
                state.counts.dropped += 1;
                false
            } else {
                true
            };
            (seq, state.delay, send)
        };
        if !send {
            continue;
        }
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        if let Ok(message) = ZmqMessage::try_from(frames) {
            if socket.send(message).await.is_ok() {
                state.lock().await.counts.sent += 1;
            }
        }
    }
}

async fn serve_replays(mut socket: RouterSocket, state: Arc<Mutex<State>>, topic: String) {
    let topic = Bytes::from(topic.into_bytes());
    loop {
        let Ok(request) = socket.recv().await else {
            // A peer that vanished; do not spin if the socket keeps failing.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let frames = request.into_vec();
        // [identity, empty, start seq]; anything else is ignored, as vLLM's publisher does.
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        let held: Vec<(u64, Bytes)> = {
            let mut state = state.lock().await;
            state.counts.replays += 1;
            state
                .ring
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .cloned()
                .collect()
        };
        for (seq, payload) in held {
            let frames = vec![
                identity.clone(),
                Bytes::new(),
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if let Ok(message) = ZmqMessage::try_from(frames) {
                let _ = socket.send(message).await;
            }
        }
        let end = vec![
            identity.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::from_static(&END_SEQ),
            Bytes::new(),
        ];
        if let Ok(message) = ZmqMessage::try_from(end) {
            let _ = socket.send(message).await;
        }
    }
}

/// Seconds since the Unix epoch, as vLLM stamps its batches.
fn wall_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
