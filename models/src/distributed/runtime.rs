//! What every sharded model shares: the TP group, the token dispatcher, this rank's vocabulary
//! columns, the RoPE tables, and the pieces of a sequence-parallel forward (vocab-parallel
//! embedding, gathered attention, TP MLP, MoE block, vocab-parallel head and loss) and of
//! sharding (embedding/head, MoE blocks).

use std::ops::Range;
use std::sync::Arc;

use burn::nn::{Embedding, Linear};
use burn::tensor::{Bool, Device, Int, Tensor};
use moe_backend::comm::autograd::{
    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
};
use moe_backend::comm::{Comm, GroupComms};
use moe_backend::dispatch::TokenDispatcher;
use moe_backend::layer::MoeLayer;
use moe_backend::parallel::tensor_parallel::{embed_vocab_parallel, vocab_parallel_cross_entropy};
use moe_backend::parallel::{GroupCountReducer, GroupFamily};
use moe_backend::router::{ReplayMode, RouteOptions, RouterLoss};

use super::sharded::mtp_labels;
use super::{
    DispatcherKind, ParallelOutput, check_batch, check_no_pp_cp, err, make_dispatcher,
    shifted_targets,
};
use crate::ModelError;
use crate::causal_lm::IGNORE_INDEX;
use crate::layers::rope::{RopeTables, RotaryEmbedding};
use crate::layers::{AttentionMask, Mlp, RmsNorm};
use crate::packing::{PackedInputs, SequenceLayout};
use crate::weights::ShardSpec;

/// One rank's parallel context for a sharded model (public as
/// [`ParallelContext`](crate::distributed::ParallelContext)): the TP group, the MoE blocks'
/// token dispatcher, this rank's vocabulary shard and RoPE tables, and the pieces of a
/// sequence-parallel forward. A model's forward written against it is the same code under
/// every layout; at `world = 1` every collective is the identity and the dispatcher local.
///
/// Activations between blocks are this rank's sequence-parallel block `[B·S/tp, H]` of the
/// replica's batch-major `B·S` token rows: [`embed`](Self::embed) produces it,
/// [`attention_residual`](Self::attention_residual), [`dense_mlp`](Self::dense_mlp) and
/// [`moe`](Self::moe) map it, [`head_loss`](Self::head_loss) ends the forward. Cut the
/// model's shard for [`shard_spec`](Self::shard_spec) (e.g. with
/// [`crate::param_plan::shard_by_plan`]).
#[derive(Debug, Clone)]
pub struct SpRuntime {
    pub(crate) tp: Comm,
    /// The MoE blocks' token dispatcher (`None` for a dense model).
    dispatcher: Option<Arc<dyn TokenDispatcher>>,
    /// This rank's vocabulary rows of the embedding / columns of the head.
    pub(crate) vocab: Range<usize>,
    rope: RotaryEmbedding,
    etp_rank: usize,
    etp: usize,
    /// Index in `dp_cp`.
    pub(crate) replica: usize,
    /// `|dp_cp|`.
    pub(crate) replicas: usize,
    /// Sums the routers' aux-loss counts over `tp_cp` / `tp_dp_cp`.
    reducer: GroupCountReducer,
    /// `|tp_cp|` and `|tp_dp_cp|` (the routers' loss groups).
    pub(crate) loss_groups: (usize, usize),
    /// `global_aux_loss` running counts of the current global batch, per MoE layer.
    global_aux: GlobalAuxCounts,
}

/// Per MoE layer (forward order): the reduced `global_aux_loss` counts `G` of the global
/// batch's micro-batches so far and their number `n` (moe-ops §4). Training forwards add to
/// them; the trainer clears them at the start of each step. A clone starts from a copy.
#[derive(Debug, Default)]
struct GlobalAuxCounts(std::sync::Mutex<Vec<(Vec<f64>, usize)>>);

impl GlobalAuxCounts {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Vec<f64>, usize)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Clone for GlobalAuxCounts {
    fn clone(&self) -> Self {
        Self(std::sync::Mutex::new(self.lock().clone()))
    }
}

