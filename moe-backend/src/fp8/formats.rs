//! FP8 formats (docs/fp8.md §Formats): `F8_E4M3` (`float8_e4m3fn`) and `F8_E5M2` codecs.
//!
//! | format | layout | bias | max finite | inf | NaN | min normal / subnormal |
//! |---|---|---|---|---|---|---|
//! | E4M3 (fn) | s.eeee.mmm | 7 | 448 (`0x7E`) | none | `0x7F`, `0xFF` | 2⁻⁶ / 2⁻⁹ |
//! | E5M2 | s.eeeee.mm | 15 | 57344 (`0x7B`) | `0x7C`, `0xFC` | `0x7D–0x7F`, `0xFD–0xFF` | 2⁻¹⁴ / 2⁻¹⁶ |
//!
//! **Decoding** is exact (a 256-entry table built from the format definition at compile time).
//!
//! **Encoding** rules (both formats):
//! - round to nearest, ties to even (the even code), in the normal and the subnormal range;
//!   magnitudes below half the smallest subnormal become ±0 (the sign is kept);
//! - finite values whose rounding would leave the finite range **saturate** to ±max (E4M3:
//!   `|x| > 464`, the midpoint above 448; E5M2: `|x| ≥ 61440`, the midpoint above 57344, which
//!   ties to the infinity code) — a finite input never gives NaN or infinity;
//! - ±inf saturates to ±max as well (E5M2 included: docs/fp8.md §Formats lets the E5M2 encoder
//!   saturate like E4M3; this is CUDA's `__NV_SATFINITE` rule);
//! - NaN gives NaN with the input's sign (E4M3 `0x7F`/`0xFF`, E5M2 `0x7E`/`0xFE`).
//!
//! Within the scaling of docs/fp8.md §Scaling (`|x · scale| ≤ max` up to f32 rounding) saturating
//! and non-saturating encoders produce the same bytes.

use burn::config::Config;

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Largest finite E5M2 value.
pub const E5M2_MAX: f32 = 57344.0;

/// An 8-bit float format.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    /// `F8_E4M3` / `float8_e4m3fn`: 4 exponent bits (bias 7), 3 mantissa bits, no infinities.
    E4M3,
    /// `F8_E5M2`: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like infinities and NaNs.
    E5M2,
}

impl Fp8Format {
    /// Largest finite value (448 or 57344), the `fp8_max` of the scaling math.
    pub const fn max(self) -> f32 {
        match self {
            Self::E4M3 => E4M3_MAX,
            Self::E5M2 => E5M2_MAX,
        }
    }

    /// Encodes `x` with the rules of the module docs.
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Self::E4M3 => f32_to_e4m3(x),
            Self::E5M2 => f32_to_e5m2(x),
        }
    }

    /// Decodes a byte exactly.
    #[inline]
    pub fn decode(self, byte: u8) -> f32 {
        self.decode_table()[byte as usize]
    }

    /// The exact value of every code, indexed by the byte.
    pub fn decode_table(self) -> &'static [f32; 256] {
        match self {
            Self::E4M3 => &E4M3_TABLE,
            Self::E5M2 => &E5M2_TABLE,
        }
    }
}

/// Round-to-nearest-even encoder for a 1.E.M format with `M` mantissa bits and exponent
/// `BIAS`; codes above `max_code` saturate to it, NaN gives `nan_code`.
#[inline(always)]
fn encode<const M: u32, const BIAS: u32>(x: f32, max_code: u32, nan_code: u8) -> u8 {
    // Branch-free (both roundings are computed and one is selected), so loops over slices
    // vectorise.
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    // f32 bits of the smallest normal FP8 magnitude 2^(1 - BIAS).
    let min_normal = (128 - BIAS) << 23;
    // Subnormal range: adding 2^(23 + 1 - BIAS - M), whose f32 ulp is the FP8 subnormal step,
    // rounds |x| to a multiple of that step (RNE, by the f32 addition); the low bits are then
    // the code.
    let magic = (151 - BIAS - M) << 23;
    let subnormal = (f32::from_bits(abs) + f32::from_bits(magic))
        .to_bits()
        .wrapping_sub(magic);
    // Normal range: rebias the exponent and round the dropped mantissa bits to even; a carry
    // moves into the exponent, and codes past the largest finite one (incl. ±inf) saturate.
    let shift = 23 - M;
    let rebased = abs.wrapping_sub((127 - BIAS) << 23);
    let normal = rebased.wrapping_add(((1 << (shift - 1)) - 1) + ((abs >> shift) & 1)) >> shift;
    let code = if abs < min_normal { subnormal } else { normal }.min(max_code);
    let code = if abs > 0x7F80_0000 {
        nan_code as u32
    } else {
        code
    };
    code as u8 | sign
}

