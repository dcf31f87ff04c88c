//! The complete actor objective: policy loss, entropy bonus and KL loss.

use burn::tensor::Tensor;

use super::correction::{
    RolloutCorrection, RolloutCorrectionMetrics, RolloutCorrectionOutput, correction_named,
};
use super::kl::{KlEstimator, kl_penalty};
use super::loss::{
    GspoConfig, LossAgg, PolicyLossOutput, PpoConfig, aggregate, gspo_token_losses,
    ppo_token_losses,
};
use super::mask::{ResponseMask, read_scalar};
use crate::ModelError;

/// Which clipped policy loss an objective uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PolicyLoss {
    /// [`ppo_loss`](super::ppo_loss).
    Ppo(PpoConfig),
    /// [`gspo_loss`](super::gspo_loss).
    Gspo(GspoConfig),
}

impl PolicyLoss {
    /// The aggregation mode, shared by the entropy and KL terms.
    pub fn agg(&self) -> LossAgg {
        match self {
            Self::Ppo(c) => c.agg,
            Self::Gspo(c) => c.agg,
        }
    }

    /// The policy loss with its per-token losses multiplied by constant `weights` (detached,
    /// cast to the dtype of `logprobs`; verl's `pg_losses * rollout_is_weights`) before
    /// aggregation; without weights, [`ppo_loss`](super::ppo_loss) or
    /// [`gspo_loss`](super::gspo_loss).
    ///
    /// Errors as those, or if `weights` has another shape than the mask.
    pub fn compute(
        &self,
        logprobs: Tensor<2>,
        old_logprobs: Tensor<2>,
        advantages: Tensor<2>,
        mask: &ResponseMask,
        weights: Option<Tensor<2>>,
    ) -> Result<PolicyLossOutput, ModelError> {
        if let Some(w) = &weights {
            mask.check("rollout_is_weights", w)?;
        }
        let dtype = logprobs.dtype();
        let mut losses = match self {
            Self::Ppo(c) => ppo_token_losses(logprobs, old_logprobs, advantages, mask, c)?,
            Self::Gspo(c) => gspo_token_losses(logprobs, old_logprobs, advantages, mask, c)?,
        };
        if let Some(w) = weights {
            losses.token_loss = losses.token_loss * mask.zero_masked(w.detach().cast(dtype));
        }
        losses.aggregate(mask, self.agg())
    }
}

/// `loss = policy_loss − entropy_coef · agg(H) + kl_coef · agg(KL(π ‖ π_ref))`, as verl's
/// actor combines `pg_loss`, `entropy_coeff` and `kl_loss_coef` (`use_kl_loss`), with every
/// term aggregated by the policy loss's [`LossAgg`].
///
/// With a [`RolloutCorrection`] (verl's `algorithm.rollout_correction`), the policy loss's
/// per-token values are multiplied by the IS weights, and the tokens rejection sampling
/// removes leave the mask of every term (see [`rollout_correction`](super::rollout_correction)).
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyObjective {
    /// The clipped policy loss and its settings.
    pub policy_loss: PolicyLoss,
    /// Weight of the KL loss (`0` ⇒ no KL term; verl's `kl_loss_coef`).
    pub kl_coef: f64,
    /// The per-token KL estimator (verl's `kl_loss_type`).
    pub kl_estimator: KlEstimator,
    /// Weight of the entropy bonus, subtracted from the loss (`0` ⇒ none; verl's
    /// `entropy_coeff`).
    pub entropy_coef: f64,
    /// Rollout correction between the rollout engine's policy and the trainer's (`None` ⇒
    /// none; mismatch metrics are still measured when the batch has `rollout_logprobs`).
    pub rollout_correction: Option<RolloutCorrection>,
}

impl Default for PolicyObjective {
    /// Default PPO, no KL term (estimator `k3` when enabled), no entropy bonus, no rollout
    /// correction.
    fn default() -> Self {
        Self {
            policy_loss: PolicyLoss::Ppo(PpoConfig::default()),
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            entropy_coef: 0.0,
            rollout_correction: None,
        }
    }
}

