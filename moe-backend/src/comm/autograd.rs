//! Differentiable collectives and Megatron's model-parallel region ops.
//!
//! A collective's forward runs on host data through [`Comm`]; its output is then attached to
//! the input's autodiff graph by the [`CollectiveOps::collective_link`] backend op, whose
//! backward runs the transposed collective ([`GradCollective`]). On backends without autodiff
//! the link is free.
//!
//! | forward | backward |
//! |---|---|
//! | `all_to_all_v(send, recv)` | `all_to_all_v(recv, send)` |
//! | `all_gather(_v)` along dim 0 | `reduce_scatter` (sum) with the gathered sizes |
//! | `reduce_scatter` (sum) | `all_gather` |
//! | `all_reduce` (sum) | identity |
//! | [`copy_to_tensor_parallel_region`] (identity) | `all_reduce` (sum) |
//! | [`reduce_from_tensor_parallel_region`] (`all_reduce`) | identity |
//! | [`scatter_to_tensor_parallel_region`] (own last-dim chunk) | all-gather along the last dim |
//! | [`gather_from_tensor_parallel_region`] (all-gather, last dim) | own last-dim chunk |
//! | [`scatter_to_sequence_parallel_region`] (own dim-0 chunk) | all-gather along dim 0 |
//! | [`gather_from_sequence_parallel_region`] (all-gather, dim 0) | reduce-scatter, or own chunk |
//! | [`reduce_scatter_to_sequence_parallel_region`] | all-gather along dim 0 |
//!
//! Devices: the link op exists for Flex, `Autodiff` and (feature `cube`) Burn's CubeCL
//! backend, so these collectives are differentiable on a GPU device too. With more than one
//! member the data still travels as host [`TensorData`] (every [`Communicator`] transport takes
//! host bytes: the tensor is read back from the device, exchanged, and uploaded again). A group
//! of one member never leaves the device: every collective, region op and backward is then the
//! identity (or its scale) on the tensor itself.
//!
//! [`Communicator`]: super::Communicator
//!
//! Collectives inside a backward pass must succeed: Burn's `backward()` cannot return an error,
//! so a failure there panics with the collective's error message (the in-process
//! [`World`](super::World) reports it as that rank's error and aborts the others).
//!
//! Ranks must not share autodiff tensors (each rank builds its own parameters): Burn merges the
//! graphs of connected tensors, and one rank's backward would then wait on another's.

use std::panic::Location;

