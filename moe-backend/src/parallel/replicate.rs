//! Per-rank copies of a module whose parameters are fresh autodiff leaves.
//!
//! Burn merges the autodiff graphs of tensors that share a node; ranks of an in-process world
//! that used the very same parameter tensors would end up in one graph, and one rank's
//! backward (which runs collectives) would wait on another's. Each rank therefore works on its
//! own [`replicate`] of a module built once (same values, same parameter ids).

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Bool, Int, Tensor};

struct Replicator;

fn copy<const D: usize, K: burn::tensor::kind::Basic>(t: Tensor<D, K>) -> Tensor<D, K> {
    let dtype = t.dtype();
    let device = t.device();
    Tensor::from_data(t.into_data(), (&device, dtype))
}

impl ModuleMapper for Replicator {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| {
            let grad = t.is_require_grad();
            let fresh = copy(t);
            if grad { fresh.require_grad() } else { fresh }
        })
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        param.map(copy)
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<D, Bool>>,
    ) -> Param<Tensor<D, Bool>> {
        param.map(copy)
    }
}

/// A copy of `module` with the same parameter values and ids whose tensors share no storage
/// or autodiff node with the original.
pub fn replicate<M: Module>(module: &M) -> M {
    module.clone().map(&mut Replicator)
}
