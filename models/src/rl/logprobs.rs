//! Per-token log-probabilities of the next token and per-token entropy of a causal LM, the
//! inputs of the RL losses of this module, on one rank (the sharded, vocab-parallel version is
//! [`crate::distributed::logprobs`]).
//!
//! Conventions shared by both: `input_ids` and `labels` are `[batch, S]` row-major host ids
//! (HF style, `labels` usually equal to `input_ids`, with [`IGNORE_INDEX`] = −100 on the tokens
//! that are not scored, e.g. the prompt). Position `t < S − 1` of row `b` of the result is
//!
//! - `logprobs[b, t] = log p(labels[b, t+1] | input_ids[b, ..=t])`,
//! - `entropy[b, t] = −Σ_v p_v log p_v` of that same next-token distribution,
//!
//! both `[batch, S − 1]` f32 (verl's `log_probs` / `entropy` of the response tokens). A position
//! whose target `labels[b, t+1]` is −100 holds **0** in both tensors, with a zero gradient:
//! the response mask of an RL batch is `labels[:, 1:] != −100`.

use burn::module::Module;
use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::ModelError;
use crate::causal_lm::{IGNORE_INDEX, token_ids};
use crate::deepseek_v3::DeepseekV3ForCausalLM;
use crate::qwen3_moe::Qwen3MoeForCausalLM;
use crate::train::TrainBatch;

/// Next-token log-probabilities and entropies of a batch, `[batch, S − 1]` each (see the
/// [module docs](self) for the positions and the masking).
#[derive(Debug, Clone)]
pub struct TokenLogProbs {
    /// `log p(labels[b, t+1] | input_ids[b, ..=t])`, 0 where the target is −100.
    /// Differentiable through the logits (unless computed detached).
    pub logprobs: Tensor<2>,
    /// Entropy of the next-token distribution at position `t`, 0 where the target is −100.
    /// Differentiable through the logits as well (an entropy bonus may use it), unless computed
    /// detached.
    pub entropy: Tensor<2>,
}

impl TokenLogProbs {
    /// Both tensors detached from the autodiff graph (e.g. old-policy log-probs kept for the
    /// next PPO epochs).
    pub fn detach(self) -> Self {
        Self {
            logprobs: self.logprobs.detach(),
            entropy: self.entropy.detach(),
        }
    }
}

/// Checks `ids` are in `0..vocab` (naming the first bad one by row and column of a
/// `[_, seq]` batch).
pub(crate) fn check_ids(
    what: &'static str,
    ids: &[i64],
    seq: usize,
    vocab: usize,
) -> Result<(), ModelError> {
    match ids.iter().position(|&t| t < 0 || t as u64 >= vocab as u64) {
        None => Ok(()),
        Some(at) => Err(ModelError::InvalidInput {
            what,
            reason: format!(
                "row {} column {} holds {}, outside the vocabulary 0..{vocab}",
                at / seq.max(1),
                at % seq.max(1),
                ids[at]
            ),
        }),
    }
}

/// The targets `labels[:, 1:]` of a `[batch, seq]` batch, row-major (`batch · (seq − 1)`),
/// after checking the shape (`seq ≥ 2`) and that every label is in `0..vocab` or −100.
pub(crate) fn next_token_targets(
    labels: &[i64],
    batch: usize,
    seq: usize,
    vocab: usize,
) -> Result<Vec<i64>, ModelError> {
    if batch == 0 || seq < 2 || labels.len() != batch * seq {
        return Err(ModelError::InvalidInput {
            what: "labels",
            reason: format!(
                "{} labels for a [{batch}, {seq}] batch; next-token log-probs need at least one \
                 sequence of at least 2 tokens",
                labels.len()
            ),
        });
    }
    if let Some(at) = labels
        .iter()
        .position(|&t| t != IGNORE_INDEX && (t < 0 || t as u64 >= vocab as u64))
    {
        return Err(ModelError::InvalidInput {
            what: "labels",
            reason: format!(
                "row {} column {} holds {}, neither in the vocabulary 0..{vocab} nor \
                 {IGNORE_INDEX}",
                at / seq,
                at % seq,
                labels[at]
            ),
        });
    }
    Ok(labels
        .chunks(seq)
        .flat_map(|row| row[1..].iter().copied())
        .collect())
}

/// Column indices `[n, 1]` (ignored targets at 0) and validity `[n, 1]` (1 = scored) of
/// `targets`, each shifted by `-offset` and kept only inside `0..width` (the columns a
/// vocabulary shard holds; `offset = 0`, `width = V` for the full vocabulary).
pub(crate) fn target_columns(
    targets: &[i64],
    offset: usize,
    width: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2>) {
    let n = targets.len();
    let (mut idx, mut keep) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for &t in targets {
        let local = t - offset as i64;
        let inside = t != IGNORE_INDEX && local >= 0 && local < width as i64;
        idx.push(if inside { local as i32 } else { 0 });
        keep.push(if inside { 1.0f32 } else { 0.0 });
    }
    (
        Tensor::from_data(TensorData::new(idx, [n, 1]), device),
        Tensor::from_data(TensorData::new(keep, [n, 1]), device),
    )
}

