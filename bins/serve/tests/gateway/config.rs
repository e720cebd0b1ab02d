//! The configuration: one set of keys, named alike in the file, the environment and the
//! flags, laid file < environment < flags, and printed back as it took effect.

use clap::{CommandFactory, Parser};
use kvroute_serve::{ServeConfig, ServeOptions};

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    config: ServeConfig,
}

fn example() -> (String, ServeConfig) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kvroute.example.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    (text, ServeConfig::read(&path).unwrap())
}

#[test]
fn every_key_has_one_name_in_the_file_the_environment_and_the_flags() {
    let (text, _) = example();
    let every = ServeConfig::effective(&ServeOptions {
        api_key: Some("k".into()),
        admin_key: Some("a".into()),
        max_model_len: Some(8),
        model: Some("m".into()),
        tokenizer: Some("t".into()),
        replicas: Some(kvroute_serve::ReplicaOptions::new(
            "nats://127.0.0.1:4222",
            "f",
        )),
        disagg: kvroute_serve::disagg::DisaggOptions {
            conditional: Some(kvroute_serve::disagg::Conditional {
                max_new_tokens: 64,
                max_new_share: 0.5,
                prefill_busy_tokens: Some(5_000),
                decode_busy_tokens: Some(9_000),
            }),
            ..Default::default()
        },
        router: kvroute_core::RouterConfig {
            busy: kvroute_core::BusyThresholds {
                decode_blocks_fraction: Some(0.9),
                prefill_tokens_fraction: Some(2.0),
            },
            queue: kvroute_core::Queueing::On {
                max_queued_tokens: 9,
                order: kvroute_core::QueueOrder::Fcfs,
            },
            ..kvroute_core::RouterConfig::default()
        },
        ..ServeOptions::default()
    });
    let keys: Vec<String> = toml::Table::try_from(&every)
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let command = Cli::command();
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str();
        if id == "worker_flags" {
            assert_eq!(arg.get_long(), Some("worker"));
            continue;
        }
        assert_eq!(
            arg.get_long().map(|l| l.replace('-', "_")).as_deref(),
            Some(id),
            "{id}"
        );
        let env = arg.get_env().and_then(|e| e.to_str()).map(str::to_owned);
        assert_eq!(env, Some(format!("KVROUTE_{}", id.to_uppercase())), "{id}");
        // Every key is documented in the example, set or commented out.
        assert!(
            text.lines()
                .any(|l| l.trim_start_matches("# ").starts_with(&format!("{id} ="))),
            "{id} is not in kvroute.example.toml"
        );
        assert!(
            keys.contains(&id.to_owned()) || id == "api_key" || id == "admin_key",
            "{id}"
        );
    }
    // And every key the file takes is a flag.
    for key in keys {
        assert!(
            command.get_arguments().any(|a| a.get_id() == key.as_str()),
            "{key}"
        );
    }
}

#[test]
fn flags_win_over_the_environment_which_wins_over_the_file() {
    let file: ServeConfig = toml::from_str(
        "max_connections = 10\nbreaker_failures = 5\nretries = 4\n\
         [[workers]]\nid = 7\nurl = \"http://127.0.0.1:1\"\n",
    )
    .unwrap();
    // Variables only this test sets.
    std::env::set_var("KVROUTE_BREAKER_FAILURES", "6");
    std::env::set_var("KVROUTE_RETRIES", "8");
    let cli = Cli::try_parse_from([
        "serve",
        "--retries",
        "9",
        "--worker",
        "url=http://127.0.0.1:2,kv_events=tcp://127.0.0.1:3",
    ])
    .unwrap();
    std::env::remove_var("KVROUTE_BREAKER_FAILURES");
    std::env::remove_var("KVROUTE_RETRIES");
    let options = cli
        .config
        .over(file)
        .unwrap()
        .apply(ServeOptions::default())
        .unwrap();
    assert_eq!(options.max_connections, 10, "the file's");
    assert_eq!(options.breaker_failures, 6, "the environment's");
    assert_eq!(options.retries, 9, "the flag's");
    let ids: Vec<u64> = options.workers.iter().map(|w| w.id).collect();
    assert_eq!(
        ids,
        [7, 1],
        "the flags' workers after the file's, numbered by position"
    );
    assert_eq!(
        options.workers[1].kv_events.as_deref(),
        Some("tcp://127.0.0.1:3")
    );
    assert_eq!(
        options.workers[0].kv_blocks, options.workers[1].kv_blocks,
        "one default"
    );
}

