//! Per-token log-probs under every layout, pipeline parallelism included (docs/training-and-rl.md
//! §Log-probs under every layout): the RL forward as a [`PipelineStage`].
//!
//! A rank's model chunks run [`CausalLmShard::forward_logprobs_chunk`] for each micro-batch: the
//! chunks before the last virtual stage pass their activation on, the last computes the
//! replica's per-token log-probs and entropies (vocab-parallel, whole rows gathered over
//! context parallelism). What happens to them there is the mode's:
//!
//! - **scoring** ([`shard_logprobs`]; old / reference policies, `moe logprobs`): the forwards of
//!   the schedule only (Megatron's `forward_only`), the results broadcast from the last
//!   pipeline stage to every stage, so every rank of a replica returns them;
//! - **training** ([`crate::train::Trainer::step_with_logprobs`]): the caller's loss hook turns
//!   each micro-batch's log-probs into its objective on the last stage (Megatron's
//!   `loss_func` of the `forward_step`), which the executor back-propagates through the
//!   stages on the 1F1B or interleaved schedule.
//!
//! Without pipeline parallelism the same stage runs the whole model as one chunk on a
//! one-rank "pipeline", so one code path serves every layout and `world = 1`.

use burn::optim::GradientsParams;
use burn::tensor::DType;
use burn::tensor::{Device, Gradients, Tensor};
use moe_backend::comm::GroupComms;
use moe_backend::optim::MainGradAccumulator;
use moe_backend::parallel::GroupFamily;
use moe_backend::parallel::pipeline::{
    PipelineChannels, PipelineStage, StageOutput, run_pipeline, run_pipeline_forward,
};
use moe_backend::parallel::schedule::PipelineSchedule;

use super::sharded::{CausalLmShard, ChunkForward};
use super::{ChunkParts, PipelinePlace, err};
use crate::ModelError;
use crate::batch::TrainBatch;
use crate::logprob::TokenLogProbs;

/// The loss hook of a log-prob training step: `(micro-batch index, micro-batch, its log-probs)
/// → (objective, tokens)`, run on the last pipeline stage.
pub(crate) type LogProbHook<'h> =
    dyn FnMut(usize, &TrainBatch, TokenLogProbs) -> Result<(Tensor<1>, usize), ModelError> + 'h;

/// What a log-prob training run accumulated on this rank.
pub(crate) struct LogProbOutcome {
    /// Parameter gradients summed over the micro-batches.
    pub grads: GradientsParams,
    /// Σ over micro-batches of the objectives' values, read back once per run (0 off the
    /// last stage).
    pub value_sum: f64,
    /// Σ of the tokens the hook reported (0 off the last stage).
    pub tokens: usize,
    /// Per router of this rank (as `routers_mut`): the run's expert-bias counts.
    pub loads: Vec<Option<Vec<f64>>>,
}

enum Mode<'h, M> {
    /// Keep each micro-batch's log-probs.
    Score(Vec<Option<TokenLogProbs>>),
    /// Back-propagate the hook's objective times `scale`.
    Train {
        hook: &'h mut LogProbHook<'h>,
        scale: f64,
        accumulator: MainGradAccumulator<M>,
        tokens: usize,
    },
}

/// This rank's chunks running the log-prob forward.
struct LogProbStage<'a, 'h, S: CausalLmShard> {
    shard: &'a S,
    chunks: Vec<ChunkParts>,
    /// First MoE layer (this rank's numbering) of each chunk.
    moe_offsets: Vec<usize>,
    micro: &'a [TrainBatch],
    device: Device,
    tp: usize,
    hidden: usize,
    aux_grad_scale: f64,
    mode: Mode<'h, S::Model>,
    /// Per chunk: its routers' expert-bias counts over the run.
    loads: Vec<Vec<Option<Vec<f64>>>>,
    /// Training: the objectives' values summed on the device (read once after the run).
    value_sum: Option<Tensor<1>>,
}

impl<'a, 'h, S: CausalLmShard> LogProbStage<'a, 'h, S> {
    fn new(
        shard: &'a S,
        micro: &'a [TrainBatch],
        device: &Device,
        tp: usize,
        mode: Mode<'h, S::Model>,
    ) -> Self {
        let (chunks, hidden) = match shard.pipeline() {
            Some(place) => (place.chunks.clone(), place.model.hidden),
            // One rank: no activation is ever received, so the width is never asked for.
            None => (
                vec![ChunkParts {
                    virtual_stage: 0,
                    embedding: true,
                    layers: 0..shard.local_layers(),
                    loss: true,
                }],
                0,
            ),
        };
        let mut offset = 0;
        let moe_offsets = (chunks.iter())
            .map(|c| {
                let at = offset;
                offset += shard.moe_layers_in(c.layers.clone());
                at
            })
            .collect();
        let loads = vec![Vec::new(); chunks.len()];
        Self {
            shard,
            chunks,
            moe_offsets,
            micro,
            device: device.clone(),
            tp,
            hidden,
            aux_grad_scale: 1.0 / micro.len().max(1) as f64,
            mode,
            loads,
            value_sum: None,
        }
    }
}

