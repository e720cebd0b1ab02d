//! Which form a chat template wants a message's `content` in, decided the way vLLM decides it
//! when its `--chat-template-content-format` is `auto` (the default): by looking for a loop over
//! a message's content in the template's source (vLLM's `_detect_content_format`, in
//! `vllm/renderers/hf.py`, earlier `vllm/entrypoints/chat_utils.py`). A template that loops over
//! the content (Gemma 3's `{% for item in message['content'] %}`) gets it as a list of parts;
//! any other gets one string.
//!
//! vLLM walks the Jinja syntax tree; minijinja keeps its own to itself, so this reads the
//! template's statement tags (`{% ... %}`) with a small lexer of its own (comments, `raw`
//! blocks, string literals and brackets are honoured, so a `for` inside a string or a comment
//! is not a loop) and parses the expressions that matter into the few shapes the rule looks at.
//! The rule, as vLLM applies it:
//!
//! 1. *Names for the messages*: `messages`, and every `{% set NAME = EXPR %}` whose `EXPR` is
//!    such a name, possibly sliced (`messages[1:]`), filtered (`messages | selectattr(...)`) or
//!    tested, followed transitively (`loop_messages` in Llama 3's and Gemma 3's templates).
//! 2. *Message variables*: the targets of `{% for T in EXPR %}` where `EXPR` is one of those
//!    names, sliced, filtered or tested the same way (`for message in messages[::-1]`).
//! 3. The template wants *parts* when some loop, in the order they appear, iterates
//!    `V['content']` or `V.content` for a message variable `V` (sliced, filtered or tested
//!    likewise), or iterates a bare name `content` (a content held in a variable or passed to a
//!    macro; vLLM added that case later). Otherwise it wants a *string*.
//!
//! Where vLLM's walk fails (a tuple or attribute as the target of a matching `set` or `for`),
//! it falls back to its default, the string form; so does this.

use std::collections::VecDeque;

/// How the engine hands a message's `content` to the chat template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// One string: text parts joined with `"\n"` (vLLM's "string" format).
    String,
    /// A list of parts: `{"type": "text", "text": ...}`, `{"type": "image"}`, ... (vLLM's
    /// "openai" format), for templates that loop over them.
    OpenAi,
}

impl ContentFormat {
    /// The template's content format, by the rule of the module comment.
    pub fn detect(source: &str) -> ContentFormat {
        detect(&statements(source))
    }

    /// vLLM's name for the format (`"string"` or `"openai"`).
    pub fn name(self) -> &'static str {
        match self {
            ContentFormat::String => "string",
            ContentFormat::OpenAi => "openai",
        }
    }
}

/// A token of a Jinja tag.
#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Str(String),
    Num,
    Op(&'static str),
}

impl Tok {
    fn is_name(&self, name: &str) -> bool {
        matches!(self, Tok::Name(n) if n == name)
    }

    fn is_op(&self, op: &str) -> bool {
        matches!(self, Tok::Op(o) if *o == op)
    }
}

/// Operators, longest first so that `//` is not read as two `/`.
const OPS: [&str; 27] = [
    "//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "|", ".", ",", ":", ";", "(",
    ")", "[", "]", "{", "}", "=", "<", ">", "!",
];

/// The tokens of each statement tag (`{% ... %}`) of a template, in order.
fn statements(source: &str) -> Vec<Vec<Tok>> {
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        match after.as_bytes().first() {
            Some(b'#') => {
                rest = after.find("#}").map_or("", |end| &after[end + 2..]);
            }
            Some(b'{') => {
                let (_, tail) = lex_tag(&after[1..], "}}");
                rest = tail;
            }
            Some(b'%') => {
                let body = after[1..].trim_start_matches(['-', '+']);
                let (tokens, tail) = lex_tag(body, "%}");
                rest = tail;
                if tokens.first().is_some_and(|t| t.is_name("raw")) {
                    rest = skip_raw(rest);
                } else {
                    out.push(tokens);
                }
            }
            _ => rest = after,
        }
    }
    out
}

