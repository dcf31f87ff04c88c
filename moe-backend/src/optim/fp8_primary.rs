//! FP8 primary weights in the distributed optimizer (docs/fp8.md §FP8 primary weights): after each
//! update the f32 master shards are cast *directly* to blockwise E4M3, without a BF16 weight copy.
//!
//! Per class buffer (dense over `dp_cp`, experts over `expt_dp`) and step:
//! 1. every rank computes, for each FP8 parameter, partial per-block amaxes of the BF16-cast
//!    master elements it owns (blocks it does not touch stay 0);
//! 2. one packed MAX all-reduce over the group gives every rank every block's amax;
//! 3. `scale = compute_scale_from_amax(amax, 448, pow2, 0)`, `scale_inv = 1/scale`, the same on
//!    every rank (no scale gather);
//! 4. each rank quantises only its own elements (partial cast);
//! 5. the parameter all-gather moves **one byte per FP8 element** (`U8` payload) and four per
//!    remaining f32 element.
//!
//! What the module's FP8 parameters then hold depends on [`Fp8Storage`]:
//! - [`Fp8Storage::Packed`] (the default): the gathered E4M3 codes and block scales
//!   themselves, as a packed FP8 parameter ([`crate::fp8::PackedFp8`], about one byte per
//!   element), which the FP8 GEMMs use without re-quantisation; no f32 or BF16 copy of the
//!   weight exists beyond the master shard, and the optimizer's FP8 copy *is* the module's
//!   storage (shared, reference-counted). The other parameters of the class are written from a
//!   compact gathered buffer without the FP8 elements, so nothing pins four bytes per FP8
//!   element. Packed parameters live on Flex; on another device the decoded values are written.
//! - [`Fp8Storage::Decoded`]: the decoded FP8 values `decode(q) · scale_inv` as f32 values
//!   (exactly representable), the earlier emulation; with power-of-two scales the FP8 GEMMs'
//!   own blockwise quantisation of such a weight gives back exactly these FP8 values, so both
//!   storages compute bit-identical results (tested).
//!
//! The cast runs on host buffers: [`super::DistributedAdamW`] reads its master shard back from
//! the device for it and uploads the result (the one host round trip left in a step, and only
//! with FP8 primary weights on; the E4M3 codes and block scales are host data).

use std::collections::HashMap;
use std::panic::Location;

use burn::module::ParamId;
use burn::tensor::TensorData;

use super::params::{ParamClass, ParamInfo};
use crate::comm::{Comm, ReduceOp};
use crate::error::{BackendError, Result};
use crate::fp8::{
    BlockGrid, E4M3_MAX, Fp8Format, Fp8Recipe, PackedFp8, accumulate_block_amax,
    cast_shard_with_scales, compute_scale_from_amax, decode_scaled, simd,
};

/// What a module's FP8 primary parameters hold (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Storage {
    /// The E4M3 codes and block scales, as packed FP8 parameters (Flex; decoded values on
    /// other devices). Only for parameters the model runs through the FP8 GEMMs
    /// ([`crate::fp8::fp8_grouped_matmul`], [`crate::fp8::fp8_linear_forward`]): any other op
    /// reads a packed parameter as NaN ([`crate::fp8::PackedFp8`]); readers that need values
    /// use [`crate::fp8::dequantize_param`] (the optimizer's own flattening does).
    #[default]
    Packed,
    /// The decoded FP8 values as f32 (the reference emulation: four bytes per element).
    Decoded,
}

/// Settings of FP8 primary weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8PrimaryConfig {
    /// Weight block `[b0, b1]` (128×128 in the Hopper recipe).
    pub block: [usize; 2],
    /// Round scales down to powers of two.
    pub pow2_scales: bool,
    /// What the module's FP8 parameters hold.
    pub storage: Fp8Storage,
}

impl Fp8PrimaryConfig {
    /// The weight blocks and scale rounding of a GEMM recipe (square `b×b` blocks), so the
    /// primary weights are exactly what the recipe's GEMMs quantise.
    pub fn from_recipe(recipe: &Fp8Recipe) -> Self {
        Self {
            block: [recipe.block_size, recipe.block_size],
            pow2_scales: recipe.pow2_scales,
            storage: Fp8Storage::default(),
        }
    }

    /// `self` with the module's FP8 parameters holding `storage`.
    pub fn with_storage(mut self, storage: Fp8Storage) -> Self {
        self.storage = storage;
        self
    }
}

/// How an FP8 parameter is made of matrices: `matrices` canonical `[rows, cols]` (`[out, in]`)
/// matrices, stored row-major or (`transposed`) as `[cols, rows]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8ParamLayout {
    /// Stacked matrices (local experts; 1 for a linear weight).
    pub matrices: usize,
    /// Canonical rows (output features).
    pub rows: usize,
    /// Canonical columns (input features).
    pub cols: usize,
    /// Stored `[cols, rows]` (Burn `Linear` weights are `[in, out]`).
    pub transposed: bool,
}

