//! Which dimension of each canonical tensor the sharded models split (checkpoints.md §3): the
//! one table the distributed checkpoint (moe-bridge's `dist::sharding`, which re-exports it)
//! and the weight sync ([`crate::weight_sync`]) read.
//!
//! Canonical names are HF names, except routed experts, stacked per MoE layer
//! (`…mlp.experts.gate_up_proj [E, 2, Im, H]` ≡ HF's fused `[E, 2·Im, H]`,
//! `…mlp.experts.down_proj [E, H, Im]`); orientation is PyTorch `[out, in]`.
//!
//! | tensor | split |
//! |---|---|
//! | `embed_tokens`, `lm_head`, `q/k/v_proj` (+ biases; DeepSeek's `q_proj` when `q_lora_rank` is unset), `q_b_proj`, `kv_b_proj`, dense `gate_proj`/`up_proj` | TP dim 0 |
//! | `o_proj.weight`, dense `down_proj` | TP dim 1 |
//! | `experts.gate_up_proj [E,2,Im,H]`, `experts.down_proj [E,H,Im]` | EP dim 0, ETP dim 2 |
//! | everything else: norms (incl. `q_a_layernorm`, `kv_a_layernorm`, MTP `enorm`/`hnorm`/`shared_head.norm`), router `gate.weight`, `e_score_correction_bias`, `q_a_proj`, `kv_a_proj_with_mqa`, `o_proj.bias`, the shared experts `mlp.shared_experts.*`, MTP `eh_proj` | replicated |

/// How a canonical tensor is split over the ranks of one pipeline stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardRule {
    /// Every rank of the owning stage holds the whole tensor.
    Replicated,
    /// Split over dense TP along `dim`.
    Tp {
        /// The split dimension.
        dim: usize,
    },
    /// Routed experts: dim 0 split over EP, `etp_dim` over expert TP.
    Expert {
        /// The dimension split over ETP.
        etp_dim: usize,
    },
}

/// The split of the canonical tensor `name` (see the module table).
pub fn shard_rule(name: &str) -> ShardRule {
    if name.ends_with("mlp.experts.gate_up_proj") || name.ends_with("mlp.experts.down_proj") {
        return ShardRule::Expert { etp_dim: 2 };
    }
    if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
        return ShardRule::Tp { dim: 0 };
    }
    // Column-parallel (output features, canonical dim 0) and row-parallel (input features,
    // dim 1) tensors, matched as `.<suffix>`: `mlp.gate_proj.weight` is a dense MLP's, not the
    // (replicated) `mlp.shared_experts.gate_proj.weight`.
    const DIM0: [&str; 12] = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
        "self_attn.q_b_proj.weight",
        "self_attn.q_b_proj.bias",
        "self_attn.kv_b_proj.weight",
        "self_attn.kv_b_proj.bias",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
    ];
    const DIM1: [&str; 2] = ["self_attn.o_proj.weight", "mlp.down_proj.weight"];
    let ends = |suffix: &&str| {
        name.strip_suffix(*suffix)
            .is_some_and(|head| head.ends_with('.'))
    };
    if DIM0.iter().any(ends) {
        ShardRule::Tp { dim: 0 }
    } else if DIM1.iter().any(ends) {
        ShardRule::Tp { dim: 1 }
    } else {
        ShardRule::Replicated
    }
}
