//! Blockwise FP8 weights of release checkpoints (DeepSeek-V3),
//! docs/checkpoints.md §FP8 release format.
//!
//! - **Rule:** a tensor is dequantised iff its dtype is one byte wide and `<name>_scale_inv`
//!   exists ([`should_dequantize`]); the list of quantised tensors is never hard-coded. An FP8
//!   tensor (`F8_E4M3`/`F8_E5M2`) without a scale is value-cast; other one-byte tensors without
//!   a scale, and all wider tensors, pass through unchanged.
//! - **Dequantisation:** `W[i,j] = f32(Q[i,j]) · S[i / b0, j / b1]` in f32, rounded once
//!   (round-to-nearest-even) to the output dtype; partial edge blocks use their block's scale;
//!   `(b0, b1)` comes from `quantization_config.weight_block_size` (default 128×128).
//! - **Quantisation** (release recipe, for writing FP8): blocks zero-padded to `b`,
//!   `scale_inv = amax / 448` (1 when `amax = 0`), `Q = e4m3(W / scale_inv)`.

mod codec;

use std::path::Path;

use serde_json::Value;

use crate::BridgeError;
use crate::dist::TensorBox;
use crate::dist::fp8::scale_box;
use crate::hf::{CONFIG_FILE, HfCheckpoint};
use crate::safetensors::elem::{bf16_bits_to_f32, f32_to_bf16_bits};
use crate::safetensors::{Dtype, OwnedTensor, TensorView};

pub use codec::{E4M3_MAX, f32_to_e4m3};

/// Block size used when the config gives none.
pub const DEFAULT_BLOCK_SIZE: [usize; 2] = [128, 128];

/// Suffix of the inverse-scale tensor that accompanies a quantised weight.
pub const SCALE_INV_SUFFIX: &str = "_scale_inv";

/// The float dtype dequantised or cast FP8 tensors are produced in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutDtype {
    /// bfloat16 (the release checkpoints' own dtype; the default).
    #[default]
    BF16,
    /// float32 (exact: no rounding after the f32 product).
    F32,
}

impl OutDtype {
    /// The safetensors dtype.
    pub fn dtype(self) -> Dtype {
        match self {
            OutDtype::BF16 => Dtype::BF16,
            OutDtype::F32 => Dtype::F32,
        }
    }

    /// Encodes f32 values (rounding once, RNE, for BF16).
    fn encode(self, values: impl Iterator<Item = f32>) -> Vec<u8> {
        match self {
            OutDtype::BF16 => values
                .flat_map(|v| crate::safetensors::elem::f32_to_bf16_bits(v).to_le_bytes())
                .collect(),
            OutDtype::F32 => values.flat_map(f32::to_le_bytes).collect(),
        }
    }
}

/// `<name>_scale_inv`.
pub fn scale_inv_name(name: &str) -> String {
    format!("{name}{SCALE_INV_SUFFIX}")
}

/// Whether `name` is an inverse-scale tensor (consumed by dequantisation, never exported).
pub fn is_scale_inv(name: &str) -> bool {
    name.ends_with(SCALE_INV_SUFFIX)
}

/// The normative rule: dequantise iff the dtype is one byte and a scale exists.
pub fn should_dequantize(dtype: Dtype, has_scale_inv: bool) -> bool {
    dtype.size() == 1 && has_scale_inv
}

/// `quantization_config.weight_block_size` of a parsed `config.json`, or
/// [`DEFAULT_BLOCK_SIZE`] when absent. `path` names the config in errors.
pub fn block_size_from_config(config: &Value, path: &Path) -> Result<[usize; 2], BridgeError> {
    let Some(value) = config
        .get("quantization_config")
        .and_then(|q| q.get("weight_block_size"))
    else {
        return Ok(DEFAULT_BLOCK_SIZE);
    };
    let bad = |reason: String| BridgeError::InvalidConfig {
        path: path.to_path_buf(),
        field: "quantization_config.weight_block_size".to_owned(),
        reason,
    };
    let items = value
        .as_array()
        .ok_or_else(|| bad(format!("{value} is not an array")))?;
    let sizes: Vec<usize> = items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .filter(|&x| x > 0)
                .ok_or_else(|| bad(format!("{v} is not a positive integer")))
        })
        .collect::<Result<_, _>>()?;
    match sizes.as_slice() {
        &[b0, b1] => Ok([b0, b1]),
        _ => Err(bad(format!("expected 2 entries, found {}", sizes.len()))),
    }
}

