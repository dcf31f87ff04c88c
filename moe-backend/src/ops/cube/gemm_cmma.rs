//! Tensor-core bodies of the grouped GEMM (docs/gpu.md §Cube kernels): the same contract, launch
//! geometry and output mapping as the scalar bodies of [`super::gemm`], with the products done
//! by CubeCL's cooperative matrices (`cmma`: WMMA `16 × 16 × 16` fragments on CUDA,
//! `VK_KHR_cooperative_matrix` on Vulkan) on half-precision operands (BF16 / F16) with f32
//! accumulators.
//!
//! The tiling follows the classic WMMA GEMM of CUTLASS's `gemm::warp` level, kept simple:
//! a cube of 4 planes (warps) computes a `64 × 128` output tile; operands are staged through
//! shared memory in `K = 32` slices, zero-padded past the group's rows, the matrix's columns and
//! `K` (so ragged and empty groups need no special case and every fragment load is in bounds);
//! plane `(pr, pc)` of the `2 × 2` plane grid owns the `32 × 64` block `(pr, pc)` as `2 × 4`
//! accumulator fragments. The accumulators leave through a per-plane `16 × 16` f32 scratch in
//! shared memory, from which the plane's lanes store the rows inside the group and the columns
//! inside the matrix, rounded once to the output dtype.
//!
//! Summation order: each fragment product adds 16 terms in the tensor core's order, then the
//! fragments accumulate along `K` in order; results match the scalar bodies to f32 rounding, not
//! bit for bit.
//!
//! Shared-memory layouts (element `(row, col)` of a fragment at `base + row·stride + col` for
//! row-major, `base + col·stride + row` for column-major; every fragment base is a multiple of
//! 16 elements, 32 bytes, as WMMA requires):
//! - forward / dgrad `A` (`x` rows): row-major `64 × 32`, stride 32;
//! - forward / dgrad `B` (`W_g(ᵀ)`): row-major `32 × 128`, stride 128, for `W [G, K, M]`;
//!   column-major, stride 32, for `W [G, M, K]` (read along `K`, the contiguous axis);
//! - wgrad `A` (`lhsᵀ`): column-major `64 × 32`, stride 64 (read along `P`, contiguous);
//! - wgrad `B` (`rhs` rows): row-major `32 × 128`, stride 128.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::cmma::{self, Matrix, MatrixIdent, MatrixLayout};
use burn_cubecl::cubecl::prelude::*;

use super::gemm::tile_group;

/// Output rows per cube (also the forward's row tile of the group-offset scan).
pub(crate) const CMMA_TILE_M: usize = 64;
/// Output columns per cube.
pub(crate) const CMMA_TILE_N: usize = 128;
/// Planes per cube (a `2 × 2` grid over the output tile).
pub(crate) const CMMA_PLANES: u32 = 4;
// The kernels spell these sizes as literals.
const _: () = assert!(CMMA_TILE_M == 64 && CMMA_TILE_N == 128 && CMMA_PLANES == 4);

/// Whether a plane of `plane_dim` lanes can run the kernels: the staging loops divide the
/// `16 × 16` scratch and the operand tiles evenly among the cube's `4 · plane_dim` units.
pub(crate) fn plane_dim_fits(plane_dim: u32) -> bool {
    plane_dim.is_power_of_two() && (4..=256).contains(&plane_dim)
}

/// A `16 × 16 × 16` f32 accumulator fragment set to zero.
#[cube]
fn zero_acc() -> Matrix<f32> {
    Matrix::<f32>::from_value(
        MatrixIdent::Accumulator,
        16usize,
        16usize,
        16usize,
        MatrixLayout::Undefined,
        0.0f32,
    )
}

/// Loads the `A` fragment whose first element is `s[base]` (`layout`, `stride`).
#[cube]
fn load_a<E: Float>(
    s: &Shared<[E]>,
    base: usize,
    #[comptime] stride: usize,
    #[comptime] layout: MatrixLayout,
) -> Matrix<E> {
    let end = base + comptime!(15 * stride + 16);
    Matrix::<E>::from_slice(
        MatrixIdent::A,
        16usize,
        16usize,
        16usize,
        layout,
        s.slice(base, end),
        comptime!(stride as u32),
    )
}

