//! The training step users call from their own loop (SFT or RL): one [`Trainer`] per rank,
//! wrapping the rank's shard of any [`ParallelCausalLm`] (Qwen3-MoE, DeepSeek-V3 with its MTP
//! modules, dense Qwen3) and a ZeRO-1 [`DistributedAdamW`].
//!
//! Batches are token ids with HF-style labels ([`TrainBatch`]), optionally packed (several
//! documents per row, Megatron THD `cu_seqlens` per row: [`TrainBatch::with_cu_seqlens`],
//! [`TrainBatch::packed`]) or padded (HF `attention_mask`: [`TrainBatch::with_attention_mask`],
//! [`TrainBatch::padded`]); see [`crate::packing`]. Attention then stays within each document
//! and skips padding, RoPE positions restart at every document, labels across a boundary or on
//! padding become −100, and the routers leave padded tokens out of their load-balancing losses
//! and expert-bias counts, so a packed batch trains exactly as its documents unpacked. The
//! step returns the cross-entropy, the router load-balancing loss, the global gradient norm and
//! throughput.
//!
//! ```no_run
//! # use moe_models::train::{Trainer, TrainerConfig, TrainBatch};
//! # fn demo<M: moe_models::distributed::ParallelCausalLm>(trainer: &mut Trainer<M>, ids: Vec<i64>) -> Result<(), moe_models::ModelError> {
//! let batch = TrainBatch::causal(ids, 4)?; // labels = ids
//! let stats = trainer.step(&batch)?;
//! println!("loss {:.4} aux {:.4} |g| {:.3} {:.0} tok/s", stats.loss, stats.aux_loss,
//!          stats.grad_norm, stats.tokens_per_second);
//! # Ok(()) }
//! ```

use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};
use moe_backend::comm::{Comm, GroupComms, ReduceOp};
use moe_backend::fp8::Fp8Recipe;
use moe_backend::optim::{
    DistributedAdamW, DistributedAdamWConfig, Fp8ParamLayout, Fp8PrimaryConfig, GradScaler,
    GradScalerConfig, LrSchedule, MainGradAccumulator, MuonAdamW, MuonConfig, ParamClass,
    ParamInfo, Precision, WdSchedule, cast_trainable,
};
use moe_backend::parallel::{GroupFamily, ProcessGroups};
use moe_backend::router::{AuxLossSpec, AuxLossType, RouterLoss, RouterLossKind};

use crate::ModelError;
use crate::distributed::sharded::{add_loads, mtp_labels, scalar, scored_targets_at};
use crate::distributed::{CausalLmShard, DispatcherKind, ParallelCausalLm, TrainForward, err};
use crate::param_plan::GradClass;
use crate::plan::activations::Recompute;
use crate::rl::logprobs::TokenLogProbs;

mod loss_scale;
mod pipeline;

pub use crate::batch::{PaddingSide, TrainBatch};

/// Settings of a [`Trainer`].
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    /// Learning rate (of every step, unless `lr_schedule` is set).
    pub lr: f64,
    /// Megatron's learning-rate schedule (warmup, then constant / linear / cosine / inverse
    /// square root / WSD decay to `min_lr`); step `k` (counted by the optimizer, so a restored
    /// trainer continues its schedule) uses `lr_schedule.lr(k)`. `None`: the constant `lr`.
    pub lr_schedule: Option<LrSchedule>,
    /// Megatron's weight-decay schedule (`start_wd` → `end_wd` over `wd_incr_steps`, constant,
    /// linear or cosine); step `k` uses `wd_schedule.wd(k)`. `None`: the constant
    /// `optimizer.weight_decay`.
    pub wd_schedule: Option<WdSchedule>,
    /// AdamW settings (ZeRO-1 over `dp_cp` / `expt_dp`); with `muon`, those of the AdamW side
    /// (embedding, LM head, norms, biases) and its `max_grad_norm` the joint clipping threshold.
    pub optimizer: DistributedAdamWConfig,
    /// Muon (report §7.8) for the weight matrices (chosen and split by the model's parallel
    /// plan, [`crate::param_plan::ParallelPlan::muon_matrices`]: every 2-D weight and
    /// stacked expert weight except the embedding and the LM head), AdamW for the rest, one
    /// global gradient norm over both ([`MuonAdamW`]); `None`: AdamW for everything. Muon takes
    /// the same learning rate (its default scale matches AdamW's update RMS). Not with FP8
    /// primary weights.
    pub muon: Option<MuonConfig>,
    /// Token dispatcher of the MoE blocks.
    pub dispatcher: DispatcherKind,
    /// Coefficient of the routers' load-balancing loss (Megatron's `moe_aux_loss_coeff`; 0
    /// disables it). The loss is Megatron's: computed in every MoE layer with the per-expert
    /// token counts summed over `tp_cp` (so it does not depend on how a replica's tokens are
    /// split over its ranks), attached to the routing weights (it never enters the reported
    /// cross-entropy) and weighted by `1 / micro-batches`.
    pub aux_loss_coeff: f64,
    /// Which load-balancing loss; the sharded forward supports `aux_loss` (over each
    /// micro-batch of a replica) so far.
    pub aux_loss_type: AuxLossType,
    /// Router z-loss coefficient (Megatron's `moe_z_loss_coeff`; 0 disables it).
    pub z_loss_coeff: f64,
    /// Aux-loss-free balancing: after every optimizer step each router with an expert bias
    /// (DeepSeek-V3) moves it by `rate · sign(mean − count)`, the counts summed over the step's
    /// micro-batches and over `tp_dp_cp` (exactly as one router seeing every token of the
    /// global batch). `false` freezes the bias.
    pub update_expert_bias: bool,
    /// Overrides the routers' expert-bias update rate (Megatron's
    /// `moe_router_bias_update_rate`, default 1e-3); `None` keeps the model's.
    pub expert_bias_update_rate: Option<f64>,
    /// Weight of the multi-token-prediction loss of models with MTP modules (Megatron's
    /// `mtp_loss_scaling_factor`): the objective adds `factor / D · Σⱼ CEⱼ` over the `D`
    /// depths, each depth's cross-entropy normalised per target token over the global batch;
    /// 0 skips the MTP modules (they then get no gradient).
    pub mtp_loss_scaling_factor: f64,
    /// Run the routed experts' GEMMs in FP8 with this blockwise recipe (docs/fp8.md §Recipes);
    /// `None` keeps them in the parameters' precision. Router, attention, norms, embeddings and
    /// head stay in high precision (docs/fp8.md §Selective precision).
    pub fp8: Option<Fp8Recipe>,
    /// With `fp8`: also run the dense linears (attention projections, dense MLPs) in FP8.
    pub fp8_linears: bool,
    /// With `fp8`: keep the FP8 layers' weights as FP8 primary weights
    /// (docs/fp8.md §FP8 primary weights): the optimizer casts its f32 master shards straight to
    /// blockwise E4M3 with the recipe's blocks and all-gathers one byte per element.
    pub fp8_primary_weights: bool,
    /// Activations recomputed in the backward pass instead of kept (Megatron's
    /// `--recompute-granularity full`, or `selective` with `--recompute-modules` `core_attn`,
    /// `moe_act`, `shared_experts`, `mlp`; see
    /// [`ParallelContext::set_recompute`](crate::distributed::ParallelContext::set_recompute)).
    /// Changes memory, never results: the gradients are bit-identical.
    pub recompute: Recompute,
    /// Megatron's `moe_shared_expert_overlap`: each MoE layer's shared experts run while its
    /// token dispatch is in flight (forward pass; results bit-identical). Default off.
    pub moe_shared_expert_overlap: bool,
    /// How attention exchanges keys and values over the context-parallel group (Megatron's
    /// `--cp-comm-type`): one all-gather (default) or around the ring (`p2p`).
    pub cp_comm_type: crate::distributed::CpCommType,
    /// Megatron's `--check-for-nan-in-loss-and-grad` (default on): a step whose loss, router
    /// or MTP loss (any rank) or global gradient norm is NaN or infinite is refused on every
    /// rank before the optimizer updates anything ([`ModelError::NonFiniteLoss`],
    /// [`moe_backend::BackendError::NonFiniteGradients`]), unless `skip_nonfinite_steps`
    /// allows skipping it. Off: such a step is applied as it is.
    pub check_for_nan_in_loss_and_grad: bool,
    /// With the check on: how many refused non-finite steps are skipped (no update, no
    /// expert-bias update, [`StepStats::skipped`]) instead of failing, over the trainer's
    /// life ([`Trainer::skipped_steps`], restored on resume by the caller). Default 0.
    pub skip_nonfinite_steps: u64,
    /// Precision of the parameters, activations and gradients (Megatron's `--bf16`; see
    /// [`moe_backend::optim::precision`] and docs/training-and-rl.md §Mixed precision (BF16)): under
    /// [`Precision::Bf16`] the shard's trainable parameters are held in BF16, each the rounded
    /// f32 main weight of the optimizer, which keeps f32 main weights and moments; router,
    /// norm statistics, attention softmax and cross-entropy compute in f32. Default f32.
    pub precision: Precision,
    /// Under BF16: accumulate the micro-batches' gradients and reduce them over the
    /// data-parallel groups in f32 (Megatron's `accumulate_allreduce_grads_in_fp32`, the
    /// default), or `false`: in BF16 (half the reduction bytes). No effect in f32; F16
    /// needs it (its scaled gradients are unscaled into the f32 main gradients).
    pub accumulate_allreduce_grads_in_fp32: bool,
    /// Under [`Precision::F16`]: the loss scaler (Megatron's `DynamicGradScaler` with its
    /// defaults, or a constant `--loss-scale`; see [`moe_backend::optim::grad_scaler`] and
    /// docs/training-and-rl.md §Mixed precision (FP16 and loss scaling)). Unused otherwise.
    pub grad_scaler: GradScalerConfig,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            lr_schedule: None,
            wd_schedule: None,
            optimizer: DistributedAdamWConfig {
                max_grad_norm: Some(1.0),
                exempt_norms_and_biases: true,
                ..DistributedAdamWConfig::default()
            },
            muon: None,
            dispatcher: DispatcherKind::AllToAll,
            aux_loss_coeff: 1e-3,
            aux_loss_type: AuxLossType::Aux,
            z_loss_coeff: 0.0,
            update_expert_bias: true,
            expert_bias_update_rate: None,
            mtp_loss_scaling_factor: 0.1,
            fp8: None,
            fp8_linears: false,
            fp8_primary_weights: false,
            recompute: Recompute::None,
            moe_shared_expert_overlap: false,
            cp_comm_type: crate::distributed::CpCommType::AllGather,
            check_for_nan_in_loss_and_grad: true,
            skip_nonfinite_steps: 0,
            precision: Precision::F32,
            accumulate_allreduce_grads_in_fp32: true,
            grad_scaler: GradScalerConfig::default(),
        }
    }
}

