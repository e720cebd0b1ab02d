//! `kvroute replay`: a workload (a Mooncake-format trace or the built-in chat workload) sent
//! to a live router or engine over HTTP, open loop at the workload's times ÷ the speed-up or
//! closed loop at a concurrency, streaming, and what came back in figures.
//!
//! ```text
//!  Workload ──at its times (or N at a time)──▶ POST /v1/completions (token ids, streamed)
//!     each answer: first chunk (TTFT), chunks (ITL), end (latency), usage.cached_tokens,
//!     kvroute's x-kvroute-worker / x-kvroute-predicted-cached-tokens headers
//!  ──▶ ReplayReport: hit rate, TTFT, ITL, latency, throughput, imbalance, prediction accuracy
//!  with --oracle-worker URL...: the same body to each worker's POST /admin/cached at sending
//!  ──▶ the most prompt tokens any worker held: the oracle's hit rate
//! ```
//!
//! Prompts are sent as token ids, so every router and engine sees the same tokens and no
//! tokenizer is needed. The hit rate is the engines' own (`cached_tokens` ÷ prompt tokens).
//! Load imbalance and prediction accuracy need to know where each request went: kvroute serve
//! says so in its response headers; other routers leave them out. The oracle needs workers that
//! answer `POST /admin/cached` (`kvroute worker`), whichever router is in front of them: all
//! are asked, and have answered, just before the request is sent (its send time and TTFT start
//! after that), so the request's own blocks are not yet anywhere.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::Semaphore;

use kvroute_sim::workload::{Workload, WorkloadRequest};

use kvroute_serve::headers;
use kvroute_serve::openai::{CompletionRequest, PromptOut, StreamOptions};

/// How to replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// The router's (or engine's) base URL.
    pub url: String,
    /// The model name sent (none: no `model` field).
    pub model: Option<String>,
    /// Closed loop at this many requests in flight (none: open loop at the workload's times).
    pub concurrency: Option<usize>,
    /// Longest a request may take.
    pub timeout: Duration,
    /// Bearer key, when the router wants one.
    pub api_key: Option<String>,
    /// Send text instead of token ids: each prompt decoded with this model's tokenizer, for
    /// routers that take text only. The engines then tokenize it themselves, and the record's
    /// prompt tokens are the engine's count (`usage.prompt_tokens`).
    pub text: Option<std::sync::Arc<kvroute_text::ModelText>>,
    /// Base URLs of the workers behind the router, asked at each sending how many of the
    /// prompt's tokens they hold (`POST /admin/cached`): the oracle. Empty: no oracle.
    pub oracle: Vec<String>,
}

/// What happened to one request.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ReplayRecord {
    /// Its position in the workload.
    pub index: usize,
    /// When it was sent, from the replay's start.
    pub sent_ms: f64,
    /// Time to its first chunk.
    pub ttft_ms: Option<f64>,
    /// Time to its end.
    pub latency_ms: Option<f64>,
    /// Chunks that carried text.
    pub chunks: u32,
    /// Prompt tokens sent.
    pub prompt_tokens: u32,
    /// Tokens generated (the usage's, else the chunks counted).
    pub output_tokens: u32,
    /// The engine's `cached_tokens`.
    pub cached_tokens: u32,
    /// The worker kvroute chose.
    pub worker: Option<u64>,
    /// The prompt tokens kvroute predicted cached there.
    pub predicted_cached_tokens: Option<u64>,
    /// How long kvroute's decision took, µs.
    pub decision_us: Option<f64>,
    /// How long kvroute took to read and tokenize the prompt, µs.
    pub prompt_read_us: Option<f64>,
    /// The most prompt tokens any worker held as the request was sent (with an oracle; none
    /// when a worker did not say).
    pub oracle_cached_tokens: Option<u32>,
    /// Oracle workers that could not be reached for this request (counted as holding none).
    pub oracle_unreachable: u32,
    /// HTTP status (0: no answer).
    pub status: u16,
    /// Why it failed, when it did.
    pub error: Option<String>,
}

