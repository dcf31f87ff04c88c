//! Dense Qwen3 configuration (`model_type = "qwen3"`), HF `Qwen3Config`
//! (docs/models.md §Config parsing, §Qwen3 and its attention).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ModelError;
use crate::config::layer_types::{LayerType, layer_windows, parse_layer_types};
use crate::config::rope::{self, RopeJson, RopeKeys};
use crate::config::{RopeParameters, check, de};

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
        sliding_window: Option<usize> = Some(4096);
        max_window_layers: usize = 28;
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
    /// `null` ⇒ false.
    #[serde(default, deserialize_with = "de::null_as_default")]
    use_sliding_window: bool,
    /// Absent ⇒ 4096; only read with `use_sliding_window`.
    #[serde(default = "hf_default::sliding_window")]
    sliding_window: Option<usize>,
    #[serde(default = "hf_default::max_window_layers")]
    max_window_layers: usize,
    /// Absent or `null` ⇒ derived from `sliding_window` and `max_window_layers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    layer_types: Option<Vec<String>>,
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
    /// Whether `sliding_window` applies (HF `use_sliding_window`, default false).
    pub use_sliding_window: bool,
    /// The window of the sliding layers as HF resolves it: `None` unless `use_sliding_window`
    /// (then the written `sliding_window`, default 4096).
    pub sliding_window: Option<usize>,
    /// Layers from this index on slide when `layer_types` is not written (default 28).
    pub max_window_layers: usize,
    /// Each layer's attention (`layer_types`, one per layer; derived as HF does when absent:
    /// sliding from `max_window_layers` on if a window is set, full otherwise). Empty when
    /// every layer is full attention (the parsed form then, so struct literals that change
    /// `num_hidden_layers` stay valid); written out one per layer.
    pub layer_types: Vec<LayerType>,
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
            use_sliding_window: false,
            sliding_window: None,
            max_window_layers: hf_default::max_window_layers(),
            layer_types: Vec::new(),
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
        check::read_config_file(path.as_ref(), Self::from_json_str)
    }

    /// Parses the text of a `config.json` and validates it.
    pub fn from_json_str(text: &str) -> Result<Self, ModelError> {
        de::parse::<Qwen3Json>(text, Self::MODEL_TYPE)?.try_into()
    }

    /// The sliding window of layer `i` (`None`: full attention, or no such layer).
    pub fn layer_sliding_window(&self, i: usize) -> Option<usize> {
        match self.layer_types.get(i) {
            Some(LayerType::SlidingAttention) => self.sliding_window,
            _ => None,
        }
    }

    /// Checks sizes and cross-field rules; errors name the offending field.
    pub fn validate(&self) -> Result<(), ModelError> {
        check::positive(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ])?;
        check::kv_heads_divide(self.num_attention_heads, self.num_key_value_heads)?;
        check::positive_number("rms_norm_eps", self.rms_norm_eps)?;
        if self.sliding_window == Some(0) {
            return Err(ModelError::invalid(
                "sliding_window",
                "must be positive, got 0",
            ));
        }
        if !self.layer_types.is_empty() && self.layer_types.len() != self.num_hidden_layers {
            return Err(ModelError::invalid(
                "layer_types",
                format!(
                    "{} entries for num_hidden_layers = {}",
                    self.layer_types.len(),
                    self.num_hidden_layers
                ),
            ));
        }
        layer_windows(&self.layer_types, self.sliding_window)?;
        Ok(())
    }
}

impl TryFrom<Qwen3Json> for Qwen3Config {
    type Error = ModelError;

