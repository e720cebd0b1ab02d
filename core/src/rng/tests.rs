use super::*;

#[test]
fn same_seed_same_stream_and_shared_matches_owned() {
    let mut a = Rng::new(42);
    let b = SharedRng::new(42);
    for _ in 0..100 {
        assert_eq!(a.next_u64(), b.next_u64());
    }
}

#[test]
fn below_is_in_range_and_roughly_uniform() {
    let mut rng = Rng::new(7);
    let mut counts = [0u32; 5];
    for _ in 0..50_000 {
        let x = rng.below(5);
        counts[x as usize] += 1;
    }
    for c in counts {
        assert!((9_000..11_000).contains(&c), "{counts:?}");
    }
    assert_eq!(rng.below(0), 0);
    assert_eq!(rng.below(1), 0);
}

#[test]
fn unit_is_in_half_open_interval() {
    let mut rng = Rng::new(1);
    for _ in 0..10_000 {
        let u = rng.unit_f64();
        assert!((0.0..1.0).contains(&u));
    }
}
