//! One connection: the in-flight table its reader and writer share ([`Link`]), the
//! handshake, the reader loop, and flushing while the worker shows life.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvroute_core::WorkerId;
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit};

use super::config::DispatchConfig;
use super::error::{LinkError, StreamError};
use super::status::{DispatchStats, WorkerStatus};
use crate::conn::{FlushError, FrameReader, FrameWriter};
use crate::frame::{DecodeStats, MAX_PAYLOAD};
use crate::net::Stream;
use crate::wire::{ErrorCode, Hello, Message, MessageRef, ResponseItem, Role, PROTOCOL_VERSION};

/// A request in flight: where its items go, and its slot.
pub(super) struct Pending {
    pub(super) tx: mpsc::Sender<Result<ResponseItem, StreamError>>,
    pub(super) _permit: OwnedSemaphorePermit,
}

/// What one connection's reader and writer share (same thread).
pub(super) struct Link {
    pub(super) pending: RefCell<HashMap<u64, Pending>>,
    pub(super) last_rx: Cell<Instant>,
    /// The reader waits for a consumer to make room in its stream: the worker may well be
    /// sending, so silence on the socket says nothing about it then.
    pub(super) delivering: Cell<bool>,
    /// Signalled when `pending` becomes empty (shutdown waits on it).
    pub(super) drained: Notify,
    pub(super) decode: Cell<DecodeStats>,
}

/// Flushes while the worker shows life (see [`FrameWriter::flush_while_alive`]).
pub(super) async fn flush(
    writer: &mut FrameWriter,
    link: &Link,
    limit: Duration,
) -> Result<(), LinkError> {
    let silent_for = || {
        if link.delivering.get() {
            Duration::ZERO
        } else {
            link.last_rx.get().elapsed()
        }
    };
    match writer.flush_while_alive(limit, silent_for).await {
        Ok(()) => Ok(()),
        Err(FlushError::Io(e)) => Err(LinkError::io(&e)),
        Err(FlushError::PeerSilent { silent }) => Err(LinkError::Idle { silent }),
    }
}

/// Connects, sends our Hello, and checks the worker's.
pub(super) async fn handshake(
    cfg: &DispatchConfig,
) -> Result<(FrameReader, FrameWriter, Hello), LinkError> {
    let addr = cfg.addr;
    let stream =
        match tokio::time::timeout(cfg.connect_timeout, Stream::connect(cfg.backend, addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                return Err(LinkError::Connect {
                    addr,
                    reason: e.to_string(),
                })
            }
            Err(_) => {
                return Err(LinkError::Connect {
                    addr,
                    reason: format!("timed out after {:?}", cfg.connect_timeout),
                })
            }
        };
    let (r, w) = stream.into_split();
    let mut reader = FrameReader::new(r, cfg.max_payload.min(MAX_PAYLOAD), cfg.read_chunk);
    let mut writer = FrameWriter::new(w);
    let ours = Hello {
        protocol_version: PROTOCOL_VERSION,
        // The worker we expect; a router has no ranks or cache of its own.
        worker_id: cfg.worker.0,
        dp_start: 0,
        dp_size: 0,
        kv_blocks: 0,
        block_size: 0,
        role: Role::Aggregated,
        max_batched_tokens: 0,
        labels: Vec::new(),
    };
    if writer.push(&Message::Hello(ours)).is_err() {
        return Err(LinkError::Protocol {
            what: "our Hello does not encode",
        });
    }
    writer.flush().await.map_err(|e| LinkError::io(&e))?;
    let frame = match tokio::time::timeout(cfg.connect_timeout, reader.next_frame()).await {
        Err(_) => {
            return Err(LinkError::HandshakeTimeout {
                addr,
                waited: cfg.connect_timeout,
            })
        }
        Ok(Err(end)) => return Err(LinkError::from_read(end)),
        Ok(Ok(frame)) => frame,
    };
    let msg = reader
        .validate(&frame)
        .map_err(|error| LinkError::Frame { error })?;
    let hello = match msg {
        MessageRef::Hello(h) => {
            let found = h.protocol_version.to_native();
            if found != PROTOCOL_VERSION {
                return Err(LinkError::WrongVersion {
                    expected: PROTOCOL_VERSION,
                    found,
                });
            }
            let found = WorkerId(h.worker_id.to_native());
            if found != cfg.worker {
                return Err(LinkError::WrongWorker {
                    expected: cfg.worker,
                    found,
                });
            }
            match msg.deserialize() {
                Ok(Message::Hello(hello)) => hello,
                _ => {
                    return Err(LinkError::Protocol {
                        what: "a validated Hello did not deserialize",
                    })
                }
            }
        }
        MessageRef::Error(e) => {
            return Err(LinkError::Refused {
                code: match msg.deserialize() {
                    Ok(Message::Error(e)) => e.code,
                    _ => ErrorCode::Internal,
                },
                message: e.message.to_string(),
            })
        }
        other => return Err(LinkError::NotHello { kind: other.kind() }),
    };
    Ok((reader, writer, hello))
}

