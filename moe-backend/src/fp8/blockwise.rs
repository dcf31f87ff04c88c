//! Scaled FP8 quantisation of row-major matrices (docs/fp8.md §Scaling, §Recipes): per-tensor
//! current scaling and blockwise scaling with any block shape (weights `128×128`, activations and
//! gradients `1×128` along the GEMM reduction dimension), with partial edge blocks and optional
//! power-of-two scales.
//!
//! Per block: `amax = max |x|` (NaN elements are ignored; they encode to NaN),
//! `scale = compute_scale_from_amax(amax, fp8_max, pow2, 0)`, `q = encode(x · scale)`,
//! stored `scale_inv = 1 / scale`; dequantisation is `x̂ = decode(q) · scale_inv`.
//!
//! The quantisers are fused (one read pass for the amaxes, one for the casts, per strip of
//! block rows while the strip is cache resident) and parallel over strips with rayon; no
//! per-element allocation.

use rayon::prelude::*;

/// Runs `f` compiled for the best instruction set of this CPU (AVX-512 / AVX2 through `pulp`),
/// so the codec loops below vectorise; the workspace is built for baseline x86-64.
#[inline(always)]
pub(crate) fn simd<R>(f: impl FnOnce() -> R) -> R {
    pulp::Arch::new().dispatch(f)
}

use super::formats::{Fp8Format, f32_to_e4m3, f32_to_e5m2};
use super::primary_weights::compute_scale_from_amax;
use crate::error::{BackendError, Result};

/// A blockwise-quantised row-major `[rows, cols]` matrix: FP8 bytes plus one f32 `scale_inv`
/// per block (`[ceil(rows/b0), ceil(cols/b1)]`, row-major).
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Blocks {
    /// Element format of `data`.
    pub format: Fp8Format,
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix.
    pub cols: usize,
    /// Block shape `[b0, b1]` (both ≥ 1; a per-tensor scale is one block covering everything).
    pub block: [usize; 2],
    /// `[rows, cols]` FP8 codes.
    pub data: Vec<u8>,
    /// `[ceil(rows/b0), ceil(cols/b1)]` dequantisation multipliers.
    pub scale_inv: Vec<f32>,
}

impl Fp8Blocks {
    /// `[ceil(rows/b0), ceil(cols/b1)]`.
    pub fn grid(&self) -> [usize; 2] {
        [
            self.rows.div_ceil(self.block[0]),
            self.cols.div_ceil(self.block[1]),
        ]
    }

    /// Bytes held (FP8 data + f32 scales).
    pub fn nbytes(&self) -> usize {
        self.data.len() + 4 * self.scale_inv.len()
    }

    /// Dequantises into `out` (`rows · cols` elements): `out = decode(q) · scale_inv`.
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<()> {
        if out.len() != self.data.len() {
            return Err(BackendError::Shape {
                op: "Fp8Blocks::dequantize_into",
                detail: format!("{} outputs for {} elements", out.len(), self.data.len()),
            });
        }
        let (cols, [b0, b1], gc) = (self.cols, self.block, self.grid()[1]);
        if out.is_empty() {
            return Ok(());
        }
        let format = self.format;
        let strip = b0 * cols;
        out.par_chunks_mut(strip)
            .zip(self.data.par_chunks(strip))
            .zip(self.scale_inv.par_chunks(gc))
            .with_min_len(min_strips_per_task(strip))
            .for_each(|((out, q), s)| {
                simd(|| {
                    for (out_row, q_row) in out.chunks_exact_mut(cols).zip(q.chunks_exact(cols)) {
                        for ((o, q), &s) in out_row.chunks_mut(b1).zip(q_row.chunks(b1)).zip(s) {
                            decode_scaled(format, q, s, o);
                        }
                    }
                })
            });
        Ok(())
    }

    /// The dequantised matrix.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.data.len()];
        // Lengths match by construction.
        let _ = self.dequantize_into(&mut out);
        out
    }

    /// The transposed matrix `[cols, rows]` with block `[b1, b0]`: bytes and scale grid
    /// transposed, no requantisation (a block's elements and scale are the same either way).
    /// This is the FP8 "columnwise" weight copy the backward GEMM reads (docs/fp8.md §Recipes).
    pub fn transpose(&self) -> Self {
        transpose_blocks(
            self.format,
            &self.data,
            &self.scale_inv,
            self.rows,
            self.cols,
            self.block,
        )
    }
}

