//! Router replay in the sharded training forward (RL "R3" routing replay,
//! docs/training-and-rl.md §Router replay).
//!
//! An RL framework hands the trainer the experts its inference engine routed every token to,
//! as `routed_experts [batch, seq, layers, topk]` (NeMo-RL / verl `router_replay`):
//! [`RoutedExperts`]. [`ParallelQwen3Moe::forward_loss_replayed`] routes every MoE layer of
//! every rank exactly as given, and [`ParallelQwen3Moe::forward_loss_recorded`] returns the
//! routing of a natural forward in the same format. [`ParallelDeepseekV3`] has the same two
//! entry points (its group-limited router with `e_score_correction_bias` skips the selection
//! under replay and recomputes the sigmoid weights at the replayed ids, normalised and scaled
//! by `routed_scaling_factor`).
//!
//! # Layout of `routed_experts`
//!
//! - `batch × seq` are the replica's `input_ids [B, S]` (row-major, token row `b·S + s`);
//! - `layers` counts the model's **MoE layers** in ascending decoder-layer order (dense layers,
//!   e.g. Qwen3-MoE's `mlp_only_layers`, have no entry), see [`ReplaySpec::moe_layers`];
//! - `topk` is the router's `k`; ids are in `0..E` and distinct within a token.
//!
//! # Mapping onto the shards
//!
//! Between blocks a replica's `B·S` tokens (rows `b·S + s` of the flattened batch) are
//! sequence-parallel: TP rank `r` of `tp` holds the contiguous block of rows
//! `r·B·S/tp .. (r+1)·B·S/tp` (the reduce-scatter of the vocab-parallel embedding and of
//! every attention / MLP block). Its router sees exactly those rows, so replay hands each MoE
//! layer's router the `[B·S/tp, k]` slice of those rows in `ReplayForward` mode: the top-k
//! selection is skipped, the routing weights are recomputed from the current logits at the
//! replayed ids (normalised / scaled as usual, so router gradients flow), and the token
//! dispatcher then sends every (token, expert) pair to the EP rank owning that expert (and
//! its ETP group) exactly as in a natural forward. Expert placement (`ep`, `etp`) and data
//! parallelism therefore play no part in the mapping; each replica passes its own rows'
//! routing (split a global batch's with [`RoutedExperts::slice_batch`]).
//!
//! Recording is the inverse: every rank keeps its routers' `[B·S/tp, k]` selections, which
//! are all-gathered over TP (in rank order, i.e. back to rows `b·S + s`), so every TP rank of
//! a replica returns the replica's whole `[B, S, layers, k]`.
//!
//! With a capacity factor, replayed ids can still be dropped by the capacity limit, as in
//! Megatron; routing replay is meant for dropless routing.

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::runtime::{RouterTrace, SpRuntime};
use super::{ParallelDeepseekV3, ParallelOutput, ParallelQwen3Moe, check_batch, err};
use crate::ModelError;
use crate::replay::{ReplaySpec, RouterReplayFile, RouterReplayModel};

/// Expert ids routed to by every token of a batch in every MoE layer:
/// `indices [batch, seq, layers, topk]`, row-major (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedExperts {
    /// `B`, sequences.
    pub batch: usize,
    /// `S`, tokens per sequence.
    pub seq: usize,
    /// MoE layers (ascending decoder-layer order; dense layers are not counted).
    pub layers: usize,
    /// `k`, experts per token.
    pub topk: usize,
    /// Row-major `[batch, seq, layers, topk]` expert ids.
    pub indices: Vec<i64>,
}

fn invalid(what: &'static str, reason: String) -> ModelError {
    ModelError::InvalidInput { what, reason }
}

impl RoutedExperts {
    /// Wraps row-major `[batch, seq, layers, topk]` ids; errors unless their count is
    /// `batch·seq·layers·topk`.
    pub fn new(
        batch: usize,
        seq: usize,
        layers: usize,
        topk: usize,
        indices: Vec<i64>,
    ) -> Result<Self, ModelError> {
        let routed = Self {
            batch,
            seq,
            layers,
            topk,
            indices,
        };
        routed.check_len()?;
        Ok(routed)
    }