/// The expected scale shape for a quantised tensor of `shape` (rank ≥ 2; leading dimensions
/// are batch dimensions): `[.., ceil(M/b0), ceil(N/b1)]`.
pub fn scale_shape(shape: &[usize], block: [usize; 2]) -> Option<Vec<usize>> {
    let (&n, rest) = shape.split_last()?;
    let (&m, batch) = rest.split_last()?;
    let mut out = batch.to_vec();
    out.push(m.div_ceil(block[0]));
    out.push(n.div_ceil(block[1]));
    Some(out)
}

/// Dequantises `q` (any one-byte dtype, rank ≥ 2) with its inverse scale `scale` (any float dtype)
/// and block size `block`, naming the result `q.name` (docs/checkpoints.md §FP8 release format).
pub fn dequantize_blockwise(
    q: &TensorView<'_>,
    scale: &TensorView<'_>,
    block: [usize; 2],
    out: OutDtype,
) -> Result<OwnedTensor, BridgeError> {
    let fail = |reason: String| BridgeError::Dequantize {
        path: q.path.to_path_buf(),
        tensor: q.name.to_owned(),
        reason,
    };
    if q.dtype.size() != 1 {
        return Err(fail(format!("{} is not a one-byte dtype", q.dtype)));
    }
    if block.contains(&0) {
        return Err(fail(format!("block size {block:?} has a zero")));
    }
    let expected = scale_shape(q.shape, block)
        .ok_or_else(|| fail(format!("shape {:?} has rank < 2", q.shape)))?;
    if scale.shape != expected.as_slice() {
        return Err(fail(format!(
            "`{}` has shape {:?}, expected {expected:?} for {:?} in {block:?} blocks",
            scale.name, scale.shape, q.shape
        )));
    }
    let values = q.to_f32_vec()?;
    let scales = scale.to_f32_vec()?;
    let (rows, cols) = (q.shape[q.shape.len() - 2], q.shape[q.shape.len() - 1]);
    let (srows, scols) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    let per_matrix = rows * cols;
    let result = values.iter().enumerate().map(|(k, &v)| {
        let (b, rem) = (k / per_matrix.max(1), k % per_matrix.max(1));
        let (i, j) = (rem / cols, rem % cols);
        v * scales[(b * srows + i / block[0]) * scols + j / block[1]]
    });
    let bytes = out.encode(result);
    OwnedTensor::new(q.name, out.dtype(), q.shape.to_vec(), bytes)
}

/// Value-casts an FP8 tensor without a scale to `out` (exact for F32).
pub fn cast_fp8(q: &TensorView<'_>, out: OutDtype) -> Result<OwnedTensor, BridgeError> {
    let bytes = out.encode(q.to_f32_vec()?.into_iter());
    OwnedTensor::new(q.name, out.dtype(), q.shape.to_vec(), bytes)
}

