//! The router's configuration: one struct, validated once. The defaults are the reference
//! router's but for the cost's two weights: `overlap_credit` 2 and `prefill_load_scale` 32
//! (the reference's are 1 and 1), measured on the simulated fleet to hit 0.91–0.92 of the
//! oracle's cache against 0.67–0.70 and cut mean TTFT by a quarter on a production trace, with
//! the load within 1.21 of even (`benches/RESULTS.md`, 2026-11-28); and `affinity`, which the
//! reference does not have: a rank holding most of a prompt earns more credit per block
//! (4–6% more cached tokens on the traces at the same mean TTFT, `docs/experiments.md` §8.6).
//! Lower tiers' credits (`tier_weights`) are absolute, not fractions of `overlap_credit`.
//!
//! Every knob that changes a decision lives here, so that a decision can be explained from the
//! request, the load snapshot and this value alone. [`RouterConfig::validate`] rejects a bad
//! value with an error naming the field; [`crate::router::Router::new`] refuses to start
//! without it.
//!
//! | field | default | meaning |
//! |---|---|---|
//! | `block_size` | 16 | tokens per KV block (the index's and the workers' block size) |
//! | `overlap_credit` | 2.0 | cost credit per device-tier cached block (reference: 1.0) |
//! | `prefill_load_scale` | 32.0 | weight of prefill blocks against decode blocks (reference: 1.0) |
//! | `tier_weights` | 0.75 / 0.25 / 0.25 | credit of host-pinned / disk / external blocks |
//! | `affinity` | from 0.7, boost 8 | a rank holding over `from_share` of the prompt's full blocks earns up to `1 + boost` times the credit per block (see [`Affinity`]) |
//! | `hot_load` | share 1.4, weight 16 | a rank's context (every active request's prompt and output blocks) past `share` times the fleet's mean, plus the request's blocks, costs `weight` per block (see [`HotLoad`]) |
//! | `temperature` | 0.0 | 0 = cheapest worker (random ties), > 0 = softmax sampling |
//! | `busy` | off | fractions of capacity over which a rank leaves selection |
//! | `request_expiry` | 600 s | bookings older than this are freed by [`crate::router::Router::expire`] |
//! | `min_workers` | 0 | workers that must join before the router is ready |
//! | `policy` | `KvAware` | how a worker is chosen (see [`Policy`]) |
//! | `seed` | fixed | seed of the router's random draws (ties, softmax, random policies) |
//! | `timing` | `Off` | record the hash / match / select overhead split in histograms |
//! | `metrics` | `Off` | record per-request TTFT, ITL, ISL, OSL and KV hit rate in histograms |
//! | `disaggregation` | `Optional` | prefill requests fall back to aggregated workers when no prefill worker exists |
//! | `session_idle_ttl` | 300 s | a sticky session idle this long (its last request ended) is dropped by [`crate::router::Router::expire_sessions`] |
//! | `approximate.ttl` | 120 s | how long a routing decision counts as cached blocks on a worker without KV events (see [`crate::approx`]) |
//! | `approximate.speculative` | `Off` | `On { ttl }`: workers with events also get a short-lived record of each decision until their events arrive |
//! | `approximate.max_records` | 2^20 | cap of the record table (checkpoint blocks) |
//! | `warm_up` | `Off` | `On { share, duration, low_share }`: a worker that joined less than `duration` ago, or whose reported cache is below `low_share` × the fleet's mean, takes `share` of the cache misses (the least loaded such worker) |
//! | `pool_credit` | 0.25 | credit per block found in a shared KV pool beyond a worker's own overlap (the external tier's weight) |
//! | `queue` | `Off` | with `On { max_queued_tokens, order }`, [`crate::router::Router::submit`] queues a request while every eligible rank is busy, up to a cap of queued prompt tokens (order default FCFS with priority jumps) |

use std::time::Duration;

/// Why a configuration was rejected.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ConfigError {
    /// A field holds a value outside its allowed range.
    #[error("config field `{field}` is invalid: {reason}")]
    Invalid {
        /// The field, as a path from [`RouterConfig`] (`"queue.max_queued_tokens"`).
        field: &'static str,
        /// What it must be (`"must be > 0"`).
        reason: &'static str,
    },
}

/// The near-tie share ([`RouterConfig::near_tie`]) replicas of one fleet default to.
pub const REPLICA_NEAR_TIE: f64 = 0.05;

