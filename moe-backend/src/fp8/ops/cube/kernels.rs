//! CubeCL kernels of the device FP8 fake quantisation: blockwise `amax` (two passes), block
//! scales, and the elementwise scale → FP8 round trip → unscale. They reproduce
//! [`crate::fp8::quantize_blockwise`] followed by [`crate::fp8::Fp8Blocks::dequantize`] bit for
//! bit: the same integer `amax` over `|x|` bits (NaN ignored), the same scale rule
//! ([`crate::fp8::compute_scale_from_amax`] with `eps = 0`), and the branch structure of the
//! host encoder of `fp8/formats.rs` (round to nearest even, subnormals by the f32 "magic"
//! addition, saturation to the largest finite code, NaN passed through). No shared memory (it
//! cannot run on lavapipe, see `ops/cube/gemm.rs`), no atomics, no float reductions: every
//! result is independent of scheduling.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;

/// `|x|` bits of the finite and infinite values; NaN gives 0 (ignored by the max). For
/// non-NaN floats the order of these keys is the order of `|x|`.
#[cube]
fn abs_key(v: f32) -> u32 {
    let mut key = u32::reinterpret(v) & 0x7FFF_FFFFu32;
    if key > 0x7F80_0000u32 {
        key = 0u32;
    }
    key
}

/// Pass 1: `partial[r, cb] = max |x[r, c]|` (as [`abs_key`] bits) over the columns `c` of
/// column block `cb` (`b1` columns, the last one partial) for `x [rows, cols]`,
/// `partial [rows, gc]`.
#[cube(launch)]
pub(super) fn row_amax_kernel(
    x: &Tensor<f32>,
    partial: &mut Tensor<u32>,
    cols: u32,
    b1: u32,
    gc: u32,
) {
    let pos = ABSOLUTE_POS;
    if pos >= partial.len() {
        terminate!();
    }
    let cols = cols as usize;
    let b1 = b1 as usize;
    let gc = gc as usize;
    let r = pos / gc;
    let c0 = (pos % gc) * b1;
    let mut c1 = c0 + b1;
    if c1 > cols {
        c1 = cols;
    }
    let mut amax = 0u32;
    for c in c0..c1 {
        let key = abs_key(x[r * cols + c]);
        if key > amax {
            amax = key;
        }
    }
    partial[pos] = amax;
}

/// Pass 2: per block `(rb, cb)` the max of `partial[r, cb]` over the rows
/// `row_starts[rb]..row_starts[rb + 1]` of row block `rb`, then the block's
/// `scale = compute_scale_from_amax(amax, fmax, pow2, 0)` and `scale_inv = 1 / scale`
/// (`scales`, `scale_invs`: `[num_row_blocks, gc]`).
#[cube(launch)]
pub(super) fn block_scale_kernel(
    partial: &Tensor<u32>,
    row_starts: &Tensor<u32>,
    scales: &mut Tensor<f32>,
    scale_invs: &mut Tensor<f32>,
    gc: u32,
    fmax: f32,
    pow2: u32,
) {
    let pos = ABSOLUTE_POS;
    if pos >= scales.len() {
        terminate!();
    }
    let gc = gc as usize;
    let rb = pos / gc;
    let cb = pos % gc;
    let r0 = row_starts[rb] as usize;
    let r1 = row_starts[rb + 1] as usize;
    let mut amax = 0u32;
    for r in r0..r1 {
        let v = partial[r * gc + cb];
        if v > amax {
            amax = v;
        }
    }
    // Zero and infinite amax: scale 1 (compute_scale_from_amax).
    let mut scale = 1.0f32;
    if amax != 0u32 && amax < 0x7F80_0000u32 {
        scale = fmax / f32::reinterpret(amax);
        if u32::reinterpret(scale) >= 0x7F80_0000u32 {
            // +inf (a subnormal amax): f32::MAX.
            scale = f32::reinterpret(0x7F7F_FFFFu32);
        }
        if pow2 != 0u32 {
            // 2^floor(log2(scale)): the exponent bits alone. The scale is always normal here
            // (fmax >= 448 and amax <= f32::MAX give scale > 2^-126), the host's only case.
            scale = f32::reinterpret(u32::reinterpret(scale) & 0xFF80_0000u32);
        }
    }
    scales[pos] = scale;
    scale_invs[pos] = 1.0f32 / scale;
}

/// `decode(encode(v))` for a 1.E.M FP8 format with `m_bits` mantissa bits and exponent bias
/// `bias` whose largest finite code is `max_code`: the host encoder of `fp8/formats.rs`
/// (round to nearest even, saturating, sign kept on underflow) followed by the exact decoding
/// of the code. NaN stays NaN.
#[cube]
pub(super) fn fp8_round_trip(v: f32, m_bits: u32, bias: u32, max_code: u32) -> f32 {
    let bits = u32::reinterpret(v);
    let sign = bits & 0x8000_0000u32;
    let abs = bits & 0x7FFF_FFFFu32;
    let mut result = v;
    if abs <= 0x7F80_0000u32 {
        let mut code = if abs < ((128u32 - bias) << 23u32) {
            // Subnormal range: adding 2^(23 + 1 - bias - M), whose f32 ulp is the FP8
            // subnormal step, rounds |v| to that step (RNE by the f32 addition).
            let magic = (151u32 - bias - m_bits) << 23u32;
            u32::reinterpret(f32::reinterpret(abs) + f32::reinterpret(magic)) - magic
        } else {
            // Normal range: rebias the exponent, round the dropped mantissa bits to even; a
            // carry moves into the exponent.
            let shift = 23u32 - m_bits;
            let rebased = abs - ((127u32 - bias) << 23u32);
            let round = ((1u32 << (shift - 1u32)) - 1u32) + ((abs >> shift) & 1u32);
            (rebased + round) >> shift
        };
        // Codes past the largest finite one (incl. +-inf) saturate.
        if code > max_code {
            code = max_code;
        }
        // Exact decoding of the (finite) code.
        let e = code >> m_bits;
        let man = code & ((1u32 << m_bits) - 1u32);
        let mag = if e == 0u32 {
            f32::cast_from(man) * f32::reinterpret((128u32 - bias - m_bits) << 23u32)
        } else {
            f32::reinterpret(((e + 127u32 - bias) << 23u32) | (man << (23u32 - m_bits)))
        };
        result = f32::reinterpret(u32::reinterpret(mag) | sign);
    }
    result
}

/// Pass 3: `out[r, c] = decode(encode(x[r, c] · scale)) · scale_inv` with the scale of the
/// element's block (`row_block[r] · gc + c / b1`), for `x, out [rows, cols]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn fake_quant_kernel(
    x: &Tensor<f32>,
    row_block: &Tensor<u32>,
    scales: &Tensor<f32>,
    scale_invs: &Tensor<f32>,
    out: &mut Tensor<f32>,
    cols: u32,
    b1: u32,
    gc: u32,
    m_bits: u32,
    bias: u32,
    max_code: u32,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let cols = cols as usize;
    let r = pos / cols;
    let c = pos % cols;
    let blk = row_block[r] as usize * gc as usize + c / b1 as usize;
    let v = x[pos] * scales[blk];
    out[pos] = fp8_round_trip(v, m_bits, bias, max_code) * scale_invs[blk];
}
