//! What every causal LM shares: the LM head, the causal-LM loss, HF's load-balancing loss for
//! Qwen3-MoE (docs/models.md §Qwen3-MoE load-balancing loss), greedy/sampled generation with a KV
//! cache, and shape-only parameter counting.

mod generation;

pub use generation::{GenerationConfig, Sampling, generate};

use burn::nn::{Embedding, Linear};
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use moe_backend::ops::{routing_map_from_indices, topk_indices};

use crate::ModelError;
use crate::layers::kv_cache::KvCache;

/// Losses of a labelled forward ([`crate::AnyCausalLm::losses`]), each `[1]`.
#[derive(Debug, Clone)]
pub struct LmLosses {
    /// What HF's `outputs.loss` is: cross-entropy, plus `router_aux_loss_coef · aux_loss` for
    /// Qwen3-MoE (docs/models.md §Qwen3-MoE load-balancing loss).
    pub loss: Tensor<1>,
    /// HF's load-balancing loss (Qwen3-MoE); `None` for models HF computes none for (dense
    /// Qwen3, DeepSeek-V3, whose routing is auxiliary-loss free).
    pub aux_loss: Option<Tensor<1>>,
}

/// Labels equal to this are ignored by [`causal_lm_loss`] (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// A decoder-only language model that can continue a sequence from a [`KvCache`].
pub trait CausalLm {
    /// Vocabulary size `V`.
    fn vocab_size(&self) -> usize;

    /// An empty cache with one entry per decoder layer.
    fn new_cache(&self) -> KvCache;

    /// Logits `[B, S, V]` for `input_ids [B, S]` at positions `cache.seq_len()..`; the new
    /// keys/values are appended to `cache`.
    fn forward_cached(
        &self,
        input_ids: Tensor<2, Int>,
        cache: &mut KvCache,
    ) -> Result<Tensor<3>, ModelError>;
}

/// `hidden [B, S, H] → logits [B, S, V]` with `lm_head`, or with `embed_tokens`' weight when
/// the embeddings are tied (`lm_head = None`).
pub fn lm_logits(hidden: Tensor<3>, lm_head: Option<&Linear>, embed: &Embedding) -> Tensor<3> {
    match lm_head {
        Some(head) => head.forward(hidden),
        None => {
            let [b, s, h] = hidden.dims();
            let weight = embed.weight.val();
            let v = weight.dims()[0];
            hidden
                .reshape([b * s, h])
                .matmul(weight.transpose())
                .reshape([b, s, v])
        }
    }
}

/// Token ids `[batch, seq]` (row-major `ids`) as an int tensor, after checking every id is
/// in `0..vocab_size`.
pub fn token_ids(
    ids: &[i64],
    [batch, seq]: [usize; 2],
    vocab_size: usize,
    device: &Device,
) -> Result<Tensor<2, Int>, ModelError> {
    if ids.len() != batch * seq || ids.is_empty() {
        return Err(ModelError::InvalidInput {
            what: "input_ids",
            reason: format!("{} ids for shape [{batch}, {seq}]", ids.len()),
        });
    }
    if let Some(bad) = ids
        .iter()
        .find(|&&t| t < 0 || t as u64 >= vocab_size as u64)
    {
        return Err(ModelError::InvalidInput {
            what: "input_ids",
            reason: format!("token id {bad} is outside 0..{vocab_size}"),
        });
    }
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Tensor::from_data(
        TensorData::new(ids, [batch, seq]),
        device,
    ))
}