/// What the MoE blocks of one forward report: router logits and the router losses of every
/// sparse layer (in layer order), and the gradient scale of the attached router losses.
#[derive(Debug, Clone)]
pub struct RouterTrace {
    /// Router logits `[T_local, E]` of every MoE layer so far.
    pub logits: Vec<Tensor<2>>,
    /// Router losses of every MoE layer so far.
    pub losses: Vec<Vec<RouterLoss>>,
    /// Upstream gradient of the attached losses (`1 / micro-batches` in training).
    pub aux_grad_scale: f64,
    /// Router replay: per sparse layer (layer order), this rank's forced `[T_local, k]`
    /// expert ids (the routers run in `ReplayForward` mode).
    pub replay: Option<Vec<Tensor<2, Int>>>,
    /// Whether [`selected`](Self::selected) collects the routing of every sparse layer.
    pub record: bool,
    /// Per sparse layer (layer order), this rank's selected `[T_local, k]` expert ids, when
    /// [`record`](Self::record) is set.
    pub selected: Vec<Tensor<2, Int>>,
    /// Per MoE layer (forward order), this rank's expert-bias token counts of a grad-enabled
    /// forward (`None` for routers without an expert bias).
    pub expert_load: Vec<Option<Vec<f64>>>,
    /// The routers' padding mask `[T_local]` (`true` = padded) of this rank's
    /// sequence-parallel rows, for a padded or packed batch.
    pub padding: Option<Tensor<1, Bool>>,
}

/// The per-forward inputs of one replica batch after its checks: the row length, RoPE tables
/// (per row for a packed or padded batch), the attention mask and this rank's router padding
/// rows of such a batch, and the labels the loss scores (masked by the layout).
#[derive(Debug, Clone)]
pub struct Prepared<'a> {
    /// Tokens per row `S`.
    pub s: usize,
    /// RoPE tables of the batch's positions.
    pub rope: RopeTables,
    /// The attention mask of a packed or padded batch.
    pub mask: Option<AttentionMask>,
    /// This rank's router padding rows of a packed or padded batch.
    pub padding: Option<Tensor<1, Bool>>,
    /// The labels, with [`SequenceLayout::mask_labels`] applied.
    pub labels: Vec<i64>,
    /// The batch's layout.
    pub layout: Option<&'a SequenceLayout>,
}

impl Prepared<'_> {
    /// A fresh router trace carrying this batch's padding rows.
    pub fn trace(&self, aux_grad_scale: f64) -> RouterTrace {
        RouterTrace {
            padding: self.padding.clone(),
            ..RouterTrace::new(aux_grad_scale)
        }
    }

    /// The labels of multi-token-prediction depth `j` on the full row length (Megatron's
    /// rolled sequence): every row shifted left by `j + 1`, the freed tail −100, and with a
    /// layout every target whose predicting position lies in another document (or is
    /// padding) −100 as well.
    pub(crate) fn mtp_labels(&self, j: usize) -> Vec<i64> {
        mtp_labels(&self.labels, self.s, j, self.layout)
    }
}

impl RouterTrace {
    /// An empty trace whose attached router losses get the upstream gradient
    /// `aux_grad_scale` (the trainer passes `1 / micro-batches`).
    pub fn new(aux_grad_scale: f64) -> Self {
        Self {
            logits: Vec::new(),
            losses: Vec::new(),
            aux_grad_scale,
            replay: None,
            record: false,
            selected: Vec::new(),
            expert_load: Vec::new(),
            padding: None,
        }
    }
}

