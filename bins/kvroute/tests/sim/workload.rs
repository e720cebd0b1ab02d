//! Workloads: the built-in chat generator's arrivals and determinism, Mooncake-format traces
//! read and expanded, and the infinite-cache ceiling computed by hand on a small trace.

use std::io::Write;
use std::time::Duration;

use kvroute_sim::workload::{
    read_trace, ChatConfig, ChatWorkload, Ties, TraceError, TraceRow, Workload,
};

fn small_chat(seed: u64, rate: f64) -> ChatConfig {
    ChatConfig {
        requests: 400,
        seed,
        documents: 50,
        open_conversations: 8,
        rate,
        ..ChatConfig::default()
    }
}

#[test]
fn the_chat_workload_follows_its_seed_and_its_prompts_do_not_depend_on_the_rate() {
    let a: Vec<_> = Workload::chat(small_chat(1, 5.0)).requests().collect();
    let b: Vec<_> = Workload::chat(small_chat(1, 5.0)).requests().collect();
    let slow: Vec<_> = Workload::chat(small_chat(1, 0.5)).requests().collect();
    let other: Vec<_> = Workload::chat(small_chat(2, 5.0)).requests().collect();
    assert_eq!(a, b);
    assert_eq!(a.len(), 400);
    assert_ne!(a, other);
    for (fast, slow) in a.iter().zip(&slow) {
        assert_eq!(fast.prompt, slow.prompt);
        assert_eq!(fast.output_tokens, slow.output_tokens);
    }
    assert!(slow.last().unwrap().at > a.last().unwrap().at * 5);
}

#[test]
fn chat_arrivals_are_poisson_at_the_rate_and_replies_are_the_outputs() {
    let requests: Vec<_> = Workload::chat(ChatConfig {
        requests: 4_000,
        ..small_chat(3, 20.0)
    })
    .requests()
    .collect();
    assert_eq!(requests[0].at, Duration::ZERO);
    assert!(requests.windows(2).all(|w| w[0].at <= w[1].at));
    // 3,999 exponential gaps of mean 50 ms: the mean is within 10% with overwhelming odds.
    let mean_gap = requests.last().unwrap().at.as_secs_f64() / 3_999.0;
    assert!((0.045..0.055).contains(&mean_gap), "mean gap {mean_gap}");
    let config = ChatConfig::default();
    assert!(requests.iter().all(|r| {
        (config.reply_tokens.0..=config.reply_tokens.1).contains(&(r.output_tokens as usize))
    }));
}

#[test]
fn a_conversations_next_turn_extends_its_prompt_by_the_reply_and_a_message() {
    let mut chat = ChatWorkload::new(ChatConfig {
        open_conversations: 1,
        turns: (3, 3),
        ..small_chat(4, 1.0)
    });
    let first = chat
        .next_turn()
        .map(|t| (t.prompt.to_vec(), t.reply_tokens));
    let (first, reply) = first.unwrap();
    let second = chat.next_prompt().unwrap();
    assert!(second.len() > first.len() + reply);
    assert_eq!(&second[..first.len()], &first[..]);
}

/// Writes `lines` to a fresh file and returns its path.
fn trace_file(name: &str, lines: &[&str]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-workload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let mut file = std::fs::File::create(&path).unwrap();
    for line in lines {
        writeln!(file, "{line}").unwrap();
    }
    path
}

const SMALL_TRACE: [&str; 4] = [
    r#"{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]}"#,
    r#"{"timestamp": 2000, "input_length": 1300, "output_length": 5, "hash_ids": [0, 1, 3]}"#,
    "",
    r#"{"timestamp": 1000, "input_length": 1024, "output_length": 0, "hash_ids": [0, 2], "x": 1}"#,
];

