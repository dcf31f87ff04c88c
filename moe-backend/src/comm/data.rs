//! Host-side tensor-data helpers for the collectives: row slicing and concatenation along
//! dim 0, and element-wise reductions in a fixed member order (so every rank computes
//! bit-identical results).

use burn::tensor::{DType, TensorData, bf16, f16};

use super::ReduceOp;
use crate::error::{BackendError, Result};

/// Rows (dim 0) and bytes per row of `data`; a 0-d tensor counts as one row.
pub(crate) fn rows_and_row_bytes(data: &TensorData) -> (usize, usize) {
    let dims = data.shape().as_slice();
    let elem = data.dtype().size();
    match dims.split_first() {
        Some((&rows, rest)) => (rows, rest.iter().product::<usize>() * elem),
        None => (1, elem),
    }
}

/// Trailing dims (everything after dim 0).
pub(crate) fn trailing(data: &TensorData) -> Vec<usize> {
    data.shape().iter().skip(1).copied().collect()
}

/// `data` split along dim 0 into consecutive byte blocks of `splits` rows.
pub(crate) fn split_rows<'a>(data: &'a TensorData, splits: &[usize]) -> Vec<&'a [u8]> {
    let (_, row_bytes) = rows_and_row_bytes(data);
    let bytes = data.as_bytes();
    let mut start = 0;
    splits
        .iter()
        .map(|&n| {
            let end = start + n * row_bytes;
            let block = &bytes[start..end];
            start = end;
            block
        })
        .collect()
}

/// Element-wise reduction of same-shape byte blocks of `dtype`, summed in the given order.
///
/// Floats accumulate in f32 (f64 for f64) and round once; integers accumulate in i64 (u64 for
/// unsigned) with wrapping; `Mean` divides by the number of parts and is rejected for integers.
pub(crate) fn reduce_blocks(
    op_name: &'static str,
    group: &str,
    parts: &[&[u8]],
    dtype: DType,
    op: ReduceOp,
) -> Result<Vec<u8>> {
    let n = parts.len();
    let bad = |detail: String| BackendError::Collective {
        op: op_name,
        group: group.to_string(),
        detail,
    };
    let Some(first) = parts.first() else {
        return Ok(Vec::new());
    };
    let len = first.len();
    macro_rules! float_reduce {
        ($t:ty, $acc:ty, $to:expr, $from:expr) => {{
            let size = core::mem::size_of::<$t>();
            let count = len / size;
            let mut acc: Vec<$acc> = vec![<$acc>::default(); count];
            for (p, part) in parts.iter().enumerate() {
                for (i, chunk) in part.chunks_exact(size).enumerate() {
                    let v: $acc = $to(<$t>::from_le_bytes(chunk.try_into().unwrap_or_default()));
                    acc[i] = match op {
                        ReduceOp::Sum | ReduceOp::Mean => acc[i] + v,
                        ReduceOp::Max if p == 0 => v,
                        ReduceOp::Max => {
                            if v > acc[i] || v.is_nan() {
                                v
                            } else {
                                acc[i]
                            }
                        }
                    };
                }
            }
            if op == ReduceOp::Mean {
                for a in &mut acc {
                    *a /= n as $acc;
                }
            }
            let mut out = Vec::with_capacity(len);
            for a in acc {
                out.extend_from_slice(&$from(a).to_le_bytes());
            }
            Ok(out)
        }};
    }
    macro_rules! int_reduce {
        ($t:ty, $acc:ty) => {{
            if op == ReduceOp::Mean {
                return Err(bad(format!(
                    "mean is not defined for integer dtype {dtype:?}"
                )));
            }
            let size = core::mem::size_of::<$t>();
            let count = len / size;
            let mut acc: Vec<$acc> = vec![0; count];
            for (p, part) in parts.iter().enumerate() {
                for (i, chunk) in part.chunks_exact(size).enumerate() {
                    let v = <$t>::from_le_bytes(chunk.try_into().unwrap_or_default()) as $acc;
                    acc[i] = match op {
                        ReduceOp::Max if p == 0 => v,
                        ReduceOp::Max => acc[i].max(v),
                        _ => acc[i].wrapping_add(v),
                    };
                }
            }
            let mut out = Vec::with_capacity(len);
            for a in acc {
                out.extend_from_slice(&(a as $t).to_le_bytes());
            }
            Ok(out)
        }};
    }
    match dtype {
        DType::F32 => float_reduce!(f32, f32, |v: f32| v, |a: f32| a),
        DType::F64 => float_reduce!(f64, f64, |v: f64| v, |a: f64| a),
        DType::BF16 => float_reduce!(bf16, f32, |v: bf16| v.to_f32(), bf16::from_f32),
        DType::F16 => float_reduce!(f16, f32, |v: f16| v.to_f32(), f16::from_f32),
        DType::I64 => int_reduce!(i64, i64),
        DType::I32 => int_reduce!(i32, i64),
        DType::I16 => int_reduce!(i16, i64),
        DType::I8 => int_reduce!(i8, i64),
        DType::U64 => int_reduce!(u64, u64),
        DType::U32 => int_reduce!(u32, u64),
        DType::U16 => int_reduce!(u16, u64),
        DType::U8 => int_reduce!(u8, u64),
        other => Err(bad(format!(
            "reductions are not supported for dtype {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_f32(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn sums_in_member_order_and_means() {
        let a = bytes_f32(&[1.0, 2.0]);
        let b = bytes_f32(&[3.0, -5.0]);
        let sum = reduce_blocks("t", "[0,1]", &[&a, &b], DType::F32, ReduceOp::Sum).unwrap();
        assert_eq!(sum, bytes_f32(&[4.0, -3.0]));
        let mean = reduce_blocks("t", "[0,1]", &[&a, &b], DType::F32, ReduceOp::Mean).unwrap();
        assert_eq!(mean, bytes_f32(&[2.0, -1.5]));
        let max = reduce_blocks("t", "[0,1]", &[&a, &b], DType::F32, ReduceOp::Max).unwrap();
        assert_eq!(max, bytes_f32(&[3.0, 2.0]));
    }

    #[test]
    fn bf16_accumulates_in_f32_and_rounds_once() {
        // 256 + 1 + 1: bf16 pairwise would lose both ones (spacing 2 at 256); f32 keeps 258.
        let parts: Vec<Vec<u8>> = [256.0f32, 1.0, 1.0]
            .iter()
            .map(|v| bf16::from_f32(*v).to_le_bytes().to_vec())
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let out = reduce_blocks("t", "g", &refs, DType::BF16, ReduceOp::Sum).unwrap();
        assert_eq!(bf16::from_le_bytes([out[0], out[1]]).to_f32(), 258.0);
    }

    #[test]
    fn integer_mean_is_an_error() {
        let a = 7i32.to_le_bytes();
        let err = reduce_blocks("all_reduce", "[0]", &[&a], DType::I32, ReduceOp::Mean);
        assert!(matches!(err, Err(BackendError::Collective { .. })));
        let max = reduce_blocks(
            "t",
            "g",
            &[&a, &9i32.to_le_bytes()],
            DType::I32,
            ReduceOp::Max,
        );
        assert_eq!(max.unwrap(), 9i32.to_le_bytes().to_vec());
    }
}
