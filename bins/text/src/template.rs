//! The model's chat template (Jinja, from `tokenizer_config.json`), rendered as Hugging Face
//! `transformers` renders it: minijinja with Python's string methods, `trim_blocks` and
//! `lstrip_blocks`, `raise_exception`, `strftime_now`, and a `tojson` that writes what
//! Python's `json.dumps` writes (`", "` and `": "` between items, non-ASCII kept).

use minijinja::value::Value as JinjaValue;
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::Serialize;
use serde_json::Value;

use crate::format::ContentFormat;

/// A template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The configuration has no chat template.
    #[error("tokenizer_config.json has no chat_template")]
    Missing,
    /// The template does not parse.
    #[error("the chat template does not parse: {0}")]
    Parse(String),
    /// Rendering failed (the template raised, or the messages do not fit it).
    #[error("cannot render the chat: {0}")]
    Render(String),
}

/// A compiled chat template and the special tokens it may name.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    content_format: ContentFormat,
}

/// What one render takes.
#[derive(Debug, Clone, Serialize)]
pub struct RenderInput<'a> {
    /// The messages (`role`, `content`, and whatever else the template reads).
    pub messages: &'a [Value],
    /// Tool definitions, when the request has them.
    pub tools: Option<&'a Value>,
    /// Whether to open the assistant's turn at the end.
    pub add_generation_prompt: bool,
}

/// `json.dumps(value)` with Python's default separators.
fn python_json(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_json(&Value::String(k.clone()), out);
                out.push_str(": ");
                python_json(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_json(v, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

fn tojson(value: JinjaValue) -> Result<JinjaValue, JinjaError> {
    let json: Value = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&json, &mut out);
    Ok(JinjaValue::from_safe_string(out))
}

fn raise_exception(message: String) -> Result<JinjaValue, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> String {
    // Templates use it for today's date; the router renders for routing only, and what the
    // engine renders decides the cache, so the date format is followed for %d %B %Y only.
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    let (y, m, d) = civil_from_days(days);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    format
        .replace("%d", &format!("{d:02}"))
        .replace("%B", MONTHS[(m - 1) as usize])
        .replace("%b", &MONTHS[(m - 1) as usize][..3])
        .replace("%m", &format!("{m:02}"))
        .replace("%Y", &y.to_string())
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// A token named in the config: a string, or an object with `content`.
fn token_text(value: Option<&Value>) -> String {
    match value {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template of a `tokenizer_config.json` (its `chat_template`: a string, or a list of
    /// named templates of which `default` is taken).
    pub fn from_config(config: &Value) -> Result<Self, TemplateError> {
        let source = match config.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| named.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .ok_or(TemplateError::Missing)?
                .to_owned(),
            _ => return Err(TemplateError::Missing),
        };
        Self::new(
            source,
            token_text(config.get("bos_token")),
            token_text(config.get("eos_token")),
        )
    }

    /// A template from its source.
    pub fn new(
        source: String,
        bos_token: String,
        eos_token: String,
    ) -> Result<Self, TemplateError> {
        let content_format = ContentFormat::detect(&source);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source)
            .map_err(|e| TemplateError::Parse(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            content_format,
        })
    }

    /// The form the engine gives messages' content in for this template (vLLM's automatic
    /// choice: [`ContentFormat::detect`]).
    pub fn content_format(&self) -> ContentFormat {
        self.content_format
    }

    /// The conversation as text, the way the engine's template renders it. The messages are
    /// rendered as given: [`crate::conversation`] makes them what the engine passes.
    pub fn render(&self, input: &RenderInput<'_>) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => input.messages,
                tools => input.tools,
                add_generation_prompt => input.add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| TemplateError::Render(format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_writes_what_python_writes() {
        let v = serde_json::json!({"name": "f", "args": [1, "é", {"a": null}]});
        let mut out = String::new();
        python_json(&v, &mut out);
        assert_eq!(out, r#"{"name": "f", "args": [1, "é", {"a": null}]}"#);
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_419), (2025, 11, 27));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }

    #[test]
    fn a_template_renders_with_python_methods_and_trimmed_blocks() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n<{{ m.role }}>{{ m.content.strip() }}\n{% endfor %}\
             {% if add_generation_prompt %}<assistant>{% endif %}"
                .to_owned(),
            String::new(),
            String::new(),
        )
        .unwrap();
        let messages = [serde_json::json!({"role": "user", "content": "  hi  "})];
        let text = t
            .render(&RenderInput {
                messages: &messages,
                tools: None,
                add_generation_prompt: true,
            })
            .unwrap();
        assert_eq!(text, "<user>hi\n<assistant>");
        let raising = ChatTemplate::new(
            "{{ raise_exception('no system role') }}".to_owned(),
            String::new(),
            String::new(),
        )
        .unwrap();
        let err = raising
            .render(&RenderInput {
                messages: &messages,
                tools: None,
                add_generation_prompt: false,
            })
            .unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
    }
}
