//! `Fp8Ops` for Burn's CubeCL backend (every CubeCL runtime), computed on the device: no
//! operand or result travels to the host.
//!
//! Every GEMM of the blockwise recipe is a fake-quantised f32 GEMM: each operand is quantised
//! blockwise and decoded back to f32 on the device (`dq(q(·))`, [`kernels`]), then the crate's
//! Cube grouped GEMM ([`MoeOps`] on `CubeBackend`, `ops/cube/gemm.rs`) multiplies the decoded
//! operands with f32 accumulation. This is the numerical contract of the Flex emulation
//! ([`crate::fp8::gemm`]): the decoded operands are the values Flex multiplies, bit for bit,
//! and the products differ from Flex's only by summation order.
//!
//! | GEMM | left operand (`1×b` tiles) | right operand (`b×b` blocks) | grouped GEMM |
//! |---|---|---|---|
//! | fprop | `x [N, K]` rowwise (activation format) | `W_g [M, K]` (weight format) | `moe_grouped_matmul`, `W_gᵀ` |
//! | dgrad | `dy [N, M]` rowwise (grad format) | `W_g [M, K]` (same blocks as fprop) | `moe_grouped_matmul`, `W_g` |
//! | wgrad | `dy_g` columnwise: `b` tokens × 1, restarting at every group (grad format) | `x_g` columnwise likewise (activation format) | `moe_grouped_matmul_wgrad` |
//!
//! Quantisation runs three kernels per operand: the `amax` of every `1 × b1` row segment, the
//! `amax` of every block over its rows with the block's scale (`compute_scale_from_amax`,
//! power-of-two rounding when the recipe asks for it, scale 1 for zero or infinite `amax`), and
//! the elementwise `x · scale` → FP8 (round to nearest even, subnormals, saturation: the host
//! codec's bit manipulation) → decoded value `· scale_inv`. The row blocking (which rows form a
//! block: single rows, `b` rows of one weight matrix, `b` tokens of one group) is a small `u32`
//! table built from the host group sizes and uploaded; the group sizes go to the grouped GEMM
//! as a device tensor the same way. Inputs of any float dtype are quantised from their f32
//! values (f16/bf16 widen exactly; f64 narrows, as on Flex); results have the dtype of the
//! first tensor argument.
//!
//! Device arithmetic: the scale division `fmax / amax` and `1 / scale` are single f32
//! divisions, correctly rounded on Mesa's CPU drivers (the tests check non-power-of-two scales
//! bit for bit on lavapipe); Vulkan lets other drivers approximate `OpFDiv` (and a runtime's
//! fast-math division would too), which can move a non-power-of-two scale by an ulp there
//! (a power-of-two scale, the default, only when `fmax / amax` lies within an ulp of a power
//! of two; `1 / scale` is then exact). Subnormal f32 *inputs* (below
//! 2⁻¹²⁶; not covered by the tests) may be flushed to zero by a driver that flushes denormals,
//! giving ±0 where Flex scales them up to a nonzero code.
//!
//! Not on the device: packed FP8 weights ([`crate::fp8::PackedFp8`]) exist only as Flex
//! tensors, so a Cube weight is always ordinary float values and is quantised here.

mod kernels;

use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Shape, TensorData};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::calculate_cube_count_elemwise;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;

use super::Fp8Ops;
use crate::fp8::formats::Fp8Format;
use crate::fp8::recipe::Fp8Recipe;
use crate::ops::MoeOps;

/// `(mantissa bits, exponent bias, largest finite code)` of `format`.
fn format_params(format: Fp8Format) -> (u32, u32, u32) {
    match format {
        Fp8Format::E4M3 => (3, 7, 0x7E),
        Fp8Format::E5M2 => (2, 15, 0x7B),
    }
}

/// A size as a `u32` kernel argument (panics, naming `op`, when it does not fit).
fn u32_arg(v: usize, op: &str) -> u32 {
    u32::try_from(v).unwrap_or_else(|_| panic!("{op} (cube): size {v} exceeds the u32 range"))
}

/// Grid of an elementwise launch over `elems` units.
fn elementwise(client: &Client, elems: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(client, elems);
    (calculate_cube_count_elemwise(client, elems, dim), dim)
}

/// Row-major contiguous f32 copy of `t` (no copy when it already is one).
fn f32_contiguous(t: CubeTensor) -> CubeTensor {
    let t = into_contiguous(t);
    if t.dtype == DType::F32 {
        t
    } else {
        cast(t, DType::F32)
    }
}

/// `t` in `dtype` (no copy when it already has it).
fn to_dtype(t: CubeTensor, dtype: DType) -> CubeTensor {
    if t.dtype == dtype { t } else { cast(t, dtype) }
}