use burn::backend::{
    Backend, Dispatch, Flex, TensorMetadata,
    autodiff::{
        Autodiff,
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
    backend_extension,
    tensor::FloatTensor,
};
use burn::tensor::{Tensor, TensorData};

use super::data::{rows_and_row_bytes, split_rows, trailing};
use super::{CallSite, Comm, ReduceOp};
use crate::error::{BackendError, Result};

/// The collective a backward pass runs on the output gradient.
#[derive(Clone, Debug)]
pub enum GradCollective {
    /// Gradient passes through.
    Identity,
    /// Gradient scaled by a constant.
    Scale(f64),
    /// The forward op has no gradient (e.g. `max` reductions).
    NotDifferentiable(&'static str),
    /// Sum-all-reduce of the gradient.
    AllReduce {
        /// Group.
        comm: Comm,
        /// Forward call site.
        site: CallSite,
    },
    /// Sum-reduce-scatter of the gradient with the given dim-0 blocks.
    ReduceScatter {
        /// Group.
        comm: Comm,
        /// Block sizes (the forward all-gather's per-member rows).
        splits: Vec<usize>,
        /// Forward call site.
        site: CallSite,
    },
    /// All-gather of the gradient along dim 0, times `scale`.
    AllGather {
        /// Group.
        comm: Comm,
        /// Factor applied after gathering.
        scale: f64,
        /// Forward call site.
        site: CallSite,
    },
    /// All-to-all of the gradient (splits already swapped).
    AllToAll {
        /// Group.
        comm: Comm,
        /// Rows to send to each member.
        send_splits: Vec<usize>,
        /// Rows to receive from each member.
        recv_splits: Vec<usize>,
        /// Forward call site.
        site: CallSite,
    },
    /// Sum of all members' gradients on `root`, zero elsewhere.
    ReduceToRoot {
        /// Group.
        comm: Comm,
        /// Root member.
        root: usize,
        /// Forward call site.
        site: CallSite,
    },
    /// This member's dim-0 block of the gradient.
    SplitRows {
        /// Group (for the member index).
        comm: Comm,
        /// Block sizes.
        splits: Vec<usize>,
    },
    /// All-gather of the gradient along its last dim.
    GatherLastDim {
        /// Group.
        comm: Comm,
        /// Forward call site.
        site: CallSite,
    },
    /// This member's chunk of the gradient's last dim.
    SplitLastDim {
        /// Group (for the member index and size).
        comm: Comm,
    },
}

fn ok_or_panic<T>(result: Result<T>) -> T {
    result.unwrap_or_else(|e| panic!("collective backward failed: {e}"))
}

fn read<B: Backend>(comm: &Comm, t: FloatTensor<B>) -> TensorData {
    comm.staged
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    match burn::tensor::try_read_sync(B::float_into_data(t)) {
        Some(Ok(data)) => data,
        Some(Err(e)) => panic!("collective backward: reading the gradient failed: {e:?}"),
        None => panic!("collective backward: the backend cannot read tensors synchronously"),
    }
}

fn upload<B: Backend>(comm: &Comm, data: TensorData, device: &B::Device) -> FloatTensor<B> {
    comm.staged
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    B::float_from_data(data, device)
}

impl GradCollective {
    /// Runs the backward collective on `grad` (panics on a communication failure; see the
    /// module docs). Collectives take the transport's device-buffer path when it has one
    /// for the gradient's device ([`Comm::run_primitive`]).
    fn apply<B: Backend>(&self, grad: FloatTensor<B>) -> FloatTensor<B> {
        if let Some(out) = self.apply_single_member::<B>(&grad) {
            return out;
        }
        let scaled = |out: FloatTensor<B>, scale: f64| {
            if scale == 1.0 {
                out
            } else {
                B::float_mul_scalar(out, scale.into())
            }
        };
        match self {
            GradCollective::Identity => grad,
            GradCollective::Scale(s) => B::float_mul_scalar(grad, (*s).into()),
            GradCollective::NotDifferentiable(op) => {
                panic!("{op} is not differentiable")
            }
            GradCollective::AllReduce { comm, site } => ok_or_panic(comm.run_primitive::<B>(
                grad,
                |dc, buf| dc.all_reduce(buf, ReduceOp::Sum, site),
                |c, data| c.all_reduce(data, ReduceOp::Sum, site),
            )),
            GradCollective::ReduceScatter { comm, splits, site } => {
                ok_or_panic(comm.run_primitive::<B>(
                    grad,
                    |dc, buf| dc.reduce_scatter_v(buf, splits, ReduceOp::Sum, site),
                    |c, data| c.reduce_scatter_v(data, splits, ReduceOp::Sum, site),
                ))
            }
            GradCollective::AllGather { comm, scale, site } => {
                let out = ok_or_panic(comm.run_primitive::<B>(
                    grad,
                    |dc, buf| dc.all_gather_v(buf, site).map(|(b, _)| b),
                    |c, data| c.all_gather_v(data, site).map(|(d, _)| d),
                ));
                scaled(out, *scale)
            }
            GradCollective::AllToAll {
                comm,
                send_splits,
                recv_splits,
                site,
            } => ok_or_panic(comm.run_primitive::<B>(
                grad,
                |dc, buf| dc.all_to_all_v(buf, send_splits, recv_splits, site),
                |c, data| c.all_to_all_v(data, send_splits, recv_splits, site),
            )),
            GradCollective::ReduceToRoot { comm, root, site } => {
                let sum = ok_or_panic(comm.run_primitive::<B>(
                    grad,
                    |dc, buf| dc.all_reduce(buf, ReduceOp::Sum, site),
                    |c, data| c.all_reduce(data, ReduceOp::Sum, site),
                ));
                if comm.rank() == *root {
                    sum
                } else {
                    B::float_mul_scalar(sum, 0.0.into())
                }
            }
            GradCollective::SplitRows { comm, splits } => {
                let device = grad.device();
                let data = ok_or_panic(own_rows(&read::<B>(comm, grad), splits, comm.rank()));
                upload::<B>(comm, data, &device)
            }
            GradCollective::GatherLastDim { comm, site } => {
                let device = grad.device();
                let data = ok_or_panic(gather_last_dim(comm, read::<B>(comm, grad), site));
                upload::<B>(comm, data, &device)
            }
            GradCollective::SplitLastDim { comm } => {
                let device = grad.device();
                let data = ok_or_panic(split_last_dim(
                    comm,
                    &read::<B>(comm, grad),
                    Location::caller(),
                ));
                upload::<B>(comm, data, &device)
            }
        }
    }
}

impl GradCollective {
    /// The backward of a group of one member, on the device (no host read): every transposed
    /// collective is then the identity (times the `AllGather` scale). `None` for a larger group.
    fn apply_single_member<B: Backend>(&self, grad: &FloatTensor<B>) -> Option<FloatTensor<B>> {
        let comm = match self {
            GradCollective::Identity
            | GradCollective::Scale(_)
            | GradCollective::NotDifferentiable(_) => return None,
            GradCollective::AllReduce { comm, .. }
            | GradCollective::ReduceScatter { comm, .. }
            | GradCollective::AllGather { comm, .. }
            | GradCollective::AllToAll { comm, .. }
            | GradCollective::ReduceToRoot { comm, .. }
            | GradCollective::SplitRows { comm, .. }
            | GradCollective::GatherLastDim { comm, .. }
            | GradCollective::SplitLastDim { comm } => comm,
        };
        if comm.size() != 1 {
            return None;
        }
        Some(match self {
            GradCollective::AllGather { scale, .. } if *scale != 1.0 => {
                B::float_mul_scalar(grad.clone(), (*scale).into())
            }
            _ => grad.clone(),
        })
    }
}

/// Backend op attaching a collective's output to the autodiff graph of its input.
#[backend_extension(Flex, Autodiff, Cube: cfg(feature = "cube"))]
pub trait CollectiveOps: Backend {
    /// Returns `output`; under autodiff its gradient flows to `input` through `grad`.
    fn collective_link(
        input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        grad: GradCollective,
    ) -> FloatTensor<Self>;
}

impl CollectiveOps for Flex {
    fn collective_link(
        _input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        _grad: GradCollective,
    ) -> FloatTensor<Self> {
        output
    }
}

/// Burn's CubeCL backend (every CubeCL runtime): the link is free, as on Flex; the collective
/// itself ran before (host-staged for groups of several members, on the device for one).
#[cfg(feature = "cube")]
impl CollectiveOps for burn_cubecl::CubeBackend {
    fn collective_link(
        _input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        _grad: GradCollective,
    ) -> FloatTensor<Self> {
        output
    }
}

impl<B: CollectiveOps, C: CheckpointStrategy> CollectiveOps for Autodiff<B, C> {
    fn collective_link(
        input: FloatTensor<Self>,
        output: FloatTensor<Self>,
        grad: GradCollective,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LinkBackward;

        impl<B: Backend> Backward<B, 1> for LinkBackward {
            type State = GradCollective;

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let dx = ops.state.apply::<B>(grad);
                if let Some(node) = parent {
                    grads.register::<B>(node.id, dx);
                }
            }
        }

        match LinkBackward
            .prepare::<C>([input.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(grad, output.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(output.into_primitive()),
        }
    }
}

/// Attaches `output` to `input`'s graph (see [`CollectiveOps::collective_link`]).
pub(crate) fn link<const D: usize>(
    input: Tensor<D>,
    output: Tensor<D>,
    grad: GradCollective,
) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::collective_link(
        input.into_dispatch(),
        output.into_dispatch(),
        grad,
    ))
}

/// This member's block of dim 0.
fn own_rows(data: &TensorData, splits: &[usize], index: usize) -> Result<TensorData> {
    let (rows, _) = rows_and_row_bytes(data);
    if splits.iter().sum::<usize>() != rows || index >= splits.len() {
        return Err(BackendError::SizeSum {
            op: "split_rows",
            sum: splits.iter().sum(),
            rows,
        });
    }
    let block = split_rows(data, splits)[index];
    let mut shape = vec![splits[index]];
    shape.extend(trailing(data));
    Ok(TensorData::from_bytes_vec(
        block.to_vec(),
        shape,
        data.dtype(),
    ))
}

/// `(rows, cols)` of the `[Π leading dims, last dim]` view.
fn last_dim_view(data: &TensorData) -> (usize, usize) {
    let dims = data.shape().as_slice();
    let cols = dims.last().copied().unwrap_or(1);
    let rows = dims.iter().rev().skip(1).product::<usize>();
    (rows, cols)
}

/// Every member's tensor concatenated along the last dim (all members pass the same shape).
fn gather_last_dim(comm: &Comm, data: TensorData, site: CallSite) -> Result<TensorData> {
    let n = comm.size();
    let dims = data.shape().to_vec();
    let dtype = data.dtype();
    let (rows, cols) = last_dim_view(&data);
    let flat = TensorData::from_bytes_vec(data.into_bytes().to_vec(), [rows * cols], dtype);
    let (gathered, sizes) = comm.inner.all_gather_v(flat, site)?;
    if sizes.iter().any(|&s| s != rows * cols) {
        return Err(BackendError::Collective {
            op: "gather_last_dim",
            group: comm.group_name(),
            detail: format!("members passed different shapes (element counts {sizes:?}) at {site}"),
        });
    }
    let elem = dtype.size();
    let src = gathered.as_bytes();
    let row = cols * elem;
    let mut out = Vec::with_capacity(src.len());
    for r in 0..rows {
        for m in 0..n {
            let start = (m * rows + r) * row;
            out.extend_from_slice(&src[start..start + row]);
        }
    }
    let mut shape = dims;
    if let Some(last) = shape.last_mut() {
        *last = cols * n;
    }
    Ok(TensorData::from_bytes_vec(out, shape, dtype))
}

/// This member's chunk of the last dim (which must divide by the group size).
fn split_last_dim(comm: &Comm, data: &TensorData, site: CallSite) -> Result<TensorData> {
    let n = comm.size();
    let (rows, cols) = last_dim_view(data);
    if cols % n != 0 {
        return Err(BackendError::Collective {
            op: "split_last_dim",
            group: comm.group_name(),
            detail: format!("last dim {cols} does not divide over {n} members (at {site})"),
        });
    }
    let chunk = cols / n;
    let elem = data.dtype().size();
    let src = data.as_bytes();
    let mut out = Vec::with_capacity(rows * chunk * elem);
    for r in 0..rows {
        let start = (r * cols + comm.rank() * chunk) * elem;
        out.extend_from_slice(&src[start..start + chunk * elem]);
    }
    let mut shape = data.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = chunk;
    }
    Ok(TensorData::from_bytes_vec(out, shape, data.dtype()))
}