/// Loads the `B` fragment whose first element is `s[base]` (`layout`, `stride`).
#[cube]
fn load_b<E: Float>(
    s: &Shared<[E]>,
    base: usize,
    #[comptime] stride: usize,
    #[comptime] layout: MatrixLayout,
) -> Matrix<E> {
    let end = base + comptime!(15 * stride + 16);
    Matrix::<E>::from_slice(
        MatrixIdent::B,
        16usize,
        16usize,
        16usize,
        layout,
        s.slice(base, end),
        comptime!(stride as u32),
    )
}

/// `acc += a · b`.
#[cube]
fn mma<E: Float>(a: &Matrix<E>, b: &Matrix<E>, acc: &mut Matrix<f32>) {
    cmma::execute(a, b, &*acc, &*acc);
}

/// The products of one `K = 32` slice for one plane: `A` fragments at `a_base + mi·a_row`
/// (mi < 2), `B` fragments at `b_base + nj·b_col` (nj < 4), for both 16-wide `K` steps
/// (`a_k`, `b_k` apart); accumulators row-major `acc[mi][nj]`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn mma_slice<E: Float>(
    a_s: &Shared<[E]>,
    b_s: &Shared<[E]>,
    a_base: usize,
    b_base: usize,
    #[comptime] a_stride: usize,
    #[comptime] a_layout: MatrixLayout,
    #[comptime] a_row: usize,
    #[comptime] a_k: usize,
    #[comptime] b_stride: usize,
    #[comptime] b_layout: MatrixLayout,
    #[comptime] b_col: usize,
    #[comptime] b_k: usize,
    acc: &mut Sequence<Matrix<f32>>,
) {
    #[unroll]
    for ks in 0..2usize {
        let a0 = load_a::<E>(a_s, a_base + ks * a_k, a_stride, a_layout);
        let a1 = load_a::<E>(a_s, a_base + a_row + ks * a_k, a_stride, a_layout);
        #[unroll]
        for nj in 0..4usize {
            let b = load_b::<E>(b_s, b_base + nj * b_col + ks * b_k, b_stride, b_layout);
            mma::<E>(&a0, &b, acc.index_mut(nj));
            mma::<E>(&a1, &b, acc.index_mut(4usize + nj));
        }
    }
}

/// Stores accumulator `acc` (rows `r0..r0 + 16` of the output, columns `c0..c0 + 16`) through
/// this plane's scratch `c_s[scratch..scratch + 256]`: lanes write the elements with row below
/// `row_end` and column below `cols` to `out[row_base + r · row_stride + c]`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn store_acc<E: Float>(
    acc: &Matrix<f32>,
    c_s: &mut Shared<[f32]>,
    out: &mut Tensor<E>,
    scratch: usize,
    r0: usize,
    c0: usize,
    row_end: usize,
    cols: usize,
    row_base: usize,
    row_stride: usize,
    #[comptime] plane_dim: u32,
) {
    cmma::store(
        c_s.slice_mut(scratch, scratch + 256usize),
        acc,
        16u32,
        MatrixLayout::RowMajor,
    );
    sync_cube();
    let lane = UNIT_POS_X as usize;
    #[unroll]
    for l in 0..comptime!(256 / plane_dim as usize) {
        let e = lane + l * comptime!(plane_dim as usize);
        let r = r0 + e / 16usize;
        let c = c0 + e % 16usize;
        if r < row_end && c < cols {
            out[row_base + r * row_stride + c] = E::cast_from(c_s[scratch + e]);
        }
    }
    sync_cube();
}

