use super::*;

#[test]
fn defaults_are_as_documented_and_valid() {
    let c = RouterConfig::default();
    assert_eq!(c.overlap_credit, 2.0);
    assert_eq!(c.prefill_load_scale, 32.0);
    assert_eq!(c.tier_credits(), [2.0, 0.75, 0.25, 0.25]);
    assert_eq!(c.temperature, 0.0);
    assert_eq!(c.min_workers, 0);
    assert_eq!(c.policy, Policy::KvAware);
    assert_eq!(c.metrics, Metrics::Off);
    assert_eq!(c.disaggregation, Disaggregation::Optional);
    assert_eq!(c.queue, Queueing::Off);
    assert_eq!(c.session_idle_ttl, Duration::from_secs(300));
    assert_eq!(c.approximate.ttl, Duration::from_secs(120));
    assert_eq!(c.approximate.speculative, Speculative::Off);
    assert_eq!(c.warm_up, WarmUp::Off);
    assert_eq!(c.pool_credit, 0.25);
    c.validate().unwrap();
}

fn field_of(c: RouterConfig) -> &'static str {
    match c.validate() {
        Err(ConfigError::Invalid { field, .. }) => field,
        Ok(()) => "ok",
    }
}

#[test]
fn each_bad_field_is_named() {
    let d = RouterConfig::default;
    assert_eq!(
        field_of(RouterConfig {
            block_size: 0,
            ..d()
        }),
        "block_size"
    );
    assert_eq!(
        field_of(RouterConfig {
            overlap_credit: -1.0,
            ..d()
        }),
        "overlap_credit"
    );
    assert_eq!(
        field_of(RouterConfig {
            prefill_load_scale: f64::NAN,
            ..d()
        }),
        "prefill_load_scale"
    );
    assert_eq!(
        field_of(RouterConfig {
            tier_weights: TierWeights {
                disk: f64::INFINITY,
                ..TierWeights::default()
            },
            ..d()
        }),
        "tier_weights.disk"
    );
    assert_eq!(
        field_of(RouterConfig {
            temperature: -0.1,
            ..d()
        }),
        "temperature"
    );
    for bad in [-0.01, 1.5, f64::NAN] {
        assert_eq!(
            field_of(RouterConfig {
                near_tie: bad,
                ..d()
            }),
            "near_tie"
        );
    }
    assert_eq!(
        field_of(RouterConfig {
            busy: BusyThresholds {
                decode_blocks_fraction: Some(0.0),
                prefill_tokens_fraction: None,
            },
            ..d()
        }),
        "busy.decode_blocks_fraction"
    );
    assert_eq!(
        field_of(RouterConfig {
            request_expiry: Duration::ZERO,
            ..d()
        }),
        "request_expiry"
    );
    assert_eq!(
        field_of(RouterConfig {
            policy: Policy::PrefixHash {
                prefix_blocks: 4,
                load_factor: 0.5
            },
            ..d()
        }),
        "policy.load_factor"
    );
    assert_eq!(
        field_of(RouterConfig {
            policy: Policy::CacheThreshold {
                min_match_ratio: 1.5,
                balance_abs: 10,
                balance_rel: 1.5
            },
            ..d()
        }),
        "policy.min_match_ratio"
    );
    assert_eq!(
        field_of(RouterConfig {
            queue: Queueing::On {
                max_queued_tokens: 0,
                order: QueueOrder::Wspt
            },
            ..d()
        }),
        "queue.max_queued_tokens"
    );
    assert_eq!(
        field_of(RouterConfig {
            session_idle_ttl: Duration::ZERO,
            ..d()
        }),
        "session_idle_ttl"
    );
    for (approximate, field) in [
        (
            Approximate {
                ttl: Duration::ZERO,
                ..Approximate::default()
            },
            "approximate.ttl",
        ),
        (
            Approximate {
                speculative: Speculative::On {
                    ttl: Duration::ZERO,
                },
                ..Approximate::default()
            },
            "approximate.speculative.ttl",
        ),
        (
            Approximate {
                max_records: 0,
                ..Approximate::default()
            },
            "approximate.max_records",
        ),
    ] {
        assert_eq!(field_of(RouterConfig { approximate, ..d() }), field);
    }
    let warm = |share, duration, low_share| RouterConfig {
        warm_up: WarmUp::On {
            share,
            duration,
            low_share,
        },
        ..d()
    };
    let minute = Duration::from_secs(60);
    assert_eq!(field_of(warm(0.0, minute, 0.1)), "warm_up.share");
    assert_eq!(field_of(warm(f64::NAN, minute, 0.1)), "warm_up.share");
    assert_eq!(field_of(warm(0.2, Duration::ZERO, 0.1)), "warm_up.duration");
    assert_eq!(field_of(warm(0.2, minute, 1.0)), "warm_up.low_share");
    assert_eq!(field_of(warm(1.0, minute, 0.0)), "ok");
    assert_eq!(
        field_of(RouterConfig {
            pool_credit: -0.5,
            ..d()
        }),
        "pool_credit"
    );
}

#[test]
fn the_error_message_names_the_field() {
    let msg = RouterConfig {
        temperature: -1.0,
        ..RouterConfig::default()
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(msg.contains("`temperature`"), "{msg}");
}