/// [`Fp8Blocks::transpose`] of the borrowed row-major `[rows, cols]` codes `data` with block
/// `block` and its `scale_inv` grid: the `[cols, rows]` matrix with block `[b1, b0]`.
pub(crate) fn transpose_blocks(
    format: Fp8Format,
    data: &[u8],
    scale_inv: &[f32],
    rows: usize,
    cols: usize,
    block: [usize; 2],
) -> Fp8Blocks {
    let (r, c) = (rows, cols);
    let (gr, gc) = (r.div_ceil(block[0]), c.div_ceil(block[1]));
    let mut out_data = vec![0u8; r * c];
    const T: usize = 64;
    if r > 0 && c > 0 {
        out_data
            .par_chunks_mut(T * r)
            .enumerate()
            .for_each(|(jb, out)| {
                let j0 = jb * T;
                for i0 in (0..r).step_by(T) {
                    for j in j0..(j0 + T).min(c) {
                        for i in i0..(i0 + T).min(r) {
                            out[(j - j0) * r + i] = data[i * c + j];
                        }
                    }
                }
            });
    }
    Fp8Blocks {
        format,
        rows: c,
        cols: r,
        block: [block[1], block[0]],
        data: out_data,
        scale_inv: transpose_grid(scale_inv, gr, gc),
    }
}

/// The row-major `[gc, gr]` transpose of a row-major `[gr, gc]` scale grid.
pub(crate) fn transpose_grid(scale_inv: &[f32], gr: usize, gc: usize) -> Vec<f32> {
    let mut out = vec![0f32; gr * gc];
    for i in 0..gr {
        for j in 0..gc {
            out[j * gr + i] = scale_inv[i * gc + j];
        }
    }
    out
}

/// Strips per rayon task so that every task handles at least ~64 KiB of input.
fn min_strips_per_task(strip_elems: usize) -> usize {
    (16 * 1024 / strip_elems.max(1)).max(1)
}

fn check_shape(op: &'static str, len: usize, rows: usize, cols: usize) -> Result<()> {
    if rows.checked_mul(cols) != Some(len) {
        return Err(BackendError::Shape {
            op,
            detail: format!("{len} values for a {rows}x{cols} matrix"),
        });
    }
    Ok(())
}

fn check_block(op: &'static str, block: [usize; 2]) -> Result<()> {
    if block.contains(&0) {
        return Err(BackendError::Config {
            field: "block",
            detail: format!("{op}: block {block:?} must be non-empty"),
        });
    }
    Ok(())
}

/// Casts `x · scale` elementwise into `q` with `format`'s encoder (monomorphised per format so
/// the inner loop inlines the encoder).
#[inline(always)]
fn encode_scaled(format: Fp8Format, x: &[f32], scale: f32, q: &mut [u8]) {
    match format {
        Fp8Format::E4M3 => {
            for (q, &x) in q.iter_mut().zip(x) {
                *q = f32_to_e4m3(x * scale);
            }
        }
        Fp8Format::E5M2 => {
            for (q, &x) in q.iter_mut().zip(x) {
                *q = f32_to_e5m2(x * scale);
            }
        }
    }
}

/// `out = decode(q) · s` elementwise, by table lookup (measured faster than decoding the bits
/// arithmetically, with AVX-512 too).
#[inline(always)]
pub(crate) fn decode_scaled(format: Fp8Format, q: &[u8], s: f32, out: &mut [f32]) {
    let table = format.decode_table();
    for (o, &q) in out.iter_mut().zip(q) {
        *o = table[q as usize] * s;
    }
}

/// `max |x|` ignoring NaN. For non-NaN floats the order of `|x|` equals the order of their
/// bit patterns as integers, so the reduction is an integer max over masked bits (NaNs mapped
/// to 0), which vectorises, exactly.
#[inline(always)]
fn abs_max(x: &[f32]) -> f32 {
    const LANES: usize = 16;
    let key = |v: &f32| {
        let a = v.to_bits() & 0x7FFF_FFFF;
        if a > 0x7F80_0000 { 0 } else { a }
    };
    let mut acc = [0u32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a = (*a).max(key(v));
        }
    }
    let tail = chunks.remainder().iter().map(key).max().unwrap_or(0);
    f32::from_bits(acc.into_iter().max().unwrap_or(0).max(tail))
}

