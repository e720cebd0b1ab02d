use super::*;
use std::collections::HashMap;

/// High halves by position, as a test sets them.
#[derive(Default)]
struct Highs(HashMap<u32, u32>);

impl HighHalves for Highs {
    fn high(&self, pos: u32) -> u32 {
        self.0[&pos]
    }
}

/// High halves that are the position itself.
struct Same;

impl HighHalves for Same {
    fn high(&self, pos: u32) -> u32 {
        pos
    }
}

#[test]
fn name_map_matches_a_hashmap() {
    let mut m = NameMap::default();
    let mut highs = Highs::default();
    let mut model = HashMap::new();
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    for step in 0..300_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Small names collide often; some are 0; the size swings up and down. Low halves
        // repeat across names (97 of them), so that a matching low half alone proves
        // nothing.
        let range = if (step / 50_000) % 2 == 0 { 5_000 } else { 300 };
        let k = x % range;
        let name = (k % 97) | (k / 97) << 32;
        let pos = step as u32;
        match x % 7 {
            0..=3 => {
                // Most positions keep the name's high half; one in five another, so that
                // the name goes to the side map.
                let high = match (x >> 20) % 5 {
                    0 => (name >> 32) as u32 ^ 0x55,
                    _ => (name >> 32) as u32,
                };
                highs.0.insert(pos, high);
                assert_eq!(m.insert(name, pos, &highs), model.insert(name, pos));
            }
            4 | 5 => assert_eq!(m.remove(name, &highs), model.remove(&name)),
            _ => assert_eq!(m.get(name, &highs), model.get(&name).copied()),
        }
        assert_eq!(m.len(), model.len());
    }
    assert!(!m.side.is_empty() && m.len > 0, "both maps in use");
    for (k, v) in &model {
        assert_eq!(m.get(*k, &highs), Some(*v));
    }
    m.retain(|k, _| k % 2 == 0, &highs);
    model.retain(|k, _| k % 2 == 0);
    assert_eq!(m.len(), model.len());
    for (k, v) in &model {
        assert_eq!(m.get(*k, &highs), Some(*v));
        m.prefetch(*k, false);
    }
    assert_eq!(m.get(1, &highs), None);
}

#[test]
fn a_low_half_that_matches_is_not_a_match_without_its_high_half() {
    let mut m = NameMap::default();
    m.reserve(10, &Same);
    // Two names with one low half, one home group and one tag: only the high half kept
    // at the entry's position tells them apart.
    let names: Vec<u64> = (1..1_000u64).map(|h| h << 32 | 7).collect();
    let (a, b) = names
        .iter()
        .enumerate()
        .find_map(|(i, &a)| {
            let twin = names[i + 1..].iter().find(|&&b| m.place(b) == m.place(a))?;
            Some((a, *twin))
        })
        .expect("a pair in a few groups");
    let pos = |n: u64| (n >> 32) as u32;
    assert_eq!(m.insert(a, pos(a), &Same), None);
    assert_eq!(m.get(b, &Same), None, "b is not a");
    assert_eq!(m.remove(b, &Same), None);
    assert_eq!(m.insert(b, pos(b), &Same), None, "b is new beside a");
    assert_eq!(
        (m.get(a, &Same), m.get(b, &Same)),
        (Some(pos(a)), Some(pos(b)))
    );
    assert_eq!(m.remove(a, &Same), Some(pos(a)));
    assert_eq!((m.get(a, &Same), m.get(b, &Same)), (None, Some(pos(b))));
    assert!(m.side.is_empty());
}

#[test]
fn a_name_the_position_does_not_know_is_kept_whole_and_moves_back() {
    let mut m = NameMap::default();
    let mut highs = Highs::default();
    m.reserve(10, &highs);
    let name = 0x1234_5678_9abc_def0u64;
    highs.0.insert(1, 0x1111);
    highs.0.insert(2, 0x1234_5678);
    // Position 1 keeps another high half: the name goes to the side map.
    assert_eq!(m.insert(name, 1, &highs), None);
    assert_eq!((m.len, m.side.len()), (0, 1));
    assert_eq!(m.find(name, &highs), Some((SIDE, 1)));
    // Stored again where its high half is kept: back in the table, once.
    assert_eq!(m.insert(name, 2, &highs), Some(1));
    assert_eq!((m.len, m.side.len()), (1, 0));
    assert_eq!(m.get(name, &highs), Some(2));
    // And out again.
    assert_eq!(m.insert(name, 1, &highs), Some(2));
    assert_eq!((m.len, m.side.len()), (0, 1));
    assert_eq!(m.remove(name, &highs), Some(1));
    assert_eq!(m.len(), 0);
    assert!(m.bytes() >= m.reserved_bytes());
}

#[test]
fn a_group_takes_64_bytes() {
    assert_eq!(GROUP_BYTES, 64);
}

#[test]
fn tag_matching_finds_every_equal_byte() {
    let word = u64::from_le_bytes([5, EMPTY, 5, 0x7F, EMPTY, 0, 5, 0xFF]);
    let m = matches(word, 5);
    assert_eq!(
        m & (0x80 | 0x80 << 16 | 0x80 << 48),
        0x80 | 0x80 << 16 | 0x80 << 48
    );
    assert_eq!(m >> COUNT_SHIFT, 0, "the overflow count is never a tag");
    assert_eq!(empties(word), 0x80 << 8 | 0x80 << 32);
    assert_eq!(overflow(word), 0xFF);
}

