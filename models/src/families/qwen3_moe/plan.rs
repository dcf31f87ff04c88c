//! The Qwen3-MoE model's HF layout (HF `Qwen3MoeForCausalLM`): its parallel plan,
//! name-mapping rules and expected-tensor table, over the shared Llama-family names of
//! [`crate::param_plan::hf_names`] and Qwen3's attention ([`crate::families::qwen3::plan`]).

use std::path::Path;

use moe_bridge::BridgeError;
use moe_bridge::mapping::{ExpectedBuilder as Builder, ExpectedTable, ExpertLayout};

use crate::Qwen3MoeConfig;
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

/// Qwen3-MoE (`Qwen3MoeForCausalLM`): MoE layers (router `mlp.gate` and routed experts in
/// `layout`) and the dense layers of `mlp_only_layers` / `decoder_sparse_step`.
pub fn qwen3_moe_expected(
    c: &Qwen3MoeConfig,
    layout: ExpertLayout,
    path: &Path,
    block: [usize; 2],
) -> Result<ExpectedTable, BridgeError> {
    let mut b = Builder::new(path, block);
    let per_layer = 20 + 3 * c.num_experts as u128;
    b.bound(
        c.num_hidden_layers,
        per_layer,
        "num_hidden_layers/num_experts",
    )?;
    let h = c.hidden_size;
    n::expected_top_level(&mut b, c.vocab_size, h, c.tie_word_embeddings)?;
    for l in 0..c.num_hidden_layers {
        let p = layer(l);
        n::expected_layer_norms(&mut b, &p, h)?;
        crate::families::qwen3::plan::qwen_attention(
            &mut b,
            &join(&p, n::SELF_ATTN),
            h,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.attention_bias,
        )?;
        let m = join(&p, n::MLP);
        if c.is_moe_layer(l) {
            n::expected_moe(
                &mut b,
                &m,
                c.num_experts,
                c.moe_intermediate_size,
                h,
                layout,
            )?;
        } else {
            n::expected_mlp(&mut b, &m, h, c.intermediate_size)?;
        }
    }
    Ok(b.finish())
}
