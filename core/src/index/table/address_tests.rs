use super::*;

fn key(i: u32) -> ChildKey {
    ChildKey {
        parent: i / 3,
        off: (i % 3) as u8,
        hash: u64::from(i).wrapping_mul(0x9E37_79B9),
    }
}

#[test]
fn an_entry_follows_its_slots_array_across_relinks_and_rebuilds() {
    let t = ChildTable::new();
    let mut w = ChildTableWriter::new(&t);
    for i in 0..100 {
        w.insert(&t, key(i), i, 1);
    }
    // Slot 5 relinked as a commit does it: the new link first, the old one removed after,
    // with enough inserts between to rebuild the table.
    let relinked = ChildKey {
        parent: 77,
        off: 9,
        hash: 5,
    };
    w.insert(&t, relinked, 5, 2);
    for i in 100..2000 {
        w.insert(&t, key(i), i, 1);
    }
    assert!(w.remove(key(5)));
    w.set_run(5, 3);
    w.set_run(7, 4);
    let table = t.load();
    assert_eq!(table.get(relinked), Some((5, 3)));
    assert_eq!(table.get(key(5)), None);
    assert_eq!(table.get(key(7)), Some((7, 4)));
    assert_eq!(table.get(key(1999)), Some((1999, 1)));
    // A slot whose entry is gone takes no address.
    assert!(w.remove(key(8)));
    w.set_run(8, 6);
    assert!(w.entries().all(|(_, slot, run)| slot != 8 && run != 6));
}
