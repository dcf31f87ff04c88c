//! Exact scalar decoding of the 8-bit float formats and f32 ↔ bf16.
//!
//! FP8 formats (docs/fp8.md §Formats, docs/checkpoints.md §FP8 release format):
//! - `F8_E4M3` = torch `float8_e4m3fn` and `F8_E5M2`: moe-backend's exact decode tables
//!   ([`moe_backend::fp8`]);
//! - `F8_E8M0`: unsigned power of two `2^(x−127)`, `0xFF` is NaN (moe-backend has no E8M0
//!   codec, so it is decoded here).
//!
//! bf16 is [`half::bf16`] (round to nearest even, NaN stays a quiet NaN).

use half::bf16;

pub use moe_backend::fp8::{e4m3_to_f32 as f8_e4m3_to_f32, e5m2_to_f32 as f8_e5m2_to_f32};

/// Exact value of an `F8_E8M0` byte (a power of two, or NaN for `0xFF`).
pub fn f8_e8m0_to_f32(b: u8) -> f32 {
    match b {
        0xFF => f32::NAN,
        // 2^-127 is an f32 subnormal: the top mantissa bit.
        0 => f32::from_bits(1 << 22),
        _ => f32::from_bits(u32::from(b) << 23),
    }
}

/// Bits of `x` rounded once to bf16, round-to-nearest-even (NaN stays a quiet NaN).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// The f32 value of bf16 bits (exact; a signalling NaN comes back quiet).
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    bf16::from_bits(bits).to_f32()
}

