//! [`TopKRouterConfig`] and its validation (docs/routing-and-dispatch.md, from §Score functions
//! and top-k to §Aux-loss-free expert bias).

use burn::config::Config;
use burn::module::{Initializer, Param};
use burn::tensor::{DType, Device, FloatDType, Tensor};

use super::TopKRouter;
use super::scoring::{ScoreFunction, ScoreSpec};
use crate::error::{BackendError, Result as BackendResult};

/// Which tokens are dropped first when an expert exceeds its capacity
/// (docs/routing-and-dispatch.md §Capacity, dropping and padding).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum DropPolicy {
    /// Keep the `cap` largest `probs[:, e]` (ties → lower token index).
    Probs,
    /// Keep the first `cap` routed tokens in ascending token index.
    Position,
}

/// Load-balancing loss types (docs/routing-and-dispatch.md §Load-balancing losses and z-loss).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum AuxLossType {
    /// Switch loss over the micro-batch (`aux_loss`).
    Aux,
    /// Mean over sequences of the per-sequence switch loss (`seq_aux_loss`).
    SeqAux,
    /// Switch loss with counts averaged over the micro-batches of a global batch
    /// (`global_aux_loss`).
    GlobalAux,
}

impl AuxLossType {
    /// Megatron's configuration name of the loss type.
    pub fn name(self) -> &'static str {
        match self {
            Self::Aux => "aux_loss",
            Self::SeqAux => "seq_aux_loss",
            Self::GlobalAux => "global_aux_loss",
        }
    }
}

/// One enabled load-balancing loss and its coefficient.
#[derive(Config, Debug, PartialEq)]
pub struct AuxLossSpec {
    /// Loss type.
    pub kind: AuxLossType,
    /// Coefficient (`moe_aux_loss_coeff`); 0 disables the loss.
    pub coeff: f64,
}

/// Group-limited top-k (docs/routing-and-dispatch.md §Group-limited top-k): experts are split into
/// `num_groups` equal groups and every token picks its experts from its `group_topk` best groups.
#[derive(Config, Debug, PartialEq, Eq)]
pub struct GroupLimitConfig {
    /// `G`, the number of expert groups (`E % G == 0`).
    pub num_groups: usize,
    /// `g`, groups kept per token (`1 ≤ g ≤ G`).
    pub group_topk: usize,
    /// `m`, experts summed per group for the group score (`1 ≤ m ≤ E/G`). Megatron uses
    /// `k / g`, DeepSeek-V3 (HF and official code) uses 2; there is no default on purpose.
    pub group_score_topk: usize,
}

/// Configuration of a [`TopKRouter`] (Megatron's `moe_router_*` options,
/// docs/routing-and-dispatch.md).
#[derive(Config, Debug)]
pub struct TopKRouterConfig {
    /// `H`, the hidden size of the router input.
    pub hidden_size: usize,
    /// `E`, the number of routed experts.
    pub num_experts: usize,
    /// `k`, experts selected per token.
    pub topk: usize,
    /// Score function applied to the logits.
    #[config(default = "ScoreFunction::Softmax")]
    pub score_function: ScoreFunction,
    /// Softmax over all experts before the top-k (no renormalisation). Ignored by the sigmoid
    /// and sqrt-softplus score functions (DeepSeek-style configurations set it anyway).
    #[config(default = false)]
    pub pre_softmax: bool,
    /// Renormalise sigmoid / sqrt-softplus probs over the selected `k` (for `k > 1`).
    #[config(default = true)]
    pub normalize: bool,
    /// Multiplies the selected probs (`moe_router_topk_scaling_factor`).
    pub topk_scaling_factor: Option<f64>,
    /// Group-limited routing (docs/routing-and-dispatch.md §Group-limited top-k).
    pub group_limit: Option<GroupLimitConfig>,
    /// Aux-loss-free load balancing: a per-expert selection bias
    /// (docs/routing-and-dispatch.md §Aux-loss-free expert bias). Only valid with the sigmoid and
    /// sqrt-softplus score functions.
    #[config(default = false)]
    pub enable_expert_bias: bool,
    /// Expert-bias update rate (`bias += rate · sign(mean(c) − c)`).
    #[config(default = 1e-3)]
    pub expert_bias_update_rate: f64,
    /// Capacity factor `cf`; `None` or a negative value means dropless
    /// (docs/routing-and-dispatch.md §Capacity, dropping and padding).
    pub capacity_factor: Option<f64>,
    /// Which tokens are dropped at capacity.
    #[config(default = "DropPolicy::Probs")]
    pub drop_policy: DropPolicy,
    /// Pad every expert to exactly `cap` rows (requires a capacity factor).
    #[config(default = false)]
    pub pad_to_capacity: bool,
    /// Lower bound on the capacity.
    pub min_capacity: Option<usize>,
    /// Load-balancing losses, any combination of the three types, each at most once.
    #[config(default = "Vec::new()")]
    pub aux_losses: Vec<AuxLossSpec>,
    /// z-loss coefficient (`moe_z_loss_coeff`); `None` or 0 disables it.
    pub z_loss_coeff: Option<f64>,
    /// Per-token-loss mode (`calculate_per_token_loss`): attached losses are pre-multiplied by
    /// `valid_tokens · tp_cp_size`
    /// (docs/routing-and-dispatch.md §Load-balancing losses and z-loss).
    #[config(default = false)]
    pub per_token_loss: bool,
    /// dtype of the router math; the input, weight and bias are cast to it.
    #[config(default = "FloatDType::F32")]
    pub router_dtype: FloatDType,
    /// Adds a gating bias `[E]` (`logits = x·Wᵀ + b`).
    #[config(default = false)]
    pub bias: bool,
    /// Standard deviation of the normal initialisation of the gating weight.
    #[config(default = 0.02)]
    pub init_std: f64,
    /// `|tp_cp|`: ranks whose rows share aux-loss counts (1 on a single rank).
    #[config(default = 1)]
    pub tp_cp_size: usize,
    /// `|tp_dp_cp|`: ranks whose rows share global-aux-loss counts (1 on a single rank).
    #[config(default = 1)]
    pub tp_dp_cp_size: usize,
}