impl SpRuntime {
    /// The context of this rank (checks `pp = cp = 1`); `vocab_size` fixes the vocab shard;
    /// `num_experts` is `None` for a dense model (no dispatcher).
    pub fn new(
        groups: &GroupComms,
        kind: DispatcherKind,
        num_experts: Option<usize>,
        vocab_size: usize,
        rope: RotaryEmbedding,
    ) -> Result<Self, ModelError> {
        let dispatcher = match num_experts {
            Some(e) => Some(make_dispatcher(groups, kind, e)?),
            None => {
                check_no_pp_cp(groups)?;
                None
            }
        };
        let tp = groups.comm(GroupFamily::Tp).clone();
        let vocab = moe_backend::parallel::tensor_parallel::shard_range(
            "vocabulary",
            vocab_size,
            tp.rank(),
            tp.size(),
        )
        .map_err(err)?;
        let dp_cp = groups.groups.get(GroupFamily::DpCp);
        let loss_groups = (
            groups.groups.get(GroupFamily::TpCp).size(),
            groups.groups.get(GroupFamily::TpDpCp).size(),
        );
        Ok(Self {
            reducer: GroupCountReducer::new(groups),
            loss_groups,
            global_aux: GlobalAuxCounts::default(),
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

    /// Sizes of this rank's `tp_cp` and `tp_dp_cp` groups (the routers' count groups, what
    /// [`crate::distributed::CausalLmShard::loss_groups`] returns).
    pub fn loss_groups(&self) -> (usize, usize) {
        self.loss_groups
    }

    /// This rank's vocabulary rows of the embedding / columns of the LM head.
    pub fn vocab(&self) -> Range<usize> {
        self.vocab.clone()
    }

    /// This rank's data-parallel replica (index in `dp_cp`).
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// Number of data-parallel replicas (`|dp_cp|`).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The token dispatcher (an error for a dense model's context).
    fn dispatcher(&self) -> Result<&dyn TokenDispatcher, ModelError> {
        self.dispatcher
            .as_deref()
            .ok_or_else(|| ModelError::input("model", "a dense model has no MoE block"))
    }

    /// The part of every canonical tensor this rank holds: its TP coordinates, the
    /// dispatcher's local experts (all of them for a dense model) and its ETP block.
    pub fn shard_spec(&self) -> ShardSpec {
        let (tp_rank, tp) = self.tp_rank_size();
        ShardSpec {
            tp_rank,
            tp,
            experts: self.dispatcher.as_ref().map(|d| d.local_experts()),
            etp_rank: self.etp_rank,
            etp: self.etp,
        }
    }

    /// `(rank, size)` in the TP group.
    pub fn tp_rank_size(&self) -> (usize, usize) {
        (self.tp.rank(), self.tp.size())
    }

    /// RoPE tables of positions `0..s`.
    pub fn rope(&self, s: usize, device: &Device) -> RopeTables {
        self.rope.tables(0, s, device)
    }

    /// Checks a replica batch (`input_ids` and `labels [batch, S]`, `B·S` divisible by `tp`,
    /// `layout` of the same shape) and builds its per-forward inputs. Attention runs on the
    /// gathered full sequence, so the mask is the replica's; the router padding mask is this
    /// rank's block of the batch-major `[B·S]` rows.
    pub fn prepare<'a>(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        layout: Option<&'a SequenceLayout>,
        device: &Device,
    ) -> Result<Prepared<'a>, ModelError> {
        let s = check_batch(input_ids, labels, batch, self.tp.size())?;
        let mut labels = labels.to_vec();
        let Some(l) = layout else {
            return Ok(Prepared {
                s,
                rope: self.rope(s, device),
                mask: None,
                padding: None,
                labels,
                layout: None,
            });
        };
        l.check_shape("input_ids", batch, s)?;
        l.mask_labels(&mut labels);
        let (rank, tp) = self.tp_rank_size();
        let local = batch * s / tp;
        let packed =
            PackedInputs::for_rows(l, &self.rope, rank * local..(rank + 1) * local, device);
        Ok(Prepared {
            s,
            rope: packed.rope,
            mask: Some(packed.mask),
            padding: Some(packed.padding),
            labels,
            layout: Some(l),
        })
    }

    /// This rank's sequence-parallel block `[B·S/tp, H]` of the embedded `ids`.
    pub fn embed(
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
    pub fn attention_residual(
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
    pub fn dense_mlp(&self, mlp: &Mlp, normed: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        self.scatter(mlp.forward(self.gather(normed)?))
    }

    /// The MoE block on this rank's SP tokens (`batch` sequences in the replica's micro-batch);
    /// its router logits and losses are appended to `trace`. The router's load-balancing
    /// losses (if configured) use counts summed over `tp_cp` / `tp_dp_cp` and are attached
    /// with `trace.aux_grad_scale`; `seq_aux_loss` groups the rows by their sequence.
    pub fn moe(
        &self,
        moe: &MoeLayer,
        normed: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
    ) -> Result<Tensor<2>, ModelError> {
        let mut state = moe.router.init_state();
        if let Some(replay) = &trace.replay {
            let layer = trace.logits.len();
            let idx = replay
                .get(layer)
                .cloned()
                .ok_or_else(|| ModelError::InvalidInput {
                    what: "routed_experts.layers",
                    reason: format!("no replayed routing for sparse layer {layer}"),
                })?;
            state.replay.set_indices(idx);
            state.replay.set_mode(ReplayMode::ReplayForward);
        }
        let layer = trace.logits.len();
        if let Some((counts, steps)) = self.global_aux.lock().get(layer) {
            state.set_global_aux(counts, *steps).map_err(err)?;
        }
        let rows = self.row_sequences(normed.dims()[0], batch)?;
        let mut options = RouteOptions::default()
            .with_batch_size(batch)
            .with_row_sequences(&rows)
            .with_count_reducer(&self.reducer)
            .with_grad_scale(trace.aux_grad_scale);
        if let Some(padding) = &trace.padding {
            options = options.with_padding_mask(padding.clone());
        }
        let out = moe
            .forward_with(normed, &state, &options, self.dispatcher()?)
            .map_err(err)?;
        if trace.record {
            trace.selected.push(out.routing.topk_indices.clone());
        }
        trace.logits.push(out.routing.logits);
        trace.losses.push(out.routing.losses);
        trace.expert_load.push(out.routing.state_update.expert_load);
        if let Some(counts) = out.routing.state_update.global_aux_counts {
            let mut store = self.global_aux.lock();
            if store.len() <= layer {
                store.resize(layer + 1, (vec![0.0; counts.len()], 0));
            }
            let (sum, steps) = &mut store[layer];
            sum.iter_mut().zip(&counts).for_each(|(g, c)| *g += c);
            *steps += 1;
        }
        Ok(out.output)
    }

    /// Clears the `global_aux_loss` running counts (a new global batch starts).
    pub fn reset_global_aux(&self) {
        self.global_aux.lock().clear();
    }

    /// The sequence (`0..batch`) of each of this rank's `local` sequence-parallel rows: the
    /// replica's `[batch·S]` batch-major rows are cut into `tp` contiguous blocks.
    fn row_sequences(&self, local: usize, batch: usize) -> Result<Vec<usize>, ModelError> {
        let (rank, tp) = self.tp_rank_size();
        let rows = local * tp;
        if batch == 0 || !rows.is_multiple_of(batch) {
            return Err(ModelError::InvalidInput {
                what: "batch",
                reason: format!("{rows} token rows do not split into {batch} sequences"),
            });
        }
        let s = rows / batch;
        Ok((rank * local..(rank + 1) * local).map(|r| r / s).collect())
    }

    /// Final norm, vocab-parallel head (tied to the embedding shard without `lm_head`) and
    /// vocab-parallel cross-entropy of the shifted `labels`.
    #[allow(clippy::too_many_arguments)]
    pub fn head_loss(
        &self,
        x: Tensor<2>,
        norm: &RmsNorm,
        lm_head: Option<&Linear>,
        embed: &Embedding,
        labels: &[i64],
        s: usize,
        trace: RouterTrace,
    ) -> Result<ParallelOutput, ModelError> {
        let (loss, logits) = self.normed_head_loss(norm.forward(x), lm_head, embed, labels, s)?;
        Ok(ParallelOutput {
            loss,
            logits,
            vocab: self.vocab.clone(),
            router_logits: trace.logits,
            router_losses: trace.losses,
        })
    }

    /// Logits `[batch, S, V]` (full vocabulary, identical on the replica's TP ranks) of the
    /// next `S` positions after those in `cache`, for generation: the ids are embedded
    /// vocab-parallel, `layer(i, x, batch, rope, layer_cache, trace)` runs decoder layer `i` on
    /// the sequence-parallel block with this rank's part of the KV cache, and the head's
    /// logits are gathered ([`full_logits`](Self::full_logits)). `batch · S` must split over
    /// `tp`.
    #[allow(clippy::too_many_arguments)]
    pub fn cached_logits(
        &self,
        input_ids: Tensor<2, Int>,
        cache: &mut crate::layers::KvCache,
        embed: &Embedding,
        norm: &RmsNorm,
        lm_head: Option<&Linear>,
        mut layer: impl FnMut(
            usize,
            Tensor<2>,
            usize,
            &RopeTables,
            &mut crate::layers::LayerCache,
            &mut RouterTrace,
        ) -> Result<Tensor<2>, ModelError>,
    ) -> Result<Tensor<3>, ModelError> {
        let [batch, s] = input_ids.dims();
        let (_, tp) = self.tp_rank_size();
        if !(batch * s).is_multiple_of(tp) {
            return Err(ModelError::layout(
                "tp",
                format!("{batch} sequences × {s} positions do not split over tp = {tp}"),
            ));
        }
        let device = input_ids.device();
        let ids = input_ids
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .map_err(|e| ModelError::input("input_ids", format!("unreadable ids: {e:?}")))?;
        let rope = self.rope_at(cache.seq_len(), s, &device);
        let mut trace = RouterTrace::new(0.0);
        let mut x = self.embed(embed, &ids, batch)?;
        for (i, layer_cache) in cache.layers.iter_mut().enumerate() {
            x = layer(i, x, batch, &rope, layer_cache, &mut trace)?;
        }
        let logits = self.full_logits(x, norm, lm_head, embed)?;
        let v = logits.dims()[1];
        Ok(logits.reshape([batch, s, v]))
    }

    /// Final norm and vocab-parallel head on this rank's sequence-parallel block, gathered to
    /// the replica's full logits `[B·S, V]` (identical on its TP ranks): what generation
    /// samples from.
    pub fn full_logits(
        &self,
        x: Tensor<2>,
        norm: &RmsNorm,
        lm_head: Option<&Linear>,
        embed: &Embedding,
    ) -> Result<Tensor<2>, ModelError> {
        let full = self.gather(norm.forward(x))?;
        let local = match lm_head {
            Some(head) => head.forward(full),
            None => full.matmul(embed.weight.val().transpose()),
        };
        if self.tp.size() == 1 {
            return Ok(local);
        }
        // Vocabulary shards are contiguous in TP rank order.
        Ok(self
            .tp
            .all_gather(local.swap_dims(0, 1))
            .map_err(err)?
            .swap_dims(0, 1))
    }

    /// RoPE tables of positions `offset..offset + s` (decoding after a KV cache).
    pub fn rope_at(&self, offset: usize, s: usize, device: &Device) -> RopeTables {
        self.rope.tables(offset, s, device)
    }

    /// Vocab-parallel head and cross-entropy of the shifted `labels` on an already normed
    /// sequence-parallel block: `(mean loss [1], [B·S, V/tp] logits)`.
    pub fn normed_head_loss(
        &self,
        normed: Tensor<2>,
        lm_head: Option<&Linear>,
        embed: &Embedding,
        labels: &[i64],
        s: usize,
    ) -> Result<(Tensor<1>, Tensor<2>), ModelError> {
        let full = self.gather(normed)?;
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
        Ok((loss, logits))
    }
}
