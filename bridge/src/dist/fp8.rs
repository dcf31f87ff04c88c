//! FP8 weights in distributed checkpoints (docs/checkpoints.md §Distributed checkpoint format,
//! docs/fp8.md §FP8 checkpoints): a blockwise-quantised weight is stored as its FP8 bytes
//! (`F8_E4M3` chunks, sharded like any parameter) beside a companion tensor `<fqn>_scale_inv` (kind
//! [`TensorKind::Scale`]) holding one dequantisation multiplier per block, shaped
//! `[.., ceil(rows/b0), ceil(cols/b1)]` over the weight's last two dimensions, with the block
//! `[b0, b1]` of the index's `fp8` record.
//!
//! The bytes are never re-quantised: HF FP8 → distributed → (any resharding) → HF FP8 moves the
//! release bytes and scales unchanged. Readers that need values dequantise a box on the fly
//! ([`DistCheckpoint::read_box_dequantized`]): `W = decode(Q) · S[i / b0, j / b1]` in f32,
//! rounded once to the output dtype, with block indices in global coordinates, so any box of any
//! layout decodes exactly like the whole tensor.

use moe_backend::fp8::BlockGrid;
use moe_backend::optim::{Fp8Weight, ParamPlacement};

use super::index::{DcpIndex, TensorEntry, TensorKind};
use super::load::DistCheckpoint;
use super::region::TensorBox;
use super::sharding::ShardingPlan;
use crate::BridgeError;
use crate::fp8::{OutDtype, SCALE_INV_SUFFIX, scale_inv_name, scale_shape};
use crate::safetensors::{Dtype, OwnedTensor};

/// The companion scale fqn of an FP8 weight (`<fqn>_scale_inv`).
pub fn scale_fqn(fqn: &str) -> String {
    scale_inv_name(fqn)
}

/// The weight fqn a scale fqn belongs to.
pub fn weight_of_scale(fqn: &str) -> Option<&str> {
    fqn.strip_suffix(SCALE_INV_SUFFIX)
}

/// Whether `entry` (of `index`) is an FP8 weight with a stored scale.
pub fn is_fp8_weight(index: &DcpIndex, fqn: &str, entry: &TensorEntry) -> bool {
    entry.dtype.size() == 1
        && entry.kind != TensorKind::Scale
        && index
            .tensors
            .get(&scale_fqn(fqn))
            .is_some_and(|s| s.kind == TensorKind::Scale)
}

/// Coverage checks (as docs/checkpoints.md §Distributed checkpoint validation) of the FP8 entries
/// of `index`: every FP8 parameter has its scale (its bytes alone would read as unscaled values),
/// every scale belongs to a one-byte weight, the index has an `fp8` record, and each scale has the
/// block-grid shape of its weight.
pub fn validate_fp8(dir: &std::path::Path, index: &DcpIndex) -> Result<(), BridgeError> {
    let invalid = |reason: String| BridgeError::InvalidDistIndex {
        path: dir.to_path_buf(),
        reason,
    };
    for (fqn, entry) in &index.tensors {
        let model_tensor = matches!(entry.kind, TensorKind::Param | TensorKind::Buffer);
        if model_tensor
            && matches!(entry.dtype, Dtype::F8E4M3 | Dtype::F8E5M2)
            && !index.tensors.contains_key(&scale_fqn(fqn))
        {
            return Err(invalid(format!(
                "`{fqn}` is stored as {} without its block scales `{}`",
                entry.dtype,
                scale_fqn(fqn)
            )));
        }
        if entry.kind != TensorKind::Scale {
            continue;
        }
        let weight = weight_of_scale(fqn)
            .and_then(|w| index.tensors.get(w).map(|e| (w, e)))
            .ok_or_else(|| invalid(format!("scale `{fqn}` has no weight tensor")))?;
        let (wname, wentry) = weight;
        if wentry.dtype.size() != 1 {
            return Err(invalid(format!(
                "scale `{fqn}` belongs to `{wname}`, which is {} (not an FP8 tensor)",
                wentry.dtype
            )));
        }
        if !matches!(entry.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(invalid(format!("scale `{fqn}` is {}", entry.dtype)));
        }
        let record = index.fp8.as_ref().ok_or_else(|| {
            invalid(format!(
                "`{wname}` is stored in FP8 with scales but the index has no `fp8` record"
            ))
        })?;
        let block = record.weight_block_size;
        if block.contains(&0) {
            return Err(invalid(format!(
                "fp8.weight_block_size {block:?} has a zero"
            )));
        }
        let expected = scale_shape(&wentry.global_shape, block).ok_or_else(|| {
            invalid(format!(
                "FP8 weight `{wname}` {:?} has rank < 2",
                wentry.global_shape
            ))
        })?;
        if entry.global_shape != expected {
            return Err(invalid(format!(
                "scale `{fqn}` has shape {:?}, expected {expected:?} for `{wname}` {:?} in \
                 {block:?} blocks",
                entry.global_shape, wentry.global_shape
            )));
        }
    }
    Ok(())
}

