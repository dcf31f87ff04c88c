//! The dense Qwen3 parallel plan (HF `Qwen3ForCausalLM`).

use super::ParallelPlan;
use super::rows::{column, embedding, gqa, mlp, norm};

/// The plan of [`crate::Qwen3ForCausalLM`] and its shards: vocab-parallel embedding and
/// head, GQA attention (q/k/v column-, o row-parallel, QK-norms replicated), SwiGLU MLPs
/// tensor-parallel, norms replicated.
pub fn qwen3_plan() -> ParallelPlan {
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
    rows.extend(mlp(&format!("{l}.mlp"), &format!("{h}.mlp")));
    rows.extend(norm("model.norm", "model.norm"));
    rows.extend(column("lm_head", "lm_head", false, false));
    ParallelPlan::new("qwen3", rows)
}

impl super::Planned for crate::Qwen3ForCausalLM {
    fn parallel_plan() -> ParallelPlan {
        qwen3_plan()
    }

    fn main_layers(&self) -> usize {
        self.config().num_hidden_layers
    }
}
