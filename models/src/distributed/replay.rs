//! Router replay in the sharded training forward (RL "R3" routing replay,
//! docs/training-and-rl.md §Router replay).
//!
//! An RL framework hands the trainer the experts its inference engine routed every token to,
//! as `routed_experts [batch, seq, layers, topk]` (NeMo-RL / verl `router_replay`):
//! [`RoutedExperts`]. [`Sharded::forward_loss_replayed`] routes every MoE layer of every rank
//! exactly as given, and [`Sharded::forward_loss_recorded`] returns the routing of a natural
//! forward in the same format (a group-limited router with `e_score_correction_bias`, as
//! DeepSeek-V3's, skips the selection under replay and recomputes the sigmoid weights at the
//! replayed ids, normalised and scaled by `routed_scaling_factor`).
//!
//! The trainer replays a routing per micro-batch: [`TrainBatch::with_routed_experts`]
//! attaches it to the batch, and every training forward of that batch
//! ([`crate::train::Trainer::step_micro_batches`], under every layout, the pipeline's chunk
//! forwards included) routes as given; [`Sharded::forward_train_recorded`] records the routing
//! of a training forward (DeepSeek-V3's MTP modules included) in the same format.
//!
//! # Layout of `routed_experts`
//!
//! - `batch × seq` are the replica's `input_ids [B, S]` (row-major, token row `b·S + s`); for
//!   a packed batch (THD, `cu_seqlens` per row, [`TrainBatch::packed`]) these are the packed
//!   rows' tokens, padding included (a padding token's ids must be valid experts; they change
//!   nothing but that token's own output, which no loss reads);
//! - `layers` counts the model's **MoE layers** in ascending decoder-layer order (dense layers,
//!   e.g. Qwen3-MoE's `mlp_only_layers`, have no entry), see [`ReplaySpec::moe_layers`],
//!   optionally followed by DeepSeek-V3's **MTP modules** in depth order
//!   ([`ReplaySpec::mtp_layers`], decoder layers `N + j`): Megatron's `RouterReplay`
//!   numbers its routers in the order it builds them, the decoder's then the MTP block's,
//!   and verl / slime hand each pipeline stage the slice of that list its layers own. A
//!   routing of the main layers only (what an inference engine returns) leaves the MTP
//!   routers to route naturally when a training forward runs them;
//! - `topk` is the router's `k`; ids are in `0..E` and distinct within a token.
//!
//! # Mapping onto the shards
//!
//! Between blocks a replica's tokens are sequence-parallel. Without context parallelism TP
//! rank `r` of `tp` holds the contiguous block of rows `r·B·S/tp .. (r+1)·B·S/tp` (the
//! reduce-scatter of the vocab-parallel embedding and of every attention / MLP block). Under
//! context parallelism (`cp`) each CP rank holds two chunks of every sequence
//! (positions `c·r .. c·(r+1)` and `c·(2cp−1−r) .. c·(2cp−r)`, `c = S/2cp`): its local tokens
//! are rows `b·S + p` for `b` in `0..B` and `p` in its positions, in that order, and TP rank `r`
//! holds the `r`-th contiguous block of those. A router sees exactly its rank's rows, so replay
//! hands each MoE layer's router the `[T_local, k]` ids of those rows in `ReplayForward` mode:
//! the top-k selection is skipped, the routing weights are recomputed from the current logits
//! at the replayed ids (normalised / scaled as usual, so router gradients flow), and the token
//! dispatcher then sends every (token, expert) pair to the EP rank owning that expert (and its
//! ETP group) exactly as in a natural forward. Expert placement (`ep`, `etp`) and data
//! parallelism therefore play no part in the mapping; each replica passes its own rows'
//! routing (split a global batch's with [`RoutedExperts::slice_batch`]).
//!
//! Under pipeline parallelism (`pp`, with `vpp` virtual stages) a rank runs the routers of
//! its chunks' decoder layers (global indices [`PipelinePlace`](super::PipelinePlace)'s
//! `holding.layers`) and, on the last stage, of the MTP modules: each router takes the entry
//! of `layers` of its global MoE layer (its position in [`ReplaySpec::moe_layers`], or
//! `moe_layers.len() + j` for MTP depth `j`). Every chunk forward of every micro-batch sets
//! its routers from that micro-batch's routing right before it runs, so the interleaved
//! schedule never mixes micro-batches.
//!
//! With activation recompute (`full`), a recomputed layer's rerun in the backward pass replays
//! the expert ids its first pass used (natural or replayed), held by the recompute closure
//! (Megatron's `REPLAY_BACKWARD`).
//!
//! Recording is the inverse: every rank keeps its routers' `[T_local, k]` selections, which
//! are all-gathered over TP (in rank order) and then over CP (each rank's rows put back at its
//! positions), so every rank of a replica returns the replica's whole `[B, S, layers, k]`.
//!
//! With a capacity factor, replayed ids can still be dropped by the capacity limit, as in
//! Megatron; routing replay is meant for dropless routing.

