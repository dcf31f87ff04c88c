//! Qwen3-MoE (and DeepSeek-V3, [`ParallelDeepseekV3`]) under any [`ParallelLayout`] on the ranks of
//! a moe-backend world: attention and dense MLPs tensor-parallel with sequence parallelism,
//! vocab-parallel embedding, LM head and cross-entropy, routed experts expert-parallel (EP × ETP)
//! behind a token dispatcher, data parallelism over the remaining ranks
//! (docs/parallelism.md §Tensor and sequence parallelism,
//! docs/routing-and-dispatch.md §Token dispatchers).
//!
//! Activations between blocks are sequence-parallel: the `B·S` tokens of a replica's batch
//! (rows `b·S + s`) are split into `tp` equal blocks. Attention and dense MLPs all-gather them,
//! compute their head/column shard and reduce-scatter back; the MoE block routes this rank's
//! tokens directly. Under context parallelism every sequence is cut into `2·cp` chunks
//! ([`CpExchange`]); under pipeline parallelism a rank holds its stage's layers
//! ([`PipelinePlace`]) and the [`crate::train::Trainer`] runs the pipeline schedule.
//!
//! Build one [`ParallelQwen3Moe`] per rank straight from the weights with
//! [`ParallelQwen3Moe::load`] (only the rank's boxes are read; [`LoadShard`] for every model),
//! as a zero skeleton for a restore with [`ParallelQwen3Moe::skeleton`], or from a full model
//! with [`ParallelQwen3Moe::shard`] (the same loading code reading the live model); train it
//! with
//! [`moe_backend::optim::DistributedAdamW::with_classes`] and the gradient classes of the
//! model's parallel plan ([`crate::param_plan::Planned::param_classes`]).

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Device, Int, Tensor};
use moe_backend::comm::GroupComms;
use moe_backend::dispatch::{
    AllGatherDispatcher, AllToAllDispatcher, FlexDispatcher, LocalDispatcher, TokenDispatcher,
};
use moe_backend::parallel::{GroupFamily, ParallelLayout};

use crate::ModelError;
use crate::causal_lm::{CausalLm, IGNORE_INDEX};
use crate::config::Qwen3MoeConfig;
use crate::layers::KvCache;
use crate::layers::rope::RotaryEmbedding;
use crate::packing::SequenceLayout;
use crate::qwen3_moe::{Qwen3MoeFeedForward, Qwen3MoeForCausalLM};
use crate::train::TrainBatch;
use crate::weights::{ModuleWeights, WeightLoader, WeightSource, adopt_param_ids};

mod context_parallel;
mod deepseek_v3;
mod gather;
pub mod logprob_pipeline;
pub mod logprobs;
mod pipeline;
mod qwen3;
pub mod replay;
mod runtime;
mod shard_rule;
pub mod sharded;
mod stack;

pub use context_parallel::{CpCommType, CpExchange, ring_gather_sequence};
pub use pipeline::{ChunkParts, PipelineModel, PipelinePlace};
pub(crate) use pipeline::{stage_accessors, stage_model};
use runtime::SpRuntime;
/// One rank's parallel context: what a model's forward is written against (see
/// [`SpRuntime`]'s methods; the built-in models use it too).
pub use runtime::SpRuntime as ParallelContext;
pub use runtime::{Prepared, RouterTrace};
pub use sharded::{CausalLmShard, LoadShard, ParallelCausalLm, TrainForward};
pub use stack::{AttentionInputs, DecoderStack, SelfAttention, StackLogits};
pub(crate) use stack::{decoder_stack, held};

pub use deepseek_v3::ParallelDeepseekV3;
pub use gather::{gather_full_deepseek_v3, gather_full_qwen3_moe, gather_planned};
pub use qwen3::ParallelQwen3;
pub use shard_rule::{ShardRule, shard_rule};

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

/// One rank's Qwen3-MoE: sharded parameters plus the groups and dispatcher to run them.
#[derive(Debug, Clone)]
pub struct ParallelQwen3Moe {
    /// This rank's shard of the model (a regular module: hand it to the optimizer).
    pub model: Qwen3MoeForCausalLM,
    rt: SpRuntime,
    /// This rank's data-parallel replica (index in `dp`; its context-parallel ranks share it).
    pub replica: usize,
    /// Number of data-parallel replicas (`|dp|`).
    pub replicas: usize,
}

