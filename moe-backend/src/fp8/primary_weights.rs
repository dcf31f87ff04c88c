//! FP8 primary weights (docs/fp8.md §Scaling, §FP8 primary weights): a rank owning the flat range
//! `[start, start+len)` of a row-major `[h, w]` weight computes partial per-block amaxes over its
//! elements (BF16-cast, as the model dtype), all-reduces them (MAX) over the optimizer's group,
//! derives every block's scale and quantises only its own elements. The result is bit-identical to
//! quantising the whole BF16-cast weight on one rank, for any shard boundaries.

use burn::tensor::TensorData;

use super::formats::{E4M3_MAX, f32_to_e4m3};
use crate::comm::{Comm, ReduceOp};
use crate::error::{BackendError, Result};

/// The block grid of a weight made of `matrices` stacked `[rows, cols]` matrices (canonical
/// `[out, in]` orientation) with `[b0, b1]` blocks; edge blocks are partial. Scales are laid
/// out `[matrices, ceil(rows/b0), ceil(cols/b1)]`, row-major.
///
/// Flat element indices count the parameter's *storage* order: matrix after matrix, each
/// row-major `[rows, cols]`, or `[cols, rows]` when `transposed` (Burn's `Linear` stores
/// `[in, out]`). A block of the transposed storage is the same set of elements as the
/// canonical block, so the scales and bytes are those of the canonical matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGrid {
    /// Stacked matrices (experts; 1 for a plain weight).
    pub matrices: usize,
    /// Canonical rows `h` of one matrix (`out`).
    pub rows: usize,
    /// Canonical columns `w` of one matrix (`in`).
    pub cols: usize,
    /// Block rows.
    pub b0: usize,
    /// Block columns.
    pub b1: usize,
    /// Whether each matrix is stored `[cols, rows]`.
    pub transposed: bool,
}

impl BlockGrid {
    /// Grid for one row-major `[rows, cols]` weight (blocks must be non-empty).
    pub fn new(rows: usize, cols: usize, block: [usize; 2]) -> Result<Self> {
        Self::stacked(1, rows, cols, block, false)
    }

    /// Grid for `matrices` stacked `[rows, cols]` weights, stored transposed or not.
    pub fn stacked(
        matrices: usize,
        rows: usize,
        cols: usize,
        block: [usize; 2],
        transposed: bool,
    ) -> Result<Self> {
        if block[0] == 0 || block[1] == 0 {
            return Err(BackendError::Config {
                field: "weight_block_size",
                detail: format!("block {block:?} must be non-empty"),
            });
        }
        Ok(Self {
            matrices,
            rows,
            cols,
            b0: block[0],
            b1: block[1],
            transposed,
        })
    }

    /// `[ceil(h/b0), ceil(w/b1)]`, the grid of one matrix.
    pub fn shape(&self) -> [usize; 2] {
        [self.rows.div_ceil(self.b0), self.cols.div_ceil(self.b1)]
    }

    /// Blocks of all matrices (`matrices · ceil(h/b0) · ceil(w/b1)`).
    pub fn num_blocks(&self) -> usize {
        let [gr, gc] = self.shape();
        self.matrices * gr * gc
    }

    /// Elements of all matrices.
    pub fn numel(&self) -> usize {
        self.matrices * self.rows * self.cols
    }

    /// Block index of flat (storage-order) element `i`.
    pub fn block_of(&self, i: usize) -> usize {
        let per = self.rows * self.cols;
        let (m, j) = (i / per, i % per);
        let (r, c) = if self.transposed {
            (j % self.rows, j / self.rows)
        } else {
            (j / self.cols, j % self.cols)
        };
        let [gr, gc] = self.shape();
        m * gr * gc + (r / self.b0) * gc + c / self.b1
    }

    /// Calls `f(offset, len, block)` for the runs of consecutive flat elements
    /// `start..start+len` that share a block, in order (`offset` counts from `start`). A run
    /// never crosses a stored row, so each is a contiguous slice of one block.
    pub fn for_each_run(&self, start: usize, len: usize, mut f: impl FnMut(usize, usize, usize)) {
        let per = self.rows * self.cols;
        if per == 0 {
            return;
        }
        let [gr, gc] = self.shape();
        // Stored rows: canonical rows (`cols` long, blocks every b1) or, transposed, canonical
        // columns (`rows` long, blocks every b0).
        let (inner, step) = if self.transposed {
            (self.rows, self.b0)
        } else {
            (self.cols, self.b1)
        };
        let end = start + len;
        let mut i = start;
        while i < end {
            let (m, j) = (i / per, i % per);
            let (outer, at) = (j / inner, j % inner);
            let run = ((at / step + 1) * step).min(inner) - at;
            let n = run.min(end - i);
            let block = if self.transposed {
                m * gr * gc + (at / self.b0) * gc + outer / self.b1
            } else {
                m * gr * gc + (outer / self.b0) * gc + at / self.b1
            };
            f(i - start, n, block);
            i += n;
        }
    }