/// The text after the `{% endraw %}` that closes a raw block.
fn skip_raw(mut rest: &str) -> &str {
    while let Some(open) = rest.find("{%") {
        let body = rest[open + 2..].trim_start_matches(['-', '+']);
        let (tokens, tail) = lex_tag(body, "%}");
        rest = tail;
        if tokens.first().is_some_and(|t| t.is_name("endraw")) {
            return rest;
        }
    }
    ""
}

/// The tokens of a tag's body up to its `end` (`%}` or `}}`, with an optional `-` or `+`
/// before it, outside brackets), and the text after it.
fn lex_tag<'a>(body: &'a str, end: &str) -> (Vec<Tok>, &'a str) {
    let mut tokens = Vec::new();
    let mut depth = 0usize;
    let mut rest = body;
    loop {
        rest = rest.trim_start();
        if depth == 0 {
            for modifier in ["", "-", "+"] {
                if rest
                    .strip_prefix(modifier)
                    .is_some_and(|r| r.starts_with(end))
                {
                    return (tokens, &rest[modifier.len() + end.len()..]);
                }
            }
        }
        let Some(c) = rest.chars().next() else {
            return (tokens, rest);
        };
        if c == '\'' || c == '"' {
            let (value, tail) = lex_string(rest, c);
            tokens.push(Tok::Str(value));
            rest = tail;
        } else if c.is_ascii_digit() {
            let len = rest
                .char_indices()
                .find(|&(i, ch)| {
                    !(ch.is_ascii_digit()
                        || ch == '_'
                        || (ch == '.' && rest[i + 1..].starts_with(|d: char| d.is_ascii_digit())))
                })
                .map_or(rest.len(), |(i, _)| i);
            tokens.push(Tok::Num);
            rest = &rest[len..];
        } else if c.is_alphabetic() || c == '_' {
            let len = rest
                .char_indices()
                .find(|&(_, ch)| !(ch.is_alphanumeric() || ch == '_'))
                .map_or(rest.len(), |(i, _)| i);
            tokens.push(Tok::Name(rest[..len].to_owned()));
            rest = &rest[len..];
        } else if let Some(op) = OPS.iter().find(|op| rest.starts_with(**op)) {
            match *op {
                "(" | "[" | "{" => depth += 1,
                ")" | "]" | "}" => depth = depth.saturating_sub(1),
                _ => {}
            }
            tokens.push(Tok::Op(op));
            rest = &rest[op.len()..];
        } else {
            // A character no Jinja token starts with: the tag does not parse; skip it.
            rest = &rest[c.len_utf8()..];
        }
    }
}

/// A string literal's value (escapes kept but for the quote's own) and the text after it.
fn lex_string(text: &str, quote: char) -> (String, &str) {
    let mut value = String::new();
    let mut chars = text.char_indices().skip(1);
    while let Some((i, c)) = chars.next() {
        if c == quote {
            return (value, &text[i + 1..]);
        }
        if c == '\\' {
            if let Some((_, escaped)) = chars.next() {
                if escaped != quote {
                    value.push('\\');
                }
                value.push(escaped);
            }
        } else {
            value.push(c);
        }
    }
    (value, "")
}

/// The shapes of expression the rule tells apart.
#[derive(Debug, PartialEq)]
enum Expr {
    /// A variable.
    Name(String),
    /// `E['key']` or `E.key`.
    Key(Box<Expr>, String),
    /// `E[a:b]`, `E | filter`, `E is test`: what vLLM looks through.
    Through(Box<Expr>),
    /// Anything else.
    Other,
}

/// Whether `expr` is `var` (or `var[key]` when a key is given), possibly sliced, filtered or
/// tested: vLLM's "variable or its elements".
fn reaches(expr: &Expr, var: &str, key: Option<&str>) -> bool {
    match (expr, key) {
        (Expr::Through(inner), _) => reaches(inner, var, key),
        (Expr::Name(name), None) => name == var,
        (Expr::Key(inner, k), Some(key)) => k == key && **inner == Expr::Name(var.to_owned()),
        _ => false,
    }
}

