//! The route itself, as a sequence of named steps over one thread's scratch buffers: check the
//! request, hash it, resolve its constraints and its pin or session, match it against the
//! index, raise the match from the router's own records, select a rank, book it.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{
    bump, lock, Bookkeeping, DecidedBy, Decision, EvidenceLevel, Fallback, Mode, Phase, PoolHits,
    RouteError, RouteRequest, Router,
};
use crate::approx::checkpoint_keys_extend;
use crate::config::{Disaggregation, Speculative};
use crate::event::{StorageTier, WorkerRank};
use crate::hash::{BlockHasher, HashSeed, LocalHash};
use crate::index::{MatchOptions, RankDepths, RankKey};
use crate::load::{prefix_keys_into, BookingSpec};
use crate::registry::{Fleet, KvEvents, Readiness, WorkerRole};
use crate::select::{
    filter_busy, filter_unhealthy, merge_pool_ranges, rank_depth_unchecked, BusyOutcome, Candidate,
    FloorTerms, HealthOutcome, LeastLoaded, PolicyKind, ProbeTargets, RequestShape, Scored, Scorer,
    SelectInput, Selector, Weights,
};
use crate::session::SessionRouting;

/// When a request may be booked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gate {
    /// Now, on the least loaded busy rank if every one is busy (`route`).
    Immediate,
    /// Now if some eligible rank is free; else wait (an admission with an empty queue, or the
    /// queue's head on release).
    IfFree,
    /// Wait behind the requests already queued (unless pinned).
    Behind,
}

/// What a gated route came to. The decision stays inline: boxing it would allocate per route.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(super) enum Routed {
    Decided(Decision),
    /// Not booked: the request must wait. Carries what the queue orders by.
    Wait {
        new_prefill_tokens: u64,
    },
}

/// The time of one call: the caller's, or the clock's, read once and only when needed.
#[derive(Debug)]
pub(super) struct Now(pub(super) std::cell::Cell<Option<Instant>>);

impl Now {
    pub(super) fn lazy() -> Self {
        Now(std::cell::Cell::new(None))
    }

    pub(super) fn at(t: Instant) -> Self {
        Now(std::cell::Cell::new(Some(t)))
    }

    /// The time; a reading the caller already took stands in for the clock.
    pub(super) fn get_or(&self, reading: Option<Instant>) -> Instant {
        match self.0.get() {
            Some(t) => t,
            None => {
                let t = reading.unwrap_or_else(Instant::now);
                self.0.set(Some(t));
                t
            }
        }
    }
}

/// A pinned route's rank, checked before the match.
#[derive(Clone, Copy)]
pub(super) struct PinnedRank {
    /// The rank scored (in the fleet's table).
    pub(super) index: usize,
    /// False when the pin named a worker with several dp ranks and none of them.
    pub(super) resolved: bool,
    pub(super) by: DecidedBy,
}

#[derive(Default)]
pub(super) struct Scratch {
    pub(super) locals: Vec<LocalHash>,
    /// Prefix keys of the blocks the policy keys on.
    pub(super) keys: Vec<u64>,
    /// Checkpoint keys for the router's records, computed as far as they are looked at.
    pub(super) marks: Vec<u64>,
    /// The match, by the index's rank ids.
    pub(super) depths: RankDepths,
    pub(super) candidates: Vec<Scored>,
    /// Every candidate, for warm-up's pick on a cache miss after a pruned gather.
    pub(super) unpruned: Vec<Scored>,
    /// The request's preferred labels as (label bit, weight).
    pub(super) preferred: Vec<(u64, f64)>,
    /// The pool's hits, clipped, sorted and merged into disjoint `[start, end)` ranges.
    pub(super) pool: Vec<(u32, u32)>,
    /// Ranks whose load this thread read in selection only to find that they could not win,
    /// plus four per route, since it last refreshed the booked-prefill floor
    /// ([`Router::refresh_prefill_floor`]).
    pub(super) loaded_losers: u64,
}

