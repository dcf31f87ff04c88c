//! The response mask shared by every RL loss.

use burn::tensor::{Bool, DType, Tensor};

use crate::ModelError;

/// Which tokens of a `[batch, seq]` batch are response tokens (the ones a loss counts), with
/// the per-sequence token counts read to the host once. It must live on the device of the
/// tensors it masks (the autodiff device when training).
#[derive(Clone, Debug)]
pub struct ResponseMask {
    mask: Tensor<2, Bool>,
    lengths: Vec<usize>,
}

impl ResponseMask {
    /// A mask from a bool tensor (`true` = response token).
    ///
    /// Errors if the counts cannot be read back from the device.
    pub fn from_bool(mask: Tensor<2, Bool>) -> Result<Self, ModelError> {
        let [batch, _] = mask.dims();
        let counts = mask
            .clone()
            .int()
            .sum_dim(1)
            .reshape([batch])
            .try_into_vec_as::<i64>()
            .map_err(|e| ModelError::InvalidInput {
                what: "response_mask",
                reason: format!("cannot read the mask: {e}"),
            })?;
        let lengths = counts.into_iter().map(|c| c.max(0) as usize).collect();
        Ok(Self { mask, lengths })
    }

    /// A mask from a float tensor of 0s and 1s (verl's `response_mask`).
    ///
    /// Errors if a value is neither 0 nor 1 (NaN included), naming its position.
    pub fn from_float(mask: Tensor<2>) -> Result<Self, ModelError> {
        let [batch, seq] = mask.dims();
        let values =
            mask.clone()
                .try_into_vec_as::<f64>()
                .map_err(|e| ModelError::InvalidInput {
                    what: "response_mask",
                    reason: format!("cannot read the mask: {e}"),
                })?;
        if let Some(i) = values.iter().position(|&v| v != 0.0 && v != 1.0) {
            return Err(ModelError::InvalidInput {
                what: "response_mask",
                reason: format!(
                    "value {} at [{}, {}] of a [{batch}, {seq}] mask is neither 0 nor 1",
                    values[i],
                    i / seq.max(1),
                    i % seq.max(1)
                ),
            });
        }
        Self::from_bool(mask.greater_elem(0.5))
    }

    /// `[batch, seq]`.
    pub fn dims(&self) -> [usize; 2] {
        self.mask.dims()
    }

    /// The mask as a bool tensor (`true` = response token).
    pub fn tensor(&self) -> &Tensor<2, Bool> {
        &self.mask
    }

    /// The mask as 0/1 floats of `dtype`.
    pub fn to_float(&self, dtype: DType) -> Tensor<2> {
        self.mask.clone().float().cast(dtype)
    }

    /// Response tokens of each sequence.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// Response tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// Sequences with at least one response token.
    pub fn num_nonempty(&self) -> usize {
        self.lengths.iter().filter(|&&n| n > 0).count()
    }

    /// Errors unless `tensor` has the mask's shape; `what` names the input.
    pub(crate) fn check(&self, what: &'static str, tensor: &Tensor<2>) -> Result<(), ModelError> {
        let (found, want) = (tensor.dims(), self.dims());
        if found != want {
            return Err(ModelError::InvalidInput {
                what,
                reason: format!("shape {found:?} differs from the response mask's {want:?}"),
            });
        }
        Ok(())
    }

    /// Errors if the batch has no response token (no loss is defined then).
    pub(crate) fn check_nonempty(&self) -> Result<(), ModelError> {
        if self.num_tokens() == 0 {
            return Err(ModelError::InvalidInput {
                what: "response_mask",
                reason: format!(
                    "no response token in the {:?} batch: the loss is undefined",
                    self.dims()
                ),
            });
        }
        Ok(())
    }

    /// `t` with masked positions set to 0: whatever they held (NaN included) is dropped and
    /// gets a zero gradient.
    pub(crate) fn zero_masked(&self, t: Tensor<2>) -> Tensor<2> {
        t.mask_fill(self.mask.clone().bool_not(), 0.0)
    }

    /// Masked mean over all response tokens of a detached tensor, on the host.
    pub(crate) fn host_mean(&self, t: Tensor<2>) -> Result<f64, ModelError> {
        let sum = read_scalar(self.zero_masked(t.detach()).sum().cast(DType::F64))?;
        Ok(sum / self.num_tokens().max(1) as f64)
    }

    /// Fraction of response tokens where `flag` holds.
    pub(crate) fn host_fraction(&self, flag: Tensor<2, Bool>) -> Result<f64, ModelError> {
        let hits = flag
            .bool_and(self.mask.clone())
            .int()
            .sum()
            .try_into_vec_as::<i64>()
            .map_err(read_error)?;
        Ok(hits.first().copied().unwrap_or(0) as f64 / self.num_tokens().max(1) as f64)
    }
}

/// The value of a one-element float tensor on the host.
pub(crate) fn read_scalar(t: Tensor<1>) -> Result<f64, ModelError> {
    t.detach()
        .try_into_vec_as::<f64>()
        .map_err(read_error)?
        .first()
        .copied()
        .ok_or_else(|| ModelError::InvalidInput {
            what: "loss",
            reason: "empty tensor".to_owned(),
        })
}

fn read_error(e: burn::tensor::TensorReadError) -> ModelError {
    ModelError::InvalidInput {
        what: "loss",
        reason: format!("cannot read a value back from the device: {e}"),
    }
}