    fn check_range(&self, start: usize, len: usize) -> Result<()> {
        if start + len > self.numel() {
            return Err(BackendError::Index {
                op: "fp8 primary weights",
                detail: format!(
                    "range {start}..{} exceeds the {}x{}x{} weight",
                    start + len,
                    self.matrices,
                    self.rows,
                    self.cols
                ),
            });
        }
        Ok(())
    }
}

/// `compute_scale_from_amax` (docs/fp8.md §Scaling): `a = max(amax, eps)`; 1 when `a` is 0, inf or
/// NaN; else `fp8_max / a` (inf → `f32::MAX`), optionally rounded down to a power of two.
pub fn compute_scale_from_amax(amax: f32, fp8_max: f32, pow2: bool, eps: f32) -> f32 {
    let a = amax.max(eps);
    if a == 0.0 || !a.is_finite() {
        return 1.0;
    }
    let mut scale = fp8_max / a;
    if scale.is_infinite() {
        scale = f32::MAX;
    }
    if pow2 {
        scale = if scale.is_normal() {
            // 2^floor(log2(scale)) of a normal float: its exponent bits alone.
            f32::from_bits(scale.to_bits() & 0xFF80_0000)
        } else {
            2f32.powi(scale.log2().floor() as i32)
        };
    }
    scale
}

fn model_dtype(v: f32) -> f32 {
    f32::from_bits(bf16_bits(v))
}

