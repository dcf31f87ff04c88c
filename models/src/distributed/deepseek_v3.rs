//! DeepSeek-V3 under a [`ParallelLayout`](moe_backend::parallel::ParallelLayout): MLA with its
//! heads split over TP (`q_b_proj`/`q_proj` and `kv_b_proj` column-parallel by head, `o_proj`
//! row-parallel, the latent down-projections `q_a_proj`/`kv_a_proj_with_mqa` and their norms
//! replicated), dense MLPs TP-sharded, MoE blocks (sigmoid group-limited router with
//! `e_score_correction_bias`, routed experts over EP × ETP, shared experts replicated on the
//! sequence-parallel tokens), vocab-parallel embedding, head and cross-entropy. The MTP
//! modules train beside the main model ([`CausalLmShard::forward_train`]).

use burn::tensor::{Device, Int, Tensor};
use moe_backend::comm::GroupComms;
use moe_backend::fp8::Fp8Recipe;
use moe_backend::router::TopKRouter;

use super::replay::ForwardRouting;
use super::runtime::{RouterTrace, SpRuntime};
use super::sharded::{
    CausalLmShard, ChunkForward, LoadShard, ParallelCausalLm, TrainForward, roll_rows,
};
use super::stack::ChunkRun;
use super::{
    ChunkParts, DispatcherKind, ForwardTraced, ParallelOutput, ShardParts, build_shard, held,
};
use crate::ModelError;
use crate::causal_lm::CausalLm;
use crate::config::DeepseekV3Config;
use crate::deepseek_v3::{DeepseekV3FeedForward, DeepseekV3ForCausalLM};
use crate::layers::KvCache;
use crate::layers::rope::RotaryEmbedding;
use crate::packing::SequenceLayout;
use crate::train::TrainBatch;
use crate::weights::{ModuleWeights, WeightLoader, WeightSource, adopt_param_ids};

/// One rank's DeepSeek-V3 (see the module docs).
#[derive(Debug, Clone)]
pub struct ParallelDeepseekV3 {
    /// This rank's shard of the model (hand it to the optimizer).
    pub model: DeepseekV3ForCausalLM,
    rt: SpRuntime,
    /// This rank's data-parallel replica (index in `dp`; its context-parallel ranks share it).
    pub replica: usize,
    /// Number of data-parallel replicas.
    pub replicas: usize,
}

impl ShardParts for ParallelDeepseekV3 {
    type Config = DeepseekV3Config;
    type Model = DeepseekV3ForCausalLM;

