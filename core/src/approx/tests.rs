use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::cache::REFRESH_SLACK_NS;
use super::checkpoints::{
    checkpoint_at, checkpoint_count, checkpoints, first_checkpoint_from, is_checkpoint,
    DENSE_BLOCKS, STRIDE,
};
use super::*;
use crate::event::{WorkerId, WorkerRank};
use crate::hash::LocalHash;
use crate::index::RankKey;
use crate::rng::mix64;

fn locals(seed: u64, n: usize) -> Vec<LocalHash> {
    (0..n as u64)
        .map(|i| LocalHash(mix64(seed * 1_000_003 + i)))
        .collect()
}

/// All the checkpoint keys of a prompt.
fn marks_of(locals: &[LocalHash]) -> Vec<u64> {
    let mut k = Vec::new();
    checkpoint_keys_extend(locals, &mut k, usize::MAX);
    k
}

/// The index key the tests give a rank.
fn key_of(r: WorkerRank) -> RankKey {
    RankKey {
        id: r.worker.0 as u32 * 8 + r.dp_rank.0,
        epoch: 0,
    }
}

fn rec(c: &ApproxCache, marks: &[u64], r: WorkerRank, until: Instant) {
    c.record(marks, r, key_of(r), until, || true);
}

/// `lookup` from scratch keys (as a route starts with few).
fn look(c: &ApproxCache, l: &[LocalHash], now: Instant) -> Vec<(WorkerRank, u32)> {
    let mut keys = Vec::new();
    let mut got = Vec::new();
    c.lookup(l, &mut keys, now, |rank, d| got.push((rank, d)));
    got.sort();
    got
}

/// The closed forms agree with the definition, for every prompt length.
#[test]
fn checkpoint_positions_match_the_rule() {
    for n in 1..300 {
        let listed: Vec<usize> = checkpoints(n).collect();
        let literal: Vec<usize> = (0..n).filter(|&i| is_checkpoint(i, n)).collect();
        assert_eq!(listed, literal, "n = {n}");
        assert_eq!(checkpoint_count(n), literal.len(), "n = {n}");
        for (j, &i) in literal.iter().enumerate() {
            assert_eq!(checkpoint_at(j, n), i, "n = {n}, j = {j}");
        }
        for i in 0..n + 2 {
            let first = literal
                .iter()
                .position(|&c| c >= i)
                .unwrap_or(literal.len());
            assert_eq!(
                first_checkpoint_from(i, n, literal.len()),
                first,
                "n = {n}, i = {i}"
            );
        }
    }
}

/// A checkpoint's key names the prefix up to it, whatever the prompt's length: a prefix
/// of a prompt has the prompt's keys at the checkpoints they share, and a different
/// block anywhere before a checkpoint changes its key.
#[test]
fn checkpoint_keys_name_prefixes_at_any_length() {
    let a = locals(1, 300);
    let all = marks_of(&a);
    for n in 1..=a.len() {
        let part = marks_of(&a[..n]);
        assert_eq!(part.len(), checkpoint_count(n));
        // One block more, with a hash of 0 (or all ones): the shorter prompt's last key
        // is not among the longer one's, whatever the extra block.
        for extra in [0, u64::MAX] {
            let mut longer = a[..n].to_vec();
            longer.push(LocalHash(extra));
            let last = *part.last().unwrap();
            let is_checkpoint =
                (0..checkpoint_count(n + 1)).any(|jj| checkpoint_at(jj, n + 1) == n - 1);
            assert_eq!(
                marks_of(&longer).contains(&last),
                is_checkpoint,
                "n = {n}, extra {extra:#x}"
            );
        }
        for (j, &k) in part.iter().enumerate() {
            let i = checkpoint_at(j, n);
            match (0..all.len()).find(|&jj| checkpoint_at(jj, a.len()) == i) {
                // The same block is a checkpoint of both: the same prefix, the same key.
                Some(jj) => assert_eq!(k, all[jj], "n = {n}, block {i}"),
                // The prefix's own last checkpoint: a prefix no checkpoint of `a` ends at.
                None => assert!(!all.contains(&k), "n = {n}, block {i}"),
            }
        }
        // One block changed, or two swapped (within a pair, a run, or across runs), in
        // the dense part and past it: every key from the first one's checkpoint on
        // changes.
        for at in [11 % n, mix64(n as u64) as usize % n] {
            let mut b = a[..n].to_vec();
            b[at] = LocalHash(b[at].0 ^ 1);
            let mut variants = vec![(b, at)];
            for gap in [1, 2, 3, 7, 8, 17] {
                if at + gap < n {
                    let mut b = a[..n].to_vec();
                    b.swap(at, at + gap);
                    variants.push((b, at + gap));
                }
            }
            for (b, other) in variants {
                let changed = marks_of(&b);
                for (j, (&x, &y)) in part.iter().zip(&changed).enumerate() {
                    assert_eq!(
                        x == y,
                        checkpoint_at(j, n) < at,
                        "n = {n}, changed {at} and {other}"
                    );
                }
            }
        }
    }
}

