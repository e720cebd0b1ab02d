//! [`DeltaLog`]: the routing threads' booking changes, appended as plain words under a short
//! lock and taken in batches by one collector. The routing path allocates nothing (the log's
//! buffer keeps its room), reads the clock only for the first change of a batch, and makes no
//! system call while the collector is polling; it wakes a collector that went idle.

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

#[derive(Debug, Default)]
struct Words {
    words: Vec<u64>,
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
#[derive(Debug, Default)]
pub struct DeltaLog {
    inner: Mutex<Words>,
    /// The collector is parked, waiting for a change.
    idle: AtomicBool,
    /// The log is closed: the collector stops.
    closed: AtomicBool,
    /// The thread that last waited: the one to wake.
    collector: Mutex<Option<std::thread::Thread>>,
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl DeltaLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends one change (the router's booking sink calls it).
    pub fn append(&self, d: &BookingDelta<'_>) {
        {
            let mut w = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            if w.words.len() >= MAX_LOG_WORDS {
                w.lost = true;
                return;
            }
            if w.words.is_empty() {
                w.oldest_ns = unix_ns();
            }
            match *d {
                BookingDelta::Booked(b) => {
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
                    ]);
                    w.words.extend(b.block_hashes.iter().map(|h| h.0));
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

    /// Takes every change appended so far, leaving `spare`'s buffer (cleared) in its place,
    /// so that the log keeps its room. With nothing appended, hands `spare` back unused.
    pub fn take(&self, spare: Vec<u64>) -> Taken {
        let mut spare = spare;
        spare.clear();
        let mut w = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if w.words.is_empty() && !w.lost {
            return Taken {
                words: spare,
                ..Taken::default()
            };
        }
        Taken {
            words: std::mem::replace(&mut w.words, spare),
            oldest_ns: w.oldest_ns,
            lost: std::mem::take(&mut w.lost),
        }
    }

    /// Parks the calling thread (the collector) until a change is appended or the log is
    /// closed, unless one is there already. Spurious returns are possible: the caller takes
    /// and loops.
    pub fn wait(&self) {
        if let Ok(mut c) = self.collector.lock() {
            *c = Some(std::thread::current());
        }
        self.idle.store(true, Ordering::SeqCst);
        let empty = self
            .inner
            .lock()
            .map(|w| w.words.is_empty() && !w.lost)
            .unwrap_or(false);
        if empty && !self.is_closed() {
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

/// Pushes the changes `words` encode into `outbox`, in order; returns how many. Words that do
/// not decode end the batch (they cannot come from [`DeltaLog::append`]).
pub fn replay(words: &[u64], outbox: &mut Outbox) -> usize {
    let mut hashes: Vec<LocalHash> = Vec::new();
    let (mut i, mut n) = (0, 0);
    while i < words.len() {
        let field = |k: usize| words.get(i + k).copied();
        let delta = match words[i] {
            BOOKED => {
                let (Some(request), Some(worker), Some(dp), Some(prefill), Some(prompt)) =
                    (field(1), field(2), field(3), field(4), field(5))
                else {
                    break;
                };
                let (Some(cached), Some(expected), Some(len)) = (field(6), field(7), field(8))
                else {
                    break;
                };
                let Some(h) = words.get(i + 9..i + 9 + len as usize) else {
                    break;
                };
                hashes.clear();
                hashes.extend(h.iter().map(|&x| LocalHash(x)));
                i += 9 + len as usize;
                BookingDelta::Booked(RemoteBooking {
                    request: RequestId(request),
                    rank: WorkerRank::new(worker, dp as u32),
                    prefill_tokens: prefill,
                    block_hashes: &hashes,
                    prompt_tokens: prompt,
                    cached_tokens: cached,
                    expected_output_tokens: expected.checked_sub(1).map(|e| e as u32),
                })
            }
            PREFILL_DONE | FREED => {
                let Some(r) = field(1) else { break };
                let kind = words[i];
                i += 2;
                if kind == FREED {
                    BookingDelta::Freed(RequestId(r))
                } else {
                    BookingDelta::PrefillDone(RequestId(r))
                }
            }
            OUTPUT_BLOCKS => {
                let (Some(request), Some(blocks), Some(generated)) = (field(1), field(2), field(3))
                else {
                    break;
                };
                i += 4;
                BookingDelta::OutputBlocks {
                    request: RequestId(request),
                    blocks,
                    generated,
                }
            }
            _ => break,
        };
        outbox.push(&delta);
        n += 1;
    }
    n
}
