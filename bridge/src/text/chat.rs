//! Chat templates rendered as transformers' `apply_chat_template` renders them.
//!
//! transformers compiles templates with Jinja2's `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True)` plus the `loopcontrols` extension and its own `{% generation %}` tag,
//! overrides the `tojson` filter with Python's `json.dumps` (no HTML escaping, `indent`,
//! `separators`, `sort_keys`, `ensure_ascii` keyword arguments), and adds the globals
//! `raise_exception(message)` and `strftime_now(format)`. The template sees `messages` (keys
//! whose value is null dropped; `reasoning_content` / `thinking` / `reasoning` aliased to each
//! other), `tools` and `documents` (none unless given), `add_generation_prompt`, the tokenizer's
//! special tokens (`bos_token`, `eos_token`, …) and the caller's keyword arguments.
//!
//! Here the template runs on `minijinja` with the same whitespace settings, Python string and
//! dict methods (`.strip()`, `.startswith()`, `.split()`, `.items()`, `.get()`, … from
//! `minijinja-contrib`'s `pycompat`), loop controls, and the filter and globals above.
//!
//! `{% generation %}…{% endgeneration %}` renders its body, as transformers' `AssistantTracker`
//! extension does; [`CompiledChatTemplate::render_with_generation_spans`] also reports where
//! each block's output lies in the rendered text, in characters (Unicode code points, as
//! Python's `len` counts them), which is what transformers 5.23's
//! `_render_with_assistant_indices` records as `generation_indices` for
//! `apply_chat_template(..., return_assistant_tokens_mask=True)`. The tags are rewritten to a
//! `{% filter %}` block (the same whitespace control, a body rendered to a string like
//! transformers' `caller()`), whose filter wraps the body in two Unicode noncharacters that are
//! stripped after rendering; input text holding those characters is refused. transformers
//! takes a block's start from the output the template has yielded so far, which is the same
//! position for blocks at the template's top level (every known template); inside a macro or a
//! `{% set %}` capture this module reports where the text ends up instead.
//!
//! Known differences: JSON objects passed in arrive with their keys sorted (serde_json's map
//! order), where Python keeps insertion order, which shows in `tojson` of a non-sorted object;
//! `strftime_now` formats the current UTC time and supports the common `%` codes only.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, Value as JValue};
use serde_json::{Map, Value};

use super::{CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE};
use crate::BridgeError;

/// A chat template's source and where it came from.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// The Jinja source.
    pub source: String,
    /// The file it was read from (`tokenizer_config.json` or a `.jinja` file).
    pub path: PathBuf,
    /// Its name when the model ships several (`default`, `tool_use`, …).
    pub name: Option<String>,
}

/// The chat templates a model ships: one, or several by name (transformers picks `tool_use`
/// when tools are given and the model has it, else `default`).
#[derive(Debug, Clone)]
pub enum ChatTemplates {
    /// A single template.
    Single(ChatTemplate),
    /// Named templates.
    Named(BTreeMap<String, ChatTemplate>),
}

