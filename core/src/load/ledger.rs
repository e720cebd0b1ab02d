//! The request table ([`Ledger`]): which request holds what on which rank, sharded by request
//! id, and every lifecycle step that moves a rank's counters (book, first token, output
//! blocks, decay, free, expiry, purge), with the prefill floor selection reads.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use super::decay::{decayed, generated_at_block, remaining_fraction};
use super::keys::PassThrough;
use super::rank::{lock, RankState};
use super::records::{
    BookingSpec, DispatchState, Freed, Generated, LedgerCounts, LoadError, RequestId, Step,
};
use crate::config::PromptDecay;
use crate::event::{WorkerId, WorkerRank};
use crate::rng::mix64;
use crate::session::SessionId;
use crate::sync::{fence, AtomicU64, Mutex, Ordering};

/// What a request holds on its rank, and its timeline.
#[derive(Debug)]
struct Booking {
    state: Arc<RankState>,
    prefill_tokens: u64,
    /// The request's prompt in its rank's [`PrefixRefs`](super::PrefixRefs).
    slot: u32,
    tail_blocks: u64,
    /// The prompt's blocks, shared or not ([`LoadView::context_blocks`](super::LoadView)).
    context_blocks: u64,
    output_blocks: u64,
    /// Output tokens generated: counted by [`Ledger::tokens_generated`], or at least the
    /// token that opened the latest output block.
    generated: u64,
    /// What decay took off `output_blocks`, as added to the rank
    /// ([`DECAY_SCALE`](super::DECAY_SCALE) units).
    output_decay: u64,
    /// What decay took off the request's unshared prompt blocks, as added to the rank.
    prompt_decay: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    block_size: u32,
    expected_output_tokens: Option<u32>,
    booked_at: Instant,
    session: Option<SessionId>,
    dispatch: DispatchState,
    first_token_seen: bool,
    /// The last token event (first token or block boundary) timed by a caller's clock.
    last_token_at: Option<Instant>,
}

const SHARDS: usize = 16;

/// A booking's key: a request of this router (origin [`Key::LOCAL`]), or of another router of
/// the fleet (origin: that router's nonzero [`ReplicaId`](crate::ReplicaId)), so the two never
/// collide whatever ids their callers choose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Key {
    pub id: RequestId,
    pub origin: u64,
}

impl Key {
    pub(crate) const LOCAL: u64 = 0;

    /// A booking of the router `origin`.
    pub(crate) fn remote(origin: u64, id: RequestId) -> Self {
        Key { id, origin }
    }

    fn is_local(&self) -> bool {
        self.origin == Key::LOCAL
    }

    /// The key's 64 bits: the id itself for a local booking (as before origins), else mixed
    /// with its origin.
    #[inline]
    fn bits(&self) -> u64 {
        self.id.0 ^ mix64(self.origin).wrapping_mul(u64::from(!self.is_local()))
    }
}

impl From<RequestId> for Key {
    fn from(id: RequestId) -> Self {
        Key {
            id,
            origin: Key::LOCAL,
        }
    }
}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        h.write_u64(self.bits());
    }
}

