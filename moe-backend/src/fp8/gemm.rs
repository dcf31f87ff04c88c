//! FP8 GEMMs emulated on the CPU (the blockwise recipe of docs/fp8.md §Recipes): every operand is
//! held as FP8 bytes plus block scales, and each K-block of the reduction is dequantised into small
//! f32 tiles that are accumulated into the f32 output with the `gemm` crate. No full-precision copy
//! of an operand is ever materialised.
//!
//! All products are "TN" (`out = A · Bᵀ`, both operands row-major with the reduction dimension
//! last), as Hopper FP8 tensor cores require; the backward passes use the transposed FP8
//! copies (fused cast + transpose):
//!
//! | GEMM | A (1×128 tiles) | B | out |
//! |---|---|---|---|
//! | fprop | `x_g [n_g, K]` rowwise | `W_g [M, K]`, 128×128 blocks | `y_g [n_g, M]` |
//! | dgrad | `dy_g [n_g, M]` rowwise | `W_gᵀ [K, M]` (same blocks, transposed bytes) | `dx_g [n_g, K]` |
//! | wgrad | `dy_gᵀ [M, n_g]` columnwise | `x_gᵀ [K, n_g]` columnwise | `dW_g [M, K]` |
//!
//! Numerical contract (docs/fp8.md §Recipes): `out = dq(q(A)) · dq(q(B))ᵀ` with f32 accumulation;
//! the result differs from a plain f32 product of the dequantised operands only by summation order.

use rayon::prelude::*;

use super::blockwise::{Fp8Blocks, quantize_blockwise, quantize_columnwise};
use super::formats::Fp8Format;
use super::recipe::Fp8Recipe;
use crate::error::{BackendError, Result};
use crate::ops::kernels::offsets_of;

/// A borrowed block-quantised `[rows, cols]` operand (rows may be a row range of a larger
/// matrix whose row blocks are single rows).
#[derive(Clone, Copy, Debug)]
pub struct Fp8View<'a> {
    data: &'a [u8],
    scale_inv: &'a [f32],
    rows: usize,
    cols: usize,
    block: [usize; 2],
    format: Fp8Format,
}

impl<'a> Fp8View<'a> {
    /// A row-major `[rows, cols]` matrix of `format` codes `data` with block `block` and its
    /// `[ceil(rows/b0), ceil(cols/b1)]` row-major `scale_inv` grid (lengths checked by the
    /// GEMM entry points that take views).
    pub(crate) fn new(
        data: &'a [u8],
        scale_inv: &'a [f32],
        rows: usize,
        cols: usize,
        block: [usize; 2],
        format: Fp8Format,
    ) -> Self {
        Self {
            data,
            scale_inv,
            rows,
            cols,
            block,
            format,
        }
    }

    /// The row-major codes.
    #[cfg(test)]
    pub(crate) fn data(&self) -> &'a [u8] {
        self.data
    }

    /// The row-major scale grid.
    #[cfg(test)]
    pub(crate) fn scale_inv(&self) -> &'a [f32] {
        self.scale_inv
    }

    /// Whether the code and scale lengths fit the shape and block.
    fn is_consistent(&self) -> bool {
        self.block[0] > 0
            && self.block[1] > 0
            && self.data.len() == self.rows * self.cols
            && self.scale_inv.len()
                == self.rows.div_ceil(self.block[0]) * self.cols.div_ceil(self.block[1])
    }

    /// The whole matrix.
    pub fn of(m: &'a Fp8Blocks) -> Self {
        Self {
            data: &m.data,
            scale_inv: &m.scale_inv,
            rows: m.rows,
            cols: m.cols,
            block: m.block,
            format: m.format,
        }
    }

    /// Rows `r0..r1` of a matrix with single-row blocks (`1×b1` tiles).
    fn row_range(m: &'a Fp8Blocks, r0: usize, r1: usize) -> Self {
        debug_assert_eq!(m.block[0], 1);
        let gc = m.cols.div_ceil(m.block[1]);
        Self {
            data: &m.data[r0 * m.cols..r1 * m.cols],
            scale_inv: &m.scale_inv[r0 * gc..r1 * gc],
            rows: r1 - r0,
            ..Self::of(m)
        }
    }

    /// Dequantises rows `r0..r0+len`, columns `c0..c0+kk` (inside one column block) into
    /// `buf` (`len · kk`, row-major).
    #[inline(always)]
    fn dequantize_tile(&self, r0: usize, len: usize, c0: usize, kk: usize, buf: &mut [f32]) {
        let gc = self.cols.div_ceil(self.block[1]);
        let bj = c0 / self.block[1];
        for (i, dst) in buf.chunks_exact_mut(kk).take(len).enumerate() {
            let r = r0 + i;
            let s = self.scale_inv[(r / self.block[0]) * gc + bj];
            let src = &self.data[r * self.cols + c0..r * self.cols + c0 + kk];
            super::blockwise::decode_scaled(self.format, src, s, dst);
        }
    }
}

