//! Per-token log-probabilities of the next token and per-token entropy of a causal LM, the
//! inputs of the RL losses of this module, on one rank (the sharded, vocab-parallel version is
//! [`crate::distributed::logprobs`]).
//!
//! Conventions shared by both: `input_ids` and `labels` are `[batch, S]` row-major host ids
//! (HF style, `labels` usually equal to `input_ids`, with [`IGNORE_INDEX`](crate::causal_lm::IGNORE_INDEX) = −100 on the tokens
//! that are not scored, e.g. the prompt). Position `t < S − 1` of row `b` of the result is
//!
//! - `logprobs[b, t] = log p(labels[b, t+1] | input_ids[b, ..=t])`,
//! - `entropy[b, t] = −Σ_v p_v log p_v` of that same next-token distribution,
//!
//! both `[batch, S − 1]` f32 (verl's `log_probs` / `entropy` of the response tokens). A position
//! whose target `labels[b, t+1]` is −100 holds **0** in both tensors, with a zero gradient:
//! the response mask of an RL batch is `labels[:, 1:] != −100`.

use burn::tensor::Device;

use crate::ModelError;
use crate::batch::TrainBatch;
use crate::causal_lm::token_ids;
use crate::distributed::{RouterTrace, ShardModel};
use crate::families::local_context;
pub use crate::logprob::{TokenLogProbs, logprobs_from_logits};
pub(crate) use crate::logprob::{check_ids, next_token_targets};

/// [`logprobs_from_logits`] of a single-rank model's forward (its main model: MTP modules do
/// not take part) over `input_ids [batch, S]` (host, row-major) on `device` (an autodiff
/// device to train through the log-probs); any family.
///
/// Errors on ids outside the vocabulary, a shape that is not `[batch, S ≥ 2]`, or bad labels.
pub fn model_logprobs<M: ShardModel>(
    model: &M,
    input_ids: &[i64],
    labels: &[i64],
    batch: usize,
    device: &Device,
) -> Result<TokenLogProbs, ModelError> {
    let train = TrainBatch::new(input_ids.to_vec(), labels.to_vec(), batch)?;
    model_logprobs_batch(model, &train, device)
}

/// [`model_logprobs`] of a [`TrainBatch`], packed or padded when it carries a
/// [`SequenceLayout`](crate::packing::SequenceLayout): each document's log-probs equal those of
/// the document alone; positions whose target lies across a document boundary or in padding
/// hold 0 (their labels are −100).
pub fn model_logprobs_batch<M: ShardModel>(
    model: &M,
    batch: &TrainBatch,
    device: &Device,
) -> Result<TokenLogProbs, ModelError> {
    let ctx = local_context::<M>(model.model_config())?;
    let vocab = ctx.vocab().len();
    let (rows, seq) = (batch.batch, batch.seq_len());
    if rows == 0 || seq < 2 {
        return Err(ModelError::InvalidInput {
            what: "input_ids",
            reason: format!(
                "{} ids do not form {rows} sequences of at least 2 tokens",
                batch.input_ids.len()
            ),
        });
    }
    check_ids("input_ids", &batch.input_ids, seq, vocab)?;
    next_token_targets(&batch.labels, rows, seq, vocab)?;
    let ids = token_ids(&batch.input_ids, [rows, seq], vocab, device)?;
    let mut trace = RouterTrace::new(1.0);
    let logits = ctx
        .logits(model, ids, batch.layout(), None, &mut trace)?
        .logits;
    logprobs_from_logits(logits, &batch.labels)
}

/// [`model_logprobs`] in forward-only mode, for reference and old policies: the model's
/// [`valid`](burn::module::Module::valid) copy runs on the device without autodiff, so nothing is recorded
/// and the results are plain (non-autodiff) tensors.
pub fn model_logprobs_detached<M: ShardModel>(
    model: &M,
    input_ids: &[i64],
    labels: &[i64],
    batch: usize,
) -> Result<TokenLogProbs, ModelError> {
    let model = model.valid();
    let device = crate::weights::module_device(&model);
    model_logprobs(&model, input_ids, labels, batch, &device)
}