#[test]
fn a_trace_is_read_expanded_and_ordered_by_arrival() {
    let path = trace_file("small.jsonl", &SMALL_TRACE);
    let rows = read_trace(&path, None).unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(read_trace(&path, Some(1)).unwrap().len(), 1);
    let workload = Workload::trace("small", rows.clone()).with_speedup(2.0);
    let requests: Vec<_> = workload.requests().collect();
    let at: Vec<_> = requests.iter().map(|r| r.at.as_millis()).collect();
    assert_eq!(at, [0, 500, 1000]);
    // Output lengths of 0 become 1: a request generates at least its first token.
    let outputs: Vec<_> = requests.iter().map(|r| r.output_tokens).collect();
    assert_eq!(outputs, [10, 1, 5]);
    assert_eq!(requests[1].prompt, rows[2].tokens());
    assert_eq!(requests[2].prompt.len(), 1300);
    // Rows sharing block ids share those 512 tokens, and only those.
    assert_eq!(requests[0].prompt[..512], requests[1].prompt[..512]);
    assert_ne!(requests[0].prompt[512..], requests[1].prompt[512..]);
    assert_eq!(requests[2].prompt[..1024], requests[0].prompt[..]);
}

#[test]
fn spread_ties_come_evenly_over_the_gap_to_the_next_stamp_in_file_order() {
    let lines = [
        r#"{"timestamp": 3000, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}"#,
        r#"{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]}"#,
        r#"{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 3]}"#,
        r#"{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 4]}"#,
        r#"{"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 5]}"#,
        r#"{"timestamp": 5000, "input_length": 600, "output_length": 6, "hash_ids": [0, 6]}"#,
        r#"{"timestamp": 9000, "input_length": 600, "output_length": 7, "hash_ids": [0, 7]}"#,
        r#"{"timestamp": 9000, "input_length": 600, "output_length": 8, "hash_ids": [0, 8]}"#,
    ];
    let rows = read_trace(&trace_file("ties.jsonl", &lines), None).unwrap();
    let arrivals = |w: &Workload| -> Vec<(u128, u32)> {
        w.requests()
            .map(|r| (r.at.as_millis(), r.output_tokens))
            .collect()
    };
    let stamped = Workload::trace("ties", rows.clone());
    assert_eq!(stamped.name(), "ties");
    assert_eq!(
        arrivals(&stamped),
        [
            (0, 2),
            (0, 3),
            (0, 4),
            (3000, 1),
            (3000, 5),
            (5000, 6),
            (9000, 7),
            (9000, 8)
        ]
    );
    // Three at 0 over the 3 s to the next stamp, two at 3000 over 2 s, one at 5000, and the
    // last stamp's two over the median gap (3 s of 3, 2 and 4 s).
    let spread = Workload::trace("ties", rows).with_ties(Ties::Spread);
    assert_eq!(spread.name(), "ties+spread");
    assert_eq!(
        arrivals(&spread),
        [
            (0, 2),
            (1000, 3),
            (2000, 4),
            (3000, 1),
            (4000, 5),
            (5000, 6),
            (9000, 7),
            (10500, 8)
        ]
    );
    let halved = spread.clone().with_speedup(2.0);
    assert_eq!(arrivals(&halved)[2], (1000, 4));
    assert_eq!(spread.with_ties(Ties::Stamped).name(), "ties");
}

#[test]
fn the_ceiling_of_a_small_trace_is_what_a_hand_count_gives() {
    let rows = read_trace(&trace_file("ceiling.jsonl", &SMALL_TRACE), None).unwrap();
    let workload = Workload::trace("small", rows);
    let ceiling = workload.ceiling(16, 1 << 20);
    // In arrival order: [0,1] finds nothing; [0,2] finds id 0 (512 tokens); [0,1,3] finds ids
    // 0 and 1 (1,024 tokens, under its cap of (1300 - 1) / 16 = 81 blocks).
    assert_eq!(ceiling.requests, 3);
    assert_eq!(ceiling.prompt_tokens, 1024 + 1024 + 1300);
    assert_eq!(ceiling.cached_tokens, 512 + 1024);
    assert_eq!(ceiling.output_tokens, 10 + 1 + 5);
    assert!((ceiling.hit_rate() - 1536.0 / 3348.0).abs() < 1e-12);
    // A cache large enough for every block holds what the infinite one does.
    assert_eq!(ceiling.lru_cached_tokens, ceiling.cached_tokens);
}

