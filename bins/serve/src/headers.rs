//! The HTTP header names the gateway reads and sets, in one place: clients (and `kvroute
//! replay`) read the `x-kvroute-*` answers; engines read the data-parallel rank.

/// The worker that served the request (its id), set on every routed answer.
pub const WORKER: &str = "x-kvroute-worker";
/// The prompt tokens the router predicted the chosen worker holds.
pub const PREDICTED_CACHED_TOKENS: &str = "x-kvroute-predicted-cached-tokens";
/// How long the routing decision took, in microseconds (absent when the request waited in the
/// admission queue).
pub const DECISION_US: &str = "x-kvroute-decision-us";
/// How long the gateway took to read the request's routing fields and tokenize its prompt, µs.
pub const PROMPT_READ_US: &str = "x-kvroute-prompt-read-us";
/// Sends a request to one data-parallel rank of an engine (vLLM's and SGLang's name).
pub const DATA_PARALLEL_RANK: &str = "x-data-parallel-rank";
