//! Supervised fine-tuning data as HF TRL 1.16.0's `SFTTrainer` prepares it.
//!
//! [`read_sft_jsonl`] reads a JSONL file in TRL's two standard SFT shapes, detected per row (all
//! rows of a file must share one, as a `datasets` table has one schema):
//!
//! - **conversational** `{"messages": [{"role", "content"}, …]}`, rendered with the model's chat
//!   template;
//! - **prompt–completion** `{"prompt": …, "completion": …}`, both plain text or both lists of
//!   messages.
//!
//! Each row becomes token ids and a per-token loss mask, as TRL's
//! `SFTTrainer._prepare_dataset` (`trl/trainer/sft_trainer.py`) makes `input_ids` and `labels`
//! (labels are the ids where the mask is set and -100 elsewhere, [`SftExample::labels`]):
//!
//! - Conversational: `apply_chat_template(messages, tokenize=True)`; with `assistant_only_loss`
//!   the mask is transformers' `assistant_masks` (`return_assistant_tokens_mask=True`: the
//!   tokens of the template's `{% generation %}` blocks,
//!   [`Tokenizer::encode_chat_with_assistant_mask`]), else every token. No EOS is appended:
//!   the template ends the turns.
//! - Prompt–completion text: the tokenizer's `eos_token` is appended to the completion unless
//!   it already ends with it; `prompt` and `prompt + completion` are encoded (with the
//!   tokenizer's special tokens, as `tokenizer(text)`), and the completion starts where the two
//!   id lists first differ (`common_prefix_length`: a prompt ending in a space merges with the
//!   completion's first word). With `completion_only_loss` (TRL's default for this shape) the
//!   mask is the completion's tokens.
//! - Prompt–completion messages: the prompt is rendered with the generation prompt
//!   (`add_generation_prompt=True`), `prompt + completion` without; the completion mask as
//!   above, and with `assistant_only_loss` the assistant mask too (a token is trained when
//!   both masks set it).
//! - Rows may carry `tools` (a list, or its JSON text) and `chat_template_kwargs` (an object,
//!   e.g. `{"enable_thinking": false}`), passed to the template as TRL passes them.
//!
//! With `assistant_only_loss`, a template without `{% generation %}` tags is replaced by TRL's
//! training variant of it, or refused with TRL's message ([`super::training_templates`]).
//! Qwen3's official template has no tags: TRL (and this module) swaps in its
//! `qwen3_training.jinja`, which also always writes the assistant turns' `<think>` block, so
//! ids differ from those of the plain template.
//!
//! Then `max_length` (TRL's default 1024): a longer example is either cut to its first
//! `max_length` tokens ([`Truncation::Truncate`], TRL's `truncation_mode="keep_start"`; an
//! example left without a trained token is dropped, as TRL's filter after truncation drops it,
//! and its line listed in [`SftDataset::dropped_lines`]) or refused
//! ([`Truncation::Refuse`]). Examples are never split.
//!
//! Where this module is stricter than TRL (which crashes or silently trains on garbage), rows
//! are refused naming the file, the line and the field: text that is not JSON or not an
//! object, a missing `messages` / `prompt` / `completion`, both shapes in one row or in one
//! file, an empty list of messages, a message that is not an object, a role other than
//! system / user / assistant / tool (templates such as Qwen3's silently skip other roles),
//! content that is not a string (except a missing one on an assistant message with
//! `tool_calls`), a template that raises (`raise_exception`, with its message), assistant-only
//! loss on a conversation with no assistant token (TRL raises too), and an example with no
//! trained token before truncation (TRL keeps it when it does not truncate).
//!
//! Packing and padding ([`SftDataset::pack_bfd`], [`pack_bfd`], [`pad_batch`]) follow TRL's
//! `pack_dataset(strategy="bfd")` (`trl/data_utils.py`) and `DataCollatorForLanguageModeling`.

mod pack;
#[cfg(test)]
mod tests;

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

pub use pack::{PackedRow, PaddedBatch, TRL_PACK_BATCH, pack_bfd, pack_bfd_batch, pad_batch};

