//! Fused SwiGLU with routing weights (docs/routing-and-dispatch.md §Experts, steps 3–4), forward
//! and backward, computed in f32 for every input dtype.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use super::launch::{self, LaunchShape, empty_like_dtype, float_storage};

/// `z[r, j] = silu(h[r, j]) · h[r, F + j] · p[r]` for `h [N, 2F]`, `p [N]`, `z [N, F]`.
#[cube(launch)]
fn swiglu_kernel<E: Float>(
    hidden: &Tensor<E>,
    probs: &Tensor<E>,
    out: &mut Tensor<E>,
    f_dim: u32,
    #[define(E)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let f = f_dim as usize;
    let r = pos / f;
    let j = pos % f;
    let g = f32::cast_from(hidden[r * 2 * f + j]);
    let u = f32::cast_from(hidden[r * 2 * f + f + j]);
    let p = f32::cast_from(probs[r]);
    let s = 1.0f32 / (1.0f32 + (-g).exp());
    out[pos] = E::cast_from(g * s * u * p);
}

/// `d_hidden [N, 2F]` of the fused SwiGLU for upstream `dz [N, F]`.
#[cube(launch)]
fn swiglu_dhidden_kernel<E: Float>(
    hidden: &Tensor<E>,
    probs: &Tensor<E>,
    dz: &Tensor<E>,
    dh: &mut Tensor<E>,
    f_dim: u32,
    #[define(E)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= dz.len() {
        terminate!();
    }
    let f = f_dim as usize;
    let r = pos / f;
    let j = pos % f;
    let g = f32::cast_from(hidden[r * 2 * f + j]);
    let u = f32::cast_from(hidden[r * 2 * f + f + j]);
    let p = f32::cast_from(probs[r]);
    let d = f32::cast_from(dz[pos]);
    let s = 1.0f32 / (1.0f32 + (-g).exp());
    dh[r * 2 * f + j] = E::cast_from(d * p * u * s * (1.0f32 + g * (1.0f32 - s)));
    dh[r * 2 * f + f + j] = E::cast_from(d * p * g * s);
}

/// `d_probs[r] = Σ_j dz[r, j] · silu(h[r, j]) · h[r, F + j]` (one unit per row, f32 sum).
#[cube(launch)]
fn swiglu_dprobs_kernel<E: Float>(
    hidden: &Tensor<E>,
    dz: &Tensor<E>,
    dp: &mut Tensor<E>,
    f_dim: u32,
    #[define(E)] _dtype: ElemType,
) {
    let r = ABSOLUTE_POS;
    if r >= dp.len() {
        terminate!();
    }
    let f = f_dim as usize;
    let mut acc = 0.0f32;
    for j in 0..f {
        let g = f32::cast_from(hidden[r * 2 * f + j]);
        let u = f32::cast_from(hidden[r * 2 * f + f + j]);
        let s = 1.0f32 / (1.0f32 + (-g).exp());
        acc += f32::cast_from(dz[r * f + j]) * g * s * u;
    }
    dp[r] = E::cast_from(acc);
}

fn dims(hidden: &CubeTensor, op: &str) -> (usize, usize) {
    let s = hidden.meta.shape();
    assert!(s.num_dims() == 2, "{op}: hidden must be 2-D, got {s:?}");
    (s[0], s[1] / 2)
}

/// Forward; see [`MoeOps::moe_swiglu`](crate::ops::MoeOps::moe_swiglu).
pub(crate) fn swiglu(hidden: CubeTensor, probs: CubeTensor) -> CubeTensor {
    let op = "moe_swiglu";
    let hidden = launch::contiguous(hidden);
    let probs = launch::cast_float(launch::contiguous(probs), hidden.dtype);
    let (n, f) = dims(&hidden, op);
    assert_eq!(
        launch::elem_count(&probs),
        n,
        "{op}: probs must have {n} rows"
    );
    let out = empty_like_dtype(&hidden, [n, f], hidden.dtype);
    if n * f == 0 {
        return out;
    }
    let shape = LaunchShape::elementwise(&hidden.client, n * f);
    let dtype = float_storage(hidden.dtype);
    swiglu_kernel::launch(
        &hidden.client,
        shape.count,
        shape.dim,
        hidden.clone().into_tensor_arg(),
        probs.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        launch::u32_arg(f, op),
        dtype,
    );
    out
}

/// Backward; see [`MoeOps::moe_swiglu_backward`](crate::ops::MoeOps::moe_swiglu_backward).
pub(crate) fn swiglu_backward(
    hidden: CubeTensor,
    probs: CubeTensor,
    grad: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let op = "moe_swiglu_backward";
    let hidden = launch::contiguous(hidden);
    let probs = launch::cast_float(launch::contiguous(probs), hidden.dtype);
    let grad = launch::cast_float(launch::contiguous(grad), hidden.dtype);
    let (n, f) = dims(&hidden, op);
    assert_eq!(
        [grad.meta.shape()[0], grad.meta.shape()[1]],
        [n, f],
        "{op}: grad must be [{n}, {f}]"
    );
    let dtype = float_storage(hidden.dtype);
    let client = hidden.client.clone();
    if f == 0 {
        let zeros = |shape: burn::tensor::Shape| {
            burn_cubecl::ops::numeric::zeros_client(
                client.clone(),
                hidden.device.clone(),
                shape,
                hidden.dtype,
            )
        };
        return (
            zeros(burn::tensor::Shape::new([n, 0])),
            zeros(burn::tensor::Shape::new([n])),
        );
    }
    let dh = empty_like_dtype(&hidden, [n, 2 * f], hidden.dtype);
    let dp = empty_like_dtype(&hidden, [n], hidden.dtype);
    if n == 0 {
        return (dh, dp);
    }
    let shape = LaunchShape::elementwise(&client, n * f);
    swiglu_dhidden_kernel::launch(
        &client,
        shape.count,
        shape.dim,
        hidden.clone().into_tensor_arg(),
        probs.into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        dh.clone().into_tensor_arg(),
        launch::u32_arg(f, op),
        dtype,
    );
    let shape = LaunchShape::elementwise(&client, n);
    swiglu_dprobs_kernel::launch(
        &client,
        shape.count,
        shape.dim,
        hidden.into_tensor_arg(),
        grad.into_tensor_arg(),
        dp.clone().into_tensor_arg(),
        launch::u32_arg(f, op),
        dtype,
    );
    (dh, dp)
}
