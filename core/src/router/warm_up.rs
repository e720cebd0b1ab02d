//! Warm-up: a newly joined (or emptied) worker takes a share of cache misses while it warms.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::plan::Now;
use super::{bump, Router};
use crate::config::WarmUp;
use crate::load::RankState;
use crate::registry::Fleet;
use crate::select::Scored;

impl Router {
    /// Nanoseconds from the router's epoch to `t` (0 before it).
    pub(super) fn ns_since_epoch(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Warms `state` from `now` for the configured duration (no-op with warm-up off).
    pub(super) fn warm(&self, state: &RankState, now: Instant) {
        if let WarmUp::On { duration, .. } = self.config.warm_up {
            let until = self.ns_since_epoch(now + duration);
            state.warm_until(until);
            self.warm_horizon_ns.fetch_max(until, Ordering::Relaxed);
        }
    }

    /// True while some rank may still be warming up at `now` (warm-up's pick may then look
    /// at every candidate).
    pub(super) fn warming(&self, now: &Now<'_>) -> bool {
        matches!(self.config.warm_up, WarmUp::On { .. })
            && self.ns_since_epoch(now.get_or(None)) < self.warm_horizon_ns.load(Ordering::Relaxed)
    }

    /// For a cache miss (no candidate holds a block), with probability `share`, the least
    /// loaded candidate still warming (random ties); `None` otherwise.
    pub(super) fn warm_pick(
        &self,
        fleet: &Fleet,
        candidates: &[Scored],
        now: &Now<'_>,
        rng: &mut crate::rng::Rng,
    ) -> Option<usize> {
        let WarmUp::On { share, .. } = self.config.warm_up else {
            return None;
        };
        let now_ns = self.ns_since_epoch(now.get_or(None));
        if now_ns >= self.warm_horizon_ns.load(Ordering::Relaxed)
            || candidates.iter().any(|c| c.overlap_blocks > 0)
            || rng.unit_f64() >= share
        {
            return None;
        }
        let bs = self.config.block_size;
        let (mut best, mut best_load, mut ties) = (None, u64::MAX, 0u64);
        for (i, c) in candidates.iter().enumerate() {
            if fleet.ranks[c.fleet_index as usize].state.warm_until_ns() <= now_ns {
                continue;
            }
            let load = c.load.load_blocks(bs);
            if load < best_load {
                (best, best_load, ties) = (Some(i), load, 1);
            } else if load == best_load {
                ties += 1;
                if rng.below(ties) == 0 {
                    best = Some(i);
                }
            }
        }
        if best.is_some() {
            bump(&self.counters.warm_up);
        }
        best
    }

    /// Warms every rank whose reported cache is below `low_share` of the fleet's mean and
    /// that is not warming already.
    pub(super) fn rewarm_low_ranks(&self, now: Instant) {
        let WarmUp::On { low_share, .. } = self.config.warm_up else {
            return;
        };
        let fleet = self.registry.load();
        if low_share <= 0.0 || fleet.ranks.is_empty() {
            return;
        }
        let total: u64 = fleet.ranks.iter().map(|r| r.state.reported_blocks()).sum();
        let mean = total as f64 / fleet.ranks.len() as f64;
        let now_ns = self.ns_since_epoch(now);
        for r in fleet.ranks.iter() {
            if (r.state.reported_blocks() as f64) < low_share * mean
                && r.state.warm_until_ns() <= now_ns
            {
                self.warm(&r.state, now);
                bump(&self.counters.rewarmed);
            }
        }
    }
}