use super::Tokenizer;
use super::chat::{ChatTemplate, ChatTemplates, CompiledChatTemplate};
use super::training_templates::assistant_mask_template;
use crate::BridgeError;

/// The TRL release whose data preparation this module follows.
pub const TRL_VERSION: &str = "1.16.0";

/// The label of a token the loss skips (PyTorch's `ignore_index`, HF's -100).
pub const IGNORE_INDEX: i64 = -100;

/// TRL's default `max_length` (`SFTConfig.max_length`).
pub const DEFAULT_MAX_LENGTH: usize = 1024;

/// The message roles accepted (those TRL's chat templates render).
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// TRL's error for assistant-only loss on data that is not conversational.
const NOT_CONVERSATIONAL: &str = "You set `assistant_only_loss=True`, but the dataset is not \
    conversational. This option is only supported for conversational datasets.";

/// What to do with an example longer than the maximum length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Truncation {
    /// Keep its first `max_length` tokens, as TRL does (`truncation_mode="keep_start"`).
    #[default]
    Truncate,
    /// Refuse the row, naming its line.
    Refuse,
}

/// How to prepare SFT data (TRL's `SFTConfig` fields of the same names; [`Default`] is TRL's
/// defaults).
#[derive(Debug, Clone)]
pub struct SftOptions {
    /// Longest example in tokens; `None` for no limit. TRL's default: 1024.
    pub max_length: Option<usize>,
    /// What to do with longer examples.
    pub truncation: Truncation,
    /// Train on the assistant tokens only (the template's `{% generation %}` blocks);
    /// conversational data only. TRL's default: off (every token of a conversation trained).
    pub assistant_only_loss: bool,
    /// Train on the completion tokens only; `None` is TRL's default: on for prompt–completion
    /// data (it does not apply to conversational data).
    pub completion_only_loss: Option<bool>,
    /// A chat template to use instead of the tokenizer's (TRL's `chat_template_path`).
    pub chat_template: Option<ChatTemplate>,
}

impl Default for SftOptions {
    fn default() -> Self {
        Self {
            max_length: Some(DEFAULT_MAX_LENGTH),
            truncation: Truncation::Truncate,
            assistant_only_loss: false,
            completion_only_loss: None,
            chat_template: None,
        }
    }
}

/// The shape of SFT data rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SftShape {
    /// `{"messages": [...]}`.
    Conversational,
    /// `{"prompt": "...", "completion": "..."}`.
    PromptCompletion,
    /// `{"prompt": [messages], "completion": [messages]}`.
    PromptCompletionMessages,
}

impl SftShape {
    /// Whether rows are rendered with the chat template (TRL's `is_conversational`).
    pub fn is_conversational(self) -> bool {
        !matches!(self, Self::PromptCompletion)
    }
}

impl fmt::Display for SftShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Conversational => "conversational (`messages`)",
            Self::PromptCompletion => "prompt-completion text",
            Self::PromptCompletionMessages => "prompt-completion messages",
        })
    }
}

/// One prepared example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftExample {
    /// The row's line in the file (1-based).
    pub line: usize,
    /// Token ids (at most the maximum length).
    pub input_ids: Vec<u32>,
    /// Per token, whether the loss trains on it (same length as `input_ids`).
    pub loss_mask: Vec<bool>,
    /// The number of tokens before truncation.
    pub untruncated_len: usize,
}

impl SftExample {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether the example has no token (never the case for a prepared example).
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// Whether truncation cut the example.
    pub fn is_truncated(&self) -> bool {
        self.untruncated_len > self.input_ids.len()
    }

    /// Number of trained tokens.
    pub fn trained_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m).count()
    }

    /// HF labels: the token id where trained, [`IGNORE_INDEX`] elsewhere (unshifted; the
    /// model shifts them).
    pub fn labels(&self) -> Vec<i64> {
        self.input_ids
            .iter()
            .zip(&self.loss_mask)
            .map(|(&id, &trained)| if trained { i64::from(id) } else { IGNORE_INDEX })
            .collect()
    }
}