impl ChatTemplates {
    /// The templates of model directory `dir`: `chat_template.jinja` and
    /// `additional_chat_templates/*.jinja` when present (they take priority), else the
    /// `chat_template` entry of `config` (read from `config_path`), a string or a list of
    /// `{"name", "template"}` objects. `None` when there is none.
    pub fn load(
        dir: &Path,
        config: &Map<String, Value>,
        config_path: &Path,
    ) -> Result<Option<Self>, BridgeError> {
        let mut files = BTreeMap::new();
        let default = dir.join(CHAT_TEMPLATE_FILE);
        if default.is_file() {
            files.insert("default".to_string(), read_template(&default, None)?);
        }
        let extra = dir.join(CHAT_TEMPLATE_DIR);
        if extra.is_dir() {
            let entries = std::fs::read_dir(&extra).map_err(|source| BridgeError::Io {
                path: extra.clone(),
                source,
            })?;
            for entry in entries {
                let entry = entry.map_err(|source| BridgeError::Io {
                    path: extra.clone(),
                    source,
                })?;
                let path = entry.path();
                let name = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".jinja"));
                if let Some(name) = name {
                    let name = name.to_string();
                    let template = read_template(&path, Some(name.clone()))?;
                    files.insert(name, template);
                }
            }
        }
        if !files.is_empty() {
            if files.len() == 1
                && let Some(mut single) = files.remove("default")
            {
                single.name = None;
                return Ok(Some(Self::Single(single)));
            }
            return Ok(Some(Self::Named(files)));
        }
        let field = "chat_template";
        match config.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(source)) => Ok(Some(Self::Single(ChatTemplate {
                source: source.clone(),
                path: config_path.to_path_buf(),
                name: None,
            }))),
            Some(Value::Array(items)) => {
                let mut named = BTreeMap::new();
                for item in items {
                    let name = item.get("name").and_then(Value::as_str);
                    let source = item.get("template").and_then(Value::as_str);
                    let (Some(name), Some(source)) = (name, source) else {
                        return Err(BridgeError::InvalidConfig {
                            path: config_path.to_path_buf(),
                            field: field.into(),
                            reason: format!(
                                "expected {{\"name\": …, \"template\": …}} objects, found {item}"
                            ),
                        });
                    };
                    named.insert(
                        name.to_string(),
                        ChatTemplate {
                            source: source.to_string(),
                            path: config_path.to_path_buf(),
                            name: Some(name.to_string()),
                        },
                    );
                }
                Ok((!named.is_empty()).then_some(Self::Named(named)))
            }
            Some(other) => Err(BridgeError::InvalidConfig {
                path: config_path.to_path_buf(),
                field: field.into(),
                reason: format!(
                    "expected a template string or a list of named templates, found {other}"
                ),
            }),
        }
    }

    /// The template to use: `name` if given, else transformers' choice (`tool_use` when
    /// `has_tools` and the model has one, else `default`).
    pub fn select(
        &self,
        name: Option<&str>,
        has_tools: bool,
    ) -> Result<&ChatTemplate, BridgeError> {
        let named = match self {
            Self::Single(template) => {
                return match name {
                    None | Some("default") => Ok(template),
                    Some(other) => Err(template.error(
                        None,
                        format!("no template named \"{other}\" (the model ships a single one)"),
                    )),
                };
            }
            Self::Named(named) => named,
        };
        let wanted = match name {
            Some(name) => Some(name),
            None if has_tools && named.contains_key("tool_use") => Some("tool_use"),
            None => named.contains_key("default").then_some("default"),
        };
        if let Some(template) = wanted.and_then(|n| named.get(n)) {
            return Ok(template);
        }
        let names: Vec<&str> = named.keys().map(String::as_str).collect();
        let path = named
            .values()
            .next()
            .map(|t| t.path.clone())
            .unwrap_or_default();
        Err(BridgeError::ChatTemplate {
            path,
            name: None,
            line: None,
            reason: match wanted.or(name) {
                Some(n) => format!("no template named \"{n}\" (the model has {names:?})"),
                None => format!("several templates ({names:?}) and none named \"default\""),
            },
        })
    }
}

