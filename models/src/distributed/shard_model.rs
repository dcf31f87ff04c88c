//! One rank's shard of any model: [`Sharded<M>`] holds the rank's parameters (a model of the
//! same type as the whole model, at local shapes) and its parallel context, for every family
//! alike. A model becomes shardable by implementing [`ShardModel`] (its decoder stack, its
//! parallel plan and a few facts about its config); the trainer, the log-prob and replay
//! forwards, generation, gathering and checkpoints then serve it under every layout
//! (torchtitan's "model code unchanged by parallelism"; Megatron-Core's one `GPTModel` for
//! every family).

use std::ops::Range;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use moe_backend::comm::GroupComms;
use moe_backend::fp8::Fp8Recipe;
use moe_backend::router::TopKRouter;

use super::layer_parts::{LayerParts, ShardAttention, copy_layer_fp8, layer_router, set_layer_fp8};
use super::pipeline::{ChunkParts, PipelineModel, PipelinePlace};
use super::replay::ForwardRouting;
use super::runtime::{RouterTrace, SpRuntime};
use super::sharded::{CausalLmShard, ChunkForward, LoadShard, ParallelCausalLm, TrainForward};
use super::stack::DecoderStack;
use super::{DispatcherKind, ForwardTraced, ParallelOutput};
use crate::ModelError;
use crate::batch::TrainBatch;
use crate::causal_lm::CausalLm;
use crate::layers::KvCache;
use crate::layers::LayerStack;
use crate::layers::rope::RotaryEmbedding;
use crate::param_plan::Planned;
use crate::routing::ReplaySpec;
use crate::weights::{
    ModuleWeights, ShardSpec, WeightLoader, WeightSource, adopt_param_ids, module_device,
};

/// What the parallel context of a model needs from its config.
#[derive(Debug, Clone)]
pub struct StackShape {
    /// Decoder layers, MTP depths, tied head and hidden size (the pipeline's view).
    pub pipeline: PipelineModel,
    /// Routed experts of the MoE blocks (`None` for a dense model: no dispatcher).
    pub num_experts: Option<usize>,
    /// Vocabulary size (split over TP).
    pub vocab_size: usize,
    /// The rotary embedding of the attention (its tables are built per batch).
    pub rope: RotaryEmbedding,
}

/// A model whose shard [`Sharded`] runs under any layout: a [`DecoderStack`] (embedding,
/// layers, final norm, head, optional MTP modules) with a parallel plan ([`Planned`]) whose
/// decoder layers ([`DecoderStack::Layer`]) are [`LayerParts`]. Loading, localizing, FP8, the routers and gathering have
/// defaults read off the layers; a family states its config's shape, its template and its
/// routing.
pub trait ShardModel: DecoderStack + Planned + Module + Clone + std::fmt::Debug + Sized {
    /// The model's configuration (HF `config.json` of its family).
    type Config: Clone + std::fmt::Debug + Send + Sync + 'static;

    /// The configuration the model was built from.
    fn model_config(&self) -> &Self::Config;

    /// What the parallel context needs from `config`.
    fn stack_shape(config: &Self::Config) -> Result<StackShape, ModelError>;

    /// The whole model as the family's own initialisation builds it, lazily (its parameters
    /// have shapes but are never allocated unless read): the template loading and the
    /// planner cut.
    fn template(config: &Self::Config, device: &Device) -> Result<Self, ModelError>;

    /// The parts of the model a pipeline stage holds (`stage`): its decoder layers (named by
    /// their global index), the embedding, final norm, head and MTP modules only where held.
    fn select_stage(self, stage: &crate::weights::StageHolding) -> Result<Self, ModelError>;

    /// The MTP modules' decoder layers this model holds, in depth order (none by default).
    fn mtp_layers(&self) -> Vec<&Self::Layer> {
        Vec::new()
    }

