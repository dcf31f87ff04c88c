//! MXFP4 weights of release checkpoints (gpt-oss), docs/checkpoints.md §MXFP4 release format.
//!
//! The OCP Microscaling format as the gpt-oss release stores it, one weight `W` as two tensors:
//!
//! - `<name>_blocks`, `U8 [..., G, 16]`: 32 E2M1 codes per block, two per byte — value `2i` of a
//!   block in the **low** nibble of byte `i`, value `2i + 1` in the high one;
//! - `<name>_scales`, `U8 [..., G]`: one E8M0 exponent per block, `2^(s − 127)`.
//!
//! Decoding follows transformers 5.23's `integrations/mxfp4.py`
//! (`_convert_moe_packed_tensors`): code `c` is `FP4_VALUES[c]` (`±{0, 0.5, 1, 1.5, 2, 3, 4,
//! 6}`, the sign in bit 3), multiplied by `2^(s − 127)` in f32 (`torch.ldexp`: exact, subnormal
//! for the smallest scales, ±inf past f32's range (scales from 253 on) as in transformers), and
//! the blocks of a row laid end to end: `W [..., G·32]` in the stored
//! orientation. transformers then transposes the last two dims for its `GptOssExperts`
//! parameters; that is the model's business (its name mapping), not this codec's. The scale
//! `0xFF` is NaN in the OCP format and is refused.
//!
//! Encoding ([`encode_mxfp4`]) writes the same layout. Per block of 32 values: when
//! `reference` scales are given (those the weights were decoded from) and every value is
//! exactly a code times the reference scale, that scale and those codes are kept — so weights
//! that did not change re-pack **bit for bit** to the release's bytes; otherwise the OCP MX
//! rule: shared exponent `⌊log2 amax⌋ − 2` (E2M1's largest exponent), codes rounded to the
//! nearest FP4 value (ties to the even code), saturating at ±6; an all-zero block gets the
//! smallest scale (0) and zero codes. [`encode_mxfp4_param`] packs a parameter held in
//! transformers' orientation (`[..., in, out]`) into that layout.

use crate::BridgeError;

/// The E2M1 values of the 16 codes (bit 3 the sign), as transformers' `FP4_VALUES`.
pub const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Values per MXFP4 block.
pub const BLOCK: usize = 32;

/// Suffix of the packed codes of an MXFP4 weight.
pub const BLOCKS_SUFFIX: &str = "_blocks";

/// Suffix of the E8M0 block scales of an MXFP4 weight.
pub const SCALES_SUFFIX: &str = "_scales";

/// The weight an MXFP4 tensor name belongs to: `"…gate_up_proj"` for
/// `"…gate_up_proj_blocks"` or `"…gate_up_proj_scales"`.
pub fn mxfp4_base(name: &str) -> Option<&str> {
    name.strip_suffix(BLOCKS_SUFFIX)
        .or_else(|| name.strip_suffix(SCALES_SUFFIX))
}

/// An MXFP4-packed weight: codes and scales with their shapes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mxfp4Packed {
    /// Two E2M1 codes per byte, `[..., G, 16]`.
    pub blocks: Vec<u8>,
    /// Shape of `blocks`.
    pub blocks_shape: Vec<usize>,
    /// E8M0 exponents, `[..., G]`.
    pub scales: Vec<u8>,
    /// Shape of `scales`.
    pub scales_shape: Vec<usize>,
}

fn error(tensor: &str, reason: impl Into<String>) -> BridgeError {
    BridgeError::Mxfp4 {
        tensor: tensor.to_owned(),
        reason: reason.into(),
    }
}

/// `2^(s − 127)` in f32 (exact; subnormal for `s < 1`, as `torch.ldexp`).
fn e8m0(s: u8) -> f32 {
    (f64::from(s) - 127.0).exp2() as f32
}

