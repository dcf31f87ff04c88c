//! GLM-4.5 MoE configuration (`model_type = "glm4_moe"`), HF transformers 5.23
//! `models/glm4_moe/configuration_glm4_moe.py` `Glm4MoeConfig` (docs/models.md §Config parsing).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ModelError;
use crate::config::rope::{self, RopeJson, RopeKeys};
use crate::config::{RopeParameters, check, de};
use crate::families::blocks::moe::SigmoidGroupMoe;

/// HF `Glm4MoeConfig` class defaults (transformers 5.23).
mod hf_default {
    crate::config::de::hf_defaults! {
        vocab_size: usize = 151552;
        hidden_size: usize = 4096;
        intermediate_size: usize = 10944;
        num_hidden_layers: usize = 46;
        num_attention_heads: usize = 96;
        num_key_value_heads: usize = 8;
        max_position_embeddings: usize = 131072;
        rms_norm_eps: f64 = 1e-5;
        moe_intermediate_size: usize = 1408;
        num_experts_per_tok: usize = 8;
        n_shared_experts: usize = 1;
        n_routed_experts: usize = 128;
        routed_scaling_factor: f64 = 1.0;
        n_group: usize = 1;
        topk_group: usize = 1;
        first_k_dense_replace: usize = 1;
        // `__post_init__`: `kwargs.setdefault("partial_rotary_factor", 0.5)`.
        partial_rotary_factor: f64 = 0.5;
        // Deliberately not HF's: 5.23 defaults `num_mtp_layers` to 1, but a config without the
        // key describes a checkpoint without MTP weights (as for DeepSeek-V3).
        num_nextn_predict_layers: usize = 0;
    }
}

/// The key of the rotated share of each head, inside `rope_parameters` (5.23) or top-level
/// (the releases' `config.json`).
const PARTIAL_ROTARY_FACTOR: &str = "partial_rotary_factor";

/// A GLM-4.5 MoE `config.json` field by field, as HF `Glm4MoeConfig` reads and writes it, with
/// the class defaults for absent keys. Keys not interpreted (`initializer_range`, `use_cache`,
/// `attention_dropout`, `output_router_logits`, token ids, …) stay in `extra`.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub(crate) struct Glm4MoeJson {
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
    #[serde(default = "hf_default::num_key_value_heads")]
    num_key_value_heads: usize,
    /// Not a class field: `null` / absent ⇒ `hidden_size / num_attention_heads`
    /// (`getattr(config, "head_dim", None) or …`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    head_dim: Option<usize>,
    /// Only `"silu"` is supported (`null` ⇒ HF's default, `"silu"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hidden_act: Option<String>,
    #[serde(default = "hf_default::max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default = "hf_default::rms_norm_eps")]
    rms_norm_eps: f64,
    #[serde(default, deserialize_with = "de::null_as_default")]
    tie_word_embeddings: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope_parameters: Option<RopeJson>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rope_scaling: Option<RopeJson>,
    /// Top-level spelling (the releases'); `rope_parameters.partial_rotary_factor` wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    partial_rotary_factor: Option<f64>,
    #[serde(default, deserialize_with = "de::null_as_default")]
    attention_bias: bool,
    #[serde(default = "hf_default::moe_intermediate_size")]
    moe_intermediate_size: usize,
    #[serde(default = "hf_default::num_experts_per_tok")]
    num_experts_per_tok: usize,
    #[serde(default = "hf_default::n_shared_experts")]
    n_shared_experts: usize,
    /// Default 128, applied after merging with `num_local_experts`.
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
    #[serde(default = "hf_default::routed_scaling_factor")]
    routed_scaling_factor: f64,
    #[serde(default = "hf_default::n_group")]
    n_group: usize,
    #[serde(default = "hf_default::topk_group")]
    topk_group: usize,
    #[serde(default = "hf_default::first_k_dense_replace")]
    first_k_dense_replace: usize,
    #[serde(default = "de::yes", deserialize_with = "de::null_as_true")]
    norm_topk_prob: bool,
    #[serde(default, deserialize_with = "de::null_as_default")]
    use_qk_norm: bool,
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