use std::ops::Range;

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::context_parallel::cp_positions;
use super::runtime::{RouterTrace, SpRuntime};
use super::sharded::TrainForward;
use super::{ParallelOutput, ShardModel, Sharded, check_batch, err};
use crate::ModelError;

fn invalid(what: &'static str, reason: String) -> ModelError {
    ModelError::InvalidInput { what, reason }
}
use crate::batch::TrainBatch;
use crate::routing::ReplaySpec;
pub use crate::routing::RoutedExperts;

impl<M: ShardModel> Sharded<M> {
    /// What a routing for this model must match: the main model's MoE layers (ascending
    /// decoder-layer order), optionally followed by the MTP modules' (decoder layers `N + j`;
    /// the loss forwards here run none and ignore them, the training forwards replay them),
    /// `k`, `E`. An error for a model without routers.
    pub fn replay_spec(&self) -> Result<ReplaySpec, ModelError> {
        self.require_replay_spec()
    }

    /// [`forward_loss_scaled`](Self::forward_loss_scaled) with every MoE layer routed exactly
    /// as `routed` (this replica's `[batch, S, layers, k]`, identical on its TP and CP ranks):
    /// each rank's routers get the ids of its sequence-parallel rows and recompute the routing
    /// weights from the current logits at them (see the [module docs](self); a group-limited,
    /// bias-shifted router skips its selection and takes its scores without the bias,
    /// normalised and scaled as in a natural forward). Errors if `routed` does not fit the
    /// batch and the model ([`RoutedExperts::validate`]).
    pub fn forward_loss_replayed(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        device: &Device,
        aux_grad_scale: f64,
        routed: &RoutedExperts,
    ) -> Result<ParallelOutput, ModelError> {
        let spec = self.replay_spec()?;
        let batch_ids = (input_ids, labels, batch);
        let trace = replay_trace(&self.rt, &spec, batch_ids, device, aux_grad_scale, routed)?;
        Ok(self
            .forward_traced(input_ids, labels, batch, None, device, trace)?
            .0)
    }

    /// [`forward_loss_scaled`](Self::forward_loss_scaled) that also returns the replica's
    /// routing `[batch, S, layers, k]` (all-gathered over TP and CP: every rank of the replica
    /// returns the whole batch's), in the format [`forward_loss_replayed`](Self::forward_loss_replayed)
    /// takes. With `replay`, the routers are forced as in `forward_loss_replayed` and the
    /// returned routing is the one actually used.
    pub fn forward_loss_recorded(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        device: &Device,
        aux_grad_scale: f64,
        replay: Option<&RoutedExperts>,
    ) -> Result<(ParallelOutput, RoutedExperts), ModelError> {
        let spec = self.replay_spec()?;
        let batch_ids = (input_ids, labels, batch);
        let trace = record_trace(&self.rt, &spec, batch_ids, device, aux_grad_scale, replay)?;
        let (out, selected, _) =
            self.forward_traced(input_ids, labels, batch, None, device, trace)?;
        let routed = gather_routing(&self.rt, &spec, selected, batch, input_ids.len() / batch)?;
        Ok((out, routed))
    }

