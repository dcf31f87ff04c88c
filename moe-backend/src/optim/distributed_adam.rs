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
use rayon::prelude::*;

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
        if n == 1 {
            // A sum over one rank is the buffer itself: no round trip through a tensor.
            if scale != 1.0 {
                grad.par_iter_mut().for_each(|x| *x *= scale);
            }
            return Ok(grad);
        }
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
    fn all_gather_values(&self, mut shard: Vec<f32>) -> Result<Vec<f32>> {
        if self.comm.size() == 1 {
            shard.truncate(self.len);
            return Ok(shard);
        }
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
    /// AdamW on this rank's shard with the gradient shard `grad` scaled by `clip` (the
    /// global-norm clipping coefficient), in parallel over fixed chunks of [`ADAMW_CHUNK`]
    /// elements (every element's arithmetic is the same whatever the thread count).
    fn adamw(&mut self, grad: &[f32], clip: f64, lr: f64, step: i32, c: &DistributedAdamWConfig) {
        let k = AdamwConstants {
            lr: lr as f32,
            bc1: 1.0 - c.beta_1.powi(step),
            bc2: 1.0 - c.beta_2.powi(step),
            decay: 1.0 - lr as f32 * c.weight_decay,
            clip,
            beta_1: c.beta_1,
            beta_2: c.beta_2,
            epsilon: c.epsilon,
        };
        let Shard {
            master,
            moments,
            no_decay,
            ..
        } = self;
        let no_decay = no_decay.as_slice();
        let chunks = master
            .par_chunks_mut(ADAMW_CHUNK)
            .zip(grad.par_chunks(ADAMW_CHUNK))
            .enumerate();
        match moments {
            Moments::F32(m1, m2) => chunks
                .zip(m1.par_chunks_mut(ADAMW_CHUNK))
                .zip(m2.par_chunks_mut(ADAMW_CHUNK))
                .for_each(|(((j, (p, g)), m), v)| {
                    let mut factor = k.factors(no_decay, j * ADAMW_CHUNK);
                    for i in 0..p.len() {
                        k.update(&mut p[i], g[i], &mut m[i], &mut v[i], factor(i));
                    }
                }),
            Moments::Bf16(m1, m2) => chunks
                .zip(m1.par_chunks_mut(ADAMW_CHUNK))
                .zip(m2.par_chunks_mut(ADAMW_CHUNK))
                .for_each(|(((j, (p, g)), m), v)| {
                    let mut factor = k.factors(no_decay, j * ADAMW_CHUNK);
                    for i in 0..p.len() {
                        let (mut a, mut b) = (m[i].to_f32(), v[i].to_f32());
                        k.update(&mut p[i], g[i], &mut a, &mut b, factor(i));
                        m[i] = bf16::from_f32(a);
                        v[i] = bf16::from_f32(b);
                    }
                }),
        }
    }
}

/// `Σ x²` in f64, in parallel over fixed chunks summed in order (the same value for any
/// thread count).
fn sum_of_squares(values: &[f32]) -> f64 {
    let partial: Vec<f64> = values
        .par_chunks(ADAMW_CHUNK)
        .map(|c| c.iter().map(|&g| (g as f64) * (g as f64)).sum::<f64>())
        .collect();
    partial.iter().sum()
}

/// Elements per parallel AdamW chunk.
const ADAMW_CHUNK: usize = 1 << 15;

/// The per-step constants of the AdamW update.
#[derive(Debug, Clone, Copy)]
struct AdamwConstants {
    lr: f32,
    bc1: f32,
    bc2: f32,
    decay: f32,
    clip: f64,
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
}

impl AdamwConstants {
    /// The decay factor of element `base + i` (`decay`, or 1 inside an exempt range of the
    /// sorted `no_decay`), for increasing `i`.
    fn factors(self, no_decay: &[Range<usize>], base: usize) -> impl FnMut(usize) -> f32 {
        let first = no_decay.partition_point(|r| r.end <= base);
        let mut exempt = no_decay[first..].iter().peekable();
        move |i: usize| {
            let i = base + i;
            while exempt.peek().is_some_and(|r| r.end <= i) {
                exempt.next();
            }
            if exempt.peek().is_some_and(|r| r.contains(&i)) {
                1.0
            } else {
                self.decay
            }
        }
    }

