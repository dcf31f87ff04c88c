//! GRPO outcome advantages.

use burn::tensor::{DType, Tensor, TensorData};

use super::mask::ResponseMask;
use crate::ModelError;

/// GRPO outcome advantages (verl's `compute_grpo_outcome_advantage`), one per sequence.
///
/// `rewards` holds one scalar reward per response, in groups of `group_size` consecutive
/// responses to the same prompt (verl's interleaved repeat). For a response with reward `r` in
/// a group with mean `μ` and unbiased standard deviation `σ` (`torch.std`,
/// `√(Σ (r − μ)² / (G − 1))`), the advantage is `(r − μ) / (σ + eps)` when `norm_by_std`
/// (GRPO) and `r − μ` otherwise (Dr. GRPO). As in verl, a group of one response uses `μ = 0`,
/// `σ = 1`; a group whose rewards are all equal gets advantages 0.
///
/// Errors if `group_size` is 0 or does not divide the number of rewards, a reward is not
/// finite, or `eps` is negative or not finite.
pub fn grpo_advantages(
    rewards: &[f64],
    group_size: usize,
    norm_by_std: bool,
    eps: f64,
) -> Result<Vec<f64>, ModelError> {
    if group_size == 0 || !rewards.len().is_multiple_of(group_size) {
        return Err(ModelError::InvalidInput {
            what: "group_size",
            reason: format!(
                "{} rewards do not split into groups of {group_size}",
                rewards.len()
            ),
        });
    }
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        return Err(ModelError::InvalidInput {
            what: "rewards",
            reason: format!("reward {i} is {} (not finite)", rewards[i]),
        });
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(ModelError::invalid(
            "epsilon",
            format!("must be a finite number ≥ 0, got {eps}"),
        ));
    }
    let mut advantages = Vec::with_capacity(rewards.len());
    for group in rewards.chunks(group_size) {
        let (mean, std) = if group.len() == 1 {
            (0.0, 1.0)
        } else {
            let n = group.len() as f64;
            let mean = group.iter().sum::<f64>() / n;
            let var = group.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0);
            (mean, var.sqrt())
        };
        advantages.extend(group.iter().map(|&r| {
            if norm_by_std {
                (r - mean) / (std + eps)
            } else {
                r - mean
            }
        }));
    }
    Ok(advantages)
}

/// Per-sequence advantages broadcast over the response tokens: `[B, S]` of `dtype` on the
/// mask's device, `advantages[b]` at response tokens and 0 elsewhere.
///
/// Errors unless there is one finite advantage per sequence of the mask.
pub fn token_advantages(
    advantages: &[f64],
    mask: &ResponseMask,
    dtype: DType,
) -> Result<Tensor<2>, ModelError> {
    let [batch, _] = mask.dims();
    if advantages.len() != batch {
        return Err(ModelError::InvalidInput {
            what: "advantages",
            reason: format!(
                "{} advantages for a response mask of {:?}",
                advantages.len(),
                mask.dims()
            ),
        });
    }
    if let Some(i) = advantages.iter().position(|a| !a.is_finite()) {
        return Err(ModelError::InvalidInput {
            what: "advantages",
            reason: format!("advantage {i} is {} (not finite)", advantages[i]),
        });
    }
    let device = mask.tensor().device();
    let column = Tensor::<2>::from_data(
        TensorData::new(advantages.to_vec(), [batch, 1]),
        (&device, DType::F64),
    )
    .cast(dtype);
    Ok(mask.to_float(dtype) * column)
}