#[test]
fn depth_is_exact_when_dense_and_never_above_the_truth() {
    let c = ApproxCache::new(1 << 20);
    let t0 = Instant::now();
    let r = WorkerRank::new(1, 0);
    let a = locals(1, 100);
    rec(&c, &marks_of(&a[..10]), r, t0 + Duration::from_secs(5));
    assert_eq!(look(&c, &a, t0), vec![(r, 10)]);
    rec(&c, &marks_of(&a), r, t0 + Duration::from_secs(5));
    assert_eq!(
        look(&c, &a, t0),
        vec![(r, 100)],
        "the last block is a checkpoint"
    );
    for q in [1usize, 15, 16, 17, 20, 47, 63, 64, 99] {
        // A query that shares q blocks and then diverges.
        let mut b = a[..q].to_vec();
        b.extend(locals(9, 50));
        let d = look(&c, &b, t0)[0].1 as usize;
        assert!(d <= q && d + STRIDE > q, "q = {q}, found {d}");
        if q <= DENSE_BLOCKS {
            assert_eq!(d, q);
        }
    }
    assert!(look(&c, &locals(2, 30), t0).is_empty());
}

/// The galloping search computes only the keys it looks at: none past the first for a
/// prompt no record starts, a few for a shallow record.
#[test]
fn lookup_extends_keys_only_as_far_as_it_looks() {
    let c = ApproxCache::new(1 << 20);
    let t0 = Instant::now();
    let a = locals(1, 512);
    rec(
        &c,
        &marks_of(&a[..3]),
        WorkerRank::new(1, 0),
        t0 + Duration::from_secs(5),
    );
    let other = locals(2, 512);
    let mut keys = Vec::new();
    c.lookup(&other, &mut keys, t0, |_, _| {});
    assert_eq!(keys.len(), 1);
    let mut keys = Vec::new();
    let mut depth = 0;
    c.lookup(&a, &mut keys, t0, |_, d| depth = d);
    assert_eq!(depth, 3);
    assert!(keys.len() <= 5, "{}", keys.len());
    assert_eq!(keys, marks_of(&a)[..keys.len()]);
}

/// Ranks searched one after another, most at one depth and some deeper or shallower (the
/// search tries the previous rank's depth first), each get the depth they get alone.
#[test]
fn depths_of_ranks_in_a_row_match_each_rank_alone() {
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs(5);
    let a = locals(3, 300);
    let depths = [
        30usize, 30, 30, 100, 30, 7, 30, 300, 31, 16, 17, 1, 299, 30, 64, 63, 65,
    ];
    let all = ApproxCache::new(1 << 20);
    let mut want = Vec::new();
    for (w, &d) in depths.iter().enumerate() {
        let r = WorkerRank::new(w as u64, 0);
        rec(&all, &marks_of(&a[..d]), r, until);
        let alone = ApproxCache::new(1 << 20);
        rec(&alone, &marks_of(&a[..d]), r, until);
        want.extend(look(&alone, &a, t0));
    }
    want.sort();
    assert_eq!(look(&all, &a, t0), want);
}

