//! Aux-loss-free load balancing: the expert-bias update
//! (docs/routing-and-dispatch.md §Aux-loss-free expert bias).
//!
//! The bias `[E]` lives in [`TopKRouter::expert_bias`] as an f32 parameter that never requires a
//! gradient (so it is checkpointed with the module and ignored by optimizers); it only shifts the
//! selection scores (docs/routing-and-dispatch.md §Score functions and top-k). Counts are
//! accumulated in [`RouterState`] from committed grad-enabled forwards, and the bias is updated
//! once per global batch, after the gradient sync.

use burn::tensor::{DType, Tensor, TensorData};

use super::TopKRouter;
use super::state::RouterState;
use crate::error::{BackendError, Result};

/// `bias + rate · sign(mean(c) − c)` with `sign(0) = 0`, in f32
/// (docs/routing-and-dispatch.md §Aux-loss-free expert bias): underloaded experts move up by
/// `rate`, overloaded ones down by `rate`.
pub fn updated_expert_bias(bias: &[f32], counts: &[f64], rate: f64) -> Result<Vec<f32>> {
    if bias.len() != counts.len() || counts.is_empty() {
        return Err(BackendError::Shape {
            op: "updated_expert_bias",
            detail: format!("{} counts for {} experts", counts.len(), bias.len()),
        });
    }
    let mean = counts.iter().sum::<f64>() / counts.len() as f64;
    let rate = rate as f32;
    Ok(bias
        .iter()
        .zip(counts)
        .map(|(&b, &c)| {
            let offset = mean - c;
            let sign = if offset > 0.0 {
                1.0
            } else if offset < 0.0 {
                -1.0
            } else {
                0.0
            };
            b + sign * rate
        })
        .collect())
}

impl TopKRouter {
    /// The expert bias `[E]` on the host, `None` when the expert bias is disabled.
    pub fn expert_bias_values(&self) -> Result<Option<Vec<f32>>> {
        let Some(bias) = &self.expert_bias else {
            return Ok(None);
        };
        bias.val()
            .into_data()
            .try_into_vec_as::<f32>()
            .map(Some)
            .map_err(|e| BackendError::Shape {
                op: "expert_bias_values",
                detail: format!("cannot read the expert bias: {e:?}"),
            })
    }

    /// Single-rank expert-bias update: applies the counts accumulated in `state` (they are the
    /// reduced counts when there is one rank) and resets them. Call once per global batch.
    pub fn update_expert_bias(&mut self, state: &mut RouterState) -> Result<()> {
        let counts = state.take_local_tokens_per_expert();
        self.update_expert_bias_with_counts(&counts)
    }

    /// Expert-bias update with counts already summed over `tp_dp_cp`
    /// (`allreduce_SUM(local_tokens_per_expert)`,
    /// docs/routing-and-dispatch.md §Aux-loss-free expert bias, step 2).
    pub fn update_expert_bias_with_counts(&mut self, reduced_counts: &[f64]) -> Result<()> {
        let Some(old) = self.expert_bias_values()? else {
            return Err(BackendError::Config {
                field: "enable_expert_bias",
                detail: "the router has no expert bias to update".into(),
            });
        };
        let new = updated_expert_bias(&old, reduced_counts, self.config.expert_bias_update_rate)?;
        if let Some(param) = self.expert_bias.take() {
            let e = new.len();
            self.expert_bias = Some(param.map(|t| {
                let device = t.device();
                Tensor::<1>::from_data(TensorData::new(new, [e]), (&device, DType::F32))
            }));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_expert_bias_update_moves_by_exactly_the_rate() {
        let bias = [0.25f32, -0.5, 0.0, 1.0];
        // mean = 3: expert 0 underloaded, 1 balanced, 2 and 3 overloaded / underloaded.
        let counts = [1.0, 3.0, 7.0, 1.0];
        let new = updated_expert_bias(&bias, &counts, 0.1).unwrap();
        let r = 0.1f32;
        assert_eq!(new, vec![0.25 + r, -0.5, 0.0 - r, 1.0 + r]);
        assert!(updated_expert_bias(&bias, &counts[..3], 0.1).is_err());
    }
}
