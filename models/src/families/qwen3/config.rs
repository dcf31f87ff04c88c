//! Dense Qwen3 configuration (`model_type = "qwen3"`), HF `Qwen3Config`
//! (docs/models.md §Config parsing, §Qwen3 and its attention).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ModelError;
use crate::config::rope::{self, RopeJson, RopeKeys};
use crate::config::{RopeParameters, de};

/// HF `Qwen3Config` class defaults (transformers 5.23 `configuration_qwen3.py`).
mod hf_default {
    crate::config::de::hf_defaults! {
        vocab_size: usize = 151936;
        hidden_size: usize = 4096;
        intermediate_size: usize = 22016;
        num_hidden_layers: usize = 32;
        num_attention_heads: usize = 32;
        num_key_value_heads: Option<usize> = Some(32);
        head_dim: usize = 128;
        max_position_embeddings: usize = 32768;
        rms_norm_eps: f64 = 1e-6;
    }
}

/// A dense Qwen3 `config.json` field by field, as HF `Qwen3Config` reads and writes it, with
/// the class defaults for absent keys. [`Qwen3Config`] is this with spellings merged, RoPE
/// normalised and `null`s resolved.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub(crate) struct Qwen3Json {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model_type: Option<String>,
    #[serde(default = "hf_default::vocab_size")]
    vocab_size: usize,
    #[serde(default = "hf_default::hidden_size")]
    hidden_size: usize,
    #[serde(default = "hf_default::intermediate_size")]
    intermediate_size: usize,
    #[serde(default = "hf_default::num_hidden_layers")]
    num_hidden_layers: usize,
    #[serde(default = "hf_default::num_attention_heads")]
    num_attention_heads: usize,
    /// `null` ⇒ `num_attention_heads` (HF `__post_init__`).
    #[serde(default = "hf_default::num_key_value_heads")]
    num_key_value_heads: Option<usize>,
    /// Absent or `null` ⇒ the class default 128 (not `hidden_size / num_attention_heads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    head_dim: Option<usize>,
    /// Only `"silu"` is supported (`null` ⇒ HF's default, `"silu"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hidden_act: Option<String>,
    /// Must be false (`null` ⇒ false).
    #[serde(default, deserialize_with = "de::null_as_default")]
    use_sliding_window: bool,
    #[serde(default = "hf_default::max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default = "hf_default::rms_norm_eps")]
    rms_norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope_parameters: Option<RopeJson>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope_scaling: Option<RopeJson>,
    #[serde(default, deserialize_with = "de::null_as_default")]
    tie_word_embeddings: bool,
    #[serde(default, deserialize_with = "de::null_as_default")]
    attention_bias: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dtype: Option<String>,
    /// Pre-5.0 spelling of `dtype`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    torch_dtype: Option<String>,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

/// Dense Qwen3 configuration with HF `Qwen3Config` defaults.
///
/// (De)serializes as HF's `config.json` (written in the transformers 5.23 spelling, `extra`
/// keys included); deserializing validates like [`Qwen3Config::from_json_str`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "Qwen3Json", try_from = "Qwen3Json")]
pub struct Qwen3Config {
    /// Vocabulary size `V` (default 151936).
    pub vocab_size: usize,
    /// Hidden size `H` (default 4096).
    pub hidden_size: usize,
    /// Width `I` of the SwiGLU MLP (default 22016).
    pub intermediate_size: usize,
    /// Number of decoder layers (default 32).
    pub num_hidden_layers: usize,
    /// Query heads `nh` (default 32).
    pub num_attention_heads: usize,
    /// Key/value heads `nkv` (absent ⇒ 32; `null` ⇒ `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Per-head size `hd` (absent or `null` ⇒ the class default 128, not `H / nh`).
    pub head_dim: usize,
    /// RMSNorm epsilon (default 1e-6).
    pub rms_norm_eps: f64,
    /// RoPE settings, from `rope_parameters` or legacy `rope_theta` + `rope_scaling`.
    pub rope_parameters: RopeParameters,
    /// Maximum sequence length (default 32768).
    pub max_position_embeddings: usize,
    /// `lm_head` shares `embed_tokens`' weight (default false).
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v/o projections (default false).
    pub attention_bias: bool,
    /// Checkpoint dtype string (`dtype` | `torch_dtype`).
    pub dtype: Option<String>,
    /// Keys this parser does not interpret, kept verbatim for export.
    pub extra: Map<String, Value>,
}

impl Default for Qwen3Config {
    fn default() -> Self {
        Self {
            vocab_size: hf_default::vocab_size(),
            hidden_size: hf_default::hidden_size(),
            intermediate_size: hf_default::intermediate_size(),
            num_hidden_layers: hf_default::num_hidden_layers(),
            num_attention_heads: hf_default::num_attention_heads(),
            num_key_value_heads: hf_default::num_key_value_heads()
                .unwrap_or(hf_default::num_attention_heads()),
            head_dim: hf_default::head_dim(),
            rms_norm_eps: hf_default::rms_norm_eps(),
            rope_parameters: RopeParameters::default(),
            max_position_embeddings: hf_default::max_position_embeddings(),
            tie_word_embeddings: false,
            attention_bias: false,
            dtype: None,
            extra: Map::new(),
        }
    }
}