/// A record never outlives its TTL, and a longer-lived refresh of a prefix keeps the
/// prefix only.
#[test]
fn records_never_outlive_their_ttl() {
    let c = ApproxCache::new(1 << 20);
    let t0 = Instant::now();
    let r = WorkerRank::new(1, 0);
    let a = locals(1, 40);
    rec(&c, &marks_of(&a), r, t0 + Duration::from_secs(2));
    rec(&c, &marks_of(&a[..8]), r, t0 + Duration::from_secs(10));
    let depth = |at: Instant| look(&c, &a, at).first().map_or(0, |x| x.1);
    assert_eq!(depth(t0 + Duration::from_millis(1999)), 40);
    assert_eq!(depth(t0 + Duration::from_secs(2)), 8);
    assert_eq!(depth(t0 + Duration::from_secs(10)), 0);
    // 18 checkpoints (blocks 0-15, 31, 39); the first 8 live on.
    assert_eq!(c.counts().records, 18);
    assert_eq!(c.sweep(t0 + Duration::from_secs(2)), 18 - 8);
    assert_eq!(c.sweep(t0 + Duration::from_secs(10)), 8);
    assert!(c.is_empty());
}

#[test]
fn retiring_a_rank_drops_its_records_and_new_ones_count_again() {
    let c = ApproxCache::new(1 << 20);
    let t0 = Instant::now();
    let (r1, r2) = (WorkerRank::new(1, 0), WorkerRank::new(2, 0));
    let a = locals(1, 20);
    rec(&c, &marks_of(&a), r1, t0 + Duration::from_secs(5));
    rec(&c, &marks_of(&a), r2, t0 + Duration::from_secs(5));
    c.retire_rank(r1);
    assert_eq!(look(&c, &a, t0), vec![(r2, 20)]);
    rec(&c, &marks_of(&a[..5]), r1, t0 + Duration::from_secs(5));
    assert_eq!(look(&c, &a, t0), vec![(r1, 5), (r2, 20)]);
    // 17 checkpoints each (blocks 0-15, 19); rank 1 refreshed 5 of its own.
    assert_eq!(c.sweep(t0), 12, "the retired epoch's tail");
    c.remove_worker(WorkerId(2));
    assert_eq!(c.counts().records, 5);
}

/// A record asked for a rank that is leaving writes nothing: its worker's records may
/// already be gone, and must not come back.
#[test]
fn a_leaving_rank_gets_no_records() {
    let c = ApproxCache::new(1 << 20);
    let t0 = Instant::now();
    let r = WorkerRank::new(1, 0);
    let k = marks_of(&locals(1, 20));
    c.record(&k, r, key_of(r), t0 + Duration::from_secs(1), || false);
    assert!(c.is_empty());
    assert_eq!(c.counts().written, 0);
}

#[test]
fn the_cap_drops_and_counts() {
    let c = ApproxCache::new(10);
    let t0 = Instant::now();
    let k = marks_of(&locals(1, 14));
    rec(&c, &k, WorkerRank::new(1, 0), t0 + Duration::from_secs(1));
    let n = c.counts();
    assert_eq!((n.records, n.written, n.dropped), (10, 10, 4));
}