/// Causal-LM cross-entropy (HF `ForCausalLMLoss`): the mean over the shifted targets
/// `labels[:, 1:]` that are not [`IGNORE_INDEX`] of `−log softmax(f32(logits[:, :-1]))`.
///
/// `logits [B, S, V]`, `labels [B, S]` (host values, row-major). Errors if the shapes
/// disagree, a label is out of range, or no target is valid. Returns `[1]`.
pub fn causal_lm_loss(logits: Tensor<3>, labels: &[i64]) -> Result<Tensor<1>, ModelError> {
    let [b, s, v] = logits.dims();
    if labels.len() != b * s {
        return Err(ModelError::InvalidInput {
            what: "labels",
            reason: format!("{} labels for logits [{b}, {s}, {v}]", labels.len()),
        });
    }
    let mut targets = Vec::with_capacity(b * (s.saturating_sub(1)));
    let mut weights = Vec::with_capacity(targets.capacity());
    for row in labels.chunks(s) {
        for &t in &row[1..] {
            if t == IGNORE_INDEX {
                targets.push(0i32);
                weights.push(0.0f32);
            } else if t < 0 || t as u64 >= v as u64 {
                return Err(ModelError::InvalidInput {
                    what: "labels",
                    reason: format!("label {t} is outside 0..{v} (and is not {IGNORE_INDEX})"),
                });
            } else {
                targets.push(t as i32);
                weights.push(1.0);
            }
        }
    }
    let valid: f32 = weights.iter().sum();
    if valid == 0.0 {
        return Err(ModelError::InvalidInput {
            what: "labels",
            reason: "no valid target after shifting (all ignored or S = 1)".to_owned(),
        });
    }
    let n = targets.len();
    let device = logits.device();
    let logp = log_softmax(
        logits.narrow(1, 0, s - 1).reshape([n, v]).cast(DType::F32),
        1,
    );
    let targets = Tensor::<2, Int>::from_data(TensorData::new(targets, [n, 1]), &device);
    let weights = Tensor::<2>::from_data(TensorData::new(weights, [n, 1]), &device);
    let picked = logp.gather(1, targets) * weights;
    Ok(picked.sum().neg().div_scalar(valid))
}

/// HF `load_balancing_loss_func` (docs/models.md §Qwen3-MoE load-balancing loss) over the router
/// logits `[T, E]` of every MoE layer, treated as concatenated: `aux = E · Σ_e (c_e / D)·(p_e / D)`
/// with `c_e` the top-k assignments and `p_e` the softmax mass of expert `e`, both summed over
/// layers and rows weighted by `attention_mask` (`[T]` host values, 1 = real token; `None` ⇒ all
/// ones), and `D = n_layers · Σ mask`. Equals `k` for a uniform router. Returns `[1]`,
/// differentiable through the logits. The softmax is taken in f32 (HF takes it in the logits'
/// dtype, which is the same thing under this crate's default f32 compute).
pub fn hf_load_balancing_loss(
    router_logits: &[Tensor<2>],
    top_k: usize,
    attention_mask: Option<&[f32]>,
) -> Result<Tensor<1>, ModelError> {
    let Some(first) = router_logits.first() else {
        return Err(ModelError::InvalidInput {
            what: "router_logits",
            reason: "no MoE layer produced router logits".to_owned(),
        });
    };
    let [t, e] = first.dims();
    let device = first.device();
    let mask = match attention_mask {
        Some(m) if m.len() != t => {
            return Err(ModelError::InvalidInput {
                what: "attention_mask",
                reason: format!("{} values for {t} router rows", m.len()),
            });
        }
        Some(m) => Some(Tensor::<2>::from_data(
            TensorData::new(m.to_vec(), [t, 1]),
            &device,
        )),
        None => None,
    };
    let rows = attention_mask.map_or(t as f64, |m| m.iter().map(|&x| f64::from(x)).sum());
    let mut counts = Tensor::<2>::zeros([1, e], &device);
    let mut prob_sum = Tensor::<2>::zeros([1, e], &device);
    for logits in router_logits {
        if logits.dims() != [t, e] {
            return Err(ModelError::InvalidInput {
                what: "router_logits",
                reason: format!("layers disagree: {:?} vs [{t}, {e}]", logits.dims()),
            });
        }
        let p = softmax(logits.clone().cast(DType::F32), 1);
        let selected = routing_map_from_indices(topk_indices(p.clone().detach(), top_k)?, e)
            .float()
            .cast(DType::F32);
        let (selected, p) = match &mask {
            Some(m) => (selected * m.clone(), p * m.clone()),
            None => (selected, p),
        };
        counts = counts + selected.sum_dim(0);
        prob_sum = prob_sum + p.sum_dim(0);
    }
    let d = router_logits.len() as f64 * rows;
    let aux = (counts.div_scalar(d) * prob_sum.div_scalar(d))
        .sum()
        .mul_scalar(e as f64);
    Ok(aux)
}