    /// One element: clipped gradient, moments, bias-corrected step with decoupled decay.
    #[inline]
    fn update(self, p: &mut f32, g: f32, m: &mut f32, v: &mut f32, factor: f32) {
        let g = if self.clip != 1.0 {
            (g as f64 * self.clip) as f32
        } else {
            g
        };
        *m = *m * self.beta_1 + g * (1.0 - self.beta_1);
        *v = *v * self.beta_2 + g * g * (1.0 - self.beta_2);
        let m_hat = *m / self.bc1;
        let v_hat = *v / self.bc2;
        *p = *p * factor - self.lr * (m_hat / (v_hat.sqrt() + self.epsilon));
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
        self.step += 1;
        self.dense
            .adamw(&dense_shard, clip_coeff, lr, self.step, &self.config);
        self.expert
            .adamw(&expert_shard, clip_coeff, lr, self.step, &self.config);
        let module =
            if self.fp8.is_none() && self.dense.comm.size() == 1 && self.expert.comm.size() == 1 {
                // One rank owns everything: write the master weights straight into the module.
                self.table
                    .write_values(module, &self.dense.master, &self.expert.master)?
            } else {
                let (dense, expert) = self.gather_parameters()?;
                self.table.write_values(module, &dense, &expert)?
            };
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
            sq += sum_of_squares(
                dense_shard
                    .get(lo.saturating_sub(start)..hi.saturating_sub(start))
                    .unwrap_or(&[]),
            );
        }
        sq += sum_of_squares(expert_shard);
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

#[cfg(test)]
mod chunk_tests {
    use super::*;
    use crate::comm::World;
    use crate::testing::SplitMix;

    /// The chunked parallel AdamW equals a plain sequential loop written from the update rule,
    /// bit for bit, with exempt ranges straddling chunk boundaries and clipping on.
    #[test]
    fn chunked_adamw_equals_the_sequential_rule() {
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
        let (full_ref, grad_ref, exempt_ref, c_ref) = (&full, &grad, &exempt, &c);
        let got = World::run(1, |ctx| {
            let mut shard = Shard::new(ctx.world()?, full_ref, MomentDtype::F32);
            shard.exempt(exempt_ref.clone());
            for step in 1..=3 {
                shard.adamw(grad_ref, 0.5, 1e-2, step, c_ref);
            }
            Ok(shard.master)
        })
        .remove(0)
        .expect("rank");
        let (mut p, mut m, mut v) = (full.clone(), vec![0f32; n], vec![0f32; n]);
        for step in 1..=3 {
            let (lr, b1, b2) = (1e-2f32, c.beta_1, c.beta_2);
            for i in 0..n {
                let g = (grad[i] as f64 * 0.5) as f32;
                m[i] = m[i] * b1 + g * (1.0 - b1);
                v[i] = v[i] * b2 + g * g * (1.0 - b2);
                // `black_box`: in release builds LLVM folds `powi` of constants correctly
                // rounded, while the optimizer's runtime `powi` multiplies; the rule is the
                // same, the last bit of the bias correction is not.
                let (b1p, b2p) = (
                    std::hint::black_box(b1).powi(std::hint::black_box(step)),
                    std::hint::black_box(b2).powi(std::hint::black_box(step)),
                );
                let m_hat = m[i] / (1.0 - b1p);
                let v_hat = v[i] / (1.0 - b2p);
                let decay = if exempt.iter().any(|r| r.contains(&i)) {
                    1.0
                } else {
                    1.0 - lr * c.weight_decay
                };
                p[i] = p[i] * decay - lr * (m_hat / (v_hat.sqrt() + c.epsilon));
            }
        }
        assert_eq!(got, p);
    }
}
