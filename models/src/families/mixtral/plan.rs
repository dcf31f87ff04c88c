//! The Mixtral model's HF layout (HF `MixtralForCausalLM` as released and as transformers 5.23
//! `save_pretrained` writes it): its parallel plan, name-mapping rules and expected-tensor
//! table, over the shared Llama-family names of [`crate::param_plan::hf_names`]. Mixtral's own
//! names: the MoE block `block_sparse_moe` (router `block_sparse_moe.gate`) and the per-expert
//! projections `w1` (gate), `w3` (up), `w2` (down). Attention has no QK-norm and no biases.

use std::path::Path;

use moe_bridge::BridgeError;
use moe_bridge::mapping::{ExpectedBuilder as Builder, ExpectedTable, ExpertLayout};

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

/// Mixtral (`MixtralForCausalLM`): every layer's attention, norms and MoE block (router
/// `block_sparse_moe.gate`, routed experts in `layout`). `path` names the config in errors;
/// `block` is the FP8 block size of the scale companions.
pub fn mixtral_expected(
    c: &MixtralConfig,
    layout: ExpertLayout,
    path: &Path,
    block: [usize; 2],
) -> Result<ExpectedTable, BridgeError> {
    let mut b = Builder::new(path, block);
    let per_layer = 8 + 3 * c.num_local_experts as u128;
    b.bound(
        c.num_hidden_layers,
        per_layer,
        "num_hidden_layers/num_local_experts",
    )?;
    let h = c.hidden_size;
    n::expected_top_level(&mut b, c.vocab_size, h, c.tie_word_embeddings)?;
    let q = b.mul(c.num_attention_heads, c.head_dim, "num_attention_heads")?;
    let kv = b.mul(c.num_key_value_heads, c.head_dim, "num_key_value_heads")?;
    for l in 0..c.num_hidden_layers {
        let p = layer(l);
        n::expected_layer_norms(&mut b, &p, h)?;
        let attn = join(&p, n::SELF_ATTN);
        for (proj, inp, out) in [(n::Q_PROJ, h, q), (n::K_PROJ, h, kv), (n::V_PROJ, h, kv)] {
            b.linear(&join(&attn, proj), inp, out, false)?;
        }
        b.linear(&join(&attn, n::O_PROJ), q, h, false)?;
        n::expected_moe_with(
            &mut b,
            &join(&p, BLOCK_SPARSE_MOE),
            EXPERT_PROJECTIONS,
            c.num_local_experts,
            c.intermediate_size,
            h,
            layout,
        )?;
    }
    Ok(b.finish())
}
