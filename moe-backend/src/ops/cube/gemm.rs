//! Grouped GEMM kernels (docs/routing-and-dispatch.md §Grouped GEMM) that read group sizes from
//! device memory.
//!
//! A tiny scan kernel turns `group_sizes [G]` into row offsets and row-tile offsets on the
//! device. The forward / dgrad kernel is launched over an upper bound of row tiles,
//! `ceil(N / TILE_M) + G` (each group adds at most one partial tile); every cube finds its group
//! by binary search over the tile offsets and idles when it is past the last tile. No token
//! count ever travels to the host. The wgrad kernel runs one cube per `(group, P tile, Q tile)`
//! and loops over the group's rows.
//!
//! Two kernel bodies share that launch geometry and output mapping ([`GemmKernel`]):
//!
//! - **tiled** (GPUs): the forward / dgrad kernel computes `64 × 128` outputs per cube of
//!   `16 × 16` units (4 × 8 outputs per unit), wgrad `64 × 64` (4 × 4 per unit); operands are
//!   staged through shared memory in `TILE_K = 16` slices.
//! - **direct** (software Vulkan devices): the same per-unit register tiles, with every operand
//!   read straight from global memory (no shared memory, no barriers). CubeCL 0.11.3's SPIR-V
//!   compiler emits invalid SPIR-V for *any* shared memory on a Vulkan device without
//!   `VK_KHR_workgroup_memory_explicit_layout` (its implicit lowering declares the `Workgroup`
//!   variable with a pointer-to-pointer type, which `spirv-val` rejects and Mesa's lavapipe
//!   segfaults on in `vkCreateComputePipelines`). lavapipe (Mesa 25) is such a device; the GPU
//!   drivers (NVIDIA, RADV, ANV) expose the extension. [`GemmKernel::for_client`] picks the body.
//!
//! Both accumulate in f32 for every input dtype and add the reduction terms in the same order
//! (`k = 0, 1, …` for the forward / dgrad, group rows in order for wgrad), so they agree up to
//! the driver's FMA contraction.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use std::sync::atomic::{AtomicU8, Ordering};

use super::gemm_cmma;
#[cfg(feature = "cuda")]
use super::gemm_cublas;
use super::launch::{self, empty_like_dtype, float_storage, int_storage};
use crate::error::BackendError;

/// Output rows per cube.
const TILE_M: usize = 64;
/// Output columns per cube of the forward / dgrad kernel.
const TILE_N: usize = 128;
/// Output columns (Q) per cube of the wgrad kernel.
const TILE_Q: usize = 64;
/// Reduction slice staged in shared memory.
const TILE_K: usize = 16;
/// Units per cube along each axis (`UNITS × UNITS` units, each computing `4 × 4` outputs).
const UNITS: u32 = 16;
// The kernels spell these sizes as literals (shared slices of 1024, 4 loads per unit).
const _: () =
    assert!(TILE_M * TILE_K == 1024 && TILE_N * TILE_K == 2048 && TILE_Q == TILE_M && UNITS == 16);
// The tensor-core forward shares the launch grid and the row-tile scan.
const _: () = assert!(gemm_cmma::CMMA_TILE_M == TILE_M && gemm_cmma::CMMA_TILE_N == TILE_N);

/// `offsets[g + 1] = Σ_{g' ≤ g} sizes[g']` and `tile_offsets[g + 1] = Σ ceil(sizes / 64usize)`.
#[cube(launch)]
fn group_offsets_kernel<I: Int>(
    sizes: &Tensor<I>,
    offsets: &mut Tensor<u32>,
    tile_offsets: &mut Tensor<u32>,
    #[comptime] tile_m: usize,
    #[define(I)] _dtype: ElemType,
) {
    if ABSOLUTE_POS == 0 {
        let mut rows = 0u32;
        let mut tiles = 0u32;
        offsets[0] = 0u32;
        tile_offsets[0] = 0u32;
        for g in 0..sizes.len() {
            let s = u32::cast_from(sizes[g]);
            rows += s;
            tiles += s.div_ceil(tile_m as u32);
            offsets[g + 1] = rows;
            tile_offsets[g + 1] = tiles;
        }
    }
}

