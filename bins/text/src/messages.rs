//! An OpenAI chat request's messages and tools as the engine hands them to the chat template:
//! vLLM's parsing of the request (`_parse_chat_message_content` and `_postprocess_messages` in
//! `vllm/entrypoints/chat_utils.py`, `tool.model_dump()` in its chat serving), then what
//! transformers' `apply_chat_template` does to them before rendering (drops the keys whose value
//! is `None`, and copies a message's reasoning under each name templates read).
//!
//! Per message, the template sees:
//! * `role`; `content`, never null: in the [`ContentFormat::String`] form the text parts joined
//!   with `"\n"` (empty parts left out, an absent or null content giving `""`); in the
//!   [`ContentFormat::OpenAi`] form a list of parts, `{"type": "text", "text": ...}` for text
//!   (a plain string content is one such part, a null content an empty list) and
//!   `{"type": "image"}` (or `audio`, `video`) for media;
//! * for an assistant, its `tool_calls` (each call's `arguments`, a JSON string on the wire,
//!   parsed into an object; `{}` where it does not parse; an empty list dropped) and its
//!   `reasoning`, also as `reasoning_content` and `thinking`;
//! * for a tool answer, its `tool_call_id`, and in the parts form a content of only text parts
//!   joined into one string again, as most templates expect there;
//! * `name` when it is a string; every other key is dropped.
//!
//! Media parts have no text of their own: in the string form vLLM puts the model's placeholder
//! for them in the text, which only a multimodal model has (a text-only model refuses them), and
//! the router cannot know it from the tokenizer's files, so they are left out of the string.

use serde_json::{Map, Value};

use crate::format::ContentFormat;

/// One part of a message's content, as vLLM reads it.
enum Part {
    /// Text (`text`, `input_text`, `output_text`, `refusal`, `thinking` parts, plain strings).
    Text(String),
    /// An image, audio or video.
    Media(&'static str),
    /// A reference to a deferred tool, passed through for the template to expand.
    ToolReference(String),
}

/// The modality of a media part type.
fn media(kind: &str) -> Option<&'static str> {
    match kind {
        "image_url" | "input_image" | "image_pil" | "image_embeds" => Some("image"),
        "audio_url" | "input_audio" | "audio_embeds" => Some("audio"),
        "video_url" => Some("video"),
        _ => None,
    }
}

/// A part, `None` for a text part without text (vLLM skips those), or why it is refused.
fn part(value: &Value) -> Result<Option<Part>, String> {
    let object = match value {
        Value::String(text) => return Ok(Some(Part::Text(text.clone()))),
        Value::Object(object) => object,
        other => return Err(format!("a content part must be an object, not {other}")),
    };
    let text = |key: &str| object.get(key).and_then(Value::as_str).map(str::to_owned);
    let has_uuid = object.get("uuid").is_some_and(|u| !u.is_null());
    match object.get("type") {
        Some(Value::String(kind)) if !has_uuid => Ok(match kind.as_str() {
            "text" | "input_text" | "output_text" => text("text").map(Part::Text),
            "refusal" => text("refusal").map(Part::Text),
            "thinking" => text("thinking").map(Part::Text),
            "tool_reference" => Some(Part::ToolReference(text("name").unwrap_or_default())),
            other => match media(other) {
                Some(modality) => Some(Part::Media(modality)),
                None => return Err(format!("unsupported chat content part type: {other:?}")),
            },
        }),
        None | Some(Value::Null) | Some(Value::String(_)) => {
            // No type (or a media id): known by the key it carries.
            for key in ["image_url", "image_pil", "image_embeds", "audio_embeds"] {
                if object.contains_key(key) {
                    return Ok(media(key).map(Part::Media));
                }
            }
            if object.contains_key("audio_url")
                || object.get("input_audio").is_some_and(|a| !a.is_null())
            {
                return Ok(Some(Part::Media("audio")));
            }
            if object.contains_key("video_url") {
                return Ok(Some(Part::Media("video")));
            }
            if object.contains_key("tool_reference") {
                return Ok(Some(Part::ToolReference(
                    text("tool_reference").unwrap_or_default(),
                )));
            }
            Err("missing 'type' field in a content part".to_owned())
        }
        Some(_) => Err("invalid 'type' field in a content part".to_owned()),
    }
}

