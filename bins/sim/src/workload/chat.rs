//! The built-in workload: a chat service. Multi-turn conversations whose prompt grows by the
//! previous reply and a new user message each turn, opened by one of a few shared system
//! prompts and often by a document drawn from a Zipf-popular library, many conversations
//! interleaved, arriving as a Poisson process. Everything follows from the seed.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::tokens::pseudo_token;

/// Parameters of the built-in chat workload. Ranges are inclusive and sampled uniformly.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatConfig {
    /// Requests generated (one per conversation turn).
    pub requests: usize,
    /// Seed of everything random in the workload.
    pub seed: u64,
    /// Shared system prompts; a conversation opens with one, chosen Zipf(1.0)-popular.
    pub system_prompts: usize,
    /// Length of each system prompt, in tokens.
    pub system_prompt_tokens: (usize, usize),
    /// Documents in the library.
    pub documents: usize,
    /// Zipf exponent of document popularity (rank k drawn with weight 1/k^s).
    pub document_zipf: f64,
    /// Length of each document, in tokens.
    pub document_tokens: (usize, usize),
    /// Fraction of conversations that put a document after the system prompt.
    pub document_share: f64,
    /// Turns of a conversation (one request each).
    pub turns: (usize, usize),
    /// Length of a user message, in tokens.
    pub user_tokens: (usize, usize),
    /// Length of an assistant reply, in tokens: what the turn's request generates, and what
    /// joins the next turn's prompt.
    pub reply_tokens: (usize, usize),
    /// Conversations open at once; each request continues one of them, chosen uniformly, and a
    /// finished conversation is replaced by a new one.
    pub open_conversations: usize,
    /// Mean arrivals per second of the Poisson process the requests arrive by.
    pub rate: f64,
}

impl Default for ChatConfig {
    fn default() -> Self {
        ChatConfig {
            requests: 10_000,
            seed: 42,
            system_prompts: 4,
            system_prompt_tokens: (1_024, 3_072),
            documents: 2_000,
            document_zipf: 1.1,
            document_tokens: (1_000, 8_000),
            document_share: 0.5,
            turns: (1, 10),
            user_tokens: (50, 600),
            reply_tokens: (100, 900),
            open_conversations: 64,
            rate: 10.0,
        }
    }
}

impl ChatConfig {
    /// The long mix: most conversations open with a long document (4,000 to 16,000 tokens)
    /// and replies run long (400 to 1,500 tokens), over few turns, so that on an engine
    /// serving whole requests the prefill chunks of new documents slow every decode: the
    /// case for splitting prefill from decode.
    pub fn long_mix() -> Self {
        ChatConfig {
            document_share: 0.9,
            document_tokens: (4_000, 16_000),
            turns: (1, 3),
            user_tokens: (50, 300),
            reply_tokens: (400, 1_500),
            ..ChatConfig::default()
        }
    }
}

/// Content streams of [`pseudo_token`] for the built-in workload.
const STREAM_SYSTEM: u64 = 1;
const STREAM_DOCUMENT: u64 = 2;
const STREAM_MESSAGE: u64 = 3;

/// Mixed into the seed for the arrival times, so that the prompts do not depend on the rate.
const ARRIVAL_SEED_MIX: u64 = 0xA1B2_C3D4_E5F6_0718;

/// One turn: the prompt, what the reply generates, and when it arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Turn<'a> {
    /// The prompt's tokens: the conversation so far and a new user message.
    pub prompt: &'a [u32],
    /// Tokens of the reply (the request's output).
    pub reply_tokens: usize,
    /// Arrival from the workload's start.
    pub at: Duration,
}

/// Draws ranks `0..n` with probability proportional to `1 / (rank + 1)^s`.
#[derive(Debug)]
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Self {
        let mut total = 0.0;
        let mut cdf: Vec<f64> = (0..n.max(1))
            .map(|rank| {
                total += 1.0 / ((rank + 1) as f64).powf(s);
                total
            })
            .collect();
        for value in &mut cdf {
            *value /= total;
        }
        Zipf { cdf }
    }

    fn sample(&self, rng: &mut SmallRng) -> usize {
        let u: f64 = rng.gen();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}

#[derive(Debug)]
struct Conversation {
    tokens: Vec<u32>,
    turns_left: usize,
}

