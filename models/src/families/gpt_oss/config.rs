//! The gpt-oss `config.json` (HF `GptOssConfig`, transformers 5.23
//! `models/gpt_oss/configuration_gpt_oss.py`; parsing as docs/models.md §Config parsing).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ModelError;
use crate::config::RopeParameters;
use crate::config::layer_types::{LayerType, layer_windows, parse_layer_types};
use crate::config::rope::{self, RopeJson, RopeKeys, RopeScaling, YarnParameters};
use crate::config::{check, de};

/// HF `GptOssConfig` class defaults (transformers 5.23 `configuration_gpt_oss.py`).
mod hf_default {
    crate::config::de::hf_defaults! {
        vocab_size: usize = 201088;
        hidden_size: usize = 2880;
        intermediate_size: usize = 2880;
        num_hidden_layers: usize = 36;
        num_attention_heads: usize = 64;
        num_key_value_heads: Option<usize> = Some(8);
        head_dim: Option<usize> = Some(64);
        num_experts_per_tok: usize = 4;
        sliding_window: Option<usize> = Some(128);
        rms_norm_eps: f64 = 1e-5;
        max_position_embeddings: usize = 131072;
        router_aux_loss_coef: f64 = 0.001;
        swiglu_alpha: f64 = 1.702;
        swiglu_limit: f64 = 7.0;
        attention_bias: bool = true;
        rope_theta: f64 = 150000.0;
    }
}

/// HF's default number of routed experts (`num_local_experts`, applied after merging the
/// `num_experts` spelling).
const DEFAULT_EXPERTS: usize = 128;

/// A gpt-oss `config.json` field by field, as HF `GptOssConfig` reads and writes it.
#[derive(Debug, Clone, Deserialize, Serialize)]
struct GptOssJson {
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
    /// `null` ⇒ `hidden_size / num_attention_heads`.
    #[serde(default = "hf_default::head_dim")]
    head_dim: Option<usize>,
    #[serde(
        default,
        deserialize_with = "de::present",
        skip_serializing_if = "Option::is_none"
    )]
    num_local_experts: Option<usize>,
    /// The `attribute_map` spelling of `num_local_experts`.
    #[serde(
        default,
        deserialize_with = "de::present",
        skip_serializing_if = "Option::is_none"
    )]
    num_experts: Option<usize>,
    #[serde(default = "hf_default::num_experts_per_tok")]
    num_experts_per_tok: usize,
    /// HF writes `"silu"`; the experts' activation is the clamped SwiGLU whatever it says
    /// (`GptOssExperts` never reads it), so only `"silu"` / `null` are accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hidden_act: Option<String>,
    /// The window of the sliding layers (`null`: none may slide).
    #[serde(default = "hf_default::sliding_window")]
    sliding_window: Option<usize>,
    /// Absent or `null` ⇒ sliding on even layers, full on odd ones (HF `__post_init__`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    layer_types: Option<Vec<String>>,
    #[serde(default, deserialize_with = "de::null_as_default")]
    attention_dropout: f64,
    #[serde(default = "hf_default::attention_bias")]
    attention_bias: bool,
    #[serde(default = "hf_default::rms_norm_eps")]
    rms_norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope_parameters: Option<RopeJson>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope_scaling: Option<RopeJson>,
    #[serde(default = "hf_default::max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default, deserialize_with = "de::null_as_default")]
    tie_word_embeddings: bool,
    #[serde(default = "hf_default::router_aux_loss_coef")]
    router_aux_loss_coef: f64,
    #[serde(default, deserialize_with = "de::null_as_default")]
    output_router_logits: bool,
    #[serde(default = "hf_default::swiglu_alpha")]
    swiglu_alpha: f64,
    #[serde(default = "hf_default::swiglu_limit")]
    swiglu_limit: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dtype: Option<String>,
    /// Pre-5.0 spelling of `dtype`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    torch_dtype: Option<String>,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

