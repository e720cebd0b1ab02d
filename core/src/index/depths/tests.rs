use super::*;

/// Holder words of rank `id`: one `(tier, mask)` pair per tier.
fn group(id: u32, holders: &[(u8, u64)]) -> Vec<u64> {
    holders
        .iter()
        .flat_map(|&(t, mask)| [u64::from(id) << 8 | u64::from(t), mask])
        .collect()
}

fn key(id: u32, epoch: u32) -> RankKey {
    RankKey { id, epoch }
}

#[test]
fn entries_split_tiers_only_when_blocks_sit_in_several() {
    let mut d = RankDepths::default();
    d.begin(4, 0);
    // Device holds blocks 0..2, host 0..5: blocks 2..5 are host's.
    d.first(1, &group(1, &[(0, 0b11), (1, 0b11111)]), 5);
    // Two tiers, but the device one covers every leading block.
    d.first(2, &group(2, &[(0, 0b111), (1, 0b1)]), 3);
    assert_eq!(d.per_tier(1), [2, 3, 0, 0]);
    assert_eq!(d.get(1).unwrap().tier, None);
    assert_eq!(d.get(2).unwrap().tier, Some(StorageTier::Device));
    assert_eq!(d.per_tier(2), [3, 0, 0, 0]);
    // A later run in disk for rank 2 makes it mixed; in device for rank 1 adds to device.
    d.add(2, &group(2, &[(2, 0b1)]), 1);
    d.add(1, &group(1, &[(0, 0b111)]), 3);
    assert_eq!(d.per_tier(2), [3, 0, 1, 0]);
    assert_eq!(d.per_tier(1), [5, 3, 0, 0]);
    assert_eq!(d.get(1).unwrap().blocks, 8);
    assert_eq!(d.ids().collect::<Vec<_>>(), [1, 2]);
    assert_eq!(d.get(0), None);
    assert_eq!(d.get(9), None);
}

#[test]
fn raises_add_device_blocks_and_only_ever_raise() {
    let mut d = RankDepths::default();
    d.begin(2, 0);
    d.first(0, &group(0, &[(1, 0b111)]), 3);
    assert!(!d.raise(key(0, 0), 3));
    assert!(d.raise(key(0, 0), 5));
    assert_eq!(d.per_tier(0), [2, 3, 0, 0]);
    // A rank the walk did not score, beyond the table: it grows.
    assert!(d.raise(key(7, 0), 4));
    assert_eq!(d.per_tier(7), [4, 0, 0, 0]);
    assert_eq!(d.ids().collect::<Vec<_>>(), [0, 7]);
    // A key given out after the match began: neither read nor raised.
    d.begin(8, 3);
    d.first(2, &group(2, &[(0, 1)]), 1);
    assert_eq!(d.get_for(key(2, 3)).map(|x| x.blocks), Some(1));
    assert_eq!(d.get_for(key(2, 4)), None);
    assert!(!d.raise(key(2, 4), 9));
    assert!(d.raise(key(2, 2), 9));
}

/// The first run kept as it is reads as the eager walk writes it, ids past the table left
/// out, even after a raise grows the table.
#[test]
fn a_kept_first_run_reads_as_the_eager_walk_writes_it() {
    let words: Vec<u64> = [
        group(0, &[(0, 0b1111)]),
        group(1, &[(0, 0b11), (1, 0b1111)]),
        group(2, &[(1, 0b111)]),
        group(3, &[(0, 0b1111)]),
    ]
    .concat();
    let m = 4;
    let mut both = [RankDepths::default(), RankDepths::default()];
    both[1].set_eager(true);
    for d in &mut both {
        d.begin(3, 0);
        let ranks = std::sync::Arc::new(vec![None; 4]);
        super::super::read::Sink::first_run(d, 0, &words, m, &ranks);
        // Rank 3 is past the table of 3; a record then raises rank 4, growing it.
        d.raise(key(4, 0), 2);
    }
    let [lazy, eager] = &both;
    for id in 0..6 {
        assert_eq!(lazy.get(id), eager.get(id), "id {id}");
        assert_eq!(lazy.per_tier(id), eager.per_tier(id), "id {id}");
    }
    assert_eq!(lazy.get(3), None);
    assert_eq!(lazy.ids().collect::<Vec<_>>(), [0, 1, 2, 4]);
    assert_eq!(eager.ids().collect::<Vec<_>>(), [0, 1, 2, 4]);
    for least in 1..=5 {
        assert_eq!(
            lazy.ids_with_at_least(least).collect::<Vec<_>>(),
            eager.ids_with_at_least(least).collect::<Vec<_>>(),
            "at least {least}"
        );
    }
    assert_eq!(
        lazy.deepest_ids().collect::<Vec<_>>(),
        eager.deepest_ids().collect::<Vec<_>>()
    );
}

#[test]
fn a_new_match_forgets_the_last_even_when_stamps_wrap() {
    let mut d = RankDepths::default();
    d.begin(2, 0);
    d.first(1, &group(1, &[(0, 1)]), 1);
    d.first(0, &group(0, &[(0, 1)]), 1);
    d.begin(2, 0);
    assert_eq!(d.get(1), None);
    // Rank 1's entry carries stamp 1, the stamp the wrap starts over at.
    d.stamp = STAMP_LIMIT - 1;
    d.begin(2, 0);
    assert_eq!(d.stamp, 1);
    assert_eq!((d.get(0), d.get(1)), (None, None));
    assert_eq!(d.ids().count(), 0);
}
