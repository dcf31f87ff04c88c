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
//! The fragment operations sit behind [`TileMma`]: [`Cmma`] runs them on the tensor cores,
//! `Emulated` in scalar code with the same contract, so the kernels' own index math runs (and
//! is tested) on a CPU driver without cooperative matrices; only the `cmma` instructions
//! themselves need a GPU (the GPU script's `grouped_gemm_rust` case).
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

/// The `16 × 16 × 16` fragment products of the kernels below: [`Cmma`] on tensor cores, and
/// `Emulated`, the same contract in scalar code, which tests every index of the kernels
/// (staging, fragment offsets, layouts, the store) on devices without cooperative matrices.
#[cube]
pub(crate) trait TileMma<E: Float>: Send + Sync + 'static {
    /// An operand fragment.
    type Frag: CubeType;
    /// An f32 accumulator fragment (`16 × 16`).
    type Acc: CubeType;

    /// An accumulator set to zero.
    fn zero(#[comptime] plane_dim: u32) -> Self::Acc;

    /// The `A` (`ident`: false) or `B` (true) fragment whose element `(0, 0)` is `s[base]`,
    /// element `(r, c)` at `base + r·stride + c` (row-major) or `base + c·stride + r`.
    fn load(
        s: &Shared<[E]>,
        base: usize,
        #[comptime] stride: usize,
        #[comptime] row_major: bool,
        #[comptime] b: bool,
    ) -> Self::Frag;

    /// `acc += a · b` (`a_s`, `b_s` and the layouts are those the fragments were loaded with).
    #[allow(clippy::too_many_arguments)]
    fn mma(
        a_s: &Shared<[E]>,
        a: &Self::Frag,
        #[comptime] a_stride: usize,
        #[comptime] a_row_major: bool,
        b_s: &Shared<[E]>,
        b: &Self::Frag,
        #[comptime] b_stride: usize,
        #[comptime] b_row_major: bool,
        acc: &mut Self::Acc,
        #[comptime] plane_dim: u32,
    );

    /// Writes `acc` row-major (stride 16) to `c_s[at..at + 256]`.
    fn store(acc: &Self::Acc, c_s: &mut Shared<[f32]>, at: usize, #[comptime] plane_dim: u32);

    /// Orders the plane's accesses to its scratch: what [`TileMma::store`] wrote is visible to
    /// every lane of the plane, and the lanes' reads finish before the next store.
    fn fence();
}

/// Tensor cores through CubeCL's cooperative matrices.
pub(crate) struct Cmma;

/// Scalar stand-in for [`Cmma`]: a fragment is its base offset in shared memory, an
/// accumulator the `256 / plane_dim` elements `lane + l · plane_dim` (row-major `16 × 16`)
/// this lane owns. Test-only: the tests run the kernels' index math with it on CPU drivers.
#[cfg(test)]
pub(crate) struct Emulated;

/// The cooperative-matrix layout of a row-major (`true`) or column-major operand.
fn layout_of(row_major: bool) -> MatrixLayout {
    if row_major {
        MatrixLayout::RowMajor
    } else {
        MatrixLayout::ColMajor
    }
}

#[cube]
impl<E: Float> TileMma<E> for Cmma {
    type Frag = Matrix<E>;
    type Acc = Matrix<f32>;

    fn zero(#[comptime] _plane_dim: u32) -> Matrix<f32> {
        Matrix::<f32>::from_value(
            MatrixIdent::Accumulator,
            16usize,
            16usize,
            16usize,
            MatrixLayout::Undefined,
            0.0f32,
        )
    }

    fn load(
        s: &Shared<[E]>,
        base: usize,
        #[comptime] stride: usize,
        #[comptime] row_major: bool,
        #[comptime] b: bool,
    ) -> Matrix<E> {
        let end = base + comptime!(15 * stride + 16);
        let ident = comptime!(if b { MatrixIdent::B } else { MatrixIdent::A });
        Matrix::<E>::from_slice(
            ident,
            16usize,
            16usize,
            16usize,
            comptime!(layout_of(row_major)),
            s.slice(base, end),
            comptime!(stride as u32),
        )
    }

    fn mma(
        _a_s: &Shared<[E]>,
        a: &Matrix<E>,
        #[comptime] _a_stride: usize,
        #[comptime] _a_row_major: bool,
        _b_s: &Shared<[E]>,
        b: &Matrix<E>,
        #[comptime] _b_stride: usize,
        #[comptime] _b_row_major: bool,
        acc: &mut Matrix<f32>,
        #[comptime] _plane_dim: u32,
    ) {
        cmma::execute(a, b, &*acc, &*acc);
    }

    fn store(acc: &Matrix<f32>, c_s: &mut Shared<[f32]>, at: usize, #[comptime] _plane_dim: u32) {
        cmma::store(
            c_s.slice_mut(at, at + 256usize),
            acc,
            16u32,
            MatrixLayout::RowMajor,
        );
    }

    fn fence() {
        // The fragment's elements are spread over the plane's lanes in the device's own way.
        sync_plane();
    }
}

#[cfg(test)]
#[cube]
impl<E: Float> TileMma<E> for Emulated {
    type Frag = usize;
    type Acc = Array<f32>;

    fn zero(#[comptime] plane_dim: u32) -> Array<f32> {
        let mut acc = Array::<f32>::new(comptime!(256 / plane_dim as usize));
        for l in 0..comptime!(256 / plane_dim as usize) {
            acc[l] = 0.0f32;
        }
        acc
    }

    fn load(
        _s: &Shared<[E]>,
        base: usize,
        #[comptime] _stride: usize,
        #[comptime] _row_major: bool,
        #[comptime] _b: bool,
    ) -> usize {
        base
    }

    fn mma(
        a_s: &Shared<[E]>,
        a: &usize,
        #[comptime] a_stride: usize,
        #[comptime] a_row_major: bool,
        b_s: &Shared<[E]>,
        b: &usize,
        #[comptime] b_stride: usize,
        #[comptime] b_row_major: bool,
        acc: &mut Array<f32>,
        #[comptime] plane_dim: u32,
    ) {
        let lane = UNIT_POS_X as usize;
        for l in 0..comptime!(256 / plane_dim as usize) {
            let e = lane + l * comptime!(plane_dim as usize);
            let (i, j) = (e / 16usize, e % 16usize);
            let mut sum = 0.0f32;
            #[unroll]
            for kk in 0..16usize {
                let av = if comptime![a_row_major] {
                    a_s[*a + i * a_stride + kk]
                } else {
                    a_s[*a + kk * a_stride + i]
                };
                let bv = if comptime![b_row_major] {
                    b_s[*b + kk * b_stride + j]
                } else {
                    b_s[*b + j * b_stride + kk]
                };
                sum += f32::cast_from(av) * f32::cast_from(bv);
            }
            acc[l] += sum;
        }
    }

    fn store(acc: &Array<f32>, c_s: &mut Shared<[f32]>, at: usize, #[comptime] plane_dim: u32) {
        let lane = UNIT_POS_X as usize;
        for l in 0..comptime!(256 / plane_dim as usize) {
            c_s[at + lane + l * comptime!(plane_dim as usize)] = acc[l];
        }
    }

    fn fence() {
        // Every lane reads back exactly the elements it wrote.
    }
}

/// The products of one `K = 32` slice for one plane: `A` fragments at `a_base + mi·a_row`
/// (mi < 2), `B` fragments at `b_base + nj·b_col` (nj < 4), for both 16-wide `K` steps
/// (`a_k`, `b_k` apart); accumulators row-major `acc[mi·4 + nj]`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn mma_slice<E: Float, T: TileMma<E>>(
    a_s: &Shared<[E]>,
    b_s: &Shared<[E]>,
    a_base: usize,
    b_base: usize,
    #[comptime] a_stride: usize,
    #[comptime] a_row_major: bool,
    #[comptime] a_row: usize,
    #[comptime] a_k: usize,
    #[comptime] b_stride: usize,
    #[comptime] b_row_major: bool,
    #[comptime] b_col: usize,
    #[comptime] b_k: usize,
    acc: &mut Sequence<T::Acc>,
    #[comptime] plane_dim: u32,
) {
    #[unroll]
    for ks in 0..2usize {
        let a0 = T::load(a_s, a_base + ks * a_k, a_stride, a_row_major, false);
        let a1 = T::load(a_s, a_base + a_row + ks * a_k, a_stride, a_row_major, false);
        #[unroll]
        for nj in 0..4usize {
            let b = T::load(
                b_s,
                b_base + nj * b_col + ks * b_k,
                b_stride,
                b_row_major,
                true,
            );
            T::mma(
                a_s,
                &a0,
                a_stride,
                a_row_major,
                b_s,
                &b,
                b_stride,
                b_row_major,
                acc.index_mut(nj),
                plane_dim,
            );
            T::mma(
                a_s,
                &a1,
                a_stride,
                a_row_major,
                b_s,
                &b,
                b_stride,
                b_row_major,
                acc.index_mut(4usize + nj),
                plane_dim,
            );
        }
    }
}

