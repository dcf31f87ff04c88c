//! AdamW as a distributed optimizer (ZeRO-1, parallelism.md §5–§6).
//!
//! Per class (dense over `dp_cp`, experts over `expt_dp`) the flat gradient buffer is padded
//! to a multiple of the group size and reduce-scattered (sum, pre-factor `1/|dp_cp|` for both
//! classes); each rank updates the f32 master shard of its range with AdamW (moments in f32
//! or bf16, computed in f32), then the parameter buffer is all-gathered and written back.
//! Before the reduction, sequence-parallel replicated gradients are summed over `tp`; the
//! global gradient norm counts every unique element once (TP-replicated shards on TP rank 0
//! only) and is all-reduced over the world, so it is the same for every layout.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData, bf16};

use super::fp8_primary::{
    Fp8ParamLayout, Fp8PrimaryConfig, Fp8Slot, Fp8Weight, cast_and_gather, check_loaded, slots_for,
};
use super::params::{ParamClass, ParamInfo, ParamTable, default_classify};
use super::schedule::no_weight_decay;
use crate::comm::{Comm, GroupComms, ReduceOp};
use crate::error::{BackendError, Result};
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

/// Moments of one shard.
#[derive(Debug, Clone)]
pub(super) enum Moments {
    F32(Vec<f32>, Vec<f32>),
    Bf16(Vec<bf16>, Vec<bf16>),
}

/// The shard of one class's flat buffer owned by this rank.
#[derive(Debug, Clone)]
pub(super) struct Shard {
    pub(super) comm: Comm,
    /// Unpadded buffer length.
    pub(super) len: usize,
    /// Shard length (padded buffer / group size).
    pub(super) size: usize,
    pub(super) master: Vec<f32>,
    pub(super) moments: Moments,
    /// Ranges of the shard (shard coordinates, sorted, disjoint) without weight decay.
    pub(super) no_decay: Vec<Range<usize>>,
}

impl Shard {
    fn new(comm: Comm, full: &[f32], dtype: MomentDtype) -> Self {
        let n = comm.size();
        let size = full.len().div_ceil(n);
        let start = comm.rank() * size;
        let mut master = vec![0.0; size];
        for (i, m) in master.iter_mut().enumerate() {
            if let Some(v) = full.get(start + i) {
                *m = *v;
            }
        }
        let moments = match dtype {
            MomentDtype::F32 => Moments::F32(vec![0.0; size], vec![0.0; size]),
            MomentDtype::Bf16 => Moments::Bf16(vec![bf16::ZERO; size], vec![bf16::ZERO; size]),
        };
        Self {
            comm,
            len: full.len(),
            size,
            master,
            moments,
            no_decay: Vec::new(),
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
    }

    /// Reduce-scatter (sum) of the padded gradient buffer; returns this rank's shard.
    fn reduce_scatter(&self, mut grad: Vec<f32>, scale: f32) -> Result<Vec<f32>> {
        let n = self.comm.size();
        grad.resize(self.size * n, 0.0);
        let t = Tensor::<1>::from_data(TensorData::new(grad, [self.size * n]), &Device::flex());
        let shard = self.comm.reduce_scatter(t, ReduceOp::Sum)?;
        let mut v = shard
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| BackendError::Shape {
                op: "DistributedAdamW",
                detail: format!("gradient shard unreadable: {e:?}"),
            })?;
        for x in &mut v {
            *x *= scale;
        }
        Ok(v)
    }

    /// All-gather of the master shards; the unpadded full buffer.
    fn all_gather(&self) -> Result<Vec<f32>> {
        self.all_gather_values(self.master.clone())
    }

