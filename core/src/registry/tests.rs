use super::*;

#[test]
fn join_publishes_sorted_ranks_and_readiness_follows_min_workers() {
    let reg = Registry::new(16, 2);
    assert_eq!(
        reg.readiness(),
        Readiness::Waiting {
            joined: 0,
            needed: 2
        }
    );
    reg.join(WorkerConfig {
        dp_start: 2,
        dp_size: 2,
        ..WorkerConfig::simple(9, 100, 16)
    })
    .unwrap();
    assert!(matches!(
        reg.readiness(),
        Readiness::Waiting { joined: 1, .. }
    ));
    reg.join(WorkerConfig::simple(3, 100, 16)).unwrap();
    assert_eq!(reg.readiness(), Readiness::Ready);
    let f = reg.load();
    let ranks: Vec<WorkerRank> = f.ranks.iter().map(|r| r.rank).collect();
    assert_eq!(
        ranks,
        vec![
            WorkerRank::new(3, 0),
            WorkerRank::new(9, 2),
            WorkerRank::new(9, 3)
        ]
    );
    assert_eq!(f.rank_index(WorkerRank::new(9, 3)), Some(2));
    assert_eq!(f.worker(WorkerId(9)).unwrap().ranks, 1..3);
    assert_eq!(f.generation, 2);
}

/// The lookup table agrees with a binary search over the sorted ranks, for present and
/// absent ranks alike, across many workers with several dp ranks.
#[test]
fn rank_lookup_matches_a_binary_search() {
    let reg = Registry::new(16, 0);
    for w in 0..97u64 {
        reg.join(WorkerConfig {
            dp_start: (w % 3) as u32,
            dp_size: 1 + (w % 4) as u32,
            ..WorkerConfig::simple(w * 1_000_003, 100, 16)
        })
        .unwrap();
    }
    let f = reg.load();
    for w in 0..100u64 {
        for dp in 0..8 {
            let rank = WorkerRank::new(w * 1_000_003, dp);
            let expected = f.ranks.binary_search_by_key(&rank, |r| r.rank).ok();
            assert_eq!(f.rank_index(rank), expected, "{rank}");
        }
    }
    assert_eq!(Fleet::default().rank_index(WorkerRank::new(0, 0)), None);
}

#[test]
fn states_survive_other_workers_churn_and_leave_retires() {
    let reg = Registry::new(16, 0);
    reg.join(WorkerConfig::simple(1, 100, 16)).unwrap();
    let s1 = Arc::clone(&reg.load().ranks[0].state);
    reg.join(WorkerConfig::simple(2, 100, 16)).unwrap();
    assert!(Arc::ptr_eq(&s1, &reg.load().ranks[0].state));
    let retired = reg.leave(WorkerId(1)).unwrap();
    assert!(Arc::ptr_eq(&s1, &retired[0]));
    assert!(s1.is_retired());
    assert_eq!(reg.load().ranks.len(), 1);
    assert_eq!(reg.load().ranks[0].worker, 0);
}

#[test]
fn labels_are_interned_as_bits_and_capped() {
    let reg = Registry::new(16, 0);
    let with = |id: u64, labels: &[(&str, &str)]| WorkerConfig {
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..WorkerConfig::simple(id, 100, 16)
    };
    reg.join(with(1, &[("zone", "a"), ("gpu", "h100")]))
        .unwrap();
    reg.join(with(2, &[("zone", "b"), ("gpu", "h100")]))
        .unwrap();
    let f = reg.load();
    let (a, b, h) = (
        f.label_bit("zone", "a").unwrap(),
        f.label_bit("zone", "b").unwrap(),
        f.label_bit("gpu", "h100").unwrap(),
    );
    assert_eq!(f.ranks[0].label_bits, a | h);
    assert_eq!(f.ranks[1].label_bits, b | h);
    assert_eq!(f.label_bit("zone", "c"), None);
    let many: Vec<(String, String)> = (0..64).map(|i| ("k".to_string(), i.to_string())).collect();
    let err = reg
        .join(WorkerConfig {
            labels: many,
            ..WorkerConfig::simple(3, 100, 16)
        })
        .unwrap_err();
    assert_eq!(
        err,
        RegistryError::TooManyLabels {
            worker: WorkerId(3),
            limit: MAX_LABELS
        }
    );
    assert_eq!(reg.load().len(), 2, "the refused worker did not join");
}

#[test]
fn bad_joins_and_leaves_are_typed_errors() {
    let reg = Registry::new(16, 0);
    reg.join(WorkerConfig::simple(1, 100, 16)).unwrap();
    assert_eq!(
        reg.join(WorkerConfig::simple(1, 100, 16)).unwrap_err(),
        RegistryError::WorkerExists {
            worker: WorkerId(1)
        }
    );
    assert!(matches!(
        reg.join(WorkerConfig::simple(2, 100, 32)),
        Err(RegistryError::InvalidWorker {
            field: "block_size",
            ..
        })
    ));
    assert!(matches!(
        reg.join(WorkerConfig {
            dp_size: 0,
            ..WorkerConfig::simple(2, 100, 16)
        }),
        Err(RegistryError::InvalidWorker {
            field: "dp_size",
            ..
        })
    ));
    assert!(matches!(
        reg.join(WorkerConfig::simple(2, 0, 16)),
        Err(RegistryError::InvalidWorker {
            field: "kv_blocks",
            ..
        })
    ));
    assert_eq!(
        reg.leave(WorkerId(7)).unwrap_err(),
        RegistryError::UnknownWorker {
            worker: WorkerId(7)
        }
    );
}
