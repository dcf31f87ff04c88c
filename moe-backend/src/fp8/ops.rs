//! The `Fp8Ops` backend extension: FP8 grouped GEMMs (fprop, dgrad, wgrad) with the blockwise
//! recipe, and the user-facing differentiable [`fp8_grouped_matmul`] / [`fp8_linear`].
//!
//! On Flex the kernels quantise the operands and run the tiled emulation of [`super::gemm`];
//! on Burn's CubeCL backend (feature `cube`) device kernels quantise the operands with the
//! same blocks and rounding (bit-identical decoded values) and the Cube grouped GEMM
//! multiplies them (results within float reordering of Flex's);
//! for `Autodiff<B>` the forward saves `x` and `W` and the backward calls the FP8 dgrad and
//! wgrad (straight-through: quantisation is treated as the identity in the gradient, as in
//! Transformer Engine).

mod autodiff;
#[cfg(feature = "cube")]
mod cube;
mod flex;

use burn::backend::{Backend, Dispatch, backend_extension, tensor::FloatTensor};
use burn::nn::Linear;
use burn::tensor::Tensor;

use super::recipe::Fp8Recipe;
use crate::error::{BackendError, Result};

/// Backend extension with the FP8 grouped GEMMs of the blockwise recipe (docs/fp8.md §Recipes).
///
/// `group_sizes` are host row counts per group (they must sum to the row count; the
/// user-facing functions check this). Outputs have the dtype of the first tensor argument,
/// accumulated in f32.
#[backend_extension(Flex, Autodiff, Cube: cfg(feature = "cube"))]
pub trait Fp8Ops: Backend {
    /// fprop: `x [N, K]` in segments of `group_sizes`, `weights [G, M, K]` (`[out, in]`, or
    /// `[M, K]` for one group): `y_g = dq(q(x_g)) · dq(q(W_g))ᵀ`, `[N, M]`. Differentiable in
    /// `x` and `weights`. A packed FP8 parameter ([`super::PackedFp8`]) as `weights` is used as
    /// its codes and scales (no re-quantisation) where the backend supports it (Flex).
    fn fp8_grouped_matmul(
        x: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self>;

    /// dgrad: `grad [N, M]`, `weights [G, M, K]` (or `[M, K]`):
    /// `dx_g = dq(q(dy_g)) · dq(q(W_g))`, `[N, K]`. Not itself differentiable.
    fn fp8_grouped_matmul_dgrad(
        grad: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self>;

    /// wgrad: `grad [N, M]`, `x [N, K]`: `dW_g = dq(q_col(dy_g))ᵀ · dq(q_col(x_g))`,
    /// `[G, M, K]`. Not itself differentiable.
    fn fp8_grouped_matmul_wgrad(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self>;
}

/// FP8 grouped GEMM for expert linears: `x [N, K]` split into consecutive row segments of
/// `sizes`, each multiplied by its expert's weight `weights [G, M, K]` (PyTorch `[out, in]`),
/// `y_g = dq(q(x_g)) · dq(q(W_g))ᵀ` with the blockwise recipe; `[N, M]`. Differentiable: the
/// backward runs the FP8 dgrad and wgrad. Empty groups and partial blocks are allowed.
pub fn fp8_grouped_matmul(
    x: Tensor<2>,
    weights: Tensor<3>,
    sizes: &[usize],
    recipe: &Fp8Recipe,
) -> Result<Tensor<2>> {
    let op = "fp8_grouped_matmul";
    recipe.validate()?;
    let [n, k] = x.dims();
    let [g, m, wk] = weights.dims();
    if wk != k || sizes.len() != g {
        return Err(BackendError::Shape {
            op,
            detail: format!(
                "x [{n}, {k}], weights [{g}, {m}, {wk}] ([G, out, in]) and {} group sizes",
                sizes.len()
            ),
        });
    }
    let sum: usize = sizes.iter().sum();
    if sum != n {
        return Err(BackendError::SizeSum { op, sum, rows: n });
    }
    Ok(Tensor::from_dispatch(Dispatch::fp8_grouped_matmul(
        x.into_dispatch(),
        weights.into_dispatch(),
        sizes.to_vec(),
        *recipe,
    )))
}

/// FP8 dense linear `y = dq(q(x)) · dq(q(W))ᵀ` for `x [N, K]`, `weight [M, K]`; `[N, M]`,
/// differentiable (a grouped GEMM with one group).
pub fn fp8_linear(x: Tensor<2>, weight: Tensor<2>, recipe: &Fp8Recipe) -> Result<Tensor<2>> {
    recipe.validate()?;
    let [n, k] = x.dims();
    let [m, wk] = weight.dims();
    if wk != k {
        return Err(BackendError::Shape {
            op: "fp8_linear",
            detail: format!("x [{n}, {k}], weight [{m}, {wk}] ([out, in])"),
        });
    }
    // The 2-D weight goes to the op as it is (one group): a reshape would materialise a
    // packed FP8 parameter.
    Ok(Tensor::from_dispatch(Dispatch::fp8_grouped_matmul(
        x.into_dispatch(),
        weight.into_dispatch(),
        vec![n],
        *recipe,
    )))
}

/// A Burn [`Linear`] run in FP8 (docs/fp8.md §Recipes): `y = dq(q(x)) · dq(q(W))ᵀ + b` over the
/// last dimension of `x [..., in]`. The weight (Burn `[in, out]`) is quantised as its canonical
/// `[out, in]` matrix in `b×b` blocks — the blocks FP8 primary weights use
/// ([`crate::optim::Fp8ParamLayout::linear`]) — and the bias stays in high precision.
/// Differentiable: the backward runs the FP8 dgrad and wgrad. A packed FP8 primary weight
/// ([`super::PackedFp8`]) is used as its codes and scales: the op receives the weight's transposed
/// view (zero-copy), never a materialised copy.
///
/// # Panics
/// Like [`Linear::forward`], when the last dimension of `x` is not the linear's input size.
pub fn fp8_linear_forward<const D: usize>(
    linear: &Linear,
    x: Tensor<D>,
    recipe: &Fp8Recipe,
) -> Tensor<D> {
    let dims = x.dims();
    let [d_in, d_out] = linear.weight.dims();
    assert_eq!(
        dims[D - 1],
        d_in,
        "fp8 linear: input [.., {}] for a {d_in} -> {d_out} linear",
        dims[D - 1]
    );
    let n: usize = dims[..D - 1].iter().product();
    let x2: Tensor<2> = x.reshape([n, d_in]);
    // `[out, in]`, a zero-copy view of the `[in, out]` parameter (one group).
    let w: Tensor<2> = linear.weight.val().transpose();
    let y: Tensor<2> = Tensor::from_dispatch(Dispatch::fp8_grouped_matmul(
        x2.into_dispatch(),
        w.into_dispatch(),
        vec![n],
        *recipe,
    ));
    let mut out_dims = dims;
    out_dims[D - 1] = d_out;
    let y = y.reshape(out_dims);
    match &linear.bias {
        Some(b) => y + b.val().unsqueeze(),
        None => y,
    }
}

/// `linear(x)`, in FP8 with `recipe` when one is given (see [`fp8_linear_forward`]).
pub fn linear_maybe_fp8<const D: usize>(
    linear: &Linear,
    x: Tensor<D>,
    recipe: Option<&Fp8Recipe>,
) -> Tensor<D> {
    match recipe {
        Some(r) => fp8_linear_forward(linear, x, r),
        None => linear.forward(x),
    }
}
