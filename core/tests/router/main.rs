//! The router's behaviour through its public API, one module per behaviour.

mod approx;
mod common;
mod constraints;
mod health;
mod pool;
mod queue;
mod route;
mod sessions;
mod warm_up;