/// The credit of a rank that holds most of a prompt grows with the share it holds: each cached
/// block's credit is multiplied by `1 + boost · max(0, share − from_share) / (1 − from_share)`,
/// where `share` is the rank's leading blocks held (any tier) over the prompt's full blocks.
///
/// The cost weighs one request's prefill against the load it adds now. A rank that holds
/// most of a prompt is where its conversation lives; sending the turn elsewhere copies the
/// conversation's cache to a second rank, and the next turns find it split. The cost does not
/// see those next turns; this does, for prompts mostly held and for nothing else, so the short
/// shared prefixes (a system prompt, a popular document) that draw new conversations onto
/// their holders keep their plain credit. `boost` 0 turns it off. Measured on the simulated
/// fleet in `docs/experiments.md` §8.6 and `benches/RESULTS.md` (2026-11-28, affinity).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Affinity {
    /// Share of the prompt's full blocks held past which the credit grows, in [0, 1).
    pub from_share: f64,
    /// Growth of the credit multiplier from `from_share` to the whole prompt held (≥ 0).
    pub boost: f64,
}

impl Affinity {
    /// No growth: every cached block earns its tier's credit.
    pub const OFF: Affinity = Affinity {
        from_share: 0.7,
        boost: 0.0,
    };
}

impl Default for Affinity {
    fn default() -> Self {
        Affinity {
            from_share: 0.7,
            boost: 8.0,
        }
    }
}

/// A rank running hot against the fleet pays for it: each block of its context (every active
/// request's prompt and output blocks, a shared prefix counted once per request, as each decode
/// reads its own) past `share` times the mean of the fleet's ranks of the request's role, plus
/// the request's own blocks, adds `weight` to its cost.
///
/// The overlap credit and the affinity grow with the prompt held while the decode term is in
/// blocks: on a large fleet, where one conversation's concurrent turns or one popular prefix
/// is a large part of one rank's fair share, the holder keeps winning until it runs far above
/// the others, and its decodes slow down. This follows the fleet's size and load on its own:
/// cheap moves (a new conversation whose prefix other ranks hold too) leave a hot rank first,
/// a long conversation's turn only once the excess outweighs its prefill elsewhere. `share` 0
/// turns it off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HotLoad {
    /// Multiple of the fleet's mean context past which a rank's context costs (0: off).
    pub share: f64,
    /// Cost per block of context past that (in the cost's units: blocks of decode load).
    pub weight: f64,
}

impl HotLoad {
    /// No cost for running hot.
    pub const OFF: HotLoad = HotLoad {
        share: 0.0,
        weight: 16.0,
    };
}

impl Default for HotLoad {
    fn default() -> Self {
        HotLoad {
            share: 1.4,
            weight: 16.0,
        }
    }
}

/// Overlap credit of a block held in a tier below device memory (device blocks earn
/// [`RouterConfig::overlap_credit`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierWeights {
    /// Credit of a block in host-pinned memory.
    pub host_pinned: f64,
    /// Credit of a block on local disk.
    pub disk: f64,
    /// Credit of a block in external storage.
    pub external: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights {
            host_pinned: 0.75,
            disk: 0.25,
            external: 0.25,
        }
    }
}

/// Load levels over which a rank is "busy" and leaves selection while some rank is under them.
/// `None` turns a threshold off.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct BusyThresholds {
    /// Active decode blocks (prompt and output) over this fraction of the rank's KV capacity.
    pub decode_blocks_fraction: Option<f64>,
    /// Active prefill tokens over this fraction of the worker's max batched tokens.
    pub prefill_tokens_fraction: Option<f64>,
}

