//! Expert MLPs: [`GroupedExperts`] (all routed experts of a rank as grouped GEMMs, Megatron-Core
//! `TEGroupedMLP`) and [`SharedExperts`] (a dense SwiGLU applied to every token),
//! docs/routing-and-dispatch.md §Experts, §Shared experts. The optional per-expert biases and the
//! clamped SwiGLU follow transformers 5.23 `GptOssExperts`; [`layout`] converts its fused,
//! interleaved `gate_up_proj` to and from `fc1`.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::activation::{gelu, sigmoid, silu};
use burn::tensor::{Device, Int, Tensor};

use crate::error::BackendError;
use crate::fp8::{Fp8Recipe, fp8_grouped_matmul};
use crate::ops::{
    GroupSizes, WeightLayout, clamped_swiglu_with_probs, grouped_matmul, swiglu_with_probs,
    usize_to_int_tensor,
};

pub mod layout;

/// gpt-oss's default `swiglu_alpha` (transformers `GptOssConfig`).
pub const CLAMPED_SWIGLU_ALPHA: f64 = 1.702;
/// gpt-oss's default `swiglu_limit` (transformers `GptOssConfig`).
pub const CLAMPED_SWIGLU_LIMIT: f64 = 7.0;

/// Activation of the expert FFN.
#[derive(Config, Debug, Copy, PartialEq)]
pub enum ExpertActivation {
    /// Gated SiLU: `fc1` rows are `[gate; up]`, `z = silu(gate) ⊙ up`.
    SwiGlu,
    /// gpt-oss's clamped SwiGLU (transformers `GptOssExperts._apply_gate`): `fc1` rows are
    /// `[gate; up]`, `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`,
    /// `z = (u + 1) ⊙ g ⊙ σ(alpha·g)`; the gradient is zero where a value is clamped.
    /// [`ExpertActivation::clamped_swiglu`] gives the released defaults.
    ClampedSwiGlu {
        /// `swiglu_alpha`, the sigmoid's slope (gpt-oss: 1.702).
        alpha: f64,
        /// `swiglu_limit`, the clamp bound (gpt-oss: 7.0); finite and > 0.
        limit: f64,
    },
    /// Plain SiLU on `fc1`'s output.
    Silu,
    /// Plain (erf) GELU on `fc1`'s output.
    Gelu,
}

impl ExpertActivation {
    /// gpt-oss's clamped SwiGLU with its defaults ([`CLAMPED_SWIGLU_ALPHA`],
    /// [`CLAMPED_SWIGLU_LIMIT`]).
    pub fn clamped_swiglu() -> Self {
        Self::ClampedSwiGlu {
            alpha: CLAMPED_SWIGLU_ALPHA,
            limit: CLAMPED_SWIGLU_LIMIT,
        }
    }

    /// Whether `fc1` produces a gate and an up half.
    pub fn is_gated(self) -> bool {
        matches!(self, Self::SwiGlu | Self::ClampedSwiGlu { .. })
    }

    /// Checks the activation's parameters (the clamped SwiGLU's `alpha` finite, `limit` finite
    /// and > 0); the error names the `activation` field.
    pub fn validate(self) -> crate::Result<()> {
        if let Self::ClampedSwiGlu { alpha, limit } = self
            && (!alpha.is_finite() || !limit.is_finite() || limit <= 0.0)
        {
            return Err(BackendError::Config {
                field: "activation",
                detail: format!(
                    "the clamped SwiGLU needs a finite alpha ({alpha}) and a finite limit > 0 \
                     ({limit})"
                ),
            });
        }
        Ok(())
    }
}