impl<S: CausalLmShard> PipelineStage<2> for LogProbStage<'_, '_, S> {
    type Error = ModelError;

    fn activation_shape(&self, microbatch: usize) -> [usize; 2] {
        let batch = &self.micro[microbatch];
        let positions = self.shard.sequence_positions(batch.seq_len()).len();
        [batch.batch * positions / self.tp, self.hidden]
    }

    fn activation_dtype(&self) -> DType {
        // Activations travel in the weights' dtype (BF16 under mixed precision), also on a
        // forward-only copy whose parameters need no gradient.
        weight_dtype(self.shard.model())
    }

    fn device(&self) -> Device {
        self.device.clone()
    }

    fn forward(
        &mut self,
        chunk: usize,
        microbatch: usize,
        input: Option<Tensor<2>>,
    ) -> Result<StageOutput<2>, ModelError> {
        let parts = self.chunks.get(chunk).ok_or_else(|| {
            ModelError::layout("pipeline_layout", format!("no local chunk {chunk}"))
        })?;
        let batch = self.micro.get(microbatch).ok_or_else(|| {
            ModelError::input("micro_batches", format!("no micro-batch {microbatch}"))
        })?;
        let out = self.shard.forward_logprobs_chunk(
            parts,
            self.moe_offsets[chunk],
            batch,
            &self.device,
            self.aux_grad_scale,
            input,
        )?;
        let (output, load) = match out {
            ChunkForward::Activation {
                hidden,
                expert_load,
                ..
            } => (StageOutput::Activation(hidden), expert_load),
            ChunkForward::LogProbs {
                logprobs,
                expert_load,
                ..
            } => {
                let objective = match &mut self.mode {
                    Mode::Score(out) => {
                        if let Some(slot) = out.get_mut(microbatch) {
                            *slot = Some(logprobs);
                        }
                        // Nothing to back-propagate in a forward-only run.
                        Tensor::zeros([1], &self.device)
                    }
                    Mode::Train {
                        hook,
                        scale,
                        tokens,
                        ..
                    } => {
                        let (objective, n) = hook(microbatch, batch, logprobs)?;
                        let value = objective.clone().detach();
                        self.value_sum = Some(match self.value_sum.take() {
                            Some(sum) => sum + value,
                            None => value,
                        });
                        *tokens += n;
                        if *scale == 1.0 {
                            objective
                        } else {
                            objective.mul_scalar(*scale)
                        }
                    }
                };
                (StageOutput::Loss(objective), expert_load)
            }
            ChunkForward::Loss(_) => {
                return Err(ModelError::layout(
                    "pp",
                    "a log-prob forward returned a training loss",
                ));
            }
        };
        super::sharded::add_loads(&mut self.loads[chunk], load)?;
        Ok(output)
    }

    fn backward_done(
        &mut self,
        _chunk: usize,
        _microbatch: usize,
        grads: Gradients,
    ) -> Result<(), ModelError> {
        let model = self.shard.model();
        if let Mode::Train { accumulator, .. } = &mut self.mode {
            accumulator.accumulate(model, GradientsParams::from_grads(grads, model));
            for grads in moe_backend::recompute::take_param_grads() {
                accumulator.accumulate(model, grads);
            }
        }
        Ok(())
    }
}

/// The dtype of `module`'s first weight matrix (a float parameter of rank ≥ 2; f32 without
/// one): what its layers compute and pass between pipeline stages in.
fn weight_dtype<M: burn::module::Module>(module: &M) -> DType {
    struct Probe(Option<DType>);
    impl burn::module::ModuleVisitor for Probe {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            if self.0.is_none() && D >= 2 {
                self.0 = Some(param.val().dtype());
            }
        }
    }
    let mut probe = Probe(None);
    module.visit(&mut probe);
    probe.0.unwrap_or(DType::F32)
}

/// The schedule of `m` micro-batches on `place` (1F1B, interleaved with virtual stages), or
/// the one-rank schedule without pipeline parallelism.
fn schedule(place: Option<&PipelinePlace>, m: usize) -> Result<PipelineSchedule, ModelError> {
    match place {
        Some(p) if p.split.vpp() > 1 => {
            PipelineSchedule::interleaved(p.split.pp(), p.split.vpp(), m)
        }
        Some(p) => PipelineSchedule::one_f_one_b(p.split.pp(), m),
        None => PipelineSchedule::one_f_one_b(1, m),
    }
    .map_err(err)
}