/// Output of [`ParallelQwen3Moe::forward_loss`].
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

/// What building any model's shard needs: its parallel context under a layout, its model
/// built by a [`WeightLoader`] at local shapes, and the step joining the two.
pub(crate) trait ShardParts: Sized {
    /// The model's config.
    type Config;
    /// The model (a shard holds one at local shapes).
    type Model;
    /// The parallel context of `config` under the layout of `groups`.
    fn context(
        config: &Self::Config,
        groups: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<SpRuntime, ModelError>;
    /// The model built by `loader` (sharded or skeleton).
    fn from_loader(
        config: &Self::Config,
        loader: &WeightLoader<'_>,
    ) -> Result<Self::Model, ModelError>;
    /// The shard of the local `model` and its context.
    fn from_local(model: Self::Model, rt: SpRuntime) -> Self;
}

/// The shard of this rank: its boxes read from `source`, or with `None` a skeleton of zeros at
/// local shapes (nothing is read).
pub(crate) fn build_shard<S: ShardParts>(
    config: &S::Config,
    source: Option<&dyn WeightSource>,
    groups: &GroupComms,
    kind: DispatcherKind,
    device: &Device,
) -> Result<S, ModelError> {
    let rt = S::context(config, groups, kind)?;
    let spec = rt.shard_spec();
    let loader = match source {
        Some(source) => WeightLoader::sharded(source, device, &spec),
        None => WeightLoader::skeleton(device, &spec),
    };
    let model = S::from_loader(config, &loader)?;
    Ok(S::from_local(model, rt))
}

impl ShardParts for ParallelQwen3Moe {
    type Config = Qwen3MoeConfig;
    type Model = Qwen3MoeForCausalLM;

