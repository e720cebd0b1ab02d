//! Unit tests of the sequence state machine.

use super::*;

fn tracker() -> SeqTracker<&'static str> {
    SeqTracker::new(SequenceConfig {
        max_held: 3,
        restart_below: 4,
    })
}

#[test]
fn the_first_batch_is_applied_whatever_its_seq_and_contiguous_ones_follow() {
    let mut t = tracker();
    assert_eq!(t.offer_live(40, "a"), Verdict::Apply("a"));
    assert_eq!(t.offer_live(41, "b"), Verdict::Apply("b"));
    assert_eq!(t.next_expected(), Some(42));
    assert_eq!(t.counts().applied, 2);
}

#[test]
fn an_older_seq_above_the_restart_window_is_a_duplicate() {
    let mut t = tracker();
    t.offer_live(10, "a");
    t.offer_live(11, "b");
    assert_eq!(t.offer_live(10, "again"), Verdict::Duplicate);
    assert_eq!(t.next_expected(), Some(12));
    assert_eq!(t.counts().duplicates, 1);
}

#[test]
fn a_seq_back_near_zero_is_a_restart_that_drops_held_batches() {
    let mut t = tracker();
    t.offer_live(10, "a");
    assert!(matches!(t.offer_live(12, "held"), Verdict::Held { .. }));
    assert_eq!(t.offer_live(0, "new"), Verdict::Restart("new"));
    assert_eq!(t.next_expected(), Some(1));
    assert!(!t.is_replaying());
    assert_eq!(t.held(), 0);
    assert_eq!(t.offer_live(1, "next"), Verdict::Apply("next"));
    let c = t.counts();
    assert_eq!((c.restarts, c.dropped_at_restart), (1, 1));
}

#[test]
fn a_restart_whose_first_batches_were_missed_is_still_a_restart() {
    let mut t = tracker();
    t.offer_live(100, "a");
    assert_eq!(t.offer_live(3, "b"), Verdict::Restart("b"));
    assert_eq!(t.next_expected(), Some(4));
}

#[test]
fn a_gap_asks_for_one_replay_and_holds_what_comes_ahead() {
    let mut t = tracker();
    t.offer_live(0, "0");
    assert_eq!(
        t.offer_live(3, "3"),
        Verdict::Held {
            replay: Some(ReplayRequest { from: 1, until: 3 })
        }
    );
    // While the replay is outstanding, no second request.
    assert_eq!(t.offer_live(4, "4"), Verdict::Held { replay: None });
    assert_eq!(t.offer_live(4, "4 again"), Verdict::Duplicate);
    assert!(t.is_replaying());
    // The replay answers from 1: 1, 2, then 3 and 4 again, then its end.
    assert_eq!(t.offer_replayed(1, "1"), Verdict::Apply("1"));
    assert_eq!(t.offer_replayed(2, "2"), Verdict::Apply("2"));
    assert_eq!(t.offer_replayed(3, "3r"), Verdict::Apply("3r"));
    // A batch published while the answer was on its way arrives live.
    assert_eq!(t.offer_live(5, "5"), Verdict::Held { replay: None });
    let drain = t.replay_end();
    assert_eq!(drain.apply, vec![(4, "4"), (5, "5")]);
    assert_eq!(drain.replay, None);
    assert_eq!(t.next_expected(), Some(6));
    assert_eq!(t.held(), 0);
    let c = t.counts();
    assert_eq!(
        (c.gaps, c.replay_requests, c.replayed, c.released),
        (1, 1, 3, 2)
    );
    // The held 3 was replaced by the replayed one: counted as a duplicate at the drain.
    assert_eq!(c.duplicates, 2);
}

#[test]
fn a_replay_that_no_longer_reaches_back_reports_the_lost_range() {
    let mut t = tracker();
    t.offer_live(0, "0");
    t.offer_live(9, "9");
    assert_eq!(
        t.offer_replayed(5, "5"),
        Verdict::Lost {
            missing: 1..5,
            batch: "5"
        }
    );
    let c = t.counts();
    assert_eq!((c.lost_gaps, c.lost_batches), (1, 4));
}

