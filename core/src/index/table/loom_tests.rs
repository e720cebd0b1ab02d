use super::*;
use loom::sync::Arc;

/// Two keys of one parent position whose probes start at the same entry.
fn colliding_keys(mask: usize) -> (ChildKey, ChildKey) {
    let a = ChildKey {
        parent: 7,
        off: 3,
        hash: 1,
    };
    let target = home(a.meta(), a.hash, mask);
    let hash = (2..)
        .find(|h| home(a.meta(), *h, mask) == target)
        .expect("some hash collides");
    (a, ChildKey { hash, ..a })
}

#[test]
fn a_reader_never_pairs_a_key_with_another_keys_value() {
    loom::model(|| {
        let table = Arc::new(TableInner::with_capacity(2));
        let (k1, k2) = colliding_keys(table.mask);
        let reader = {
            let table = Arc::clone(&table);
            loom::thread::spawn(move || (table.get(k1), table.get(k2)))
        };
        table.insert(k1, 11, 0);
        table.remove(k1);
        table.insert(k2, 22, 0);
        let (got1, got2) = reader.join().expect("reader");
        assert!(got1.is_none() || got1 == Some((11, 0)), "k1 -> {got1:?}");
        assert!(got2.is_none() || got2 == Some((22, 0)), "k2 -> {got2:?}");
        assert_eq!(table.get(k1), None);
        assert_eq!(table.get(k2), Some((22, 0)));
    });
}
