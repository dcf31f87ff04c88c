//! Per-token next-token log-probabilities and entropy of a sharded model,
//! computed vocab-parallel (the inputs of [`crate::rl`]'s losses under any layout).
//!
//! The head of a [`Sharded`] model gathers the replica's sequence-parallel tokens and gives
//! every TP rank the logits `[B·S, V/tp]` of its vocabulary columns only. From them,
//! [`vocab_parallel_logprobs`] computes, per token row and without any rank holding the full
//! vocabulary of a row, with `z = logit − m` and `m` the row's global max:
//!
//! - `m`: all-reduce (max) over TP of the local row max (detached, as in the cross-entropy);
//! - `Z = Σ_v e^{z_v}` and `A = Σ_v e^{z_v}·z_v`: local sums, all-reduced (sum) over TP;
//! - `z_y`: the target column picked on the rank owning it (0 elsewhere), all-reduced (sum);
//! - `log p_y = z_y − log Z` and `H = −Σ p_v log p_v = log Z − A / Z`.
//!
//! The three sums travel in one all-reduce of `[rows, 3]`. Its backward is the identity (the
//! tensor-parallel convention: every TP rank computes the same loss of the reduced values), so
//! each rank's logits get `∂/∂z_v` of its own columns: `onehot − p` for the log-prob and
//! `−p_v (z_v − A/Z)` (= `−p_v (log p_v + H)`) for the entropy; both outputs are therefore
//! differentiable, and each is identical on the TP ranks of a replica.
//!
//! Shapes, target positions and −100 masking follow [`crate::rl::logprobs`]: results are
//! `[batch, S − 1]`, position `t` scoring `labels[b, t + 1]`, 0 where that label is −100.

use std::ops::Range;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use moe_backend::comm::autograd::{
    gather_from_sequence_parallel_region, reduce_from_tensor_parallel_region,
};
use moe_backend::comm::{Comm, ReduceOp};

use super::context_parallel::gathered_positions;
use super::runtime::{Prepared, SpRuntime};
use super::sharded::{CausalLmShard, ChunkForward};
use super::{ChunkParts, ShardModel, Sharded, err};
use crate::ModelError;
use crate::batch::TrainBatch;
use crate::causal_lm::IGNORE_INDEX;
use crate::logprob::{TokenLogProbs, check_ids, next_token_targets, target_columns};

/// Log-probabilities of `targets` and entropies, per row, of `logits [N, V/tp]` (this rank's
/// vocabulary columns `vocab`, the rows identical in meaning on every rank of `tp`), computed
/// in f32 across the TP group without gathering the vocabulary (see the
/// [module docs](self)). `targets [N]` are global token ids or −100 (row ignored: both
/// outputs 0, zero gradient). Returns `([N], [N])`, the same on every TP rank, differentiable.
///
/// Errors if the shapes disagree or a target is neither in `0..V` (`V = vocab.len() · tp`) nor
/// −100; every rank of `tp` must call it with the same rows (it runs collectives).
pub fn vocab_parallel_logprobs(
    logits: Tensor<2>,
    targets: &[i64],
    vocab: Range<usize>,
    tp: &Comm,
) -> Result<(Tensor<1>, Tensor<1>), ModelError> {
    let [n, vl] = logits.dims();
    let full = vl * tp.size();
    if targets.len() != n || vocab.len() != vl {
        return Err(ModelError::InvalidInput {
            what: "targets",
            reason: format!(
                "logits [{n}, {vl}] need {n} targets (got {}) and a vocabulary shard of {vl} \
                 columns (got {vocab:?})",
                targets.len()
            ),
        });
    }
    if let Some(&bad) = targets
        .iter()
        .find(|&&t| t != IGNORE_INDEX && (t < 0 || t as u64 >= full as u64))
    {
        return Err(ModelError::InvalidInput {
            what: "targets",
            reason: format!("target {bad} is neither in the vocabulary 0..{full} nor -100"),
        });
    }
    let device = logits.device();
    let logits = logits.cast(DType::F32);
    // Constant max: `detach` alone keeps `require_grad` on a leaf, and `all_reduce(max)` has no
    // backward.
    let local_max = logits.clone().detach().set_require_grad(false).max_dim(1);
    let max = tp.all_reduce(local_max, ReduceOp::Max).map_err(err)?;
    let z = logits - max;
    let e = z.clone().exp();
    let (idx, owned) = target_columns(targets, vocab.start, vl, &device);
    let local = Tensor::cat(
        vec![
            e.clone().sum_dim(1),
            (e * z.clone()).sum_dim(1),
            z.gather(1, idx) * owned,
        ],
        1,
    );
    let sums = reduce_from_tensor_parallel_region(tp, local).map_err(err)?;
    let sum_exp = sums.clone().narrow(1, 0, 1);
    let sum_ez = sums.clone().narrow(1, 1, 1);
    let target = sums.narrow(1, 2, 1);
    let valid: Vec<f32> = targets
        .iter()
        .map(|&t| if t == IGNORE_INDEX { 0.0 } else { 1.0 })
        .collect();
    let valid = Tensor::<1>::from_data(burn::tensor::TensorData::new(valid, [n]), &device);
    let log_z = sum_exp.clone().log();
    let logprobs = (target - log_z.clone()).reshape([n]) * valid.clone();
    let entropy = (log_z - sum_ez / sum_exp).reshape([n]) * valid;
    Ok((logprobs, entropy))
}