/// Megatron `copy_to_tensor_model_parallel_region`: identity forward, sum-all-reduce backward
/// (input of a column-parallel linear).
#[track_caller]
pub fn copy_to_tensor_parallel_region<const D: usize>(comm: &Comm, x: Tensor<D>) -> Tensor<D> {
    if comm.size() == 1 {
        return x;
    }
    let site = Location::caller();
    let out = x.clone().detach();
    link(
        x,
        out,
        GradCollective::AllReduce {
            comm: comm.clone(),
            site,
        },
    )
}

/// Megatron `reduce_from_tensor_model_parallel_region`: sum-all-reduce forward, identity
/// backward (output of a row-parallel linear).
#[track_caller]
pub fn reduce_from_tensor_parallel_region<const D: usize>(
    comm: &Comm,
    x: Tensor<D>,
) -> Result<Tensor<D>> {
    comm.all_reduce(x, ReduceOp::Sum)
}

/// Megatron `scatter_to_tensor_model_parallel_region`: this member's chunk of the last dim
/// forward, all-gather along the last dim backward.
#[track_caller]
pub fn scatter_to_tensor_parallel_region<const D: usize>(
    comm: &Comm,
    x: Tensor<D>,
) -> Result<Tensor<D>> {
    if comm.size() == 1 {
        return Ok(x);
    }
    let site = Location::caller();
    let data = split_last_dim(comm, &comm.read(&x), site)?;
    let out = comm.upload(data, &x.device());
    Ok(link(
        x,
        out,
        GradCollective::GatherLastDim {
            comm: comm.clone(),
            site,
        },
    ))
}