    /// The training forward of `batch` ([`CausalLmShard::forward_train_batch`](super::CausalLmShard::forward_train_batch):
    /// packed or padded with its layout, its routing replayed when it carries one; with `mtp`
    /// the MTP modules too) that also returns the replica's routing `[batch, S, layers, k]`
    /// (the one actually used, the MTP modules' after the main layers' in depth order; every
    /// rank of the replica returns the whole batch's, gathered over TP and CP). Refused on a
    /// pipeline stage (run the whole model: the routing is recorded under one layout and
    /// replayed under any).
    pub fn forward_train_recorded(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        mtp: bool,
    ) -> Result<(TrainForward, RoutedExperts), ModelError> {
        self.rt
            .require_whole_model("recording a training forward's routing")?;
        let spec = self.replay_spec()?;
        let (out, selected) = self.train_whole(batch, device, aux_grad_scale, mtp, true)?;
        let routed = gather_routing(&self.rt, &spec, selected, batch.batch, batch.seq_len())?;
        Ok((out, routed))
    }
}

/// A replica batch: `(input_ids, labels, batch)`.
type BatchIds<'a> = (&'a [i64], &'a [i64], usize);

/// A recording trace, replaying `replay` when given.
fn record_trace(
    rt: &SpRuntime,
    spec: &ReplaySpec,
    batch: BatchIds<'_>,
    device: &Device,
    aux_grad_scale: f64,
    replay: Option<&RoutedExperts>,
) -> Result<RouterTrace, ModelError> {
    let mut trace = match replay {
        Some(routed) => replay_trace(rt, spec, batch, device, aux_grad_scale, routed)?,
        None => RouterTrace::new(aux_grad_scale),
    };
    trace.record = true;
    Ok(trace)
}

/// The token rows (of the replica's `b·S + s` flattening) this rank's routers see, in the
/// order of its sequence-parallel block: its positions of every sequence (all of them, or its
/// two chunks under context parallelism), batch-major, cut into `tp` contiguous blocks (see
/// the [module docs](self)).
pub(crate) fn local_token_rows(
    rt: &SpRuntime,
    batch: usize,
    s: usize,
) -> Result<Vec<usize>, ModelError> {
    let positions = rt.sequence_positions(s);
    let (rank, tp) = rt.tp_rank_size();
    let n = batch * positions.len();
    if positions.is_empty() || !n.is_multiple_of(tp) {
        return Err(ModelError::layout(
            "tp",
            format!(
                "{batch} sequences × {} positions per rank do not split over tp = {tp}",
                positions.len()
            ),
        ));
    }
    let block = n / tp;
    let p = positions.len();
    Ok((rank * block..(rank + 1) * block)
        .map(|i| (i / p) * s + positions[i % p])
        .collect())
}

/// Per entry of `layers` (an index into `routed`'s layers, or `None` for a router that routes
/// naturally), the `[rows.len(), k]` ids of `rows` on `device`.
fn layer_tensors(
    routed: &RoutedExperts,
    layers: &[Option<usize>],
    rows: &[usize],
    device: &Device,
) -> Vec<Option<Tensor<2, Int>>> {
    layers
        .iter()
        .map(|layer| {
            layer.map(|l| {
                let ids: Vec<i32> = (routed.layer_at_rows(l, rows).into_iter())
                    .map(|v| v as i32)
                    .collect();
                Tensor::<2, Int>::from_data(TensorData::new(ids, [rows.len(), routed.topk]), device)
            })
        })
        .collect()
}

