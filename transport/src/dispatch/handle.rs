//! The caller's side: [`DispatchClient`], the handle on one worker connection, and the
//! [`ResponseStream`] of each request.

use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvroute_core::WorkerId;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

use super::config::DispatchConfig;
use super::driver::{Command, Driver};
use super::error::{DispatchError, Rejected, StreamError};
use super::status::{DispatchStats, LinkState, WorkerStatus};
use crate::wire::{Dispatch, Hello, ResponseItem};

/// A request's response items, in order, ending with a finishing item or an error.
///
/// An engine that fails a request ends it with an item whose `finish` is
/// `FinishReason::Error` and whose `error` says why (so does a worker that refuses a request
/// as overloaded or shutting down); `Err` items are for what went wrong between the two
/// sides: a lost connection, a worker's error message, a duplicate id, shutdown.
#[derive(Debug)]
pub struct ResponseStream {
    request_id: u64,
    worker: WorkerId,
    rx: mpsc::Receiver<Result<ResponseItem, StreamError>>,
    commands: mpsc::UnboundedSender<Command>,
    done: bool,
    cancel_sent: bool,
}

impl ResponseStream {
    /// The id of the request it answers.
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// The next item; `None` after the finishing item or an error.
    pub async fn next(&mut self) -> Option<Result<ResponseItem, StreamError>> {
        if self.done {
            return None;
        }
        let got = match self.rx.recv().await {
            Some(Ok(item)) => {
                self.done = item.finish.is_some();
                Ok(item)
            }
            Some(Err(e)) => {
                self.done = true;
                Err(e)
            }
            // The driver dropped the request without a word: its connection went away.
            None => {
                self.done = true;
                Err(StreamError::ConnectionLost {
                    worker: self.worker,
                    reason: None,
                })
            }
        };
        Some(got)
    }

    /// Asks the worker to stop. The stream goes on to its end: a `Cancelled` item, or
    /// whatever finishing item was already on its way.
    pub fn cancel(&mut self) {
        if !self.done && !self.cancel_sent {
            self.cancel_sent = true;
            // A closed queue means the driver has gone, and the request with it.
            let _ = self.commands.send(Command::Cancel {
                request_id: self.request_id,
            });
        }
    }
}

impl Drop for ResponseStream {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// The router's handle on one worker connection.
#[derive(Debug)]
pub struct DispatchClient {
    worker: WorkerId,
    max_in_flight: usize,
    stream_buffer: usize,
    commands: mpsc::UnboundedSender<Command>,
    permits: Arc<Semaphore>,
    status: watch::Receiver<WorkerStatus>,
    stats: Arc<Mutex<DispatchStats>>,
    stop: watch::Sender<bool>,
    driver: tokio::task::JoinHandle<()>,
}

impl DispatchClient {
    /// Starts connecting to the worker in the background. Call inside a runtime of
    /// `config.backend` with a `LocalSet` ([`crate::backend::block_on`] builds one).
    pub fn start(config: DispatchConfig) -> DispatchClient {
        let (commands, commands_rx) = mpsc::unbounded_channel();
        let permits = Arc::new(Semaphore::new(config.max_in_flight.max(1)));
        let (status_tx, status) = watch::channel(WorkerStatus {
            state: LinkState::Connecting,
            hello: None,
            load: None,
            last_error: None,
            connects: 0,
        });
        let stats = Arc::new(Mutex::new(DispatchStats::default()));
        let (stop, stop_rx) = watch::channel(false);
        let driver = Driver {
            config: Arc::new(config.clone()),
            commands: commands_rx,
            status: Rc::new(status_tx),
            stats: Arc::clone(&stats),
            stop: stop_rx,
            permits: Arc::clone(&permits),
        };
        let driver = tokio::task::spawn_local(driver.run());
        DispatchClient {
            worker: config.worker,
            max_in_flight: config.max_in_flight.max(1),
            stream_buffer: config.stream_buffer.max(1),
            commands,
            permits,
            status,
            stats,
            stop,
            driver,
        }
    }

    /// The worker it connects to.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// The worker's status now.
    pub fn status(&self) -> WorkerStatus {
        self.status.borrow().clone()
    }

    /// A receiver that sees every status change (connects, heartbeats, losses).
    pub fn watch_status(&self) -> watch::Receiver<WorkerStatus> {
        self.status.clone()
    }