#[test]
fn overflow_counts_return_to_zero_when_the_names_that_raised_them_leave() {
    let mut m = NameMap::default();
    m.resize(8, &Same);
    // Ten names with one home group: seven fill it, three go on.
    let home: Vec<u64> = (0..u64::MAX)
        .map(|n| n << 32 | 9)
        .filter(|&n| m.place(n).0 == 3)
        .take(10)
        .collect();
    for &n in &home {
        assert_eq!(m.insert(n, (n >> 32) as u32, &Same), None);
    }
    assert_eq!(m.groups(), 8, "no rebuild in between");
    assert_eq!(overflow(m.ctrl[3]), 3);
    for &n in &home {
        assert_eq!(m.get(n, &Same), Some((n >> 32) as u32));
    }
    // Emptying the home group leaves the count: the three beyond must stay reachable.
    for &n in &home[..7] {
        let (i, _) = m.find(n, &Same).unwrap();
        m.vacate(i, n);
    }
    assert_eq!(overflow(m.ctrl[3]), 3);
    for &n in &home[7..] {
        assert_eq!(m.get(n, &Same), Some((n >> 32) as u32));
    }
    for &n in &home[7..] {
        let (i, _) = m.find(n, &Same).unwrap();
        m.vacate(i, n);
    }
    assert!(m.ctrl.iter().all(|&w| overflow(w) == 0));
    assert_eq!(m.len(), 0);
}

#[test]
fn reserved_room_is_neither_rebuilt_while_filling_nor_given_back() {
    let mut m = NameMap::default();
    m.reserve(10_000, &Same);
    let groups = m.groups();
    assert!(
        groups * GROUP * RESERVED_LOAD_PCT >= 10_000 * 100,
        "room for 10,000 at the reserved load"
    );
    // Names whose high half is their position, so that `Same` keeps it.
    let name = |n: u64| n << 32 | (n.wrapping_mul(0x9E37_79B9) & 0xFFFF_FFFF);
    let pos = |n: u64| n as u32;
    let mut model = HashMap::new();
    for n in 0..10_000u64 {
        assert_eq!(m.insert(name(n), pos(n), &Same), None);
        model.insert(name(n), pos(n));
    }
    assert_eq!(m.groups(), groups, "not rebuilt while it filled");
    // Half as many again fit before it grows.
    for n in 10_000..15_000u64 {
        assert_eq!(m.insert(name(n), pos(n), &Same), None);
    }
    assert_eq!(m.groups(), groups, "not rebuilt within the slack");
    for n in 10_000..15_000u64 {
        assert_eq!(m.remove(name(n), &Same), Some(pos(n)));
    }
    // Removals that leave it nearly empty do not shrink it below the reservation.
    let names: Vec<u64> = model.keys().copied().collect();
    for &n in &names[..9_990] {
        assert_eq!(m.remove(n, &Same), model.remove(&n));
    }
    assert_eq!(m.groups(), groups);
    for (k, v) in &model {
        assert_eq!(m.get(*k, &Same), Some(*v));
    }
    // Past the reservation it grows as an unreserved map would.
    for n in 20_000..40_000u64 {
        m.insert(name(n), pos(n), &Same);
    }
    assert!(m.groups() > groups);
    assert_eq!(m.len(), 20_010);
    for (k, v) in &model {
        assert_eq!(m.get(*k, &Same), Some(*v), "kept through the rebuilds");
    }
    // Clearing forgets the names and keeps the reserved room (not the growth past it).
    m.clear();
    assert_eq!((m.len(), m.groups()), (0, groups));
    assert_eq!(m.get(name(5), &Same), None);
}

#[test]
fn room_checked_for_a_batch_is_room_for_each_of_its_inserts() {
    let mut m = NameMap::default();
    assert!(!m.has_room_for(1), "an empty table has no groups yet");
    m.reserve(1_000, &Same);
    let groups = m.groups();
    // Room up to 70% full, and not one name more.
    let fit = groups * GROUP * 7 / 10;
    assert!(fit >= 1_500, "half as many again as reserved");
    assert!(m.has_room_for(fit));
    assert!(!m.has_room_for(fit + 1));
    let name = |n: u64| n << 32 | (n.wrapping_mul(0x9E37_79B9) & 0xFFFF_FFFF);
    for n in 0..fit as u64 {
        assert_eq!(
            m.insert_compared(name(n), n as u32, true, true, &Same),
            None
        );
    }
    assert_eq!((m.groups(), m.len()), (groups, fit));
    assert!(!m.has_room_for(1));
    // A replacement needs no room, and `insert` grows the table once it is due. (Position
    // 0's high half is 0: the name stays in the table.)
    assert_eq!(m.insert_compared(name(0), 0, true, true, &Same), Some(0));
    assert_eq!(m.insert(name(9_000), 9_000, &Same), None);
    assert!(m.groups() > groups);
    assert_eq!(m.get(name(0), &Same), Some(0));
}

#[test]
fn replacing_a_name_when_the_table_is_due_to_grow_keeps_one_entry() {
    let mut m = NameMap::default();
    let mut n = 0u64;
    while (m.len() + 1) * 10 <= m.groups() * GROUP * 7 || m.len() == 0 {
        n += 1;
        m.insert(n << 32 | 3, n as u32, &Same);
    }
    let len = m.len();
    assert_eq!(m.insert(1 << 32 | 3, 1, &Same), Some(1));
    assert_eq!(m.len(), len);
    assert_eq!(m.remove(1 << 32 | 3, &Same), Some(1));
    assert_eq!(m.get(1 << 32 | 3, &Same), None);
}