/// Decodes `tensor`'s MXFP4 `blocks [..., G, 16]` and `scales [..., G]` into its values
/// `[..., G·32]` (f32, exact), in the stored orientation.
///
/// Errors ([`BridgeError::Mxfp4`], naming `tensor`): shapes that do not pair (the blocks'
/// leading dims must be the scales' shape, the last dim 16), byte lengths that do not match
/// the shapes, and a NaN scale (`0xFF`).
pub fn decode_mxfp4(
    tensor: &str,
    blocks: &[u8],
    blocks_shape: &[usize],
    scales: &[u8],
    scales_shape: &[usize],
) -> Result<(Vec<usize>, Vec<f32>), BridgeError> {
    let Some((&bytes_per_block, lead)) = blocks_shape.split_last() else {
        return Err(error(tensor, "the blocks are a scalar"));
    };
    if bytes_per_block != BLOCK / 2 || lead != scales_shape || lead.is_empty() {
        return Err(error(
            tensor,
            format!(
                "blocks {blocks_shape:?} and scales {scales_shape:?} do not pair (blocks \
                 [..., G, {}] with scales [..., G])",
                BLOCK / 2
            ),
        ));
    }
    let groups: usize = lead.iter().product();
    if blocks.len() != groups * (BLOCK / 2) || scales.len() != groups {
        return Err(error(
            tensor,
            format!(
                "{} code bytes and {} scales for blocks {blocks_shape:?} and scales \
                 {scales_shape:?}",
                blocks.len(),
                scales.len()
            ),
        ));
    }
    if let Some(at) = scales.iter().position(|&s| s == 0xFF) {
        return Err(error(tensor, format!("block {at} has the NaN scale 0xFF")));
    }
    let mut values = Vec::with_capacity(groups * BLOCK);
    for (codes, &s) in blocks.chunks_exact(BLOCK / 2).zip(scales) {
        let scale = e8m0(s);
        for &byte in codes {
            values.push(FP4_VALUES[usize::from(byte & 0x0F)] * scale);
            values.push(FP4_VALUES[usize::from(byte >> 4)] * scale);
        }
    }
    let mut shape = lead.to_vec();
    if let Some(last) = shape.last_mut() {
        *last *= BLOCK;
    }
    Ok((shape, values))
}

/// The FP4 code of `x` (already divided by the block scale): the nearest value, ties to the
/// even code (the one whose mantissa bit is 0), saturating at ±6; `-0` for negative zero.
fn fp4_code(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 8 } else { 0 };
    let a = x.abs();
    // Magnitudes of codes 0..=7 and the midpoints between neighbours.
    let mut best = 0u8;
    for c in 1..8u8 {
        let (lo, hi) = (FP4_VALUES[usize::from(c - 1)], FP4_VALUES[usize::from(c)]);
        let mid = (lo + hi) / 2.0;
        if a > mid || (a == mid && c % 2 == 0) {
            best = c;
        }
    }
    if a.is_nan() {
        best = 7;
    }
    sign | best
}

/// The exact code of `x` at `scale`, when `x / scale` is an FP4 value.
fn exact_code(x: f32, scale: f32) -> Option<u8> {
    let q = x / scale;
    let code = fp4_code(q);
    (FP4_VALUES[usize::from(code)] * scale == x).then_some(code)
}

/// The OCP MX scale byte of a block whose largest magnitude is `amax`: `⌊log2 amax⌋ − 2 + 127`
/// clamped to `0..=254`; 0 for an all-zero block.
fn ocp_scale(amax: f32) -> u8 {
    if amax == 0.0 || !amax.is_finite() {
        return if amax.is_finite() { 0 } else { 254 };
    }
    let e = f64::from(amax).log2().floor() as i64 - 2 + 127;
    e.clamp(0, 254) as u8
}

