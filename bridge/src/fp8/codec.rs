//! f32 → `F8_E4M3` (`float8_e4m3fn`) encoding, bit-identical to PyTorch's conversion.

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::elem::f8_e4m3_to_f32;

    #[test]
    fn every_finite_code_round_trips() {
        for b in 0..=255u8 {
            let v = f8_e4m3_to_f32(b);
            if v.is_nan() {
                assert_eq!(f32_to_e4m3(v) & 0x7F, 0x7F);
                continue;
            }
            assert_eq!(f32_to_e4m3(v), b, "{b:#04x} = {v}");
        }
    }

    #[test]
    fn rounds_to_nearest_even_and_overflows_to_nan() {
        // Halfway between 1.0 (0x38) and 1.125 (0x39): ties to the even code 0x38.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        // Halfway between 1.125 (0x39) and 1.25 (0x3A): ties to 0x3A.
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        assert_eq!(f32_to_e4m3(1.07), 0x39);
        assert_eq!(f32_to_e4m3(-1.07), 0xB9);
        // Subnormals: step 2^-9; half a step rounds to even (0).
        assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0x00);
        assert_eq!(f32_to_e4m3(3.0 * 2f32.powi(-10)), 0x02);
        assert_eq!(f32_to_e4m3(450.0), 0x7E);
        assert_eq!(f32_to_e4m3(463.9), 0x7E);
        assert_eq!(f32_to_e4m3(464.0), 0x7E);
        assert_eq!(f32_to_e4m3(464.1), 0x7F);
        assert_eq!(f32_to_e4m3(1e6), 0x7F);
        assert_eq!(f32_to_e4m3(-1e6), 0xFF);
        assert_eq!(f32_to_e4m3(f32::NAN) & 0x7F, 0x7F);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
    }

    #[test]
    fn nearest_code_by_exhaustive_search() {
        // Compare with the nearest representable value (ties to even code) on a sweep.
        let finite: Vec<(u8, f32)> = (0..0x7Fu8).map(|b| (b, f8_e4m3_to_f32(b))).collect();
        let mut x = 0.0f32;
        while x < 448.0 {
            let best = finite
                .iter()
                .min_by(|(ba, a), (bb, b)| {
                    let (da, db) = ((a - x).abs(), (b - x).abs());
                    da.total_cmp(&db).then((ba & 1).cmp(&(bb & 1)))
                })
                .map(|(b, _)| *b);
            assert_eq!(Some(f32_to_e4m3(x)), best, "{x}");
            x = x * 1.01 + 1e-4;
        }
    }
}
