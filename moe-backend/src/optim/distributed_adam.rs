//! AdamW as a distributed optimizer (ZeRO-1, docs/parallelism.md §Gradient reduction and scaling,
//! §Distributed optimizer (ZeRO-1)).
//!
//! Per class (dense over `dp_cp`, experts over `expt_dp`) the flat gradient buffer is padded
//! to a multiple of the group size and reduce-scattered (sum, pre-factor `1/|dp_cp|` for both
//! classes); each rank updates the f32 master shard of its range with AdamW (moments in f32
//! or bf16, computed in f32), then the parameter buffer is all-gathered and written back.
//! Before the reduction, sequence-parallel replicated gradients are summed over `tp`; the
//! global gradient norm counts every unique element once (TP-replicated shards on TP rank 0
//! only) and is all-reduced over the world, so it is the same for every layout.
//!
//! # Device
//!
//! The whole step runs on the device of the parameters (Flex, or a Cube device): master
//! weights, moments and the flat gradient / parameter buffers are [`Tensor`]s there. Flattening
//! is a `Tensor::cat` of the reshaped gradients, writing back slices the flat buffer into each
//! parameter, the reductions are [`Comm`] collectives on those tensors (a transport may stage
//! through host memory; a group of one never does), and the AdamW update is element-wise
//! tensor ops in the order of the scalar rule (bit-identical to it on Flex). The one value a
//! step reads back is the global gradient norm (a one-element tensor, accumulated in f64
//! where the device has f64), which the clipping decision and [`StepReport`] need. Host
//! vectors remain in the checkpoint / diagnostics APIs ([`ParamTable::flatten_values`],
//! [`DistributedAdamW::reduced_gradients`], the state pieces) and in the FP8 primary-weight
//! cast ([`super::fp8_primary`]), which runs on host buffers.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Bool, DType, Device, Shape, Tensor, TensorData};

use super::fp8_primary::{
    Fp8ParamLayout, Fp8PrimaryConfig, Fp8Slot, Fp8Storage, Fp8Weight, cast_and_gather,
    check_loaded, compact_offsets, slots_for,
};
use super::host_step::{self, HostGrad, InPlace};
use super::params::{
    ParamClass, ParamInfo, ParamTable, cat_flat, default_classify, like_param, param_device,
};
use super::schedule::no_weight_decay;
use crate::comm::{Comm, GroupComms, ReduceOp};
use crate::error::{BackendError, Result};
use crate::fp8::PackedFp8;
use crate::parallel::GroupFamily;

/// Storage precision of the Adam moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MomentDtype {
    /// f32 moments.
    #[default]
    F32,
    /// bf16 moments (updated in f32, rounded once per step).
    Bf16,
}

/// Hyper-parameters of [`DistributedAdamW`].
#[derive(Debug, Clone)]
pub struct DistributedAdamWConfig {
    /// β₁.
    pub beta_1: f32,
    /// β₂.
    pub beta_2: f32,
    /// ε.
    pub epsilon: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Megatron's default weight-decay exemptions: no decay for 1-D parameters (norm weights)
    /// and biases ([`super::schedule::no_weight_decay`]). `false` decays every parameter (as
    /// Burn's `AdamW`).
    pub exempt_norms_and_biases: bool,
    /// Global gradient-norm clipping threshold.
    pub max_grad_norm: Option<f64>,
    /// Moment storage precision.
    pub moment_dtype: MomentDtype,
}

impl Default for DistributedAdamWConfig {
    fn default() -> Self {
        Self {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.0,
            exempt_norms_and_biases: false,
            max_grad_norm: None,
            moment_dtype: MomentDtype::F32,
        }
    }
}

/// The Adam moments of one shard: device tensors of `[size]` elements, stored in f32 or bf16
/// (always computed in f32).
#[derive(Debug, Clone)]
pub(super) struct Moments {
    pub(super) exp_avg: Tensor<1>,
    pub(super) exp_avg_sq: Tensor<1>,
}

/// The shard of one class's flat buffer owned by this rank; its state lives on the
/// parameters' device.
#[derive(Debug, Clone)]
pub(super) struct Shard {
    pub(super) comm: Comm,
    /// Unpadded buffer length.
    pub(super) len: usize,
    /// Shard length (padded buffer / group size).
    pub(super) size: usize,
    /// The device of the parameters (without autodiff), where the state lives.
    pub(super) device: Device,
    /// f32 master weights, `[size]`.
    pub(super) master: Tensor<1>,
    pub(super) moments: Moments,
    /// Storage precision of the moments.
    pub(super) moment_dtype: MomentDtype,
    /// The dtype the gradient reduce-scatter moves and sums in (f32, or BF16 as Megatron
    /// without `accumulate_allreduce_grads_in_fp32`); the shard it returns is f32.
    pub(super) reduce_dtype: DType,
    /// Ranges of the shard (shard coordinates, sorted, disjoint) without weight decay.
    pub(super) no_decay: Vec<Range<usize>>,
    /// `true` on the elements of `no_decay` (built once, `None` when it is empty).
    no_decay_mask: Option<Tensor<1, Bool>>,
}

/// `t` (1-D) padded with zeros to `n` elements.
fn pad_to(t: Tensor<1>, n: usize, device: &Device) -> Tensor<1> {
    let have = t.dims()[0];
    if have >= n {
        return t;
    }
    if have == 0 {
        return Tensor::zeros([n], (device, DType::F32));
    }
    Tensor::cat(vec![t, Tensor::zeros([n - have], (device, DType::F32))], 0)
}

fn moment_storage(dtype: MomentDtype) -> DType {
    match dtype {
        MomentDtype::F32 => DType::F32,
        MomentDtype::Bf16 => DType::BF16,
    }
}

impl Shard {
    /// The shard of the full f32 buffer `full` (on the parameters' device) owned by this rank,
    /// with zero moments.
    pub(super) fn new(comm: Comm, full: Tensor<1>, dtype: MomentDtype) -> Self {
        let device = full.device();
        let len = full.dims()[0];
        let n = comm.size();
        let size = len.div_ceil(n);
        let start = (comm.rank() * size).min(len);
        let end = (start + size).min(len);
        let mine = if (start, end) == (0, len) {
            full
        } else if start == end {
            Tensor::zeros([0], (&device, DType::F32))
        } else {
            full.slice(start..end)
        };
        let master = pad_to(mine, size, &device);
        let zeros = || Tensor::<1>::zeros([size], (&device, moment_storage(dtype)));
        Self {
            comm,
            len,
            size,
            master,
            moments: Moments {
                exp_avg: zeros(),
                exp_avg_sq: zeros(),
            },
            moment_dtype: dtype,
            reduce_dtype: DType::F32,
            no_decay: Vec::new(),
            no_decay_mask: None,
            device,
        }
    }