/// Group of row tile `tile`: the last `g` with `tile_offsets[g] <= tile` (binary search; the
/// caller has checked `tile < tile_offsets[groups]`).
#[cube]
pub(crate) fn tile_group(tile_offsets: &Tensor<u32>, tile: u32, groups: u32) -> u32 {
    let mut lo = 0u32;
    let mut hi = groups;
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if tile_offsets[mid as usize] <= tile {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Tiled grouped GEMM (shared-memory staging): `out[seg_g] = x[seg_g] · W_g(ᵀ)` for
/// `x [N, K]`; `w [G, M, K]` when `transpose_w`, else `[G, K, M]`; `out [N, M]`.
#[cube(launch)]
fn grouped_gemm_kernel<E: Float>(
    x: &Tensor<E>,
    w: &Tensor<E>,
    offsets: &Tensor<u32>,
    tile_offsets: &Tensor<u32>,
    out: &mut Tensor<E>,
    k_dim: u32,
    m_dim: u32,
    groups: u32,
    #[comptime] transpose_w: bool,
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

    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let tid = ty * 16usize + tx;
    let threads = 256usize;

    let mut a_s = Shared::<[f32]>::new_slice(1024usize);
    let mut b_s = Shared::<[f32]>::new_slice(2048usize);
    let mut acc = Array::<f32>::new(32usize);
    #[unroll]
    for i in 0..32 {
        acc[i] = 0.0f32;
    }

    let mut k0 = 0usize;
    while k0 < k {
        // A tile: rows row0.., columns k0..; coalesced along k.
        #[unroll]
        for l in 0..4 {
            let e = tid + l * threads;
            let i = e / 16usize;
            let kk = e % 16usize;
            let r = row0 + i;
            let kc = k0 + kk;
            let mut v = 0.0f32;
            if r < row_end && kc < k {
                v = f32::cast_from(x[r * k + kc]);
            }
            a_s[kk * 64usize + i] = v;
        }
        // B tile: (kk, j) = W_g(ᵀ)[k0 + kk, col0 + j].
        #[unroll]
        for l in 0..8 {
            let e = tid + l * threads;
            let mut v = 0.0f32;
            if comptime![transpose_w] {
                let j = e / 16usize;
                let kk = e % 16usize;
                let c = col0 + j;
                let kc = k0 + kk;
                if c < m && kc < k {
                    v = f32::cast_from(w[w_base + c * k + kc]);
                }
                b_s[kk * 128usize + j] = v;
            } else {
                let kk = e / 128usize;
                let j = e % 128usize;
                let c = col0 + j;
                let kc = k0 + kk;
                if c < m && kc < k {
                    v = f32::cast_from(w[w_base + kc * m + c]);
                }
                b_s[kk * 128usize + j] = v;
            }
        }
        sync_cube();
        #[unroll]
        for kk in 0..16usize {
            let mut a_r = Array::<f32>::new(4usize);
            let mut b_r = Array::<f32>::new(8usize);
            #[unroll]
            for i in 0..4 {
                a_r[i] = a_s[kk * 64usize + ty + i * 16usize];
            }
            #[unroll]
            for j in 0..8 {
                b_r[j] = b_s[kk * 128usize + tx + j * 16usize];
            }
            #[unroll]
            for i in 0..4 {
                #[unroll]
                for j in 0..8 {
                    acc[i * 8 + j] += a_r[i] * b_r[j];
                }
            }
        }
        sync_cube();
        k0 += 16usize;
    }

    #[unroll]
    for i in 0..4 {
        let r = row0 + ty + i * 16usize;
        #[unroll]
        for j in 0..8 {
            let c = col0 + tx + j * 16usize;
            if r < row_end && c < m {
                out[r * m + c] = E::cast_from(acc[i * 8 + j]);
            }
        }
    }
}

/// Tiled grouped weight gradient (shared-memory staging): `out[g] = lhs[seg_g]ᵀ · rhs[seg_g]`
/// for `lhs [N, P]`, `rhs [N, Q]`, `out [G, P, Q]` (zero for empty groups).
#[cube(launch)]
fn grouped_wgrad_kernel<E: Float>(
    lhs: &Tensor<E>,
    rhs: &Tensor<E>,
    offsets: &Tensor<u32>,
    out: &mut Tensor<E>,
    p_dim: u32,
    q_dim: u32,
    #[define(E)] _dtype: ElemType,
) {
    let g = CUBE_POS_Z as usize;
    let p0 = CUBE_POS_Y as usize * 64usize;
    let q0 = CUBE_POS_X as usize * 64usize;
    let p = p_dim as usize;
    let q = q_dim as usize;
    let row_start = offsets[g] as usize;
    let row_end = offsets[g + 1] as usize;

    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let tid = ty * 16usize + tx;
    let threads = 256usize;

    let mut a_s = Shared::<[f32]>::new_slice(1024usize);
    let mut b_s = Shared::<[f32]>::new_slice(1024usize);
    let mut acc = Array::<f32>::new(16usize);
    #[unroll]
    for i in 0..16 {
        acc[i] = 0.0f32;
    }

    let mut r0 = row_start;
    while r0 < row_end {
        #[unroll]
        for l in 0..4 {
            let e = tid + l * threads;
            let kk = e / 64usize;
            let i = e % 64usize;
            let r = r0 + kk;
            let mut va = 0.0f32;
            if r < row_end && p0 + i < p {
                va = f32::cast_from(lhs[r * p + p0 + i]);
            }
            a_s[kk * 64usize + i] = va;
            let mut vb = 0.0f32;
            if r < row_end && q0 + i < q {
                vb = f32::cast_from(rhs[r * q + q0 + i]);
            }
            b_s[kk * 64usize + i] = vb;
        }
        sync_cube();
        #[unroll]
        for kk in 0..16usize {
            let mut a_r = Array::<f32>::new(4usize);
            let mut b_r = Array::<f32>::new(4usize);
            #[unroll]
            for i in 0..4 {
                a_r[i] = a_s[kk * 64usize + ty + i * 16usize];
                b_r[i] = b_s[kk * 64usize + tx + i * 16usize];
            }
            #[unroll]
            for i in 0..4 {
                #[unroll]
                for j in 0..4 {
                    acc[i * 4 + j] += a_r[i] * b_r[j];
                }
            }
        }
        sync_cube();
        r0 += 16usize;
    }

    #[unroll]
    for i in 0..4 {
        let pi = p0 + ty + i * 16usize;
        #[unroll]
        for j in 0..4 {
            let qj = q0 + tx + j * 16usize;
            if pi < p && qj < q {
                out[g * p * q + pi * q + qj] = E::cast_from(acc[i * 4 + j]);
            }
        }
    }
}

/// Direct grouped GEMM (no shared memory), same contract, grid and output mapping as
/// [`grouped_gemm_kernel`]: unit `(tx, ty)` of a row tile owns rows `row0 + ty + 16 i` (i < 4)
/// and columns `col0 + tx + 16 j` (j < 8) and reads its operands from global memory. Row and
/// column indices past the segment / matrix are clamped to its last row / column, so every load
/// is in bounds; those outputs are not stored.
#[cube(launch)]
fn grouped_gemm_direct_kernel<E: Float>(
    x: &Tensor<E>,
    w: &Tensor<E>,
    offsets: &Tensor<u32>,
    tile_offsets: &Tensor<u32>,
    out: &mut Tensor<E>,
    k_dim: u32,
    m_dim: u32,
    groups: u32,
    #[comptime] transpose_w: bool,
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
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;

    // Element offsets of this unit's x rows and W_g columns (clamped, see above).
    let mut x_row = Array::<usize>::new(4usize);
    #[unroll]
    for i in 0..4 {
        let mut r = row0 + ty + i * 16usize;
        if r >= row_end {
            r = row_end - 1;
        }
        x_row[i] = r * k;
    }
    let mut w_col = Array::<usize>::new(8usize);
    #[unroll]
    for j in 0..8 {
        let mut c = col0 + tx + j * 16usize;
        if c >= m {
            c = m - 1;
        }
        w_col[j] = c;
    }
    let mut acc = Array::<f32>::new(32usize);
    #[unroll]
    for i in 0..32 {
        acc[i] = 0.0f32;
    }

    for kk in 0..k {
        let mut a_r = Array::<f32>::new(4usize);
        let mut b_r = Array::<f32>::new(8usize);
        #[unroll]
        for i in 0..4 {
            a_r[i] = f32::cast_from(x[x_row[i] + kk]);
        }
        #[unroll]
        for j in 0..8 {
            if comptime![transpose_w] {
                b_r[j] = f32::cast_from(w[w_base + w_col[j] * k + kk]);
            } else {
                b_r[j] = f32::cast_from(w[w_base + kk * m + w_col[j]]);
            }
        }
        #[unroll]
        for i in 0..4 {
            #[unroll]
            for j in 0..8 {
                acc[i * 8 + j] += a_r[i] * b_r[j];
            }
        }
    }

    #[unroll]
    for i in 0..4 {
        let r = row0 + ty + i * 16usize;
        #[unroll]
        for j in 0..8 {
            let c = col0 + tx + j * 16usize;
            if r < row_end && c < m {
                out[r * m + c] = E::cast_from(acc[i * 8 + j]);
            }
        }
    }
}

/// Direct grouped weight gradient (no shared memory), same contract, grid and output mapping as
/// [`grouped_wgrad_kernel`]: unit `(tx, ty)` owns `P` indices `p0 + ty + 16 i` and `Q` indices
/// `q0 + tx + 16 j` (i, j < 4), clamped for the loads like [`grouped_gemm_direct_kernel`].
#[cube(launch)]
fn grouped_wgrad_direct_kernel<E: Float>(
    lhs: &Tensor<E>,
    rhs: &Tensor<E>,
    offsets: &Tensor<u32>,
    out: &mut Tensor<E>,
    p_dim: u32,
    q_dim: u32,
    #[define(E)] _dtype: ElemType,
) {
    let g = CUBE_POS_Z as usize;
    let p0 = CUBE_POS_Y as usize * 64usize;
    let q0 = CUBE_POS_X as usize * 64usize;
    let p = p_dim as usize;
    let q = q_dim as usize;
    let row_start = offsets[g] as usize;
    let row_end = offsets[g + 1] as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;

    let mut a_col = Array::<usize>::new(4usize);
    let mut b_col = Array::<usize>::new(4usize);
    #[unroll]
    for i in 0..4 {
        let mut pi = p0 + ty + i * 16usize;
        if pi >= p {
            pi = p - 1;
        }
        a_col[i] = pi;
        let mut qj = q0 + tx + i * 16usize;
        if qj >= q {
            qj = q - 1;
        }
        b_col[i] = qj;
    }
    let mut acc = Array::<f32>::new(16usize);
    #[unroll]
    for i in 0..16 {
        acc[i] = 0.0f32;
    }

    for r in row_start..row_end {
        let mut a_r = Array::<f32>::new(4usize);
        let mut b_r = Array::<f32>::new(4usize);
        #[unroll]
        for i in 0..4 {
            a_r[i] = f32::cast_from(lhs[r * p + a_col[i]]);
            b_r[i] = f32::cast_from(rhs[r * q + b_col[i]]);
        }
        #[unroll]
        for i in 0..4 {
            #[unroll]
            for j in 0..4 {
                acc[i * 4 + j] += a_r[i] * b_r[j];
            }
        }
    }

    #[unroll]
    for i in 0..4 {
        let pi = p0 + ty + i * 16usize;
        #[unroll]
        for j in 0..4 {
            let qj = q0 + tx + j * 16usize;
            if pi < p && qj < q {
                out[g * p * q + pi * q + qj] = E::cast_from(acc[i * 4 + j]);
            }
        }
    }
}

/// A grouped-GEMM kernel body of the Cube backend (docs/gpu.md §Cube kernels), or the automatic
/// choice among them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CubeGemmKernel {
    /// Per device: [`CubeGemmKernel::Direct`] on a software Vulkan device (no usable shared
    /// memory) and [`CubeGemmKernel::Tiled`] everywhere else. [`CubeGemmKernel::Cmma`] runs
    /// only when asked for until a GPU run has checked it.
    Auto,
    /// Scalar f32 FMAs on register tiles, operands staged through shared memory (any dtype).
    Tiled,
    /// Scalar f32 FMAs on register tiles, operands read from global memory (any dtype).
    Direct,
    /// Tensor cores (CubeCL `cmma`): BF16 / F16 operands, f32 accumulators. Where the device or
    /// dtype cannot run it, the automatic choice runs instead (with a warning on stderr, once).
    Cmma,
    /// cuBLAS (feature `cuda`, CUDA devices; BF16 / F16 / F32 operands, f32 accumulation): one
    /// `cublasGemmGroupedBatchedEx` per op, or one `cublasGemmEx` per group where the library
    /// lacks it ([`last_cublas_route`]). Reads the group sizes to the host. Where the device,
    /// dtype or build cannot run it, or libcublas is missing, the automatic choice runs
    /// instead (with a warning on stderr, once).
    Cublas,
}

/// Environment variable that sets the process's initial [`CubeGemmKernel`]:
/// `auto`, `tiled`, `direct`, `cmma` or `cublas`.
pub const GEMM_KERNEL_ENV: &str = "MOE_CUBE_GEMM";

impl CubeGemmKernel {
    /// The name `MOE_CUBE_GEMM` and [`str::parse`] take.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Tiled => "tiled",
            Self::Direct => "direct",
            Self::Cmma => "cmma",
            Self::Cublas => "cublas",
        }
    }

    fn code(self) -> u8 {
        match self {
            Self::Auto => 0,
            Self::Tiled => 1,
            Self::Direct => 2,
            Self::Cmma => 3,
            Self::Cublas => 4,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::Auto),
            1 => Some(Self::Tiled),
            2 => Some(Self::Direct),
            3 => Some(Self::Cmma),
            4 => Some(Self::Cublas),
            _ => None,
        }
    }
}