/// The per-token inputs of [`PolicyObjective::compute`], each `[B, S]` like `mask`.
#[derive(Clone, Debug)]
pub struct PolicyBatch<'a> {
    /// `log π(y_t)` under the policy being trained (differentiated).
    pub logprobs: Tensor<2>,
    /// `log π_old(y_t)` under the policy that sampled the batch.
    pub old_logprobs: Tensor<2>,
    /// Advantages (e.g. [`token_advantages`](super::token_advantages)).
    pub advantages: Tensor<2>,
    /// The response tokens.
    pub mask: &'a ResponseMask,
    /// `log π_ref(y_t)`; required when `kl_coef ≠ 0`, otherwise only logged.
    pub ref_logprobs: Option<Tensor<2>>,
    /// Per-token entropies of the current policy (e.g.
    /// [`entropy_from_logits`](super::entropy_from_logits), differentiable); required when
    /// `entropy_coef ≠ 0`, otherwise only logged.
    pub entropy: Option<Tensor<2>>,
    /// `log π_rollout(y_t)` from the rollout engine that sampled the batch (constant). Required
    /// by a [`RolloutCorrection`] in decoupled mode, refused in bypass mode (whose rollout
    /// log-probs are `old_logprobs`); without a correction, only measured
    /// ([`ObjectiveOutput::rollout`]).
    pub rollout_logprobs: Option<Tensor<2>>,
}

/// Host values logged with an objective.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyMetrics {
    /// The total loss.
    pub loss: f64,
    /// The policy loss alone (`actor/pg_loss`).
    pub pg_loss: f64,
    /// See [`PolicyLossOutput::clip_fraction`](super::PolicyLossOutput::clip_fraction).
    pub clip_fraction: f64,
    /// See [`PolicyLossOutput::dual_clip_fraction`](super::PolicyLossOutput::dual_clip_fraction).
    pub dual_clip_fraction: f64,
    /// `log π_old − log π` averaged over response tokens (`actor/ppo_kl`).
    pub approx_kl: f64,
    /// The aggregated KL estimate against the reference (`actor/kl_loss`), if given.
    pub kl: Option<f64>,
    /// The aggregated entropy (`actor/entropy`), if given.
    pub entropy: Option<f64>,
}

/// What [`PolicyObjective::compute`] returns.
#[derive(Clone, Debug)]
pub struct ObjectiveOutput {
    /// `[1]` total loss, differentiable through `logprobs` and `entropy`.
    pub loss: Tensor<1>,
    /// Logged values.
    pub metrics: PolicyMetrics,
    /// Rollout correction and mismatch metrics, when the objective has a
    /// [`RolloutCorrection`] or the batch has `rollout_logprobs`.
    pub rollout: Option<RolloutCorrectionMetrics>,
}

impl PolicyObjective {
    /// Errors (naming the field) if a coefficient is not finite or the policy-loss or rollout
    /// correction settings are invalid.
    pub fn validate(&self) -> Result<(), ModelError> {
        for (field, v) in [
            ("kl_coef", self.kl_coef),
            ("entropy_coef", self.entropy_coef),
        ] {
            if !v.is_finite() {
                return Err(ModelError::invalid(
                    field,
                    format!("must be finite, got {v}"),
                ));
            }
        }
        match &self.policy_loss {
            PolicyLoss::Ppo(c) => c.validate()?,
            PolicyLoss::Gspo(c) => c.validate()?,
        }
        if let Some(c) = &self.rollout_correction {
            c.validate()?;
        }
        Ok(())
    }

