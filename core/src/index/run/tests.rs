use super::*;

#[test]
fn hold_and_unhold_track_bits_per_rank_and_tier() {
    let mut r = RunBuf {
        parent: 0,
        parent_off: 0,
        hashes: vec![1, 2],
        holders: vec![],
    };
    assert_eq!(r.hold(3, 0, 0b01), 0);
    assert_eq!(r.hold(3, 0, 0b10), 0);
    assert_eq!(r.hold(3, 0, 0b11), 0b11);
    assert_eq!(r.hold(1, 1, 0b01), 0);
    assert_eq!(r.holders.len(), 2);
    assert_eq!(r.holders[0].rank, 1);
    assert_eq!(r.held_mask(), 0b11);
    assert_eq!(r.unhold(3, 0, 0b01), (0b01, 0));
    assert_eq!(r.unhold(3, 0, 0b01), (0, 0));
    r.hold(3, 1, 0b10);
    assert_eq!(r.unhold(3, 0, 0b11), (0b10, 0b10));
    assert_eq!(r.unhold(3, 1, 0b10), (0b10, 0));
    assert_eq!(r.unhold(7, 0, 0b10), (0, 0));
    assert!(!r.has_rank(3));
    assert!(r.has_rank(1));
}

#[test]
fn a_run_reads_back_as_it_was_written() {
    let buf = RunBuf {
        parent: 77,
        parent_off: 63,
        hashes: (0..64).map(|i| i * 3 + 1).collect(),
        holders: vec![
            Holder {
                rank: 0,
                tier: 0,
                mask: !0,
            },
            Holder {
                rank: u32::MAX >> 8,
                tier: 3,
                mask: 0b101,
            },
        ],
    };
    let mut out = vec![MaybeUninit::new(u64::MAX); buf.words() + 1];
    assert_eq!(buf.write(&mut out), buf.words());
    assert_eq!(
        buf.write(&mut out[..10]),
        10,
        "a short buffer takes what fits"
    );
    assert_eq!(buf.write(&mut out), buf.words());
    // SAFETY: every element was initialised above.
    #[allow(unsafe_code)]
    let words: Vec<u64> = out[..buf.words()]
        .iter()
        .map(|w| unsafe { w.assume_init() })
        .collect();
    let run = Run::parse(&words).unwrap();
    assert_eq!((run.parent, run.parent_off), (77, 63));
    assert_eq!(run.hashes, &buf.hashes[..]);
    let holders: Vec<Holder> = holders_of(run.holders).collect();
    assert_eq!(holders, buf.holders);
    let mut copy = RunBuf::default();
    copy.copy_run(run);
    assert_eq!(copy.words(), buf.words());
    assert!(Run::parse(&words[..words.len() - 1]).is_none());
}
