//! DeepSeek-V3 configuration (`model_type = "deepseek_v3"`), HF `DeepseekV3Config`
//! (models.md §2, §3.1).

use std::path::Path;

use serde_json::{Map, Value};

use super::json::JsonObject;
use super::{RopeParameters, RopeScaling, rope};
use crate::ModelError;

/// DeepSeek-V3 configuration with HF `DeepseekV3Config` defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepseekV3Config {
    /// Vocabulary size `V` (default 129280).
    pub vocab_size: usize,
    /// Hidden size `H` (default 7168).
    pub hidden_size: usize,
    /// Width of the dense MLP of the first `first_k_dense_replace` layers (default 18432).
    pub intermediate_size: usize,
    /// Width `Im` of each routed expert (default 2048).
    pub moe_intermediate_size: usize,
    /// Number of decoder layers `N` (default 61).
    pub num_hidden_layers: usize,
    /// Attention heads `nh` (default 128).
    pub num_attention_heads: usize,
    /// Key/value heads (default 128; unused by MLA, kept for export).
    pub num_key_value_heads: usize,
    /// Shared experts (default 1; their MLP width is `Im · n_shared_experts`).
    pub n_shared_experts: usize,
    /// Routed experts `E` (`n_routed_experts` | `num_local_experts`; default 256).
    pub n_routed_experts: usize,
    /// Experts per token `k` (default 8).
    pub num_experts_per_tok: usize,
    /// Expert groups (default 8).
    pub n_group: usize,
    /// Groups kept per token (default 4).
    pub topk_group: usize,
    /// Multiplies the routing weights (default 2.5).
    pub routed_scaling_factor: f64,
    /// Renormalise the selected sigmoid scores (default true).
    pub norm_topk_prob: bool,
    /// Rank of the query compression; `None` ⇒ a plain `q_proj` (default 1536).
    pub q_lora_rank: Option<usize>,
    /// Rank of the key/value compression (default 512).
    pub kv_lora_rank: usize,
    /// Per-head query/key dims without RoPE (default 128).
    pub qk_nope_head_dim: usize,
    /// Per-head query/key dims with RoPE, shared key (default 64).
    pub qk_rope_head_dim: usize,
    /// Per-head value dims (default 128).
    pub v_head_dim: usize,
    /// Layers `0..first_k_dense_replace` use a dense MLP (default 3).
    pub first_k_dense_replace: usize,
    /// Maximum sequence length (default 4096).
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon (default 1e-6; the MLA latent norms always use 1e-6).
    pub rms_norm_eps: f64,
    /// RoPE settings (YaRN in the official config).
    pub rope_parameters: RopeParameters,
    /// RoPE dims are stored as interleaved pairs (default true).
    pub rope_interleave: bool,
    /// Biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` (default false).
    pub attention_bias: bool,
    /// `lm_head` shares `embed_tokens`' weight (default false).
    pub tie_word_embeddings: bool,
    /// MTP depth `D` (`num_nextn_predict_layers` | `num_mtp_layers`; default 0 here).
    pub num_nextn_predict_layers: usize,
    /// Checkpoint dtype string (`dtype` | `torch_dtype`).
    pub dtype: Option<String>,
    /// Keys this parser does not interpret (e.g. `quantization_config`, `scoring_func`),
    /// kept verbatim for export.
    pub extra: Map<String, Value>,
}

impl Default for DeepseekV3Config {
    fn default() -> Self {
        Self {
            vocab_size: 129280,
            hidden_size: 7168,
            intermediate_size: 18432,
            moe_intermediate_size: 2048,
            num_hidden_layers: 61,
            num_attention_heads: 128,
            num_key_value_heads: 128,
            n_shared_experts: 1,
            n_routed_experts: 256,
            num_experts_per_tok: 8,
            n_group: 8,
            topk_group: 4,
            routed_scaling_factor: 2.5,
            norm_topk_prob: true,
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            first_k_dense_replace: 3,
            max_position_embeddings: 4096,
            rms_norm_eps: 1e-6,
            rope_parameters: RopeParameters::default(),
            rope_interleave: true,
            attention_bias: false,
            tie_word_embeddings: false,
            num_nextn_predict_layers: 0,
            dtype: None,
            extra: Map::new(),
        }
    }
}