#[test]
fn the_fleet_sized_lru_evicts_the_least_recently_used_prompt_blocks() {
    let rows = read_trace(&trace_file("lru.jsonl", &SMALL_TRACE), None).unwrap();
    let workload = Workload::trace("small", rows);
    // 32 blocks of 16 tokens a trace id, used as an engine frees them: a prompt's tail first,
    // its head last. 64 blocks: [0,1] fills them; [0,2] finds id 0 and evicts id 1 (older
    // than id 0 within [0,1]); [0,1,3] finds id 0 only.
    assert_eq!(workload.ceiling(16, 64).lru_cached_tokens, 512 + 512);
    // 96 blocks: ids 0, 1 and 2 all fit, as in the infinite cache.
    assert_eq!(workload.ceiling(16, 96).lru_cached_tokens, 512 + 1024);
    // An answer's full blocks take room too: 512 output tokens for [0,2] fill 32 blocks, so
    // its prompt evicts id 1 from 96 blocks before [0,1,3] comes.
    let long_answers: Vec<String> = SMALL_TRACE
        .iter()
        .map(|l| l.replace("\"output_length\": 0,", "\"output_length\": 512,"))
        .collect();
    let long: Vec<&str> = long_answers.iter().map(String::as_str).collect();
    let rows = read_trace(&trace_file("lru_answers.jsonl", &long), None).unwrap();
    let answers = Workload::trace("answers", rows);
    assert_eq!(answers.ceiling(16, 96).lru_cached_tokens, 512 + 512);
    assert_eq!(answers.ceiling(16, 128).lru_cached_tokens, 512 + 1024);
    assert_eq!(workload.ceiling(16, 0).lru_cached_tokens, 0);
    // 48 blocks for [0,1]'s 64: its tail goes, its head stays, so [0,2] still finds id 0.
    let two = [SMALL_TRACE[0], SMALL_TRACE[3]];
    let rows = read_trace(&trace_file("lru_head.jsonl", &two), None).unwrap();
    assert_eq!(
        Workload::trace("head", rows)
            .ceiling(16, 48)
            .lru_cached_tokens,
        512
    );
}

#[test]
fn a_bad_trace_line_is_named() {
    let path = trace_file(
        "bad.jsonl",
        &[
            SMALL_TRACE[0],
            r#"{"timestamp": 1, "input_length": "many"}"#,
        ],
    );
    match read_trace(&path, None) {
        Err(TraceError::Parse { line, .. }) => assert_eq!(line, 2),
        other => panic!("expected a parse error, got {other:?}"),
    }
    let long = trace_file(
        "long.jsonl",
        &[r#"{"timestamp": 0, "input_length": 600, "hash_ids": [4]}"#],
    );
    assert!(matches!(
        read_trace(&long, None),
        Err(TraceError::Length { line: 1, .. })
    ));
    let empty = trace_file(
        "empty.jsonl",
        &[r#"{"timestamp": 0, "input_length": 0, "hash_ids": []}"#],
    );
    assert!(matches!(
        read_trace(&empty, None),
        Err(TraceError::Length { .. })
    ));
    let missing = std::env::temp_dir().join("kvroute-no-such-trace.jsonl");
    assert!(matches!(
        read_trace(&missing, None),
        Err(TraceError::Io { .. })
    ));
    assert_eq!(
        TraceRow {
            timestamp: 0,
            input_length: 3,
            output_length: 0,
            hash_ids: vec![7]
        }
        .tokens()
        .len(),
        3
    );
}
