//! The optimizer state of a [`DistributedAdamW`] in global, layout-independent coordinates
//! (docs/checkpoints.md §Training checkpoints): which elements of which model parameter each rank's
//! ZeRO-1 shard covers, and reading / writing the master weights and moments of those elements.
//!
//! Each class buffer (dense, expert) is the concatenation of this rank's *local* parameters
//! (TP/EP/ETP shards) in [`ParamTable`](super::ParamTable) order; the rank owns the flat range
//! `[r·size, (r+1)·size)` of it (`r` its index in `dp_cp` / `expt_dp`). The caller says where
//! every local parameter lies in its global tensor ([`ParamPlacement`]: fqn, global shape,
//! offsets, and whether Burn stores it transposed); [`DistributedAdamW::state_pieces`] cuts the
//! owned range into per-parameter flat ranges and each of those into at most `2·ndim − 1`
//! boxes ([`flat_range_boxes`]), so the state of a box can be stored as one chunk of
//! `optim.<state>.<fqn>` and read back under any other layout.

use std::ops::Range;

use burn::module::Module;
use burn::tensor::{DType, Tensor, TensorData};

use super::distributed_adam::{DistributedAdamW, DistributedAdamWConfig, Shard, host_f32};
use super::params::ParamInfo;
use crate::error::{BackendError, Result};

/// One of the per-element states of AdamW.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OptimState {
    /// The f32 master weights.
    Master,
    /// First moment.
    ExpAvg,
    /// Second moment.
    ExpAvgSq,
}

impl OptimState {
    /// Every state, in checkpoint order.
    pub const ALL: [OptimState; 3] = [OptimState::Master, OptimState::ExpAvg, OptimState::ExpAvgSq];

    /// The checkpoint spelling (`master`, `exp_avg`, `exp_avg_sq`).
    pub fn name(self) -> &'static str {
        match self {
            OptimState::Master => "master",
            OptimState::ExpAvg => "exp_avg",
            OptimState::ExpAvgSq => "exp_avg_sq",
        }
    }
}

/// Where one local parameter lies in its global tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamPlacement {
    /// Fully qualified name of the global tensor (e.g. `model.layers.1.mlp.experts.gate_up_proj`).
    pub fqn: String,
    /// Shape of the global tensor.
    pub global_shape: Vec<usize>,
    /// Global offsets of the local parameter's block.
    pub offsets: Vec<usize>,
    /// Shape of the block in global orientation: the local parameter's shape, reversed when
    /// `transposed`, otherwise any shape with the same row-major order (e.g. experts'
    /// `[L, 2F, H]` stored as `[L, 2, F, H]`).
    pub shape: Vec<usize>,
    /// The local parameter is the 2-D transpose of its block (Burn `Linear` stores `[in, out]`,
    /// checkpoints `[out, in]`).
    pub transposed: bool,
}

/// A box `[offsets, offsets + shape)` of a row-major tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FlatBox {
    /// Offsets of the first element.
    pub offsets: Vec<usize>,
    /// Extent along each dimension.
    pub shape: Vec<usize>,
}