/// Stores accumulator `acc` (rows `r0..r0 + 16` of the output, columns `c0..c0 + 16`) through
/// this plane's scratch `c_s[scratch..scratch + 256]` (ordered by [`TileMma::fence`], the
/// scratch being the plane's own): lanes write the elements with row below
/// `row_end` and column below `cols` to `out[row_base + r · row_stride + c]`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn store_acc<E: Float, T: TileMma<E>>(
    acc: &T::Acc,
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
    T::store(acc, c_s, scratch, plane_dim);
    T::fence();
    let lane = UNIT_POS_X as usize;
    for l in 0..comptime!(256 / plane_dim as usize) {
        let e = lane + l * comptime!(plane_dim as usize);
        let r = r0 + e / 16usize;
        let c = c0 + e % 16usize;
        if r < row_end && c < cols {
            out[row_base + r * row_stride + c] = E::cast_from(c_s[scratch + e]);
        }
    }
    T::fence();
}

/// Tensor-core grouped GEMM: `out[seg_g] = x[seg_g] · W_g(ᵀ)` for `x [N, K]`; `w [G, M, K]`
/// when `transpose_w`, else `[G, K, M]`; `out [N, M]`. Grid `(ceil(M / 128), row-tile bound)`,
/// cube `(plane_dim, 4)`; offsets as in [`super::gemm`] (row tiles of 64).
#[cube(launch)]
pub(crate) fn grouped_gemm_cmma_kernel<E: Float, T: TileMma<E>>(
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
    let mut acc = Sequence::<T::Acc>::new();
    #[unroll]
    for _i in 0..8usize {
        acc.push(T::zero(plane_dim));
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
            mma_slice::<E, T>(
                &a_s,
                &b_s,
                pr * 1024usize,
                pc * 2048usize,
                32usize,
                true,
                512usize,
                16usize,
                32usize,
                false,
                512usize,
                16usize,
                &mut acc,
                plane_dim,
            );
        } else {
            mma_slice::<E, T>(
                &a_s,
                &b_s,
                pr * 1024usize,
                pc * 64usize,
                32usize,
                true,
                512usize,
                16usize,
                128usize,
                true,
                16usize,
                2048usize,
                &mut acc,
                plane_dim,
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
        store_acc::<E, T>(
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
pub(crate) fn grouped_wgrad_cmma_kernel<E: Float, T: TileMma<E>>(
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
    let mut acc = Sequence::<T::Acc>::new();
    #[unroll]
    for _i in 0..8usize {
        acc.push(T::zero(plane_dim));
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
        mma_slice::<E, T>(
            &a_s,
            &b_s,
            pr * 32usize,
            pc * 64usize,
            64usize,
            false,
            16usize,
            1024usize,
            128usize,
            true,
            16usize,
            2048usize,
            &mut acc,
            plane_dim,
        );
        sync_cube();
        r0 += 32usize;
    }

    let scratch = plane * 256usize;
    #[unroll]
    for f in 0..8usize {
        let mi = comptime!(f / 4);
        let nj = comptime!(f % 4);
        store_acc::<E, T>(
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
