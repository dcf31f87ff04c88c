//! The Mixtral `config.json` (HF `MixtralConfig`, transformers 5.23
//! `models/mixtral/configuration_mixtral.py`; parsing as docs/models.md §Config parsing).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ModelError;
use crate::config::RopeParameters;
use crate::config::rope::{self, RopeJson, RopeKeys};
use crate::config::{check, de};

/// HF `MixtralConfig` class defaults (transformers 5.23 `configuration_mixtral.py`).
mod hf_default {
    crate::config::de::hf_defaults! {
        vocab_size: usize = 32000;
        hidden_size: usize = 4096;
        intermediate_size: usize = 14336;
        num_hidden_layers: usize = 32;
        num_attention_heads: usize = 32;
        num_key_value_heads: Option<usize> = Some(8);
        num_local_experts: usize = 8;
        num_experts_per_tok: usize = 2;
        rms_norm_eps: f64 = 1e-5;
        max_position_embeddings: usize = 4096 * 32;
        router_aux_loss_coef: f64 = 0.001;
        rope_theta: f64 = 1e6;
    }
}

/// A Mixtral `config.json` field by field, as HF `MixtralConfig` reads and writes it, with the
/// class defaults for absent keys. [`MixtralConfig`] is this with spellings merged, RoPE
/// normalised and `null`s resolved.
#[derive(Debug, Clone, Deserialize, Serialize)]
struct MixtralJson {
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
    /// Absent or `null` ⇒ `hidden_size / num_attention_heads` (the attention's fallback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    head_dim: Option<usize>,
    /// Default 8, applied after merging with `num_experts`.
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
    /// Only `"silu"` is supported (`null` ⇒ HF's default, `"silu"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hidden_act: Option<String>,
    /// Must be `null` (sliding-window attention is not wired for this family).
    #[serde(default)]
    sliding_window: Option<Value>,
    /// Must be 0 (`null` ⇒ 0): the multiplicative jitter of the router input in training.
    #[serde(default, deserialize_with = "de::null_as_default")]
    router_jitter_noise: f64,
    /// Must be 0 (`null` ⇒ 0): attention-probability dropout in training.
    #[serde(default, deserialize_with = "de::null_as_default")]
    attention_dropout: f64,
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dtype: Option<String>,
    /// Pre-5.0 spelling of `dtype`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    torch_dtype: Option<String>,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

/// Mixtral configuration (`model_type = "mixtral"`), HF `MixtralConfig` defaults.
///
/// (De)serializes as HF's `config.json` (written in the transformers 5.23 spelling, `extra`
/// keys included); deserializing validates like [`MixtralConfig::from_json_str`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "MixtralJson", try_from = "MixtralJson")]
pub struct MixtralConfig {
    /// Vocabulary size `V` (default 32000).
    pub vocab_size: usize,
    /// Hidden size `H` (default 4096).
    pub hidden_size: usize,
    /// Width `Im` of each routed expert (default 14336).
    pub intermediate_size: usize,
    /// Number of decoder layers, every one an MoE layer (default 32).
    pub num_hidden_layers: usize,
    /// Query heads `nh` (default 32).
    pub num_attention_heads: usize,
    /// Key/value heads `nkv` (default 8; `null` ⇒ `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Per-head size `hd`: `head_dim` if present and non-null, else `hidden_size / heads`.
    pub head_dim: usize,
    /// Routed experts `E` (`num_local_experts` | `num_experts`; default 8).
    pub num_local_experts: usize,
    /// Experts per token `k` (default 2); the top-k weights are always renormalised.
    pub num_experts_per_tok: usize,
    /// RMSNorm epsilon (default 1e-5).
    pub rms_norm_eps: f64,
    /// RoPE settings, from `rope_parameters` or legacy `rope_theta` + `rope_scaling`
    /// (θ defaults to 1e6, the class's `default_theta`).
    pub rope_parameters: RopeParameters,
    /// Maximum sequence length (default 131072).
    pub max_position_embeddings: usize,
    /// `lm_head` shares `embed_tokens`' weight (default false).
    pub tie_word_embeddings: bool,
    /// Coefficient of HF's load-balancing loss (default 0.001).
    pub router_aux_loss_coef: f64,
    /// Return router logits (and add the aux loss to HF's loss) (default false).
    pub output_router_logits: bool,
    /// Checkpoint dtype string (`dtype` | `torch_dtype`), e.g. `"bfloat16"`.
    pub dtype: Option<String>,
    /// Keys this parser does not interpret, kept verbatim for export.
    pub extra: Map<String, Value>,
}

impl Default for MixtralConfig {
    fn default() -> Self {
        Self {
            vocab_size: hf_default::vocab_size(),
            hidden_size: hf_default::hidden_size(),
            intermediate_size: hf_default::intermediate_size(),
            num_hidden_layers: hf_default::num_hidden_layers(),
            num_attention_heads: hf_default::num_attention_heads(),
            num_key_value_heads: (hf_default::num_key_value_heads())
                .unwrap_or_else(hf_default::num_attention_heads),
            head_dim: hf_default::hidden_size() / hf_default::num_attention_heads(),
            num_local_experts: hf_default::num_local_experts(),
            num_experts_per_tok: hf_default::num_experts_per_tok(),
            rms_norm_eps: hf_default::rms_norm_eps(),
            rope_parameters: RopeParameters {
                rope_theta: hf_default::rope_theta(),
                ..RopeParameters::default()
            },
            max_position_embeddings: hf_default::max_position_embeddings(),
            tie_word_embeddings: false,
            router_aux_loss_coef: hf_default::router_aux_loss_coef(),
            output_router_logits: false,
            dtype: None,
            extra: Map::new(),
        }
    }
}

impl MixtralConfig {
    /// The `model_type` this config parses.
    pub const MODEL_TYPE: &'static str = "mixtral";