fn config_err(field: &'static str, detail: String) -> BackendError {
    BackendError::Config { field, detail }
}

fn check_finite(field: &'static str, value: f64, min: f64) -> BackendResult<()> {
    if !value.is_finite() || value < min {
        return Err(config_err(
            field,
            format!("{value} must be finite and ≥ {min}"),
        ));
    }
    Ok(())
}

impl TopKRouterConfig {
    /// Coefficient of a load-balancing loss type (0 when it is not enabled).
    pub fn aux_coeff(&self, kind: AuxLossType) -> f64 {
        self.aux_losses
            .iter()
            .find(|s| s.kind == kind)
            .map_or(0.0, |s| s.coeff)
    }

    /// Whether any load-balancing loss has a non-zero coefficient.
    pub fn has_aux_loss(&self) -> bool {
        self.aux_losses.iter().any(|s| s.coeff != 0.0)
    }

    /// The effective capacity factor: `None` when dropless (unset or negative).
    pub fn effective_capacity_factor(&self) -> Option<f64> {
        self.capacity_factor.filter(|cf| *cf >= 0.0)
    }

    /// The score-function part of the configuration.
    pub fn score_spec(&self) -> ScoreSpec {
        ScoreSpec {
            function: self.score_function,
            pre_softmax: self.pre_softmax,
            normalize: self.normalize,
            scaling_factor: self.topk_scaling_factor,
        }
    }

    /// Checks every rule of docs/routing-and-dispatch.md, from §Score functions and top-k to
    /// §Aux-loss-free expert bias; the error names the offending field.
    pub fn validate(&self) -> BackendResult<()> {
        let (e, k) = (self.num_experts, self.topk);
        if self.hidden_size == 0 {
            return Err(config_err("hidden_size", "must be ≥ 1".into()));
        }
        if e == 0 {
            return Err(config_err("num_experts", "must be ≥ 1".into()));
        }
        if k == 0 || k > e {
            return Err(config_err("topk", format!("k = {k} must be in 1..={e}")));
        }
        let softmax = self.score_function == ScoreFunction::Softmax;
        if softmax && !self.pre_softmax && k == 1 {
            return Err(config_err(
                "pre_softmax",
                "post-softmax routing with k = 1 gives probs identically 1; use pre_softmax".into(),
            ));
        }
        if let Some(s) = self.topk_scaling_factor
            && (!s.is_finite() || s <= 0.0)
        {
            return Err(config_err(
                "topk_scaling_factor",
                format!("{s} must be finite and > 0"),
            ));
        }
        if let Some(g) = &self.group_limit {
            validate_group_limit(g, e, k)?;
        }
        if self.enable_expert_bias && softmax {
            return Err(config_err(
                "enable_expert_bias",
                "the expert bias needs the sigmoid or sqrtsoftplus score function".into(),
            ));
        }
        check_finite("expert_bias_update_rate", self.expert_bias_update_rate, 0.0)?;
        if let Some(cf) = self.capacity_factor
            && cf.is_nan()
        {
            return Err(config_err("capacity_factor", "is NaN".into()));
        }
        if self.pad_to_capacity && self.effective_capacity_factor().is_none() {
            return Err(config_err(
                "pad_to_capacity",
                "padding to capacity requires a non-negative capacity_factor".into(),
            ));
        }
        for (i, spec) in self.aux_losses.iter().enumerate() {
            check_finite("aux_losses", spec.coeff, 0.0)?;
            if self.aux_losses[..i].iter().any(|s| s.kind == spec.kind) {
                return Err(config_err(
                    "aux_losses",
                    format!("{} is listed twice", spec.kind.name()),
                ));
            }
        }
        if let Some(z) = self.z_loss_coeff {
            check_finite("z_loss_coeff", z, 0.0)?;
        }
        if !matches!(
            self.router_dtype,
            FloatDType::F32 | FloatDType::F64 | FloatDType::BF16 | FloatDType::F16
        ) {
            return Err(config_err(
                "router_dtype",
                format!(
                    "{:?} is not supported (use F32, F64, BF16 or F16)",
                    self.router_dtype
                ),
            ));
        }
        check_finite("init_std", self.init_std, 0.0)?;
        if self.tp_cp_size == 0 {
            return Err(config_err("tp_cp_size", "must be ≥ 1".into()));
        }
        if !self.tp_dp_cp_size.is_multiple_of(self.tp_cp_size) || self.tp_dp_cp_size == 0 {
            return Err(config_err(
                "tp_dp_cp_size",
                format!(
                    "{} must be a non-zero multiple of tp_cp_size {}",
                    self.tp_dp_cp_size, self.tp_cp_size
                ),
            ));
        }
        Ok(())
    }