impl std::fmt::Display for CubeGemmKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CubeGemmKernel {
    type Err = BackendError;

    fn from_str(s: &str) -> Result<Self, BackendError> {
        [
            Self::Auto,
            Self::Tiled,
            Self::Direct,
            Self::Cmma,
            Self::Cublas,
        ]
        .into_iter()
        .find(|k| k.name() == s)
        .ok_or_else(|| BackendError::Config {
            field: GEMM_KERNEL_ENV,
            detail: format!("{s:?} is not auto, tiled, direct, cmma or cublas"),
        })
    }
}

/// No kernel requested yet (the environment is read on first use) / no launch yet.
const UNSET: u8 = u8::MAX;
/// The requested kernel ([`CubeGemmKernel::code`]), or [`UNSET`].
static REQUESTED: AtomicU8 = AtomicU8::new(UNSET);
/// The body the most recent launch ran, or [`UNSET`].
static LAST_RUN: AtomicU8 = AtomicU8::new(UNSET);

/// Sets the grouped-GEMM kernel of the Cube backend for the rest of the process (every device;
/// overrides `MOE_CUBE_GEMM`). Benches use it to time the candidates in one process.
pub fn set_cube_gemm_kernel(kernel: CubeGemmKernel) {
    REQUESTED.store(kernel.code(), Ordering::Relaxed);
}

/// The requested grouped-GEMM kernel: the last [`set_cube_gemm_kernel`], else `MOE_CUBE_GEMM`
/// (read once; an unknown value warns on stderr and means [`CubeGemmKernel::Auto`]).
pub fn cube_gemm_kernel() -> CubeGemmKernel {
    if let Some(k) = CubeGemmKernel::from_code(REQUESTED.load(Ordering::Relaxed)) {
        return k;
    }
    let k = match std::env::var(GEMM_KERNEL_ENV) {
        Ok(v) if v.is_empty() => CubeGemmKernel::Auto,
        Ok(v) => v.parse().unwrap_or_else(|e| {
            eprintln!("warning: {e}; choosing the grouped-GEMM kernel automatically");
            CubeGemmKernel::Auto
        }),
        Err(std::env::VarError::NotPresent) => CubeGemmKernel::Auto,
        Err(e) => {
            eprintln!("warning: {GEMM_KERNEL_ENV}: {e}; choosing automatically");
            CubeGemmKernel::Auto
        }
    };
    // A concurrent `set_cube_gemm_kernel` wins over the environment.
    let _ = REQUESTED.compare_exchange(UNSET, k.code(), Ordering::Relaxed, Ordering::Relaxed);
    CubeGemmKernel::from_code(REQUESTED.load(Ordering::Relaxed)).unwrap_or(k)
}

/// The body the most recent grouped GEMM (forward, dgrad or wgrad) of the Cube backend ran in
/// this process — never [`CubeGemmKernel::Auto`]; `None` before the first launch.
pub fn last_cube_gemm_kernel() -> Option<CubeGemmKernel> {
    CubeGemmKernel::from_code(LAST_RUN.load(Ordering::Relaxed))
}

