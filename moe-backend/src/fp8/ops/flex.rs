//! `Fp8Ops` for the Flex CPU backend: reads the tensors as f32 host slices (widening f16/bf16,
//! narrowing f64), runs the emulated FP8 GEMMs of [`crate::fp8::gemm`] and returns the result
//! in the dtype of the first tensor argument.
//!
//! A weight that is a packed FP8 parameter ([`PackedFp8`]) is used as its codes and scales,
//! without re-quantisation, when its blocks are the recipe's (E4M3, `b×b`); otherwise its
//! decoded values are quantised like any f32 weight. Weights are `[G, M, K]`, or `[M, K]` for
//! one group (a dense linear's transposed view).

use std::borrow::Cow;

use burn::backend::{Flex, tensor::FloatTensor};
use burn::tensor::{DType, TensorData};
use burn_flex::FlexTensor;

use super::Fp8Ops;
use crate::fp8::gemm::{
    fp8_grouped_dgrad, fp8_grouped_dgrad_quantized, fp8_grouped_fprop, fp8_grouped_fprop_quantized,
    fp8_grouped_wgrad,
};
use crate::fp8::packed::PackedFp8;
use crate::fp8::recipe::Fp8Recipe;

/// The f32 values of `t` (borrowed when it is already a contiguous f32 buffer).
fn host_f32<'a>(t: &'a FlexTensor, op: &str) -> Cow<'a, [f32]> {
    if let Some(s) = t.as_slice::<f32>() {
        return Cow::Borrowed(s);
    }
    let data = t.clone().into_data().convert::<f32>();
    Cow::Owned(
        data.try_into_vec::<f32>()
            .unwrap_or_else(|e| panic!("{op}: cannot read tensor data: {e:?}")),
    )
}

fn dims<const D: usize>(t: &FlexTensor, op: &str) -> [usize; D] {
    let s = t.layout().shape();
    assert!(
        s.num_dims() == D,
        "{op}: expected a {D}-D tensor, got {s:?}"
    );
    core::array::from_fn(|i| s[i])
}

/// `[G, M, K]` of a weights tensor: 3-D, or 2-D `[M, K]` as one group.
fn weight_dims(t: &FlexTensor, op: &str) -> [usize; 3] {
    let s = t.layout().shape();
    match s.num_dims() {
        2 => [1, s[0], s[1]],
        3 => [s[0], s[1], s[2]],
        _ => panic!("{op}: expected [G, M, K] or [M, K] weights, got {s:?}"),
    }
}

/// The packed FP8 weight `t` holds, checked against the GEMM's `[G, M, K]`, or `None` for
/// ordinary values.
fn packed_weight(t: &FlexTensor, gmk: [usize; 3], op: &str) -> Option<PackedFp8> {
    let p = PackedFp8::from_flex(t)?;
    let g = p.grid();
    assert!(
        [g.matrices, g.rows, g.cols] == gmk,
        "{op}: packed FP8 weight of {} [{}, {}] matrices used as {gmk:?} (only the \
         parameter's own orientation, or a linear's transposed view, can be read)",
        g.matrices,
        g.rows,
        g.cols
    );
    Some(p)
}

/// Wraps f32 results as a tensor of `dtype`.
fn output(values: Vec<f32>, shape: &[usize], dtype: DType) -> FlexTensor {
    let data = TensorData::new(values, shape.to_vec());
    FlexTensor::from_data(match dtype {
        DType::F64 => data.convert::<f64>(),
        DType::F16 => data.convert::<burn::tensor::f16>(),
        DType::BF16 => data.convert::<burn::tensor::bf16>(),
        _ => data,
    })
}

impl Fp8Ops for Flex {
    fn fp8_grouped_matmul(
        x: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        let op = "fp8_grouped_matmul";
        let [n, k] = dims::<2>(&x, op);
        let gmk = weight_dims(&weights, op);
        let m = gmk[1];
        let xs = host_f32(&x, op);
        let y = match packed_weight(&weights, gmk, op) {
            Some(p) if p.fits_recipe(recipe.block_size, recipe.weight_format) => {
                let w = p.operands(false);
                let views: Vec<_> = w.iter().map(|o| o.view()).collect();
                fp8_grouped_fprop_quantized(&xs, k, &views, m, &group_sizes, &recipe)
            }
            Some(p) => fp8_grouped_fprop(&xs, k, &p.canonical_values(), m, &group_sizes, &recipe),
            None => fp8_grouped_fprop(&xs, k, &host_f32(&weights, op), m, &group_sizes, &recipe),
        }
        .unwrap_or_else(|e| panic!("{op}: {e}"));
        output(y, &[n, m], x.dtype())
    }

    fn fp8_grouped_matmul_dgrad(
        grad: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        let op = "fp8_grouped_matmul_dgrad";
        let [n, m] = dims::<2>(&grad, op);
        let gmk = weight_dims(&weights, op);
        let k = gmk[2];
        let dy = host_f32(&grad, op);
        let dx = match packed_weight(&weights, gmk, op) {
            Some(p) if p.fits_recipe(recipe.block_size, recipe.weight_format) => {
                let wt = p.operands(true);
                let views: Vec<_> = wt.iter().map(|o| o.view()).collect();
                fp8_grouped_dgrad_quantized(&dy, m, &views, k, &group_sizes, &recipe)
            }
            Some(p) => fp8_grouped_dgrad(&dy, m, &p.canonical_values(), k, &group_sizes, &recipe),
            None => fp8_grouped_dgrad(&dy, m, &host_f32(&weights, op), k, &group_sizes, &recipe),
        }
        .unwrap_or_else(|e| panic!("{op}: {e}"));
        output(dx, &[n, k], grad.dtype())
    }

    fn fp8_grouped_matmul_wgrad(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        let op = "fp8_grouped_matmul_wgrad";
        let [_, m] = dims::<2>(&grad, op);
        let [_, k] = dims::<2>(&x, op);
        let g = group_sizes.len();
        let dw = fp8_grouped_wgrad(
            &host_f32(&grad, op),
            m,
            &host_f32(&x, op),
            k,
            &group_sizes,
            &recipe,
        )
        .unwrap_or_else(|e| panic!("{op}: {e}"));
        output(dw, &[g, m, k], grad.dtype())
    }
}
