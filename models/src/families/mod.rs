//! Model families: one trait ([`Family`]) and one list ([`visit_family`], [`MODEL_TYPES`]).
//!
//! A family is its config type (serde, HF field names), its model (a [`ShardModel`]: a
//! [`DecoderStack`](crate::distributed::DecoderStack) with a parallel plan), its HF names and
//! expected tensors, and hooks only where it really differs. Everything above (HF loading and
//! export, checkpoints, the trainer, RL, rollout, weight sync, the `moe` CLI) reaches a family
//! through this trait: tools that pick the model from `config.json` at run time hold a
//! type-erased [`ModelConfig`](crate::ModelConfig) / [`AnyCausalLm`](crate::AnyCausalLm) and
//! get the family's static types back with a [`FamilyVisitor`]. Adding a family is its folder
//! and one line in the list at the bottom of this file (torchtitan's one registration per
//! model; Megatron-Core's one `GPTModel` built from a spec).

pub mod blocks;
pub mod deepseek_v3;
pub mod expected;
pub mod glm4_moe;
pub mod gpt_oss;
pub mod mixtral;
pub mod qwen3;
pub mod qwen3_moe;
mod shard_rule;

/// The families' main types (and their modules), re-exported at the crate root.
pub mod prelude {
    pub use super::blocks::mtp;
    pub use super::deepseek_v3::{self, DeepseekV3Config, DeepseekV3ForCausalLM};
    pub use super::qwen3::{self, Qwen3Config, Qwen3ForCausalLM};
    pub use super::qwen3_moe::{self, Qwen3MoeConfig, Qwen3MoeForCausalLM};
}

pub use shard_rule::shard_rule;

use std::path::Path;

use burn::tensor::{Int, Tensor};
use moe_bridge::BridgeError;
use moe_bridge::mapping::{ExpectedTable, ExpertLayout, Rule};

use crate::ModelError;
use crate::causal_lm::{CausalLm, LmLosses, ParamCount, causal_lm_loss};
pub use crate::config::{ConfigSizes, FamilyConfig};
use crate::distributed::{
    ParallelContext, PipelineModel, RouterTrace, ShardModel, StackLogits, StackShape,
};
use crate::layers::KvCache;
use crate::layers::rope::RotaryEmbedding;
use crate::packing::SequenceLayout;
use crate::param_plan::hf_names;
use crate::routing::ReplaySpec;

/// A model family (see the module docs).
pub trait Family: Send + Sync + 'static {
    /// HF `model_type` (also the checkpoints' and plans' family name).
    const MODEL_TYPE: &'static str;
    /// HF architecture class (`config.json` `architectures[0]`).
    const ARCHITECTURE: &'static str;
    /// The parsed `config.json`.
    type Config: FamilyConfig;
    /// The model: the whole model at `world = 1` and one rank's shard under any layout.
    type Model: ShardModel<Config = Self::Config> + CausalLm + Send + Sync + 'static;

    /// The name-mapping rules from HF checkpoint names to canonical names (moe-bridge's
    /// engine; ignored HF-only tensors shared by every family are added in front). The
    /// default: read off the plan rows ([`hf_names::rules_from_plan`]); a family adds only
    /// what no row spells (the ignores of tensors its release repeats, release layouts).
    fn mapping_rules() -> Vec<Rule> {
        hf_names::rules_from_plan(&<Self::Model as crate::param_plan::Planned>::parallel_plan())
    }

    /// The HF tensors `config` implies (name, shape, role), with the optional FP8
    /// `*_scale_inv` companions of block size `block`; `path` names the config in errors.
    /// The default derives them from the family's model and plan
    /// ([`expected::derive_expected`]): a family writes no table.
    fn expected_tensors(
        config: &Self::Config,
        layout: ExpertLayout,
        path: &Path,
        block: [usize; 2],
    ) -> Result<ExpectedTable, BridgeError> {
        expected::derive_expected::<Self>(config, layout, path, block)
    }

    /// Where the family's release may store canonical tensor `hf_name` (of canonical shape
    /// `canonical`) as an MXFP4 pair (`<name>_blocks`, `<name>_scales`): the shape of the
    /// matrix its blocks decode to ([`ExpectedHf::mxfp4`](moe_bridge::mapping::ExpectedHf)).
    /// `None` (the default): the release stores no MXFP4 tensors.
    fn release_mxfp4(hf_name: &str, canonical: &[usize]) -> Option<Vec<usize>> {
        let _ = (hf_name, canonical);
        None
    }

    /// Tensors an export writes twice, `(copy, source)` (DeepSeek-V3's MTP layers repeat the
    /// embedding and head); `has` says whether the source exists. None by default.
    fn export_copies(config: &Self::Config, has: &dyn Fn(&str) -> bool) -> Vec<(String, String)> {
        let _ = (config, has);
        Vec::new()
    }

    /// The dimensions the planner's memory, activation and communication models read
    /// (`moe plan`); `None` (the default) for a family the planner does not plan.
    fn model_shape(config: &Self::Config) -> Option<crate::param_plan::ModelShape> {
        let _ = config;
        None
    }

    /// The dense family (`model_type`) whose checkpoints upcycle into this one (`moe upcycle`,
    /// docs/checkpoints.md §Upcycling); `None` (the default) for a family nothing upcycles into.
    const UPCYCLED_FROM: Option<&'static str> = None;

    /// This family's `config.json` for the dense `source` config (of family
    /// [`UPCYCLED_FROM`](Family::UPCYCLED_FROM)) upcycled to `moe`: the dense fields copied, the
    /// MoE fields set. `None` (the default) for a family nothing upcycles into.
    fn upcycled_config(source: &serde_json::Value, moe: UpcycledMoe) -> Option<serde_json::Value> {
        let _ = (source, moe);
        None
    }

    /// Logits of `input_ids [B, S]` and the losses HF reports for `labels` (`[B, S]`, −100
    /// ignored, shifted inside). The default: cross-entropy only (families whose HF loss adds
    /// a load-balancing term override it).
    fn hf_losses(
        model: &Self::Model,
        input_ids: Tensor<2, Int>,
        labels: &[i64],
    ) -> Result<(Tensor<3>, LmLosses), ModelError> {
        let logits = local_logits(model, input_ids)?;
        let loss = causal_lm_loss(logits.clone(), labels)?;
        Ok((
            logits,
            LmLosses {
                loss,
                aux_loss: None,
            },
        ))
    }
}

