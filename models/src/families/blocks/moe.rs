//! DeepSeek-V3's MoE block: its module types and its config values, shared by every family that
//! routes like
//! it (HF transformers 5.23 `DeepseekV3TopkRouter` / `DeepseekV3MoE` and their copies): the
//! checks of the routing fields and moe-backend's [`MoeLayerConfig`] (docs/models.md
//! §DeepSeek-V3 router, §DeepSeek-V3 MoE block).

use burn::module::Module;
use burn::tensor::{Int, Tensor};
use moe_backend::layer::{MoeLayer, MoeLayerConfig};
use moe_backend::router::{GroupLimitConfig, ScoreFunction, TopKRouterConfig};

use crate::ModelError;
use crate::layers::Mlp;

/// The routing and expert fields of a DeepSeek-V3-style MoE block, by their HF names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SigmoidGroupMoe {
    /// Hidden size `H`.
    pub hidden_size: usize,
    /// Routed experts `E`.
    pub n_routed_experts: usize,
    /// Experts per token `k`.
    pub num_experts_per_tok: usize,
    /// Expert groups.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Multiplies the routing weights.
    pub routed_scaling_factor: f64,
    /// Renormalise the selected sigmoid scores.
    pub norm_topk_prob: bool,
    /// Width `Im` of each routed expert.
    pub moe_intermediate_size: usize,
    /// Shared experts (their MLP width is `Im · n_shared_experts`; 0: none).
    pub n_shared_experts: usize,
}

impl SigmoidGroupMoe {
    /// Checks the fields (errors name the field): positive sizes, `n_group | E`, at least 2
    /// experts a group (the group score sums the top 2), `topk_group ≤ n_group`, `k` within
    /// the kept groups, a positive finite `routed_scaling_factor`.
    pub fn validate(&self) -> Result<(), ModelError> {
        for (field, value) in [
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
        ] {
            if value == 0 {
                return Err(ModelError::invalid(field, "must be positive, got 0"));
            }
        }
        let e = self.n_routed_experts;
        if !e.is_multiple_of(self.n_group) {
            return Err(ModelError::invalid(
                "n_group",
                format!("{} does not divide n_routed_experts = {e}", self.n_group),
            ));
        }
        let per_group = e / self.n_group;
        if self.topk_group > self.n_group || per_group < 2 {
            return Err(ModelError::invalid(
                "topk_group",
                format!(
                    "needs topk_group ≤ n_group = {} and ≥ 2 experts per group (group score \
                     sums the top 2), got topk_group {} with {per_group} per group",
                    self.n_group, self.topk_group
                ),
            ));
        }
        if self.num_experts_per_tok > self.topk_group * per_group {
            return Err(ModelError::invalid(
                "num_experts_per_tok",
                format!(
                    "{} exceeds the {} experts of the kept groups",
                    self.num_experts_per_tok,
                    self.topk_group * per_group
                ),
            ));
        }
        if !(self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0) {
            return Err(ModelError::invalid(
                "routed_scaling_factor",
                format!(
                    "must be a positive number, got {}",
                    self.routed_scaling_factor
                ),
            ));
        }
        Ok(())
    }

    /// The moe-backend layer: sigmoid scores, group-limited top-k (`group_score_topk = 2`),
    /// the expert bias (`e_score_correction_bias`) for the selection only, renormalisation
    /// (`norm_topk_prob`) and scaling, shared experts of width `Im · n_shared_experts`.
    pub fn layer_config(&self) -> Result<MoeLayerConfig, ModelError> {
        if self.norm_topk_prob && self.num_experts_per_tok == 1 {
            // HF renormalises a single weight to 1; moe-backend normalises only for k > 1.
            return Err(ModelError::invalid(
                "norm_topk_prob",
                "renormalising a single routed expert (num_experts_per_tok = 1) is not supported",
            ));
        }
        let router = TopKRouterConfig::new(
            self.hidden_size,
            self.n_routed_experts,
            self.num_experts_per_tok,
        )
        .with_score_function(ScoreFunction::Sigmoid)
        .with_normalize(self.norm_topk_prob)
        .with_topk_scaling_factor(Some(self.routed_scaling_factor))
        .with_group_limit(Some(GroupLimitConfig::new(
            self.n_group,
            self.topk_group,
            2,
        )))
        .with_enable_expert_bias(true);
        let shared = (self.n_shared_experts > 0)
            .then_some(self.moe_intermediate_size * self.n_shared_experts);
        Ok(MoeLayerConfig::new(router, self.moe_intermediate_size)
            .with_shared_ffn_hidden_size(shared))
    }
}

/// Routing decisions of one MoE layer (HF `DeepseekV3TopkRouter` outputs and their copies).
#[derive(Debug, Clone)]
pub struct MoeRouting {
    /// `[T, E]` f32 router logits.
    pub router_logits: Tensor<2>,
    /// `[T, k]` selected experts (descending selection score).
    pub topk_indices: Tensor<2, Int>,
    /// `[T, k]` routing weights of `topk_indices` (normalised, scaled).
    pub topk_weights: Tensor<2>,
}

/// HF `DeepseekV3MoE` (and its copies): router `gate`, routed `experts`, `shared_experts`.
#[derive(Module, Debug)]
pub struct MoeBlock {
    /// Router (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`), experts
    /// (`mlp.experts.*`) and shared experts (`mlp.shared_experts.*`).
    pub moe: MoeLayer,
}

/// The feed-forward part of a decoder layer.
// One value per layer: the size difference between variants is immaterial, and boxing would
// hide the module from Burn's derive.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum MoeFeedForward {
    /// Dense SwiGLU MLP (e.g. `layer < first_k_dense_replace`).
    Dense(Mlp),
    /// MoE block.
    Moe(MoeBlock),
}

impl MoeFeedForward {
    /// The MoE block's layer (`None`: a dense MLP).
    pub fn moe(&self) -> Option<&MoeLayer> {
        match self {
            Self::Moe(block) => Some(&block.moe),
            Self::Dense(_) => None,
        }
    }

    /// The MoE block's layer, mutably.
    pub fn moe_mut(&mut self) -> Option<&mut MoeLayer> {
        match self {
            Self::Moe(block) => Some(&mut block.moe),
            Self::Dense(_) => None,
        }
    }

    /// The dense MLP (`None`: an MoE block).
    pub fn dense(&self) -> Option<&Mlp> {
        match self {
            Self::Dense(mlp) => Some(mlp),
            Self::Moe(_) => None,
        }
    }

    /// The dense MLP, mutably.
    pub fn dense_mut(&mut self) -> Option<&mut Mlp> {
        match self {
            Self::Dense(mlp) => Some(mlp),
            Self::Moe(_) => None,
        }
    }
}
