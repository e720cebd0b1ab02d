//! The worker registry: which workers exist, how they are configured, and each rank's load
//! state, published as one immutable snapshot.
//!
//! ```text
//!   join / leave (rare, serialised) ──build──▶ Fleet { workers (by id), ranks (by rank) }
//!                                                  │ ArcSwap::store
//!   route (any thread) ◀──── ArcSwap::load ────────┘  one snapshot = one consistent view
//! ```
//!
//! A [`Fleet`] lists workers sorted by id and ranks sorted by (worker, dp rank); each rank
//! carries its [`RankState`] (`Arc`) and its worker's role, so selection walks one flat array
//! and reads load counters with no lookup. A small open-addressing table built with the
//! snapshot ([`RankLookup`]) maps a rank to its place in that array in one probe or two, so the
//! index's scores land on their ranks without a search per score.
//!
//! Worker labels (`zone=a`, `gpu=h100`) are interned per snapshot: every distinct label gets a
//! bit (at most [`MAX_LABELS`] in a fleet) and each rank carries its worker's label bits, so a
//! request's required labels become one mask test per rank. Ranks keep their `RankState` across snapshots; a leaving worker's states are
//! retired before the snapshot without them is published, so in-flight bookings against the old
//! snapshot notice (see [`crate::load`]).

use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::event::{DpRank, WorkerId, WorkerRank};
use crate::index::RankKey;
use crate::load::{context_total, ContextTotal, RankState};
use crate::rng::mix64;

/// What a worker does in (possibly disaggregated) serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WorkerRole {
    /// Computes prompts only, then hands the KV cache to a decode worker.
    Prefill,
    /// Generates only, from KV cache handed over by a prefill worker.
    Decode,
    /// Does both.
    #[default]
    Aggregated,
}

/// Whether a worker publishes KV events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum KvEvents {
    /// It does: the index knows its cache.
    #[default]
    Published,
    /// It does not: the router records its own decisions as the worker's cache, with a TTL
    /// (approximate mode; see the `approx` module).
    Absent,
}

/// A worker's configuration, as it announces itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerConfig {
    /// The worker's id, unique in the fleet.
    pub id: WorkerId,
    /// First data-parallel rank.
    pub dp_start: u32,
    /// Number of data-parallel ranks (≥ 1).
    pub dp_size: u32,
    /// KV cache capacity of each rank, in blocks (≥ 1).
    pub kv_blocks: u64,
    /// Tokens per KV block; must equal the router's.
    pub block_size: u32,
    /// What it does in (possibly disaggregated) serving.
    pub role: WorkerRole,
    /// Most tokens the engine batches in one step (≥ 1).
    pub max_batched_tokens: u64,
    /// Free-form labels (zone, GPU type, ...), for routing constraints.
    pub labels: Vec<(String, String)>,
    /// Whether it publishes KV events.
    pub kv_events: KvEvents,
}

impl WorkerConfig {
    /// A single-rank aggregated worker with the given capacity: the common case in tests.
    pub fn simple(id: u64, kv_blocks: u64, block_size: u32) -> Self {
        WorkerConfig {
            id: WorkerId(id),
            dp_start: 0,
            dp_size: 1,
            kv_blocks,
            block_size,
            role: WorkerRole::Aggregated,
            max_batched_tokens: 8192,
            labels: Vec::new(),
            kv_events: KvEvents::Published,
        }
    }
}

/// Why a join or leave was rejected.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum RegistryError {
    /// A worker with this id has already joined.
    #[error("worker {worker:?} has already joined")]
    WorkerExists {
        /// The worker's id.
        worker: WorkerId,
    },
    /// No worker with this id has joined.
    #[error("unknown worker {worker:?}")]
    UnknownWorker {
        /// The worker's id.
        worker: WorkerId,
    },
    /// The worker's labels would take the fleet past the labels a request can test at once.
    #[error("worker {worker:?} would bring the fleet past {limit} distinct labels")]
    TooManyLabels {
        /// The worker joining.
        worker: WorkerId,
        /// Most distinct labels in a fleet (64: one bit each).
        limit: usize,
    },
    /// A field of the worker's config has a value the router cannot use.
    #[error("worker {worker:?} config field `{field}` is invalid: {reason}")]
    InvalidWorker {
        /// The worker joining.
        worker: WorkerId,
        /// The field of [`WorkerConfig`] (`"dp_size"`).
        field: &'static str,
        /// What it must be (`"must be ≥ 1"`).
        reason: &'static str,
    },
}