    /// The totals so far.
    pub fn stats(&self) -> DispatchStats {
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Requests that may still be dispatched before `dispatch` waits.
    pub fn free_slots(&self) -> usize {
        self.permits.available_permits()
    }

    /// Waits until the client is connected (returning the worker's Hello), for at most
    /// `timeout`; else the last error.
    pub async fn wait_connected(&self, timeout: Duration) -> Result<Hello, DispatchError> {
        let mut status = self.status.clone();
        let connected = tokio::time::timeout(
            timeout,
            status.wait_for(|s| s.state == LinkState::Connected || s.state == LinkState::ShutDown),
        )
        .await
        // Drop the guard at once: it holds the status lock.
        .map(|r| r.is_ok());
        let s = self.status.borrow().clone();
        match (connected, s.state, s.hello) {
            (Ok(true), LinkState::Connected, Some(hello)) => Ok(hello),
            (_, LinkState::ShutDown, _) => Err(DispatchError::ShutDown {
                worker: self.worker,
            }),
            _ => Err(DispatchError::NotConnected {
                worker: self.worker,
                last_error: s.last_error,
            }),
        }
    }

    /// Dispatches `request`, waiting for an in-flight slot; fails at once if the worker is
    /// not connected.
    pub async fn dispatch(&self, request: Dispatch) -> Result<ResponseStream, Rejected> {
        let request = self.check_connected(request)?;
        match Arc::clone(&self.permits).acquire_owned().await {
            Ok(permit) => self.send(request, permit),
            Err(_) => Err(self.rejected(
                DispatchError::ShutDown {
                    worker: self.worker,
                },
                request,
            )),
        }
    }

    /// Dispatches `request` if a slot is free now; else hands it back with
    /// [`DispatchError::Full`].
    pub fn try_dispatch(&self, request: Dispatch) -> Result<ResponseStream, Rejected> {
        let request = self.check_connected(request)?;
        match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(permit) => self.send(request, permit),
            Err(tokio::sync::TryAcquireError::NoPermits) => Err(self.rejected(
                DispatchError::Full {
                    worker: self.worker,
                    max_in_flight: self.max_in_flight,
                },
                request,
            )),
            Err(tokio::sync::TryAcquireError::Closed) => Err(self.rejected(
                DispatchError::ShutDown {
                    worker: self.worker,
                },
                request,
            )),
        }
    }

    /// Refuses new requests, lets in-flight ones finish within the grace period, closes the
    /// connection and returns the totals.
    pub async fn shutdown(self) -> DispatchStats {
        // A send error only means the driver has already gone.
        let _ = self.stop.send(true);
        self.permits.close();
        // The driver never panics on input; a panic elsewhere leaves the totals as they are.
        let _ = self.driver.await;
        let stats = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        stats.clone()
    }

    fn rejected(&self, reason: DispatchError, request: Dispatch) -> Rejected {
        Rejected {
            reason,
            request: Box::new(request),
        }
    }

    fn check_connected(&self, request: Dispatch) -> Result<Dispatch, Rejected> {
        let s = self.status.borrow();
        match s.state {
            LinkState::Connected => Ok(request),
            LinkState::ShutDown => {
                drop(s);
                Err(self.rejected(
                    DispatchError::ShutDown {
                        worker: self.worker,
                    },
                    request,
                ))
            }
            _ => {
                let last_error = s.last_error.clone();
                drop(s);
                Err(self.rejected(
                    DispatchError::NotConnected {
                        worker: self.worker,
                        last_error,
                    },
                    request,
                ))
            }
        }
    }

    fn send(
        &self,
        request: Dispatch,
        permit: OwnedSemaphorePermit,
    ) -> Result<ResponseStream, Rejected> {
        // The connection may have dropped while we waited for the permit.
        let request = self.check_connected(request)?;
        let (tx, rx) = mpsc::channel(self.stream_buffer);
        let request_id = request.request_id;
        let sent = self.commands.send(Command::Dispatch {
            request,
            tx,
            permit,
        });
        if let Err(mpsc::error::SendError(cmd)) = sent {
            let Command::Dispatch { request, .. } = cmd else {
                unreachable!("the command just built is a dispatch")
            };
            return Err(self.rejected(
                DispatchError::ShutDown {
                    worker: self.worker,
                },
                request,
            ));
        }
        Ok(ResponseStream {
            request_id,
            worker: self.worker,
            rx,
            commands: self.commands.clone(),
            done: false,
            cancel_sent: false,
        })
    }
}