    /// Builds the ids from per-layer row-major `[batch·seq, topk]` tensors' values.
    pub fn from_layers(
        batch: usize,
        seq: usize,
        topk: usize,
        layers: &[Vec<i64>],
    ) -> Result<Self, ModelError> {
        let t = batch * seq;
        if let Some((l, ids)) = layers.iter().enumerate().find(|(_, v)| v.len() != t * topk) {
            return Err(invalid(
                "routed_experts.indices",
                format!(
                    "layer {l} has {} ids, expected batch·seq·topk = {t}·{topk}",
                    ids.len()
                ),
            ));
        }
        let mut indices = Vec::with_capacity(t * layers.len() * topk);
        for row in 0..t {
            for layer in layers {
                indices.extend_from_slice(&layer[row * topk..(row + 1) * topk]);
            }
        }
        Self::new(batch, seq, layers.len(), topk, indices)
    }

    /// `B·S`.
    pub fn num_tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// The `k` ids of token `(b, s)` in MoE layer `layer`.
    pub fn token(&self, b: usize, s: usize, layer: usize) -> &[i64] {
        let at = ((b * self.seq + s) * self.layers + layer) * self.topk;
        &self.indices[at..at + self.topk]
    }

    /// MoE layer `layer`'s ids of the token rows `rows` (of the `b·S + s` flattening),
    /// row-major `[rows.len(), topk]`.
    pub fn layer_rows(&self, layer: usize, rows: std::ops::Range<usize>) -> Vec<i64> {
        let (l, k) = (self.layers, self.topk);
        rows.flat_map(|row| {
            let at = (row * l + layer) * k;
            self.indices[at..at + k].iter().copied()
        })
        .collect()
    }

    /// The sequences `batches` (e.g. one data-parallel replica's rows of a global batch).
    pub fn slice_batch(&self, batches: std::ops::Range<usize>) -> Result<Self, ModelError> {
        if batches.start > batches.end || batches.end > self.batch {
            return Err(invalid(
                "routed_experts.batch",
                format!("sequences {batches:?} of a batch of {}", self.batch),
            ));
        }
        let per = self.seq * self.layers * self.topk;
        Self::new(
            batches.len(),
            self.seq,
            self.layers,
            self.topk,
            self.indices[batches.start * per..batches.end * per].to_vec(),
        )
    }

    fn check_len(&self) -> Result<(), ModelError> {
        let want = self.batch * self.seq * self.layers * self.topk;
        if self.indices.len() != want {
            return Err(invalid(
                "routed_experts.indices",
                format!(
                    "{} ids, expected batch·seq·layers·topk = {}·{}·{}·{} = {want}",
                    self.indices.len(),
                    self.batch,
                    self.seq,
                    self.layers,
                    self.topk
                ),
            ));
        }
        Ok(())
    }