/// The prepared examples of a file.
#[derive(Debug, Clone)]
pub struct SftDataset {
    /// The file read.
    pub path: PathBuf,
    /// The shape of its rows.
    pub shape: SftShape,
    /// The examples, in file order.
    pub examples: Vec<SftExample>,
    /// Lines of rows dropped because truncation left them no trained token (TRL drops them).
    pub dropped_lines: Vec<usize>,
}

impl SftDataset {
    /// Packs the examples into rows of at most `seq_len` tokens with TRL's best-fit-decreasing
    /// packing ([`pack_bfd`], in TRL's row order), each row built as TRL's padding-free
    /// collator builds it ([`PackedRow`]). An example longer than `seq_len` is refused (TRL
    /// would cut it): read the data with a maximum length of at most `seq_len`.
    pub fn pack_bfd(&self, seq_len: usize) -> Result<Vec<PackedRow>, BridgeError> {
        if seq_len == 0 {
            return Err(BridgeError::SftData {
                path: self.path.clone(),
                reason: "cannot pack into rows of 0 tokens".into(),
            });
        }
        if let Some(long) = self.examples.iter().find(|e| e.len() > seq_len) {
            return Err(BridgeError::SftRow {
                path: self.path.clone(),
                line: long.line,
                field: None,
                reason: format!(
                    "the example has {} tokens, more than the packed row length {seq_len} \
                     (TRL's bfd packing would cut it); read the data with a maximum length of \
                     at most {seq_len}",
                    long.len()
                ),
            });
        }
        let lengths: Vec<usize> = self.examples.iter().map(SftExample::len).collect();
        Ok(pack_bfd(&lengths, seq_len)
            .into_iter()
            .map(|indices| PackedRow::new(&self.examples, indices))
            .collect())
    }
}

/// The pad token TRL's `SFTTrainer` pads with: the tokenizer's `pad_token`, else its
/// `eos_token`.
pub fn trl_pad_token_id(tokenizer: &Tokenizer) -> Option<u32> {
    tokenizer
        .pad_token_id()
        .or_else(|| tokenizer.eos_token_id())
}

/// Reads and prepares the SFT JSONL file `path` (see the module docs).
pub fn read_sft_jsonl(
    path: impl AsRef<Path>,
    tokenizer: &Tokenizer,
    options: &SftOptions,
) -> Result<SftDataset, BridgeError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| BridgeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_sft_jsonl(path, &bytes, tokenizer, options)
}

/// Prepares SFT JSONL `bytes` as [`read_sft_jsonl`] does; `path` names them in errors. Blank
/// lines are skipped (as `datasets` skips them), a UTF-8 byte-order mark before the first row
/// too; lines are numbered from 1.
pub fn parse_sft_jsonl(
    path: &Path,
    bytes: &[u8],
    tokenizer: &Tokenizer,
    options: &SftOptions,
) -> Result<SftDataset, BridgeError> {
    if options.max_length == Some(0) {
        return Err(BridgeError::SftData {
            path: path.to_path_buf(),
            reason: "the maximum length is 0 tokens".into(),
        });
    }
    let mut reader = Reader {
        path,
        tokenizer,
        options,
        templates: None,
        first: None,
    };
    let mut examples = Vec::new();
    let mut dropped_lines = Vec::new();
    for (index, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = index + 1;
        let text = std::str::from_utf8(raw)
            .map_err(|e| reader.row_error(line, None, format!("not UTF-8 text: {e}")))?;
        let text = if index == 0 {
            text.strip_prefix('\u{feff}').unwrap_or(text)
        } else {
            text
        };
        if text.trim().is_empty() {
            continue;
        }
        match reader.example(line, text)? {
            Some(example) => examples.push(example),
            None => dropped_lines.push(line),
        }
    }
    let Some((shape, _)) = reader.first else {
        return Err(BridgeError::SftData {
            path: path.to_path_buf(),
            reason: "no rows (the file is empty or blank)".into(),
        });
    };
    Ok(SftDataset {
        path: path.to_path_buf(),
        shape,
        examples,
        dropped_lines,
    })
}

/// The templates conversational rows render with: transformers' choice per row (`tool_use`
/// when the row has tools and the model ships one, else `default`), or one fixed template.
struct Templates {
    default: CompiledChatTemplate,
    tool_use: Option<CompiledChatTemplate>,
}

