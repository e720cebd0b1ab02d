use super::*;

#[test]
fn bytes_round_trip() {
    for h in [Health::Healthy, Health::Unreachable, Health::Wedged] {
        assert_eq!(Health::from_u8(h.to_u8()), h);
    }
    assert_eq!(Health::from_u8(200), Health::Healthy);
}
