//! The `MoeOps` backend extension and its user-facing tensor functions.
//!
//! Primitive ops (one per kernel) live on the [`MoeOps`] trait, implemented for the Flex CPU
//! backend in `flex`, for `Autodiff<B>` with hand-written backward passes in `autodiff`, and
//! (features `vulkan`, `cuda`, `rocm`) for Burn's CubeCL backend with GPU kernels in `cube`.
//!
//! The free functions in this module ([`permute`], [`unpermute`], [`grouped_matmul`],
//! [`sort_chunks_by_idxs`], [`topk_indices`], [`attach_loss`]) take and return plain
//! `burn::tensor::Tensor`s, validate their arguments and return [`BackendError`] on bad input.

mod autodiff;
// The cuBLAS candidate's host planning: built (and tested) everywhere, used with `cuda`.
#[cfg(feature = "cube")]
mod cube;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod cublas_plan;
#[cfg(feature = "cube")]
pub use cube::{
    CubeGemmKernel, CublasRoute, GEMM_KERNEL_ENV, cube_gemm_kernel, cublas_library_info,
    last_cube_gemm_kernel, last_cublas_route, set_cube_gemm_kernel,
};
mod flex;
pub mod kernels;
#[cfg(test)]
mod tests;

use burn::backend::{
    Backend, Dispatch, backend_extension,
    tensor::{BoolTensor, FloatTensor, IntTensor},
};
use burn::tensor::{Bool, Int, Tensor, TensorData};

use crate::error::{BackendError, Result};

/// Backend extension with the primitive MoE kernels
/// (docs/routing-and-dispatch.md §Permute and unpermute, §Chunk sorting, §Grouped GEMM).
///
/// Integer outputs use `i32`. Implementations must be deterministic: results do not depend on
/// thread count.
#[backend_extension(Flex, Autodiff, Cube: cfg(feature = "cube"))]
pub trait MoeOps: Backend {
    /// Expert-major row order for `routing_map [T, E]`
    /// (docs/routing-and-dispatch.md §Permute and unpermute).
    ///
    /// Returns `(sorted_indices [N], probs_index [N], tokens_per_expert [E])`: row `r` of the
    /// permuted tensor is token `sorted_indices[r]`; `probs_index[r] = t·E + e` indexes the
    /// flattened `probs [T, E]`. Rows are expert-major with ascending token index inside each
    /// expert. With `capacity = Some(c)` (drop-and-pad) every expert gets exactly `c` rows: its
    /// routed tokens ascending, then unrouted tokens ascending, truncated to `c`.
    fn moe_routing_index(
        routing_map: BoolTensor<Self>,
        capacity: Option<usize>,
    ) -> (IntTensor<Self>, IntTensor<Self>, IntTensor<Self>);

    /// Indices of the `k` largest entries of each row of `scores [T, E]`, in descending value
    /// order; among equal values the lower index wins
    /// (docs/routing-and-dispatch.md §Notation and conventions). Output `[T, k]`.
    fn moe_topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self>;

    /// Gathers token rows: `out[r] = tokens[sorted_indices[r]]` (`[T, H] -> [N, H]`).
    fn moe_permute(tokens: FloatTensor<Self>, sorted_indices: IntTensor<Self>)
    -> FloatTensor<Self>;

    /// Scatter-adds rows back to tokens: `out[t] = Σ_{r: idx[r] = t} rows[r]`,
    /// accumulated in f32 (f64 for f64 inputs); `[N, H] -> [num_tokens, H]`.
    fn moe_unpermute(
        rows: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
        num_tokens: usize,
    ) -> FloatTensor<Self>;

    /// [`moe_unpermute`](MoeOps::moe_unpermute) with every row scaled by `probs [N]` before
    /// the sum.
    fn moe_unpermute_weighted(
        rows: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
        probs: FloatTensor<Self>,
        num_tokens: usize,
    ) -> FloatTensor<Self>;