/// What one [`Trainer::step`] measured on this rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Cross-entropy of this replica's batch.
    pub loss: f32,
    /// This rank's part of the load-balancing loss (mean over MoE layers and micro-batches,
    /// without its coefficient); summed over `tp_cp` it is the replica's.
    pub aux_loss: f32,
    /// This replica's multi-token-prediction cross-entropy (mean over the depths of each
    /// depth's token-weighted mean, without the scaling factor), for models with MTP modules.
    pub mtp_loss: Option<f32>,
    /// Global gradient norm (before clipping).
    pub grad_norm: f64,
    /// Target tokens of this replica's batch.
    pub tokens: usize,
    /// `tokens` per second of wall time for the whole step.
    pub tokens_per_second: f64,
    /// Learning rate the step used.
    pub lr: f64,
    /// Nothing was updated: the step was non-finite and skipped (`skip_nonfinite_steps`),
    /// or (with `overflow`) the loss scaler found non-finite gradients.
    pub skipped: bool,
    /// The loss scale this step's backward pass used (FP16; `None` without loss scaling).
    pub loss_scale: Option<f64>,
    /// The dynamic loss scaler found NaN or infinite gradients on some rank and skipped the
    /// step (Megatron's overflow skip; not a divergence, not counted by
    /// `skip_nonfinite_steps`).
    pub overflow: bool,
}

/// One rank's training state (Qwen3-MoE unless another [`ParallelCausalLm`] is named).
#[derive(Debug, Clone)]
pub struct Trainer<M: ParallelCausalLm> {
    model: M::Shard,
    optimizer: Optimizer,
    config: TrainerConfig,
    device: Device,
    groups: ProcessGroups,
    /// The dense data-parallel group (token counts of the global batch).
    dp_cp: Comm,
    /// The context-parallel group (a replica's logged loss and token counts).
    cp: Comm,
    /// The routers' count group (expert-bias updates).
    tp_dp_cp: Comm,
    /// The pipeline group (logged values of every stage).
    pp: Comm,
    /// The pipeline's activation and gradient channels.
    channels: moe_backend::parallel::pipeline::PipelineChannels,
    /// Megatron's embedding group (first and last pipeline stage).
    embedding_group: Option<Comm>,
    /// `|tp|`.
    tp: usize,
    /// Every rank (the non-finite check's agreement).
    world: Comm,
    /// Non-finite steps skipped so far.
    skipped_steps: u64,
    /// The loss scaler (FP16 only).
    grad_scaler: Option<GradScaler>,
}

impl<M: ParallelCausalLm> Trainer<M> {
    /// Shards `full` for this rank (`groups`, all ranks in `world`) and sets up the optimizer
    /// (with FP8 primary weights a collective: every rank calls it): [`from_shard`] of
    /// [`ParallelCausalLm::shard`].
    ///
    /// [`from_shard`]: Self::from_shard
    pub fn new(
        full: &M,
        groups: &GroupComms,
        world: Comm,
        config: TrainerConfig,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let shard = full.shard(groups, config.dispatcher)?;
        Self::from_shard(shard, groups, world, config, device)
    }