/// One worker in a snapshot.
#[derive(Debug)]
pub struct WorkerEntry {
    /// Its configuration, as it joined.
    pub config: WorkerConfig,
    /// Its ranks: a range of [`Fleet::ranks`].
    pub ranks: std::ops::Range<usize>,
    /// Its labels, as bits of [`Fleet::labels`].
    pub label_bits: u64,
}

/// One rank in a snapshot.
#[derive(Debug, Clone)]
pub struct RankEntry {
    /// The rank.
    pub rank: WorkerRank,
    /// Index of its worker in [`Fleet::workers`].
    pub worker: usize,
    /// Its worker's role (copied here so that selection need not visit the worker).
    pub role: WorkerRole,
    /// Its worker's label bits (copied likewise).
    pub label_bits: u64,
    /// Its key in the prefix index, as registered when the snapshot was built (`None`
    /// before: the registry's `republish` fills it in), so that selection reads a rank's
    /// overlap without visiting its state.
    pub index_key: Option<RankKey>,
    /// Its load, kept across snapshots for as long as its worker stays.
    pub state: Arc<RankState>,
}

/// Rank → index in [`Fleet::ranks`]: open addressing with linear probing, at most half full,
/// built once per snapshot and read-only after.
#[derive(Debug, Default)]
pub struct RankLookup {
    /// `(rank, index)`; `u32::MAX` marks an empty slot. Length a power of two (or 0).
    slots: Box<[(WorkerRank, u32)]>,
}

impl RankLookup {
    const EMPTY: u32 = u32::MAX;

    #[inline]
    fn home(rank: WorkerRank, mask: usize) -> usize {
        (mix64(rank.worker.0 ^ mix64(u64::from(rank.dp_rank.0))) as usize) & mask
    }

    /// A table of `ranks`, each mapped to its position.
    pub fn new(ranks: &[RankEntry]) -> Self {
        if ranks.is_empty() {
            return RankLookup::default();
        }
        let len = (ranks.len() * 2).next_power_of_two();
        let mut slots = vec![(WorkerRank::default(), Self::EMPTY); len].into_boxed_slice();
        let mask = len - 1;
        for (i, r) in ranks.iter().enumerate() {
            let mut at = Self::home(r.rank, mask);
            while slots[at].1 != Self::EMPTY {
                at = (at + 1) & mask;
            }
            slots[at] = (r.rank, i as u32);
        }
        RankLookup { slots }
    }

    /// The position of `rank`, if present.
    #[inline]
    pub fn get(&self, rank: WorkerRank) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut at = Self::home(rank, mask);
        loop {
            let (r, i) = self.slots[at];
            if i == Self::EMPTY {
                return None;
            }
            if r == rank {
                return Some(i as usize);
            }
            at = (at + 1) & mask;
        }
    }
}

/// An immutable view of the fleet.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Sorted by id.
    pub workers: Vec<WorkerEntry>,
    /// Sorted by (worker, dp rank).
    pub ranks: Vec<RankEntry>,
    /// Where each rank sits in `ranks`.
    pub lookup: RankLookup,
    /// By prefix-index rank id ([`RankKey::id`]): the rank's index in `ranks` (`u32::MAX`:
    /// no rank of this snapshot has the id).
    pub by_index_id: Vec<u32>,
    /// Every distinct `(key, value)` label of the fleet; label `i` is bit `i`.
    pub labels: Vec<(String, String)>,
    /// Bumped by every join and leave.
    pub generation: u64,
    /// Ranks of each role ([`role_slot`]).
    role_ranks: [u32; 3],
}

/// A role's place in per-role arrays.
pub(crate) fn role_slot(role: WorkerRole) -> usize {
    match role {
        WorkerRole::Prefill => 0,
        WorkerRole::Decode => 1,
        WorkerRole::Aggregated => 2,
    }
}

impl Fleet {
    /// How many of its ranks have `role`.
    #[inline]
    pub fn ranks_of(&self, role: WorkerRole) -> usize {
        self.role_ranks[role_slot(role)] as usize
    }