/// The f32 bits of `v` rounded to BF16 (round to nearest even; NaN stays a quiet NaN), as
/// `half::bf16::from_f32`, branch-free so that slice loops vectorise.
#[inline(always)]
fn bf16_bits(v: f32) -> u32 {
    let b = v.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000;
    let nan = (b | 0x0040_0000) & 0xFFFF_0000;
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

/// Per-block amax of the BF16-cast `values` (flat elements `start..start+len`); blocks the
/// range does not touch are 0. Length [`BlockGrid::num_blocks`].
pub fn partial_block_amax(values: &[f32], start: usize, grid: &BlockGrid) -> Result<Vec<f32>> {
    let mut amax = vec![0f32; grid.num_blocks()];
    accumulate_block_amax(values, start, grid, &mut amax)?;
    Ok(amax)
}

/// Folds the BF16-cast amaxes of `values` (flat elements from `start`) into `amax`
/// ([`BlockGrid::num_blocks`] entries; NaN wins, as in the MAX all-reduce).
pub fn accumulate_block_amax(
    values: &[f32],
    start: usize,
    grid: &BlockGrid,
    amax: &mut [f32],
) -> Result<()> {
    grid.check_range(start, values.len())?;
    if amax.len() != grid.num_blocks() {
        return Err(BackendError::Shape {
            op: "accumulate_block_amax",
            detail: format!("{} amaxes for {} blocks", amax.len(), grid.num_blocks()),
        });
    }
    super::blockwise::simd(|| {
        grid.for_each_run(start, values.len(), |at, n, b| {
            // Integer max over the BF16-cast |v| bits: for non-NaN floats the order of the bits
            // is the order of the values, and NaN bits exceed every finite one, so a NaN wins,
            // as the MAX all-reduce would.
            let run = values[at..at + n]
                .iter()
                .map(|&v| bf16_bits(v) & 0x7FFF_FFFF)
                .fold(0u32, u32::max);
            let a = f32::from_bits(run);
            if a > amax[b] || a.is_nan() {
                amax[b] = a;
            }
        });
    });
    Ok(())
}

/// E4M3 bytes of the BF16-cast `values` (flat elements from `start`) with their blocks'
/// `scales`.
pub fn cast_shard_with_scales(
    values: &[f32],
    start: usize,
    grid: &BlockGrid,
    scales: &[f32],
) -> Result<Vec<u8>> {
    grid.check_range(start, values.len())?;
    if scales.len() != grid.num_blocks() {
        return Err(BackendError::Shape {
            op: "cast_shard_with_scales",
            detail: format!("{} scales for {} blocks", scales.len(), grid.num_blocks()),
        });
    }
    let mut out = vec![0u8; values.len()];
    super::blockwise::simd(|| {
        grid.for_each_run(start, values.len(), |at, n, b| {
            let scale = scales[b];
            for (q, &v) in out[at..at + n].iter_mut().zip(&values[at..at + n]) {
                *q = f32_to_e4m3(model_dtype(v) * scale);
            }
        });
    });
    Ok(out)
}

/// docs/fp8.md §FP8 primary weights, steps 2–5, on one rank: partial amax, MAX all-reduce over
/// `group` (every rank of the weight's optimizer group calls this), scales, partial cast. Returns
/// this shard's E4M3 bytes and the full `scale_inv` grid (identical on every rank).
pub fn cast_master_shard(
    group: &Comm,
    values: &[f32],
    start: usize,
    grid: &BlockGrid,
    pow2: bool,
) -> Result<(Vec<u8>, Vec<f32>)> {
    let partial = partial_block_amax(values, start, grid)?;
    let n = partial.len();
    // Host values in, host values out: the amaxes go through the transport as host bytes.
    let amax = if group.size() > 1 {
        group
            .communicator()
            .all_reduce(
                TensorData::new(partial, [n]),
                ReduceOp::Max,
                std::panic::Location::caller(),
            )?
            .try_into_vec::<f32>()
            .map_err(|e| BackendError::Shape {
                op: "cast_master_shard",
                detail: format!("amaxes unreadable: {e:?}"),
            })?
    } else {
        partial
    };
    let scales: Vec<f32> = amax
        .iter()
        .map(|&a| compute_scale_from_amax(a, E4M3_MAX, pow2, 0.0))
        .collect();
    let bytes = cast_shard_with_scales(values, start, grid, &scales)?;
    Ok((bytes, scales.iter().map(|s| 1.0 / s).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::World;
    use crate::testing::SplitMix;

    #[test]
    fn scale_rules() {
        assert_eq!(compute_scale_from_amax(0.0, 448.0, false, 0.0), 1.0);
        assert_eq!(compute_scale_from_amax(f32::NAN, 448.0, false, 0.0), 1.0);
        assert_eq!(compute_scale_from_amax(448.0, 448.0, false, 0.0), 1.0);
        assert_eq!(compute_scale_from_amax(2.0, 448.0, false, 0.0), 224.0);
        assert_eq!(compute_scale_from_amax(2.0, 448.0, true, 0.0), 128.0);
        assert_eq!(compute_scale_from_amax(1e-30, 448.0, false, 0.5), 896.0);
        assert_eq!(compute_scale_from_amax(1e-45, 448.0, false, 0.0), f32::MAX);
    }

    #[test]
    fn bf16_rounding_equals_half_and_runs_tile_the_range() {
        use burn::tensor::bf16;
        let mut rng = SplitMix::new(99);
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
        ];
        let values = specials
            .into_iter()
            .chain([f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001)])
            .chain((0..200_000).map(|_| f32::from_bits(rng.below(u32::MAX as usize) as u32)));
        for v in values {
            let want = bf16::from_f32(v).to_f32();
            let got = model_dtype(v);
            if want.is_nan() {
                assert!(got.is_nan(), "{v:e}");
            } else {
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{v:e} ({:#010x})",
                    v.to_bits()
                );
            }
        }
        // Runs cover every element once, in order, each inside one block, for both storages.
        for transposed in [false, true] {
            let g = BlockGrid::stacked(3, 10, 7, [4, 3], transposed).unwrap();
            for (start, len) in [(0, g.numel()), (5, 97), (69, 1), (13, 0)] {
                let mut next = 0;
                g.for_each_run(start, len, |at, n, b| {
                    assert_eq!(at, next);
                    assert!(n > 0);
                    for i in at..at + n {
                        assert_eq!(g.block_of(start + i), b, "transposed {transposed}");
                    }
                    next += n;
                });
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn one_block_by_hand() {
        // 2x2 weight, one block: amax 4 -> scale 112; 4·112 = 448 = 1.75·2^8 -> 0x7E;
        // 112 = 1.75·2^6 -> exponent 13, mantissa 0b110 -> 0x6E (0xEE negative).
        let grid = BlockGrid::new(2, 2, [128, 128]).unwrap();
        let bytes = cast_shard_with_scales(&[4.0, -1.0, 0.0, 1.0], 0, &grid, &[112.0]).unwrap();
        assert_eq!(bytes, vec![0x7E, 0xEE, 0x00, 0x6E]);
        assert_eq!(
            partial_block_amax(&[4.0, -1.0], 2, &grid).unwrap(),
            vec![4.0]
        );
        assert!(partial_block_amax(&[1.0; 3], 2, &grid).is_err());
    }

    /// A stacked, transposed-storage grid blocks the same elements as the canonical matrices:
    /// casting the storage order gives the canonical bytes transposed, with the same scales.
    #[test]
    fn transposed_and_stacked_storage_block_like_the_canonical_matrices() {
        let (m, h, w) = (2, 20, 36); // canonical [h, w] = [out, in] per matrix
        let mut rng = SplitMix::new(4);
        let canon: Vec<f32> = (0..m * h * w)
            .map(|_| rng.uniform(-3.0, 3.0) as f32)
            .collect();
        let storage: Vec<f32> = (0..m)
            .flat_map(|e| {
                let c = &canon[e * h * w..(e + 1) * h * w];
                (0..w).flat_map(move |i| (0..h).map(move |o| c[o * w + i]))
            })
            .collect();
        let block = [16, 8];
        let g_canon = BlockGrid::stacked(m, h, w, block, false).unwrap();
        let g_store = BlockGrid::stacked(m, h, w, block, true).unwrap();
        assert_eq!(g_canon.num_blocks(), 2 * 2 * 5);
        let amax = partial_block_amax(&canon, 0, &g_canon).unwrap();
        assert_eq!(partial_block_amax(&storage, 0, &g_store).unwrap(), amax);
        let scales: Vec<f32> = amax
            .iter()
            .map(|&a| compute_scale_from_amax(a, 448.0, false, 0.0))
            .collect();
        let q_canon = cast_shard_with_scales(&canon, 0, &g_canon, &scales).unwrap();
        let q_store = cast_shard_with_scales(&storage, 0, &g_store, &scales).unwrap();
        for e in 0..m {
            for o in 0..h {
                for i in 0..w {
                    assert_eq!(
                        q_store[e * h * w + i * h + o],
                        q_canon[e * h * w + o * w + i]
                    );
                }
            }
        }
        // The canonical bytes of each matrix are quantize_blockwise of the BF16-cast matrix.
        let bf: Vec<f32> = canon.iter().map(|&v| model_dtype(v)).collect();
        for e in 0..m {
            let q = crate::fp8::quantize_blockwise(
                &bf[e * h * w..(e + 1) * h * w],
                h,
                w,
                block,
                crate::fp8::Fp8Format::E4M3,
                false,
            )
            .unwrap();
            assert_eq!(q.data, q_canon[e * h * w..(e + 1) * h * w]);
        }
    }

    /// The property of docs/fp8.md §FP8 primary weights: sharded cast == unsharded cast, bit for
    /// bit, for any boundaries (equal DistOpt shards cutting through blocks, and random ones), with
    /// partial edge blocks.
    #[test]
    fn sharded_master_cast_equals_the_unsharded_cast() {
        let (h, w) = (130, 260); // 2 x 3 grid of 128-blocks, partial on both edges
        let grid = BlockGrid::new(h, w, [128, 128]).unwrap();
        let mut rng = SplitMix::new(21);
        let mut master: Vec<f32> = (0..h * w).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
        master[5] = 37.0; // an outlier in block (0, 0)
        master[h * w - 1] = -0.002; // the last block is tiny
        for pow2 in [false, true] {
            let amax = partial_block_amax(&master, 0, &grid).unwrap();
            let scales: Vec<f32> = amax
                .iter()
                .map(|&a| compute_scale_from_amax(a, 448.0, pow2, 0.0))
                .collect();
            let expected = cast_shard_with_scales(&master, 0, &grid, &scales).unwrap();
            let inv: Vec<f32> = scales.iter().map(|s| 1.0 / s).collect();
            for n in 1..=5usize {
                // Equal DistOpt shards of the padded buffer, then random cut points.
                let size = (h * w).div_ceil(n);
                let equal: Vec<usize> = (0..=n).map(|i| (i * size).min(h * w)).collect();
                let mut cuts: Vec<usize> = (0..n - 1).map(|_| rng.below(h * w)).collect();
                cuts.extend([0, h * w]);
                cuts.sort_unstable();
                for bounds in [equal, cuts] {
                    let (m, b) = (&master, &bounds);
                    let out = World::run(n, |ctx| {
                        let r = ctx.rank();
                        let shard = &m[b[r]..b[r + 1]];
                        cast_master_shard(&ctx.world()?, shard, b[r], &grid, pow2)
                    });
                    let mut bytes = Vec::new();
                    for res in out {
                        let (q, s) = res.unwrap();
                        assert_eq!(s, inv, "scale_inv grids differ (n = {n})");
                        bytes.extend(q);
                    }
                    assert_eq!(bytes, expected, "n = {n}, bounds {bounds:?}, pow2 {pow2}");
                }
            }
        }
    }
}
