//! `Fp8Ops` for the Flex CPU backend: reads the tensors as f32 host slices (widening f16/bf16,
//! narrowing f64), runs the emulated FP8 GEMMs of [`crate::fp8::gemm`] and returns the result
//! in the dtype of the first tensor argument.

use std::borrow::Cow;

use burn::backend::{Flex, tensor::FloatTensor};
use burn::tensor::{DType, TensorData};
use burn_flex::FlexTensor;

use super::Fp8Ops;
use crate::fp8::gemm::{fp8_grouped_dgrad, fp8_grouped_fprop, fp8_grouped_wgrad};
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
        let [_, m, _] = dims::<3>(&weights, op);
        let y = fp8_grouped_fprop(
            &host_f32(&x, op),
            k,
            &host_f32(&weights, op),
            m,
            &group_sizes,
            &recipe,
        )
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
        let [_, _, k] = dims::<3>(&weights, op);
        let dx = fp8_grouped_dgrad(
            &host_f32(&grad, op),
            m,
            &host_f32(&weights, op),
            k,
            &group_sizes,
            &recipe,
        )
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
