//! The dense Qwen3 model's HF layout (HF `Qwen3ForCausalLM`): its parallel plan and name-mapping
//! rules, over the shared Llama-family names of [`crate::param_plan::hf_names`]
//! plus Qwen3's own QK-norms (`self_attn.q_norm`, `self_attn.k_norm`).

use crate::param_plan::ParallelPlan;
use crate::param_plan::hf_names::{self as n, join, layer};
use crate::param_plan::rows::{column, embedding, gqa, mlp, norm};

pub use crate::param_plan::hf_names::K_NORM;
pub use crate::param_plan::hf_names::Q_NORM;

/// The plan of [`crate::Qwen3ForCausalLM`] and its shards: vocab-parallel embedding and
/// head, GQA attention (q/k/v column-, o row-parallel, QK-norms replicated), SwiGLU MLPs
/// tensor-parallel, norms replicated.
pub fn qwen3_plan() -> ParallelPlan {
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
    rows.extend(mlp(&join(&l, n::MLP), &join(&h, n::MLP)));
    rows.extend(norm(n::FINAL_NORM, n::FINAL_NORM));
    rows.extend(column(n::LM_HEAD, n::LM_HEAD, false, false));
    ParallelPlan::new("qwen3", rows)
}

impl crate::param_plan::Planned for crate::Qwen3ForCausalLM {
    fn parallel_plan() -> ParallelPlan {
        qwen3_plan()
    }

    fn main_layers(&self) -> usize {
        self.config().num_hidden_layers
    }
}