    /// Exempts the flat-buffer ranges `ranges` (buffer coordinates) from weight decay.
    fn exempt(&mut self, ranges: impl IntoIterator<Item = Range<usize>>) {
        let start = self.comm.rank() * self.size;
        let end = start + self.size;
        self.no_decay = ranges
            .into_iter()
            .filter_map(|r| {
                let (a, b) = (r.start.max(start), r.end.min(end));
                (a < b).then(|| a - start..b - start)
            })
            .collect();
        self.no_decay.sort_by_key(|r| r.start);
        // Built once on the host at construction (not per step) and uploaded.
        self.no_decay_mask = (!self.no_decay.is_empty()).then(|| {
            let mut mask = vec![false; self.size];
            for r in &self.no_decay {
                mask[r.clone()].fill(true);
            }
            Tensor::from_data(TensorData::new(mask, [self.size]), &self.device)
        });
    }

    /// Reduce-scatter (sum) of the gradient buffer (padded here); returns this rank's shard
    /// scaled by `scale`, on the device.
    fn reduce_scatter(&self, grad: Tensor<1>, scale: f32) -> Result<Tensor<1>> {
        let n = self.comm.size();
        let grad = pad_to(grad, self.size * n, &self.device);
        // A sum over one rank is the buffer itself (the collective returns its input).
        let shard = if n == 1 {
            grad
        } else if self.reduce_dtype != DType::F32 {
            // Sent and summed in the reduction dtype (the transports accumulate BF16 in f32
            // and round the sum once), read back as f32.
            let grad = grad.cast(self.reduce_dtype);
            self.comm
                .reduce_scatter(grad, ReduceOp::Sum)?
                .cast(DType::F32)
        } else {
            self.comm.reduce_scatter(grad, ReduceOp::Sum)?
        };
        Ok(if scale != 1.0 {
            shard.mul_scalar(scale)
        } else {
            shard
        })
    }

    /// All-gather of the master shards; the unpadded full buffer.
    fn all_gather(&self) -> Result<Tensor<1>> {
        self.all_gather_values(self.master.clone())
    }

    /// All-gather of one shard-sized tensor; the unpadded full buffer.
    fn all_gather_values(&self, shard: Tensor<1>) -> Result<Tensor<1>> {
        let full = if self.comm.size() == 1 {
            shard
        } else {
            self.comm.all_gather(shard)?
        };
        Ok(if full.dims()[0] == self.len {
            full
        } else if self.len == 0 {
            Tensor::zeros([0], (&self.device, DType::F32))
        } else {
            full.slice(0..self.len)
        })
    }

    /// AdamW on this rank's master shard with the gradient shard `grad` scaled by `clip` (the
    /// global-norm clipping coefficient): bias-corrected, decoupled decay except on the exempt
    /// ranges, computed in f32 on the device. Element-wise tensor ops in the order of the
    /// scalar rule (`g ← (g as f64 · clip) as f32`, `m ← m·β₁ + g·(1−β₁)`,
    /// `v ← v·β₂ + g·g·(1−β₂)`, `p ← p·factor − lr·(m/bc₁ / (√(v/bc₂) + ε))`, each op rounded
    /// to f32), so Flex gives that rule's bits (checked by the test below).
    ///
    /// On the CPU backend (Flex), whose tensors live in host memory, the same rule runs as one
    /// fused pass over rayon chunks ([`adamw_in_place`](Self::adamw_in_place)): the
    /// composite ops make a dozen passes over the shard, each allocating its output
    /// (BENCHMARKS.md measured 4.6 s against 1.1–1.3 s for a 230 M-parameter model).
    fn adamw(
        &mut self,
        grad: Tensor<1>,
        clip: f64,
        lr: f64,
        step: i32,
        c: &DistributedAdamWConfig,
    ) -> Result<()> {
        if self.size == 0 {
            return Ok(());
        }
        let k = AdamwConstants::new(c, lr, step);
        if self.device == Device::flex() {
            return self.adamw_in_place(&HostGrad::from_pieces(vec![grad])?, clip, &k);
        }
        self.adamw_composite(grad, clip, &k);
        Ok(())
    }

    /// [`adamw`](Self::adamw) as element-wise tensor ops on the shard's device.
    fn adamw_composite(&mut self, grad: Tensor<1>, clip: f64, k: &AdamwConstants) {
        let g = if clip != 1.0 {
            scale_f64(grad, clip, &self.device)
        } else {
            grad
        };
        let m = self.moments.exp_avg.clone().cast(DType::F32);
        let v = self.moments.exp_avg_sq.clone().cast(DType::F32);
        // m ← m·β₁ + g·(1−β₁);  v ← v·β₂ + g·g·(1−β₂)
        let m = m.mul_scalar(k.beta_1) + g.clone().mul_scalar(1.0 - k.beta_1);
        let v = v.mul_scalar(k.beta_2) + g.clone().mul(g).mul_scalar(1.0 - k.beta_2);
        // p ← p·factor − lr·(m̂ / (√v̂ + ε))
        let m_hat = m.clone().div_scalar(k.bc1);
        let v_hat = v.clone().div_scalar(k.bc2);
        let step = (m_hat / v_hat.sqrt().add_scalar(k.epsilon)).mul_scalar(k.lr);
        let p = self.master.clone();
        let decayed = if k.decay == 1.0 {
            p
        } else {
            match &self.no_decay_mask {
                Some(mask) => p.clone().mul_scalar(k.decay).mask_where(mask.clone(), p),
                None => p.mul_scalar(k.decay),
            }
        };
        self.master = decayed - step;
        let store = moment_storage(self.moment_dtype);
        self.moments = Moments {
            exp_avg: m.cast(store),
            exp_avg_sq: v.cast(store),
        };
    }

    /// [`adamw`](Self::adamw) on the CPU backend: the scalar rule element by element in one
    /// pass over chunks in parallel, the master weights and moments updated in their own
    /// storage and the gradient read where it lies ([`host_step`]).
    pub(super) fn adamw_in_place(
        &mut self,
        g: &HostGrad,
        clip: f64,
        k: &AdamwConstants,
    ) -> Result<()> {
        let mut p = InPlace::take(&mut self.master, "master shard")?;
        let mut m = InPlace::take(&mut self.moments.exp_avg, "first moment")?;
        let mut v = InPlace::take(&mut self.moments.exp_avg_sq, "second moment")?;
        let done = host_step::adamw(
            p.values_mut(),
            m.values_mut(),
            v.values_mut(),
            g,
            clip,
            k,
            &self.no_decay,
        );
        self.master = p.finish();
        self.moments = Moments {
            exp_avg: m.finish(),
            exp_avg_sq: v.finish(),
        };
        done
    }
}

/// Whether f64 tensors are available on `device` (Flex: yes; a Cube device: when the
/// adapter has 64-bit floats).
pub(super) fn has_f64(device: &Device) -> bool {
    device.supports_dtype(DType::F64)
}