    /// Checks the routing against a forward of `input_ids [batch, seq]` of a model described
    /// by `spec`: id count, `batch`, `seq`, `layers` (the model's MoE layers), `topk` (the
    /// router's `k`), ids in `0..E` and distinct within each token. Errors name the field
    /// (`routed_experts.batch`, `.seq`, `.layers`, `.topk`, `.indices`).
    pub fn validate(&self, batch: usize, seq: usize, spec: &ReplaySpec) -> Result<(), ModelError> {
        self.check_len()?;
        if self.batch != batch {
            return Err(invalid(
                "routed_experts.batch",
                format!("{} sequences routed, the forward has {batch}", self.batch),
            ));
        }
        if self.seq != seq {
            return Err(invalid(
                "routed_experts.seq",
                format!(
                    "{} tokens per sequence routed, the forward has {seq}",
                    self.seq
                ),
            ));
        }
        if self.layers != spec.moe_layers.len() {
            return Err(invalid(
                "routed_experts.layers",
                format!(
                    "{} layers routed, the model has {} MoE layers {:?}",
                    self.layers,
                    spec.moe_layers.len(),
                    spec.moe_layers
                ),
            ));
        }
        if self.topk != spec.topk {
            return Err(invalid(
                "routed_experts.topk",
                format!(
                    "topk = {}, the router selects num_experts_per_tok = {}",
                    self.topk, spec.topk
                ),
            ));
        }
        let e = spec.num_experts as i64;
        for (at, chunk) in self.indices.chunks(self.topk.max(1)).enumerate() {
            let (token, layer) = (at / self.layers.max(1), at % self.layers.max(1));
            let (b, s) = (token / self.seq.max(1), token % self.seq.max(1));
            for (j, &id) in chunk.iter().enumerate() {
                if !(0..e).contains(&id) {
                    return Err(invalid(
                        "routed_experts.indices",
                        format!("[{b}, {s}, {layer}, {j}]: expert {id} out of range 0..{e}"),
                    ));
                }
                if chunk[..j].contains(&id) {
                    return Err(invalid(
                        "routed_experts.indices",
                        format!("[{b}, {s}, {layer}]: expert {id} selected twice"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The same routing as a single-rank replay file ([`crate::replay`]) for a model
    /// described by `spec` (checked with [`validate`](Self::validate) first).
    pub fn to_replay_file(&self, spec: &ReplaySpec) -> Result<RouterReplayFile, ModelError> {
        self.validate(self.batch, self.seq, spec)?;
        let t = self.num_tokens();
        let mut file = RouterReplayFile::new(spec.model_type, self.topk, t);
        for (l, &layer) in spec.moe_layers.iter().enumerate() {
            let ids = self.layer_rows(l, 0..t).into_iter().map(|v| v as i32);
            file.insert_layer(layer, ids.collect())?;
        }
        Ok(file)
    }

    /// The routing of a single-rank replay file whose `T` tokens form `batch` sequences
    /// (layers in ascending decoder-layer order).
    pub fn from_replay_file(file: &RouterReplayFile, batch: usize) -> Result<Self, ModelError> {
        if batch == 0 || !file.num_tokens.is_multiple_of(batch) {
            return Err(invalid(
                "routed_experts.batch",
                format!("{} tokens do not form {batch} sequences", file.num_tokens),
            ));
        }
        let layers: Vec<Vec<i64>> = file
            .layers
            .values()
            .map(|ids| ids.iter().map(|&v| i64::from(v)).collect())
            .collect();
        Self::from_layers(batch, file.num_tokens / batch, file.topk, &layers)
    }
}

impl ParallelQwen3Moe {
    /// What a routing for this model must match: MoE layers, `k`, `E`.
    pub fn replay_spec(&self) -> ReplaySpec {
        self.model.replay_spec()
    }

    /// [`forward_loss_scaled`](Self::forward_loss_scaled) with every MoE layer routed exactly
    /// as `routed` (this replica's `[batch, S, layers, k]`, identical on its TP ranks): each
    /// rank's routers get the ids of its sequence-parallel rows and recompute the routing
    /// weights from the current logits at them (see the [module docs](self)). Errors if
    /// `routed` does not fit the batch and the model ([`RoutedExperts::validate`]).
    pub fn forward_loss_replayed(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        device: &Device,
        aux_grad_scale: f64,
        routed: &RoutedExperts,
    ) -> Result<ParallelOutput, ModelError> {
        let spec = self.replay_spec();
        let trace = replay_trace(
            &self.rt,
            &spec,
            (input_ids, labels, batch),
            device,
            aux_grad_scale,
            routed,
        )?;
        Ok(self
            .forward_traced(input_ids, labels, batch, device, trace)?
            .0)
    }

    /// [`forward_loss_scaled`](Self::forward_loss_scaled) that also returns the replica's
    /// routing `[batch, S, layers, k]` (all-gathered over TP: every TP rank of the replica
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
        let spec = self.replay_spec();
        let batch_ids = (input_ids, labels, batch);
        let trace = record_trace(&self.rt, &spec, batch_ids, device, aux_grad_scale, replay)?;
        let (out, selected, _) = self.forward_traced(input_ids, labels, batch, device, trace)?;
        let routed = gather_routing(&self.rt, &spec, selected, batch, input_ids.len() / batch)?;
        Ok((out, routed))
    }
}

impl ParallelDeepseekV3 {
    /// What a routing for this model must match: the main model's MoE layers (decoder layers
    /// from `first_k_dense_replace` on; the MTP modules, which the loss forward does not run,
    /// have no entry), `k` (`num_experts_per_tok`), `E` (`n_routed_experts`).
    pub fn replay_spec(&self) -> ReplaySpec {
        self.model.replay_spec()
    }

    /// [`forward_loss_scaled`](Self::forward_loss_scaled) with every MoE layer routed exactly
    /// as `routed` (this replica's `[batch, S, layers, k]`, identical on its TP ranks), as
    /// [`ParallelQwen3Moe::forward_loss_replayed`]: the group-limited, bias-shifted selection
    /// is skipped, and the routing weights are the sigmoid scores of the current logits at the
    /// replayed ids (without `e_score_correction_bias`), normalised and multiplied by
    /// `routed_scaling_factor` as in a natural forward. Errors if `routed` does not fit the
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
        let spec = self.replay_spec();
        let rt = self.runtime();
        let batch_ids = (input_ids, labels, batch);
        let trace = replay_trace(rt, &spec, batch_ids, device, aux_grad_scale, routed)?;
        Ok(self
            .forward_traced_packed(input_ids, labels, batch, None, device, trace)?
            .0)
    }

    /// [`forward_loss_scaled`](Self::forward_loss_scaled) that also returns the replica's
    /// routing `[batch, S, layers, k]` (every TP rank of the replica returns the whole
    /// batch's), as [`ParallelQwen3Moe::forward_loss_recorded`]. With `replay`, the routers
    /// are forced as in [`forward_loss_replayed`](Self::forward_loss_replayed) and the
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
        let spec = self.replay_spec();
        let rt = self.runtime();
        let batch_ids = (input_ids, labels, batch);
        let trace = record_trace(rt, &spec, batch_ids, device, aux_grad_scale, replay)?;
        let (out, selected, _) =
            self.forward_traced_packed(input_ids, labels, batch, None, device, trace)?;
        let routed = gather_routing(rt, &spec, selected, batch, input_ids.len() / batch)?;
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

/// The replica's `[batch, seq, layers, k]` routing from every MoE layer's recorded
/// `[T_local, k]` selections of this rank (all-gathered over TP, in rank order).
fn gather_routing(
    rt: &SpRuntime,
    spec: &ReplaySpec,
    selected: Vec<Tensor<2, Int>>,
    batch: usize,
    seq: usize,
) -> Result<RoutedExperts, ModelError> {
    let layers = selected
        .into_iter()
        .map(|local| {
            let full = rt.tp.all_gather(local).map_err(err)?;
            full.into_data()
                .try_into_vec_as::<i64>()
                .map_err(|e| invalid("routed_experts.indices", format!("{e:?}")))
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    RoutedExperts::from_layers(batch, seq, spec.topk, &layers)
}

/// The trace replaying `routed` on this rank's sequence-parallel rows (checked against the
/// batch and `spec` first).
fn replay_trace(
    rt: &SpRuntime,
    spec: &ReplaySpec,
    (input_ids, labels, batch): BatchIds<'_>,
    device: &Device,
    aux_grad_scale: f64,
    routed: &RoutedExperts,
) -> Result<RouterTrace, ModelError> {
    let (rank, tp) = rt.tp_rank_size();
    let s = check_batch(input_ids, labels, batch, tp)?;
    routed.validate(batch, s, spec)?;
    let n = batch * s;
    let rows = rank * n / tp..(rank + 1) * n / tp;
    let k = routed.topk;
    let local = (0..routed.layers)
        .map(|layer| {
            let ids: Vec<i32> = routed
                .layer_rows(layer, rows.clone())
                .into_iter()
                .map(|v| v as i32)
                .collect();
            Tensor::<2, Int>::from_data(TensorData::new(ids, [rows.len(), k]), device)
        })
        .collect();
    let mut trace = RouterTrace::new(aux_grad_scale);
    trace.replay = Some(local);
    Ok(trace)
}