/// How a worker is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Policy {
    /// The reference's cost function: prefill blocks after overlap credit plus decode blocks.
    #[default]
    KvAware,
    /// Ranks in turn.
    RoundRobin,
    /// A uniformly random rank.
    Random,
    /// The rank with the fewest active blocks and tokens (random ties).
    LeastLoaded,
    /// The less loaded of two random ranks.
    PowerOfTwo,
    /// Consistent hashing of the first `prefix_blocks` blocks onto a ring of ranks, skipping a
    /// rank whose load exceeds `load_factor` times the mean (bounded-load consistent hashing).
    PrefixHash {
        /// Blocks at the prompt's start that are hashed onto the ring (> 0).
        prefix_blocks: u32,
        /// A rank loaded over `load_factor` × (mean load + 1) blocks is skipped (≥ 1).
        load_factor: f64,
    },
    /// The best-matching rank when its match ratio is at least `min_match_ratio` and the fleet
    /// is balanced (max load - min load ≤ `balance_abs` blocks, or max ≤ `balance_rel` × min);
    /// otherwise the least-loaded rank.
    CacheThreshold {
        /// Least share of the prompt's blocks the best-matching rank must hold, in [0, 1].
        min_match_ratio: f64,
        /// Spread between the highest and lowest load, in blocks, at or under which the fleet
        /// counts as balanced.
        balance_abs: u64,
        /// Ratio of the highest load to the lowest at or under which the fleet counts as balanced
        /// (≥ 1).
        balance_rel: f64,
    },
}

/// Whether decisions record their overhead split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Timing {
    /// No clock reads on the route path.
    #[default]
    Off,
    /// Hash, match and select times go into histograms ([`crate::router::Router::timings`]).
    On,
}

/// Whether requests that reach a worker record their metrics
/// ([`crate::router::Router::request_metrics`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Metrics {
    /// No clock reads beyond the booking's own timestamp; nothing recorded.
    #[default]
    Off,
    /// TTFT and ITL are timed at the lifecycle calls (one clock read each); ISL, OSL and the
    /// KV hit rate are recorded when the request ends.
    On,
}

/// What a prefill-phase request does when no prefill worker has joined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Disaggregation {
    /// Fall back to aggregated workers (the reference's default), reported in the decision.
    #[default]
    Optional,
    /// Never: the request fails with [`crate::router::RouteError::NoWorkers`].
    Enforced,
}

/// The order of the admission queue within a priority class (see the `queue` module).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QueueOrder {
    /// Arrival time minus priority jump, earliest first: best for tail TTFT.
    #[default]
    Fcfs,
    /// Weighted shortest processing time, `(1 + priority jump) / new prefill tokens`, largest
    /// first: best for mean TTFT.
    Wspt,
}

/// Whether requests wait when every eligible rank is busy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Queueing {
    /// Never: a request goes to the least loaded busy rank (`route` always does this).
    #[default]
    Off,
    /// [`crate::router::Router::submit`] queues the request; past `max_queued_tokens` prompt
    /// tokens waiting it is rejected with [`crate::router::RouteError::ResourceExhausted`].
    /// Needs a busy threshold to have any effect.
    On {
        /// Cap on the prompt tokens of the requests waiting (> 0).
        max_queued_tokens: u64,
        /// The order within a priority class.
        order: QueueOrder,
    },
}

/// Speculative records for workers that publish KV events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Speculative {
    /// No speculative records: a worker with KV events is known from its events alone.
    #[default]
    Off,
    /// Each booked decision counts as cached on its rank for `ttl` (a second or two: until
    /// the worker's own events arrive).
    On {
        /// How long a speculative record lasts.
        ttl: Duration,
    },
}

/// Routing decisions recorded as cached blocks (see the `approx` module).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Approximate {
    /// Lifetime of a record on a worker without KV events.
    pub ttl: Duration,
    /// Records on workers with KV events.
    pub speculative: Speculative,
    /// Most records held.
    pub max_records: usize,
}

impl Default for Approximate {
    fn default() -> Self {
        Approximate {
            ttl: Duration::from_secs(120),
            speculative: Speculative::Off,
            max_records: 1 << 20,
        }
    }
}

/// Warm-up of workers with an empty (or nearly empty) cache.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum WarmUp {
    /// No warm-up: every worker is chosen by the policy alone.
    #[default]
    Off,
    /// Workers that joined recently, or whose cache is nearly empty, take a share of the cache
    /// misses.
    On {
        /// Fraction of cache-miss requests (no candidate holds a block) sent to a warming
        /// worker, in (0, 1].
        share: f64,
        /// How long a worker warms after joining (or after falling below `low_share`).
        duration: Duration,
        /// A worker whose reported device blocks are below this fraction of the fleet's mean
        /// warms again, in [0, 1) (0: only joins warm).
        low_share: f64,
    },
}

