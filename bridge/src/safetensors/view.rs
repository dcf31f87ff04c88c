//! Borrowed and owned tensors in safetensors form (dtype, shape, raw little-endian bytes) and
//! their conversions to `f32` and to Burn's [`TensorData`].

use std::path::Path;

use burn::tensor::{BoolStore, DType, TensorData};
use half::{bf16, f16};

use super::Dtype;
use super::elem::{f8_e4m3_to_f32, f8_e5m2_to_f32, f8_e8m0_to_f32};
use crate::BridgeError;

/// One tensor's bytes, borrowed from a mapped file or from caller memory.
///
/// The byte length always equals `product(shape) · dtype size` ([`TensorView::new`] checks it;
/// readers only hand out validated views).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorView<'a> {
    /// The file the tensor was read from (`<memory>` for caller data); used in errors.
    pub path: &'a Path,
    /// Tensor name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major); `[]` is a scalar.
    pub shape: &'a [usize],
    /// Raw little-endian element bytes.
    pub bytes: &'a [u8],
}

/// The path shown in errors about tensors that came from memory rather than a file.
pub const MEMORY: &str = "<memory>";

/// `product(shape) · size`, or `None` on overflow.
pub(crate) fn byte_len_of(dtype: Dtype, shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))?
        .checked_mul(dtype.size())
}

impl<'a> TensorView<'a> {
    /// A view over caller memory; fails when `bytes` does not hold exactly
    /// `product(shape) · dtype size` bytes.
    pub fn new(
        name: &'a str,
        dtype: Dtype,
        shape: &'a [usize],
        bytes: &'a [u8],
    ) -> Result<Self, BridgeError> {
        let path = Path::new(MEMORY);
        let expected = byte_len_of(dtype, shape).ok_or_else(|| BridgeError::ShapeOverflow {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            shape: shape.to_vec(),
        })?;
        if expected != bytes.len() {
            return Err(BridgeError::ByteLengthMismatch {
                path: path.to_path_buf(),
                tensor: name.to_owned(),
                dtype: dtype.to_string(),
                shape: shape.to_vec(),
                expected,
                actual: bytes.len(),
            });
        }
        Ok(Self {
            path,
            name,
            dtype,
            shape,
            bytes,
        })
    }

    /// Number of elements.
    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// An owned copy.
    pub fn to_owned_tensor(&self) -> OwnedTensor {
        OwnedTensor {
            name: self.name.to_owned(),
            dtype: self.dtype,
            shape: self.shape.to_vec(),
            bytes: self.bytes.to_vec(),
        }
    }

    /// Fails with [`BridgeError::DtypeMismatch`] (naming file and tensor) unless the dtype is
    /// `expected`.
    pub fn expect_dtype(&self, expected: Dtype) -> Result<(), BridgeError> {
        if self.dtype == expected {
            return Ok(());
        }
        Err(BridgeError::DtypeMismatch {
            path: self.path.to_path_buf(),
            tensor: self.name.to_owned(),
            expected: expected.to_string(),
            actual: self.dtype.to_string(),
        })
    }

    /// Fails with [`BridgeError::ShapeMismatch`] unless the shape is `expected`.
    pub fn expect_shape(&self, expected: &[usize]) -> Result<(), BridgeError> {
        if self.shape == expected {
            return Ok(());
        }
        Err(BridgeError::ShapeMismatch {
            path: self.path.to_path_buf(),
            tensor: self.name.to_owned(),
            expected: expected.to_vec(),
            actual: self.shape.to_vec(),
        })
    }

    /// Checks that the byte length matches dtype and shape (the fields are public, so a view
    /// built by hand may be inconsistent); conversions call this first.
    pub fn validate(&self) -> Result<(), BridgeError> {
        let expected =
            byte_len_of(self.dtype, self.shape).ok_or_else(|| BridgeError::ShapeOverflow {
                path: self.path.to_path_buf(),
                tensor: self.name.to_owned(),
                shape: self.shape.to_vec(),
            })?;
        if expected == self.bytes.len() {
            return Ok(());
        }
        Err(BridgeError::ByteLengthMismatch {
            path: self.path.to_path_buf(),
            tensor: self.name.to_owned(),
            dtype: self.dtype.to_string(),
            shape: self.shape.to_vec(),
            expected,
            actual: self.bytes.len(),
        })
    }