/// Release quantisation of a row-major `[M, N]` f32 matrix: returns the `F8_E4M3` bytes and the
/// F32 inverse scales `[ceil(M/b0), ceil(N/b1)]` (row-major).
pub fn quantize_blockwise(
    values: &[f32],
    shape: [usize; 2],
    block: [usize; 2],
) -> Option<(Vec<u8>, Vec<f32>)> {
    let [rows, cols] = shape;
    if values.len() != rows.checked_mul(cols)? || block.contains(&0) {
        return None;
    }
    let (srows, scols) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    let mut amax = vec![0.0f32; srows * scols];
    if cols == 0 {
        return Some((Vec::new(), vec![1.0; srows * scols]));
    }
    // Row by row, one column block at a time (no per-element index arithmetic).
    for (r, row) in values.chunks_exact(cols).enumerate() {
        let cells = &mut amax[(r / block[0]) * scols..(r / block[0] + 1) * scols];
        for (cell, seg) in cells.iter_mut().zip(row.chunks(block[1])) {
            *cell = seg.iter().fold(*cell, |m, v| m.max(v.abs()));
        }
    }
    let scales: Vec<f32> = amax
        .iter()
        .map(|&a| if a > 0.0 { a / E4M3_MAX } else { 1.0 })
        .collect();
    let mut q = vec![0u8; values.len()];
    for (r, (row, out)) in values
        .chunks_exact(cols)
        .zip(q.chunks_exact_mut(cols))
        .enumerate()
    {
        let cells = &scales[(r / block[0]) * scols..(r / block[0] + 1) * scols];
        for ((seg, out), &s) in row
            .chunks(block[1])
            .zip(out.chunks_mut(block[1]))
            .zip(cells)
        {
            for (o, &v) in out.iter_mut().zip(seg) {
                *o = f32_to_e4m3(v / s);
            }
        }
    }
    Some((q, scales))
}

impl HfCheckpoint {
    /// The FP8 block size from `config.json` (default 128×128 when the file or the field is
    /// absent).
    pub fn fp8_block_size(&self) -> Result<[usize; 2], BridgeError> {
        match self.config_json_opt()? {
            Some(config) => block_size_from_config(&config, &self.dir().join(CONFIG_FILE)),
            None => Ok(DEFAULT_BLOCK_SIZE),
        }
    }

    /// Reads tensor `name` applying the FP8 load hook (docs/checkpoints.md §FP8 release format):
    /// dequantised to `out` when one byte wide with a `<name>_scale_inv`; value-cast to `out` when
    /// FP8 (`F8_E4M3`/`F8_E5M2`) without a scale; otherwise returned as stored.
    pub fn read_dequantized(&self, name: &str, out: OutDtype) -> Result<OwnedTensor, BridgeError> {
        let view = self.tensor(name)?;
        let scale_name = scale_inv_name(name);
        if should_dequantize(view.dtype, self.contains(&scale_name)) {
            let block = match self.fp8_block.get() {
                Some(block) => *block,
                None => {
                    let block = self.fp8_block_size()?;
                    let _ = self.fp8_block.set(block);
                    block
                }
            };
            let scale = self.tensor(&scale_name)?;
            return dequantize_blockwise(&view, &scale, block, out);
        }
        if matches!(view.dtype, Dtype::F8E4M3 | Dtype::F8E5M2) {
            return cast_fp8(&view, out);
        }
        Ok(view.to_owned_tensor())
    }

    /// Shape and f32 values of tensor `name` after the FP8 hook: FP8 weights are dequantised
    /// to BF16 first (the dtype transformers loads release checkpoints in) and then widened, so
    /// the values equal the BF16 reference exactly.
    ///
    /// Only float data is read as weights: an integer or bool tensor (without a scale that
    /// dequantises it) is a [`BridgeError::DtypeMismatch`], never widened value by value.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), BridgeError> {
        let t = self.read_dequantized(name, OutDtype::BF16)?;
        if !matches!(t.dtype, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64) {
            return Err(BridgeError::DtypeMismatch {
                path: self.file_of(name)?.to_path_buf(),
                tensor: name.to_owned(),
                expected: "a float dtype".to_owned(),
                actual: t.dtype.to_string(),
            });
        }
        let values = t.to_f32_vec()?;
        Ok((t.shape, values))
    }
}

