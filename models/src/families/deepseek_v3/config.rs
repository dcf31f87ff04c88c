//! DeepSeek-V3 configuration (`model_type = "deepseek_v3"`), HF `DeepseekV3Config`
//! (docs/models.md §Config parsing, §DeepSeek-V3 config).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ModelError;
use crate::config::rope::{self, RopeJson, RopeKeys};
use crate::config::{RopeParameters, RopeScaling, check, de};

/// HF `DeepseekV3Config` class defaults (transformers 5.23 `configuration_deepseek_v3.py`).
mod hf_default {
    crate::config::de::hf_defaults! {
        vocab_size: usize = 129280;
        hidden_size: usize = 7168;
        intermediate_size: usize = 18432;
        moe_intermediate_size: usize = 2048;
        num_hidden_layers: usize = 61;
        num_attention_heads: usize = 128;
        num_key_value_heads: Option<usize> = Some(128);
        n_shared_experts: usize = 1;
        n_routed_experts: usize = 256;
        num_experts_per_tok: usize = 8;
        n_group: usize = 8;
        topk_group: usize = 4;
        routed_scaling_factor: f64 = 2.5;
        q_lora_rank: Option<usize> = Some(1536);
        kv_lora_rank: usize = 512;
        qk_nope_head_dim: usize = 128;
        qk_rope_head_dim: usize = 64;
        v_head_dim: usize = 128;
        first_k_dense_replace: usize = 3;
        max_position_embeddings: usize = 4096;
        rms_norm_eps: f64 = 1e-6;
        // Deliberately not HF's: 5.23 defaults `num_mtp_layers` to 1, but a config without the
        // key describes a checkpoint without MTP weights (4.x had no MTP).
        num_nextn_predict_layers: usize = 0;
    }
}

/// A DeepSeek-V3 `config.json` field by field, as HF `DeepseekV3Config` reads and writes it,
/// with the class defaults for absent keys. [`DeepseekV3Config`] is this with spellings
/// merged, RoPE normalised and `null`s resolved. Keys 5.23 no longer reads (`scoring_func`,
/// `topk_method`, `moe_layer_freq`) and `quantization_config` stay in `extra`.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub(crate) struct DeepseekV3Json {
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
    /// `null` ⇒ `num_attention_heads` (HF `__post_init__`).
    #[serde(default = "hf_default::num_key_value_heads")]
    num_key_value_heads: Option<usize>,
    #[serde(default = "hf_default::n_shared_experts")]
    n_shared_experts: usize,
    /// Default 256, applied after merging with `num_local_experts`.
    #[serde(
        default,
        deserialize_with = "de::present",
        skip_serializing_if = "Option::is_none"
    )]
    n_routed_experts: Option<usize>,
    /// Alias of `n_routed_experts` (5.23 `attribute_map`).
    #[serde(
        default,
        deserialize_with = "de::present",
        skip_serializing_if = "Option::is_none"
    )]
    num_local_experts: Option<usize>,
    #[serde(default = "hf_default::num_experts_per_tok")]
    num_experts_per_tok: usize,
    #[serde(default = "hf_default::n_group")]
    n_group: usize,
    #[serde(default = "hf_default::topk_group")]
    topk_group: usize,
    #[serde(default = "hf_default::routed_scaling_factor")]
    routed_scaling_factor: f64,
    #[serde(default = "de::yes", deserialize_with = "de::null_as_true")]
    norm_topk_prob: bool,
    /// `null` ⇒ a plain `q_proj`.
    #[serde(default = "hf_default::q_lora_rank")]
    q_lora_rank: Option<usize>,
    #[serde(default = "hf_default::kv_lora_rank")]
    kv_lora_rank: usize,
    #[serde(default = "hf_default::qk_nope_head_dim")]
    qk_nope_head_dim: usize,
    #[serde(default = "hf_default::qk_rope_head_dim")]
    qk_rope_head_dim: usize,
    #[serde(default = "hf_default::v_head_dim")]
    v_head_dim: usize,
    /// Derived by 5.23 (`qk_rope_head_dim`); ignored when read, written when serialized.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    head_dim: Option<Value>,
    /// Derived by 5.23 (`qk_nope_head_dim + qk_rope_head_dim`); as `head_dim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    qk_head_dim: Option<Value>,
    #[serde(default = "hf_default::first_k_dense_replace")]
    first_k_dense_replace: usize,
    /// Only `"silu"` is supported (`null` ⇒ HF's default, `"silu"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hidden_act: Option<String>,
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
    #[serde(default = "de::yes", deserialize_with = "de::null_as_true")]
    rope_interleave: bool,
    #[serde(default, deserialize_with = "de::null_as_default")]
    attention_bias: bool,
    #[serde(default, deserialize_with = "de::null_as_default")]
    tie_word_embeddings: bool,
    /// Default 0 (see `hf_default`), applied after merging with `num_mtp_layers`.
    #[serde(
        default,
        deserialize_with = "de::present",
        skip_serializing_if = "Option::is_none"
    )]
    num_nextn_predict_layers: Option<usize>,
    /// 5.23 spelling of `num_nextn_predict_layers` (its `attribute_map`).
    #[serde(
        default,
        deserialize_with = "de::present",
        skip_serializing_if = "Option::is_none"
    )]
    num_mtp_layers: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dtype: Option<String>,
    /// Pre-5.0 spelling of `dtype`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    torch_dtype: Option<String>,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