    /// The trainer of this rank's `shard` (built for the layout of `groups` with
    /// `config.dispatcher`, e.g. loaded straight from a checkpoint with
    /// [`LoadShard::load_shard`](crate::distributed::LoadShard::load_shard), or a skeleton a
    /// restore then fills): applies the FP8 settings and router-loss configuration and sets up
    /// the optimizer (with FP8 primary weights a collective: every rank calls it). No rank
    /// ever holds more than its shard.
    pub fn from_shard(
        mut model: M::Shard,
        groups: &GroupComms,
        world: Comm,
        config: TrainerConfig,
        device: &Device,
    ) -> Result<Self, ModelError> {
        if let Some(schedule) = &config.lr_schedule {
            schedule.validate()?;
        }
        if let Some(schedule) = &config.wd_schedule {
            schedule.validate()?;
        }
        let aux_losses = vec![AuxLossSpec {
            kind: config.aux_loss_type,
            coeff: config.aux_loss_coeff,
        }];
        let z_loss = (config.z_loss_coeff != 0.0).then_some(config.z_loss_coeff);
        if let Some(recipe) = config.fp8 {
            let fp8 = model.model().clone().with_fp8(recipe, config.fp8_linears)?;
            *model.model_mut() = fp8;
        }
        if let Some(rate) = config.expert_bias_update_rate {
            for router in model.routers_mut() {
                router.set_expert_bias_update_rate(rate).map_err(err)?;
            }
        }
        model.set_router_losses(aux_losses, z_loss)?;
        model.set_recompute(config.recompute.clone())?;
        model
            .context_mut()
            .set_shared_expert_overlap(config.moe_shared_expert_overlap);
        model.context_mut().set_cp_comm_type(config.cp_comm_type);
        // Gradient classes from the model's parallel plan (an unplanned parameter is an error
        // here, before any optimizer state exists).
        let classes = model.model().param_classes()?;
        let param_class = classes.classifier();
        let world_comm = world.clone();
        let muon_matrices = model.model().muon_matrices()?;
        let optimizer = match &config.muon {
            Some(muon) => {
                if config.fp8_primary_weights {
                    return Err(ModelError::unsupported(
                        "muon",
                        "with FP8 primary weights (Muon keeps f32 masters)",
                    ));
                }
                Optimizer::Muon(Box::new(MuonAdamW::new(
                    model.model(),
                    groups,
                    world,
                    muon.clone(),
                    config.optimizer.clone(),
                    &param_class,
                    &|info: &ParamInfo| muon_matrices.select(info),
                )?))
            }
            None => {
                let mut adamw = DistributedAdamW::with_classes(
                    model.model(),
                    groups,
                    world,
                    config.optimizer.clone(),
                    &param_class,
                )?;
                if config.fp8_primary_weights {
                    let module = model.model().clone();
                    *model.model_mut() = enable_fp8_primary::<M>(&mut adamw, module, &config)?;
                }
                Optimizer::AdamW(Box::new(adamw))
            }
        };
        let mut optimizer = optimizer;
        optimizer.set_check_non_finite(config.check_for_nan_in_loss_and_grad);
        if config.precision != Precision::F32 {
            // The optimizer took its f32 main weights from the f32 parameters above; from now
            // on the module holds them rounded (and every step writes them rounded).
            let dtype = config.precision.param_dtype();
            if !device.supports_dtype(dtype) {
                return Err(ModelError::unsupported(
                    "precision",
                    format!(
                        "{} on {device:?}, which lacks {dtype:?} tensors",
                        config.precision
                    ),
                ));
            }
            if !config.accumulate_allreduce_grads_in_fp32 {
                if config.precision.needs_loss_scaling() {
                    return Err(ModelError::unsupported(
                        "accumulate_allreduce_grads_in_fp32",
                        "false with FP16 (the scaled F16 gradients are unscaled into f32 main \
                         gradients, which are accumulated and reduced in f32)",
                    ));
                }
                optimizer.set_grad_reduce_dtype(dtype)?;
            }
            *model.model_mut() = cast_trainable(model.model().clone(), dtype);
        }
        if let (Some(place), Some(id)) = (model.pipeline(), model.embedding().map(|e| e.weight.id))
            && place.holds_embedding_copy()
        {
            // The first stage counts the embedding in the gradient norm.
            let adamw = match &mut optimizer {
                Optimizer::AdamW(adamw) => adamw.as_mut(),
                Optimizer::Muon(muon) => muon.adamw_mut(),
            };
            adamw.exclude_from_norm(&[id])?;
        }
        let grad_scaler = match config.precision.needs_loss_scaling() {
            true => Some(GradScaler::new(config.grad_scaler)?),
            false => None,
        };
        Ok(Self {
            model,
            optimizer,
            config,
            device: device.clone(),
            groups: groups.groups.clone(),
            dp_cp: groups.comm(GroupFamily::DpCp).clone(),
            cp: groups.comm(GroupFamily::Cp).clone(),
            tp_dp_cp: groups.comm(GroupFamily::TpDpCp).clone(),
            pp: groups.comm(GroupFamily::Pp).clone(),
            channels: groups.pipeline_channels(),
            embedding_group: groups.embedding_group().cloned(),
            tp: groups.comm(GroupFamily::Tp).size(),
            world: world_comm,
            skipped_steps: 0,
            grad_scaler,
        })
    }

    /// This rank's shard.
    pub fn model(&self) -> &M::Shard {
        &self.model
    }

    /// This rank's AdamW (ZeRO-1 shards of the master weights and moments): every parameter's,
    /// or with Muon the AdamW side's ([`Trainer::muon`]).
    pub fn optimizer(&self) -> &DistributedAdamW {
        match &self.optimizer {
            Optimizer::AdamW(adamw) => adamw,
            Optimizer::Muon(muon) => muon.adamw(),
        }
    }

    /// The Muon + AdamW optimizer when [`TrainerConfig::muon`] is set.
    pub fn muon(&self) -> Option<&MuonAdamW> {
        match &self.optimizer {
            Optimizer::AdamW(_) => None,
            Optimizer::Muon(muon) => Some(muon),
        }
    }

    /// Mutable shard and Muon + AdamW optimizer when [`TrainerConfig::muon`] is set (to
    /// restore both from a checkpoint).
    pub fn muon_parts_mut(&mut self) -> Option<(&mut M::Shard, &mut MuonAdamW)> {
        match &mut self.optimizer {
            Optimizer::AdamW(_) => None,
            Optimizer::Muon(muon) => Some((&mut self.model, muon)),
        }
    }

    /// Mutable shard and AdamW (as [`Trainer::optimizer`]), e.g. to restore both from a
    /// checkpoint; the optimizer's master weights must then match the parameters
    /// ([`DistributedAdamW::reset_master_from`]).
    pub fn parts_mut(&mut self) -> (&mut M::Shard, &mut DistributedAdamW) {
        let adamw = match &mut self.optimizer {
            Optimizer::AdamW(adamw) => adamw,
            Optimizer::Muon(muon) => muon.adamw_mut(),
        };
        (&mut self.model, adamw)
    }

    /// This rank's memberships (global rank and layout).
    pub fn process_groups(&self) -> &ProcessGroups {
        &self.groups
    }

    /// The settings.
    pub fn config(&self) -> &TrainerConfig {
        &self.config
    }

    /// Forward, backward and optimizer step on this replica's `batch` (the same batch on every
    /// TP rank of the replica): [`Trainer::step_micro_batches`] with one micro-batch.
    pub fn step(&mut self, batch: &TrainBatch) -> Result<StepStats, ModelError> {
        self.step_micro_batches(std::slice::from_ref(batch))
    }

