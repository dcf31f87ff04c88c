//! The Mixtral model's HF layout (HF `MixtralForCausalLM` as released and as transformers 5.23
//! `save_pretrained` writes it): its parallel plan and name-mapping rules, over the shared Llama-family names of [`crate::param_plan::hf_names`]. Mixtral's own
//! names: the MoE block `block_sparse_moe` (router `block_sparse_moe.gate`) and the per-expert
//! projections `w1` (gate), `w3` (up), `w2` (down). Attention has no QK-norm and no biases.

use super::{MixtralConfig, MixtralForCausalLM};
use crate::param_plan::hf_names::{self as n, ExpertProjections, join, layer};
use crate::param_plan::rows::{column, embedding, gqa, moe, norm};
use crate::param_plan::{ParallelPlan, Planned};

/// A decoder layer's MoE block (HF module and Burn field alike).
pub const BLOCK_SPARSE_MOE: &str = "block_sparse_moe";

/// The per-expert projection names of the release: `w1` gate, `w3` up, `w2` down.
pub const EXPERT_PROJECTIONS: ExpertProjections = ExpertProjections {
    gate: "w1",
    up: "w3",
    down: "w2",
};

/// The plan of [`MixtralForCausalLM`] and its shards: vocab-parallel embedding and head, GQA
/// attention (q/k/v column-, o row-parallel), every layer's MoE block with a replicated router
/// and routed experts over EP × ETP (no shared experts), per-expert names `w1`/`w3`/`w2`.
pub fn mixtral_plan() -> ParallelPlan {
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
    rows.extend(moe(
        &join(&l, BLOCK_SPARSE_MOE),
        &join(&h, BLOCK_SPARSE_MOE),
        false,
    ));
    rows.extend(norm(n::FINAL_NORM, n::FINAL_NORM));
    rows.extend(column(n::LM_HEAD, n::LM_HEAD, false, false));
    ParallelPlan::new(MixtralConfig::MODEL_TYPE, rows).with_expert_projections(EXPERT_PROJECTIONS)
}

impl Planned for MixtralForCausalLM {
    fn parallel_plan() -> ParallelPlan {
        mixtral_plan()
    }

    fn main_layers(&self) -> usize {
        self.config().num_hidden_layers
    }
}