/// How the cuBLAS candidate issued a grouped GEMM ([`last_cublas_route`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CublasRoute {
    /// One `cublasGemmGroupedBatchedEx` for the op (cuBLAS ≥ 12.5).
    Grouped,
    /// One `cublasGemmEx` per non-empty group (the library lacks or refused the grouped call).
    PerGroup,
}

impl CublasRoute {
    /// `grouped` or `per_group`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Grouped => "grouped",
            Self::PerGroup => "per_group",
        }
    }
}

/// The route of the most recent cuBLAS grouped GEMM (0: none yet, 1: grouped, 2: per group).
static CUBLAS_ROUTE: AtomicU8 = AtomicU8::new(0);

/// Records a grouped GEMM that cuBLAS ran by `route`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn record_cublas_route(route: CublasRoute) {
    let code = match route {
        CublasRoute::Grouped => 1,
        CublasRoute::PerGroup => 2,
    };
    CUBLAS_ROUTE.store(code, Ordering::Relaxed);
    LAST_RUN.store(CubeGemmKernel::Cublas.code(), Ordering::Relaxed);
}

/// How the most recent grouped GEMM that ran on cuBLAS ([`CubeGemmKernel::Cublas`]) was
/// issued in this process; `None` before the first.
pub fn last_cublas_route() -> Option<CublasRoute> {
    match CUBLAS_ROUTE.load(Ordering::Relaxed) {
        1 => Some(CublasRoute::Grouped),
        2 => Some(CublasRoute::PerGroup),
        _ => None,
    }
}

/// The cuBLAS library the [`CubeGemmKernel::Cublas`] candidate loads (version, and whether it
/// has `cublasGemmGroupedBatchedEx`), or why it cannot: no libcublas on the library path, or
/// a build without the `cuda` feature. Loads the library on first use.
pub fn cublas_library_info() -> Result<String, String> {
    #[cfg(feature = "cuda")]
    {
        gemm_cublas::library_info()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this build has no `cuda` feature".into())
    }
}

/// What a device offers the kernel choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DeviceTraits {
    /// The runtime compiles to SPIR-V for a device that is no card (lavapipe, SwiftShader: no
    /// explicit workgroup-memory layout, so CubeCL 0.11.3's shared memory is invalid SPIR-V).
    software_spirv: bool,
    /// The plane size of the tensor-core kernel, where the device has its fragments for the
    /// operands' dtype (f32 accumulators) and a fixed plane size that fits the kernel.
    cmma_plane: Option<u32>,
    /// cuBLAS can take the operands: a CUDA device in a build with `cuda`, a dtype cuBLAS's
    /// candidate runs (BF16, F16, F32). Whether libcublas loads is known only when it runs.
    cublas: bool,
}

/// Whether `device` is a CUDA device (always false without the `cuda` feature).
fn is_cuda(device: &burn_cubecl::CubeDevice) -> bool {
    #[cfg(feature = "cuda")]
    {
        matches!(device, burn_cubecl::CubeDevice::Cuda(_))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

impl DeviceTraits {
    /// The traits of `client`'s device for operands of `dtype`; `cuda`: the device is a CUDA
    /// device ([`is_cuda`]).
    fn of(client: &Client, dtype: burn::tensor::DType, cuda: bool) -> Self {
        let props = client.properties();
        let software_spirv = client.name() == "wgpu<spirv>" && props.identity.physical.is_none();
        let half = matches!(dtype, burn::tensor::DType::BF16 | burn::tensor::DType::F16);
        let elem = float_storage(dtype);
        let f32_elem = float_storage(burn::tensor::DType::F32);
        let has_fragments = props.features.matmul.cmma.iter().any(|c| {
            c.a_type == elem
                && c.b_type == elem
                && c.cd_type == f32_elem
                && (c.m, c.n, c.k) == (16, 16, 16)
        });
        let (lo, hi) = (props.hardware.plane_size_min, props.hardware.plane_size_max);
        let cmma_plane =
            (half && has_fragments && lo == hi && gemm_cmma::plane_dim_fits(hi)).then_some(hi);
        let cublas_dtype = matches!(
            dtype,
            burn::tensor::DType::BF16 | burn::tensor::DType::F16 | burn::tensor::DType::F32
        );
        Self {
            software_spirv,
            cmma_plane,
            cublas: cuda && cublas_dtype,
        }
    }
}

/// What a grouped GEMM runs: a CubeCL kernel body, or cuBLAS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Choice {
    /// A CubeCL kernel body.
    Kernel(Body),
    /// [`CubeGemmKernel::Cublas`] (`gemm_cublas`).
    Cublas,
}

/// The automatic body on a device with `traits`: the scalar body it can compile.
fn automatic(traits: DeviceTraits) -> Body {
    if traits.software_spirv {
        Body::Direct
    } else {
        Body::Tiled
    }
}

/// What runs for `requested` on a device with `traits`, and a reason when a requested
/// [`CubeGemmKernel::Cmma`] or [`CubeGemmKernel::Cublas`] cannot run there.
fn resolve(requested: CubeGemmKernel, traits: DeviceTraits) -> (Choice, Option<&'static str>) {
    let scalar = Choice::Kernel(automatic(traits));
    match requested {
        CubeGemmKernel::Tiled => (Choice::Kernel(Body::Tiled), None),
        CubeGemmKernel::Direct => (Choice::Kernel(Body::Direct), None),
        // Tensor cores (CubeCL's or cuBLAS's) only on request until a GPU run has checked
        // them (the device script times the candidates and names the choice).
        CubeGemmKernel::Auto => (scalar, None),
        CubeGemmKernel::Cmma => match traits.cmma_plane {
            Some(plane) => (Choice::Kernel(Body::Cmma(plane)), None),
            None => (
                scalar,
                Some(
                    "the device has no 16x16x16 tensor-core fragments with f32 accumulators \
                     for this dtype (or no fixed plane size of 4..=256 lanes); cmma needs BF16 \
                     or F16 operands",
                ),
            ),
        },
        CubeGemmKernel::Cublas if traits.cublas => (Choice::Cublas, None),
        CubeGemmKernel::Cublas => (
            scalar,
            Some(
                "cuBLAS needs a CUDA device (a build with the `cuda` feature) and BF16, F16 or \
                 F32 operands",
            ),
        ),
    }
}

/// The kernel body a launch runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    /// [`CubeGemmKernel::Tiled`].
    Tiled,
    /// [`CubeGemmKernel::Direct`].
    Direct,
    /// [`CubeGemmKernel::Cmma`] with planes of this many lanes.
    Cmma(u32),
    /// The tensor-core kernels with [`gemm_cmma::Emulated`] fragment products (tests; run
    /// by the Vulkan ones).
    #[cfg(test)]
    #[cfg_attr(not(feature = "vulkan"), allow(dead_code))]
    Emulated(u32),
}