/// GLM-4.5 MoE configuration with HF `Glm4MoeConfig` defaults.
///
/// (De)serializes as HF's `config.json` (written in the transformers 5.23 spelling, `extra`
/// keys included); deserializing validates like [`Glm4MoeConfig::from_json_str`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "Glm4MoeJson", try_from = "Glm4MoeJson")]
pub struct Glm4MoeConfig {
    /// Vocabulary size `V` (default 151552).
    pub vocab_size: usize,
    /// Hidden size `H` (default 4096).
    pub hidden_size: usize,
    /// Width of the dense MLP of the first `first_k_dense_replace` layers (default 10944).
    pub intermediate_size: usize,
    /// Number of decoder layers `N` (default 46).
    pub num_hidden_layers: usize,
    /// Attention heads `nh` (default 96).
    pub num_attention_heads: usize,
    /// Key/value heads (default 8).
    pub num_key_value_heads: usize,
    /// Per-head size `hd` (absent ⇒ `H / nh`; the releases set 128 with `nh·hd ≠ H`).
    pub head_dim: usize,
    /// Maximum sequence length (default 131072).
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon of every norm, QK-norms included (default 1e-5).
    pub rms_norm_eps: f64,
    /// `lm_head` shares `embed_tokens`' weight (default false).
    pub tie_word_embeddings: bool,
    /// RoPE settings.
    pub rope_parameters: RopeParameters,
    /// Share of each head's dims RoPE rotates (default 0.5; the first `int(hd·factor)` dims,
    /// rotate-half).
    pub partial_rotary_factor: f64,
    /// Biases on `q_proj`, `k_proj`, `v_proj` (never on `o_proj`; default false).
    pub attention_bias: bool,
    /// Width `Im` of each routed expert (default 1408).
    pub moe_intermediate_size: usize,
    /// Experts per token `k` (default 8).
    pub num_experts_per_tok: usize,
    /// Shared experts (default 1; their MLP width is `Im · n_shared_experts`).
    pub n_shared_experts: usize,
    /// Routed experts `E` (`n_routed_experts` | `num_local_experts`; default 128).
    pub n_routed_experts: usize,
    /// Multiplies the routing weights (default 1.0; the releases use 2.5).
    pub routed_scaling_factor: f64,
    /// Expert groups (default 1).
    pub n_group: usize,
    /// Groups kept per token (default 1).
    pub topk_group: usize,
    /// Layers `0..first_k_dense_replace` use a dense MLP (default 1).
    pub first_k_dense_replace: usize,
    /// Renormalise the selected sigmoid scores (default true).
    pub norm_topk_prob: bool,
    /// Per-head RMSNorm of q and k before RoPE (default false; GLM-4.5 sets true).
    pub use_qk_norm: bool,
    /// MTP depth `D` (`num_nextn_predict_layers` | `num_mtp_layers`; default 0 here).
    pub num_nextn_predict_layers: usize,
    /// Checkpoint dtype string (`dtype` | `torch_dtype`).
    pub dtype: Option<String>,
    /// Keys this parser does not interpret, kept verbatim for export.
    pub extra: Map<String, Value>,
}

impl Default for Glm4MoeConfig {
    fn default() -> Self {
        Self {
            vocab_size: hf_default::vocab_size(),
            hidden_size: hf_default::hidden_size(),
            intermediate_size: hf_default::intermediate_size(),
            num_hidden_layers: hf_default::num_hidden_layers(),
            num_attention_heads: hf_default::num_attention_heads(),
            num_key_value_heads: hf_default::num_key_value_heads(),
            head_dim: hf_default::hidden_size() / hf_default::num_attention_heads(),
            max_position_embeddings: hf_default::max_position_embeddings(),
            rms_norm_eps: hf_default::rms_norm_eps(),
            tie_word_embeddings: false,
            rope_parameters: RopeParameters::default(),
            partial_rotary_factor: hf_default::partial_rotary_factor(),
            attention_bias: false,
            moe_intermediate_size: hf_default::moe_intermediate_size(),
            num_experts_per_tok: hf_default::num_experts_per_tok(),
            n_shared_experts: hf_default::n_shared_experts(),
            n_routed_experts: hf_default::n_routed_experts(),
            routed_scaling_factor: hf_default::routed_scaling_factor(),
            n_group: hf_default::n_group(),
            topk_group: hf_default::topk_group(),
            first_k_dense_replace: hf_default::first_k_dense_replace(),
            norm_topk_prob: true,
            use_qk_norm: false,
            num_nextn_predict_layers: hf_default::num_nextn_predict_layers(),
            dtype: None,
            extra: Map::new(),
        }
    }
}

impl Glm4MoeConfig {
    /// The `model_type` this config parses.
    pub const MODEL_TYPE: &'static str = "glm4_moe";

