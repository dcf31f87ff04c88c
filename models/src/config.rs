//! HF `config.json` parsing and validation (models.md §2, §5.1).
//!
//! Each config struct mirrors its HF twin field by field, with HF's class defaults for absent
//! keys, both accepted spellings of renamed keys, and the keys we do not interpret kept verbatim
//! in `extra` so that an export can write them back.

mod deepseek_v3;
mod json;
mod qwen3;
mod rope;

use std::path::Path;

use serde_json::{Map, Value};

pub use self::deepseek_v3::DeepseekV3Config;
use self::json::JsonObject;
pub use self::qwen3::Qwen3Config;
pub use self::rope::{DEFAULT_ROPE_THETA, RopeParameters, RopeScaling, YarnParameters};
use crate::ModelError;

/// Qwen3-MoE configuration (`model_type = "qwen3_moe"`), HF `Qwen3MoeConfig` defaults.
#[derive(Debug, Clone, PartialEq)]
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
            vocab_size: 151936,
            hidden_size: 2048,
            intermediate_size: 6144,
            moe_intermediate_size: 768,
            num_hidden_layers: 24,
            num_attention_heads: 32,
            num_key_value_heads: 4,
            head_dim: 2048 / 32,
            num_experts: 128,
            num_experts_per_tok: 8,
            norm_topk_prob: false,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
            rms_norm_eps: 1e-6,
            rope_parameters: RopeParameters::default(),
            max_position_embeddings: 32768,
            tie_word_embeddings: false,
            router_aux_loss_coef: 0.001,
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
        let hidden_act = cfg.string("hidden_act")?;
        if let Some(act) = hidden_act.filter(|a| a != "silu") {
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
        let hidden_size = cfg.usize_or("hidden_size", d.hidden_size)?;
        let num_attention_heads = cfg.usize_or("num_attention_heads", d.num_attention_heads)?;
        if cfg.is_null("num_key_value_heads") {
            return Err(ModelError::MissingField {
                field: "num_key_value_heads",
                detail: ": null is not accepted for qwen3_moe".to_owned(),
            });
        }
        let num_key_value_heads = cfg.usize_or("num_key_value_heads", d.num_key_value_heads)?;
        let head_dim = match cfg.nullable_usize("head_dim")? {
            Some(hd) => hd,
            None => derived_head_dim(hidden_size, num_attention_heads)?,
        };
        let max_position_embeddings =
            cfg.usize_or("max_position_embeddings", d.max_position_embeddings)?;
        let rope_parameters = rope::parse_rope(&mut cfg, max_position_embeddings)?;

        let config = Self {
            vocab_size: cfg.usize_or("vocab_size", d.vocab_size)?,
            hidden_size,
            intermediate_size: cfg.usize_or("intermediate_size", d.intermediate_size)?,
            moe_intermediate_size: cfg
                .usize_or("moe_intermediate_size", d.moe_intermediate_size)?,
            num_hidden_layers: cfg.usize_or("num_hidden_layers", d.num_hidden_layers)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            num_experts: cfg
                .either_usize("num_experts", "num_local_experts")?
                .unwrap_or(d.num_experts),
            num_experts_per_tok: cfg.usize_or("num_experts_per_tok", d.num_experts_per_tok)?,
            norm_topk_prob: cfg.bool_or("norm_topk_prob", d.norm_topk_prob)?,
            decoder_sparse_step: cfg.usize_or("decoder_sparse_step", d.decoder_sparse_step)?,
            mlp_only_layers: cfg.usize_list("mlp_only_layers")?,
            rms_norm_eps: cfg.f64_or("rms_norm_eps", d.rms_norm_eps)?,
            rope_parameters,
            max_position_embeddings,
            tie_word_embeddings: cfg.bool_or("tie_word_embeddings", d.tie_word_embeddings)?,
            router_aux_loss_coef: cfg.f64_or("router_aux_loss_coef", d.router_aux_loss_coef)?,
            output_router_logits: cfg.bool_or("output_router_logits", d.output_router_logits)?,
            attention_bias: cfg.bool_or("attention_bias", d.attention_bias)?,
            dtype: cfg.either_string("dtype", "torch_dtype")?,
            extra: cfg.into_remaining(),
        };
        config.validate()?;
        Ok(config)
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
        for (field, value) in positive {
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
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(ModelError::invalid(
                "rms_norm_eps",
                format!("must be a positive number, got {}", self.rms_norm_eps),
            ));
        }
        if !(self.router_aux_loss_coef.is_finite() && self.router_aux_loss_coef >= 0.0) {
            return Err(ModelError::invalid(
                "router_aux_loss_coef",
                format!(
                    "must be a non-negative number, got {}",
                    self.router_aux_loss_coef
                ),
            ));
        }
        Ok(())
    }

    /// Whether decoder layer `layer` (0-based) uses the MoE block rather than the dense MLP:
    /// `layer ∉ mlp_only_layers ∧ num_experts > 0 ∧ (layer + 1) % decoder_sparse_step == 0`
    /// (models.md §5.1). A zero `decoder_sparse_step` makes every layer dense.
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

/// `hidden_size / num_attention_heads`, which must divide exactly.
fn derived_head_dim(hidden_size: usize, heads: usize) -> Result<usize, ModelError> {
    if heads == 0 {
        return Err(ModelError::invalid(
            "num_attention_heads",
            "must be positive, got 0",
        ));
    }
    if !hidden_size.is_multiple_of(heads) {
        return Err(ModelError::invalid(
            "hidden_size",
            format!(
                "{hidden_size} is not divisible by num_attention_heads = {heads} \
                 (and head_dim is absent)"
            ),
        ));
    }
    Ok(hidden_size / heads)
}

#[cfg(test)]
mod tests;
