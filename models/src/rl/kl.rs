//! Per-token KL estimators against a reference policy, and token entropies.

use std::str::FromStr;

use burn::tensor::Tensor;
use burn::tensor::activation::log_softmax;

use crate::ModelError;

/// Bound on `log π_ref − log π` before it is exponentiated by [`KlEstimator::K3`].
const K3_LOG_RATIO_BOUND: f64 = 20.0;
/// Bound on the [`KlEstimator::K3`] value (verl clamps `low_var_kl` to `[-10, 10]`).
const K3_VALUE_BOUND: f64 = 10.0;

/// Per-token estimators of `KL(π ‖ π_ref)` from the sampled tokens' log-probabilities
/// (J. Schulman, "Approximating KL divergence"; verl's `kl_penalty`). With
/// `d = log π − log π_ref`:
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KlEstimator {
    /// `k1 = d` (verl `kl` / `k1`): unbiased, high variance, can be negative.
    K1,
    /// `|d|` (verl `abs`).
    Abs,
    /// `k2 = d² / 2` (verl `mse` / `k2`).
    K2,
    /// `k3 = exp(−d') + d' − 1` with `d' = clamp(d, −20, 20)`, clamped to `[−10, 10]` (verl
    /// `low_var_kl` / `k3`): unbiased, low variance, never negative. The gradient is zero
    /// where either clamp binds.
    #[default]
    K3,
}

impl FromStr for KlEstimator {
    type Err = ModelError;

    /// Parses verl's `kl_loss_type` names (`kl`, `k1`, `abs`, `mse`, `k2`, `low_var_kl`, `k3`).
    fn from_str(s: &str) -> Result<Self, ModelError> {
        match s {
            "kl" | "k1" => Ok(Self::K1),
            "abs" => Ok(Self::Abs),
            "mse" | "k2" => Ok(Self::K2),
            "low_var_kl" | "k3" => Ok(Self::K3),
            other => Err(ModelError::invalid(
                "kl_loss_type",
                format!("unknown estimator {other:?}; expected k1, abs, k2 or k3"),
            )),
        }
    }
}

/// The per-token KL estimate `[B, S]` of `logprobs` (current policy, differentiated) against
/// `ref_logprobs` (constant: detached and cast to the dtype of `logprobs`). Not masked: pass
/// the result through [`aggregate`](super::aggregate).
///
/// Errors if the shapes differ.
pub fn kl_penalty(
    logprobs: Tensor<2>,
    ref_logprobs: Tensor<2>,
    estimator: KlEstimator,
) -> Result<Tensor<2>, ModelError> {
    if logprobs.dims() != ref_logprobs.dims() {
        return Err(ModelError::InvalidInput {
            what: "ref_logprobs",
            reason: format!(
                "shape {:?} differs from the logprobs' {:?}",
                ref_logprobs.dims(),
                logprobs.dims()
            ),
        });
    }
    let reference = ref_logprobs.detach().cast(logprobs.dtype());
    Ok(match estimator {
        KlEstimator::K1 => logprobs - reference,
        KlEstimator::Abs => (logprobs - reference).abs(),
        KlEstimator::K2 => (logprobs - reference).square().mul_scalar(0.5),
        KlEstimator::K3 => {
            let log_ratio = (reference - logprobs).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND);
            (log_ratio.clone().exp() - log_ratio)
                .sub_scalar(1.0)
                .clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)
        }
    })
}

/// Entropy `H = −Σ_v p_v log p_v` of the softmax of each row of `logits [B, S, V]`, as
/// `[B, S]` (verl's `entropy_from_logits`), differentiable through the logits.
pub fn entropy_from_logits(logits: Tensor<3>) -> Tensor<2> {
    let [batch, seq, _] = logits.dims();
    let logp = log_softmax(logits, 2);
    let p = logp.clone().exp();
    (p * logp).sum_dim(2).neg().reshape([batch, seq])
}