    /// Reads and parses a `config.json` file; errors carry the path.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        check::read_config_file(path.as_ref(), Self::from_json_str)
    }

    /// Parses the text of a `config.json` and validates it.
    pub fn from_json_str(text: &str) -> Result<Self, ModelError> {
        de::parse::<Glm4MoeJson>(text, Self::MODEL_TYPE)?.try_into()
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
        self.moe_block().validate()?;
        check::positive_number("rms_norm_eps", self.rms_norm_eps)?;
        // Head counts and the rotated width (an error naming `partial_rotary_factor`).
        self.attention_config().check_split(1)
    }

    /// The fields of the MoE block (DeepSeek-V3's router and shared experts).
    pub fn moe_block(&self) -> SigmoidGroupMoe {
        SigmoidGroupMoe {
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

    /// Whether decoder layer `layer` uses the MoE block (`layer ≥ first_k_dense_replace`; the
    /// MTP layers always do).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace
    }
}

impl TryFrom<Glm4MoeJson> for Glm4MoeConfig {
    type Error = ModelError;

    /// Merges spellings, normalises RoPE (taking `partial_rotary_factor` out of it), resolves
    /// `null`s, then [`Glm4MoeConfig::validate`]s.
    fn try_from(mut j: Glm4MoeJson) -> Result<Self, ModelError> {
        de::check_model_type(j.model_type.as_deref(), Self::MODEL_TYPE)?;
        de::check_silu(j.hidden_act.as_deref())?;
        // HF's priority: `rope_parameters.partial_rotary_factor`, the top-level key, 0.5.
        let nested = match j.rope_parameters.as_mut() {
            Some(p) => match p.extra.remove(PARTIAL_ROTARY_FACTOR) {
                Some(v) => Some(de::deserialize::<f64>(
                    "rope_parameters.partial_rotary_factor",
                    &v,
                )?),
                None => None,
            },
            None => None,
        };
        let partial_rotary_factor = nested
            .or(j.partial_rotary_factor)
            .unwrap_or_else(hf_default::partial_rotary_factor);
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
        let head_dim = match j.head_dim {
            Some(d) => d,
            None => j
                .hidden_size
                .checked_div(j.num_attention_heads)
                .ok_or_else(|| ModelError::invalid("num_attention_heads", "must be positive"))?,
        };
        let config = Self {
            vocab_size: j.vocab_size,
            hidden_size: j.hidden_size,
            intermediate_size: j.intermediate_size,
            num_hidden_layers: j.num_hidden_layers,
            num_attention_heads: j.num_attention_heads,
            num_key_value_heads: j.num_key_value_heads,
            head_dim,
            max_position_embeddings: j.max_position_embeddings,
            rms_norm_eps: j.rms_norm_eps,
            tie_word_embeddings: j.tie_word_embeddings,
            rope_parameters,
            partial_rotary_factor,
            attention_bias: j.attention_bias,
            moe_intermediate_size: j.moe_intermediate_size,
            num_experts_per_tok: j.num_experts_per_tok,
            n_shared_experts: j.n_shared_experts,
            n_routed_experts: n_routed_experts.unwrap_or_else(hf_default::n_routed_experts),
            routed_scaling_factor: j.routed_scaling_factor,
            n_group: j.n_group,
            topk_group: j.topk_group,
            first_k_dense_replace: j.first_k_dense_replace,
            norm_topk_prob: j.norm_topk_prob,
            use_qk_norm: j.use_qk_norm,
            num_nextn_predict_layers: num_nextn_predict_layers
                .unwrap_or_else(hf_default::num_nextn_predict_layers),
            dtype: de::either(("dtype", j.dtype), ("torch_dtype", j.torch_dtype))?,
            extra: j.extra,
        };
        config.validate()?;
        Ok(config)
    }
}