    /// Grouped GEMM (docs/routing-and-dispatch.md §Grouped GEMM): `x [N, K]` in consecutive
    /// segments of `group_sizes [G]`. With `transpose_weights`, `weights [G, M, K]` and
    /// `Y_g = X_g · W_gᵀ`; otherwise `weights [G, K, M]` and `Y_g = X_g · W_g`. Output `[N, M]`.
    fn moe_grouped_matmul(
        x: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: IntTensor<Self>,
        transpose_weights: bool,
    ) -> FloatTensor<Self>;

    /// Grouped weight gradient: `out_g [P, Q] = lhs[seg_g]ᵀ · rhs[seg_g]` for `lhs [N, P]`,
    /// `rhs [N, Q]`; zero for empty groups. Output `[G, P, Q]`.
    fn moe_grouped_matmul_wgrad(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        group_sizes: IntTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `sort_chunks_by_idxs` (docs/routing-and-dispatch.md §Chunk sorting): split rows into chunks
    /// of `split_sizes` and concatenate them in `sorted_idxs` order.
    fn moe_sort_chunks(
        x: FloatTensor<Self>,
        split_sizes: Vec<usize>,
        sorted_idxs: Vec<usize>,
    ) -> FloatTensor<Self>;

    /// Fused SwiGLU with routing weights (docs/routing-and-dispatch.md §Experts, steps 3–4):
    /// `hidden [N, 2F]` with rows `[gate; up]`, `probs [N]`; returns `z = silu(gate) ⊙ up · p` as
    /// `[N, F]`.
    fn moe_swiglu(hidden: FloatTensor<Self>, probs: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Backward of [`moe_swiglu`](MoeOps::moe_swiglu): `(d_hidden [N, 2F], d_probs [N])` for the
    /// upstream gradient `grad [N, F]`. Not itself differentiable.
    fn moe_swiglu_backward(
        hidden: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Identity on `x` whose backward also sends the constant gradient `grad_scale` to `loss`
    /// (Megatron's `MoEAuxLossAutoScaler`,
    /// docs/routing-and-dispatch.md §Load-balancing losses and z-loss): attaches an auxiliary loss
    /// to the graph without adding it to the main loss.
    fn moe_attach_loss(
        x: FloatTensor<Self>,
        loss: FloatTensor<Self>,
        grad_scale: f64,
    ) -> FloatTensor<Self>;
}

/// Token-to-row bookkeeping produced by [`permute`] and consumed by [`unpermute`].
#[derive(Clone, Debug)]
pub struct RowIdMap {
    /// `[N]` token index of every permuted row.
    pub sorted_indices: Tensor<1, Int>,
    /// `[N]` flat index `t·E + e` of every permuted row into `probs [T, E]`.
    pub probs_index: Tensor<1, Int>,
    /// `[E]` rows per expert.
    pub tokens_per_expert: Tensor<1, Int>,
    /// `T`, the number of tokens to restore.
    pub num_tokens: usize,
    /// `E`, the number of experts of the routing map.
    pub num_experts: usize,
}

impl RowIdMap {
    /// Number of permuted rows `N`.
    pub fn num_rows(&self) -> usize {
        self.sorted_indices.dims()[0]
    }

    /// Rows per expert read back to the host.
    pub fn tokens_per_expert_host(&self) -> Vec<usize> {
        int_tensor_to_usize(self.tokens_per_expert.clone())
    }
}

/// How [`permute`] treats experts with more or fewer tokens than a capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PermuteMode {
    /// Every selected (token, expert) pair becomes one row: `N = routing_map.sum()`.
    #[default]
    Dropless,
    /// Every expert gets exactly `capacity` rows: its routed tokens (ascending), then unrouted
    /// tokens (ascending) as padding; routed tokens beyond `capacity` are dropped.
    DropAndPad {
        /// Rows per expert.
        capacity: usize,
    },
}

/// Output of [`permute`].
#[derive(Clone, Debug)]
pub struct Permuted {
    /// `[N, H]` token rows in expert-major order.
    pub rows: Tensor<2>,
    /// `[N]` routing weight of every row (present when `probs` were given).
    pub probs: Option<Tensor<1>>,
    /// Bookkeeping for [`unpermute`].
    pub row_id_map: RowIdMap,
}

/// Builds a `[T, E]` routing map from top-k expert indices `[T, k]`.
pub fn routing_map_from_indices(indices: Tensor<2, Int>, num_experts: usize) -> Tensor<2, Bool> {
    let [t, _] = indices.dims();
    let device = indices.device();
    let ones = indices.ones_like();
    Tensor::<2, Int>::zeros([t, num_experts], &device)
        .scatter(1, indices, ones, burn::tensor::IndexingUpdateOp::Add)
        .greater_elem(0)
}

/// Permutes `tokens [T, H]` into expert-major rows
/// (docs/routing-and-dispatch.md §Permute and unpermute).
///
/// `routing_map [T, E]` selects the (token, expert) pairs; `probs [T, E]` (optional) are gathered
/// in the same order and stay differentiable. Rows are expert-major with ascending token index
/// inside each expert.
pub fn permute(
    tokens: Tensor<2>,
    routing_map: Tensor<2, Bool>,
    probs: Option<Tensor<2>>,
    mode: PermuteMode,
) -> Result<Permuted> {
    let [t, _h] = tokens.dims();
    let [tm, e] = routing_map.dims();
    if tm != t {
        return Err(BackendError::Shape {
            op: "permute",
            detail: format!("routing_map has {tm} rows but tokens have {t}"),
        });
    }
    if let Some(p) = &probs
        && p.dims() != [t, e]
    {
        return Err(BackendError::Shape {
            op: "permute",
            detail: format!("probs have shape {:?}, expected [{t}, {e}]", p.dims()),
        });
    }
    let capacity = match mode {
        PermuteMode::Dropless => None,
        PermuteMode::DropAndPad { capacity } => {
            if capacity > t {
                return Err(BackendError::Config {
                    field: "capacity",
                    detail: format!("capacity {capacity} exceeds the {t} tokens available"),
                });
            }
            Some(capacity)
        }
    };
    let (sorted, probs_index, per_expert) =
        Dispatch::moe_routing_index(routing_map.into_dispatch(), capacity);
    let row_id_map = RowIdMap {
        sorted_indices: Tensor::from_dispatch(sorted),
        probs_index: Tensor::from_dispatch(probs_index),
        tokens_per_expert: Tensor::from_dispatch(per_expert),
        num_tokens: t,
        num_experts: e,
    };
    let rows = Tensor::from_dispatch(Dispatch::moe_permute(
        tokens.into_dispatch(),
        row_id_map.sorted_indices.clone().into_dispatch(),
    ));
    let probs = probs.map(|p| p.reshape([t * e]).select(0, row_id_map.probs_index.clone()));
    Ok(Permuted {
        rows,
        probs,
        row_id_map,
    })
}

/// Like [`permute`], with routing given as top-k expert indices `[T, k]` and their weights
/// `[T, k]` (HF style). Duplicate experts within a row count once.
pub fn permute_with_indices(
    tokens: Tensor<2>,
    indices: Tensor<2, Int>,
    weights: Option<Tensor<2>>,
    num_experts: usize,
    mode: PermuteMode,
) -> Result<Permuted> {
    let [t, k] = indices.dims();
    if let Some(w) = &weights
        && w.dims() != [t, k]
    {
        return Err(BackendError::Shape {
            op: "permute_with_indices",
            detail: format!("weights have shape {:?}, expected [{t}, {k}]", w.dims()),
        });
    }
    let (min, max) = if t > 0 && k > 0 {
        let v = indices
            .clone()
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .map_err(|e| BackendError::Index {
                op: "permute_with_indices",
                detail: format!("cannot read indices: {e:?}"),
            })?;
        (
            v.iter().copied().min().unwrap_or(0),
            v.iter().copied().max().unwrap_or(0),
        )
    } else {
        (0, 0)
    };
    if min < 0 || max >= num_experts as i64 {
        return Err(BackendError::Index {
            op: "permute_with_indices",
            detail: format!("expert indices span {min}..={max}, valid is 0..{num_experts}"),
        });
    }
    let map = routing_map_from_indices(indices.clone(), num_experts);
    let dense = weights.map(|w| {
        Tensor::<2>::zeros([t, num_experts], &w.device()).scatter(
            1,
            indices,
            w,
            burn::tensor::IndexingUpdateOp::Add,
        )
    });
    permute(tokens, map, dense, mode)
}

/// Restores `[T, H]` from permuted rows `[N, H]`: each token gets the sum of its copies, optionally
/// weighted by `probs [N]` (docs/routing-and-dispatch.md §Permute and unpermute). Unrouted tokens
/// get zeros.
pub fn unpermute(
    rows: Tensor<2>,
    row_id_map: &RowIdMap,
    probs: Option<Tensor<1>>,
) -> Result<Tensor<2>> {
    let [n, _] = rows.dims();
    if n != row_id_map.num_rows() {
        return Err(BackendError::Shape {
            op: "unpermute",
            detail: format!("{n} rows given, row_id_map has {}", row_id_map.num_rows()),
        });
    }
    if let Some(p) = &probs
        && p.dims() != [n]
    {
        return Err(BackendError::Shape {
            op: "unpermute",
            detail: format!("probs have shape {:?}, expected [{n}]", p.dims()),
        });
    }
    let idx = row_id_map.sorted_indices.clone().into_dispatch();
    let t = row_id_map.num_tokens;
    Ok(Tensor::from_dispatch(match probs {
        None => Dispatch::moe_unpermute(rows.into_dispatch(), idx, t),
        Some(p) => {
            Dispatch::moe_unpermute_weighted(rows.into_dispatch(), idx, p.into_dispatch(), t)
        }
    }))
}

/// Group sizes of a grouped GEMM: on the host, or as a device tensor (no device-to-host sync).
#[derive(Clone, Debug)]
pub enum GroupSizes {
    /// Host sizes; validated against the row count.
    Host(Vec<usize>),
    /// Device int tensor `[G]`; trusted to sum to the row count (checked by the kernel).
    Device(Box<Tensor<1, Int>>),
}

/// Orientation of grouped-GEMM weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[G, M, K]` (PyTorch `[out, in]`): `Y_g = X_g · W_gᵀ`.
    OutIn,
    /// `[G, K, M]` (`[in, out]`): `Y_g = X_g · W_g`.
    InOut,
}

/// Grouped GEMM: `x [N, K]` split into consecutive row segments by `sizes`, each multiplied by its
/// own weight matrix (docs/routing-and-dispatch.md §Grouped GEMM). Differentiable in `x` and
/// `weights`.
pub fn grouped_matmul(
    x: Tensor<2>,
    weights: Tensor<3>,
    sizes: &GroupSizes,
    layout: WeightLayout,
) -> Result<Tensor<2>> {
    let [n, k] = x.dims();
    let [g, a, b] = weights.dims();
    let in_dim = match layout {
        WeightLayout::OutIn => b,
        WeightLayout::InOut => a,
    };
    if in_dim != k {
        return Err(BackendError::Shape {
            op: "grouped_matmul",
            detail: format!(
                "x has {k} columns but {layout:?} weights {:?} expect {in_dim}",
                [g, a, b]
            ),
        });
    }
    let sizes = group_sizes_tensor("grouped_matmul", sizes, g, n, &x.device())?;
    Ok(Tensor::from_dispatch(Dispatch::moe_grouped_matmul(
        x.into_dispatch(),
        weights.into_dispatch(),
        sizes.into_dispatch(),
        layout == WeightLayout::OutIn,
    )))
}

/// Grouped weight gradient `out_g = lhs[seg_g]ᵀ · rhs[seg_g]` (`[N,P] x [N,Q] -> [G,P,Q]`).
pub fn grouped_matmul_wgrad(
    lhs: Tensor<2>,
    rhs: Tensor<2>,
    sizes: &GroupSizes,
) -> Result<Tensor<3>> {
    let [n, _] = lhs.dims();
    let [n2, _] = rhs.dims();
    if n != n2 {
        return Err(BackendError::Shape {
            op: "grouped_matmul_wgrad",
            detail: format!("lhs has {n} rows, rhs has {n2}"),
        });
    }
    let groups = match sizes {
        GroupSizes::Host(s) => s.len(),
        GroupSizes::Device(t) => t.dims()[0],
    };
    let sizes = group_sizes_tensor("grouped_matmul_wgrad", sizes, groups, n, &lhs.device())?;
    Ok(Tensor::from_dispatch(Dispatch::moe_grouped_matmul_wgrad(
        lhs.into_dispatch(),
        rhs.into_dispatch(),
        sizes.into_dispatch(),
    )))
}

fn group_sizes_tensor(
    op: &'static str,
    sizes: &GroupSizes,
    groups: usize,
    rows: usize,
    device: &burn::tensor::Device,
) -> Result<Tensor<1, Int>> {
    match sizes {
        GroupSizes::Host(s) => {
            if s.len() != groups {
                return Err(BackendError::Shape {
                    op,
                    detail: format!("{} group sizes for {groups} weight groups", s.len()),
                });
            }
            let sum: usize = s.iter().sum();
            if sum != rows {
                return Err(BackendError::SizeSum { op, sum, rows });
            }
            usize_to_int_tensor(s, device)
        }
        GroupSizes::Device(t) => {
            if t.dims()[0] != groups {
                return Err(BackendError::Shape {
                    op,
                    detail: format!("{} group sizes for {groups} weight groups", t.dims()[0]),
                });
            }
            Ok(t.as_ref().clone())
        }
    }
}

/// `sort_chunks_by_idxs` (docs/routing-and-dispatch.md §Chunk sorting): splits `x` along rows into
/// chunks of `split_sizes` and concatenates them in `sorted_idxs` order. Differentiable (backward
/// is the inverse reorder).
pub fn sort_chunks_by_idxs(
    x: Tensor<2>,
    split_sizes: &[usize],
    sorted_idxs: &[usize],
) -> Result<Tensor<2>> {
    let op = "sort_chunks_by_idxs";
    let rows = x.dims()[0];
    let sum: usize = split_sizes.iter().sum();
    if sum != rows {
        return Err(BackendError::SizeSum { op, sum, rows });
    }
    check_permutation(op, sorted_idxs, split_sizes.len())?;
    Ok(Tensor::from_dispatch(Dispatch::moe_sort_chunks(
        x.into_dispatch(),
        split_sizes.to_vec(),
        sorted_idxs.to_vec(),
    )))
}

/// Checks that `order` is a permutation of `0..n`.
pub(crate) fn check_permutation(op: &'static str, order: &[usize], n: usize) -> Result<()> {
    if order.len() != n {
        return Err(BackendError::Index {
            op,
            detail: format!("order has {} entries for {n} chunks", order.len()),
        });
    }
    let mut seen = vec![false; n];
    for &i in order {
        if i >= n || std::mem::replace(&mut seen[i], true) {
            return Err(BackendError::Index {
                op,
                detail: format!("order {order:?} is not a permutation of 0..{n}"),
            });
        }
    }
    Ok(())
}

/// Indices of the `k` largest entries per row of `scores [T, E]`, descending, ties to the lower
/// index (docs/routing-and-dispatch.md §Notation and conventions). Not differentiable (gather the
/// scores with the result instead).
pub fn topk_indices(scores: Tensor<2>, k: usize) -> Result<Tensor<2, Int>> {
    let [_, e] = scores.dims();
    if k == 0 || k > e {
        return Err(BackendError::Config {
            field: "topk",
            detail: format!("k = {k} must be in 1..={e}"),
        });
    }
    Ok(Tensor::from_dispatch(Dispatch::moe_topk_indices(
        scores.into_dispatch(),
        k,
    )))
}

/// Fused SwiGLU with routing weights: `hidden [N, 2F]` (rows `[gate; up]`), `probs [N]` ->
/// `silu(gate) ⊙ up · p` `[N, F]` (docs/routing-and-dispatch.md §Experts, steps 3–4).
/// Differentiable in both inputs.
pub fn swiglu_with_probs(hidden: Tensor<2>, probs: Tensor<1>) -> Result<Tensor<2>> {
    let [n, two_f] = hidden.dims();
    if two_f % 2 != 0 || probs.dims() != [n] {
        return Err(BackendError::Shape {
            op: "swiglu_with_probs",
            detail: format!(
                "hidden {:?} must be [N, 2F] and probs {:?} must be [{n}]",
                [n, two_f],
                probs.dims()
            ),
        });
    }
    Ok(Tensor::from_dispatch(Dispatch::moe_swiglu(
        hidden.into_dispatch(),
        probs.into_dispatch(),
    )))
}

/// gpt-oss's clamped SwiGLU with routing weights (transformers 5.23
/// `GptOssExperts._apply_gate`, then the routing weight): `hidden [N, 2F]` (rows `[gate; up]`),
/// `probs [N]` -> `(clamp(up, −limit, limit) + 1) ⊙ g ⊙ σ(alpha·g) · p` `[N, F]` with
/// `g = min(gate, limit)` (the gate is clamped from above only).
///
/// Composed of Burn tensor ops, so it runs on every backend and autodiff gives its exact
/// gradient: zero for a gate above `limit` and an up outside `[−limit, limit]`; a value exactly
/// at the limit passes its gradient, as `torch.clamp` does. Differentiable in both inputs.
pub fn clamped_swiglu_with_probs(
    hidden: Tensor<2>,
    probs: Tensor<1>,
    alpha: f64,
    limit: f64,
) -> Result<Tensor<2>> {
    let [n, two_f] = hidden.dims();
    if two_f % 2 != 0 || probs.dims() != [n] {
        return Err(BackendError::Shape {
            op: "clamped_swiglu_with_probs",
            detail: format!(
                "hidden {:?} must be [N, 2F] and probs {:?} must be [{n}]",
                [n, two_f],
                probs.dims()
            ),
        });
    }
    if !alpha.is_finite() || !limit.is_finite() || limit <= 0.0 {
        return Err(BackendError::Config {
            field: "activation",
            detail: format!(
                "clamped SwiGLU needs a finite alpha ({alpha}) and limit > 0 ({limit})"
            ),
        });
    }
    let f = two_f / 2;
    let gate = hidden.clone().narrow(1, 0, f).clamp_max(limit);
    let up = hidden.narrow(1, f, f).clamp(-limit, limit);
    let glu = gate.clone() * burn::tensor::activation::sigmoid(gate.mul_scalar(alpha));
    Ok((up.add_scalar(1.0) * glu) * probs.reshape([n, 1]))
}

/// Returns `x` unchanged; in the backward pass `loss` receives the constant gradient `grad_scale`
/// (the attachment of docs/routing-and-dispatch.md §Load-balancing losses and z-loss). `loss` is
/// never added to the main loss.
pub fn attach_loss<const D: usize>(x: Tensor<D>, loss: Tensor<1>, grad_scale: f64) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::moe_attach_loss(
        x.into_dispatch(),
        loss.into_dispatch(),
        grad_scale,
    ))
}

/// Reads a small int tensor back to the host as `usize` (negative values clamp to 0).
pub fn int_tensor_to_usize<const D: usize>(t: Tensor<D, Int>) -> Vec<usize> {
    t.into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .map(|v| v.into_iter().map(|x| x.max(0) as usize).collect())
        .unwrap_or_default()
}

/// Creates an `i32` int tensor from host values.
pub fn usize_to_int_tensor(
    values: &[usize],
    device: &burn::tensor::Device,
) -> Result<Tensor<1, Int>> {
    let ints = values
        .iter()
        .map(|&v| {
            i32::try_from(v).map_err(|_| BackendError::Index {
                op: "usize_to_int_tensor",
                detail: format!("{v} does not fit in i32"),
            })
        })
        .collect::<Result<Vec<i32>>>()?;
    Ok(Tensor::from_data(
        TensorData::new(ints, [values.len()]),
        device,
    ))
}