/// `(g as f64 · c) as f32` element-wise, on the device (in f32, `g · (c as f32)`, where the
/// device has no f64).
pub(super) fn scale_f64(g: Tensor<1>, c: f64, device: &Device) -> Tensor<1> {
    if has_f64(device) {
        g.cast(DType::F64).mul_scalar(c).cast(DType::F32)
    } else {
        g.mul_scalar(c as f32)
    }
}

/// `Σ x²` of `t` as a one-element tensor on its device: accumulated in f64 where the device
/// has f64, else in f32.
pub(super) fn sum_of_squares(t: Tensor<1>, f64: bool) -> Tensor<1> {
    let device = t.device();
    if device == Device::flex() {
        // The CPU backend: one pass over the buffer where it lies, in fixed chunks
        // (deterministic whatever the thread count), each squared and summed in f64, instead
        // of an f64 copy, its square and a sum (three passes allocating twice the buffer).
        if let Ok(values) = HostGrad::from_pieces(vec![t.clone()]) {
            let total = values.sum_of_squares(0..values.len());
            return Tensor::from_data(TensorData::new(vec![total], [1]), (&device, DType::F64));
        }
    }
    if f64 {
        t.cast(DType::F64).square().sum()
    } else {
        t.square().sum()
    }
}

/// The per-step constants of the AdamW update.
#[derive(Debug, Clone, Copy)]
pub(super) struct AdamwConstants {
    pub(super) lr: f32,
    pub(super) bc1: f32,
    pub(super) bc2: f32,
    pub(super) decay: f32,
    pub(super) beta_1: f32,
    pub(super) beta_2: f32,
    pub(super) epsilon: f32,
}

impl AdamwConstants {
    fn new(c: &DistributedAdamWConfig, lr: f64, step: i32) -> Self {
        Self {
            lr: lr as f32,
            bc1: 1.0 - c.beta_1.powi(step),
            bc2: 1.0 - c.beta_2.powi(step),
            decay: 1.0 - lr as f32 * c.weight_decay,
            beta_1: c.beta_1,
            beta_2: c.beta_2,
            epsilon: c.epsilon,
        }
    }
}

/// What one optimizer step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Factor the gradients were multiplied by (1 without clipping).
    pub clip_coeff: f64,
}

/// FP8 primary weights: the selected parameters of each class and their current FP8 weights
/// (with packed storage on Flex, the very storage of the module's parameters: shared, not a
/// copy).
#[derive(Debug, Clone)]
pub(super) struct Fp8Primary {
    pub(super) config: Fp8PrimaryConfig,
    pub(super) dense: Vec<Fp8Slot>,
    pub(super) expert: Vec<Fp8Slot>,
    pub(super) weights: HashMap<ParamId, PackedFp8>,
}

/// ZeRO-1 AdamW over the dense (`dp_cp`) and expert (`expt_dp`) groups, optionally with FP8
/// primary weights ([`DistributedAdamW::enable_fp8_primary_weights`]).
#[derive(Debug, Clone)]
pub struct DistributedAdamW {
    pub(super) config: DistributedAdamWConfig,
    pub(super) table: ParamTable,
    pub(super) tp: Comm,
    /// The expert-TP group (its rank 0 counts the ETP-replicated expert parameters).
    pub(super) expt_tp: Comm,
    world: Comm,
    pub(super) dense: Shard,
    pub(super) expert: Shard,
    /// Ranges of the dense shard (shard coordinates) this rank counts in the global norm, or
    /// `None` for the whole shard (every dense parameter counts on this TP rank).
    norm_ranges: Option<Vec<Range<usize>>>,
    /// The same for the expert shard (ETP-replicated parameters count on expert-TP rank 0).
    expert_norm_ranges: Option<Vec<Range<usize>>>,
    /// Dense parameters left out of the gradient norm ([`DistributedAdamW::exclude_from_norm`]).
    norm_excluded: Vec<ParamId>,
    /// `1/|dp_cp|`, the gradient pre-factor of both classes.
    scale: f32,
    pub(super) step: i32,
    pub(super) fp8: Option<Fp8Primary>,
    /// Refuse a step whose global gradient norm is not finite
    /// ([`DistributedAdamW::set_check_non_finite`]).
    check_non_finite: bool,
}

impl DistributedAdamW {
    /// Builds the optimizer for `module` (parameters classified by
    /// [`default_classify`]) on this rank's groups; `world` is the communicator of all ranks.
    pub fn new<M: Module>(
        module: &M,
        groups: &GroupComms,
        world: Comm,
        config: DistributedAdamWConfig,
    ) -> Result<Self> {
        Self::with_classes(module, groups, world, config, &default_classify)
    }

    /// [`DistributedAdamW::new`] with a custom classification.
    pub fn with_classes<M: Module, F: Fn(&str, bool) -> ParamClass>(
        module: &M,
        groups: &GroupComms,
        world: Comm,
        config: DistributedAdamWConfig,
        classify: &F,
    ) -> Result<Self> {
        let table = ParamTable::new(module, classify);
        let device = param_device(module);
        if config.moment_dtype == MomentDtype::Bf16 && !device.supports_dtype(DType::BF16) {
            return Err(BackendError::Config {
                field: "moment_dtype",
                detail: format!("bf16 moments need bf16 tensors, which {device:?} lacks"),
            });
        }
        let (dense, expert) = table.flatten_values_on(module, &device)?;
        let dp_cp = groups.comm(GroupFamily::DpCp).clone();
        let scale = 1.0 / dp_cp.size() as f32;
        let mut dense = Shard::new(dp_cp, dense, config.moment_dtype);
        let mut expert = Shard::new(
            groups.comm(GroupFamily::ExptDp).clone(),
            expert,
            config.moment_dtype,
        );
        let tp = groups.comm(GroupFamily::Tp).clone();
        let expt_tp = groups.comm(GroupFamily::ExptTp).clone();
        let ranks = (tp.rank(), expt_tp.rank());
        let (norm_ranges, expert_norm_ranges) = (
            counted_ranges(&table, &dense, false, ranks, &[]),
            counted_ranges(&table, &expert, true, ranks, &[]),
        );
        if config.exempt_norms_and_biases {
            let exempt = |experts: bool| {
                table
                    .params
                    .iter()
                    .filter(move |p| p.class.is_expert() == experts)
                    .filter(|p| no_weight_decay(&p.path, &p.shape))
                    .map(|p| p.offset..p.offset + p.numel())
            };
            dense.exempt(exempt(false));
            expert.exempt(exempt(true));
        }
        Ok(Self {
            dense,
            expert,
            norm_ranges,
            expert_norm_ranges,
            norm_excluded: Vec::new(),
            check_non_finite: true,
            tp,
            expt_tp,
            world,
            config,
            table,
            scale,
            step: 0,
            fp8: None,
        })
    }