/// A message's content in `format`.
fn content(value: Option<&Value>, format: ContentFormat) -> Result<Value, String> {
    let parts: Vec<Part> = match value {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(text)) => vec![Part::Text(text.clone())],
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| part(p).transpose())
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(format!(
                "a message's content must be text or parts: {other}"
            ))
        }
    };
    Ok(match format {
        ContentFormat::OpenAi => Value::Array(
            parts
                .into_iter()
                .map(|p| match p {
                    Part::Text(text) => serde_json::json!({"type": "text", "text": text}),
                    Part::Media(modality) => serde_json::json!({ "type": modality }),
                    Part::ToolReference(name) => {
                        serde_json::json!({"type": "tool_reference", "name": name})
                    }
                })
                .collect(),
        ),
        ContentFormat::String => Value::String(
            parts
                .into_iter()
                .filter_map(|p| match p {
                    Part::Text(text) | Part::ToolReference(text) => Some(text),
                    Part::Media(_) => None,
                })
                // vLLM keeps only truthy parts: an empty text adds no line.
                .filter(|text| !text.is_empty())
                .collect::<Vec<_>>()
                .join("\n"),
        ),
    })
}

/// A tool call with its `arguments` as an object (parsed from the JSON string the API sends;
/// `{}` when absent or not JSON).
fn tool_call(call: &Value) -> Result<Value, String> {
    let mut call = call.clone();
    let function = call
        .get_mut("function")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| "a tool call must have a function".to_owned())?;
    let arguments = match function.get("arguments") {
        Some(Value::String(text)) => {
            serde_json::from_str(text).unwrap_or_else(|_| Value::Object(Map::new()))
        }
        Some(v @ (Value::Object(_) | Value::Array(_))) => v.clone(),
        _ => Value::Object(Map::new()),
    };
    function.insert("arguments".to_owned(), arguments);
    Ok(call)
}

/// The message the template sees for one request message.
fn message(message: &Value, format: ContentFormat) -> Result<Value, String> {
    let object = message
        .as_object()
        .ok_or_else(|| format!("a message must be an object, not {message}"))?;
    let role = object
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| "a message must have a role".to_owned())?;
    let mut out = Map::new();
    out.insert("role".to_owned(), Value::String(role.to_owned()));
    out.insert(
        "content".to_owned(),
        content(object.get("content"), format)?,
    );
    match role {
        "assistant" => {
            match object.get("tool_calls") {
                None | Some(Value::Null) => {}
                Some(Value::Array(calls)) if calls.is_empty() => {}
                Some(Value::Array(calls)) => {
                    let calls = calls.iter().map(tool_call).collect::<Result<_, _>>()?;
                    out.insert("tool_calls".to_owned(), Value::Array(calls));
                }
                Some(_) => return Err("an assistant's tool_calls must be a list".to_owned()),
            }
            let reasoning = ["reasoning", "reasoning_content"]
                .iter()
                .find_map(|k| object.get(*k).filter(|v| !v.is_null()));
            if let Some(reasoning) = reasoning {
                out.insert("reasoning".to_owned(), reasoning.clone());
                out.insert("reasoning_content".to_owned(), reasoning.clone());
            }
        }
        "tool" => {
            if let Some(id) = object.get("tool_call_id") {
                out.insert("tool_call_id".to_owned(), id.clone());
            }
            if let Some(Value::Array(parts)) = out.get("content") {
                let all_text = parts.iter().all(|p| p["type"] == "text");
                if all_text {
                    let texts: Vec<&str> =
                        parts.iter().filter_map(|p| p["text"].as_str()).collect();
                    out.insert("content".to_owned(), Value::String(texts.join("\n")));
                }
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(Value::String(s)) = object.get(key) {
            out.insert(key.to_owned(), Value::String(s.clone()));
        }
    }
    if role == "developer" {
        out.insert(
            "tools".to_owned(),
            object.get("tools").cloned().unwrap_or(Value::Null),
        );
    }
    // transformers: keys whose value is None are dropped ...
    out.retain(|_, v| !v.is_null());
    // ... and a reasoning is also given as `thinking` (first) and `reasoning_content`.
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| out.get(*k).cloned());
    if let Some(reasoning) = reasoning {
        let mut aliased = Map::new();
        aliased.insert("thinking".to_owned(), reasoning.clone());
        aliased.extend(out);
        aliased.insert("reasoning_content".to_owned(), reasoning);
        out = aliased;
    }
    Ok(Value::Object(out))
}