/// Packs `values [..., K]` (`K` a multiple of 32) of `tensor` into MXFP4 (see the
/// [module docs](self)): blocks `[..., K/32, 16]`, scales `[..., K/32]`. With `reference`
/// scales (one per block, e.g. those the values were decoded from), blocks whose values are
/// exactly representable at their reference scale keep it, so unchanged weights re-pack bit
/// for bit.
///
/// Errors ([`BridgeError::Mxfp4`]): a last dim not divisible by 32, a value count that does not
/// match the shape, a `reference` of the wrong length, and non-finite values.
pub fn encode_mxfp4(
    tensor: &str,
    values: &[f32],
    shape: &[usize],
    reference: Option<&[u8]>,
) -> Result<Mxfp4Packed, BridgeError> {
    let Some((&k, lead)) = shape.split_last() else {
        return Err(error(tensor, "a scalar has no MXFP4 blocks"));
    };
    if k == 0 || !k.is_multiple_of(BLOCK) || values.len() != shape.iter().product::<usize>() {
        return Err(error(
            tensor,
            format!(
                "{} values of shape {shape:?}: MXFP4 needs the last dim in blocks of {BLOCK}",
                values.len()
            ),
        ));
    }
    let groups = values.len() / BLOCK;
    if let Some(r) = reference
        && r.len() != groups
    {
        return Err(error(
            tensor,
            format!("{} reference scales for {groups} blocks", r.len()),
        ));
    }
    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
        return Err(error(
            tensor,
            format!("value {at} is {} (MXFP4 holds finite values)", values[at]),
        ));
    }
    let mut blocks = Vec::with_capacity(groups * BLOCK / 2);
    let mut scales = Vec::with_capacity(groups);
    for (g, block) in values.chunks_exact(BLOCK).enumerate() {
        let kept = reference
            .and_then(|r| r.get(g).copied())
            .filter(|&s| s != 0xFF)
            .and_then(|s| {
                let scale = e8m0(s);
                let codes: Option<Vec<u8>> = block.iter().map(|&x| exact_code(x, scale)).collect();
                codes.map(|c| (s, c))
            });
        let (s, codes) = match kept {
            Some(found) => found,
            None => {
                let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
                let s = ocp_scale(amax);
                let scale = e8m0(s);
                (s, block.iter().map(|&x| fp4_code(x / scale)).collect())
            }
        };
        scales.push(s);
        blocks.extend(codes.chunks_exact(2).map(|p| p[0] | (p[1] << 4)));
    }
    let mut scales_shape = lead.to_vec();
    scales_shape.push(k / BLOCK);
    let mut blocks_shape = scales_shape.clone();
    blocks_shape.push(BLOCK / 2);
    Ok(Mxfp4Packed {
        blocks,
        blocks_shape,
        scales,
        scales_shape,
    })
}

/// The last two dims of `values` (shape `shape`, rank ≥ 2) swapped: the values and the
/// swapped shape. `tensor` names a lower rank in errors.
fn swap_last_two(
    tensor: &str,
    shape: &[usize],
    values: &[f32],
) -> Result<(Vec<usize>, Vec<f32>), BridgeError> {
    let n = shape.len();
    if n < 2 || values.len() != shape.iter().product::<usize>() {
        return Err(error(
            tensor,
            format!(
                "{} values of shape {shape:?} are not a matrix (or a stack of them)",
                values.len()
            ),
        ));
    }
    let (rows, cols) = (shape[n - 2], shape[n - 1]);
    let mut out = vec![0.0f32; values.len()];
    let size = (rows * cols).max(1);
    for (src, dst) in values.chunks_exact(size).zip(out.chunks_exact_mut(size)) {
        for r in 0..rows {
            for c in 0..cols {
                dst[c * rows + r] = src[r * cols + c];
            }
        }
    }
    let mut swapped = shape.to_vec();
    swapped.swap(n - 2, n - 1);
    Ok((swapped, out))
}

/// Packs the parameter `values` of `tensor`, shape `[..., in, out]` (the orientation
/// [`HfCheckpoint::read_mxfp4_param`](crate::hf::HfCheckpoint::read_mxfp4_param) returns and
/// transformers' `GptOssExperts` holds), into the release's MXFP4 pair: the matrix is
/// transposed to the stored `[..., out, in]` and its rows packed in blocks of 32 along `in`
/// ([`encode_mxfp4`], `reference` scales `[..., out, in/32]` as there). The inverse of
/// `read_mxfp4_param` for values an MXFP4 pair holds exactly.
///
/// Errors ([`BridgeError::Mxfp4`], naming `tensor`): a rank below 2, an `in` that 32 does not
/// divide, and [`encode_mxfp4`]'s.
pub fn encode_mxfp4_param(
    tensor: &str,
    values: &[f32],
    shape: &[usize],
    reference: Option<&[u8]>,
) -> Result<Mxfp4Packed, BridgeError> {
    let (stored, values) = swap_last_two(tensor, shape, values)?;
    encode_mxfp4(tensor, &values, &stored, reference)
}

/// The shapes of the MXFP4 pair of a parameter of shape `[..., in, out]`
/// ([`encode_mxfp4_param`]): blocks `[..., out, in/32, 16]` and scales `[..., out, in/32]`.
/// Errors ([`BridgeError::Mxfp4`], naming `tensor`): a rank below 2 or an `in` that 32 does
/// not divide.
pub fn mxfp4_pair_shapes(
    tensor: &str,
    shape: &[usize],
) -> Result<(Vec<usize>, Vec<usize>), BridgeError> {
    match shape {
        [lead @ .., k, out] if *k > 0 && k.is_multiple_of(BLOCK) => {
            let scales = [lead, &[*out, k / BLOCK][..]].concat();
            let blocks = [&scales[..], &[BLOCK / 2][..]].concat();
            Ok((blocks, scales))
        }
        _ => Err(error(
            tensor,
            format!(
                "a parameter of shape {shape:?} is not [..., in, out] with `in` in blocks of \
                 {BLOCK}"
            ),
        )),
    }
}

