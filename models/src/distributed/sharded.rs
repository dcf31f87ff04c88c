//! What the [`Trainer`](crate::train::Trainer) needs from a model: how to cut it into one
//! rank's shard ([`ParallelCausalLm`], implemented by the full model type) and the training
//! forward of that shard ([`CausalLmShard`]).

use burn::tensor::{Device, Tensor};
use moe_backend::comm::GroupComms;
use moe_backend::fp8::Fp8Recipe;
use moe_backend::router::{AuxLossSpec, RouterLoss, TopKRouter};

use super::DispatcherKind;
use crate::ModelError;
use crate::batch::TrainBatch;
pub(crate) use crate::batch::scored_targets_at;
use crate::causal_lm::IGNORE_INDEX;
use crate::packing::SequenceLayout;
use crate::weights::WeightSource;

/// A causal LM the trainer can shard and train (Qwen3-MoE, DeepSeek-V3, dense Qwen3).
pub trait ParallelCausalLm: crate::param_plan::Planned {
    /// One rank's shard of this model.
    type Shard: CausalLmShard<Model = Self>;

    /// This rank's shard under the layout of `groups` with the `kind` dispatcher.
    fn shard(&self, groups: &GroupComms, kind: DispatcherKind) -> Result<Self::Shard, ModelError>;

    /// The model with its routed experts (and with `linears`, its dense linears) running in
    /// FP8 with `recipe`. Models without an FP8 path return an error naming the model.
    fn with_fp8(self, recipe: Fp8Recipe, linears: bool) -> Result<Self, ModelError>;
}

/// A [`ParallelCausalLm`] whose rank shard is built without the full model: read straight from
/// a [`WeightSource`] (only this rank's boxes), or as a zero skeleton at local shapes that a
/// restore fills.
pub trait LoadShard: ParallelCausalLm {
    /// The model's configuration.
    type Config;