/// Configuration of [`GroupedExperts`].
#[derive(Config, Debug)]
pub struct GroupedExpertsConfig {
    /// Experts held by this module (`L`, local experts).
    pub num_experts: usize,
    /// Hidden size `H`.
    pub hidden_size: usize,
    /// Expert FFN width `F` (`moe_ffn_hidden_size`).
    pub ffn_hidden_size: usize,
    /// Activation.
    #[config(default = "ExpertActivation::SwiGlu")]
    pub activation: ExpertActivation,
    /// Add per-expert biases: `fc1_bias [L, 2F]` (`[L, F]` ungated) and `fc2_bias [L, H]`
    /// (transformers `GptOssExperts.gate_up_proj_bias` / `down_proj_bias`).
    #[config(default = false)]
    pub bias: bool,
    /// Standard deviation of the normal weight initialisation.
    #[config(default = 0.02)]
    pub init_std: f64,
    /// Run fc1 and fc2 as FP8 grouped GEMMs with this blockwise recipe (docs/fp8.md §Recipes);
    /// `None` keeps them in the parameters' precision.
    #[config(default = "None")]
    pub fp8: Option<Fp8Recipe>,
}

impl GroupedExpertsConfig {
    /// Builds the module, validating sizes.
    pub fn init(&self, device: &Device) -> crate::Result<GroupedExperts> {
        self.validate()?;
        let (l, h, f) = (self.num_experts, self.hidden_size, self.ffn_hidden_size);
        let fc1_out = self.fc1_out();
        let init = Initializer::Normal {
            mean: 0.0,
            std: self.init_std,
        };
        Ok(GroupedExperts {
            fc1: init.init([l, fc1_out, h], device),
            fc2: init.init([l, h, f], device),
            fc1_bias: self
                .bias
                .then(|| Initializer::Zeros.init([l, fc1_out], device)),
            fc2_bias: self.bias.then(|| Initializer::Zeros.init([l, h], device)),
            adds_fc2_bias: true,
            activation: self.activation,
            fp8: self.fp8,
        })
    }

    /// Validates the configuration and builds the experts around given parameters (e.g. loaded
    /// from a checkpoint) instead of [`init`](Self::init)'s: `fc1 [L, 2F, H]` (`[L, F, H]`
    /// ungated) with rows `[gate; up]`, `fc2 [L, H, F]`, and the biases `fc1_bias [L, 2F]` /
    /// `fc2_bias [L, H]` iff [`bias`](Self::bias). A parameter of the wrong shape, or a bias
    /// given but not configured (or configured but not given), is a [`BackendError::Config`]
    /// naming it. Nothing is initialised.
    pub fn init_with_params(
        &self,
        fc1: Param<Tensor<3>>,
        fc2: Param<Tensor<3>>,
        fc1_bias: Option<Param<Tensor<2>>>,
        fc2_bias: Option<Param<Tensor<2>>>,
    ) -> crate::Result<GroupedExperts> {
        self.validate()?;
        let (l, h, f) = (self.num_experts, self.hidden_size, self.ffn_hidden_size);
        let fc1_out = self.fc1_out();
        for (field, dims, want) in [
            ("fc1", fc1.dims().to_vec(), vec![l, fc1_out, h]),
            ("fc2", fc2.dims().to_vec(), vec![l, h, f]),
        ] {
            if dims != want {
                return Err(BackendError::Config {
                    field,
                    detail: format!("has shape {dims:?}, expected {want:?}"),
                });
            }
        }
        for (field, param, want) in [
            ("fc1_bias", &fc1_bias, [l, fc1_out]),
            ("fc2_bias", &fc2_bias, [l, h]),
        ] {
            match param {
                Some(p) if p.dims() != want => {
                    return Err(BackendError::Config {
                        field,
                        detail: format!("has shape {:?}, expected {want:?}", p.dims()),
                    });
                }
                Some(_) if !self.bias => {
                    return Err(BackendError::Config {
                        field,
                        detail: "given but `bias` is not configured".into(),
                    });
                }
                None if self.bias => {
                    return Err(BackendError::Config {
                        field,
                        detail: "`bias` is configured but the tensor is not given".into(),
                    });
                }
                _ => {}
            }
        }
        Ok(GroupedExperts {
            fc1,
            fc2,
            fc1_bias,
            fc2_bias,
            adds_fc2_bias: true,
            activation: self.activation,
            fp8: self.fp8,
        })
    }