/// `values` as a `u32` vector on `like`'s device.
fn upload_u32(values: Vec<u32>, like: &CubeTensor) -> CubeTensor {
    let len = values.len();
    CubeBackend::int_from_data(TensorData::new(values, [len]), &like.device)
}

/// The group sizes as an `i32` device vector for the grouped GEMM.
fn sizes_tensor(sizes: &[usize], like: &CubeTensor, op: &str) -> CubeTensor {
    let v: Vec<i32> = sizes
        .iter()
        .map(|&s| i32::try_from(s).unwrap_or_else(|_| panic!("{op} (cube): group of {s} rows")))
        .collect();
    CubeBackend::int_from_data(TensorData::new(v, [sizes.len()]), &like.device)
}

/// How the rows of a `[rows, cols]` matrix form row blocks: consecutive segments of rows
/// (`segments`, summing to `rows`), each cut into blocks of `b0` rows (the last one partial).
/// Returns `(row_starts [num_row_blocks + 1], row_block [rows])`.
fn row_blocking(segments: &[usize], b0: usize, op: &str) -> (Vec<u32>, Vec<u32>) {
    let mut starts = vec![0u32];
    let mut of_row = Vec::new();
    let mut r = 0usize;
    for &len in segments {
        let end = r + len;
        while r < end {
            let block_end = (r + b0).min(end);
            let id = u32_arg(starts.len() - 1, op);
            of_row.extend(std::iter::repeat_n(id, block_end - r));
            starts.push(u32_arg(block_end, op));
            r = block_end;
        }
    }
    (starts, of_row)
}

/// Blockwise fake quantisation on the device: `dq(q(x))` for the row-major f32 matrix
/// `x [rows, cols]` (any shape whose trailing dimension is `cols`), blocks of `b0` rows within
/// each row segment of `segments` by `b1` columns, encoded in `format`; the result has `x`'s
/// shape. Equals `quantize_blockwise(..).dequantize()` (or `quantize_columnwise`, transposed)
/// bit for bit.
#[allow(clippy::too_many_arguments)]
fn fake_quantize(
    x: CubeTensor,
    cols: usize,
    segments: &[usize],
    b0: usize,
    b1: usize,
    format: Fp8Format,
    pow2: bool,
    op: &str,
) -> CubeTensor {
    let rows: usize = segments.iter().sum();
    let elems = x.meta.shape().num_elements();
    assert_eq!(
        elems,
        rows * cols,
        "{op} (cube): {elems} values for a [{rows}, {cols}] matrix"
    );
    if elems == 0 {
        return x;
    }
    let (row_starts, row_block) = row_blocking(segments, b0, op);
    let gc = cols.div_ceil(b1);
    let num_blocks = (row_starts.len() - 1) * gc;
    let client = x.client.clone();
    let new = |shape: Shape, dtype: DType| {
        empty_device_dtype(client.clone(), x.device.clone(), shape, dtype)
    };
    let partial = new(Shape::new([rows * gc]), DType::U32);
    let scales = new(Shape::new([num_blocks]), DType::F32);
    let scale_invs = new(Shape::new([num_blocks]), DType::F32);
    let out = new(x.meta.shape().clone(), DType::F32);
    let (cols_arg, b1_arg, gc_arg) = (u32_arg(cols, op), u32_arg(b1, op), u32_arg(gc, op));

    let (count, dim) = elementwise(&client, rows * gc);
    kernels::row_amax_kernel::launch(
        &client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        cols_arg,
        b1_arg,
        gc_arg,
    );
    let (count, dim) = elementwise(&client, num_blocks);
    kernels::block_scale_kernel::launch(
        &client,
        count,
        dim,
        partial.into_tensor_arg(),
        upload_u32(row_starts, &x).into_tensor_arg(),
        scales.clone().into_tensor_arg(),
        scale_invs.clone().into_tensor_arg(),
        gc_arg,
        format.max(),
        u32::from(pow2),
    );
    let (m_bits, bias, max_code) = format_params(format);
    let (count, dim) = elementwise(&client, elems);
    kernels::fake_quant_kernel::launch(
        &client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        upload_u32(row_block, &x).into_tensor_arg(),
        scales.into_tensor_arg(),
        scale_invs.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        cols_arg,
        b1_arg,
        gc_arg,
        m_bits,
        bias,
        max_code,
    );
    out
}

/// Dimensions of a 2-D tensor.
fn dims2(t: &CubeTensor, op: &str) -> [usize; 2] {
    let s = t.meta.shape();
    assert!(s.num_dims() == 2, "{op}: expected a 2-D tensor, got {s:?}");
    [s[0], s[1]]
}