/// The replica's `[batch, seq, layers, k]` routing from every MoE layer's recorded
/// `[T_local, k]` selections of this rank: all-gathered over TP (in rank order) and then over
/// CP (every rank's rows put back at its positions).
fn gather_routing(
    rt: &SpRuntime,
    spec: &ReplaySpec,
    selected: Vec<Tensor<2, Int>>,
    batch: usize,
    seq: usize,
) -> Result<RoutedExperts, ModelError> {
    let cp = rt.cp.size();
    let k = spec.topk;
    let t = batch * seq;
    let layers = selected
        .into_iter()
        .map(|local| {
            let mut full = rt.tp.all_gather(local).map_err(err)?;
            if cp > 1 {
                full = rt.cp.all_gather(full).map_err(err)?;
            }
            let gathered = full
                .into_data()
                .try_into_vec_as::<i64>()
                .map_err(|e| invalid("routed_experts.indices", format!("{e:?}")))?;
            if gathered.len() != t * k {
                return Err(invalid(
                    "routed_experts.indices",
                    format!("{} ids gathered for {t} tokens × k = {k}", gathered.len()),
                ));
            }
            if cp == 1 {
                return Ok(gathered);
            }
            // CP rank r's block holds rows `b·S + p` for its positions p, batch-major.
            let mut ids = vec![0i64; t * k];
            let mut at = 0;
            for r in 0..cp {
                let positions = cp_positions(seq, cp, r);
                for b in 0..batch {
                    for &p in &positions {
                        let row = b * seq + p;
                        ids[row * k..(row + 1) * k].copy_from_slice(&gathered[at..at + k]);
                        at += k;
                    }
                }
            }
            Ok(ids)
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    RoutedExperts::from_layers(batch, seq, k, &layers)
}

/// The trace replaying `routed` on this rank's sequence-parallel rows (checked against the
/// batch and `spec` first); the main model's MoE layers only (a loss forward runs no MTP
/// module).
fn replay_trace(
    rt: &SpRuntime,
    spec: &ReplaySpec,
    (input_ids, labels, batch): BatchIds<'_>,
    device: &Device,
    aux_grad_scale: f64,
    routed: &RoutedExperts,
) -> Result<RouterTrace, ModelError> {
    let s = check_batch(input_ids, labels, batch, 1)?;
    routed.validate(batch, s, spec)?;
    let rows = local_token_rows(rt, batch, s)?;
    let layers: Vec<Option<usize>> = (0..spec.moe_layers.len()).map(Some).collect();
    let mut trace = RouterTrace::new(aux_grad_scale);
    trace.replay = Some(layer_tensors(routed, &layers, &rows, device));
    Ok(trace)
}

/// What a training forward's routers do with its batch's routing
/// ([`TrainBatch::routed_experts`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ForwardRouting<'a> {
    /// What the model's routings must match (`None`: a model without routers, which refuses
    /// a routed batch).
    pub spec: Option<&'a ReplaySpec>,
    /// MTP depths the forward runs after the chunk's decoder layers (on the last stage).
    pub mtp: usize,
    /// Keep every router's selection ([`RouterTrace::selected`]).
    pub record: bool,
}

/// The forced ids of a training forward's routers on this rank, as
/// [`RouterTrace::replay`] holds them (indexed by this rank's MoE layer): `None` before
/// `moe_offset` (another chunk's layers), then one entry per MoE layer among this rank's
/// local decoder layers `layers` (a pipeline chunk, or the whole model) and per MTP depth of
/// `routing.mtp`, each the `[T_local, k]` ids of its global MoE layer in `batch`'s routing, or
/// `None` for an MTP router the routing does not cover. `None` for a batch without routing.
pub(crate) fn train_replay(
    rt: &SpRuntime,
    routing: &ForwardRouting<'_>,
    batch: &TrainBatch,
    layers: Range<usize>,
    moe_offset: usize,
    device: &Device,
) -> Result<Option<Vec<Option<Tensor<2, Int>>>>, ModelError> {
    let Some(routed) = batch.routed_experts() else {
        return Ok(None);
    };
    let spec = routing.spec.ok_or_else(|| {
        ModelError::input(
            "routed_experts",
            "the model has no MoE router to replay a routing in",
        )
    })?;
    let s = batch.seq_len();
    routed.validate(batch.batch, s, spec)?;
    let mut entries: Vec<Option<usize>> = vec![None; moe_offset];
    let holding = rt.pipeline.as_ref().map(|p| &p.holding.layers);
    for local in layers {
        let global = match holding {
            Some(held) => *held.get(local).ok_or_else(|| {
                ModelError::layout(
                    "pipeline_layout",
                    format!(
                        "local decoder layer {local} of a stage holding {}",
                        held.len()
                    ),
                )
            })?,
            None => local,
        };
        if let Ok(at) = spec.moe_layers.binary_search(&global) {
            entries.push(Some(at));
        }
    }
    if routing.mtp > spec.mtp_layers.len() {
        return Err(ModelError::input(
            "mtp",
            format!(
                "{} MTP depths run, the model has {}",
                routing.mtp,
                spec.mtp_layers.len()
            ),
        ));
    }
    let main = spec.moe_layers.len();
    let covered = routed.covers_mtp(spec);
    entries.extend((0..routing.mtp).map(|j| covered.then_some(main + j)));
    let rows = local_token_rows(rt, batch.batch, s)?;
    Ok(Some(layer_tensors(routed, &entries, &rows, device)))
}
