//! FP8 primary weights held *in the parameter* (docs/fp8.md §FP8 primary weights, issue 21): a
//! parameter whose storage is its blockwise E4M3 codes plus `scale_inv` per block — about one byte
//! per element instead of four (f32) or two (the BF16 reference) — and that the FP8 GEMMs read
//! directly.
//!
//! # Why not Burn's quantised tensors
//!
//! Burn 0.22.1 has `QFloat` tensors (`QuantValue::E4M3`, per-block scales), but they cannot be
//! trainable parameters here:
//! - autodiff does not track them: `Autodiff`'s quantised primitive is the inner backend's
//!   (`burn-autodiff-0.22.1/src/backend.rs:38`), `q_set_require_grad` is the default no-op
//!   (`burn-backend-0.22.1/src/backend/ops/qtensor.rs:199`), and autodiff `quantize` detaches
//!   while `dequantize` returns an untracked leaf (`burn-autodiff-0.22.1/src/ops/qtensor.rs:16`,
//!   `:38`), so such a parameter never receives a gradient;
//! - Flex stores quantised values as `i8` integers (`FlexQTensor::new` asserts `I8`,
//!   `burn-flex-0.22.1/src/qtensor.rs:36`), quantises `(x / scale).round().clamp(-448, 448) as
//!   i8` and dequantises `scale · (q as f32)` (`burn-flex-0.22.1/src/ops/qtensor.rs:144`,
//!   `:190`, `:203`): no E4M3 encoding or decoding, so E4M3 codes would decode to wrong values;
//! - iterating or converting E4M3 `TensorData` is `unimplemented!`
//!   (`burn-std-0.22.1/src/data/tensor/conversion.rs:214`).
//!
//! A float tensor must also have a float dtype (`Tensor::from_dispatch`,
//! `burn-tensor-0.22.1/src/tensor/api/extension.rs:56`), and the smallest is two bytes.
//!
//! # The packed parameter
//!
//! So the parameter stays an ordinary f32 (or the model dtype) Flex tensor of the weight's
//! shape — a tracked autodiff leaf with its `ParamId`, so Burn routes its gradient to
//! [`burn::optim::GradientsParams`] unchanged — whose *storage* is the packed FP8 weight:
//!
//! ```text
//! [header 64 B: magic, matrices, rows, cols, b0, b1, flags] [E4M3 codes, storage order]
//! [pad to 4] [scale_inv f32 × blocks] [one NaN element of the tensor's dtype]
//! ```
//!
//! and whose layout is a zero-stride view of that last NaN element (a broadcast, like
//! `expand`). The FP8 GEMMs ([`super::Fp8Ops`] on Flex) recognise the storage and compute with
//! the codes and scales as they are (no re-quantisation) when the recipe's weight blocks are
//! the packed ones (else they quantise the decoded values, like any f32 weight); any other
//! reader of the tensor sees NaN everywhere, never plausible numbers, and consumers that need
//! values decode on demand ([`dequantize_param`]). Transpose and permute keep the storage
//! recognisable; a narrowed view is no longer recognised, and an op that materialises the
//! tensor (reshape of the broadcast, arithmetic) yields NaNs.
//!
//! Packed parameters exist on Flex (host memory); on other devices the optimizer writes the
//! decoded values instead (see [`crate::optim::Fp8Storage`]).

use burn::backend::Flex;
use burn::tensor::{Bytes, DType, Tensor};
use burn_flex::{FlexTensor, Layout};

use super::blockwise::{Fp8Blocks, decode_scaled, simd, transpose_blocks, transpose_grid};
use super::formats::Fp8Format;
use super::gemm::Fp8View;
use super::primary_weights::BlockGrid;
use crate::error::{BackendError, Result};

/// First bytes of a packed FP8 parameter's storage.
const MAGIC: [u8; 8] = *b"MOEFP8W1";
/// Header bytes (magic and seven little-endian `u64` fields).
const HEADER: usize = 64;

/// A packed FP8 weight: the storage of a packed parameter (see the module docs), shared
/// (reference-counted) with every tensor made from it.
#[derive(Debug, Clone)]
pub struct PackedFp8 {
    /// The zero-stride carrier tensor over the packed storage.
    tensor: FlexTensor,
    grid: BlockGrid,
}

