//! Per-token next-token log-probabilities and entropies as data ([`TokenLogProbs`]) and their
//! closed form from full-vocabulary logits ([`logprobs_from_logits`]); the conventions are
//! [`crate::rl::logprobs`]'s. The sharded, vocab-parallel forward is
//! [`crate::distributed::logprobs`].

use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::ModelError;
use crate::causal_lm::IGNORE_INDEX;

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