/// DeepSeek-V3 configuration with HF `DeepseekV3Config` defaults.
///
/// (De)serializes as HF's `config.json` (written in the transformers 5.23 spelling, `extra`
/// keys included); deserializing validates like [`DeepseekV3Config::from_json_str`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "DeepseekV3Json", try_from = "DeepseekV3Json")]
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
            vocab_size: hf_default::vocab_size(),
            hidden_size: hf_default::hidden_size(),
            intermediate_size: hf_default::intermediate_size(),
            moe_intermediate_size: hf_default::moe_intermediate_size(),
            num_hidden_layers: hf_default::num_hidden_layers(),
            num_attention_heads: hf_default::num_attention_heads(),
            num_key_value_heads: hf_default::num_key_value_heads()
                .unwrap_or(hf_default::num_attention_heads()),
            n_shared_experts: hf_default::n_shared_experts(),
            n_routed_experts: hf_default::n_routed_experts(),
            num_experts_per_tok: hf_default::num_experts_per_tok(),
            n_group: hf_default::n_group(),
            topk_group: hf_default::topk_group(),
            routed_scaling_factor: hf_default::routed_scaling_factor(),
            norm_topk_prob: true,
            q_lora_rank: hf_default::q_lora_rank(),
            kv_lora_rank: hf_default::kv_lora_rank(),
            qk_nope_head_dim: hf_default::qk_nope_head_dim(),
            qk_rope_head_dim: hf_default::qk_rope_head_dim(),
            v_head_dim: hf_default::v_head_dim(),
            first_k_dense_replace: hf_default::first_k_dense_replace(),
            max_position_embeddings: hf_default::max_position_embeddings(),
            rms_norm_eps: hf_default::rms_norm_eps(),
            rope_parameters: RopeParameters::default(),
            rope_interleave: true,
            attention_bias: false,
            tie_word_embeddings: false,
            num_nextn_predict_layers: hf_default::num_nextn_predict_layers(),
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
        check::read_config_file(path.as_ref(), Self::from_json_str)
    }

    /// Parses the text of a `config.json` and validates it.
    pub fn from_json_str(text: &str) -> Result<Self, ModelError> {
        de::parse::<DeepseekV3Json>(text, Self::MODEL_TYPE)?.try_into()
    }

    /// Checks sizes and cross-field rules; errors name the offending field.
    pub fn validate(&self) -> Result<(), ModelError> {
        check::positive(&[
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
        ])?;
        if self.q_lora_rank == Some(0) {
            return Err(ModelError::invalid(
                "q_lora_rank",
                "must be positive or null",
            ));
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(ModelError::invalid("qk_rope_head_dim", "must be even"));
        }
        self.moe_block().validate()?;
        check::positive_number("rms_norm_eps", self.rms_norm_eps)?;
        Ok(())
    }

    /// The fields of the MoE block (shared with the families that route like DeepSeek-V3).
    pub fn moe_block(&self) -> crate::families::blocks::moe::SigmoidGroupMoe {
        crate::families::blocks::moe::SigmoidGroupMoe {
            hidden_size: self.hidden_size,
            n_routed_experts: self.n_routed_experts,
            num_experts_per_tok: self.num_experts_per_tok,
            n_group: self.n_group,
            topk_group: self.topk_group,
            routed_scaling_factor: self.routed_scaling_factor,
            norm_topk_prob: self.norm_topk_prob,
            moe_intermediate_size: self.moe_intermediate_size,
            n_shared_experts: self.n_shared_experts,
        }
    }

    /// `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Whether decoder layer `layer` uses the MoE block (`layer ≥ first_k_dense_replace`).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace
    }

    /// Non-fatal findings (docs/models.md §Config parsing): settings HF 5.23 ignores
    /// (`scoring_func`, `topk_method`, `moe_layer_freq`) and a YaRN `factor` that differs from
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

