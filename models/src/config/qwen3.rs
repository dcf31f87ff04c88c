//! Dense Qwen3 configuration (`model_type = "qwen3"`), HF `Qwen3Config` (models.md §2, §4).

use std::path::Path;

use serde_json::{Map, Value};

use super::json::JsonObject;
use super::{RopeParameters, rope};
use crate::ModelError;

/// Dense Qwen3 configuration with HF `Qwen3Config` defaults.
#[derive(Debug, Clone, PartialEq)]
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
            vocab_size: 151936,
            hidden_size: 4096,
            intermediate_size: 22016,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_parameters: RopeParameters::default(),
            max_position_embeddings: 32768,
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
        let mut cfg = JsonObject::parse(text)?;
        match cfg.string("model_type")? {
            Some(t) if t == Self::MODEL_TYPE => {}
            found => {
                return Err(ModelError::WrongModelType {
                    expected: Self::MODEL_TYPE,
                    found: found.map_or_else(|| "absent".to_owned(), |t| format!("\"{t}\"")),
                });
            }
        }
        if let Some(act) = cfg.string("hidden_act")?.filter(|a| a != "silu") {
            return Err(ModelError::invalid(
                "hidden_act",
                format!("\"{act}\" is not supported (only \"silu\")"),
            ));
        }
        if cfg.bool_or("use_sliding_window", false)? {
            return Err(ModelError::invalid(
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }
        let d = Self::default();
        let num_attention_heads = cfg.usize_or("num_attention_heads", d.num_attention_heads)?;
        let num_key_value_heads = if cfg.is_null("num_key_value_heads") {
            cfg.take("num_key_value_heads");
            num_attention_heads
        } else {
            cfg.usize_or("num_key_value_heads", d.num_key_value_heads)?
        };
        let max_position_embeddings =
            cfg.usize_or("max_position_embeddings", d.max_position_embeddings)?;
        let rope_parameters = rope::parse_rope(&mut cfg, max_position_embeddings)?;
        let config = Self {
            vocab_size: cfg.usize_or("vocab_size", d.vocab_size)?,
            hidden_size: cfg.usize_or("hidden_size", d.hidden_size)?,
            intermediate_size: cfg.usize_or("intermediate_size", d.intermediate_size)?,
            num_hidden_layers: cfg.usize_or("num_hidden_layers", d.num_hidden_layers)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim: cfg.nullable_usize("head_dim")?.unwrap_or(d.head_dim),
            rms_norm_eps: cfg.f64_or("rms_norm_eps", d.rms_norm_eps)?,
            rope_parameters,
            max_position_embeddings,
            tie_word_embeddings: cfg.bool_or("tie_word_embeddings", d.tie_word_embeddings)?,
            attention_bias: cfg.bool_or("attention_bias", d.attention_bias)?,
            dtype: cfg.either_string("dtype", "torch_dtype")?,
            extra: cfg.into_remaining(),
        };
        config.validate()?;
        Ok(config)
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