/// The router's records (approximate mode, speculation) raise a rank's overlap to their
/// depth, as device blocks; the index's overlap stands where it is deeper.
impl crate::approx::Overlaps for RankDepths {
    #[inline(always)]
    fn raise(&mut self, _: WorkerRank, key: RankKey, depth: u32) -> bool {
        // A key given out after the match began raises nothing (`RankDepths::raise`); a
        // retired rank's raise is never read (selection skips retired ranks), and a rank's
        // records leave the table before the index frees its id.
        RankDepths::raise(self, key, depth)
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl Router {
    /// Decides which rank serves `req`, and books it unless query-only. Never waits: when
    /// every eligible rank is busy the least loaded takes it ([`DecidedBy::FallbackAllBusy`]);
    /// [`Router::submit`] queues instead.
    pub fn route(&self, req: &RouteRequest<'_>) -> Result<Decision, RouteError> {
        match self.route_gated(req, &Now::lazy(), Gate::Immediate)? {
            Routed::Decided(d) => Ok(d),
            // `Gate::Immediate` always decides.
            Routed::Wait { .. } => Err(RouteError::NoWorkers { request: req.id }),
        }
    }

    /// [`Router::route`] at a given time (bookings, sessions and cache records are stamped with
    /// `now`), for callers that own the clock.
    pub fn route_at(&self, req: &RouteRequest<'_>, now: Instant) -> Result<Decision, RouteError> {
        match self.route_gated(req, &Now::at(now), Gate::Immediate)? {
            Routed::Decided(d) => Ok(d),
            Routed::Wait { .. } => Err(RouteError::NoWorkers { request: req.id }),
        }
    }

    pub(super) fn route_gated(
        &self,
        req: &RouteRequest<'_>,
        now: &Now,
        gate: Gate,
    ) -> Result<Routed, RouteError> {
        SCRATCH.with(|s| match s.try_borrow_mut() {
            Ok(mut s) => self.route_with(req, &mut s, now, gate),
            // Re-entered from inside a route on this thread (not possible through this API,
            // but never panic): use a fresh scratch.
            Err(_) => self.route_with(req, &mut Scratch::default(), now, gate),
        })
    }

    pub(super) fn route_with(
        &self,
        req: &RouteRequest<'_>,
        s: &mut Scratch,
        now: &Now,
        gate: Gate,
    ) -> Result<Routed, RouteError> {
        let request = req.id;
        let hints = &req.hints;
        if req.tokens.is_empty() {
            bump(&self.counters.no_tokens);
            return Err(RouteError::NoTokens { request });
        }
        if let Readiness::Waiting { joined, needed } = self.registry.readiness() {
            bump(&self.counters.not_ready);
            return Err(RouteError::NotReady { joined, needed });
        }
        let timing = self.timings.is_some();
        let t0 = timing.then(Instant::now);

        // 1. Hash. Prefix keys only as far as the policy keys on (records extend them).
        let bs = self.config.block_size;
        let hasher = BlockHasher::new(bs as usize)
            .with_seed(HashSeed::new(hints.lora_name, hints.cache_salt));
        hasher.local_hashes_into(req.tokens, &mut s.locals);
        let keyed = self.prefix_key_blocks().min(s.locals.len());
        prefix_keys_into(&s.locals[..keyed], &mut s.keys);
        s.marks.clear();
        let t1 = timing.then(Instant::now);

        let fleet = self.registry.load();
        let overrides = hints.overrides.sanitized();
        let mut weights = Weights::new(&self.config, &overrides);
        if hints.phase == Phase::Decode {
            weights.credits = [0.0; StorageTier::COUNT];
        }
        let tokens = req.tokens.len() as u64;
        let shape = RequestShape {
            tokens,
            blocks: tokens.div_ceil(u64::from(bs)),
            full_blocks: s.locals.len() as u32,
            prefix_key: self.prefix_key(&s.keys),
        };
        let temperature = overrides.temperature.unwrap_or(self.config.temperature);
        // Constraints: required labels as one mask; preferred ones as (bit, weight).
        let mut required = 0u64;
        for l in hints.required {
            match fleet.label_bit(l.key, l.value) {
                Some(bit) => required |= bit,
                None => {
                    bump(&self.counters.no_eligible);
                    return Err(RouteError::NoEligibleWorker { request });
                }
            }
        }
        s.preferred.clear();
        for p in hints.preferred {
            if !(p.weight.is_finite() && p.weight >= 0.0) {
                bump(&self.counters.invalid_hints);
                return Err(RouteError::InvalidHint {
                    request,
                    field: "preferred.weight",
                    reason: "must be a finite number ≥ 0",
                });
            }
            if let Some(bit) = fleet.label_bit(p.label.key, p.label.value) {
                s.preferred.push((bit, p.weight));
            }
        }
        s.pool.clear();
        match hints.pool {
            PoolHits::None => {}
            PoolHits::Failed => bump(&self.counters.pool_failed),
            PoolHits::Hits(ranges) => {
                if merge_pool_ranges(ranges, shape.full_blocks, &mut s.pool).is_err() {
                    bump(&self.counters.pool_failed);
                }
            }
        }
        let mut rng = self.rng.fork();
        let mut bookkeeping = match hints.mode {
            Mode::Book => Bookkeeping::Booked,
            Mode::QueryOnly => Bookkeeping::QueryOnly,
        };
        let probe = self.selector.kind() == PolicyKind::KvAware;
        let mut fallback = None;
        // A sticky session acts as a pin to its rank while that rank is present and may
        // serve the request; otherwise it is chosen afresh (and rebound when booked).
        let mut session_routing = None;
        let mut pin = hints
            .pinned
            .for_phase(hints.phase)
            .map(|p| (p, DecidedBy::Pinned));
        if let (None, Some(sid)) = (pin, hints.session) {
            session_routing = Some(match self.sessions.bound(sid) {
                None => SessionRouting::Bound,
                Some(rank) => {
                    let usable = fleet.rank_index(rank).is_some_and(|i| {
                        let r = &fleet.ranks[i];
                        r.label_bits & required == required
                            && hints.allowed.is_none_or(|a| a.contains(&rank.worker))
                    });
                    if usable {
                        pin = Some(((rank.worker, Some(rank.dp_rank)), DecidedBy::Session));
                        SessionRouting::Sticky
                    } else {
                        SessionRouting::Rerouted { previous: rank }
                    }
                }
            });
        }
        // A pin is checked and resolved to its rank before the match: that rank is the only
        // one scored. A worker with several dp ranks pinned without one is scored on its
        // first (and the booking is not tracked).
        let pinned = match pin {
            None => None,
            Some(((wid, dp), pinned_by)) => {
                let Some(w) = fleet.worker(wid) else {
                    bump(&self.counters.unknown_worker);
                    return Err(RouteError::UnknownWorker {
                        request,
                        worker: wid,
                    });
                };
                if hints.allowed.is_some_and(|a| !a.contains(&wid)) {
                    bump(&self.counters.pinned_not_allowed);
                    return Err(RouteError::PinnedNotAllowed {
                        request,
                        worker: wid,
                    });
                }
                if w.label_bits & required != required {
                    bump(&self.counters.no_eligible);
                    return Err(RouteError::PinnedLacksLabels {
                        request,
                        worker: wid,
                    });
                }
                let ranks = w.ranks.clone();
                let resolved = match dp {
                    Some(dp) => ranks.clone().find(|&i| fleet.ranks[i].rank.dp_rank == dp),
                    None if ranks.len() == 1 => Some(ranks.start),
                    None => None,
                };
                Some(PinnedRank {
                    index: resolved.unwrap_or(ranks.start),
                    resolved: resolved.is_some(),
                    by: pinned_by,
                })
            }
        };

        // Candidates that cannot win are not kept where only the winner matters: the
        // cheapest is taken (ties at random), and nothing else reads the whole list (no
        // evidence, no wait to estimate). While ranks warm up, warm-up's pick needs every
        // candidate on a cache miss: a request the kept candidates hold no block of is
        // gathered again, whole, for it.
        let prune = probe
            && temperature == 0.0
            && hints.evidence != EvidenceLevel::Full
            && gate != Gate::Behind;

        // 2. Match, by the index's rank ids; each fleet rank reads its own (`rank_depth`). A
        // pinned route's walk follows its rank alone. A pruning route reads few ranks, the
        // deep ones: the walk's first run (shared by many ranks, as a system prompt is) is
        // kept to be read when asked for. A route that reads every rank (no pruning, or no
        // credit for cached blocks, as in decode, so no least winning overlap) has every rank
        // written as the walk goes.
        let credit = weights
            .credits
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        s.depths
            .set_eager(!prune || credit.is_nan() || credit <= 0.0);
        match pinned.and_then(|p| fleet.ranks[p.index].index_key) {
            Some(key) => self.reader.find_depth_of_into(
                &s.locals,
                MatchOptions::default(),
                key.id,
                &mut s.depths,
            ),
            None => self
                .reader
                .find_depths_into(&s.locals, MatchOptions::default(), &mut s.depths),
        }
        let t2 = timing.then(Instant::now);

        // 3. Select.
        let (role, role_fallback) = self.selection_role(&fleet, hints.phase);
        let busy = &self.config.busy;
        let booked_floor = self.ledger.prefill_floor();
        let health_on = self.marked_ranks.load(Ordering::Relaxed) > 0;
        let decay_anywhere = self.ledger.prompt_decay_anywhere();
        // The scorer over the match as it stands (before and after the records raise it).
        macro_rules! scorer {
            ($known_seed:expr) => {
                Scorer {
                    pool: &s.pool,
                    pool_credit: self.config.pool_credit,
                    preferred: &s.preferred,
                    fleet: &fleet,
                    depths: &s.depths,
                    seed: s.depths.deepest().and_then(|rank| fleet.rank_index(rank)),
                    known_seed: $known_seed,
                    decay_anywhere,
                    booked_floor,
                    floor_terms: FloorTerms::new(&weights, &shape, booked_floor),
                    weights: &weights,
                    shape: &shape,
                    busy,
                    busy_on: busy.decode_blocks_fraction.is_some()
                        || busy.prefill_tokens_fraction.is_some(),
                    health_on,
                }
            };
        }
        // The router's own records (approximate mode, speculation) raise a rank's overlap to
        // their depth, as device blocks; the index's overlap stands where it is deeper. Where
        // only the winner matters, the deepest eligible rank is scored on the index's overlap
        // alone first: records shallower than any overlap that could beat it are not read
        // (`Scorer::least_winning_blocks`; the rank's cost without its records is no lower
        // than with them, so the depth found is no higher than it would be with them).
        let mut known_seed = None;
        if !self.approx.is_empty() && !s.locals.is_empty() {
            let mut least = 0;
            if prune && pin.is_none() {
                let first = scorer!(None);
                let (seed, blocks) =
                    first.least_after_seed(role, hints.allowed, required, &mut s.candidates);
                known_seed = seed;
                least = blocks.unwrap_or(0);
            } else if let Some(p) = pinned {
                // Only the pinned rank's overlap matters: records no deeper than what the
                // index gives it change nothing.
                least = rank_depth_unchecked(&fleet.ranks[p.index], &s.depths)
                    .map_or(0, |(_, d)| d.blocks)
                    .saturating_add(1);
            }
            let now = now.get_or(None);
            if self
                .approx
                .lookup_over(&s.locals, &mut s.marks, now, least, &mut s.depths)
            {
                bump(&self.counters.approx_raised);
            }
        }
        let scorer = scorer!(known_seed);
        let full = |c: &Scored| {
            let i = c.fleet_index as usize;
            let per_tier = scorer.per_tier(i);
            let mut c = Candidate::from_scored(c, fleet.ranks[i].rank, per_tier, &weights, &shape);
            let (pool_credit, pool_blocks) = scorer.pool_extension(c.overlap.blocks);
            if pool_blocks > 0 {
                c.cost = c.cost.with_pool_credit(&weights, pool_credit, pool_blocks);
            }
            if !scorer.preferred.is_empty() {
                c.cost = c
                    .cost
                    .with_preference(scorer.preference(fleet.ranks[i].label_bits));
            }
            c
        };

        let (chosen, decided_by, evidence) = if let Some(p) = pinned {
            let i = p.index;
            if !p.resolved && hints.mode == Mode::Book {
                bookkeeping = Bookkeeping::UntrackedDpRankUnresolved;
            }
            let pinned_by = p.by;
            s.candidates.clear();
            s.candidates.push(scorer.score(i));
            if probe {
                let mut targets = ProbeTargets::new(shape.full_blocks);
                targets.offer(0, &s.candidates[0]);
                self.probe_shared(
                    &fleet,
                    &scorer,
                    targets.targets(),
                    &s.locals,
                    &mut s.candidates,
                );
            }
            let c = full(&s.candidates[0]);
            let ev = (hints.evidence == EvidenceLevel::Full).then(|| vec![c]);
            (c, pinned_by, ev)
        } else {
            if role_fallback.is_some() {
                fallback = role_fallback;
            }
            s.candidates.clear();
            s.candidates.reserve(fleet.ranks.len());
            let warming = self.warming(now);
            let mut targets =
                ProbeTargets::new(if probe { shape.full_blocks } else { 0 }).pruning(prune);
            let unlabelled = scorer.gather(
                role,
                hints.allowed,
                required,
                &mut s.candidates,
                &mut targets,
            );
            // Loads read in vain say the booked-prefill floor may lag the fleet's loads: once
            // they add up to some sixteen reads of every rank, read every rank twice to raise
            // it (a refresh then costs at most an eighth of what triggered it). Each route
            // selecting over the fleet (neither pinned nor session-bound, which read no floor)
            // counts as four such reads as well: a floor left low (by joins, by releases) also
            // weakens what selection prunes before any load is read (the records' least depth,
            // the ranks visited), so it rises within four such routes per rank even when no
            // load is read in vain, at half a read per route.
            s.loaded_losers += u64::from(targets.loaded_losers()) + 4;
            if s.loaded_losers > 16 * fleet.ranks.len() as u64 {
                s.loaded_losers = 0;
                self.refresh_prefill_floor();
            }
            if s.candidates.is_empty() {
                if unlabelled > 0 {
                    bump(&self.counters.no_eligible);
                    return Err(RouteError::NoEligibleWorker { request });
                }
                bump(&self.counters.no_workers);
                return Err(RouteError::NoWorkers { request });
            }
            self.probe_shared(
                &fleet,
                &scorer,
                targets.targets(),
                &s.locals,
                &mut s.candidates,
            );
            let ev = (hints.evidence == EvidenceLevel::Full)
                .then(|| s.candidates.iter().map(full).collect());
            let health = if scorer.health_on {
                filter_unhealthy(&mut s.candidates)
            } else {
                HealthOutcome::Filtered {
                    unreachable: 0,
                    wedged: 0,
                }
            };
            let outcome = match health {
                HealthOutcome::AllVetoed => {
                    bump(&self.counters.all_unhealthy);
                    None
                }
                HealthOutcome::Filtered {
                    unreachable,
                    wedged,
                } => {
                    if unreachable + wedged > 0 {
                        let c = &self.counters;
                        c.vetoed_unreachable
                            .fetch_add(u64::from(unreachable), Ordering::Relaxed);
                        c.vetoed_wedged
                            .fetch_add(u64::from(wedged), Ordering::Relaxed);
                    }
                    Some(if scorer.busy_on {
                        filter_busy(&mut s.candidates)
                    } else {
                        BusyOutcome::Filtered
                    })
                }
            };
            let input = SelectInput {
                candidates: &s.candidates,
                ranks: &fleet.ranks,
                shape: &shape,
                block_size: bs,
                temperature,
            };
            let waits = hints.mode == Mode::Book
                && match gate {
                    Gate::Immediate => false,
                    Gate::IfFree => outcome == Some(BusyOutcome::AllBusy),
                    Gate::Behind => outcome.is_some(),
                };
            if waits {
                let best = s.candidates.iter().map(|c| c.overlap_blocks).max();
                let cached = u64::from(best.unwrap_or(0)) * u64::from(bs);
                return Ok(Routed::Wait {
                    new_prefill_tokens: tokens.saturating_sub(cached),
                });
            }
            let (pick, by) = match outcome {
                None => (
                    s.candidates[LeastLoaded.select(&input, &mut rng)],
                    DecidedBy::FallbackAllUnhealthy,
                ),
                Some(BusyOutcome::AllBusy) => {
                    bump(&self.counters.all_busy);
                    (
                        s.candidates[LeastLoaded.select(&input, &mut rng)],
                        DecidedBy::FallbackAllBusy,
                    )
                }
                Some(BusyOutcome::Filtered) => {
                    let by = match self.selector.kind() {
                        PolicyKind::KvAware => DecidedBy::Cost,
                        k => DecidedBy::Policy(k),
                    };
                    let miss = !s.candidates.iter().any(|c| c.overlap_blocks > 0);
                    let warm = if prune && warming && miss {
                        // Maybe a cache miss while ranks warm up (a pruned rank may hold a
                        // block): warm-up's pick sees every free, healthy candidate (there
                        // are some: a pruned gather keeps the cheapest of them).
                        let all = &mut s.unpruned;
                        all.clear();
                        let mut unpruned = ProbeTargets::new(0);
                        scorer.gather(role, hints.allowed, required, all, &mut unpruned);
                        if scorer.health_on {
                            filter_unhealthy(all);
                        }
                        if scorer.busy_on {
                            filter_busy(all);
                        }
                        self.warm_pick(&fleet, all, now, &mut rng).map(|i| all[i])
                    } else {
                        self.warm_pick(&fleet, &s.candidates, now, &mut rng)
                            .map(|i| s.candidates[i])
                    };
                    match warm {
                        Some(c) => (c, DecidedBy::WarmUp),
                        None => (s.candidates[self.selector.select(&input, &mut rng)], by),
                    }
                }
            };
            (full(&pick), by, ev)
        };
        let t3 = timing.then(Instant::now);

        // 4. Book.
        match bookkeeping {
            Bookkeeping::Booked => {
                let prefill_tokens = match hints.phase {
                    Phase::Decode => 0,
                    _ => tokens - chosen.overlap.cached_tokens,
                };
                self.ledger.book(BookingSpec {
                    request,
                    state: &fleet.ranks[chosen.fleet_index].state,
                    prefill_tokens,
                    block_hashes: &s.locals,
                    tail_blocks: u64::from(tokens % u64::from(bs) != 0),
                    prompt_tokens: tokens,
                    cached_tokens: chosen.overlap.cached_tokens,
                    block_size: bs,
                    expected_output_tokens: hints.expected_output_tokens,
                    session: hints.session,
                    now: now.get_or(t3),
                })?;
                bump(&self.counters.routed);
                let record_ttl = match fleet.ranks[chosen.fleet_index].state.kv_events() {
                    KvEvents::Absent => Some(self.config.approximate.ttl),
                    KvEvents::Published => match self.config.approximate.speculative {
                        Speculative::On { ttl } => Some(ttl),
                        Speculative::Off => None,
                    },
                };
                let entry = &fleet.ranks[chosen.fleet_index];
                if let (Some(ttl), Some(key)) = (record_ttl, entry.index_key) {
                    checkpoint_keys_extend(&s.locals, &mut s.marks, usize::MAX);
                    self.approx
                        .record(&s.marks, chosen.rank, key, now.get_or(t3) + ttl, || {
                            !entry.state.is_retired()
                        });
                }
                if let Some(sid) = hints.session {
                    self.sessions.record(
                        sid,
                        chosen.rank,
                        request,
                        now.get_or(t3),
                        hints.session_close,
                    );
                    match session_routing {
                        Some(SessionRouting::Bound) => bump(&self.counters.sessions_bound),
                        Some(SessionRouting::Rerouted { .. }) => {
                            bump(&self.counters.sessions_rerouted)
                        }
                        _ => {}
                    }
                }
                if fallback.is_some() {
                    bump(&self.counters.prefill_fallbacks);
                }
            }
            Bookkeeping::QueryOnly => bump(&self.counters.query_only),
            Bookkeeping::UntrackedDpRankUnresolved => bump(&self.counters.untracked),
        }

        if let (Some(t), Some(t0), Some(t1), Some(t2), Some(t3)) = (&self.timings, t0, t1, t2, t3) {
            let ns = |a: Instant, b: Instant| b.duration_since(a).as_nanos() as u64;
            lock(t).record(ns(t0, t1), ns(t1, t2), ns(t2, t3));
        }

        Ok(Routed::Decided(Decision {
            request,
            worker: chosen.rank,
            overlap: chosen.overlap,
            cost: chosen.cost,
            load: chosen.load,
            decided_by,
            fallback,
            bookkeeping,
            expected_output_tokens: hints.expected_output_tokens,
            session: session_routing,
            evidence,
        }))
    }

    /// Probes `targets` (candidates whose cost could fall to the cheapest, [`ProbeTargets`])
    /// for the prompt blocks already active on their rank, and lowers their cost by them.
    pub(super) fn probe_shared(
        &self,
        fleet: &Fleet,
        scorer: &Scorer<'_>,
        targets: &[u32],
        locals: &[LocalHash],
        candidates: &mut [Scored],
    ) {
        let full = scorer.shape.full_blocks;
        let room = |c: &Scored| c.load.prompt_blocks.min(u64::from(full)) as usize;
        for &t in targets {
            let c = &mut candidates[t as usize];
            let blocks = &locals[..room(c)];
            match fleet.ranks[c.fleet_index as usize]
                .state
                .try_shared_prefix_blocks(blocks)
            {
                Some(shared) => {
                    bump(&self.counters.shared_probes);
                    *c = scorer.with_shared(c, shared as u32);
                }
                None => bump(&self.counters.shared_probes_busy),
            }
        }
    }

    /// The role a request of `phase` is served by, and the fallback taken to find it (with
    /// optional disaggregation and no prefill worker, prefill goes to aggregated workers).
    pub(super) fn selection_role(
        &self,
        fleet: &Fleet,
        phase: Phase,
    ) -> (WorkerRole, Option<Fallback>) {
        let role = match phase {
            Phase::Aggregated => WorkerRole::Aggregated,
            Phase::Prefill => WorkerRole::Prefill,
            Phase::Decode => WorkerRole::Decode,
        };
        if role == WorkerRole::Prefill
            && self.config.disaggregation == Disaggregation::Optional
            && !fleet.ranks.iter().any(|r| r.role == WorkerRole::Prefill)
        {
            return (WorkerRole::Aggregated, Some(Fallback::PrefillToAggregated));
        }
        (role, None)
    }

    /// How many leading blocks the prefix key covers.
    pub(super) fn prefix_key_blocks(&self) -> usize {
        match self.config.policy {
            crate::config::Policy::PrefixHash { prefix_blocks, .. } => prefix_blocks as usize,
            _ => 1,
        }
    }

    /// The key of the prompt's first [`Router::prefix_key_blocks`] blocks (all of them when
    /// the prompt is shorter; `None` without a full block).
    pub(super) fn prefix_key(&self, keys: &[u64]) -> Option<u64> {
        let n = self.prefix_key_blocks().min(keys.len());
        n.checked_sub(1).map(|i| keys[i])
    }
}
