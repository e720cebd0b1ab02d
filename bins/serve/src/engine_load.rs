//! The engines' own word on their load, for a replica that cannot hear the fleet's other
//! replicas. While the booking sync is down, each replica's bookings are only its own share
//! of what the engines run; so every [`EVERY`] each engine's `/metrics` is read, its KV-cache
//! usage turned into blocks (usage × its `kv_blocks`), and the router told them
//! ([`Router::set_engine_blocks`]): blocks past this replica's bookings weigh in its choices.
//! When the sync is back, the engines' word is forgotten and the shared bookings are the load
//! again.
//!
//! ```text
//!  sync down ──▶ every 1 s: GET engine/metrics ──▶ kv usage × kv_blocks ──▶ set_engine_blocks
//!  sync up   ──▶ clear_engine_blocks (once)
//! ```
//!
//! The gauges read: vLLM's `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before
//! 0.10), per data-parallel engine by its `engine` label; SGLang's `sglang:token_usage`, by
//! its `dp_rank` label. An engine whose metrics cannot be read keeps its last figure.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{Router, WorkerRank};
use tokio::task::JoinHandle;

use crate::backends::{Backend, Backends};
use crate::upstream::{read_all, Upstream};

/// How often the engines are read while the sync is down.
pub(crate) const EVERY: Duration = Duration::from_secs(1);

/// Longest a read of one engine's metrics may take.
const READ_TIMEOUT: Duration = Duration::from_millis(500);

/// The gauges of KV-cache usage (a share, 0 to 1) and the label naming the data-parallel rank.
const USAGE_GAUGES: [(&str, &str); 3] = [
    ("vllm:kv_cache_usage_perc", "engine"),
    ("vllm:gpu_cache_usage_perc", "engine"),
    ("sglang:token_usage", "dp_rank"),
];

/// Reads the engines while `local()` says this replica hears no other, and tells `router`.
pub(crate) fn start(
    router: Arc<Router>,
    backends: Arc<Backends>,
    client: Upstream,
    local: impl Fn() -> bool + Send + 'static,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut told = false;
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            if !local() {
                if told {
                    router.clear_engine_blocks();
                    told = false;
                    tracing::info!("booking sync up: the engines' reported load set aside");
                }
                continue;
            }
            if !told {
                tracing::info!("booking sync down: the engines' reported load counts");
                told = true;
            }
            // All at once: an engine that hangs holds up none of the others.
            let all = backends.all();
            let read = futures_util::future::join_all(all.iter().map(|b| read(&client, b))).await;
            for (backend, usage) in all.iter().zip(read) {
                for (rank, blocks) in usage.map_or_else(Vec::new, |u| blocks_by_rank(&u, backend)) {
                    router.set_engine_blocks(WorkerRank::new(backend.spec.id, rank), blocks);
                }
            }
        }
    })
}

/// The engine's usage gauges, or none when its metrics cannot be read in time.
async fn read(client: &Upstream, backend: &Backend) -> Option<Vec<(Option<u32>, f64)>> {
    let answer = tokio::time::timeout(READ_TIMEOUT, async {
        let response = client.get(backend.urls.metrics.clone()).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        read_all(response.into_body()).await.ok()
    })
    .await
    .ok()??;
    let text = std::str::from_utf8(&answer).ok()?;
    let usage = usage_gauges(text);
    (!usage.is_empty()).then_some(usage)
}

/// Blocks in use per rank of `backend`: a gauge naming its rank goes to that rank; one naming
/// none is the whole engine's, shared evenly over its ranks.
fn blocks_by_rank(usage: &[(Option<u32>, f64)], backend: &Backend) -> Vec<(u32, u64)> {
    let (ranks, blocks) = (backend.spec.dp_size.max(1), backend.spec.kv_blocks);
    let to_blocks = |share: f64| (share.clamp(0.0, 1.0) * blocks as f64).round() as u64;
    let mut out = Vec::new();
    for &(rank, share) in usage {
        match rank {
            Some(r) if r < ranks => out.push((r, to_blocks(share))),
            Some(_) => {}
            None => out.extend((0..ranks).map(|r| (r, to_blocks(share)))),
        }
    }
    out
}

/// The KV-cache usage gauges of a Prometheus text page: (the rank its label names, the share
/// in use), for the first gauge name of [`USAGE_GAUGES`] the page has.
pub(crate) fn usage_gauges(text: &str) -> Vec<(Option<u32>, f64)> {
    for (name, rank_label) in USAGE_GAUGES {
        let found: Vec<(Option<u32>, f64)> = text
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(name)?;
                let (labels, value) = match rest.strip_prefix('{') {
                    Some(r) => r.split_once('}')?,
                    None if rest.starts_with(' ') => ("", rest),
                    None => return None,
                };
                let value: f64 = value.split_whitespace().next()?.parse().ok()?;
                if !value.is_finite() {
                    return None;
                }
                Some((
                    label(labels, rank_label).and_then(|v| v.parse().ok()),
                    value,
                ))
            })
            .collect();
        if !found.is_empty() {
            return found;
        }
    }
    Vec::new()
}

/// The value of label `key` in a Prometheus label set (`a="1",b="x"`).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

#[cfg(test)]
mod tests {
    use super::usage_gauges;

    #[test]
    fn usage_is_read_from_vllm_and_sglang_pages_by_rank() {
        let vllm = "# HELP vllm:kv_cache_usage_perc KV-cache usage.\n\
                    # TYPE vllm:kv_cache_usage_perc gauge\n\
                    vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
                    vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n\
                    vllm:num_requests_running{engine=\"0\"} 3\n";
        assert_eq!(usage_gauges(vllm), [(Some(0), 0.25), (Some(1), 0.5)]);
        let older = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.125\n";
        assert_eq!(usage_gauges(older), [(None, 0.125)]);
        let sglang = "sglang:token_usage{dp_rank=\"2\",model_name=\"m\"} 0.75\n";
        assert_eq!(usage_gauges(sglang), [(Some(2), 0.75)]);
        let bare = "sglang:token_usage 0.1\n";
        assert_eq!(usage_gauges(bare), [(None, 0.1)]);
        // Other gauges, a longer name with the same start, garbage and NaN: nothing.
        for page in [
            "vllm:num_requests_running 4\n",
            "vllm:kv_cache_usage_perc_total 0.5\n",
            "vllm:kv_cache_usage_perc{engine=\"0\"} lots\n",
            "vllm:kv_cache_usage_perc NaN\n",
            "",
        ] {
            assert!(usage_gauges(page).is_empty(), "{page:?}");
        }
    }
}