/// Per-token next-token log-probs and entropies `[batch, S − 1]` of this replica's
/// micro-batches (each scoring its labels; packed or padded with a layout) under the layout of
/// `groups`, pipeline parallelism included: the micro-batches run forward through the stages
/// (Megatron's `forward_only` schedule) and the last stage's results are broadcast over the
/// pipeline group, so **every** rank of the replica returns every micro-batch's log-probs.
/// Identical on the replica's TP and CP ranks. A collective of the world (every rank calls it
/// with its replica's micro-batches, the same number everywhere).
///
/// On a device without autodiff (e.g. a [`valid`](burn::module::Module::valid) copy
/// of the shard) nothing is recorded: what old and reference policies use.
pub fn shard_logprobs<S: CausalLmShard>(
    shard: &S,
    micro: &[TrainBatch],
    groups: &GroupComms,
    device: &Device,
) -> Result<Vec<TokenLogProbs>, ModelError> {
    if micro.is_empty() {
        return Ok(Vec::new());
    }
    let place = shard.pipeline();
    let schedule = schedule(place, micro.len())?;
    let tp = groups.comm(GroupFamily::Tp).size();
    let pp = groups.comm(GroupFamily::Pp);
    let channels: PipelineChannels = groups.pipeline_channels();
    let mut stage = LogProbStage::new(
        shard,
        micro,
        device,
        tp,
        Mode::Score(vec![None; micro.len()]),
    );
    let rank = place.map_or(0, |p| p.rank);
    run_pipeline_forward(&schedule, rank, &channels, &mut stage)?;
    let Mode::Score(out) = stage.mode else {
        return Err(ModelError::layout("pp", "a scoring run changed mode"));
    };
    if pp.size() == 1 {
        return out
            .into_iter()
            .enumerate()
            .map(|(i, lp)| lp.ok_or_else(|| missing(i)))
            .collect();
    }
    let last = pp.size() - 1;
    micro
        .iter()
        .zip(out)
        .enumerate()
        .map(|(i, (batch, lp))| {
            let shape = [batch.batch, batch.seq_len().saturating_sub(1)];
            let (logprobs, entropy) = match lp {
                Some(lp) => (lp.logprobs, lp.entropy),
                None if pp.rank() != last => {
                    (Tensor::zeros(shape, device), Tensor::zeros(shape, device))
                }
                None => return Err(missing(i)),
            };
            Ok(TokenLogProbs {
                logprobs: pp.broadcast(logprobs.detach(), last).map_err(err)?,
                entropy: pp.broadcast(entropy.detach(), last).map_err(err)?,
            })
        })
        .collect()
}

fn missing(microbatch: usize) -> ModelError {
    ModelError::layout(
        "pp",
        format!("the last pipeline stage produced no log-probs for micro-batch {microbatch}"),
    )
}

/// The training part of a log-prob step: the micro-batches forward and backward through this
/// rank's chunks on the pipeline schedule (one chunk and a one-rank schedule without pipeline
/// parallelism), `hook`'s objective of each micro-batch's log-probs back-propagated times
/// `scale` on the last stage, the parameter gradients accumulated in `main_grad_dtype` (the
/// parameters' own dtype when `None`). `loss_scale` (FP16; 1 otherwise) multiplies what is
/// back-propagated, the objective and the routers' attached losses alike (the logged values
/// stay unscaled).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_logprob_step<S: CausalLmShard>(
    shard: &S,
    micro: &[TrainBatch],
    channels: &PipelineChannels,
    tp: usize,
    device: &Device,
    scale: f64,
    loss_scale: f64,
    main_grad_dtype: Option<DType>,
    hook: &mut LogProbHook<'_>,
) -> Result<LogProbOutcome, ModelError> {
    let place = shard.pipeline();
    let schedule = schedule(place, micro.len())?;
    let rank = place.map_or(0, |p| p.rank);
    let mode = Mode::Train {
        hook,
        scale: scale * loss_scale,
        accumulator: MainGradAccumulator::new(main_grad_dtype),
        tokens: 0,
    };
    let mut stage = LogProbStage::new(shard, micro, device, tp, mode);
    stage.aux_grad_scale *= loss_scale;
    run_pipeline(&schedule, rank, channels, &mut stage)?;
    let loads = stage.loads.into_iter().flatten().collect();
    match stage.mode {
        Mode::Train {
            mut accumulator,
            tokens,
            ..
        } => Ok(LogProbOutcome {
            grads: accumulator.grads(),
            value_sum: match stage.value_sum {
                Some(sum) => f64::from(super::sharded::scalar(&sum)?),
                None => 0.0,
            },
            tokens,
            loads,
        }),
        Mode::Score(_) => Err(ModelError::layout("pp", "a training run changed mode")),
    }
}