/// The box of the scale grid covering `request` (a box of a weight) with `block`.
pub fn scale_box(request: &TensorBox, block: [usize; 2]) -> Option<TensorBox> {
    let r = request.offsets.len();
    if r < 2 {
        return None;
    }
    let mut offsets = request.offsets.clone();
    let mut shape = request.shape.clone();
    for (d, b) in [(r - 2, block[0]), (r - 1, block[1])] {
        let (lo, len) = (request.offsets[d], request.shape[d]);
        offsets[d] = lo / b;
        shape[d] = if len == 0 {
            0
        } else {
            (lo + len - 1) / b + 1 - lo / b
        };
    }
    Some(TensorBox::new(offsets, shape))
}

/// Why the box `pl` of a parameter blocked by `grid` does not map onto whole blocks of its
/// canonical tensor, if it does not: the box must start on a block boundary in the last two
/// dimensions, and a stacked gate/up pair (`[L, 2, F, H]` stored as `[L, 2F, H]`) must split
/// on a block boundary.
fn misalignment(offsets: &[usize], shape: &[usize], grid: &BlockGrid) -> Option<String> {
    let r = offsets.len();
    if r < 2 || shape.len() != r {
        return Some(format!("a rank-{r} box cannot hold FP8 blocks"));
    }
    let (b0, b1) = (grid.b0, grid.b1);
    if !offsets[r - 2].is_multiple_of(b0) || !offsets[r - 1].is_multiple_of(b1) {
        return Some(format!(
            "the box at {offsets:?} does not start on a {b0}x{b1} block boundary"
        ));
    }
    if grid.rows != shape[r - 2] && !shape[r - 2].is_multiple_of(b0) {
        return Some(format!(
            "stacked matrices of {} rows are not whole {b0}-row blocks",
            shape[r - 2]
        ));
    }
    None
}

/// The FP8 chunks a rank saves for its FP8 primary weight `w` placed at `pl`: the codes in
/// canonical order (the box of the weight) and the scale box with its values.
pub fn fp8_chunks(
    pl: &ParamPlacement,
    w: &Fp8Weight,
) -> Result<(Vec<u8>, TensorBox, Vec<f32>), BridgeError> {
    let fail = |reason: String| BridgeError::Sharding {
        tensor: pl.fqn.clone(),
        reason: format!("FP8 primary weight: {reason}"),
    };
    if let Some(why) = misalignment(&pl.offsets, &pl.shape, &w.grid) {
        return Err(fail(why));
    }
    let b = TensorBox::new(pl.offsets.clone(), pl.shape.clone());
    let sbox = scale_box(&b, [w.grid.b0, w.grid.b1]).ok_or_else(|| fail("rank < 2".into()))?;
    let bytes = w.canonical_data();
    if bytes.len() != b.numel() || sbox.numel() != w.scale_inv.len() {
        return Err(fail(format!(
            "{} codes / {} scales for a box of {:?} (scales {:?})",
            bytes.len(),
            w.scale_inv.len(),
            b.shape,
            sbox.shape
        )));
    }
    Ok((bytes, sbox, w.scale_inv.clone()))
}

