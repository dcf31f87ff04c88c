//! The Qwen3-MoE `config.json` (HF `Qwen3MoeConfig`, transformers 5.23
//! `configuration_qwen3_moe.py`; docs/models.md §Config parsing, §Qwen3-MoE config).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ModelError;
use crate::config::RopeParameters;
use crate::config::rope::{self, RopeJson, RopeKeys};
use crate::config::{check, de};

/// HF `Qwen3MoeConfig` class defaults (transformers 5.23 `configuration_qwen3_moe.py`).
mod hf_default {
    crate::config::de::hf_defaults! {
        vocab_size: usize = 151936;
        hidden_size: usize = 2048;
        intermediate_size: usize = 6144;
        moe_intermediate_size: usize = 768;
        num_hidden_layers: usize = 24;
        num_attention_heads: usize = 32;
        num_key_value_heads: Option<usize> = Some(4);
        num_experts: usize = 128;
        num_experts_per_tok: usize = 8;
        decoder_sparse_step: usize = 1;
        rms_norm_eps: f64 = 1e-6;
        max_position_embeddings: usize = 32768;
        router_aux_loss_coef: f64 = 0.001;
    }
}

/// A Qwen3-MoE `config.json` field by field, as HF `Qwen3MoeConfig` reads and writes it, with
/// the class defaults for absent keys. [`Qwen3MoeConfig`] is this with spellings merged, RoPE
/// normalised and `null`s resolved.
#[derive(Debug, Clone, Deserialize, Serialize)]
struct Qwen3MoeJson {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model_type: Option<String>,
    #[serde(default = "hf_default::vocab_size")]
    vocab_size: usize,
    #[serde(default = "hf_default::hidden_size")]
    hidden_size: usize,
    #[serde(default = "hf_default::intermediate_size")]
    intermediate_size: usize,
    #[serde(default = "hf_default::moe_intermediate_size")]
    moe_intermediate_size: usize,
    #[serde(default = "hf_default::num_hidden_layers")]
    num_hidden_layers: usize,
    #[serde(default = "hf_default::num_attention_heads")]
    num_attention_heads: usize,
    /// `null` is rejected (HF's class declares a plain `int`).
    #[serde(default = "hf_default::num_key_value_heads")]
    num_key_value_heads: Option<usize>,
    /// Not a `Qwen3MoeConfig` field: absent or `null` ⇒ `hidden_size / num_attention_heads`
    /// (the attention's `getattr` fallback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    head_dim: Option<usize>,
    /// Default 128, applied after merging with `num_local_experts`.
    #[serde(
        default,
        deserialize_with = "de::present",
        skip_serializing_if = "Option::is_none"
    )]
    num_experts: Option<usize>,
    /// 5.23 spelling of `num_experts` (its `attribute_map`).
    #[serde(
        default,
        deserialize_with = "de::present",
        skip_serializing_if = "Option::is_none"
    )]
    num_local_experts: Option<usize>,
    #[serde(default = "hf_default::num_experts_per_tok")]
    num_experts_per_tok: usize,
    #[serde(default, deserialize_with = "de::null_as_default")]
    norm_topk_prob: bool,
    #[serde(default = "hf_default::decoder_sparse_step")]
    decoder_sparse_step: usize,
    /// `null` ⇒ `[]` (HF `__post_init__`).
    #[serde(default, deserialize_with = "de::null_as_default")]
    mlp_only_layers: Vec<usize>,
    /// Only `"silu"` is supported (`null` ⇒ HF's default, `"silu"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hidden_act: Option<String>,
    /// Must be false (`null` ⇒ false).
    #[serde(default, deserialize_with = "de::null_as_default")]
    use_sliding_window: bool,
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