    /// Switches the parameters `select` picks (with their matrix layout) to FP8 primary weights
    /// (docs/fp8.md §FP8 primary weights, see [`super::fp8_primary`]): from now on every step casts
    /// their master shards straight to blockwise E4M3 (partial amax, MAX all-reduce over the
    /// class's group, partial cast) and all-gathers one byte per element. Casts the current master
    /// weights right away and returns `module` holding the FP8 weights as `config.storage` says
    /// (packed codes and scales, or decoded values). A collective: every rank of the world calls it
    /// with the same selection.
    pub fn enable_fp8_primary_weights<M: Module>(
        &mut self,
        module: M,
        config: Fp8PrimaryConfig,
        select: &dyn Fn(&ParamInfo) -> Option<Fp8ParamLayout>,
    ) -> Result<M> {
        let dense = slots_for(&self.table.params, false, &config, select)?;
        let expert = slots_for(&self.table.params, true, &config, select)?;
        self.fp8 = Some(Fp8Primary {
            config,
            dense,
            expert,
            weights: HashMap::new(),
        });
        self.gather_into(module)
    }

    /// Re-casts the FP8 primary weights from the current master shards (a collective) and
    /// returns `module` holding them, e.g. after the master weights were restored from a
    /// checkpoint that stores the parameters in high precision. Errors when FP8 primary
    /// weights are off.
    pub fn recast_fp8_primary_weights<M: Module>(&mut self, module: M) -> Result<M> {
        if self.fp8.is_none() {
            return Err(fp8_off());
        }
        self.gather_into(module)
    }

    /// The FP8 primary-weight settings, when enabled.
    pub fn fp8_config(&self) -> Option<&Fp8PrimaryConfig> {
        self.fp8.as_ref().map(|f| &f.config)
    }

    /// The current FP8 weight of parameter `id` (codes and scales copied out of the packed
    /// storage the module computes with), when it is an FP8 primary weight.
    pub fn fp8_weight(&self, id: ParamId) -> Option<Fp8Weight> {
        self.packed_fp8_weight(id).map(Fp8Weight::from_packed)
    }

    /// The current packed FP8 weight of parameter `id` (with packed storage on Flex, the
    /// module parameter's own storage), when it is an FP8 primary weight.
    pub fn packed_fp8_weight(&self, id: ParamId) -> Option<&PackedFp8> {
        self.fp8.as_ref().and_then(|f| f.weights.get(&id))
    }

    /// Whether the module's FP8 parameters hold packed codes and scales (packed storage, on
    /// Flex) rather than decoded values.
    fn packs(&self) -> bool {
        self.fp8
            .as_ref()
            .is_some_and(|f| f.config.storage == Fp8Storage::Packed)
            && self.dense.device == Device::flex()
    }

    /// Replaces the FP8 weights, e.g. with the bytes and scales restored from a checkpoint;
    /// [`DistributedAdamW::apply_fp8_weights`] then writes them into the module. Errors when
    /// FP8 primary weights are off, or a weight does not match its parameter's block grid.
    pub fn set_fp8_weights(&mut self, weights: HashMap<ParamId, Fp8Weight>) -> Result<()> {
        let fp8 = self.fp8.as_mut().ok_or_else(fp8_off)?;
        let mut packed = HashMap::new();
        for (id, w) in &weights {
            let slot = fp8
                .dense
                .iter()
                .chain(&fp8.expert)
                .find(|s| s.id == *id)
                .ok_or_else(|| BackendError::Config {
                    field: "fp8_primary_weights",
                    detail: format!("parameter {id} is not an FP8 primary weight"),
                })?;
            check_loaded(slot, w)?;
            packed.insert(
                *id,
                w.to_packed(&param_shape(&self.table, *id)?, DType::F32)?,
            );
        }
        fp8.weights.extend(packed);
        Ok(())
    }

    /// `module` with its FP8 primary parameters holding the current FP8 weights (packed, or
    /// decoded values; see [`Fp8Storage`]), the other parameters untouched. Errors when FP8
    /// primary weights are off.
    pub fn apply_fp8_weights<M: Module>(&mut self, module: M) -> Result<M> {
        if self.fp8.is_none() {
            return Err(fp8_off());
        }
        self.write_fp8(module, None)
    }

    /// All-gathers the master shards into full `(dense, expert)` buffers on the device: plain
    /// f32 for a class without FP8 primary weights, else the FP8 cast-and-gather (which also
    /// refreshes the FP8 weights) with the FP8 parameters' values decoded.
    pub(super) fn gather_parameters(&mut self) -> Result<(Tensor<1>, Tensor<1>)> {
        self.gather_classes(true)
    }

    /// [`DistributedAdamW::gather_parameters`]; without `decode`, a class with FP8 parameters
    /// gathers into its compact buffer (the other parameters only, see
    /// [`super::fp8_primary::compact_offsets`]).
    fn gather_classes(&mut self, decode: bool) -> Result<(Tensor<1>, Tensor<1>)> {
        let Some(fp8) = self.fp8.as_mut() else {
            return Ok((self.dense.all_gather()?, self.expert.all_gather()?));
        };
        let table = &self.table;
        let mut gather = |shard: &Shard, slots: &[Fp8Slot]| -> Result<Tensor<1>> {
            if slots.is_empty() {
                return shard.all_gather();
            }
            // Host path: the blockwise E4M3 cast (partial amax, scales, partial cast, byte
            // gather) runs on host buffers (`super::fp8_primary`); the master shard is read
            // back and the gathered buffer uploaded again. Only with FP8 primary weights.
            let master = shard
                .master
                .clone()
                .into_data()
                .try_into_vec::<f32>()
                .map_err(|e| BackendError::Shape {
                    op: "DistributedAdamW",
                    detail: format!("master shard unreadable: {e:?}"),
                })?;
            let (values, weights) = cast_and_gather(
                &shard.comm,
                &master,
                shard.size,
                shard.len,
                slots,
                &fp8.config,
                decode,
            )?;
            for (id, w) in weights {
                let packed = w.to_packed(&param_shape(table, id)?, DType::F32)?;
                fp8.weights.insert(id, packed);
            }
            let n = values.len();
            Ok(Tensor::from_data(
                TensorData::new(values, [n]),
                (&shard.device, DType::F32),
            ))
        };
        let dense = gather(&self.dense, &fp8.dense)?;
        let expert = gather(&self.expert, &fp8.expert)?;
        Ok((dense, expert))
    }

    /// Gathers the parameters and writes them into `module`: with packed storage, the FP8
    /// parameters become their packed weights and the others slices of the compact buffers;
    /// otherwise every parameter is a slice of the full (decoded) buffers.
    fn gather_into<M: Module>(&mut self, module: M) -> Result<M> {
        if self.packs() {
            let (dense, expert) = self.gather_classes(false)?;
            self.write_fp8(module, Some((&dense, &expert)))
        } else {
            let (dense, expert) = self.gather_parameters()?;
            self.table.write_tensors(module, &dense, &expert)
        }
    }

