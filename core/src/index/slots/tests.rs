use super::*;

#[test]
fn locate_covers_segments_contiguously() {
    assert_eq!(locate(0), (0, 0));
    assert_eq!(locate(1023), (0, 1023));
    assert_eq!(locate(1024), (1, 0));
    assert_eq!(locate(3071), (1, 2047));
    assert_eq!(locate(3072), (2, 0));
    let last = (Slots::CAPACITY - 1) as u32;
    assert_eq!(locate(last).0, SEGMENTS - 1);
}

fn publish(s: &Slots, i: u32, words: &[u64], guard: &Guard) {
    s.publish(
        i,
        words.len(),
        0,
        |out| {
            for (o, w) in out.iter_mut().zip(words) {
                o.write(*w);
            }
            words.len()
        },
        |_| {},
        guard,
    );
}

#[test]
fn slots_keep_values_across_growth() {
    let s = Slots::new();
    let guard = crossbeam_epoch::pin();
    assert!(s.load(5000, &guard).is_none());
    for i in [0u32, 1, 1023, 1024, 5000, 70_000] {
        publish(&s, i, &[i as u64, 7, 9], &guard);
    }
    for i in [0u32, 1, 1023, 1024, 5000, 70_000] {
        assert_eq!(s.load(i, &guard), Some(&[i as u64, 7, 9][..]));
    }
    assert!(s.load(2, &guard).is_none());
    s.clear(5000, |_| {}, &guard);
    assert!(s.load(5000, &guard).is_none());
    // A word the filler leaves reads as zero.
    s.publish(
        9,
        2,
        0,
        |out| {
            out[0].write(5);
            1
        },
        |_| {},
        &guard,
    );
    assert_eq!(s.load(9, &guard), Some(&[5, 0][..]));
}

#[test]
fn the_word_ahead_is_kept_apart_from_the_run() {
    let s = Slots::new();
    let guard = crossbeam_epoch::pin();
    s.publish(
        3,
        2,
        77,
        |out| {
            out[0].write(5);
            out[1].write(6);
            2
        },
        |_| {},
        &guard,
    );
    let address = s.address(3);
    assert_eq!(s.load(3, &guard), Some(&[5, 6][..]));
    assert_eq!(s.ahead(3), 77);
    // SAFETY: the address was read from the slot while `guard` was pinned.
    #[allow(unsafe_code)]
    let read = unsafe { s.ahead_at(address, &guard) };
    assert_eq!(read, 77);
    s.set_ahead(3, 99);
    assert_eq!(s.ahead(3), 99);
    assert_eq!(s.load(3, &guard), Some(&[5, 6][..]));
    // A slot without an array has no word to set, and reads as none.
    s.set_ahead(4, 1);
    assert_eq!(s.ahead(4), 0);
    // SAFETY: 0 names no array.
    #[allow(unsafe_code)]
    let none = unsafe { s.ahead_at(0, &guard) };
    assert_eq!(none, 0);
    // A new array takes the word it is published with.
    s.publish(
        3,
        1,
        0,
        |out| {
            out[0].write(8);
            1
        },
        |_| {},
        &guard,
    );
    assert_eq!(s.ahead(3), 0);
    assert_eq!(s.address_of_next2(3), 0);
}

#[test]
fn replaced_and_cleared_arrays_are_freed() {
    let s = Slots::new();
    for round in 0..1000u32 {
        let guard = crossbeam_epoch::pin();
        publish(&s, round % 7, &vec![round as u64; 64], &guard);
        if round % 5 == 0 {
            s.clear(round % 3, |_| {}, &guard);
        }
    }
    let guard = crossbeam_epoch::pin();
    assert_eq!(s.load(999 % 7, &guard).map(|w| w[0]), Some(999));
}