/// Tensor-core grouped GEMM: `out[seg_g] = x[seg_g] · W_g(ᵀ)` for `x [N, K]`; `w [G, M, K]`
/// when `transpose_w`, else `[G, K, M]`; `out [N, M]`. Grid `(ceil(M / 128), row-tile bound)`,
/// cube `(plane_dim, 4)`; offsets as in [`super::gemm`] (row tiles of 64).
#[cube(launch)]
pub(crate) fn grouped_gemm_cmma_kernel<E: Float>(
    x: &Tensor<E>,
    w: &Tensor<E>,
    offsets: &Tensor<u32>,
    tile_offsets: &Tensor<u32>,
    out: &mut Tensor<E>,
    k_dim: u32,
    m_dim: u32,
    groups: u32,
    #[comptime] transpose_w: bool,
    #[comptime] plane_dim: u32,
    #[define(E)] _dtype: ElemType,
) {
    let tile = CUBE_POS_Y;
    let total_tiles = tile_offsets[groups as usize];
    if tile >= total_tiles {
        terminate!();
    }
    let g = tile_group(tile_offsets, tile, groups) as usize;
    let row0 = (offsets[g] + (tile - tile_offsets[g]) * 64u32) as usize;
    let row_end = offsets[g + 1] as usize;
    let col0 = CUBE_POS_X as usize * 128usize;
    let k = k_dim as usize;
    let m = m_dim as usize;
    let w_base = g * m * k;

    let plane = UNIT_POS_Y as usize;
    let units = comptime!(4 * plane_dim as usize);
    let tid = plane * comptime!(plane_dim as usize) + UNIT_POS_X as usize;
    let pr = plane / 2usize;
    let pc = plane % 2usize;

    let mut a_s = Shared::<[E]>::new_aligned_slice(2048usize, 128usize);
    let mut b_s = Shared::<[E]>::new_aligned_slice(4096usize, 128usize);
    let mut c_s = Shared::<[f32]>::new_aligned_slice(1024usize, 128usize);
    let mut acc = Sequence::<Matrix<f32>>::new();
    #[unroll]
    for _i in 0..8usize {
        acc.push(zero_acc());
    }

    let mut k0 = 0usize;
    while k0 < k {
        // A: a_s[i·32 + kk] = x[row0 + i, k0 + kk], zero outside the segment / K.
        #[unroll]
        for l in 0..comptime!(2048 / (4 * plane_dim as usize)) {
            let e = tid + l * units;
            let r = row0 + e / 32usize;
            let kc = k0 + e % 32usize;
            let mut v = E::from_int(0);
            if r < row_end && kc < k {
                v = x[r * k + kc];
            }
            a_s[e] = v;
        }
        // B: W_g(ᵀ)[k0 + kk, col0 + j], zero outside M / K.
        #[unroll]
        for l in 0..comptime!(4096 / (4 * plane_dim as usize)) {
            let e = tid + l * units;
            let mut v = E::from_int(0);
            if comptime![transpose_w] {
                // Column-major, b_s[j·32 + kk] = W[g, col0 + j, k0 + kk].
                let c = col0 + e / 32usize;
                let kc = k0 + e % 32usize;
                if c < m && kc < k {
                    v = w[w_base + c * k + kc];
                }
            } else {
                // Row-major, b_s[kk·128 + j] = W[g, k0 + kk, col0 + j].
                let kc = k0 + e / 128usize;
                let c = col0 + e % 128usize;
                if c < m && kc < k {
                    v = w[w_base + kc * m + c];
                }
            }
            b_s[e] = v;
        }
        sync_cube();
        if comptime![transpose_w] {
            mma_slice::<E>(
                &a_s,
                &b_s,
                pr * 1024usize,
                pc * 2048usize,
                32usize,
                MatrixLayout::RowMajor,
                512usize,
                16usize,
                32usize,
                MatrixLayout::ColMajor,
                512usize,
                16usize,
                &mut acc,
            );
        } else {
            mma_slice::<E>(
                &a_s,
                &b_s,
                pr * 1024usize,
                pc * 64usize,
                32usize,
                MatrixLayout::RowMajor,
                512usize,
                16usize,
                128usize,
                MatrixLayout::RowMajor,
                16usize,
                2048usize,
                &mut acc,
            );
        }
        sync_cube();
        k0 += 32usize;
    }

    let scratch = plane * 256usize;
    #[unroll]
    for f in 0..8usize {
        let mi = comptime!(f / 4);
        let nj = comptime!(f % 4);
        store_acc::<E>(
            acc.index(f),
            &mut c_s,
            out,
            scratch,
            row0 + pr * 32usize + mi * 16usize,
            col0 + pc * 64usize + nj * 16usize,
            row_end,
            m,
            0usize,
            m,
            plane_dim,
        );
    }
}