/// The weights as a contiguous f32 `[G, M, K]` tensor (a 2-D `[M, K]` weight is one group).
fn weights_3d(w: CubeTensor, op: &str) -> (CubeTensor, [usize; 3]) {
    let s = w.meta.shape().clone();
    let gmk = match s.num_dims() {
        2 => [1, s[0], s[1]],
        3 => [s[0], s[1], s[2]],
        _ => panic!("{op}: expected [G, M, K] or [M, K] weights, got {s:?}"),
    };
    let w = CubeBackend::float_reshape(f32_contiguous(w), Shape::new(gmk));
    (w, gmk)
}

/// `dq(q(W))` of `w [G, M, K]` in the recipe's `b×b` weight blocks (per matrix).
fn quantize_weights(
    w: CubeTensor,
    [g, m, k]: [usize; 3],
    recipe: &Fp8Recipe,
    op: &str,
) -> CubeTensor {
    let b = recipe.block_size;
    let segments = vec![m; g];
    fake_quantize(
        w,
        k,
        &segments,
        b,
        b,
        recipe.weight_format,
        recipe.pow2_scales,
        op,
    )
}

fn check_recipe(recipe: &Fp8Recipe, op: &str) {
    if let Err(e) = recipe.validate() {
        panic!("{op}: {e}");
    }
}

fn check_sizes(sizes: &[usize], groups: usize, rows: usize, op: &str) {
    let sum: usize = sizes.iter().sum();
    assert!(
        sizes.len() == groups && sum == rows,
        "{op}: {} group sizes summing to {sum} for {groups} groups of {rows} rows",
        sizes.len()
    );
}

impl Fp8Ops for CubeBackend {
    fn fp8_grouped_matmul(
        x: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        let op = "fp8_grouped_matmul";
        check_recipe(&recipe, op);
        let dtype = x.dtype;
        let [n, k] = dims2(&x, op);
        let (w, gmk) = weights_3d(weights, op);
        assert_eq!(gmk[2], k, "{op}: x [{n}, {k}] with weights {gmk:?}");
        check_sizes(&group_sizes, gmk[0], n, op);
        let b = recipe.block_size;
        let xq = fake_quantize(
            f32_contiguous(x),
            k,
            &[n],
            1,
            b,
            recipe.activation_format,
            recipe.pow2_scales,
            op,
        );
        let wq = quantize_weights(w, gmk, &recipe, op);
        let sizes = sizes_tensor(&group_sizes, &xq, op);
        to_dtype(Self::moe_grouped_matmul(xq, wq, sizes, true), dtype)
    }

    fn fp8_grouped_matmul_dgrad(
        grad: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        let op = "fp8_grouped_matmul_dgrad";
        check_recipe(&recipe, op);
        let dtype = grad.dtype;
        let [n, m] = dims2(&grad, op);
        let (w, gmk) = weights_3d(weights, op);
        assert_eq!(gmk[1], m, "{op}: grad [{n}, {m}] with weights {gmk:?}");
        check_sizes(&group_sizes, gmk[0], n, op);
        let b = recipe.block_size;
        let dyq = fake_quantize(
            f32_contiguous(grad),
            m,
            &[n],
            1,
            b,
            recipe.grad_format,
            recipe.pow2_scales,
            op,
        );
        // W_g's b×b blocks are the blocks of its transpose: dx_g = dq(q(dy_g)) · dq(q(W_g)).
        let wq = quantize_weights(w, gmk, &recipe, op);
        let sizes = sizes_tensor(&group_sizes, &dyq, op);
        to_dtype(Self::moe_grouped_matmul(dyq, wq, sizes, false), dtype)
    }

    fn fp8_grouped_matmul_wgrad(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        let op = "fp8_grouped_matmul_wgrad";
        check_recipe(&recipe, op);
        let dtype = grad.dtype;
        let [n, m] = dims2(&grad, op);
        let [n2, k] = dims2(&x, op);
        assert_eq!(n, n2, "{op}: grad has {n} rows, x {n2}");
        check_sizes(&group_sizes, group_sizes.len(), n, op);
        let b = recipe.block_size;
        // Columnwise: 1×b tiles along each group's tokens, i.e. blocks of b rows (restarting
        // at every group) by one column.
        let dyq = fake_quantize(
            f32_contiguous(grad),
            m,
            &group_sizes,
            b,
            1,
            recipe.grad_format,
            recipe.pow2_scales,
            op,
        );
        let xq = fake_quantize(
            f32_contiguous(x),
            k,
            &group_sizes,
            b,
            1,
            recipe.activation_format,
            recipe.pow2_scales,
            op,
        );
        let sizes = sizes_tensor(&group_sizes, &dyq, op);
        to_dtype(Self::moe_grouped_matmul_wgrad(dyq, xq, sizes), dtype)
    }
}
