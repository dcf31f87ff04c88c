//! FP8 primary weights (fp8.md §2, §4): a rank owning the flat range `[start, start+len)` of a
//! row-major `[h, w]` weight computes partial per-block amaxes over its elements (BF16-cast,
//! as the model dtype), all-reduces them (MAX) over the optimizer's group, derives every
//! block's scale and quantises only its own elements. The result is bit-identical to
//! quantising the whole BF16-cast weight on one rank, for any shard boundaries.

use burn::tensor::{DType, Device, Tensor, TensorData, bf16};

use super::formats::{E4M3_MAX, f32_to_e4m3};
use crate::comm::{Comm, ReduceOp};
use crate::error::{BackendError, Result};

/// The block grid of a `[rows, cols]` weight with `[b0, b1]` blocks (edge blocks partial).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGrid {
    /// Weight rows `h`.
    pub rows: usize,
    /// Weight columns `w`.
    pub cols: usize,
    /// Block rows.
    pub b0: usize,
    /// Block columns.
    pub b1: usize,
}

impl BlockGrid {
    /// Grid for a weight and block size (blocks must be non-empty).
    pub fn new(rows: usize, cols: usize, block: [usize; 2]) -> Result<Self> {
        if block[0] == 0 || block[1] == 0 {
            return Err(BackendError::Config {
                field: "weight_block_size",
                detail: format!("block {block:?} must be non-empty"),
            });
        }
        Ok(Self {
            rows,
            cols,
            b0: block[0],
            b1: block[1],
        })
    }

    /// `[ceil(h/b0), ceil(w/b1)]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.rows.div_ceil(self.b0), self.cols.div_ceil(self.b1)]
    }

    /// Block index of flat element `i`.
    fn block_of(&self, i: usize) -> usize {
        let (r, c) = (i / self.cols, i % self.cols);
        (r / self.b0) * self.shape()[1] + c / self.b1
    }

    fn check_range(&self, start: usize, len: usize) -> Result<()> {
        if start + len > self.rows * self.cols {
            return Err(BackendError::Index {
                op: "fp8 primary weights",
                detail: format!(
                    "range {start}..{} exceeds the {}x{} weight",
                    start + len,
                    self.rows,
                    self.cols
                ),
            });
        }
        Ok(())
    }
}

/// `compute_scale_from_amax` (fp8.md §2): `a = max(amax, eps)`; 1 when `a` is 0, inf or NaN;
/// else `fp8_max / a` (inf → `f32::MAX`), optionally rounded down to a power of two.
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
        scale = 2f32.powi(scale.log2().floor() as i32);
    }
    scale
}

fn model_dtype(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// Per-block amax of the BF16-cast `values` (flat elements `start..start+len`); blocks the
/// range does not touch are 0. Length `grid.shape()[0] · grid.shape()[1]`.
pub fn partial_block_amax(values: &[f32], start: usize, grid: &BlockGrid) -> Result<Vec<f32>> {
    grid.check_range(start, values.len())?;
    let [gr, gc] = grid.shape();
    let mut amax = vec![0f32; gr * gc];
    for (i, &v) in values.iter().enumerate() {
        let b = grid.block_of(start + i);
        let a = model_dtype(v).abs();
        if a > amax[b] || a.is_nan() {
            amax[b] = a;
        }
    }
    Ok(amax)
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
    let [gr, gc] = grid.shape();
    if scales.len() != gr * gc {
        return Err(BackendError::Shape {
            op: "cast_shard_with_scales",
            detail: format!("{} scales for a {gr}x{gc} block grid", scales.len()),
        });
    }
    Ok(values
        .iter()
        .enumerate()
        .map(|(i, &v)| f32_to_e4m3(model_dtype(v) * scales[grid.block_of(start + i)]))
        .collect())
}

/// Steps 2–5 of fp8.md §4 on one rank: partial amax, MAX all-reduce over `group` (every rank
/// of the weight's optimizer group calls this), scales, partial cast. Returns this shard's
/// E4M3 bytes and the full `scale_inv` grid (identical on every rank).
pub fn cast_master_shard(
    group: &Comm,
    values: &[f32],
    start: usize,
    grid: &BlockGrid,
    pow2: bool,
) -> Result<(Vec<u8>, Vec<f32>)> {
    let partial = partial_block_amax(values, start, grid)?;
    let n = partial.len();
    let t = Tensor::<1>::from_data(TensorData::new(partial, [n]), (&Device::flex(), DType::F32));
    let amax = group
        .all_reduce(t, ReduceOp::Max)?
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| BackendError::Shape {
            op: "cast_master_shard",
            detail: format!("amaxes unreadable: {e:?}"),
        })?;
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

    /// fp8.md §4 property: sharded cast == unsharded cast, bit for bit, for any boundaries
    /// (equal DistOpt shards cutting through blocks, and random ones), with partial edge blocks.
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