    /// Reads and parses a `config.json` file; errors carry the path.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        check::read_config_file(path.as_ref(), Self::from_json_str)
    }

    /// Parses the text of a `config.json` and validates it.
    pub fn from_json_str(text: &str) -> Result<Self, ModelError> {
        de::parse::<MixtralJson>(text, Self::MODEL_TYPE)?.try_into()
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
        if !(2..=self.num_local_experts).contains(&k) {
            return Err(ModelError::invalid(
                "num_experts_per_tok",
                format!(
                    "must be in 2..={} (num_local_experts), got {k}: the top-k weights are \
                     renormalised, which a single expert would turn into a constant 1",
                    self.num_local_experts
                ),
            ));
        }
        check::positive_number("rms_norm_eps", self.rms_norm_eps)?;
        check::non_negative_number("router_aux_loss_coef", self.router_aux_loss_coef)?;
        Ok(())
    }
}

impl TryFrom<MixtralJson> for MixtralConfig {
    type Error = ModelError;

    /// Merges spellings, normalises RoPE, resolves `null`s, refuses what the model does not
    /// implement, then [`MixtralConfig::validate`]s.
    fn try_from(mut j: MixtralJson) -> Result<Self, ModelError> {
        de::check_model_type(j.model_type.as_deref(), Self::MODEL_TYPE)?;
        de::check_silu(j.hidden_act.as_deref())?;
        match &j.sliding_window {
            None | Some(Value::Null) => {}
            Some(w) => {
                return Err(ModelError::invalid(
                    "sliding_window",
                    format!(
                        "{} is not supported for mixtral (only null: full causal attention)",
                        de::describe(w)
                    ),
                ));
            }
        }
        check::zero_in_training("router_jitter_noise", j.router_jitter_noise)?;
        check::zero_in_training("attention_dropout", j.attention_dropout)?;
        let num_key_value_heads = j.num_key_value_heads.unwrap_or(j.num_attention_heads);
        let head_dim = match j.head_dim {
            Some(hd) => hd,
            None => check::derived_head_dim(j.hidden_size, j.num_attention_heads)?,
        };
        let rope = RopeKeys {
            // `default_theta` when neither spelling gives one.
            rope_theta: Some(j.rope_theta.unwrap_or_else(hf_default::rope_theta)),
            rope_parameters: j.rope_parameters,
            rope_scaling: j.rope_scaling,
        };
        let rope_parameters = rope::resolve(rope, &mut j.extra, j.max_position_embeddings)?;
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
            num_local_experts: experts.unwrap_or_else(hf_default::num_local_experts),
            num_experts_per_tok: j.num_experts_per_tok,
            rms_norm_eps: j.rms_norm_eps,
            rope_parameters,
            max_position_embeddings: j.max_position_embeddings,
            tie_word_embeddings: j.tie_word_embeddings,
            router_aux_loss_coef: j.router_aux_loss_coef,
            output_router_logits: j.output_router_logits,
            dtype: de::either(("dtype", j.dtype), ("torch_dtype", j.torch_dtype))?,
            extra: j.extra,
        };
        config.validate()?;
        Ok(config)
    }
}

