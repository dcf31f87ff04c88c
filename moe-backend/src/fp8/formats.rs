//! FP8 formats (fp8.md §1): f32 → `F8_E4M3` (`float8_e4m3fn`) encoding, bit-identical to
//! PyTorch's conversion (tested in `moe-bridge` against every code's decoding).

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Encodes `x` as an `F8_E4M3` byte, rounding to nearest even, as `torch.Tensor.to(
/// torch.float8_e4m3fn)` does (c10 `fp8e4m3fn_from_fp32_value`): magnitudes that round past 448
/// (> 464) and NaN become the NaN code `0x7F` (with the sign bit); there is no saturation.
pub fn f32_to_e4m3(x: f32) -> u8 {
    // |x| ≥ 480 (bits 1087 << 20): NaN.
    const FP8_MAX_BITS: u32 = 1087 << 20;
    // 2^14: adding it rounds |x| < 2^-6 to a multiple of 2^-9, the subnormal step.
    const DENORM_MASK: u32 = 141 << 23;
    // 2^-6, the smallest normal E4M3 magnitude.
    const MIN_NORMAL_BITS: u32 = 121 << 23;

    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    let code = if abs >= FP8_MAX_BITS {
        // Also covers NaN and infinities.
        0x7F
    } else if abs < MIN_NORMAL_BITS {
        let rounded = (f32::from_bits(abs) + f32::from_bits(DENORM_MASK)).to_bits();
        (rounded - DENORM_MASK) as u8
    } else {
        let mant_odd = (abs >> 20) & 1;
        // Rebias the exponent (127 → 7) and round the 20 dropped mantissa bits to even.
        let rebiased = abs
            .wrapping_add(((7u32).wrapping_sub(127)) << 23)
            .wrapping_add(0x7FFFF + mant_odd);
        (rebiased >> 20) as u8
    };
    code | sign
}