    /// This rank's shard under the layout of `groups` with the `kind` dispatcher, reading only
    /// this rank's box of every tensor of `source` onto `device`.
    fn load_shard(
        config: &Self::Config,
        source: &dyn WeightSource,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self::Shard, ModelError>;

    /// This rank's shard at local shapes filled with zeros (nothing is read).
    fn shard_skeleton(
        config: &Self::Config,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self::Shard, ModelError>;
}

/// One rank's shard of a [`ParallelCausalLm`].
pub trait CausalLmShard: Clone + std::fmt::Debug {
    /// The model type (shards are modules of the same type, with smaller tensors).
    type Model: ParallelCausalLm<Shard = Self>;

    /// This rank's parameters (hand them to the optimizer).
    fn model(&self) -> &Self::Model;

    /// Mutable parameters (the optimizer's step replaces them).
    fn model_mut(&mut self) -> &mut Self::Model;

    /// Sizes of this rank's `tp_cp` and `tp_dp_cp` groups (the routers' count groups).
    fn loss_groups(&self) -> (usize, usize);

    /// Configures every router for training: the load-balancing losses and the z-loss, with
    /// counts summed over this rank's `tp_cp` / `tp_dp_cp` (so the losses and their gradients
    /// do not depend on how a replica's tokens are split over its ranks).
    fn set_router_losses(
        &mut self,
        aux_losses: Vec<AuxLossSpec>,
        z_loss_coeff: Option<f64>,
    ) -> Result<(), ModelError> {
        let (tp_cp, tp_dp_cp) = self.loss_groups();
        for router in self.routers_mut() {
            router
                .set_losses(aux_losses.clone(), z_loss_coeff, tp_cp, tp_dp_cp)
                .map_err(ModelError::from)?;
        }
        Ok(())
    }

    /// The training forward of one micro-batch of this replica (identical on its TP ranks):
    /// the causal-LM loss, with `mtp` the multi-token-prediction losses of models that have
    /// MTP modules, router losses attached with the upstream gradient `aux_grad_scale`, and
    /// the routers' expert-bias counts. A batch with a
    /// [`SequenceLayout`] is packed or padded: attention stays
    /// within each document and skips padding, RoPE positions restart at every document, no
    /// target crosses a document boundary or is padding, and the routers leave padded rows out
    /// of their losses and counts.
    fn forward_train_batch(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        mtp: bool,
    ) -> Result<TrainForward, ModelError>;

    /// [`forward_train_batch`](Self::forward_train_batch) of a plain (unpacked, unpadded)
    /// batch `input_ids`, `labels [batch, S]`.
    fn forward_train(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        device: &Device,
        aux_grad_scale: f64,
        mtp: bool,
    ) -> Result<TrainForward, ModelError> {
        let batch = TrainBatch::new(input_ids.to_vec(), labels.to_vec(), batch)?;
        self.forward_train_batch(&batch, device, aux_grad_scale, mtp)
    }

    /// The training forward of this pipeline rank's chunk `chunk` on one micro-batch
    /// (`input`: the previous virtual stage's activation, `None` on the first); the chunk's
    /// routers report from this rank's MoE layer `moe_offset` on. Under `pp = 1` the only
    /// chunk is the whole model. The default runs
    /// [`forward_train_batch`](Self::forward_train_batch) for the whole model and refuses
    /// a part of it (a model without pipeline support).
    #[allow(clippy::too_many_arguments)]
    fn forward_train_chunk(
        &self,
        chunk: &super::ChunkParts,
        moe_offset: usize,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        mtp: bool,
        input: Option<Tensor<2>>,
    ) -> Result<ChunkForward, ModelError> {
        let whole = chunk.embedding && chunk.loss && moe_offset == 0 && input.is_none();
        if !whole {
            return Err(ModelError::unsupported(
                "pp",
                "this model does not run as pipeline chunks (implement `forward_train_chunk`)",
            ));
        }
        (self.forward_train_batch(batch, device, aux_grad_scale, mtp)).map(ChunkForward::Loss)
    }

    /// The log-prob forward of this pipeline rank's chunk `chunk` on one micro-batch: as
    /// [`forward_train_chunk`](Self::forward_train_chunk), but the last virtual stage returns
    /// [`ChunkForward::LogProbs`], the per-token next-token log-probs and entropies of the
    /// micro-batch's labels (vocab-parallel, gathered over context parallelism; MTP modules
    /// do not run). The default refuses (a model without a log-prob head).
    #[allow(clippy::too_many_arguments)]
    fn forward_logprobs_chunk(
        &self,
        chunk: &super::ChunkParts,
        moe_offset: usize,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        input: Option<Tensor<2>>,
    ) -> Result<ChunkForward, ModelError> {
        let _ = (chunk, moe_offset, batch, device, aux_grad_scale, input);
        Err(ModelError::unsupported(
            "logprobs",
            "this model has no log-prob forward (implement `forward_logprobs_chunk`)",
        ))
    }

    /// Decoder layers this rank holds (all of them when `pp = 1`; the default: none).
    fn local_layers(&self) -> usize {
        0
    }

    /// This rank's place in its pipeline (`None` when `pp = 1`, the default).
    fn pipeline(&self) -> Option<&super::PipelinePlace> {
        None
    }

    /// The token embedding (this rank's vocabulary rows), when this rank holds it (used to keep
    /// a pipeline's embedding copies equal; the default: none).
    fn embedding(&self) -> Option<&burn::nn::Embedding> {
        None
    }

    /// Number of MoE layers (routers) among this rank's local decoder layers `layers` (the
    /// default: none).
    fn moe_layers_in(&self, layers: std::ops::Range<usize>) -> usize {
        let _ = layers;
        0
    }

    /// Starts a new global batch for the routers' state that spans micro-batches (the
    /// `global_aux_loss` running counts); the trainer calls it at the start of every step.
    fn begin_global_batch(&self) {}

    /// Number of multi-token-prediction depths (MTP modules) the shard trains.
    fn mtp_depths(&self) -> usize {
        0
    }

    /// The positions of a row of `s` tokens whose targets this rank's losses score: all of
    /// them, or this rank's two chunks under context parallelism. The trainer normalises the
    /// loss by the targets counted there.
    fn sequence_positions(&self, s: usize) -> Vec<usize> {
        (0..s).collect()
    }

    /// What a routing replayed in this shard's training forwards
    /// ([`TrainBatch::with_routed_experts`]) must match: the model's MoE (and MTP) layers, `k`,
    /// `E`. `None` (the default) for a model without routers, whose forwards refuse a routed
    /// batch.
    fn routing_spec(&self) -> Option<crate::routing::ReplaySpec> {
        None
    }

    /// Every router of the shard, in the order [`TrainForward::expert_load`] lists them.
    fn routers_mut(&mut self) -> Vec<&mut TopKRouter>;

    /// The shard's parallel context (its groups, dispatcher and training options).
    fn context_mut(&mut self) -> &mut super::ParallelContext;

    /// Recompute `recompute` in the backward pass instead of keeping those activations
    /// ([`ParallelContext::set_recompute`](super::ParallelContext::set_recompute)).
    fn set_recompute(&mut self, recompute: crate::recompute::Recompute) -> Result<(), ModelError> {
        self.context_mut().set_recompute(recompute)
    }
}

/// What one training forward of a shard returns.
#[derive(Debug, Clone)]
pub struct TrainForward {
    /// Mean cross-entropy of the micro-batch's target tokens, `[1]` (identical on the TP ranks
    /// of the replica).
    pub loss: Tensor<1>,
    /// Per MTP depth `j`: the mean cross-entropy of predicting token `i + j + 2`, `[1]`.
    pub mtp_losses: Vec<Tensor<1>>,
    /// The router losses of every MoE layer (forward order), this rank's part.
    pub router_losses: Vec<Vec<RouterLoss>>,
    /// Per router (forward order, as [`CausalLmShard::routers_mut`]): this rank's expert-bias
    /// token counts; `None` for routers without an expert bias.
    pub expert_load: Vec<Option<Vec<f64>>>,
}

/// What the training forward of one pipeline chunk returns.
#[derive(Debug, Clone)]
pub enum ChunkForward {
    /// A chunk before the last virtual stage: the activation it passes on.
    Activation {
        /// This rank's sequence-parallel block `[B·S/tp, H]` after the chunk's layers.
        hidden: Tensor<2>,
        /// The router losses of the chunk's MoE layers (forward order), this rank's part.
        router_losses: Vec<Vec<RouterLoss>>,
        /// The chunk's routers' expert-bias counts (forward order).
        expert_load: Vec<Option<Vec<f64>>>,
    },
    /// The last virtual stage: the losses (its own router losses and counts inside).
    Loss(TrainForward),
    /// The last virtual stage of a log-prob forward
    /// ([`CausalLmShard::forward_logprobs_chunk`]): the replica's per-token log-probs.
    LogProbs {
        /// Next-token log-probs and entropies `[B, S − 1]` of the micro-batch's whole rows
        /// (gathered over the context-parallel group), identical on the replica's TP and CP
        /// ranks.
        logprobs: crate::logprob::TokenLogProbs,
        /// The router losses of the chunk's MoE layers (forward order), this rank's part.
        router_losses: Vec<Vec<RouterLoss>>,
        /// The chunk's routers' expert-bias counts (forward order).
        expert_load: Vec<Option<Vec<f64>>>,
    },
}

/// Row-major `values [B, S]` with every row shifted left by `by` and `fill` in the `by` freed
/// tail positions: the inputs / labels of MTP depth `by − 1` on the full sequence length
/// (Megatron rolls them the same way; the tail positions are masked out of the loss and,
/// attention being causal, never reach the real positions).
pub(crate) fn roll_rows(values: &[i64], s: usize, by: usize, fill: i64) -> Vec<i64> {
    values
        .chunks(s)
        .flat_map(|row| (0..s).map(move |i| row.get(i + by).copied().unwrap_or(fill)))
        .collect()
}

/// The labels of multi-token-prediction depth `j` of `labels [B, S]` on the full row length
/// (Megatron's rolled sequence): every row shifted left by `j + 1`, the freed tail −100, and
/// with a `layout` every target whose predicting position lies in another document (or is
/// padding) −100 as well ([`SequenceLayout::mask_labels_at_distance`] at distance `j + 2`).
pub(crate) fn mtp_labels(
    labels: &[i64],
    s: usize,
    j: usize,
    layout: Option<&SequenceLayout>,
) -> Vec<i64> {
    match layout {
        None => roll_rows(labels, s, j + 1, IGNORE_INDEX),
        Some(l) => roll_rows(
            &l.mask_labels_at_distance(labels, j + 2),
            s,
            j + 1,
            IGNORE_INDEX,
        ),
    }
}

/// Adds one forward's per-router counts into the step's running sums.
pub(crate) fn add_loads(
    sums: &mut Vec<Option<Vec<f64>>>,
    loads: Vec<Option<Vec<f64>>>,
) -> Result<(), ModelError> {
    if sums.is_empty() {
        *sums = loads;
        return Ok(());
    }
    if sums.len() != loads.len() {
        return Err(ModelError::input(
            "expert_load",
            "micro-batches report counts of different routers",
        ));
    }
    for (sum, load) in sums.iter_mut().zip(loads) {
        match (sum, load) {
            (Some(sum), Some(load)) if sum.len() == load.len() => {
                sum.iter_mut().zip(load).for_each(|(a, b)| *a += b);
            }
            (None, None) => {}
            _ => {
                return Err(ModelError::input(
                    "expert_load",
                    "micro-batches report counts of different routers",
                ));
            }
        }
    }
    Ok(())
}

pub(crate) fn scalar(t: &burn::tensor::Tensor<1>) -> Result<f32, ModelError> {
    t.to_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .ok()
        .and_then(|v| v.first().copied())
        .ok_or_else(|| ModelError::input("loss", "the loss tensor is empty"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::scored_targets;

    #[test]
    fn rolled_rows_shift_each_row_and_fill_the_tail() {
        let v = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(
            roll_rows(&v, 4, 1, -100),
            vec![2, 3, 4, -100, 6, 7, 8, -100]
        );
        assert_eq!(roll_rows(&v, 4, 2, 0), vec![3, 4, 0, 0, 7, 8, 0, 0]);
        assert_eq!(scored_targets(&roll_rows(&v, 4, 1, -100), 4), 4);
    }
}
