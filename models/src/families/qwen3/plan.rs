//! The dense Qwen3 model's HF layout (HF `Qwen3ForCausalLM`): its parallel plan, name-mapping
//! rules and expected-tensor table, over the shared Llama-family names of [`crate::param_plan::hf_names`]
//! plus Qwen3's own QK-norms (`self_attn.q_norm`, `self_attn.k_norm`).

use std::path::Path;

use moe_bridge::BridgeError;
use moe_bridge::mapping::{ExpectedBuilder as Builder, ExpectedTable};

use crate::Qwen3Config;
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

/// Qwen-style attention: `q/k/v/o_proj` (biases with `attention_bias`) and `q_norm`/`k_norm`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qwen_attention(
    b: &mut Builder<'_>,
    prefix: &str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    bias: bool,
) -> Result<(), BridgeError> {
    let q = b.mul(heads, head_dim, "num_attention_heads")?;
    let kv = b.mul(kv_heads, head_dim, "num_key_value_heads")?;
    b.linear(&join(prefix, n::Q_PROJ), hidden, q, bias)?;
    b.linear(&join(prefix, n::K_PROJ), hidden, kv, bias)?;
    b.linear(&join(prefix, n::V_PROJ), hidden, kv, bias)?;
    b.linear(&join(prefix, n::O_PROJ), q, hidden, bias)?;
    b.norm(&join(prefix, Q_NORM), head_dim)?;
    b.norm(&join(prefix, K_NORM), head_dim)
}

/// Dense Qwen3 (`Qwen3ForCausalLM`). `path` names the config in errors; `block` is the FP8
/// block size of the scale companions.
pub fn qwen3_expected(
    c: &Qwen3Config,
    path: &Path,
    block: [usize; 2],
) -> Result<ExpectedTable, BridgeError> {
    let mut b = Builder::new(path, block);
    b.bound(c.num_hidden_layers, 16, "num_hidden_layers")?;
    let h = c.hidden_size;
    n::expected_top_level(&mut b, c.vocab_size, h, c.tie_word_embeddings)?;
    for l in 0..c.num_hidden_layers {
        let p = layer(l);
        n::expected_layer_norms(&mut b, &p, h)?;
        qwen_attention(
            &mut b,
            &join(&p, n::SELF_ATTN),
            h,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.attention_bias,
        )?;
        n::expected_mlp(&mut b, &join(&p, n::MLP), h, c.intermediate_size)?;
    }
    Ok(b.finish())
}
