//! The route itself, as a sequence of named steps over one thread's scratch buffers: check the
//! request, hash it, resolve its constraints and its pin or session, match it against the
//! index, raise the match from the router's own records, select a rank, book it.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::choose::Selected;
use super::plan::{Eligible, Gate, Now, PinnedRank, Plan};
use super::scratch::{Constraints, Prompt, Scratch};
use super::{
    bump, lock, DecidedBy, Decision, EvidenceLevel, Fallback, Phase, PoolHits, RouteError,
    RouteHints, RouteRequest, Router,
};
use crate::config::Disaggregation;
use crate::event::{DpRank, StorageTier, WorkerId, WorkerRank};
use crate::hash::{BlockHasher, HashSeed, LocalHash};
use crate::index::{MatchOptions, RankDepths, RankKey};
use crate::load::prefix_keys_into;
use crate::registry::{Fleet, Readiness, WorkerRole};
use crate::select::{
    merge_pool_ranges, rank_depth_unchecked, PolicyKind, RequestShape, ScoreInput, Scored, Scorer,
    Weights,
};
use crate::session::SessionRouting;

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

/// A pin before it is checked: the worker, the dp rank if named, and what pinned it.
#[derive(Clone, Copy)]
struct Pin {
    worker: WorkerId,
    dp: Option<DpRank>,
    by: DecidedBy,
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

/// The longest prompt [`RouteHints::prompt_len`] may name: far past any model's context, and
/// low enough that token counts summed over every booking cannot overflow.
const MAX_PROMPT_LEN: u64 = 1 << 32;

thread_local! {
    pub(super) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl Router {
    /// Decides which rank serves `req`, and books it unless query-only. Never waits: when
    /// every eligible rank is busy the least loaded takes it ([`DecidedBy::FallbackAllBusy`]);
    /// [`Router::submit`] queues instead.
    pub fn route(&self, req: &RouteRequest<'_>) -> Result<Decision, RouteError> {
        match self.route_gated(req, &Now::lazy(&self.clock), Gate::Immediate)? {
            Routed::Decided(d) => Ok(d),
            // `Gate::Immediate` always decides.
            Routed::Wait { .. } => Err(RouteError::NoWorkers { request: req.id }),
        }
    }

    pub(super) fn route_gated(
        &self,
        req: &RouteRequest<'_>,
        now: &Now<'_>,
        gate: Gate,
    ) -> Result<Routed, RouteError> {
        SCRATCH.with(|s| match s.try_borrow_mut() {
            Ok(mut s) => self.route_with(req, &mut s, now, gate),
            // Re-entered from inside a route on this thread (not possible through this API,
            // but never panic): use a fresh scratch.
            Err(_) => self.route_with(req, &mut Scratch::default(), now, gate),
        })
    }

    /// The route, step by step: check, hash, constraints, pin or session, match, raise from
    /// the router's records, select, book.
    fn route_with(
        &self,
        req: &RouteRequest<'_>,
        s: &mut Scratch,
        now: &Now<'_>,
        gate: Gate,
    ) -> Result<Routed, RouteError> {
        let hints = &req.hints;
        self.check(req)?;
        let timing = self.timings.is_some();
        let t0 = timing.then(Instant::now);
        let shape = self.hash(req, &mut s.prompt);
        let t1 = timing.then(Instant::now);

        let fleet = self.registry.load();
        let (mut weights, temperature) = self.weigh(hints, shape.full_blocks);
        let required = self.constraints(req, &fleet, shape.full_blocks, &mut s.constraints)?;
        let mut rng = self.rng.fork();
        let (pin, session) = self.pin_or_session(req, &fleet, required);
        let pinned = match pin {
            Some(pin) => Some(self.resolve_pin(req, &fleet, required, pin)?),
            None => None,
        };
        let (role, role_fallback) = self.selection_role(&fleet, hints.phase);
        if self.config.hot_load.share > 0.0 {
            let mean = mean_context(&self.registry, &fleet, role);
            weights = weights.with_fleet_load(&self.config.hot_load, mean, &shape);
        }
        let probe = self.selector.kind() == PolicyKind::KvAware;
        let plan = Plan {
            request: req.id,
            eligible: Eligible {
                role,
                allowed: hints.allowed,
                required,
            },
            pinned,
            prune: probe
                && temperature == 0.0
                && self.config.near_tie == 0.0
                && hints.evidence != EvidenceLevel::Full
                && gate != Gate::Behind,
            probe,
            gate,
            temperature,
            evidence: hints.evidence,
            mode: hints.mode,
            fallback: role_fallback,
            now,
        };

        self.match_prompt(&s.prompt.locals, &fleet, &plan, &weights, &mut s.depths);
        let t2 = timing.then(Instant::now);

        let input = self.score_input(&fleet, &weights, &shape, &s.constraints);
        let known_seed = self.raise_from_records(
            input,
            &plan,
            &mut s.prompt,
            &mut s.depths,
            &mut s.candidates.kept,
        );
        let scorer = Scorer::new(input, &s.depths, known_seed);
        let choice = match pinned {
            Some(p) => {
                self.select_pinned(&scorer, &plan, p, &s.prompt.locals, &mut s.candidates.kept)
            }
            None => match self.select(
                &scorer,
                &plan,
                &s.prompt.locals,
                &mut s.candidates,
                &mut rng,
            )? {
                Selected::Chosen(c) => c,
                Selected::Wait { new_prefill_tokens } => {
                    return Ok(Routed::Wait { new_prefill_tokens })
                }
            },
        };
        let t3 = timing.then(Instant::now);

        let chosen = choice.candidate;
        let decision = choice.decision(req, self.config.block_size, pinned, session);
        self.book(
            req,
            &fleet.ranks[chosen.fleet_index],
            &decision,
            &mut s.prompt,
            || now.get_or(t3),
        )?;

        if let (Some(t), Some(t0), Some(t1), Some(t2), Some(t3)) = (&self.timings, t0, t1, t2, t3) {
            let ns = |a: Instant, b: Instant| b.duration_since(a).as_nanos() as u64;
            lock(t).record(ns(t0, t1), ns(t1, t2), ns(t2, t3));
        }
        Ok(Routed::Decided(decision))
    }

    /// What scoring reads of the request besides the match.
    #[inline(always)]
    fn score_input<'a>(
        &'a self,
        fleet: &'a Fleet,
        weights: &'a Weights,
        shape: &'a RequestShape,
        constraints: &'a Constraints,
    ) -> ScoreInput<'a> {
        ScoreInput {
            fleet,
            weights,
            shape,
            pool: &constraints.pool,
            pool_credit: self.config.pool_credit,
            preferred: &constraints.preferred,
            busy: &self.config.busy,
            booked_floor: self.ledger.prefill_floor(),
            decay_anywhere: self.ledger.prompt_decay_anywhere(),
            health_on: self.marked_ranks.load(Ordering::Relaxed) > 0,
        }
    }