fn read_template(path: &Path, name: Option<String>) -> Result<ChatTemplate, BridgeError> {
    let source = std::fs::read_to_string(path).map_err(|source| BridgeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(ChatTemplate {
        source,
        path: path.to_path_buf(),
        name,
    })
}

impl ChatTemplate {
    /// Renders the template for `messages` (see the module docs for the variables it sees).
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        special_tokens: &BTreeMap<String, String>,
        kwargs: &Map<String, Value>,
    ) -> Result<String, BridgeError> {
        self.compile()?
            .render(messages, add_generation_prompt, special_tokens, kwargs)
    }

    /// Parses the template once, to render many conversations with it.
    pub fn compile(&self) -> Result<CompiledChatTemplate, BridgeError> {
        let mut env = environment();
        env.add_template_owned(COMPILED_NAME, rewrite_generation_tags(&self.source))
            .map_err(|e| self.template_error(&e))?;
        Ok(CompiledChatTemplate {
            env,
            template: self.clone(),
        })
    }

    /// Whether the template has transformers' `{% generation %}` tag, as TRL 1.16's
    /// `has_generation_markers` (and transformers' own check) match it: `{%`, an optional `-`,
    /// whitespace, `generation`, whitespace, an optional `-`, `%}`.
    pub fn has_generation_markers(&self) -> bool {
        has_generation_markers(&self.source)
    }

    fn error(&self, line: Option<usize>, reason: String) -> BridgeError {
        BridgeError::ChatTemplate {
            path: self.path.clone(),
            name: self.name.clone(),
            line,
            reason,
        }
    }

    /// The error of a failed parse or render, with the template line and the causes.
    fn template_error(&self, error: &Error) -> BridgeError {
        let mut reason = describe(error);
        let mut line = error.line();
        let mut source = std::error::Error::source(error);
        while let Some(cause) = source {
            if let Some(inner) = cause.downcast_ref::<Error>() {
                reason.push_str(": ");
                reason.push_str(&describe(inner));
                line = line.or(inner.line());
            } else {
                reason.push_str(&format!(": {cause}"));
            }
            source = cause.source();
        }
        self.error(line.filter(|&l| l > 0), reason)
    }
}

/// Name of the one template of a [`CompiledChatTemplate`]'s environment.
const COMPILED_NAME: &str = "chat_template";

/// Filter the `{% generation %}` tags are rewritten to.
const GENERATION_FILTER: &str = "__moe_generation";

/// Template variable that turns the generation-span markers on.
const TRACK_GENERATION: &str = "__moe_track_generation";

/// Marks the start of a generation block's output (a Unicode noncharacter).
const SPAN_START: char = '\u{FDD0}';

/// Marks the end of a generation block's output (a Unicode noncharacter).
const SPAN_END: char = '\u{FDD1}';

/// A parsed chat template, ready to render many conversations.
#[derive(Debug)]
pub struct CompiledChatTemplate {
    env: Environment<'static>,
    template: ChatTemplate,
}

/// A rendered conversation with the character spans of its `{% generation %}` blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedChat {
    /// The rendered text.
    pub text: String,
    /// `(start, end)` of each generation block's output in `text`, in characters (Unicode
    /// code points), end exclusive, in the order the blocks finished rendering (transformers'
    /// `generation_indices`).
    pub generation_spans: Vec<(usize, usize)>,
}

impl CompiledChatTemplate {
    /// The template this was compiled from.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// Renders the template for `messages` (see the module docs for the variables it sees).
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        special_tokens: &BTreeMap<String, String>,
        kwargs: &Map<String, Value>,
    ) -> Result<String, BridgeError> {
        let context = template_context(messages, add_generation_prompt, special_tokens, kwargs);
        self.render_context(context)
    }

    /// Renders as [`CompiledChatTemplate::render`] and reports the character spans of the
    /// `{% generation %}` blocks' output, as transformers' `_render_with_assistant_indices`
    /// does (see the module docs). Text holding U+FDD0 or U+FDD1 (the markers used to find the
    /// spans) is refused.
    pub fn render_with_generation_spans(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        special_tokens: &BTreeMap<String, String>,
        kwargs: &Map<String, Value>,
    ) -> Result<RenderedChat, BridgeError> {
        let mut inputs = messages.iter().chain(kwargs.values());
        let mut special = special_tokens.iter().flat_map(|(k, v)| [k, v]);
        if inputs.any(holds_span_marker) || special.any(|s| has_marker(s)) {
            return Err(self.template.error(
                None,
                "the conversation holds U+FDD0 or U+FDD1, which mark the generation blocks".into(),
            ));
        }
        let mut context = template_context(messages, add_generation_prompt, special_tokens, kwargs);
        context.insert(TRACK_GENERATION.into(), JValue::from(true));
        let marked = self.render_context(context)?;
        extract_generation_spans(&marked).ok_or_else(|| {
            self.template.error(
                None,
                "the template writes U+FDD0 or U+FDD1, which mark the generation blocks".into(),
            )
        })
    }

    fn render_context(&self, context: BTreeMap<String, JValue>) -> Result<String, BridgeError> {
        let template = self
            .env
            .get_template(COMPILED_NAME)
            .map_err(|e| self.template.template_error(&e))?;
        template
            .render(JValue::from_pairs(context))
            .map_err(|e| self.template.template_error(&e))
    }
}