/// Generates the built-in workload's turns, in arrival order.
#[derive(Debug)]
pub struct ChatWorkload {
    config: ChatConfig,
    rng: SmallRng,
    arrivals: SmallRng,
    clock: f64,
    system_lengths: Vec<usize>,
    system_pick: Zipf,
    document_lengths: Vec<usize>,
    document_pick: Zipf,
    open: Vec<Conversation>,
    next_message: u64,
    emitted: usize,
}

impl ChatWorkload {
    /// The workload's generator, at its start.
    pub fn new(config: ChatConfig) -> Self {
        let mut rng = SmallRng::seed_from_u64(config.seed);
        let arrivals = SmallRng::seed_from_u64(config.seed ^ ARRIVAL_SEED_MIX);
        let system_lengths = (0..config.system_prompts.max(1))
            .map(|_| uniform(&mut rng, config.system_prompt_tokens))
            .collect();
        let document_lengths = (0..config.documents.max(1))
            .map(|_| uniform(&mut rng, config.document_tokens))
            .collect();
        let mut workload = ChatWorkload {
            system_pick: Zipf::new(config.system_prompts, 1.0),
            document_pick: Zipf::new(config.documents, config.document_zipf),
            rng,
            arrivals,
            clock: 0.0,
            system_lengths,
            document_lengths,
            open: Vec::new(),
            next_message: 0,
            emitted: 0,
            config,
        };
        workload.open = (0..workload.config.open_conversations.max(1))
            .map(|_| workload.new_conversation())
            .collect();
        workload
    }

    /// The next request's prompt tokens, or `None` once `requests` prompts were produced.
    pub fn next_prompt(&mut self) -> Option<&[u32]> {
        self.next_turn().map(|turn| turn.prompt)
    }

    /// The next turn, or `None` once `requests` turns were produced. The first arrives at 0;
    /// gaps are exponential with mean `1 / rate` (none when the rate is not positive).
    pub fn next_turn(&mut self) -> Option<Turn<'_>> {
        if self.emitted == self.config.requests {
            return None;
        }
        if self.emitted > 0 && self.config.rate > 0.0 {
            let u: f64 = self.arrivals.gen();
            self.clock += -(1.0 - u).ln() / self.config.rate;
        }
        self.emitted += 1;
        let slot = self.rng.gen_range(0..self.open.len());
        if self.open[slot].turns_left == 0 {
            self.open[slot] = self.new_conversation();
        }
        // This turn's prompt is the history so far plus a new user message; the reply joins the
        // history right after, so the next turn's prompt extends this one.
        let user = uniform(&mut self.rng, self.config.user_tokens);
        let message = self.message_id();
        let reply = uniform(&mut self.rng, self.config.reply_tokens);
        let reply_message = self.message_id();
        let conversation = &mut self.open[slot];
        append_item(&mut conversation.tokens, STREAM_MESSAGE, message, user);
        conversation.turns_left -= 1;
        let prompt_len = conversation.tokens.len();
        append_item(
            &mut conversation.tokens,
            STREAM_MESSAGE,
            reply_message,
            reply,
        );
        Some(Turn {
            prompt: &conversation.tokens[..prompt_len],
            reply_tokens: reply,
            at: Duration::from_secs_f64(self.clock),
        })
    }

    fn message_id(&mut self) -> u64 {
        let id = self.next_message;
        self.next_message += 1;
        id
    }

    fn new_conversation(&mut self) -> Conversation {
        let mut tokens = Vec::new();
        let system = self.system_pick.sample(&mut self.rng);
        append_item(
            &mut tokens,
            STREAM_SYSTEM,
            system as u64,
            self.system_lengths[system],
        );
        if self.rng.gen::<f64>() < self.config.document_share {
            let document = self.document_pick.sample(&mut self.rng);
            append_item(
                &mut tokens,
                STREAM_DOCUMENT,
                document as u64,
                self.document_lengths[document],
            );
        }
        Conversation {
            tokens,
            turns_left: uniform(&mut self.rng, self.config.turns).max(1),
        }
    }
}

fn append_item(tokens: &mut Vec<u32>, stream: u64, item: u64, len: usize) {
    tokens.extend((0..len as u64).map(|position| pseudo_token(stream, item, position)));
}

fn uniform(rng: &mut SmallRng, (low, high): (usize, usize)) -> usize {
    rng.gen_range(low..=high.max(low))
}