    /// One optimizer step over this replica's share of a global batch, given as micro-batches
    /// (every rank of the job passes the same number; the TP ranks of a replica the same
    /// batches). Gradients are accumulated over the micro-batches (one forward and backward
    /// at a time, so memory is that of one micro-batch) and the cross-entropy is normalised
    /// per target token over the whole global batch (all replicas, all micro-batches): how the
    /// global batch is cut into micro-batches and replicas changes nothing but rounding. The
    /// load-balancing loss of each micro-batch is weighted by `1 / micro_batches`, as Megatron
    /// scales every per-micro-batch loss.
    ///
    /// A micro-batch carrying a routing ([`TrainBatch::with_routed_experts`], RL routing
    /// replay) is trained on it: every MoE router of its forwards (and of their recomputation
    /// in the backward pass) sends each token to the given experts, under every layout (each
    /// rank's routers take their rows and, under pipeline parallelism, each stage its layers'
    /// entries, set right before each chunk's forward of that micro-batch). Micro-batches with
    /// and without routing can be mixed. Every routing is checked against the model before
    /// any forward runs.
    ///
    /// The returned `loss` is this replica's token-weighted mean cross-entropy, `aux_loss` the
    /// mean over micro-batches, `tokens` the replica's target tokens.
    pub fn step_micro_batches(&mut self, micro: &[TrainBatch]) -> Result<StepStats, ModelError> {
        let start = Instant::now();
        if micro.is_empty() {
            return Err(ModelError::input(
                "micro_batches",
                "a step needs at least one micro-batch",
            ));
        }
        self.check_routings(micro)?;
        self.model.begin_global_batch();
        moe_backend::recompute::clear_param_grads();
        if self.model.pipeline().is_some() {
            return self.step_pipelined(micro, start);
        }
        let mtp_scale = self.config.mtp_loss_scaling_factor;
        let depths = if mtp_scale != 0.0 {
            self.model.mtp_depths()
        } else {
            0
        };
        let (counts, local, global) = self.step_counts(micro, depths)?;
        let replicas = self.dp_cp.size();
        let mut accumulator = self.grad_accumulator();
        // Logged values summed over the micro-batches on the device, read once per step:
        // token-summed cross-entropy, aux loss, then each depth's token-summed MTP loss.
        let mut logged: Option<Tensor<1>> = None;
        let mut loads: Vec<Option<Vec<f64>>> = Vec::new();
        let n_micro = micro.len() as f64;
        // The loss scale multiplies the objective and the routers' attached losses alike.
        let loss_scale = self.loss_scale();
        for (batch, tokens) in micro.iter().zip(&counts) {
            let out = self.model.forward_train_batch(
                batch,
                &self.device,
                loss_scale / n_micro,
                depths > 0,
            )?;
            let TrainForward {
                loss,
                mtp_losses,
                router_losses,
                expert_load,
                ..
            } = out;
            add_loads(&mut loads, expert_load)?;
            let weights = MicroWeights {
                tokens,
                global: &global,
                replicas,
                depths,
                mtp_scale,
                loss_scale,
            };
            let aux = self.logged_aux(&router_losses);
            let (objective, row) = weights.weigh(loss, mtp_losses, aux, &self.device);
            logged = Some(match logged {
                Some(sum) => sum + row,
                None => row,
            });
            let grads = GradientsParams::from_grads(objective.backward(), self.model.model());
            accumulator.accumulate(self.model.model(), grads);
            self.accumulate_recomputed(&mut accumulator);
        }
        let grads = accumulator.grads();
        // The replica's logged sums and token counts: under context parallelism its ranks
        // hold different tokens of the same sequences, so they are summed over `cp`.
        let (logged, local) = self.replica_sums(logged, local)?;
        let sums: Vec<f64> = match logged {
            Some(t) => read_f32(t)?.into_iter().map(f64::from).collect(),
            None => Vec::new(),
        };
        let sum = |i: usize| sums.get(i).copied().unwrap_or(0.0);
        if let Some(refused) = self.check_losses(&sums, &["loss", "aux loss"])? {
            return self.refuse(refused, sum(0), local[0], start);
        }
        let used_scale = self.grad_scaler.as_ref().map(GradScaler::scale);
        let grads = match self.unscale(grads, sum(0), sum(1) / n_micro, local[0], start)? {
            loss_scale::Unscaled::Grads(grads) => grads,
            loss_scale::Unscaled::Skipped(stats) => return Ok(stats),
        };
        let mut stats = match self.finish_step(grads, sum(0), sum(1) / n_micro, local[0], start) {
            Err(e) if e.is_non_finite() => return self.refuse(e, sum(0), local[0], start),
            other => other?,
        };
        stats.loss_scale = used_scale;
        if self.config.update_expert_bias {
            self.update_expert_bias(loads)?;
        }
        if depths > 0 {
            let per_depth = (0..depths).map(|j| match local[j + 1] {
                0 => 0.0,
                n => sum(j + 2) / n as f64,
            });
            stats.mtp_loss = Some((per_depth.sum::<f64>() / depths as f64) as f32);
        }
        stats.tokens_per_second = stats.tokens as f64 / start.elapsed().as_secs_f64().max(1e-9);
        Ok(stats)
    }

    /// The validation loss of this replica's share of an evaluation batch, given as
    /// micro-batches as for [`step_micro_batches`](Self::step_micro_batches) (every rank passes
    /// the same number): `(token-summed cross-entropy, target tokens)` of the replica (summed
    /// over its context-parallel ranks), for the caller to sum over replicas and batches.
    /// Nothing is updated: no optimizer step, no expert-bias update, no router statistic kept
    /// (the next training step starts its global batch afresh). Under pipeline parallelism the
    /// micro-batches run through the stages on the training schedule and the gradients are
    /// dropped; otherwise a forward pass only. The MTP modules are not run.
    pub fn evaluate(&mut self, micro: &[TrainBatch]) -> Result<(f64, usize), ModelError> {
        if micro.is_empty() {
            return Err(ModelError::input(
                "micro_batches",
                "an evaluation needs at least one micro-batch",
            ));
        }
        self.check_routings(micro)?;
        self.model.begin_global_batch();
        moe_backend::recompute::clear_param_grads();
        let (counts, local, global) = self.step_counts(micro, 0)?;
        let loss_sum = match self.model.pipeline().cloned() {
            Some(place) => {
                let inputs = pipeline::StepInputs {
                    micro,
                    counts: &counts,
                    global: &global,
                    replicas: self.dp_cp.size(),
                    depths: 0,
                    mtp_scale: 0.0,
                    aux_kind: RouterLossKind::from(self.config.aux_loss_type),
                    device: &self.device,
                    main_grad_dtype: self.main_grad_dtype(),
                    loss_scale: 1.0,
                };
                let outcome =
                    pipeline::run_step(&self.model, &place, &self.channels, self.tp, &inputs)?;
                let logged = outcome.logged.first().copied().unwrap_or(0.0);
                sum_over(&self.pp, &[logged], &self.device)?
                    .first()
                    .copied()
                    .unwrap_or(0.0)
            }
            None => {
                let mut sum: Option<Tensor<1>> = None;
                for (batch, tokens) in micro.iter().zip(&counts) {
                    let out = self.model.forward_train_batch(
                        batch,
                        &self.device,
                        1.0 / micro.len() as f64,
                        false,
                    )?;
                    if tokens[0] == 0 {
                        continue;
                    }
                    let row = out.loss.detach().mul_scalar(tokens[0] as f64);
                    sum = Some(match sum {
                        Some(s) => s + row,
                        None => row,
                    });
                }
                match sum {
                    Some(t) => read_f32(t)?.first().copied().map_or(0.0, f64::from),
                    None => 0.0,
                }
            }
        };
        moe_backend::recompute::clear_param_grads();
        // `[loss, aux]` as `replica_sums` takes the logged row (the aux entry unused here).
        let logged = Tensor::<1>::from_data(
            burn::tensor::TensorData::new(vec![loss_sum as f32, 0.0], [2]),
            &self.device,
        );
        let (logged, local) = self.replica_sums(Some(logged), local)?;
        let loss_sum = match logged {
            Some(t) => read_f32(t)?.first().copied().map_or(0.0, f64::from),
            None => 0.0,
        };
        Ok((loss_sum, local.first().copied().unwrap_or(0)))
    }

    /// Checks the routing of every routed micro-batch against the model (before any forward:
    /// a stage of a pipeline must not fail alone mid-schedule).
    fn check_routings(&self, micro: &[TrainBatch]) -> Result<(), ModelError> {
        let spec = self.model.routing_spec();
        for (i, batch) in micro.iter().enumerate() {
            let Some(routed) = batch.routed_experts() else {
                continue;
            };
            let spec = spec.as_ref().ok_or_else(|| {
                ModelError::input(
                    "routed_experts",
                    format!("micro-batch {i}: the model has no MoE router to replay a routing in"),
                )
            })?;
            routed.validate(batch.batch, batch.seq_len(), spec)?;
        }
        Ok(())
    }

