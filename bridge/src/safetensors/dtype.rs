//! Element types of safetensors tensors: the subset of the `safetensors` crate's
//! [`Dtype`](::safetensors::Dtype) that this crate converts.

use std::fmt;

use ::safetensors::Dtype as St;

/// A safetensors dtype this crate reads: every byte-sized dtype of the `safetensors` crate's
/// [`Dtype`](::safetensors::Dtype) but `C64` and the FNUZ FP8 variants (sub-byte formats such as
/// `F4` are not accepted either). Converts to and from the crate's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// `BOOL`, one byte per element.
    Bool,
    /// `U8`.
    U8,
    /// `I8`.
    I8,
    /// `F8_E5M2` (torch `float8_e5m2`).
    F8E5M2,
    /// `F8_E4M3` (torch `float8_e4m3fn`).
    F8E4M3,
    /// `F8_E8M0` (power-of-two scales).
    F8E8M0,
    /// `I16`.
    I16,
    /// `U16`.
    U16,
    /// `F16`.
    F16,
    /// `BF16`.
    BF16,
    /// `I32`.
    I32,
    /// `U32`.
    U32,
    /// `F32`.
    F32,
    /// `F64`.
    F64,
    /// `I64`.
    I64,
    /// `U64`.
    U64,
}

impl Dtype {
    /// Every accepted dtype.
    pub const ALL: [Dtype; 16] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E5M2,
        Dtype::F8E4M3,
        Dtype::F8E8M0,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        St::from(self).bitsize() / 8
    }

    /// The header spelling, e.g. `"F8_E4M3"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Parses the header spelling; `None` for anything not accepted.
    pub fn from_header_str(s: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.as_str() == s)
    }

    /// Whether this is one of the 8-bit float formats.
    pub fn is_fp8(self) -> bool {
        matches!(self, Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::F8E8M0)
    }
}

impl From<Dtype> for St {
    fn from(d: Dtype) -> St {
        match d {
            Dtype::Bool => St::BOOL,
            Dtype::U8 => St::U8,
            Dtype::I8 => St::I8,
            Dtype::F8E5M2 => St::F8_E5M2,
            Dtype::F8E4M3 => St::F8_E4M3,
            Dtype::F8E8M0 => St::F8_E8M0,
            Dtype::I16 => St::I16,
            Dtype::U16 => St::U16,
            Dtype::F16 => St::F16,
            Dtype::BF16 => St::BF16,
            Dtype::I32 => St::I32,
            Dtype::U32 => St::U32,
            Dtype::F32 => St::F32,
            Dtype::F64 => St::F64,
            Dtype::I64 => St::I64,
            Dtype::U64 => St::U64,
        }
    }
}

impl TryFrom<St> for Dtype {
    /// The crate's dtype, which this crate does not read.
    type Error = St;

    fn try_from(d: St) -> Result<Dtype, St> {
        Dtype::ALL
            .into_iter()
            .find(|&ours| St::from(ours) == d)
            .ok_or(d)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip_and_sizes() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_header_str(d.as_str()), Some(d));
        }
        assert_eq!(Dtype::from_header_str("F8_E4M3").map(Dtype::size), Some(1));
        assert_eq!(Dtype::BF16.size(), 2);
        assert!(Dtype::F8E8M0.is_fp8() && !Dtype::U8.is_fp8());
        for bad in ["F4", "F6_E2M3", "f32", "", "Q8"] {
            assert_eq!(Dtype::from_header_str(bad), None, "{bad}");
        }
        // The crate's spelling and size agree with ours; its other dtypes are refused.
        for d in Dtype::ALL {
            assert_eq!(St::from(d).to_string(), d.as_str());
            assert_eq!(Dtype::try_from(St::from(d)), Ok(d));
        }
        for other in [St::F4, St::F6_E2M3, St::C64, St::F8_E4M3FNUZ] {
            assert_eq!(Dtype::try_from(other), Err(other));
        }
    }
}
