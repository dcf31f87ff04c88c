//! Dense Qwen3 under a [`ParallelLayout`](moe_backend::parallel::ParallelLayout): attention
//! heads and MLP widths over TP with sequence parallelism, vocab-parallel embedding, head and
//! cross-entropy, data parallelism over the remaining ranks (expert-parallel sizes have no
//! expert to split and only fold into the data-parallel ranks).

use burn::tensor::{Device, Int, Tensor};
use moe_backend::comm::GroupComms;
use moe_backend::fp8::Fp8Recipe;
use moe_backend::router::TopKRouter;

use super::runtime::{RouterTrace, SpRuntime};
use super::sharded::{CausalLmShard, LoadShard, ParallelCausalLm, TrainForward};
use super::{DispatcherKind, ShardParts, build_shard};
use crate::ModelError;
use crate::causal_lm::CausalLm;
use crate::config::Qwen3Config;
use crate::layers::KvCache;
use crate::layers::rope::RotaryEmbedding;
use crate::qwen3::Qwen3ForCausalLM;
use crate::train::TrainBatch;
use crate::weights::{ModuleWeights, WeightLoader, WeightSource, adopt_param_ids};

/// One rank's dense Qwen3.
#[derive(Debug, Clone)]
pub struct ParallelQwen3 {
    /// This rank's shard of the model (hand it to the optimizer).
    pub model: Qwen3ForCausalLM,
    rt: SpRuntime,
    /// This rank's data-parallel replica (index in `dp`; its context-parallel ranks share it).
    pub replica: usize,
    /// Number of data-parallel replicas.
    pub replicas: usize,
}

impl ShardParts for ParallelQwen3 {
    type Config = Qwen3Config;
    type Model = Qwen3ForCausalLM;

    fn context(
        config: &Qwen3Config,
        groups: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<SpRuntime, ModelError> {
        let rope = RotaryEmbedding::new(&config.rope_parameters, config.head_dim)?;
        let model = super::PipelineModel {
            layers: config.num_hidden_layers,
            mtp: 0,
            tied: config.tie_word_embeddings,
            hidden: config.hidden_size,
        };
        SpRuntime::new(groups, kind, None, config.vocab_size, rope)?.with_pipeline(groups, model)
    }

    fn from_loader(
        config: &Qwen3Config,
        loader: &WeightLoader<'_>,
    ) -> Result<Qwen3ForCausalLM, ModelError> {
        Qwen3ForCausalLM::from_loader(config, loader)
    }

    fn from_local(model: Qwen3ForCausalLM, rt: SpRuntime) -> Self {
        Self {
            model,
            replica: rt.replica,
            replicas: rt.replicas,
            rt,
        }
    }
}

impl ParallelQwen3 {
    /// This rank's shard read straight from `source`: only this rank's box of every tensor
    /// (attention heads, MLP widths, embedding and head over TP; norms whole).
    /// Requirements as [`shard`](Self::shard).
    pub fn load(
        config: &Qwen3Config,
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
        config: &Qwen3Config,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self, ModelError> {
        build_shard(config, None, groups, kind, device)
    }

    /// This rank's shard of `full` (heads, KV heads, vocabulary and MLP width divisible by
    /// `tp`; its pipeline stage only): [`load`](Self::load) reading `full`'s tensors box by box
    /// ([`ModuleWeights`]) on `full`'s device, with `full`'s FP8 settings.
    pub fn shard(
        full: &Qwen3ForCausalLM,
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
            dst.mlp.fp8 = src.mlp.fp8;
        }
        Ok(shard)
    }
}

impl CausalLm for ParallelQwen3 {
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

impl crate::rollout::RolloutModel for ParallelQwen3 {
    fn device(&self) -> Device {
        self.model.device()
    }
}

impl ParallelCausalLm for Qwen3ForCausalLM {
    type Shard = ParallelQwen3;

    fn shard(&self, groups: &GroupComms, kind: DispatcherKind) -> Result<Self::Shard, ModelError> {
        ParallelQwen3::shard(self, groups, kind)
    }

    fn with_fp8(self, _recipe: Fp8Recipe, _linears: bool) -> Result<Self, ModelError> {
        Err(ModelError::unsupported(
            "fp8",
            "FP8 compute is not implemented for dense Qwen3 training",
        ))
    }
}

impl LoadShard for Qwen3ForCausalLM {
    type Config = Qwen3Config;

    fn load_shard(
        config: &Qwen3Config,
        source: &dyn WeightSource,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self::Shard, ModelError> {
        ParallelQwen3::load(config, source, groups, kind, device)
    }

    fn shard_skeleton(
        config: &Qwen3Config,
        groups: &GroupComms,
        kind: DispatcherKind,
        device: &Device,
    ) -> Result<Self::Shard, ModelError> {
        ParallelQwen3::skeleton(config, groups, kind, device)
    }
}

impl CausalLmShard for ParallelQwen3 {
    type Model = Qwen3ForCausalLM;

    fn model(&self) -> &Self::Model {
        &self.model
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
        if batch.routed_experts().is_some() {
            return Err(ModelError::input(
                "routed_experts",
                "the dense Qwen3 model has no MoE router to replay a routing in",
            ));
        }
        let (out, _, _) = self.rt.loss_forward(
            &self.model,
            &batch.input_ids,
            &batch.labels,
            batch.batch,
            batch.layout(),
            device,
            RouterTrace::new(aux_grad_scale),
        )?;
        Ok(TrainForward {
            loss: out.loss,
            mtp_losses: Vec::new(),
            router_losses: Vec::new(),
            expert_load: Vec::new(),
        })
    }

    crate::distributed::stage_accessors!(decoder_stack);

    fn moe_layers_in(&self, _layers: std::ops::Range<usize>) -> usize {
        0
    }

    fn routers_mut(&mut self) -> Vec<&mut TopKRouter> {
        Vec::new()
    }
}
