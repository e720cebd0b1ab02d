//! The policies the demo compares: the router's own, configured, and Dynamo's selector.

use std::fmt;
use std::str::FromStr;

use kvroute_core::{Policy, RouterConfig};

/// A routing policy the demo runs the workload under.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DemoPolicy {
    /// kvroute's own cost, with its defaults.
    KvAware,
    /// kvroute's cost sampled by softmax at this temperature.
    KvAwareTemperature(f64),
    /// The best-matching worker when it holds at least 30% of the prompt and the fleet is
    /// balanced (spread ≤ 1,024 blocks or max ≤ 1.5 × min), else the least loaded: the core's
    /// [`Policy::CacheThreshold`], a rule after SGLang's `cache_aware` that reads the engines'
    /// caches and counts load in blocks (`sglang-cache-aware` is the peer's own rule).
    CacheThreshold,
    /// Bounded-load consistent hashing of the first 1,024 prompt tokens (64 blocks of 16),
    /// load factor 1.25.
    PrefixHash,
    /// The worker with the least active load.
    LeastLoaded,
    /// Workers in turn.
    RoundRobin,
    /// A uniformly random worker.
    Random,
    /// The less loaded of two random workers.
    PowerOfTwo,
    /// NVIDIA Dynamo's `DefaultWorkerSelector` (crate `dynamo-kv-router`) with its default
    /// configuration, fed the router's overlaps and loads.
    DynamoDefault,
    /// SGLang's router's `cache_aware` policy (`sglang-router` 0.3.2, its defaults), modelled
    /// on the prompts it sent to each worker, as the peer remembers them.
    SglangCacheAware,
}

impl DemoPolicy {
    /// Every policy, in the order of the report.
    pub const ALL: [DemoPolicy; 10] = [
        DemoPolicy::KvAware,
        DemoPolicy::KvAwareTemperature(0.5),
        DemoPolicy::DynamoDefault,
        DemoPolicy::SglangCacheAware,
        DemoPolicy::CacheThreshold,
        DemoPolicy::PrefixHash,
        DemoPolicy::LeastLoaded,
        DemoPolicy::PowerOfTwo,
        DemoPolicy::RoundRobin,
        DemoPolicy::Random,
    ];

    /// The policy's name in reports and on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            DemoPolicy::KvAware => "kv-aware",
            DemoPolicy::KvAwareTemperature(_) => "kv-aware-temp",
            DemoPolicy::CacheThreshold => "cache-threshold",
            DemoPolicy::PrefixHash => "prefix-hash",
            DemoPolicy::LeastLoaded => "least-loaded",
            DemoPolicy::RoundRobin => "round-robin",
            DemoPolicy::Random => "random",
            DemoPolicy::PowerOfTwo => "power-of-two",
            DemoPolicy::DynamoDefault => "dynamo-default",
            DemoPolicy::SglangCacheAware => "sglang-cache-aware",
        }
    }

    /// The router's configuration for this policy: `base` (its block size, and the cost's
    /// weights that the KV-aware policies use) with the policy's own settings. Dynamo's
    /// selector runs beside the router, which books its choice.
    pub fn router_config(&self, base: &RouterConfig) -> RouterConfig {
        let block_size = base.block_size;
        let mut config = base.clone();
        match *self {
            DemoPolicy::KvAware | DemoPolicy::DynamoDefault | DemoPolicy::SglangCacheAware => {}
            DemoPolicy::KvAwareTemperature(t) => config.temperature = t,
            DemoPolicy::CacheThreshold => {
                config.policy = Policy::CacheThreshold {
                    min_match_ratio: 0.3,
                    balance_abs: 1_024,
                    balance_rel: 1.5,
                }
            }
            DemoPolicy::PrefixHash => {
                config.policy = Policy::PrefixHash {
                    prefix_blocks: (1_024 / block_size.max(1)).max(1),
                    load_factor: 1.25,
                }
            }
            DemoPolicy::LeastLoaded => config.policy = Policy::LeastLoaded,
            DemoPolicy::RoundRobin => config.policy = Policy::RoundRobin,
            DemoPolicy::Random => config.policy = Policy::Random,
            DemoPolicy::PowerOfTwo => config.policy = Policy::PowerOfTwo,
        }
        config
    }
}

impl fmt::Display for DemoPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name the demo does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy {0:?}; the policies are {names}", names = names())]
pub struct UnknownPolicy(pub String);

fn names() -> String {
    DemoPolicy::ALL
        .iter()
        .map(|p| p.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl FromStr for DemoPolicy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DemoPolicy::ALL
            .iter()
            .copied()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}