    /// Writes the FP8 weights into `module`'s FP8 parameters (packed when [`Self::packs`],
    /// else decoded values) and, with `compact` buffers, every other parameter from them.
    fn write_fp8<M: Module>(
        &mut self,
        module: M,
        compact: Option<(&Tensor<1>, &Tensor<1>)>,
    ) -> Result<M> {
        let carriers = self.packs();
        let device = self.dense.device.clone();
        let Some(fp8) = self.fp8.as_mut() else {
            return Err(fp8_off());
        };
        let compact = compact.map(|(dense, expert)| {
            let mut offsets = compact_offsets(
                self.table.params.iter().filter(|p| !p.class.is_expert()),
                &fp8.dense,
            );
            offsets.extend(compact_offsets(
                self.table.params.iter().filter(|p| p.class.is_expert()),
                &fp8.expert,
            ));
            (dense, expert, offsets)
        });
        let mut writer = Fp8Writer {
            table: &self.table,
            index: 0,
            compact,
            weights: &mut fp8.weights,
            carriers,
            device,
            error: None,
        };
        let module = module.map(&mut writer);
        match writer.error {
            Some(e) => Err(e),
            None => Ok(module),
        }
    }

    /// Leaves the dense parameters `ids` out of the global gradient norm (they are still
    /// updated): copies whose original another rank counts, such as the last pipeline stage's
    /// copy of the embedding (Megatron counts shared parameters once). Expert parameters
    /// cannot be excluded.
    pub fn exclude_from_norm(&mut self, ids: &[ParamId]) -> Result<()> {
        if let Some(p) =
            (self.table.params.iter()).find(|p| ids.contains(&p.id) && p.class.is_expert())
        {
            return Err(BackendError::Config {
                field: "exclude_from_norm",
                detail: format!("`{}` is an expert parameter", p.path),
            });
        }
        let ranks = (self.tp.rank(), self.expt_tp.rank());
        self.norm_ranges = counted_ranges(&self.table, &self.dense, false, ranks, ids);
        self.norm_excluded = ids.to_vec();
        Ok(())
    }

    /// The parameters left out of the gradient norm ([`exclude_from_norm`](Self::exclude_from_norm)).
    pub fn norm_excluded(&self) -> &[ParamId] {
        &self.norm_excluded
    }

    /// Sets the decoupled weight decay of the following steps (a weight-decay schedule).
    pub fn set_weight_decay(&mut self, weight_decay: f32) {
        self.config.weight_decay = weight_decay;
    }

    /// The parameter table (classes and flat offsets).
    pub fn table(&self) -> &ParamTable {
        &self.table
    }

    /// The device the optimizer state lives on (the parameters' device, without autodiff).
    pub fn device(&self) -> &Device {
        &self.dense.device
    }

    /// One step: reduces this rank's local gradients, clips by the global norm, updates the
    /// local shards and returns `module` with the all-gathered new parameters. Runs on the
    /// parameters' device: flat buffers, master weights and moments are device tensors; the
    /// only value read back is the global gradient norm (one scalar, needed on the host for
    /// the clipping decision and the report).
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<(M, StepReport)> {
        let max_norm = self.config.max_grad_norm;
        let clip = |norm: f64| match max_norm {
            Some(max) if norm > max => max / (norm + 1e-6),
            _ => 1.0,
        };
        let (grad_norm, clip_coeff);
        let mut module = module;
        if self.dense.device == Device::flex() {
            // The CPU backend: gradients read where they lie, the norm and the update from the
            // same buffers, master weights and moments updated in their storage (`host_step`).
            let (dense, expert) = self.reduce_local_host(&module, &mut grads)?;
            for (shard, g) in [(&self.dense, &dense), (&self.expert, &expert)] {
                if shard.size > 0 && g.len() != shard.size {
                    return Err(BackendError::Shape {
                        op: "DistributedAdamW",
                        detail: format!(
                            "gradient shard of {} elements for a shard of {}",
                            g.len(),
                            shard.size
                        ),
                    });
                }
            }
            grad_norm = self.global_norm_host(&dense, &expert)?;
            if self.check_non_finite && !grad_norm.is_finite() {
                let bad = [
                    dense.sum_of_squares(0..dense.len()),
                    expert.sum_of_squares(0..expert.len()),
                ]
                .map(|sq| !sq.is_finite());
                return Err(self.non_finite_error(grad_norm, bad)?);
            }
            clip_coeff = clip(grad_norm);
            self.step += 1;
            if self.writes_master_views() {
                // The module's parameters view the master weights: let them go, so the update
                // writes the master's storage instead of a copy of it.
                module = self.table.release(module);
            }
            let k = AdamwConstants::new(&self.config, lr, self.step);
            for (shard, g) in [(&mut self.dense, dense), (&mut self.expert, expert)] {
                if shard.size > 0 {
                    shard.adamw_in_place(&g, clip_coeff, &k)?;
                }
            }
        } else {
            let (dense_shard, expert_shard) = self.reduce_local(&module, &mut grads)?;
            grad_norm = self.global_norm(&dense_shard, &expert_shard)?;
            if self.check_non_finite && !grad_norm.is_finite() {
                let wide = has_f64(&self.dense.device);
                let finite = |t: &Tensor<1>| {
                    sum_of_squares(t.clone(), wide)
                        .into_data()
                        .iter::<f64>()
                        .next()
                        .is_some_and(f64::is_finite)
                };
                let bad = [!finite(&dense_shard), !finite(&expert_shard)];
                return Err(self.non_finite_error(grad_norm, bad)?);
            }
            clip_coeff = clip(grad_norm);
            self.step += 1;
            self.dense
                .adamw(dense_shard, clip_coeff, lr, self.step, &self.config)?;
            self.expert
                .adamw(expert_shard, clip_coeff, lr, self.step, &self.config)?;
        }
        let module = if self.writes_master_views() {
            // One rank owns everything: write the master weights straight into the module.
            self.table
                .write_tensors(module, &self.dense.master, &self.expert.master)?
        } else {
            self.gather_into(module)?
        };
        Ok((
            module,
            StepReport {
                grad_norm,
                clip_coeff,
            },
        ))
    }

    /// [`step`](Self::step) on the module in place. Where the step gives the module views of
    /// the master weights (one rank owns each class, no FP8 primary weights), the module's
    /// previous views are let go before the update, so that on the CPU backend the master
    /// weights are updated in their own storage instead of a copy of it (a caller of
    /// [`step`](Self::step) that keeps a clone of the module gets the copy). On an error the
    /// module holds the parameters as they were (an error comes before any update, or from
    /// a collective of the gather).
    pub fn step_in_place<M: Module>(
        &mut self,
        lr: f64,
        module: &mut M,
        grads: GradientsParams,
    ) -> Result<StepReport> {
        let current = if self.writes_master_views() {
            let released = self.table.release(module.clone());
            std::mem::replace(module, released)
        } else {
            module.clone()
        };
        match self.step(lr, current, grads) {
            Ok((next, report)) => {
                *module = next;
                Ok(report)
            }
            Err(e) => {
                if self.writes_master_views() {
                    *module = self.table.write_tensors(
                        module.clone(),
                        &self.dense.master,
                        &self.expert.master,
                    )?;
                }
                Err(e)
            }
        }
    }