/// Byte offset of the scales after `numel` codes.
fn scales_at(numel: usize) -> usize {
    (HEADER + numel).div_ceil(4) * 4
}

/// The NaN element of a float dtype (little-endian bytes), or `None` for other dtypes.
fn nan_bytes(dtype: DType) -> Option<Vec<u8>> {
    match dtype {
        DType::F32 | DType::Flex32 => Some(f32::NAN.to_le_bytes().to_vec()),
        DType::F64 => Some(f64::NAN.to_le_bytes().to_vec()),
        DType::F16 => Some(0x7E00u16.to_le_bytes().to_vec()),
        DType::BF16 => Some(0x7FC0u16.to_le_bytes().to_vec()),
        _ => None,
    }
}

fn packed_error(detail: String) -> BackendError {
    BackendError::Shape {
        op: "packed fp8 parameter",
        detail,
    }
}

impl PackedFp8 {
    /// Packs E4M3 `codes` (the parameter's storage order, see [`BlockGrid`]) and their
    /// `scale_inv` (`[matrices, gr, gc]`) as a parameter of `shape` and `dtype` (a float
    /// dtype; the shape must hold `grid.numel()` elements).
    pub fn new(
        grid: BlockGrid,
        codes: &[u8],
        scale_inv: &[f32],
        shape: &[usize],
        dtype: DType,
    ) -> Result<Self> {
        let numel = grid.numel();
        if codes.len() != numel
            || scale_inv.len() != grid.num_blocks()
            || shape.iter().product::<usize>() != numel
        {
            return Err(packed_error(format!(
                "{} codes and {} scales for {grid:?} as a {shape:?} parameter",
                codes.len(),
                scale_inv.len()
            )));
        }
        let nan = nan_bytes(dtype)
            .ok_or_else(|| packed_error(format!("{dtype:?} is not a float dtype")))?;
        let elem = nan.len();
        let scales_end = scales_at(numel) + 4 * scale_inv.len();
        let view = scales_end.div_ceil(elem);
        let total = (view + 1) * elem;
        let mut bytes = vec![0u8; total.div_ceil(8) * 8];
        bytes[..8].copy_from_slice(&MAGIC);
        let fields = [
            grid.matrices,
            grid.rows,
            grid.cols,
            grid.b0,
            grid.b1,
            usize::from(grid.transposed),
            0,
        ];
        for (i, f) in fields.iter().enumerate() {
            bytes[8 + 8 * i..16 + 8 * i].copy_from_slice(&(*f as u64).to_le_bytes());
        }
        bytes[HEADER..HEADER + numel].copy_from_slice(codes);
        let at = scales_at(numel);
        for (i, s) in scale_inv.iter().enumerate() {
            bytes[at + 4 * i..at + 4 * i + 4].copy_from_slice(&s.to_le_bytes());
        }
        bytes[view * elem..(view + 1) * elem].copy_from_slice(&nan);
        // Held as u64 words (same bytes in memory): aligned for every float view dtype.
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        let data = Bytes::from_elems(words);
        let layout = Layout::new(shape.to_vec().into(), vec![0; shape.len()], view);
        let tensor = FlexTensor::new(data, layout, dtype);
        Ok(Self { tensor, grid })
    }