impl Choice {
    /// What runs for operands like `t` (its client, device and dtype); warns once per process
    /// when a requested `cmma` or `cublas` falls back, and records a kernel body for
    /// [`last_cube_gemm_kernel`] (cuBLAS records itself when it has run).
    fn choose(t: &CubeTensor) -> Self {
        static WARNED: std::sync::Once = std::sync::Once::new();
        let requested = cube_gemm_kernel();
        let traits = DeviceTraits::of(&t.client, t.dtype, is_cuda(&t.device));
        let (choice, fallback) = resolve(requested, traits);
        if let (Some(why), Choice::Kernel(body)) = (fallback, choice) {
            WARNED.call_once(|| {
                eprintln!(
                    "warning: grouped-GEMM kernel {requested} requested on {} with {:?}: \
                     {why}; running the {} kernel",
                    t.client.name(),
                    t.dtype,
                    body.kernel()
                )
            });
        }
        if let Choice::Kernel(body) = choice {
            LAST_RUN.store(body.kernel().code(), Ordering::Relaxed);
        }
        choice
    }
}

impl Body {
    /// The automatic body for operands like `t` after cuBLAS could not run (`why`): warns once
    /// per process and records the body for [`last_cube_gemm_kernel`].
    #[cfg(feature = "cuda")]
    fn after_cublas(t: &CubeTensor, why: &str) -> Self {
        static WARNED: std::sync::Once = std::sync::Once::new();
        let body = automatic(DeviceTraits::of(&t.client, t.dtype, true));
        WARNED.call_once(|| {
            eprintln!(
                "warning: grouped-GEMM kernel cublas could not run on {} with {:?}: {why}; \
                 running the {} kernel",
                t.client.name(),
                t.dtype,
                body.kernel()
            )
        });
        LAST_RUN.store(body.kernel().code(), Ordering::Relaxed);
        body
    }

    fn kernel(self) -> CubeGemmKernel {
        match self {
            Self::Tiled => CubeGemmKernel::Tiled,
            Self::Direct => CubeGemmKernel::Direct,
            Self::Cmma(_) => CubeGemmKernel::Cmma,
            #[cfg(test)]
            Self::Emulated(_) => CubeGemmKernel::Cmma,
        }
    }
}

/// Device row offsets `[G + 1]` and row-tile offsets `[G + 1]` of `group_sizes [G]`.
fn group_offsets(sizes: &CubeTensor) -> (CubeTensor, CubeTensor) {
    let g = sizes.meta.shape()[0];
    let offsets = empty_like_dtype(sizes, [g + 1], burn::tensor::DType::U32);
    let tiles = empty_like_dtype(sizes, [g + 1], burn::tensor::DType::U32);
    group_offsets_kernel::launch(
        &sizes.client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        sizes.clone().into_tensor_arg(),
        offsets.clone().into_tensor_arg(),
        tiles.clone().into_tensor_arg(),
        TILE_M,
        int_storage(sizes.dtype),
    );
    (offsets, tiles)
}

fn tiles(n: usize, tile: usize, op: &str) -> u32 {
    launch::u32_arg(n.div_ceil(tile), op)
}

/// Grouped GEMM; see [`MoeOps::moe_grouped_matmul`](crate::ops::MoeOps::moe_grouped_matmul).
pub(crate) fn grouped_matmul(
    x: CubeTensor,
    weights: CubeTensor,
    sizes: CubeTensor,
    transpose_weights: bool,
) -> CubeTensor {
    grouped_matmul_with(x, weights, sizes, transpose_weights, None)
}

/// [`grouped_matmul`] running `body` (`None`: the requested kernel, [`Choice::choose`]).
fn grouped_matmul_with(
    x: CubeTensor,
    weights: CubeTensor,
    sizes: CubeTensor,
    transpose_weights: bool,
    body: Option<Body>,
) -> CubeTensor {
    let op = "moe_grouped_matmul";
    let x = launch::contiguous(x);
    let w = launch::cast_float(launch::contiguous(weights), x.dtype);
    let sizes = launch::contiguous(sizes);
    let [n, k] = [x.meta.shape()[0], x.meta.shape()[1]];
    let ws = w.meta.shape().clone();
    assert!(ws.num_dims() == 3, "{op}: weights must be 3-D, got {ws:?}");
    let (g, m, in_dim) = if transpose_weights {
        (ws[0], ws[1], ws[2])
    } else {
        (ws[0], ws[2], ws[1])
    };
    assert_eq!(
        in_dim, k,
        "{op}: x has {k} columns, weights expect {in_dim}"
    );
    assert_eq!(
        sizes.meta.shape()[0],
        g,
        "{op}: {} group sizes for {g} groups",
        sizes.meta.shape()[0]
    );
    if n == 0 || m == 0 || g == 0 {
        return empty_like_dtype(&x, [n, m], x.dtype);
    }
    if k == 0 {
        return burn_cubecl::ops::numeric::zeros_client(
            x.client.clone(),
            x.device.clone(),
            burn::tensor::Shape::new([n, m]),
            x.dtype,
        );
    }
    let body = match body.map_or_else(|| Choice::choose(&x), Choice::Kernel) {
        Choice::Kernel(body) => body,
        #[cfg(feature = "cuda")]
        Choice::Cublas => {
            match gemm_cublas::grouped_matmul(&x, &w, &sizes, transpose_weights, [n, k, m]) {
                Ok(out) => return out,
                Err(gemm_cublas::Failure::Input(e)) => panic!("{e}"),
                Err(gemm_cublas::Failure::Unavailable(why)) => Body::after_cublas(&x, &why),
            }
        }
        // `resolve` picks cuBLAS only for CUDA devices, which need the `cuda` feature.
        #[cfg(not(feature = "cuda"))]
        Choice::Cublas => automatic(DeviceTraits::of(&x.client, x.dtype, false)),
    };
    let out = empty_like_dtype(&x, [n, m], x.dtype);
    let (offsets, tile_offsets) = group_offsets(&sizes);
    let count = CubeCount::Static(tiles(m, TILE_N, op), tiles(n, TILE_M, op) + g as u32, 1);
    let dtype = float_storage(x.dtype);
    let dim = CubeDim::new_2d(UNITS, UNITS);
    let (x_arg, w_arg) = (x.clone().into_tensor_arg(), w.into_tensor_arg());
    let (off_arg, tiles_arg) = (offsets.into_tensor_arg(), tile_offsets.into_tensor_arg());
    let out_arg = out.clone().into_tensor_arg();
    let (k_arg, m_arg, g_arg) = (
        launch::u32_arg(k, op),
        launch::u32_arg(m, op),
        launch::u32_arg(g, op),
    );
    match body {
        Body::Tiled => grouped_gemm_kernel::launch(
            &x.client,
            count,
            dim,
            x_arg,
            w_arg,
            off_arg,
            tiles_arg,
            out_arg,
            k_arg,
            m_arg,
            g_arg,
            transpose_weights,
            dtype,
        ),
        Body::Direct => grouped_gemm_direct_kernel::launch(
            &x.client,
            count,
            dim,
            x_arg,
            w_arg,
            off_arg,
            tiles_arg,
            out_arg,
            k_arg,
            m_arg,
            g_arg,
            transpose_weights,
            dtype,
        ),
        Body::Cmma(plane) => gemm_cmma::grouped_gemm_cmma_kernel::launch::<gemm_cmma::Cmma>(
            &x.client,
            count,
            CubeDim::new_2d(plane, gemm_cmma::CMMA_PLANES),
            x_arg,
            w_arg,
            off_arg,
            tiles_arg,
            out_arg,
            k_arg,
            m_arg,
            g_arg,
            transpose_weights,
            plane,
            dtype,
        ),
        #[cfg(test)]
        Body::Emulated(plane) => {
            gemm_cmma::grouped_gemm_cmma_kernel::launch::<gemm_cmma::Emulated>(
                &x.client,
                count,
                CubeDim::new_2d(plane, gemm_cmma::CMMA_PLANES),
                x_arg,
                w_arg,
                off_arg,
                tiles_arg,
                out_arg,
                k_arg,
                m_arg,
                g_arg,
                transpose_weights,
                plane,
                dtype,
            )
        }
    }
    out
}

