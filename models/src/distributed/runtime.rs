//! What every sharded model shares: the TP group, the token dispatcher, this rank's vocabulary
//! columns, the RoPE tables, and the pieces of a sequence-parallel forward (vocab-parallel
//! embedding, gathered attention, TP MLP, MoE block, vocab-parallel head and loss) and of
//! sharding (embedding/head, MoE blocks).

use std::ops::Range;
use std::sync::Arc;

use burn::nn::{Embedding, Linear};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use moe_backend::comm::autograd::{
    gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
};
use moe_backend::comm::{Comm, GroupComms};
use moe_backend::dispatch::TokenDispatcher;
use moe_backend::layer::{MoeExecution, MoeLayer, MoeRecompute};
use moe_backend::parallel::tensor_parallel::{embed_vocab_parallel, vocab_parallel_cross_entropy};
use moe_backend::parallel::{GroupCountReducer, GroupFamily};
use moe_backend::recompute::recompute_module;
use moe_backend::router::{ReplayMode, RouteOptions, RouterLoss};

use super::context_parallel::{
    CpCommType, CpExchange, check_sequence, cp_positions, gathered_positions, position_mask,
    select_positions,
};
use super::sharded::mtp_labels;
use super::stack::AttentionInputs;
use super::{DispatcherKind, ParallelOutput, check_batch, err, make_dispatcher, shifted_targets};
use crate::ModelError;
use crate::causal_lm::IGNORE_INDEX;
use crate::layers::rope::{RopeTables, RotaryEmbedding};
use crate::layers::{AttentionMask, Mlp, RmsNorm};
use crate::packing::SequenceLayout;
use crate::recompute::{Recompute, RecomputeModule};
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
    /// The context-parallel group (one member without context parallelism).
    pub(crate) cp: Comm,
    /// The MoE blocks' token dispatcher (`None` for a dense model).
    dispatcher: Option<Arc<dyn TokenDispatcher>>,
    /// This rank's vocabulary rows of the embedding / columns of the head.
    pub(crate) vocab: Range<usize>,
    pub(super) rope: RotaryEmbedding,
    etp_rank: usize,
    etp: usize,
    /// Index in `dp` (the data-parallel replica).
    pub(crate) replica: usize,
    /// `|dp|`.
    pub(crate) replicas: usize,
    /// Sums the routers' aux-loss counts over `tp_cp` / `tp_dp_cp`.
    reducer: GroupCountReducer,
    /// `|tp_cp|` and `|tp_dp_cp|` (the routers' loss groups).
    pub(crate) loss_groups: (usize, usize),
    /// `global_aux_loss` running counts of the current global batch, per MoE layer.
    global_aux: GlobalAuxCounts,
    /// The activations recomputed in the backward pass instead of kept.
    recompute: Recompute,
    /// Megatron's `moe_shared_expert_overlap`: shared experts run while the tokens move.
    shared_expert_overlap: bool,
    /// How keys and values travel over the context-parallel group.
    cp_comm_type: CpCommType,
    /// This rank's place in its pipeline (`None` when `pp = 1`).
    pub(crate) pipeline: Option<super::pipeline::PipelinePlace>,
}

/// Per MoE layer (forward order): the reduced `global_aux_loss` counts `G` of the global batch's
/// micro-batches so far and their number `n`
/// (docs/routing-and-dispatch.md §Load-balancing losses and z-loss). Training forwards add to them;
/// the trainer clears them at the start of each step. A clone starts from a copy.
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

