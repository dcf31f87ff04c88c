//! Exact scalar decoding of the 8-bit float formats and f32 → bf16/f16 rounding.
//!
//! FP8 formats (fp8.md, checkpoints.md §2):
//! - `F8_E4M3` = torch `float8_e4m3fn`: bias 7, no infinities, `S.1111.111` is NaN, max 448;
//! - `F8_E5M2` = torch `float8_e5m2`: bias 15, IEEE-like (inf and NaN at exponent 31), max 57344;
//! - `F8_E8M0`: unsigned power of two `2^(x−127)`, `0xFF` is NaN.
//!
//! Every FP8 value is exactly representable in f32, so decoding is exact (it goes through lookup
//! tables built at compile time).

/// `2^e` for `−149 ≤ e ≤ 127`, built from bits (exact, usable in `const fn`).
const fn pow2(e: i32) -> f32 {
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        // Subnormal f32: a single mantissa bit.
        f32::from_bits(1u32 << (e + 149))
    }
}

const fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0x0F) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0F && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * pow2(-9)
    } else {
        sign * (8.0 + man) * pow2(exp - 7 - 3)
    }
}

const fn e5m2(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 2) & 0x1F) as i32;
    let man = (b & 0x03) as f32;
    if exp == 0x1F {
        return if b & 0x03 == 0 {
            sign * f32::INFINITY
        } else {
            f32::NAN
        };
    }
    if exp == 0 {
        sign * man * pow2(-16)
    } else {
        sign * (4.0 + man) * pow2(exp - 15 - 2)
    }
}

const fn e8m0(b: u8) -> f32 {
    if b == 0xFF {
        f32::NAN
    } else {
        pow2(b as i32 - 127)
    }
}

/// Builds a 256-entry decode table (a macro because `const fn` cannot call fn pointers).
macro_rules! decode_table {
    ($f:ident) => {{
        let mut out = [0.0f32; 256];
        let mut i = 0;
        while i < 256 {
            out[i] = $f(i as u8);
            i += 1;
        }
        out
    }};
}

static E4M3_TABLE: [f32; 256] = decode_table!(e4m3);
static E5M2_TABLE: [f32; 256] = decode_table!(e5m2);
static E8M0_TABLE: [f32; 256] = decode_table!(e8m0);

/// Exact value of an `F8_E4M3` (`float8_e4m3fn`) byte.
pub fn f8_e4m3_to_f32(b: u8) -> f32 {
    E4M3_TABLE[b as usize]
}

/// Exact value of an `F8_E5M2` byte.
pub fn f8_e5m2_to_f32(b: u8) -> f32 {
    E5M2_TABLE[b as usize]
}

/// Exact value of an `F8_E8M0` byte (a power of two, or NaN for `0xFF`).
pub fn f8_e8m0_to_f32(b: u8) -> f32 {
    E8M0_TABLE[b as usize]
}

/// Bits of `x` rounded once to bf16, round-to-nearest-even (NaN stays a quiet NaN).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// The f32 value of bf16 bits (exact).
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::bf16;

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
            let h = burn::tensor::f16::from_bits(u16::from(b) << 8).to_f32();
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
    fn bf16_rounding_matches_half() {
        // 1 + 2^-8 lies exactly halfway between two bf16 values and ties down to the even one;
        // 1 + 3·2^-8 is halfway too and ties up.
        let tie_down = 1.0 + 2f32.powi(-8);
        let tie_up = 1.0 + 3.0 * 2f32.powi(-8);
        let samples = [
            0.0f32,
            -0.0,
            1.0,
            tie_down,
            tie_up,
            std::f32::consts::PI,
            -std::f32::consts::E,
            1e-40,
            f32::MAX,
            f32::INFINITY,
            f32::MIN_POSITIVE,
        ];
        for x in samples {
            assert_eq!(f32_to_bf16_bits(x), bf16::from_f32(x).to_bits(), "{x}");
        }
        assert_eq!(f32_to_bf16_bits(tie_down), 0x3F80);
        assert_eq!(f32_to_bf16_bits(tie_up), 0x3F82);
        assert!(bf16_bits_to_f32(f32_to_bf16_bits(f32::NAN)).is_nan());
        assert_eq!(bf16_bits_to_f32(0x3F80), 1.0);
    }
}
