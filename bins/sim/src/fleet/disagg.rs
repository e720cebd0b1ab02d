//! A split request's way through the fleet: routed to a prefill engine, one token there, its
//! prompt's KV across the link, then routed to a decode engine and admitted with the KV
//! handed over.
//!
//! ```text
//!  arrive_split ──route (prefill phase)──▶ prefill engine: max_tokens 1
//!       prefill_output (its token): its booking freed, its blocks held ──▶ transfers (ends at
//!       now + link time)
//!  hand_over: the prefill engine's blocks released ──route (decode phase)──▶ decode engine:
//!       admit_transferred ──▶ outputs as usual
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::{Phase, Pinned, RequestId, RouteHints, RouteRequest, Router, WorkerRank};

use super::{Arrival, Fleet, FleetError, Split};
use crate::request::{EngineRequest, RequestOutput};

/// How a request enters an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Admit {
    /// Served whole there.
    Whole,
    /// A split request's prefill: its blocks stay in use after its one token, until its
    /// transfer ends.
    Prefill,
    /// A split request's decode, its prompt's KV handed over.
    Transferred,
}

/// A split request between its two engines: what its decode half needs.
#[derive(Clone, Debug)]
pub(super) struct Handoff {
    id: RequestId,
    prompt: Vec<u32>,
    max_output_tokens: u32,
    arrival: Duration,
    /// The router that routed its prefill, which routes its decode too.
    replica: usize,
    /// The prefill engine, which holds the prompt's blocks until the transfer ends.
    prefill: usize,
}

impl Fleet {
    /// The decode engine that serves `arrival` whole under conditional disaggregation
    /// ([`Router::whole_on_decode`]), as `router` sees the fleet.
    pub(super) fn local_decode(
        &self,
        router: &Router,
        arrival: &Arrival,
        split: Split,
    ) -> Option<WorkerRank> {
        let conditional = split.conditional?;
        let request = RouteRequest {
            id: arrival.id,
            tokens: &arrival.prompt,
            hints: RouteHints::default(),
        };
        router
            .whole_on_decode(&request, &conditional)
            .map(|(rank, _)| rank)
    }

    /// A split arrival: routed by router `replica` to a prefill engine and admitted there for
    /// one token.
    pub(super) fn arrive_split(
        &mut self,
        replica: usize,
        arrival: Arrival,
        oracle_cached: u32,
        started: Instant,
    ) -> Result<(), FleetError> {
        let at = self.now;
        let request = RouteRequest {
            id: arrival.id,
            tokens: &arrival.prompt,
            hints: RouteHints {
                phase: Phase::Prefill,
                expected_output_tokens: Some(1),
                ..RouteHints::default()
            },
        };
        let router = Arc::clone(&self.routers[replica]);
        let (decision, guard) = self.route_dispatched(router, &request, Some(started))?;
        self.admit_arrival(decision.worker, &arrival, Admit::Prefill)?;
        let prefill = decision.worker.worker.0 as usize;
        self.record(&arrival, &decision, oracle_cached, Some(decision.worker));
        self.guards.insert(arrival.id, guard);
        self.prefilling.insert(
            arrival.id,
            Handoff {
                id: arrival.id,
                prompt: arrival.prompt,
                max_output_tokens: arrival.max_output_tokens,
                arrival: at,
                replica,
                prefill,
            },
        );
        Ok(())
    }

    /// The prefill engine's token for a split request: its booking is freed, and the prompt's
    /// KV starts across the link (the engine holds its blocks until the transfer ends).
    pub(super) fn prefill_output(&mut self, output: &RequestOutput) -> Result<(), FleetError> {
        if output.finish.is_none() {
            return Ok(());
        }
        let Some(handoff) = self.prefilling.remove(&output.id) else {
            return Ok(());
        };
        if let Some(guard) = self.guards.remove(&output.id) {
            guard.prefill_done()?;
            guard.finish()?;
        }
        if let Some(&i) = self.record_of.get(&output.id) {
            let record = &mut self.records[i];
            record.cached = output.cached_tokens;
            let worker = record.worker.worker.0 as usize;
            if let Some(active) = self.active_tokens.get_mut(worker) {
                *active = active.saturating_sub(u64::from(record.prompt_tokens));
            }
        }
        let Some(split) = self.split else {
            if let Some(engine) = self.engines.get_mut(handoff.prefill) {
                engine.release_held(handoff.id);
            }
            return Ok(());
        };
        let block = self.hasher.block_size();
        let full = (handoff.prompt.len().saturating_sub(1) / block * block) as u64;
        let ends = self.now + split.transfer.duration(full);
        self.transfers
            .insert((ends, self.transfers_started), handoff);
        self.transfers_started += 1;
        Ok(())
    }

    /// The first transfer ending at `at`: the prefill engine's blocks released, its request
    /// routed to a decode engine and admitted there with its KV.
    pub(super) fn hand_over(&mut self, at: Duration) -> Result<(), FleetError> {
        let Some((_, handoff)) = self.transfers.pop_first() else {
            return Ok(());
        };
        self.set_time(at);
        if let Some(engine) = self.engines.get_mut(handoff.prefill) {
            engine.release_held(handoff.id);
        }
        let request = RouteRequest {
            id: handoff.id,
            tokens: &handoff.prompt,
            hints: RouteHints {
                phase: Phase::Decode,
                expected_output_tokens: Some(handoff.max_output_tokens),
                pinned: Pinned::default(),
                ..RouteHints::default()
            },
        };
        let router = Arc::clone(&self.routers[handoff.replica]);
        let (decision, guard) = self.route_dispatched(router, &request, None)?;
        let worker = decision.worker.worker.0 as usize;
        self.admit_on(
            worker,
            EngineRequest {
                id: handoff.id,
                prompt: handoff.prompt.clone(),
                max_output_tokens: handoff.max_output_tokens,
                arrival: handoff.arrival,
                cache_salt: None,
            },
            Admit::Transferred,
        )?;
        if let Some(&i) = self.record_of.get(&handoff.id) {
            self.records[i].worker = decision.worker;
        }
        self.active_tokens[worker] += handoff.prompt.len() as u64;
        self.guards.insert(handoff.id, guard);
        Ok(())
    }

    /// Admits `request` to engine `worker` as `how` says, and starts a pass there if it was
    /// idle.
    pub(super) fn admit_on(
        &mut self,
        worker: usize,
        request: EngineRequest,
        how: Admit,
    ) -> Result<(), FleetError> {
        let now = self.now;
        let idle = !self.in_pass[worker];
        let engine = self.engines.get_mut(worker).ok_or(FleetError::Config {
            reason: "the router chose a worker the fleet does not have",
        })?;
        if idle {
            // Idle: its clock stands at its last pass's end; it starts now.
            engine.advance_to(now);
        }
        match how {
            Admit::Whole => engine.admit(request)?,
            Admit::Prefill => {
                let id = request.id;
                engine.admit(request)?;
                engine.hold_when_finished(id)?;
            }
            Admit::Transferred => engine.admit_transferred(request)?,
        }
        if idle {
            self.start_pass(worker);
        }
        Ok(())
    }
}
