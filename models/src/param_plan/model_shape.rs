//! The dimensions the planner's memory, activation and communication models read of a model
//! ([`ModelShape`]); each family describes itself
//! ([`Family::model_shape`](crate::families::Family::model_shape)).

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
    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.moe_layers.len()
    }
}