    fn context(
        config: &Qwen3MoeConfig,
        groups: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<SpRuntime, ModelError> {
        let rope = RotaryEmbedding::new(&config.rope_parameters, config.head_dim)?;
        let model = PipelineModel {
            layers: config.num_hidden_layers,
            mtp: 0,
            tied: config.tie_word_embeddings,
            hidden: config.hidden_size,
        };
        SpRuntime::new(
            groups,
            kind,
            Some(config.num_experts),
            config.vocab_size,
            rope,
        )?
        .with_pipeline(groups, model)
    }

    fn from_loader(
        config: &Qwen3MoeConfig,
        loader: &WeightLoader<'_>,
    ) -> Result<Qwen3MoeForCausalLM, ModelError> {
        Qwen3MoeForCausalLM::from_loader(config, loader)
    }

    fn from_local(model: Qwen3MoeForCausalLM, rt: SpRuntime) -> Self {
        Self {
            model,
            replica: rt.replica,
            replicas: rt.replicas,
            rt,
        }
    }
}

impl ParallelQwen3Moe {
    /// This rank's shard read straight from `source` (e.g. an HF checkpoint directory): only
    /// this rank's box of every tensor is read (TP slices per
    /// [`shard_rule`], this rank's experts and their ETP block), so the rank never holds more
    /// than its shard plus one box. Requirements as [`shard`](Self::shard).
    pub fn load(
        config: &Qwen3MoeConfig,
        source: &dyn WeightSource,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self, ModelError> {
        build_shard(config, Some(source), groups, kind, device)
    }

    /// This rank's shard at local shapes filled with zeros (nothing is read), for a restore
    /// (e.g. from a distributed checkpoint) to overwrite.
    pub fn skeleton(
        config: &Qwen3MoeConfig,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self, ModelError> {
        build_shard(config, None, groups, kind, device)
    }

    /// This rank's shard of `full` under the layout of `groups` (its pipeline stage only;
    /// heads, KV heads, vocabulary and FFN widths divisible by `tp`, experts by `ep`, expert
    /// width by `etp`): [`load`](Self::load) reading `full`'s tensors box by box
    /// ([`ModuleWeights`]), on `full`'s device, with `full`'s FP8 settings.
    pub fn shard(
        full: &Qwen3MoeForCausalLM,
        groups: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<Self, ModelError> {
        let device = full.device();
        let source = ModuleWeights::new(full)?;
        let mut shard = Self::load(full.config(), &source, groups, kind, &device)?;
        // The full model's parameter ids identify the shard's parameters too.
        shard.model = adopt_param_ids(shard.model, full)?;
        for (dst, src) in shard.model.model.layers.select_from_mut(&full.model.layers) {
            dst.self_attn.fp8 = src.self_attn.fp8;
            match (&mut dst.mlp, &src.mlp) {
                (Qwen3MoeFeedForward::Dense(d), Qwen3MoeFeedForward::Dense(s)) => d.fp8 = s.fp8,
                (Qwen3MoeFeedForward::Sparse(d), Qwen3MoeFeedForward::Sparse(s)) => {
                    d.moe.experts.fp8 = s.moe.experts.fp8;
                }
                _ => {}
            }
        }
        Ok(shard)
    }

    /// Forward and causal-LM loss of this replica's batch `input_ids [batch, S]` (row-major
    /// host ids, identical on every TP rank of the replica); `labels` as in HF (−100 ignored,
    /// shifted inside). Router auxiliary losses are not added.
    pub fn forward_loss(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        device: &Device,
    ) -> Result<ParallelOutput, ModelError> {
        self.forward_loss_scaled(input_ids, labels, batch, device, 1.0)
    }

    /// [`forward_loss`](Self::forward_loss) whose router losses (attached to the graph) get
    /// the upstream gradient `aux_grad_scale` (the trainer passes `1 / micro-batches`).
    pub fn forward_loss_scaled(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        device: &Device,
        aux_grad_scale: f64,
    ) -> Result<ParallelOutput, ModelError> {
        self.forward_traced(
            input_ids,
            labels,
            batch,
            device,
            RouterTrace::new(aux_grad_scale),
        )
        .map(|(out, _, _)| out)
    }

    /// [`forward_loss_scaled`](Self::forward_loss_scaled) of a [`TrainBatch`], packed or
    /// padded when it carries a [`SequenceLayout`]: attention
    /// on the gathered sequence stays within each document and skips padded keys, RoPE
    /// positions restart at every document, the loss skips targets across document boundaries
    /// and padding, and the routers leave this rank's padded rows out of their losses and
    /// expert-bias counts.
    pub fn forward_loss_batch(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
    ) -> Result<ParallelOutput, ModelError> {
        self.forward_traced_packed(
            &batch.input_ids,
            &batch.labels,
            batch.batch,
            batch.layout(),
            device,
            RouterTrace::new(aux_grad_scale),
        )
        .map(|(out, _, _)| out)
    }

    /// The forward of [`forward_loss_scaled`](Self::forward_loss_scaled) with the routers
    /// driven by `trace` (replay / record); also returns the recorded per-layer indices.
    pub(crate) fn forward_traced(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        device: &Device,
        trace: RouterTrace,
    ) -> Result<ForwardTraced, ModelError> {
        self.forward_traced_packed(input_ids, labels, batch, None, device, trace)
    }

    /// The training forward of the whole model (`pp = 1`) on `batch`, its routers driven by
    /// `routing` (the batch's routing replayed, selections recorded); also returns the
    /// selections of this rank's routers (when recorded).
    pub(crate) fn train_whole(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        routing: &replay::ForwardRouting<'_>,
    ) -> Result<(TrainForward, Vec<Tensor<2, Int>>), ModelError> {
        self.rt.require_whole_model("`forward_train_batch`")?;
        let whole = ChunkParts {
            virtual_stage: 0,
            embedding: true,
            layers: 0..self.model.model.layers.len(),
            loss: true,
        };
        let (out, selected) = (self.rt).train_chunk(
            &self.model,
            &whole,
            0,
            batch,
            device,
            aux_grad_scale,
            None,
            routing,
        )?;
        match out {
            sharded::ChunkForward::Loss(out) => Ok((out, selected)),
            _ => Err(ModelError::layout(
                "pp",
                "the whole model's forward returned no loss",
            )),
        }
    }

    /// [`forward_traced`](Self::forward_traced) of a batch with an optional packing layout.
    pub(crate) fn forward_traced_packed(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        layout: Option<&SequenceLayout>,
        device: &Device,
        trace: RouterTrace,
    ) -> Result<ForwardTraced, ModelError> {
        self.rt
            .loss_forward(&self.model, input_ids, labels, batch, layout, device, trace)
    }
}

/// Generation under any layout: every rank of a replica runs the same loop (e.g.
/// [`crate::generate`] or [`crate::rollout::generate_batch`]) on the same ids; the KV cache
/// holds this rank's heads, the logits are gathered to the full vocabulary on every rank, so
/// every rank samples the same tokens. `batch · S` must be divisible by `tp` at every call
/// (sequence parallelism), e.g. an even batch under `tp = 2`.
impl CausalLm for ParallelQwen3Moe {
    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn new_cache(&self) -> KvCache {
        KvCache::new(self.model.model.layers.len())
    }

    fn forward_cached(
        &self,
        input_ids: Tensor<2, Int>,
        cache: &mut KvCache,
    ) -> Result<Tensor<3>, ModelError> {
        let mut trace = RouterTrace::new(0.0);
        let out = (self.rt).logits(&self.model, input_ids, None, Some(cache), &mut trace)?;
        Ok(out.logits)
    }
}

impl crate::rollout::RolloutModel for ParallelQwen3Moe {
    fn device(&self) -> Device {
        self.model.device()
    }
}

impl ParallelCausalLm for Qwen3MoeForCausalLM {
    type Shard = ParallelQwen3Moe;

    fn shard(&self, groups: &GroupComms, kind: DispatcherKind) -> Result<Self::Shard, ModelError> {
        ParallelQwen3Moe::shard(self, groups, kind)
    }

    fn with_fp8(
        self,
        recipe: moe_backend::fp8::Fp8Recipe,
        linears: bool,
    ) -> Result<Self, ModelError> {
        let model = self.with_fp8_experts(Some(recipe))?;
        if linears {
            model.with_fp8_linears(Some(recipe))
        } else {
            Ok(model)
        }
    }
}

impl LoadShard for Qwen3MoeForCausalLM {
    type Config = Qwen3MoeConfig;

    fn load_shard(
        config: &Qwen3MoeConfig,
        source: &dyn WeightSource,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self::Shard, ModelError> {
        ParallelQwen3Moe::load(config, source, groups, kind, device)
    }

    fn shard_skeleton(
        config: &Qwen3MoeConfig,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self::Shard, ModelError> {
        ParallelQwen3Moe::skeleton(config, groups, kind, device)
    }
}

impl CausalLmShard for ParallelQwen3Moe {
    type Model = Qwen3MoeForCausalLM;

    fn model(&self) -> &Self::Model {
        &self.model
    }

    fn begin_global_batch(&self) {
        self.rt.reset_global_aux();
    }

    fn model_mut(&mut self) -> &mut Self::Model {
        &mut self.model
    }

    fn loss_groups(&self) -> (usize, usize) {
        self.rt.loss_groups
    }

    fn context_mut(&mut self) -> &mut SpRuntime {
        &mut self.rt
    }

    fn sequence_positions(&self, s: usize) -> Vec<usize> {
        self.rt.sequence_positions(s)
    }

    fn forward_train_batch(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        _mtp: bool,
    ) -> Result<TrainForward, ModelError> {
        let spec = self.replay_spec();
        let routing = replay::ForwardRouting {
            spec: Some(&spec),
            ..Default::default()
        };
        Ok(self.train_whole(batch, device, aux_grad_scale, &routing)?.0)
    }

    fn routing_spec(&self) -> Option<crate::replay::ReplaySpec> {
        Some(self.replay_spec())
    }

    crate::distributed::stage_accessors!(decoder_stack);

    fn moe_layers_in(&self, layers: Range<usize>) -> usize {
        (self
            .model
            .model
            .layers
            .get(layers)
            .unwrap_or_default()
            .iter())
        .filter(|l| matches!(l.mlp, Qwen3MoeFeedForward::Sparse(_)))
        .count()
    }

    fn routers_mut(&mut self) -> Vec<&mut moe_backend::router::TopKRouter> {
        self.model
            .model
            .layers
            .iter_mut()
            .filter_map(|layer| match &mut layer.mlp {
                Qwen3MoeFeedForward::Sparse(block) => Some(&mut block.moe.router),
                Qwen3MoeFeedForward::Dense(_) => None,
            })
            .collect()
    }
}