/// gpt-oss configuration (`model_type = "gpt_oss"`), HF `GptOssConfig` defaults.
///
/// (De)serializes as HF's `config.json` (written in the transformers 5.23 spelling, `extra`
/// keys such as `quantization_config` kept); deserializing validates like
/// [`GptOssConfig::from_json_str`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "GptOssJson", try_from = "GptOssJson")]
pub struct GptOssConfig {
    /// Vocabulary size `V` (default 201088).
    pub vocab_size: usize,
    /// Hidden size `H` (default 2880).
    pub hidden_size: usize,
    /// Width `Im` of each routed expert (default 2880).
    pub intermediate_size: usize,
    /// Number of decoder layers, every one an MoE layer (default 36).
    pub num_hidden_layers: usize,
    /// Query heads `nh` (default 64).
    pub num_attention_heads: usize,
    /// Key/value heads `nkv` (default 8).
    pub num_key_value_heads: usize,
    /// Per-head size `hd` (default 64).
    pub head_dim: usize,
    /// Routed experts `E` (`num_local_experts` | `num_experts`; default 128).
    pub num_local_experts: usize,
    /// Experts per token `k` (default 4).
    pub num_experts_per_tok: usize,
    /// The window of the sliding layers (default 128).
    pub sliding_window: Option<usize>,
    /// Each layer's attention (one per layer; HF's alternation from sliding when absent).
    pub layer_types: Vec<LayerType>,
    /// Biases on q/k/v/o (default true).
    pub attention_bias: bool,
    /// RMSNorm epsilon (default 1e-5).
    pub rms_norm_eps: f64,
    /// RoPE settings (default YaRN factor 32 over 4096 positions, θ 150000).
    pub rope_parameters: RopeParameters,
    /// Maximum sequence length (default 131072).
    pub max_position_embeddings: usize,
    /// `lm_head` shares `embed_tokens`' weight (default false).
    pub tie_word_embeddings: bool,
    /// Coefficient of HF's load-balancing loss (default 0.001).
    pub router_aux_loss_coef: f64,
    /// Return router logits (and add the aux loss to HF's loss) (default false).
    pub output_router_logits: bool,
    /// The clamped SwiGLU's sigmoid gain (default 1.702).
    pub swiglu_alpha: f64,
    /// The clamped SwiGLU's clamp bound (default 7.0).
    pub swiglu_limit: f64,
    /// Checkpoint dtype string (`dtype` | `torch_dtype`).
    pub dtype: Option<String>,
    /// Keys this parser does not interpret, kept verbatim for export.
    pub extra: Map<String, Value>,
}

/// HF's default YaRN of gpt-oss (`__post_init__` when `rope_parameters` is absent).
fn default_rope() -> RopeParameters {
    RopeParameters {
        rope_theta: hf_default::rope_theta(),
        scaling: RopeScaling::Yarn(YarnParameters {
            factor: 32.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: false,
        }),
    }
}

/// HF's alternation: layer `i` slides iff `i` is even.
fn alternating(layers: usize) -> Vec<LayerType> {
    (0..layers)
        .map(|i| match i % 2 {
            0 => LayerType::SlidingAttention,
            _ => LayerType::FullAttention,
        })
        .collect()
}

impl Default for GptOssConfig {
    fn default() -> Self {
        let layers = hf_default::num_hidden_layers();
        Self {
            vocab_size: hf_default::vocab_size(),
            hidden_size: hf_default::hidden_size(),
            intermediate_size: hf_default::intermediate_size(),
            num_hidden_layers: layers,
            num_attention_heads: hf_default::num_attention_heads(),
            num_key_value_heads: hf_default::num_key_value_heads()
                .unwrap_or_else(hf_default::num_attention_heads),
            head_dim: hf_default::head_dim().unwrap_or(64),
            num_local_experts: DEFAULT_EXPERTS,
            num_experts_per_tok: hf_default::num_experts_per_tok(),
            sliding_window: hf_default::sliding_window(),
            layer_types: alternating(layers),
            attention_bias: hf_default::attention_bias(),
            rms_norm_eps: hf_default::rms_norm_eps(),
            rope_parameters: default_rope(),
            max_position_embeddings: hf_default::max_position_embeddings(),
            tie_word_embeddings: false,
            router_aux_loss_coef: hf_default::router_aux_loss_coef(),
            output_router_logits: false,
            swiglu_alpha: hf_default::swiglu_alpha(),
            swiglu_limit: hf_default::swiglu_limit(),
            dtype: None,
            extra: Map::new(),
        }
    }
}

impl GptOssConfig {
    /// The `model_type` this config parses.
    pub const MODEL_TYPE: &'static str = "gpt_oss";

