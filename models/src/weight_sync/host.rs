//! Host byte work of the sync: copying (and casting) a piece into its box of a tensor's region
//! of a bucket, and decoding bucket bytes to f32.

use burn::tensor::{DType, bf16, f16};

use super::WeightSyncError;

/// The f32 values of little-endian `bytes` of `dtype` (F32, BF16, F16).
pub(crate) fn decode_f32(
    name: &str,
    bytes: &[u8],
    dtype: DType,
) -> Result<Vec<f32>, WeightSyncError> {
    Ok(match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(WeightSyncError::UnsupportedDtype {
                name: name.to_owned(),
                dtype: other,
            });
        }
    })
}

/// Copies the elements of `src` (`src_dtype`) into `dst` (`dst_dtype`), same count; floats
/// convert through f32 with round-to-nearest-even (`half`'s rule).
pub(crate) fn convert(
    name: &str,
    dst: &mut [u8],
    dst_dtype: DType,
    src: &[u8],
    src_dtype: DType,
) -> Result<(), WeightSyncError> {
    if dst_dtype == src_dtype {
        dst.copy_from_slice(src);
        return Ok(());
    }
    let unsupported = |dtype| WeightSyncError::UnsupportedDtype {
        name: name.to_owned(),
        dtype,
    };
    match (src_dtype, dst_dtype) {
        (DType::F32, DType::BF16) => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let v = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                d.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
        }
        (DType::BF16, DType::F32) => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                let v = bf16::from_le_bytes([s[0], s[1]]).to_f32();
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        (_, DType::F32 | DType::BF16 | DType::F16) => {
            let n = src.len() / src_dtype.size().max(1);
            for i in 0..n {
                let s = &src[i * src_dtype.size()..(i + 1) * src_dtype.size()];
                let v = match src_dtype {
                    DType::F32 => f32::from_le_bytes([s[0], s[1], s[2], s[3]]),
                    DType::BF16 => bf16::from_le_bytes([s[0], s[1]]).to_f32(),
                    DType::F16 => f16::from_le_bytes([s[0], s[1]]).to_f32(),
                    DType::F64 => {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(s);
                        f64::from_le_bytes(b) as f32
                    }
                    other => return Err(unsupported(other)),
                };
                let d = &mut dst[i * dst_dtype.size()..(i + 1) * dst_dtype.size()];
                match dst_dtype {
                    DType::F32 => d.copy_from_slice(&v.to_le_bytes()),
                    DType::BF16 => d.copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
                    _ => d.copy_from_slice(&f16::from_f32(v).to_le_bytes()),
                }
            }
        }
        (_, other) => return Err(unsupported(other)),
    }
    Ok(())
}

/// Where a piece goes: the box `offsets .. offsets + shape` of a row-major tensor of shape
/// `full` (both of the same rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PieceBox {
    /// The whole tensor's shape (possibly a finer view of it, e.g. `[E, 2, Im, H]` for
    /// `[E, 2·Im, H]`).
    pub full: Vec<usize>,
    /// Start of the box in every dimension.
    pub offsets: Vec<usize>,
    /// Extent of the box (the piece's shape, viewed in `full`'s rank).
    pub shape: Vec<usize>,
}

impl PieceBox {
    /// The box covering the whole tensor.
    pub fn whole(shape: &[usize]) -> Self {
        Self {
            full: shape.to_vec(),
            offsets: vec![0; shape.len()],
            shape: shape.to_vec(),
        }
    }
}

/// Copies `src` (row-major over `bx.shape`, `src_dtype`) into its box of `dst` (row-major over
/// `bx.full`, `dst_dtype`), casting.
pub(crate) fn scatter(
    name: &str,
    dst: &mut [u8],
    dst_dtype: DType,
    src: &[u8],
    src_dtype: DType,
    bx: &PieceBox,
) -> Result<(), WeightSyncError> {
    let bad = |reason: String| WeightSyncError::Layout {
        name: name.to_owned(),
        reason,
    };
    let rank = bx.full.len();
    if bx.offsets.len() != rank
        || bx.shape.len() != rank
        || (0..rank).any(|d| bx.offsets[d] + bx.shape[d] > bx.full[d])
    {
        return Err(bad(format!("piece box {bx:?} does not fit the tensor")));
    }
    let (numel, full_numel) = (
        bx.shape.iter().product::<usize>(),
        bx.full.iter().product::<usize>(),
    );
    if src.len() != numel * src_dtype.size() || dst.len() != full_numel * dst_dtype.size() {
        return Err(bad(format!(
            "a piece of {} bytes ({src_dtype:?}) for box {bx:?}, a region of {} bytes \
             ({dst_dtype:?})",
            src.len(),
            dst.len()
        )));
    }
    if numel == 0 {
        return Ok(());
    }
    if rank == 0 {
        return convert(name, dst, dst_dtype, src, src_dtype);
    }
    // Trailing dimensions the box spans entirely are copied as one run.
    let mut k = rank.saturating_sub(1);
    while k > 0 && bx.shape[k] == bx.full[k] {
        k -= 1;
    }
    let run: usize = bx.shape[k..].iter().product();
    let mut strides = vec![1usize; rank];
    for d in (0..rank.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * bx.full[d + 1];
    }
    let (ss, ds) = (src_dtype.size(), dst_dtype.size());
    let outer: usize = bx.shape[..k].iter().product();
    let mut idx = vec![0usize; k];
    for r in 0..outer {
        let start = (0..k)
            .map(|d| (bx.offsets[d] + idx[d]) * strides[d])
            .sum::<usize>()
            + bx.offsets.get(k).copied().unwrap_or(0) * strides.get(k).copied().unwrap_or(1);
        convert(
            name,
            &mut dst[start * ds..(start + run) * ds],
            dst_dtype,
            &src[r * run * ss..(r + 1) * run * ss],
            src_dtype,
        )?;
        for d in (0..k).rev() {
            idx[d] += 1;
            if idx[d] < bx.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(())
}