impl Fp8ParamLayout {
    /// Routed-expert weights `[L, M, K]` (`[experts, out, in]`, the grouped GEMM's layout),
    /// or `None` for other parameters.
    pub fn experts(info: &ParamInfo) -> Option<Self> {
        match (info.class, info.shape.as_slice()) {
            (ParamClass::Expert, &[l, m, k]) => Some(Self {
                matrices: l,
                rows: m,
                cols: k,
                transposed: false,
            }),
            _ => None,
        }
    }

    /// A Burn `Linear` weight `[in, out]` (canonical `[out, in]`), or `None` if not 2-D.
    pub fn linear(info: &ParamInfo) -> Option<Self> {
        match info.shape.as_slice() {
            &[i, o] => Some(Self {
                matrices: 1,
                rows: o,
                cols: i,
                transposed: true,
            }),
            _ => None,
        }
    }
}

/// The FP8 primary copy of one parameter: E4M3 codes in the parameter's storage order and one
/// `scale_inv` per block (`[matrices, ceil(rows/b0), ceil(cols/b1)]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Weight {
    /// Blocks and storage order.
    pub grid: BlockGrid,
    /// E4M3 codes, storage order.
    pub data: Vec<u8>,
    /// Dequantisation multipliers, `[matrices, gr, gc]` row-major.
    pub scale_inv: Vec<f32>,
}

impl Fp8Weight {
    /// Decoded values in storage order: `decode(q) · scale_inv` of each element's block.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.data.len()];
        simd(|| {
            self.grid.for_each_run(0, self.data.len(), |at, n, b| {
                let (q, o) = (&self.data[at..at + n], &mut out[at..at + n]);
                decode_scaled(Fp8Format::E4M3, q, self.scale_inv[b], o);
            });
        });
        out
    }

    /// The FP8 weight a packed parameter holds (codes and scales copied out).
    pub fn from_packed(p: &PackedFp8) -> Self {
        Self {
            grid: p.grid(),
            data: p.codes().to_vec(),
            scale_inv: p.scale_inv(),
        }
    }

    /// Packs this weight as a parameter of `shape` and float `dtype`.
    pub fn to_packed(&self, shape: &[usize], dtype: burn::tensor::DType) -> Result<PackedFp8> {
        PackedFp8::new(self.grid, &self.data, &self.scale_inv, shape, dtype)
    }

    /// The codes in canonical order (`[matrices, rows, cols]`): the storage order, transposed
    /// per matrix when the parameter is stored `[cols, rows]`.
    pub fn canonical_data(&self) -> Vec<u8> {
        let g = &self.grid;
        if !g.transposed {
            return self.data.clone();
        }
        let per = g.rows * g.cols;
        let mut out = vec![0u8; self.data.len()];
        for m in 0..g.matrices {
            let (src, dst) = (&self.data[m * per..], &mut out[m * per..(m + 1) * per]);
            for c in 0..g.cols {
                for r in 0..g.rows {
                    dst[r * g.cols + c] = src[c * g.rows + r];
                }
            }
        }
        out
    }
}

/// One FP8 parameter of a class buffer.
#[derive(Debug, Clone)]
pub(super) struct Fp8Slot {
    pub(super) id: ParamId,
    pub(super) path: String,
    /// Offset of its first element in the class buffer.
    pub(super) offset: usize,
    pub(super) grid: BlockGrid,
}

impl Fp8Slot {
    fn end(&self) -> usize {
        self.offset + self.grid.numel()
    }
}

/// The FP8 slots of one class (sorted by offset) for `infos`, with `select`'s layouts.
pub(super) fn slots_for(
    infos: &[ParamInfo],
    expert_class: bool,
    config: &Fp8PrimaryConfig,
    select: &dyn Fn(&ParamInfo) -> Option<Fp8ParamLayout>,
) -> Result<Vec<Fp8Slot>> {
    let mut slots = Vec::new();
    for info in infos.iter().filter(|p| p.class.is_expert() == expert_class) {
        let Some(layout) = select(info) else {
            continue;
        };
        let grid = BlockGrid::stacked(
            layout.matrices,
            layout.rows,
            layout.cols,
            config.block,
            layout.transposed,
        )?;
        if grid.numel() != info.numel() {
            return Err(BackendError::Shape {
                op: "fp8 primary weights",
                detail: format!(
                    "`{}` {:?} is not {} matrices of [{}, {}]",
                    info.path, info.shape, layout.matrices, layout.rows, layout.cols
                ),
            });
        }
        slots.push(Fp8Slot {
            id: info.id,
            path: info.path.clone(),
            offset: info.offset,
            grid,
        });
    }
    slots.sort_by_key(|s| s.offset);
    Ok(slots)
}

