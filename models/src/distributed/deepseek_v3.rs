//! DeepSeek-V3 under a [`ParallelLayout`](moe_backend::parallel::ParallelLayout): MLA with its
//! heads split over TP (`q_b_proj`/`q_proj` and `kv_b_proj` column-parallel by head, `o_proj`
//! row-parallel, the latent down-projections `q_a_proj`/`kv_a_proj_with_mqa` and their norms
//! replicated), dense MLPs TP-sharded, MoE blocks (sigmoid group-limited router with
//! `e_score_correction_bias`, routed experts over EP × ETP, shared experts replicated on the
//! sequence-parallel tokens), vocab-parallel embedding, head and cross-entropy. The MTP modules
//! are not part of the parallel forward.

use burn::tensor::Device;
use moe_backend::comm::GroupComms;
use moe_backend::parallel::replicate;
use moe_backend::parallel::tensor_parallel::{column_parallel_linear, row_parallel_linear};

use super::runtime::{RouterTrace, SpRuntime};
use super::{DispatcherKind, ParallelOutput, check_batch, err};
use crate::ModelError;
use crate::deepseek_v3::{DeepseekV3FeedForward, DeepseekV3ForCausalLM, DeepseekV3Moe};
use crate::layers::mla::MlaQuery;
use crate::layers::rope::RotaryEmbedding;

/// One rank's DeepSeek-V3 (see the module docs).
#[derive(Debug, Clone)]
pub struct ParallelDeepseekV3 {
    /// This rank's shard of the model (hand it to the optimizer).
    pub model: DeepseekV3ForCausalLM,
    rt: SpRuntime,
    /// This rank's data-parallel replica (index in `dp_cp`).
    pub replica: usize,
    /// Number of data-parallel replicas.
    pub replicas: usize,
}

impl ParallelDeepseekV3 {
    /// This rank's shard of `full` (heads, vocabulary and FFN widths divisible by `tp`,
    /// experts by `ep`, expert width by `etp`; `pp = cp = 1`).
    pub fn shard(
        full: &DeepseekV3ForCausalLM,
        groups: &GroupComms,
        kind: DispatcherKind,
    ) -> Result<Self, ModelError> {
        let config = full.config();
        let rope = RotaryEmbedding::new(&config.rope_parameters, config.qk_rope_head_dim)?;
        let rt = SpRuntime::new(
            groups,
            kind,
            config.n_routed_experts,
            config.vocab_size,
            rope,
        )?;
        let (rank, tp) = rt.tp_rank_size();
        let mut model = replicate(full);
        (model.model.embed_tokens, model.lm_head) =
            rt.shard_embeddings(&full.model.embed_tokens, full.lm_head.as_ref())?;
        for (dst, src) in model.model.layers.iter_mut().zip(&full.model.layers) {
            let attn = &src.self_attn;
            if attn.num_heads % tp != 0 {
                return Err(ModelError::invalid(
                    "tp",
                    format!("{} heads cannot be split over tp = {tp}", attn.num_heads),
                ));
            }
            let a = &mut dst.self_attn;
            match (&mut a.query, &attn.query) {
                (MlaQuery::Direct(q), MlaQuery::Direct(full_q)) => {
                    *q = column_parallel_linear(full_q, rank, tp).map_err(err)?;
                }
                (MlaQuery::LowRank(q), MlaQuery::LowRank(full_q)) => {
                    q.q_b_proj = column_parallel_linear(&full_q.q_b_proj, rank, tp).map_err(err)?;
                }
                _ => return Err(ModelError::invalid("q_lora_rank", "query layouts differ")),
            }
            a.kv_b_proj = column_parallel_linear(&attn.kv_b_proj, rank, tp).map_err(err)?;
            a.o_proj = row_parallel_linear(&attn.o_proj, rank, tp).map_err(err)?;
            a.num_heads = attn.num_heads / tp;
            dst.mlp = match &src.mlp {
                DeepseekV3FeedForward::Dense(mlp) => {
                    DeepseekV3FeedForward::Dense(rt.shard_mlp(mlp)?)
                }
                DeepseekV3FeedForward::Moe(block) => DeepseekV3FeedForward::Moe(DeepseekV3Moe {
                    moe: rt.shard_moe(&block.moe)?,
                }),
            };
        }
        Ok(Self {
            model,
            replica: rt.replica,
            replicas: rt.replicas,
            rt,
        })
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
        let rt = &self.rt;
        let s = check_batch(input_ids, labels, batch, rt.tp.size())?;
        let model = &self.model.model;
        let rope = rt.rope(s, device);
        let mut trace = RouterTrace::new(1.0);
        let mut x = rt.embed(&model.embed_tokens, input_ids, batch)?;
        for layer in &model.layers {
            let h = rt.attention_residual(x, &layer.input_layernorm, batch, |full| {
                layer.self_attn.forward(full, &rope, None)
            })?;
            let normed = layer.post_attention_layernorm.forward(h.clone());
            let y = match &layer.mlp {
                DeepseekV3FeedForward::Dense(mlp) => rt.dense_mlp(mlp, normed)?,
                DeepseekV3FeedForward::Moe(block) => rt.moe(&block.moe, normed, &mut trace)?,
            };
            x = h + y;
        }
        rt.head_loss(
            x,
            &model.norm,
            self.model.lm_head.as_ref(),
            &model.embed_tokens,
            labels,
            s,
            trace,
        )
    }
}
