//! kvroute's transport: the wire protocol between frontends and GPU workers and the
//! shard-per-core I/O loops that drive the core. It depends on `kvroute-core` and nothing here
//! is needed by the core itself.
#![forbid(unsafe_code)]

pub use kvroute_core as core;
