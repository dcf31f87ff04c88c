//! The dimensions the planner needs, taken from a Qwen3-MoE or DeepSeek-V3 config: one
//! [`ModelShape`] serves the memory, activation and communication models of every family.

use moe_backend::parallel::ParallelLayout;
use moe_backend::parallel::pipeline::StageParts;

use super::{
    RankParams, deepseek_v3_chunk_params, deepseek_v3_rank_params, qwen3_moe_chunk_params,
    qwen3_moe_rank_params,
};
use crate::{DeepseekV3Config, Qwen3MoeConfig};

/// Attention of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionShape {
    /// Grouped-query attention (Qwen3: with per-head QK-norm).
    Gqa {
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        kv_heads: usize,
        /// Head dimension.
        head_dim: usize,
        /// Per-head RMSNorm of queries and keys.
        qk_norm: bool,
    },
    /// Multi-latent attention (DeepSeek-V3).
    Mla {
        /// Query heads.
        heads: usize,
        /// Query latent rank (`None`: direct query projection).
        q_lora_rank: Option<usize>,
        /// Key/value latent rank.
        kv_lora_rank: usize,
        /// Non-rotary query/key head dimension.
        qk_nope: usize,
        /// Rotary query/key head dimension.
        qk_rope: usize,
        /// Value head dimension.
        v_head: usize,
    },
}

impl AttentionShape {
    /// Query heads.
    pub fn heads(&self) -> usize {
        match *self {
            Self::Gqa { heads, .. } | Self::Mla { heads, .. } => heads,
        }
    }

    /// Per-token elements a context-parallel rank all-gathers per attention layer under
    /// `tp`: GQA its heads' keys and values, MLA the compressed latent and the shared rotary
    /// key (computed whole on every TP rank).
    pub fn cp_exchange_width(&self, tp: usize) -> f64 {
        match *self {
            Self::Gqa {
                kv_heads, head_dim, ..
            } => (2 * kv_heads * head_dim) as f64 / tp as f64,
            Self::Mla {
                kv_lora_rank,
                qk_rope,
                ..
            } => (kv_lora_rank + qk_rope) as f64,
        }
    }

    /// Per-token elements of `(query, key, value, output)` over all heads.
    pub fn qkvo(&self) -> (usize, usize, usize, usize) {
        match *self {
            Self::Gqa {
                heads,
                kv_heads,
                head_dim,
                ..
            } => (
                heads * head_dim,
                kv_heads * head_dim,
                kv_heads * head_dim,
                heads * head_dim,
            ),
            Self::Mla {
                heads,
                qk_nope,
                qk_rope,
                v_head,
                ..
            } => (
                heads * (qk_nope + qk_rope),
                heads * (qk_nope + qk_rope),
                heads * v_head,
                heads * v_head,
            ),
        }
    }
}

/// Model dimensions used by the planner.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShape {
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size `h`.
    pub hidden: usize,
    /// Attention of every layer.
    pub attention: AttentionShape,
    /// `true` for the MoE layers, in layer order.
    pub moe_layers: Vec<bool>,
    /// Dense MLP width.
    pub dense_ffn: usize,
    /// Routed experts `E`.
    pub experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// Routed expert width `F`.
    pub moe_ffn: usize,
    /// Total shared-expert width (0 without shared experts).
    pub shared_ffn: usize,
    /// Input embedding and head share their weights.
    pub tied_embeddings: bool,
}

impl ModelShape {
    /// Shape of a Qwen3-MoE config.
    pub fn qwen3_moe(c: &Qwen3MoeConfig) -> Self {
        Self {
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            attention: AttentionShape::Gqa {
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                qk_norm: true,
            },
            moe_layers: (0..c.num_hidden_layers)
                .map(|l| c.is_moe_layer(l))
                .collect(),
            dense_ffn: c.intermediate_size,
            experts: c.num_experts,
            top_k: c.num_experts_per_tok,
            moe_ffn: c.moe_intermediate_size,
            shared_ffn: 0,
            tied_embeddings: c.tie_word_embeddings,
        }
    }

    /// Shape of a DeepSeek-V3 config (main model; MTP layers are not planned).
    pub fn deepseek_v3(c: &DeepseekV3Config) -> Self {
        Self {
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            attention: AttentionShape::Mla {
                heads: c.num_attention_heads,
                q_lora_rank: c.q_lora_rank,
                kv_lora_rank: c.kv_lora_rank,
                qk_nope: c.qk_nope_head_dim,
                qk_rope: c.qk_rope_head_dim,
                v_head: c.v_head_dim,
            },
            moe_layers: (0..c.num_hidden_layers)
                .map(|l| c.is_moe_layer(l))
                .collect(),
            dense_ffn: c.intermediate_size,
            experts: c.n_routed_experts,
            top_k: c.num_experts_per_tok,
            moe_ffn: c.moe_intermediate_size,
            shared_ffn: c.n_shared_experts * c.moe_intermediate_size,
            tied_embeddings: c.tie_word_embeddings,
        }
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.moe_layers.len()
    }
}

/// A model the planner can count parameters of.
#[derive(Debug, Clone)]
pub enum PlannedModel {
    /// Qwen3-MoE.
    Qwen3Moe(Qwen3MoeConfig),
    /// DeepSeek-V3 (main model).
    DeepseekV3(DeepseekV3Config),
}

impl PlannedModel {
    /// The `model_type`s the planner counts parameters of.
    pub const MODEL_TYPES: &'static [&'static str] = &["qwen3_moe", "deepseek_v3"];

    /// The planner's model of `config`, `None` for a family it does not plan.
    pub fn from_config(config: &crate::ModelConfig) -> Option<Self> {
        use crate::deepseek_v3::DeepseekV3;
        use crate::qwen3_moe::Qwen3Moe;
        if let Some(c) = config.get::<Qwen3Moe>() {
            return Some(Self::Qwen3Moe(c.clone()));
        }
        config
            .get::<DeepseekV3>()
            .map(|c| Self::DeepseekV3(c.clone()))
    }

    /// The planner's dimensions.
    pub fn shape(&self) -> ModelShape {
        match self {
            Self::Qwen3Moe(c) => ModelShape::qwen3_moe(c),
            Self::DeepseekV3(c) => ModelShape::deepseek_v3(c),
        }
    }

    /// MTP modules of the model (DeepSeek-V3's `num_nextn_predict_layers`; 0 for Qwen3-MoE):
    /// an explicit pipeline layout must place them (`m`). Their parameters are not planned.
    pub fn mtp_modules(&self) -> usize {
        match self {
            Self::Qwen3Moe(_) => 0,
            Self::DeepseekV3(c) => c.num_nextn_predict_layers,
        }
    }

    /// Parameters a rank of pipeline stage `stage` holds under `layout`'s split (its `vpp` and
    /// `pp_layout`; see [`super::qwen3_moe_rank_params`]).
    pub fn rank_params(&self, layout: &ParallelLayout, stage: usize) -> RankParams {
        match self {
            Self::Qwen3Moe(c) => qwen3_moe_rank_params(c, layout, stage),
            Self::DeepseekV3(c) => deepseek_v3_rank_params(c, layout, stage),
        }
    }

    /// Parameters a rank holding `chunks` (virtual stages, see [`super::rank_chunks`]) holds.
    pub fn chunk_params(&self, layout: &ParallelLayout, chunks: &[StageParts]) -> RankParams {
        match self {
            Self::Qwen3Moe(c) => qwen3_moe_chunk_params(c, layout, chunks),
            Self::DeepseekV3(c) => deepseek_v3_chunk_params(c, layout, chunks),
        }
    }
}