    /// A worker by id.
    pub fn worker(&self, id: WorkerId) -> Option<&WorkerEntry> {
        self.workers
            .binary_search_by_key(&id, |w| w.config.id)
            .ok()
            .map(|i| &self.workers[i])
    }

    /// Index of a rank in [`Fleet::ranks`].
    #[inline]
    pub fn rank_index(&self, rank: WorkerRank) -> Option<usize> {
        self.lookup.get(rank)
    }

    /// The bit of a label, if some worker carries it.
    pub fn label_bit(&self, key: &str, value: &str) -> Option<u64> {
        self.labels
            .iter()
            .position(|(k, v)| k == key && v == value)
            .map(|i| 1u64 << i)
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// True when no worker has joined.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

/// Whether the router may route yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Enough workers have joined.
    Ready,
    /// Fewer than the minimum of workers have joined.
    Waiting {
        /// Workers joined so far.
        joined: usize,
        /// Workers that must join first
        /// ([`RouterConfig::min_workers`](crate::RouterConfig::min_workers)).
        needed: usize,
    },
}

/// The registry: one writer at a time (join / leave), lock-free readers.
#[derive(Debug)]
pub(crate) struct Registry {
    current: ArcSwap<Fleet>,
    /// The summed context of each role's ranks ([`role_slot`]), which their states move.
    role_context: [ContextTotal; 3],
    /// Serialises writers (reads never take it).
    writer: Mutex<()>,
    block_size: u32,
    min_workers: usize,
}

impl Registry {
    /// An empty registry for workers of `block_size`, ready once `min_workers` joined.
    pub(crate) fn new(block_size: u32, min_workers: usize) -> Self {
        Registry {
            current: ArcSwap::from_pointee(Fleet::default()),
            role_context: [context_total(), context_total(), context_total()],
            writer: Mutex::new(()),
            block_size,
            min_workers,
        }
    }

    /// The current snapshot, cheaply (no reference count traffic in the common case).
    #[inline]
    pub(crate) fn load(&self) -> arc_swap::Guard<Arc<Fleet>> {
        self.current.load()
    }

    /// The current snapshot as an owned `Arc`.
    pub(crate) fn load_full(&self) -> Arc<Fleet> {
        self.current.load_full()
    }

    /// Ready once enough workers joined.
    pub(crate) fn readiness(&self) -> Readiness {
        let joined = self.current.load().workers.len();
        if joined >= self.min_workers {
            Readiness::Ready
        } else {
            Readiness::Waiting {
                joined,
                needed: self.min_workers,
            }
        }
    }

    fn check(&self, c: &WorkerConfig) -> Result<(), RegistryError> {
        let bad = |field, reason| {
            Err(RegistryError::InvalidWorker {
                worker: c.id,
                field,
                reason,
            })
        };
        if c.dp_size == 0 {
            return bad("dp_size", "must be ≥ 1");
        }
        if c.dp_start.checked_add(c.dp_size).is_none() {
            return bad("dp_size", "dp_start + dp_size overflows");
        }
        if c.kv_blocks == 0 {
            return bad("kv_blocks", "must be ≥ 1");
        }
        if c.block_size != self.block_size {
            return bad("block_size", "must equal the router's block size");
        }
        if c.max_batched_tokens == 0 {
            return bad("max_batched_tokens", "must be ≥ 1");
        }
        Ok(())
    }

    /// The summed context ([`crate::LoadView::context_load`]) of every rank of `role` that is
    /// or was in the fleet: a leaving rank's bookings are purged, taking its context out.
    #[inline]
    pub(crate) fn role_context(&self, role: WorkerRole) -> u64 {
        self.role_context[role_slot(role)].load(crate::sync::Ordering::Relaxed)
    }

    /// Adds a worker with fresh, idle ranks; returns the new snapshot.
    pub(crate) fn join(&self, config: WorkerConfig) -> Result<Arc<Fleet>, RegistryError> {
        self.check(&config)?;
        let _w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.current.load_full();
        if old.worker(config.id).is_some() {
            return Err(RegistryError::WorkerExists { worker: config.id });
        }
        let mut configs = configs_of(&old, None);
        let states = (config.dp_start..config.dp_start + config.dp_size)
            .map(|dp| {
                let rank = WorkerRank {
                    worker: config.id,
                    dp_rank: DpRank(dp),
                };
                let total = Arc::clone(&self.role_context[role_slot(config.role)]);
                Arc::new(RankState::counted_in(rank, total))
            })
            .collect();
        let id = config.id;
        configs.push((config, states));
        configs.sort_by_key(|(c, _)| c.id);
        if distinct_labels(&configs).len() > MAX_LABELS {
            return Err(RegistryError::TooManyLabels {
                worker: id,
                limit: MAX_LABELS,
            });
        }
        let fleet = Arc::new(build(configs, old.generation + 1));
        self.current.store(Arc::clone(&fleet));
        Ok(fleet)
    }

