//! [`DeltaLog`]: the routing threads' booking changes, appended as plain words under a short
//! lock and taken in batches by one collector. The routing path allocates nothing (the log's
//! buffer keeps its room), reads the clock only for the first change of a batch, and makes no
//! system call while the collector is polling; it wakes a collector that went idle.
//!
//! The words a routing thread writes are read by the collector on another core, and writing
//! them again costs the routing thread a cache-coherence miss per line; across caches that is
//! most of the sync's cost (`replica-sync`'s "log unread" row). So a booking does not repeat
//! the hashes a recent booking already carried: both ends keep the latest hash chain per
//! first block ([`Chains`], updated in log order), and a booking names its slot, how many
//! leading hashes it shares with that chain, and only the hashes after them. And a buffer
//! the collector read is written again only after [`RECYCLE_AFTER`] others.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use kvroute_core::{BookingDelta, LocalHash, RemoteBooking, RequestId, WorkerRank};

use super::outbox::Outbox;

const BOOKED: u64 = 1;
const PREFILL_DONE: u64 = 2;
const OUTPUT_BLOCKS: u64 = 3;
const FREED: u64 = 4;

/// Most words the log holds before changes are dropped (and the loss reported): 64 MiB.
pub const MAX_LOG_WORDS: usize = 8 << 20;

/// Words of room a new log buffer is given (128 KiB: a 500 µs batch, serve's default window,
/// at a million requests a second, each booked with 6 blocks no recent booking carried, its
/// first token and its free), so that the routing thread seldom grows it. A buffer keeps what
/// it grew to when it is recycled: under longer windows the routing thread grows buffers
/// only until each has grown once.
pub const LOG_ROOM: usize = 16 << 10;

/// Buffers handed back ([`DeltaLog::recycle`]) that wait before the log writes into them
/// again. The collector read each; writing a line another core holds costs the routing
/// thread a coherence miss, so a buffer is reused only once the collector has read this many
/// others since, and its lines have likely left that core's private cache. Against reusing
/// the last one at once, this took a route with the sync from 1.26–1.29× a route without to
/// 1.08–1.14× on this machine's two vCPUs, at times when the two did not share a cache
/// (`replica-sync`; benches/RESULTS.md).
pub const RECYCLE_AFTER: usize = 32;

/// Slots of [`Chains`]: recent chains kept, one per first block (hashed to a slot).
const CHAIN_SLOTS: usize = 256;
/// Most leading hashes a slot keeps of a chain (32k tokens in blocks of 16).
const CHAIN_MAX: usize = 2048;

/// The latest hash chain seen per first block, kept alike by the log's writers and its reader:
/// both apply [`Chains::set`] for every booking the log holds, in its order (a change the full
/// log drops changes neither side).
#[derive(Debug, Default)]
pub(crate) struct Chains {
    slots: Vec<Vec<u64>>,
}