/// The variables a template sees (see the module docs).
fn template_context(
    messages: &[Value],
    add_generation_prompt: bool,
    special_tokens: &BTreeMap<String, String>,
    kwargs: &Map<String, Value>,
) -> BTreeMap<String, JValue> {
    let mut context: BTreeMap<String, JValue> = BTreeMap::new();
    for (name, token) in special_tokens {
        context.insert(name.clone(), JValue::from(token.as_str()));
    }
    for (name, value) in kwargs {
        context.insert(name.clone(), to_jinja(value));
    }
    for name in ["tools", "documents"] {
        context
            .entry(name.to_string())
            .or_insert_with(|| JValue::from(()));
    }
    let messages: Vec<JValue> = messages
        .iter()
        .map(|m| to_jinja(&prepare_message(m)))
        .collect();
    context.insert("messages".into(), JValue::from(messages));
    context.insert(
        "add_generation_prompt".into(),
        JValue::from(add_generation_prompt),
    );
    context
}

fn has_marker(text: &str) -> bool {
    text.contains([SPAN_START, SPAN_END])
}

/// Whether a JSON value holds a generation-span marker in a string or a key.
fn holds_span_marker(value: &Value) -> bool {
    match value {
        Value::String(s) => has_marker(s),
        Value::Array(items) => items.iter().any(holds_span_marker),
        Value::Object(map) => map
            .iter()
            .any(|(k, v)| has_marker(k) || holds_span_marker(v)),
        _ => false,
    }
}

/// The text without the span markers, and the marked spans in characters (in closing order);
/// `None` when the markers do not pair up.
fn extract_generation_spans(marked: &str) -> Option<RenderedChat> {
    let mut text = String::with_capacity(marked.len());
    let mut spans = Vec::new();
    let mut open = Vec::new();
    let mut chars = 0usize;
    for c in marked.chars() {
        match c {
            SPAN_START => open.push(chars),
            SPAN_END => spans.push((open.pop()?, chars)),
            c => {
                text.push(c);
                chars += 1;
            }
        }
    }
    open.is_empty().then_some(RenderedChat {
        text,
        generation_spans: spans,
    })
}

/// The filter of the rewritten `{% generation %}` blocks: the body, between the span markers
/// when the render tracks generation spans.
fn generation_filter(state: &State, body: String) -> String {
    let tracking = state.lookup(TRACK_GENERATION).is_some_and(|v| v.is_true());
    if tracking {
        format!("{SPAN_START}{body}{SPAN_END}")
    } else {
        body
    }
}

/// transformers' check for the `{% generation %}` tag (the regex
/// `\{%-?\s*generation\s*-?%\}`).
pub(crate) fn has_generation_markers(source: &str) -> bool {
    source.match_indices("{%").any(|(at, _)| {
        let rest = &source[at + 2..];
        let rest = rest.strip_prefix('-').unwrap_or(rest);
        let Some(rest) = rest.trim_start().strip_prefix("generation") else {
            return false;
        };
        let rest = rest.trim_start();
        let rest = rest.strip_prefix('-').unwrap_or(rest);
        rest.starts_with("%}")
    })
}