impl SpRuntime {
    /// Per-token next-token log-probs and entropies `[rows, S − 1]` of this rank's head
    /// `logits [rows·P, V/tp]` at its positions `p.positions` (`P = S`, or its two chunks
    /// under context parallelism), scoring `p.targets` ([`vocab_parallel_logprobs`]); under
    /// context parallelism the rows are all-gathered over the CP group and put back in
    /// position order, with the backward taking each rank's own positions (every CP rank then
    /// holds the same values, and a loss computed from them alike on every CP rank gets each
    /// rank's share of the gradient, as under TP). Differentiable.
    pub(crate) fn token_logprobs(
        &self,
        logits: Tensor<2>,
        p: &Prepared<'_>,
        rows: usize,
    ) -> Result<TokenLogProbs, ModelError> {
        let (logprobs, entropy) =
            vocab_parallel_logprobs(logits, &p.targets, self.vocab.clone(), &self.tp)?;
        let held = p.positions.len();
        let whole = |t: Tensor<1>| -> Result<Tensor<2>, ModelError> {
            let t = self.cp_whole_rows(t.reshape([rows, held]), p.s)?;
            Ok(t.narrow(1, 0, p.s - 1))
        };
        Ok(TokenLogProbs {
            logprobs: whole(logprobs)?,
            entropy: whole(entropy)?,
        })
    }

    /// `t [rows, P]` at this rank's context-parallel positions → `[rows, S]` in position order
    /// (all-gathered over `cp`; backward: this rank's positions of the gradient).
    fn cp_whole_rows(&self, t: Tensor<2>, s: usize) -> Result<Tensor<2>, ModelError> {
        let cp = self.cp.size();
        if cp == 1 {
            return Ok(t);
        }
        let gathered = gather_from_sequence_parallel_region(&self.cp, t.swap_dims(0, 1), false)
            .map_err(err)?;
        // Row `i` of the gathered block holds position `order[i]`.
        let order = gathered_positions(s, cp);
        let mut at = vec![0i64; s];
        for (i, &pos) in order.iter().enumerate() {
            if let Some(slot) = at.get_mut(pos) {
                *slot = i as i64;
            }
        }
        let idx = Tensor::<1, Int>::from_data(TensorData::new(at, [s]), &gathered.device());
        Ok(gathered.select(0, idx).swap_dims(0, 1))
    }
}

/// Per-token next-token log-probs and entropies `[batch, S − 1]` of one replica micro-batch
/// through `shard`'s whole model (every layer on this rank: `pp = 1`), packed or padded when
/// the batch carries a layout, under any tp / sp / cp / ep / etp / dp layout (whole rows on
/// every rank of the replica); router losses attached with `aux_grad_scale`. Under pipeline
/// parallelism use [`shard_logprobs`](super::logprob_pipeline::shard_logprobs) or the
/// trainer's [`step_with_logprobs`](crate::train::Trainer::step_with_logprobs).
pub fn shard_logprobs_batch<S: CausalLmShard>(
    shard: &S,
    batch: &TrainBatch,
    device: &Device,
    aux_grad_scale: f64,
) -> Result<TokenLogProbs, ModelError> {
    if shard.pipeline().is_some() {
        return Err(ModelError::unsupported(
            "pp",
            "a whole-model log-prob forward needs every layer on one rank; under pipeline \
             parallelism use `shard_logprobs` or `Trainer::step_with_logprobs` (they run the \
             pipeline schedule)",
        ));
    }
    let whole = ChunkParts {
        virtual_stage: 0,
        embedding: true,
        layers: 0..shard.local_layers(),
        loss: true,
    };
    match shard.forward_logprobs_chunk(&whole, 0, batch, device, aux_grad_scale, None)? {
        ChunkForward::LogProbs { logprobs, .. } => Ok(logprobs),
        _ => Err(ModelError::layout(
            "pp",
            "the whole model's log-prob forward returned no log-probs",
        )),
    }
}

