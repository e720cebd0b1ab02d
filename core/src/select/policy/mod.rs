//! The selection policies behind one trait ([`Selector`]): the KV-aware cost and the baselines,
//! one file each, with the random draws they share. An embedder's own policy implements the
//! same trait ([`crate::Router::with_selector`]).
//!
//! | file | policy |
//! |---|---|
//! | `kv_aware.rs` | [`Policy::KvAware`]: the cost's argmin, or a softmax sample |
//! | `round_robin.rs`, `random.rs`, `least_loaded.rs`, `power_of_two.rs` | the baselines |
//! | `prefix_hash.rs` | [`Policy::PrefixHash`]: bounded-load consistent hashing |
//! | `cache_threshold.rs` | [`Policy::CacheThreshold`]: SGLang's `cache_aware` rule |

mod cache_threshold;
mod kv_aware;
mod least_loaded;
mod power_of_two;
mod prefix_hash;
mod random;
mod round_robin;

use super::candidate::Scored;
use super::cost::RequestShape;
use crate::config::Policy;
use crate::registry::RankEntry;
use crate::rng::Rng;
use std::fmt;

pub(crate) use self::cache_threshold::CacheThreshold;
pub(crate) use self::kv_aware::KvAware;
pub(crate) use self::least_loaded::LeastLoaded;
pub(crate) use self::power_of_two::PowerOfTwo;
pub(crate) use self::prefix_hash::PrefixHash;
pub(crate) use self::random::RandomPick;
pub(crate) use self::round_robin::RoundRobin;

/// The built-in policies, as named in decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// [`Policy::KvAware`].
    KvAware,
    /// [`Policy::RoundRobin`].
    RoundRobin,
    /// [`Policy::Random`].
    Random,
    /// [`Policy::LeastLoaded`].
    LeastLoaded,
    /// [`Policy::PowerOfTwo`].
    PowerOfTwo,
    /// [`Policy::PrefixHash`].
    PrefixHash,
    /// [`Policy::CacheThreshold`].
    CacheThreshold,
    /// An embedder's own [`Selector`] ([`Router::with_selector`](crate::Router::with_selector)):
    /// not a name users type.
    Custom,
}

impl PolicyKind {
    /// Every built-in policy, in the order users see them listed.
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::KvAware,
        PolicyKind::CacheThreshold,
        PolicyKind::PrefixHash,
        PolicyKind::LeastLoaded,
        PolicyKind::PowerOfTwo,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
    ];

    /// The policy's name, as users type it (serve's `policy` key, the demo's `--policies`) and
    /// as reports print it. Names are parsed here and nowhere else.
    pub const fn name(self) -> &'static str {
        match self {
            PolicyKind::KvAware => "kv-aware",
            PolicyKind::CacheThreshold => "cache-threshold",
            PolicyKind::PrefixHash => "prefix-hash",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::PowerOfTwo => "power-of-two",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::Custom => "custom",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that names no built-in policy.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy {name:?}; the policies are {known}", known = known_names())]
pub struct UnknownPolicy {
    /// The name given.
    pub name: String,
}

fn known_names() -> String {
    let names: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.name()).collect();
    names.join(", ")
}

impl std::str::FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownPolicy { name: s.to_owned() })
    }
}

impl Policy {
    /// Which built-in policy this is.
    pub const fn kind(&self) -> PolicyKind {
        match self {
            Policy::KvAware => PolicyKind::KvAware,
            Policy::RoundRobin => PolicyKind::RoundRobin,
            Policy::Random => PolicyKind::Random,
            Policy::LeastLoaded => PolicyKind::LeastLoaded,
            Policy::PowerOfTwo => PolicyKind::PowerOfTwo,
            Policy::PrefixHash { .. } => PolicyKind::PrefixHash,
            Policy::CacheThreshold { .. } => PolicyKind::CacheThreshold,
        }
    }

    /// The policy of `kind` with its default parameters, for blocks of `block_size` tokens:
    /// prefix hashing over the prompt's first 1,024 tokens with load factor 1.25; the cache
    /// threshold at 30% of the prompt, balanced within 1,024 blocks or 1.5× (SGLang's
    /// `cache_aware` defaults).
    pub fn with_defaults(kind: PolicyKind, block_size: u32) -> Policy {
        match kind {
            PolicyKind::KvAware => Policy::KvAware,
            PolicyKind::RoundRobin => Policy::RoundRobin,
            PolicyKind::Random => Policy::Random,
            PolicyKind::LeastLoaded => Policy::LeastLoaded,
            PolicyKind::PowerOfTwo => Policy::PowerOfTwo,
            PolicyKind::PrefixHash => Policy::PrefixHash {
                prefix_blocks: (1_024 / block_size.max(1)).max(1),
                load_factor: 1.25,
            },
            PolicyKind::CacheThreshold => Policy::CacheThreshold {
                min_match_ratio: 0.3,
                balance_abs: 1_024,
                balance_rel: 1.5,
            },
            // A custom selector is set on the router; its configured policy stays the default.
            PolicyKind::Custom => Policy::KvAware,
        }
    }
}