/// The run in figures.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ReplayReport {
    /// Requests sent.
    pub requests: usize,
    /// Requests that ended with a 2xx and a whole answer.
    pub ok: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Engines' cached prompt tokens ÷ prompt tokens (answered requests).
    pub hit_rate: f64,
    /// The oracle's: the most any worker held at each sending ÷ prompt tokens, over the
    /// answered requests that every worker answered for (0 without an oracle).
    pub oracle_hit_rate: f64,
    /// The hit rate over the same requests ÷ the oracle's (0 without an oracle). It can pass
    /// 1: a request that waits in its engine finds blocks stored after it was sent.
    pub hit_over_oracle: f64,
    /// Answered requests left out of the oracle's figures: a worker did not say.
    pub oracle_missing: usize,
    /// Questions to oracle workers that found no worker (counted as holding none: a killed
    /// worker, or a wrong URL).
    pub oracle_unreachable: u64,
    /// Mean time to first token, ms.
    pub ttft_mean_ms: f64,
    /// Median time to first token, ms.
    pub ttft_p50_ms: f64,
    /// 99th percentile time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Mean inter-token latency, ms.
    pub itl_mean_ms: f64,
    /// Mean request latency (send to last byte), ms.
    pub latency_mean_ms: f64,
    /// Output tokens per second of the run.
    pub throughput_tok_s: f64,
    /// The busiest worker's time-averaged active tokens ÷ the mean worker's (from kvroute's
    /// headers; 0 without them).
    pub imbalance: f64,
    /// Share of answered requests whose predicted cached tokens equal the engine's (0 without
    /// kvroute's headers).
    pub prediction_accuracy: f64,
    /// Median and 99th percentile of kvroute's decision time, µs (0 without its headers).
    pub decision_p50_us: f64,
    /// See `decision_p50_us`.
    pub decision_p99_us: f64,
    /// Median and 99th percentile of kvroute's reading and tokenizing of prompts, µs (0
    /// without its headers).
    pub prompt_read_p50_us: f64,
    /// See `prompt_read_p50_us`.
    pub prompt_read_p99_us: f64,
    /// Seconds the run took.
    pub wall_seconds: f64,
}

/// Replays `workload` against `options.url`; `progress(done, total)` after each answer.
pub async fn run(
    workload: &Workload,
    options: &ReplayOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> anyhow::Result<(Vec<ReplayRecord>, ReplayReport)> {
    run_spread(
        workload,
        options,
        std::slice::from_ref(&options.url),
        progress,
    )
    .await
}

/// [`run`], the requests handed to `urls` in turn (round robin, as a load balancer in front
/// of several routers would): request `i` goes to `urls[i % urls.len()]`, and to
/// `options.url` when `urls` is empty.
pub async fn run_spread(
    workload: &Workload,
    options: &ReplayOptions,
    urls: &[String],
    progress: &(dyn Fn(usize, usize) + Sync),
) -> anyhow::Result<(Vec<ReplayRecord>, ReplayReport)> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .timeout(options.timeout)
        .build()?;
    let total = workload.len();
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let gate = options
        .concurrency
        .map(|n| Arc::new(Semaphore::new(n.max(1))));
    let mut tasks = Vec::with_capacity(total);
    for (index, request) in workload.requests().enumerate() {
        let permit = match &gate {
            Some(gate) => Some(Arc::clone(gate).acquire_owned().await?),
            None => {
                let due = started + request.at;
                tokio::time::sleep_until(due.into()).await;
                None
            }
        };
        let client = client.clone();
        let mut options = options.clone();
        if let Some(url) = urls.get(index % urls.len().max(1)) {
            options.url.clone_from(url);
        }
        let answered = Arc::clone(&done);
        tasks.push(tokio::spawn(async move {
            let record = send(&client, &options, index, request, started).await;
            drop(permit);
            answered.fetch_add(1, Ordering::Relaxed);
            record
        }));
        progress(done.load(Ordering::Relaxed) as usize, total);
    }
    let mut records = Vec::with_capacity(total);
    for task in tasks {
        records.push(task.await?);
        progress(records.len(), total);
    }
    let report = figures(&records, started.elapsed().as_secs_f64());
    Ok((records, report))
}

