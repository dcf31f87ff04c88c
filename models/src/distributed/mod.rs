//! Any model under any [`ParallelLayout`] on the ranks of a moe-backend world: attention and
//! dense MLPs tensor-parallel with sequence parallelism, vocab-parallel embedding, LM head and
//! cross-entropy, routed experts expert-parallel (EP × ETP) behind a token dispatcher, data
//! parallelism over the remaining ranks (docs/parallelism.md §Tensor and sequence parallelism,
//! docs/routing-and-dispatch.md §Token dispatchers).
//!
//! Activations between blocks are sequence-parallel: the `B·S` tokens of a replica's batch
//! (rows `b·S + s`) are split into `tp` equal blocks. Attention and dense MLPs all-gather them,
//! compute their head/column shard and reduce-scatter back; the MoE block routes this rank's
//! tokens directly. Under context parallelism every sequence is cut into `2·cp` chunks
//! ([`CpExchange`]); under pipeline parallelism a rank holds its stage's layers
//! ([`PipelinePlace`]) and the [`crate::train::Trainer`] runs the pipeline schedule.
//!
//! A model written against the [`ParallelContext`] as a [`DecoderStack`] with a parallel plan
//! is a [`ShardModel`]; build one [`Sharded`] per rank straight from the weights with
//! [`Sharded::load`] (only the rank's boxes are read), as a zero skeleton for a restore with
//! [`Sharded::skeleton`], or from a full model with [`Sharded::shard`] (the same loading code
//! reading the live model); train it with [`crate::train::Trainer`].

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::Tensor;
use moe_backend::comm::GroupComms;
use moe_backend::dispatch::{
    AllGatherDispatcher, AllToAllDispatcher, FlexDispatcher, LocalDispatcher, TokenDispatcher,
};
use moe_backend::parallel::{GroupFamily, ParallelLayout};

use crate::ModelError;
use crate::causal_lm::IGNORE_INDEX;

mod context_parallel;
mod gather;
mod layer_parts;
pub mod logprob_pipeline;
pub mod logprobs;
mod pipeline;
pub mod replay;
mod runtime;
mod shard_model;
pub mod sharded;
mod stack;

pub use context_parallel::{CpCommType, CpExchange, ring_gather_sequence};
pub(crate) use pipeline::stage_model;
pub use pipeline::{ChunkParts, PipelineModel, PipelinePlace};
/// One rank's parallel context: what a model's forward is written against (see
/// [`ParallelContext`]'s methods; every family uses it).
pub use runtime::SpRuntime as ParallelContext;
pub use runtime::{Prepared, RouterTrace};
pub use sharded::{CausalLmShard, LoadShard, ParallelCausalLm, TrainForward};
pub(crate) use stack::decoder_stack;
pub use stack::held;
pub use stack::{AttentionInputs, DecoderStack, SelfAttention, StackLogits};

pub use gather::{gather_full, gather_planned};
pub use layer_parts::{LayerParts, ShardAttention};
/// The MoE block [`LayerParts::moe`] returns (moe-backend's, re-exported for
/// [`layer_parts!`](crate::layer_parts)).
pub use moe_backend::layer::MoeLayer;
/// How a canonical tensor is split over the ranks of one pipeline stage (moe-bridge's type).
pub use moe_bridge::dist::ShardRule;
pub use shard_model::{ShardModel, Sharded, StackShape};

/// Output of the traced forward: the output, the recorded routing and the expert-bias counts.
pub(crate) type ForwardTraced = (
    ParallelOutput,
    Vec<Tensor<2, burn::tensor::Int>>,
    Vec<Option<Vec<f64>>>,
);

/// Which token dispatcher the MoE blocks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DispatcherKind {
    /// All-gather over `tp_ep`, reduce-scatter back.
    AllGather,
    /// All-to-all over `ep` (+ ETP all-gather / reduce-scatter).
    #[default]
    AllToAll,
    /// One copy per destination rank.
    Flex,
}