impl crate::hf::HfCheckpoint {
    /// Shape and f32 values of the MXFP4 weight `base` (`<base>_blocks`, `<base>_scales`, both
    /// `U8`), decoded ([`decode_mxfp4`]), in the stored orientation.
    pub fn read_mxfp4(&self, base: &str) -> Result<(Vec<usize>, Vec<f32>), BridgeError> {
        let blocks_name = format!("{base}{BLOCKS_SUFFIX}");
        let scales_name = format!("{base}{SCALES_SUFFIX}");
        let blocks = self.tensor(&blocks_name)?;
        let scales = self.tensor(&scales_name)?;
        for view in [&blocks, &scales] {
            if view.dtype != crate::safetensors::Dtype::U8 {
                return Err(BridgeError::DtypeMismatch {
                    path: view.path.to_path_buf(),
                    tensor: view.name.to_owned(),
                    expected: "U8 (MXFP4 codes / E8M0 scales)".to_owned(),
                    actual: view.dtype.to_string(),
                });
            }
        }
        decode_mxfp4(
            &blocks_name,
            blocks.bytes,
            blocks.shape,
            scales.bytes,
            scales.shape,
        )
    }

    /// Shape and f32 values of the MXFP4 weight `base` as a parameter: the decoded
    /// `[..., out, in]` matrix ([`read_mxfp4`](Self::read_mxfp4)) with its last two dims
    /// swapped, as transformers' `convert_moe_packed_tensors` hands it to the model (its
    /// `.transpose(1, 2)`). Errors: those of [`read_mxfp4`](Self::read_mxfp4), and
    /// [`BridgeError::Mxfp4`] for a decoded tensor of rank < 2.
    pub fn read_mxfp4_param(&self, base: &str) -> Result<(Vec<usize>, Vec<f32>), BridgeError> {
        let (shape, values) = self.read_mxfp4(base)?;
        swap_last_two(base, &shape, &values)
    }

    /// The stored E8M0 scales of the MXFP4 weight `base` (`<base>_scales`, `U8 [..., G]`): its
    /// shape and bytes, e.g. the reference scales [`encode_mxfp4`] keeps for unchanged blocks.
    /// Errors: a missing tensor, and [`BridgeError::DtypeMismatch`] for scales not `U8`.
    pub fn read_mxfp4_scales(&self, base: &str) -> Result<(Vec<usize>, Vec<u8>), BridgeError> {
        let name = format!("{base}{SCALES_SUFFIX}");
        let view = self.tensor(&name)?;
        if view.dtype != crate::safetensors::Dtype::U8 {
            return Err(BridgeError::DtypeMismatch {
                path: view.path.to_path_buf(),
                tensor: view.name.to_owned(),
                expected: "U8 (E8M0 scales)".to_owned(),
                actual: view.dtype.to_string(),
            });
        }
        Ok((view.shape.to_vec(), view.bytes.to_vec()))
    }

    /// The parameter shape of the MXFP4 weight `base` ([`read_mxfp4_param`](Self::read_mxfp4_param)'s)
    /// from the headers alone: the blocks `[..., out, G, 16]` give `[..., G·32, out]`.
    /// Errors: a missing pair, and [`BridgeError::Mxfp4`] for blocks of rank < 3 or whose
    /// last dim is not 16.
    pub fn mxfp4_param_shape(&self, base: &str) -> Result<Vec<usize>, BridgeError> {
        let blocks_name = format!("{base}{BLOCKS_SUFFIX}");
        let info = self.info(&blocks_name)?;
        match info.shape.as_slice() {
            [lead @ .., out, groups, bytes] if *bytes == BLOCK / 2 => {
                Ok([lead, &[groups * BLOCK, *out][..]].concat())
            }
            shape => Err(error(
                &blocks_name,
                format!(
                    "blocks of shape {shape:?} are not [..., out, G, {}]",
                    BLOCK / 2
                ),
            )),
        }
    }

    /// Whether `base` is stored as an MXFP4 pair (`<base>_blocks` and `<base>_scales`).
    pub fn is_mxfp4(&self, base: &str) -> bool {
        self.contains(&format!("{base}{BLOCKS_SUFFIX}"))
            && self.contains(&format!("{base}{SCALES_SUFFIX}"))
    }
}

#[cfg(test)]
mod tests;