async fn send(
    client: &reqwest::Client,
    options: &ReplayOptions,
    index: usize,
    request: WorkloadRequest,
    started: Instant,
) -> ReplayRecord {
    let mut record = ReplayRecord {
        index,
        prompt_tokens: request.prompt.len() as u32,
        ..ReplayRecord::default()
    };
    let text = match &options.text {
        Some(text) => match text.tokenizer.decode(&request.prompt) {
            Ok(decoded) => Some(decoded),
            Err(e) => {
                record.error = Some(kvroute_serve::with_causes(&e));
                return record;
            }
        },
        None => None,
    };
    let sending = CompletionRequest {
        model: options.model.as_deref(),
        prompt: match &text {
            Some(text) => PromptOut::Text(text),
            None => PromptOut::Ids(&request.prompt),
        },
        max_tokens: request.output_tokens,
        ignore_eos: true,
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
    };
    let body = match serde_json::to_value(&sending) {
        Ok(body) => body,
        Err(e) => {
            record.error = Some(kvroute_serve::with_causes(&e));
            return record;
        }
    };
    if !options.oracle.is_empty() {
        let oracle = oracle_cached(client, &options.oracle, &body).await;
        record.oracle_cached_tokens = oracle.best;
        record.oracle_unreachable = oracle.unreachable;
    }
    let sent = Instant::now();
    record.sent_ms = sent.duration_since(started).as_secs_f64() * 1e3;
    answer(client, options, record, &body, sent).await
}

/// How long a worker may take to answer the oracle's question.
const ORACLE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the workers said of one request's prompt.
struct OracleAnswer {
    /// The most prompt tokens any of them holds, or `None` when one answered without saying
    /// (an error status, a body without `cached_tokens`) or not in time.
    best: Option<u32>,
    /// Workers that could not be reached: counted as holding nothing (a killed worker holds
    /// nothing a request could find), and reported, since a wrong URL looks the same.
    unreachable: u32,
}

/// Asks every worker in `workers` how much of the request `body`'s prompt it holds.
async fn oracle_cached(client: &reqwest::Client, workers: &[String], body: &Value) -> OracleAnswer {
    let asks = workers.iter().map(|url| {
        client
            .post(format!("{url}/admin/cached"))
            .timeout(ORACLE_TIMEOUT)
            .json(body)
            .send()
    });
    let mut out = OracleAnswer {
        best: Some(0),
        unreachable: 0,
    };
    for answer in futures_util::future::join_all(asks).await {
        let said = match answer {
            Err(e) if e.is_connect() => {
                out.unreachable += 1;
                continue;
            }
            Err(_) => None,
            Ok(answer) => match answer.error_for_status() {
                Ok(answer) => answer.json::<Value>().await.ok().and_then(|v| {
                    v["cached_tokens"]
                        .as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                }),
                Err(_) => None,
            },
        };
        out.best = match (out.best, said) {
            (Some(best), Some(n)) => Some(best.max(n)),
            _ => None,
        };
    }
    out
}

