//! DeepSeek-V3 under a [`ParallelLayout`](moe_backend::parallel::ParallelLayout): MLA with its
//! heads split over TP (`q_b_proj`/`q_proj` and `kv_b_proj` column-parallel by head, `o_proj`
//! row-parallel, the latent down-projections `q_a_proj`/`kv_a_proj_with_mqa` and their norms
//! replicated), dense MLPs TP-sharded, MoE blocks (sigmoid group-limited router with
//! `e_score_correction_bias`, routed experts over EP × ETP, shared experts replicated on the
//! sequence-parallel tokens), vocab-parallel embedding, head and cross-entropy. The MTP modules
//! are not part of the parallel forward.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Device, Tensor};
use moe_backend::comm::autograd::{
    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
};
use moe_backend::comm::{Comm, GroupComms};
use moe_backend::dispatch::TokenDispatcher;
use moe_backend::parallel::tensor_parallel::{
    column_parallel_linear, embed_vocab_parallel, row_parallel_linear,
    vocab_parallel_cross_entropy, vocab_parallel_embedding,
};
use moe_backend::parallel::{GroupFamily, replicate};
use moe_backend::router::RouteOptions;

use super::{
    DispatcherKind, ParallelOutput, check_batch, err, make_dispatcher, shard_mlp, shifted_targets,
};
use crate::ModelError;
use crate::causal_lm::IGNORE_INDEX;
use crate::deepseek_v3::{DeepseekV3FeedForward, DeepseekV3ForCausalLM};
use crate::layers::mla::MlaQuery;
use crate::layers::rope::RotaryEmbedding;

/// One rank's DeepSeek-V3 (see the module docs).
#[derive(Debug, Clone)]
pub struct ParallelDeepseekV3 {
    /// This rank's shard of the model (hand it to the optimizer).
    pub model: DeepseekV3ForCausalLM,
    tp: Comm,
    dispatcher: Arc<dyn TokenDispatcher>,
    vocab: Range<usize>,
    rope: RotaryEmbedding,
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
        let config = full.config().clone();
        let tp_comm = groups.comm(GroupFamily::Tp).clone();
        let (rank, tp) = (tp_comm.rank(), tp_comm.size());
        let dispatcher = make_dispatcher(groups, kind, config.n_routed_experts)?;
        let layout = &groups.groups.layout;
        let etp_rank = groups.groups.get(GroupFamily::ExptTp).index;
        let mut model = replicate(full);
        let (embed, vocab) =
            vocab_parallel_embedding(&full.model.embed_tokens, rank, tp).map_err(err)?;
        model.model.embed_tokens = embed;
        if let Some(head) = &full.lm_head {
            model.lm_head = Some(column_parallel_linear(head, rank, tp).map_err(err)?);
        }
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
                    DeepseekV3FeedForward::Dense(shard_mlp(mlp, rank, tp)?)
                }
                DeepseekV3FeedForward::Moe(block) => {
                    let mut block = block.clone();
                    block.moe.router = replicate(&block.moe.router);
                    block.moe.shared_experts = block.moe.shared_experts.as_ref().map(replicate);
                    block.moe.experts = block
                        .moe
                        .experts
                        .shard(dispatcher.local_experts(), etp_rank, layout.etp)
                        .map_err(err)?;
                    DeepseekV3FeedForward::Moe(block)
                }
            };
        }
        let dp_cp = groups.groups.get(GroupFamily::DpCp);
        Ok(Self {
            model,
            tp: tp_comm,
            dispatcher,
            vocab,
            rope: RotaryEmbedding::new(&config.rope_parameters, config.qk_rope_head_dim)?,
            replica: dp_cp.index,
            replicas: dp_cp.size(),
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
        let n = input_ids.len();
        let s = check_batch(input_ids, labels, batch, self.tp.size())?;
        let model = &self.model;
        let h = model.config().hidden_size;
        let rope = self.rope.tables(0, s, device);
        let gather = |x: Tensor<2>| gather_from_sequence_parallel_region(&self.tp, x, true);
        let scatter = |x: Tensor<2>| reduce_scatter_to_sequence_parallel_region(&self.tp, x);
        let mut router_logits = Vec::new();
        let mut x = embed_vocab_parallel(
            &model.model.embed_tokens,
            input_ids,
            batch,
            self.vocab.clone(),
            &self.tp,
            true,
        )
        .map_err(err)?;
        for layer in &model.model.layers {
            let full = gather(layer.input_layernorm.forward(x.clone())).map_err(err)?;
            let attn = layer
                .self_attn
                .forward(full.reshape([batch, s, h]), &rope, None);
            let h_sp = x + scatter(attn.reshape([n, h])).map_err(err)?;
            let normed = layer.post_attention_layernorm.forward(h_sp.clone());
            let y = match &layer.mlp {
                DeepseekV3FeedForward::Dense(mlp) => {
                    scatter(mlp.forward(gather(normed).map_err(err)?)).map_err(err)?
                }
                DeepseekV3FeedForward::Moe(block) => {
                    let state = block.moe.router.init_state();
                    let out = block
                        .moe
                        .forward_with(
                            normed,
                            &state,
                            &RouteOptions::default(),
                            self.dispatcher.as_ref(),
                        )
                        .map_err(err)?;
                    router_logits.push(out.routing.logits);
                    out.output
                }
            };
            x = h_sp + y;
        }
        let full = gather(model.model.norm.forward(x)).map_err(err)?;
        let logits = match &model.lm_head {
            Some(head) => head.forward(full),
            None => full.matmul(model.model.embed_tokens.weight.val().transpose()),
        };
        let loss = vocab_parallel_cross_entropy(
            logits.clone(),
            &shifted_targets(labels, s),
            IGNORE_INDEX,
            self.vocab.clone(),
            &self.tp,
        )
        .map_err(err)?;
        Ok(ParallelOutput {
            loss,
            logits,
            vocab: self.vocab.clone(),
            router_logits,
        })
    }
}