/// Qwen3-MoE configuration (`model_type = "qwen3_moe"`), HF `Qwen3MoeConfig` defaults.
///
/// (De)serializes as HF's `config.json` (written in the transformers 5.23 spelling, `extra`
/// keys included); deserializing validates like [`Qwen3MoeConfig::from_json_str`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "Qwen3MoeJson", try_from = "Qwen3MoeJson")]
pub struct Qwen3MoeConfig {
    /// Vocabulary size `V` (default 151936).
    pub vocab_size: usize,
    /// Hidden size `H` (default 2048).
    pub hidden_size: usize,
    /// Width of the dense SwiGLU MLP used by non-MoE layers (default 6144).
    pub intermediate_size: usize,
    /// Width `Im` of each routed expert (default 768).
    pub moe_intermediate_size: usize,
    /// Number of decoder layers (default 24).
    pub num_hidden_layers: usize,
    /// Query heads `nh` (default 32).
    pub num_attention_heads: usize,
    /// Key/value heads `nkv` (default 4; `null` is rejected as in HF's strict config).
    pub num_key_value_heads: usize,
    /// Per-head size `hd`: `head_dim` if present and non-null, else `hidden_size / heads`.
    pub head_dim: usize,
    /// Routed experts `E` (`num_experts` | `num_local_experts`; default 128; 0 = dense model).
    pub num_experts: usize,
    /// Experts per token `k` (default 8).
    pub num_experts_per_tok: usize,
    /// Renormalise the top-k routing weights to sum to one (default false).
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is MoE (default 1).
    pub decoder_sparse_step: usize,
    /// Layers forced to a dense MLP (default `[]`; `null` ⇒ `[]`).
    pub mlp_only_layers: Vec<usize>,
    /// RMSNorm epsilon (default 1e-6).
    pub rms_norm_eps: f64,
    /// RoPE settings, from `rope_parameters` or legacy `rope_theta` + `rope_scaling`.
    pub rope_parameters: RopeParameters,
    /// Maximum sequence length (default 32768).
    pub max_position_embeddings: usize,
    /// `lm_head` shares `embed_tokens`' weight (default false).
    pub tie_word_embeddings: bool,
    /// Coefficient of HF's load-balancing loss (default 0.001).
    pub router_aux_loss_coef: f64,
    /// Return router logits (and add the aux loss to the loss) (default false).
    pub output_router_logits: bool,
    /// Biases on q/k/v/o projections (default false).
    pub attention_bias: bool,
    /// Checkpoint dtype string (`dtype` | `torch_dtype`), e.g. `"bfloat16"`.
    pub dtype: Option<String>,
    /// Keys this parser does not interpret, kept verbatim for export.
    pub extra: Map<String, Value>,
}

impl Default for Qwen3MoeConfig {
    fn default() -> Self {
        Self {
            vocab_size: hf_default::vocab_size(),
            hidden_size: hf_default::hidden_size(),
            intermediate_size: hf_default::intermediate_size(),
            moe_intermediate_size: hf_default::moe_intermediate_size(),
            num_hidden_layers: hf_default::num_hidden_layers(),
            num_attention_heads: hf_default::num_attention_heads(),
            num_key_value_heads: hf_default::num_key_value_heads().unwrap_or_default(), // Some(4)
            head_dim: hf_default::hidden_size() / hf_default::num_attention_heads(),
            num_experts: hf_default::num_experts(),
            num_experts_per_tok: hf_default::num_experts_per_tok(),
            norm_topk_prob: false,
            decoder_sparse_step: hf_default::decoder_sparse_step(),
            mlp_only_layers: Vec::new(),
            rms_norm_eps: hf_default::rms_norm_eps(),
            rope_parameters: RopeParameters::default(),
            max_position_embeddings: hf_default::max_position_embeddings(),
            tie_word_embeddings: false,
            router_aux_loss_coef: hf_default::router_aux_loss_coef(),
            output_router_logits: false,
            attention_bias: false,
            dtype: None,
            extra: Map::new(),
        }
    }
}

impl Qwen3MoeConfig {
    /// The `model_type` this config parses.
    pub const MODEL_TYPE: &'static str = "qwen3_moe";

    /// Reads and parses a `config.json` file; errors carry the path.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        check::read_config_file(path.as_ref(), Self::from_json_str)
    }

    /// Parses the text of a `config.json` and validates it.
    pub fn from_json_str(text: &str) -> Result<Self, ModelError> {
        de::parse::<Qwen3MoeJson>(text, Self::MODEL_TYPE)?.try_into()
    }

    /// Checks sizes and cross-field rules; errors name the offending field.
    ///
    /// `mlp_only_layers` entries beyond `num_hidden_layers` are allowed (HF ignores them).
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("decoder_sparse_step", self.decoder_sparse_step),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        check::positive(&positive)?;
        check::kv_heads_divide(self.num_attention_heads, self.num_key_value_heads)?;
        if self.num_experts > 0 {
            if self.moe_intermediate_size == 0 {
                return Err(ModelError::invalid(
                    "moe_intermediate_size",
                    "must be positive when num_experts > 0",
                ));
            }
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
                return Err(ModelError::invalid(
                    "num_experts_per_tok",
                    format!(
                        "must be in 1..={} (num_experts), got {}",
                        self.num_experts, self.num_experts_per_tok
                    ),
                ));
            }
        }
        check::positive_number("rms_norm_eps", self.rms_norm_eps)?;
        check::non_negative_number("router_aux_loss_coef", self.router_aux_loss_coef)?;
        Ok(())
    }

    /// Whether decoder layer `layer` (0-based) uses the MoE block rather than the dense MLP:
    /// `layer ∉ mlp_only_layers ∧ num_experts > 0 ∧ (layer + 1) % decoder_sparse_step == 0`
    /// (docs/models.md §Qwen3-MoE config). A zero `decoder_sparse_step` makes every layer dense.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// Number of MoE layers among the `num_hidden_layers` decoder layers.
    pub fn num_moe_layers(&self) -> usize {
        (0..self.num_hidden_layers)
            .filter(|&l| self.is_moe_layer(l))
            .count()
    }
}