    /// Recognises the packed storage of a Flex tensor (any zero-copy view of a packed
    /// parameter), or `None` for an ordinary tensor.
    pub fn from_flex(t: &FlexTensor) -> Option<Self> {
        let layout = t.layout();
        if layout.strides().iter().any(|&s| s != 0) {
            return None;
        }
        let bytes = t.bytes();
        if bytes.len() < HEADER || bytes[..8] != MAGIC {
            return None;
        }
        let field = |i: usize| -> Option<usize> {
            let raw: [u8; 8] = bytes.get(8 + 8 * i..16 + 8 * i)?.try_into().ok()?;
            usize::try_from(u64::from_le_bytes(raw)).ok()
        };
        let grid = BlockGrid {
            matrices: field(0)?,
            rows: field(1)?,
            cols: field(2)?,
            b0: field(3)?,
            b1: field(4)?,
            transposed: field(5)? != 0,
        };
        let elem = nan_bytes(t.dtype())?.len();
        if grid.b0 == 0 || grid.b1 == 0 {
            return None;
        }
        // Checked sizes: the header is data, never trusted to be small.
        let numel = grid
            .matrices
            .checked_mul(grid.rows)?
            .checked_mul(grid.cols)?;
        let blocks = grid
            .rows
            .div_ceil(grid.b0)
            .checked_mul(grid.cols.div_ceil(grid.b1))?
            .checked_mul(grid.matrices)?;
        let scales_end = HEADER
            .checked_add(numel)?
            .div_ceil(4)
            .checked_mul(4)?
            .checked_add(blocks.checked_mul(4)?)?;
        let view = scales_end.div_ceil(elem);
        let end = view.checked_add(1)?.checked_mul(elem)?;
        let consistent = layout.shape().num_elements() == numel
            && layout.start_offset() == view
            && bytes.len() == end.div_ceil(8) * 8;
        consistent.then(|| Self {
            tensor: t.clone(),
            grid,
        })
    }

    /// The packed weight a parameter tensor holds (any autodiff wrapping removed), or `None`
    /// when it holds ordinary values (or lives on another backend).
    pub fn from_tensor<const D: usize>(t: &Tensor<D>) -> Option<Self> {
        let flex = t
            .clone()
            .without_autodiff()
            .try_into_primitive::<Flex>()
            .ok()?;
        Self::from_flex(&flex)
    }

    /// The parameter tensor (the zero-stride carrier, sharing this storage) in its `D`-D
    /// shape, without autodiff.
    pub fn to_tensor<const D: usize>(&self) -> Result<Tensor<D>> {
        let dims = self.tensor.layout().shape().num_dims();
        if dims != D {
            return Err(packed_error(format!(
                "a {dims}-D packed parameter read as {D}-D"
            )));
        }
        Ok(Tensor::from_primitive::<Flex>(self.tensor.clone()))
    }

    /// The dtype of the parameter (of its view element).
    pub fn dtype(&self) -> DType {
        self.tensor.dtype()
    }

    /// Blocks and storage order.
    pub fn grid(&self) -> BlockGrid {
        self.grid
    }

    /// The E4M3 codes in storage order.
    pub fn codes(&self) -> &[u8] {
        &self.tensor.bytes()[HEADER..HEADER + self.grid.numel()]
    }