    /// Rows of `fc1` per expert: `2F` gated, `F` otherwise.
    fn fc1_out(&self) -> usize {
        if self.activation.is_gated() {
            2 * self.ffn_hidden_size
        } else {
            self.ffn_hidden_size
        }
    }

    fn validate(&self) -> crate::Result<()> {
        for (field, v) in [
            ("num_experts", self.num_experts),
            ("hidden_size", self.hidden_size),
            ("ffn_hidden_size", self.ffn_hidden_size),
        ] {
            if v == 0 {
                return Err(BackendError::Config {
                    field,
                    detail: "must be positive".into(),
                });
            }
        }
        self.activation.validate()
    }
}

/// The routed experts of one rank, computed with grouped GEMMs over expert-major rows.
///
/// Weights use PyTorch orientation (`[out, in]`), stacked over experts: `fc1 [L, 2F, H]` with rows
/// `[gate (F); up (F)]` for SwiGLU, `fc2 [L, H, F]`. Probabilities are applied after the activation
/// and before `fc2` (docs/routing-and-dispatch.md §Experts, step 4).
#[derive(Module, Debug)]
pub struct GroupedExperts {
    /// `[L, 2F, H]` (gated) or `[L, F, H]`.
    pub fc1: Param<Tensor<3>>,
    /// `[L, H, F]`.
    pub fc2: Param<Tensor<3>>,
    /// Optional `[L, 2F]` / `[L, F]` fc1 bias.
    pub fc1_bias: Option<Param<Tensor<2>>>,
    /// Optional `[L, H]` fc2 bias (scaled by the routing prob,
    /// docs/routing-and-dispatch.md §Experts, step 5).
    pub fc2_bias: Option<Param<Tensor<2>>>,
    /// Whether this module adds `fc2_bias`'s value to its output: always for unsharded experts
    /// and on expert-tensor-parallel rank 0 of a shard ([`GroupedExperts::shard`]). The ETP
    /// ranks' partial `fc2` outputs are summed by the combine, so the bias enters the sum once
    /// (Megatron's row-parallel bias, added after the reduction). The other ranks add a zero
    /// that carries the bias's gradient: every ETP rank gets the full gradient of its
    /// replicated `fc2_bias` (the ranks see the same rows and the same upstream gradient), and
    /// the routing probs get the bias's contribution once.
    #[module(skip)]
    pub adds_fc2_bias: bool,
    /// Activation.
    #[module(skip)]
    pub activation: ExpertActivation,
    /// FP8 recipe of the expert GEMMs (`None`: the parameters' precision). Only fc1/fc2 are
    /// quantised; biases, the activation and the probs stay in high precision
    /// (docs/fp8.md §Selective precision).
    #[module(skip)]
    pub fp8: Option<Fp8Recipe>,
}

impl GroupedExperts {
    /// Number of experts `L`.
    pub fn num_experts(&self) -> usize {
        self.fc1.dims()[0]
    }

    /// Expert FFN width `F`.
    pub fn ffn_hidden_size(&self) -> usize {
        self.fc2.dims()[2]
    }

    /// The same experts with their GEMMs in FP8 (`Some(recipe)`) or high precision (`None`).
    pub fn with_fp8(mut self, recipe: Option<Fp8Recipe>) -> crate::Result<Self> {
        if let Some(r) = &recipe {
            r.validate()?;
        }
        self.fp8 = recipe;
        Ok(self)
    }

    /// Runs every expert on its segment of `rows [N, H]` (expert-major, `tokens_per_expert`
    /// rows each) with per-row routing weights `probs [N]`; returns `[N, H]`.
    pub fn forward(
        &self,
        rows: Tensor<2>,
        tokens_per_expert: &[usize],
        probs: Tensor<1>,
    ) -> crate::Result<Tensor<2>> {
        self.forward_recomputing(rows, tokens_per_expert, probs, false)
    }