/// Number of NaN or infinite elements in `bytes` (little-endian elements of `dtype`); 0 for
/// integer and boolean dtypes. `F8_E8M0` scales count their NaN code `0xFF`.
pub fn count_non_finite(dtype: super::Dtype, bytes: &[u8]) -> usize {
    use super::Dtype;
    fn count<const N: usize>(bytes: &[u8], bad: impl Fn([u8; N]) -> bool) -> usize {
        bytes
            .chunks_exact(N)
            .filter(|c| {
                let mut b = [0u8; N];
                b.copy_from_slice(c);
                bad(b)
            })
            .count()
    }
    match dtype {
        Dtype::F32 => count(bytes, |b| !f32::from_le_bytes(b).is_finite()),
        Dtype::F64 => count(bytes, |b| !f64::from_le_bytes(b).is_finite()),
        Dtype::BF16 => count(bytes, |b| {
            !bf16::from_bits(u16::from_le_bytes(b)).is_finite()
        }),
        Dtype::F16 => count(bytes, |b| {
            !half::f16::from_bits(u16::from_le_bytes(b)).is_finite()
        }),
        Dtype::F8E4M3 => count(bytes, |[b]: [u8; 1]| !f8_e4m3_to_f32(b).is_finite()),
        Dtype::F8E5M2 => count(bytes, |[b]: [u8; 1]| !f8_e5m2_to_f32(b).is_finite()),
        Dtype::F8E8M0 => count(bytes, |[b]: [u8; 1]| b == 0xFF),
        Dtype::Bool
        | Dtype::U8
        | Dtype::I8
        | Dtype::I16
        | Dtype::U16
        | Dtype::I32
        | Dtype::U32
        | Dtype::I64
        | Dtype::U64 => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_elements_are_counted_in_every_float_dtype() {
        use crate::safetensors::Dtype;
        let f32s: Vec<u8> = [1.0f32, f32::NAN, f32::INFINITY, -0.0, f32::NEG_INFINITY]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(Dtype::F32, &f32s), 3);
        let f64s: Vec<u8> = [f64::NAN, 2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(Dtype::F64, &f64s), 1);
        // bf16: 0x7F80 = +inf, 0x7FC0 = NaN, 0x3F80 = 1.0.
        let bf: Vec<u8> = [0x7F80u16, 0x7FC0, 0x3F80]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(Dtype::BF16, &bf), 2);
        // f16: 0x7C00 = +inf, 0x3C00 = 1.0.
        let f16s: Vec<u8> = [0x7C00u16, 0x3C00]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(count_non_finite(Dtype::F16, &f16s), 1);
        // E4M3 has two NaN codes and no infinity; E5M2 0x7C = +inf, 0x7E = NaN.
        assert_eq!(
            count_non_finite(Dtype::F8E4M3, &[0x7F, 0xFF, 0x7E, 0x00]),
            2
        );
        assert_eq!(count_non_finite(Dtype::F8E5M2, &[0x7C, 0x7E, 0x3C]), 2);
        assert_eq!(count_non_finite(Dtype::F8E8M0, &[0xFF, 0x7F]), 1);
        assert_eq!(count_non_finite(Dtype::I64, &[0xFF; 16]), 0);
    }

    #[test]
    fn e4m3_known_values() {
        assert_eq!(f8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(f8_e4m3_to_f32(0xB8), -1.0);
        assert_eq!(f8_e4m3_to_f32(0x7E), 448.0);
        assert_eq!(f8_e4m3_to_f32(0xFE), -448.0);
        assert_eq!(f8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(f8_e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(f8_e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(f8_e4m3_to_f32(0x40), 2.0);
        assert_eq!(f8_e4m3_to_f32(0x3C), 1.5);
        assert_eq!(f8_e4m3_to_f32(0x00), 0.0);
        assert!(f8_e4m3_to_f32(0x80) == 0.0 && f8_e4m3_to_f32(0x80).is_sign_negative());
        assert!(f8_e4m3_to_f32(0x7F).is_nan() && f8_e4m3_to_f32(0xFF).is_nan());
        // Exactly two NaN codes and no infinities.
        let nans = (0..=255u8).filter(|&b| f8_e4m3_to_f32(b).is_nan()).count();
        assert_eq!(nans, 2);
        assert!((0..=255u8).all(|b| !f8_e4m3_to_f32(b).is_infinite()));
    }

    #[test]
    fn e4m3_is_monotonic_on_positive_codes() {
        let values: Vec<f32> = (0..0x7Fu8).map(f8_e4m3_to_f32).collect();
        assert!(values.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn e5m2_known_values() {
        assert_eq!(f8_e5m2_to_f32(0x3C), 1.0);
        assert_eq!(f8_e5m2_to_f32(0x7B), 57344.0);
        assert_eq!(f8_e5m2_to_f32(0x01), 2f32.powi(-16));
        assert_eq!(f8_e5m2_to_f32(0x04), 2f32.powi(-14));
        assert_eq!(f8_e5m2_to_f32(0x7C), f32::INFINITY);
        assert_eq!(f8_e5m2_to_f32(0xFC), f32::NEG_INFINITY);
        assert!(f8_e5m2_to_f32(0x7D).is_nan());
        // E5M2 is the top byte of an f16.
        for b in 0..=255u8 {
            let h = half::f16::from_bits(u16::from(b) << 8).to_f32();
            let v = f8_e5m2_to_f32(b);
            assert!(v == h || (v.is_nan() && h.is_nan()), "{b:#x}");
        }
    }

    #[test]
    fn e8m0_values() {
        assert_eq!(f8_e8m0_to_f32(127), 1.0);
        assert_eq!(f8_e8m0_to_f32(128), 2.0);
        assert_eq!(f8_e8m0_to_f32(0), 2f32.powi(-127));
        assert_eq!(f8_e8m0_to_f32(254), 2f32.powi(127));
        assert!(f8_e8m0_to_f32(255).is_nan());
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 lies exactly halfway between two bf16 values and ties down to the even one;
        // 1 + 3·2^-8 is halfway too and ties up.
        assert_eq!(f32_to_bf16_bits(1.0 + 2f32.powi(-8)), 0x3F80);
        assert_eq!(f32_to_bf16_bits(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
        assert_eq!(f32_to_bf16_bits(f32::MAX), 0x7F80); // rounds up to +inf
        assert!(bf16_bits_to_f32(f32_to_bf16_bits(f32::NAN)).is_nan());
        assert_eq!(bf16_bits_to_f32(0x3F80), 1.0);
        assert_eq!(bf16_bits_to_f32(0xC000), -2.0);
    }
}