/// Tensor-core grouped weight gradient: `out[g] = lhs[seg_g]ᵀ · rhs[seg_g]` for `lhs [N, P]`,
/// `rhs [N, Q]`, `out [G, P, Q]` (zero for empty groups). Grid `(ceil(Q / 128), ceil(P / 64),
/// G)`, cube `(plane_dim, 4)`; each cube loops over its group's rows 32 at a time.
#[cube(launch)]
pub(crate) fn grouped_wgrad_cmma_kernel<E: Float>(
    lhs: &Tensor<E>,
    rhs: &Tensor<E>,
    offsets: &Tensor<u32>,
    out: &mut Tensor<E>,
    p_dim: u32,
    q_dim: u32,
    #[comptime] plane_dim: u32,
    #[define(E)] _dtype: ElemType,
) {
    let g = CUBE_POS_Z as usize;
    let p0 = CUBE_POS_Y as usize * 64usize;
    let q0 = CUBE_POS_X as usize * 128usize;
    let p = p_dim as usize;
    let q = q_dim as usize;
    let row_start = offsets[g] as usize;
    let row_end = offsets[g + 1] as usize;

    let plane = UNIT_POS_Y as usize;
    let units = comptime!(4 * plane_dim as usize);
    let tid = plane * comptime!(plane_dim as usize) + UNIT_POS_X as usize;
    let pr = plane / 2usize;
    let pc = plane % 2usize;

    let mut a_s = Shared::<[E]>::new_aligned_slice(2048usize, 128usize);
    let mut b_s = Shared::<[E]>::new_aligned_slice(4096usize, 128usize);
    let mut c_s = Shared::<[f32]>::new_aligned_slice(1024usize, 128usize);
    let mut acc = Sequence::<Matrix<f32>>::new();
    #[unroll]
    for _i in 0..8usize {
        acc.push(zero_acc());
    }

    let mut r0 = row_start;
    while r0 < row_end {
        // A = lhsᵀ, column-major: a_s[kk·64 + i] = lhs[r0 + kk, p0 + i].
        #[unroll]
        for l in 0..comptime!(2048 / (4 * plane_dim as usize)) {
            let e = tid + l * units;
            let r = r0 + e / 64usize;
            let pi = p0 + e % 64usize;
            let mut v = E::from_int(0);
            if r < row_end && pi < p {
                v = lhs[r * p + pi];
            }
            a_s[e] = v;
        }
        // B, row-major: b_s[kk·128 + j] = rhs[r0 + kk, q0 + j].
        #[unroll]
        for l in 0..comptime!(4096 / (4 * plane_dim as usize)) {
            let e = tid + l * units;
            let r = r0 + e / 128usize;
            let qj = q0 + e % 128usize;
            let mut v = E::from_int(0);
            if r < row_end && qj < q {
                v = rhs[r * q + qj];
            }
            b_s[e] = v;
        }
        sync_cube();
        mma_slice::<E>(
            &a_s,
            &b_s,
            pr * 32usize,
            pc * 64usize,
            64usize,
            MatrixLayout::ColMajor,
            16usize,
            1024usize,
            128usize,
            MatrixLayout::RowMajor,
            16usize,
            2048usize,
            &mut acc,
        );
        sync_cube();
        r0 += 32usize;
    }

    let scratch = plane * 256usize;
    #[unroll]
    for f in 0..8usize {
        let mi = comptime!(f / 4);
        let nj = comptime!(f % 4);
        store_acc::<E>(
            acc.index(f),
            &mut c_s,
            out,
            scratch,
            p0 + pr * 32usize + mi * 16usize,
            q0 + pc * 64usize + nj * 16usize,
            p,
            q,
            g * p * q,
            q,
            plane_dim,
        );
    }
}
