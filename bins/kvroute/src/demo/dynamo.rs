//! NVIDIA Dynamo's `DefaultWorkerSelector` (crate `dynamo-kv-router`) as a [`Picker`]: the
//! peer's own cost function and tie-breaking on the same simulated fleet, fed what its
//! scheduler would compute per request from the router's index and load ledger.
//!
//! Per request: the prompt's overlap with every rank per tier, the tier-weighted effective
//! blocks and cached tokens (weights 1, 0.75 and 0.25, both routers' defaults), and each rank's
//! load projection (prefill tokens, decode blocks, requests, and the prompt's blocks not
//! already active there). Its choice is booked through the router as a pin.

use std::collections::HashMap;
use std::fmt;

use dynamo_kv_router::protocols::{RoutingConstraints, WorkerConfigLike, WorkerWithDpRank};
use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode, SchedulingRequest};
use dynamo_kv_router::selector::{DefaultWorkerSelector, WorkerSelectionInput, WorkerSelector};
use dynamo_kv_router::{KvRouterConfig, WorkerLoadProjection};
use kvroute_core::{
    BlockHasher, MatchOptions, OverlapScores, RequestId, RouteError, Router, WorkerRank,
};

use kvroute_sim::Picker;

/// What Dynamo's selector reads of a worker.
#[derive(Debug, Clone, Copy)]
struct PeerWorker {
    kv_blocks: u64,
    max_batched_tokens: u64,
}

impl WorkerConfigLike for PeerWorker {
    fn data_parallel_start_rank(&self) -> u32 {
        0
    }
    fn data_parallel_size(&self) -> u32 {
        1
    }
    fn max_num_batched_tokens(&self) -> Option<u64> {
        Some(self.max_batched_tokens)
    }
    fn total_kv_blocks(&self) -> Option<u64> {
        Some(self.kv_blocks)
    }
}

/// Dynamo's default selector over a fleet of identical single-rank workers.
pub struct DynamoPicker {
    selector: DefaultWorkerSelector,
    workers: HashMap<u64, PeerWorker>,
    hasher: BlockHasher,
    block_size: u32,
    scores: OverlapScores,
}

impl fmt::Debug for DynamoPicker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoPicker")
            .field("workers", &self.workers.len())
            .field("block_size", &self.block_size)
            .finish_non_exhaustive()
    }
}

impl DynamoPicker {
    /// A selector for workers `0..workers`, each with `kv_blocks` blocks of `block_size`
    /// tokens and a pass budget of `max_batched_tokens`; its random draws seeded by `seed`.
    pub fn new(
        workers: usize,
        kv_blocks: u64,
        max_batched_tokens: u64,
        block_size: u32,
        seed: u64,
    ) -> Self {
        let peer = PeerWorker {
            kv_blocks,
            max_batched_tokens,
        };
        DynamoPicker {
            selector: DefaultWorkerSelector::new_seeded(
                Some(KvRouterConfig::default()),
                "decode",
                seed,
            ),
            workers: (0..workers as u64).map(|w| (w, peer)).collect(),
            hasher: BlockHasher::new(block_size as usize),
            block_size,
            scores: OverlapScores::default(),
        }
    }

    /// The scheduling request Dynamo's scheduler would build for `tokens`.
    fn request(&mut self, router: &Router, tokens: &[u32]) -> SchedulingRequest {
        let locals = self.hasher.local_hashes(tokens);
        let bs = self.block_size as usize;
        let blocks = tokens.len().div_ceil(bs);
        router
            .index_reader()
            .find_matches_into(&locals, MatchOptions::default(), &mut self.scores);
        let mut overlap = OverlapSignals::default();
        for s in &self.scores.scores {
            let w = WorkerWithDpRank::new(s.rank.worker.0, s.rank.dp_rank.0);
            let [device, host, disk, external] = s.per_tier.map(|b| b as usize);
            let effective = device as f64 + 0.75 * host as f64 + 0.25 * (disk + external) as f64;
            let t = &mut overlap.tier_overlap_blocks;
            t.device.insert(w, device);
            t.host_pinned.insert(w, host);
            t.disk.insert(w, disk + external);
            overlap.effective_overlap_blocks.insert(w, effective);
            overlap
                .effective_cached_tokens
                .insert(w, ((effective * bs as f64) as usize).min(tokens.len()));
        }
        let mut request = SchedulingRequest {
            mode: ScheduleMode::QueryOnly { request_id: None },
            token_seq: None,
            isl_tokens: tokens.len(),
            lora_name: None,
            expected_output_tokens: None,
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: None,
            routing_constraints: RoutingConstraints::default(),
            router_config_override: None,
            track_prefill_tokens: true,
            priority_jump: 0.0,
            strict_priority: 0,
            policy_class: None,
            session_context: None,
            overlap,
            kv_transfer_candidates: None,
            retain_kv_transfer_chain: false,
            shared_cache_hits: None,
            worker_loads: Default::default(),
            resp_tx: None,
        };
        let fleet = router.fleet();
        for rank in &fleet.ranks {
            let Some(load) = router.load(rank.rank) else {
                continue;
            };
            let shared = rank.state.try_shared_prefix_blocks(&locals).unwrap_or(0);
            request.worker_loads.insert(
                WorkerWithDpRank::new(rank.rank.worker.0, rank.rank.dp_rank.0),
                WorkerLoadProjection {
                    active_prefill_tokens: load.prefill_tokens as usize,
                    active_decode_blocks: load.decode_blocks() as usize,
                    active_requests: load.requests as usize,
                    additional_active_blocks: blocks.saturating_sub(shared),
                },
            );
        }
        request
    }
}

impl Picker for DynamoPicker {
    fn pick(
        &mut self,
        router: &Router,
        id: RequestId,
        tokens: &[u32],
    ) -> Result<WorkerRank, RouteError> {
        let request = self.request(router, tokens);
        let input = WorkerSelectionInput::configured(
            &self.workers,
            &request,
            request.eligibility(),
            self.block_size,
        );
        let chosen = self
            .selector
            .select_worker(input)
            .map_err(|_| RouteError::NoWorkers { request: id })?;
        Ok(WorkerRank::new(
            chosen.worker.worker_id,
            chosen.worker.dp_rank,
        ))
    }
}