/// The table against a plain model (per rank: prefix key → generation and expiry, and a
/// query's depth is its deepest checkpoint live for the rank), over random records on
/// branching prompts, retirements, re-registrations, leaves, sweeps and lookups.
#[test]
fn agrees_with_a_plain_model() {
    /// Prefix key → (generation, expiry).
    type Records = HashMap<u64, (u32, Instant)>;
    #[derive(Default)]
    struct Model {
        /// rank → (key, generation, records).
        ranks: HashMap<WorkerRank, (RankKey, u32, Records)>,
    }
    impl Model {
        fn records(&self) -> usize {
            self.ranks.values().map(|r| r.2.len()).sum()
        }
    }
    let t0 = Instant::now();
    let ms = |x: u64| t0 + Duration::from_millis(x);
    let trunk = locals(1, 160);
    let branches: Vec<Vec<LocalHash>> = (0..4).map(|b| locals(10 + b, 120)).collect();
    let mut rng = crate::rng::Rng::new(7);
    let prompt = |rng: &mut crate::rng::Rng| {
        let cut = rng.below(trunk.len() as u64 + 1) as usize;
        let mut p = trunk[..cut].to_vec();
        let b = &branches[rng.below(branches.len() as u64) as usize];
        p.extend_from_slice(&b[..rng.below(b.len() as u64) as usize]);
        if p.is_empty() {
            p.push(trunk[0]);
        }
        p
    };
    for round in 0..40 {
        let c = ApproxCache::new(1 << 20);
        let mut m = Model::default();
        let mut epoch = 0u32;
        let mut epochs = HashMap::new();
        for _ in 0..300 {
            let r = WorkerRank::new(rng.below(6), rng.below(2) as u32);
            match rng.below(20) {
                0..=9 => {
                    let p = prompt(&mut rng);
                    let marks = marks_of(&p);
                    let until = ms(rng.below(100));
                    let key = RankKey {
                        id: r.worker.0 as u32 * 2 + r.dp_rank.0,
                        epoch: *epochs.get(&r).unwrap_or(&0),
                    };
                    let entry = m.ranks.entry(r).or_insert((key, 0, HashMap::new()));
                    if entry.0 != key {
                        // Registered again: the older records stop counting.
                        entry.0 = key;
                        entry.1 += 1;
                    }
                    let (key, generation) = (entry.0, entry.1);
                    c.record(&marks, r, key, until, || true);
                    for &mark in &marks {
                        let e = entry.2.entry(mark).or_insert((generation, until));
                        *e = if e.0 == generation {
                            (generation, e.1.max(until))
                        } else {
                            (generation, until)
                        };
                    }
                }
                10..=11 => {
                    c.retire_rank(r);
                    if let Some(e) = m.ranks.get_mut(&r) {
                        e.1 += 1;
                    }
                }
                12 => {
                    // Registered again under a new key, from its next record on.
                    epoch += 1;
                    epochs.insert(r, epoch);
                }
                13 => {
                    c.remove_worker(r.worker);
                    m.ranks.retain(|x, _| x.worker != r.worker);
                }
                14 => {
                    let now = ms(rng.below(100));
                    let before = m.records();
                    for (_, generation, recs) in m.ranks.values_mut() {
                        recs.retain(|_, &mut (g, t)| g == *generation && t > now);
                    }
                    assert_eq!(c.sweep(now), before - m.records(), "round {round}");
                }
                _ => {
                    let q = prompt(&mut rng);
                    let now = ms(rng.below(100));
                    let kq = marks_of(&q);
                    let mut want = Vec::new();
                    for (&rank, (_, generation, recs)) in &m.ranks {
                        let deepest = (0..checkpoint_count(q.len()))
                            .filter(|&j| {
                                recs.get(&kq[j])
                                    .is_some_and(|&(g, t)| g == *generation && t > now)
                            })
                            .map(|j| checkpoint_at(j, q.len()))
                            .max();
                        if let Some(i) = deepest {
                            want.push((rank, i as u32 + 1));
                        }
                    }
                    want.sort();
                    let mut got = Vec::new();
                    let mut keys = Vec::new();
                    c.lookup_over(&q, &mut keys, now, 0, &mut Keys(&m, &mut got));
                    got.sort();
                    assert_eq!(got, want, "round {round}");
                    assert_eq!(keys, kq[..keys.len()]);
                    // Down to a least depth: the same reports, less those shallower.
                    let least = rng.below(q.len() as u64 + 2) as u32;
                    let mut deep = Vec::new();
                    c.lookup_over(&q, &mut keys, now, least, &mut Keys(&m, &mut deep));
                    deep.sort();
                    want.retain(|&(_, d)| d >= least);
                    assert_eq!(deep, want, "round {round}, from {least} blocks");
                }
            }
            assert_eq!(c.counts().records, m.records(), "round {round}");
        }
    }

    /// Checks each reported key against the model's.
    struct Keys<'a>(&'a Model, &'a mut Vec<(WorkerRank, u32)>);
    impl Overlaps for Keys<'_> {
        fn raise(&mut self, rank: WorkerRank, key: RankKey, depth: u32) -> bool {
            assert_eq!(self.0.ranks[&rank].0, key);
            self.1.push((rank, depth));
            true
        }
    }
}