/// Per-token log-probs and entropy from full-vocabulary `logits [B, S, V]` (world = 1) and
/// HF-style `labels [B, S]` (host, row-major; −100 ⇒ 0): `log_softmax` in f32 over the
/// vocabulary of positions `0..S−1`, the target column picked, `H = −Σ p·log p`. Both outputs
/// are differentiable through `logits`.
///
/// Errors if `labels` does not hold `B·S` values, `S < 2`, or a label is neither in `0..V` nor
/// −100.
pub fn logprobs_from_logits(
    logits: Tensor<3>,
    labels: &[i64],
) -> Result<TokenLogProbs, ModelError> {
    let [b, s, v] = logits.dims();
    let targets = next_token_targets(labels, b, s, v)?;
    let n = targets.len();
    let device = logits.device();
    let logp = log_softmax(
        logits.narrow(1, 0, s - 1).reshape([n, v]).cast(DType::F32),
        1,
    );
    let (idx, valid) = target_columns(&targets, 0, v, &device);
    let picked = logp.clone().gather(1, idx) * valid.clone();
    let entropy = (logp.clone().exp() * logp).sum_dim(1).neg() * valid;
    Ok(TokenLogProbs {
        logprobs: picked.reshape([b, s - 1]),
        entropy: entropy.reshape([b, s - 1]),
    })
}

/// [`logprobs_from_logits`] of a single-rank Qwen3-MoE's forward over `input_ids [batch, S]`
/// (host, row-major) on `device` (an autodiff device to train through the log-probs).
///
/// Errors on ids outside the vocabulary, a shape that is not `[batch, S ≥ 2]`, or bad labels.
pub fn qwen3_moe_logprobs(
    model: &Qwen3MoeForCausalLM,
    input_ids: &[i64],
    labels: &[i64],
    batch: usize,
    device: &Device,
) -> Result<TokenLogProbs, ModelError> {
    let vocab = model.config().vocab_size;
    let ids = checked_token_ids(input_ids, labels, batch, vocab, device)?;
    logprobs_from_logits(model.forward(ids)?.logits, labels)
}

/// Checks `input_ids` (`batch` rows of `S ≥ 2` ids in `0..vocab`) and `labels`, and returns
/// the ids as a `[batch, S]` tensor on `device`.
fn checked_token_ids(
    input_ids: &[i64],
    labels: &[i64],
    batch: usize,
    vocab: usize,
    device: &Device,
) -> Result<Tensor<2, Int>, ModelError> {
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
    next_token_targets(labels, batch, seq, vocab)?;
    token_ids(input_ids, [batch, seq], vocab, device)
}

/// [`logprobs_from_logits`] of a single-rank DeepSeek-V3's main-model forward (the MTP
/// modules do not take part) over `input_ids [batch, S]` (host, row-major) on `device`, as
/// [`qwen3_moe_logprobs`].
///
/// Errors on ids outside the vocabulary, a shape that is not `[batch, S ≥ 2]`, or bad labels.
pub fn deepseek_v3_logprobs(
    model: &DeepseekV3ForCausalLM,
    input_ids: &[i64],
    labels: &[i64],
    batch: usize,
    device: &Device,
) -> Result<TokenLogProbs, ModelError> {
    let vocab = model.config().vocab_size;
    let ids = checked_token_ids(input_ids, labels, batch, vocab, device)?;
    logprobs_from_logits(model.forward(ids)?.logits, labels)
}

/// [`deepseek_v3_logprobs`] in forward-only mode (the model's [`valid`](Module::valid) copy,
/// plain tensors), for reference and old policies.
pub fn deepseek_v3_logprobs_detached(
    model: &DeepseekV3ForCausalLM,
    input_ids: &[i64],
    labels: &[i64],
    batch: usize,
) -> Result<TokenLogProbs, ModelError> {
    let model = model.valid();
    let device = model.device();
    deepseek_v3_logprobs(&model, input_ids, labels, batch, &device)
}

/// [`qwen3_moe_logprobs`] of a [`TrainBatch`], packed or padded when it carries a
/// [`SequenceLayout`](crate::packing::SequenceLayout)
/// ([`Qwen3MoeForCausalLM::forward_packed`]): each document's log-probs equal those of the
/// document alone; positions whose target lies across a document boundary or in padding hold
/// 0 (their labels are −100).
pub fn qwen3_moe_logprobs_batch(
    model: &Qwen3MoeForCausalLM,
    batch: &TrainBatch,
    device: &Device,
) -> Result<TokenLogProbs, ModelError> {
    let Some(layout) = batch.layout() else {
        return qwen3_moe_logprobs(model, &batch.input_ids, &batch.labels, batch.batch, device);
    };
    let vocab = model.config().vocab_size;
    let (rows, seq) = (batch.batch, batch.seq_len());
    if seq < 2 {
        return Err(ModelError::InvalidInput {
            what: "input_ids",
            reason: format!("{rows} sequences of {seq} tokens; log-probs need at least 2"),
        });
    }
    next_token_targets(&batch.labels, rows, seq, vocab)?;
    let ids = token_ids(&batch.input_ids, [rows, seq], vocab, device)?;
    logprobs_from_logits(model.forward_packed(ids, layout)?.logits, &batch.labels)
}

/// [`qwen3_moe_logprobs`] in forward-only mode, for reference and old policies: the model's
/// [`valid`](Module::valid) copy runs on the device without autodiff, so nothing is recorded
/// and the results are plain (non-autodiff) tensors.
pub fn qwen3_moe_logprobs_detached(
    model: &Qwen3MoeForCausalLM,
    input_ids: &[i64],
    labels: &[i64],
    batch: usize,
) -> Result<TokenLogProbs, ModelError> {
    let model = model.valid();
    let device = model.device();
    qwen3_moe_logprobs(&model, input_ids, labels, batch, &device)
}