#[test]
fn a_full_hold_drops_and_the_drain_asks_again_for_the_rest() {
    let mut t = tracker();
    t.offer_live(0, "0");
    for seq in 2..5 {
        assert!(matches!(t.offer_live(seq, "h"), Verdict::Held { .. }));
    }
    assert_eq!(t.offer_live(5, "5"), Verdict::Dropped { replay: None });
    // The replay answers only 1 (say the publisher's answer raced its buffer); 2..4 follow.
    assert_eq!(t.offer_replayed(1, "1"), Verdict::Apply("1"));
    let drain = t.replay_end();
    assert_eq!(drain.apply.len(), 3);
    assert_eq!(drain.replay, None);
    // 5 was dropped: the next live batch finds the gap and asks for it.
    assert_eq!(
        t.offer_live(6, "6"),
        Verdict::Held {
            replay: Some(ReplayRequest { from: 5, until: 6 })
        }
    );
    assert_eq!(t.counts().dropped, 1);
}

#[test]
fn a_gap_left_among_held_batches_asks_for_another_replay() {
    let mut t = tracker();
    t.offer_live(0, "0");
    t.offer_live(2, "2");
    t.offer_live(4, "4");
    t.offer_replayed(1, "1");
    let drain = t.replay_end();
    assert_eq!(drain.apply, vec![(2, "2")]);
    assert_eq!(drain.replay, Some(ReplayRequest { from: 3, until: 4 }));
    assert!(t.is_replaying());
}

#[test]
fn an_abandoned_replay_loses_the_gap_and_releases_what_follows() {
    let mut t = tracker();
    t.offer_live(0, "0");
    t.offer_live(3, "3");
    t.offer_live(4, "4");
    let (lost, drain) = t.abandon_replay();
    assert_eq!(lost, 1..3);
    assert_eq!(drain.apply, vec![(3, "3"), (4, "4")]);
    assert_eq!(t.next_expected(), Some(5));
    assert!(!t.is_replaying());
    assert_eq!(t.counts().lost_batches, 2);
}

#[test]
fn a_replayed_duplicate_is_skipped() {
    let mut t = tracker();
    t.offer_live(0, "0");
    t.offer_live(1, "1");
    assert_eq!(t.offer_replayed(1, "1"), Verdict::Duplicate);
}

/// A publisher whose live batches are dropped at random and whose replay answers a request
/// some live messages later with everything published so far: every batch from the first
/// delivered to (at least) the last delivered is applied exactly once, in order, however the
/// drops and delays fall.
mod replay_model {
    use proptest::prelude::*;

    use super::*;