/// Many ranks recorded with one system prompt, each with its own tail: a query sharing the
/// prompt gets every rank at the prompt's depth, and ranks recorded deeper or shallower
/// at theirs, while looking at few keys past the shared depth.
#[test]
fn ranks_sharing_a_prompt_are_read_together() {
    let c = ApproxCache::new(1 << 20);
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs(5);
    let system = locals(1, 64);
    for w in 0..256u64 {
        let mut p = system.clone();
        p.extend(locals(100 + w, 64));
        rec(&c, &marks_of(&p), WorkerRank::new(w, 0), until);
    }
    // Two ranks hold shallower records only: of 20 blocks (the query sees its first 16,
    // the checkpoints they share), and of 3.
    rec(&c, &marks_of(&system[..20]), WorkerRank::new(300, 0), until);
    rec(&c, &marks_of(&system[..3]), WorkerRank::new(301, 0), until);
    let mut q = system.clone();
    q.extend(locals(7, 448));
    let mut keys = Vec::new();
    let mut got = Vec::new();
    c.lookup(&q, &mut keys, t0, |r, d| got.push((r.worker.0, d)));
    got.sort();
    let mut want: Vec<(u64, u32)> = (0..256).map(|w| (w, 64)).collect();
    want.extend([(300, 16), (301, 3)]);
    assert_eq!(got, want);
    // The gallop doubles the depth in blocks: it stops at the first checkpoint past 127
    // (the 23rd).
    assert!(keys.len() <= 23, "{}", keys.len());
}

/// A record of a chain the rank already holds to its end, expiring within the slack of
/// the one held, writes nothing; one that expires later by more, one that goes deeper,
/// and one made after the rank was retired each write their chain.
#[test]
fn a_record_the_rank_already_holds_is_not_written_again() {
    let c = ApproxCache::new(1 << 20);
    let t0 = Instant::now();
    let r = WorkerRank::new(1, 0);
    let p = locals(1, 64);
    let marks = marks_of(&p);
    let slack = Duration::from_nanos(REFRESH_SLACK_NS as u64);
    let until = t0 + Duration::from_secs(5);
    rec(&c, &marks, r, until);
    let written = c.counts().written;
    assert_eq!(written, marks.len() as u64);
    // Within the slack, and a prefix of the chain: nothing written, the first expiry kept.
    rec(&c, &marks, r, until + slack / 2);
    rec(&c, &marks_of(&p[..32]), r, until + slack / 2);
    assert_eq!(c.counts().written, written);
    assert_eq!(look(&c, &p, until + slack / 4), vec![]);
    assert_eq!(look(&c, &p, until - slack / 4), vec![(r, 64)]);
    // Later by more than the slack: the chain is refreshed.
    rec(&c, &marks, r, until + 2 * slack);
    assert_eq!(c.counts().written, 2 * written);
    assert_eq!(look(&c, &p, until + slack), vec![(r, 64)]);
    // Deeper: written.
    let mut longer = p.clone();
    longer.extend(locals(2, 16));
    rec(&c, &marks_of(&longer), r, until + 2 * slack);
    assert_eq!(
        c.counts().written,
        2 * written + marks_of(&longer).len() as u64
    );
    // Retired, then recorded within the slack: written again, and counted in lookups.
    c.retire_rank(r);
    assert_eq!(look(&c, &p, t0), vec![]);
    rec(&c, &marks, r, until + 2 * slack);
    assert_eq!(look(&c, &p, t0), vec![(r, 64)]);
}
