//! The driver task: it keeps the connection up (connect, handshake, backoff), writes the
//! commands the handle and the streams send it, and ends every in-flight stream when a
//! connection is lost.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute_core::mix64;
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit, Semaphore};

use super::config::DispatchConfig;
use super::error::{LinkError, StreamError};
use super::link::{flush, handshake, read_loop, Link, Pending};
use super::status::{DispatchStats, LinkState, WorkerStatus};
use crate::conn::{BackoffState, FrameReader, FrameWriter};
use crate::frame::DecodeStats;
use crate::wire::{Cancel, Dispatch, Heartbeat, Message, ResponseItem};

/// A command from the handle and the streams to the driver.
// Dispatches are the common command: boxing them would add an allocation to each.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(super) enum Command {
    Dispatch {
        request: Dispatch,
        tx: mpsc::Sender<Result<ResponseItem, StreamError>>,
        permit: OwnedSemaphorePermit,
    },
    Cancel {
        request_id: u64,
    },
}

pub(super) struct Driver {
    pub(super) config: Arc<DispatchConfig>,
    pub(super) commands: mpsc::UnboundedReceiver<Command>,
    pub(super) status: Rc<watch::Sender<WorkerStatus>>,
    pub(super) stats: Arc<Mutex<DispatchStats>>,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) permits: Arc<Semaphore>,
}

/// How a connection ended.
pub(super) enum LinkEnd {
    Lost(LinkError),
    Shutdown,
}

impl Driver {
    fn stats(&self, f: impl FnOnce(&mut DispatchStats)) {
        f(&mut self.stats.lock().unwrap_or_else(PoisonError::into_inner));
    }

    fn stopping(&self) -> bool {
        // A dropped handle counts as a stop.
        *self.stop.borrow() || self.stop.has_changed().is_err()
    }