    fn context(
        config: &DeepseekV3Config,
        groups: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<SpRuntime, ModelError> {
        let rope = RotaryEmbedding::new(&config.rope_parameters, config.qk_rope_head_dim)?;
        let model = super::PipelineModel {
            layers: config.num_hidden_layers,
            mtp: config.num_nextn_predict_layers,
            tied: config.tie_word_embeddings,
            hidden: config.hidden_size,
        };
        SpRuntime::new(
            groups,
            kind,
            Some(config.n_routed_experts),
            config.vocab_size,
            rope,
        )?
        .with_pipeline(groups, model)
    }

    fn from_loader(
        config: &DeepseekV3Config,
        loader: &WeightLoader<'_>,
    ) -> Result<DeepseekV3ForCausalLM, ModelError> {
        DeepseekV3ForCausalLM::from_loader(config, loader)
    }

    fn from_local(model: DeepseekV3ForCausalLM, rt: SpRuntime) -> Self {
        Self {
            model,
            replica: rt.replica,
            replicas: rt.replicas,
            rt,
        }
    }
}

impl ParallelDeepseekV3 {
    /// This rank's shard (MTP modules included) read straight from `source`: only this rank's
    /// box of every tensor is read (MLA heads, dense MLPs, embedding and head over TP; this
    /// rank's experts and their ETP block; norms, latent projections, routers, shared experts
    /// and the MTP projections whole). Requirements as [`shard`](Self::shard).
    pub fn load(
        config: &DeepseekV3Config,
        source: &dyn WeightSource,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self, ModelError> {
        build_shard(config, Some(source), groups, kind, device)
    }

    /// This rank's shard at local shapes filled with zeros (nothing is read), for a restore
    /// to overwrite.
    pub fn skeleton(
        config: &DeepseekV3Config,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self, ModelError> {
        build_shard(config, None, groups, kind, device)
    }

    /// This rank's shard of `full` (heads, vocabulary and FFN widths divisible by `tp`,
    /// experts by `ep`, expert width by `etp`; its pipeline stage only): [`load`](Self::load) reading
    /// `full`'s tensors box by box ([`ModuleWeights`]) on `full`'s device.
    pub fn shard(
        full: &DeepseekV3ForCausalLM,
        groups: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<Self, ModelError> {
        let device = full.device();
        let source = ModuleWeights::new(full)?;
        let mut shard = Self::load(full.config(), &source, groups, kind, &device)?;
        // The full model's parameter ids identify the shard's parameters too.
        shard.model = adopt_param_ids(shard.model, full)?;
        let main = shard.model.model.layers.select_from_mut(&full.model.layers);
        let mtp =
            (shard.model.mtp.iter_mut().zip(&full.mtp)).map(|(d, s)| (&mut d.block, &s.block));
        for (dst, src) in main.chain(mtp) {
            match (&mut dst.mlp, &src.mlp) {
                (DeepseekV3FeedForward::Dense(d), DeepseekV3FeedForward::Dense(s)) => d.fp8 = s.fp8,
                (DeepseekV3FeedForward::Moe(d), DeepseekV3FeedForward::Moe(s)) => {
                    d.moe.experts.fp8 = s.moe.experts.fp8;
                }
                _ => {}
            }
        }
        Ok(shard)
    }

    /// Forward and causal-LM loss of this replica's `input_ids [batch, S]` (same on every TP
    /// rank of the replica); `labels` as in HF (−100 ignored, shifted inside).
    pub fn forward_loss(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        device: &Device,
    ) -> Result<ParallelOutput, ModelError> {
        self.forward_loss_packed(input_ids, labels, batch, None, device, 1.0)
    }

    /// [`forward_loss`](Self::forward_loss) of a [`TrainBatch`], packed or padded when it
    /// carries a [`SequenceLayout`] (see [`ParallelQwen3Moe::forward_loss_batch`](super::ParallelQwen3Moe::forward_loss_batch)), its router
    /// losses attached with the upstream gradient `aux_grad_scale`.
    pub fn forward_loss_batch(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
    ) -> Result<ParallelOutput, ModelError> {
        self.forward_loss_packed(
            &batch.input_ids,
            &batch.labels,
            batch.batch,
            batch.layout(),
            device,
            aux_grad_scale,
        )
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
        self.forward_loss_packed(input_ids, labels, batch, None, device, aux_grad_scale)
    }

    fn forward_loss_packed(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        layout: Option<&SequenceLayout>,
        device: &Device,
        aux_grad_scale: f64,
    ) -> Result<ParallelOutput, ModelError> {
        let trace = RouterTrace::new(aux_grad_scale);
        self.forward_traced_packed(input_ids, labels, batch, layout, device, trace)
            .map(|(out, _, _)| out)
    }

    /// The main model's forward and loss (no MTP) with the routers driven by `trace`
    /// (replay / record; its padding rows are set from the batch's layout); also returns the
    /// recorded per-layer indices and the expert-bias counts.
    pub(crate) fn forward_traced_packed(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        layout: Option<&SequenceLayout>,
        device: &Device,
        trace: RouterTrace,
    ) -> Result<ForwardTraced, ModelError> {
        (self.rt).loss_forward(&self.model, input_ids, labels, batch, layout, device, trace)
    }

    /// The training forward of chunk `chunk` (its first MoE layer this rank's `moe_offset`,
    /// `input` the previous virtual stage's activation) on `batch`, the routers replaying the
    /// batch's routing and recording with `record`: the chunk's output (with `mtp`, the MTP
    /// depths on the last virtual stage) and the routers' selections (when recorded; main
    /// layers then MTP depths).
    pub(crate) fn train_chunk_traced(
        &self,
        (chunk, moe_offset, input): (&ChunkParts, usize, Option<Tensor<2>>),
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        mtp: bool,
        record: bool,
    ) -> Result<(ChunkForward, Vec<Tensor<2, Int>>), ModelError> {
        let rt = &self.rt;
        let (input_ids, rows) = (&batch.input_ids, batch.batch);
        let model = &self.model.model;
        let spec = self.replay_spec();
        let routing = ForwardRouting {
            spec: Some(&spec),
            mtp: if mtp { self.model.mtp.len() } else { 0 },
            record,
        };
        let mut run = rt.chunk_layers(
            &self.model,
            chunk,
            moe_offset,
            batch,
            device,
            aux_grad_scale,
            input,
            &routing,
        )?;
        if !chunk.loss {
            let selected = std::mem::take(&mut run.trace.selected);
            return Ok((run.passed_on(), selected));
        }
        let ChunkRun { p, mut trace, x } = run;
        let s = p.s;
        let (head, embed) = (self.model.lm_head.as_ref(), model.embed_tokens.as_ref());
        let mut hidden = held(model.norm.as_ref(), "the final norm")?.forward(x);
        let (loss, _) = rt.normed_head_loss(hidden.clone(), head, embed, &p.targets)?;
        let mut mtp_losses = Vec::new();
        if mtp {
            for (j, module) in self.model.mtp.iter().enumerate() {
                if j + 2 > s {
                    return Err(ModelError::input(
                        "input_ids",
                        format!("{s} tokens are too few for MTP depth {}", j + 1),
                    ));
                }
                // Rolled per document for a packed batch (its tail filled as the document
                // rolled alone).
                let ids = match p.layout {
                    Some(l) => l.roll_within_documents(input_ids, j + 1, 0),
                    None => roll_rows(input_ids, s, j + 1, 0),
                };
                let targets = p.local_targets(&p.mtp_labels(j));
                let embedding = held(embed, "the token embedding (the MTP modules read it)")?;
                let embeds = rt.embed(embedding, &p.local(&ids), rows)?;
                let inputs = rt.masked_inputs(&p);
                hidden = module.forward_in(rt, embeds, hidden, rows, &mut trace, inputs)?;
                let (l, _) = rt.normed_head_loss(hidden.clone(), head, embed, &targets)?;
                mtp_losses.push(l);
            }
        }
        let selected = std::mem::take(&mut trace.selected);
        let out = ChunkForward::Loss(TrainForward {
            loss,
            mtp_losses,
            router_losses: trace.losses,
            expert_load: trace.expert_load,
        });
        Ok((out, selected))
    }

    /// The training forward of the whole model (`pp = 1`) on `batch` (with `mtp` the MTP
    /// depths), as [`train_chunk_traced`](Self::train_chunk_traced) of the one chunk.
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
            layers: 0..self.model.model.layers.len(),
            loss: true,
        };
        let place = (&whole, 0, None);
        match self.train_chunk_traced(place, batch, device, aux_grad_scale, mtp, record)? {
            (ChunkForward::Loss(out), selected) => Ok((out, selected)),
            _ => Err(ModelError::layout(
                "pp",
                "the whole model's forward returned no loss",
            )),
        }
    }

    /// This rank's vocabulary columns and TP group (vocab-parallel log-probs).
    pub(crate) fn runtime(&self) -> &SpRuntime {
        &self.rt
    }
}

/// Generation under any layout, as for [`super::ParallelQwen3Moe`]: the KV cache holds this
/// rank's MLA latents (the latent is not head-split, so every TP rank caches it whole), the
/// logits are gathered to the full vocabulary on every rank. The MTP modules are not used.
impl CausalLm for ParallelDeepseekV3 {
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

impl crate::rollout::RolloutModel for ParallelDeepseekV3 {
    fn device(&self) -> Device {
        self.model.device()
    }
}

impl ParallelCausalLm for DeepseekV3ForCausalLM {
    type Shard = ParallelDeepseekV3;