impl Templates {
    fn pick(&self, has_tools: bool) -> &CompiledChatTemplate {
        match (&self.tool_use, has_tools) {
            (Some(tool_use), true) => tool_use,
            _ => &self.default,
        }
    }
}

/// A parsed row, before tokenization.
enum Row {
    Messages(Vec<Value>),
    Text {
        prompt: String,
        completion: String,
    },
    PromptCompletion {
        prompt: Vec<Value>,
        completion: Vec<Value>,
    },
}

impl Row {
    fn shape(&self) -> SftShape {
        match self {
            Self::Messages(_) => SftShape::Conversational,
            Self::Text { .. } => SftShape::PromptCompletion,
            Self::PromptCompletion { .. } => SftShape::PromptCompletionMessages,
        }
    }
}

struct Reader<'a> {
    path: &'a Path,
    tokenizer: &'a Tokenizer,
    options: &'a SftOptions,
    templates: Option<Templates>,
    /// The first row's shape and line.
    first: Option<(SftShape, usize)>,
}

impl Reader<'_> {
    fn row_error(&self, line: usize, field: Option<&str>, reason: String) -> BridgeError {
        BridgeError::SftRow {
            path: self.path.to_path_buf(),
            line,
            field: field.map(str::to_string),
            reason,
        }
    }

    /// A failure of the tokenizer or template on a row, as a row error.
    fn wrapped(&self, line: usize, field: &str, error: BridgeError) -> BridgeError {
        self.row_error(line, Some(field), error.to_string())
    }

    /// The example of one row; `None` when truncation left it no trained token.
    fn example(&mut self, line: usize, text: &str) -> Result<Option<SftExample>, BridgeError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| self.row_error(line, None, format!("not JSON: {e}")))?;
        let Value::Object(row) = value else {
            return Err(self.row_error(
                line,
                None,
                format!("expected a JSON object, found {}", kind(&value)),
            ));
        };
        let parsed = self.parse_row(line, &row)?;
        let shape = parsed.shape();
        match self.first {
            None => {
                if self.options.assistant_only_loss && !shape.is_conversational() {
                    return Err(BridgeError::SftData {
                        path: self.path.to_path_buf(),
                        reason: format!("line {line} is {shape} data: {NOT_CONVERSATIONAL}"),
                    });
                }
                self.first = Some((shape, line));
            }
            Some((first, first_line)) if first != shape => {
                return Err(self.row_error(
                    line,
                    None,
                    format!(
                        "a {shape} row, but line {first_line} is {first}: a file holds one shape"
                    ),
                ));
            }
            Some(_) => {}
        }
        let kwargs = self.template_kwargs(line, &row)?;
        let (ids, mask) = match parsed {
            Row::Messages(messages) => self.conversation(line, &messages, &kwargs)?,
            Row::Text { prompt, completion } => self.text(line, &prompt, completion)?,
            Row::PromptCompletion { prompt, completion } => {
                self.prompt_completion(line, prompt, completion, &kwargs)?
            }
        };
        self.finish(line, ids, mask)
    }

    fn parse_row(&self, line: usize, row: &Map<String, Value>) -> Result<Row, BridgeError> {
        let field = |name: &str| row.get(name).filter(|v| !v.is_null());
        let messages = field("messages");
        let prompt = field("prompt");
        let completion = field("completion");
        if messages.is_some() && (prompt.is_some() || completion.is_some()) {
            return Err(self.row_error(
                line,
                None,
                "both `messages` and `prompt` / `completion`: a row is either conversational or \
                 prompt-completion"
                    .into(),
            ));
        }
        if let Some(messages) = messages {
            return Ok(Row::Messages(self.messages(line, "messages", messages)?));
        }
        match (prompt, completion) {
            (None, None) => Err(self.row_error(
                line,
                None,
                "no `messages` (conversational) nor `prompt` and `completion` \
                 (prompt-completion) field"
                    .into(),
            )),
            (Some(_), None) => Err(self.row_error(
                line,
                Some("completion"),
                "missing: a prompt-completion row needs both `prompt` and `completion`".into(),
            )),
            (None, Some(_)) => Err(self.row_error(
                line,
                Some("prompt"),
                "missing: a prompt-completion row needs both `prompt` and `completion`".into(),
            )),
            (Some(Value::String(p)), Some(Value::String(c))) => Ok(Row::Text {
                prompt: p.clone(),
                completion: c.clone(),
            }),
            (Some(p @ Value::Array(_)), Some(c @ Value::Array(_))) => Ok(Row::PromptCompletion {
                prompt: self.messages(line, "prompt", p)?,
                completion: self.messages(line, "completion", c)?,
            }),
            (Some(p), Some(c)) => {
                for (name, value) in [("prompt", p), ("completion", c)] {
                    if !matches!(value, Value::String(_) | Value::Array(_)) {
                        return Err(self.row_error(
                            line,
                            Some(name),
                            format!("expected text or a list of messages, found {}", kind(value)),
                        ));
                    }
                }
                Err(self.row_error(
                    line,
                    Some("completion"),
                    format!(
                        "`prompt` is {} but `completion` is {}: both must be text or both lists \
                         of messages",
                        kind(p),
                        kind(c)
                    ),
                ))
            }
        }
    }

    /// A checked list of messages (see the module docs for what is refused).
    fn messages(&self, line: usize, name: &str, value: &Value) -> Result<Vec<Value>, BridgeError> {
        let Value::Array(items) = value else {
            return Err(self.row_error(
                line,
                Some(name),
                format!("expected a list of messages, found {}", kind(value)),
            ));
        };
        if items.is_empty() {
            return Err(self.row_error(line, Some(name), "empty list of messages".into()));
        }
        for (i, item) in items.iter().enumerate() {
            let at = |key: &str| format!("{name}[{i}]{key}");
            let Value::Object(message) = item else {
                return Err(self.row_error(
                    line,
                    Some(&at("")),
                    format!(
                        "expected a message object {{\"role\", \"content\"}}, found {}",
                        kind(item)
                    ),
                ));
            };
            let role = match message.get("role") {
                Some(Value::String(role)) => role.as_str(),
                None | Some(Value::Null) => {
                    return Err(self.row_error(line, Some(&at(".role")), "missing".into()));
                }
                Some(other) => {
                    return Err(self.row_error(
                        line,
                        Some(&at(".role")),
                        format!("expected a string, found {}", kind(other)),
                    ));
                }
            };
            if !ROLES.contains(&role) {
                return Err(self.row_error(
                    line,
                    Some(&at(".role")),
                    format!("unknown role \"{role}\" (accepted: {})", ROLES.join(", ")),
                ));
            }
            let has_tool_calls = message.get("tool_calls").is_some_and(|v| !v.is_null());
            match message.get("content") {
                Some(Value::String(_)) => {}
                None | Some(Value::Null) if role == "assistant" && has_tool_calls => {}
                None | Some(Value::Null) => {
                    return Err(self.row_error(
                        line,
                        Some(&at(".content")),
                        "missing (only an assistant message with `tool_calls` may have none)"
                            .into(),
                    ));
                }
                Some(other) => {
                    return Err(self.row_error(
                        line,
                        Some(&at(".content")),
                        format!(
                            "expected a string, found {} (content parts are not supported)",
                            kind(other)
                        ),
                    ));
                }
            }
        }
        Ok(items.clone())
    }

    /// The row's template keyword arguments: `tools` (a list or its JSON text) and the
    /// entries of `chat_template_kwargs`, as TRL's `tokenize_fn` passes them.
    fn template_kwargs(
        &self,
        line: usize,
        row: &Map<String, Value>,
    ) -> Result<Map<String, Value>, BridgeError> {
        let mut kwargs = Map::new();
        match row.get("tools") {
            None | Some(Value::Null) => {}
            Some(Value::Array(tools)) => {
                kwargs.insert("tools".into(), Value::Array(tools.clone()));
            }
            Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
                Ok(Value::Array(tools)) => {
                    kwargs.insert("tools".into(), Value::Array(tools));
                }
                Ok(Value::Null) => {}
                Ok(other) => {
                    return Err(self.row_error(
                        line,
                        Some("tools"),
                        format!("expected a list of tools, found {}", kind(&other)),
                    ));
                }
                Err(e) => {
                    return Err(self.row_error(
                        line,
                        Some("tools"),
                        format!("not JSON text of a list of tools: {e}"),
                    ));
                }
            },
            Some(other) => {
                return Err(self.row_error(
                    line,
                    Some("tools"),
                    format!("expected a list of tools, found {}", kind(other)),
                ));
            }
        }
        match row.get("chat_template_kwargs") {
            None | Some(Value::Null) => {}
            Some(Value::Object(extra)) => {
                kwargs.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
            Some(other) => {
                return Err(self.row_error(
                    line,
                    Some("chat_template_kwargs"),
                    format!("expected an object, found {}", kind(other)),
                ));
            }
        }
        Ok(kwargs)
    }

    /// The templates of the data, built on the first conversational row (TRL picks them when
    /// the trainer is made, from the tokenizer's `default` template).
    fn templates(&mut self) -> Result<&Templates, BridgeError> {
        if self.templates.is_none() {
            let templates = self.build_templates()?;
            self.templates = Some(templates);
        }
        self.templates.as_ref().ok_or_else(|| BridgeError::SftData {
            path: self.path.to_path_buf(),
            reason: "no chat template".into(),
        })
    }

    fn build_templates(&self) -> Result<Templates, BridgeError> {
        let (default, tool_use) = match &self.options.chat_template {
            Some(template) => (template.clone(), None),
            None => {
                let templates =
                    self.tokenizer
                        .chat_templates()
                        .ok_or_else(|| BridgeError::NoChatTemplate {
                            path: self.tokenizer.dir().join(super::TOKENIZER_CONFIG_FILE),
                        })?;
                let default = templates.select(None, false)?.clone();
                let tool_use = match templates {
                    ChatTemplates::Single(_) => None,
                    ChatTemplates::Named(named) => named.get("tool_use").cloned(),
                };
                (default, tool_use)
            }
        };
        if self.options.assistant_only_loss && !default.has_generation_markers() {
            // TRL renders every row with the training variant it swaps in.
            let training = assistant_mask_template(&default)?;
            return Ok(Templates {
                default: training.compile()?,
                tool_use: None,
            });
        }
        Ok(Templates {
            default: default.compile()?,
            tool_use: tool_use.map(|t| t.compile()).transpose()?,
        })
    }

    /// Ids of a rendered conversation, with the assistant mask when assistant-only loss is on
    /// (`None` otherwise).
    fn render(
        &mut self,
        line: usize,
        field: &str,
        messages: &[Value],
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
        assistant_mask: bool,
    ) -> Result<(Vec<u32>, Option<Vec<bool>>), BridgeError> {
        let tokenizer = self.tokenizer;
        let has_tools = kwargs.get("tools").is_some_and(|t| !t.is_null());
        let template = self.templates()?.pick(has_tools);
        let special = tokenizer.special_tokens();
        let result = if assistant_mask {
            template
                .render_with_generation_spans(messages, add_generation_prompt, special, kwargs)
                .and_then(|rendered| tokenizer.encode_chat_with_assistant_mask(&rendered))
                .map(|(ids, mask)| (ids, Some(mask)))
        } else {
            template
                .render(messages, add_generation_prompt, special, kwargs)
                .and_then(|text| tokenizer.encode(&text, false))
                .map(|ids| (ids, None))
        };
        result.map_err(|e| self.wrapped(line, field, e))
    }

    fn conversation(
        &mut self,
        line: usize,
        messages: &[Value],
        kwargs: &Map<String, Value>,
    ) -> Result<(Vec<u32>, Vec<bool>), BridgeError> {
        let assistant_only = self.options.assistant_only_loss;
        let (ids, assistant) =
            self.render(line, "messages", messages, false, kwargs, assistant_only)?;
        let mask = match assistant {
            Some(mask) => {
                self.check_assistant_tokens(line, "messages", &mask)?;
                mask
            }
            None => vec![true; ids.len()],
        };
        Ok((ids, mask))
    }

    fn prompt_completion(
        &mut self,
        line: usize,
        prompt: Vec<Value>,
        completion: Vec<Value>,
        kwargs: &Map<String, Value>,
    ) -> Result<(Vec<u32>, Vec<bool>), BridgeError> {
        let assistant_only = self.options.assistant_only_loss;
        let (prompt_ids, _) = self.render(line, "prompt", &prompt, true, kwargs, false)?;
        let mut all = prompt;
        all.extend(completion);
        let (ids, assistant) =
            self.render(line, "completion", &all, false, kwargs, assistant_only)?;
        if let Some(mask) = &assistant {
            self.check_assistant_tokens(line, "completion", mask)?;
        }
        let completion_mask = self.completion_mask(&prompt_ids, &ids);
        let mask = match assistant {
            Some(assistant) => completion_mask
                .iter()
                .zip(assistant)
                .map(|(&c, a)| c && a)
                .collect(),
            None => completion_mask,
        };
        Ok((ids, mask))
    }

    fn text(
        &self,
        line: usize,
        prompt: &str,
        mut completion: String,
    ) -> Result<(Vec<u32>, Vec<bool>), BridgeError> {
        let eos = self.tokenizer.special_token("eos_token").ok_or_else(|| {
            self.row_error(
                line,
                Some("completion"),
                format!(
                    "the tokenizer ({}) has no `eos_token`, which TRL appends to completions",
                    self.tokenizer.dir().display()
                ),
            )
        })?;
        if !completion.ends_with(eos) {
            completion.push_str(eos);
        }
        let prompt_ids = self
            .tokenizer
            .encode(prompt, true)
            .map_err(|e| self.wrapped(line, "prompt", e))?;
        let ids = self
            .tokenizer
            .encode(&format!("{prompt}{completion}"), true)
            .map_err(|e| self.wrapped(line, "completion", e))?;
        let mask = self.completion_mask(&prompt_ids, &ids);
        Ok((ids, mask))
    }

    /// TRL's `completion_mask` (the tokens after the common prefix of the prompt's ids and the
    /// whole example's) when completion-only loss is on, else every token.
    fn completion_mask(&self, prompt_ids: &[u32], ids: &[u32]) -> Vec<bool> {
        if self.options.completion_only_loss == Some(false) {
            return vec![true; ids.len()];
        }
        let prefix = prompt_ids
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count();
        (0..ids.len()).map(|i| i >= prefix).collect()
    }

    /// TRL's refusal of a conversation with no assistant token under assistant-only loss.
    fn check_assistant_tokens(
        &self,
        line: usize,
        field: &str,
        mask: &[bool],
    ) -> Result<(), BridgeError> {
        if mask.contains(&true) {
            return Ok(());
        }
        Err(self.row_error(
            line,
            Some(field),
            "assistant-only loss, but the chat template marks no assistant token in this \
             conversation (no `{% generation %}` block renders any text)"
                .into(),
        ))
    }

    /// The example after the trained-token check and truncation (`None`: dropped).
    fn finish(
        &self,
        line: usize,
        mut input_ids: Vec<u32>,
        mut loss_mask: Vec<bool>,
    ) -> Result<Option<SftExample>, BridgeError> {
        if !loss_mask.contains(&true) {
            return Err(self.row_error(
                line,
                None,
                format!(
                    "no token of the example's {} is trained (an empty completion, or a \
                     completion the prompt's tokens swallow)",
                    input_ids.len()
                ),
            ));
        }
        let untruncated_len = input_ids.len();
        if let Some(max) = self.options.max_length
            && untruncated_len > max
        {
            if self.options.truncation == Truncation::Refuse {
                return Err(self.row_error(
                    line,
                    None,
                    format!(
                        "the example has {untruncated_len} tokens, more than the maximum length \
                         {max} (truncation is off)"
                    ),
                ));
            }
            input_ids.truncate(max);
            loss_mask.truncate(max);
            if !loss_mask.contains(&true) {
                return Ok(None);
            }
        }
        Ok(Some(SftExample {
            line,
            input_ids,
            loss_mask,
            untruncated_len,
        }))
    }
}

/// A JSON value's kind, for messages.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "text",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}