/// Sends `body` to the router and reads the streamed answer into `record`.
async fn answer(
    client: &reqwest::Client,
    options: &ReplayOptions,
    mut record: ReplayRecord,
    body: &Value,
    sent: Instant,
) -> ReplayRecord {
    let mut post = client
        .post(format!("{}/v1/completions", options.url))
        .json(body);
    if let Some(key) = &options.api_key {
        post = post.bearer_auth(key);
    }
    let response = match post.send().await {
        Ok(r) => r,
        Err(e) => {
            record.error = Some(kvroute_serve::with_causes(&e));
            return record;
        }
    };
    record.status = response.status().as_u16();
    let got = response.headers();
    record.worker = header(got, headers::WORKER);
    record.predicted_cached_tokens = header(got, headers::PREDICTED_CACHED_TOKENS);
    record.decision_us = header(got, headers::DECISION_US);
    record.prompt_read_us = header(got, headers::PROMPT_READ_US);
    if !response.status().is_success() {
        record.error = Some(response.text().await.unwrap_or_default());
        return record;
    }
    let mut stream = response.bytes_stream();
    let mut buffer = Vec::new();
    let mut finished = false;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                record.error = Some(kvroute_serve::with_causes(&e));
                return record;
            }
        };
        buffer.extend_from_slice(&chunk);
        while let Some(end) = find_event_end(&buffer) {
            let event: Vec<u8> = buffer.drain(..end).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data.trim() == "[DONE]" {
                    finished = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                let has_text = v["choices"]
                    .get(0)
                    .and_then(|c| c["text"].as_str())
                    .is_some_and(|t| !t.is_empty());
                if has_text {
                    if record.ttft_ms.is_none() {
                        record.ttft_ms = Some(sent.elapsed().as_secs_f64() * 1e3);
                    }
                    record.chunks += 1;
                }
                if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
                    if let Some(p) = usage["prompt_tokens"].as_u64() {
                        record.prompt_tokens = p as u32;
                    }
                    record.output_tokens = usage["completion_tokens"].as_u64().unwrap_or(0) as u32;
                    record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0) as u32;
                }
            }
        }
    }
    if finished {
        record.latency_ms = Some(sent.elapsed().as_secs_f64() * 1e3);
        if record.output_tokens == 0 {
            record.output_tokens = record.chunks;
        }
    } else {
        record.error = Some("the stream ended before [DONE]".to_owned());
    }
    record
}

/// A response header's value read as a number, when it is one.
fn header<T: std::str::FromStr>(headers: &reqwest::header::HeaderMap, name: &str) -> Option<T> {
    headers.get(name)?.to_str().ok()?.parse().ok()
}

/// The end (past the blank line) of the first whole SSE event in `buffer`.
fn find_event_end(buffer: &[u8]) -> Option<usize> {
    buffer.windows(2).position(|w| w == b"\n\n").map(|p| p + 2)
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}

/// The report of `records` over `wall` seconds.
pub fn figures(records: &[ReplayRecord], wall: f64) -> ReplayReport {
    let ok: Vec<&ReplayRecord> = records
        .iter()
        .filter(|r| r.error.is_none() && r.latency_ms.is_some())
        .collect();
    let prompt: u64 = ok.iter().map(|r| u64::from(r.prompt_tokens)).sum();
    let cached: u64 = ok.iter().map(|r| u64::from(r.cached_tokens)).sum();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let itl = mean(
        ok.iter()
            .filter(|r| r.chunks >= 2)
            .filter_map(|r| Some((r.latency_ms? - r.ttft_ms?) / f64::from(r.chunks - 1))),
    );
    let output: u64 = ok.iter().map(|r| u64::from(r.output_tokens)).sum();
    let predicted: Vec<&&ReplayRecord> = ok
        .iter()
        .filter(|r| r.predicted_cached_tokens.is_some())
        .collect();
    let exact = predicted
        .iter()
        .filter(|r| r.predicted_cached_tokens == Some(u64::from(r.cached_tokens)))
        .count();
    let mut decisions: Vec<f64> = ok.iter().filter_map(|r| r.decision_us).collect();
    decisions.sort_by(f64::total_cmp);
    let mut reads: Vec<f64> = ok.iter().filter_map(|r| r.prompt_read_us).collect();
    reads.sort_by(f64::total_cmp);
    let (mut oracle_prompt, mut oracle_cached, mut oracle_hit) = (0u64, 0u64, 0u64);
    let asked = records
        .iter()
        .any(|r| r.oracle_cached_tokens.is_some() || r.oracle_unreachable > 0);
    let mut oracle_missing = 0;
    for r in &ok {
        if asked && r.oracle_cached_tokens.is_none() {
            oracle_missing += 1;
        }
        if let Some(best) = r.oracle_cached_tokens {
            oracle_prompt += u64::from(r.prompt_tokens);
            oracle_cached += u64::from(best);
            oracle_hit += u64::from(r.cached_tokens);
        }
    }
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    ReplayReport {
        requests: records.len(),
        ok: ok.len(),
        failed: records.len() - ok.len(),
        hit_rate: ratio(cached, prompt),
        oracle_hit_rate: ratio(oracle_cached, oracle_prompt),
        hit_over_oracle: ratio(oracle_hit, oracle_cached),
        oracle_missing,
        oracle_unreachable: records
            .iter()
            .map(|r| u64::from(r.oracle_unreachable))
            .sum(),
        ttft_mean_ms: mean(ttft.iter().copied()),
        ttft_p50_ms: quantile(&ttft, 0.5),
        ttft_p99_ms: quantile(&ttft, 0.99),
        itl_mean_ms: itl,
        latency_mean_ms: mean(ok.iter().filter_map(|r| r.latency_ms)),
        throughput_tok_s: if wall > 0.0 {
            output as f64 / wall
        } else {
            0.0
        },
        imbalance: imbalance(&ok),
        prediction_accuracy: if predicted.is_empty() {
            0.0
        } else {
            exact as f64 / predicted.len() as f64
        },
        decision_p50_us: quantile(&decisions, 0.5),
        decision_p99_us: quantile(&decisions, 0.99),
        prompt_read_p50_us: quantile(&reads, 0.5),
        prompt_read_p99_us: quantile(&reads, 0.99),
        wall_seconds: wall,
    }
}

