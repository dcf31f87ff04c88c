//! Text in and out: a model directory's HF tokenizer and chat template.
//!
//! [`Tokenizer::from_dir`] loads `<dir>/tokenizer.json` with the `tokenizers` crate (what
//! transformers 5 does for every "fast" tokenizer: the file's normalizer, pre-tokenizer, model,
//! post-processor and decoder are authoritative) and reads beside it, where present:
//!
//! - `tokenizer_config.json`: the named special tokens (`bos_token`, `eos_token`, `pad_token`,
//!   …, a string or an `AddedToken` object, `null` for none) and model-specific `*_token`
//!   entries, `added_tokens_decoder`, `additional_special_tokens` / `extra_special_tokens`,
//!   `chat_template` (a string, or a list of `{name, template}`), and
//!   `clean_up_tokenization_spaces`. Tokens the config names that tokenizer.json lacks are added
//!   as transformers adds them. Without `added_tokens_decoder`, the legacy
//!   `special_tokens_map.json` is read too.
//! - `chat_template.jinja` and `additional_chat_templates/*.jinja`: these take priority over
//!   the config's templates, as in transformers.
//! - `generation_config.json`, else `config.json`: `eos_token_id` (a number or a list), which
//!   wins over the tokenizer's `eos_token` for the ids that end generation
//!   ([`Tokenizer::generation_stop_ids`]).
//!
//! Encoding and decoding follow transformers' defaults: no truncation or padding (whatever
//! tokenizer.json says), `add_special_tokens` as the caller asks (transformers' `encode`
//! defaults to true; `apply_chat_template` encodes without), and `clean_up_tokenization_spaces`
//! applied on decode only for non-BPE models unless the config forces it (transformers 5
//! ignores it for BPE). Chat templates render as `apply_chat_template` renders them
//! ([`chat`]), with the assistant-token masks of `{% generation %}` blocks
//! ([`Tokenizer::encode_chat_with_assistant_mask`]); [`sft`] reads supervised fine-tuning data
//! as TRL prepares it. Every error names the file and what is wrong with it.

pub mod chat;
pub mod sft;
#[cfg(test)]
mod tests;
pub mod training_templates;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde_json::{Map, Value};
use tokenizers::{AddedToken, ModelWrapper};

use crate::BridgeError;
pub use chat::{ChatTemplate, ChatTemplates, CompiledChatTemplate, RenderedChat};

/// The tokenizer file.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The tokenizer's settings (special tokens, chat template).
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// Legacy special-token file, read only when the config has no `added_tokens_decoder`.
pub const SPECIAL_TOKENS_MAP_FILE: &str = "special_tokens_map.json";
/// The default chat template as its own file (transformers ≥ 4.43 writes it).
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// Directory of further named chat templates (`<name>.jinja`).
pub const CHAT_TEMPLATE_DIR: &str = "additional_chat_templates";