    /// Refuses a request without tokens or with a prompt length past any model's, or any
    /// request before the fleet is ready.
    #[inline(always)]
    fn check(&self, req: &RouteRequest<'_>) -> Result<(), RouteError> {
        if req.tokens.is_empty() {
            bump(&self.counters.no_tokens);
            return Err(RouteError::NoTokens { request: req.id });
        }
        if req.hints.prompt_len.is_some_and(|n| n > MAX_PROMPT_LEN) {
            bump(&self.counters.invalid_hints);
            return Err(RouteError::InvalidHint {
                request: req.id,
                field: "prompt_len",
                reason: "must be at most 2^32 tokens",
            });
        }
        if let Readiness::Waiting { joined, needed } = self.registry.readiness() {
            bump(&self.counters.not_ready);
            return Err(RouteError::NotReady { joined, needed });
        }
        Ok(())
    }

    /// Hashes the prompt into its blocks' local hashes, and prefix keys only as far as the
    /// policy keys on (the router's records extend them).
    #[inline(always)]
    fn hash(&self, req: &RouteRequest<'_>, prompt: &mut Prompt) -> RequestShape {
        let hints = &req.hints;
        let bs = self.config.block_size;
        let hasher = BlockHasher::new(bs as usize)
            .with_seed(HashSeed::new(hints.lora_name, hints.cache_salt));
        hasher.local_hashes_into(req.tokens, &mut prompt.locals);
        let keyed = self.prefix_key_blocks().min(prompt.locals.len());
        prefix_keys_into(&prompt.locals[..keyed], &mut prompt.keys);
        prompt.marks.clear();
        let tokens = req.prompt_tokens();
        RequestShape {
            tokens,
            blocks: tokens.div_ceil(u64::from(bs)),
            full_blocks: prompt.locals.len() as u32,
            prefix_key: self.prefix_key(&prompt.keys),
        }
    }