/// Blockwise quantisation of a row-major `[rows, cols]` matrix with `[b0, b1]` blocks (edge
/// blocks partial), scales from each block's amax (docs/fp8.md §Scaling), optionally powers of two.
pub fn quantize_blockwise(
    values: &[f32],
    rows: usize,
    cols: usize,
    block: [usize; 2],
    format: Fp8Format,
    pow2: bool,
) -> Result<Fp8Blocks> {
    check_shape("quantize_blockwise", values.len(), rows, cols)?;
    check_block("quantize_blockwise", block)?;
    let [b0, b1] = block;
    let (gr, gc) = (rows.div_ceil(b0), cols.div_ceil(b1));
    let mut data = vec![0u8; rows * cols];
    let mut scale_inv = vec![0f32; gr * gc];
    if data.is_empty() {
        return Ok(Fp8Blocks {
            format,
            rows,
            cols,
            block,
            data,
            scale_inv,
        });
    }
    let fmax = format.max();
    let strip = b0 * cols;
    data.par_chunks_mut(strip)
        .zip(values.par_chunks(strip))
        .zip(scale_inv.par_chunks_mut(gc))
        .with_min_len(min_strips_per_task(strip))
        .for_each_init(
            || vec![0f32; gc],
            |scales, ((q, x), s)| {
                simd(|| {
                    // Pass 1: amax of every block of this strip (accumulated in `s`).
                    s.fill(0.0);
                    for row in x.chunks_exact(cols) {
                        for (a, blk) in s.iter_mut().zip(row.chunks(b1)) {
                            *a = a.max(abs_max(blk));
                        }
                    }
                    for (scale, s) in scales.iter_mut().zip(s.iter_mut()) {
                        *scale = compute_scale_from_amax(*s, fmax, pow2, 0.0);
                        *s = 1.0 / *scale;
                    }
                    // Pass 2: cast with the block's scale.
                    for (q_row, x_row) in q.chunks_exact_mut(cols).zip(x.chunks_exact(cols)) {
                        for ((q, x), &scale) in
                            q_row.chunks_mut(b1).zip(x_row.chunks(b1)).zip(&*scales)
                        {
                            encode_scaled(format, x, scale, q);
                        }
                    }
                })
            },
        );
    Ok(Fp8Blocks {
        format,
        rows,
        cols,
        block,
        data,
        scale_inv,
    })
}

/// Per-tensor current scaling (docs/fp8.md §Recipes): one scale from the live amax of the whole
/// tensor. Returned as a single block covering the matrix.
pub fn quantize_per_tensor(
    values: &[f32],
    rows: usize,
    cols: usize,
    format: Fp8Format,
    pow2: bool,
) -> Result<Fp8Blocks> {
    check_shape("quantize_per_tensor", values.len(), rows, cols)?;
    let amax = values
        .par_chunks(64 * 1024)
        .map(|x| simd(|| abs_max(x)))
        .reduce(|| 0.0, f32::max);
    let scale = compute_scale_from_amax(amax, format.max(), pow2, 0.0);
    let mut data = vec![0u8; values.len()];
    data.par_chunks_mut(64 * 1024)
        .zip(values.par_chunks(64 * 1024))
        .for_each(|(q, x)| simd(|| encode_scaled(format, x, scale, q)));
    Ok(Fp8Blocks {
        format,
        rows,
        cols,
        block: [rows.max(1), cols.max(1)],
        data,
        scale_inv: if values.is_empty() {
            Vec::new()
        } else {
            vec![1.0 / scale]
        },
    })
}