impl TryFrom<DeepseekV3Json> for DeepseekV3Config {
    type Error = ModelError;

    /// Merges spellings, normalises RoPE, resolves `null`s, then
    /// [`DeepseekV3Config::validate`]s.
    fn try_from(mut j: DeepseekV3Json) -> Result<Self, ModelError> {
        de::check_model_type(j.model_type.as_deref(), Self::MODEL_TYPE)?;
        de::check_silu(j.hidden_act.as_deref())?;
        let rope = RopeKeys {
            rope_theta: j.rope_theta,
            rope_parameters: j.rope_parameters,
            rope_scaling: j.rope_scaling,
        };
        let rope_parameters = rope::resolve(rope, &mut j.extra, j.max_position_embeddings)?;
        let n_routed_experts = de::either(
            ("n_routed_experts", j.n_routed_experts),
            ("num_local_experts", j.num_local_experts),
        )?;
        let num_nextn_predict_layers = de::either(
            ("num_nextn_predict_layers", j.num_nextn_predict_layers),
            ("num_mtp_layers", j.num_mtp_layers),
        )?;
        let config = Self {
            vocab_size: j.vocab_size,
            hidden_size: j.hidden_size,
            intermediate_size: j.intermediate_size,
            moe_intermediate_size: j.moe_intermediate_size,
            num_hidden_layers: j.num_hidden_layers,
            num_attention_heads: j.num_attention_heads,
            num_key_value_heads: j.num_key_value_heads.unwrap_or(j.num_attention_heads),
            n_shared_experts: j.n_shared_experts,
            n_routed_experts: n_routed_experts.unwrap_or_else(hf_default::n_routed_experts),
            num_experts_per_tok: j.num_experts_per_tok,
            n_group: j.n_group,
            topk_group: j.topk_group,
            routed_scaling_factor: j.routed_scaling_factor,
            norm_topk_prob: j.norm_topk_prob,
            q_lora_rank: j.q_lora_rank,
            kv_lora_rank: j.kv_lora_rank,
            qk_nope_head_dim: j.qk_nope_head_dim,
            qk_rope_head_dim: j.qk_rope_head_dim,
            v_head_dim: j.v_head_dim,
            first_k_dense_replace: j.first_k_dense_replace,
            max_position_embeddings: j.max_position_embeddings,
            rms_norm_eps: j.rms_norm_eps,
            rope_parameters,
            rope_interleave: j.rope_interleave,
            attention_bias: j.attention_bias,
            tie_word_embeddings: j.tie_word_embeddings,
            num_nextn_predict_layers: num_nextn_predict_layers
                .unwrap_or_else(hf_default::num_nextn_predict_layers),
            dtype: de::either(("dtype", j.dtype), ("torch_dtype", j.torch_dtype))?,
            extra: j.extra,
        };
        config.validate()?;
        Ok(config)
    }
}

impl From<DeepseekV3Config> for DeepseekV3Json {
    /// The 5.23 spelling (`dtype`, `rope_parameters`, derived `head_dim`/`qk_head_dim`) but
    /// `num_nextn_predict_layers`, which every transformers version reads.
    fn from(c: DeepseekV3Config) -> Self {
        let qk_head_dim = c.qk_head_dim();
        Self {
            model_type: Some(DeepseekV3Config::MODEL_TYPE.to_owned()),
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            moe_intermediate_size: c.moe_intermediate_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: Some(c.num_key_value_heads),
            n_shared_experts: c.n_shared_experts,
            n_routed_experts: Some(c.n_routed_experts),
            num_local_experts: None,
            num_experts_per_tok: c.num_experts_per_tok,
            n_group: c.n_group,
            topk_group: c.topk_group,
            routed_scaling_factor: c.routed_scaling_factor,
            norm_topk_prob: c.norm_topk_prob,
            q_lora_rank: c.q_lora_rank,
            kv_lora_rank: c.kv_lora_rank,
            qk_nope_head_dim: c.qk_nope_head_dim,
            qk_rope_head_dim: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
            head_dim: Some(c.qk_rope_head_dim.into()),
            qk_head_dim: Some(qk_head_dim.into()),
            first_k_dense_replace: c.first_k_dense_replace,
            hidden_act: Some("silu".to_owned()),
            max_position_embeddings: c.max_position_embeddings,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: None,
            rope_parameters: Some((&c.rope_parameters).into()),
            rope_scaling: None,
            rope_interleave: c.rope_interleave,
            attention_bias: c.attention_bias,
            tie_word_embeddings: c.tie_word_embeddings,
            num_nextn_predict_layers: Some(c.num_nextn_predict_layers),
            num_mtp_layers: None,
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
