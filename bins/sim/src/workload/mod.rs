//! Workloads the simulated fleet and the replayer run: the built-in chat service and
//! Mooncake-format traces, each a stream of requests in arrival order, and the ceiling no
//! routing policy can beat on them.
//!
//! ```text
//!  ChatConfig ──ChatWorkload──┐
//!                             ├──▶ Workload::requests(): (arrival, prompt tokens, output tokens)…
//!  trace.jsonl ──read_trace───┘                                   │
//!                                ceiling(): every earlier prompt cached; the fleet as one LRU
//! ```
//!
//! Module map:
//!
//! * `chat.rs`: [`ChatConfig`] and [`ChatWorkload`], the built-in generator.
//! * `lru.rs`: a set of blocks that evicts the least recently used, for the LRU figure.
//! * `mooncake.rs`: [`TraceRow`] and [`read_trace`], Mooncake-format traces.
//! * `tokens.rs`: [`pseudo_token`], the content of every synthetic prompt.

mod chat;
mod lru;
mod mooncake;
mod tokens;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{seq_hashes, BlockHasher, SeqHash};

pub use chat::{ChatConfig, ChatWorkload, Turn};
pub use mooncake::{block_tokens, read_trace, TraceError, TraceRow, TRACE_BLOCK_TOKENS};
pub use tokens::pseudo_token;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadRequest {
    /// Arrival from the workload's start (already divided by the speed-up).
    pub at: Duration,
    /// The prompt's token ids (never empty).
    pub prompt: Vec<u32>,
    /// Tokens it generates (at least 1).
    pub output_tokens: u32,
}

/// What to run: the built-in chat service or a trace, at a speed-up.
#[derive(Clone, Debug)]
pub struct Workload {
    source: Source,
    speedup: f64,
}

#[derive(Clone, Debug)]
enum Source {
    Chat(ChatConfig),
    Trace {
        name: String,
        rows: Arc<[TraceRow]>,
        ties: Ties,
    },
}

/// When a trace's arrivals that share a timestamp come.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ties {
    /// All at that instant (the trace as written).
    #[default]
    Stamped,
    /// Evenly over the gap to the trace's next timestamp, in the file's order (the last
    /// timestamp's over the median gap). Traces stamped on a coarse grid (the Mooncake release
    /// stamps on a 3 s grid, about ten arrivals a stamp) otherwise arrive in bursts that
    /// their service never saw.
    Spread,
}

impl Workload {
    /// The built-in chat workload.
    pub fn chat(config: ChatConfig) -> Self {
        Workload {
            source: Source::Chat(config),
            speedup: 1.0,
        }
    }

    /// A trace's rows (read with [`read_trace`]), named for reports.
    pub fn trace(name: impl Into<String>, rows: Vec<TraceRow>) -> Self {
        Workload {
            source: Source::Trace {
                name: name.into(),
                rows: rows.into(),
                ties: Ties::Stamped,
            },
            speedup: 1.0,
        }
    }

    /// Arrivals come `speedup` times sooner (a positive number; others leave it at 1).
    pub fn with_speedup(mut self, speedup: f64) -> Self {
        self.speedup = if speedup.is_finite() && speedup > 0.0 {
            speedup
        } else {
            1.0
        };
        self
    }

    /// A trace's arrivals that share a timestamp come as `ties` says (the built-in workload's
    /// arrivals never share one, and are left as they are). A spread trace is named with
    /// `+spread`.
    pub fn with_ties(mut self, ties: Ties) -> Self {
        if let Source::Trace { name, ties: t, .. } = &mut self.source {
            if *t != ties {
                *name = match ties {
                    Ties::Spread => format!("{name}+spread"),
                    Ties::Stamped => name.trim_end_matches("+spread").to_owned(),
                };
                *t = ties;
            }
        }
        self
    }

    /// The arrival speed-up.
    pub fn speedup(&self) -> f64 {
        self.speedup
    }

    /// A name for reports: `builtin-chat` (`builtin-long` for [`ChatConfig::long_mix`]'s
    /// lengths) or the trace's.
    pub fn name(&self) -> &str {
        match &self.source {
            Source::Chat(c) if c.document_tokens == ChatConfig::long_mix().document_tokens => {
                "builtin-long"
            }
            Source::Chat(_) => "builtin-chat",
            Source::Trace { name, .. } => name,
        }
    }

    /// Requests in the workload.
    pub fn len(&self) -> usize {
        match &self.source {
            Source::Chat(config) => config.requests,
            Source::Trace { rows, .. } => rows.len(),
        }
    }