/// Fused cast + transpose for the wgrad operands (docs/fp8.md §Recipes: the columnwise copy):
/// quantises the columns of a row-major `[rows, cols]` matrix in tiles of `tile` consecutive rows
/// and returns the transposed matrix `[cols, rows]` with `[1, tile]` blocks, i.e. `1×tile` tiles
/// along `rows` (the token dimension, the reduction dimension of wgrad).
pub fn quantize_columnwise(
    values: &[f32],
    rows: usize,
    cols: usize,
    tile: usize,
    format: Fp8Format,
    pow2: bool,
) -> Result<Fp8Blocks> {
    check_shape("quantize_columnwise", values.len(), rows, cols)?;
    check_block("quantize_columnwise", [1, tile])?;
    let gt = rows.div_ceil(tile);
    let mut data = vec![0u8; rows * cols];
    let mut scale_inv = vec![0f32; cols * gt];
    if !data.is_empty() {
        let fmax = format.max();
        // Every strip of `tile` rows produces its [cols, len] transposed bytes and `cols`
        // scales; they are then written to their column ranges of the output rows.
        let strips: Vec<(Vec<u8>, Vec<f32>)> = values
            .par_chunks(tile * cols)
            .map(|x| {
                simd(|| {
                    let len = x.len() / cols;
                    let mut amax = vec![0f32; cols];
                    for row in x.chunks_exact(cols) {
                        for (a, v) in amax.iter_mut().zip(row) {
                            *a = a.max(v.abs());
                        }
                    }
                    let scales: Vec<f32> = amax
                        .iter()
                        .map(|&a| compute_scale_from_amax(a, fmax, pow2, 0.0))
                        .collect();
                    let mut q = vec![0u8; cols * len];
                    for (r, row) in x.chunks_exact(cols).enumerate() {
                        for (c, (&v, &s)) in row.iter().zip(&scales).enumerate() {
                            q[c * len + r] = format.encode(v * s);
                        }
                    }
                    (q, scales.iter().map(|s| 1.0 / s).collect::<Vec<f32>>())
                })
            })
            .collect();
        for (t, (q, s)) in strips.iter().enumerate() {
            let (r0, len) = (t * tile, q.len() / cols);
            for c in 0..cols {
                data[c * rows + r0..c * rows + r0 + len]
                    .copy_from_slice(&q[c * len..(c + 1) * len]);
                scale_inv[c * gt + t] = s[c];
            }
        }
    }
    Ok(Fp8Blocks {
        format,
        rows: cols,
        cols: rows,
        block: [1, tile],
        data,
        scale_inv,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::SplitMix;

    /// Independent fake-quant reference: per-block amax by a plain loop, scale by the
    /// formula (docs/fp8.md §Scaling), encode/decode with the `float8` crate.
    fn reference(
        values: &[f32],
        rows: usize,
        cols: usize,
        block: [usize; 2],
        pow2: bool,
    ) -> Vec<f32> {
        let [b0, b1] = block;
        let mut out = vec![0f32; values.len()];
        for bi in 0..rows.div_ceil(b0) {
            for bj in 0..cols.div_ceil(b1) {
                let cells: Vec<usize> = (bi * b0..((bi + 1) * b0).min(rows))
                    .flat_map(|i| (bj * b1..((bj + 1) * b1).min(cols)).map(move |j| i * cols + j))
                    .collect();
                let amax = cells.iter().map(|&k| values[k].abs()).fold(0f32, f32::max);
                let mut scale = if amax == 0.0 { 1.0 } else { 448.0 / amax };
                if pow2 {
                    scale = 2f32.powi(scale.log2().floor() as i32);
                }
                for &k in &cells {
                    let q = float8::F8E4M3::from_f32(values[k] * scale);
                    out[k] = q.to_f32() * (1.0 / scale);
                }
            }
        }
        out
    }

    /// Normal-ish data (sum of uniforms) with rare 1000x outliers (every 40009th element, so
    /// some 128x128 blocks hold one and others none).
    fn data_with_outliers(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix::new(seed);
        (0..n)
            .map(|i| {
                let v = (0..4).map(|_| rng.uniform(-1.0, 1.0)).sum::<f64>() as f32;
                if i % 40_009 == 13 { v * 1000.0 } else { v }
            })
            .collect()
    }

    #[test]
    fn blockwise_equals_the_reference_with_partial_edge_blocks() {
        let (rows, cols) = (130, 300); // 2 x 3 grid of 128-blocks, partial on both edges
        let x = data_with_outliers(rows * cols, 3);
        for block in [[128, 128], [1, 128], [1, 32], [16, 7], [rows, cols]] {
            for pow2 in [false, true] {
                let q = quantize_blockwise(&x, rows, cols, block, Fp8Format::E4M3, pow2).unwrap();
                assert_eq!(q.grid(), [rows.div_ceil(block[0]), cols.div_ceil(block[1])]);
                assert_eq!(q.scale_inv.len(), q.grid()[0] * q.grid()[1]);
                let expect = reference(&x, rows, cols, block, pow2);
                assert_eq!(q.dequantize(), expect, "block {block:?} pow2 {pow2}");
            }
        }
    }

    /// `|x − x̂| ≤ 2⁻⁴·|x|·(1 + 2⁻²⁰) + 2⁻¹⁰·scale_inv` per element: half an E4M3 ulp in the
    /// normal range (3 mantissa bits), half the subnormal step 2⁻⁹ (scaled back) below it,
    /// plus the f32 rounding of `x · scale`. E5M2: 2⁻³ and 2⁻¹⁷. A block's outlier only
    /// coarsens its own block: elsewhere the rms relative error stays below 2⁻⁴.
    #[test]
    fn quantize_dequantize_error_bounds_hold_on_data_with_outliers() {
        let (rows, cols) = (256, 384);
        let x = data_with_outliers(rows * cols, 11);
        for (format, rel, sub) in [
            (Fp8Format::E4M3, 2f32.powi(-4), 2f32.powi(-10)),
            (Fp8Format::E5M2, 2f32.powi(-3), 2f32.powi(-17)),
        ] {
            for (block, pow2) in [([128, 128], true), ([1, 128], false), ([1, 128], true)] {
                let q = quantize_blockwise(&x, rows, cols, block, format, pow2).unwrap();
                let xh = q.dequantize();
                let gc = q.grid()[1];
                let (mut err2, mut ref2) = (0f64, 0f64);
                for (k, (&v, &d)) in x.iter().zip(&xh).enumerate() {
                    let (i, j) = (k / cols, k % cols);
                    let b = (i / block[0]) * gc + j / block[1];
                    let s_inv = q.scale_inv[b];
                    let bound = rel * v.abs() * (1.0 + 2f32.powi(-20)) + sub * s_inv;
                    assert!(
                        (v - d).abs() <= bound,
                        "{format:?} {block:?} ({i},{j}): {v} -> {d}"
                    );
                    // Blocks whose amax is an ordinary value (no outlier inside).
                    if s_inv * format.max() < 10.0 {
                        err2 += f64::from(v - d).powi(2);
                        ref2 += f64::from(v).powi(2);
                    }
                }
                assert!(ref2 > 0.0);
                assert!(
                    (err2 / ref2).sqrt() < f64::from(rel),
                    "{format:?} {block:?}"
                );
            }
        }
    }

    #[test]
    fn per_tensor_current_scaling_and_columnwise_copies() {
        let (rows, cols) = (200, 70);
        let x = data_with_outliers(rows * cols, 5);
        let q = quantize_per_tensor(&x, rows, cols, Fp8Format::E4M3, false).unwrap();
        assert_eq!(q.scale_inv.len(), 1);
        assert_eq!(
            q.dequantize(),
            reference(&x, rows, cols, [rows, cols], false)
        );
        // Columnwise 1x128 tiles along rows == blockwise [128, 1] on x, transposed.
        let col = quantize_columnwise(&x, rows, cols, 128, Fp8Format::E4M3, true).unwrap();
        assert_eq!((col.rows, col.cols, col.block), (cols, rows, [1, 128]));
        let by_blocks =
            quantize_blockwise(&x, rows, cols, [128, 1], Fp8Format::E4M3, true).unwrap();
        assert_eq!(col, by_blocks.transpose());
        let expect = reference(&x, rows, cols, [128, 1], true);
        let got = col.dequantize();
        for i in 0..rows {
            for j in 0..cols {
                assert_eq!(got[j * rows + i], expect[i * cols + j]);
            }
        }
        // Transpose twice is the identity.
        let w = quantize_blockwise(&x, rows, cols, [128, 128], Fp8Format::E4M3, true).unwrap();
        assert_eq!(w.transpose().transpose(), w);
    }

    #[test]
    fn zero_blocks_get_unit_scale_and_bad_input_is_rejected() {
        let q = quantize_blockwise(&[0.0; 6], 2, 3, [1, 2], Fp8Format::E4M3, true).unwrap();
        assert!(q.scale_inv.iter().all(|&s| s == 1.0));
        assert!(q.data.iter().all(|&b| b == 0));
        assert!(quantize_blockwise(&[0.0; 5], 2, 3, [1, 2], Fp8Format::E4M3, true).is_err());
        assert!(quantize_blockwise(&[0.0; 6], 2, 3, [0, 2], Fp8Format::E4M3, true).is_err());
        let empty = quantize_blockwise(&[], 0, 5, [1, 128], Fp8Format::E4M3, true).unwrap();
        assert!(empty.data.is_empty() && empty.scale_inv.is_empty());
        assert!(q.dequantize_into(&mut [0.0; 5]).is_err());
    }
}