    /// The `scale_inv` grid `[matrices, gr, gc]`.
    pub fn scale_inv(&self) -> Vec<f32> {
        let at = scales_at(self.grid.numel());
        self.tensor.bytes()[at..at + 4 * self.grid.num_blocks()]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Bytes of the storage (header, codes, scales, view element): the memory the parameter
    /// holds.
    pub fn storage_bytes(&self) -> usize {
        self.tensor.bytes().len()
    }

    /// The shape of the parameter.
    pub fn shape(&self) -> Vec<usize> {
        self.tensor.layout().shape().to_vec()
    }

    /// Decoded values `decode(q) · scale_inv` in storage order.
    pub fn dequantize(&self) -> Vec<f32> {
        let (codes, scale_inv) = (self.codes(), self.scale_inv());
        let mut out = vec![0f32; codes.len()];
        simd(|| {
            self.grid.for_each_run(0, codes.len(), |at, n, b| {
                decode_scaled(
                    Fp8Format::E4M3,
                    &codes[at..at + n],
                    scale_inv[b],
                    &mut out[at..at + n],
                );
            });
        });
        out
    }

    /// Decoded values in canonical order (`[matrices, rows, cols]`, each matrix transposed
    /// back when stored `[cols, rows]`).
    pub(crate) fn canonical_values(&self) -> Vec<f32> {
        let values = self.dequantize();
        let g = self.grid;
        if !g.transposed {
            return values;
        }
        let per = g.rows * g.cols;
        let mut out = vec![0f32; values.len()];
        for m in 0..g.matrices {
            let (src, dst) = (
                &values[m * per..(m + 1) * per],
                &mut out[m * per..(m + 1) * per],
            );
            for c in 0..g.cols {
                for r in 0..g.rows {
                    dst[r * g.cols + c] = src[c * g.rows + r];
                }
            }
        }
        out
    }

    /// Whether the GEMMs of a recipe with square `block`-sized weight blocks in E4M3 can use
    /// these codes as their weight quantisation.
    pub(crate) fn fits_recipe(&self, block: usize, format: Fp8Format) -> bool {
        format == Fp8Format::E4M3 && self.grid.b0 == block && self.grid.b1 == block
    }

    /// The per-matrix FP8 weight operands: canonical `[rows, cols]` (`[M, K]`, the fprop
    /// operand) or, with `transposed`, `[cols, rows]` (`Wᵀ`, the dgrad operand). Codes are
    /// borrowed where the storage already has that orientation, else transposed (no
    /// re-quantisation either way).
    pub(crate) fn operands(&self, transposed: bool) -> Vec<WeightOperand<'_>> {
        let g = self.grid;
        let (codes, scales) = (self.codes(), self.scale_inv());
        let [gr, gc] = g.shape();
        let per = g.rows * g.cols;
        (0..g.matrices)
            .map(|i| {
                let data = &codes[i * per..(i + 1) * per];
                let s = &scales[i * gr * gc..(i + 1) * gr * gc];
                // Stored rows: canonical rows, or canonical columns when `g.transposed`.
                if g.transposed == transposed {
                    let (rows, cols, block, scale_inv) = if transposed {
                        (g.cols, g.rows, [g.b1, g.b0], transpose_grid(s, gr, gc))
                    } else {
                        (g.rows, g.cols, [g.b0, g.b1], s.to_vec())
                    };
                    WeightOperand::Borrowed {
                        data,
                        scale_inv,
                        rows,
                        cols,
                        block,
                    }
                } else if g.transposed {
                    // Stored [cols, rows] with the transposed grid; canonical wanted.
                    let st = transpose_grid(s, gr, gc);
                    WeightOperand::Owned(transpose_blocks(
                        Fp8Format::E4M3,
                        data,
                        &st,
                        g.cols,
                        g.rows,
                        [g.b1, g.b0],
                    ))
                } else {
                    WeightOperand::Owned(transpose_blocks(
                        Fp8Format::E4M3,
                        data,
                        s,
                        g.rows,
                        g.cols,
                        [g.b0, g.b1],
                    ))
                }
            })
            .collect()
    }
}

/// One matrix of FP8 weight codes for a GEMM: borrowed from a packed parameter or transposed
/// into an owned copy.
#[derive(Debug)]
pub(crate) enum WeightOperand<'a> {
    /// Codes borrowed from the packed storage.
    Borrowed {
        /// Row-major codes.
        data: &'a [u8],
        /// Scale grid of this orientation.
        scale_inv: Vec<f32>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Block.
        block: [usize; 2],
    },
    /// A transposed copy.
    Owned(Fp8Blocks),
}

impl WeightOperand<'_> {
    /// The GEMM view of this operand.
    pub(crate) fn view(&self) -> Fp8View<'_> {
        match self {
            Self::Borrowed {
                data,
                scale_inv,
                rows,
                cols,
                block,
            } => Fp8View::new(data, scale_inv, *rows, *cols, *block, Fp8Format::E4M3),
            Self::Owned(b) => Fp8View::of(b),
        }
    }
}

/// `t` with decoded values when it is a packed FP8 parameter (f32, on `t`'s device, without
/// autodiff), else `t` itself: for consumers that need values (checkpoint writers, exports,
/// checks).
pub fn dequantize_param<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    match PackedFp8::from_tensor(&t) {
        Some(p) => {
            let shape = p.shape();
            Tensor::from_data(
                burn::tensor::TensorData::new(p.dequantize(), shape),
                &t.device().without_autodiff(),
            )
        }
        None => t,
    }
}