    pub(super) async fn run(mut self) {
        let cfg = Arc::clone(&self.config);
        let seed = mix64(
            cfg.worker.0
                ^ u64::from(cfg.addr.port())
                ^ SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.subsec_nanos().into()),
        );
        let mut backoff = BackoffState::new(cfg.backoff, seed);
        'outer: while !self.stopping() {
            self.status.send_modify(|s| s.state = LinkState::Connecting);
            let attempt = tokio::select! {
                a = handshake(&cfg) => a,
                _ = self.stop.changed() => break 'outer,
            };
            match attempt {
                Ok((reader, writer, hello)) => {
                    backoff.reset();
                    self.stats(|s| s.connects += 1);
                    tracing::info!(worker = ?cfg.worker, addr = %cfg.addr, "connected to worker");
                    self.status.send_modify(|s| {
                        s.state = LinkState::Connected;
                        s.hello = Some(hello);
                        s.last_error = None;
                        s.connects += 1;
                    });
                    match self.serve(reader, writer).await {
                        LinkEnd::Shutdown => break 'outer,
                        LinkEnd::Lost(error) => {
                            self.stats(|s| s.disconnects += 1);
                            tracing::warn!(worker = ?cfg.worker, addr = %cfg.addr, %error, "worker connection lost");
                            self.status.send_modify(|s| s.last_error = Some(error));
                        }
                    }
                }
                Err(error) => {
                    self.stats(|s| match error {
                        LinkError::Connect { .. } => s.connect_failures += 1,
                        _ => s.handshake_failures += 1,
                    });
                    tracing::warn!(worker = ?cfg.worker, addr = %cfg.addr, %error, "cannot reach worker");
                    self.status.send_modify(|s| s.last_error = Some(error));
                }
            }
            self.status.send_modify(|s| s.state = LinkState::Backoff);
            let until = tokio::time::Instant::now() + backoff.next_delay();
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(until) => break,
                    _ = self.stop.changed() => break 'outer,
                    cmd = self.commands.recv() => match cmd {
                        Some(cmd) => self.refuse(cmd, false),
                        None => break 'outer,
                    },
                }
            }
        }
        self.status.send_modify(|s| s.state = LinkState::ShutDown);
        self.permits.close();
        self.commands.close();
        while let Ok(cmd) = self.commands.try_recv() {
            self.refuse(cmd, true);
        }
    }

    /// A command that arrives while no connection can take it.
    fn refuse(&self, cmd: Command, shutting_down: bool) {
        if let Command::Dispatch { tx, .. } = cmd {
            let worker = self.config.worker;
            let e = if shutting_down {
                StreamError::ShutDown { worker }
            } else {
                StreamError::ConnectionLost {
                    worker,
                    reason: self.status.borrow().last_error.clone(),
                }
            };
            // The stream's queue is new and empty: this cannot fail for want of room, and if
            // the stream is gone nobody is waiting.
            let _ = tx.try_send(Err(e));
        }
    }

    /// Runs one established connection until it ends.
    async fn serve(&mut self, reader: FrameReader, mut writer: FrameWriter) -> LinkEnd {
        let cfg = Arc::clone(&self.config);
        let link = Rc::new(Link {
            pending: RefCell::new(HashMap::new()),
            last_rx: Cell::new(Instant::now()),
            delivering: Cell::new(false),
            drained: Notify::new(),
            decode: Cell::new(DecodeStats::default()),
        });
        let mut reader_task = tokio::task::spawn_local(read_loop(
            reader,
            Rc::clone(&link),
            Rc::clone(&self.status),
            Arc::clone(&self.stats),
            cfg.worker,
        ));
        let mut ticker =
            tokio::time::interval(cfg.heartbeat_interval.max(Duration::from_millis(1)));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut batch = Vec::with_capacity(128);
        let mut seq = 0u64;
        let mut draining: Option<tokio::time::Instant> = None;
        let far = tokio::time::Instant::now() + Duration::from_secs(365 * 86_400);
        let end = loop {
            if draining.is_some() && link.pending.borrow().is_empty() {
                break LinkEnd::Shutdown;
            }
            tokio::select! {
                biased;
                ended = &mut reader_task => {
                    break LinkEnd::Lost(ended.unwrap_or(LinkError::Protocol { what: "reader task failed" }));
                }
                n = self.commands.recv_many(&mut batch, 128) => {
                    if n == 0 {
                        // Every sender is gone, the handle's too: nothing more can come.
                        draining.get_or_insert(tokio::time::Instant::now() + cfg.shutdown_grace);
                        continue;
                    }
                    for cmd in batch.drain(..) {
                        self.queue(cmd, &link, &mut writer, draining.is_some());
                    }
                    if let Err(e) = flush(&mut writer, &link, cfg.idle_timeout).await {
                        break LinkEnd::Lost(e);
                    }
                }
                _ = ticker.tick() => {
                    let silent = link.last_rx.get().elapsed();
                    if silent > cfg.idle_timeout && !link.delivering.get() {
                        break LinkEnd::Lost(LinkError::Idle { silent });
                    }
                    seq += 1;
                    let hb = Heartbeat { worker_id: cfg.worker.0, seq, ranks: Vec::new() };
                    if writer.push(&Message::Heartbeat(hb)).is_err() {
                        tracing::warn!("heartbeat does not encode; skipped");
                    }
                    if let Err(e) = flush(&mut writer, &link, cfg.idle_timeout).await {
                        break LinkEnd::Lost(e);
                    }
                }
                _ = self.stop.changed(), if draining.is_none() => {
                    draining = Some(tokio::time::Instant::now() + cfg.shutdown_grace);
                }
                _ = link.drained.notified(), if draining.is_some() => {}
                _ = tokio::time::sleep_until(draining.unwrap_or(far)), if draining.is_some() => {
                    break LinkEnd::Shutdown;
                }
            }
        };
        reader_task.abort();
        let pending = std::mem::take(&mut *link.pending.borrow_mut());
        let worker = cfg.worker;
        let error = match &end {
            LinkEnd::Lost(reason) => StreamError::ConnectionLost {
                worker,
                reason: Some(reason.clone()),
            },
            LinkEnd::Shutdown => StreamError::ShutDown { worker },
        };
        for p in pending.values() {
            // A full queue: the stream sees its end as a lost connection all the same.
            let _ = p.tx.try_send(Err(error.clone()));
        }
        let ended = pending.len() as u64;
        let decode = link.decode.get();
        self.stats(|s| {
            match &end {
                LinkEnd::Lost(_) => s.lost += ended,
                LinkEnd::Shutdown => s.shut_down += ended,
            }
            s.decode.merge(&decode);
        });
        if let LinkEnd::Shutdown = end {
            // Best effort: the worker sees end of stream when the socket drops anyway.
            let _ = writer.close().await;
        }
        end
    }

    /// Encodes one command for the worker.
    fn queue(&self, cmd: Command, link: &Link, writer: &mut FrameWriter, draining: bool) {
        match cmd {
            Command::Dispatch { tx, .. } if draining => {
                let _ = tx.try_send(Err(StreamError::ShutDown {
                    worker: self.config.worker,
                }));
            }
            Command::Dispatch {
                request,
                tx,
                permit,
            } => {
                let request_id = request.request_id;
                if link.pending.borrow().contains_key(&request_id) {
                    let _ = tx.try_send(Err(StreamError::DuplicateRequest { request_id }));
                    return;
                }
                if let Err(e) = writer.push(&Message::Dispatch(request)) {
                    let _ = tx.try_send(Err(StreamError::Encode {
                        request_id,
                        reason: e.to_string(),
                    }));
                    return;
                }
                link.pending.borrow_mut().insert(
                    request_id,
                    Pending {
                        tx,
                        _permit: permit,
                    },
                );
                self.stats(|s| s.dispatched += 1);
            }
            Command::Cancel { request_id } => {
                if link.pending.borrow().contains_key(&request_id)
                    && writer.push(&Message::Cancel(Cancel { request_id })).is_ok()
                {
                    self.stats(|s| s.cancels_sent += 1);
                }
            }
        }
    }
}