/// A run of consecutive class-buffer elements: inside FP8 slot `slot`, or plain f32 (`None`).
#[derive(Debug, Clone, Copy)]
struct Segment {
    start: usize,
    end: usize,
    slot: Option<usize>,
}

/// `[lo, hi)` cut into runs along the slots' boundaries.
fn segments(lo: usize, hi: usize, slots: &[Fp8Slot]) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut at = lo;
    for (i, s) in slots.iter().enumerate() {
        if at >= hi {
            break;
        }
        if s.end() <= at {
            continue;
        }
        if s.offset > at {
            let end = s.offset.min(hi);
            out.push(Segment {
                start: at,
                end,
                slot: None,
            });
            at = end;
        }
        if at < hi && at < s.end() {
            let end = s.end().min(hi);
            out.push(Segment {
                start: at,
                end,
                slot: Some(i),
            });
            at = end;
        }
    }
    if at < hi {
        out.push(Segment {
            start: at,
            end: hi,
            slot: None,
        });
    }
    out
}

fn unreadable(what: &str, e: impl std::fmt::Debug) -> BackendError {
    BackendError::Shape {
        op: "fp8 primary weights",
        detail: format!("{what} unreadable: {e:?}"),
    }
}

/// Steps 1–5 of the module docs for one class buffer. `master` is this rank's shard of
/// `shard_size` elements (the buffer of `len` elements padded to `shard_size · group size`).
/// Returns the FP8 weights of `slots` and, with `decode`, the full unpadded buffer (FP8
/// parameters decoded), else the compact buffer of the other elements only (the class buffer
/// with the slots' ranges cut out, see [`compact_offsets`]).
pub(super) fn cast_and_gather(
    comm: &Comm,
    master: &[f32],
    shard_size: usize,
    len: usize,
    slots: &[Fp8Slot],
    config: &Fp8PrimaryConfig,
    decode: bool,
) -> Result<(Vec<f32>, HashMap<ParamId, Fp8Weight>)> {
    let n = comm.size();
    let range = |r: usize| ((r * shard_size).min(len), ((r + 1) * shard_size).min(len));
    let (lo, hi) = range(comm.rank());
    let mine = segments(lo, hi, slots);
    // 1. Partial block amaxes, packed in slot order.
    let starts: Vec<usize> = slots
        .iter()
        .scan(0, |acc, s| {
            let at = *acc;
            *acc += s.grid.num_blocks();
            Some(at)
        })
        .collect();
    let blocks: usize = slots.iter().map(|s| s.grid.num_blocks()).sum();
    let mut amax = vec![0f32; blocks];
    for seg in &mine {
        if let Some(i) = seg.slot {
            let s = &slots[i];
            accumulate_block_amax(
                &master[seg.start - lo..seg.end - lo],
                seg.start - s.offset,
                &s.grid,
                &mut amax[starts[i]..starts[i] + s.grid.num_blocks()],
            )?;
        }
    }
    // 2. MAX all-reduce over the optimizer group (host bytes through the transport, as the
    // byte gather below: this whole cast runs on host buffers).
    let site = Location::caller();
    if blocks > 0 && comm.size() > 1 {
        amax = comm
            .communicator()
            .all_reduce(TensorData::new(amax, [blocks]), ReduceOp::Max, site)?
            .try_into_vec::<f32>()
            .map_err(|e| unreadable("block amaxes", e))?;
    }
    // 3. Scales (identical on every rank).
    let scales: Vec<f32> = amax
        .iter()
        .map(|&a| compute_scale_from_amax(a, E4M3_MAX, config.pow2_scales, 0.0))
        .collect();
    let scale_inv: Vec<f32> = scales.iter().map(|s| 1.0 / s).collect();
    // 4. Partial cast of this rank's elements, and its f32 elements.
    let (mut bytes, mut plain) = (Vec::new(), Vec::new());
    for seg in &mine {
        let values = &master[seg.start - lo..seg.end - lo];
        match seg.slot {
            Some(i) => {
                let s = &slots[i];
                let sc = &scales[starts[i]..starts[i] + s.grid.num_blocks()];
                bytes.extend(cast_shard_with_scales(
                    values,
                    seg.start - s.offset,
                    &s.grid,
                    sc,
                )?);
            }
            None => plain.extend_from_slice(values),
        }
    }
    // 5. Gather: one byte per FP8 element, four per other element. Every rank knows every
    // rank's segmentation, so a stream is skipped on all ranks alike when nobody sends on it.
    let fp8_elems: usize = slots.iter().map(|s| s.grid.numel()).sum();
    let gathered_bytes = if fp8_elems > 0 {
        let nb = bytes.len();
        let (data, _) = comm
            .communicator()
            .all_gather_v(TensorData::new(bytes, [nb]), site)?;
        data.try_into_vec::<u8>()
            .map_err(|e| unreadable("FP8 bytes", e))?
    } else {
        Vec::new()
    };
    let gathered_plain = if fp8_elems < len {
        let np = plain.len();
        let (data, _) = comm
            .communicator()
            .all_gather_v(TensorData::new(plain, [np]), site)?;
        data.try_into_vec::<f32>()
            .map_err(|e| unreadable("gathered parameters", e))?
    } else {
        Vec::new()
    };
    // Decode and reassemble in rank order.
    let mut weights: Vec<Fp8Weight> = slots
        .iter()
        .enumerate()
        .map(|(i, s)| Fp8Weight {
            grid: s.grid,
            data: vec![0u8; s.grid.numel()],
            scale_inv: scale_inv[starts[i]..starts[i] + s.grid.num_blocks()].to_vec(),
        })
        .collect();
    if !decode {
        // The plain elements arrive in class-buffer order (ranks own increasing ranges).
        let mut bi = 0usize;
        for r in 0..n {
            let (rlo, rhi) = range(r);
            for seg in segments(rlo, rhi, slots) {
                if let Some(i) = seg.slot {
                    let k = seg.end - seg.start;
                    let src = gathered_bytes
                        .get(bi..bi + k)
                        .ok_or_else(|| unreadable("FP8 bytes", "short gather"))?;
                    let local = seg.start - slots[i].offset;
                    weights[i].data[local..local + k].copy_from_slice(src);
                    bi += k;
                }
            }
        }
        if gathered_plain.len() != len - fp8_elems {
            return Err(unreadable("gathered parameters", "wrong gather length"));
        }
        let map = slots.iter().zip(weights).map(|(s, w)| (s.id, w)).collect();
        return Ok((gathered_plain, map));
    }
    let mut full = vec![0f32; len];
    let (mut bi, mut pi) = (0usize, 0usize);
    for r in 0..n {
        let (rlo, rhi) = range(r);
        for seg in segments(rlo, rhi, slots) {
            let k = seg.end - seg.start;
            match seg.slot {
                Some(i) => {
                    let src = gathered_bytes
                        .get(bi..bi + k)
                        .ok_or_else(|| unreadable("FP8 bytes", "short gather"))?;
                    let w = &mut weights[i];
                    let local = seg.start - slots[i].offset;
                    w.data[local..local + k].copy_from_slice(src);
                    let out = &mut full[seg.start..seg.end];
                    let scale_inv = &w.scale_inv;
                    simd(|| {
                        w.grid.for_each_run(local, k, |at, n, b| {
                            let s = scale_inv[b];
                            decode_scaled(
                                Fp8Format::E4M3,
                                &src[at..at + n],
                                s,
                                &mut out[at..at + n],
                            );
                        });
                    });
                    bi += k;
                }
                None => {
                    let src = gathered_plain
                        .get(pi..pi + k)
                        .ok_or_else(|| unreadable("gathered parameters", "short gather"))?;
                    full[seg.start..seg.end].copy_from_slice(src);
                    pi += k;
                }
            }
        }
    }
    let map = slots.iter().zip(weights).map(|(s, w)| (s.id, w)).collect();
    Ok((full, map))
}

