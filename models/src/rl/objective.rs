//! The complete actor objective: policy loss, entropy bonus and KL loss.

use burn::tensor::Tensor;

use super::kl::{KlEstimator, kl_penalty};
use super::loss::{GspoConfig, LossAgg, PpoConfig, aggregate, gspo_loss, ppo_loss};
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
}

/// `loss = policy_loss − entropy_coef · agg(H) + kl_coef · agg(KL(π ‖ π_ref))`, as verl's
/// actor combines `pg_loss`, `entropy_coeff` and `kl_loss_coef` (`use_kl_loss`), with every
/// term aggregated by the policy loss's [`LossAgg`].
#[derive(Clone, Copy, Debug, PartialEq)]
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
}

impl Default for PolicyObjective {
    /// Default PPO, no KL term (estimator `k3` when enabled), no entropy bonus.
    fn default() -> Self {
        Self {
            policy_loss: PolicyLoss::Ppo(PpoConfig::default()),
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            entropy_coef: 0.0,
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
}

impl PolicyObjective {
    /// Errors (naming the field) if a coefficient is not finite or the policy-loss settings
    /// are invalid.
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
            PolicyLoss::Ppo(c) => c.validate(),
            PolicyLoss::Gspo(c) => c.validate(),
        }
    }

    /// The total loss and its metrics for one batch.
    ///
    /// Errors if the settings are invalid, a shape differs from the mask's, the batch has no
    /// response token, or `kl_coef` (`entropy_coef`) is non-zero without `ref_logprobs`
    /// (`entropy`).
    pub fn compute(&self, batch: PolicyBatch<'_>) -> Result<ObjectiveOutput, ModelError> {
        self.validate()?;
        let PolicyBatch {
            logprobs,
            old_logprobs,
            advantages,
            mask,
            ref_logprobs,
            entropy,
        } = batch;
        let agg = self.policy_loss.agg();
        let dtype = logprobs.dtype();
        let policy = match &self.policy_loss {
            PolicyLoss::Ppo(c) => ppo_loss(logprobs.clone(), old_logprobs, advantages, mask, c)?,
            PolicyLoss::Gspo(c) => gspo_loss(logprobs.clone(), old_logprobs, advantages, mask, c)?,
        };
        let mut total = policy.loss.clone();
        let kl = match ref_logprobs {
            Some(reference) => {
                mask.check("ref_logprobs", &reference)?;
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
            None if self.kl_coef != 0.0 => {
                return Err(ModelError::InvalidInput {
                    what: "ref_logprobs",
                    reason: format!("kl_coef = {} needs reference log-probs", self.kl_coef),
                });
            }
            None => None,
        };
        let entropy = match entropy {
            Some(entropy) => {
                mask.check("entropy", &entropy)?;
                let bonus = aggregate(entropy.cast(dtype), mask, agg)?;
                let value = read_scalar(bonus.clone())?;
                if self.entropy_coef != 0.0 {
                    total = total - bonus.mul_scalar(self.entropy_coef);
                }
                Some(value)
            }
            None if self.entropy_coef != 0.0 => {
                return Err(ModelError::InvalidInput {
                    what: "entropy",
                    reason: format!("entropy_coef = {} needs token entropies", self.entropy_coef),
                });
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
        })
    }
}
