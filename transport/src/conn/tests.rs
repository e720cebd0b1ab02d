use super::*;

#[test]
fn backoff_doubles_within_jitter_and_caps() {
    let config = Backoff {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(100),
    };
    let mut b = BackoffState::new(config, 7);
    let mut step = config.initial;
    for _ in 0..10 {
        let d = b.next_delay();
        assert!(
            d >= step / 2 && d <= step,
            "{d:?} outside [{:?}, {step:?}]",
            step / 2
        );
        step = (step * 2).min(config.max);
    }
    b.reset();
    assert!(b.next_delay() <= config.initial);
}

#[test]
fn backoff_delays_differ_between_seeds() {
    let config = Backoff {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(1),
    };
    let a: Vec<_> = {
        let mut b = BackoffState::new(config, 1);
        (0..4).map(|_| b.next_delay()).collect()
    };
    let c: Vec<_> = {
        let mut b = BackoffState::new(config, 2);
        (0..4).map(|_| b.next_delay()).collect()
    };
    assert_ne!(a, c);
}