/// Grouped weight gradient; see
/// [`MoeOps::moe_grouped_matmul_wgrad`](crate::ops::MoeOps::moe_grouped_matmul_wgrad).
pub(crate) fn grouped_matmul_wgrad(
    lhs: CubeTensor,
    rhs: CubeTensor,
    sizes: CubeTensor,
) -> CubeTensor {
    grouped_matmul_wgrad_with(lhs, rhs, sizes, None)
}

/// [`grouped_matmul_wgrad`] running `body` (`None`: the requested kernel, [`Choice::choose`]).
fn grouped_matmul_wgrad_with(
    lhs: CubeTensor,
    rhs: CubeTensor,
    sizes: CubeTensor,
    body: Option<Body>,
) -> CubeTensor {
    let op = "moe_grouped_matmul_wgrad";
    let lhs = launch::contiguous(lhs);
    let rhs = launch::cast_float(launch::contiguous(rhs), lhs.dtype);
    let sizes = launch::contiguous(sizes);
    let [n, p] = [lhs.meta.shape()[0], lhs.meta.shape()[1]];
    let [n2, q] = [rhs.meta.shape()[0], rhs.meta.shape()[1]];
    assert_eq!(n, n2, "{op}: lhs has {n} rows, rhs {n2}");
    let g = sizes.meta.shape()[0];
    if g == 0 || p == 0 || q == 0 || n == 0 {
        return burn_cubecl::ops::numeric::zeros_client(
            lhs.client.clone(),
            lhs.device.clone(),
            burn::tensor::Shape::new([g, p, q]),
            lhs.dtype,
        );
    }
    let body = match body.map_or_else(|| Choice::choose(&lhs), Choice::Kernel) {
        Choice::Kernel(body) => body,
        #[cfg(feature = "cuda")]
        Choice::Cublas => match gemm_cublas::grouped_matmul_wgrad(&lhs, &rhs, &sizes, [n, p, q]) {
            Ok(out) => return out,
            Err(gemm_cublas::Failure::Input(e)) => panic!("{e}"),
            Err(gemm_cublas::Failure::Unavailable(why)) => Body::after_cublas(&lhs, &why),
        },
        #[cfg(not(feature = "cuda"))]
        Choice::Cublas => automatic(DeviceTraits::of(&lhs.client, lhs.dtype, false)),
    };
    let out = empty_like_dtype(&lhs, [g, p, q], lhs.dtype);
    let (offsets, _) = group_offsets(&sizes);
    let dtype = float_storage(lhs.dtype);
    let (lhs_arg, rhs_arg) = (lhs.clone().into_tensor_arg(), rhs.into_tensor_arg());
    let (off_arg, out_arg) = (offsets.into_tensor_arg(), out.clone().into_tensor_arg());
    let (p_arg, q_arg) = (launch::u32_arg(p, op), launch::u32_arg(q, op));
    let groups = launch::u32_arg(g, op);
    let dim = CubeDim::new_2d(UNITS, UNITS);
    match body {
        Body::Tiled => grouped_wgrad_kernel::launch(
            &lhs.client,
            CubeCount::Static(tiles(q, TILE_Q, op), tiles(p, TILE_M, op), groups),
            dim,
            lhs_arg,
            rhs_arg,
            off_arg,
            out_arg,
            p_arg,
            q_arg,
            dtype,
        ),
        Body::Direct => grouped_wgrad_direct_kernel::launch(
            &lhs.client,
            CubeCount::Static(tiles(q, TILE_Q, op), tiles(p, TILE_M, op), groups),
            dim,
            lhs_arg,
            rhs_arg,
            off_arg,
            out_arg,
            p_arg,
            q_arg,
            dtype,
        ),
        Body::Cmma(plane) => gemm_cmma::grouped_wgrad_cmma_kernel::launch::<gemm_cmma::Cmma>(
            &lhs.client,
            CubeCount::Static(
                tiles(q, gemm_cmma::CMMA_TILE_N, op),
                tiles(p, gemm_cmma::CMMA_TILE_M, op),
                groups,
            ),
            CubeDim::new_2d(plane, gemm_cmma::CMMA_PLANES),
            lhs_arg,
            rhs_arg,
            off_arg,
            out_arg,
            p_arg,
            q_arg,
            plane,
            dtype,
        ),
        #[cfg(test)]
        Body::Emulated(plane) => {
            gemm_cmma::grouped_wgrad_cmma_kernel::launch::<gemm_cmma::Emulated>(
                &lhs.client,
                CubeCount::Static(
                    tiles(q, gemm_cmma::CMMA_TILE_N, op),
                    tiles(p, gemm_cmma::CMMA_TILE_M, op),
                    groups,
                ),
                CubeDim::new_2d(plane, gemm_cmma::CMMA_PLANES),
                lhs_arg,
                rhs_arg,
                off_arg,
                out_arg,
                p_arg,
                q_arg,
                plane,
                dtype,
            )
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: DeviceTraits = DeviceTraits {
        software_spirv: false,
        cmma_plane: None,
        cublas: false,
    };
    const TENSOR_CORES: DeviceTraits = DeviceTraits {
        software_spirv: false,
        cmma_plane: Some(32),
        cublas: false,
    };
    const LAVAPIPE: DeviceTraits = DeviceTraits {
        software_spirv: true,
        cmma_plane: None,
        cublas: false,
    };
    /// A CUDA GPU with tensor cores, BF16 operands, in a `cuda` build.
    const CUDA: DeviceTraits = DeviceTraits {
        software_spirv: false,
        cmma_plane: Some(32),
        cublas: true,
    };

    #[test]
    fn tensor_cores_run_when_asked_for_where_the_device_has_them() {
        use CubeGemmKernel as K;
        let kernel = Choice::Kernel;
        // Automatic: the scalar bodies until a GPU run has checked the tensor-core ones.
        assert_eq!(resolve(K::Auto, TENSOR_CORES), (kernel(Body::Tiled), None));
        assert_eq!(resolve(K::Auto, GPU), (kernel(Body::Tiled), None));
        assert_eq!(resolve(K::Auto, LAVAPIPE), (kernel(Body::Direct), None));
        assert_eq!(resolve(K::Auto, CUDA), (kernel(Body::Tiled), None));
        for traits in [GPU, TENSOR_CORES, LAVAPIPE, CUDA] {
            assert_eq!(resolve(K::Tiled, traits), (kernel(Body::Tiled), None));
            assert_eq!(resolve(K::Direct, traits), (kernel(Body::Direct), None));
        }
        assert_eq!(
            resolve(K::Cmma, TENSOR_CORES),
            (kernel(Body::Cmma(32)), None)
        );
        let (body, why) = resolve(K::Cmma, GPU);
        assert_eq!(body, kernel(Body::Tiled));
        assert!(why.is_some_and(|w| w.contains("tensor-core")), "{why:?}");
        assert_eq!(resolve(K::Cmma, LAVAPIPE).0, kernel(Body::Direct));
    }

    #[test]
    fn cublas_runs_when_asked_for_on_cuda_devices_only() {
        use CubeGemmKernel as K;
        assert_eq!(resolve(K::Cublas, CUDA), (Choice::Cublas, None));
        assert_eq!(resolve(K::Cmma, CUDA).0, Choice::Kernel(Body::Cmma(32)));
        // Not CUDA (or a dtype cuBLAS's candidate does not take): the automatic scalar body,
        // with the reason.
        for (traits, body) in [
            (GPU, Body::Tiled),
            (TENSOR_CORES, Body::Tiled),
            (LAVAPIPE, Body::Direct),
        ] {
            let (choice, why) = resolve(K::Cublas, traits);
            assert_eq!(choice, Choice::Kernel(body));
            assert!(why.is_some_and(|w| w.contains("CUDA device")), "{why:?}");
        }
    }

    #[test]
    fn kernel_names_parse_and_bad_ones_are_config_errors() {
        for k in [
            CubeGemmKernel::Auto,
            CubeGemmKernel::Tiled,
            CubeGemmKernel::Direct,
            CubeGemmKernel::Cmma,
            CubeGemmKernel::Cublas,
        ] {
            assert_eq!(k.name().parse::<CubeGemmKernel>().ok(), Some(k));
            assert_eq!(CubeGemmKernel::from_code(k.code()), Some(k));
        }
        let err = "wmma".parse::<CubeGemmKernel>().unwrap_err();
        assert!(
            matches!(&err, BackendError::Config { field, .. } if *field == GEMM_KERNEL_ENV),
            "{err}"
        );
        assert!(err.to_string().contains("\"wmma\""), "{err}");
    }

    #[test]
    fn plane_sizes_that_fit_the_staging_loops() {
        for p in [4, 8, 16, 32, 64, 128, 256] {
            assert!(gemm_cmma::plane_dim_fits(p), "{p}");
        }
        for p in [0, 1, 2, 3, 24, 48, 512] {
            assert!(!gemm_cmma::plane_dim_fits(p), "{p}");
        }
    }

    /// Output of a grouped GEMM run with `body`, or the launch's error text.
    #[cfg(feature = "vulkan")]
    fn run_body(
        device: &burn::tensor::Device,
        body: Body,
        wgrad: bool,
        transpose: bool,
    ) -> Result<Vec<f32>, String> {
        use burn::backend::{BackendTensor, DispatchTensorKind};
        use burn::tensor::{DType, Int, Tensor, TensorData};
        fn cube<const D: usize, K: burn::tensor::kind::Basic>(t: Tensor<D, K>) -> CubeTensor {
            match t.into_dispatch().kind {
                DispatchTensorKind::Cube(BackendTensor::Float(t) | BackendTensor::Int(t)) => t,
                _ => panic!("not a Cube tensor"),
            }
        }
        // Two groups of 2 and 1 rows, K = 2, M = 3: small integers, exact in F16.
        let half = |v: Vec<f32>, shape: Vec<usize>| {
            Tensor::<2>::from_data(TensorData::new(v, shape), device).cast(DType::F16)
        };
        let x = half((1..=6).map(|v| v as f32).collect(), vec![3, 2]);
        let sizes = cube(Tensor::<1, Int>::from_data(
            TensorData::new(vec![2i32, 1], [2]),
            device,
        ));
        let y = if wgrad {
            let rhs = half((1..=9).map(|v| v as f32).collect(), vec![3, 3]);
            grouped_matmul_wgrad_with(cube(x), cube(rhs), sizes, Some(body))
        } else {
            let w = Tensor::<3>::from_data(
                TensorData::new((1..=12).map(|v| v as f32).collect(), [2, 2, 3]),
                device,
            )
            .cast(DType::F16);
            let w = if transpose { w.swap_dims(1, 2) } else { w };
            grouped_matmul_with(cube(x), cube(w), sizes, transpose, Some(body))
        };
        let y = launch::cast_float(y, DType::F32);
        y.client
            .read_one(y.handle.clone())
            .map(|b| bytemuck_f32(&b))
            .map_err(|e| format!("{e:?}"))
    }

    #[cfg(feature = "vulkan")]
    fn bytemuck_f32(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// The tensor-core kernels expand completely on a Vulkan device: on one without
    /// cooperative matrices (lavapipe) every expansion error is a missing fragment — all 8
    /// accumulators, both `A` and all 4 `B` fragments of both `K` steps, nothing else — and
    /// on a device with them the results equal the scalar body's (exact small integers).
    #[cfg(feature = "vulkan")]
    #[test]
    fn cmma_kernels_expand_on_vulkan() {
        use burn::tensor::{DType, Device, DeviceKind};
        let device = Device::vulkan(DeviceKind::DefaultDevice);
        for (wgrad, transpose) in [(false, true), (false, false), (true, false)] {
            let what = format!("wgrad {wgrad} transpose {transpose}");
            let client = {
                use burn::backend::{BackendTensor, DispatchTensorKind};
                let t = burn::tensor::Tensor::<1>::zeros([1], &device);
                match t.into_dispatch().kind {
                    DispatchTensorKind::Cube(BackendTensor::Float(t)) => t.client,
                    _ => panic!("not a Cube tensor"),
                }
            };
            let traits = DeviceTraits::of(&client, DType::F16, false);
            // The scalar body this device runs (lavapipe crashes on the shared-memory one).
            let scalar_traits = DeviceTraits {
                cmma_plane: None,
                ..traits
            };
            let Choice::Kernel(scalar_body) = resolve(CubeGemmKernel::Auto, scalar_traits).0 else {
                panic!("the automatic choice is a kernel body");
            };
            let scalar = run_body(&device, scalar_body, wgrad, transpose).expect("scalar body");
            match traits.cmma_plane {
                Some(plane) => {
                    let got = run_body(&device, Body::Cmma(plane), wgrad, transpose);
                    assert_eq!(got.as_ref(), Ok(&scalar), "{what}");
                }
                None => {
                    let err = run_body(&device, Body::Cmma(8), wgrad, transpose)
                        .expect_err("a device without cooperative matrices cannot run cmma");
                    let missing = |ident: &str| {
                        err.matches(&format!(
                            "doesn't support a 16x16 {ident} cooperative matrix fragment"
                        ))
                        .count()
                    };
                    assert_eq!(
                        (missing("Accumulator"), missing("A"), missing("B")),
                        (8, 4, 8),
                        "{what}: {err}"
                    );
                }
            }
            // Closed form: x = 1..=6 as [3, 2], groups of rows {0, 1} and {2}.
            let xv = |r: usize, k: usize| (r * 2 + k + 1) as f32;
            let want: Vec<f32> = if wgrad {
                // out[g][k][c] = Σ_{r ∈ g} x[r][k] · rhs[r][c], rhs = 1..=9 as [3, 3].
                let rhs = |r: usize, c: usize| (r * 3 + c + 1) as f32;
                let rows = [0..2, 2..3];
                (0..2)
                    .flat_map(|g| (0..2).flat_map(move |k| (0..3).map(move |c| (g, k, c))))
                    .map(|(g, k, c)| rows[g].clone().map(|r| xv(r, k) * rhs(r, c)).sum())
                    .collect()
            } else {
                // y[r][c] = Σ_k x[r][k] · W_g[k][c], W = 1..=12 as [2, 2, 3].
                let wv = |g: usize, k: usize, c: usize| (g * 6 + k * 3 + c + 1) as f32;
                (0..3)
                    .flat_map(|r| (0..3).map(move |c| (r, c)))
                    .map(|(r, c)| {
                        (0..2)
                            .map(|k| xv(r, k) * wv(usize::from(r == 2), k, c))
                            .sum()
                    })
                    .collect()
            };
            assert_eq!(scalar, want, "{what}: the scalar body");
        }
    }

    /// `CubeTensor` of a Burn tensor on a Cube device.
    #[cfg(feature = "vulkan")]
    fn cube_of<const D: usize, K: burn::tensor::kind::Basic>(
        t: burn::tensor::Tensor<D, K>,
    ) -> CubeTensor {
        use burn::backend::{BackendTensor, DispatchTensorKind};
        match t.into_dispatch().kind {
            DispatchTensorKind::Cube(BackendTensor::Float(t) | BackendTensor::Int(t)) => t,
            _ => panic!("not a Cube tensor"),
        }
    }

    #[cfg(feature = "vulkan")]
    fn read_f32(t: CubeTensor) -> Vec<f32> {
        let t = launch::cast_float(t, burn::tensor::DType::F32);
        let bytes = t.client.read_one(t.handle.clone()).expect("read back");
        bytemuck_f32(&bytes)
    }

    /// The tensor-core kernels' own index math — operand staging and its zero padding, the
    /// fragment offsets and layouts of every plane, the accumulators' way out through shared
    /// memory and the edge masks — run with [`gemm_cmma::Emulated`] fragment products on
    /// llvmpipe (OpenGL, WGSL: shared memory works there), at ragged shapes that cross every
    /// tile edge (groups of 0, 2, 70 and 129 rows; `K = 70`: two full `K` slices and a partial
    /// one; 130 columns: a full and a partial column tile; wgrad `P = 70`, `Q = 130`), against
    /// f64 references. Planes of 256 lanes (one accumulator element per lane): llvmpipe's
    /// shader compiler (LLVM's coroutine splitting at the barriers) takes minutes on the
    /// per-lane loops of 32-lane planes; the kernels' indexing is the same for every plane
    /// size, and the staging loops still run 2 and 4 rounds.
    #[cfg(feature = "vulkan")]
    #[test]
    fn cmma_kernels_with_emulated_fragments_equal_the_reference() {
        use burn::tensor::wgpu::WgpuBackend;
        use burn::tensor::{Device, Int, Tensor, TensorData};
        let device = Device::wgpu_options()
            .graphics_api(WgpuBackend::Gl)
            .init()
            .expect("OpenGL wgpu device (on Debian: libegl1, libegl-mesa0, libgl1-mesa-dri)");
        let sizes = [70usize, 0, 129, 2, 0];
        let (g, n) = (sizes.len(), sizes.iter().sum::<usize>());
        let (k, m) = (70usize, 130usize);
        let mut state = 7u64;
        let mut rand = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
                })
                .collect()
        };
        let (xv, wv, rv) = (rand(n * k), rand(g * k * m), rand(n * m));
        let sizes_t = || {
            let v: Vec<i32> = sizes.iter().map(|&s| s as i32).collect();
            cube_of(Tensor::<1, Int>::from_data(
                TensorData::new(v, [g]),
                &device,
            ))
        };
        let f32s = |v: &[f32], shape: Vec<usize>| TensorData::new(v.to_vec(), shape);
        let group_of = |r: usize| {
            let mut end = 0;
            sizes.iter().position(|&s| {
                end += s;
                r < end
            })
        };
        // y[r][c] = Σ_k x[r][k] · W_g[k][c] with W as [G, K, M].
        let want_y: Vec<f64> = (0..n * m)
            .map(|e| {
                let (r, c) = (e / m, e % m);
                let gi = group_of(r).expect("row in a group");
                (0..k)
                    .map(|kk| xv[r * k + kk] as f64 * wv[(gi * k + kk) * m + c] as f64)
                    .sum()
            })
            .collect();
        // dW[g][p][q] = Σ_{r ∈ g} x[r][p] · rhs[r][q] (P = K, Q = M).
        let want_dw: Vec<f64> = (0..g * k * m)
            .map(|e| {
                let (gi, p, q) = (e / (k * m), (e / m) % k, e % m);
                (0..n)
                    .filter(|&r| group_of(r) == Some(gi))
                    .map(|r| xv[r * k + p] as f64 * rv[r * m + q] as f64)
                    .sum()
            })
            .collect();
        let close = |got: &[f32], want: &[f64], what: &str| {
            assert_eq!(got.len(), want.len(), "{what}");
            for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
                assert!(
                    (a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0) * 10.0,
                    "{what}: element {i}: {a} vs {b}"
                );
            }
        };
        for plane in [256u32] {
            for transpose in [false, true] {
                let w = Tensor::<3>::from_data(f32s(&wv, vec![g, k, m]), &device);
                // `transpose`: the same W held as [G, M, K].
                let w = if transpose { w.swap_dims(1, 2) } else { w };
                let x = Tensor::<2>::from_data(f32s(&xv, vec![n, k]), &device);
                let y = grouped_matmul_with(
                    cube_of(x),
                    cube_of(w),
                    sizes_t(),
                    transpose,
                    Some(Body::Emulated(plane)),
                );
                close(
                    &read_f32(y),
                    &want_y,
                    &format!("fprop plane {plane} transpose {transpose}"),
                );
            }
            let x = Tensor::<2>::from_data(f32s(&xv, vec![n, k]), &device);
            let r = Tensor::<2>::from_data(f32s(&rv, vec![n, m]), &device);
            let dw = grouped_matmul_wgrad_with(
                cube_of(x),
                cube_of(r),
                sizes_t(),
                Some(Body::Emulated(plane)),
            );
            close(&read_f32(dw), &want_dw, &format!("wgrad plane {plane}"));
        }
    }
}