/// Encodes `x` as an `F8_E4M3` (`float8_e4m3fn`) byte: round to nearest even, saturating to
/// ±448 (finite inputs and ±inf), NaN → `0x7F` with the input's sign (docs/fp8.md §Formats).
#[inline(always)]
pub fn f32_to_e4m3(x: f32) -> u8 {
    encode::<3, 7>(x, 0x7E, 0x7F)
}

/// Encodes `x` as an `F8_E5M2` byte: round to nearest even, saturating to ±57344 (finite
/// inputs and ±inf), NaN → `0x7E` with the input's sign (docs/fp8.md §Formats).
#[inline(always)]
pub fn f32_to_e5m2(x: f32) -> u8 {
    encode::<2, 15>(x, 0x7B, 0x7E)
}

/// The exact value of an `F8_E4M3` byte (`0x7F`/`0xFF` are NaN).
#[inline]
pub fn e4m3_to_f32(byte: u8) -> f32 {
    E4M3_TABLE[byte as usize]
}

/// The exact value of an `F8_E5M2` byte (`0x7C`/`0xFC` are ±inf, `0x7D–0x7F`/`0xFD–0xFF` NaN).
#[inline]
pub fn e5m2_to_f32(byte: u8) -> f32 {
    E5M2_TABLE[byte as usize]
}

/// Decoding table of a 1.E.M format with `m_bits` mantissa bits (`7 - m_bits` exponent bits)
/// and exponent bias `bias`. `fn_variant`: the all-ones exponent is finite except for the
/// all-ones mantissa (NaN), as in E4M3fn; otherwise it holds ±inf (mantissa 0) and NaNs.
const fn decode_table(m_bits: u32, bias: u32, fn_variant: bool) -> [f32; 256] {
    let mut table = [0f32; 256];
    let e_max = (1u32 << (7 - m_bits)) - 1;
    let m_mask = (1u32 << m_bits) - 1;
    let mut b = 0usize;
    while b < 256 {
        let code = b as u32;
        let e = (code >> m_bits) & e_max;
        let m = code & m_mask;
        let magnitude = if e == 0 {
            // Subnormal: m · 2^(1 - bias - m_bits).
            (m as f32) * f32::from_bits((128 - bias - m_bits) << 23)
        } else if e == e_max && (!fn_variant || m == m_mask) {
            if !fn_variant && m == 0 {
                f32::INFINITY
            } else {
                f32::NAN
            }
        } else {
            // Normal: 2^(e - bias) · (1 + m / 2^m_bits), exactly an f32 bit pattern.
            f32::from_bits(((e + 127 - bias) << 23) | (m << (23 - m_bits)))
        };
        table[b] = f32::from_bits(magnitude.to_bits() | ((code >> 7) << 31));
        b += 1;
    }
    table
}

static E4M3_TABLE: [f32; 256] = decode_table(3, 7, true);
static E5M2_TABLE: [f32; 256] = decode_table(2, 15, false);

#[cfg(test)]
mod tests {
    use super::*;

    /// Independent reference (the formulas of docs/fp8.md §Formats, in f64): sign, exponent and
    /// mantissa fields, `(−1)^s · 2^(e−bias) · (1 + m/2^M)` for normals, `2^(1−bias) · m/2^M` for
    /// subnormals.
    fn reference(byte: u8, format: Fp8Format) -> f64 {
        let (m_bits, bias) = match format {
            Fp8Format::E4M3 => (3, 7),
            Fp8Format::E5M2 => (2, 15),
        };
        let s = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((byte & 0x7F) >> m_bits);
        let m = f64::from(byte & ((1 << m_bits) - 1));
        let frac = m / f64::from(1u32 << m_bits);
        match format {
            Fp8Format::E4M3 if byte & 0x7F == 0x7F => f64::NAN,
            Fp8Format::E5M2 if e == 31 && m == 0.0 => s * f64::INFINITY,
            Fp8Format::E5M2 if e == 31 => f64::NAN,
            _ if e == 0 => s * 2f64.powi(1 - bias) * frac,
            _ => s * 2f64.powi(e - bias) * (1.0 + frac),
        }
    }

    fn same(a: f64, b: f32) -> bool {
        (a.is_nan() && b.is_nan())
            || (a == f64::from(b) && a.is_sign_negative() == b.is_sign_negative())
    }

