//! The DeepSeek-V3 parallel plan (HF `DeepseekV3ForCausalLM`, MTP modules included).

use super::rows::{column, embedding, mlp, moe, norm, replicated, row};
use super::{ParallelPlan, PlanEntry};

/// One decoder layer at Burn path `l`, HF prefix `h`: MLA with the head-split
/// up-projections (`q_proj` or `q_b_proj`, `kv_b_proj`) column-parallel and `o_proj`
/// row-parallel, the latent down-projections (`q_a_proj`, `kv_a_proj_with_mqa`) and their
/// norms replicated; a dense MLP or an MoE block with replicated shared experts.
fn layer(l: &str, h: &str) -> Vec<PlanEntry> {
    let a = format!("{l}.self_attn");
    let ha = format!("{h}.self_attn");
    let mut rows = norm(
        &format!("{l}.input_layernorm"),
        &format!("{h}.input_layernorm"),
    );
    rows.extend(column(
        &format!("{a}.query.Direct"),
        &format!("{ha}.q_proj"),
        true,
        true,
    ));
    rows.extend(replicated(
        &format!("{a}.query.LowRank.q_a_proj"),
        &format!("{ha}.q_a_proj"),
        true,
        true,
    ));
    rows.extend(norm(
        &format!("{a}.query.LowRank.q_a_layernorm"),
        &format!("{ha}.q_a_layernorm"),
    ));
    rows.extend(column(
        &format!("{a}.query.LowRank.q_b_proj"),
        &format!("{ha}.q_b_proj"),
        true,
        true,
    ));
    rows.extend(replicated(
        &format!("{a}.kv_a_proj_with_mqa"),
        &format!("{ha}.kv_a_proj_with_mqa"),
        true,
        true,
    ));
    rows.extend(norm(
        &format!("{a}.kv_a_layernorm"),
        &format!("{ha}.kv_a_layernorm"),
    ));
    rows.extend(column(
        &format!("{a}.kv_b_proj"),
        &format!("{ha}.kv_b_proj"),
        true,
        true,
    ));
    rows.extend(row(
        &format!("{a}.o_proj"),
        &format!("{ha}.o_proj"),
        true,
        true,
    ));
    rows.extend(norm(
        &format!("{l}.post_attention_layernorm"),
        &format!("{h}.post_attention_layernorm"),
    ));
    rows.extend(mlp(&format!("{l}.mlp.Dense"), &format!("{h}.mlp")));
    rows.extend(moe(&format!("{l}.mlp.Moe.moe"), &format!("{h}.mlp"), true));
    rows
}

/// The plan of [`crate::DeepseekV3ForCausalLM`] and its shards: vocab-parallel embedding
/// and head, the decoder layers (MLA; a dense MLP or an MoE block with replicated shared
/// experts), and MTP module `j` stored as layer
/// `num_hidden_layers + j` (checkpoints.md §3): `enorm`, `hnorm`, `eh_proj` and
/// `shared_head.norm` replicated, its block sharded like any decoder layer.
pub fn deepseek_v3_plan() -> ParallelPlan {
    let mut rows = embedding("model.embed_tokens", "model.embed_tokens");
    rows.extend(layer("model.layers.*", "model.layers.{0}"));
    rows.extend(norm("model.norm", "model.norm"));
    rows.extend(column("lm_head", "lm_head", false, false));
    let m = "mtp.*";
    let h = "model.layers.{0+L}";
    rows.extend(norm(&format!("{m}.enorm"), &format!("{h}.enorm")));
    rows.extend(norm(&format!("{m}.hnorm"), &format!("{h}.hnorm")));
    rows.extend(replicated(
        &format!("{m}.eh_proj"),
        &format!("{h}.eh_proj"),
        false,
        false,
    ));
    rows.extend(layer(&format!("{m}.block"), h));
    rows.extend(norm(
        &format!("{m}.shared_head_norm"),
        &format!("{h}.shared_head.norm"),
    ));
    ParallelPlan::new("deepseek_v3", rows)
}

impl super::Planned for crate::DeepseekV3ForCausalLM {
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
    let (embed, lm_head) = ("model.embed_tokens.weight", "lm_head.weight");
    let head = if config.tie_word_embeddings || !has(lm_head) {
        embed
    } else {
        lm_head
    };
    (0..config.num_nextn_predict_layers)
        .flat_map(|j| {
            let layer = format!("model.layers.{}", config.num_hidden_layers + j);
            [
                (format!("{layer}.embed_tokens.weight"), embed.to_owned()),
                (format!("{layer}.shared_head.head.weight"), head.to_owned()),
            ]
        })
        .collect()
}
