use super::*;

#[test]
fn marks_only_rise_and_reset_with_the_slot() {
    let u = UseMarks::new();
    // Unallocated: ignored.
    u.mark(5, 3);
    u.reset(5);
    assert_eq!(u.last_used(5, 10), 0);
    u.mark(5, 3);
    u.mark(5, 2);
    assert_eq!(u.last_used(5, 10), 3);
    u.set_now(7);
    u.reset(5);
    assert_eq!(u.last_used(5, 10), 7);
    // A slot in a later segment; segment 1 is never allocated.
    u.reset(5_000);
    u.mark(5_000, 9);
    assert_eq!(u.last_used(5_000, 10), 9);
    let segments = (1024 + 4096) * 4;
    assert!(u.bytes() >= segments && u.bytes() < segments + 1024);
}

#[test]
fn marks_are_read_across_the_clocks_wrap() {
    let u = UseMarks::new();
    let before = (1u64 << 32) - 2;
    u.set_now(before);
    u.reset(1);
    assert_eq!(u.last_used(1, before + 6), before);
    // Marked just after the low half wrapped: newer than the mark `reset` left.
    u.mark(1, before + 5);
    assert_eq!(u.last_used(1, before + 6), before + 5);
    // An older clock read late does not lower it.
    u.mark(1, before + 1);
    assert_eq!(u.last_used(1, before + 6), before + 5);
}

#[test]
fn the_clock_is_what_the_writer_set() {
    let u = UseMarks::new();
    assert_eq!(u.now(), 0);
    u.set_now(41);
    assert_eq!(u.now(), 41);
}
