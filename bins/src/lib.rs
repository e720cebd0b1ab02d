//! The library behind the `kvroute` programs: what the binary wires together, kept as a library
//! so that its pieces are tested through their own API and reused between programs (the
//! simulated worker serves the same engine model live that the demo runs on a virtual clock).
//!
//! Modules:
//!
//! * [`plot`]: runs compared in one SVG picture (the demo's policies, replays side by side).
//! * [`replay`]: `kvroute replay`, a workload sent to a live router over HTTP, and its figures.
//! * [`serve`]: `kvroute serve`, the router in front of OpenAI-compatible engines, fed by their
//!   ZeroMQ KV events.
//! * [`sim`]: the simulated GPU engine, an I/O-free model of vLLM's scheduler, block pool, KV
//!   events and pass timing, driven by calls.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod chat;
pub mod demo;
pub mod plot;
pub mod replay;
pub mod serve;
pub mod sim;
pub mod worker;
pub mod workload;
