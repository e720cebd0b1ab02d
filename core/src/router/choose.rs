//! The route's selection step: the pinned rank alone, or every eligible rank gathered,
//! probed for prompt blocks already active on it, vetoed when unhealthy or busy, and picked
//! (or told to wait).

use std::sync::atomic::Ordering;

use super::plan::{Gate, PinnedRank, Plan};
use super::scratch::Candidates;
use super::{
    bump, Bookkeeping, DecidedBy, Decision, EvidenceLevel, Fallback, Mode, RouteError,
    RouteRequest, Router,
};
use crate::hash::LocalHash;
use crate::rng::Rng;
use crate::select::{
    filter_busy, filter_unhealthy, BusyOutcome, Candidate, HealthOutcome, LeastLoaded, PolicyKind,
    ProbeTargets, Scored, Scorer, SelectInput, Selector,
};
use crate::session::SessionRouting;

/// What selection chose, or that the request must wait. Returned once per route, on the
/// stack: the size is no cost worth a box.
#[allow(clippy::large_enum_variant)]
pub(super) enum Selected {
    Chosen(Choice),
    Wait { new_prefill_tokens: u64 },
}

/// The chosen rank and why.
pub(super) struct Choice {
    pub(super) candidate: Candidate,
    pub(super) by: DecidedBy,
    pub(super) evidence: Option<Vec<Candidate>>,
    pub(super) fallback: Option<Fallback>,
}

impl Choice {
    /// The decision on `req`: booked, unless query-only or pinned to a worker's ranks without
    /// naming one of them.
    #[inline(always)]
    pub(super) fn decision(
        self,
        req: &RouteRequest<'_>,
        block_size: u32,
        pinned: Option<PinnedRank>,
        session: Option<SessionRouting>,
    ) -> Decision {
        let c = self.candidate;
        let bs = u64::from(block_size);
        let computable = req.prompt_tokens().saturating_sub(1) / bs.max(1) * bs;
        let held = u64::from(c.overlap.blocks.max(c.cost.shared_blocks)) * bs;
        Decision {
            request: req.id,
            worker: c.rank,
            overlap: c.overlap,
            predicted_cached_tokens: held.min(computable),
            cost: c.cost,
            load: c.load,
            decided_by: self.by,
            fallback: self.fallback,
            bookkeeping: match (req.hints.mode, pinned) {
                (Mode::QueryOnly, _) => Bookkeeping::QueryOnly,
                (Mode::Book, Some(p)) if !p.resolved => Bookkeeping::UntrackedDpRankUnresolved,
                (Mode::Book, _) => Bookkeeping::Booked,
            },
            expected_output_tokens: req.hints.expected_output_tokens,
            session,
            evidence: self.evidence,
        }
    }
}

impl Router {
    /// Scores the pinned rank alone (probing it for prompt blocks already active on it).
    #[inline(always)]
    pub(super) fn select_pinned(
        &self,
        scorer: &Scorer<'_>,
        plan: &Plan<'_>,
        p: PinnedRank,
        locals: &[LocalHash],
        kept: &mut Vec<Scored>,
    ) -> Choice {
        kept.clear();
        kept.push(scorer.score(p.index));
        if plan.probe {
            let mut targets = ProbeTargets::new(scorer.shape.full_blocks);
            targets.offer(0, &kept[0]);
            self.probe_shared(scorer, targets.targets(), locals, kept);
        }
        let c = scorer.candidate(&kept[0]);
        Choice {
            candidate: c,
            by: p.by,
            evidence: (plan.evidence == EvidenceLevel::Full).then(|| vec![c]),
            fallback: None,
        }
    }

    /// Selects among every eligible rank: gather the candidates, probe the ones that could
    /// be cheapest for active prompt blocks, veto the unhealthy and the busy, then wait (when
    /// the gate says so) or pick.
    #[inline(always)]
    pub(super) fn select(
        &self,
        scorer: &Scorer<'_>,
        plan: &Plan<'_>,
        locals: &[LocalHash],
        c: &mut Candidates,
        rng: &mut Rng,
    ) -> Result<Selected, RouteError> {
        let targets = self.gather(scorer, plan, c)?;
        self.probe_shared(scorer, targets.targets(), locals, &mut c.kept);
        let evidence = (plan.evidence == EvidenceLevel::Full)
            .then(|| c.kept.iter().map(|k| scorer.candidate(k)).collect());
        let outcome = self.veto(scorer, &mut c.kept);
        let waits = plan.mode == Mode::Book
            && match plan.gate {
                Gate::Immediate => false,
                Gate::IfFree => outcome == Some(BusyOutcome::AllBusy),
                Gate::Behind => outcome.is_some(),
            };
        if waits {
            let best = c.kept.iter().map(|k| k.overlap_blocks).max();
            let cached = u64::from(best.unwrap_or(0)) * u64::from(self.config.block_size);
            return Ok(Selected::Wait {
                new_prefill_tokens: scorer.shape.tokens.saturating_sub(cached),
            });
        }
        let (pick, by) = self.pick(scorer, plan, outcome, c, rng);
        Ok(Selected::Chosen(Choice {
            candidate: scorer.candidate(&pick),
            by,
            evidence,
            fallback: plan.fallback,
        }))
    }

