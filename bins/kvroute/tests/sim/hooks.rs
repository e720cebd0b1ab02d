//! Fault hooks (cache reset, paused admission, abort), the clock, and refused requests.

use std::time::Duration;

use kvroute_sim::{
    Admission, ClearMode, Engine, EngineConfig, EngineEvent, Finish, RequestId, SimError,
    TimingModel,
};

use crate::{engine, request, run_to_idle, tokens, Transcript};

#[test]
fn a_reset_refuses_while_blocks_are_held_unless_told_to_preempt() {
    let mut engine = engine(100, 8_192);
    let mut t = Transcript::default();
    let prompt = tokens(0, 64);
    engine.admit(request(1, prompt.clone(), 10)).unwrap();
    engine.step().unwrap();
    assert_eq!(
        engine.clear_cache(ClearMode::RefuseIfInUse),
        Err(SimError::CacheInUse { blocks: 4 })
    );
    assert_eq!(engine.cached_prefix_blocks(&prompt), 4);
    engine.take_events();

    engine.clear_cache(ClearMode::PreemptRunning).unwrap();
    let events = engine.take_events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].events, vec![EngineEvent::AllBlocksCleared]);
    assert_eq!(engine.cached_prefix_blocks(&prompt), 0);
    assert_eq!((engine.stats().running, engine.stats().waiting), (0, 1));

    run_to_idle(&mut engine, &mut t);
    assert_eq!(
        t.count(1),
        10,
        "the preempted request recomputed and finished"
    );
}

#[test]
fn paused_admission_holds_new_requests_and_lets_running_ones_finish() {
    let mut engine = engine(100, 8_192);
    let mut t = Transcript::default();
    engine.admit(request(1, tokens(0, 20), 3)).unwrap();
    engine.step().unwrap();
    engine.set_admission(Admission::Paused);
    engine.admit(request(2, tokens(100, 20), 3)).unwrap();
    run_to_idle_or_stall(&mut engine, &mut t);
    assert_eq!((t.count(1), t.count(2)), (3, 0));
    assert!(engine.step().is_none(), "nothing to do while paused");
    engine.set_admission(Admission::Open);
    run_to_idle(&mut engine, &mut t);
    assert_eq!(t.count(2), 3);
}

fn run_to_idle_or_stall(engine: &mut Engine, t: &mut Transcript) {
    while engine.step().is_some() {}
    t.record(engine.take_outputs());
}

#[test]
fn an_aborted_request_frees_its_blocks_and_reports_it() {
    let mut engine = engine(100, 8_192);
    engine.admit(request(1, tokens(0, 40), 100)).unwrap();
    engine.step().unwrap();
    engine.take_outputs();
    assert_eq!(engine.stats().blocks.in_use, 3);
    engine.abort(RequestId(1)).unwrap();
    let out = engine.take_outputs();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].finish, Some(Finish::Aborted));
    assert!(out[0].tokens.is_empty() && out[0].first_token_at.is_none());
    assert_eq!(engine.stats().blocks.in_use, 0);
    assert!(engine.is_idle());
    assert_eq!(
        engine.abort(RequestId(1)),
        Err(SimError::UnknownRequest { id: RequestId(1) })
    );
}

#[test]
fn bad_requests_and_configs_are_refused() {
    let mut engine = engine(4, 8_192);
    let id = RequestId(1);
    assert_eq!(
        engine.admit(request(1, Vec::new(), 1)),
        Err(SimError::EmptyPrompt { id })
    );
    assert_eq!(
        engine.admit(request(1, tokens(0, 5), 0)),
        Err(SimError::NoOutput { id })
    );
    // 60 + 5 - 1 = 64 slots fit 4 blocks; one more token does not.
    engine.admit(request(1, tokens(0, 60), 5)).unwrap();
    assert_eq!(
        engine.admit(request(1, tokens(0, 5), 1)),
        Err(SimError::Duplicate { id })
    );
    assert!(matches!(
        engine.admit(request(2, tokens(0, 61), 5)),
        Err(SimError::TooLong {
            needed: 5,
            capacity: 4,
            ..
        })
    ));
    for bad in [
        EngineConfig {
            block_size: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            kv_blocks: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            speedup: 0.0,
            ..EngineConfig::default()
        },
        EngineConfig {
            speedup: f64::NAN,
            ..EngineConfig::default()
        },
    ] {
        assert!(matches!(Engine::new(bad), Err(SimError::Config { .. })));
    }
}

#[test]
fn the_clock_moves_by_passes_and_jumps_when_idle() {
    let config = EngineConfig {
        speedup: 10.0,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(config).unwrap();
    assert_eq!(engine.advance_to(Duration::from_secs(1)), 0);
    assert_eq!(engine.now(), Duration::from_secs(1));
    engine.admit(request(1, tokens(0, 2_048), 2)).unwrap();
    let pass = engine.step().unwrap();
    // 41 ms of prefill on the default H100 model, ten times faster.
    let modelled = TimingModel::default().pass_duration(&pass.shape);
    assert!((pass.duration.as_secs_f64() * 10.0 - modelled.as_secs_f64()).abs() < 1e-9);
    assert_eq!(engine.now(), Duration::from_secs(1) + pass.duration);
    let target = engine.now() + Duration::from_micros(1);
    assert_eq!(engine.advance_to(target), 1, "a pass is never cut short");
    assert!(engine.now() > target);
    assert!(engine.is_idle());
}
