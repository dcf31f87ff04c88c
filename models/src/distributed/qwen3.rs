//! Dense Qwen3 under a [`ParallelLayout`](moe_backend::parallel::ParallelLayout): attention
//! heads and MLP widths over TP with sequence parallelism, vocab-parallel embedding, head and
//! cross-entropy, data parallelism over the remaining ranks (expert-parallel sizes have no
//! expert to split and only fold into the data-parallel ranks).

use burn::tensor::Device;
use moe_backend::comm::GroupComms;
use moe_backend::fp8::Fp8Recipe;
use moe_backend::parallel::replicate;
use moe_backend::router::TopKRouter;

use super::runtime::SpRuntime;
use super::sharded::{CausalLmShard, ParallelCausalLm, TrainForward};
use super::{DispatcherKind, shard_attention};
use crate::ModelError;
use crate::layers::rope::RotaryEmbedding;
use crate::qwen3::Qwen3ForCausalLM;
use crate::train::TrainBatch;

/// One rank's dense Qwen3.
#[derive(Debug, Clone)]
pub struct ParallelQwen3 {
    /// This rank's shard of the model (hand it to the optimizer).
    pub model: Qwen3ForCausalLM,
    rt: SpRuntime,
    /// This rank's data-parallel replica (index in `dp_cp`).
    pub replica: usize,
    /// Number of data-parallel replicas.
    pub replicas: usize,
}

impl ParallelQwen3 {
    /// This rank's shard of `full` (heads, KV heads, vocabulary and MLP width divisible by
    /// `tp`; `pp = cp = 1`).
    pub fn shard(
        full: &Qwen3ForCausalLM,
        groups: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<Self, ModelError> {
        let config = full.config();
        let rope = RotaryEmbedding::new(&config.rope_parameters, config.head_dim)?;
        let rt = SpRuntime::new(groups, kind, None, config.vocab_size, rope)?;
        let mut model = replicate(full);
        (model.model.embed_tokens, model.lm_head) =
            rt.shard_embeddings(&full.model.embed_tokens, full.lm_head.as_ref())?;
        for (dst, src) in model.model.layers.iter_mut().zip(&full.model.layers) {
            shard_attention(&rt, &mut dst.self_attn, &src.self_attn)?;
            dst.mlp = rt.shard_mlp(&src.mlp)?;
        }
        Ok(Self {
            model,
            replica: rt.replica,
            replicas: rt.replicas,
            rt,
        })
    }
}

impl ParallelCausalLm for Qwen3ForCausalLM {
    type Shard = ParallelQwen3;

    fn shard(&self, groups: &GroupComms, kind: DispatcherKind) -> Result<Self::Shard, ModelError> {
        ParallelQwen3::shard(self, groups, kind)
    }

    fn with_fp8(self, _recipe: Fp8Recipe, _linears: bool) -> Result<Self, ModelError> {
        Err(ModelError::invalid(
            "fp8",
            "FP8 compute is not implemented for dense Qwen3 training",
        ))
    }

    fn is_fp8_linear_weight(_path: &str) -> bool {
        false
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

    fn forward_train_batch(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        _mtp: bool,
    ) -> Result<TrainForward, ModelError> {
        let rt = &self.rt;
        let (input_ids, rows) = (&batch.input_ids, batch.batch);
        let p = rt.prepare(input_ids, &batch.labels, rows, batch.layout(), device)?;
        let model = &self.model.model;
        let mut x = rt.embed(&model.embed_tokens, input_ids, rows)?;
        for layer in &model.layers {
            let h = rt.attention_residual(x, &layer.input_layernorm, rows, |full| {
                layer
                    .self_attn
                    .forward_masked(full, &p.rope, p.mask.as_ref())
            })?;
            let normed = layer.post_attention_layernorm.forward(h.clone());
            x = h + rt.dense_mlp(&layer.mlp, normed)?;
        }
        let out = rt.head_loss(
            x,
            &model.norm,
            self.model.lm_head.as_ref(),
            &model.embed_tokens,
            &p.labels,
            p.s,
            p.trace(aux_grad_scale),
        )?;
        Ok(TrainForward {
            loss: out.loss,
            mtp_losses: Vec::new(),
            router_losses: Vec::new(),
            expert_load: Vec::new(),
        })
    }

    fn routers_mut(&mut self) -> Vec<&mut TopKRouter> {
        Vec::new()
    }
}