/// Output of [`Sharded::forward_loss`].
#[derive(Debug, Clone)]
pub struct ParallelOutput {
    /// Mean cross-entropy of this replica's batch (identical on its TP ranks), `[1]`.
    pub loss: Tensor<1>,
    /// `[B·S, V/tp]` logits of this rank's vocabulary columns.
    pub logits: Tensor<2>,
    /// This rank's vocabulary columns.
    pub vocab: Range<usize>,
    /// Router logits `[T_local, E]` of every sparse layer for this rank's sequence-parallel
    /// tokens, in layer order.
    pub router_logits: Vec<Tensor<2>>,
    /// The router losses of every sparse layer (layer order), this rank's part: a loss summed
    /// over its reduction group (`tp_cp`) is the layer's loss.
    pub router_losses: Vec<Vec<moe_backend::router::RouterLoss>>,
}

pub(crate) fn err(e: moe_backend::BackendError) -> ModelError {
    ModelError::from(e)
}

/// The dispatcher of `kind` for `num_experts` experts.
pub(crate) fn make_dispatcher(
    groups: &GroupComms,
    kind: DispatcherKind,
    num_experts: usize,
) -> Result<Arc<dyn TokenDispatcher>, ModelError> {
    let layout: &ParallelLayout = &groups.groups.layout;
    let tp_ep = groups.comm(GroupFamily::TpEp).clone();
    let e = num_experts;
    if tp_ep.size() == 1 {
        // Every expert is local and no token leaves the rank: the single-rank dispatcher,
        // whatever the kind.
        return Ok(Arc::new(LocalDispatcher::new(e)));
    }
    Ok(match kind {
        DispatcherKind::AllGather => {
            Arc::new(AllGatherDispatcher::new(tp_ep, e, layout.ep, layout.etp).map_err(err)?)
        }
        DispatcherKind::AllToAll => Arc::new(
            AllToAllDispatcher::new(
                groups.comm(GroupFamily::Ep).clone(),
                groups.comm(GroupFamily::ExptTp).clone(),
                tp_ep,
                e,
            )
            .map_err(err)?,
        ),
        DispatcherKind::Flex => {
            Arc::new(FlexDispatcher::new(tp_ep, e, layout.ep, layout.etp).map_err(err)?)
        }
    })
}

/// Refuses layouts with pipeline parallelism (gathering the whole model onto every rank is
/// not implemented over `pp`; save a distributed checkpoint instead).
pub(crate) fn check_no_pp(groups: &GroupComms) -> Result<(), ModelError> {
    let layout = &groups.groups.layout;
    if layout.pp != 1 {
        return Err(ModelError::layout(
            "pp",
            "gathering the whole model over pipeline stages is not implemented (pp = 1); save a \
             distributed checkpoint and convert it",
        ));
    }
    Ok(())
}

/// HF causal-LM targets of row-major `labels [B, S]`: position `i` predicts `labels[i+1]`;
/// the last position of every row is ignored.
pub(crate) fn shifted_targets(labels: &[i64], s: usize) -> Vec<i64> {
    (0..labels.len())
        .map(|i| {
            if (i + 1) % s == 0 {
                IGNORE_INDEX
            } else {
                labels[i + 1]
            }
        })
        .collect()
}

/// Checks a replica batch: `n` ids and labels forming `batch` rows, `B·S` divisible by `tp`.
pub(crate) fn check_batch(
    ids: &[i64],
    labels: &[i64],
    batch: usize,
    tp: usize,
) -> Result<usize, ModelError> {
    let n = ids.len();
    if batch == 0 || !n.is_multiple_of(batch) || labels.len() != n || !n.is_multiple_of(tp) {
        return Err(ModelError::input(
            "input_ids",
            format!(
                "{n} ids / {} labels must form {batch} sequences whose B·S divides by tp = {tp}",
                labels.len()
            ),
        ));
    }
    Ok(n / batch)
}