/// A decoder layer's forward as [`SpRuntime::recompute_layer`] runs it.
pub type LayerRun<L> = fn(
    &L,
    &SpRuntime,
    Tensor<2>,
    usize,
    &mut RouterTrace,
    AttentionInputs<'_>,
) -> Result<Tensor<2>, ModelError>;

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
    /// Router replay: per sparse layer (layer order, indexed as
    /// [`moe_layer_offset`](Self::moe_layer_offset) counts), this rank's forced `[T_local, k]`
    /// expert ids (the router runs in `ReplayForward` mode), or `None` for a layer that routes
    /// naturally (e.g. the MTP modules when the routing covers the main model only, or the
    /// layers of another pipeline chunk).
    pub replay: Option<Vec<Option<Tensor<2, Int>>>>,
    /// Whether [`selected`](Self::selected) collects the routing of every sparse layer.
    pub record: bool,
    /// Per sparse layer (layer order), this rank's selected `[T_local, k]` expert ids, when
    /// [`record`](Self::record) is set.
    pub selected: Vec<Tensor<2, Int>>,
    /// Per sparse layer (layer order), the router weights `[T_local, k]` of the selected
    /// experts (their probabilities, in [`selected`](Self::selected)'s order), when
    /// [`record`](Self::record) is set.
    pub selected_weights: Vec<Tensor<2>>,
    /// Per MoE layer (forward order), this rank's expert-bias token counts of a grad-enabled
    /// forward (`None` for routers without an expert bias).
    pub expert_load: Vec<Option<Vec<f64>>>,
    /// The routers' padding mask `[T_local]` (`true` = padded) of this rank's
    /// sequence-parallel rows, for a padded or packed batch.
    pub padding: Option<Tensor<1, Bool>>,
    /// MoE layers of the forward that ran before the first one this trace reports (the
    /// index of its first layer's replayed routing and `global_aux_loss` counts): 0, or the
    /// layer's own index for a layer recomputed in the backward pass.
    pub moe_layer_offset: usize,
    /// The routers report their losses and counts even though the forward is not recorded
    /// (the first pass of a layer recomputed in the backward pass).
    pub training: bool,
}

/// The per-forward inputs of one replica batch after its checks: the row length, RoPE tables
/// (per row for a packed or padded batch), the attention mask and this rank's router padding
/// rows of such a batch, and the labels the loss scores (masked by the layout).
#[derive(Debug, Clone)]
pub struct Prepared<'a> {
    /// Tokens per row `S`.
    pub s: usize,
    /// The positions of every row this rank holds (`0..S`, or its two chunks under context
    /// parallelism).
    pub positions: Vec<usize>,
    /// This rank's ids `[B, positions]` (row-major): the replica's ids at
    /// [`positions`](Self::positions).
    pub ids: Vec<i64>,
    /// RoPE tables of this rank's positions.
    pub rope: RopeTables,
    /// The attention mask of a packed or padded batch, or of this rank's positions against
    /// the gathered keys under context parallelism.
    pub mask: Option<AttentionMask>,
    /// This rank's router padding rows of a packed or padded batch.
    pub padding: Option<Tensor<1, Bool>>,
    /// The labels `[B, S]`, with [`SequenceLayout::mask_labels`] applied.
    pub labels: Vec<i64>,
    /// The next-token targets of this rank's positions (the labels shifted by one within
    /// every row, −100 at the end, taken at [`positions`](Self::positions)).
    pub targets: Vec<i64>,
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

    /// The next-token targets of full-length `labels [B, S]` at this rank's positions.
    pub(crate) fn local_targets(&self, labels: &[i64]) -> Vec<i64> {
        select_positions(&shifted_targets(labels, self.s), self.s, &self.positions)
    }

    /// Full-length row-major `values [B, S]` at this rank's positions.
    pub(crate) fn local(&self, values: &[i64]) -> Vec<i64> {
        select_positions(values, self.s, &self.positions)
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
            selected_weights: Vec::new(),
            expert_load: Vec::new(),
            padding: None,
            moe_layer_offset: 0,
            training: false,
        }
    }

    /// [`new`](Self::new) collecting every sparse layer's routing
    /// ([`record`](Self::record)), with `replay`'s forced expert ids (per sparse layer) when
    /// given: what a single-rank forward reports.
    pub fn recording(aux_grad_scale: f64, replay: Option<Vec<Tensor<2, Int>>>) -> Self {
        Self {
            record: true,
            replay: replay.map(|layers| layers.into_iter().map(Some).collect()),
            ..Self::new(aux_grad_scale)
        }
    }
}

