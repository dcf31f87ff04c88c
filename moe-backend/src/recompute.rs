//! Activation recompute of a region (Megatron's `--recompute-granularity selective` with
//! `--recompute-modules`, and `full`; the Megatron Core MoE report §4.1.4).
//!
//! [`recompute`] runs a region `y = f(x)` without recording it: nothing the region's backward
//! would need is kept but its input `x`. The output is linked to `x`'s graph by one node whose
//! backward runs the region again on a fresh leaf copy of `x`, back-propagates the incoming
//! gradient through that second, recorded run and returns `dx`. The arithmetic of both the
//! recorded run and its backward is that of the original region, so the gradients are the
//! ones the region would have produced without recompute, bit for bit, as long as `x` has no
//! other consumer whose gradient contribution Burn would interleave with the region's own
//! (keep the region's input single-use, e.g. by including a residual in the region).
//!
//! A region with parameters ([`recompute_module`]) runs its first pass on a detached copy of
//! the module (nothing is recorded against the parameters) and its second pass on a copy
//! whose parameters are fresh leaves with the same [`ParamId`](burn::module::ParamId)s. Their
//! gradients cannot reach the outer graph's parameter nodes (Burn's backward ops have a fixed
//! number of parents), so they are kept per thread and handed to the caller of the outer
//! `backward()` by [`take_param_grads`]: a training loop adds them to the gradients it reads
//! from the outer graph (e.g. `GradientsAccumulator::accumulate` of each), and calls
//! [`clear_param_grads`] before a step so that nothing left over from an abandoned backward
//! is counted.
//!
//! Without autodiff, or when `x` does not require a gradient, the region simply runs.

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;

use burn::backend::{
    Backend, Dispatch, Flex, TensorMetadata,
    autodiff::{
        Autodiff,
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients as AutodiffGradients,
        ops::{Backward, Ops, OpsKind},
    },
    backend_extension,
    tensor::FloatTensor,
};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Tensor, TensorData};

#[cfg(test)]
mod tests;

/// The second, recorded run of a region: `(x, dy) ↦ dx` on host data.
type Rerun = dyn Fn(TensorData, TensorData) -> TensorData + Send + Sync;

/// A region's backward: runs the region again and back-propagates through it.
#[derive(Clone)]
pub struct Region(Arc<Rerun>);

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Region")
    }
}

/// Backend op linking a recomputed region's output to its input.
#[backend_extension(Flex, Autodiff, Cube: cfg(feature = "cube"))]
pub trait RecomputeOps: Backend {
    /// Returns `output`; under autodiff its gradient flows to `input` through `region` (the
    /// region is run again in the backward pass).
    fn recompute_link(
        input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        region: Region,
    ) -> FloatTensor<Self>;
}

impl RecomputeOps for Flex {
    fn recompute_link(
        _input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        _region: Region,
    ) -> FloatTensor<Self> {
        output
    }
}

/// Burn's CubeCL backend: the link is free; the region's data crosses the host in backward.
#[cfg(feature = "cube")]
impl RecomputeOps for burn_cubecl::CubeBackend {
    fn recompute_link(
        _input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        _region: Region,
    ) -> FloatTensor<Self> {
        output
    }
}

fn read<B: Backend>(t: FloatTensor<B>) -> TensorData {
    match burn::tensor::try_read_sync(B::float_into_data(t)) {
        Some(Ok(data)) => data,
        Some(Err(e)) => panic!("recompute backward: reading a tensor failed: {e:?}"),
        None => panic!("recompute backward: the backend cannot read tensors synchronously"),
    }
}

impl<B: RecomputeOps, C: CheckpointStrategy> RecomputeOps for Autodiff<B, C> {
    fn recompute_link(
        input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        region: Region,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct RecomputeBackward;

        impl<B: Backend> Backward<B, 1> for RecomputeBackward {
            type State = (FloatTensor<B>, Region);

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut AutodiffGradients,
                _: &mut Checkpointer,
            ) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (x, region) = ops.state;
                if let Some(node) = parent {
                    let device = x.device();
                    let dx = (region.0)(read::<B>(x), read::<B>(grad));
                    grads.register::<B>(node.id, B::float_from_data(dx, &device));
                }
            }
        }

        let x = input.primitive().clone();
        match RecomputeBackward
            .prepare::<C>([input.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((x, region), output.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(output.into_primitive()),
        }
    }
}

thread_local! {
    /// Parameter gradients of the regions back-propagated on this thread (module docs).
    static PARAM_GRADS: RefCell<Vec<GradientsParams>> = const { RefCell::new(Vec::new()) };
}

/// The parameter gradients of the recomputed regions that the `backward()` calls on this
/// thread produced since the last call (one entry per region run with parameters), to add to
/// the gradients read from the outer graph.
pub fn take_param_grads() -> Vec<GradientsParams> {
    PARAM_GRADS.with(|g| std::mem::take(&mut *g.borrow_mut()))
}

