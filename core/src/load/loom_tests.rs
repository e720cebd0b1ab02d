use std::sync::Arc;
use std::time::{Duration, Instant};

use loom::sync::Arc as LoomArc;

use super::*;
use crate::event::{WorkerId, WorkerRank};
use crate::hash::LocalHash;

/// Loom's exhaustive search, bounded to two preemptions per execution (enough for the
/// races below, each of which needs one thread to stop between two steps of another),
/// so each model finishes in seconds.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(f);
}

fn blocks(locals: &[u64]) -> Vec<LocalHash> {
    locals.iter().map(|&x| LocalHash(x)).collect()
}

fn book(
    ledger: &Ledger,
    state: &Arc<RankState>,
    id: u64,
    keys: &[LocalHash],
) -> Result<(), LoadError> {
    ledger.book(BookingSpec {
        request: RequestId(id),
        state,
        prefill_tokens: 16 * keys.len() as u64 + 3,
        block_hashes: keys,
        tail_blocks: 1,
        prompt_tokens: 16 * keys.len() as u64 + 3,
        cached_tokens: 0,
        block_size: 16,
        expected_output_tokens: Some(40),
        session: None,
        now: Instant::now(),
    })
}

/// Nothing is left on the rank: every counter and every prefix reference is back to zero.
fn assert_idle(state: &RankState) {
    assert_eq!(state.load(), LoadView::default());
    assert_eq!(state.distinct_prefix_blocks(), 0);
}

/// A free by id, a guard's drop (which frees by the same id) and an expiry sweep race for
/// one request with output blocks: exactly one of them frees it, the others are told it
/// is unknown, and the rank's load returns to exactly zero.
#[test]
fn loom_free_by_id_guard_drop_and_expiry_free_exactly_once() {
    model(|| {
        let ledger = LoomArc::new(Ledger::new());
        let state = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let k = blocks(&[1, 2]);
        book(&ledger, &state, 7, &k).unwrap();
        ledger.output_block(RequestId(7), None).unwrap();
        let by_id = {
            let ledger = LoomArc::clone(&ledger);
            loom::thread::spawn(move || ledger.free(RequestId(7)).is_ok())
        };
        let expiry = {
            let ledger = LoomArc::clone(&ledger);
            loom::thread::spawn(move || ledger.expire(Instant::now(), Duration::ZERO))
        };
        // The guard's drop: `RequestGuard` frees its request by id through the router.
        let guard = ledger.free(RequestId(7)).is_ok();
        let by_id = by_id.join().unwrap();
        let expired = expiry.join().unwrap();
        assert_eq!(usize::from(by_id) + usize::from(guard) + expired, 1);
        assert_idle(&state);
        let c = ledger.counts();
        assert_eq!(c.freed + c.expired, 1);
        assert_eq!(c.unknown_requests, 2 - c.freed);
        assert_eq!(ledger.active(), 0);
    });
}

/// Two requests sharing a prefix are booked, advanced and freed on one rank at once: the
/// shared blocks are counted once while both hold them (the prompt-block counter moves
/// with the rank's prefix table, so no reading ever counts a freed request's blocks
/// beside a new booking's copy of them), and the counters end at zero.
#[test]
fn loom_concurrent_book_and_free_on_one_rank_leave_the_counters_at_zero() {
    model(|| {
        let ledger = LoomArc::new(Ledger::new());
        let state = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let other = {
            let ledger = LoomArc::clone(&ledger);
            let state = Arc::clone(&state);
            loom::thread::spawn(move || {
                let k = blocks(&[1, 2, 4]);
                book(&ledger, &state, 2, &k).unwrap();
                ledger.prefill_done(RequestId(2), None).unwrap();
                ledger.free(RequestId(2)).unwrap();
            })
        };
        let k = blocks(&[1, 2, 3]);
        book(&ledger, &state, 1, &k).unwrap();
        ledger.output_block(RequestId(1), None).unwrap();
        let held = state.load().prompt_blocks;
        assert!(
            (4..=6).contains(&held),
            "own 3 blocks and tail, at most 2 more: {held}"
        );
        ledger.free(RequestId(1)).unwrap();
        other.join().unwrap();
        assert_idle(&state);
        assert_eq!(ledger.counts().freed, 2);
    });
}

/// A booking races its worker leaving (retire, then purge): whichever removes the
/// booking undoes it, once.
#[test]
fn loom_booking_racing_a_leaving_worker_is_undone_once() {
    model(|| {
        let ledger = LoomArc::new(Ledger::new());
        let state = Arc::new(RankState::new(WorkerRank::new(3, 0)));
        let booker = {
            let ledger = LoomArc::clone(&ledger);
            let state = Arc::clone(&state);
            loom::thread::spawn(move || book(&ledger, &state, 1, &blocks(&[5])).is_ok())
        };
        state.retire();
        let purged = ledger.purge_worker(WorkerId(3));
        let booked = booker.join().unwrap();
        let c = ledger.counts();
        assert_eq!(c.purged + c.retired_races, 1);
        assert_eq!(purged as u64, c.purged);
        if booked {
            assert_eq!(purged, 1, "a booking that saw no retirement is purged");
        }
        assert_idle(&state);
        assert_eq!(ledger.active(), 0);
    });
}

/// A refresh of the booked-prefill floor races a release on one of its ranks and a
/// booking on the other: once both are done, the floor is at most every rank's booked
/// prefill (a refresh that swapped in a minimum read before the release must not leave
/// it standing). The model fails if the refresh's second pass is taken out.
#[test]
fn loom_a_refresh_racing_a_release_never_leaves_the_floor_above_a_rank() {
    model(|| {
        let ledger = LoomArc::new(Ledger::new());
        let a = Arc::new(RankState::new(WorkerRank::new(1, 0)));
        let b = Arc::new(RankState::new(WorkerRank::new(2, 0)));
        book(&ledger, &a, 1, &blocks(&[1])).unwrap();
        book(&ledger, &b, 2, &blocks(&[2])).unwrap();
        let release = {
            let ledger = LoomArc::clone(&ledger);
            loom::thread::spawn(move || {
                ledger.prefill_done(RequestId(1), None).unwrap();
            })
        };
        let refresh = {
            let (ledger, a, b) = (LoomArc::clone(&ledger), Arc::clone(&a), Arc::clone(&b));
            loom::thread::spawn(move || ledger.refresh_prefill_floor([&*a, &*b]))
        };
        book(&ledger, &b, 3, &blocks(&[3])).unwrap();
        release.join().unwrap();
        refresh.join().unwrap();
        let floor = ledger.prefill_floor();
        assert!(floor <= a.booked_prefill(), "{floor} over rank a");
        assert!(floor <= b.booked_prefill(), "{floor} over rank b");
    });
}