    fn conversion_error(&self, reason: &str) -> BridgeError {
        BridgeError::Conversion {
            path: self.path.to_path_buf(),
            tensor: self.name.to_owned(),
            dtype: self.dtype.to_string(),
            reason: reason.to_owned(),
        }
    }

    /// The values as `f32`.
    ///
    /// Exact for F32, BF16, F16 and every FP8 format, and for integers of magnitude ≤ 2^24; F64
    /// and larger integers are rounded to nearest. `BOOL` gives 0.0/1.0 (any other byte is an
    /// error).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, BridgeError> {
        self.validate()?;
        let b = self.bytes;
        Ok(match self.dtype {
            Dtype::F32 => le_chunks::<4>(b).map(f32::from_le_bytes).collect(),
            Dtype::F64 => le_chunks::<8>(b)
                .map(|c| f64::from_le_bytes(c) as f32)
                .collect(),
            Dtype::BF16 => le_chunks::<2>(b)
                .map(|c| bf16::from_bits(u16::from_le_bytes(c)).to_f32())
                .collect(),
            Dtype::F16 => le_chunks::<2>(b)
                .map(|c| f16::from_bits(u16::from_le_bytes(c)).to_f32())
                .collect(),
            Dtype::F8E4M3 => b.iter().map(|&x| f8_e4m3_to_f32(x)).collect(),
            Dtype::F8E5M2 => b.iter().map(|&x| f8_e5m2_to_f32(x)).collect(),
            Dtype::F8E8M0 => b.iter().map(|&x| f8_e8m0_to_f32(x)).collect(),
            Dtype::I8 => b.iter().map(|&x| f32::from(x as i8)).collect(),
            Dtype::U8 => b.iter().map(|&x| f32::from(x)).collect(),
            Dtype::Bool => self.bools()?.map(f32::from).collect(),
            Dtype::I16 => le_chunks::<2>(b)
                .map(|c| f32::from(i16::from_le_bytes(c)))
                .collect(),
            Dtype::U16 => le_chunks::<2>(b)
                .map(|c| f32::from(u16::from_le_bytes(c)))
                .collect(),
            Dtype::I32 => le_chunks::<4>(b)
                .map(|c| i32::from_le_bytes(c) as f32)
                .collect(),
            Dtype::U32 => le_chunks::<4>(b)
                .map(|c| u32::from_le_bytes(c) as f32)
                .collect(),
            Dtype::I64 => le_chunks::<8>(b)
                .map(|c| i64::from_le_bytes(c) as f32)
                .collect(),
            Dtype::U64 => le_chunks::<8>(b)
                .map(|c| u64::from_le_bytes(c) as f32)
                .collect(),
        })
    }

    /// The bytes as booleans, rejecting anything but 0 and 1.
    fn bools(&self) -> Result<impl Iterator<Item = bool> + '_, BridgeError> {
        if self.bytes.iter().any(|&x| x > 1) {
            return Err(self.conversion_error("BOOL byte other than 0 or 1"));
        }
        Ok(self.bytes.iter().map(|&x| x == 1))
    }

    /// The tensor as Burn [`TensorData`], keeping the dtype where Burn has it (F64, F32, F16,
    /// BF16, all integers, BOOL as native bool). FP8 formats, which Burn has no plain dtype for,
    /// are decoded exactly to F32.
    pub fn to_tensor_data(&self) -> Result<TensorData, BridgeError> {
        self.validate()?;
        let b = self.bytes;
        let shape = self.shape.to_vec();
        Ok(match self.dtype {
            Dtype::F64 => {
                TensorData::new(le_chunks::<8>(b).map(f64::from_le_bytes).collect(), shape)
            }
            Dtype::F32 => {
                TensorData::new(le_chunks::<4>(b).map(f32::from_le_bytes).collect(), shape)
            }
            Dtype::BF16 => TensorData::new(
                le_chunks::<2>(b)
                    .map(|c| bf16::from_bits(u16::from_le_bytes(c)))
                    .collect(),
                shape,
            ),
            Dtype::F16 => TensorData::new(
                le_chunks::<2>(b)
                    .map(|c| f16::from_bits(u16::from_le_bytes(c)))
                    .collect(),
                shape,
            ),
            Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::F8E8M0 => {
                TensorData::new(self.to_f32_vec()?, shape)
            }
            Dtype::Bool => TensorData::new(self.bools()?.collect::<Vec<bool>>(), shape),
            Dtype::U8 => TensorData::new(b.to_vec(), shape),
            Dtype::I8 => TensorData::new(b.iter().map(|&x| x as i8).collect(), shape),
            Dtype::I16 => {
                TensorData::new(le_chunks::<2>(b).map(i16::from_le_bytes).collect(), shape)
            }
            Dtype::U16 => {
                TensorData::new(le_chunks::<2>(b).map(u16::from_le_bytes).collect(), shape)
            }
            Dtype::I32 => {
                TensorData::new(le_chunks::<4>(b).map(i32::from_le_bytes).collect(), shape)
            }
            Dtype::U32 => {
                TensorData::new(le_chunks::<4>(b).map(u32::from_le_bytes).collect(), shape)
            }
            Dtype::I64 => {
                TensorData::new(le_chunks::<8>(b).map(i64::from_le_bytes).collect(), shape)
            }
            Dtype::U64 => {
                TensorData::new(le_chunks::<8>(b).map(u64::from_le_bytes).collect(), shape)
            }
        })
    }
}