    /// Scores every eligible rank into `c.kept` (a pruning gather keeps only those that can
    /// win); returns the ranks to probe. No candidate is an error: no eligible worker when
    /// some lacked a required label, no workers otherwise.
    #[inline(always)]
    fn gather(
        &self,
        scorer: &Scorer<'_>,
        plan: &Plan<'_>,
        c: &mut Candidates,
    ) -> Result<ProbeTargets, RouteError> {
        let e = plan.eligible;
        c.kept.clear();
        c.kept.reserve(scorer.fleet.ranks.len());
        let full_blocks = if plan.probe {
            scorer.shape.full_blocks
        } else {
            0
        };
        let mut targets = ProbeTargets::new(full_blocks).pruning(plan.prune);
        let unlabelled = scorer.gather(e.role, e.allowed, e.required, &mut c.kept, &mut targets);
        // Loads read in vain say the booked-prefill floor may lag the fleet's loads: once they
        // add up to some sixteen reads of every rank, read every rank twice to raise it (a
        // refresh then costs at most an eighth of what triggered it). Each route selecting
        // over the fleet (neither pinned nor session-bound, which read no floor) counts as
        // four such reads as well: a floor left low (by joins, by releases) also weakens what
        // selection prunes before any load is read (the records' least depth, the ranks
        // visited), so it rises within four such routes per rank even when no load is read in
        // vain, at half a read per route.
        c.loaded_losers += u64::from(targets.loaded_losers()) + 4;
        if c.loaded_losers > 16 * scorer.fleet.ranks.len() as u64 {
            c.loaded_losers = 0;
            self.refresh_prefill_floor();
        }
        if c.kept.is_empty() {
            let request = plan.request;
            if unlabelled > 0 {
                bump(&self.counters.no_eligible);
                return Err(RouteError::NoEligibleWorker { request });
            }
            bump(&self.counters.no_workers);
            return Err(RouteError::NoWorkers { request });
        }
        Ok(targets)
    }

    /// Leaves out the candidates whose worker is marked unhealthy (counted per reason), then
    /// the busy ones; `None` when every candidate was marked.
    #[inline(always)]
    fn veto(&self, scorer: &Scorer<'_>, kept: &mut Vec<Scored>) -> Option<BusyOutcome> {
        let health = if scorer.health_on {
            filter_unhealthy(kept)
        } else {
            HealthOutcome::Filtered {
                unreachable: 0,
                wedged: 0,
            }
        };
        match health {
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
                    filter_busy(kept)
                } else {
                    BusyOutcome::Filtered
                })
            }
        }
    }

    /// Picks among the candidates left: the least loaded when every one was marked or busy;
    /// otherwise a warming rank on a cache miss (warm-up's share), else the policy's choice.
    #[inline(always)]
    fn pick(
        &self,
        scorer: &Scorer<'_>,
        plan: &Plan<'_>,
        outcome: Option<BusyOutcome>,
        c: &mut Candidates,
        rng: &mut Rng,
    ) -> (Scored, DecidedBy) {
        let input = SelectInput {
            candidates: &c.kept,
            ranks: &scorer.fleet.ranks,
            shape: scorer.shape,
            block_size: self.config.block_size,
            temperature: plan.temperature,
            near_tie: self.config.near_tie,
        };
        match outcome {
            None => (
                c.kept[LeastLoaded.select(&input, rng)],
                DecidedBy::FallbackAllUnhealthy,
            ),
            Some(BusyOutcome::AllBusy) => {
                bump(&self.counters.all_busy);
                (
                    c.kept[LeastLoaded.select(&input, rng)],
                    DecidedBy::FallbackAllBusy,
                )
            }
            Some(BusyOutcome::Filtered) => {
                let by = match self.selector.kind() {
                    PolicyKind::KvAware => DecidedBy::Cost,
                    k => DecidedBy::Policy(k),
                };
                match self.warm_candidate(scorer, plan, &c.kept, &mut c.unpruned, rng) {
                    Some(w) => (w, DecidedBy::WarmUp),
                    None => {
                        // An embedder's selector may answer out of range: the first, then.
                        let i = self.selector.select(&input, rng);
                        (c.kept.get(i).copied().unwrap_or(c.kept[0]), by)
                    }
                }
            }
        }
    }

    /// Warm-up's pick among the free, healthy candidates on a cache miss. After a pruned
    /// gather, a pruned rank may hold a block: warm-up's pick then sees every free, healthy
    /// candidate (there are some: a pruned gather keeps the cheapest of them).
    #[inline(always)]
    fn warm_candidate(
        &self,
        scorer: &Scorer<'_>,
        plan: &Plan<'_>,
        kept: &[Scored],
        unpruned: &mut Vec<Scored>,
        rng: &mut Rng,
    ) -> Option<Scored> {
        let miss = !kept.iter().any(|k| k.overlap_blocks > 0);
        if plan.prune && self.warming(plan.now) && miss {
            let e = plan.eligible;
            let all = unpruned;
            all.clear();
            let mut targets = ProbeTargets::new(0);
            scorer.gather(e.role, e.allowed, e.required, all, &mut targets);
            if scorer.health_on {
                filter_unhealthy(all);
            }
            if scorer.busy_on {
                filter_busy(all);
            }
            self.warm_pick(scorer.fleet, all, plan.now, rng)
                .map(|i| all[i])
        } else {
            self.warm_pick(scorer.fleet, kept, plan.now, rng)
                .map(|i| kept[i])
        }
    }

    /// Probes `targets` (candidates whose cost could fall to the cheapest, [`ProbeTargets`])
    /// for the prompt blocks already active on their rank, and lowers their cost by them.
    fn probe_shared(
        &self,
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
            match scorer.fleet.ranks[c.fleet_index as usize]
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
}
