//! The training step under pipeline parallelism: this rank's model chunks driven by the
//! pipeline executor ([`run_pipeline`]) over a 1F1B or interleaved schedule of the step's
//! micro-batches, with the same objective, weighting and accumulation as the step on one
//! rank (the losses on the last virtual stage, each router's losses attached where it runs,
//! the expert-bias counts of every stage's routers, the embedding copy's gradient summed
//! over Megatron's embedding group).

use burn::optim::GradientsParams;
use burn::tensor::{Device, Gradients, Tensor};
use moe_backend::comm::{Comm, ReduceOp};
use moe_backend::optim::MainGradAccumulator;
use moe_backend::parallel::pipeline::{PipelineChannels, PipelineStage, StageOutput, run_pipeline};
use moe_backend::parallel::schedule::PipelineSchedule;
use moe_backend::router::{RouterLoss, RouterLossKind};

use super::{MicroWeights, TrainBatch, add_loads, aux_sum};
use crate::ModelError;
use crate::distributed::sharded::ChunkForward;
use crate::distributed::{CausalLmShard, PipelinePlace, TrainForward, err};

/// What a pipelined step accumulated on this rank.
pub(super) struct PipelineOutcome {
    /// Parameter gradients summed over the micro-batches.
    pub grads: GradientsParams,
    /// Logged sums of this rank's stage: token-summed cross-entropy (last stage), the sum
    /// over its MoE layers and micro-batches of each layer's loss without its coefficient,
    /// then each MTP depth's token-summed loss (last stage).
    pub logged: Vec<f64>,
    /// Number of MoE layers whose losses `logged[1]` sums (per micro-batch).
    pub moe_layers: usize,
    /// Per router of this rank (as `routers_mut`): the step's expert-bias counts.
    pub loads: Vec<Option<Vec<f64>>>,
}

/// The step's fixed inputs.
pub(super) struct StepInputs<'a> {
    pub micro: &'a [TrainBatch],
    /// Per micro-batch: target tokens of the main loss, then of each MTP depth.
    pub counts: &'a [Vec<usize>],
    /// Target tokens of the global batch per loss.
    pub global: &'a [f64],
    /// Data-parallel replicas.
    pub replicas: usize,
    /// MTP depths trained (0: none).
    pub depths: usize,
    pub mtp_scale: f64,
    pub aux_kind: RouterLossKind,
    pub device: &'a Device,
    /// The dtype gradients are accumulated in (`None`: as the backward pass gives them).
    pub main_grad_dtype: Option<burn::tensor::DType>,
    /// The loss scale (FP16; 1 otherwise): the objective and the routers' attached losses are
    /// back-propagated times it.
    pub loss_scale: f64,
}

/// This rank's chunks as the executor drives them.
struct TrainStage<'a, S: CausalLmShard> {
    shard: &'a S,
    place: &'a PipelinePlace,
    inputs: &'a StepInputs<'a>,
    /// First MoE layer (this rank's numbering) of each chunk.
    moe_offsets: Vec<usize>,
    tp: usize,
    accumulator: MainGradAccumulator<S::Model>,
    /// Device-side logged sums (see [`PipelineOutcome::logged`]).
    logged: Option<Tensor<1>>,
    /// Per chunk: the step's expert-bias counts of its routers.
    loads: Vec<Vec<Option<Vec<f64>>>>,
    /// Router-loss entries seen over every forward (MoE layers × micro-batches).
    layer_losses: usize,
}

impl<S: CausalLmShard> TrainStage<'_, S> {
    /// Σ over one chunk's MoE layers of each layer's configured loss without its
    /// coefficient, `[1]` (detached), counting the layers for the step's mean.
    fn chunk_aux(&mut self, losses: &[Vec<RouterLoss>]) -> Tensor<1> {
        self.layer_losses += losses.len();
        aux_sum(losses, self.inputs.aux_kind)
            .unwrap_or_else(|| Tensor::zeros([1], self.inputs.device))
    }

    /// Adds one forward's logged row to the step's sums.
    fn log(&mut self, row: Tensor<1>) {
        self.logged = Some(match self.logged.take() {
            Some(sum) => sum + row,
            None => row,
        });
    }
}