    /// Target tokens per micro-batch (main loss, then each of `depths` MTP depths), this
    /// rank's sums and the global batch's (over the data-parallel replicas).
    #[allow(clippy::type_complexity)]
    fn step_counts(
        &self,
        micro: &[TrainBatch],
        depths: usize,
    ) -> Result<(Vec<Vec<usize>>, Vec<usize>, Vec<f64>), ModelError> {
        // Per micro-batch: target tokens of the main loss, then of each MTP depth.
        // Under context parallelism each rank counts the targets of its own positions.
        let counts: Vec<Vec<usize>> = micro
            .iter()
            .map(|b| {
                let s = b.seq_len();
                let at = self.model.sequence_positions(s);
                std::iter::once(scored_targets_at(&b.labels, s, &at))
                    .chain((0..depths).map(|j| {
                        scored_targets_at(&mtp_labels(&b.labels, s, j, b.layout()), s, &at)
                    }))
                    .collect()
            })
            .collect();
        let local: Vec<usize> = (0..=depths)
            .map(|d| counts.iter().map(|c| c[d]).sum())
            .collect();
        // Target tokens of the whole global batch: summed over the data-parallel replicas
        // (every TP rank of a replica holds the same batch, so the dp_cp group sees each
        // replica once).
        let global = self.global_counts(&local)?;
        if global[0] <= 0.0 {
            return Err(ModelError::input(
                "labels",
                "the global batch has no target token (every label is -100)",
            ));
        }
        Ok((counts, local, global))
    }

    /// [`step_micro_batches`](Self::step_micro_batches) under pipeline parallelism: the
    /// micro-batches run through the stages on the pipeline schedule (1F1B, or interleaved
    /// with virtual stages); the loss and the logged values come from the last stage, the
    /// router statistics from every stage, all summed over the pipeline group.
    fn step_pipelined(
        &mut self,
        micro: &[TrainBatch],
        start: Instant,
    ) -> Result<StepStats, ModelError> {
        let place = (self.model.pipeline().cloned())
            .ok_or_else(|| ModelError::layout("pp", "no pipeline on this rank"))?;
        let mtp_scale = self.config.mtp_loss_scaling_factor;
        let depths = if mtp_scale != 0.0 { place.model.mtp } else { 0 };
        let (counts, local, global) = self.step_counts(micro, depths)?;
        let inputs = pipeline::StepInputs {
            micro,
            counts: &counts,
            global: &global,
            replicas: self.dp_cp.size(),
            depths,
            mtp_scale,
            aux_kind: RouterLossKind::from(self.config.aux_loss_type),
            device: &self.device,
            main_grad_dtype: self.main_grad_dtype(),
            loss_scale: self.loss_scale(),
        };
        let outcome = pipeline::run_step(&self.model, &place, &self.channels, self.tp, &inputs)?;
        let mut grads = outcome.grads;
        let group = self.embedding_group.as_ref();
        pipeline::reduce_embedding_grads(&self.model, &place, group, &mut grads, &self.device)?;
        // Every stage's logged sums and MoE-layer count, summed over the pipeline.
        let mut values = outcome.logged;
        values.push(outcome.moe_layers as f64);
        let values = sum_over(&self.pp, &values, &self.device)?;
        let moe_layers = values.last().copied().unwrap_or(0.0).max(1.0);
        let mut sums: Vec<f32> = values[..values.len() - 1]
            .iter()
            .map(|&v| v as f32)
            .collect();
        // The aux sum over layers becomes the mean over layers, as on one rank.
        if let Some(aux) = sums.get_mut(1) {
            *aux = (f64::from(*aux) / moe_layers) as f32;
        }
        let n = sums.len();
        let logged = Tensor::<1>::from_data(burn::tensor::TensorData::new(sums, [n]), &self.device);
        let (logged, local) = self.replica_sums(Some(logged), local)?;
        let sums: Vec<f64> = match logged {
            Some(t) => read_f32(t)?.into_iter().map(f64::from).collect(),
            None => Vec::new(),
        };
        let sum = |i: usize| sums.get(i).copied().unwrap_or(0.0);
        let n_micro = micro.len() as f64;
        if let Some(refused) = self.check_losses(&sums, &["loss", "aux loss"])? {
            return self.refuse(refused, sum(0), local[0], start);
        }
        let used_scale = self.grad_scaler.as_ref().map(GradScaler::scale);
        let grads = match self.unscale(grads, sum(0), sum(1) / n_micro, local[0], start)? {
            loss_scale::Unscaled::Grads(grads) => grads,
            loss_scale::Unscaled::Skipped(stats) => return Ok(stats),
        };
        let mut stats = match self.finish_step(grads, sum(0), sum(1) / n_micro, local[0], start) {
            Err(e) if e.is_non_finite() => return self.refuse(e, sum(0), local[0], start),
            other => other?,
        };
        stats.loss_scale = used_scale;
        if self.config.update_expert_bias {
            self.update_expert_bias(outcome.loads)?;
        }
        if depths > 0 {
            let per_depth = (0..depths).map(|j| match local[j + 1] {
                0 => 0.0,
                n => sum(j + 2) / n as f64,
            });
            stats.mtp_loss = Some((per_depth.sum::<f64>() / depths as f64) as f32);
        }
        stats.tokens_per_second = stats.tokens as f64 / start.elapsed().as_secs_f64().max(1e-9);
        Ok(stats)
    }

    /// The step's gradient accumulator: f32 main gradients under BF16 with
    /// `accumulate_allreduce_grads_in_fp32`, else the gradients as the backward pass gives them.
    fn grad_accumulator(&self) -> MainGradAccumulator<M> {
        MainGradAccumulator::new(self.main_grad_dtype())
    }

    /// The dtype micro-batch gradients are cast to before accumulating (`None`: kept).
    fn main_grad_dtype(&self) -> Option<DType> {
        (self.config.precision != Precision::F32 && self.config.accumulate_allreduce_grads_in_fp32)
            .then_some(DType::F32)
    }

    /// Adds the parameter gradients of the regions recomputed in the last backward pass
    /// ([`moe_backend::recompute::take_param_grads`]) to `accumulator`.
    fn accumulate_recomputed(&self, accumulator: &mut MainGradAccumulator<M>) {
        for grads in moe_backend::recompute::take_param_grads() {
            accumulator.accumulate(self.model.model(), grads);
        }
    }

    /// The logged sums (token-summed cross-entropy, aux loss, token-summed MTP losses) and
    /// target counts of this rank, summed over its context-parallel group (unchanged without
    /// context parallelism; the aux loss stays this rank's part of its `tp_cp` group's loss,
    /// as under TP).
    fn replica_sums(
        &self,
        logged: Option<Tensor<1>>,
        local: Vec<usize>,
    ) -> Result<(Option<Tensor<1>>, Vec<usize>), ModelError> {
        if self.cp.size() == 1 {
            return Ok((logged, local));
        }
        let logged = match logged {
            Some(t) => {
                // Entry 1 (the aux loss) stays this rank's part, as under TP.
                let n = t.dims()[0];
                let keep: Vec<f32> = (0..n).map(|i| if i == 1 { 1.0 } else { 0.0 }).collect();
                let keep =
                    Tensor::<1>::from_data(burn::tensor::TensorData::new(keep, [n]), &self.device);
                let summed = (self.cp)
                    .all_reduce(
                        t.clone() * keep.clone().neg().add_scalar(1.0),
                        ReduceOp::Sum,
                    )
                    .map_err(err)?;
                Some(summed + t * keep)
            }
            None => None,
        };
        let values: Vec<f32> = local.iter().map(|&n| n as f32).collect();
        let n = values.len();
        let t = Tensor::<1>::from_data(burn::tensor::TensorData::new(values, [n]), &self.device);
        let summed = read_f32(self.cp.all_reduce(t, ReduceOp::Sum).map_err(err)?)?;
        Ok((logged, summed.into_iter().map(|v| v as usize).collect()))
    }

    /// `local` token counts summed over the data-parallel replicas (one collective).
    fn global_counts(&self, local: &[usize]) -> Result<Vec<f64>, ModelError> {
        let local: Vec<f64> = local.iter().map(|&n| n as f64).collect();
        sum_over(&self.dp_cp, &local, &self.device)
    }