/// Drops parameter gradients no caller took (e.g. of a backward that was abandoned).
pub fn clear_param_grads() {
    PARAM_GRADS.with(|g| g.borrow_mut().clear());
}

/// `f(x)` with `f` recomputed in the backward pass instead of keeping its activations (module
/// docs). `f` must not use tensors that require a gradient other than `x` (use
/// [`recompute_module`] for a region with parameters).
pub fn recompute<const D: usize, const E: usize, F>(x: Tensor<D>, f: F) -> Tensor<E>
where
    F: Fn(Tensor<D>) -> Tensor<E> + Send + Sync + 'static,
{
    if !x.is_tracked() {
        return f(x);
    }
    let output = f(x.clone().detach());
    let device = x.device();
    let region = Region(Arc::new(move |x: TensorData, dy: TensorData| {
        let x = Tensor::<D>::from_data(x, &device).require_grad();
        let y = f(x.clone());
        let dy = Tensor::<E>::from_data(dy, &device);
        let mut grads = (y * dy).sum().backward();
        grad_or_zeros(&x, &mut grads)
    }));
    link(x, output, region)
}

/// `f(module, x)` recomputed in the backward pass (module docs): the first pass sees the
/// module detached, the second a copy whose parameters are fresh leaves with the same ids;
/// their gradients are collected for [`take_param_grads`].
pub fn recompute_module<M, const D: usize, const E: usize, F>(
    module: &M,
    x: Tensor<D>,
    f: F,
) -> Tensor<E>
where
    M: Module + Send + Sync + 'static,
    F: Fn(&M, Tensor<D>) -> Tensor<E> + Send + Sync + 'static,
{
    let Ok(y) = try_recompute_module(module, x, move |m: &M, x| {
        Ok::<_, std::convert::Infallible>(f(m, x))
    });
    y
}

/// [`recompute_module`] of a fallible region: an error of the first pass is returned; the
/// second pass runs on the same inputs, so it cannot fail unless the region is not
/// deterministic, and then panics with the error (a backward pass cannot return one).
pub fn try_recompute_module<M, const D: usize, const E: usize, F, Err>(
    module: &M,
    x: Tensor<D>,
    f: F,
) -> Result<Tensor<E>, Err>
where
    M: Module + Send + Sync + 'static,
    F: Fn(&M, Tensor<D>) -> Result<Tensor<E>, Err> + Send + Sync + 'static,
    Err: fmt::Display,
{
    if !x.is_tracked() {
        return f(module, x);
    }
    let output = f(&module.clone().no_grad(), x.clone().detach())?;
    Ok(link_recomputed(module, x, output, f))
}

/// The last step of [`try_recompute_module`] for a caller that runs the first pass itself
/// (e.g. with state the second pass must not touch): `output` must be the region's value on
/// `module.clone().no_grad()` and `x.clone().detach()` (nothing recorded), and `rerun` the
/// same region (it runs on leaf copies in the backward pass; an error there panics).
pub fn link_recomputed<M, const D: usize, const E: usize, F, Err>(
    module: &M,
    x: Tensor<D>,
    output: Tensor<E>,
    rerun: F,
) -> Tensor<E>
where
    M: Module + Send + Sync + 'static,
    F: Fn(&M, Tensor<D>) -> Result<Tensor<E>, Err> + Send + Sync + 'static,
    Err: fmt::Display,
{
    let device = x.device();
    let module = module.clone();
    let region = Region(Arc::new(move |x: TensorData, dy: TensorData| {
        let leaves = module.clone().no_grad().set_require_grad(true);
        let x = Tensor::<D>::from_data(x, &device).require_grad();
        let y = rerun(&leaves, x.clone())
            .unwrap_or_else(|e| panic!("recomputing a region in the backward pass failed: {e}"));
        let dy = Tensor::<E>::from_data(dy, &device);
        let mut grads = (y * dy).sum().backward();
        let dx = grad_or_zeros(&x, &mut grads);
        let params = GradientsParams::from_grads(grads, &leaves);
        PARAM_GRADS.with(|g| g.borrow_mut().push(params));
        dx
    }));
    link(x, output, region)
}

fn grad_or_zeros<const D: usize>(x: &Tensor<D>, grads: &mut Gradients) -> TensorData {
    match x.grad_remove(grads) {
        Some(g) => g.into_data(),
        None => Tensor::<D>::zeros(x.shape(), &x.device()).into_data(),
    }
}

fn link<const D: usize, const E: usize>(
    input: Tensor<D>,
    output: Tensor<E>,
    region: Region,
) -> Tensor<E> {
    Tensor::from_dispatch(Dispatch::recompute_link(
        input.into_dispatch(),
        output.into_dispatch(),
        region,
    ))
}