#[test]
fn the_printed_configuration_reads_back_to_the_same_options() {
    let (_, example) = example();
    let options = example.apply(ServeOptions::default()).unwrap();
    let printed = toml::to_string(&ServeConfig::effective(&options)).unwrap();
    let again: ServeConfig = toml::from_str(&printed).unwrap();
    let options_again = again.apply(ServeOptions::default()).unwrap();
    assert_eq!(
        ServeConfig::effective(&options_again),
        ServeConfig::effective(&options),
        "{printed}"
    );
    assert_eq!(options_again.router, options.router);
}

#[test]
fn bad_values_are_refused_with_their_key() {
    for (text, key) in [
        ("max_connections = 0", "max_connections"),
        ("breaker_failures = 0", "breaker_failures"),
        ("header_timeout_s = -1.0", "header_timeout_s"),
        ("policy = \"fastest\"", "fastest"),
        ("worker_networks = [\"10.0.0.0/33\"]", "10.0.0.0/33"),
        (
            "conditional_max_new_tokens = 64\nconditional_max_new_share = 0.0",
            "conditional_max_new_share",
        ),
        (
            "conditional_prefill_busy_tokens = 4096",
            "conditional_prefill_busy_tokens",
        ),
        (
            "conditional_decode_busy_tokens = 4096",
            "conditional_decode_busy_tokens",
        ),
        (
            "conditional_max_new_share = 0.5",
            "need conditional_max_new_tokens",
        ),
    ] {
        let err = toml::from_str::<ServeConfig>(text)
            .map_err(|e| e.to_string())
            .and_then(|c| c.apply(ServeOptions::default()).map_err(|e| e.to_string()))
            .unwrap_err();
        assert!(err.contains(key), "{text}: {err}");
    }
    assert!(kvroute_serve::parse_worker_flag("url=http://h:1,dp_size=5000000000", 0).is_err());
    assert!(kvroute_serve::parse_worker_flag("url=http://h:1,colour=blue", 0).is_err());
}

#[test]
fn a_fleet_needs_nats_and_a_name_fit_for_a_nats_subject() {
    let alone = ServeConfig {
        fleet: Some("f".into()),
        ..ServeConfig::default()
    };
    assert!(alone.apply(ServeOptions::default()).is_err());
    let nats = ServeConfig {
        nats: Some("nats://127.0.0.1:4222".into()),
        ..ServeConfig::default()
    };
    let options = nats.clone().apply(ServeOptions::default()).unwrap();
    let replicas = options.replicas.clone().unwrap();
    assert_eq!(replicas.fleet, "default");
    assert_eq!(replicas.batch, kvroute_serve::SYNC_BATCH);
    // The batch window: with nats, within 50 µs to 100 ms.
    let batched = ServeConfig {
        sync_batch_us: Some(1_000),
        ..nats.clone()
    };
    let batch = batched
        .apply(ServeOptions::default())
        .unwrap()
        .replicas
        .unwrap()
        .batch;
    assert_eq!(batch, std::time::Duration::from_millis(1));
    for (us, with_nats) in [(49, true), (100_001, true), (0, true), (500, false)] {
        let c = ServeConfig {
            sync_batch_us: Some(us),
            nats: nats.nats.clone().filter(|_| with_nats),
            ..ServeConfig::default()
        };
        let err = c.apply(ServeOptions::default()).unwrap_err().to_string();
        assert!(err.contains("sync_batch_us"), "{us}: {err}");
    }
    // Replicas break near-ties at random unless told otherwise; a router alone does not.
    assert_eq!(options.router.near_tie, kvroute_core::REPLICA_NEAR_TIE);
    let exact = ServeConfig {
        near_tie: Some(0.0),
        ..nats.clone()
    };
    assert_eq!(
        exact
            .apply(ServeOptions::default())
            .unwrap()
            .router
            .near_tie,
        0.0
    );
    let alone = ServeConfig::default()
        .apply(ServeOptions::default())
        .unwrap();
    assert_eq!(alone.router.near_tie, 0.0);
    // JetStream refuses a stream name past 255 characters: a long name is refused here.
    let long = "f".repeat(201);
    for bad in ["", "a.b", "a b", "a*", "x>", &long] {
        let c = ServeConfig {
            fleet: Some(bad.into()),
            ..nats.clone()
        };
        assert!(c.apply(ServeOptions::default()).is_err(), "{bad:?}");
    }
    let at_most = ServeConfig {
        fleet: Some("f".repeat(200)),
        ..nats.clone()
    };
    assert!(at_most.apply(ServeOptions::default()).is_ok());
    for empty in ["", " ", "nats://127.0.0.1:4222,"] {
        let c = ServeConfig {
            nats: Some(empty.into()),
            ..ServeConfig::default()
        };
        assert!(c.apply(ServeOptions::default()).is_err(), "{empty:?}");
    }
}
