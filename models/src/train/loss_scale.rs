//! The trainer's side of FP16 loss scaling (Megatron-Core's `MixedPrecisionOptimizer.step`:
//! `_unscale_main_grads_and_check_for_nan`, then `grad_scaler.update(found_inf)` and a skipped
//! step on an overflow), see docs/training-and-rl.md §Mixed precision (FP16 and loss scaling).
//!
//! After the micro-batches' scaled gradients are accumulated in f32, they are unscaled
//! ([`moe_backend::optim::unscale_grads`]) and every rank learns whether any rank's hold a NaN
//! or an infinity in one collective (an all-reduce max over the world, which covers the
//! model-parallel and data-parallel groups, as Megatron's `found_inf` all-reduce). Megatron
//! unscales after the data-parallel reduction; unscaling before it is the same up to f32
//! rounding of the sums (a power-of-two factor is exact), and an infinity on any rank is found
//! either way.
//!
//! On an overflow under a dynamic scaler whose scale can still back off, the step is skipped
//! silently (nothing updated: parameters, moments, step count, learning-rate schedule, expert
//! biases) and the scaler updated. An overflow under a constant scaler, or with the scale at
//! its minimum, is a divergence: it goes to the non-finite guard
//! (`check_for_nan_in_loss_and_grad`, `skip_nonfinite_steps`) as a
//! [`moe_backend::BackendError::NonFiniteGradients`]; with the guard off it is skipped, as
//! Megatron always skips a step whose gradients overflowed.

use std::time::Instant;

use burn::optim::GradientsParams;
use moe_backend::BackendError;
use moe_backend::optim::{GradScaler, GradScalerState, unscale_grads};

use super::{StepStats, Trainer};
use crate::ModelError;
use crate::distributed::{CausalLmShard, ParallelCausalLm, err};

/// The accumulated gradients after the loss scaler's check.
pub(super) enum Unscaled {
    /// Unscaled f32 gradients, finite on every rank: the optimizer steps.
    Grads(GradientsParams),
    /// The step was skipped (overflow, or the guard's skip): its statistics.
    Skipped(StepStats),
}

impl<M: ParallelCausalLm> Trainer<M> {
    /// The loss scale of the next backward pass (1 without a scaler).
    pub(super) fn loss_scale(&self) -> f64 {
        self.grad_scaler.as_ref().map_or(1.0, GradScaler::scale)
    }

    /// The loss scaler of an FP16 run (`None` otherwise).
    pub fn grad_scaler(&self) -> Option<&GradScaler> {
        self.grad_scaler.as_ref()
    }

    /// Restores the loss scaler's state from a checkpoint (nothing to do without a scaler).
    pub fn set_grad_scaler_state(&mut self, state: &GradScalerState) -> Result<(), ModelError> {
        if let Some(scaler) = &mut self.grad_scaler {
            scaler.load_state(state)?;
        }
        Ok(())
    }

    /// Unscales `grads` and decides the step (see the module docs); without a scaler the
    /// gradients pass through untouched. A collective under a scaler: every rank calls it.
    pub(super) fn unscale(
        &mut self,
        grads: GradientsParams,
        loss_sum: f64,
        aux: f64,
        tokens: usize,
        start: Instant,
    ) -> Result<Unscaled, ModelError> {
        let Some(scaler) = self.grad_scaler.as_ref() else {
            return Ok(Unscaled::Grads(grads));
        };
        let scale = scaler.scale();
        let (grads, found_inf) = unscale_grads(self.model.model(), grads, scaler.inv_scale())?;
        let vote = self.world.vote(&[found_inf], &self.device).map_err(err)?;
        let Some(rank) = vote.first else {
            if let Some(scaler) = &mut self.grad_scaler {
                scaler.update(false);
            }
            return Ok(Unscaled::Grads(grads));
        };
        drop(grads);
        let divergence = scaler.overflow_is_divergence();
        if let Some(scaler) = &mut self.grad_scaler {
            scaler.update(true);
        }
        if divergence && self.config.check_for_nan_in_loss_and_grad {
            let refused = ModelError::Backend(BackendError::NonFiniteGradients {
                op: "loss scaler",
                norm: f64::NAN,
                rank: Some(rank),
                groups: format!(
                    "gradients at loss scale {scale} ({})",
                    if scaler_is_dynamic(self.grad_scaler.as_ref()) {
                        "the minimum: backing off cannot help"
                    } else {
                        "constant"
                    }
                ),
            });
            let mut stats = self.refuse(refused, loss_sum, tokens, start)?;
            stats.loss_scale = Some(scale);
            return Ok(Unscaled::Skipped(stats));
        }
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        Ok(Unscaled::Skipped(StepStats {
            loss: (loss_sum / tokens.max(1) as f64) as f32,
            aux_loss: aux as f32,
            mtp_loss: None,
            grad_norm: f64::NAN,
            tokens,
            tokens_per_second: tokens as f64 / secs,
            lr: self.lr(),
            skipped: true,
            loss_scale: Some(scale),
            overflow: true,
        }))
    }
}

fn scaler_is_dynamic(scaler: Option<&GradScaler>) -> bool {
    scaler.is_some_and(GradScaler::is_dynamic)
}