/// The named special-token attributes of transformers (`SPECIAL_TOKENS_ATTRIBUTES`).
const NAMED_SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A model's tokenizer: `tokenizer.json` plus the special tokens, chat templates and
/// generation end ids of the files beside it.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    dir: PathBuf,
    /// Special-token variables (`eos_token` → its text), as transformers' `special_tokens_map`
    /// plus model-specific `*_token` entries.
    special_tokens: BTreeMap<String, String>,
    chat_templates: Option<ChatTemplates>,
    /// `eos_token_id` of generation_config.json, else config.json.
    config_eos_ids: Option<Vec<u32>>,
    clean_up_tokenization_spaces: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size())
            .field("special_tokens", &self.special_tokens)
            .field("chat_template", &self.chat_templates.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// Loads the tokenizer of model directory `dir` (see the module docs for the files read).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, BridgeError> {
        let dir = dir.as_ref().to_path_buf();
        let path = dir.join(TOKENIZER_FILE);
        if !path.is_file() {
            return Err(BridgeError::MissingTokenizer { dir });
        }
        let mut inner = load_tokenizer_json(&path)?;
        // transformers encodes without truncation or padding unless asked per call.
        inner
            .with_truncation(None)
            .map_err(|e| BridgeError::InvalidTokenizer {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        inner.with_padding(None);

        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = match read_json_if_present(&config_path)? {
            Some(Value::Object(map)) => map,
            Some(_) => {
                return Err(BridgeError::InvalidJson {
                    path: config_path,
                    reason: "expected a JSON object".into(),
                });
            }
            None => Map::new(),
        };
        let mut special = SpecialTokenConfig::parse(&config, &config_path)?;
        if !config.contains_key("added_tokens_decoder") {
            let map_path = dir.join(SPECIAL_TOKENS_MAP_FILE);
            if let Some(Value::Object(map)) = read_json_if_present(&map_path)? {
                special.merge_legacy(&SpecialTokenConfig::parse(&map, &map_path)?);
            }
        }
        special.add_missing_tokens(&mut inner, &config_path)?;

        let clean_up = bool_field(&config, &config_path, "clean_up_tokenization_spaces")?;
        let force_bpe = bool_field(
            &config,
            &config_path,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
        )?;
        let is_bpe = matches!(inner.get_model(), ModelWrapper::BPE(_));
        let chat_templates = ChatTemplates::load(&dir, &config, &config_path)?;
        let config_eos_ids = generation_eos_ids(&dir)?;
        Ok(Self {
            inner,
            dir,
            special_tokens: special.variables,
            chat_templates,
            config_eos_ids,
            clean_up_tokenization_spaces: clean_up && (!is_bpe || force_bpe),
        })
    }

    /// [`Tokenizer::from_dir`] when `dir` has a `tokenizer.json`, `None` when it has none.
    pub fn from_dir_if_present(dir: impl AsRef<Path>) -> Result<Option<Self>, BridgeError> {
        let dir = dir.as_ref();
        if dir.join(TOKENIZER_FILE).is_file() {
            Self::from_dir(dir).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The model directory the tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The path of `tokenizer.json`.
    pub fn path(&self) -> PathBuf {
        self.dir.join(TOKENIZER_FILE)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Number of token ids, added tokens included (ids are `0..vocab_size` unless the file
    /// leaves holes).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of `text`; `add_special_tokens` applies tokenizer.json's post-processor (e.g.
    /// a BOS token), as transformers' `encode(text)` does by default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, BridgeError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| self.failure("encode text", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of each of `texts` (in parallel over the texts).
    pub fn encode_batch(
        &self,
        texts: &[&str],
        add_special_tokens: bool,
    ) -> Result<Vec<Vec<u32>>, BridgeError> {
        let encodings = self
            .inner
            .encode_batch_fast(texts.to_vec(), add_special_tokens)
            .map_err(|e| self.failure("encode text", e))?;
        Ok(encodings.iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// The text of `ids`; `skip_special_tokens` drops the tokens marked special (ids the
    /// vocabulary does not have are dropped, as in transformers).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, BridgeError> {
        let text = self
            .inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.failure("decode token ids", e))?;
        Ok(if self.clean_up_tokenization_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// The id of token `token` (added tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of id `id`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The text of special token `name` (`"eos_token"`, `"bos_token"`, `"pad_token"`, …).
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.get(name).map(String::as_str)
    }

    /// The special-token variables a chat template sees (`bos_token`, `eos_token`, …).
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    /// The id of `bos_token`.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.special_token_id("bos_token")
    }

    /// The id of `eos_token` (the tokenizer's own end of sequence).
    pub fn eos_token_id(&self) -> Option<u32> {
        self.special_token_id("eos_token")
    }

    /// The id of `pad_token`.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.special_token_id("pad_token")
    }

    fn special_token_id(&self, name: &str) -> Option<u32> {
        self.special_token(name).and_then(|t| self.token_to_id(t))
    }

    /// The ids that end generation: `eos_token_id` of generation_config.json (a number or a
    /// list), else of config.json, else the tokenizer's `eos_token`; empty when none is known.
    pub fn generation_stop_ids(&self) -> Vec<u32> {
        match &self.config_eos_ids {
            Some(ids) => ids.clone(),
            None => self.eos_token_id().into_iter().collect(),
        }
    }

    /// The model's chat templates, if it ships any.
    pub fn chat_templates(&self) -> Option<&ChatTemplates> {
        self.chat_templates.as_ref()
    }

    /// Renders `messages` (objects with `role`, `content` and whatever else the template reads:
    /// `tool_calls`, `reasoning_content`, …) with the model's chat template as transformers'
    /// `apply_chat_template(messages, add_generation_prompt=…, tokenize=False, **kwargs)` does;
    /// `kwargs` (e.g. `tools`, `enable_thinking`) are template variables that override the
    /// special tokens. The result is encoded with `add_special_tokens = false`.
    pub fn apply_chat_template(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<String, BridgeError> {
        let templates =
            self.chat_templates
                .as_ref()
                .ok_or_else(|| BridgeError::NoChatTemplate {
                    path: self.dir.join(TOKENIZER_CONFIG_FILE),
                })?;
        let has_tools = kwargs.get("tools").is_some_and(|t| !t.is_null());
        let template = templates.select(None, has_tools)?;
        template.render(
            messages,
            add_generation_prompt,
            &self.special_tokens,
            kwargs,
        )
    }

    /// The token ids of a rendered conversation and its assistant mask, as transformers'
    /// `apply_chat_template(..., tokenize=True, return_dict=True,
    /// return_assistant_tokens_mask=True)` computes `assistant_masks`: the text is encoded
    /// without special tokens, with character offsets; for each generation span in order, the
    /// tokens from `char_to_token(start)` to `char_to_token(end - 1)` are marked (to the end of
    /// the sequence when that end token is none or the first token), and the first span whose
    /// start falls on no token ends the marking.
    pub fn encode_chat_with_assistant_mask(
        &self,
        rendered: &RenderedChat,
    ) -> Result<(Vec<u32>, Vec<bool>), BridgeError> {
        let encoding = self
            .inner
            .encode_char_offsets(rendered.text.as_str(), false)
            .map_err(|e| self.failure("encode a rendered chat", e))?;
        let len = encoding.get_ids().len();
        let mut mask = vec![false; len];
        for &(start, end) in &rendered.generation_spans {
            let Some(first) = encoding.char_to_token(start, 0) else {
                break;
            };
            let last = end
                .checked_sub(1)
                .and_then(|end| encoding.char_to_token(end, 0));
            // transformers: `range(start_token, end_token + 1 if end_token else len)`.
            let stop = match last {
                Some(last) if last > 0 => last + 1,
                _ => len,
            };
            for slot in mask.iter_mut().take(stop).skip(first) {
                *slot = true;
            }
        }
        Ok((encoding.get_ids().to_vec(), mask))
    }

    /// The chat-template prompt for one user message, with the generation prompt added
    /// (`moe generate --chat`).
    pub fn chat_prompt(&self, user: &str) -> Result<String, BridgeError> {
        let message = serde_json::json!({"role": "user", "content": user});
        self.apply_chat_template(&[message], true, &Map::new())
    }

    fn failure(&self, action: &str, error: impl std::fmt::Display) -> BridgeError {
        BridgeError::Tokenization {
            path: self.path(),
            action: action.into(),
            reason: error.to_string(),
        }
    }
}

/// Parses tokenizer.json, telling JSON that does not parse from JSON the crate rejects.
fn load_tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer, BridgeError> {
    let text = std::fs::read_to_string(path).map_err(|source| BridgeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    tokenizers::Tokenizer::from_str(&text).map_err(|e| {
        match serde_json::from_str::<serde::de::IgnoredAny>(&text) {
            Err(json) => BridgeError::InvalidJson {
                path: path.to_path_buf(),
                reason: json.to_string(),
            },
            Ok(_) => BridgeError::InvalidTokenizer {
                path: path.to_path_buf(),
                reason: e.to_string(),
            },
        }
    })
}

/// The JSON of `path`, `None` when the file does not exist.
fn read_json_if_present(path: &Path) -> Result<Option<Value>, BridgeError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(BridgeError::Io {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| BridgeError::InvalidJson {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

fn invalid_field(path: &Path, field: &str, reason: impl Into<String>) -> BridgeError {
    BridgeError::InvalidConfig {
        path: path.to_path_buf(),
        field: field.into(),
        reason: reason.into(),
    }
}

/// A boolean config field (absent or null: false).
fn bool_field(config: &Map<String, Value>, path: &Path, field: &str) -> Result<bool, BridgeError> {
    match config.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(invalid_field(
            path,
            field,
            format!("expected true or false, found {other}"),
        )),
    }
}

/// `eos_token_id` of generation_config.json, else config.json (a number or a list of numbers;
/// absent or null: not set).
fn generation_eos_ids(dir: &Path) -> Result<Option<Vec<u32>>, BridgeError> {
    for name in ["generation_config.json", "config.json"] {
        let path = dir.join(name);
        let Some(json) = read_json_if_present(&path)? else {
            continue;
        };
        let ids = match json.get("eos_token_id") {
            None | Some(Value::Null) => continue,
            Some(Value::Array(items)) => items.iter().map(as_token_id).collect(),
            Some(one) => as_token_id(one).map(|id| vec![id]),
        };
        return ids.map(Some).ok_or_else(|| {
            invalid_field(
                &path,
                "eos_token_id",
                "expected a token id or a list of them",
            )
        });
    }
    Ok(None)
}

fn as_token_id(value: &Value) -> Option<u32> {
    value.as_u64().and_then(|v| u32::try_from(v).ok())
}

/// The text of a token entry: a string or an `AddedToken` object (`{"content": …}`).
fn token_content(value: &Value) -> Option<&str> {
    match value {
        Value::String(s) => Some(s),
        Value::Object(map) => map.get("content").and_then(Value::as_str),
        _ => None,
    }
}

/// An `AddedToken` from a config entry, with its flags where the entry is an object.
fn added_token(value: &Value, special: bool) -> Option<AddedToken> {
    let content = token_content(value)?;
    let mut token = AddedToken::from(content.to_string(), special);
    if let Value::Object(map) = value {
        let flag = |name: &str| map.get(name).and_then(Value::as_bool);
        if let Some(b) = flag("lstrip") {
            token = token.lstrip(b);
        }
        if let Some(b) = flag("rstrip") {
            token = token.rstrip(b);
        }
        if let Some(b) = flag("single_word") {
            token = token.single_word(b);
        }
        if let Some(b) = flag("normalized") {
            token = token.normalized(b);
        }
        if let Some(b) = flag("special") {
            token = token.special(b);
        }
    }
    Some(token)
}

/// The special tokens a tokenizer_config.json (or special_tokens_map.json) declares.
#[derive(Debug, Default)]
struct SpecialTokenConfig {
    /// `*_token` → text (named and model-specific ones).
    variables: BTreeMap<String, String>,
    /// Named and extra special tokens, as `AddedToken`s.
    special: Vec<AddedToken>,
    /// `added_tokens_decoder` entries.
    decoder: Vec<AddedToken>,
}

impl SpecialTokenConfig {
    fn parse(config: &Map<String, Value>, path: &Path) -> Result<Self, BridgeError> {
        let mut out = Self::default();
        for (key, value) in config {
            if !key.ends_with("_token") || value.is_null() {
                continue;
            }
            match token_content(value) {
                Some(content) => {
                    out.variables.insert(key.clone(), content.to_string());
                    if let Some(token) = added_token(value, true) {
                        out.special.push(token.special(true));
                    }
                }
                // Model-specific keys with other values (`add_bos_token: true`) are settings.
                None if NAMED_SPECIAL_TOKENS.contains(&key.as_str()) => {
                    return Err(invalid_field(
                        path,
                        key,
                        format!(
                            "expected a token string, an AddedToken object or null, found {value}"
                        ),
                    ));
                }
                None => {}
            }
        }
        for key in ["additional_special_tokens", "extra_special_tokens"] {
            match config.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) => {
                    for item in items {
                        let token = added_token(item, true).ok_or_else(|| {
                            invalid_field(
                                path,
                                key,
                                format!("expected token strings, found {item}"),
                            )
                        })?;
                        out.special.push(token.special(true));
                    }
                }
                // transformers 5: a map of model-specific tokens (`image_token: "<image>"`).
                Some(Value::Object(map)) => {
                    for (name, item) in map {
                        if let Some(content) = token_content(item) {
                            out.variables.insert(name.clone(), content.to_string());
                        }
                        if let Some(token) = added_token(item, true) {
                            out.special.push(token.special(true));
                        }
                    }
                }
                Some(other) => {
                    return Err(invalid_field(
                        path,
                        key,
                        format!("expected a list of tokens, found {other}"),
                    ));
                }
            }
        }
        match config.get("added_tokens_decoder") {
            None | Some(Value::Null) => {}
            Some(Value::Object(map)) => {
                for (id, entry) in map {
                    let token = added_token(entry, false)
                        .filter(|_| id.parse::<u32>().is_ok())
                        .ok_or_else(|| {
                            invalid_field(
                                path,
                                &format!("added_tokens_decoder.{id}"),
                                "expected a token id mapped to an AddedToken object",
                            )
                        })?;
                    out.decoder.push(token);
                }
            }
            Some(other) => {
                return Err(invalid_field(
                    path,
                    "added_tokens_decoder",
                    format!("expected an object, found {other}"),
                ));
            }
        }
        Ok(out)
    }

    /// Adds special_tokens_map.json's entries (transformers' legacy path: they override).
    fn merge_legacy(&mut self, legacy: &SpecialTokenConfig) {
        for (key, value) in &legacy.variables {
            self.variables.insert(key.clone(), value.clone());
        }
        self.special.extend(legacy.special.iter().cloned());
    }

    /// Adds the tokens the config (`config_path`) names that tokenizer.json lacks as added
    /// tokens, as transformers does on load (appended after the existing ids).
    fn add_missing_tokens(
        &self,
        inner: &mut tokenizers::Tokenizer,
        config_path: &Path,
    ) -> Result<(), BridgeError> {
        let mut seen: std::collections::HashSet<String> = inner
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect();
        let mut plain = Vec::new();
        for token in &self.decoder {
            if seen.insert(token.content.clone()) {
                plain.push(token.clone());
            }
        }
        let mut special = Vec::new();
        for token in &self.special {
            if seen.insert(token.content.clone()) {
                special.push(token.clone());
            }
        }
        let rejected = |e: tokenizers::Error| {
            invalid_field(
                config_path,
                "added_tokens_decoder",
                format!("cannot add its tokens to tokenizer.json's: {e}"),
            )
        };
        if !plain.is_empty() {
            inner.add_tokens(plain).map_err(rejected)?;
        }
        if !special.is_empty() {
            inner.add_special_tokens(special).map_err(rejected)?;
        }
        Ok(())
    }
}

/// transformers' `clean_up_tokenization`: drops the space before punctuation and English
/// contractions.
fn clean_up_tokenization(text: &str) -> String {
    [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ]
    .iter()
    .fold(text.to_string(), |text, (from, to)| text.replace(from, to))
}