    /// Removes a worker: its rank states are retired, then the snapshot without it published.
    /// Returns the retired states (the caller purges their bookings).
    /// Publishes the current fleet again, with what its ranks' states say now (their index
    /// keys, once registered).
    pub(crate) fn republish(&self) {
        let _w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.current.load_full();
        let configs = configs_of(&old, None);
        self.current
            .store(Arc::new(build(configs, old.generation + 1)));
    }

    pub(crate) fn leave(&self, id: WorkerId) -> Result<Vec<Arc<RankState>>, RegistryError> {
        let _w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let old = self.current.load_full();
        let Some(gone) = old.worker(id) else {
            return Err(RegistryError::UnknownWorker { worker: id });
        };
        let retired: Vec<Arc<RankState>> = old.ranks[gone.ranks.clone()]
            .iter()
            .map(|r| Arc::clone(&r.state))
            .collect();
        for s in &retired {
            s.retire();
        }
        let configs = configs_of(&old, Some(id));
        self.current
            .store(Arc::new(build(configs, old.generation + 1)));
        Ok(retired)
    }
}

/// Most distinct labels a fleet may carry (one bit each).
pub(crate) const MAX_LABELS: usize = 64;

/// The distinct labels of `configs`, in first-seen order.
fn distinct_labels(configs: &[(WorkerConfig, Vec<Arc<RankState>>)]) -> Vec<(String, String)> {
    let mut labels: Vec<(String, String)> = Vec::new();
    for (c, _) in configs {
        for l in &c.labels {
            if !labels.contains(l) {
                labels.push(l.clone());
            }
        }
    }
    labels
}

/// The workers of `fleet` (less `without`) with their rank states, to build the next one from.
fn configs_of(
    fleet: &Fleet,
    without: Option<WorkerId>,
) -> Vec<(WorkerConfig, Vec<Arc<RankState>>)> {
    fleet
        .workers
        .iter()
        .filter(|w| Some(w.config.id) != without)
        .map(|w| {
            let states = fleet.ranks[w.ranks.clone()]
                .iter()
                .map(|r| Arc::clone(&r.state))
                .collect();
            (w.config.clone(), states)
        })
        .collect()
}

fn build(configs: Vec<(WorkerConfig, Vec<Arc<RankState>>)>, generation: u64) -> Fleet {
    let mut labels = distinct_labels(&configs);
    labels.truncate(MAX_LABELS);
    let mut workers = Vec::with_capacity(configs.len());
    let mut ranks = Vec::new();
    for (i, (config, states)) in configs.into_iter().enumerate() {
        let label_bits = config
            .labels
            .iter()
            .filter_map(|l| labels.iter().position(|x| x == l))
            .fold(0u64, |bits, i| bits | 1 << i);
        let start = ranks.len();
        for state in states {
            ranks.push(RankEntry {
                rank: state.rank(),
                worker: i,
                role: config.role,
                label_bits,
                index_key: state.index_key(),
                state,
            });
        }
        workers.push(WorkerEntry {
            config,
            ranks: start..ranks.len(),
            label_bits,
        });
    }
    let mut role_ranks = [0u32; 3];
    for r in &ranks {
        role_ranks[role_slot(r.role)] += 1;
    }
    let mut by_index_id = Vec::new();
    for (i, r) in ranks.iter().enumerate() {
        if let Some(key) = r.index_key {
            let id = key.id as usize;
            if by_index_id.len() <= id {
                by_index_id.resize(id + 1, u32::MAX);
            }
            by_index_id[id] = i as u32;
        }
    }
    Fleet {
        workers,
        lookup: RankLookup::new(&ranks),
        by_index_id,
        ranks,
        labels,
        generation,
        role_ranks,
    }
}

#[cfg(test)]
mod tests;
