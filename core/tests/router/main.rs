//! The router's behaviour through its public API, one module per behaviour.

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

mod approx;
mod common;
mod conditions;
mod constraints;
mod health;
mod lifecycle;
mod pool;
mod queue;
mod replicas;
mod route;
mod sessions;
mod warm_up;
mod whole;