    /// The main model's decoder layers and the MTP modules', mutably (a model with MTP
    /// modules overrides it; the default: the main layers only).
    fn layers_with_mtp_mut(&mut self) -> (&mut LayerStack<Self::Layer>, Vec<&mut Self::Layer>) {
        (self.layers_mut(), Vec::new())
    }

    /// Every decoder layer held, main layers first and then the MTP modules', mutably.
    fn all_layers_mut(&mut self) -> Vec<&mut Self::Layer> {
        let (main, mtp) = self.layers_with_mtp_mut();
        main.iter_mut().chain(mtp).collect()
    }

    /// The model built by `loader`: whole, one rank's shard at local shapes
    /// ([`WeightLoader::sharded`]) or a zero skeleton. The default: the
    /// [`template`](Self::template) cut to the loader's pipeline stage, its attention checked
    /// against the loader's `tp`, every parameter read by its plan row
    /// ([`crate::param_plan::load_with`]), then [`localize`](Self::localize).
    fn from_loader(config: &Self::Config, loader: &WeightLoader<'_>) -> Result<Self, ModelError> {
        let template = Self::template(config, loader.device())?;
        let template = match &loader.shard().stage {
            Some(stage) => template.select_stage(stage)?,
            None => template,
        };
        let tp = loader.shard().tp;
        let main = template.layers().iter();
        for layer in main.chain(template.mtp_layers()) {
            layer.attention().check_split(tp)?;
        }
        let layers = template.main_layers();
        crate::param_plan::load_with(&template, &Self::parallel_plan(), layers, loader)?
            .localize(loader.shard())
    }

    /// Fixes the fields derived from tensor shapes after loading `shard` (the whole model:
    /// [`ShardSpec::FULL`]). The default: [`LayerParts::localize`] of every layer.
    fn localize(mut self, shard: &ShardSpec) -> Result<Self, ModelError> {
        for layer in self.all_layers_mut() {
            layer.localize(shard)?;
        }
        Ok(self)
    }

    /// Copies the FP8 settings of `full`'s layers onto this shard's (sharding keeps the whole
    /// model's compute settings): attention projections, dense MLPs, routed experts.
    fn copy_fp8_from(&mut self, full: &Self) {
        let (main, mtp) = self.layers_with_mtp_mut();
        for (dst, src) in main.select_from_mut(full.layers()) {
            copy_layer_fp8(dst, src);
        }
        for (dst, src) in mtp.into_iter().zip(full.mtp_layers()) {
            copy_layer_fp8(dst, src);
        }
    }

    /// Number of MoE layers (routers) among the local decoder layers `layers`.
    fn moe_layers_in(&self, layers: Range<usize>) -> usize {
        let held = self.layers().get(layers).unwrap_or_default();
        held.iter().filter(|layer| layer.moe().is_some()).count()
    }

    /// Every router, main layers first and then the MTP modules', in forward order.
    fn routers_mut(&mut self) -> Vec<&mut TopKRouter> {
        (self.all_layers_mut().into_iter())
            .filter_map(layer_router)
            .collect()
    }

    /// What a routing replayed in this model must match (`None`: no router).
    fn replay_spec(&self) -> Option<ReplaySpec> {
        None
    }

    /// The model with its routed experts (with `linears`, its dense linears too) in FP8.
    /// The default refuses; a family whose layers train in FP8 returns
    /// [`with_fp8_layers`](Self::with_fp8_layers).
    fn with_fp8(self, recipe: Fp8Recipe, linears: bool) -> Result<Self, ModelError> {
        let _ = (recipe, linears);
        Err(ModelError::unsupported(
            "fp8",
            format!(
                "FP8 compute is not implemented for {} training",
                Self::parallel_plan().family()
            ),
        ))
    }

    /// Every layer's routed experts in FP8 (`Some(recipe)`, docs/fp8.md §Recipes) or back in
    /// high precision (`None`); with `linears`, the attention projections and dense MLPs too
    /// (main layers and MTP modules). Routers, shared experts, embeddings, head and norms stay
    /// in high precision (docs/fp8.md §Selective precision).
    fn with_fp8_layers(
        mut self,
        recipe: Option<Fp8Recipe>,
        linears: bool,
    ) -> Result<Self, ModelError> {
        if let Some(r) = &recipe {
            r.validate()?;
        }
        for layer in self.all_layers_mut() {
            set_layer_fp8(layer, recipe, linears)?;
        }
        Ok(self)
    }