impl Chains {
    fn slot_of(first: u64) -> usize {
        (first.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % CHAIN_SLOTS
    }

    fn slot(&mut self, slot: usize) -> &mut Vec<u64> {
        if self.slots.is_empty() {
            self.slots.resize_with(CHAIN_SLOTS, Vec::new);
        }
        &mut self.slots[slot % CHAIN_SLOTS]
    }

    /// The slot of `hashes` and how many of their leading hashes its chain holds; the chain
    /// becomes `hashes` (the writer's side).
    fn share(&mut self, hashes: &[LocalHash]) -> (usize, usize) {
        let Some(first) = hashes.first() else {
            return (0, 0);
        };
        let slot = Self::slot_of(first.0);
        let chain = self.slot(slot);
        let shared = common_prefix(chain, hashes);
        Self::set(chain, shared, hashes.iter().map(|h| h.0), hashes.len());
        (slot, shared)
    }

    /// `chain` becomes its first `shared` hashes and then `rest`, kept to [`CHAIN_MAX`];
    /// `len` is the whole chain's length (`shared` + `rest`'s).
    fn set(chain: &mut Vec<u64>, shared: usize, rest: impl Iterator<Item = u64>, len: usize) {
        let keep = len.min(CHAIN_MAX);
        chain.truncate(shared.min(keep));
        if shared < keep {
            chain.extend(rest.skip(shared).take(keep - shared));
        }
    }
}

/// How many leading hashes `chain` and `hashes` share: eight at a time, without a branch
/// within each eight, then one at a time.
fn common_prefix(chain: &[u64], hashes: &[LocalHash]) -> usize {
    let n = chain.len().min(hashes.len());
    let mut i = 0;
    while i + 8 <= n {
        let same = chain[i..i + 8]
            .iter()
            .zip(&hashes[i..i + 8])
            .fold(true, |all, (a, b)| all & (*a == b.0));
        if !same {
            break;
        }
        i += 8;
    }
    while i < n && chain[i] == hashes[i].0 {
        i += 1;
    }
    i
}

#[derive(Debug, Default)]
struct Words {
    words: Vec<u64>,
    /// The writers' side of the chains.
    chains: Chains,
    /// Wall-clock time of the first change since the last take, in ns since the epoch.
    oldest_ns: u64,
    /// Changes were dropped since the last take (the log was full).
    lost: bool,
}

/// A batch taken from the log.
#[derive(Debug, Default)]
pub struct Taken {
    /// The changes, encoded.
    pub words: Vec<u64>,
    /// When the first of them was made (ns since the Unix epoch).
    pub oldest_ns: u64,
    /// Changes were dropped before these (the log was full): the book must be sent whole.
    pub lost: bool,
}

/// The booking changes of every routing thread, for one collector.
#[derive(Debug)]
pub struct DeltaLog {
    inner: Mutex<Words>,
    /// Buffers handed back, oldest first.
    recycled: Mutex<VecDeque<Vec<u64>>>,
    /// The collector is parked, waiting for a change.
    idle: AtomicBool,
    /// The log is closed: the collector stops.
    closed: AtomicBool,
    /// The thread that last waited: the one to wake.
    collector: Mutex<Option<std::thread::Thread>>,
}

impl Default for DeltaLog {
    fn default() -> Self {
        Self::new()
    }
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl DeltaLog {
    /// An empty log.
    pub fn new() -> Self {
        Self {
            inner: Mutex::new(Words {
                words: Vec::with_capacity(LOG_ROOM),
                ..Words::default()
            }),
            recycled: Mutex::new(VecDeque::new()),
            idle: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            collector: Mutex::new(None),
        }
    }

    /// Appends one change (the router's booking sink calls it).
    pub fn append(&self, d: &BookingDelta<'_>) {
        {
            let mut w = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            if w.words.len() >= MAX_LOG_WORDS {
                // Dropped before the chains see it: the reader never sees it either.
                w.lost = true;
                return;
            }
            if w.words.is_empty() {
                w.oldest_ns = unix_ns();
            }
            match *d {
                BookingDelta::Booked(b) => {
                    let (slot, shared) = w.chains.share(b.block_hashes);
                    w.words.extend_from_slice(&[
                        BOOKED,
                        b.request.0,
                        b.rank.worker.0,
                        u64::from(b.rank.dp_rank.0),
                        b.prefill_tokens,
                        b.prompt_tokens,
                        b.cached_tokens,
                        b.expected_output_tokens.map_or(0, |e| u64::from(e) + 1),
                        b.block_hashes.len() as u64,
                        ((slot as u64) << 32) | shared as u64,
                    ]);
                    w.words.extend(b.block_hashes[shared..].iter().map(|h| h.0));
                }
                BookingDelta::PrefillDone(r) => w.words.extend_from_slice(&[PREFILL_DONE, r.0]),
                BookingDelta::OutputBlocks {
                    request,
                    blocks,
                    generated,
                } => w
                    .words
                    .extend_from_slice(&[OUTPUT_BLOCKS, request.0, blocks, generated]),
                BookingDelta::Freed(r) => w.words.extend_from_slice(&[FREED, r.0]),
            }
        }
        if self.idle.load(Ordering::SeqCst) && self.idle.swap(false, Ordering::SeqCst) {
            self.wake();
        }
    }

    /// Takes every change appended so far, leaving an empty buffer in its place: one handed
    /// back at least [`RECYCLE_AFTER`] takes ago, or a new one. With nothing appended, takes
    /// nothing.
    pub fn take(&self) -> Taken {
        if self.is_empty() {
            return Taken::default();
        }
        let spare = {
            let mut r = self.recycled.lock().unwrap_or_else(|p| p.into_inner());
            if r.len() > RECYCLE_AFTER {
                r.pop_front()
            } else {
                None
            }
        };
        let mut spare = spare.unwrap_or_else(|| Vec::with_capacity(LOG_ROOM));
        spare.clear();
        let mut w = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        Taken {
            words: std::mem::replace(&mut w.words, spare),
            oldest_ns: w.oldest_ns,
            lost: std::mem::take(&mut w.lost),
        }
    }

    /// Hands a taken batch's buffer back, once read, for the log to reuse.
    pub fn recycle(&self, words: Vec<u64>) {
        if words.capacity() > 0 {
            let mut r = self.recycled.lock().unwrap_or_else(|p| p.into_inner());
            r.push_back(words);
        }
    }

    fn is_empty(&self) -> bool {
        let w = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        w.words.is_empty() && !w.lost
    }

    /// Parks the calling thread (the collector) until a change is appended or the log is
    /// closed, unless one is there already. Spurious returns are possible: the caller takes
    /// and loops.
    pub fn wait(&self) {
        if let Ok(mut c) = self.collector.lock() {
            *c = Some(std::thread::current());
        }
        self.idle.store(true, Ordering::SeqCst);
        if self.is_empty() && !self.is_closed() {
            std::thread::park();
        }
        self.idle.store(false, Ordering::SeqCst);
    }

    /// Closes the log: a parked collector wakes, and [`DeltaLog::is_closed`] tells it to stop.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.wake();
    }