    /// The cost's weights and the temperature, after the request's overrides, with the
    /// affinity of a prompt of `full_blocks`; decode earns no credit for cached blocks.
    #[inline(always)]
    fn weigh(&self, hints: &RouteHints<'_>, full_blocks: u32) -> (Weights, f64) {
        let overrides = hints.overrides.sanitized();
        let mut weights =
            Weights::new(&self.config, &overrides).for_prompt(&self.config.affinity, full_blocks);
        if hints.phase == Phase::Decode {
            weights.credits = [0.0; StorageTier::COUNT];
        }
        let temperature = overrides.temperature.unwrap_or(self.config.temperature);
        (weights, temperature)
    }

    /// The request's required labels as one mask (no worker carrying one of them: an error);
    /// its preferred labels as (bit, weight) and its pool hits merged, into `out`.
    #[inline(always)]
    fn constraints(
        &self,
        req: &RouteRequest<'_>,
        fleet: &Fleet,
        full_blocks: u32,
        out: &mut Constraints,
    ) -> Result<u64, RouteError> {
        let (request, hints) = (req.id, &req.hints);
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
        out.preferred.clear();
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
                out.preferred.push((bit, p.weight));
            }
        }
        out.pool.clear();
        match hints.pool {
            PoolHits::None => {}
            PoolHits::Failed => bump(&self.counters.pool_failed),
            PoolHits::Hits(ranges) => {
                if merge_pool_ranges(ranges, full_blocks, &mut out.pool).is_err() {
                    bump(&self.counters.pool_failed);
                }
            }
        }
        Ok(required)
    }

    /// The worker (and dp rank) the request is pinned to for its phase, else the rank its
    /// sticky session is bound to while that rank is present and may serve it (otherwise the
    /// session is chosen afresh, and rebound when booked); with how the session steered it.
    #[inline(always)]
    fn pin_or_session(
        &self,
        req: &RouteRequest<'_>,
        fleet: &Fleet,
        required: u64,
    ) -> (Option<Pin>, Option<SessionRouting>) {
        let hints = &req.hints;
        let pin = hints.pinned.for_phase(hints.phase).map(|(worker, dp)| Pin {
            worker,
            dp,
            by: DecidedBy::Pinned,
        });
        let (None, Some(sid)) = (pin, hints.session) else {
            return (pin, None);
        };
        let Some(rank) = self.sessions.bound(sid) else {
            return (None, Some(SessionRouting::Bound));
        };
        let usable = fleet.rank_index(rank).is_some_and(|i| {
            let r = &fleet.ranks[i];
            r.label_bits & required == required
                && hints.allowed.is_none_or(|a| a.contains(&rank.worker))
        });
        if usable {
            let pin = Pin {
                worker: rank.worker,
                dp: Some(rank.dp_rank),
                by: DecidedBy::Session,
            };
            (Some(pin), Some(SessionRouting::Sticky))
        } else {
            (None, Some(SessionRouting::Rerouted { previous: rank }))
        }
    }

    /// Checks a pin and resolves it to the rank scored, before the match. A worker with
    /// several dp ranks pinned without one is scored on its first (and the booking is not
    /// tracked).
    #[inline(always)]
    fn resolve_pin(
        &self,
        req: &RouteRequest<'_>,
        fleet: &Fleet,
        required: u64,
        pin: Pin,
    ) -> Result<PinnedRank, RouteError> {
        let (request, wid) = (req.id, pin.worker);
        let Some(w) = fleet.worker(wid) else {
            bump(&self.counters.unknown_worker);
            return Err(RouteError::UnknownWorker {
                request,
                worker: wid,
            });
        };
        if req.hints.allowed.is_some_and(|a| !a.contains(&wid)) {
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
        let resolved = match pin.dp {
            Some(dp) => ranks.clone().find(|&i| fleet.ranks[i].rank.dp_rank == dp),
            None if ranks.len() == 1 => Some(ranks.start),
            None => None,
        };
        Ok(PinnedRank {
            index: resolved.unwrap_or(ranks.start),
            resolved: resolved.is_some(),
            by: pin.by,
        })
    }

    /// Matches the prompt against the index, by the index's rank ids; each fleet rank reads
    /// its own ([`rank_depth`](crate::select::rank_depth)). A pinned route's walk follows its
    /// rank alone. A pruning route reads few ranks, the deep ones: the walk's first run
    /// (shared by many ranks, as a system prompt is) is kept to be read when asked for. A
    /// route that reads every rank (no pruning, or no credit for cached blocks, as in decode,
    /// so no least winning overlap) has every rank written as the walk goes.
    #[inline(always)]
    fn match_prompt(
        &self,
        locals: &[LocalHash],
        fleet: &Fleet,
        plan: &Plan<'_>,
        weights: &Weights,
        depths: &mut RankDepths,
    ) {
        let credit = weights
            .credits
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        depths.set_eager(!plan.prune || credit.is_nan() || credit <= 0.0);
        match plan.pinned.and_then(|p| fleet.ranks[p.index].index_key) {
            Some(key) => self.reader.find_depth_of_into(locals, key.id, depths),
            None => self
                .reader
                .find_depths_into(locals, MatchOptions::default(), depths),
        }
    }

    /// Raises the match from the router's own records (approximate mode, speculation) to
    /// their depth, as device blocks; the index's overlap stands where it is deeper. Where
    /// only the winner matters, the deepest eligible rank is scored on the index's overlap
    /// alone first: records shallower than any overlap that could beat it are not read
    /// ([`Scorer::least_winning_blocks`]; the rank's cost without its records is no lower than
    /// with them, so the depth found is no higher than it would be with them). Returns that
    /// rank, for the gather to score first.
    #[inline(always)]
    fn raise_from_records(
        &self,
        input: ScoreInput<'_>,
        plan: &Plan<'_>,
        prompt: &mut Prompt,
        depths: &mut RankDepths,
        scratch: &mut Vec<Scored>,
    ) -> Option<usize> {
        if self.approx.is_empty() || prompt.locals.is_empty() {
            return None;
        }
        let mut known_seed = None;
        let mut least = 0;
        if plan.prune && plan.pinned.is_none() {
            let first = Scorer::new(input, depths, None);
            let e = plan.eligible;
            let (seed, blocks) = first.least_after_seed(e.role, e.allowed, e.required, scratch);
            known_seed = seed;
            least = blocks.unwrap_or(0);
        } else if let Some(p) = plan.pinned {
            // Only the pinned rank's overlap matters: records no deeper than what the index
            // gives it change nothing.
            least = rank_depth_unchecked(&input.fleet.ranks[p.index], depths)
                .map_or(0, |(_, d)| d.blocks)
                .saturating_add(1);
        }
        let now = plan.now.get_or(None);
        if self
            .approx
            .lookup_over(&prompt.locals, &mut prompt.marks, now, least, depths)
        {
            bump(&self.counters.approx_raised);
        }
        known_seed
    }

    /// The role a request of `phase` is served by, and the fallback taken to find it (with
    /// optional disaggregation and no prefill worker, prefill goes to aggregated workers; a
    /// whole request in a fleet with decode workers and no aggregated one goes to a decode
    /// worker; a decode-phase request in a fleet with no decode worker, to an aggregated one).
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
        let has = |role: WorkerRole| fleet.ranks.iter().any(|r| r.role == role);
        if role == WorkerRole::Aggregated && !has(WorkerRole::Aggregated) && has(WorkerRole::Decode)
        {
            // A fleet of prefill and decode workers serves a whole request on a decode worker.
            return (WorkerRole::Decode, Some(Fallback::AggregatedToDecode));
        }
        if role == WorkerRole::Decode && !has(WorkerRole::Decode) && has(WorkerRole::Aggregated) {
            return (WorkerRole::Aggregated, Some(Fallback::DecodeToAggregated));
        }
        if role == WorkerRole::Prefill
            && self.config.disaggregation == Disaggregation::Optional
            && !has(WorkerRole::Prefill)
        {
            if !has(WorkerRole::Aggregated) && has(WorkerRole::Decode) {
                return (WorkerRole::Decode, Some(Fallback::AggregatedToDecode));
            }
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

/// The mean context ([`LoadView::context_load`](crate::LoadView::context_load)) of the fleet's
/// ranks of `role` (∞ without one), from the role's running total: no scan of the ranks.
fn mean_context(registry: &crate::registry::Registry, fleet: &Fleet, role: WorkerRole) -> f64 {
    match fleet.ranks_of(role) {
        0 => f64::INFINITY,
        n => registry.role_context(role) as f64 / n as f64,
    }
}