/// Reads the worker's frames until the connection ends, and returns why.
pub(super) async fn read_loop(
    mut reader: FrameReader,
    link: Rc<Link>,
    status: Rc<watch::Sender<WorkerStatus>>,
    stats: Arc<Mutex<DispatchStats>>,
    worker: WorkerId,
) -> LinkError {
    let count = |f: &dyn Fn(&mut DispatchStats)| {
        f(&mut stats.lock().unwrap_or_else(PoisonError::into_inner));
    };
    loop {
        let frame = match reader.next_frame().await {
            Ok(f) => f,
            Err(end) => {
                link.decode.set(*reader.stats());
                return LinkError::from_read(end);
            }
        };
        link.last_rx.set(Instant::now());
        let msg = match reader.validate(&frame) {
            Ok(m) => m,
            Err(error) => {
                link.decode.set(*reader.stats());
                return LinkError::Frame { error };
            }
        };
        link.decode.set(*reader.stats());
        match msg {
            MessageRef::Response(r) => {
                let request_id = r.request_id.to_native();
                let finishes = r.finish.is_some();
                let tx = match link.pending.borrow().get(&request_id) {
                    Some(p) => p.tx.clone(),
                    None => {
                        count(&|s| s.late_items += 1);
                        continue;
                    }
                };
                let Ok(Message::Response(item)) = msg.deserialize() else {
                    return LinkError::Protocol {
                        what: "a validated response item did not deserialize",
                    };
                };
                // Waits while the consumer's queue is full: backpressure on this connection.
                // A consumer that has gone already sent a Cancel when its stream dropped.
                link.delivering.set(true);
                let _ = tx.send(Ok(item)).await;
                link.delivering.set(false);
                link.last_rx.set(Instant::now());
                // Retired only once delivered: a draining shutdown ends the connection as
                // soon as nothing is pending, and must not cut a last item on its way.
                if finishes {
                    retire(&link, request_id);
                    count(&|s| s.finished += 1);
                }
            }
            MessageRef::Heartbeat(_) => {
                if let Ok(Message::Heartbeat(hb)) = msg.deserialize() {
                    status.send_modify(|s| s.load = Some(hb));
                }
                count(&|s| s.heartbeats += 1);
            }
            MessageRef::Error(e) => {
                let message = e.message.to_string();
                let code = match msg.deserialize() {
                    Ok(Message::Error(e)) => e.code,
                    _ => ErrorCode::Internal,
                };
                let request = e.request_id.as_ref().map(|id| id.to_native());
                match request.and_then(|id| retire(&link, id)) {
                    Some(p) => {
                        count(&|s| s.worker_errors += 1);
                        let _ = p.tx.try_send(Err(StreamError::Worker {
                            worker,
                            code,
                            message,
                        }));
                    }
                    None => {
                        tracing::warn!(?worker, ?code, %message, "worker reported an error");
                        count(&|s| s.ignored += 1);
                    }
                }
            }
            MessageRef::Hello(_) => {
                return LinkError::Protocol {
                    what: "a second Hello",
                }
            }
            _ => count(&|s| s.ignored += 1),
        }
    }
}

/// Removes a request from the in-flight table (freeing its slot) and wakes a draining
/// shutdown when it was the last.
pub(super) fn retire(link: &Link, request_id: u64) -> Option<Pending> {
    let mut pending = link.pending.borrow_mut();
    let p = pending.remove(&request_id);
    if pending.is_empty() {
        link.drained.notify_one();
    }
    p
}
