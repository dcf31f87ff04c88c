//! The `Fp8Ops` backend extension: FP8 grouped GEMMs (fprop, dgrad, wgrad) with the blockwise
//! recipe, and the user-facing differentiable [`fp8_grouped_matmul`] / [`fp8_linear`].
//!
//! On Flex the kernels quantise the operands and run the tiled emulation of [`super::gemm`];
//! for `Autodiff<B>` the forward saves `x` and `W` and the backward calls the FP8 dgrad and
//! wgrad (straight-through: quantisation is treated as the identity in the gradient, as in
//! Transformer Engine).

mod autodiff;
mod flex;

use burn::backend::{Backend, Dispatch, backend_extension, tensor::FloatTensor};
use burn::tensor::Tensor;

use super::recipe::Fp8Recipe;
use crate::error::{BackendError, Result};

/// Backend extension with the FP8 grouped GEMMs of the blockwise recipe (fp8.md §3).
///
/// `group_sizes` are host row counts per group (they must sum to the row count; the
/// user-facing functions check this). Outputs have the dtype of the first tensor argument,
/// accumulated in f32.
#[backend_extension(Flex, Autodiff)]
pub trait Fp8Ops: Backend {
    /// fprop: `x [N, K]` in segments of `group_sizes`, `weights [G, M, K]` (`[out, in]`):
    /// `y_g = dq(q(x_g)) · dq(q(W_g))ᵀ`, `[N, M]`. Differentiable in `x` and `weights`.
    fn fp8_grouped_matmul(
        x: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self>;

    /// dgrad: `grad [N, M]`, `weights [G, M, K]`: `dx_g = dq(q(dy_g)) · dq(q(W_g))`, `[N, K]`.
    /// Not itself differentiable.
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
    let n = x.dims()[0];
    fp8_grouped_matmul(x, weight.unsqueeze_dim(0), &[n], recipe)
}