/// Bytes of the distinct storage buffers a module's float parameters hold (a buffer shared by
/// several parameters, e.g. a flat optimizer buffer they are views of, counts once): the
/// parameter memory of the module as it is, on Flex. Parameters on other backends count their
/// element bytes.
pub fn param_storage_bytes<M: burn::module::Module>(module: &M) -> usize {
    use burn::module::{ModuleVisitor, Param};
    struct Sizer {
        seen: std::collections::HashSet<usize>,
        total: usize,
    }
    impl ModuleVisitor for Sizer {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            let fallback = t.shape().num_elements() * t.dtype().size();
            match t.without_autodiff().try_into_primitive::<Flex>() {
                Ok(flex) => {
                    let bytes = flex.bytes();
                    if self.seen.insert(bytes.as_ptr() as usize) {
                        self.total += bytes.len();
                    }
                }
                Err(_) => self.total += fallback,
            }
        }
    }
    let mut sizer = Sizer {
        seen: Default::default(),
        total: 0,
    };
    module.visit(&mut sizer);
    sizer.total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::quantize_blockwise;

    #[test]
    fn packed_parameters_round_trip_codes_and_scales() {
        let (rows, cols) = (5, 7);
        let x: Vec<f32> = (0..rows * cols).map(|i| (i as f32 - 17.0) * 0.37).collect();
        let q = quantize_blockwise(&x, rows, cols, [2, 3], Fp8Format::E4M3, true).unwrap();
        let grid = BlockGrid::new(rows, cols, [2, 3]).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let p = PackedFp8::new(grid, &q.data, &q.scale_inv, &[rows, cols], dtype).unwrap();
            assert_eq!(p.codes(), &q.data[..]);
            assert_eq!(p.scale_inv(), q.scale_inv);
            assert_eq!(p.dequantize(), q.dequantize());
            let t: Tensor<2> = p.to_tensor().unwrap();
            assert_eq!(t.dims(), [rows, cols]);
            assert_eq!(t.dtype(), dtype);
            let back = PackedFp8::from_tensor(&t).expect("recognised");
            assert_eq!(back.grid(), grid);
            assert_eq!(back.codes(), &q.data[..]);
            // A transposed view keeps the storage; anything materialised reads NaN.
            assert!(PackedFp8::from_tensor(&t.clone().transpose()).is_some());
            let values = t
                .clone()
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .unwrap();
            assert!(values.iter().all(|v| v.is_nan()));
            let decoded = dequantize_param(t)
                .into_data()
                .try_into_vec::<f32>()
                .unwrap();
            assert_eq!(decoded, q.dequantize());
            let blocks = grid.num_blocks();
            assert!(p.storage_bytes() < rows * cols + 64 + 4 * blocks + 16);
        }
        // Ordinary tensors are not packed.
        let plain = Tensor::<2>::zeros([rows, cols], &burn::tensor::Device::flex());
        assert!(PackedFp8::from_tensor(&plain).is_none());
        assert!(
            PackedFp8::new(grid, &q.data[1..], &q.scale_inv, &[rows, cols], DType::F32).is_err()
        );
        assert!(PackedFp8::new(grid, &q.data, &q.scale_inv, &[rows, cols], DType::I32).is_err());
    }

    #[test]
    fn operands_have_both_orientations_without_requantising() {
        let (rows, cols) = (6, 10);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7) % 23) as f32 - 11.0)
            .collect();
        let q = quantize_blockwise(&x, rows, cols, [4, 4], Fp8Format::E4M3, true).unwrap();
        let qt = q.transpose();
        // Canonical storage and transposed ([cols, rows], as a Burn Linear) storage.
        for transposed_storage in [false, true] {
            let (codes, shape) = if transposed_storage {
                (qt.data.clone(), [cols, rows])
            } else {
                (q.data.clone(), [rows, cols])
            };
            let grid = BlockGrid::stacked(1, rows, cols, [4, 4], transposed_storage).unwrap();
            let p = PackedFp8::new(grid, &codes, &q.scale_inv, &shape, DType::F32).unwrap();
            for (want, transposed) in [(&q, false), (&qt, true)] {
                let ops = p.operands(transposed);
                let v = ops[0].view();
                let got = Fp8Blocks {
                    format: Fp8Format::E4M3,
                    rows: want.rows,
                    cols: want.cols,
                    block: want.block,
                    data: v.data().to_vec(),
                    scale_inv: v.scale_inv().to_vec(),
                };
                assert_eq!(&got, want, "storage transposed {transposed_storage}");
            }
        }
    }
}
