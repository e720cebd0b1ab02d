//! The policies the demo compares: the router's own, configured, and Dynamo's selector.

use std::fmt;
use std::str::FromStr;

use kvroute_core::{Policy, PolicyKind, RouterConfig};

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

    /// The router's policy this runs, for the policies that are the router's own.
    pub fn router_policy(&self) -> Option<PolicyKind> {
        match self {
            DemoPolicy::KvAware | DemoPolicy::KvAwareTemperature(_) => Some(PolicyKind::KvAware),
            DemoPolicy::CacheThreshold => Some(PolicyKind::CacheThreshold),
            DemoPolicy::PrefixHash => Some(PolicyKind::PrefixHash),
            DemoPolicy::LeastLoaded => Some(PolicyKind::LeastLoaded),
            DemoPolicy::RoundRobin => Some(PolicyKind::RoundRobin),
            DemoPolicy::Random => Some(PolicyKind::Random),
            DemoPolicy::PowerOfTwo => Some(PolicyKind::PowerOfTwo),
            DemoPolicy::DynamoDefault | DemoPolicy::SglangCacheAware => None,
        }
    }

    /// The policy's name in reports and on the command line: the core's name for the router's
    /// own policies ([`PolicyKind::name`]).
    pub fn name(&self) -> &'static str {
        match self {
            DemoPolicy::KvAwareTemperature(_) => "kv-aware-temp",
            DemoPolicy::DynamoDefault => "dynamo-default",
            DemoPolicy::SglangCacheAware => "sglang-cache-aware",
            other => other.router_policy().map_or("", PolicyKind::name),
        }
    }

    /// The router's configuration for this policy: `base` (its block size, and the cost's
    /// weights that the KV-aware policies use) with the policy's own settings, the core's
    /// defaults ([`Policy::with_defaults`]). Dynamo's selector and SGLang's rule run beside the
    /// router, which books their choices.
    pub fn router_config(&self, base: &RouterConfig) -> RouterConfig {
        let mut config = base.clone();
        if let DemoPolicy::KvAwareTemperature(t) = *self {
            config.temperature = t;
        }
        if let Some(kind) = self.router_policy() {
            config.policy = Policy::with_defaults(kind, base.block_size);
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