    /// Merges spellings, normalises RoPE, resolves `null`s, then [`Qwen3Config::validate`]s.
    fn try_from(mut j: Qwen3Json) -> Result<Self, ModelError> {
        de::check_model_type(j.model_type.as_deref(), Self::MODEL_TYPE)?;
        de::check_silu(j.hidden_act.as_deref())?;
        // HF `__post_init__`: the window counts only with `use_sliding_window`; absent
        // `layer_types` slide from `max_window_layers` on when it does.
        let sliding_window = j.sliding_window.filter(|_| j.use_sliding_window);
        crate::config::check_layer_count("num_hidden_layers", j.num_hidden_layers)?;
        let layer_types = match &j.layer_types {
            Some(written) => parse_layer_types(written, j.num_hidden_layers)?,
            None => (0..j.num_hidden_layers)
                .map(|i| {
                    if sliding_window.is_some() && i >= j.max_window_layers {
                        LayerType::SlidingAttention
                    } else {
                        LayerType::FullAttention
                    }
                })
                .collect(),
        };
        let layer_types = if layer_types.iter().all(|&t| t == LayerType::FullAttention) {
            Vec::new()
        } else {
            layer_types
        };
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
            use_sliding_window: j.use_sliding_window,
            sliding_window,
            max_window_layers: j.max_window_layers,
            layer_types,
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
            use_sliding_window: c.use_sliding_window,
            // As HF writes it after `__post_init__` (`null` unless used).
            sliding_window: c.sliding_window,
            max_window_layers: c.max_window_layers,
            layer_types: Some(
                (0..c.num_hidden_layers)
                    .map(|i| {
                        let t = c.layer_types.get(i).copied();
                        t.unwrap_or(LayerType::FullAttention).as_str().to_owned()
                    })
                    .collect(),
            ),
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
        assert_eq!(c.max_window_layers, 28);
        assert!(c.layer_types.is_empty(), "every layer full");
        let absent = Qwen3Config::from_json_str(r#"{"model_type": "qwen3"}"#).unwrap();
        assert_eq!(absent.num_key_value_heads, 32);

        for (text, needle) in [
            (r#"{"model_type": "qwen3_moe"}"#, "model_type"),
            (
                r#"{"model_type": "qwen3", "num_hidden_layers": 2,
                    "layer_types": ["full_attention"]}"#,
                "layer_types",
            ),
            (
                r#"{"model_type": "qwen3", "num_hidden_layers": 2,
                    "layer_types": ["full_attention", "chunked_attention"]}"#,
                "layer_types",
            ),
            (
                r#"{"model_type": "qwen3", "num_hidden_layers": 2,
                    "layer_types": ["full_attention", "sliding_attention"]}"#,
                "layer_types",
            ),
            (
                r#"{"model_type": "qwen3", "use_sliding_window": true, "sliding_window": 0}"#,
                "sliding_window",
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

    /// transformers 5.23 `Qwen3Config.__post_init__`: the window only with
    /// `use_sliding_window`, derived `layer_types` slide from `max_window_layers` on, written
    /// ones win; the resolved config round-trips through its JSON.
    #[test]
    fn sliding_windows_resolve_as_transformers_does() {
        let c = Qwen3Config::from_json_str(
            r#"{"model_type": "qwen3", "num_hidden_layers": 4, "use_sliding_window": true,
                "sliding_window": 5, "max_window_layers": 2}"#,
        )
        .unwrap();
        use LayerType::{FullAttention as F, SlidingAttention as W};
        assert_eq!(c.layer_types, [F, F, W, W]);
        let windows: Vec<_> = (0..4).map(|i| c.layer_sliding_window(i)).collect();
        assert_eq!(windows, [None, None, Some(5), Some(5)]);
        // Unused window: `null` after resolution, every layer full.
        let off = Qwen3Config::from_json_str(
            r#"{"model_type": "qwen3", "num_hidden_layers": 2, "sliding_window": 5}"#,
        )
        .unwrap();
        assert_eq!((off.sliding_window, off.layer_types), (None, vec![]));
        // Written layer types win over max_window_layers; the window default is 4096.
        let written = Qwen3Config::from_json_str(
            r#"{"model_type": "qwen3", "num_hidden_layers": 3, "use_sliding_window": true,
                "max_window_layers": 0,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}"#,
        )
        .unwrap();
        assert_eq!(written.layer_types, [W, F, W]);
        assert_eq!(written.layer_sliding_window(0), Some(4096));
        let json = serde_json::to_string(&written).unwrap();
        assert_eq!(Qwen3Config::from_json_str(&json).unwrap(), written);
    }
}