/// The MoE sizes of an upcycled model ([`Family::upcycled_config`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpcycledMoe {
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub topk: usize,
    /// Each expert's FFN width (the dense width over the granularity).
    pub moe_intermediate: usize,
    /// Routing weights renormalised over the top-k (post-softmax routing).
    pub norm_topk_prob: bool,
}

/// Shape-only parameter counts of family `F`'s model of `config`, read off the family's own
/// lazily built model (nothing is allocated) by its plan: `total` every parameter of the main
/// model, `active` with the routed experts (plan rows split over EP, their biases included)
/// at `k / E`, `mtp` the
/// MTP modules' parameters as a release stores them (their layers and the copies of the
/// embedding and head, [`Family::export_copies`]).
pub fn param_count<F: Family>(config: &F::Config) -> Result<ParamCount, ModelError> {
    use crate::param_plan::hf_names::stage_place;
    use moe_bridge::dist::{ShardRule, StagePlace};
    let template = <F::Model as ShardModel>::template(config, &burn::tensor::Device::flex())?;
    let plan = <F::Model as crate::param_plan::Planned>::parallel_plan();
    let main = config.num_layers();
    let (experts, k) = config.experts().unwrap_or((1, 1));
    let (experts, k) = (experts.max(1) as u64, k as u64);
    let mut count = ParamCount::default();
    let mut sizes = std::collections::HashMap::new();
    for (path, numel) in crate::param_plan::param_numels(&template) {
        let resolved = plan.resolve(&path, main)?;
        let n = numel as u64;
        let mtp = matches!(stage_place(&resolved.hf_name), StagePlace::Layer(l) if l >= main);
        let split = resolved.entry.split;
        sizes.insert(resolved.hf_name, n);
        if mtp {
            count.mtp += n;
            continue;
        }
        count.total += n;
        count.active += match split {
            ShardRule::Expert { .. } | ShardRule::ExpertReplicated => n * k / experts,
            _ => n,
        };
    }
    for (_, source) in F::export_copies(config, &|name| sizes.contains_key(name)) {
        count.mtp += sizes.get(&source).copied().unwrap_or(0);
    }
    Ok(count)
}

/// The parallel plan of the family whose `model_type` is `model_type` (`None`: no family has
/// it); only that family's plan is built.
pub fn plan_of(model_type: &str) -> Option<crate::param_plan::ParallelPlan> {
    struct Plan;
    impl FamilyVisitor for Plan {
        type Output = crate::param_plan::ParallelPlan;
        fn visit<F: Family>(self) -> Self::Output {
            <F::Model as crate::param_plan::Planned>::parallel_plan()
        }
    }
    visit_family(model_type, Plan)
}

/// Logits `[B, S, V]` of `input_ids [B, S]` through the whole model `model` on its
/// single-rank context (positions `0..S`, no cache).
pub fn local_logits<M: ShardModel>(
    model: &M,
    input_ids: Tensor<2, Int>,
) -> Result<Tensor<3>, ModelError> {
    Ok(local_run(model, input_ids, None, None, None)?.0.logits)
}

