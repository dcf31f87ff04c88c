//! Policy-gradient losses for RL fine-tuning (issue 19), written after verl's
//! `verl/trainer/ppo/core_algos.py` and the GSPO paper (arXiv 2507.18071):
//!
//! - [`aggregate`] with the [`LossAgg`] modes of verl's `agg_loss`;
//! - [`ppo_loss`]: clipped PPO with asymmetric ranges and dual clip (verl's
//!   `compute_policy_loss_vanilla`);
//! - [`gspo_loss`]: sequence-level importance ratios (verl's `compute_policy_loss_gspo`);
//! - [`kl_penalty`] with the [`KlEstimator`]s of verl's `kl_penalty` and
//!   [`entropy_from_logits`];
//! - [`PolicyObjective`]: policy loss − entropy bonus + KL loss, as verl's actor combines them;
//! - [`grpo_advantages`] and [`token_advantages`]: GRPO outcome advantages;
//! - [`rollout_correction`]: truncated importance sampling and rejection sampling between the
//!   rollout engine's policy and the trainer's, with the train–inference mismatch metrics
//!   (verl's `rollout_corr_helper.py`), an option of [`PolicyObjective`].
//!
//! Every input is `[batch, seq]` over the response tokens, with the [`ResponseMask`] marking
//! the tokens that count. Values at masked positions are never read into a loss or a metric
//! (they may hold anything, even NaN) and receive a zero gradient. Log-probabilities other than
//! the current policy's (`old_logprobs`, `ref_logprobs`) and advantages are constants: they
//! are detached and cast to the dtype of `logprobs`.

mod advantage;
mod correction;
mod kl;
pub mod logprobs;
mod loss;
mod mask;
mod objective;

pub use advantage::{grpo_advantages, token_advantages};
pub use correction::{
    IsLevel, IsMetrics, MismatchMetrics, RolloutCorrection, RolloutCorrectionMetrics,
    RolloutCorrectionOutput, RolloutIs, RsCriterion, RsCriterionMetrics, RsMetrics, RsOption,
    rollout_correction,
};
pub use kl::{KlEstimator, entropy_from_logits, kl_penalty};
pub use loss::{GspoConfig, LossAgg, PolicyLossOutput, PpoConfig, aggregate, gspo_loss, ppo_loss};
pub use mask::ResponseMask;
pub use objective::{ObjectiveOutput, PolicyBatch, PolicyLoss, PolicyMetrics, PolicyObjective};

#[cfg(test)]
mod tests;
