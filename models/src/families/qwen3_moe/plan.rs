//! The Qwen3-MoE model's HF layout (HF `Qwen3MoeForCausalLM`): its parallel plan and
//! name-mapping rules, over the shared Llama-family names of
//! [`crate::param_plan::hf_names`] and Qwen3's attention ([`crate::families::qwen3::plan`]).

use crate::param_plan::ParallelPlan;
use crate::param_plan::hf_names::{self as n, join, layer};
use crate::param_plan::rows::{column, embedding, gqa, mlp, moe, norm};

/// The plan of [`crate::Qwen3MoeForCausalLM`] and its shards: vocab-parallel embedding and
/// head, GQA attention (q/k/v column-, o row-parallel, QK-norms replicated), dense MLPs of
/// `mlp_only_layers` tensor-parallel, MoE blocks with a replicated router and routed experts
/// over EP × ETP (no shared experts in Qwen3-MoE).
pub fn qwen3_moe_plan() -> ParallelPlan {
    let l = layer("*");
    let h = layer("{0}");
    let mut rows = embedding(n::EMBED_TOKENS, n::EMBED_TOKENS);
    rows.extend(norm(
        &join(&l, n::INPUT_LAYERNORM),
        &join(&h, n::INPUT_LAYERNORM),
    ));
    rows.extend(gqa(&join(&l, n::SELF_ATTN), &join(&h, n::SELF_ATTN)));
    rows.extend(norm(
        &join(&l, n::POST_ATTENTION_LAYERNORM),
        &join(&h, n::POST_ATTENTION_LAYERNORM),
    ));
    rows.extend(mlp(&format!("{l}.{}.Dense", n::MLP), &join(&h, n::MLP)));
    rows.extend(moe(
        &format!("{l}.{}.Sparse.moe", n::MLP),
        &join(&h, n::MLP),
        false,
    ));
    rows.extend(norm(n::FINAL_NORM, n::FINAL_NORM));
    rows.extend(column(n::LM_HEAD, n::LM_HEAD, false, false));
    ParallelPlan::new("qwen3_moe", rows)
}

impl crate::param_plan::Planned for crate::Qwen3MoeForCausalLM {
    fn parallel_plan() -> ParallelPlan {
        qwen3_moe_plan()
    }

    fn main_layers(&self) -> usize {
        self.config().num_hidden_layers
    }
}
