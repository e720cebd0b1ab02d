use super::*;
use std::collections::HashMap;

#[test]
fn table_matches_a_hashmap_under_inserts_and_removes() {
    let t = ChildTable::new();
    let mut w = ChildTableWriter::new(&t);
    let mut model = HashMap::new();
    let mut x = 0x1234_5678_u64;
    for i in 0..20_000u32 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let key = ChildKey {
            parent: (x % 97) as u32,
            off: (x % 5) as u8,
            hash: x % 1000,
        };
        if model.remove(&key).is_some() {
            assert!(w.remove(key));
        } else {
            w.insert(&t, key, i, u64::from(i) * 8);
            model.insert(key, i);
        }
        assert_eq!(w.len(), model.len());
    }
    for (k, v) in &model {
        assert_eq!(t.load().get(*k), Some((*v, u64::from(*v) * 8)));
    }
    let absent = ChildKey {
        parent: 1000,
        off: 0,
        hash: 1,
    };
    assert_eq!(t.load().get(absent), None);
}