    fn wake(&self) {
        if let Some(t) = self.collector.lock().ok().and_then(|c| c.clone()) {
            t.unpark();
        }
    }

    /// Whether the log was closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

/// The collector's side of the log: turns taken words back into changes, keeping the chains
/// the writers kept.
#[derive(Debug, Default)]
pub struct Replayer {
    chains: Chains,
    hashes: Vec<LocalHash>,
}

impl Replayer {
    /// A replayer for a new log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Pushes the changes of `taken` into `outbox`, in order; returns how many. Words that do
    /// not decode end the batch (they cannot come from [`DeltaLog::append`]). Every batch
    /// taken from the log must be replayed, in the order taken: the chains follow them.
    pub fn replay(&mut self, taken: &Taken, outbox: &mut Outbox) -> usize {
        self.replay_words(&taken.words, outbox)
    }

    /// [`Replayer::replay`] of bare words.
    pub fn replay_words(&mut self, words: &[u64], outbox: &mut Outbox) -> usize {
        let (mut i, mut n) = (0, 0);
        while i < words.len() {
            let Some(used) = self.one(&words[i..], outbox) else {
                break;
            };
            i += used;
            n += 1;
        }
        n
    }

    /// Decodes the change at the head of `words` into `outbox`; returns the words it took.
    fn one(&mut self, words: &[u64], outbox: &mut Outbox) -> Option<usize> {
        let field = |k: usize| words.get(k).copied();
        let (delta, used) = match words[0] {
            BOOKED => {
                let (request, worker, dp) = (field(1)?, field(2)?, field(3)?);
                let (prefill, prompt, cached) = (field(4)?, field(5)?, field(6)?);
                let (expected, len, reuse) = (field(7)?, field(8)? as usize, field(9)?);
                let (slot, shared) = ((reuse >> 32) as usize, (reuse & 0xffff_ffff) as usize);
                if shared > len || (len == 0 && reuse != 0) {
                    return None;
                }
                let rest = words.get(10..10 + (len - shared))?;
                self.hashes.clear();
                if len > 0 {
                    let chain = self.chains.slot(slot);
                    let held = chain.get(..shared)?;
                    self.hashes.extend(held.iter().map(|&h| LocalHash(h)));
                    self.hashes.extend(rest.iter().map(|&h| LocalHash(h)));
                    let whole = self.hashes.iter().map(|h| h.0);
                    Chains::set(chain, shared, whole, len);
                }
                let d = BookingDelta::Booked(RemoteBooking {
                    request: RequestId(request),
                    rank: WorkerRank::new(worker, dp as u32),
                    prefill_tokens: prefill,
                    block_hashes: &self.hashes,
                    prompt_tokens: prompt,
                    cached_tokens: cached,
                    expected_output_tokens: expected.checked_sub(1).map(|e| e as u32),
                });
                outbox.push(&d);
                return Some(10 + len - shared);
            }
            PREFILL_DONE => (BookingDelta::PrefillDone(RequestId(field(1)?)), 2),
            FREED => (BookingDelta::Freed(RequestId(field(1)?)), 2),
            OUTPUT_BLOCKS => (
                BookingDelta::OutputBlocks {
                    request: RequestId(field(1)?),
                    blocks: field(2)?,
                    generated: field(3)?,
                },
                4,
            ),
            _ => return None,
        };
        outbox.push(&delta);
        Some(used)
    }
}
