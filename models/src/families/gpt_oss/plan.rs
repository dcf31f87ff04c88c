//! The gpt-oss model's HF layout (HF `GptOssForCausalLM` as released and as transformers 5.23
//! `save_pretrained` writes it): its parallel plan, name-mapping rules and the MXFP4 test of
//! its expected table (`is_mxfp4_expert`), over the shared Llama-family names of [`crate::param_plan::hf_names`].
//!
//! gpt-oss's own names: the learned sinks `self_attn.sinks [nh]`, the router
//! `mlp.router.{weight,bias}`, and the routed experts stored fused per layer in the release
//! layout (transformers `GptOssExperts`): `mlp.experts.gate_up_proj [E, H, 2I]` (input-major,
//! gate / up interleaved on the last dim), `gate_up_proj_bias [E, 2I]` (interleaved),
//! `down_proj [E, I, H]`, `down_proj_bias [E, H]`. The canonical tensors (checkpoints,
//! resharding, weight sync) are the project's stacked layout under the same names; the plan's
//! [`ReleaseLayout`]s convert at the HF boundary (loading, export). The release stores
//! `gate_up_proj` / `down_proj` as MXFP4 (`*_blocks`, `*_scales`, the rows of the
//! output-major `[E, out, in]` matrix in blocks of 32 along `in`).

use moe_backend::optim::ParamClass;
use moe_bridge::dist::ShardRule;
use moe_bridge::mapping::Rule;

use super::{GptOssConfig, GptOssForCausalLM};
use crate::param_plan::hf_names::{self as n, join, layer};
use crate::param_plan::rows::{column, embedding, gqa, norm, replicated};
use crate::param_plan::{
    GradClass, Mxfp4Release, ParallelPlan, PlanEntry, Planned, ReleaseLayout, Storage,
};

/// The attention sinks inside `self_attn` (HF and Burn alike).
pub const SINKS: &str = "sinks";
/// The router inside `mlp`.
pub const ROUTER: &str = "router";
/// The fused gate/up projection's bias inside `mlp.experts`.
pub const GATE_UP_PROJ_BIAS: &str = "gate_up_proj_bias";
/// The down projection's bias inside `mlp.experts`.
pub const DOWN_PROJ_BIAS: &str = "down_proj_bias";

fn row(
    module: String,
    hf: String,
    storage: Storage,
    split: ShardRule,
    class: ParamClass,
) -> PlanEntry {
    PlanEntry {
        module,
        hf,
        storage,
        split,
        grad: GradClass::Param(class),
        fp8: false,
    }
}