/// Checks `input_ids` form `batch` rows of at least 2 ids in `0..vocab`; returns `S`.
fn check_logprob_ids(input_ids: &[i64], batch: usize, vocab: usize) -> Result<usize, ModelError> {
    let seq = input_ids.len().checked_div(batch).unwrap_or(0);
    if batch == 0 || seq < 2 || input_ids.len() != batch * seq {
        return Err(ModelError::InvalidInput {
            what: "input_ids",
            reason: format!(
                "{} ids do not form {batch} sequences of at least 2 tokens",
                input_ids.len()
            ),
        });
    }
    check_ids("input_ids", input_ids, seq, vocab)?;
    Ok(seq)
}

impl<M: ShardModel> Sharded<M> {
    /// Per-token next-token log-probabilities and entropies `[batch, S − 1]` of this replica's
    /// batch `input_ids [batch, S]` (row-major host ids, identical on every TP rank of the
    /// replica), scoring HF-style `labels` (usually the ids; −100 ⇒ 0, see
    /// [`crate::rl::logprobs`]). Identical on the TP ranks of a replica; differentiable on an
    /// autodiff `device` (train an RL loss of them like [`forward_loss`](Self::forward_loss)'s
    /// loss: every rank calls `backward`).
    ///
    /// Runs the main model's sequence-parallel forward (the MTP modules do not take part), its
    /// vocab-parallel head and [`vocab_parallel_logprobs`] on this rank's vocabulary columns.
    /// Router losses configured on the shard's routers are attached to the graph exactly as
    /// by `forward_loss` (so a backward of an RL loss of these log-probs carries them too).
    ///
    /// Errors if `S < 2`, an id is outside the vocabulary, a label is neither in it nor −100,
    /// or `batch · S` does not split over `tp`.
    pub fn forward_logprobs(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        device: &Device,
    ) -> Result<TokenLogProbs, ModelError> {
        self.forward_logprobs_scaled(input_ids, labels, batch, device, 1.0)
    }

    /// [`forward_logprobs`](Self::forward_logprobs) whose router losses (attached to the graph)
    /// get the upstream gradient `aux_grad_scale`, as
    /// [`forward_loss_scaled`](Self::forward_loss_scaled) (the trainer's loss hook passes
    /// `1 / micro-batches`).
    pub fn forward_logprobs_scaled(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        device: &Device,
        aux_grad_scale: f64,
    ) -> Result<TokenLogProbs, ModelError> {
        let vocab = crate::CausalLm::vocab_size(self);
        let seq = check_logprob_ids(input_ids, batch, vocab)?;
        next_token_targets(labels, batch, seq, vocab)?;
        let batch = TrainBatch::new(input_ids.to_vec(), labels.to_vec(), batch)?;
        shard_logprobs_batch(self, &batch, device, aux_grad_scale)
    }

    /// [`forward_logprobs_scaled`](Self::forward_logprobs_scaled) of a [`TrainBatch`], packed
    /// or padded when it carries a [`SequenceLayout`](crate::packing::SequenceLayout) (see
    /// [`forward_loss_batch`](Self::forward_loss_batch)): each document's log-probs equal
    /// those of the document alone, and positions whose target lies across a document
    /// boundary or in padding hold 0 (their labels are −100).
    pub fn forward_logprobs_batch(
        &self,
        batch: &TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
    ) -> Result<TokenLogProbs, ModelError> {
        let vocab = crate::CausalLm::vocab_size(self);
        check_logprob_ids(&batch.input_ids, batch.batch, vocab)?;
        shard_logprobs_batch(self, batch, device, aux_grad_scale)
    }

    /// A forward-only copy of this rank's model (old and reference policies): parameters on the
    /// device without autodiff ([`Module::valid`](burn::module::Module::valid)), same groups and dispatcher. Later optimizer
    /// steps on `self` do not change it.
    pub fn valid(&self) -> Self {
        Self {
            model: self.model.valid(),
            ..self.clone()
        }
    }

    /// [`forward_logprobs`](Self::forward_logprobs) in forward-only mode: runs on
    /// [`valid`](Self::valid)'s copy, on the parameters' device without autodiff, so nothing is
    /// recorded and the results are plain tensors. Every rank of the world must call it (it
    /// runs the same collectives as the forward).
    pub fn forward_logprobs_detached(
        &self,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
    ) -> Result<TokenLogProbs, ModelError> {
        let frozen = self.valid();
        let device = crate::weights::module_device(&frozen.model);
        frozen.forward_logprobs(input_ids, labels, batch, &device)
    }
}