/// Max ÷ mean over workers of each one's active tokens (prompt + output of the requests it
/// held) integrated over its requests' lifetimes; 0 without worker headers.
fn imbalance(ok: &[&ReplayRecord]) -> f64 {
    let mut per_worker: std::collections::BTreeMap<u64, f64> = Default::default();
    for r in ok {
        let (Some(w), Some(latency)) = (r.worker, r.latency_ms) else {
            continue;
        };
        let tokens = f64::from(r.prompt_tokens + r.output_tokens);
        *per_worker.entry(w).or_default() += tokens * latency;
    }
    if per_worker.is_empty() {
        return 0.0;
    }
    let max = per_worker.values().copied().fold(0.0, f64::max);
    let mean = per_worker.values().sum::<f64>() / per_worker.len() as f64;
    if mean > 0.0 {
        max / mean
    } else {
        0.0
    }
}

/// One replay, as `--plot` draws it: its label, its records and its figures.
#[derive(Clone, Debug)]
pub struct PlottedRun {
    /// The legend's name for it.
    pub label: String,
    /// Its requests.
    pub records: Vec<ReplayRecord>,
    /// Its figures.
    pub report: ReplayReport,
}

impl PlottedRun {
    /// A run from a file `replay --json` wrote (labelled by its `label`, else `fallback`).
    pub fn from_json(value: &Value, fallback: &str) -> anyhow::Result<Self> {
        Ok(PlottedRun {
            label: value["label"].as_str().unwrap_or(fallback).to_owned(),
            records: serde_json::from_value(value["requests"].clone())?,
            report: serde_json::from_value(value["report"].clone())?,
        })
    }
}

/// Draws `runs` to an SVG file (see [`crate::plot::write_svg`]): each run's TTFT distribution
/// and hit rate, and the load over wall time of the first two runs that say where their
/// requests went (kvroute's headers).
pub fn write_plot(
    runs: &[PlottedRun],
    path: &std::path::Path,
) -> Result<(), crate::plot::PlotError> {
    let ttfts: Vec<Vec<f64>> = runs
        .iter()
        .map(|r| {
            let mut t: Vec<f64> = r.records.iter().filter_map(|r| r.ttft_ms).collect();
            t.sort_by(f64::total_cmp);
            t
        })
        .collect();
    let picture = crate::plot::Picture {
        runs: runs
            .iter()
            .zip(&ttfts)
            .map(|(r, t)| crate::plot::Run {
                name: &r.label,
                ttft_sorted_ms: t,
                hit_rate: r.report.hit_rate,
            })
            .collect(),
        marks: Vec::new(),
        loads: runs
            .iter()
            .map(|r| crate::plot::Load {
                name: &r.label,
                imbalance: r.report.imbalance,
                windows: load_windows(&r.records, LOAD_WINDOWS),
            })
            .filter(|l| !l.windows.is_empty())
            .take(2)
            .collect(),
        time_axis: "wall time (s)",
    };
    crate::plot::write_svg(&picture, path)
}