    /// The total loss and its metrics for one batch.
    ///
    /// If rejection sampling removes every response token, the loss is 0 (a zero gradient,
    /// still connected to `logprobs` and `entropy`) and every policy metric is 0: the batch
    /// teaches nothing, and [`RsMetrics::masked_fraction`](super::RsMetrics::masked_fraction)
    /// is 1.
    ///
    /// Errors if the settings are invalid, a shape differs from the mask's, the batch has no
    /// response token, `kl_coef` (`entropy_coef`) is non-zero without `ref_logprobs`
    /// (`entropy`), or `rollout_logprobs` are missing for (or given to) the rollout correction,
    /// or hold a non-finite value at a response token.
    pub fn compute(&self, batch: PolicyBatch<'_>) -> Result<ObjectiveOutput, ModelError> {
        self.validate()?;
        let PolicyBatch {
            logprobs,
            old_logprobs,
            advantages,
            mask,
            ref_logprobs,
            entropy,
            rollout_logprobs,
        } = batch;
        match &ref_logprobs {
            Some(reference) => mask.check("ref_logprobs", reference)?,
            None if self.kl_coef != 0.0 => {
                return Err(ModelError::InvalidInput {
                    what: "ref_logprobs",
                    reason: format!("kl_coef = {} needs reference log-probs", self.kl_coef),
                });
            }
            None => {}
        }
        match &entropy {
            Some(entropy) => mask.check("entropy", entropy)?,
            None if self.entropy_coef != 0.0 => {
                return Err(ModelError::InvalidInput {
                    what: "entropy",
                    reason: format!("entropy_coef = {} needs token entropies", self.entropy_coef),
                });
            }
            None => {}
        }
        let correction = self.correct(&logprobs, &old_logprobs, rollout_logprobs, mask)?;
        let (weights, kept, rollout) = match correction {
            Some(out) => (out.weights, Some(out.mask), Some(out.metrics)),
            None => (None, None, None),
        };
        let mask = kept.as_ref().unwrap_or(mask);
        let agg = self.policy_loss.agg();
        let dtype = logprobs.dtype();
        if mask.num_tokens() == 0 {
            // Everything rejected: a zero loss with a (zero) gradient path.
            let mut total = mask.zero_masked(logprobs).sum();
            if let Some(entropy) = &entropy {
                total = total + mask.zero_masked(entropy.clone().cast(dtype)).sum();
            }
            return Ok(ObjectiveOutput {
                loss: total,
                metrics: PolicyMetrics {
                    loss: 0.0,
                    pg_loss: 0.0,
                    clip_fraction: 0.0,
                    dual_clip_fraction: 0.0,
                    approx_kl: 0.0,
                    kl: ref_logprobs.map(|_| 0.0),
                    entropy: entropy.map(|_| 0.0),
                },
                rollout,
            });
        }
        let policy =
            self.policy_loss
                .compute(logprobs.clone(), old_logprobs, advantages, mask, weights)?;
        let mut total = policy.loss.clone();
        let kl = match ref_logprobs {
            Some(reference) => {
                let per_token = kl_penalty(
                    mask.zero_masked(logprobs),
                    mask.zero_masked(reference.detach().cast(dtype)),
                    self.kl_estimator,
                )?;
                let kl_loss = aggregate(per_token, mask, agg)?;
                let value = read_scalar(kl_loss.clone())?;
                if self.kl_coef != 0.0 {
                    total = total + kl_loss.mul_scalar(self.kl_coef);
                }
                Some(value)
            }
            None => None,
        };
        let entropy = match entropy {
            Some(entropy) => {
                let bonus = aggregate(entropy.cast(dtype), mask, agg)?;
                let value = read_scalar(bonus.clone())?;
                if self.entropy_coef != 0.0 {
                    total = total - bonus.mul_scalar(self.entropy_coef);
                }
                Some(value)
            }
            None => None,
        };
        let metrics = PolicyMetrics {
            loss: read_scalar(total.clone())?,
            pg_loss: read_scalar(policy.loss)?,
            clip_fraction: policy.clip_fraction,
            dual_clip_fraction: policy.dual_clip_fraction,
            approx_kl: policy.approx_kl,
            kl,
            entropy,
        };
        Ok(ObjectiveOutput {
            loss: total,
            metrics,
            rollout,
        })
    }

    /// The rollout correction of a batch, if any: decoupled mode compares `old_logprobs` with
    /// `rollout_logprobs`; bypass mode the current `logprobs` (detached) with `old_logprobs`
    /// (the rollout engine's there), measuring but not applying IS weights; without a
    /// correction, `rollout_logprobs` are only measured against `old_logprobs`.
    fn correct(
        &self,
        logprobs: &Tensor<2>,
        old_logprobs: &Tensor<2>,
        rollout_logprobs: Option<Tensor<2>>,
        mask: &ResponseMask,
    ) -> Result<Option<RolloutCorrectionOutput>, ModelError> {
        let decoupled = |config: &RolloutCorrection, rollout: Tensor<2>| {
            correction_named(
                (old_logprobs.clone(), "old_logprobs"),
                (rollout, "rollout_logprobs"),
                mask,
                config,
            )
        };
        match (&self.rollout_correction, rollout_logprobs) {
            (Some(config), None) if config.bypass_mode => {
                let mut out = correction_named(
                    (logprobs.clone().detach(), "logprobs"),
                    (old_logprobs.clone(), "old_logprobs"),
                    mask,
                    config,
                )?;
                // verl's `compute_policy_loss_bypass_mode` with `ppo_clip`: the PPO ratio is
                // already π_θ / π_rollout, so the IS weights are measured only.
                out.weights = None;
                Ok(Some(out))
            }
            (Some(config), Some(_)) if config.bypass_mode => Err(ModelError::InvalidInput {
                what: "rollout_logprobs",
                reason: "bypass_mode takes the rollout engine's log-probs from old_logprobs \
                         (verl's apply_bypass_mode); pass them there, not as rollout_logprobs"
                    .to_owned(),
            }),
            (Some(config), Some(rollout)) => decoupled(config, rollout).map(Some),
            (Some(_), None) => Err(ModelError::InvalidInput {
                what: "rollout_logprobs",
                reason: "the rollout correction needs the rollout engine's log-probs (or \
                         bypass_mode with them as old_logprobs)"
                    .to_owned(),
            }),
            (None, Some(rollout)) => decoupled(&RolloutCorrection::default(), rollout).map(Some),
            (None, None) => Ok(None),
        }
    }
}