/// The single-rank forward of the whole model `model`: its parallel forward on the `world = 1`
/// context ([`local_context`]), after the positions in `cache` or of a packed/padded batch
/// with `layout`; `replay` forces every MoE layer's experts (per MoE layer, [`crate::replay`]).
/// Returns the logits with the final-normed hidden rows, and the routers' trace (router
/// logits, selected experts and their weights, in layer order).
pub fn local_run<M: ShardModel>(
    model: &M,
    input_ids: Tensor<2, Int>,
    layout: Option<&SequenceLayout>,
    cache: Option<&mut KvCache>,
    replay: Option<Vec<Tensor<2, Int>>>,
) -> Result<(StackLogits, RouterTrace), ModelError> {
    let ctx = local_context::<M>(model.model_config())?;
    let mut trace = RouterTrace::recording(1.0, replay);
    let out = ctx.logits(model, input_ids, layout, cache, &mut trace)?;
    Ok((out, trace))
}

/// The routing a replay in a model of family `F` and `config` must match: every MoE layer
/// ([`FamilyConfig::is_moe_layer`]) and MTP layer (every MTP module's decoder layer routes),
/// top-k and the routed experts; `None` for a dense family.
pub fn replay_spec<F: Family>(config: &F::Config) -> Option<ReplaySpec> {
    let (num_experts, topk) = config.experts()?;
    let layers = config.num_layers();
    Some(ReplaySpec {
        model_type: F::MODEL_TYPE,
        moe_layers: (0..layers).filter(|&i| config.is_moe_layer(i)).collect(),
        mtp_layers: (layers..layers + config.mtp_layers()).collect(),
        topk,
        num_experts,
    })
}

/// What the parallel context needs from a family's `config` whose attention rotates with
/// `rope`: its layers, MTP depths, tied head, hidden and vocabulary sizes and routed experts.
pub fn stack_shape<C: FamilyConfig>(config: &C, rope: RotaryEmbedding) -> StackShape {
    StackShape {
        pipeline: PipelineModel {
            layers: config.num_layers(),
            mtp: config.mtp_layers(),
            tied: config.tie_word_embeddings(),
            hidden: config.hidden_size(),
        },
        num_experts: config.experts().map(|(e, _)| e),
        vocab_size: config.vocab_size(),
        rope,
    }
}

/// The parallel context of a model of `config` at `world = 1` (identity collectives, local
/// dispatcher): the single-rank forward is the parallel forward on it.
pub fn local_context<M: ShardModel>(config: &M::Config) -> Result<ParallelContext, ModelError> {
    let shape = M::stack_shape(config)?;
    ParallelContext::local(shape.num_experts, shape.vocab_size, shape.rope)
}

/// Code generic over a family, run for a family picked at run time ([`visit_family`]).
pub trait FamilyVisitor {
    /// What the visit returns.
    type Output;
    /// Runs for family `F`.
    fn visit<F: Family>(self) -> Self::Output;
}

/// The list of families: [`MODEL_TYPES`] and [`visit_family`].
macro_rules! families {
    ($($family:ty),+ $(,)?) => {
        /// The HF `model_type` of every family, in list order.
        pub const MODEL_TYPES: &[&str] = &[$(<$family as Family>::MODEL_TYPE),+];

        /// Every family's parallel plan, in list order.
        pub fn plans() -> Vec<crate::param_plan::ParallelPlan> {
            vec![$(<<$family as Family>::Model as crate::param_plan::Planned>::parallel_plan()),+]
        }

        /// The MoE `config.json` of the dense `source` config of family `dense_model_type`
        /// upcycled to `moe`, with the target family's `model_type`; `None` when no family
        /// upcycles from `dense_model_type` ([`upcycle_sources`] lists those that do).
        pub fn upcycled_config(
            dense_model_type: &str,
            source: &serde_json::Value,
            moe: UpcycledMoe,
        ) -> Option<(&'static str, serde_json::Value)> {
            $(
                if <$family as Family>::UPCYCLED_FROM == Some(dense_model_type)
                    && let Some(config) = <$family as Family>::upcycled_config(source, moe)
                {
                    return Some((<$family as Family>::MODEL_TYPE, config));
                }
            )+
            None
        }

        /// The dense `model_type`s some family upcycles from, in list order.
        pub fn upcycle_sources() -> Vec<&'static str> {
            let all = [$(<$family as Family>::UPCYCLED_FROM),+];
            all.into_iter().flatten().collect()
        }

        /// Runs `visitor` for the family whose `model_type` is `model_type`; `None` when no
        /// family has it.
        pub fn visit_family<V: FamilyVisitor>(model_type: &str, visitor: V) -> Option<V::Output> {
            $(
                if model_type == <$family as Family>::MODEL_TYPE {
                    return Some(visitor.visit::<$family>());
                }
            )+
            None
        }
    };
}

families!(
    qwen3::Qwen3,
    qwen3_moe::Qwen3Moe,
    deepseek_v3::DeepseekV3,
    glm4_moe::Glm4Moe,
    mixtral::Mixtral,
    gpt_oss::GptOss,
);