    /// Whether a step whose global gradient norm is NaN or infinite is refused (the default:
    /// [`BackendError::NonFiniteGradients`], before any update, on every rank alike) or
    /// applied as it is (`false`, Megatron's `--no-check-for-nan-in-loss-and-grad`).
    pub fn set_check_non_finite(&mut self, check: bool) {
        self.check_non_finite = check;
    }

    /// The dtype the gradient reduce-scatter over `dp_cp` / `expt_dp` moves and sums in: f32
    /// (the default, Megatron's `accumulate_allreduce_grads_in_fp32`) or BF16 (half the
    /// bytes; the reduced shard is read back as f32 for the update). Errors for another dtype
    /// or one the parameters' device lacks.
    pub fn set_grad_reduce_dtype(&mut self, dtype: DType) -> Result<()> {
        if !matches!(dtype, DType::F32 | DType::BF16) || !self.dense.device.supports_dtype(dtype) {
            return Err(BackendError::Config {
                field: "grad_reduce_dtype",
                detail: format!(
                    "{dtype:?} on {:?} (expected F32, or BF16 where the device has it)",
                    self.dense.device
                ),
            });
        }
        self.dense.reduce_dtype = dtype;
        self.expert.reduce_dtype = dtype;
        Ok(())
    }

    /// The dtype of the gradient reduction ([`set_grad_reduce_dtype`](Self::set_grad_reduce_dtype)).
    pub fn grad_reduce_dtype(&self) -> DType {
        self.dense.reduce_dtype
    }

    /// Whether non-finite gradient norms are refused ([`set_check_non_finite`](Self::set_check_non_finite)).
    pub fn check_non_finite(&self) -> bool {
        self.check_non_finite
    }

    /// The error of a step with the non-finite global norm `norm`: `local_bad` says whether
    /// this rank's dense and expert gradient shards hold non-finite values; one collective
    /// over the world (every rank is on this path, as the norm is the same everywhere) tells
    /// which groups hold them on any rank.
    fn non_finite_error(&self, norm: f64, local_bad: [bool; 2]) -> Result<BackendError> {
        let vote = self.world.vote(&local_bad, &self.dense.device)?;
        let names = ["dense parameters", "expert parameters"];
        let groups: Vec<&str> = names
            .iter()
            .zip(&vote.raised)
            .filter(|(_, raised)| **raised)
            .map(|(n, _)| *n)
            .collect();
        Ok(BackendError::NonFiniteGradients {
            op: "DistributedAdamW",
            norm,
            rank: vote.first,
            groups: if groups.is_empty() {
                "the norm's sum".into()
            } else {
                groups.join(" and ")
            },
        })
    }

    /// Whether a step writes views of the master weights into the module: each class owned
    /// by one rank (no gather) and no FP8 primary weights.
    fn writes_master_views(&self) -> bool {
        self.fp8.is_none() && self.dense.comm.size() == 1 && self.expert.comm.size() == 1
    }

    /// [`reduce_local`](Self::reduce_local) on the CPU backend, read in place: a class owned
    /// by one rank with no pre-factor is its parameters' gradient tensors end to end (no
    /// concatenation); otherwise the reduce-scatter's output.
    fn reduce_local_host<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> Result<(HostGrad, HostGrad)> {
        let device = &self.dense.device;
        let (mut dense, expert) = self.table.pieces(module, Some(grads), device)?;
        self.sum_sequence_parallel_over_tp(&mut dense)?;
        let class = |shard: &Shard, pieces: Vec<Tensor<1>>| {
            if shard.comm.size() == 1 && self.scale == 1.0 {
                HostGrad::from_pieces(pieces)
            } else {
                let flat = cat_flat(pieces, device);
                HostGrad::from_pieces(vec![shard.reduce_scatter(flat, self.scale)?])
            }
        };
        Ok((class(&self.dense, dense)?, class(&self.expert, expert)?))
    }

    /// This rank's reduced gradient shards `(dense, expert)` on the device: local gradients
    /// flattened, sequence-parallel ones summed over TP, reduce-scattered with the `1/|dp_cp|`
    /// pre-factor.
    fn reduce_local<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> Result<(Tensor<1>, Tensor<1>)> {
        let device = &self.dense.device;
        let (mut dense, expert) = self.table.pieces(module, Some(grads), device)?;
        self.sum_sequence_parallel_over_tp(&mut dense)?;
        let dense = cat_flat(dense, device);
        let expert = cat_flat(expert, device);
        Ok((
            self.dense.reduce_scatter(dense, self.scale)?,
            self.expert.reduce_scatter(expert, self.scale)?,
        ))
    }

    /// [`DistributedAdamW::reduced_gradients`] as device tensors.
    pub fn reduced_gradient_tensors<M: Module>(
        &self,
        module: &M,
        mut grads: GradientsParams,
    ) -> Result<(Tensor<1>, Tensor<1>)> {
        let (dense_shard, expert_shard) = self.reduce_local(module, &mut grads)?;
        Ok((
            self.dense.all_gather_values(dense_shard)?,
            self.expert.all_gather_values(expert_shard)?,
        ))
    }

    /// The gradients this rank's update would use, before clipping: local gradients summed
    /// over TP (sequence-parallel parameters) and reduced over `dp_cp` / `expt_dp` with the
    /// `1/|dp_cp|` pre-factor, gathered back into full `(dense, expert)` buffers in this rank's
    /// [`ParamTable`] layout. A collective (every rank calls it); the optimizer state is not
    /// touched. Meant for checks and diagnostics (host vectors).
    pub fn reduced_gradients<M: Module>(
        &self,
        module: &M,
        grads: GradientsParams,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (dense, expert) = self.reduced_gradient_tensors(module, grads)?;
        Ok((
            host_f32(dense, "gradients")?,
            host_f32(expert, "gradients")?,
        ))
    }

    /// `module` with every parameter of the table set from the f32 main weights, each cast to
    /// its parameter's dtype (round to nearest even), exactly as a step writes them. Called
    /// after the master weights were restored from a checkpoint, so that the parameters are
    /// what the next step computes with whatever the checkpoint stored for them (e.g. f32
    /// parameters resumed from a BF16 run). A collective over the dense and expert groups
    /// when they are sharded. With FP8 primary weights, use
    /// [`recast_fp8_primary_weights`](Self::recast_fp8_primary_weights) instead (an error here).
    pub fn write_master_into<M: Module>(&mut self, module: M) -> Result<M> {
        if self.fp8.is_some() {
            return Err(BackendError::Config {
                field: "fp8_primary_weights",
                detail: "FP8 primary weights are written by recast_fp8_primary_weights".into(),
            });
        }
        if self.writes_master_views() {
            self.table
                .write_tensors(module, &self.dense.master, &self.expert.master)
        } else {
            self.gather_into(module)
        }
    }