/// Megatron `gather_from_tensor_model_parallel_region`: all-gather along the last dim
/// forward, this member's chunk backward.
#[track_caller]
pub fn gather_from_tensor_parallel_region<const D: usize>(
    comm: &Comm,
    x: Tensor<D>,
) -> Result<Tensor<D>> {
    if comm.size() == 1 {
        return Ok(x);
    }
    let site = Location::caller();
    let data = gather_last_dim(comm, comm.read(&x), site)?;
    let out = comm.upload(data, &x.device());
    Ok(link(
        x,
        out,
        GradCollective::SplitLastDim { comm: comm.clone() },
    ))
}

/// Megatron `scatter_to_sequence_parallel_region`: this member's equal block of dim 0
/// forward, all-gather along dim 0 backward.
#[track_caller]
pub fn scatter_to_sequence_parallel_region<const D: usize>(
    comm: &Comm,
    x: Tensor<D>,
) -> Result<Tensor<D>> {
    if comm.size() == 1 {
        return Ok(x);
    }
    let site = Location::caller();
    let n = comm.size();
    let rows = x.dims().first().copied().unwrap_or(1);
    if rows % n != 0 {
        return Err(BackendError::Collective {
            op: "scatter_to_sequence_parallel_region",
            group: comm.group_name(),
            detail: format!("{rows} rows do not divide over {n} members (at {site})"),
        });
    }
    let data = own_rows(&comm.read(&x), &vec![rows / n; n], comm.rank())?;
    let out = comm.upload(data, &x.device());
    Ok(link(
        x,
        out,
        GradCollective::AllGather {
            comm: comm.clone(),
            scale: 1.0,
            site,
        },
    ))
}

