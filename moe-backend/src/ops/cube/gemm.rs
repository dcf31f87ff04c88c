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

use super::launch::{self, empty_like_dtype, float_storage, int_storage};

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
fn tile_group(tile_offsets: &Tensor<u32>, tile: u32, groups: u32) -> u32 {
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

/// Which grouped-GEMM kernel body runs on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemmKernel {
    /// Shared-memory staged tiles: what a GPU runs.
    Tiled,
    /// Operands read from global memory, no shared memory.
    Direct,
}

/// Environment variable that overrides the kernel choice: `tiled`, `direct` or `auto`.
pub(crate) const GEMM_KERNEL_ENV: &str = "MOE_CUBE_GEMM";

impl GemmKernel {
    /// The kernel for `client`'s device: [`GemmKernel::Direct`] where CubeCL compiles to SPIR-V
    /// for a device that is no card (lavapipe, SwiftShader: no explicit workgroup-memory layout,
    /// so CubeCL 0.11.3's shared memory is invalid SPIR-V there), else [`GemmKernel::Tiled`].
    /// [`GEMM_KERNEL_ENV`] overrides it (read once per process; other values warn on stderr and
    /// fall back to the automatic choice).
    pub(crate) fn for_client(client: &Client) -> Self {
        static CHOICE: std::sync::OnceLock<Option<GemmKernel>> = std::sync::OnceLock::new();
        let forced = *CHOICE.get_or_init(|| match std::env::var(GEMM_KERNEL_ENV).as_deref() {
            Ok("tiled") => Some(Self::Tiled),
            Ok("direct") => Some(Self::Direct),
            Ok("auto") | Ok("") | Err(std::env::VarError::NotPresent) => None,
            Ok(other) => {
                eprintln!(
                    "warning: {GEMM_KERNEL_ENV}={other:?} is not tiled, direct or auto; \
                     choosing the grouped-GEMM kernel automatically"
                );
                None
            }
            Err(e) => {
                eprintln!("warning: {GEMM_KERNEL_ENV}: {e}; choosing automatically");
                None
            }
        });
        forced.unwrap_or_else(|| {
            Self::auto(
                client.name(),
                client.properties().identity.physical.is_some(),
            )
        })
    }

    /// The automatic choice for a runtime named `runtime` (CubeCL's `Client::name`) on a device
    /// that is (`has_card`) or is not a physical card.
    fn auto(runtime: &str, has_card: bool) -> Self {
        if runtime == "wgpu<spirv>" && !has_card {
            Self::Direct
        } else {
            Self::Tiled
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
    let out = empty_like_dtype(&x, [n, m], x.dtype);
    if n == 0 || m == 0 || g == 0 {
        return out;
    }
    if k == 0 {
        return burn_cubecl::ops::numeric::zeros_client(
            x.client.clone(),
            x.device.clone(),
            burn::tensor::Shape::new([n, m]),
            x.dtype,
        );
    }
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
    match GemmKernel::for_client(&x.client) {
        GemmKernel::Tiled => grouped_gemm_kernel::launch(
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
        GemmKernel::Direct => grouped_gemm_direct_kernel::launch(
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
    let out = empty_like_dtype(&lhs, [g, p, q], lhs.dtype);
    let (offsets, _) = group_offsets(&sizes);
    let count = CubeCount::Static(
        tiles(q, TILE_Q, op),
        tiles(p, TILE_M, op),
        launch::u32_arg(g, op),
    );
    let dtype = float_storage(lhs.dtype);
    let dim = CubeDim::new_2d(UNITS, UNITS);
    let (lhs_arg, rhs_arg) = (lhs.clone().into_tensor_arg(), rhs.into_tensor_arg());
    let (off_arg, out_arg) = (offsets.into_tensor_arg(), out.clone().into_tensor_arg());
    let (p_arg, q_arg) = (launch::u32_arg(p, op), launch::u32_arg(q, op));
    match GemmKernel::for_client(&lhs.client) {
        GemmKernel::Tiled => grouped_wgrad_kernel::launch(
            &lhs.client,
            count,
            dim,
            lhs_arg,
            rhs_arg,
            off_arg,
            out_arg,
            p_arg,
            q_arg,
            dtype,
        ),
        GemmKernel::Direct => grouped_wgrad_direct_kernel::launch(
            &lhs.client,
            count,
            dim,
            lhs_arg,
            rhs_arg,
            off_arg,
            out_arg,
            p_arg,
            q_arg,
            dtype,
        ),
    }
    out
}