/// The plan of [`GptOssForCausalLM`] and its shards: vocab-parallel embedding and head, GQA
/// attention with biases (q/k/v column-, o row-parallel, the `o_proj` bias added once after
/// the reduction) and sinks split by head, the biased router replicated, routed experts and
/// their biases over EP × ETP (the `fc2` bias replicated over ETP, added by one rank).
pub fn gpt_oss_plan() -> ParallelPlan {
    let l = layer("*");
    let h = layer("{0}");
    let mut rows = embedding(n::EMBED_TOKENS, n::EMBED_TOKENS);
    rows.extend(norm(
        &join(&l, n::INPUT_LAYERNORM),
        &join(&h, n::INPUT_LAYERNORM),
    ));
    let (attn, hf_attn) = (join(&l, n::SELF_ATTN), join(&h, n::SELF_ATTN));
    rows.extend(gqa(&attn, &hf_attn));
    rows.push(row(
        join(&attn, SINKS),
        join(&hf_attn, SINKS),
        Storage::Same,
        ShardRule::Tp { dim: 0 },
        ParamClass::DenseTpSharded,
    ));
    rows.extend(norm(
        &join(&l, n::POST_ATTENTION_LAYERNORM),
        &join(&h, n::POST_ATTENTION_LAYERNORM),
    ));
    let (mlp, hf_mlp) = (join(&l, n::MLP), join(&h, n::MLP));
    rows.extend(replicated(
        &join(&mlp, ROUTER),
        &join(&hf_mlp, ROUTER),
        true,
        false,
    ));
    // The router weight is stored `[E, H]` as Burn's `TopKRouter` holds it.
    if let Some(w) = rows
        .iter_mut()
        .rev()
        .find(|r| r.module.ends_with("router.weight"))
    {
        w.storage = Storage::Same;
    }
    let (ex, hf_ex) = (join(&mlp, n::EXPERTS), join(&hf_mlp, n::EXPERTS));
    let expert = ParamClass::Expert;
    rows.push(PlanEntry {
        fp8: true,
        ..row(
            join(&ex, "fc1"),
            n::stacked_gate_up(&hf_ex),
            Storage::GatedExperts,
            ShardRule::Expert { etp_dim: 2 },
            expert,
        )
    });
    rows.push(PlanEntry {
        fp8: true,
        ..row(
            join(&ex, "fc2"),
            n::stacked_down(&hf_ex),
            Storage::Same,
            ShardRule::Expert { etp_dim: 2 },
            expert,
        )
    });
    rows.push(row(
        join(&ex, "fc1_bias"),
        join(&hf_ex, GATE_UP_PROJ_BIAS),
        Storage::GatedExperts,
        ShardRule::Expert { etp_dim: 2 },
        expert,
    ));
    rows.push(row(
        join(&ex, "fc2_bias"),
        join(&hf_ex, DOWN_PROJ_BIAS),
        Storage::Same,
        ShardRule::ExpertReplicated,
        ParamClass::ExpertTpReplicated,
    ));
    rows.extend(norm(n::FINAL_NORM, n::FINAL_NORM));
    rows.extend(column(n::LM_HEAD, n::LM_HEAD, false, false));
    let experts = join(&h, &join(n::MLP, n::EXPERTS));
    ParallelPlan::new(GptOssConfig::MODEL_TYPE, rows)
        .with_release_layouts(vec![
            (
                n::stacked_gate_up(&experts),
                ReleaseLayout::InterleavedGateUp,
            ),
            (
                join(&experts, GATE_UP_PROJ_BIAS),
                ReleaseLayout::InterleavedGateUpBias,
            ),
            (n::stacked_down(&experts), ReleaseLayout::InputMajorExperts),
            (join(&experts, DOWN_PROJ_BIAS), ReleaseLayout::Stacked),
        ])
        .with_mxfp4_release(Mxfp4Release {
            tensors: vec![n::stacked_gate_up(&experts), n::stacked_down(&experts)],
            modules_to_not_convert: MXFP4_NOT_CONVERTED.map(str::to_owned).to_vec(),
        })
}

/// The modules the gpt-oss release leaves unquantised (its `quantization_config`).
const MXFP4_NOT_CONVERTED: [&str; 4] = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
];

impl Planned for GptOssForCausalLM {
    fn parallel_plan() -> ParallelPlan {
        gpt_oss_plan()
    }

    fn main_layers(&self) -> usize {
        self.config().num_hidden_layers
    }
}

/// The four attention projections (with biases).
const ATTENTION_PROJS: [&str; 4] = [n::Q_PROJ, n::K_PROJ, n::V_PROJ, n::O_PROJ];

/// The name-mapping rules of gpt-oss (after the shared ignores): every HF name explicit,
/// canonical name = HF name (the experts' release layout is the plan's business); MXFP4
/// blocks and scales are decoded on load.
pub(crate) fn mapping_rules() -> Vec<Rule> {
    let mut rules = vec![
        Rule::ignore("**_blocks", "MXFP4 codes, decoded on load"),
        Rule::ignore("**_scales", "MXFP4 block scales, decoded on load"),
    ];
    rules.extend(n::top_level_rules());
    rules.extend(n::per_layer(n::layer_norm_suffixes()));
    rules.extend(n::per_layer(n::attention_suffixes(&ATTENTION_PROJS, true)));
    rules.extend(n::per_layer([join(n::SELF_ATTN, SINKS)]));
    let router = join(n::MLP, ROUTER);
    rules.extend(n::per_layer([n::weight(&router), join(&router, "bias")]));
    let experts = join(n::MLP, n::EXPERTS);
    rules.extend(n::per_layer([
        n::stacked_gate_up(&experts),
        join(&experts, GATE_UP_PROJ_BIAS),
        n::stacked_down(&experts),
        join(&experts, DOWN_PROJ_BIAS),
    ]));
    rules
}

/// Whether canonical tensor `name` is a layer's routed experts' `gate_up_proj` or
/// `down_proj`, which the release stores as MXFP4 (`*_blocks`, `*_scales`).
pub(crate) fn is_mxfp4_expert(name: &str) -> bool {
    n::split_stacked(name)
        .is_some_and(|(experts, _)| experts.ends_with(&format!(".{}", n::EXPERTS)))
}