impl FlatBox {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The boxes (at most `2·ndim − 1`, in row-major order, each a contiguous run) that make up the
/// flat element range `[start, end)` of a row-major tensor of `shape`
/// (docs/checkpoints.md §Distributed checkpoint format: how a DistOpt flat range is stored):
/// partial leading rows, a full middle block, partial trailing rows, recursively.
pub fn flat_range_boxes(shape: &[usize], start: usize, end: usize) -> Vec<FlatBox> {
    let mut out = Vec::new();
    let total: usize = shape.iter().product();
    let end = end.min(total);
    if start >= end {
        return out;
    }
    if shape.is_empty() {
        out.push(FlatBox {
            offsets: Vec::new(),
            shape: Vec::new(),
        });
        return out;
    }
    flat_rec(shape, &mut vec![0; shape.len()], 0, start, end, &mut out);
    out
}

fn flat_rec(
    shape: &[usize],
    prefix: &mut Vec<usize>,
    dim: usize,
    start: usize,
    end: usize,
    out: &mut Vec<FlatBox>,
) {
    // `[start, end)` is relative to the sub-tensor `shape[dim..]` at index `prefix[..dim]`.
    let n = shape.len();
    if start >= end {
        return;
    }
    let row: usize = shape[dim + 1..].iter().product();
    let make = |prefix: &[usize], lo: usize, hi: usize| {
        let mut offsets = prefix[..dim].to_vec();
        offsets.push(lo);
        offsets.extend(std::iter::repeat_n(0, n - dim - 1));
        let mut ext = vec![1; dim];
        ext.push(hi - lo);
        ext.extend_from_slice(&shape[dim + 1..]);
        FlatBox {
            offsets,
            shape: ext,
        }
    };
    if dim == n - 1 || row == 0 {
        out.push(make(prefix, start / row.max(1), end.div_ceil(row.max(1))));
        return;
    }
    let first_full = start.div_ceil(row);
    let last_full = end / row;
    if first_full > last_full {
        // Inside one row: recurse into it.
        let r = start / row;
        prefix[dim] = r;
        flat_rec(shape, prefix, dim + 1, start - r * row, end - r * row, out);
        return;
    }
    if start < first_full * row {
        let r = start / row;
        prefix[dim] = r;
        flat_rec(shape, prefix, dim + 1, start - r * row, row, out);
    }
    if first_full < last_full {
        out.push(make(prefix, first_full, last_full));
    }
    if last_full * row < end {
        prefix[dim] = last_full;
        flat_rec(shape, prefix, dim + 1, 0, end - last_full * row, out);
    }
}

/// One box of one parameter inside this rank's optimizer shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatePiece {
    /// Index of the parameter in [`DistributedAdamW::table`].
    pub param: usize,
    /// Fully qualified name of the global tensor.
    pub fqn: String,
    /// Shape of the global tensor.
    pub global_shape: Vec<usize>,
    /// Global offsets of the box.
    pub offsets: Vec<usize>,
    /// Shape of the box (global orientation).
    pub shape: Vec<usize>,
    /// Whether the parameter is in the expert buffer.
    pub expert: bool,
    /// Positions of the box's elements in this rank's shard of the class buffer (in the
    /// parameter's local order, i.e. transposed when `transposed`).
    pub shard: Range<usize>,
    /// The shard stores the box transposed (see [`ParamPlacement::transposed`]).
    pub transposed: bool,
    /// Whether this rank writes the box to checkpoints: every rank for its own range, except that
    /// TP-replicated parameters are written by TP rank 0 only
    /// (docs/checkpoints.md §Distributed checkpoint format).
    pub main_replica: bool,
}