impl DeepseekV3Config {
    /// The `model_type` this config parses.
    pub const MODEL_TYPE: &'static str = "deepseek_v3";

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
        let d = Self::default();
        let num_attention_heads = cfg.usize_or("num_attention_heads", d.num_attention_heads)?;
        let num_key_value_heads = if cfg.is_null("num_key_value_heads") {
            cfg.take("num_key_value_heads");
            num_attention_heads
        } else {
            cfg.usize_or("num_key_value_heads", d.num_key_value_heads)?
        };
        let q_lora_rank = if cfg.contains("q_lora_rank") {
            cfg.nullable_usize("q_lora_rank")?
        } else {
            d.q_lora_rank
        };
        // Derived values 5.23 writes; recomputed from the head dims.
        cfg.take("head_dim");
        cfg.take("qk_head_dim");
        let max_position_embeddings =
            cfg.usize_or("max_position_embeddings", d.max_position_embeddings)?;
        let rope_parameters = rope::parse_rope(&mut cfg, max_position_embeddings)?;
        let config = Self {
            vocab_size: cfg.usize_or("vocab_size", d.vocab_size)?,
            hidden_size: cfg.usize_or("hidden_size", d.hidden_size)?,
            intermediate_size: cfg.usize_or("intermediate_size", d.intermediate_size)?,
            moe_intermediate_size: cfg
                .usize_or("moe_intermediate_size", d.moe_intermediate_size)?,
            num_hidden_layers: cfg.usize_or("num_hidden_layers", d.num_hidden_layers)?,
            num_attention_heads,
            num_key_value_heads,
            n_shared_experts: cfg.usize_or("n_shared_experts", d.n_shared_experts)?,
            n_routed_experts: cfg
                .either_usize("n_routed_experts", "num_local_experts")?
                .unwrap_or(d.n_routed_experts),
            num_experts_per_tok: cfg.usize_or("num_experts_per_tok", d.num_experts_per_tok)?,
            n_group: cfg.usize_or("n_group", d.n_group)?,
            topk_group: cfg.usize_or("topk_group", d.topk_group)?,
            routed_scaling_factor: cfg.f64_or("routed_scaling_factor", d.routed_scaling_factor)?,
            norm_topk_prob: cfg.bool_or("norm_topk_prob", d.norm_topk_prob)?,
            q_lora_rank,
            kv_lora_rank: cfg.usize_or("kv_lora_rank", d.kv_lora_rank)?,
            qk_nope_head_dim: cfg.usize_or("qk_nope_head_dim", d.qk_nope_head_dim)?,
            qk_rope_head_dim: cfg.usize_or("qk_rope_head_dim", d.qk_rope_head_dim)?,
            v_head_dim: cfg.usize_or("v_head_dim", d.v_head_dim)?,
            first_k_dense_replace: cfg
                .usize_or("first_k_dense_replace", d.first_k_dense_replace)?,
            max_position_embeddings,
            rms_norm_eps: cfg.f64_or("rms_norm_eps", d.rms_norm_eps)?,
            rope_parameters,
            rope_interleave: cfg.bool_or("rope_interleave", d.rope_interleave)?,
            attention_bias: cfg.bool_or("attention_bias", d.attention_bias)?,
            tie_word_embeddings: cfg.bool_or("tie_word_embeddings", d.tie_word_embeddings)?,
            num_nextn_predict_layers: cfg
                .either_usize("num_nextn_predict_layers", "num_mtp_layers")?
                .unwrap_or(d.num_nextn_predict_layers),
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
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if value == 0 {
                return Err(ModelError::invalid(field, "must be positive, got 0"));
            }
        }
        if self.q_lora_rank == Some(0) {
            return Err(ModelError::invalid(
                "q_lora_rank",
                "must be positive or null",
            ));
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(ModelError::invalid("qk_rope_head_dim", "must be even"));
        }
        let e = self.n_routed_experts;
        if !e.is_multiple_of(self.n_group) {
            return Err(ModelError::invalid(
                "n_group",
                format!("{} does not divide n_routed_experts = {e}", self.n_group),
            ));
        }
        let per_group = e / self.n_group;
        if self.topk_group > self.n_group || per_group < 2 {
            return Err(ModelError::invalid(
                "topk_group",
                format!(
                    "needs topk_group ≤ n_group = {} and ≥ 2 experts per group (group score \
                     sums the top 2), got topk_group {} with {per_group} per group",
                    self.n_group, self.topk_group
                ),
            ));
        }
        if self.num_experts_per_tok > self.topk_group * per_group {
            return Err(ModelError::invalid(
                "num_experts_per_tok",
                format!(
                    "{} exceeds the {} experts of the kept groups",
                    self.num_experts_per_tok,
                    self.topk_group * per_group
                ),
            ));
        }
        if !(self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0) {
            return Err(ModelError::invalid(
                "routed_scaling_factor",
                format!(
                    "must be a positive number, got {}",
                    self.routed_scaling_factor
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

    /// `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Whether decoder layer `layer` uses the MoE block (`layer ≥ first_k_dense_replace`).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace
    }

    /// Non-fatal findings (models.md §2): settings HF 5.23 ignores (`scoring_func`,
    /// `topk_method`, `moe_layer_freq`) and a YaRN `factor` that differs from
    /// `max_position_embeddings / original_max_position_embeddings`.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let expect = [
            ("scoring_func", Value::from("sigmoid")),
            ("topk_method", Value::from("noaux_tc")),
            ("moe_layer_freq", Value::from(1)),
        ];
        for (key, want) in expect {
            if let Some(v) = self.extra.get(key)
                && v != &want
            {
                out.push(format!(
                    "`{key}` is {v}; transformers 5.23 (and this model) use {want}"
                ));
            }
        }
        if let RopeScaling::Yarn(y) = &self.rope_parameters.scaling {
            let ratio =
                self.max_position_embeddings as f64 / y.original_max_position_embeddings as f64;
            if (ratio - y.factor).abs() > 1e-9 * ratio {
                out.push(format!(
                    "YaRN factor {} differs from max_position_embeddings / \
                     original_max_position_embeddings = {ratio}",
                    y.factor
                ));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn official_spellings_defaults_and_warnings() {
        let c = DeepseekV3Config::from_json_str(
            r#"{"model_type": "deepseek_v3", "num_local_experts": 256, "q_lora_rank": null,
                "num_mtp_layers": 1, "scoring_func": "softmax", "moe_layer_freq": 1,
                "max_position_embeddings": 163840, "rope_theta": 10000,
                "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                "quantization_config": {"quant_method": "fp8"}}"#,
        )
        .unwrap();
        assert_eq!(c.n_routed_experts, 256);
        assert_eq!(c.q_lora_rank, None);
        assert_eq!(c.num_nextn_predict_layers, 1);
        assert_eq!(c.qk_head_dim(), 192);
        assert!(c.extra.contains_key("quantization_config"));
        let w = c.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("scoring_func"));
        let d = DeepseekV3Config::from_json_str(r#"{"model_type": "deepseek_v3"}"#).unwrap();
        assert_eq!(d.q_lora_rank, Some(1536));
        assert_eq!(d.num_nextn_predict_layers, 0);
        let err = DeepseekV3Config::from_json_str(r#"{"model_type": "deepseek_v3", "n_group": 3}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("n_group"), "{err}");
    }
}