    /// The whole model reassembled from gathered shards made a single-rank model again: full
    /// head counts (and whatever else [`LayerParts::localize`] derives, for the whole model),
    /// routers without the shard's training losses.
    fn into_single_rank(self) -> Result<Self, ModelError> {
        let mut model = self.localize(&ShardSpec::FULL)?;
        for router in model.routers_mut() {
            router.set_losses(Vec::new(), None, 1, 1)?;
        }
        Ok(model)
    }
}

/// One rank's shard of a [`ShardModel`]: its parameters and parallel context.
#[derive(Debug, Clone)]
pub struct Sharded<M> {
    /// This rank's shard of the model (a regular module: hand it to the optimizer).
    pub model: M,
    pub(crate) rt: SpRuntime,
    /// This rank's data-parallel replica (index in `dp`; its context-parallel ranks share it).
    pub replica: usize,
    /// Number of data-parallel replicas (`|dp|`).
    pub replicas: usize,
}

/// The parallel context of `config` under the layout of `groups`.
fn context<M: ShardModel>(
    config: &M::Config,
    groups: &GroupComms,
    kind: DispatcherKind,
) -> Result<SpRuntime, ModelError> {
    let shape = M::stack_shape(config)?;
    SpRuntime::new(
        groups,
        kind,
        shape.num_experts,
        shape.vocab_size,
        shape.rope,
    )?
    .with_pipeline(groups, shape.pipeline)
}

impl<M: ShardModel> Sharded<M> {
    fn build(
        config: &M::Config,
        source: Option<&dyn WeightSource>,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let rt = context::<M>(config, groups, kind)?;
        let spec = rt.shard_spec();
        let loader = match source {
            Some(source) => WeightLoader::sharded(source, device, &spec),
            None => WeightLoader::skeleton(device, &spec),
        };
        let model = M::from_loader(config, &loader)?;
        Ok(Self {
            model,
            replica: rt.replica,
            replicas: rt.replicas,
            rt,
        })
    }

    /// This rank's shard read straight from `source` (e.g. an HF checkpoint directory): only
    /// this rank's box of every tensor is read (its pipeline stage's parts, TP slices, its
    /// experts and their ETP block), so the rank never holds more than its shard plus one box.
    pub fn load(
        config: &M::Config,
        source: &dyn WeightSource,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::build(config, Some(source), groups, kind, device)
    }

    /// This rank's shard at local shapes filled with zeros (nothing is read), for a restore
    /// (e.g. from a distributed checkpoint) to overwrite.
    pub fn skeleton(
        config: &M::Config,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::build(config, None, groups, kind, device)
    }

    /// This rank's shard of `full` under the layout of `groups` (heads, KV heads, vocabulary
    /// and FFN widths divisible by `tp`, experts by `ep`, expert width by `etp`): [`load`]
    /// reading `full`'s tensors box by box ([`ModuleWeights`]), on `full`'s device, with
    /// `full`'s parameter ids and FP8 settings.
    ///
    /// [`load`]: Self::load
    pub fn shard(full: &M, groups: &GroupComms, kind: DispatcherKind) -> Result<Self, ModelError> {
        let device = module_device(full);
        let source = ModuleWeights::new(full)?;
        let mut shard = Self::load(full.model_config(), &source, groups, kind, &device)?;
        // The full model's parameter ids identify the shard's parameters too.
        shard.model = adopt_param_ids(shard.model, full)?;
        shard.model.copy_fp8_from(full);
        Ok(shard)
    }

    /// This rank's parallel context (groups, dispatcher, training options).
    pub fn context(&self) -> &SpRuntime {
        &self.rt
    }