impl From<MixtralConfig> for MixtralJson {
    /// The 5.23 spelling (`num_local_experts`, `dtype`, `rope_parameters`), every interpreted
    /// field explicit.
    fn from(c: MixtralConfig) -> Self {
        Self {
            model_type: Some(MixtralConfig::MODEL_TYPE.to_owned()),
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
            sliding_window: Some(Value::Null),
            router_jitter_noise: 0.0,
            attention_dropout: 0.0,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: None,
            rope_parameters: Some((&c.rope_parameters).into()),
            rope_scaling: None,
            max_position_embeddings: c.max_position_embeddings,
            tie_word_embeddings: c.tie_word_embeddings,
            router_aux_loss_coef: c.router_aux_loss_coef,
            output_router_logits: c.output_router_logits,
            dtype: c.dtype,
            torch_dtype: None,
            extra: c.extra,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `config.json` of `model_type` "mixtral" with the given extra fields (`"…": …, …`).
    fn parse(fields: &str) -> Result<MixtralConfig, ModelError> {
        let sep = if fields.is_empty() { "" } else { ", " };
        MixtralConfig::from_json_str(&format!(r#"{{"model_type": "mixtral"{sep}{fields}}}"#))
    }

    #[test]
    fn class_defaults_fill_absent_keys_and_unknown_keys_are_kept() {
        let c = MixtralConfig::from_json_str(r#"{"model_type": "mixtral", "bos_token_id": 1}"#)
            .unwrap();
        assert_eq!(c.vocab_size, 32000);
        assert_eq!(c.intermediate_size, 14336);
        assert_eq!((c.num_attention_heads, c.num_key_value_heads), (32, 8));
        assert_eq!(c.head_dim, 128);
        assert_eq!((c.num_local_experts, c.num_experts_per_tok), (8, 2));
        assert_eq!(c.max_position_embeddings, 131072);
        assert_eq!(c.rope_parameters.rope_theta, 1e6);
        assert_eq!(c.router_aux_loss_coef, 0.001);
        assert_eq!(c.extra["bos_token_id"], 1);
        assert_eq!(c, MixtralConfig::default().with_extra("bos_token_id", 1));
    }

    impl MixtralConfig {
        fn with_extra(mut self, key: &str, value: i64) -> Self {
            self.extra.insert(key.to_owned(), value.into());
            self
        }
    }

    #[test]
    fn nulls_and_the_second_spelling_resolve_as_in_hf() {
        let c = parse(
            r#""num_key_value_heads": null, "head_dim": null, "num_experts": 4,
                "num_attention_heads": 8, "hidden_size": 64, "rope_theta": 5e5,
                "sliding_window": null"#,
        )
        .unwrap();
        assert_eq!(c.num_key_value_heads, 8);
        assert_eq!(c.head_dim, 8);
        assert_eq!(c.num_local_experts, 4);
        assert_eq!(c.rope_parameters.rope_theta, 5e5);
    }

    #[test]
    fn round_trips_through_json() {
        let c = parse(r#""num_local_experts": 4, "pad_token_id": 0"#).unwrap();
        let text = serde_json::to_string(&c).unwrap();
        assert_eq!(MixtralConfig::from_json_str(&text).unwrap(), c);
    }

    #[test]
    fn unsupported_or_inconsistent_fields_are_named() {
        for (json, field) in [
            (r#""sliding_window": 4096"#, "sliding_window"),
            (r#""router_jitter_noise": 0.01"#, "router_jitter_noise"),
            (r#""attention_dropout": 0.1"#, "attention_dropout"),
            (r#""hidden_act": "gelu""#, "hidden_act"),
            (r#""num_experts_per_tok": 1"#, "num_experts_per_tok"),
            (r#""num_experts_per_tok": 9"#, "num_experts_per_tok"),
            (r#""num_key_value_heads": 5"#, "num_key_value_heads"),
            (r#""num_local_experts": 8, "num_experts": 4"#, "num_experts"),
            (r#""intermediate_size": "wide""#, "intermediate_size"),
        ] {
            let err = parse(json).unwrap_err().to_string();
            assert!(err.contains(field), "{json}: {err}");
        }
        let err = MixtralConfig::from_json_str(r#"{"model_type": "qwen3_moe"}"#).unwrap_err();
        assert!(err.to_string().contains("model_type"), "{err}");
    }
}