/// `tokens` as one expression: [`Expr::Other`] unless they are a single chain of a name and
/// its subscripts, filters and tests (an operator joining two operands makes an `Other`).
fn expression(tokens: &[Tok]) -> Expr {
    let mut pos = 0;
    match chain(tokens, &mut pos) {
        Some(expr) if pos == tokens.len() => expr,
        _ => Expr::Other,
    }
}

/// The index just after the bracket that closes the one at `open`.
fn close(tokens: &[Tok], open: usize) -> usize {
    let mut depth = 0usize;
    for (i, t) in tokens.iter().enumerate().skip(open) {
        match t {
            Tok::Op("(" | "[" | "{") => depth += 1,
            Tok::Op(")" | "]" | "}") => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
    }
    tokens.len()
}

/// Whether `tokens` hold `op` outside brackets.
fn has_top_level(tokens: &[Tok], op: &str) -> bool {
    let mut depth = 0usize;
    tokens.iter().any(|t| {
        match t {
            Tok::Op("(" | "[" | "{") => depth += 1,
            Tok::Op(")" | "]" | "}") => depth = depth.saturating_sub(1),
            _ => {}
        }
        depth == 0 && t.is_op(op)
    })
}

/// A primary expression, its subscripts and calls, then its filters and tests (Jinja's unary
/// operand), from `pos`; `None` where it does not start one.
fn chain(tokens: &[Tok], pos: &mut usize) -> Option<Expr> {
    let mut expr = primary(tokens, pos)?;
    // Subscripts, attributes and calls.
    loop {
        match tokens.get(*pos) {
            Some(Tok::Op(".")) => {
                *pos += 1;
                expr = match tokens.get(*pos) {
                    Some(Tok::Name(attr)) => Expr::Key(Box::new(expr), attr.clone()),
                    Some(Tok::Num) => Expr::Other,
                    _ => return None,
                };
                *pos += 1;
            }
            Some(Tok::Op("[")) => {
                let end = close(tokens, *pos);
                let inner = &tokens[*pos + 1..end.saturating_sub(1).max(*pos + 1)];
                expr = if has_top_level(inner, ":") {
                    Expr::Through(Box::new(expr))
                } else if let [Tok::Str(key)] = inner {
                    Expr::Key(Box::new(expr), key.clone())
                } else {
                    Expr::Other
                };
                *pos = end;
            }
            Some(Tok::Op("(")) => {
                *pos = close(tokens, *pos);
                expr = Expr::Other;
            }
            _ => break,
        }
    }
    // Filters, tests, and calls of their results.
    loop {
        match tokens.get(*pos) {
            Some(Tok::Op("|")) => {
                *pos += 1;
                dotted_name(tokens, pos)?;
                if tokens.get(*pos).is_some_and(|t| t.is_op("(")) {
                    *pos = close(tokens, *pos);
                }
                expr = Expr::Through(Box::new(expr));
            }
            Some(t) if t.is_name("is") => {
                *pos += 1;
                if tokens.get(*pos).is_some_and(|t| t.is_name("not")) {
                    *pos += 1;
                }
                dotted_name(tokens, pos)?;
                match tokens.get(*pos) {
                    Some(Tok::Op("(")) => *pos = close(tokens, *pos),
                    // One argument without parentheses: `is divisibleby 3`.
                    Some(Tok::Name(n)) if !matches!(n.as_str(), "else" | "or" | "and") => {
                        chain(tokens, pos)?;
                    }
                    Some(Tok::Str(_) | Tok::Num | Tok::Op("[" | "{")) => {
                        chain(tokens, pos)?;
                    }
                    _ => {}
                }
                expr = Expr::Through(Box::new(expr));
            }
            Some(Tok::Op("(")) => {
                *pos = close(tokens, *pos);
                expr = Expr::Other;
            }
            _ => return Some(expr),
        }
    }
}

/// A name, possibly dotted (`foo.bar`), as filters and tests are named.
fn dotted_name(tokens: &[Tok], pos: &mut usize) -> Option<()> {
    loop {
        match tokens.get(*pos) {
            Some(Tok::Name(_)) => *pos += 1,
            _ => return None,
        }
        if tokens.get(*pos).is_some_and(|t| t.is_op("."))
            && matches!(tokens.get(*pos + 1), Some(Tok::Name(_)))
        {
            *pos += 1;
        } else {
            return Some(());
        }
    }
}

/// A literal, a name, or a bracketed expression.
fn primary(tokens: &[Tok], pos: &mut usize) -> Option<Expr> {
    let expr = match tokens.get(*pos)? {
        Tok::Name(name) => {
            if matches!(
                name.as_str(),
                "not" | "in" | "is" | "if" | "else" | "and" | "or"
            ) {
                return None;
            }
            *pos += 1;
            match name.as_str() {
                "true" | "false" | "none" | "True" | "False" | "None" => Expr::Other,
                _ => Expr::Name(name.clone()),
            }
        }
        Tok::Str(_) => {
            while matches!(tokens.get(*pos), Some(Tok::Str(_))) {
                *pos += 1;
            }
            Expr::Other
        }
        Tok::Num => {
            *pos += 1;
            Expr::Other
        }
        Tok::Op("(") => {
            let end = close(tokens, *pos);
            let inner = &tokens[*pos + 1..end.saturating_sub(1).max(*pos + 1)];
            *pos = end;
            if inner.is_empty() || has_top_level(inner, ",") {
                Expr::Other
            } else {
                expression(inner)
            }
        }
        Tok::Op("[" | "{") => {
            *pos = close(tokens, *pos);
            Expr::Other
        }
        Tok::Op(_) => return None,
    };
    Some(expr)
}

/// A `set` or `for` statement's target: `Some(name)` for one name, `None` for a tuple or an
/// attribute (`ns.x`).
fn target(tokens: &[Tok]) -> Option<String> {
    match tokens {
        [Tok::Name(name)] => Some(name.clone()),
        _ => None,
    }
}

/// The position of the first `word` outside brackets, from `from`.
fn top_level_word(tokens: &[Tok], from: usize, words: &[&str]) -> Option<usize> {
    let mut depth = 0usize;
    for (i, t) in tokens.iter().enumerate().skip(from) {
        match t {
            Tok::Op("(" | "[" | "{") => depth += 1,
            Tok::Op(")" | "]" | "}") => depth = depth.saturating_sub(1),
            Tok::Name(n) if depth == 0 && words.contains(&n.as_str()) => return Some(i),
            _ => {}
        }
    }
    None
}

/// The rule of the module comment over a template's statements.
fn detect(statements: &[Vec<Tok>]) -> ContentFormat {
    // `{% set T = E %}` (not the block form `{% set T %}...{% endset %}`) and
    // `{% for T in E [if ...] [recursive] %}`, as (target, expression).
    let mut assigns = Vec::new();
    let mut loops = Vec::new();
    for tokens in statements {
        match tokens.first() {
            Some(t) if t.is_name("set") => {
                let equals = tokens.iter().position(|t| t.is_op("="));
                if let Some(eq) = equals {
                    assigns.push((target(&tokens[1..eq]), expression(&tokens[eq + 1..])));
                }
            }
            Some(t) if t.is_name("for") => {
                let Some(in_at) = top_level_word(tokens, 1, &["in"]) else {
                    continue;
                };
                let end =
                    top_level_word(tokens, in_at + 1, &["if", "recursive"]).unwrap_or(tokens.len());
                loops.push((
                    target(&tokens[1..in_at]),
                    expression(&tokens[in_at + 1..end]),
                ));
            }
            _ => {}
        }
    }
    // 1. Names for the messages.
    let mut names = vec!["messages".to_owned()];
    let mut queue = VecDeque::from(["messages".to_owned()]);
    while let Some(name) = queue.pop_front() {
        for (target, expr) in &assigns {
            if reaches(expr, &name, None) {
                let Some(target) = target else {
                    return ContentFormat::String;
                };
                if !names.contains(target) {
                    names.push(target.clone());
                    queue.push_back(target.clone());
                }
            }
        }
    }
    // 2. Message variables.
    let mut message_vars = Vec::new();
    for (target, expr) in &loops {
        if names.iter().any(|n| reaches(expr, n, None)) {
            let Some(target) = target else {
                return ContentFormat::String;
            };
            message_vars.push(target.clone());
        }
    }
    // 3. The first loop over a message's content decides.
    for (target, expr) in &loops {
        let over_content = message_vars
            .iter()
            .any(|v| reaches(expr, v, Some("content")))
            || *expr == Expr::Name("content".to_owned());
        if over_content {
            return match target {
                Some(_) => ContentFormat::OpenAi,
                None => ContentFormat::String,
            };
        }
    }
    ContentFormat::String
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format(source: &str) -> ContentFormat {
        ContentFormat::detect(source)
    }

    #[test]
    fn a_loop_over_a_messages_content_wants_parts() {
        for source in [
            "{% for message in messages %}{% for part in message['content'] %}{{ part.text }}\
             {% endfor %}{% endfor %}",
            "{%- for m in messages -%}{%- for p in m.content | selectattr('type', 'eq', 'text') \
             -%}{{ p.text }}{%- endfor -%}{%- endfor -%}",
            "{% set loop_messages = messages[1:] %}{% set rest = loop_messages %}\
             {% for message in rest if message.role != 'system' %}\
             {% for item in message[\"content\"][1:] %}x{% endfor %}{% endfor %}",
            "{% for message in messages|reverse %}{% set content = message.content %}\
             {% for item in content %}{{ item }}{% endfor %}{% endfor %}",
            "{% macro render(content) %}{% for item in content %}{{ item.text }}{% endfor %}\
             {% endmacro %}{% for m in messages %}{{ render(m.content) }}{% endfor %}",
        ] {
            assert_eq!(format(source), ContentFormat::OpenAi, "{source}");
        }
    }

    #[test]
    fn other_templates_want_a_string() {
        for source in [
            "{% for message in messages %}{{ message['content'] }}{% endfor %}",
            // Loops that are not over a message's content.
            "{% for message in messages %}{% for call in message.tool_calls %}{% endfor %}\
             {% endfor %}",
            "{% for message in messages %}{% for c in message['content'] + [] %}{% endfor %}\
             {% endfor %}",
            "{% for m in messages %}{% endfor %}{% for c in other.content %}{% endfor %}",
            "{% for message in messages[0] %}{% for c in message.content %}{% endfor %}\
             {% endfor %}",
            // Loops only in text, a comment, a string, or a raw block.
            "for message in messages: for part in message['content']",
            "{# {% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %} #}",
            "{{ '{% for m in messages %}{% for p in m.content %}' }}",
            "{% raw %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}\
             {% endraw %}",
            // vLLM's walk fails on a tuple target and falls back to the string form.
            "{% for i, message in messages %}{% for p in message.content %}{% endfor %}\
             {% endfor %}",
        ] {
            assert_eq!(format(source), ContentFormat::String, "{source}");
        }
    }

    #[test]
    fn tags_are_lexed_with_their_strings_and_brackets() {
        let statements = statements("a {%- set x = {'k': '%}'} -%} b {% for y in z %}");
        assert_eq!(statements.len(), 2);
        assert_eq!(statements[1][0], Tok::Name("for".to_owned()));
        assert_eq!(
            expression(&statements[1][3..]),
            Expr::Name("z".to_owned()),
            "{statements:?}"
        );
    }
}