impl StatePiece {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

fn state_error(detail: String) -> BackendError {
    BackendError::Shape {
        op: "DistributedAdamW state",
        detail,
    }
}

/// `[rows, cols]` row-major → `[cols, rows]` row-major (how a Burn `Linear`'s `[in, out]`
/// values become the checkpoint's `[out, in]`).
pub fn transpose_2d(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// Checks a placement against its parameter.
fn check_placement(info: &ParamInfo, place: &ParamPlacement) -> Result<()> {
    let fail = |why: String| {
        Err(state_error(format!(
            "parameter `{}` placed in `{}`: {why}",
            info.path, place.fqn
        )))
    };
    let numel: usize = place.shape.iter().product();
    if numel != info.numel() {
        return fail(format!(
            "block shape {:?} does not hold the {:?} parameter",
            place.shape, info.shape
        ));
    }
    if place.transposed {
        let reversed: Vec<usize> = info.shape.iter().rev().copied().collect();
        if info.shape.len() != 2 || place.shape != reversed {
            return fail(format!(
                "a transposed block must be the 2-D reverse of {:?}, got {:?}",
                info.shape, place.shape
            ));
        }
    }
    let inside = place.offsets.len() == place.global_shape.len()
        && place.shape.len() == place.global_shape.len()
        && (0..place.global_shape.len())
            .all(|d| place.offsets[d] + place.shape[d] <= place.global_shape[d]);
    if !inside {
        return fail(format!(
            "block at {:?} of shape {:?} lies outside {:?}",
            place.offsets, place.shape, place.global_shape
        ));
    }
    Ok(())
}

impl Shard {
    /// `[start, end)` of the class buffer this rank owns (unpadded part only).
    fn owned(&self) -> Range<usize> {
        let start = self.comm.rank() * self.size;
        start.min(self.len)..(start + self.size).min(self.len)
    }

    fn state(&self, state: OptimState) -> &Tensor<1> {
        match state {
            OptimState::Master => &self.master,
            OptimState::ExpAvg => &self.moments.exp_avg,
            OptimState::ExpAvgSq => &self.moments.exp_avg_sq,
        }
    }

    fn state_mut(&mut self, state: OptimState) -> &mut Tensor<1> {
        match state {
            OptimState::Master => &mut self.master,
            OptimState::ExpAvg => &mut self.moments.exp_avg,
            OptimState::ExpAvgSq => &mut self.moments.exp_avg_sq,
        }
    }

    /// The values of `state` in `range` of the shard, read back to the host (bf16 moments
    /// widened exactly to f32).
    fn read(&self, state: OptimState, range: Range<usize>) -> Result<Vec<f32>> {
        if range.is_empty() {
            return Ok(Vec::new());
        }
        host_f32(self.state(state).clone().slice(range), "optimizer state")
    }

    /// Overwrites `range` of `state` with `values` (uploaded; rounded once to bf16 for bf16
    /// moments).
    fn write(&mut self, state: OptimState, range: Range<usize>, values: Vec<f32>) {
        if range.is_empty() {
            return;
        }
        let device = self.device.clone();
        let t = self.state_mut(state);
        let n = values.len();
        let values = Tensor::<1>::from_data(TensorData::new(values, [n]), (&device, DType::F32))
            .cast(t.dtype());
        *t = t.clone().slice_assign(range, values);
    }
}

impl DistributedAdamW {
    /// The hyper-parameters.
    pub fn config(&self) -> &DistributedAdamWConfig {
        &self.config
    }

    /// Optimizer steps taken (the bias-correction step count).
    pub fn step_count(&self) -> u64 {
        u64::try_from(self.step).unwrap_or(0)
    }

    /// Sets the step count (when resuming from a checkpoint).
    pub fn set_step_count(&mut self, step: u64) -> Result<()> {
        self.step = i32::try_from(step).map_err(|_| BackendError::Config {
            field: "step",
            detail: format!("optimizer step {step} exceeds i32"),
        })?;
        Ok(())
    }

    /// The boxes of global parameters this rank's shards cover. `place` gives the placement
    /// of every parameter of [`table`](Self::table) (the same on every rank for a given layout
    /// and rank); pieces come in table order, dense parameters first, then experts.
    pub fn state_pieces(
        &self,
        place: &dyn Fn(&ParamInfo) -> Result<ParamPlacement>,
    ) -> Result<Vec<StatePiece>> {
        let mut out = Vec::new();
        for expert in [false, true] {
            let shard = if expert { &self.expert } else { &self.dense };
            let owned = shard.owned();
            let base = shard.comm.rank() * shard.size;
            for (index, info) in self.table.params.iter().enumerate() {
                if info.class.is_expert() != expert {
                    continue;
                }
                let lo = info.offset.max(owned.start);
                let hi = (info.offset + info.numel()).min(owned.end);
                if lo >= hi {
                    continue;
                }
                let placement = place(info)?;
                check_placement(info, &placement)?;
                let main_replica = !info
                    .class
                    .is_duplicate_on(self.tp.rank(), self.expt_tp.rank());
                // Boxes of the parameter's local layout (transposed: Burn's `[in, out]`).
                let local_shape = if placement.transposed {
                    info.shape.clone()
                } else {
                    placement.shape.clone()
                };
                let mut at = lo - base;
                for b in flat_range_boxes(&local_shape, lo - info.offset, hi - info.offset) {
                    let n = b.numel();
                    let (offsets, shape) = if placement.transposed {
                        (
                            b.offsets.iter().rev().copied().collect::<Vec<_>>(),
                            b.shape.iter().rev().copied().collect::<Vec<_>>(),
                        )
                    } else {
                        (b.offsets, b.shape)
                    };
                    let offsets = offsets
                        .iter()
                        .zip(&placement.offsets)
                        .map(|(o, base)| o + base)
                        .collect();
                    out.push(StatePiece {
                        param: index,
                        fqn: placement.fqn.clone(),
                        global_shape: placement.global_shape.clone(),
                        offsets,
                        shape,
                        expert,
                        shard: at..at + n,
                        transposed: placement.transposed,
                        main_replica,
                    });
                    at += n;
                }
            }
        }
        Ok(out)
    }

    fn shard_of(&self, piece: &StatePiece) -> Result<&Shard> {
        let shard = if piece.expert {
            &self.expert
        } else {
            &self.dense
        };
        if piece.shard.end > shard.size || piece.shard.len() != piece.numel() {
            return Err(state_error(format!(
                "piece of `{}` at shard {:?} does not fit a shard of {} elements",
                piece.fqn, piece.shard, shard.size
            )));
        }
        Ok(shard)
    }

    /// The values of `state` in `piece`, row-major in the box's global orientation (bf16
    /// moments widened exactly to f32).
    pub fn piece_values(&self, piece: &StatePiece, state: OptimState) -> Result<Vec<f32>> {
        let values = self.shard_of(piece)?.read(state, piece.shard.clone())?;
        Ok(match piece.shape.as_slice() {
            [rows, cols] if piece.transposed => transpose_2d(&values, *cols, *rows),
            _ => values,
        })
    }

    /// Overwrites `state` in `piece` with `values` (row-major in the box's global orientation;
    /// rounded once to bf16 for bf16 moments). Loading a checkpoint under another layout is
    /// this, for every piece of the new layout, with the values read from the stored boxes.
    pub fn set_piece_values(
        &mut self,
        piece: &StatePiece,
        state: OptimState,
        values: &[f32],
    ) -> Result<()> {
        self.shard_of(piece)?;
        if values.len() != piece.numel() {
            return Err(state_error(format!(
                "{} values for the {:?} box of `{}`",
                values.len(),
                piece.shape,
                piece.fqn
            )));
        }
        let local = match piece.shape.as_slice() {
            [rows, cols] if piece.transposed => transpose_2d(values, *rows, *cols),
            _ => values.to_vec(),
        };
        let shard = if piece.expert {
            &mut self.expert
        } else {
            &mut self.dense
        };
        shard.write(state, piece.shard.clone(), local);
        Ok(())
    }

    /// Sets the master weights of this rank's shards from `module`'s parameter values (e.g.
    /// after loading parameters from a model-only checkpoint); moments are kept.
    pub fn reset_master_from<M: Module>(&mut self, module: &M) -> Result<()> {
        let device = self.dense.device.clone();
        let (dense, expert) = self.table.flatten_values_on(module, &device)?;
        for (shard, full) in [(&mut self.dense, dense), (&mut self.expert, expert)] {
            let len = full.dims()[0];
            if len != shard.len {
                return Err(state_error(format!(
                    "module has {len} elements in a class buffer of {}",
                    shard.len
                )));
            }
            let owned = shard.owned();
            let n = owned.len();
            if n > 0 {
                let mine = full.slice(owned);
                shard.master = shard.master.clone().slice_assign(0..n, mine);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_ranges_tile_exactly_and_run_contiguously() {
        let shape = [3, 4, 5];
        for start in 0..60 {
            for end in start..=60 {
                let boxes = flat_range_boxes(&shape, start, end);
                assert!(boxes.len() <= 5, "{start}..{end}: {boxes:?}");
                let mut at = start;
                for b in &boxes {
                    let first: usize = b.offsets[0] * 20 + b.offsets[1] * 5 + b.offsets[2];
                    assert_eq!(first, at, "{start}..{end}: {boxes:?}");
                    at += b.numel();
                }
                assert_eq!(at, end.max(start));
            }
        }
        assert_eq!(flat_range_boxes(&[], 0, 1).len(), 1);
    }

    #[test]
    fn transpose_round_trips() {
        let v: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let t = transpose_2d(&v, 2, 3);
        assert_eq!(t, [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_eq!(transpose_2d(&t, 3, 2), v);
    }
}