impl SpRuntime {
    /// The context of this rank (its pipeline stage set by [`with_pipeline`](Self::with_pipeline)); `vocab_size` fixes the vocab shard;
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
            None => None,
        };
        let tp = groups.comm(GroupFamily::Tp).clone();
        let vocab = moe_backend::parallel::tensor_parallel::shard_range(
            "vocabulary",
            vocab_size,
            tp.rank(),
            tp.size(),
        )
        .map_err(err)?;
        // The context-parallel ranks of a data-parallel replica share its batch.
        let dp = groups.groups.get(GroupFamily::Dp);
        let loss_groups = (
            groups.groups.get(GroupFamily::TpCp).size(),
            groups.groups.get(GroupFamily::TpDpCp).size(),
        );
        Ok(Self {
            reducer: GroupCountReducer::new(groups),
            loss_groups,
            global_aux: GlobalAuxCounts::default(),
            tp,
            cp: groups.comm(GroupFamily::Cp).clone(),
            dispatcher,
            vocab,
            rope,
            etp_rank: groups.groups.get(GroupFamily::ExptTp).index,
            etp: groups.groups.layout.etp,
            replica: dp.index,
            replicas: dp.size(),
            recompute: Recompute::None,
            shared_expert_overlap: false,
            cp_comm_type: CpCommType::AllGather,
            pipeline: None,
        })
    }

    /// The context on this rank's pipeline stage of `model` under the layout of `groups`
    /// (unchanged when `pp = 1`): the layers split over the `pp · vpp` virtual stages evenly
    /// or as the layout's `pp_layout` says.
    pub fn with_pipeline(
        mut self,
        groups: &GroupComms,
        model: super::PipelineModel,
    ) -> Result<Self, ModelError> {
        let layout = &groups.groups.layout;
        let split = layout.pp_layout.as_deref();
        self.pipeline = super::PipelinePlace::for_groups(groups, model, layout.vpp, split)?;
        Ok(self)
    }

    /// Megatron's `moe_shared_expert_overlap`: each MoE layer's shared experts run while its
    /// token dispatch is in flight (the dispatcher's communication on a scoped thread; the
    /// forward only, results bit-identical; see
    /// [`moe_backend::layer::MoeLayer::forward_executing`]).
    pub fn set_shared_expert_overlap(&mut self, overlap: bool) {
        self.shared_expert_overlap = overlap;
    }

    /// Recompute `recompute` in the backward pass instead of keeping those activations
    /// (Megatron's `--recompute-granularity`; results are bit-identical). `full`: every
    /// decoder layer of a training forward keeps only its input and runs again in the
    /// backward pass (its routers report their counts and losses once, from the first pass;
    /// the second pass sees the same replayed routing and `global_aux_loss` counts).
    /// Selective modules: `core_attn` (the attention scores and probabilities), `moe_act`
    /// (the routed experts' activation and `fc2`), `shared_experts` and `mlp` (the dense
    /// MLPs). `layernorm` and `mla_up_proj` are refused: their outputs are kept anyway as the
    /// inputs of the projections that follow (Burn's linear layers hold their input for the
    /// weight gradient), so recomputing them alone would save nothing; `moe` is refused too
    /// (use `full`).
    pub fn set_recompute(&mut self, recompute: Recompute) -> Result<(), ModelError> {
        let unsupported = match &recompute {
            Recompute::None | Recompute::Full => None,
            Recompute::Selective(set) => set
                .iter()
                .find(|m| {
                    matches!(
                        m,
                        RecomputeModule::Layernorm
                            | RecomputeModule::MlaUpProj
                            | RecomputeModule::Moe
                    )
                })
                .map(|m| m.to_string()),
        };
        if let Some(what) = unsupported {
            return Err(ModelError::unsupported(
                "recompute",
                format!("`{what}` (supported modules: core_attn, moe_act, shared_experts, mlp)"),
            ));
        }
        self.recompute = recompute;
        Ok(())
    }

    /// Whether module `m` is recomputed.
    pub fn recomputes(&self, m: RecomputeModule) -> bool {
        matches!(&self.recompute, Recompute::Selective(set) if set.contains(&m))
    }

    /// Whether whole decoder layers are recomputed (`full`).
    pub fn recomputes_layers(&self) -> bool {
        self.recompute == Recompute::Full
    }

    /// `run(layer, ctx, x, batch, trace, inputs)` of a decoder layer on a training batch
    /// (`rope`, `mask`), recomputed in the backward pass (full recompute): the first pass
    /// runs on the detached layer and reports to `trace` as usual; the second runs on a copy
    /// of this context taken before the first (so it reads the same `global_aux_loss`
    /// counts, and its own additions are dropped) with a scratch trace at the same layer
    /// index, whose counts and losses are dropped. The scratch trace carries the expert ids
    /// the first pass's routers used (natural or replayed), which the rerun replays
    /// (Megatron's `REPLAY_BACKWARD`): the recomputed routing is the first pass's, held by the
    /// recompute closure itself, not read from router state that later micro-batches could
    /// have changed, and not recomputed from scores whose rounding could differ.
    #[allow(clippy::too_many_arguments)]
    pub fn recompute_layer<L>(
        &self,
        layer: &L,
        x: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
        run: LayerRun<L>,
    ) -> Result<Tensor<2>, ModelError>
    where
        L: burn::module::Module + Send + Sync + 'static,
    {
        fn inputs<'a>(
            ctx: &'a SpRuntime,
            rope: &'a RopeTables,
            mask: Option<&'a AttentionMask>,
        ) -> AttentionInputs<'a> {
            AttentionInputs::Masked {
                rope,
                mask,
                exchange: ctx.cp_exchange(),
                recompute_core: false,
            }
        }
        if !x.is_tracked() {
            return run(layer, self, x, batch, trace, inputs(self, rope, mask));
        }
        let rerun_ctx = self.clone();
        let offset = trace.moe_layer_offset + trace.logits.len();
        let mut scratch = RouterTrace {
            padding: trace.padding.clone(),
            moe_layer_offset: offset,
            ..RouterTrace::new(trace.aux_grad_scale)
        };
        // The first pass reports as a training forward's, and its selections are kept for
        // the rerun (recorded only if the trace records).
        let training = std::mem::replace(&mut trace.training, true);
        let record = std::mem::replace(&mut trace.record, true);
        let first = trace.selected.len();
        let output = run(
            &layer.clone().no_grad(),
            self,
            x.clone().detach(),
            batch,
            trace,
            inputs(self, rope, mask),
        );
        trace.training = training;
        trace.record = record;
        let used: Vec<Tensor<2, Int>> = if record {
            trace.selected[first.min(trace.selected.len())..].to_vec()
        } else {
            trace.selected_weights.truncate(first);
            trace
                .selected
                .drain(first.min(trace.selected.len())..)
                .collect()
        };
        let output = output?;
        if !used.is_empty() {
            let mut replay = vec![None; offset];
            replay.extend(used.into_iter().map(Some));
            scratch.replay = Some(replay);
        }
        let (rope, mask) = (rope.clone(), mask.cloned());
        Ok(moe_backend::recompute::link_recomputed(
            layer,
            x,
            output,
            move |leaves: &L, x: Tensor<2>| {
                let mut trace = scratch.clone();
                let inputs = inputs(&rerun_ctx, &rope, mask.as_ref());
                run(leaves, &rerun_ctx, x, batch, &mut trace, inputs)
            },
        ))
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

    /// This rank's data-parallel replica (index in `dp`; the context-parallel ranks of a
    /// replica share its batch).
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// Number of data-parallel replicas (`|dp|`).
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
            stage: self.pipeline.as_ref().map(|p| p.holding.clone()),
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

    /// Checks a replica batch (`input_ids` and `labels [batch, S]`, `layout` of the same
    /// shape; `S` divisible by `2·cp` and this rank's `B·S/cp` tokens by `tp`) and builds
    /// its per-forward inputs: this rank's positions (its two chunks under context
    /// parallelism) with their ids, RoPE tables and next-token targets; the attention mask
    /// of a packed or padded batch, or of this rank's queries against the gathered keys under
    /// context parallelism; the router padding rows of this rank's sequence-parallel block.
    pub fn prepare<'a>(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        layout: Option<&'a SequenceLayout>,
        device: &Device,
    ) -> Result<Prepared<'a>, ModelError> {
        let s = check_batch(input_ids, labels, batch, 1)?;
        let (cp_rank, cp) = (self.cp.rank(), self.cp.size());
        check_sequence(s, cp)?;
        let positions = cp_positions(s, cp, cp_rank);
        let (_, tp) = self.tp_rank_size();
        let local_tokens = batch * positions.len();
        if !local_tokens.is_multiple_of(tp) {
            return Err(ModelError::layout(
                "tp",
                format!(
                    "{batch} sequences × {} positions per rank do not split over tp = {tp}",
                    positions.len()
                ),
            ));
        }
        let mut labels = labels.to_vec();
        if let Some(l) = layout {
            l.check_shape("input_ids", batch, s)?;
            l.mask_labels(&mut labels);
        }
        let targets = select_positions(&shifted_targets(&labels, s), s, &positions);
        let ids = select_positions(input_ids, s, &positions);
        let (rope, mask, padding) = match (layout, cp) {
            (None, 1) => (self.rope(s, device), None, None),
            (Some(l), 1) => {
                let packed = self.packed_inputs(l, batch * s, device);
                (packed.rope, Some(packed.mask), Some(packed.padding))
            }
            (layout, _) => {
                let keys = gathered_positions(s, cp);
                let documents = layout.map(|l| l.segment_ids());
                let mask = position_mask(batch, s, &positions, &keys, documents, device);
                let rope = match layout {
                    Some(l) => {
                        let local = select_positions(l.positions(), s, &positions);
                        self.rope
                            .tables_at(&local, [batch, positions.len()], device)
                    }
                    None => self
                        .rope
                        .tables_at(&positions, [1, positions.len()], device),
                };
                // The router padding of this rank's sequence-parallel block of its tokens.
                let padding = documents.map(|d| {
                    let (rank, tp) = self.tp_rank_size();
                    let block = local_tokens / tp;
                    let flags: Vec<bool> = select_positions(d, s, &positions)
                        [rank * block..(rank + 1) * block]
                        .iter()
                        .map(|&doc| doc < 0)
                        .collect();
                    Tensor::<1, Bool>::from_data(TensorData::new(flags, [block]), device)
                });
                (rope, Some(mask), padding)
            }
        };
        Ok(Prepared {
            s,
            positions,
            ids,
            rope,
            mask,
            padding,
            labels,
            targets,
            layout,
        })
    }

    /// The positions of a row of `s` tokens this rank holds: `0..s`, or its two chunks
    /// under context parallelism.
    pub fn sequence_positions(&self, s: usize) -> Vec<usize> {
        cp_positions(s, self.cp.size(), self.cp.rank())
    }

    /// The context-parallel group, when it has more than one member: what attention
    /// exchanges keys and values over.
    pub fn cp_exchange(&self) -> Option<CpExchange<'_>> {
        (self.cp.size() > 1).then_some(CpExchange {
            comm: &self.cp,
            kind: self.cp_comm_type,
        })
    }

    /// How attention exchanges keys and values over the context-parallel group (Megatron's
    /// `--cp-comm-type`: `all_gather`, the default, or `p2p` around the ring).
    pub fn set_cp_comm_type(&mut self, kind: CpCommType) {
        self.cp_comm_type = kind;
    }

    /// Refuses a forward that needs every position of the sequence on this rank (generation,
    /// per-token log-probs, router replay) under context parallelism.
    /// Refuses `what` on a pipeline stage (it needs every layer on this rank).
    pub(crate) fn require_whole_model(&self, what: &str) -> Result<(), ModelError> {
        if self.pipeline.is_some() {
            return Err(ModelError::unsupported(
                "pp",
                format!(
                    "{what} needs every layer on one rank; under pipeline parallelism train \
                     with the Trainer (it runs the pipeline schedule)"
                ),
            ));
        }
        Ok(())
    }

    /// This rank's place in its pipeline (`None` when `pp = 1`).
    pub fn pipeline(&self) -> Option<&super::pipeline::PipelinePlace> {
        self.pipeline.as_ref()
    }

    pub(crate) fn require_whole_sequence(&self, what: &str) -> Result<(), ModelError> {
        if self.cp.size() > 1 {
            return Err(ModelError::unsupported(
                "cp",
                format!("{what} needs whole sequences on every rank; run it with cp = 1"),
            ));
        }
        Ok(())
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
        self.try_attention_residual(x, norm, batch, |full| Ok(attention(full)))
    }

    /// [`attention_residual`](Self::attention_residual) with a fallible `attention`.
    pub fn try_attention_residual(
        &self,
        x: Tensor<2>,
        norm: &RmsNorm,
        batch: usize,
        attention: impl FnOnce(Tensor<3>) -> Result<Tensor<3>, ModelError>,
    ) -> Result<Tensor<2>, ModelError> {
        let full = self.gather(norm.forward(x.clone()))?;
        let [n, h] = full.dims();
        let out = attention(full.reshape([batch, n / batch, h]))?;
        Ok(x + self.scatter(out.reshape([n, h]))?)
    }

    /// A TP-sharded dense MLP on the SP block (gather, column/row shard, reduce-scatter).
    pub fn dense_mlp(&self, mlp: &Mlp, normed: Tensor<2>) -> Result<Tensor<2>, ModelError> {
        let full = self.gather(normed)?;
        let out = if self.recomputes(RecomputeModule::Mlp) {
            recompute_module(mlp, full, |m: &Mlp, x| m.forward(x))
        } else {
            mlp.forward(full)
        };
        self.scatter(out)
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
        let layer = trace.moe_layer_offset + trace.logits.len();
        if let Some(replay) = &trace.replay {
            let entry = replay.get(layer).ok_or_else(|| ModelError::InvalidInput {
                what: "routed_experts.layers",
                reason: format!("no replayed routing for sparse layer {layer}"),
            })?;
            if let Some(idx) = entry {
                state.replay.set_indices(idx.clone());
                state.replay.set_mode(ReplayMode::ReplayForward);
            }
        }
        if let Some((counts, steps)) = self.global_aux.lock().get(layer) {
            state.set_global_aux(counts, *steps).map_err(err)?;
        }
        let rows = self.row_sequences(normed.dims()[0], batch)?;
        let mut options = RouteOptions::default()
            .with_batch_size(batch)
            .with_row_sequences(&rows)
            .with_count_reducer(&self.reducer)
            // Megatron's `loss_scale·|cp|/num_microbatches`
            // (docs/routing-and-dispatch.md §Load-balancing losses and z-loss): the data-parallel
            // gradient average runs over `dp_cp`, while the context-parallel ranks' router losses
            // are parts of one replica's loss.
            .with_grad_scale(trace.aux_grad_scale * self.cp.size() as f64)
            .with_training(trace.training);
        if let Some(padding) = &trace.padding {
            options = options.with_padding_mask(padding.clone());
        }
        let recompute = MoeRecompute {
            activation: self.recomputes(RecomputeModule::MoeAct),
            shared_experts: self.recomputes(RecomputeModule::SharedExperts),
        };
        let execution = MoeExecution {
            recompute,
            overlap_shared_experts: self.shared_expert_overlap,
            observer: None,
        };
        let out = moe
            .forward_executing(normed, &state, &options, self.dispatcher()?, &execution)
            .map_err(err)?;
        if trace.record {
            let r = &out.routing;
            trace.selected.push(r.topk_indices.clone());
            let weights = r.probs.clone().gather(1, r.topk_indices.clone());
            trace.selected_weights.push(weights);
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
    /// vocab-parallel cross-entropy of this rank's next-token `targets`
    /// ([`Prepared::targets`]).
    pub fn head_loss(
        &self,
        x: Tensor<2>,
        norm: &RmsNorm,
        lm_head: Option<&Linear>,
        embed: Option<&Embedding>,
        targets: &[i64],
        trace: RouterTrace,
    ) -> Result<ParallelOutput, ModelError> {
        let (loss, logits) = self.normed_head_loss(norm.forward(x), lm_head, embed, targets)?;
        Ok(ParallelOutput {
            loss,
            logits,
            vocab: self.vocab.clone(),
            router_logits: trace.logits,
            router_losses: trace.losses,
        })
    }

    /// The vocab-parallel head on this rank's normed sequence-parallel block: the replica's
    /// rows gathered over TP, times this rank's vocabulary columns (`lm_head`, or the
    /// embedding shard it is tied to): `[rows, V/tp]`.
    pub fn vocab_parallel_logits(
        &self,
        normed: Tensor<2>,
        lm_head: Option<&Linear>,
        embed: Option<&Embedding>,
    ) -> Result<Tensor<2>, ModelError> {
        let full = self.gather(normed)?;
        Ok(match lm_head {
            Some(head) => head.forward(full),
            None => full.matmul(
                super::held(embed, "the output layer (or the embedding it is tied to)")?
                    .weight
                    .val()
                    .transpose(),
            ),
        })
    }

    /// The head on this rank's already normed sequence-parallel block, gathered to the
    /// replica's full-vocabulary logits `[B·S, V]` (identical on its TP ranks): what
    /// generation samples from.
    pub fn head_logits(
        &self,
        normed: Tensor<2>,
        lm_head: Option<&Linear>,
        embed: Option<&Embedding>,
    ) -> Result<Tensor<2>, ModelError> {
        let local = self.vocab_parallel_logits(normed, lm_head, embed)?;
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

    /// Vocab-parallel head and cross-entropy of this rank's next-token `targets` (one per
    /// token of the replica's rows this rank holds, −100 ignored) on an already normed
    /// sequence-parallel block: `(mean loss [1], [B·S, V/tp] logits)`.
    pub fn normed_head_loss(
        &self,
        normed: Tensor<2>,
        lm_head: Option<&Linear>,
        embed: Option<&Embedding>,
        targets: &[i64],
    ) -> Result<(Tensor<1>, Tensor<2>), ModelError> {
        let logits = self.vocab_parallel_logits(normed, lm_head, embed)?;
        let loss = vocab_parallel_cross_entropy(
            logits.clone(),
            targets,
            IGNORE_INDEX,
            self.vocab.clone(),
            &self.tp,
        )
        .map_err(err)?;
        Ok((loss, logits))
    }
}