    /// Reads and parses a `config.json` file; errors carry the path.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        check::read_config_file(path.as_ref(), Self::from_json_str)
    }

    /// Parses the text of a `config.json` and validates it.
    pub fn from_json_str(text: &str) -> Result<Self, ModelError> {
        de::parse::<GptOssJson>(text, Self::MODEL_TYPE)?.try_into()
    }

    /// The sliding window of layer `i` (`None`: full causal attention).
    pub fn layer_sliding_window(&self, i: usize) -> Option<usize> {
        match self.layer_types.get(i) {
            Some(LayerType::SlidingAttention) => self.sliding_window,
            _ => None,
        }
    }

    /// Checks sizes and cross-field rules; errors name the offending field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("num_local_experts", self.num_local_experts),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        check::positive(&positive)?;
        check::kv_heads_divide(self.num_attention_heads, self.num_key_value_heads)?;
        let k = self.num_experts_per_tok;
        if !(1..=self.num_local_experts).contains(&k) {
            return Err(ModelError::invalid(
                "num_experts_per_tok",
                format!(
                    "must be in 1..={} (num_local_experts), got {k}",
                    self.num_local_experts
                ),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(ModelError::invalid(
                "sliding_window",
                "must be positive (a query always sees itself)",
            ));
        }
        if self.layer_types.len() != self.num_hidden_layers {
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
        check::positive_number("rms_norm_eps", self.rms_norm_eps)?;
        check::positive_number("swiglu_alpha", self.swiglu_alpha)?;
        check::positive_number("swiglu_limit", self.swiglu_limit)?;
        check::non_negative_number("router_aux_loss_coef", self.router_aux_loss_coef)?;
        Ok(())
    }
}

impl TryFrom<GptOssJson> for GptOssConfig {
    type Error = ModelError;

    /// Merges spellings, applies HF's `__post_init__` (KV heads, head size, layer types,
    /// YaRN), refuses what the model does not implement, then [`GptOssConfig::validate`]s.
    fn try_from(mut j: GptOssJson) -> Result<Self, ModelError> {
        de::check_model_type(j.model_type.as_deref(), Self::MODEL_TYPE)?;
        de::check_silu(j.hidden_act.as_deref())?;
        check::zero_in_training("attention_dropout", j.attention_dropout)?;
        let num_key_value_heads = j.num_key_value_heads.unwrap_or(j.num_attention_heads);
        let head_dim = match j.head_dim {
            Some(hd) => hd,
            None if j.num_attention_heads > 0 => j.hidden_size / j.num_attention_heads,
            None => {
                return Err(ModelError::invalid(
                    "num_attention_heads",
                    "must be positive, got 0",
                ));
            }
        };
        crate::config::check_layer_count("num_hidden_layers", j.num_hidden_layers)?;
        let layer_types = match &j.layer_types {
            Some(written) => parse_layer_types(written, j.num_hidden_layers)?,
            None => alternating(j.num_hidden_layers),
        };
        let rope_parameters = if j.rope_parameters.is_none() && j.rope_scaling.is_none() {
            let mut p = default_rope();
            if let Some(theta) = j.rope_theta {
                p.rope_theta = theta;
            }
            p
        } else {
            let keys = RopeKeys {
                rope_theta: Some(j.rope_theta.unwrap_or_else(hf_default::rope_theta)),
                rope_parameters: j.rope_parameters,
                rope_scaling: j.rope_scaling,
            };
            rope::resolve(keys, &mut j.extra, j.max_position_embeddings)?
        };
        let experts = de::either(
            ("num_local_experts", j.num_local_experts),
            ("num_experts", j.num_experts),
        )?;
        let config = Self {
            vocab_size: j.vocab_size,
            hidden_size: j.hidden_size,
            intermediate_size: j.intermediate_size,
            num_hidden_layers: j.num_hidden_layers,
            num_attention_heads: j.num_attention_heads,
            num_key_value_heads,
            head_dim,
            num_local_experts: experts.unwrap_or(DEFAULT_EXPERTS),
            num_experts_per_tok: j.num_experts_per_tok,
            sliding_window: j.sliding_window,
            layer_types,
            attention_bias: j.attention_bias,
            rms_norm_eps: j.rms_norm_eps,
            rope_parameters,
            max_position_embeddings: j.max_position_embeddings,
            tie_word_embeddings: j.tie_word_embeddings,
            router_aux_loss_coef: j.router_aux_loss_coef,
            output_router_logits: j.output_router_logits,
            swiglu_alpha: j.swiglu_alpha,
            swiglu_limit: j.swiglu_limit,
            dtype: de::either(("dtype", j.dtype), ("torch_dtype", j.torch_dtype))?,
            extra: j.extra,
        };
        config.validate()?;
        Ok(config)
    }
}

impl From<GptOssConfig> for GptOssJson {
    /// The 5.23 spelling (`num_local_experts`, `dtype`, `rope_parameters`, `layer_types`),
    /// every interpreted field explicit.
    fn from(c: GptOssConfig) -> Self {
        Self {
            model_type: Some(GptOssConfig::MODEL_TYPE.to_owned()),
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: Some(c.num_key_value_heads),
            head_dim: Some(c.head_dim),
            num_local_experts: Some(c.num_local_experts),
            num_experts: None,
            num_experts_per_tok: c.num_experts_per_tok,
            hidden_act: Some("silu".to_owned()),
            sliding_window: c.sliding_window,
            layer_types: Some(
                c.layer_types
                    .iter()
                    .map(|t| t.as_str().to_owned())
                    .collect(),
            ),
            attention_dropout: 0.0,
            attention_bias: c.attention_bias,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: None,
            rope_parameters: Some((&c.rope_parameters).into()),
            rope_scaling: None,
            max_position_embeddings: c.max_position_embeddings,
            tie_word_embeddings: c.tie_word_embeddings,
            router_aux_loss_coef: c.router_aux_loss_coef,
            output_router_logits: c.output_router_logits,
            swiglu_alpha: c.swiglu_alpha,
            swiglu_limit: c.swiglu_limit,
            dtype: c.dtype,
            torch_dtype: None,
            extra: c.extra,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(fields: &str) -> Result<GptOssConfig, ModelError> {
        let sep = if fields.is_empty() { "" } else { ", " };
        GptOssConfig::from_json_str(&format!(r#"{{"model_type": "gpt_oss"{sep}{fields}}}"#))
    }

    /// The class defaults of transformers 5.23 (`GptOssConfig()` and its `__post_init__`).
    #[test]
    fn class_defaults_fill_absent_keys_and_unknown_keys_are_kept() {
        let c = parse(r#""bos_token_id": 1"#).unwrap();
        assert_eq!(c, GptOssConfig::default().with_extra("bos_token_id", 1));
        assert_eq!((c.num_local_experts, c.num_experts_per_tok), (128, 4));
        assert_eq!((c.num_attention_heads, c.num_key_value_heads), (64, 8));
        assert_eq!(c.layer_types[0], LayerType::SlidingAttention);
        assert_eq!(c.layer_types[1], LayerType::FullAttention);
        assert_eq!(c.layer_sliding_window(0), Some(128));
        assert_eq!(c.layer_sliding_window(1), None);
        assert_eq!(c.rope_parameters.rope_theta, 150000.0);
        assert!(matches!(
            c.rope_parameters.scaling,
            RopeScaling::Yarn(YarnParameters {
                factor: 32.0,
                truncate: false,
                ..
            })
        ));
        assert_eq!((c.swiglu_alpha, c.swiglu_limit), (1.702, 7.0));
        assert!(c.attention_bias);
    }

    impl GptOssConfig {
        fn with_extra(mut self, key: &str, value: i64) -> Self {
            self.extra.insert(key.to_owned(), value.into());
            self
        }
    }

    #[test]
    fn the_release_spelling_and_the_fixture_round_trip() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");
        let f32 = GptOssConfig::from_file(format!("{dir}/gpt_oss/config.json")).unwrap();
        let release = GptOssConfig::from_file(format!("{dir}/gpt_oss_mxfp4/config.json")).unwrap();
        // `rope_scaling` + top-level `rope_theta` read as the same `rope_parameters`.
        assert_eq!(release.rope_parameters, f32.rope_parameters);
        assert_eq!(release.layer_types, f32.layer_types);
        assert!(release.extra.contains_key("quantization_config"));
        let text = serde_json::to_string(&release).unwrap();
        assert_eq!(GptOssConfig::from_json_str(&text).unwrap(), release);
    }

    #[test]
    fn unsupported_or_inconsistent_fields_are_named() {
        for (json, field) in [
            (
                r#""num_hidden_layers": 4, "layer_types": ["sliding_attention"]"#,
                "layer_types",
            ),
            (
                r#""layer_types": ["chunked_attention"], "num_hidden_layers": 1"#,
                "layer_types",
            ),
            (r#""sliding_window": null"#, "layer_types"),
            (r#""sliding_window": 0"#, "sliding_window"),
            (r#""swiglu_limit": 0"#, "swiglu_limit"),
            (r#""attention_dropout": 0.1"#, "attention_dropout"),
            (r#""num_experts_per_tok": 129"#, "num_experts_per_tok"),
            (r#""num_key_value_heads": 7"#, "num_key_value_heads"),
            (r#""num_local_experts": 8, "num_experts": 4"#, "num_experts"),
            (r#""hidden_act": "gelu""#, "hidden_act"),
        ] {
            let err = parse(json).unwrap_err().to_string();
            assert!(err.contains(field), "{json}: {err}");
        }
    }
}
