use super::*;

#[test]
fn a_runs_writer_side_facts_take_24_bytes() {
    assert_eq!(std::mem::size_of::<SlotMeta>(), 24);
}

#[test]
fn room_is_counted_against_the_slot_limit() {
    let mut w = ShardWriter::new(0, false);
    assert!(w.has_room_for(MAX_SLOTS as usize));
    assert!(!w.has_room_for(MAX_SLOTS as usize + 1));
    let slot = w.alloc_slot();
    assert!(!w.has_room_for(MAX_SLOTS as usize));
    w.metas[slot as usize].live = false;
    w.free.push(slot);
    assert!(w.has_room_for(MAX_SLOTS as usize));
}
