//! The DeepSeek-V3 model's HF layout (HF `DeepseekV3ForCausalLM`, MTP modules included): its
//! parallel plan, name-mapping rules and export copies, over the shared
//! Llama-family names of [`crate::param_plan::hf_names`] plus DeepSeek-V3's own: MLA's projections, the
//! router's `e_score_correction_bias`, shared experts, the MTP modules' `enorm`, `hnorm`,
//! `eh_proj` and `shared_head`, and FP8 `weight_scale_inv` companions.

use moe_bridge::mapping::Rule;

pub use crate::families::blocks::plan::{
    EH_PROJ, ENORM, HNORM, expert_bias_and_shared_rules, mtp_copies, mtp_rows, mtp_rules,
};
use crate::param_plan::hf_names::{self as n, join, layer as layer_of};
use crate::param_plan::rows::{column, embedding, mlp, moe, norm, replicated, row};
use crate::param_plan::{ParallelPlan, PlanEntry};

// MLA (the query projection without `q_lora_rank` is the shared `q_proj`).
/// Low-rank query down-projection.
pub const Q_A_PROJ: &str = "q_a_proj";
/// Low-rank query norm.
pub const Q_A_LAYERNORM: &str = "q_a_layernorm";
/// Low-rank query up-projection.
pub const Q_B_PROJ: &str = "q_b_proj";
/// Latent KV down-projection (with the shared RoPE key).
pub const KV_A_PROJ_WITH_MQA: &str = "kv_a_proj_with_mqa";
/// Latent KV norm.
pub const KV_A_LAYERNORM: &str = "kv_a_layernorm";
/// KV up-projection.
pub const KV_B_PROJ: &str = "kv_b_proj";
pub use crate::param_plan::hf_names::EXPERT_BIAS;
pub use crate::param_plan::hf_names::SHARED_EXPERTS;
pub use crate::param_plan::hf_names::{
    SHARED_HEAD, is_expert_bias, is_mtp_head_copy, mtp_copy_names,
};

/// One decoder layer at Burn path `l`, HF prefix `h`: MLA with the head-split
/// up-projections (`q_proj` or `q_b_proj`, `kv_b_proj`) column-parallel and `o_proj`
/// row-parallel, the latent down-projections (`q_a_proj`, `kv_a_proj_with_mqa`) and their
/// norms replicated; a dense MLP or an MoE block with replicated shared experts.
fn layer(l: &str, h: &str) -> Vec<PlanEntry> {
    let a = join(l, n::SELF_ATTN);
    let ha = join(h, n::SELF_ATTN);
    let mut rows = norm(&join(l, n::INPUT_LAYERNORM), &join(h, n::INPUT_LAYERNORM));
    rows.extend(column(
        &format!("{a}.query.Direct"),
        &join(&ha, n::Q_PROJ),
        true,
        true,
    ));
    rows.extend(replicated(
        &format!("{a}.query.LowRank.{Q_A_PROJ}"),
        &join(&ha, Q_A_PROJ),
        true,
        true,
    ));
    rows.extend(norm(
        &format!("{a}.query.LowRank.{Q_A_LAYERNORM}"),
        &join(&ha, Q_A_LAYERNORM),
    ));
    rows.extend(column(
        &format!("{a}.query.LowRank.{Q_B_PROJ}"),
        &join(&ha, Q_B_PROJ),
        true,
        true,
    ));
    rows.extend(replicated(
        &join(&a, KV_A_PROJ_WITH_MQA),
        &join(&ha, KV_A_PROJ_WITH_MQA),
        true,
        true,
    ));
    rows.extend(norm(&join(&a, KV_A_LAYERNORM), &join(&ha, KV_A_LAYERNORM)));
    rows.extend(column(
        &join(&a, KV_B_PROJ),
        &join(&ha, KV_B_PROJ),
        true,
        true,
    ));
    rows.extend(row(&join(&a, n::O_PROJ), &join(&ha, n::O_PROJ), true, true));
    rows.extend(norm(
        &join(l, n::POST_ATTENTION_LAYERNORM),
        &join(h, n::POST_ATTENTION_LAYERNORM),
    ));
    rows.extend(mlp(&format!("{l}.{}.Dense", n::MLP), &join(h, n::MLP)));
    rows.extend(moe(
        &format!("{l}.{}.Moe.moe", n::MLP),
        &join(h, n::MLP),
        true,
    ));
    rows
}

/// The plan of [`crate::DeepseekV3ForCausalLM`] and its shards: vocab-parallel embedding and head,
/// the decoder layers (MLA; a dense MLP or an MoE block with replicated shared experts), and MTP
/// module `j` stored as layer `num_hidden_layers + j`
/// (docs/checkpoints.md §Canonical names and sharding): `enorm`, `hnorm`, `eh_proj` and
/// `shared_head.norm` replicated, its block sharded like any decoder layer.
pub fn deepseek_v3_plan() -> ParallelPlan {
    let mut rows = embedding(n::EMBED_TOKENS, n::EMBED_TOKENS);
    rows.extend(layer(&layer_of("*"), &layer_of("{0}")));
    rows.extend(norm(n::FINAL_NORM, n::FINAL_NORM));
    rows.extend(column(n::LM_HEAD, n::LM_HEAD, false, false));
    rows.extend(mtp_rows(layer));
    ParallelPlan::new("deepseek_v3", rows)
}

impl crate::param_plan::Planned for crate::DeepseekV3ForCausalLM {
    fn parallel_plan() -> ParallelPlan {
        deepseek_v3_plan()
    }

    fn main_layers(&self) -> usize {
        self.config().num_hidden_layers
    }
}

/// The copies DeepSeek-V3's release checkpoints carry in every MTP layer `N + j`
/// (`embed_tokens.weight`, `shared_head.head.weight`: the main model's embedding and head,
/// shared, not separate parameters), `(name, source)`, for an HF export that reproduces the
/// release layout; `has` says which names the exported checkpoint holds (a tied or absent
/// `lm_head` makes the embedding the head).
pub(crate) fn mtp_export_copies(
    config: &crate::DeepseekV3Config,
    has: &dyn Fn(&str) -> bool,
) -> Vec<(String, String)> {
    mtp_copies(
        config.num_hidden_layers,
        config.num_nextn_predict_layers,
        config.tie_word_embeddings,
        has,
    )
}

/// The name-mapping rules of DeepSeek-V3 (after the shared ignores): MLA attention, shared
/// experts, router bias kept F32 on export, and MTP layers (`model.layers.{N+j}`) whose copies
/// of the embedding and the LM head are ignored (they are the main model's tensors, re-emitted
/// on export).
pub(crate) fn mapping_rules() -> Vec<Rule> {
    let (mut rules, _) = mtp_rules();
    rules.extend(n::rules_from_plan(&deepseek_v3_plan()));
    rules
}