/// The kind and detail of a template error (the line is reported separately).
fn describe(error: &Error) -> String {
    match error.detail() {
        Some(detail)
            if error.kind() == ErrorKind::InvalidOperation && detail.starts_with(RAISED) =>
        {
            detail.to_string()
        }
        Some(detail) => format!("{}: {detail}", error.kind()),
        None => error.kind().to_string(),
    }
}

/// Prefix of the errors of `raise_exception`.
const RAISED: &str = "raise_exception: ";

/// The environment transformers' `_compile_jinja_template` builds, on minijinja.
fn environment<'source>() -> Environment<'source> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build();
    // The default delimiters always build.
    if let Ok(syntax) = syntax {
        env.set_syntax(syntax);
    }
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_filter(GENERATION_FILTER, generation_filter);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<JValue, Error> {
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("{RAISED}{message}"),
            ))
        },
    );
    env.add_function("strftime_now", |format: String| -> Result<String, Error> {
        strftime_now(&format)
    });
    env
}

/// A message as transformers hands it to the template: keys whose value is null dropped, and
/// the reasoning text (`reasoning_content`, `thinking` or `reasoning`, first one set) copied to
/// `reasoning_content` and, unless the message has it, `thinking`.
fn prepare_message(message: &Value) -> Value {
    let Value::Object(map) = message else {
        return message.clone();
    };
    let mut map: Map<String, Value> = map
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|key| map.get(*key).cloned());
    if let Some(reasoning) = reasoning {
        map.entry("thinking").or_insert_with(|| reasoning.clone());
        map.insert("reasoning_content".into(), reasoning);
    }
    Value::Object(map)
}

/// A JSON value as a template value.
fn to_jinja(value: &Value) -> JValue {
    match value {
        Value::Null => JValue::from(()),
        Value::Bool(b) => JValue::from(*b),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                JValue::from(i)
            } else if let Some(u) = n.as_u64() {
                JValue::from(u)
            } else {
                JValue::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Value::String(s) => JValue::from(s.as_str()),
        Value::Array(items) => JValue::from(items.iter().map(to_jinja).collect::<Vec<_>>()),
        Value::Object(map) => {
            JValue::from_pairs(map.iter().map(|(k, v)| (k.as_str(), to_jinja(v))))
        }
    }
}

/// Replaces transformers' `{% generation %}` / `{% endgeneration %}` tags by
/// `{% filter __moe_generation %}` / `{% endfilter %}`, keeping the whitespace-control markers
/// (so trimming is unchanged) and the line numbers.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let body_start = 2 + usize::from(tag[2..].starts_with(['-', '+']));
        let body = &tag[body_start..];
        let trimmed = body.trim_start();
        let keyword_at = body_start + (body.len() - trimmed.len());
        let filter = format!("filter {GENERATION_FILTER}");
        let replacement = [
            ("endgeneration", "endfilter"),
            ("generation", filter.as_str()),
        ]
        .into_iter()
        .find(|(keyword, _)| {
            trimmed.starts_with(keyword)
                && trimmed[keyword.len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_whitespace() || c == '-' || c == '+' || c == '%')
        });
        match replacement {
            Some((keyword, with)) => {
                out.push_str(&tag[..keyword_at]);
                out.push_str(with);
                rest = &tag[keyword_at + keyword.len()..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// transformers' `tojson` filter: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` with those keyword arguments.
fn tojson(value: &JValue, kwargs: Kwargs) -> Result<JValue, Error> {
    let indent: Option<JValue> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be a number or a string",
                ));
            }
        },
    };
    let separators: Option<JValue> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .unwrap_or_default();
            match parts.as_slice() {
                [item, key] => (item.clone(), key.clone()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys,
        ensure_ascii,
    };
    let mut out = String::new();
    style.write(value, 0, &mut out)?;
    Ok(JValue::from(out))
}

