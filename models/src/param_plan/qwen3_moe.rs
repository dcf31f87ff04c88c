//! The Qwen3-MoE parallel plan (HF `Qwen3MoeForCausalLM`).

use super::ParallelPlan;
use super::rows::{column, embedding, gqa, mlp, moe, norm};

/// The plan of [`crate::Qwen3MoeForCausalLM`] and its shards: vocab-parallel embedding and
/// head, GQA attention (q/k/v column-, o row-parallel, QK-norms replicated), dense MLPs of
/// `mlp_only_layers` tensor-parallel, MoE blocks with a replicated router and routed experts
/// over EP × ETP (no shared experts in Qwen3-MoE).
pub fn qwen3_moe_plan() -> ParallelPlan {
    let l = "model.layers.*";
    let h = "model.layers.{0}";
    let mut rows = embedding("model.embed_tokens", "model.embed_tokens");
    rows.extend(norm(
        &format!("{l}.input_layernorm"),
        &format!("{h}.input_layernorm"),
    ));
    rows.extend(gqa(&format!("{l}.self_attn"), &format!("{h}.self_attn")));
    rows.extend(norm(
        &format!("{l}.post_attention_layernorm"),
        &format!("{h}.post_attention_layernorm"),
    ));
    rows.extend(mlp(&format!("{l}.mlp.Dense"), &format!("{h}.mlp")));
    rows.extend(moe(
        &format!("{l}.mlp.Sparse.moe"),
        &format!("{h}.mlp"),
        false,
    ));
    rows.extend(norm("model.norm", "model.norm"));
    rows.extend(column("lm_head", "lm_head", false, false));
    ParallelPlan::new("qwen3_moe", rows)
}

impl super::Planned for crate::Qwen3MoeForCausalLM {
    fn parallel_plan() -> ParallelPlan {
        qwen3_moe_plan()
    }

    fn main_layers(&self) -> usize {
        self.config().num_hidden_layers
    }
}
