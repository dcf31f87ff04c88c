//! Expert-parallel shards of [`GroupedExperts`]: a contiguous range of experts (EP) and one
//! column block of every expert's FFN (ETP), as fresh parameters.

use std::ops::Range;

use burn::module::{Param, ParamId};
use burn::tensor::Tensor;

use super::GroupedExperts;
use crate::error::{BackendError, Result};

/// A fresh leaf with the values of `t` (tracked iff `requires_grad`) under parameter `id`.
fn fresh<const D: usize>(id: ParamId, t: Tensor<D>, requires_grad: bool) -> Param<Tensor<D>> {
    let dtype = t.dtype();
    let device = t.device();
    let leaf = Tensor::from_data(t.into_data(), (&device, dtype));
    Param::initialized(
        id,
        if requires_grad {
            leaf.require_grad()
        } else {
            leaf
        },
    )
}

impl GroupedExperts {
    /// Experts `experts` (global ids into this module's stacked weights) with FFN block
    /// `etp_rank` of `etp`: for SwiGLU, gate rows `[r·F/etp, (r+1)·F/etp)` and the same up
    /// rows (fc1 stays `[gate; up]`), fc2 columns likewise; `fc1_bias` is split with fc1's rows.
    /// `fc2_bias` is replicated and its value added by ETP rank 0 only
    /// ([`GroupedExperts::adds_fc2_bias`]: Megatron's row-parallel bias), so the summed partial
    /// outputs carry it once. The shard's parameters are new leaves, so ranks of an in-process
    /// world never share autodiff nodes.
    pub fn shard(&self, experts: Range<usize>, etp_rank: usize, etp: usize) -> Result<Self> {
        let op = "GroupedExperts::shard";
        let e = self.num_experts();
        let f = self.ffn_hidden_size();
        if experts.start >= experts.end || experts.end > e {
            return Err(BackendError::Index {
                op,
                detail: format!("experts {experts:?} out of 0..{e}"),
            });
        }
        if etp == 0 || !f.is_multiple_of(etp) || etp_rank >= etp {
            return Err(BackendError::Config {
                field: "etp",
                detail: format!("FFN width {f} cannot be split into block {etp_rank} of {etp}"),
            });
        }
        let block = f / etp;
        let cols = etp_rank * block..(etp_rank + 1) * block;
        let gated = self.activation.is_gated();
        let grad = self.fc1.val().is_require_grad();
        let fc1 = self.fc1.val().slice([experts.clone()]);
        let [l, _, h] = fc1.dims();
        let fc1 = if gated {
            let gate = fc1.clone().slice([0..l, cols.clone(), 0..h]);
            let up = fc1.slice([0..l, f + cols.start..f + cols.end, 0..h]);
            Tensor::cat(vec![gate, up], 1)
        } else {
            fc1.slice([0..l, cols.clone(), 0..h])
        };
        let fc2 = self.fc2.val().slice([experts.clone(), 0..h, cols.clone()]);
        let fc1_bias = self.fc1_bias.as_ref().map(|param| {
            let b = param.val().slice([experts.clone()]);
            let b = if gated {
                let gate = b.clone().slice([0..l, cols.clone()]);
                let up = b.slice([0..l, f + cols.start..f + cols.end]);
                Tensor::cat(vec![gate, up], 1)
            } else {
                b.slice([0..l, cols.clone()])
            };
            fresh(param.id, b, grad)
        });
        let fc2_bias = self
            .fc2_bias
            .as_ref()
            .map(|b| fresh(b.id, b.val().slice([experts.clone()]), grad));
        Ok(GroupedExperts {
            fc1: fresh(self.fc1.id, fc1, grad),
            fc2: fresh(self.fc2.id, fc2, grad),
            fc1_bias,
            fc2_bias,
            adds_fc2_bias: self.adds_fc2_bias && etp_rank == 0,
            activation: self.activation,
            fp8: self.fp8,
        })
    }
}