    /// [`forward`](Self::forward); with `recompute_activation` the activation and `fc2` run
    /// again in the backward pass (Megatron's `moe_act` recompute), so the activation output
    /// `fc2` would keep for its weight gradient is not held between the passes.
    pub fn forward_recomputing(
        &self,
        rows: Tensor<2>,
        tokens_per_expert: &[usize],
        probs: Tensor<1>,
        recompute_activation: bool,
    ) -> crate::Result<Tensor<2>> {
        let [n, h] = rows.dims();
        let l = self.num_experts();
        if tokens_per_expert.len() != l {
            return Err(BackendError::Shape {
                op: "GroupedExperts::forward",
                detail: format!("{} token counts for {l} experts", tokens_per_expert.len()),
            });
        }
        if probs.dims() != [n] {
            return Err(BackendError::Shape {
                op: "GroupedExperts::forward",
                detail: format!("probs have shape {:?}, expected [{n}]", probs.dims()),
            });
        }
        if h != self.fc1.dims()[2] {
            return Err(BackendError::Shape {
                op: "GroupedExperts::forward",
                detail: format!(
                    "rows have hidden size {h}, experts expect {}",
                    self.fc1.dims()[2]
                ),
            });
        }
        self.check_biases()?;
        self.activation.validate()?;
        let device = rows.device();
        let mut hidden = match &self.fp8 {
            Some(recipe) => fp8_grouped_matmul(rows, self.fc1.val(), tokens_per_expert, recipe)?,
            None => grouped_matmul(
                rows,
                self.fc1.val(),
                &GroupSizes::Host(tokens_per_expert.to_vec()),
                WeightLayout::OutIn,
            )?,
        };
        if let Some(b) = &self.fc1_bias {
            hidden = hidden + b.val().select(0, row_experts(tokens_per_expert, &device)?);
        }
        if !recompute_activation {
            return self.activation_fc2(hidden, probs, tokens_per_expert);
        }
        // One region input: the fc1 output with the probs as an extra column.
        let w = hidden.dims()[1];
        let packed = Tensor::cat(vec![hidden, probs.reshape([n, 1])], 1);
        let sizes = tokens_per_expert.to_vec();
        crate::recompute::try_recompute_module(self, packed, move |m: &Self, p: Tensor<2>| {
            let hidden = p.clone().narrow(1, 0, w);
            let probs = p.narrow(1, w, 1).reshape([n]);
            m.activation_fc2(hidden, probs, &sizes)
        })
    }

    /// The activation (with the routing probs applied after it,
    /// docs/routing-and-dispatch.md §Experts, step 4), `fc2` and its bias on the `fc1` output
    /// `hidden [N, 2F]` of the rows grouped by `tokens_per_expert`.
    fn activation_fc2(
        &self,
        hidden: Tensor<2>,
        probs: Tensor<1>,
        tokens_per_expert: &[usize],
    ) -> crate::Result<Tensor<2>> {
        let n = hidden.dims()[0];
        let device = hidden.device();
        let sizes = GroupSizes::Device(Box::new(usize_to_int_tensor(tokens_per_expert, &device)?));
        let p = probs.clone().reshape([n, 1]);
        let z = match self.activation {
            ExpertActivation::SwiGlu => swiglu_with_probs(hidden, probs)?,
            ExpertActivation::ClampedSwiGlu { alpha, limit } => {
                clamped_swiglu_with_probs(hidden, probs, alpha, limit)?
            }
            ExpertActivation::Silu => silu(hidden) * p.clone(),
            ExpertActivation::Gelu => gelu(hidden) * p.clone(),
        };
        let mut out = match &self.fp8 {
            Some(recipe) => fp8_grouped_matmul(z, self.fc2.val(), tokens_per_expert, recipe)?,
            None => grouped_matmul(z, self.fc2.val(), &sizes, WeightLayout::OutIn)?,
        };
        if let Some(b) = &self.fc2_bias {
            let b = b.val();
            if self.adds_fc2_bias {
                out = out + b.select(0, row_experts(tokens_per_expert, &device)?) * p;
            } else if b.is_require_grad() {
                // `b − b` is exactly zero: nothing is added, the gradient reaches the bias.
                let rows = b.select(0, row_experts(tokens_per_expert, &device)?);
                out = out + (rows.clone() - rows.detach()) * p.detach();
            }
        }
        Ok(out)
    }