/// A request's messages as the template sees them, with content in `format` (see the module
/// comment); an error for a message vLLM refuses.
pub fn conversation(messages: &[Value], format: ContentFormat) -> Result<Vec<Value>, String> {
    messages.iter().map(|m| message(m, format)).collect()
}

/// A request's tool definitions as vLLM dumps them for the template: `type` (`"function"` when
/// absent) then `function`, whose `name`, `description` and `parameters` come first, `null`
/// when absent; other keys follow as given.
pub fn tools(tools: &Value) -> Result<Value, String> {
    let Value::Array(tools) = tools else {
        return Err("tools must be a list".to_owned());
    };
    let tool = |tool: &Value| -> Result<Value, String> {
        let object = tool
            .as_object()
            .ok_or_else(|| "a tool must be an object".to_owned())?;
        let kind = object
            .get("type")
            .cloned()
            .unwrap_or_else(|| Value::String("function".to_owned()));
        if kind != "function" {
            return Err(format!("unsupported tool type {kind}"));
        }
        let function = object
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| "a tool must have a function".to_owned())?;
        if !function.get("name").is_some_and(Value::is_string) {
            return Err("a tool's function must have a name".to_owned());
        }
        let mut dumped = Map::new();
        for key in ["name", "description", "parameters"] {
            dumped.insert(
                key.to_owned(),
                function.get(key).cloned().unwrap_or(Value::Null),
            );
        }
        for (k, v) in function {
            dumped.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let mut out = Map::new();
        out.insert("type".to_owned(), kind);
        out.insert("function".to_owned(), Value::Object(dumped));
        for (k, v) in object {
            out.entry(k.clone()).or_insert_with(|| v.clone());
        }
        Ok(Value::Object(out))
    };
    Ok(Value::Array(
        tools.iter().map(tool).collect::<Result<_, _>>()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parts_are_joined_or_listed_by_format() {
        let messages = [json!({"role": "user", "content": [
            "plain",
            {"type": "text", "text": ""},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            {"type": "text", "text": "b"}]})];
        let string = conversation(&messages, ContentFormat::String).unwrap();
        assert_eq!(string, [json!({"role": "user", "content": "plain\nb"})]);
        let parts = conversation(&messages, ContentFormat::OpenAi).unwrap();
        assert_eq!(
            parts,
            [json!({"role": "user", "content": [
                {"type": "text", "text": "plain"},
                {"type": "text", "text": ""},
                {"type": "image"},
                {"type": "text", "text": "b"}]})]
        );
        let plain = [json!({"role": "user", "content": "hi", "extra": 1})];
        assert_eq!(
            conversation(&plain, ContentFormat::OpenAi).unwrap(),
            [json!({"role": "user", "content": [{"type": "text", "text": "hi"}]})]
        );
        let unknown = [json!({"role": "user", "content": [{"type": "file", "file": {}}]})];
        assert!(conversation(&unknown, ContentFormat::String).is_err());
    }

    #[test]
    fn a_tool_call_turn_has_empty_content_and_parsed_arguments() {
        let messages = [
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": "{\"city\": \"Zürich\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"},
                {"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": "ok", "tool_calls": [], "reasoning": "r"}),
        ];
        for format in [ContentFormat::String, ContentFormat::OpenAi] {
            let out = conversation(&messages, format).unwrap();
            let empty = match format {
                ContentFormat::String => json!(""),
                ContentFormat::OpenAi => json!([]),
            };
            assert_eq!(out[0]["content"], empty);
            assert_eq!(
                out[0]["tool_calls"][0]["function"]["arguments"],
                json!({"city": "Zürich"})
            );
            assert_eq!(out[0]["tool_calls"][1]["function"]["arguments"], json!({}));
            assert_eq!(out[1]["content"], "a\nb");
            assert_eq!(out[1]["tool_call_id"], "c1");
            assert!(out[2].get("tool_calls").is_none());
            let keys: Vec<&String> = out[2].as_object().unwrap().keys().collect();
            assert_eq!(
                keys,
                [
                    "thinking",
                    "role",
                    "content",
                    "reasoning",
                    "reasoning_content"
                ]
            );
        }
    }

    #[test]
    fn tools_are_dumped_in_the_models_field_order() {
        let given = json!([{"function": {"parameters": {}, "name": "f", "strict": true}}]);
        let dumped = tools(&given).unwrap();
        assert_eq!(
            serde_json::to_string(&dumped).unwrap(),
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{},"strict":true}}]"#
        );
        assert!(tools(&json!([{"type": "web_search"}])).is_err());
    }
}