    /// Forward and causal-LM loss of this replica's batch `input_ids [batch, S]` (row-major
    /// host ids, identical on every TP rank of the replica); `labels` as in HF (−100 ignored,
    /// shifted inside). Router auxiliary losses are not added; MTP modules do not run.
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
        let trace = RouterTrace::new(aux_grad_scale);
        self.forward_traced(input_ids, labels, batch, None, device, trace)
            .map(|(out, _, _)| out)
    }

    /// [`forward_loss_scaled`](Self::forward_loss_scaled) of a [`TrainBatch`], packed or
    /// padded when it carries a [`SequenceLayout`](crate::packing::SequenceLayout): attention
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
        let trace = RouterTrace::new(aux_grad_scale);
        let (ids, labels) = (&batch.input_ids, &batch.labels);
        self.forward_traced(ids, labels, batch.batch, batch.layout(), device, trace)
            .map(|(out, _, _)| out)
    }

    /// The whole model's loss forward with the routers driven by `trace` (replay / record):
    /// the output, the recorded per-layer indices and the expert-bias counts.
    pub(crate) fn forward_traced(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        layout: Option<&crate::packing::SequenceLayout>,
        device: &Device,
        trace: RouterTrace,
    ) -> Result<ForwardTraced, ModelError> {
        (self.rt).loss_forward(&self.model, input_ids, labels, batch, layout, device, trace)
    }

    /// The routing spec, or an error naming the model for a model without routers.
    pub(crate) fn require_replay_spec(&self) -> Result<ReplaySpec, ModelError> {
        self.model.replay_spec().ok_or_else(|| {
            ModelError::input(
                "routed_experts",
                format!(
                    "the {} model has no MoE router to replay or record a routing in",
                    M::parallel_plan().family()
                ),
            )
        })
    }

    /// The training forward of the whole model (`pp = 1`) on `batch` (with `mtp` the MTP
    /// depths), its routers replaying the batch's routing and recording with `record`; also
    /// returns the recorded selections (main layers, then MTP depths).
    pub(crate) fn train_whole(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        mtp: bool,
        record: bool,
    ) -> Result<(TrainForward, Vec<Tensor<2, Int>>), ModelError> {
        self.rt.require_whole_model("`forward_train_batch`")?;
        let whole = ChunkParts {
            virtual_stage: 0,
            embedding: true,
            layers: 0..self.model.num_layers(),
            loss: true,
        };
        match self.train_chunk(&whole, 0, batch, device, aux_grad_scale, mtp, None, record)? {
            (ChunkForward::Loss(out), selected) => Ok((out, selected)),
            _ => Err(ModelError::layout(
                "pp",
                "the whole model's forward returned no loss",
            )),
        }
    }

    /// The training forward of chunk `chunk` (see [`CausalLmShard::forward_train_chunk`]),
    /// recording the routers' selections with `record`.
    #[allow(clippy::too_many_arguments)]
    fn train_chunk(
        &self,
        chunk: &ChunkParts,
        moe_offset: usize,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        mtp: bool,
        input: Option<Tensor<2>>,
        record: bool,
    ) -> Result<(ChunkForward, Vec<Tensor<2, Int>>), ModelError> {
        let spec = self.model.replay_spec();
        let routing = ForwardRouting {
            spec: spec.as_ref(),
            mtp: if mtp { self.model.mtp_depths() } else { 0 },
            record,
        };
        (self.rt).train_chunk(
            &self.model,
            chunk,
            moe_offset,
            batch,
            device,
            aux_grad_scale,
            input,
            &routing,
        )
    }
}

/// Every [`ShardModel`] shards into a [`Sharded`].
impl<M: ShardModel> ParallelCausalLm for M {
    type Shard = Sharded<M>;

    fn shard(&self, groups: &GroupComms, kind: DispatcherKind) -> Result<Sharded<M>, ModelError> {
        Sharded::shard(self, groups, kind)
    }

    fn with_fp8(self, recipe: Fp8Recipe, linears: bool) -> Result<Self, ModelError> {
        ShardModel::with_fp8(self, recipe, linears)
    }
}