/// Shape-only parameter counts ([`crate::families::param_count`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ParamCount {
    /// Every parameter (embeddings, untied head, all experts).
    pub total: u64,
    /// Parameters a token passes through: all dense weights, embedding and head, the router
    /// and `k` routed (+ shared) experts per MoE layer.
    pub active: u64,
    /// Parameters of DeepSeek-V3's multi-token-prediction modules as stored (not in `total`;
    /// 0 for other models).
    pub mtp: u64,
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;
    use crate::Qwen3MoeConfig;

    #[test]
    fn qwen3_30b_a3b_counts() {
        let cfg = Qwen3MoeConfig::from_json_str(
            r#"{"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                "moe_intermediate_size": 768, "intermediate_size": 6144}"#,
        )
        .unwrap();
        let c = crate::families::param_count::<crate::qwen3_moe::Qwen3Moe>(&cfg).unwrap();
        assert!((30.4e9..30.6e9).contains(&(c.total as f64)), "{c:?}");
        assert!((3.25e9..3.4e9).contains(&(c.active as f64)), "{c:?}");
    }

    #[test]
    fn loss_ignores_masked_targets_and_matches_a_uniform_model() {
        let device = Device::flex();
        // Uniform logits: CE = ln V for every valid target.
        let logits = Tensor::<3>::zeros([2, 3, 8], &device);
        let loss = causal_lm_loss(logits.clone(), &[1, 2, 3, 4, IGNORE_INDEX, 5]).unwrap();
        assert!((loss.into_scalar::<f32>() - 8f32.ln()).abs() < 1e-6);
        assert!(
            causal_lm_loss(
                logits.clone(),
                &[1, IGNORE_INDEX, IGNORE_INDEX, 0, -100, -100]
            )
            .is_err()
        );
        assert!(causal_lm_loss(logits, &[1, 2, 9, 4, 5, 6]).is_err());
    }

    #[test]
    fn load_balancing_loss_is_k_for_a_uniform_router() {
        let device = Device::flex();
        let uniform = Tensor::<2>::zeros([6, 4], &device);
        let aux = hf_load_balancing_loss(&[uniform.clone(), uniform], 2, None).unwrap();
        assert!((aux.into_scalar::<f32>() - 2.0).abs() < 1e-6);
        // A mask that drops rows changes nothing for a row-independent router.
        let logits = Tensor::<2>::random([6, 4], Distribution::Normal(0.0, 1.0), &device);
        let mask = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0];
        let masked = hf_load_balancing_loss(std::slice::from_ref(&logits), 2, Some(&mask)).unwrap();
        let kept = Tensor::cat(
            [0, 1, 3, 5]
                .iter()
                .map(|&r| logits.clone().narrow(0, r, 1))
                .collect(),
            0,
        );
        let direct = hf_load_balancing_loss(&[kept], 2, None).unwrap();
        assert!((masked.into_scalar::<f32>() - direct.into_scalar::<f32>()).abs() < 1e-6);
    }

    #[test]
    fn token_ids_are_range_checked() {
        let device = Device::flex();
        assert!(token_ids(&[0, 3], [1, 2], 4, &device).is_ok());
        assert!(token_ids(&[0, 4], [1, 2], 4, &device).is_err());
        assert!(token_ids(&[0, -1], [1, 2], 4, &device).is_err());
        assert!(token_ids(&[0], [1, 2], 4, &device).is_err());
    }
}
