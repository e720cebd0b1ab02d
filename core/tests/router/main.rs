//! The router's behaviour through its public API, one module per behaviour.

mod approx;
mod common;
mod conditions;
mod constraints;
mod health;
mod lifecycle;
mod pool;
mod queue;
mod route;
mod sessions;
mod warm_up;