/// What decays with a request's expected output length, as generation proceeds.
///
/// With an expected output length `E`, at each output block a request's weight is what is left
/// of its output, `r = max(0, 1 − generated / max(E, 1))`; its output blocks always weigh `r`.
/// This chooses whether its unshared prompt blocks weigh `r` too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PromptDecay {
    /// The reference router's behaviour: at each output block, the request's prompt blocks
    /// that no other active request on its rank holds (the end of its prompt past what it
    /// shares, and its partial last block) weigh `r` in the decode load, as its output
    /// blocks do. Shared prompt blocks always weigh 1. The unshared count is taken at each
    /// output block and kept until the next one (or the free).
    #[default]
    Unshared,
    /// Only output blocks decay; prompt blocks weigh 1 until the request is freed.
    Off,
}

/// The router's configuration. Build it with struct update syntax over `Default`.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// Cost credit per cached device block.
    pub overlap_credit: f64,
    /// Weight of prefill blocks in the cost.
    pub prefill_load_scale: f64,
    /// Credit of blocks in lower tiers.
    pub tier_weights: TierWeights,
    /// Growth of the credit of a rank holding most of the prompt.
    pub affinity: Affinity,
    /// Cost of a rank's context far above the fleet's mean.
    pub hot_load: HotLoad,
    /// Softmax temperature; 0 picks the cheapest.
    pub temperature: f64,
    /// Near-ties (with temperature 0): the choice is drawn at random among the candidates
    /// whose cost is within this share of the cheapest's (0: the cheapest, exact ties at
    /// random). Replicas of one fleet, which route at the same moment without each other's
    /// newest bookings, set it so that they spread their choices instead of herding. Every
    /// rank is then scored (no pruning).
    pub near_tie: f64,
    /// Busy thresholds.
    pub busy: BusyThresholds,
    /// Age after which a request that never ended is freed by `expire`.
    pub request_expiry: Duration,
    /// Workers that must have joined before the router is ready.
    pub min_workers: usize,
    /// Selection policy.
    pub policy: Policy,
    /// Seed of the router's random draws.
    pub seed: u64,
    /// Overhead timing.
    pub timing: Timing,
    /// Per-request metrics.
    pub metrics: Metrics,
    /// Prefill → aggregated fallback.
    pub disaggregation: Disaggregation,
    /// Admission queue.
    pub queue: Queueing,
    /// Idle time after which a sticky session expires.
    pub session_idle_ttl: Duration,
    /// Approximate mode and speculative records.
    pub approximate: Approximate,
    /// Warm-up of new and nearly empty workers.
    pub warm_up: WarmUp,
    /// Credit per shared-pool block beyond a worker's own overlap.
    pub pool_credit: f64,
    /// Whether a request's unshared prompt blocks decay with its expected output length, as
    /// its output blocks do.
    pub prompt_decay: PromptDecay,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            block_size: 16,
            overlap_credit: 2.0,
            prefill_load_scale: 32.0,
            tier_weights: TierWeights::default(),
            affinity: Affinity::default(),
            hot_load: HotLoad::default(),
            temperature: 0.0,
            near_tie: 0.0,
            busy: BusyThresholds::default(),
            request_expiry: Duration::from_secs(600),
            min_workers: 0,
            policy: Policy::KvAware,
            seed: 0x6b76_726f_7574_6521,
            timing: Timing::Off,
            metrics: Metrics::Off,
            disaggregation: Disaggregation::Optional,
            queue: Queueing::Off,
            session_idle_ttl: Duration::from_secs(300),
            approximate: Approximate::default(),
            warm_up: WarmUp::Off,
            pool_credit: 0.25,
            prompt_decay: PromptDecay::Unshared,
        }
    }
}

fn non_negative(field: &'static str, x: f64) -> Result<(), ConfigError> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            field,
            reason: "must be a finite number ≥ 0",
        })
    }
}

fn fraction(field: &'static str, x: Option<f64>) -> Result<(), ConfigError> {
    match x {
        Some(x) if !(x.is_finite() && x > 0.0) => Err(ConfigError::Invalid {
            field,
            reason: "must be a finite number > 0",
        }),
        _ => Ok(()),
    }
}