    /// The aux-loss-free expert-bias update of every router with counts: the step's counts
    /// (all micro-batches) summed over `tp_dp_cp` in one collective, then the same update on
    /// every replica of each router.
    fn update_expert_bias(&mut self, loads: Vec<Option<Vec<f64>>>) -> Result<(), ModelError> {
        // The routers report in forward order, the main model's first: with the MTP loss off
        // the MTP blocks' routers did not run this step and keep their bias.
        let routers = self.model.routers_mut().len();
        if loads.len() > routers {
            return Err(ModelError::input(
                "expert_load",
                format!(
                    "{} routers report counts, the model has {routers}",
                    loads.len()
                ),
            ));
        }
        let flat: Vec<f64> = loads.iter().flatten().flatten().copied().collect();
        if flat.is_empty() {
            return Ok(());
        }
        // f64 keeps integer counts exact however large the global batch.
        let n = flat.len();
        let t = Tensor::<1>::from_data(
            burn::tensor::TensorData::new(flat, [n]),
            (&self.device, burn::tensor::DType::F64),
        );
        let summed = self
            .tp_dp_cp
            .all_reduce(t, ReduceOp::Sum)
            .map_err(err)?
            .into_data()
            .convert::<f64>()
            .try_into_vec::<f64>()
            .map_err(|e| ModelError::input("expert_load", format!("{e:?}")))?;
        let mut offset = 0;
        for (router, load) in self.model.routers_mut().into_iter().zip(&loads) {
            if let Some(load) = load {
                let counts = &summed[offset..offset + load.len()];
                offset += load.len();
                router.update_expert_bias_with_counts(counts).map_err(err)?;
            }
        }
        Ok(())
    }

    /// One optimizer step with a caller-defined loss (the loss hook RL objectives use): for
    /// every micro-batch, `loss(shard, batch, aux_grad_scale)` runs the sharded forward it needs
    /// with that router-loss scale (e.g. [`Sharded::<Qwen3MoeForCausalLM>::forward_logprobs_scaled`](crate::distributed::Sharded::<Qwen3MoeForCausalLM>::forward_logprobs_scaled), or
    /// [`Sharded::<Qwen3MoeForCausalLM>::forward_loss_scaled`](crate::distributed::Sharded::<Qwen3MoeForCausalLM>::forward_loss_scaled); `1 / micro-batches`, so the attached router
    /// losses weigh as in [`Trainer::step_micro_batches`]) and returns the objective to
    /// back-propagate and the number of tokens it covers. Gradients are accumulated over the micro-batches and
    /// averaged over the data-parallel replicas by the optimizer, so the objective should be
    /// normalised as the caller wants it for one replica's share of the batch (e.g. summed
    /// over its tokens and divided by the replica's token count). The returned `loss` is the
    /// mean over micro-batches of the objective values, `tokens` their token count.
    /// The hook runs the forward it needs itself, so the trainer sees no router counts: expert
    /// biases (DeepSeek-V3) stay as they are on these steps.
    pub fn step_with<B>(
        &mut self,
        micro: &[B],
        mut loss: impl FnMut(&M::Shard, &B, f64) -> Result<(Tensor<1>, usize), ModelError>,
    ) -> Result<StepStats, ModelError> {
        let start = Instant::now();
        if self.model.pipeline().is_some() {
            return Err(ModelError::unsupported(
                "pp",
                "a caller-defined loss runs a whole-model forward; under pipeline parallelism \
                 train with `step_micro_batches`",
            ));
        }
        if micro.is_empty() {
            return Err(ModelError::input(
                "micro_batches",
                "a step needs at least one micro-batch",
            ));
        }
        self.model.begin_global_batch();
        moe_backend::recompute::clear_param_grads();
        let mut accumulator = self.grad_accumulator();
        let (mut value_sum, mut tokens) = (0.0f64, 0usize);
        let loss_scale = self.loss_scale();
        let aux_grad_scale = loss_scale / micro.len() as f64;
        for batch in micro {
            let (objective, n) = loss(&self.model, batch, aux_grad_scale)?;
            value_sum += f64::from(scalar(&objective)?);
            tokens += n;
            let objective = if loss_scale == 1.0 {
                objective
            } else {
                objective.mul_scalar(loss_scale)
            };
            let grads = GradientsParams::from_grads(objective.backward(), self.model.model());
            accumulator.accumulate(self.model.model(), grads);
            self.accumulate_recomputed(&mut accumulator);
        }
        let grads = accumulator.grads();
        let value = value_sum / micro.len() as f64;
        if let Some(refused) = self.check_losses(&[value], &["objective"])? {
            return self.refuse(refused, value, 1, start);
        }
        let used_scale = self.grad_scaler.as_ref().map(GradScaler::scale);
        let grads = match self.unscale(grads, value, 0.0, 1, start)? {
            loss_scale::Unscaled::Grads(grads) => grads,
            loss_scale::Unscaled::Skipped(mut stats) => {
                stats.loss = value as f32;
                stats.tokens = tokens;
                return Ok(stats);
            }
        };
        let mut stats = match self.finish_step(grads, 0.0, 0.0, tokens, start) {
            Err(e) if e.is_non_finite() => return self.refuse(e, value, 1, start),
            other => other?,
        };
        stats.loss_scale = used_scale;
        stats.loss = value as f32;
        Ok(stats)
    }

    /// One optimizer step whose objective is a function of the model's per-token log-probs
    /// (RL policy losses), under **every** layout, pipeline and context parallelism included:
    /// the trainer runs each micro-batch's forward (on the pipeline schedule under `pp`,
    /// 1F1B or interleaved), computes the replica's next-token log-probs and entropies
    /// `[batch, S − 1]` of the micro-batch's labels on the last stage (vocab-parallel; whole
    /// rows gathered over context parallelism; packed or padded with a layout) and calls
    /// `loss(i, &micro[i], logprobs)` there — Megatron's `loss_func` of a `forward_step`.
    /// The hook returns the micro-batch's objective, normalised as the caller wants it for one
    /// replica's share of the batch (as for [`step_with`](Self::step_with): the optimizer
    /// averages over the data-parallel replicas), and its token count; it is back-propagated
    /// through the stages, with the routers' losses weighted `1 / micro-batches` as in
    /// [`step_micro_batches`](Self::step_micro_batches). Under context parallelism every CP
    /// rank of a replica computes the same objective from the same gathered log-probs and
    /// back-propagates it into its own positions (the trainer scales it by `cp`, since the
    /// optimizer averages over the `dp × cp` ranks), so the hook needs no CP logic.
    ///
    /// A micro-batch with a routing ([`TrainBatch::with_routed_experts`]) replays it in the
    /// log-prob forward (RL routing replay), under every layout as in
    /// [`step_micro_batches`](Self::step_micro_batches). The routers' expert-bias counts of the
    /// step update the biases as in a training step (with
    /// [`TrainerConfig::update_expert_bias`]). The returned `loss` is the mean over
    /// micro-batches of the objectives, `tokens` their token count (the same on every rank).
    pub fn step_with_logprobs(
        &mut self,
        micro: &[TrainBatch],
        mut loss: impl FnMut(
            usize,
            &TrainBatch,
            TokenLogProbs,
        ) -> Result<(Tensor<1>, usize), ModelError>,
    ) -> Result<StepStats, ModelError> {
        let start = Instant::now();
        if micro.is_empty() {
            return Err(ModelError::input(
                "micro_batches",
                "a step needs at least one micro-batch",
            ));
        }
        // Routings are checked on every rank before any forward (no stage fails alone).
        self.check_routings(micro)?;
        self.model.begin_global_batch();
        moe_backend::recompute::clear_param_grads();
        let scale = self.cp.size() as f64;
        let outcome = crate::distributed::logprob_pipeline::run_logprob_step(
            &self.model,
            micro,
            &self.channels,
            self.tp,
            &self.device,
            scale,
            self.loss_scale(),
            self.main_grad_dtype(),
            &mut loss,
        )?;
        let mut grads = outcome.grads;
        if let Some(place) = self.model.pipeline().cloned() {
            let group = self.embedding_group.as_ref();
            pipeline::reduce_embedding_grads(&self.model, &place, group, &mut grads, &self.device)?;
        }
        // The objectives live on the last stage: summed over the pipeline group.
        let values = sum_over(
            &self.pp,
            &[outcome.value_sum, outcome.tokens as f64],
            &self.device,
        )?;
        let value = values[0] / micro.len() as f64;
        let tokens = values[1].round() as usize;
        if let Some(refused) = self.check_losses(&[value], &["objective"])? {
            return self.refuse(refused, value, 1, start);
        }
        let used_scale = self.grad_scaler.as_ref().map(GradScaler::scale);
        let grads = match self.unscale(grads, value, 0.0, 1, start)? {
            loss_scale::Unscaled::Grads(grads) => grads,
            loss_scale::Unscaled::Skipped(mut stats) => {
                stats.loss = value as f32;
                stats.tokens = tokens;
                return Ok(stats);
            }
        };
        let mut stats = match self.finish_step(grads, 0.0, 0.0, tokens, start) {
            Err(e) if e.is_non_finite() => return self.refuse(e, value, 1, start),
            other => other?,
        };
        stats.loss_scale = used_scale;
        if self.config.update_expert_bias {
            self.update_expert_bias(outcome.loads)?;
        }
        stats.loss = value as f32;
        stats.tokens_per_second = tokens as f64 / start.elapsed().as_secs_f64().max(1e-9);
        Ok(stats)
    }