    /// The f32 main weights of every parameter of the table, all-gathered into full
    /// `(dense, expert)` buffers in this rank's [`ParamTable`] layout (host vectors). A
    /// collective (every rank of the dense and expert groups calls it); meant for checks, e.g.
    /// that BF16 parameters are their main weights rounded.
    pub fn master_values(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok((
            host_f32(self.dense.all_gather()?, "master weights")?,
            host_f32(self.expert.all_gather()?, "master weights")?,
        ))
    }

    /// Sums the gradients of sequence-parallel replicated parameters over `tp`
    /// (docs/parallelism.md §Gradient reduction and scaling, step 2): `dense` are the dense class's
    /// pieces in table order; the SP ones are packed into one device tensor, all-reduced and split
    /// back.
    fn sum_sequence_parallel_over_tp(&self, dense: &mut [Tensor<1>]) -> Result<()> {
        if self.tp.size() == 1 {
            return Ok(());
        }
        let sp: Vec<(usize, usize)> = self
            .table
            .params
            .iter()
            .filter(|p| !p.class.is_expert())
            .enumerate()
            .filter(|(_, p)| p.class == ParamClass::DenseSequenceParallel)
            .map(|(i, p)| (i, p.numel()))
            .collect();
        if sp.iter().all(|&(_, n)| n == 0) {
            return Ok(());
        }
        let packed = Tensor::cat(sp.iter().map(|&(i, _)| dense[i].clone()).collect(), 0);
        let summed = self.tp.all_reduce(packed, ReduceOp::Sum)?;
        let mut at = 0;
        for &(i, n) in sp.iter().filter(|&&(_, n)| n > 0) {
            dense[i] = summed.clone().slice(at..at + n);
            at += n;
        }
        Ok(())
    }

    /// √(Σ g²) over unique elements: every rank's expert shard, dense shards on TP rank 0 for
    /// TP-replicated parameters and on every TP rank for TP-sharded ones. Summed on the device
    /// (f64 where it has f64), all-reduced over the world as a one-element tensor; the result
    /// is the one scalar a step reads back.
    fn global_norm(&self, dense_shard: &Tensor<1>, expert_shard: &Tensor<1>) -> Result<f64> {
        let device = &self.dense.device;
        let f64 = has_f64(device);
        let mut parts = Vec::new();
        match &self.norm_ranges {
            None if self.dense.size > 0 => parts.push(dense_shard.clone()),
            None => {}
            Some(ranges) => {
                parts.extend(ranges.iter().map(|r| dense_shard.clone().slice(r.clone())))
            }
        }
        match &self.expert_norm_ranges {
            None if self.expert.size > 0 => parts.push(expert_shard.clone()),
            None => {}
            Some(ranges) => {
                parts.extend(ranges.iter().map(|r| expert_shard.clone().slice(r.clone())))
            }
        }
        let dtype = if f64 { DType::F64 } else { DType::F32 };
        let mut sq = Tensor::<1>::zeros([1], (device, dtype));
        for part in parts {
            sq = sq + sum_of_squares(part, f64);
        }
        let total = self.world.all_reduce(sq, ReduceOp::Sum)?;
        let total = total
            .into_data()
            .iter::<f64>()
            .next()
            .ok_or_else(|| BackendError::Shape {
                op: "DistributedAdamW",
                detail: "norm unreadable".into(),
            })?;
        Ok(total.sqrt())
    }
}

impl DistributedAdamW {
    /// [`global_norm`](Self::global_norm) of host gradient shards (the CPU backend): the same
    /// parts summed in f64 on the host, one all-reduce of the scalar over the world.
    fn global_norm_host(&self, dense: &HostGrad, expert: &HostGrad) -> Result<f64> {
        let mut sq = match &self.norm_ranges {
            None => dense.sum_of_squares(0..dense.len()),
            Some(ranges) => ranges.iter().map(|r| dense.sum_of_squares(r.clone())).sum(),
        };
        sq += match &self.expert_norm_ranges {
            None => expert.sum_of_squares(0..expert.len()),
            Some(ranges) => ranges
                .iter()
                .map(|r| expert.sum_of_squares(r.clone()))
                .sum(),
        };
        let t = Tensor::<1>::from_data(
            TensorData::new(vec![sq], [1]),
            (&self.dense.device, DType::F64),
        );
        let total = self.world.all_reduce(t, ReduceOp::Sum)?;
        let total = total
            .into_data()
            .iter::<f64>()
            .next()
            .ok_or_else(|| BackendError::Shape {
                op: "DistributedAdamW",
                detail: "norm unreadable".into(),
            })?;
        Ok(total.sqrt())
    }
}

/// The ranges of the dense (`experts = false`) or expert shard this rank counts in the global
/// norm (see [`DistributedAdamW::global_norm`]), merged; `None` when that is every parameter.
/// `ranks` are this rank's (TP, expert-TP) ranks: a duplicate copy
/// ([`ParamClass::is_duplicate_on`]) or an `excluded` parameter is not counted.
fn counted_ranges(
    table: &ParamTable,
    shard: &Shard,
    experts: bool,
    (tp_rank, expt_tp_rank): (usize, usize),
    excluded: &[ParamId],
) -> Option<Vec<Range<usize>>> {
    let params = || (table.params.iter()).filter(move |p| p.class.is_expert() == experts);
    let skipped =
        |p: &ParamInfo| excluded.contains(&p.id) || p.class.is_duplicate_on(tp_rank, expt_tp_rank);
    if !params().any(skipped) {
        return None;
    }
    let start = shard.comm.rank() * shard.size;
    let mut out: Vec<Range<usize>> = Vec::new();
    for p in params().filter(|p| !skipped(p)) {
        // Intersection of the parameter's range with this rank's shard.
        let lo = p.offset.max(start);
        let hi = (p.offset + p.numel()).min(start + shard.size);
        if lo >= hi {
            continue;
        }
        let r = lo - start..hi - start;
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    Some(out)
}

/// A 1-D f32 device tensor read back into a host vector (checkpoints, diagnostics).
pub(super) fn host_f32(t: Tensor<1>, what: &str) -> Result<Vec<f32>> {
    t.cast(DType::F32)
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| BackendError::Shape {
            op: "DistributedAdamW",
            detail: format!("{what} unreadable: {e:?}"),
        })
}

/// The error of an FP8 primary-weight call while they are off.
fn fp8_off() -> BackendError {
    BackendError::Config {
        field: "fp8_primary_weights",
        detail: "FP8 primary weights are not enabled".into(),
    }
}

/// The shape of parameter `id` of `table`.
fn param_shape(table: &ParamTable, id: ParamId) -> Result<Vec<usize>> {
    table
        .params
        .iter()
        .find(|p| p.id == id)
        .map(|p| p.shape.clone())
        .ok_or_else(|| BackendError::Config {
            field: "fp8_primary_weights",
            detail: format!("parameter {id} is not in the optimizer's table"),
        })
}