    #[test]
    fn all_256_codes_decode_as_the_format_definition_and_the_float8_crate() {
        for b in 0..=255u8 {
            for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                let got = format.decode(b);
                assert!(
                    same(reference(b, format), got),
                    "{format:?} {b:#04x}: {got}"
                );
            }
            let crate_e4m3 = float8::F8E4M3::from_bits(b).to_f32();
            let crate_e5m2 = float8::F8E5M2::from_bits(b).to_f32();
            assert!(same(f64::from(crate_e4m3), e4m3_to_f32(b)) || crate_e4m3.is_nan());
            assert!(same(f64::from(crate_e5m2), e5m2_to_f32(b)) || crate_e5m2.is_nan());
            assert_eq!(crate_e4m3.is_nan(), e4m3_to_f32(b).is_nan(), "{b:#04x}");
            assert_eq!(crate_e5m2.is_nan(), e5m2_to_f32(b).is_nan(), "{b:#04x}");
        }
        // The table of docs/fp8.md §Formats.
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e5m2_to_f32(0x7B), 57344.0);
        assert_eq!(e5m2_to_f32(0xFC), f32::NEG_INFINITY);
        assert_eq!(e5m2_to_f32(0x04), 2f32.powi(-14));
        assert_eq!(e5m2_to_f32(0x01), 2f32.powi(-16));
        assert_eq!(
            Fp8Format::E4M3.max(),
            reference(0x7E, Fp8Format::E4M3) as f32
        );
        assert_eq!(
            Fp8Format::E5M2.max(),
            reference(0x7B, Fp8Format::E5M2) as f32
        );
    }

    /// Every finite code encodes to itself; every midpoint between adjacent finite codes
    /// (exact in f32: 5 significant bits) goes to the even code, and one f32 ulp either side
    /// of it goes to the nearer code. Covers the subnormal range, the normal range, the
    /// subnormal/normal boundary and the sign.
    #[test]
    fn encoding_is_exact_on_codes_and_rounds_exhaustive_midpoints_to_even() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let max_code = if format == Fp8Format::E4M3 {
                0x7E
            } else {
                0x7B
            };
            for sign in [0u8, 0x80] {
                for c in 0..=max_code {
                    let code = c | sign;
                    let v = reference(code, format) as f32;
                    assert_eq!(format.encode(v), code, "{format:?} {code:#04x} = {v}");
                    if c == max_code {
                        continue;
                    }
                    let next = reference(c + 1, format) as f32 * if sign == 0 { 1.0 } else { -1.0 };
                    let mid = (f64::from(v) + f64::from(next)) / 2.0;
                    assert_eq!(mid as f32 as f64, mid, "midpoint not exact");
                    let mid = mid as f32;
                    let even = if c % 2 == 0 { c } else { c + 1 } | sign;
                    assert_eq!(format.encode(mid), even, "{format:?} tie {mid}");
                    let toward_v = f32::from_bits(mid.to_bits() - 1);
                    let toward_next = f32::from_bits(mid.to_bits() + 1);
                    assert_eq!(format.encode(toward_v), code, "{format:?} below {mid}");
                    assert_eq!(
                        format.encode(toward_next),
                        (c + 1) | sign,
                        "{format:?} above {mid}"
                    );
                }
            }
        }
    }

    #[test]
    fn saturates_finite_and_infinite_inputs_and_keeps_nan() {
        let up = |x: f32| f32::from_bits(x.to_bits() + 1);
        // E4M3: (448, 464] rounds to 448 anyway; above 464 it would round to the NaN code.
        for x in [
            448.0,
            460.0,
            464.0,
            up(464.0),
            480.0,
            1e6,
            f32::MAX,
            f32::INFINITY,
        ] {
            assert_eq!(f32_to_e4m3(x), 0x7E, "{x}");
            assert_eq!(f32_to_e4m3(-x), 0xFE, "{}", -x);
        }
        // E5M2: 61440 is the tie between 57344 and the infinity code.
        for x in [57344.0, 61439.0, 61440.0, up(61440.0), 1e9, f32::INFINITY] {
            assert_eq!(f32_to_e5m2(x), 0x7B, "{x}");
            assert_eq!(f32_to_e5m2(-x), 0xFB, "{}", -x);
        }
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
        assert_eq!(f32_to_e4m3(-f32::NAN), 0xFF);
        assert!(e5m2_to_f32(f32_to_e5m2(f32::NAN)).is_nan());
        assert!(e5m2_to_f32(f32_to_e5m2(-f32::NAN)).is_nan());
        // Underflow keeps the sign; half the smallest subnormal ties to zero.
        assert_eq!(f32_to_e4m3(-1e-30), 0x80);
        assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0x00);
        assert_eq!(f32_to_e4m3(up(2f32.powi(-10))), 0x01);
        assert_eq!(f32_to_e5m2(2f32.powi(-17)), 0x00);
        assert_eq!(f32_to_e5m2(up(2f32.powi(-17))), 0x01);
    }

    /// The encoders equal the `float8` crate (CUDA `cuda_fp8.hpp` conversion with
    /// `__NV_SATFINITE`) on a sweep of f32 bit patterns across the whole range.
    #[test]
    fn encoders_match_the_float8_crate_on_an_f32_sweep() {
        let mut bits = 0u32;
        while let Some(next) = bits.checked_add(1021) {
            let x = f32::from_bits(bits);
            if !x.is_nan() {
                assert_eq!(
                    f32_to_e4m3(x),
                    float8::F8E4M3::from_f32(x).to_bits(),
                    "{x:e}"
                );
                assert_eq!(
                    f32_to_e5m2(x),
                    float8::F8E5M2::from_f32(x).to_bits(),
                    "{x:e}"
                );
            }
            bits = next;
        }
    }
}