    /// Non-finite steps skipped so far (`TrainerConfig::skip_nonfinite_steps`).
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// Sets the count of skipped non-finite steps (restoring a run: the budget
    /// `TrainerConfig::skip_nonfinite_steps` covers the whole run).
    pub fn set_skipped_steps(&mut self, skipped: u64) {
        self.skipped_steps = skipped;
    }

    /// With the non-finite check on: whether any of this rank's logged `values` (named by
    /// `names`, the rest `MTP loss`) or any other rank's is NaN or infinite, agreed over the
    /// world in one collective, as the refusal naming the lowest such rank and the value.
    fn check_losses(
        &self,
        values: &[f64],
        names: &[&str],
    ) -> Result<Option<ModelError>, ModelError> {
        if !self.config.check_for_nan_in_loss_and_grad {
            return Ok(None);
        }
        let bad: Vec<bool> = values.iter().map(|v| !v.is_finite()).collect();
        let vote = self.world.vote(&bad, &self.device).map_err(err)?;
        let Some(rank) = vote.first else {
            return Ok(None);
        };
        let mut what: Vec<&str> = vote
            .raised
            .iter()
            .enumerate()
            .filter(|(_, raised)| **raised)
            .map(|(i, _)| names.get(i).copied().unwrap_or("MTP loss"))
            .collect();
        what.dedup();
        Ok(Some(ModelError::NonFiniteLoss {
            what: what.join(" and "),
            rank,
        }))
    }

    /// A refused non-finite step: skipped (nothing updated; the statistics say `skipped`)
    /// while `skip_nonfinite_steps` allows, else the error.
    fn refuse(
        &mut self,
        refused: ModelError,
        loss_sum: f64,
        tokens: usize,
        start: Instant,
    ) -> Result<StepStats, ModelError> {
        if self.skipped_steps >= self.config.skip_nonfinite_steps {
            return Err(refused);
        }
        self.skipped_steps += 1;
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        Ok(StepStats {
            loss: (loss_sum / tokens.max(1) as f64) as f32,
            aux_loss: f32::NAN,
            mtp_loss: None,
            grad_norm: f64::NAN,
            tokens,
            tokens_per_second: tokens as f64 / secs,
            lr: self.lr(),
            skipped: true,
            loss_scale: self.grad_scaler.as_ref().map(GradScaler::scale),
            overflow: false,
        })
    }

    /// The optimizer step on accumulated gradients and the step's statistics (`loss_sum` is
    /// the replica's token-summed cross-entropy).
    fn finish_step(
        &mut self,
        grads: GradientsParams,
        loss_sum: f64,
        aux: f64,
        tokens: usize,
        start: Instant,
    ) -> Result<StepStats, ModelError> {
        let lr = self.lr();
        if let Some(schedule) = &self.config.wd_schedule {
            let wd = schedule.wd(self.optimizer.step_count());
            self.optimizer.set_weight_decay(wd as f32);
        }
        let report = self
            .optimizer
            .step_in_place(lr, self.model.model_mut(), grads)?;
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        Ok(StepStats {
            loss: if tokens > 0 {
                (loss_sum / tokens as f64) as f32
            } else {
                0.0
            },
            aux_loss: aux as f32,
            mtp_loss: None,
            grad_norm: report.grad_norm,
            tokens,
            tokens_per_second: tokens as f64 / secs,
            lr,
            skipped: false,
            loss_scale: self.grad_scaler.as_ref().map(GradScaler::scale),
            overflow: false,
        })
    }

    /// This rank's part of the logged load-balancing loss of one forward: the mean over MoE
    /// layers of the configured loss without its coefficient (as Megatron logs it); summed
    /// over `tp_cp` it is the replica's.
    fn logged_aux(&self, losses: &[Vec<RouterLoss>]) -> Tensor<1> {
        let kind = RouterLossKind::from(self.config.aux_loss_type);
        // Summed on the device (detached), read with the step's other logged values.
        aux_sum(losses, kind)
            .map(|sum| sum.div_scalar(losses.len().max(1) as f64))
            .unwrap_or_else(|| Tensor::zeros([1], &self.device))
    }

    /// Learning rate of the next step (from the schedule at the optimizer's step count).
    pub fn lr(&self) -> f64 {
        match &self.config.lr_schedule {
            Some(schedule) => schedule.lr(self.optimizer.step_count()),
            None => self.config.lr,
        }
    }
}

/// Switches `adamw` to FP8 primary weights for the FP8 layers of `config` and returns `module`
/// holding them (a collective): the selected parameters are exactly those the model runs
/// through the FP8 GEMMs, so they hold packed E4M3 codes and block scales (the default
/// [`moe_backend::optim::Fp8Storage::Packed`]; on non-Flex devices their decoded values).
fn enable_fp8_primary<M: ParallelCausalLm>(
    adamw: &mut DistributedAdamW,
    module: M,
    config: &TrainerConfig,
) -> Result<M, ModelError> {
    let recipe = config.fp8.ok_or_else(|| {
        ModelError::invalid(
            "fp8_primary_weights",
            "FP8 primary weights need an FP8 recipe (`fp8`)",
        )
    })?;
    // The dense linears' weights that `with_fp8(recipe, linears)` runs in FP8: the plan's
    // FP8-eligible non-expert entries.
    let fp8_linears: std::collections::HashSet<String> = if config.fp8_linears {
        M::parallel_plan()
            .walk(&module, module.main_layers())?
            .into_iter()
            .filter(|t| t.entry.fp8 && t.entry.grad != GradClass::Param(ParamClass::Expert))
            .map(|t| t.path)
            .collect()
    } else {
        Default::default()
    };
    let select = move |info: &ParamInfo| {
        Fp8ParamLayout::experts(info).or_else(|| {
            fp8_linears
                .contains(&info.path)
                .then(|| Fp8ParamLayout::linear(info))
                .flatten()
        })
    };
    Ok(
        adamw.enable_fp8_primary_weights(
            module,
            Fp8PrimaryConfig::from_recipe(&recipe),
            &select,
        )?,
    )
}