impl HfCheckpoint {
    /// The FP8 block size, read from `config.json` once.
    fn cached_fp8_block(&self) -> Result<[usize; 2], BridgeError> {
        match self.fp8_block.get() {
            Some(block) => Ok(*block),
            None => {
                let block = self.fp8_block_size()?;
                let _ = self.fp8_block.set(block);
                Ok(block)
            }
        }
    }

    /// The box at `offsets` of extent `shape` of tensor `name` as f32 values, equal to the
    /// same box of [`read_f32`](Self::read_f32) but reading only the box (positioned reads,
    /// [`SafetensorsFile::read_box`](crate::safetensors::SafetensorsFile::read_box)): a
    /// blockwise FP8 weight reads its codes in the box and the scales of the blocks the box
    /// touches (any box works: every element is scaled by its own block's scale, in global
    /// block coordinates), dequantises to BF16 and widens; other float tensors are widened.
    ///
    /// Errors: as [`read_f32`](Self::read_f32), and [`BridgeError::ShapeMismatch`] when the
    /// box does not lie inside the tensor.
    pub fn read_box_f32(
        &self,
        name: &str,
        offsets: &[usize],
        shape: &[usize],
    ) -> Result<Vec<f32>, BridgeError> {
        let file = self.shard_for(name)?;
        let dtype = file.info(name)?.dtype;
        let scale_name = scale_inv_name(name);
        if should_dequantize(dtype, self.contains(&scale_name)) {
            let block = self.cached_fp8_block()?;
            let fail = |reason: String| BridgeError::Dequantize {
                path: file.path().to_path_buf(),
                tensor: name.to_owned(),
                reason,
            };
            let global = file.info(name)?.shape.clone();
            let expected = scale_shape(&global, block)
                .ok_or_else(|| fail(format!("shape {global:?} has rank < 2")))?;
            let scale_file = self.shard_for(&scale_name)?;
            if scale_file.info(&scale_name)?.shape != expected {
                return Err(fail(format!(
                    "`{scale_name}` has shape {:?}, expected {expected:?} for {global:?} in \
                     {block:?} blocks",
                    scale_file.info(&scale_name)?.shape
                )));
            }
            let request = TensorBox::new(offsets.to_vec(), shape.to_vec());
            let sbox = scale_box(&request, block)
                .ok_or_else(|| fail(format!("shape {global:?} has rank < 2")))?;
            let codes = file.read_box(name, offsets, shape)?.to_f32_vec()?;
            let scales = scale_file
                .read_box(&scale_name, &sbox.offsets, &sbox.shape)?
                .to_f32_vec()?;
            let r = shape.len();
            let (rows, cols) = (shape[r - 2], shape[r - 1]);
            let (r0, c0) = (offsets[r - 2], offsets[r - 1]);
            let (sr, sc) = (sbox.shape[r - 2], sbox.shape[r - 1]);
            let per = (rows * cols).max(1);
            return Ok(codes
                .iter()
                .enumerate()
                .map(|(k, &v)| {
                    let (m, rem) = (k / per, k % per);
                    let (i, j) = (rem / cols.max(1), rem % cols.max(1));
                    let bi = (r0 + i) / block[0] - r0 / block[0];
                    let bj = (c0 + j) / block[1] - c0 / block[1];
                    // Rounded once to BF16 as `read_f32` does, then widened.
                    bf16_bits_to_f32(f32_to_bf16_bits(v * scales[(m * sr + bi) * sc + bj]))
                })
                .collect());
        }
        if !matches!(
            dtype,
            Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64 | Dtype::F8E4M3 | Dtype::F8E5M2
        ) {
            return Err(BridgeError::DtypeMismatch {
                path: file.path().to_path_buf(),
                tensor: name.to_owned(),
                expected: "a float dtype".to_owned(),
                actual: dtype.to_string(),
            });
        }
        // FP8 without a scale: its values are exact in BF16, so `read_f32`'s value cast to BF16
        // and widening equals the direct decode.
        file.read_box(name, offsets, shape)?.to_f32_vec()
    }
}

#[cfg(test)]
mod tests;