/// What a selector sees: the candidates the router kept for the request (its health, busy and
/// label vetoes already applied), each with its overlap, load and cost.
#[derive(Clone, Copy, Debug)]
pub struct SelectInput<'a> {
    /// The candidates; never empty.
    pub candidates: &'a [Scored],
    /// The fleet snapshot's ranks, which [`Scored::fleet_index`] points into (a rank's
    /// worker, role, labels and live load state).
    pub ranks: &'a [RankEntry],
    /// The request's prompt: tokens, blocks, and a key of its first blocks.
    pub shape: &'a RequestShape,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The configured softmax temperature (0: none), for selectors that sample.
    pub temperature: f64,
    /// The configured near-tie share (0: none): a cheapest-cost selector draws among the
    /// candidates within it of the cheapest ([`crate::RouterConfig::near_tie`]).
    pub near_tie: f64,
}

/// A selection policy: given the candidates, which one serves the request. The built-in
/// policies implement it, one type each; an embedder adds its own with
/// [`Router::with_selector`](crate::Router::with_selector), without forking the router.
///
/// A selector runs on every decision, on the caller's thread: it must be cheap, allocation-free
/// and free of side effects other than its own counters (booking the chosen rank is the
/// router's job). Draw randomness from `rng` only, so that a seeded router stays reproducible.
pub trait Selector: Send + Sync + fmt::Debug {
    /// Which built-in policy this is; [`PolicyKind::Custom`] for an embedder's own. The
    /// router probes shared prompt blocks for the KV-aware cost only.
    fn kind(&self) -> PolicyKind {
        PolicyKind::Custom
    }
    /// The index in `input.candidates` of the chosen candidate (`input.candidates` is not
    /// empty; an index out of range is taken as the first candidate).
    fn select(&self, input: &SelectInput<'_>, rng: &mut Rng) -> usize;
}

/// The selector for a configured policy.
pub(crate) fn selector_for(policy: Policy) -> Box<dyn Selector> {
    match policy {
        Policy::KvAware => Box::new(KvAware),
        Policy::RoundRobin => Box::new(RoundRobin::default()),
        Policy::Random => Box::new(RandomPick),
        Policy::LeastLoaded => Box::new(LeastLoaded),
        Policy::PowerOfTwo => Box::new(PowerOfTwo),
        Policy::PrefixHash {
            prefix_blocks: _,
            load_factor,
        } => Box::new(PrefixHash { load_factor }),
        Policy::CacheThreshold {
            min_match_ratio,
            balance_abs,
            balance_rel,
        } => Box::new(CacheThreshold {
            min_match_ratio,
            balance_abs,
            balance_rel,
        }),
    }
}

/// Index of the smallest `key`, ties broken uniformly at random (reservoir sampling).
pub(crate) fn argmin_random_ties<T>(items: &[T], rng: &mut Rng, key: impl Fn(&T) -> f64) -> usize {
    let mut best = 0;
    let mut best_key = f64::INFINITY;
    let mut ties = 0u64;
    for (i, item) in items.iter().enumerate() {
        let k = key(item);
        if k < best_key {
            best = i;
            best_key = k;
            ties = 1;
        } else if k == best_key {
            ties += 1;
            if rng.below(ties) == 0 {
                best = i;
            }
        }
    }
    best
}

/// The index of a random item among those whose key is within `share` of the least key
/// (`share · max(|least|, 1)` above it), each equally likely. Two passes, no allocation.
pub(crate) fn near_min_random<T>(
    items: &[T],
    share: f64,
    rng: &mut Rng,
    key: impl Fn(&T) -> f64,
) -> usize {
    let least = items.iter().map(&key).fold(f64::INFINITY, f64::min);
    let bar = least + share * least.abs().max(1.0);
    let (mut chosen, mut seen) = (0, 0u64);
    for (i, item) in items.iter().enumerate() {
        if key(item) <= bar {
            seen += 1;
            if rng.below(seen) == 0 {
                chosen = i;
            }
        }
    }
    chosen
}

/// Samples an index with probability ∝ exp(−normalised cost / temperature), costs normalised
/// to [0, 1] over the candidates (uniform when all are equal). Two passes, no allocation.
pub(crate) fn softmax_sample<T>(
    items: &[T],
    temperature: f64,
    rng: &mut Rng,
    cost: impl Fn(&T) -> f64,
) -> usize {
    let (lo, hi) = items
        .iter()
        .map(&cost)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), c| {
            (lo.min(c), hi.max(c))
        });
    let range = hi - lo;
    if !(range.is_finite() && range > 0.0) {
        return rng.below(items.len() as u64) as usize;
    }
    let weight = |c: f64| (-((c - lo) / range) / temperature).exp();
    let total: f64 = items.iter().map(|x| weight(cost(x))).sum();
    let mut target = rng.unit_f64() * total;
    for (i, x) in items.iter().enumerate() {
        target -= weight(cost(x));
        if target < 0.0 {
            return i;
        }
    }
    items.len() - 1
}
