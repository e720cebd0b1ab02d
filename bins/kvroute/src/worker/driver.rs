//! The engine in real time: one task owns the [`Engine`], runs its passes, sleeps each pass's
//! duration, and hands every request's outputs to its caller and every batch of KV events to
//! the publisher.
//!
//! ```text
//!  HTTP handlers ──Command::Admit (request, output sink)──▶ driver task ──step──▶ Engine
//!                ──Command::Abort / Fault──────────────────▶     │ sleep(pass)   │
//!  output sinks ◀── tokens, first token, finish, cached ─────────┘◀── outputs ───┘
//!  publisher    ◀── event batches
//! ```
//!
//! Requests that arrive during a pass join the next one, as in vLLM. A sink whose receiver is
//! gone (the client disconnected) has its request aborted at once, so its blocks are freed and
//! nothing more is computed for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use kvroute_sim::{
    Admission, ClearMode, Engine, EngineRequest, EngineStats, Occupancy, RequestId, RequestOutput,
    SimError,
};

use super::publisher::Publisher;

/// Where an admitted request's prompt KV comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PromptKv {
    /// The engine computes it (what its cache lacks).
    Computed,
    /// A prefill worker computed it and handed it over: the decode half of a disaggregated
    /// request ([`Engine::admit_transferred`]).
    Transferred,
}

/// What the driver is asked to do.
#[derive(Debug)]
pub(crate) enum Command {
    /// Admit a request; its outputs go to `sink`. The reply says whether it was admitted.
    Admit {
        prompt: Vec<u32>,
        cache_salt: Option<Arc<str>>,
        max_output_tokens: u32,
        kv: PromptKv,
        sink: mpsc::UnboundedSender<RequestOutput>,
        reply: oneshot::Sender<Result<RequestId, SimError>>,
    },
    /// Stop a request (its caller went away); unknown or finished ones are ignored.
    Abort(RequestId),
    /// Stop or restart admissions.
    SetAdmission(Admission),
    /// Drop the prefix cache (vLLM's `/reset_prefix_cache`).
    ClearCache(oneshot::Sender<Result<(), SimError>>),
    /// The engine process restarts: running requests are preempted, the cache is emptied and
    /// the event sequence starts again at 0, in that order on the event stream.
    Restart(oneshot::Sender<Result<(), SimError>>),
    /// The engine's state in numbers.
    Stats(oneshot::Sender<DriverStats>),
    /// The prompt tokens the prefix cache holds for `prompt` now, leaving its last token to
    /// compute as admission does: what an oracle placing the request here would find.
    Cached {
        prompt: Vec<u32>,
        cache_salt: Option<Arc<str>>,
        reply: oneshot::Sender<u32>,
    },
}

/// The engine's state and the driver's own counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// The engine's counters.
    pub engine: EngineStats,
    /// Requests admitted since start.
    pub admitted: u64,
    /// Of those, decode halves admitted with their prompt's KV handed over.
    pub transferred: u64,
    /// Requests aborted because their caller went away.
    pub aborted: u64,
    /// Requests that generated all their tokens.
    pub finished: u64,
    /// Prompt tokens admitted.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
}

/// The handle the HTTP side (and the wire's) uses.
#[derive(Debug, Clone)]
pub(crate) struct Driver {
    commands: mpsc::UnboundedSender<Command>,
    /// How busy the engine was after its latest pass, for readers that must not wait.
    latest: Arc<Mutex<Occupancy>>,
}

impl Driver {
    /// Starts the driver task on the current runtime.
    pub(crate) fn start(engine: Engine, publisher: Option<Publisher>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let latest = Arc::new(Mutex::new(engine.occupancy()));
        tokio::spawn(run(engine, rx, publisher, Arc::clone(&latest)));
        Driver {
            commands: tx,
            latest,
        }
    }

    /// Sends a command; false when the driver has stopped.
    pub(crate) fn send(&self, command: Command) -> bool {
        self.commands.send(command).is_ok()
    }