/// Megatron `gather_from_sequence_parallel_region`: all-gather along dim 0 forward; backward
/// reduce-scatter when the consumer is tensor-parallel (`tensor_parallel_output_grad`, each
/// rank holds a partial gradient), else this member's block of the (replicated) gradient.
#[track_caller]
pub fn gather_from_sequence_parallel_region<const D: usize>(
    comm: &Comm,
    x: Tensor<D>,
    tensor_parallel_output_grad: bool,
) -> Result<Tensor<D>> {
    if comm.size() == 1 {
        return Ok(x);
    }
    let site = Location::caller();
    let (out, sizes) = comm.run(
        &x,
        |dc, buf| dc.all_gather_v(buf, site),
        |c, data| c.all_gather_v(data, site),
    )?;
    let grad = if tensor_parallel_output_grad {
        GradCollective::ReduceScatter {
            comm: comm.clone(),
            splits: sizes,
            site,
        }
    } else {
        GradCollective::SplitRows {
            comm: comm.clone(),
            splits: sizes,
        }
    };
    Ok(link(x, out, grad))
}

/// Megatron `reduce_scatter_to_sequence_parallel_region`: sum-reduce-scatter along dim 0
/// forward, all-gather backward.
#[track_caller]
pub fn reduce_scatter_to_sequence_parallel_region<const D: usize>(
    comm: &Comm,
    x: Tensor<D>,
) -> Result<Tensor<D>> {
    comm.reduce_scatter(x, ReduceOp::Sum)
}