    /// Notes a verdict: an applied seq, or a replay request answered at live index `due`.
    fn note(
        v: Verdict<u64>,
        applied: &mut Vec<u64>,
        pending: &mut Option<(u64, usize)>,
        due: usize,
    ) {
        match v {
            Verdict::Apply(s) => applied.push(s),
            Verdict::Held { replay } | Verdict::Dropped { replay } => {
                if let Some(r) = replay {
                    *pending = Some((r.from, due));
                }
            }
            Verdict::Duplicate => {}
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Feeds the live batches (`delivered[seq]`: whether seq arrives) to a tracker, in order; a
    /// replay request is answered after `delay` more live messages. Returns the seqs applied.
    fn run(delivered: &[bool], delay: usize) -> Vec<u64> {
        let mut t: SeqTracker<u64> = SeqTracker::default();
        let mut applied = Vec::new();
        let mut pending: Option<(u64, usize)> = None; // (from, answered at live index)
        let n = delivered.len();
        for i in 0..=n {
            // The publisher has published 0..i; a due replay is answered first.
            if let Some((from, due)) = pending {
                if due <= i || i == n {
                    pending = None;
                    for seq in from..i as u64 {
                        note(
                            t.offer_replayed(seq, seq),
                            &mut applied,
                            &mut pending,
                            i + delay,
                        );
                    }
                    let drain = t.replay_end();
                    applied.extend(drain.apply.iter().map(|&(s, _)| s));
                    if let Some(r) = drain.replay {
                        pending = Some((r.from, i + delay));
                    }
                }
            }
            if delivered.get(i) == Some(&true) {
                note(
                    t.offer_live(i as u64, i as u64),
                    &mut applied,
                    &mut pending,
                    i + delay,
                );
            }
        }
        assert_eq!(t.held(), 0, "the last replay answered everything published");
        applied
    }

    proptest! {
        #[test]
        fn every_batch_up_to_the_last_delivered_is_applied_once_in_order(
            delivered in proptest::collection::vec(proptest::bool::weighted(0.8), 1..200),
            delay in 0_usize..6,
        ) {
            let applied = run(&delivered, delay);
            // From the first batch delivered, a contiguous run that reaches at least the last
            // one delivered (a replay may bring later ones, published by the time it answers).
            let first = delivered.iter().position(|&d| d).map_or(0, |f| f as u64);
            let last = delivered.iter().rposition(|&d| d).map(|l| l as u64);
            let run: Vec<u64> = (first..first + applied.len() as u64).collect();
            prop_assert_eq!(&applied, &run);
            if let Some(last) = last {
                prop_assert!(applied.last() >= Some(&last));
            }
        }
    }
}

#[test]
fn live_copies_of_replayed_batches_are_duplicates_even_near_zero() {
    let mut t = tracker();
    assert_eq!(t.offer_live(0, "0"), Verdict::Apply("0"));
    // Seq 1 is lost; seq 2 arrives and is held while 1.. is replayed.
    assert!(matches!(
        t.offer_live(2, "2"),
        Verdict::Held { replay: Some(_) }
    ));
    // The replay answers with everything the publisher holds, ahead of the live stream.
    assert_eq!(t.offer_replayed(1, "1"), Verdict::Apply("1"));
    assert_eq!(t.offer_replayed(2, "2"), Verdict::Apply("2"));
    assert_eq!(t.offer_replayed(3, "3"), Verdict::Apply("3"));
    assert!(t.replay_end().apply.is_empty());
    // Seq 3's live copy arrives after it: below the expected 4 and the restart bound, yet a
    // duplicate, because the replay fetched it.
    assert_eq!(t.offer_live(3, "3 again"), Verdict::Duplicate);
    assert_eq!(t.counts().restarts, 0);
    // The live stream catches up; a real restart afterwards is still seen.
    assert_eq!(t.offer_live(4, "4"), Verdict::Apply("4"));
    assert!(matches!(
        t.offer_live(0, "new 0"),
        Verdict::Restart("new 0")
    ));
    assert_eq!(t.counts().restarts, 1);
}

#[test]
fn lost_batches_saturate_rather_than_wrap_after_huge_sequence_jumps() {
    let mut t = tracker();
    t.offer_live(0, "0");
    t.offer_live(u64::MAX - 2, "far");
    let (lost, _) = t.abandon_replay();
    assert_eq!(lost, 1..u64::MAX - 2);
    // A second jump as far: the count stays at its ceiling, never wraps to a small number.
    assert!(matches!(
        t.offer_replayed(u64::MAX - 1, "x"),
        Verdict::Apply(_) | Verdict::Lost { .. }
    ));
    t.offer_live(0, "restart");
    t.offer_live(u64::MAX - 1, "far again");
    let _ = t.abandon_replay();
    assert!(
        t.counts().lost_batches >= u64::MAX - 3,
        "{}",
        t.counts().lost_batches
    );
}

#[test]
fn a_new_epoch_drops_what_is_held_and_takes_the_next_batch_whatever_its_seq() {
    let mut t = tracker();
    t.offer_live(10, "a");
    assert!(matches!(t.offer_live(12, "held"), Verdict::Held { .. }));
    t.new_epoch();
    assert_eq!(t.next_expected(), None);
    assert!(!t.is_replaying());
    assert_eq!(t.held(), 0);
    // The new process's batches, as its replay gives them: a seq equal to the old next one
    // is no duplicate.
    assert_eq!(t.offer_replayed(11, "new"), Verdict::Apply("new"));
    assert_eq!(t.offer_live(12, "next"), Verdict::Apply("next"));
    let c = t.counts();
    assert_eq!((c.restarts, c.dropped_at_restart, c.duplicates), (1, 1, 0));
}

#[test]
fn an_expected_seq_turns_a_later_first_batch_into_a_gap() {
    let mut t = tracker();
    t.expect(0);
    assert_eq!(
        t.offer_live(2, "2"),
        Verdict::Held {
            replay: Some(ReplayRequest { from: 0, until: 2 })
        }
    );
    // Only a tracker that expects nothing yet takes it.
    t.expect(7);
    assert_eq!(t.next_expected(), Some(0));
}
