//! Weights, gradients, master weights and optimizer state per GPU
//! (docs/parallelism.md §Distributed optimizer (ZeRO-1)): BF16 (or FP8 primary) weights, f32 main
//! gradients, f32 master weights and Adam moments in f32 or BF16, sharded by the distributed
//! optimizer over `dp·cp` for dense parameters and over `edp` for routed experts (ZeRO-1), or
//! replicated on every data-parallel rank without it.

use std::str::FromStr;

use moe_backend::optim::Precision;
use moe_backend::parallel::ParallelLayout;

use super::{PlanError, RankParams};

/// Precision of the Adam moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OptimizerDtype {
    /// f32 moments (4 bytes each).
    #[default]
    Fp32,
    /// BF16 moments (2 bytes each; the update still computes in f32).
    Bf16,
}

impl OptimizerDtype {
    /// Bytes of one moment element.
    pub fn moment_bytes(self) -> usize {
        match self {
            Self::Fp32 => 4,
            Self::Bf16 => 2,
        }
    }
}

impl FromStr for OptimizerDtype {
    type Err = PlanError;

    fn from_str(s: &str) -> Result<Self, PlanError> {
        match s {
            "fp32" | "f32" | "float32" => Ok(Self::Fp32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            other => Err(PlanError::Option {
                option: "optimizer-dtype",
                detail: format!("`{other}` (expected bf16 or fp32)"),
            }),
        }
    }
}

/// Precision and sharding of parameters and optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryOptions {
    /// FP8 primary weights (1 byte per parameter instead of BF16's 2).
    pub fp8_weights: bool,
    /// Adam moment precision.
    pub optimizer_dtype: OptimizerDtype,
    /// ZeRO-1 distributed optimizer.
    pub distributed_optimizer: bool,
    /// Precision of the parameters (and of the gradients the backward pass produces): BF16
    /// (Megatron's `--bf16`, the default here) holds 2 bytes per parameter, f32 4; main
    /// gradients, main weights and (unless `optimizer_dtype` says BF16) moments are f32 in both
    /// (docs/training-and-rl.md §Mixed precision (BF16)).
    pub precision: Precision,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        Self {
            fp8_weights: false,
            optimizer_dtype: OptimizerDtype::Fp32,
            distributed_optimizer: true,
            precision: Precision::Bf16,
        }
    }
}

/// Per-GPU bytes of parameters and optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StateBytes {
    /// Model weights.
    pub weights: f64,
    /// f32 main gradients.
    pub grads: f64,
    /// f32 master weights.
    pub master: f64,
    /// Adam moments.
    pub moments: f64,
}

impl StateBytes {
    /// Weights and gradients.
    pub fn weights_grads(&self) -> f64 {
        self.weights + self.grads
    }

    /// Master weights and optimizer moments.
    pub fn master_optimizer(&self) -> f64 {
        self.master + self.moments
    }

    /// Everything.
    pub fn total(&self) -> f64 {
        self.weights_grads() + self.master_optimizer()
    }
}

/// Parameter and optimizer bytes of a rank holding `params` under `layout`.
pub fn state_bytes(
    params: &RankParams,
    layout: &ParallelLayout,
    opts: &MemoryOptions,
) -> StateBytes {
    let dense = (params.dense_sharded + params.dense_replicated) as f64;
    let expert = params.expert as f64;
    let (d_dense, d_expert) = if opts.distributed_optimizer {
        ((layout.dp * layout.cp) as f64, layout.edp as f64)
    } else {
        (1.0, 1.0)
    };
    let weight_bytes = if opts.fp8_weights {
        1.0
    } else {
        opts.precision.param_bytes() as f64
    };
    let moment = 2.0 * opts.optimizer_dtype.moment_bytes() as f64;
    StateBytes {
        weights: (dense + expert) * weight_bytes,
        grads: (dense + expert) * 4.0,
        master: dense * 4.0 / d_dense + expert * 4.0 / d_expert,
        moments: dense * moment / d_dense + expert * moment / d_expert,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_parameter_follow_the_spec() {
        // docs/parallelism.md §Distributed optimizer (ZeRO-1): 6 + 12/d with f32 moments, 6 + 8/d
        // with BF16 moments.
        let layout = ParallelLayout::parse(8, "").unwrap();
        let p = RankParams {
            dense_sharded: 1000,
            dense_replicated: 0,
            expert: 0,
            buffers: 0,
        };
        let f32m = state_bytes(&p, &layout, &MemoryOptions::default());
        assert_eq!(f32m.total(), 1000.0 * (6.0 + 12.0 / 8.0));
        let bf16 = MemoryOptions {
            optimizer_dtype: OptimizerDtype::Bf16,
            ..MemoryOptions::default()
        };
        assert_eq!(
            state_bytes(&p, &layout, &bf16).total(),
            1000.0 * (6.0 + 8.0 / 8.0)
        );
        let fp8 = MemoryOptions {
            fp8_weights: true,
            ..MemoryOptions::default()
        };
        assert_eq!(state_bytes(&p, &layout, &fp8).weights, 1000.0);
        let plain = MemoryOptions {
            distributed_optimizer: false,
            ..MemoryOptions::default()
        };
        assert_eq!(state_bytes(&p, &layout, &plain).total(), 18_000.0);
        // f32 parameters: 4 bytes each instead of 2, the rest unchanged.
        let fp32 = MemoryOptions {
            precision: Precision::F32,
            ..MemoryOptions::default()
        };
        let b = state_bytes(&p, &layout, &fp32);
        assert_eq!(b.weights, 4000.0);
        assert_eq!(b.total(), 1000.0 * (8.0 + 12.0 / 8.0));
    }
}
