use super::*;

fn ids(body: &str) -> Vec<u32> {
    match completion_fields(body.as_bytes()).unwrap().prompt {
        Some(Prompt::Ids(ids)) => ids,
        _ => panic!("no ids in {body}"),
    }
}

fn text(body: &str) -> String {
    match completion_fields(body.as_bytes()).unwrap().prompt {
        Some(Prompt::Text(t)) => t.into_owned(),
        _ => panic!("no text in {body}"),
    }
}

#[test]
fn the_routing_fields_are_read_and_every_other_field_is_skipped() {
    let body = r#"{"stream": true, "stop": ["a", {"x": [1, 2.5, null]}], "model": "m",
        "logit_bias": {"7": -100}, "prompt": [1, 2, 4294967295], "max_tokens": 9,
        "extra": {"deep": [[[]]]}}"#;
    let f = completion_fields(body.as_bytes()).unwrap();
    assert_eq!(f.model.as_deref(), Some("m"));
    assert_eq!((f.max_tokens, f.max_completion_tokens), (Some(9), None));
    assert_eq!(ids(body), [1, 2, u32::MAX]);
    assert_eq!(ids(r#"{"prompt": []}"#), Vec::<u32>::new());
}

#[test]
fn text_prompts_are_read_with_their_escapes() {
    assert_eq!(text(r#"{"prompt": "plain"}"#), "plain");
    assert_eq!(
        text(r#"{"prompt": "line\nnext \"q\" \u00e9\ud83d\ude80"}"#),
        "line\nnext \"q\" é🚀"
    );
}

#[test]
fn other_shapes_are_left_to_the_general_reader() {
    for body in [
        "",
        "[1, 2]",
        "not json",
        r#"{"prompt": [1, -2]}"#,
        r#"{"prompt": [1, 4294967296]}"#,
        r#"{"prompt": [1.5]}"#,
        r#"{"prompt": ["a", "b"]}"#,
        r#"{"prompt": {"a": 1}}"#,
        r#"{"prompt": 3}"#,
        r#"{"model": 5, "prompt": [1]}"#,
        r#"{"max_tokens": -1, "prompt": [1]}"#,
        r#"{"prompt": [1], "prompt": [2]}"#,
        r#"{"prompt": [1]"#,
    ] {
        assert!(completion_fields(body.as_bytes()).is_none(), "{body}");
    }
    // Absent fields are absent, not errors.
    let f = completion_fields(b"{}").unwrap();
    assert!(f.model.is_none() && f.prompt.is_none() && f.max_tokens.is_none());
    let f = completion_fields(br#"{"model": null, "max_tokens": null}"#).unwrap();
    assert!(f.model.is_none() && f.max_tokens.is_none());
}

#[test]
fn plain_id_lists_read_fast_equal_serdes_reading() {
    for body in [
        "[]",
        "[ ]",
        "[0]",
        "[1,2,3]",
        " [ 1 , 2 ,\n\t3 ] ",
        "[4294967295, 0, 10]",
        "[100000, 7]",
    ] {
        let fast = plain_ids(body.as_bytes()).unwrap();
        let slow: Vec<u32> = serde_json::from_str(body).unwrap();
        assert_eq!(fast, slow, "{body}");
    }
    // Not plain: left to serde (which reads some, refuses others) or refused.
    for body in [
        "[01]",
        "[1,]",
        "[,1]",
        "[1 2]",
        "[-1]",
        "[1.0]",
        "[1e2]",
        "[4294967296]",
        "[\"1\"]",
        "[1]]",
        "[[1]]",
        "",
        "[",
    ] {
        assert!(plain_ids(body.as_bytes()).is_none(), "{body}");
    }
    // Through the body: the same answers as before the fast path.
    assert_eq!(ids(r#"{"prompt":[5,6]}"#), [5, 6]);
    assert!(completion_fields(br#"{"prompt": [01]}"#).is_none());
    assert!(completion_fields(br#"{"prompt": [1,]}"#).is_none());
}
