use super::*;

fn w(id: u64, tokens: u64, t0: Instant) -> Waiting<()> {
    Waiting {
        request: RequestId(id),
        tokens,
        enqueued_at: t0,
        lane: (id % 3) as usize,
        item: (),
    }
}

fn order(class: u8, jump: f64, arrival: f64, new: u64) -> OrderInput {
    OrderInput {
        class: PriorityClass(class),
        priority_jump: jump,
        arrival_secs: arrival,
        new_prefill_tokens: new,
    }
}

fn ids<T>(q: &AdmissionQueue<T>) -> Vec<u64> {
    q.iter().map(|w| w.request.0).collect()
}

#[test]
fn fcfs_orders_by_arrival_minus_jump_under_strict_classes() {
    let t0 = Instant::now();
    let mut q = AdmissionQueue::new(QueueOrder::Fcfs, 1_000);
    q.push(w(1, 10, t0), order(0, 0.0, 1.0, 10)).unwrap();
    q.push(w(2, 10, t0), order(0, 0.0, 2.0, 10)).unwrap();
    // Arrived at 3.0 with a 1.5 s jump: key 1.5, ahead of 2 (2.0), behind 1 (1.0).
    q.push(w(3, 10, t0), order(0, 1.5, 3.0, 10)).unwrap();
    // A higher class goes first whatever its arrival.
    q.push(w(4, 10, t0), order(1, 0.0, 9.0, 10)).unwrap();
    // Equal keys keep arrival order.
    q.push(w(5, 10, t0), order(0, 0.0, 2.0, 10)).unwrap();
    assert_eq!(ids(&q), vec![4, 1, 3, 2, 5]);
    assert_eq!(q.queued_tokens(), 50);
    assert_eq!(q.pop().unwrap().request, RequestId(4));
    assert_eq!(q.remove(RequestId(3)).unwrap().request, RequestId(3));
    assert!(q.remove(RequestId(3)).is_none(), "removed once");
    assert_eq!(ids(&q), vec![1, 2, 5]);
    assert_eq!(q.queued_tokens(), 30);
}

/// Lanes count their requests through every way in and out, and a walk over lane heads
/// that skips a lane never visits its requests.
#[test]
fn lanes_count_and_a_walk_over_heads_takes_in_order() {
    let t0 = Instant::now();
    let mut q = AdmissionQueue::new(QueueOrder::Fcfs, 1_000);
    for id in 1..=7u64 {
        // Lanes 1, 2, 0, 1, 2, 0, 1 (id % 3).
        q.push(w(id, 10, t0), order(0, 0.0, id as f64, 10)).unwrap();
    }
    assert_eq!((q.lane_len(0), q.lane_len(1), q.lane_len(2)), (2, 3, 2));
    assert_eq!((q.nonempty_lanes(), q.lane_len(9)), (3, 0));
    // Lane 2 given up on; lanes 0 and 1 taken head by head, in release order.
    let mut seen = Vec::new();
    while let Some((place, w)) = q.first_head(|lane| lane == 2) {
        seen.push(w.request.0);
        assert!(q.take(place).is_some());
        assert!(q.take(place).is_none(), "taken once");
    }
    assert_eq!(seen, vec![1, 3, 4, 6, 7]);
    assert_eq!(ids(&q), vec![2, 5]);
    assert_eq!(
        (q.lane_len(0), q.lane_len(1), q.nonempty_lanes()),
        (0, 0, 1)
    );
    // A request that jumps ahead of its lane's head becomes the head.
    q.push(w(8, 10, t0), order(0, 0.0, 0.5, 10)).unwrap();
    assert_eq!(q.first_head(|_| false).unwrap().1.request, RequestId(8));
    assert!(q.first_head(|lane| lane == 2).is_none());
    assert_eq!(q.pop().unwrap().request, RequestId(8));
    assert!(q.remove(RequestId(2)).is_some());
    assert_eq!(q.first_head(|_| false).unwrap().1.request, RequestId(5));
    assert!(q.remove(RequestId(5)).is_some());
    assert_eq!((q.lane_len(2), q.nonempty_lanes()), (0, 0));
    assert_eq!(q.queued_tokens(), 0);
    assert!(q.first_head(|_| false).is_none());
}

#[test]
fn wspt_orders_by_weight_over_new_prefill_tokens() {
    let t0 = Instant::now();
    let mut q = AdmissionQueue::new(QueueOrder::Wspt, 1_000_000);
    q.push(w(1, 4000, t0), order(0, 0.0, 1.0, 4000)).unwrap(); // 1/4000
    q.push(w(2, 4000, t0), order(0, 0.0, 2.0, 100)).unwrap(); // 1/100: mostly cached
    q.push(w(3, 1000, t0), order(0, 3.0, 3.0, 1000)).unwrap(); // 4/1000 = 1/250
    q.push(w(4, 50, t0), order(0, 0.0, 4.0, 0)).unwrap(); // fully cached: 1/1
    q.push(w(5, 10, t0), order(2, 0.0, 5.0, 9000)).unwrap(); // higher class
    assert_eq!(ids(&q), vec![5, 4, 2, 3, 1]);
}

#[test]
fn the_cap_refuses_with_the_numbers_and_hands_the_request_back() {
    let t0 = Instant::now();
    let mut q = AdmissionQueue::new(QueueOrder::Fcfs, 100);
    q.push(w(1, 60, t0), order(0, 0.0, 0.0, 60)).unwrap();
    q.push(w(2, 40, t0), order(0, 0.0, 0.0, 40)).unwrap();
    match q.push(w(3, 1, t0), order(0, 0.0, 0.0, 1)) {
        Err(Refused::OverCap(over, back)) => {
            assert_eq!(
                over,
                OverCap {
                    queued_tokens: 100,
                    cap_tokens: 100
                }
            );
            assert_eq!(back.request, RequestId(3));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        q.push(w(2, 1, t0), order(0, 0.0, 0.0, 1)),
        Err(Refused::Duplicate(_))
    ));
    q.pop().unwrap();
    q.push(w(3, 60, t0), order(0, 0.0, 0.0, 60)).unwrap();
    assert_eq!(q.len(), 2);
    let mut big = AdmissionQueue::new(QueueOrder::Fcfs, 10);
    assert!(matches!(
        big.push(w(9, 11, t0), order(0, 0.0, 0.0, 11)),
        Err(Refused::OverCap(
            OverCap {
                queued_tokens: 0,
                cap_tokens: 10
            },
            _
        ))
    ));
}