impl From<Glm4MoeConfig> for Glm4MoeJson {
    /// The 5.23 spelling (`dtype`, `rope_parameters` holding `partial_rotary_factor`, explicit
    /// `head_dim`) but `num_nextn_predict_layers`, which every transformers version reads.
    fn from(c: Glm4MoeConfig) -> Self {
        let mut rope = RopeJson::from(&c.rope_parameters);
        rope.extra.insert(
            PARTIAL_ROTARY_FACTOR.to_owned(),
            c.partial_rotary_factor.into(),
        );
        Self {
            model_type: Some(Glm4MoeConfig::MODEL_TYPE.to_owned()),
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: Some(c.head_dim),
            hidden_act: Some("silu".to_owned()),
            max_position_embeddings: c.max_position_embeddings,
            rms_norm_eps: c.rms_norm_eps,
            tie_word_embeddings: c.tie_word_embeddings,
            rope_theta: None,
            rope_parameters: Some(rope),
            rope_scaling: None,
            partial_rotary_factor: None,
            attention_bias: c.attention_bias,
            moe_intermediate_size: c.moe_intermediate_size,
            num_experts_per_tok: c.num_experts_per_tok,
            n_shared_experts: c.n_shared_experts,
            n_routed_experts: Some(c.n_routed_experts),
            num_local_experts: None,
            routed_scaling_factor: c.routed_scaling_factor,
            n_group: c.n_group,
            topk_group: c.topk_group,
            first_k_dense_replace: c.first_k_dense_replace,
            norm_topk_prob: c.norm_topk_prob,
            use_qk_norm: c.use_qk_norm,
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
    fn defaults_spellings_and_partial_rotary_priority() {
        // The class defaults alone give head_dim 4096 / 96 = 42 and 21 rotated dims, which
        // HF's rotate-half cannot pair: refused, naming the field.
        let e = Glm4MoeConfig::from_json_str(r#"{"model_type": "glm4_moe"}"#).unwrap_err();
        assert!(e.to_string().contains("partial_rotary_factor"), "{e}");
        let d = Glm4MoeConfig::from_json_str(
            r#"{"model_type": "glm4_moe", "num_attention_heads": 32}"#,
        )
        .unwrap();
        assert_eq!(d.head_dim, 4096 / 32);
        assert_eq!(d.partial_rotary_factor, 0.5);
        assert!(!d.use_qk_norm);
        assert_eq!(d.routed_scaling_factor, 1.0);
        assert_eq!(d.num_nextn_predict_layers, 0);
        // The release's spelling: top-level `rope_theta` and `partial_rotary_factor`.
        let release = Glm4MoeConfig::from_json_str(
            r#"{"model_type": "glm4_moe", "head_dim": 128, "partial_rotary_factor": 0.25,
                "rope_theta": 1000000, "num_local_experts": 128, "num_mtp_layers": 1,
                "use_cache": true, "pad_token_id": 151329}"#,
        )
        .unwrap();
        assert_eq!(release.partial_rotary_factor, 0.25);
        assert_eq!(release.rope_parameters.rope_theta, 1e6);
        assert_eq!(release.num_nextn_predict_layers, 1);
        assert!(release.extra.contains_key("pad_token_id"));
        // `rope_parameters` wins over the top-level key.
        let nested = Glm4MoeConfig::from_json_str(
            r#"{"model_type": "glm4_moe", "partial_rotary_factor": 0.25,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                    "partial_rotary_factor": 1.0}}"#,
        )
        .unwrap();
        assert_eq!(nested.partial_rotary_factor, 1.0);
        // Written back in the 5.23 spelling and read again unchanged.
        let text = serde_json::to_string(&release).unwrap();
        let json: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["rope_parameters"]["partial_rotary_factor"], 0.25);
        assert_eq!(json["num_nextn_predict_layers"], 1);
        assert_eq!(Glm4MoeConfig::from_json_str(&text).unwrap(), release);
    }

    #[test]
    fn errors_name_the_field() {
        let err = |text: &str| Glm4MoeConfig::from_json_str(text).unwrap_err().to_string();
        let e = err(r#"{"model_type": "glm4_moe", "n_group": 3}"#);
        assert!(e.contains("n_group"), "{e}");
        let e = err(
            r#"{"model_type": "glm4_moe", "head_dim": 6, "partial_rotary_factor": 0.5,
                        "num_attention_heads": 4, "num_key_value_heads": 2}"#,
        );
        assert!(e.contains("partial_rotary_factor"), "{e}");
        let e = err(r#"{"model_type": "glm4_moe", "num_key_value_heads": 5}"#);
        assert!(e.contains("num_key_value_heads"), "{e}");
        let e = err(r#"{"model_type": "glm4_moe", "hidden_act": "gelu"}"#);
        assert!(e.contains("hidden_act"), "{e}");
        let e = err(r#"{"model_type": "glm4_moe", "num_mtp_layers": 1,
                        "num_nextn_predict_layers": 2}"#);
        assert!(e.contains("num_mtp_layers"), "{e}");
    }
}