    /// Whether it has no request.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its requests in arrival order, generated as they are drawn (a trace's prompts are
    /// expanded one at a time; ties keep the file's order).
    pub fn requests(&self) -> Box<dyn Iterator<Item = WorkloadRequest> + Send + '_> {
        let speedup = self.speedup;
        match &self.source {
            Source::Chat(config) => {
                let mut generator = ChatWorkload::new(config.clone());
                Box::new(std::iter::from_fn(move || {
                    let turn = generator.next_turn()?;
                    Some(WorkloadRequest {
                        at: turn.at.div_f64(speedup),
                        prompt: turn.prompt.to_vec(),
                        output_tokens: turn.reply_tokens.max(1) as u32,
                    })
                }))
            }
            Source::Trace { rows, ties, .. } => {
                let mut order: Vec<usize> = (0..rows.len()).collect();
                order.sort_by_key(|&i| rows[i].timestamp);
                let arrivals = arrivals(rows, &order, *ties);
                Box::new(order.into_iter().zip(arrivals).map(move |(i, at)| {
                    let row = &rows[i];
                    WorkloadRequest {
                        at: at.div_f64(speedup),
                        prompt: row.tokens(),
                        output_tokens: row.output_length.clamp(1, u32::MAX as usize) as u32,
                    }
                }))
            }
        }
    }

    /// The workload's figures with an infinite cache that every worker shares: prompt tokens
    /// of blocks some earlier prompt had, counting a prompt's leading blocks only and leaving
    /// its last token to compute (as an engine does), ÷ prompt tokens. No routing policy can
    /// beat its hit rate.
    ///
    /// Beside it, the same count with one cache of `fleet_blocks` blocks that evicts the least
    /// recently used (as the engines do): the fleet's caches as one, a reference for placement
    /// that never caches a block twice, with the load even (not a bound: it ignores the blocks
    /// running requests pin, and uneven placement can keep some blocks longer). Each request
    /// fills fresh blocks with its output, which no prompt finds again (a workload's later
    /// turns carry their own copy of an answer), and its blocks become the most recently used
    /// in the order an engine frees them.
    pub fn ceiling(&self, block_size: u32, fleet_blocks: usize) -> Ceiling {
        let hasher = BlockHasher::new(block_size as usize);
        let mut seen = HashSet::new();
        let mut fleet = lru::Lru::new(fleet_blocks);
        let mut answers = 0u64;
        let mut ceiling = Ceiling::default();
        for request in self.requests() {
            let hashes = seq_hashes(&hasher.local_hashes(&request.prompt));
            let cap = (request.prompt.len() - 1) / block_size as usize;
            let hits = hashes.iter().take(cap).take_while(|h| seen.contains(*h));
            ceiling.cached_tokens += (hits.count() * block_size as usize) as u64;
            let held = hashes
                .iter()
                .take(cap)
                .take_while(|h| fleet.contains(&Held::Prompt(**h)));
            ceiling.lru_cached_tokens += (held.count() * block_size as usize) as u64;
            ceiling.prompt_tokens += request.prompt.len() as u64;
            ceiling.output_tokens += u64::from(request.output_tokens);
            ceiling.requests += 1;
            ceiling.span = request.at;
            // In the order an engine frees them when the request ends, last block first: the
            // answer's, then the prompt's from its tail, so a prompt's head is evicted last.
            let full =
                (request.prompt.len() + request.output_tokens as usize) / block_size as usize;
            for _ in hashes.len().min(full)..full {
                answers += 1;
                fleet.touch(Held::Answer(answers));
            }
            for h in hashes.iter().rev() {
                fleet.touch(Held::Prompt(*h));
            }
            seen.extend(hashes);
        }
        ceiling
    }
}

/// A block of the fleet-sized LRU cache: a prompt's, or one an answer filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Held {
    Prompt(SeqHash),
    Answer(u64),
}

/// The arrival of each row of `order` (rows sorted by timestamp).
fn arrivals(rows: &[TraceRow], order: &[usize], ties: Ties) -> Vec<Duration> {
    let stamps: Vec<u64> = order.iter().map(|&i| rows[i].timestamp).collect();
    if ties == Ties::Stamped {
        return stamps.iter().map(|&t| Duration::from_millis(t)).collect();
    }
    let mut distinct = stamps.clone();
    distinct.dedup();
    let mut gaps: Vec<u64> = distinct.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort_unstable();
    let median_gap = gaps.get(gaps.len() / 2).copied().unwrap_or(0);
    let mut out = Vec::with_capacity(stamps.len());
    let mut start = 0;
    for (k, &t) in distinct.iter().enumerate() {
        let n = stamps[start..].iter().take_while(|&&s| s == t).count();
        let gap = distinct.get(k + 1).map_or(median_gap, |next| next - t);
        let step = Duration::from_millis(gap).div_f64(n as f64);
        out.extend((0..n).map(|j| Duration::from_millis(t) + step * j as u32));
        start += n;
    }
    out
}

/// A workload's totals and its infinite-cache ceiling ([`Workload::ceiling`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ceiling {
    /// Requests.
    pub requests: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Prompt tokens an infinite shared cache would have held.
    pub cached_tokens: u64,
    /// Prompt tokens one least-recently-used cache of the fleet's size would have held.
    pub lru_cached_tokens: u64,
    /// The last arrival.
    pub span: Duration,
}

impl Ceiling {
    /// Cached ÷ prompt tokens (0 for no prompt).
    pub fn hit_rate(&self) -> f64 {
        self.share(self.cached_tokens)
    }

    /// Held by the fleet-sized LRU cache ÷ prompt tokens (0 for no prompt).
    pub fn lru_hit_rate(&self) -> f64 {
        self.share(self.lru_cached_tokens)
    }

    fn share(&self, tokens: u64) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            tokens as f64 / self.prompt_tokens as f64
        }
    }
}
