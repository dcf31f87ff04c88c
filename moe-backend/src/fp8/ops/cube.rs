//! `Fp8Ops` for Burn's CubeCL backend (every CubeCL runtime), host-staged: the operands are
//! read back from the device, the Flex implementation (the emulated blockwise FP8 GEMMs of
//! [`crate::fp8::gemm`]) runs on the host copies, and the result is uploaded to the operands'
//! device in the dtype of the first tensor argument. Results are those of Flex bit for bit.
//! This costs a device → host → device round trip per GEMM; device kernels (quantise on the
//! device, then a grouped GEMM) are the remaining step.

use burn::backend::Flex;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::tensor::TensorData;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use burn_flex::FlexTensor;

use super::Fp8Ops;
use crate::fp8::recipe::Fp8Recipe;

/// The host copy of a device tensor, as a Flex tensor (panics, naming `op`, when the runtime
/// cannot read it back synchronously: backend ops cannot return errors).
fn to_host(t: CubeTensor, op: &str) -> FlexTensor {
    let data: TensorData = match burn::tensor::try_read_sync(CubeBackend::float_into_data(t)) {
        Some(Ok(data)) => data,
        Some(Err(e)) => panic!("{op} (cube): reading the operand back failed: {e:?}"),
        None => panic!("{op} (cube): the runtime cannot read tensors synchronously"),
    };
    FlexTensor::from_data(data)
}

/// `t` uploaded to `device`.
fn to_device(t: FlexTensor, device: &CubeDevice) -> CubeTensor {
    CubeBackend::float_from_data(t.into_data(), device)
}

impl Fp8Ops for CubeBackend {
    fn fp8_grouped_matmul(
        x: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        let op = "fp8_grouped_matmul";
        let device = x.device.clone();
        let y = Flex::fp8_grouped_matmul(to_host(x, op), to_host(weights, op), group_sizes, recipe);
        to_device(y, &device)
    }

    fn fp8_grouped_matmul_dgrad(
        grad: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        let op = "fp8_grouped_matmul_dgrad";
        let device = grad.device.clone();
        let dx = Flex::fp8_grouped_matmul_dgrad(
            to_host(grad, op),
            to_host(weights, op),
            group_sizes,
            recipe,
        );
        to_device(dx, &device)
    }

    fn fp8_grouped_matmul_wgrad(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        let op = "fp8_grouped_matmul_wgrad";
        let device = grad.device.clone();
        let dw =
            Flex::fp8_grouped_matmul_wgrad(to_host(grad, op), to_host(x, op), group_sizes, recipe);
        to_device(dw, &device)
    }
}