    /// The biases' shapes against the weights' (`fc1_bias [L, fc1 rows]`, `fc2_bias [L, H]`).
    fn check_biases(&self) -> crate::Result<()> {
        let [l, fc1_out, h] = self.fc1.dims();
        for (field, dims, want) in [
            (
                "fc1_bias",
                self.fc1_bias.as_ref().map(|b| b.dims()),
                [l, fc1_out],
            ),
            ("fc2_bias", self.fc2_bias.as_ref().map(|b| b.dims()), [l, h]),
        ] {
            if let Some(dims) = dims
                && dims != want
            {
                return Err(BackendError::Config {
                    field,
                    detail: format!("has shape {dims:?}, expected {want:?}"),
                });
            }
        }
        Ok(())
    }
}

/// The group (local expert) of every row of rows grouped by `tokens_per_expert`, for the
/// per-expert biases.
fn row_experts(tokens_per_expert: &[usize], device: &Device) -> crate::Result<Tensor<1, Int>> {
    let ids: Vec<usize> = tokens_per_expert
        .iter()
        .enumerate()
        .flat_map(|(e, &c)| std::iter::repeat_n(e, c))
        .collect();
    usize_to_int_tensor(&ids, device)
}

/// Configuration of [`SharedExperts`].
#[derive(Config, Debug)]
pub struct SharedExpertsConfig {
    /// Hidden size `H`.
    pub hidden_size: usize,
    /// FFN width (`moe_ffn_hidden_size · n_shared_experts`).
    pub ffn_hidden_size: usize,
    /// Scale the output by `sigmoid(x · g)` with a learned `g [1, H]` (Qwen2-MoE style).
    #[config(default = false)]
    pub gate: bool,
}

impl SharedExpertsConfig {
    /// Builds the module.
    pub fn init(&self, device: &Device) -> crate::Result<SharedExperts> {
        if self.hidden_size == 0 || self.ffn_hidden_size == 0 {
            return Err(BackendError::Config {
                field: "ffn_hidden_size",
                detail: "shared expert sizes must be positive".into(),
            });
        }
        let (h, f) = (self.hidden_size, self.ffn_hidden_size);
        let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        Ok(SharedExperts {
            gate_proj: linear(h, f),
            up_proj: linear(h, f),
            down_proj: linear(f, h),
            gate: self.gate.then(|| linear(h, 1)),
        })
    }
}

/// Dense SwiGLU MLP applied to every token and added to the routed output
/// (docs/routing-and-dispatch.md §Shared experts): `y = down(silu(gate(x)) ⊙ up(x))`, optionally
/// `y ⊙= sigmoid(x · g)`.
#[derive(Module, Debug)]
pub struct SharedExperts {
    /// `H -> F` gate projection.
    pub gate_proj: Linear,
    /// `H -> F` up projection.
    pub up_proj: Linear,
    /// `F -> H` down projection.
    pub down_proj: Linear,
    /// Optional `H -> 1` output gate.
    pub gate: Option<Linear>,
}

impl SharedExperts {
    /// `x [T, H] -> [T, H]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let z = silu(self.gate_proj.forward(x.clone())) * self.up_proj.forward(x.clone());
        let y = self.down_proj.forward(z);
        match &self.gate {
            Some(g) => y * sigmoid(g.forward(x)),
            None => y,
        }
    }
}

mod shard;

#[cfg(test)]
mod tests;
