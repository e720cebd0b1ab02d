//! The simulated GPU engine: an I/O-free model of vLLM V1's scheduler, its block pool and
//! prefix cache, the KV events it publishes and how long its passes take.
//!
//! ```text
//!  admit(request) ──▶ waiting ──▶ step(): one pass ──▶ outputs (tokens, first token, finish,
//!                                   │                           cached prompt tokens)
//!                                   ├─▶ events (Stored / Removed / AllBlocksCleared)
//!                                   └─▶ its duration: the clock moves by it
//! ```
//!
//! Nothing here does I/O, starts threads or reads the system clock: the engine's time is a
//! number that passes move. `kvroute worker` drives it live (a pass, then sleep its
//! duration); `kvroute demo` drives a fleet of them on one virtual clock.
//!
//! Module map:
//!
//! * `engine.rs`: [`Engine`], the facade: admit, abort, step, advance, outputs, events,
//!   fault hooks, stats.
//! * `scheduler.rs`: one pass of the scheduler: running first, then admissions, preemption.
//! * `blocks.rs`: the block pool: reference counts, the prefix cache by chained hash, idle
//!   blocks evicted least recently used, leaves first.
//! * `request.rs`: [`EngineRequest`], [`RequestOutput`], and a request's state inside.
//! * `events.rs`: [`EngineEvent`] and its conversion to the router's [`kvroute_core::KvEvent`].
//! * `timing.rs`: pass duration models ([`TimingModel`]) and their sources.
//! * `config.rs`: [`EngineConfig`]; `error.rs`: [`SimError`].
//! * `fleet/`: [`Fleet`], engines and the core's router on one virtual clock (the demo's
//!   discrete-event loop), with its per-request records and [`FleetReport`]; split into
//!   prefill and decode engines (`disagg.rs`), or routed by several routers ([`Replicas`],
//!   `replicas.rs`).
//! * `tests.rs`: unit tests of the pool and the timing models; behaviour tests are in
//!   `bins/kvroute/tests/sim/`.
//! * `workload/`: the workloads the demo and replay send: the built-in chat workload and
//!   Mooncake-format traces.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod blocks;
mod config;
mod engine;
mod error;
mod events;
mod fleet;
mod request;
mod scheduler;
mod timing;
mod transfer;
pub mod workload;

#[cfg(test)]
mod tests;

pub use blocks::PoolCounts;
pub use config::EngineConfig;
pub use engine::{ClearMode, Engine, EngineStats, Occupancy, Pass};
pub use error::SimError;
pub use events::{EngineBlockHash, EngineEvent, EventBatch, Medium};
pub use fleet::{
    Arrival, BookingSync, Fleet, FleetConfig, FleetError, FleetReport, LoadSeries, Picker,
    Replicas, RequestRecord, Split,
};
pub use kvroute_core::RequestId;
pub use request::{EngineRequest, Finish, RequestOutput};
pub use scheduler::Admission;
pub use timing::{Calibration, LinearFit, PassShape, TimingError, TimingModel};
pub use transfer::KvTransfer;