impl<S: CausalLmShard> PipelineStage<2> for TrainStage<'_, S> {
    type Error = ModelError;

    fn activation_shape(&self, microbatch: usize) -> [usize; 2] {
        let batch = &self.inputs.micro[microbatch];
        let positions = self.shard.sequence_positions(batch.seq_len()).len();
        [batch.batch * positions / self.tp, self.place.model.hidden]
    }

    /// The parameters' dtype (BF16 activations under BF16 mixed precision).
    fn activation_dtype(&self) -> burn::tensor::DType {
        moe_backend::optim::trainable_dtype(self.shard.model()).unwrap_or(burn::tensor::DType::F32)
    }

    fn device(&self) -> Device {
        self.inputs.device.clone()
    }

    fn forward(
        &mut self,
        chunk: usize,
        microbatch: usize,
        input: Option<Tensor<2>>,
    ) -> Result<StageOutput<2>, ModelError> {
        let parts = self.place.chunks.get(chunk).ok_or_else(|| {
            ModelError::layout("pipeline_layout", format!("no local chunk {chunk}"))
        })?;
        let inputs = self.inputs;
        let out = self.shard.forward_train_chunk(
            parts,
            self.moe_offsets[chunk],
            &inputs.micro[microbatch],
            inputs.device,
            inputs.loss_scale / inputs.micro.len() as f64,
            inputs.depths > 0,
            input,
        )?;
        match out {
            ChunkForward::Activation {
                hidden,
                router_losses,
                expert_load,
            } => {
                add_loads(&mut self.loads[chunk], expert_load)?;
                // `[0, aux, 0…]`: the losses are the last stage's.
                let aux = self.chunk_aux(&router_losses);
                let zeros = |n| Tensor::zeros([n], inputs.device);
                self.log(Tensor::cat(vec![zeros(1), aux, zeros(inputs.depths)], 0));
                Ok(StageOutput::Activation(hidden))
            }
            ChunkForward::Loss(out) => {
                let TrainForward {
                    loss,
                    mtp_losses,
                    router_losses,
                    expert_load,
                } = out;
                add_loads(&mut self.loads[chunk], expert_load)?;
                let weights = MicroWeights {
                    tokens: &inputs.counts[microbatch],
                    global: inputs.global,
                    replicas: inputs.replicas,
                    depths: inputs.depths,
                    mtp_scale: inputs.mtp_scale,
                    loss_scale: inputs.loss_scale,
                };
                let aux = self.chunk_aux(&router_losses);
                let (objective, row) = weights.weigh(loss, mtp_losses, aux, inputs.device);
                self.log(row);
                Ok(StageOutput::Loss(objective))
            }
            ChunkForward::LogProbs { .. } => Err(ModelError::layout(
                "pp",
                "a training forward returned log-probs instead of its loss",
            )),
        }
    }

    fn backward_done(
        &mut self,
        _chunk: usize,
        _microbatch: usize,
        grads: Gradients,
    ) -> Result<(), ModelError> {
        let model = self.shard.model();
        let grads = GradientsParams::from_grads(grads, model);
        self.accumulator.accumulate(model, grads);
        for grads in moe_backend::recompute::take_param_grads() {
            self.accumulator.accumulate(model, grads);
        }
        Ok(())
    }
}

/// Runs this rank's part of the step's pipeline schedule (`vpp` chunks per rank) and returns
/// what it accumulated.
pub(super) fn run_step<S: CausalLmShard>(
    shard: &S,
    place: &PipelinePlace,
    channels: &PipelineChannels,
    tp: usize,
    inputs: &StepInputs<'_>,
) -> Result<PipelineOutcome, ModelError> {
    let (pp, vpp, m) = (place.split.pp(), place.split.vpp(), inputs.micro.len());
    let schedule = if vpp == 1 {
        PipelineSchedule::one_f_one_b(pp, m)
    } else {
        PipelineSchedule::interleaved(pp, vpp, m)
    }
    .map_err(err)?;
    let mut offset = 0;
    let moe_offsets = (place.chunks.iter())
        .map(|c| {
            let at = offset;
            offset += shard.moe_layers_in(c.layers.clone());
            at
        })
        .collect();
    let mut stage = TrainStage {
        shard,
        place,
        inputs,
        moe_offsets,
        tp,
        accumulator: MainGradAccumulator::new(inputs.main_grad_dtype),
        logged: None,
        loads: vec![Vec::new(); place.chunks.len()],
        layer_losses: 0,
    };
    run_pipeline(&schedule, place.rank, channels, &mut stage)?;
    let n = 2 + inputs.depths;
    let logged = match stage.logged {
        Some(t) => super::read_f32(t)?.into_iter().map(f64::from).collect(),
        None => vec![0.0; n],
    };
    let loads = stage.loads.into_iter().flatten().collect();
    Ok(PipelineOutcome {
        grads: stage.accumulator.grads(),
        logged,
        moe_layers: stage.layer_losses / m.max(1),
        loads,
    })
}

/// Sums the gradient of the embedding held on both the first and the last stage (a tied
/// output layer, the MTP modules) over Megatron's embedding group, so both copies take the
/// same step; a copy that got no gradient contributes zeros.
pub(super) fn reduce_embedding_grads<S: CausalLmShard>(
    shard: &S,
    place: &PipelinePlace,
    group: Option<&Comm>,
    grads: &mut GradientsParams,
    device: &Device,
) -> Result<(), ModelError> {
    // Only a model whose last stage keeps a copy has one to keep equal (the same answer on
    // every stage).
    if !(place.model.tied || place.model.mtp > 0) {
        return Ok(());
    }
    let Some(group) = group.filter(|g| g.size() > 1) else {
        return Ok(());
    };
    let weight = &shard
        .embedding()
        .ok_or_else(|| {
            ModelError::layout(
                "pp",
                "a stage of the embedding group does not hold the embedding",
            )
        })?
        .weight;
    let (id, shape) = (weight.id, weight.shape());
    let local: Tensor<2> = grads
        .remove::<2>(id)
        .unwrap_or_else(|| Tensor::zeros(shape, &device.clone().without_autodiff()));
    let summed = group.all_reduce(local, ReduceOp::Sum).map_err(err)?;
    grads.register(id, summed);
    Ok(())
}