/// The trainer's optimizer.
#[derive(Debug, Clone)]
enum Optimizer {
    /// ZeRO-1 AdamW for every parameter.
    AdamW(Box<DistributedAdamW>),
    /// Muon for the weight matrices, AdamW for the rest.
    Muon(Box<MuonAdamW>),
}

impl Optimizer {
    fn step_count(&self) -> u64 {
        match self {
            Self::AdamW(o) => o.step_count(),
            Self::Muon(o) => o.step_count(),
        }
    }

    fn set_check_non_finite(&mut self, check: bool) {
        match self {
            Self::AdamW(o) => o.set_check_non_finite(check),
            Self::Muon(o) => o.set_check_non_finite(check),
        }
    }

    /// BF16 (or f32) gradient reduction; Muon reduces its matrices in f32 only.
    fn set_grad_reduce_dtype(&mut self, dtype: DType) -> Result<(), ModelError> {
        match self {
            Self::AdamW(o) => Ok(o.set_grad_reduce_dtype(dtype)?),
            Self::Muon(_) if dtype == DType::F32 => Ok(()),
            Self::Muon(_) => Err(ModelError::unsupported(
                "accumulate_allreduce_grads_in_fp32",
                "false with Muon (its gradient reduction is f32)",
            )),
        }
    }

    fn set_weight_decay(&mut self, wd: f32) {
        match self {
            Self::AdamW(o) => o.set_weight_decay(wd),
            Self::Muon(o) => o.set_weight_decay(wd),
        }
    }

    /// One step on `module` in place (AdamW: [`DistributedAdamW::step_in_place`], which
    /// lets the CPU backend update the master weights without copying them).
    fn step_in_place<T: burn::module::Module>(
        &mut self,
        lr: f64,
        module: &mut T,
        grads: GradientsParams,
    ) -> Result<moe_backend::optim::StepReport, ModelError> {
        Ok(match self {
            Self::AdamW(o) => o.step_in_place(lr, module, grads)?,
            Self::Muon(o) => {
                let (next, report) = o.step(lr, module.clone(), grads)?;
                *module = next;
                report
            }
        })
    }
}

/// How one micro-batch's losses enter the step: the weights of the one-rank objective.
struct MicroWeights<'a> {
    /// Target tokens of this micro-batch: the main loss, then each MTP depth.
    tokens: &'a [usize],
    /// Target tokens of the global batch, per loss.
    global: &'a [f64],
    /// Data-parallel replicas (the optimizer averages over them).
    replicas: usize,
    /// MTP depths trained.
    depths: usize,
    /// `mtp_loss_scaling_factor`.
    mtp_scale: f64,
    /// The loss scale (FP16; 1 otherwise): the objective is back-propagated times it.
    loss_scale: f64,
}

impl MicroWeights<'_> {
    /// The objective to back-propagate — the cross-entropy's token sum scaled by
    /// `replicas / global tokens` (the optimizer averages over the replicas), plus each MTP
    /// depth's likewise times `mtp_scale / depths` (the router losses are attached to the
    /// graph already) — and the logged row `[CE·tokens, aux, MTPⱼ·tokensⱼ…]` (detached).
    fn weigh(
        &self,
        loss: Tensor<1>,
        mtp_losses: Vec<Tensor<1>>,
        aux: Tensor<1>,
        device: &Device,
    ) -> (Tensor<1>, Tensor<1>) {
        let mut row = vec![loss.clone().detach().mul_scalar(self.tokens[0] as f64), aux];
        row.extend(
            (0..self.depths).map(|j| match (mtp_losses.get(j), self.tokens.get(j + 1)) {
                (Some(l), Some(&n)) => l.clone().detach().mul_scalar(n as f64),
                _ => Tensor::zeros([1], device),
            }),
        );
        let weight = self.tokens[0] as f64 * self.replicas as f64 / self.global[0];
        let mut objective = if weight == 1.0 {
            loss
        } else {
            loss.mul_scalar(weight)
        };
        for (j, l) in mtp_losses.into_iter().enumerate().take(self.depths) {
            if self.global[j + 1] > 0.0 {
                let w = self.tokens[j + 1] as f64 * self.replicas as f64 / self.global[j + 1];
                objective = objective + l.mul_scalar(w * self.mtp_scale / self.depths as f64);
            }
        }
        if self.loss_scale != 1.0 {
            objective = objective.mul_scalar(self.loss_scale);
        }
        (objective, Tensor::cat(row, 0))
    }
}

/// Σ over MoE layers of each layer's `kind` loss without its coefficient (detached), `None`
/// when no layer has it.
fn aux_sum(losses: &[Vec<RouterLoss>], kind: RouterLossKind) -> Option<Tensor<1>> {
    losses
        .iter()
        .filter_map(|layer| layer.iter().find(|l| l.kind == kind && l.coeff != 0.0))
        .map(|l| l.loss.clone().detach().div_scalar(l.coeff))
        .reduce(|a, b| a + b)
}

/// `values` summed over `comm` (one f32 all-reduce; integer counts stay exact).
fn sum_over(comm: &Comm, values: &[f64], device: &Device) -> Result<Vec<f64>, ModelError> {
    if comm.size() == 1 {
        return Ok(values.to_vec());
    }
    let data: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    let t = Tensor::<1>::from_data(burn::tensor::TensorData::new(data, [values.len()]), device);
    let summed = comm.all_reduce(t, ReduceOp::Sum).map_err(err)?;
    Ok(read_f32(summed)?.into_iter().map(f64::from).collect())
}

fn read_f32(t: Tensor<1>) -> Result<Vec<f32>, ModelError> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| ModelError::input("loss", format!("unreadable values: {e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_and_padded_batches_carry_their_layout() {
        let docs = vec![vec![5, 6, 7], vec![8, 9]];
        let b = TrainBatch::packed(&docs, 2, 4, 0).unwrap();
        let layout = b.layout().unwrap();
        assert_eq!(layout.cu_seqlens().unwrap(), &[vec![0, 3, 4], vec![0, 1]]);
        assert_eq!(layout.position_ids(), vec![0, 1, 2, 0, 0, 0, 0, 0]);
        let p = TrainBatch::padded(&docs, 4, 0, PaddingSide::Left).unwrap();
        assert_eq!(p.input_ids, vec![0, 5, 6, 7, 0, 0, 8, 9]);
        assert_eq!(p.labels, vec![-100, -100, 6, 7, -100, -100, -100, 9]);
        assert_eq!(p.target_tokens(), 3);
        let r = TrainBatch::padded(&docs, 4, 0, PaddingSide::Right).unwrap();
        assert_eq!(r.labels, vec![5, 6, 7, -100, 8, 9, -100, -100]);
        let e = TrainBatch::causal(vec![1; 8], 2)
            .unwrap()
            .with_cu_seqlens(vec![vec![0, 5], vec![0]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`cu_seqlens` of row 0 ends at 5"), "{e}");
        assert!(TrainBatch::padded(&[vec![]], 4, 0, PaddingSide::Right).is_err());
    }

    #[test]
    fn packing_masks_document_starts_and_padding() {
        let docs = vec![vec![5, 6, 7], vec![8, 9]];
        let b = TrainBatch::packed(&docs, 2, 4, 0).unwrap();
        assert_eq!(b.input_ids, vec![5, 6, 7, 8, 9, 0, 0, 0]);
        assert_eq!(b.labels, vec![-100, 6, 7, -100, 9, -100, -100, -100]);
        // Shifted targets: row 0 -> [6, 7, -100], row 1 -> [-100, -100, -100].
        assert_eq!(b.target_tokens(), 2);
        assert!(TrainBatch::new(vec![1, 2, 3], vec![1, 2, 3], 2).is_err());
    }
}