/// Little-endian element chunks of `bytes` (a trailing partial chunk, impossible for validated
/// views, is ignored).
fn le_chunks<const N: usize>(bytes: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    bytes.chunks_exact(N).map(|c| {
        let mut out = [0u8; N];
        out.copy_from_slice(c);
        out
    })
}

/// A tensor that owns its bytes: the result of dequantisation or casting, or data to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedTensor {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major).
    pub shape: Vec<usize>,
    /// Raw little-endian element bytes (`product(shape) · dtype size` of them).
    pub bytes: Vec<u8>,
}

impl OwnedTensor {
    /// An owned tensor; fails when the byte length does not match dtype and shape.
    pub fn new(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    ) -> Result<Self, BridgeError> {
        let name = name.into();
        TensorView::new(&name, dtype, &shape, &bytes)?;
        Ok(Self {
            name,
            dtype,
            shape,
            bytes,
        })
    }

    /// An F32 tensor from values (fails when `values.len()` ≠ `product(shape)`).
    pub fn from_f32(
        name: impl Into<String>,
        shape: Vec<usize>,
        values: &[f32],
    ) -> Result<Self, BridgeError> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(name, Dtype::F32, shape, bytes)
    }

    /// A tensor from Burn [`TensorData`] (F64, F32, F16, BF16, integers and bool).
    pub fn from_tensor_data(
        name: impl Into<String>,
        data: &TensorData,
    ) -> Result<Self, BridgeError> {
        let name = name.into();
        let shape: Vec<usize> = data.shape().iter().copied().collect();
        let unsupported = |what: &str| BridgeError::Conversion {
            path: MEMORY.into(),
            tensor: name.clone(),
            dtype: format!("{:?}", data.dtype()),
            reason: what.to_owned(),
        };
        let dtype = match data.dtype() {
            DType::F64 => Dtype::F64,
            DType::F32 | DType::Flex32 => Dtype::F32,
            DType::F16 => Dtype::F16,
            DType::BF16 => Dtype::BF16,
            DType::I64 => Dtype::I64,
            DType::I32 => Dtype::I32,
            DType::I16 => Dtype::I16,
            DType::I8 => Dtype::I8,
            DType::U64 => Dtype::U64,
            DType::U32 => Dtype::U32,
            DType::U16 => Dtype::U16,
            DType::U8 => Dtype::U8,
            DType::Bool(BoolStore::Native | BoolStore::U8) => Dtype::Bool,
            DType::Bool(BoolStore::U32) => {
                return Err(unsupported("u32-stored bools are not written"));
            }
            DType::QFloat(_) => return Err(unsupported("quantized data is not written")),
        };
        if cfg!(target_endian = "big") && dtype.size() > 1 {
            return Err(unsupported("big-endian hosts are not supported"));
        }
        let bytes = data.as_bytes().to_vec();
        Self::new(name, dtype, shape, bytes)
    }

    /// The tensor converted to the float dtype `dtype` (F32, F64, BF16 or F16), rounding once
    /// to nearest even from the exact f32 value (F64 sources are rounded to f32 first). A tensor
    /// already of that dtype is returned unchanged.
    pub fn cast(&self, dtype: Dtype) -> Result<OwnedTensor, BridgeError> {
        if dtype == self.dtype {
            return Ok(self.clone());
        }
        let values = self.to_f32_vec()?;
        let bytes: Vec<u8> = match dtype {
            Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::F64 => values
                .iter()
                .flat_map(|&v| f64::from(v).to_le_bytes())
                .collect(),
            Dtype::BF16 => values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            Dtype::F16 => values
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            other => {
                return Err(BridgeError::Conversion {
                    path: MEMORY.into(),
                    tensor: self.name.clone(),
                    dtype: self.dtype.to_string(),
                    reason: format!("cannot cast to {other} (only float dtypes)"),
                });
            }
        };
        Self::new(self.name.clone(), dtype, self.shape.clone(), bytes)
    }

    /// A borrowed view.
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            path: Path::new(MEMORY),
            name: &self.name,
            dtype: self.dtype,
            shape: &self.shape,
            bytes: &self.bytes,
        }
    }

    /// See [`TensorView::to_f32_vec`].
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, BridgeError> {
        self.view().to_f32_vec()
    }

    /// See [`TensorView::to_tensor_data`].
    pub fn to_tensor_data(&self) -> Result<TensorData, BridgeError> {
        self.view().to_tensor_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) -> OwnedTensor {
        OwnedTensor::new("t", dtype, shape, bytes).expect("valid")
    }

    #[test]
    fn hand_built_inconsistent_views_are_rejected() {
        let t = owned(Dtype::F32, vec![2], vec![0; 8]);
        let mut view = t.view();
        view.shape = &[3];
        assert!(matches!(
            view.to_f32_vec(),
            Err(BridgeError::ByteLengthMismatch { .. })
        ));
        assert!(view.to_tensor_data().is_err());
        let mut bad = t.clone();
        bad.bytes.pop();
        assert!(bad.cast(Dtype::BF16).is_err());
    }

    #[test]
    fn new_checks_byte_length() {
        let err = TensorView::new("w", Dtype::F32, &[2, 3], &[0u8; 20]).unwrap_err();
        assert!(matches!(
            err,
            BridgeError::ByteLengthMismatch {
                expected: 24,
                actual: 20,
                ..
            }
        ));
        assert!(err.to_string().contains("`w`"));
        assert!(TensorView::new("w", Dtype::F32, &[usize::MAX, 2], &[]).is_err());
    }

    #[test]
    fn f32_from_every_float_dtype() {
        let vals = [1.0f32, -2.5, 0.0, 3.0];
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f64b: Vec<u8> = vals
            .iter()
            .flat_map(|&v| f64::from(v).to_le_bytes())
            .collect();
        let bf16b: Vec<u8> = vals
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let f16b: Vec<u8> = vals
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        // e4m3: 1.0 = 0x38, -2.5 = 0xC2 (1.25·2^1), 0, 3.0 = 0x44 (1.5·2^1).
        let e4m3 = vec![0x38, 0xC2, 0x00, 0x44];
        // e5m2: 1.0 = 0x3C, -2.5 = 0xC1, 0, 3.0 = 0x42.
        let e5m2 = vec![0x3C, 0xC1, 0x00, 0x42];
        for (dtype, bytes) in [
            (Dtype::F32, f32b),
            (Dtype::F64, f64b),
            (Dtype::BF16, bf16b),
            (Dtype::F16, f16b),
            (Dtype::F8E4M3, e4m3),
            (Dtype::F8E5M2, e5m2),
        ] {
            let t = owned(dtype, vec![2, 2], bytes);
            assert_eq!(t.to_f32_vec().unwrap(), vals, "{dtype}");
            let data = t.to_tensor_data().unwrap();
            assert_eq!(data.shape().iter().copied().collect::<Vec<_>>(), vec![2, 2]);
            assert_eq!(
                data.convert::<f32>().try_to_vec::<f32>().unwrap(),
                vals,
                "{dtype}"
            );
        }
    }

    #[test]
    fn tensor_data_keeps_supported_dtypes() {
        let t = owned(Dtype::BF16, vec![2], vec![0x80, 0x3F, 0x00, 0x40]);
        let data = t.to_tensor_data().unwrap();
        assert_eq!(data.dtype(), DType::BF16);
        assert_eq!(
            data.try_to_vec::<bf16>().unwrap(),
            vec![bf16::from_f32(1.0), bf16::from_f32(2.0)]
        );
        let t = owned(
            Dtype::I64,
            vec![2],
            [7i64, -3].iter().flat_map(|v| v.to_le_bytes()).collect(),
        );
        let data = t.to_tensor_data().unwrap();
        assert_eq!(data.dtype(), DType::I64);
        assert_eq!(data.try_to_vec::<i64>().unwrap(), vec![7, -3]);
        assert_eq!(t.to_f32_vec().unwrap(), vec![7.0, -3.0]);
        let fp8 = owned(Dtype::F8E4M3, vec![1], vec![0x7E]);
        assert_eq!(fp8.to_tensor_data().unwrap().dtype(), DType::F32);
        let b = owned(Dtype::Bool, vec![3], vec![1, 0, 1]);
        assert_eq!(
            b.to_tensor_data().unwrap().try_to_vec::<bool>().unwrap(),
            vec![true, false, true]
        );
        let bad = owned(Dtype::Bool, vec![1], vec![2]);
        assert!(matches!(
            bad.to_f32_vec(),
            Err(BridgeError::Conversion { .. })
        ));
    }

    #[test]
    fn tensor_data_round_trip_through_owned() {
        let data = TensorData::new(vec![bf16::from_f32(0.5), bf16::from_f32(-8.0)], [1, 2]);
        let t = OwnedTensor::from_tensor_data("x", &data).unwrap();
        assert_eq!(t.dtype, Dtype::BF16);
        assert_eq!(t.shape, vec![1, 2]);
        assert_eq!(t.to_tensor_data().unwrap(), data);
        let data = TensorData::new(vec![1.5f32, 2.0, 3.0], [3]);
        let t = OwnedTensor::from_tensor_data("y", &data).unwrap();
        assert_eq!(t.to_tensor_data().unwrap(), data);
    }

    #[test]
    fn casts_between_float_dtypes() {
        let t = OwnedTensor::from_f32("x", vec![3], &[1.0, -0.5, 1.0 + 2f32.powi(-8)]).unwrap();
        let b = t.cast(Dtype::BF16).unwrap();
        assert_eq!(b.bytes, vec![0x80, 0x3F, 0x00, 0xBF, 0x80, 0x3F]);
        assert_eq!(
            b.cast(Dtype::F32).unwrap().to_f32_vec().unwrap(),
            vec![1.0, -0.5, 1.0]
        );
        let h = t.cast(Dtype::F16).unwrap();
        assert_eq!(h.to_f32_vec().unwrap(), t.to_f32_vec().unwrap());
        assert_eq!(
            t.cast(Dtype::F64).unwrap().to_f32_vec().unwrap(),
            t.to_f32_vec().unwrap()
        );
        assert_eq!(t.cast(Dtype::F32).unwrap(), t);
        assert!(matches!(
            t.cast(Dtype::I32),
            Err(BridgeError::Conversion { .. })
        ));
    }

    #[test]
    fn expectations_name_the_tensor() {
        let t = owned(Dtype::F32, vec![2], vec![0; 8]);
        let mut view = t.view();
        view.path = Path::new("dir/model.safetensors");
        let err = view.expect_dtype(Dtype::BF16).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("model.safetensors") && msg.contains("`t`") && msg.contains("BF16"));
        let err = view.expect_shape(&[3]).unwrap_err();
        assert!(matches!(err, BridgeError::ShapeMismatch { .. }));
        assert!(err.to_string().contains("dir/model.safetensors"));
        assert!(view.expect_shape(&[2]).is_ok() && view.expect_dtype(Dtype::F32).is_ok());
    }
}