impl Qwen3Config {
    /// The `model_type` this config parses.
    pub const MODEL_TYPE: &'static str = "qwen3";

    /// Reads and parses a `config.json` file; errors carry the path.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|e| e.in_file(path))
    }

    /// Parses the text of a `config.json` and validates it.
    pub fn from_json_str(text: &str) -> Result<Self, ModelError> {
        de::parse::<Qwen3Json>(text, Self::MODEL_TYPE)?.try_into()
    }

    /// Checks sizes and cross-field rules; errors name the offending field.
    pub fn validate(&self) -> Result<(), ModelError> {
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if value == 0 {
                return Err(ModelError::invalid(field, "must be positive, got 0"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(ModelError::invalid(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads = {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(ModelError::invalid(
                "rms_norm_eps",
                format!("must be a positive number, got {}", self.rms_norm_eps),
            ));
        }
        Ok(())
    }
}

impl TryFrom<Qwen3Json> for Qwen3Config {
    type Error = ModelError;

    /// Merges spellings, normalises RoPE, resolves `null`s, then [`Qwen3Config::validate`]s.
    fn try_from(mut j: Qwen3Json) -> Result<Self, ModelError> {
        de::check_model_type(j.model_type.as_deref(), Self::MODEL_TYPE)?;
        de::check_silu(j.hidden_act.as_deref())?;
        if j.use_sliding_window {
            return Err(ModelError::invalid(
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }
        let rope = RopeKeys {
            rope_theta: j.rope_theta,
            rope_parameters: j.rope_parameters,
            rope_scaling: j.rope_scaling,
        };
        let rope_parameters = rope::resolve(rope, &mut j.extra, j.max_position_embeddings)?;
        let config = Self {
            vocab_size: j.vocab_size,
            hidden_size: j.hidden_size,
            intermediate_size: j.intermediate_size,
            num_hidden_layers: j.num_hidden_layers,
            num_attention_heads: j.num_attention_heads,
            num_key_value_heads: j.num_key_value_heads.unwrap_or(j.num_attention_heads),
            head_dim: j.head_dim.unwrap_or_else(hf_default::head_dim),
            rms_norm_eps: j.rms_norm_eps,
            rope_parameters,
            max_position_embeddings: j.max_position_embeddings,
            tie_word_embeddings: j.tie_word_embeddings,
            attention_bias: j.attention_bias,
            dtype: de::either(("dtype", j.dtype), ("torch_dtype", j.torch_dtype))?,
            extra: j.extra,
        };
        config.validate()?;
        Ok(config)
    }
}

impl From<Qwen3Config> for Qwen3Json {
    /// The 5.23 spelling: `dtype`, `rope_parameters`, every interpreted field explicit.
    fn from(c: Qwen3Config) -> Self {
        Self {
            model_type: Some(Qwen3Config::MODEL_TYPE.to_owned()),
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: Some(c.num_key_value_heads),
            head_dim: Some(c.head_dim),
            hidden_act: Some("silu".to_owned()),
            use_sliding_window: false,
            max_position_embeddings: c.max_position_embeddings,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: None,
            rope_parameters: Some((&c.rope_parameters).into()),
            rope_scaling: None,
            tie_word_embeddings: c.tie_word_embeddings,
            attention_bias: c.attention_bias,
            dtype: c.dtype,
            torch_dtype: None,
            extra: c.extra,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_nulls_and_rejections() {
        let c = Qwen3Config::from_json_str(
            r#"{"model_type": "qwen3", "num_attention_heads": 8, "num_key_value_heads": null,
                "hidden_size": 64, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
                "max_window_layers": 28}"#,
        )
        .unwrap();
        assert_eq!(c.num_key_value_heads, 8);
        assert_eq!(
            c.head_dim, 128,
            "absent head_dim is the class default, not H / nh"
        );
        assert_eq!(c.rope_parameters.rope_theta, 1e6);
        assert_eq!(c.dtype.as_deref(), Some("bfloat16"));
        assert!(c.extra.contains_key("max_window_layers"));
        let absent = Qwen3Config::from_json_str(r#"{"model_type": "qwen3"}"#).unwrap();
        assert_eq!(absent.num_key_value_heads, 32);

        for (text, needle) in [
            (r#"{"model_type": "qwen3_moe"}"#, "model_type"),
            (
                r#"{"model_type": "qwen3", "use_sliding_window": true}"#,
                "use_sliding_window",
            ),
            (
                r#"{"model_type": "qwen3", "hidden_act": "gelu"}"#,
                "hidden_act",
            ),
            (
                r#"{"model_type": "qwen3", "num_key_value_heads": 5}"#,
                "num_key_value_heads",
            ),
        ] {
            let err = Qwen3Config::from_json_str(text).unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }
}
