//! f32 → `F8_E4M3` (`float8_e4m3fn`) encoding: round to nearest even, saturating to ±448
//! (docs/fp8.md §Formats; the encoder lives in `moe_backend::fp8`; these tests check it against the
//! decoding tables of this crate's safetensors reader).

pub use moe_backend::fp8::{E4M3_MAX, f32_to_e4m3};

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
    fn rounds_to_nearest_even_and_saturates() {
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
        // Beyond the 464 midpoint finite values saturate (docs/fp8.md §Formats), never NaN.
        assert_eq!(f32_to_e4m3(464.1), 0x7E);
        assert_eq!(f32_to_e4m3(1e6), 0x7E);
        assert_eq!(f32_to_e4m3(-1e6), 0xFE);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7E);
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