/// Python `json.dumps` settings.
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, value: &JValue, level: usize, out: &mut String) -> Result<(), Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if value.is_integer() {
                    out.push_str(&value.to_string());
                } else {
                    out.push_str(&python_float(f64::try_from(value.clone())?));
                }
            }
            ValueKind::String => self.write_str(value.as_str().unwrap_or_default(), out),
            ValueKind::Map => {
                let mut keys: Vec<JValue> = value.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                out.push('{');
                for (i, key) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    let name = match key.as_str() {
                        Some(s) => s.to_string(),
                        None => key.to_string(),
                    };
                    self.write_str(&name, out);
                    out.push_str(&self.key_sep);
                    self.write(&value.get_item(key)?, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<JValue> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {other} is not JSON serializable"),
                ));
            }
        }
        Ok(())
    }

    /// A JSON string as Python escapes it.
    fn write_str(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)` (which `json.dumps` uses): shortest round-trip digits, exponent form
/// below 1e-4 and from 1e16, `NaN` / `Infinity`.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let abs = x.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // `{:e}` gives the shortest digits as `1.5e16` / `1e-5`; Python writes `1.5e+16` /
        // `1e-05`.
        let text = format!("{x:e}");
        let Some((mantissa, exponent)) = text.split_once('e') else {
            return text;
        };
        let (sign, digits) = match exponent.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exponent),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    // `{:?}` gives the shortest digits with a `.0` for integral values.
    format!("{x:?}")
}

/// transformers' `strftime_now(format)`: the current time (UTC here) formatted with `%Y %m %d
/// %H %M %S %y %j %B %b %A %a %p %I %e %%`.
fn strftime_now(format: &str) -> Result<String, Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(format, now)
}

fn strftime(format: &str, unix_seconds: u64) -> Result<String, Error> {
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
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = i64::try_from(unix_seconds / 86_400).unwrap_or(0);
    let secs = unix_seconds % 86_400;
    let (hour, minute, second) = (secs / 3600, secs % 3600 / 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let month_index = usize::try_from(month - 1).unwrap_or(0);
    let day_of_year = cumulative[month_index] + day + i64::from(leap && month > 2);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = usize::try_from((days + 3).rem_euclid(7)).unwrap_or(0);
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{hour12:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[month_index]),
            Some('b') => out.push_str(&MONTHS[month_index][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported format code %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_floats() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (0.1, "0.1"),
            (f64::INFINITY, "Infinity"),
        ] {
            assert_eq!(python_float(x), want, "{x}");
        }
    }

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %j %a %A %b %B %y %I%p %%", t).unwrap(),
            "2024-02-29 13:05:09 060 Thu Thursday Feb February 24 01PM %"
        );
        assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
        assert!(strftime("%Q", t).is_err());
    }

    #[test]
    fn generation_tags_become_filter_blocks() {
        let src = "a{%- generation -%}b{% endgeneration %}c{% if generation_x %}{% endif %}";
        assert_eq!(
            rewrite_generation_tags(src),
            "a{%- filter __moe_generation -%}b{% endfilter %}c{% if generation_x %}{% endif %}"
        );
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let env = environment();
        let render = |src: &str, value: Value| {
            env.render_str(src, JValue::from_pairs([("x", to_jinja(&value))]))
                .unwrap()
        };
        let value =
            serde_json::json!({"a": [1, 2.5, "q\"<>&é\n"], "b": {}, "c": [], "d": null, "e": true});
        assert_eq!(
            render("{{ x | tojson }}", value.clone()),
            r#"{"a": [1, 2.5, "q\"<>&é\n"], "b": {}, "c": [], "d": null, "e": true}"#
        );
        assert_eq!(
            render(
                "{{ x | tojson(indent=2) }}",
                serde_json::json!({"a": [1, {"b": 2}]})
            ),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": 2\n    }\n  ]\n}"
        );
        assert_eq!(
            render(
                "{{ x | tojson(ensure_ascii=true, separators=(',', ':')) }}",
                value
            ),
            r#"{"a":[1,2.5,"q\"<>&\u00e9\n"],"b":{},"c":[],"d":null,"e":true}"#
        );
    }
}