/// One product `out[start..start + a.rows·b.rows] = A · Bᵀ` (row-major, `[a.rows, b.rows]`).
#[derive(Clone, Copy, Debug)]
pub struct TnProblem<'a> {
    /// `[Ma, K]` left operand.
    pub a: Fp8View<'a>,
    /// `[Mb, K]` right operand (transposed in the product).
    pub b: Fp8View<'a>,
    /// First output element of this product.
    pub out_start: usize,
}

/// Raw output pointer shared by tasks writing disjoint tiles.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: only used by tasks that write disjoint output tiles (see `grouped_gemm_tn`).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Rows of A and of B per task: a 128×128 output tile re-dequantises each K-block of its
/// operands once per 2·128·128·K flops.
const TILE: usize = 128;

/// Runs every product of `problems` into `out` (which the caller zero-filled), in parallel
/// over output tiles; each tile walks the K-blocks, dequantises the A and B tiles of the block
/// into two small f32 buffers and accumulates their product (f32) into the output tile.
///
/// Every problem's operands share the reduction length `K` and its block size `bk`
/// (`a.block[1] == b.block[1]`), so each K-block has one scale per operand row.
pub fn grouped_gemm_tn(problems: &[TnProblem<'_>], out: &mut [f32]) -> Result<()> {
    for p in problems {
        let end = p.out_start + p.a.rows * p.b.rows;
        if p.a.cols != p.b.cols || p.a.block[1] != p.b.block[1] || end > out.len() {
            return Err(BackendError::Shape {
                op: "fp8 grouped_gemm_tn",
                detail: format!(
                    "A [{}, {}] blocks {:?}, B [{}, {}] blocks {:?}, output {}..{end} of {}",
                    p.a.rows,
                    p.a.cols,
                    p.a.block,
                    p.b.rows,
                    p.b.cols,
                    p.b.block,
                    p.out_start,
                    out.len()
                ),
            });
        }
    }
    let mut tasks = Vec::new();
    for (pi, p) in problems.iter().enumerate() {
        if p.a.cols == 0 {
            continue; // empty reduction: the output stays zero
        }
        for i0 in (0..p.a.rows).step_by(TILE) {
            for j0 in (0..p.b.rows).step_by(TILE) {
                tasks.push((pi, i0, j0));
            }
        }
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    tasks.into_par_iter().for_each_init(
        || (Vec::<f32>::new(), Vec::<f32>::new()),
        |(buf_a, buf_b), (pi, i0, j0)| {
            let p = &problems[pi];
            let (k, bk) = (p.a.cols, p.a.block[1]);
            let (ta, tb) = (TILE.min(p.a.rows - i0), TILE.min(p.b.rows - j0));
            let ldo = p.b.rows;
            for c0 in (0..k).step_by(bk) {
                let kk = bk.min(k - c0);
                buf_a.resize(ta * kk, 0.0);
                buf_b.resize(tb * kk, 0.0);
                super::blockwise::simd(|| {
                    p.a.dequantize_tile(i0, ta, c0, kk, buf_a);
                    p.b.dequantize_tile(j0, tb, c0, kk, buf_b);
                });
                // SAFETY: the tile [i0, i0+ta) x [j0, j0+tb) of problem `pi` lies inside
                // out[out_start .. out_start + Ma·Mb] (checked above); problems' output
                // ranges are disjoint by the callers' construction and tiles of one problem
                // are disjoint, so no other task writes these elements. buf_a is [ta, kk]
                // row-major (lhs), buf_b is [tb, kk] row-major read as [kk, tb] (rhs).
                unsafe {
                    gemm::gemm(
                        ta,
                        tb,
                        kk,
                        out_ptr.get().add(p.out_start + i0 * ldo + j0),
                        1,
                        ldo as isize,
                        true,
                        buf_a.as_ptr(),
                        1,
                        kk as isize,
                        buf_b.as_ptr(),
                        kk as isize,
                        1,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            }
        },
    );
    Ok(())
}

fn check_sizes(op: &'static str, sizes: &[usize], rows: usize) -> Result<Vec<usize>> {
    let sum: usize = sizes.iter().sum();
    if sum != rows {
        return Err(BackendError::SizeSum { op, sum, rows });
    }
    Ok(offsets_of(sizes))
}

fn check_len(op: &'static str, what: &str, len: usize, shape: &[usize]) -> Result<()> {
    if shape.iter().product::<usize>() != len {
        return Err(BackendError::Shape {
            op,
            detail: format!("{what} has {len} values, expected {shape:?}"),
        });
    }
    Ok(())
}

/// Quantises each of the `G` weight matrices `[M, K]` of `w [G, M, K]` with the recipe's
/// square weight blocks.
pub fn quantize_weights(
    w: &[f32],
    groups: usize,
    m: usize,
    k: usize,
    recipe: &Fp8Recipe,
) -> Result<Vec<Fp8Blocks>> {
    check_len("fp8 quantize_weights", "weights", w.len(), &[groups, m, k])?;
    let b = recipe.block_size;
    (0..groups)
        .map(|g| {
            quantize_blockwise(
                &w[g * m * k..(g + 1) * m * k],
                m,
                k,
                [b, b],
                recipe.weight_format,
                recipe.pow2_scales,
            )
        })
        .collect()
}

/// FP8 grouped fprop: `y_g = dq(q(x_g)) · dq(q(W_g))ᵀ` for `x [N, K]` in segments of `sizes`
/// and `w [G, M, K]` (PyTorch `[out, in]`); returns `y [N, M]` (f32).
pub fn fp8_grouped_fprop(
    x: &[f32],
    k: usize,
    w: &[f32],
    m: usize,
    sizes: &[usize],
    recipe: &Fp8Recipe,
) -> Result<Vec<f32>> {
    recipe.validate()?;
    let wq = quantize_weights(w, sizes.len(), m, k, recipe)?;
    let views: Vec<Fp8View<'_>> = wq.iter().map(Fp8View::of).collect();
    fp8_grouped_fprop_quantized(x, k, &views, m, sizes, recipe)
}

/// Checks that `w` are `groups` consistent `[rows, cols]` weight views whose reduction blocks
/// are the recipe's.
fn check_weight_views(
    op: &'static str,
    w: &[Fp8View<'_>],
    groups: usize,
    rows: usize,
    cols: usize,
    recipe: &Fp8Recipe,
) -> Result<()> {
    let ok = w.len() == groups
        && w.iter().all(|v| {
            v.is_consistent() && v.rows == rows && v.cols == cols && v.block[1] == recipe.block_size
        });
    if ok {
        Ok(())
    } else {
        Err(BackendError::Shape {
            op,
            detail: format!(
                "{} quantised weights for {groups} groups of [{rows}, {cols}] with reduction \
                 block {}",
                w.len(),
                recipe.block_size
            ),
        })
    }
}

/// [`fp8_grouped_fprop`] with the weights already quantised: `w` holds one `[M, K]` FP8 view
/// per group (e.g. FP8 primary weights, which are their own quantisation), used as they are.
pub(crate) fn fp8_grouped_fprop_quantized(
    x: &[f32],
    k: usize,
    w: &[Fp8View<'_>],
    m: usize,
    sizes: &[usize],
    recipe: &Fp8Recipe,
) -> Result<Vec<f32>> {
    let op = "fp8_grouped_fprop";
    recipe.validate()?;
    let n = x.len().checked_div(k).unwrap_or_else(|| sizes.iter().sum());
    check_len(op, "x", x.len(), &[n, k])?;
    let offsets = check_sizes(op, sizes, n)?;
    check_weight_views(op, w, sizes.len(), m, k, recipe)?;
    let b = recipe.block_size;
    let xq = quantize_blockwise(
        x,
        n,
        k,
        [1, b],
        recipe.activation_format,
        recipe.pow2_scales,
    )?;
    let problems: Vec<TnProblem<'_>> = w
        .iter()
        .enumerate()
        .map(|(g, wg)| TnProblem {
            a: Fp8View::row_range(&xq, offsets[g], offsets[g + 1]),
            b: *wg,
            out_start: offsets[g] * m,
        })
        .collect();
    let mut y = vec![0f32; n * m];
    grouped_gemm_tn(&problems, &mut y)?;
    Ok(y)
}

/// FP8 grouped dgrad: `dx_g = dq(q(dy_g)) · dq(q(W_g))` for `dy [N, M]` and `w [G, M, K]`, with
/// `dy` in `1×b` tiles along `M` and the transposed FP8 weight; returns `dx [N, K]` (f32).
pub fn fp8_grouped_dgrad(
    dy: &[f32],
    m: usize,
    w: &[f32],
    k: usize,
    sizes: &[usize],
    recipe: &Fp8Recipe,
) -> Result<Vec<f32>> {
    recipe.validate()?;
    let wt: Vec<Fp8Blocks> = quantize_weights(w, sizes.len(), m, k, recipe)?
        .iter()
        .map(Fp8Blocks::transpose)
        .collect();
    let views: Vec<Fp8View<'_>> = wt.iter().map(Fp8View::of).collect();
    fp8_grouped_dgrad_quantized(dy, m, &views, k, sizes, recipe)
}

/// [`fp8_grouped_dgrad`] with the weights already quantised and transposed: `wt` holds one
/// `[K, M]` FP8 view (`W_gᵀ`, blocks `[b, b]`) per group, used as they are.
pub(crate) fn fp8_grouped_dgrad_quantized(
    dy: &[f32],
    m: usize,
    wt: &[Fp8View<'_>],
    k: usize,
    sizes: &[usize],
    recipe: &Fp8Recipe,
) -> Result<Vec<f32>> {
    let op = "fp8_grouped_dgrad";
    recipe.validate()?;
    let n = dy
        .len()
        .checked_div(m)
        .unwrap_or_else(|| sizes.iter().sum());
    check_len(op, "dy", dy.len(), &[n, m])?;
    let offsets = check_sizes(op, sizes, n)?;
    check_weight_views(op, wt, sizes.len(), k, m, recipe)?;
    let b = recipe.block_size;
    let dyq = quantize_blockwise(dy, n, m, [1, b], recipe.grad_format, recipe.pow2_scales)?;
    let problems: Vec<TnProblem<'_>> = wt
        .iter()
        .enumerate()
        .map(|(g, wg)| TnProblem {
            a: Fp8View::row_range(&dyq, offsets[g], offsets[g + 1]),
            b: *wg,
            out_start: offsets[g] * k,
        })
        .collect();
    let mut dx = vec![0f32; n * k];
    grouped_gemm_tn(&problems, &mut dx)?;
    Ok(dx)
}

/// FP8 grouped wgrad: `dW_g = dq(q_col(dy_g))ᵀ · dq(q_col(x_g))` for `dy [N, M]`, `x [N, K]`,
/// both quantised columnwise (`1×b` tiles along each group's tokens, restarting at every
/// group); returns `dW [G, M, K]` (f32), zero for empty groups.
pub fn fp8_grouped_wgrad(
    dy: &[f32],
    m: usize,
    x: &[f32],
    k: usize,
    sizes: &[usize],
    recipe: &Fp8Recipe,
) -> Result<Vec<f32>> {
    let op = "fp8_grouped_wgrad";
    recipe.validate()?;
    let n: usize = sizes.iter().sum();
    check_len(op, "dy", dy.len(), &[n, m])?;
    check_len(op, "x", x.len(), &[n, k])?;
    let offsets = offsets_of(sizes);
    let b = recipe.block_size;
    let pow2 = recipe.pow2_scales;
    let mut quantized = Vec::with_capacity(sizes.len());
    for g in 0..sizes.len() {
        let (r0, r1) = (offsets[g], offsets[g + 1]);
        let dyt =
            quantize_columnwise(&dy[r0 * m..r1 * m], r1 - r0, m, b, recipe.grad_format, pow2)?;
        let xt = quantize_columnwise(
            &x[r0 * k..r1 * k],
            r1 - r0,
            k,
            b,
            recipe.activation_format,
            pow2,
        )?;
        quantized.push((dyt, xt));
    }
    let problems: Vec<TnProblem<'_>> = quantized
        .iter()
        .enumerate()
        .map(|(g, (dyt, xt))| TnProblem {
            a: Fp8View::of(dyt),
            b: Fp8View::of(xt),
            out_start: g * m * k,
        })
        .collect();
    let mut dw = vec![0f32; sizes.len() * m * k];
    grouped_gemm_tn(&problems, &mut dw)?;
    Ok(dw)
}

#[cfg(test)]
mod tests;