impl<M: ShardModel> LoadShard for M {
    type Config = M::Config;

    fn load_shard(
        config: &M::Config,
        source: &dyn WeightSource,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Sharded<M>, ModelError> {
        Sharded::load(config, source, groups, kind, device)
    }

    fn shard_skeleton(
        config: &M::Config,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Sharded<M>, ModelError> {
        Sharded::skeleton(config, groups, kind, device)
    }
}

impl<M: ShardModel> CausalLmShard for Sharded<M> {
    type Model = M;

    fn model(&self) -> &M {
        &self.model
    }

    fn model_mut(&mut self) -> &mut M {
        &mut self.model
    }

    fn begin_global_batch(&self) {
        self.rt.reset_global_aux();
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

    /// The main causal-LM loss and, with `mtp`, the loss of every MTP depth `j` on the full
    /// sequence length as Megatron computes it (ids and labels rolled left by `j + 1` per row,
    /// or per document of a packed batch; see [`SpRuntime`]'s chunk forward). A routed batch
    /// ([`TrainBatch::with_routed_experts`]) replays its routing in the main model's MoE
    /// layers and, when it covers them, in the MTP modules'.
    fn forward_train_batch(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        mtp: bool,
    ) -> Result<TrainForward, ModelError> {
        Ok(self
            .train_whole(batch, device, aux_grad_scale, mtp, false)?
            .0)
    }

    fn forward_train_chunk(
        &self,
        chunk: &ChunkParts,
        moe_offset: usize,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        mtp: bool,
        input: Option<Tensor<2>>,
    ) -> Result<ChunkForward, ModelError> {
        let out = self.train_chunk(
            chunk,
            moe_offset,
            batch,
            device,
            aux_grad_scale,
            mtp,
            input,
            false,
        )?;
        Ok(out.0)
    }

    fn forward_logprobs_chunk(
        &self,
        chunk: &ChunkParts,
        moe_offset: usize,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        input: Option<Tensor<2>>,
    ) -> Result<ChunkForward, ModelError> {
        // A routed batch replays its routing here too (RL routing replay with log-probs).
        let spec = self.model.replay_spec();
        let routing = ForwardRouting {
            spec: spec.as_ref(),
            ..Default::default()
        };
        (self.rt).logprobs_chunk(
            &self.model,
            chunk,
            moe_offset,
            batch,
            device,
            aux_grad_scale,
            input,
            &routing,
        )
    }

    fn local_layers(&self) -> usize {
        self.model.num_layers()
    }

    fn pipeline(&self) -> Option<&PipelinePlace> {
        self.rt.pipeline()
    }

    fn embedding(&self) -> Option<&burn::nn::Embedding> {
        self.model.embed_tokens().ok()
    }

    fn moe_layers_in(&self, layers: Range<usize>) -> usize {
        self.model.moe_layers_in(layers)
    }

    fn mtp_depths(&self) -> usize {
        self.model.mtp_depths()
    }

    fn routing_spec(&self) -> Option<ReplaySpec> {
        self.model.replay_spec()
    }

    fn routers_mut(&mut self) -> Vec<&mut TopKRouter> {
        self.model.routers_mut()
    }
}

/// Generation under any layout: every rank of a replica runs the same loop (e.g.
/// [`crate::generate`] or [`crate::rollout::generate_batch`]) on the same ids; the KV cache
/// holds this rank's heads (or MLA latents), the logits are gathered to the full vocabulary
/// on every rank, so every rank samples the same tokens. `batch · S` must be divisible by
/// `tp` at every call (sequence parallelism), e.g. an even batch under `tp = 2`. MTP modules
/// are not used.
impl<M: ShardModel> CausalLm for Sharded<M> {
    fn vocab_size(&self) -> usize {
        self.rt.vocab.len() * self.rt.tp.size()
    }

    fn new_cache(&self) -> KvCache {
        KvCache::new(self.model.num_layers())
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