impl TryFrom<Qwen3MoeJson> for Qwen3MoeConfig {
    type Error = ModelError;

    /// Merges spellings, normalises RoPE, resolves `null`s, then [`Qwen3MoeConfig::validate`]s.
    fn try_from(mut j: Qwen3MoeJson) -> Result<Self, ModelError> {
        de::check_model_type(j.model_type.as_deref(), Self::MODEL_TYPE)?;
        de::check_silu(j.hidden_act.as_deref())?;
        if j.use_sliding_window {
            return Err(ModelError::invalid(
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }
        let Some(num_key_value_heads) = j.num_key_value_heads else {
            return Err(ModelError::MissingField {
                field: "num_key_value_heads",
                detail: ": null is not accepted for qwen3_moe".to_owned(),
            });
        };
        let head_dim = match j.head_dim {
            Some(hd) => hd,
            None => check::derived_head_dim(j.hidden_size, j.num_attention_heads)?,
        };
        let rope = RopeKeys {
            rope_theta: j.rope_theta,
            rope_parameters: j.rope_parameters,
            rope_scaling: j.rope_scaling,
        };
        let rope_parameters = rope::resolve(rope, &mut j.extra, j.max_position_embeddings)?;
        let num_experts = de::either(
            ("num_experts", j.num_experts),
            ("num_local_experts", j.num_local_experts),
        )?;
        let config = Self {
            vocab_size: j.vocab_size,
            hidden_size: j.hidden_size,
            intermediate_size: j.intermediate_size,
            moe_intermediate_size: j.moe_intermediate_size,
            num_hidden_layers: j.num_hidden_layers,
            num_attention_heads: j.num_attention_heads,
            num_key_value_heads,
            head_dim,
            num_experts: num_experts.unwrap_or_else(hf_default::num_experts),
            num_experts_per_tok: j.num_experts_per_tok,
            norm_topk_prob: j.norm_topk_prob,
            decoder_sparse_step: j.decoder_sparse_step,
            mlp_only_layers: j.mlp_only_layers,
            rms_norm_eps: j.rms_norm_eps,
            rope_parameters,
            max_position_embeddings: j.max_position_embeddings,
            tie_word_embeddings: j.tie_word_embeddings,
            router_aux_loss_coef: j.router_aux_loss_coef,
            output_router_logits: j.output_router_logits,
            attention_bias: j.attention_bias,
            dtype: de::either(("dtype", j.dtype), ("torch_dtype", j.torch_dtype))?,
            extra: j.extra,
        };
        config.validate()?;
        Ok(config)
    }
}

impl From<Qwen3MoeConfig> for Qwen3MoeJson {
    /// The 5.23 spelling (`dtype`, `rope_parameters`) but `num_experts`, which every
    /// transformers version reads; every interpreted field explicit.
    fn from(c: Qwen3MoeConfig) -> Self {
        Self {
            model_type: Some(Qwen3MoeConfig::MODEL_TYPE.to_owned()),
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            moe_intermediate_size: c.moe_intermediate_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: Some(c.num_key_value_heads),
            head_dim: Some(c.head_dim),
            num_experts: Some(c.num_experts),
            num_local_experts: None,
            num_experts_per_tok: c.num_experts_per_tok,
            norm_topk_prob: c.norm_topk_prob,
            decoder_sparse_step: c.decoder_sparse_step,
            mlp_only_layers: c.mlp_only_layers,
            hidden_act: Some("silu".to_owned()),
            use_sliding_window: false,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: None,
            rope_parameters: Some((&c.rope_parameters).into()),
            rope_scaling: None,
            max_position_embeddings: c.max_position_embeddings,
            tie_word_embeddings: c.tie_word_embeddings,
            router_aux_loss_coef: c.router_aux_loss_coef,
            output_router_logits: c.output_router_logits,
            attention_bias: c.attention_bias,
            dtype: c.dtype,
            torch_dtype: None,
            extra: c.extra,
        }
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