/// The request table: which request holds what on which rank.
#[derive(Debug)]
pub(crate) struct Ledger {
    shards: [CachePadded<Mutex<HashMap<Key, Booking, PassThrough>>>; SHARDS],
    prompt_decay: PromptDecay,
    /// Bookings whose prompt load is decayed now, on any rank: while 0, no rank's
    /// [`LoadView::prompt_decay`](super::LoadView::prompt_decay) is either (selection bounds
    /// costs tighter then).
    decaying: AtomicU64,
    /// At most every rank's booked prefill tokens ([`Ledger::prefill_floor`]).
    prefill_floor: CachePadded<AtomicU64>,
    booked: AtomicU64,
    freed: AtomicU64,
    expired: AtomicU64,
    purged: AtomicU64,
    duplicate: AtomicU64,
    unknown: AtomicU64,
    retired_races: AtomicU64,
    /// Bookings of other routers held now.
    remote: AtomicU64,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            shards: std::array::from_fn(|_| CachePadded::new(Mutex::new(HashMap::default()))),
            prompt_decay: PromptDecay::default(),
            decaying: AtomicU64::new(0),
            prefill_floor: CachePadded::new(AtomicU64::new(0)),
            booked: AtomicU64::new(0),
            freed: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            purged: AtomicU64::new(0),
            duplicate: AtomicU64::new(0),
            unknown: AtomicU64::new(0),
            retired_races: AtomicU64::new(0),
            remote: AtomicU64::new(0),
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Ledger {
    #[cfg(test)]
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A ledger whose requests' unshared prompt blocks decay as `mode` says.
    pub(crate) fn with_prompt_decay(mode: PromptDecay) -> Self {
        Ledger {
            prompt_decay: mode,
            ..Self::default()
        }
    }

    fn shard(&self, key: Key) -> &Mutex<HashMap<Key, Booking, PassThrough>> {
        &self.shards[(mix64(key.bits()) >> 60) as usize % SHARDS]
    }

    /// Books a request on its rank: the prefill tokens, the prompt blocks not already active on
    /// the rank, the tail, one request.
    pub(crate) fn book(&self, spec: BookingSpec<'_>) -> Result<(), LoadError> {
        self.book_as(Key::LOCAL, spec)
    }

    /// [`Ledger::book`] for the router `origin` ([`Key::LOCAL`] for this one).
    pub(crate) fn book_as(&self, origin: u64, spec: BookingSpec<'_>) -> Result<(), LoadError> {
        let BookingSpec {
            request,
            state,
            prefill_tokens,
            block_hashes,
            tail_blocks,
            prompt_tokens,
            cached_tokens,
            block_size,
            expected_output_tokens,
            session,
            now,
        } = spec;
        {
            let key = Key::remote(origin, request);
            let mut shard = lock(self.shard(key));
            if shard.contains_key(&key) {
                drop(shard);
                bump(&self.duplicate);
                return Err(LoadError::DuplicateRequest { request });
            }
            // Under the shard lock, so that a concurrent free of the same id cannot release
            // references before they are taken.
            let l = &*state.load;
            let slot = {
                // The counter moves under the table's lock, so that its every value is the
                // table's distinct keys plus the tails at some moment.
                let mut refs = lock(&state.refs);
                let (slot, new_blocks) = refs.acquire(block_hashes);
                l.prompt_blocks
                    .fetch_add(new_blocks + tail_blocks, Ordering::Relaxed);
                slot
            };
            l.prefill_tokens
                .fetch_add(prefill_tokens, Ordering::Relaxed);
            l.requests.fetch_add(1, Ordering::Relaxed);
            let context_blocks = block_hashes.len() as u64 + tail_blocks;
            l.context_blocks
                .fetch_add(context_blocks, Ordering::Relaxed);
            state
                .role_context
                .fetch_add(context_blocks, Ordering::Relaxed);
            shard.insert(
                key,
                Booking {
                    state: Arc::clone(state),
                    prefill_tokens,
                    slot,
                    tail_blocks,
                    context_blocks,
                    output_blocks: 0,
                    generated: 0,
                    output_decay: 0,
                    prompt_decay: 0,
                    prompt_tokens,
                    cached_tokens,
                    block_size,
                    expected_output_tokens,
                    booked_at: now,
                    session,
                    dispatch: DispatchState::NotYet,
                    first_token_seen: false,
                    last_token_at: None,
                },
            );
        }
        if origin == Key::LOCAL {
            bump(&self.booked);
        } else {
            bump(&self.remote);
        }
        if state.is_retired() {
            // The worker left while we booked; the purge may have missed us. Whoever removes
            // the booking undoes it, so this cannot double-free.
            if let Some(b) = self.remove(Key::remote(origin, request)) {
                self.undo(b, now);
                bump(&self.retired_races);
            }
            return Err(LoadError::RankRetired {
                request,
                rank: state.rank,
            });
        }
        Ok(())
    }

    fn remove(&self, key: Key) -> Option<Booking> {
        let b = lock(self.shard(key)).remove(&key);
        if b.is_some() {
            self.note_removed(key);
        }
        b
    }

    fn note_removed(&self, key: Key) {
        if !key.is_local() {
            self.remote.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Releases everything `b` booked; the request's age is counted up to `now`.
    fn undo(&self, b: Booking, now: Instant) -> Freed {
        let l = &*b.state.load;
        {
            let mut refs = lock(&b.state.refs);
            let gone = refs.release(b.slot);
            l.prompt_blocks
                .fetch_sub(gone + b.tail_blocks, Ordering::Relaxed);
        }
        self.release_prefill(&b.state, b.prefill_tokens);
        // Counters with nothing to give back are not written.
        if b.output_blocks > 0 {
            l.output_blocks
                .fetch_sub(b.output_blocks, Ordering::Relaxed);
        }
        if b.output_decay > 0 {
            l.output_decay.fetch_sub(b.output_decay, Ordering::Relaxed);
        }
        if b.prompt_decay > 0 {
            l.prompt_decay.fetch_sub(b.prompt_decay, Ordering::Relaxed);
            self.decaying.fetch_sub(1, Ordering::Relaxed);
        }
        l.requests.fetch_sub(1, Ordering::Relaxed);
        l.context_blocks
            .fetch_sub(b.context_blocks, Ordering::Relaxed);
        b.state
            .role_context
            .fetch_sub(b.context_blocks + b.output_blocks, Ordering::Relaxed);
        Freed {
            rank: b.state.rank,
            prefill_tokens: b.prefill_tokens,
            output_blocks: b.output_blocks,
            prompt_tokens: b.prompt_tokens,
            cached_tokens: b.cached_tokens,
            dispatch: b.dispatch,
            age: now.saturating_duration_since(b.booked_at),
            session: b.session,
        }
    }

    /// A call for a booking that is not held; counted when it is this router's own.
    fn unknown(&self, key: impl Into<Key>) -> LoadError {
        let key = key.into();
        if key.is_local() {
            bump(&self.unknown);
        }
        LoadError::UnknownRequest { request: key.id }
    }

    /// The request reached its worker. Repeated calls are harmless.
    pub(crate) fn mark_dispatched(&self, request: RequestId) -> Result<WorkerRank, LoadError> {
        let key = Key::from(request);
        let mut shard = lock(self.shard(key));
        let Some(b) = shard.get_mut(&key) else {
            drop(shard);
            return Err(self.unknown(request));
        };
        b.dispatch = DispatchState::Reached;
        Ok(b.state.rank)
    }

    /// The request's first token arrived (at `now`, when the caller times it): its prefill
    /// tokens are no longer pending. Repeated calls are harmless (the second releases nothing
    /// and reports no elapsed time).
    pub(crate) fn prefill_done(
        &self,
        request: impl Into<Key>,
        now: Option<Instant>,
    ) -> Result<Step, LoadError> {
        let key = request.into();
        let mut shard = lock(self.shard(key));
        let Some(b) = shard.get_mut(&key) else {
            drop(shard);
            return Err(self.unknown(key));
        };
        let tokens = std::mem::take(&mut b.prefill_tokens);
        self.release_prefill(&b.state, tokens);
        let first = !std::mem::replace(&mut b.first_token_seen, true);
        let elapsed = match now {
            Some(now) if first => {
                b.last_token_at.get_or_insert(now);
                Some(now.saturating_duration_since(b.booked_at))
            }
            _ => None,
        };
        Ok(Step {
            rank: b.state.rank,
            dispatch: b.dispatch,
            elapsed,
            tokens: 0,
            decayed_at: 0,
        })
    }

    /// Generation crossed into a new block (at `now`, when the caller times it). With an
    /// expected output length, the request's output blocks decay (see the module comment).
    pub(crate) fn output_block(
        &self,
        request: impl Into<Key>,
        now: Option<Instant>,
    ) -> Result<Step, LoadError> {
        let key = request.into();
        let mut shard = lock(self.shard(key));
        let Some(b) = shard.get_mut(&key) else {
            drop(shard);
            return Err(self.unknown(key));
        };
        b.output_blocks += 1;
        let k = b.output_blocks;
        b.state.load.output_blocks.fetch_add(1, Ordering::Relaxed);
        b.state.role_context.fetch_add(1, Ordering::Relaxed);
        let g_k = generated_at_block(b.prompt_tokens, b.block_size, k);
        b.generated = b.generated.max(g_k);
        self.decay(b, g_k);
        let (g, g_before) = (
            generated_at_block(b.prompt_tokens, b.block_size, k),
            generated_at_block(b.prompt_tokens, b.block_size, k - 1).max(1),
        );
        let elapsed = now.and_then(|now| {
            b.last_token_at
                .replace(now)
                .map(|t| now.saturating_duration_since(t))
        });
        Ok(Step {
            rank: b.state.rank,
            dispatch: b.dispatch,
            elapsed,
            tokens: g.saturating_sub(g_before),
            decayed_at: g_k,
        })
    }

    /// Another router's request opened `blocks` output blocks, its decay taken at `generated`
    /// output tokens (as its own router took it).
    pub(crate) fn remote_output_blocks(
        &self,
        key: Key,
        blocks: u64,
        generated: u64,
    ) -> Result<(), LoadError> {
        let mut shard = lock(self.shard(key));
        let Some(b) = shard.get_mut(&key) else {
            drop(shard);
            return Err(self.unknown(key));
        };
        if blocks == 0 {
            return Ok(());
        }
        b.output_blocks += blocks;
        b.state
            .load
            .output_blocks
            .fetch_add(blocks, Ordering::Relaxed);
        b.state.role_context.fetch_add(blocks, Ordering::Relaxed);
        b.generated = b.generated.max(generated);
        self.decay(b, generated);
        Ok(())
    }

    /// `tokens` more output tokens arrived (at `now`, when the caller times it). Every output
    /// token counts, the first included: the first call with tokens also completes the
    /// prefill as [`Ledger::prefill_done`] does (and reports the TTFT); later calls report the
    /// time since the previous token event over their tokens (the ITL). Output blocks follow
    /// the count: the request holds `ceil((prompt + generated) / block size)` blocks, so a
    /// call may open several or none, and decay is taken at the count when one opens.
    /// Mixes with [`Ledger::output_block`], which counts at least the token opening its block.
    pub(crate) fn tokens_generated(
        &self,
        request: impl Into<Key>,
        tokens: u64,
        now: Option<Instant>,
    ) -> Result<Generated, LoadError> {
        let key = request.into();
        let mut shard = lock(self.shard(key));
        let Some(b) = shard.get_mut(&key) else {
            drop(shard);
            return Err(self.unknown(key));
        };
        let mut out = Generated {
            rank: b.state.rank,
            dispatch: b.dispatch,
            prefill_released: false,
            ttft: None,
            itl: None,
            itl_tokens: 0,
            new_blocks: 0,
            generated: b.generated,
        };
        if tokens == 0 {
            return Ok(out);
        }
        if !std::mem::replace(&mut b.first_token_seen, true) {
            let pending = std::mem::take(&mut b.prefill_tokens);
            self.release_prefill(&b.state, pending);
            out.prefill_released = true;
            if let Some(now) = now {
                b.last_token_at = Some(now);
                out.ttft = Some(now.saturating_duration_since(b.booked_at));
            }
        } else if let Some(now) = now {
            if let Some(prev) = b.last_token_at.replace(now) {
                out.itl = Some(now.saturating_duration_since(prev));
                out.itl_tokens = tokens;
            }
        }
        b.generated = b.generated.saturating_add(tokens);
        let bs = u64::from(b.block_size.max(1));
        let held = (b.prompt_tokens.saturating_add(b.generated)).div_ceil(bs)
            - b.prompt_tokens.div_ceil(bs);
        if held > b.output_blocks {
            out.new_blocks = held - b.output_blocks;
            b.output_blocks = held;
            b.state
                .load
                .output_blocks
                .fetch_add(out.new_blocks, Ordering::Relaxed);
            b.state
                .role_context
                .fetch_add(out.new_blocks, Ordering::Relaxed);
            let g = b.generated;
            self.decay(b, g);
        }
        out.generated = b.generated;
        Ok(out)
    }

    /// Re-weighs a request with an expected output length after `generated` output tokens:
    /// its output blocks, and with [`PromptDecay::Unshared`] its prompt blocks no other
    /// request on the rank holds, weigh what is left of its expected output.
    fn decay(&self, b: &mut Booking, generated: u64) {
        let Some(expected) = b.expected_output_tokens else {
            return;
        };
        let l = &*b.state.load;
        let left = remaining_fraction(generated, expected);
        let out = decayed(b.output_blocks, left);
        l.output_decay
            .fetch_add(out.saturating_sub(b.output_decay), Ordering::Relaxed);
        b.output_decay = out.max(b.output_decay);
        if self.prompt_decay == PromptDecay::Unshared {
            // Under the table's lock: the unshared count is read, and the decay moved, at
            // one moment of the rank's prefix table.
            let refs = lock(&b.state.refs);
            let unshared = refs.unshared(b.slot) as u64 + b.tail_blocks;
            let now = decayed(unshared, left);
            // The count of decaying bookings rises before a rank's decay does and falls
            // after, so that it is 0 only while no rank's is.
            if b.prompt_decay == 0 && now > 0 {
                self.decaying.fetch_add(1, Ordering::Relaxed);
            }
            if now >= b.prompt_decay {
                l.prompt_decay
                    .fetch_add(now - b.prompt_decay, Ordering::Relaxed);
            } else {
                l.prompt_decay
                    .fetch_sub(b.prompt_decay - now, Ordering::Relaxed);
            }
            drop(refs);
            if b.prompt_decay > 0 && now == 0 {
                self.decaying.fetch_sub(1, Ordering::Relaxed);
            }
            b.prompt_decay = now;
        }
    }

    /// A number of prefill tokens that every rank has booked at least: selection's floors
    /// count them on every rank before reading its load. Lowered at once whenever a rank's
    /// booked prefill falls below it (a release, or a new rank: [`Ledger::lower_prefill_floor`]),
    /// raised only by [`Ledger::refresh_prefill_floor`]; 0 until then.
    #[inline]
    pub(crate) fn prefill_floor(&self) -> u64 {
        self.prefill_floor.load(Ordering::SeqCst)
    }

    /// Keeps [`Ledger::prefill_floor`] at most `tokens`, some rank's booked prefill now.
    #[inline]
    pub(crate) fn lower_prefill_floor(&self, tokens: u64) {
        if tokens < self.prefill_floor.load(Ordering::SeqCst) {
            self.prefill_floor.fetch_min(tokens, Ordering::SeqCst);
        }
    }

    /// Raises [`Ledger::prefill_floor`] to the least prefill booked on `ranks` (every rank
    /// that can be selected; the caller covers ranks published meanwhile).
    ///
    /// The floor stays a floor against releases racing with the refresh. A release lowers its
    /// rank's counter, then (past a `SeqCst` fence) reads the floor; the refresh swaps its
    /// minimum in, then (past a `SeqCst` fence) reads every rank again and lowers the floor to
    /// any count below it. The fences order each side's write before its read, so a release
    /// that the second pass misses reads the swapped-in floor (or a lower one) and lowers it
    /// itself. A refresh that loses the swap to another writer changes nothing. The loom
    /// model `loom_a_refresh_racing_a_release_never_leaves_the_floor_above_a_rank` fails
    /// without either fence or without the second pass.
    pub(crate) fn refresh_prefill_floor<'a, I>(&self, ranks: I)
    where
        I: IntoIterator<Item = &'a RankState>,
        I::IntoIter: Clone,
    {
        let ranks = ranks.into_iter();
        let seen = self.prefill_floor.load(Ordering::SeqCst);
        let least = ranks
            .clone()
            .map(RankState::booked_prefill)
            .min()
            .unwrap_or(0);
        if least == seen
            || self
                .prefill_floor
                .compare_exchange(seen, least, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
        {
            return;
        }
        fence(Ordering::SeqCst);
        for r in ranks {
            self.lower_prefill_floor(r.booked_prefill());
        }
    }

    /// Releases `tokens` of prefill booked on `state`, keeping the floor under its new count.
    fn release_prefill(&self, state: &RankState, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let before = state
            .load
            .prefill_tokens
            .fetch_sub(tokens, Ordering::SeqCst);
        // The count's change is ordered before the floor is read (see
        // `refresh_prefill_floor`).
        fence(Ordering::SeqCst);
        self.lower_prefill_floor(before.wrapping_sub(tokens));
    }

    /// True when some booking's prompt load is decayed now (on some rank,
    /// [`LoadView::prompt_decay`] is not 0). Advisory, like every counter read.
    ///
    /// [`LoadView::prompt_decay`]: super::LoadView::prompt_decay
    pub(crate) fn prompt_decay_anywhere(&self) -> bool {
        self.decaying.load(Ordering::Relaxed) != 0
    }

    #[cfg(test)]
    /// The request ended: everything it booked is released.
    pub(crate) fn free(&self, request: RequestId) -> Result<Freed, LoadError> {
        self.free_at(request, Instant::now())
    }

    /// [`Ledger::free`] at `now`, which dates the request's [`Freed::age`].
    pub(crate) fn free_at(
        &self,
        request: impl Into<Key>,
        now: Instant,
    ) -> Result<Freed, LoadError> {
        let key = request.into();
        match self.remove(key) {
            Some(b) => {
                if key.is_local() {
                    bump(&self.freed);
                }
                Ok(self.undo(b, now))
            }
            None => Err(self.unknown(key)),
        }
    }

    /// Frees every request booked at or before `now - max_age`; returns how many.
    pub(crate) fn expire(&self, now: Instant, max_age: Duration) -> usize {
        let n = self.drain_where(now, |_, b| {
            now.saturating_duration_since(b.booked_at) >= max_age
        });
        self.expired.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Drops every booking on a rank of `worker` (whose ranks must already be retired);
    /// returns how many.
    pub(crate) fn purge_worker(&self, worker: WorkerId) -> usize {
        let n = self.drain_where(Instant::now(), |_, b| b.state.rank.worker == worker);
        self.purged.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Drops every booking of the router `origin` (another router of the fleet that left or
    /// resynchronises); returns how many.
    pub(crate) fn drop_origin(&self, origin: u64) -> usize {
        debug_assert_ne!(origin, Key::LOCAL);
        self.drain_where(Instant::now(), |k, _| k.origin == origin)
    }

    /// Removes every booking `drop` selects and undoes its load; returns how many.
    fn drain_where(&self, now: Instant, mut drop: impl FnMut(&Key, &Booking) -> bool) -> usize {
        let mut n = 0;
        for shard in &self.shards {
            let gone: Vec<Booking> = {
                let mut s = lock(shard);
                let ids: Vec<Key> = s
                    .iter()
                    .filter(|(k, b)| drop(k, b))
                    .map(|(id, _)| *id)
                    .collect();
                ids.iter()
                    .filter_map(|k| {
                        let b = s.remove(k)?;
                        self.note_removed(*k);
                        Some(b)
                    })
                    .collect()
            };
            for b in gone {
                self.undo(b, now);
                n += 1;
            }
        }
        n
    }

    /// The rank a request is booked on.
    pub(crate) fn rank_of(&self, request: RequestId) -> Option<WorkerRank> {
        let key = Key::from(request);
        lock(self.shard(key)).get(&key).map(|b| b.state.rank)
    }

    /// This router's requests currently booked.
    pub(crate) fn active(&self) -> usize {
        let all: usize = self.shards.iter().map(|s| lock(s).len()).sum();
        all.saturating_sub(self.active_remote())
    }

    /// Requests of the fleet's other routers currently booked.
    pub(crate) fn active_remote(&self) -> usize {
        self.remote.load(Ordering::Relaxed) as usize
    }

    /// Lifecycle counters.
    pub(crate) fn counts(&self) -> LedgerCounts {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LedgerCounts {
            booked: r(&self.booked),
            freed: r(&self.freed),
            expired: r(&self.expired),
            purged: r(&self.purged),
            duplicate_requests: r(&self.duplicate),
            unknown_requests: r(&self.unknown),
            retired_races: r(&self.retired_races),
        }
    }
}
