//! What every sharded model shares: the TP group, the token dispatcher, this rank's vocabulary
//! columns, the RoPE tables, and the pieces of a sequence-parallel forward (vocab-parallel
//! embedding, gathered attention, TP MLP, MoE block, vocab-parallel head and loss) and of
//! sharding (embedding/head, MoE blocks).

use std::ops::Range;
use std::sync::Arc;

use burn::nn::{Embedding, Linear};
use burn::tensor::{Device, Tensor};
use moe_backend::comm::autograd::{
    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
};
use moe_backend::comm::{Comm, GroupComms};
use moe_backend::dispatch::TokenDispatcher;
use moe_backend::layer::MoeLayer;
use moe_backend::parallel::tensor_parallel::{
    column_parallel_linear, embed_vocab_parallel, vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
};
use moe_backend::parallel::{GroupFamily, replicate};
use moe_backend::router::RouteOptions;

use super::{DispatcherKind, ParallelOutput, err, make_dispatcher, shard_mlp, shifted_targets};
use crate::ModelError;
use crate::causal_lm::IGNORE_INDEX;
use crate::layers::rope::{RopeTables, RotaryEmbedding};
use crate::layers::{Mlp, RmsNorm};

/// One rank's parallel context for a sharded model.
#[derive(Debug, Clone)]
pub(crate) struct SpRuntime {
    pub(crate) tp: Comm,
    dispatcher: Arc<dyn TokenDispatcher>,
    /// This rank's vocabulary rows of the embedding / columns of the head.
    pub(crate) vocab: Range<usize>,
    rope: RotaryEmbedding,
    etp_rank: usize,
    etp: usize,
    /// Index in `dp_cp`.
    pub(crate) replica: usize,
    /// `|dp_cp|`.
    pub(crate) replicas: usize,
}

impl SpRuntime {
    /// The context of this rank (checks `pp = cp = 1`); `vocab_size` fixes the vocab shard.
    pub(crate) fn new(
        groups: &GroupComms,
        kind: DispatcherKind,
        num_experts: usize,
        vocab_size: usize,
        rope: RotaryEmbedding,
    ) -> Result<Self, ModelError> {
        let dispatcher = make_dispatcher(groups, kind, num_experts)?;
        let tp = groups.comm(GroupFamily::Tp).clone();
        let vocab = moe_backend::parallel::tensor_parallel::shard_range(
            "vocabulary",
            vocab_size,
            tp.rank(),
            tp.size(),
        )
        .map_err(err)?;
        let dp_cp = groups.groups.get(GroupFamily::DpCp);
        Ok(Self {
            tp,
            dispatcher,
            vocab,
            rope,
            etp_rank: groups.groups.get(GroupFamily::ExptTp).index,
            etp: groups.groups.layout.etp,
            replica: dp_cp.index,
            replicas: dp_cp.size(),
        })
    }

    /// `(rank, size)` in the TP group.
    pub(crate) fn tp_rank_size(&self) -> (usize, usize) {
        (self.tp.rank(), self.tp.size())
    }

    /// Vocab-parallel shards of the embedding and the (untied) head.
    pub(crate) fn shard_embeddings(
        &self,
        embed: &Embedding,
        head: Option<&Linear>,
    ) -> Result<(Embedding, Option<Linear>), ModelError> {
        let (rank, tp) = self.tp_rank_size();
        let (embed, _) = vocab_parallel_embedding(embed, rank, tp).map_err(err)?;
        let head = head
            .map(|h| column_parallel_linear(h, rank, tp))
            .transpose()
            .map_err(err)?;
        Ok((embed, head))
    }

    /// TP shard of a dense SwiGLU MLP.
    pub(crate) fn shard_mlp(&self, mlp: &Mlp) -> Result<Mlp, ModelError> {
        let (rank, tp) = self.tp_rank_size();
        shard_mlp(mlp, rank, tp)
    }

    /// This rank's MoE block: router and shared experts replicated (fed by sequence-parallel
    /// tokens), routed experts cut to the dispatcher's local experts and this ETP block.
    pub(crate) fn shard_moe(&self, moe: &MoeLayer) -> Result<MoeLayer, ModelError> {
        let mut out = moe.clone();
        out.router = replicate(&moe.router);
        out.shared_experts = moe.shared_experts.as_ref().map(replicate);
        out.experts = moe
            .experts
            .shard(self.dispatcher.local_experts(), self.etp_rank, self.etp)
            .map_err(err)?;
        Ok(out)
    }

    /// RoPE tables of positions `0..s`.
    pub(crate) fn rope(&self, s: usize, device: &Device) -> RopeTables {
        self.rope.tables(0, s, device)
    }

    /// This rank's sequence-parallel block `[B·S/tp, H]` of the embedded `ids`.
    pub(crate) fn embed(
        &self,
        embed: &Embedding,
        ids: &[i64],
        batch: usize,
    ) -> Result<Tensor<2>, ModelError> {
        embed_vocab_parallel(embed, ids, batch, self.vocab.clone(), &self.tp, true).map_err(err)
    }

    fn gather(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        gather_from_sequence_parallel_region(&self.tp, x, true).map_err(err)
    }

    fn scatter(&self, x: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        reduce_scatter_to_sequence_parallel_region(&self.tp, x).map_err(err)
    }

    /// `x + attention(norm(x))`: the normed SP block is all-gathered to `[batch, S, H]`, the
    /// head shard runs `attention`, and its partial output is reduce-scattered back.
    pub(crate) fn attention_residual(
        &self,
        x: Tensor<2>,
        norm: &RmsNorm,
        batch: usize,
        attention: impl FnOnce(Tensor<3>) -> Tensor<3>,
    ) -> Result<Tensor<2>, ModelError> {
        let full = self.gather(norm.forward(x.clone()))?;
        let [n, h] = full.dims();
        let out = attention(full.reshape([batch, n / batch, h]));
        Ok(x + self.scatter(out.reshape([n, h]))?)
    }

    /// A TP-sharded dense MLP on the SP block (gather, column/row shard, reduce-scatter).
    pub(crate) fn dense_mlp(&self, mlp: &Mlp, normed: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        self.scatter(mlp.forward(self.gather(normed)?))
    }

    /// The MoE block on this rank's SP tokens; its router logits are appended to `logits`.
    pub(crate) fn moe(
        &self,
        moe: &MoeLayer,
        normed: Tensor<2>,
        logits: &mut Vec<Tensor<2>>,
    ) -> Result<Tensor<2>, ModelError> {
        let state = moe.router.init_state();
        let out = moe
            .forward_with(
                normed,
                &state,
                &RouteOptions::default(),
                self.dispatcher.as_ref(),
            )
            .map_err(err)?;
        logits.push(out.routing.logits);
        Ok(out.output)
    }

    /// Final norm, vocab-parallel head (tied to the embedding shard without `lm_head`) and
    /// vocab-parallel cross-entropy of the shifted `labels`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn head_loss(
        &self,
        x: Tensor<2>,
        norm: &RmsNorm,
        lm_head: Option<&Linear>,
        embed: &Embedding,
        labels: &[i64],
        s: usize,
        router_logits: Vec<Tensor<2>>,
    ) -> Result<ParallelOutput, ModelError> {
        let full = self.gather(norm.forward(x))?;
        let logits = match lm_head {
            Some(head) => head.forward(full),
            None => full.matmul(embed.weight.val().transpose()),
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
