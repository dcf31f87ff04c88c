//! `MoeOps` for Burn's CubeCL backend (`burn_cubecl::CubeBackend`): one set of GPU kernels for
//! every CubeCL runtime (Vulkan, CUDA, ROCm, Metal).
//!
//! | op | kernel |
//! |---|---|
//! | `moe_routing_index` | one unit per expert scans the routing map ([`routing`]) |
//! | `moe_topk_indices` | one unit per token, k selection passes ([`routing`]) |
//! | `moe_permute`, `moe_sort_chunks` | row gather ([`rows`]) |
//! | `moe_unpermute(_weighted)` | device CSR inverse map + per-token f32 sum ([`rows`]) |
//! | `moe_grouped_matmul(_wgrad)` | grouped GEMM, group offsets on device ([`gemm`]; tensor cores: [`gemm_cmma`]; cuBLAS: `gemm_cublas`) |
//! | `moe_swiglu(_backward)` | elementwise + per-row reduction ([`swiglu`]) |
//!
//! The grouped GEMM has three bodies ([`CubeGemmKernel`]): tensor cores (`cmma`, BF16 / F16
//! operands with f32 accumulators, where the device advertises the fragments), scalar tiles
//! staged through shared memory on other GPUs, and scalar tiles read straight from global memory
//! on software Vulkan devices such as lavapipe, where CubeCL 0.11.3 cannot compile shared memory
//! (see [`gemm`]); on CUDA a fourth candidate hands the GEMMs to cuBLAS (`cublas`, feature
//! `cuda`: `cublasGemmGroupedBatchedEx` or per-group `cublasGemmEx`, planned on the host by
//! `ops/cublas_plan.rs`). `MOE_CUBE_GEMM=auto|tiled|direct|cmma|cublas` or
//! [`set_cube_gemm_kernel`] overrides the choice.
//!
//! Inputs may be any float dtype the runtime supports (f32 everywhere; f16/bf16 where the device
//! has them); accumulation is f32. Index tensors may be any integer dtype; index outputs are
//! `i32`. Results are deterministic: no float atomics, fixed summation orders. Burn's `fusion`
//! feature must stay off (the selector names `CubeBackend`, not `Fusion<CubeBackend>`).

mod gemm;
mod gemm_cmma;
#[cfg(feature = "cuda")]
mod gemm_cublas;
mod launch;
mod routing;
mod rows;
mod swiglu;

use burn::backend::ops::IntTensorOps;
use burn::backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn::tensor::TensorData;
use burn_cubecl::CubeBackend;

pub use gemm::{
    CubeGemmKernel, CublasRoute, GEMM_KERNEL_ENV, cube_gemm_kernel, cublas_library_info,
    last_cube_gemm_kernel, last_cublas_route, set_cube_gemm_kernel,
};

use super::MoeOps;
use super::kernels::sort_chunks_row_index;

impl MoeOps for CubeBackend {
    fn moe_routing_index(
        routing_map: BoolTensor<Self>,
        capacity: Option<usize>,
    ) -> (IntTensor<Self>, IntTensor<Self>, IntTensor<Self>) {
        routing::routing_index(routing_map, capacity)
    }

    fn moe_topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        routing::topk_indices(scores, k)
    }

    fn moe_permute(
        tokens: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        rows::gather_rows(tokens, sorted_indices)
    }

    fn moe_unpermute(
        rows: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
        num_tokens: usize,
    ) -> FloatTensor<Self> {
        rows::unpermute(rows, sorted_indices, None, num_tokens)
    }

    fn moe_unpermute_weighted(
        rows: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
        probs: FloatTensor<Self>,
        num_tokens: usize,
    ) -> FloatTensor<Self> {
        rows::unpermute(rows, sorted_indices, Some(probs), num_tokens)
    }

    fn moe_grouped_matmul(
        x: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: IntTensor<Self>,
        transpose_weights: bool,
    ) -> FloatTensor<Self> {
        gemm::grouped_matmul(x, weights, group_sizes, transpose_weights)
    }

    fn moe_grouped_matmul_wgrad(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        group_sizes: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        gemm::grouped_matmul_wgrad(lhs, rhs, group_sizes)
    }

    fn moe_sort_chunks(
        x: FloatTensor<Self>,
        split_sizes: Vec<usize>,
        sorted_idxs: Vec<usize>,
    ) -> FloatTensor<Self> {
        let op = "moe_sort_chunks";
        let n = x.meta.shape()[0];
        let sum: usize = split_sizes.iter().sum();
        assert_eq!(sum, n, "{op}: split sizes sum to {sum} but x has {n} rows");
        if let Err(e) = super::check_permutation(op, &sorted_idxs, split_sizes.len()) {
            panic!("{e}");
        }
        // Chunk sizes are host values already: the row index is built here and uploaded.
        let index: Vec<i32> = sort_chunks_row_index(&split_sizes, &sorted_idxs)
            .into_iter()
            .map(|v| {
                i32::try_from(v).unwrap_or_else(|_| panic!("{op}: row {v} does not fit in i32"))
            })
            .collect();
        let len = index.len();
        let index = Self::int_from_data(TensorData::new(index, [len]), &x.device);
        rows::gather_rows(x, index)
    }

    fn moe_swiglu(hidden: FloatTensor<Self>, probs: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu::swiglu(hidden, probs)
    }

    fn moe_swiglu_backward(
        hidden: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        swiglu::swiglu_backward(hidden, probs, grad)
    }

    fn moe_attach_loss(
        x: FloatTensor<Self>,
        _loss: FloatTensor<Self>,
        _grad_scale: f64,
    ) -> FloatTensor<Self> {
        x
    }
}