/// Windows the load panels average over.
const LOAD_WINDOWS: usize = 120;

/// Every worker's active tokens (prompt and output of the requests it was serving, from
/// sending to the last byte) averaged over `n` equal windows of the run's wall time: each
/// window's end in seconds and the workers' means, workers in id order. Empty without
/// kvroute's worker headers.
pub fn load_windows(records: &[ReplayRecord], n: usize) -> Vec<crate::plot::Window> {
    let held: Vec<(u64, f64, f64, f64)> = records
        .iter()
        .filter_map(|r| {
            let tokens = f64::from(r.prompt_tokens) + f64::from(r.output_tokens);
            Some((r.worker?, r.sent_ms, r.sent_ms + r.latency_ms?, tokens))
        })
        .collect();
    let ids: std::collections::BTreeSet<u64> = held.iter().map(|h| h.0).collect();
    let index: std::collections::BTreeMap<u64, usize> =
        ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let end = held.iter().map(|h| h.2).fold(0.0, f64::max);
    if index.is_empty() || end <= 0.0 || n == 0 {
        return Vec::new();
    }
    let step = end / n as f64;
    let mut windows = vec![vec![0.0; index.len()]; n];
    for &(id, from, to, tokens) in &held {
        let w = index[&id];
        let first = ((from / step) as usize).min(n - 1);
        let last = ((to / step) as usize).min(n - 1);
        for (k, window) in windows.iter_mut().enumerate().take(last + 1).skip(first) {
            let (a, b) = (k as f64 * step, (k + 1) as f64 * step);
            window[w] += tokens * (to.min(b) - from.max(a)).max(0.0) / step;
        }
    }
    windows
        .into_iter()
        .enumerate()
        .map(|(k, v)| ((k + 1) as f64 * step / 1e3, v))
        .collect()
}

/// The report as the terminal shows it.
pub fn table(report: &ReplayReport, name: &str) -> String {
    format!(
        "{name}: {} requests, {} ok, {} failed in {:.1} s\n\
         hit rate {:.3}{}   TTFT mean {:.0} ms, p50 {:.0} ms, p99 {:.0} ms   ITL {:.1} ms   \
         latency {:.0} ms\nthroughput {:.0} tok/s   imbalance {:.2}   predicted exactly {:.1}%   \
         decision p50 {:.1} µs, p99 {:.1} µs   prompt read p50 {:.1} µs, p99 {:.1} µs\n",
        report.requests,
        report.ok,
        report.failed,
        report.wall_seconds,
        report.hit_rate,
        if report.oracle_hit_rate > 0.0 || report.oracle_missing > 0 {
            let mut note = format!(
                " (oracle {:.3}, {:.2} of it",
                report.oracle_hit_rate, report.hit_over_oracle
            );
            if report.oracle_missing > 0 {
                note += &format!("; {} requests without its figure", report.oracle_missing);
            }
            if report.oracle_unreachable > 0 {
                note += &format!("; {} questions found no worker", report.oracle_unreachable);
            }
            note + ")"
        } else {
            String::new()
        },
        report.ttft_mean_ms,
        report.ttft_p50_ms,
        report.ttft_p99_ms,
        report.itl_mean_ms,
        report.latency_mean_ms,
        report.throughput_tok_s,
        report.imbalance,
        report.prediction_accuracy * 100.0,
        report.decision_p50_us,
        report.decision_p99_us,
        report.prompt_read_p50_us,
        report.prompt_read_p99_us
    )
}