impl RouterConfig {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(ConfigError::Invalid {
                field: "block_size",
                reason: "must be > 0",
            });
        }
        non_negative("overlap_credit", self.overlap_credit)?;
        non_negative("prefill_load_scale", self.prefill_load_scale)?;
        non_negative("tier_weights.host_pinned", self.tier_weights.host_pinned)?;
        non_negative("tier_weights.disk", self.tier_weights.disk)?;
        non_negative("tier_weights.external", self.tier_weights.external)?;
        non_negative("temperature", self.temperature)?;
        non_negative("near_tie", self.near_tie)?;
        if self.near_tie > 1.0 {
            return Err(ConfigError::Invalid {
                field: "near_tie",
                reason: "must be at most 1 (a share of the cheapest cost)",
            });
        }
        non_negative("pool_credit", self.pool_credit)?;
        non_negative("affinity.boost", self.affinity.boost)?;
        non_negative("hot_load.share", self.hot_load.share)?;
        non_negative("hot_load.weight", self.hot_load.weight)?;
        if !(0.0..1.0).contains(&self.affinity.from_share) {
            return Err(ConfigError::Invalid {
                field: "affinity.from_share",
                reason: "must be in [0, 1)",
            });
        }
        fraction(
            "busy.decode_blocks_fraction",
            self.busy.decode_blocks_fraction,
        )?;
        fraction(
            "busy.prefill_tokens_fraction",
            self.busy.prefill_tokens_fraction,
        )?;
        if self.request_expiry.is_zero() {
            return Err(ConfigError::Invalid {
                field: "request_expiry",
                reason: "must be > 0",
            });
        }
        match self.policy {
            Policy::PrefixHash {
                prefix_blocks,
                load_factor,
            } => {
                if prefix_blocks == 0 {
                    return Err(ConfigError::Invalid {
                        field: "policy.prefix_blocks",
                        reason: "must be > 0",
                    });
                }
                if !(load_factor.is_finite() && load_factor >= 1.0) {
                    return Err(ConfigError::Invalid {
                        field: "policy.load_factor",
                        reason: "must be a finite number ≥ 1",
                    });
                }
            }
            Policy::CacheThreshold {
                min_match_ratio,
                balance_rel,
                ..
            } => {
                if !(0.0..=1.0).contains(&min_match_ratio) {
                    return Err(ConfigError::Invalid {
                        field: "policy.min_match_ratio",
                        reason: "must be in [0, 1]",
                    });
                }
                if !(balance_rel.is_finite() && balance_rel >= 1.0) {
                    return Err(ConfigError::Invalid {
                        field: "policy.balance_rel",
                        reason: "must be a finite number ≥ 1",
                    });
                }
            }
            _ => {}
        }
        if self.session_idle_ttl.is_zero() {
            return Err(ConfigError::Invalid {
                field: "session_idle_ttl",
                reason: "must be > 0",
            });
        }
        if self.approximate.ttl.is_zero() {
            return Err(ConfigError::Invalid {
                field: "approximate.ttl",
                reason: "must be > 0",
            });
        }
        if self.approximate.speculative
            == (Speculative::On {
                ttl: Duration::ZERO,
            })
        {
            return Err(ConfigError::Invalid {
                field: "approximate.speculative.ttl",
                reason: "must be > 0",
            });
        }
        if self.approximate.max_records == 0 {
            return Err(ConfigError::Invalid {
                field: "approximate.max_records",
                reason: "must be > 0",
            });
        }
        if let WarmUp::On {
            share,
            duration,
            low_share,
        } = self.warm_up
        {
            if !(share > 0.0 && share <= 1.0) {
                return Err(ConfigError::Invalid {
                    field: "warm_up.share",
                    reason: "must be in (0, 1]",
                });
            }
            if duration.is_zero() {
                return Err(ConfigError::Invalid {
                    field: "warm_up.duration",
                    reason: "must be > 0",
                });
            }
            if !(0.0..1.0).contains(&low_share) {
                return Err(ConfigError::Invalid {
                    field: "warm_up.low_share",
                    reason: "must be in [0, 1)",
                });
            }
        }
        if let Queueing::On {
            max_queued_tokens: 0,
            ..
        } = self.queue
        {
            return Err(ConfigError::Invalid {
                field: "queue.max_queued_tokens",
                reason: "must be > 0",
            });
        }
        Ok(())
    }

    /// The overlap credit of one block in each tier, in [`crate::StorageTier::ALL`] order.
    pub fn tier_credits(&self) -> [f64; crate::StorageTier::COUNT] {
        [
            self.overlap_credit,
            self.tier_weights.host_pinned,
            self.tier_weights.disk,
            self.tier_weights.external,
        ]
    }
}

#[cfg(test)]
mod tests;