/// Offsets of the non-FP8 parameters of one class (`infos` of the class) in the compact
/// buffer of [`cast_and_gather`] without `decode`: the class offset minus the FP8 elements
/// before it.
pub(super) fn compact_offsets<'a>(
    infos: impl Iterator<Item = &'a ParamInfo>,
    slots: &[Fp8Slot],
) -> HashMap<ParamId, usize> {
    infos
        .filter(|p| !slots.iter().any(|s| s.id == p.id))
        .map(|p| {
            let before: usize = slots
                .iter()
                .filter(|s| s.offset < p.offset)
                .map(|s| s.grid.numel())
                .sum();
            (p.id, p.offset - before)
        })
        .collect()
}

/// Checks that `weights` (e.g. loaded from a checkpoint) fit the slots.
pub(super) fn check_loaded(slot: &Fp8Slot, w: &Fp8Weight) -> Result<()> {
    if w.grid != slot.grid
        || w.data.len() != slot.grid.numel()
        || w.scale_inv.len() != slot.grid.num_blocks()
    {
        return Err(BackendError::Shape {
            op: "fp8 primary weights",
            detail: format!(
                "`{}`: loaded FP8 weight {:?} ({} codes, {} scales) does not match {:?}",
                slot.path,
                w.grid,
                w.data.len(),
                w.scale_inv.len(),
                slot.grid
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