    fn shard(&self, groups: &GroupComms, kind: DispatcherKind) -> Result<Self::Shard, ModelError> {
        ParallelDeepseekV3::shard(self, groups, kind)
    }

    fn with_fp8(self, _recipe: Fp8Recipe, _linears: bool) -> Result<Self, ModelError> {
        Err(ModelError::unsupported(
            "fp8",
            "FP8 compute is not implemented for DeepSeek-V3 training (load FP8 releases \
             dequantised)",
        ))
    }
}

impl LoadShard for DeepseekV3ForCausalLM {
    type Config = DeepseekV3Config;

    fn load_shard(
        config: &DeepseekV3Config,
        source: &dyn WeightSource,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self::Shard, ModelError> {
        ParallelDeepseekV3::load(config, source, groups, kind, device)
    }

    fn shard_skeleton(
        config: &DeepseekV3Config,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self::Shard, ModelError> {
        ParallelDeepseekV3::skeleton(config, groups, kind, device)
    }
}

impl CausalLmShard for ParallelDeepseekV3 {
    type Model = DeepseekV3ForCausalLM;

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

    /// The main causal-LM loss and, with `mtp`, the loss of every MTP depth `j` on the full
    /// sequence length as Megatron computes it: the ids and labels of each row are rolled left
    /// by `j + 1` (the freed tail is masked out of the loss; attention being causal it never
    /// reaches the real positions), `u = eh_proj([enorm(embed(rolled ids)) ; hnorm(hʲ)])` on
    /// the sequence-parallel tokens (`h⁰` the main model's final-normed output), one decoder
    /// layer, `shared_head.norm`, and the shared vocab-parallel head and cross-entropy. Values
    /// at the real positions equal [`DeepseekV3ForCausalLM::forward_mtp`]'s.
    /// With a packed or padded batch the ids are rolled within every document (Megatron's
    /// `roll_tensor` of packed sequences: a document's tail gets id 0, as the document rolled
    /// alone) and depth `j`'s target at position `i` (token `i + j + 2`) counts only when
    /// positions `i ..= i + j + 2` are real tokens of one document.
    /// A routed batch ([`TrainBatch::with_routed_experts`]) replays its routing in the main
    /// model's MoE layers and, when it covers them, in the MTP modules' (which route
    /// naturally otherwise).
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

    /// The chunk's part of [`forward_train_batch`](Self::forward_train_batch): on the last
    /// virtual stage the main loss and, with `mtp`, the MTP depths.
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
        let place = (chunk, moe_offset, input);
        Ok(self
            .train_chunk_traced(place, batch, device, aux_grad_scale, mtp, false)?
            .0)
    }

    fn routing_spec(&self) -> Option<crate::replay::ReplaySpec> {
        Some(self.replay_spec())
    }

    crate::distributed::stage_accessors!();

    fn moe_layers_in(&self, layers: std::ops::Range<usize>) -> usize {
        (self
            .model
            .model
            .layers
            .get(layers)
            .unwrap_or_default()
            .iter())
        .filter(|l| matches!(l.mlp, DeepseekV3FeedForward::Moe(_)))
        .count()
    }

    fn mtp_depths(&self) -> usize {
        self.model.mtp.len()
    }

    fn routers_mut(&mut self) -> Vec<&mut TopKRouter> {
        let main = self.model.model.layers.iter_mut();
        let mtp = self.model.mtp.iter_mut().map(|m| &mut m.block);
        main.chain(mtp)
            .filter_map(|layer| match &mut layer.mlp {
                DeepseekV3FeedForward::Moe(block) => Some(&mut block.moe.router),
                DeepseekV3FeedForward::Dense(_) => None,
            })
            .collect()
    }
}