    /// How busy the engine was after its latest pass, without waiting for the driver.
    pub(crate) fn occupancy(&self) -> Occupancy {
        *self.latest.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct Task {
    engine: Engine,
    publisher: Option<Publisher>,
    sinks: HashMap<RequestId, mpsc::UnboundedSender<RequestOutput>>,
    next_id: u64,
    stats: DriverStats,
    /// Wall time at engine time zero.
    origin: Instant,
    latest: Arc<Mutex<Occupancy>>,
}

async fn run(
    engine: Engine,
    mut commands: mpsc::UnboundedReceiver<Command>,
    publisher: Option<Publisher>,
    latest: Arc<Mutex<Occupancy>>,
) {
    let mut task = Task {
        engine,
        publisher,
        sinks: HashMap::new(),
        next_id: 0,
        stats: DriverStats::default(),
        origin: Instant::now(),
        latest,
    };
    loop {
        // Take everything that came in; wait for a command only when there is nothing to run.
        while let Ok(command) = commands.try_recv() {
            task.handle(command);
        }
        if task.engine.step().is_none() {
            task.flush();
            let Some(command) = commands.recv().await else {
                return;
            };
            // The engine stood idle: its clock catches up with the wall's (no pass runs).
            task.engine.advance_to(task.origin.elapsed());
            task.handle(command);
            continue;
        }
        // The pass's outputs are known now; they are delivered when it would have ended.
        tokio::time::sleep_until(task.origin + task.engine.now()).await;
        task.flush();
    }
}

impl Task {
    fn handle(&mut self, command: Command) {
        match command {
            Command::Admit {
                prompt,
                cache_salt,
                max_output_tokens,
                kv,
                sink,
                reply,
            } => {
                let id = RequestId(self.next_id);
                self.next_id += 1;
                let prompt_tokens = prompt.len() as u64;
                let now = self.origin.elapsed().max(self.engine.now());
                let request = EngineRequest {
                    id,
                    prompt,
                    max_output_tokens,
                    arrival: now,
                    cache_salt,
                };
                let result = match kv {
                    PromptKv::Computed => self.engine.admit(request),
                    PromptKv::Transferred => self.engine.admit_transferred(request),
                }
                .map(|()| id);
                if result.is_ok() {
                    self.sinks.insert(id, sink);
                    self.stats.admitted += 1;
                    self.stats.prompt_tokens += prompt_tokens;
                    if kv == PromptKv::Transferred {
                        self.stats.transferred += 1;
                    }
                }
                let _ = reply.send(result);
            }
            Command::Abort(id) => self.abort(id),
            Command::SetAdmission(admission) => self.engine.set_admission(admission),
            Command::ClearCache(reply) => {
                let result = self.engine.clear_cache(ClearMode::PreemptRunning);
                self.flush();
                let _ = reply.send(result);
            }
            Command::Restart(reply) => {
                // Everything published so far keeps its numbering; the cleared batch and what
                // follows are the new process's, from 0.
                self.flush();
                if let Some(publisher) = &self.publisher {
                    publisher.restart_in_stream();
                }
                let result = self.engine.clear_cache(ClearMode::PreemptRunning);
                self.flush();
                let _ = reply.send(result);
            }
            Command::Stats(reply) => {
                let mut stats = self.stats;
                stats.engine = self.engine.stats();
                let _ = reply.send(stats);
            }
            Command::Cached {
                prompt,
                cache_salt,
                reply,
            } => {
                let computable = &prompt[..prompt.len().saturating_sub(1)];
                let blocks = self
                    .engine
                    .cached_prefix_blocks_salted(computable, cache_salt.as_deref());
                let tokens = blocks * self.engine.config().block_size as usize;
                let _ = reply.send(u32::try_from(tokens).unwrap_or(u32::MAX));
            }
        }
    }

    fn abort(&mut self, id: RequestId) {
        if self.sinks.remove(&id).is_some() && self.engine.abort(id).is_ok() {
            self.stats.aborted += 1;
        }
    }

    /// Hands the outputs to their sinks (aborting requests whose caller left) and the events
    /// to the publisher.
    fn flush(&mut self) {
        for output in self.engine.take_outputs() {
            self.stats.generation_tokens += output.tokens.len() as u64;
            let id = output.id;
            let done = output.finish.is_some();
            let delivered = match self.sinks.get(&id) {
                Some(sink) => sink.send(output).is_ok(),
                None => true,
            };
            if done {
                if self.sinks.remove(&id).is_some() {
                    self.stats.finished += 1;
                }
            } else if !delivered {
                self.abort(id);
            }
        }
        let batches = self.engine.take_events();
        if let Some(publisher) = &self.publisher {
            for batch in batches {
                publisher.publish(batch);
            }
        }
        *self.latest.lock().unwrap_or_else(PoisonError::into_inner) = self.engine.occupancy();
    }
}