/// Writes FP8 primary weights into a module ([`DistributedAdamW::write_fp8`]): FP8 parameters
/// become their packed weight (`carriers`; re-packed once in the parameter's dtype when that
/// is not f32) or its decoded values; the other trainable parameters become their slice of the
/// `compact` buffers when given, else stay as they are.
struct Fp8Writer<'a> {
    table: &'a ParamTable,
    index: usize,
    compact: Option<(&'a Tensor<1>, &'a Tensor<1>, HashMap<ParamId, usize>)>,
    weights: &'a mut HashMap<ParamId, PackedFp8>,
    carriers: bool,
    device: Device,
    error: Option<BackendError>,
}

impl Fp8Writer<'_> {
    /// The new value of FP8 parameter `id` (a `dtype` tensor of `packed`'s shape).
    fn fp8_value<const D: usize>(
        &mut self,
        id: ParamId,
        packed: PackedFp8,
        dtype: DType,
    ) -> Result<Tensor<D>> {
        if !self.carriers {
            let shape = packed.shape();
            return Ok(Tensor::from_data(
                TensorData::new(packed.dequantize(), shape),
                (&self.device, DType::F32),
            ));
        }
        let packed = if packed.dtype() == dtype {
            packed
        } else {
            let again = PackedFp8::new(
                packed.grid(),
                packed.codes(),
                &packed.scale_inv(),
                &packed.shape(),
                dtype,
            )?;
            self.weights.insert(id, again.clone());
            again
        };
        packed.to_tensor::<D>()
    }
}

impl ModuleMapper for Fp8Writer<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(info) = self.table.params.get(self.index) else {
            return param;
        };
        if info.id != param.id || self.error.is_some() {
            return param; // non-trainable, not in the table
        }
        self.index += 1;
        if let Some(packed) = self.weights.get(&param.id).cloned() {
            let dtype = param.val().dtype();
            return match self.fp8_value::<D>(param.id, packed, dtype) {
                Ok(fresh) => param.map(move |t| like_param(fresh, &t)),
                Err(e) => {
                    self.error = Some(e);
                    param
                }
            };
        }
        let Some((dense, expert, offsets)) = &self.compact else {
            return param;
        };
        let n = info.numel();
        if n == 0 {
            return param;
        }
        let Some(&at) = offsets.get(&param.id) else {
            self.error = Some(BackendError::Shape {
                op: "DistributedAdamW",
                detail: format!("`{}` has no place in the compact buffer", info.path),
            });
            return param;
        };
        let buf = if info.class.is_expert() {
            expert
        } else {
            dense
        };
        let values = (*buf).clone().slice(at..at + n);
        let shape = Shape::from(info.shape.clone());
        param.map(move |t| like_param(values.reshape::<D, _>(shape), &t))
    }
}

#[cfg(test)]
mod chunk_tests {
    use super::*;
    use crate::comm::World;
    use crate::testing::SplitMix;

    /// The device AdamW equals a plain sequential loop written from the update rule, bit for
    /// bit on Flex, with exempt ranges, with and without clipping (an inexact coefficient, so
    /// the f64 product is exercised) and with f32 or bf16 moments.
    #[test]
    fn device_adamw_equals_the_sequential_rule() {
        const ADAMW_CHUNK: usize = 1 << 15;
        let n = 3 * ADAMW_CHUNK + 123;
        let mut rng = SplitMix::new(7);
        let full: Vec<f32> = (0..n).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
        let grad: Vec<f32> = (0..n).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
        let exempt = vec![
            10..20,
            ADAMW_CHUNK - 5..ADAMW_CHUNK + 5,
            2 * ADAMW_CHUNK..3 * ADAMW_CHUNK + 1,
        ];
        let c = DistributedAdamWConfig {
            weight_decay: 0.1,
            ..DistributedAdamWConfig::default()
        };
        for (dtype, clip, fused) in [
            (MomentDtype::F32, 0.3, true),
            (MomentDtype::F32, 1.0, true),
            (MomentDtype::Bf16, 0.3, true),
            (MomentDtype::F32, 0.3, false),
            (MomentDtype::F32, 1.0, false),
            (MomentDtype::Bf16, 0.3, false),
        ] {
            let (full_ref, grad_ref, exempt_ref, c_ref) = (&full, &grad, &exempt, &c);
            let got = World::run(1, |ctx| {
                let device = Device::flex();
                let tensor = |v: &Vec<f32>| {
                    Tensor::<1>::from_data(TensorData::new(v.clone(), [v.len()]), &device)
                };
                let mut shard = Shard::new(ctx.world()?, tensor(full_ref), dtype);
                shard.exempt(exempt_ref.clone());
                for step in 1..=3 {
                    if fused {
                        // The CPU backend's path.
                        shard.adamw(tensor(grad_ref), clip, 1e-2, step, c_ref)?;
                    } else {
                        // Every other device's path, run on Flex.
                        let k = AdamwConstants::new(c_ref, 1e-2, step);
                        shard.adamw_composite(tensor(grad_ref), clip, &k);
                    }
                }
                host_f32(shard.master, "master")
            })
            .remove(0)
            .expect("rank");
            let (mut p, mut m, mut v) = (full.clone(), vec![0f32; n], vec![0f32; n]);
            for step in 1..=3 {
                let (lr, b1, b2) = (1e-2f32, c.beta_1, c.beta_2);
                for i in 0..n {
                    let g = if clip != 1.0 {
                        (grad[i] as f64 * clip) as f32
                    } else {
                        grad[i]
                    };
                    let mut mi = m[i] * b1 + g * (1.0 - b1);
                    let mut vi = v[i] * b2 + g * g * (1.0 - b2);
                    // `black_box`: in release builds LLVM folds `powi` of constants correctly
                    // rounded, while the optimizer's runtime `powi` multiplies; the rule is
                    // the same, the last bit of the bias correction is not.
                    let (b1p, b2p) = (
                        std::hint::black_box(b1).powi(std::hint::black_box(step)),
                        std::hint::black_box(b2).powi(std::hint::black_box(step)),
                    );
                    let m_hat = mi / (1.0 - b1p);
                    let v_hat = vi / (1.0 - b2p);
                    let decay = if exempt.iter().any(|r| r.contains(&i)) {
                        1.0
                    } else {
                        1.0 - lr * c.weight_decay
                    };
                    p[i] = p[i] * decay - lr * (m_hat / (v_hat.sqrt() + c.epsilon));
                    if dtype == MomentDtype::Bf16 {
                        mi = burn::tensor::bf16::from_f32(mi).to_f32();
                        vi = burn::tensor::bf16::from_f32(vi).to_f32();
                    }
                    (m[i], v[i]) = (mi, vi);
                }
            }
            assert!(
                got == p,
                "{dtype:?} clip {clip} fused {fused}: AdamW differs from the rule"
            );
        }
    }
}
