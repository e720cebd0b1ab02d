//! The library behind the `kvroute` program: the commands that only the lab needs, kept as a
//! library so that they are tested through their own API. The gateway (`kvroute serve`) is the
//! crate `kvroute-serve`; the simulated engine and the workloads are `kvroute-sim`; the chat
//! template and tokenizer are `kvroute-text`. Only this crate links the lab's dependencies
//! (plots, progress bars, Dynamo's selector for the demo).
//!
//! Modules:
//!
//! * [`demo`]: `kvroute demo`, a workload through a simulated fleet once per policy.
//! * [`plot`]: runs compared in one SVG picture (the demo's policies, replays side by side).
//! * [`replay`]: `kvroute replay`, a workload sent to a live router over HTTP, and its figures.
//! * [`worker`]: `kvroute worker`, the simulated engine live behind vLLM's interfaces.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod demo;
pub mod plot;
pub mod replay;
pub mod worker;
