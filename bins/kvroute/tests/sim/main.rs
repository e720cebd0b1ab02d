//! Behaviour tests of the programs' library, through its public API: the simulated engine's
//! scheduler rules (`scheduling.rs`), its prefix cache and its truth (`cache.rs`), fault hooks
//! and refusals (`hooks.rs`), a property test that the router's index built from the engine's
//! events equals the engine's cache after every pass (`events_model.rs`), the fleet on one
//! virtual clock (`fleet.rs`), workloads and traces (`workload.rs`), the demo (`demo.rs`), and the
//! live worker through its HTTP and ZeroMQ interfaces (`worker.rs`), and `kvroute serve` end to end
//! with workers as real processes (`serve.rs`); the chat template and tokenizer against
//! transformers (`chat.rs`); replay's figures and a replay against a worker (`replay.rs`); SGLang's own KV-event
//! publisher feeding serve (`sglang.rs`); prefill and decode workers behind serve in both
//! protocols (`disagg.rs`); several serve replicas sharing bookings over a real NATS server
//! (`serve_replicas.rs`); several routers over the simulated fleet, their bookings synced at
//! once, late or never, and `demo --replicas` (`replicas.rs`).

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

mod cache;
mod chat;
mod demo;
mod disagg;
mod events_model;
mod fast_bpe;
mod fleet;
mod hooks;
mod lifecycle;
mod publishers;
mod replay;
mod replicas;
mod scheduling;
mod serve;
mod serve_replicas;
mod sglang;
mod vllm;
mod worker;
mod workload;

use std::collections::HashMap;
use std::time::Duration;

use kvroute_sim::{
    Engine, EngineConfig, EngineEvent, EngineRequest, Finish, RequestId, RequestOutput,
};

/// Says why a test that needs `scripts/fixtures.sh`'s files is skipped, or fails it when
/// `KVROUTE_FIXTURES=required` (as the README's test command sets it):
/// there a missing fixture is a failure, never a pass.
pub fn skip_without_fixtures(why: &str) {
    if std::env::var("KVROUTE_FIXTURES").as_deref() == Ok("required") {
        panic!("{why}");
    }
    eprintln!("skipped: {why}");
}

/// An engine of `kv_blocks` 16-token blocks with a token budget of `budget`.
pub fn engine(kv_blocks: u32, budget: u32) -> Engine {
    Engine::new(EngineConfig {
        kv_blocks,
        max_num_batched_tokens: budget,
        ..EngineConfig::default()
    })
    .unwrap()
}

/// A request arriving at time zero.
pub fn request(id: u64, prompt: Vec<u32>, max_output_tokens: u32) -> EngineRequest {
    EngineRequest {
        id: RequestId(id),
        prompt,
        max_output_tokens,
        arrival: Duration::ZERO,
        cache_salt: None,
    }
}

/// `n` tokens starting at `first`: distinct ranges make prompts that share nothing.
pub fn tokens(first: u32, n: u32) -> Vec<u32> {
    (first..first + n).collect()
}

/// What the passes reported, per request.
#[derive(Default, Debug)]
pub struct Transcript {
    pub tokens: HashMap<RequestId, Vec<u32>>,
    pub first_token: HashMap<RequestId, Duration>,
    pub finished: HashMap<RequestId, (Finish, Duration)>,
    pub cached: HashMap<RequestId, u32>,
}

impl Transcript {
    pub fn record(&mut self, outputs: Vec<RequestOutput>) {
        for out in outputs {
            self.tokens.entry(out.id).or_default().extend(&out.tokens);
            if let Some(at) = out.first_token_at {
                assert!(
                    self.first_token.insert(out.id, at).is_none(),
                    "two first tokens"
                );
            }
            if let Some(finish) = out.finish {
                assert!(self.finished.insert(out.id, (finish, out.at)).is_none());
            }
            self.cached.insert(out.id, out.cached_tokens);
        }
    }

    pub fn count(&self, id: u64) -> usize {
        self.tokens.get(&RequestId(id)).map_or(0, Vec::len)
    }

    pub fn finished_at(&self, id: u64) -> Duration {
        self.finished[&RequestId(id)].1
    }
}

/// Runs passes until the engine is idle, recording every output.
pub fn run_to_idle(engine: &mut Engine, transcript: &mut Transcript) {
    while engine.step().is_some() {
        transcript.record(engine.take_outputs());
    }
    transcript.record(engine.take_outputs());
    assert!(engine.is_idle());
}

/// The engine hashes named by every Removed event since the last call, in order.
pub fn removed_since(engine: &mut Engine) -> Vec<u64> {
    engine
        .take_events()
        .into_iter()
        .flat_map(|batch| batch.events)
        .flat_map(|event| match event {
            EngineEvent::Removed { block_hashes, .. } => block_hashes,
            _ => Vec::new(),
        })
        .map(|h| h.0)
        .collect()
}

/// A child process killed when dropped.
#[derive(Debug)]
pub struct Process(pub std::process::Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port free now (the system's choice), never one handed out before in this test
/// process: tests run at once, and a port released here could otherwise be handed to two.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut given = GIVEN.lock().unwrap();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}