    /// Validates the configuration and creates the router: gating weight `[E, H]` drawn from
    /// `N(0, init_std²)`, optional zero bias `[E]`, zero expert bias `[E]` (f32, no gradient).
    pub fn init(&self, device: &Device) -> BackendResult<TopKRouter> {
        self.validate()?;
        let (e, h) = (self.num_experts, self.hidden_size);
        let weight = Initializer::Normal {
            mean: 0.0,
            std: self.init_std,
        }
        .init_with([e, h], Some(h), Some(e), device);
        let bias = self
            .bias
            .then(|| Initializer::Zeros.init_with([e], Some(h), Some(e), device));
        let expert_bias = self.enable_expert_bias.then(|| {
            Param::from_tensor(Tensor::<1>::zeros([e], (device, DType::F32)))
                .set_require_grad(false)
        });
        Ok(TopKRouter {
            weight,
            bias,
            expert_bias,
            config: self.clone(),
        })
    }
}

impl TopKRouterConfig {
    /// Validates the configuration and builds the router around given parameters (e.g. loaded
    /// from a checkpoint) instead of [`init`](Self::init)'s: gating weight `[E, H]`, the
    /// optional gating bias `[E]` (iff [`bias`](Self::bias)) and the f32 expert bias `[E]`
    /// (iff [`enable_expert_bias`](Self::enable_expert_bias); no gradient). Nothing is
    /// initialised.
    pub fn init_with_params(
        &self,
        weight: Param<Tensor<2>>,
        bias: Option<Param<Tensor<1>>>,
        expert_bias: Option<Param<Tensor<1>>>,
    ) -> BackendResult<TopKRouter> {
        self.validate()?;
        let (e, h) = (self.num_experts, self.hidden_size);
        if weight.dims() != [e, h] {
            return Err(config_err(
                "weight",
                format!("has shape {:?}, expected [{e}, {h}]", weight.dims()),
            ));
        }
        for (field, param, wanted) in [
            ("bias", &bias, self.bias),
            ("expert_bias", &expert_bias, self.enable_expert_bias),
        ] {
            match param {
                Some(p) if p.dims() != [e] => {
                    return Err(config_err(
                        field,
                        format!("has shape {:?}, expected [{e}]", p.dims()),
                    ));
                }
                Some(_) if !wanted => {
                    return Err(config_err(field, "given but not configured".into()));
                }
                None if wanted => return Err(config_err(field, "configured but not given".into())),
                _ => {}
            }
        }
        Ok(TopKRouter {
            weight,
            bias,
            expert_bias: expert_bias.map(|b| b.set_require_grad(false)),
            config: self.clone(),
        })
    }
}

fn validate_group_limit(g: &GroupLimitConfig, e: usize, k: usize) -> BackendResult<()> {
    let field = "group_limit";
    if g.num_groups == 0 || !e.is_multiple_of(g.num_groups) {
        return Err(config_err(
            field,
            format!(
                "num_groups = {} must divide num_experts = {e}",
                g.num_groups
            ),
        ));
    }
    let per_group = e / g.num_groups;
    if g.group_topk == 0 || g.group_topk > g.num_groups {
        return Err(config_err(
            field,
            format!(
                "group_topk = {} must be in 1..={}",
                g.group_topk, g.num_groups
            ),
        ));
    }
    if g.group_score_topk == 0 || g.group_score_topk > per_group {
        return Err(config_err(
            field,
            format!(
                "group_score_topk = {} must be in 1..={per_group}",
                g.group_score_topk
            ),
        ));
    }
    if k > g.group_topk * per_group {
        return Err(config_err(
            field,
            format!(
                "topk = {k} exceeds the {} experts of {} kept groups",
                g.group_topk * per_group,
                g.group_topk
            ),
        ));
    }
    Ok(())
}
