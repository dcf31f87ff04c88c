//! Launch helpers shared by the CubeCL kernels: output allocation, dtype mapping, grid sizes.

use burn::tensor::{DType, Shape};
use burn_cubecl::cubecl::calculate_cube_count_elemwise;
use burn_cubecl::cubecl::ir::{ElemType, FloatKind, IntKind, UIntKind};
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::{empty_device_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;

/// Grid of an elementwise launch: one unit per element.
pub(crate) struct LaunchShape {
    /// Number of cubes.
    pub(crate) count: CubeCount,
    /// Units per cube.
    pub(crate) dim: CubeDim,
}

impl LaunchShape {
    /// One unit per element for `elems` elements.
    pub(crate) fn elementwise(client: &Client, elems: usize) -> Self {
        let dim = CubeDim::new(client, elems);
        let count = calculate_cube_count_elemwise(client, elems, dim);
        Self { count, dim }
    }
}

/// Row-major contiguous copy of `t` (no copy when it already is).
pub(crate) fn contiguous(t: CubeTensor) -> CubeTensor {
    into_contiguous(t)
}

/// `t` converted to the float dtype `dtype` (no copy when it already has it).
pub(crate) fn cast_float(t: CubeTensor, dtype: DType) -> CubeTensor {
    if t.dtype == dtype { t } else { cast(t, dtype) }
}

/// Uninitialised contiguous tensor on `like`'s device.
pub(crate) fn empty_like_dtype<const D: usize>(
    like: &CubeTensor,
    shape: [usize; D],
    dtype: DType,
) -> CubeTensor {
    empty_device_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::new(shape),
        dtype,
    )
}

/// Zeroed `u32` vector of `len` elements on `like`'s device (at least one element).
pub(crate) fn zeros_u32(like: &CubeTensor, len: usize) -> CubeTensor {
    zeros_client(
        like.client.clone(),
        like.device.clone(),
        Shape::new([len.max(1)]),
        DType::U32,
    )
}

/// Number of elements of `t`.
pub(crate) fn elem_count(t: &CubeTensor) -> usize {
    t.meta.shape().num_elements()
}

/// Kernel element type of a float tensor's dtype (panics on non-float dtypes).
pub(crate) fn float_storage(dtype: DType) -> ElemType {
    match dtype {
        DType::F32 | DType::Flex32 => ElemType::Float(FloatKind::F32),
        DType::F16 => ElemType::Float(FloatKind::F16),
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        DType::F64 => ElemType::Float(FloatKind::F64),
        other => panic!("moe ops (cube): unsupported float dtype {other:?}"),
    }
}

/// Kernel element type of an index tensor's dtype (panics on non-integer dtypes).
pub(crate) fn int_storage(dtype: DType) -> ElemType {
    match dtype {
        DType::I64 => ElemType::Int(IntKind::I64),
        DType::I32 => ElemType::Int(IntKind::I32),
        DType::I16 => ElemType::Int(IntKind::I16),
        DType::I8 => ElemType::Int(IntKind::I8),
        DType::U64 => ElemType::UInt(UIntKind::U64),
        DType::U32 => ElemType::UInt(UIntKind::U32),
        DType::U16 => ElemType::UInt(UIntKind::U16),
        DType::U8 => ElemType::UInt(UIntKind::U8),
        other => panic!("moe ops (cube): unsupported index dtype {other:?}"),
    }
}

/// A size as a `u32` kernel argument (panics, naming `op`, when it does not fit).
pub(crate) fn u32_arg(v: usize, op: &str) -> u32 {
    u32::try_from(v).unwrap_or_else(|_| panic!("{op}: size {v} exceeds the u32 kernel range"))
}