/// Whether every rank's box of FP8 parameter `fqn` (global shape `global`) under `plan` maps
/// onto whole blocks of `grid`'s size, so the stored FP8 bytes and scales can be adopted as
/// they are. Independent of the calling rank, so all ranks decide alike.
pub fn every_box_aligned(
    plan: &ShardingPlan,
    fqn: &str,
    global: &[usize],
    grid: &BlockGrid,
) -> Result<bool, BridgeError> {
    for rank in 0..plan.layout().world {
        if let Some(shard) = plan.rank_shard(fqn, global, rank)?
            && misalignment(&shard.tensor_box.offsets, &shard.tensor_box.shape, grid).is_some()
        {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The FP8 weight of a rank's parameter at `pl` (blocked like `grid`) as stored in `ckpt`:
/// the codes of its box in storage order and the scales of the box's blocks. `None` when the
/// checkpoint does not store the tensor in FP8 with `grid`'s block size.
pub fn read_fp8_weight(
    ckpt: &DistCheckpoint,
    pl: &ParamPlacement,
    grid: BlockGrid,
) -> Result<Option<Fp8Weight>, BridgeError> {
    if !ckpt.is_fp8(&pl.fqn) || ckpt.fp8_block() != Some([grid.b0, grid.b1]) {
        return Ok(None);
    }
    if misalignment(&pl.offsets, &pl.shape, &grid).is_some() {
        return Ok(None);
    }
    let b = TensorBox::new(pl.offsets.clone(), pl.shape.clone());
    let canon = ckpt.read_box(&pl.fqn, &b)?.bytes;
    let Some(sbox) = scale_box(&b, [grid.b0, grid.b1]) else {
        return Ok(None);
    };
    let scale_inv = ckpt.read_box(&scale_fqn(&pl.fqn), &sbox)?.to_f32_vec()?;
    if canon.len() != grid.numel() || scale_inv.len() != grid.num_blocks() {
        return Err(BridgeError::Sharding {
            tensor: pl.fqn.clone(),
            reason: format!(
                "stored FP8 box of {} codes / {} scales does not fit the parameter's {}x{}x{} \
                 weight in {}x{} blocks",
                canon.len(),
                scale_inv.len(),
                grid.matrices,
                grid.rows,
                grid.cols,
                grid.b0,
                grid.b1
            ),
        });
    }
    let data = if grid.transposed {
        let per = grid.rows * grid.cols;
        let mut out = vec![0u8; canon.len()];
        for m in 0..grid.matrices {
            for r in 0..grid.rows {
                for c in 0..grid.cols {
                    out[m * per + c * grid.rows + r] = canon[m * per + r * grid.cols + c];
                }
            }
        }
        out
    } else {
        canon
    };
    Ok(Some(Fp8Weight {
        grid,
        data,
        scale_inv,
    }))
}

impl DistCheckpoint {
    /// The FP8 block size of the checkpoint's `fp8` record.
    pub fn fp8_block(&self) -> Option<[usize; 2]> {
        self.index().fp8.as_ref().map(|r| r.weight_block_size)
    }

    /// Whether `fqn` is stored as FP8 bytes with a scale tensor.
    pub fn is_fp8(&self, fqn: &str) -> bool {
        self.index()
            .tensors
            .get(fqn)
            .is_some_and(|e| is_fp8_weight(self.index(), fqn, e))
    }

    /// The box `request` of `fqn` as `out` values: FP8 weights are dequantised with the scales
    /// of their blocks (global block coordinates, f32 product rounded once), other float
    /// tensors are cast.
    pub fn read_box_dequantized(
        &self,
        fqn: &str,
        request: &TensorBox,
        out: OutDtype,
    ) -> Result<OwnedTensor, BridgeError> {
        if !self.is_fp8(fqn) {
            return self.read_box(fqn, request)?.cast(out.dtype());
        }
        let fail = |reason: String| BridgeError::Dequantize {
            path: self.dir().to_path_buf(),
            tensor: fqn.to_owned(),
            reason,
        };
        let block = self
            .fp8_block()
            .ok_or_else(|| fail("the index has no fp8 record".to_owned()))?;
        let q = self.read_box(fqn, request)?;
        let sbox = scale_box(request, block).ok_or_else(|| fail("rank < 2".to_owned()))?;
        let scales = self.read_box(&scale_fqn(fqn), &sbox)?.to_f32_vec()?;
        let codes = q.to_f32_vec()?;
        let r = request.shape.len();
        let (rows, cols) = (request.shape[r - 2], request.shape[r - 1]);
        let (r0, c0) = (request.offsets[r - 2], request.offsets[r - 1]);
        let (sr, sc) = (sbox.shape[r - 2], sbox.shape[r - 1]);
        let per = rows * cols;
        let values = codes.iter().enumerate().map(|(k, &v)| {
            let (m, rem) = (k / per.max(1), k % per.max(1));
            let (i, j) = (rem / cols.max(1), rem % cols.max(1));
            let bi = (r0 + i) / block[0] - r0 / block[0];
            let bj = (c0 + j) / block[1] - c0 / block[1];
            v * scales[(m * sr + bi) * sc + bj]
        });
        let bytes = match out {
            OutDtype::BF16 => values
                .flat_map(|v| crate::safetensors::elem::f32_to_bf16_bits(v).to_le_bytes())
                .collect(),
            OutDtype::F32 => values.flat_map(f32::to_le_bytes).collect(),
        };
        OwnedTensor::new(fqn, out.dtype(), request.shape.clone(), bytes)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use moe_backend::parallel::ParallelLayout;

    use super::super::index::{ChunkEntry, Fp8Record};
    use super::*;

    fn entry(kind: TensorKind, dtype: Dtype, shape: &[usize]) -> TensorEntry {
        TensorEntry {
            kind,
            dtype,
            global_shape: shape.to_vec(),
            hf: Vec::new(),
            chunks: vec![ChunkEntry {
                file: "f.safetensors".into(),
                offsets: vec![0; shape.len()],
                shape: shape.to_vec(),
                writer_rank: 0,
            }],
        }
    }

    fn index(scale_shape: &[usize], record: bool) -> DcpIndex {
        let layout = ParallelLayout::parse_spec("").unwrap();
        let mut index = DcpIndex::new(0, &layout);
        index.fp8 = record.then(|| Fp8Record {
            format: "e4m3".into(),
            weight_block_size: [16, 16],
            pow2_scales: false,
        });
        index.tensors.insert(
            "w.weight".into(),
            entry(TensorKind::Param, Dtype::F8E4M3, &[40, 32]),
        );
        index.tensors.insert(
            "w.weight_scale_inv".into(),
            entry(TensorKind::Scale, Dtype::F32, scale_shape),
        );
        index
    }

    #[test]
    fn scales_must_match_the_block_grid_of_an_fp8_weight() {
        let dir = Path::new("ckpt");
        validate_fp8(dir, &index(&[3, 2], true)).unwrap();
        assert!(is_fp8_weight(
            &index(&[3, 2], true),
            "w.weight",
            &entry(TensorKind::Param, Dtype::F8E4M3, &[40, 32])
        ));
        let wrong = validate_fp8(dir, &index(&[2, 2], true))
            .unwrap_err()
            .to_string();
        assert!(
            wrong.contains("w.weight_scale_inv") && wrong.contains("[3, 2]"),
            "{wrong}"
        );
        let no_record = validate_fp8(dir, &index(&[3, 2], false))
            .unwrap_err()
            .to_string();
        assert!(no_record.contains("no `fp8` record"), "{no_record}");
        let mut orphan = index(&[3, 2], true);
        orphan.tensors.remove("w.weight");
        let e = validate_fp8(dir, &orphan).unwrap_err().to_string();
        assert!(e.contains("has no weight tensor"), "{e}");
        let mut wide = index(&[3, 2], true);
        wide.tensors.insert(
            "w.weight".into(),
            entry(TensorKind::Param, Dtype::BF16, &[40, 32]),
        );
        let e = validate_fp8(dir, &wide).unwrap_err().to_string();
        assert!(e.contains("not an FP8 tensor"), "{e}");
    }

    #[test]
    fn scale_boxes_cover_the_blocks_a_box_touches() {
        let b = TensorBox::new(vec![3, 20, 0], vec![2, 13, 16]);
        let s = scale_box(&b, [16, 16]).unwrap();
        // Rows 20..33 touch blocks 1 and 2; columns 0..16 block 0.
        assert_eq!(s, TensorBox::new(vec![3, 1, 0], vec![2, 2, 1]));
        let e = scale_box(&TensorBox::new(vec![0, 32], vec![0, 16]), [16, 16]).unwrap();
        assert_eq!(e.shape, vec![0, 1]);
        assert!(scale_box(&TensorBox::new(vec![1], vec![1]), [1, 1]).is_none());
    }
}
