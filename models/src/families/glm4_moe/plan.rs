//! The GLM-4.5 MoE model's HF layout (HF `Glm4MoeForCausalLM` and the release's MTP layers):
//! its parallel plan, name-mapping rules and export copies — the shared
//! Llama-family names of [`crate::param_plan::hf_names`] (GQA attention with q/k/v biases and
//! QK-norms, as Qwen3's) plus DeepSeek-V3's MoE block and MTP layers
//! ([`crate::families::blocks::plan`]).

use moe_bridge::mapping::Rule;

use super::config::Glm4MoeConfig;
use crate::families::blocks::plan as ds;
use crate::param_plan::hf_names::{self as n, join, layer as layer_of};
use crate::param_plan::rows::{column, embedding, gqa, mlp, moe, norm};
use crate::param_plan::{ParallelPlan, PlanEntry};

/// One decoder layer at Burn path `l`, HF prefix `h`: GQA attention (q/k/v and their biases
/// column-parallel by head, `o_proj` row-parallel, QK-norms replicated), then a dense MLP or
/// DeepSeek-V3's MoE block with replicated shared experts.
fn layer(l: &str, h: &str) -> Vec<PlanEntry> {
    let mut rows = norm(&join(l, n::INPUT_LAYERNORM), &join(h, n::INPUT_LAYERNORM));
    rows.extend(gqa(&join(l, n::SELF_ATTN), &join(h, n::SELF_ATTN)));
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

/// The plan of [`super::Glm4MoeForCausalLM`] and its shards: vocab-parallel embedding and
/// head, the decoder layers, and MTP module `j` stored as layer `num_hidden_layers + j`.
pub fn glm4_moe_plan() -> ParallelPlan {
    let mut rows = embedding(n::EMBED_TOKENS, n::EMBED_TOKENS);
    rows.extend(layer(&layer_of("*"), &layer_of("{0}")));
    rows.extend(norm(n::FINAL_NORM, n::FINAL_NORM));
    rows.extend(column(n::LM_HEAD, n::LM_HEAD, false, false));
    rows.extend(ds::mtp_rows(layer));
    ParallelPlan::new(Glm4MoeConfig::MODEL_TYPE, rows)
}

impl crate::param_plan::Planned for super::Glm4MoeForCausalLM {
    fn parallel_plan() -> ParallelPlan {
        glm4_moe_plan()
    }

    fn main_layers(&self) -> usize {
        self.config().num_hidden_layers
    }
}

/// The release copies of the embedding and the LM head in every MTP layer `N + j`
/// (`(name, source)`, as DeepSeek-V3's).
pub(crate) fn mtp_export_copies(
    config: &Glm4MoeConfig,
    has: &dyn Fn(&str) -> bool,
) -> Vec<(String, String)> {
    ds::mtp_copies(
        config.num_hidden_layers,
        config.num_nextn_predict_layers,
        config.tie_word_embeddings,
        has,
    )
}

/// The name-mapping rules (after the shared ignores): the MTP copies ignored, every other HF
/// name explicit with canonical name = HF name.
pub(crate) fn mapping_rules() -> Vec<Rule> {
    let (mut rules, _) = ds::mtp_rules();
    rules.extend(n::rules_from_plan(&glm4_moe_plan()));
    rules
}