    /// All-gather of one shard-sized vector; the unpadded full buffer.
    fn all_gather_values(&self, shard: Vec<f32>) -> Result<Vec<f32>> {
        let t = Tensor::<1>::from_data(TensorData::new(shard, [self.size]), &Device::flex());
        let mut full = self
            .comm
            .all_gather(t)?
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| BackendError::Shape {
                op: "DistributedAdamW",
                detail: format!("gathered parameters unreadable: {e:?}"),
            })?;
        full.truncate(self.len);
        Ok(full)
    }

    /// AdamW on the master shard (bias-corrected, decoupled decay except on the exempt
    /// ranges), computed in f32.
    fn adamw(&mut self, grad: &[f32], lr: f64, step: i32, c: &DistributedAdamWConfig) {
        let lr = lr as f32;
        let bc1 = 1.0 - c.beta_1.powi(step);
        let bc2 = 1.0 - c.beta_2.powi(step);
        let decay = 1.0 - lr * c.weight_decay;
        // Decay factor of each element: `decay`, or 1 inside an exempt range.
        let mut exempt = self.no_decay.iter().peekable();
        let mut factor = move |i: usize| {
            while exempt.peek().is_some_and(|r| r.end <= i) {
                exempt.next();
            }
            if exempt.peek().is_some_and(|r| r.contains(&i)) {
                1.0
            } else {
                decay
            }
        };
        let mut update = |i: usize, m: &mut f32, v: &mut f32| {
            let g = grad[i];
            *m = *m * c.beta_1 + g * (1.0 - c.beta_1);
            *v = *v * c.beta_2 + g * g * (1.0 - c.beta_2);
            let m_hat = *m / bc1;
            let v_hat = *v / bc2;
            let p = &mut self.master[i];
            *p = *p * factor(i) - lr * (m_hat / (v_hat.sqrt() + c.epsilon));
        };
        match &mut self.moments {
            Moments::F32(m1, m2) => {
                for i in 0..grad.len() {
                    update(i, &mut m1[i], &mut m2[i]);
                }
            }
            Moments::Bf16(m1, m2) => {
                for i in 0..grad.len() {
                    let (mut a, mut b) = (m1[i].to_f32(), m2[i].to_f32());
                    update(i, &mut a, &mut b);
                    m1[i] = bf16::from_f32(a);
                    m2[i] = bf16::from_f32(b);
                }
            }
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

/// FP8 primary weights: the selected parameters of each class and their current FP8 copies.
#[derive(Debug, Clone)]
pub(super) struct Fp8Primary {
    pub(super) config: Fp8PrimaryConfig,
    pub(super) dense: Vec<Fp8Slot>,
    pub(super) expert: Vec<Fp8Slot>,
    pub(super) weights: HashMap<ParamId, Fp8Weight>,
}

/// ZeRO-1 AdamW over the dense (`dp_cp`) and expert (`expt_dp`) groups, optionally with FP8
/// primary weights ([`DistributedAdamW::enable_fp8_primary_weights`]).
#[derive(Debug, Clone)]
pub struct DistributedAdamW {
    pub(super) config: DistributedAdamWConfig,
    pub(super) table: ParamTable,
    pub(super) tp: Comm,
    world: Comm,
    pub(super) dense: Shard,
    pub(super) expert: Shard,
    /// `1/|dp_cp|`, the gradient pre-factor of both classes.
    scale: f32,
    pub(super) step: i32,
    pub(super) fp8: Option<Fp8Primary>,
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
        let (dense, expert) = table.flatten_values(module)?;
        let dp_cp = groups.comm(GroupFamily::DpCp).clone();
        let scale = 1.0 / dp_cp.size() as f32;
        let mut dense = Shard::new(dp_cp, &dense, config.moment_dtype);
        let mut expert = Shard::new(
            groups.comm(GroupFamily::ExptDp).clone(),
            &expert,
            config.moment_dtype,
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
            tp: groups.comm(GroupFamily::Tp).clone(),
            world,
            config,
            table,
            scale,
            step: 0,
            fp8: None,
        })
    }

    /// Switches the parameters `select` picks (with their matrix layout) to FP8 primary
    /// weights (fp8.md §4, see [`super::fp8_primary`]): from now on every step casts their
    /// master shards straight to blockwise E4M3 (partial amax, MAX all-reduce over the
    /// class's group, partial cast) and all-gathers one byte per element. Casts the current
    /// master weights right away and returns `module` holding the decoded FP8 values. A
    /// collective: every rank of the world calls it with the same selection.
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
        let (dense, expert) = self.gather_parameters()?;
        self.table.write_values(module, &dense, &expert)
    }

    /// Re-casts the FP8 primary weights from the current master shards (a collective) and
    /// returns `module` holding their decoded values, e.g. after the master weights were
    /// restored from a checkpoint that stores the parameters in high precision. Errors when
    /// FP8 primary weights are off.
    pub fn recast_fp8_primary_weights<M: Module>(&mut self, module: M) -> Result<M> {
        if self.fp8.is_none() {
            return Err(BackendError::Config {
                field: "fp8_primary_weights",
                detail: "FP8 primary weights are not enabled".into(),
            });
        }
        let (dense, expert) = self.gather_parameters()?;
        self.table.write_values(module, &dense, &expert)
    }

    /// The FP8 primary-weight settings, when enabled.
    pub fn fp8_config(&self) -> Option<&Fp8PrimaryConfig> {
        self.fp8.as_ref().map(|f| &f.config)
    }

    /// The current FP8 copy of parameter `id` (bytes and scales the module's values decode
    /// from), when it is an FP8 primary weight.
    pub fn fp8_weight(&self, id: ParamId) -> Option<&Fp8Weight> {
        self.fp8.as_ref().and_then(|f| f.weights.get(&id))
    }

    /// Replaces the FP8 copies, e.g. with the bytes and scales restored from a checkpoint
    /// (the module's parameters must hold their decoded values). Errors when FP8 primary
    /// weights are off, or a weight does not match its parameter's block grid.
    pub fn set_fp8_weights(&mut self, weights: HashMap<ParamId, Fp8Weight>) -> Result<()> {
        let fp8 = self.fp8.as_mut().ok_or_else(|| BackendError::Config {
            field: "fp8_primary_weights",
            detail: "FP8 primary weights are not enabled".into(),
        })?;
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
        }
        fp8.weights.extend(weights);
        Ok(())
    }

    /// All-gathers the master shards into full `(dense, expert)` buffers: plain f32 for a
    /// class without FP8 primary weights, else the FP8 cast-and-gather (which also refreshes
    /// the FP8 copies).
    pub(super) fn gather_parameters(&mut self) -> Result<(Vec<f32>, Vec<f32>)> {
        let Some(fp8) = self.fp8.as_mut() else {
            return Ok((self.dense.all_gather()?, self.expert.all_gather()?));
        };
        let mut gather = |shard: &Shard, slots: &[Fp8Slot]| -> Result<Vec<f32>> {
            if slots.is_empty() {
                return shard.all_gather();
            }
            let (full, weights) = cast_and_gather(
                &shard.comm,
                &shard.master,
                shard.size,
                shard.len,
                slots,
                &fp8.config,
            )?;
            fp8.weights.extend(weights);
            Ok(full)
        };
        let dense = gather(&self.dense, &fp8.dense)?;
        let expert = gather(&self.expert, &fp8.expert)?;
        Ok((dense, expert))
    }

    /// Sets the decoupled weight decay of the following steps (a weight-decay schedule).
    pub fn set_weight_decay(&mut self, weight_decay: f32) {
        self.config.weight_decay = weight_decay;
    }

    /// The parameter table (classes and flat offsets).
    pub fn table(&self) -> &ParamTable {
        &self.table
    }

    /// One step: reduces this rank's local gradients, clips by the global norm, updates the
    /// local shards and returns `module` with the all-gathered new parameters.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<(M, StepReport)> {
        let (mut dense, expert) = self.table.flatten_grads(&module, &mut grads)?;
        self.sum_sequence_parallel_over_tp(&mut dense)?;
        let dense_shard = self.dense.reduce_scatter(dense, self.scale)?;
        let expert_shard = self.expert.reduce_scatter(expert, self.scale)?;
        let grad_norm = self.global_norm(&dense_shard, &expert_shard)?;
        let clip_coeff = match self.config.max_grad_norm {
            Some(max) if grad_norm > max => max / (grad_norm + 1e-6),
            _ => 1.0,
        };
        let clip = |mut v: Vec<f32>| {
            if clip_coeff != 1.0 {
                for x in &mut v {
                    *x = (*x as f64 * clip_coeff) as f32;
                }
            }
            v
        };
        let (dense_shard, expert_shard) = (clip(dense_shard), clip(expert_shard));
        self.step += 1;
        self.dense.adamw(&dense_shard, lr, self.step, &self.config);
        self.expert
            .adamw(&expert_shard, lr, self.step, &self.config);
        let (dense, expert) = self.gather_parameters()?;
        let module = self.table.write_values(module, &dense, &expert)?;
        Ok((
            module,
            StepReport {
                grad_norm,
                clip_coeff,
            },
        ))
    }

    /// The gradients this rank's update would use, before clipping: local gradients summed
    /// over TP (sequence-parallel parameters) and reduced over `dp_cp` / `expt_dp` with the
    /// `1/|dp_cp|` pre-factor, gathered back into full `(dense, expert)` buffers in this rank's
    /// [`ParamTable`] layout. A collective (every rank calls it); the optimizer state is not
    /// touched. Meant for checks and diagnostics.
    pub fn reduced_gradients<M: Module>(
        &self,
        module: &M,
        mut grads: GradientsParams,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut dense, expert) = self.table.flatten_grads(module, &mut grads)?;
        self.sum_sequence_parallel_over_tp(&mut dense)?;
        let dense_shard = self.dense.reduce_scatter(dense, self.scale)?;
        let expert_shard = self.expert.reduce_scatter(expert, self.scale)?;
        Ok((
            self.dense.all_gather_values(dense_shard)?,
            self.expert.all_gather_values(expert_shard)?,
        ))
    }

    /// Sums the gradients of sequence-parallel replicated parameters over `tp` (§5 step 2).
    fn sum_sequence_parallel_over_tp(&self, dense: &mut [f32]) -> Result<()> {
        if self.tp.size() == 1 {
            return Ok(());
        }
        let sp: Vec<_> = self
            .table
            .params
            .iter()
            .filter(|p| p.class == ParamClass::DenseSequenceParallel)
            .collect();
        let packed: Vec<f32> = sp
            .iter()
            .flat_map(|p| dense[p.offset..p.offset + p.numel()].to_vec())
            .collect();
        if packed.is_empty() {
            return Ok(());
        }
        let n = packed.len();
        let t = Tensor::<1>::from_data(TensorData::new(packed, [n]), &Device::flex());
        let summed = self
            .tp
            .all_reduce(t, ReduceOp::Sum)?
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| BackendError::Shape {
                op: "DistributedAdamW",
                detail: format!("tp-summed gradients unreadable: {e:?}"),
            })?;
        let mut at = 0;
        for p in sp {
            dense[p.offset..p.offset + p.numel()].copy_from_slice(&summed[at..at + p.numel()]);
            at += p.numel();
        }
        Ok(())
    }

    /// √(Σ g²) over unique elements: every rank's expert shard, dense shards on TP rank 0 for
    /// TP-replicated parameters and on every TP rank for TP-sharded ones.
    fn global_norm(&self, dense_shard: &[f32], expert_shard: &[f32]) -> Result<f64> {
        let start = self.dense.comm.rank() * self.dense.size;
        let mut sq = 0.0f64;
        for p in &self.table.params {
            if p.class.is_expert() || (p.class.tp_replicated() && self.tp.rank() != 0) {
                continue;
            }
            // Intersection of the parameter's range with this rank's dense shard.
            let lo = p.offset.max(start);
            let hi = (p.offset + p.numel()).min(start + self.dense.size);
            for &g in dense_shard
                .get(lo.saturating_sub(start)..hi.saturating_sub(start))
                .unwrap_or(&[])
            {
                sq += (g as f64) * (g as f64);
            }
        }
        sq += expert_shard
            .iter()
            .map(|&g| (g as f64) * (g as f64))
            .sum::<f64>();
        let t = Tensor::<1>::from_data(
            TensorData::new(vec![sq], [1]),
            (&Device::flex(), burn::tensor::DType::F64),
        );
        let total = self
            .world
            .all_reduce(t, ReduceOp::Sum)?
            .into_data()
            .try_into_vec::<f64>()
            .map_err(|e| BackendError::Shape {
                op: "DistributedAdamW",
                detail: format!("norm unreadable: {e:?}"),
            })?;
        Ok(total.first().copied().unwrap_or(0.0).sqrt())
    }
}
