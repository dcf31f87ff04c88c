//! Multi-token prediction as DeepSeek-V3 releases it (docs/models.md §Multi-token prediction), beside HF 5.23's
//! `MtpLayer` / `MtpModel.forward_layer`; the module type is generic over its decoder layer, so
//! every family whose release carries DeepSeek-style MTP layers uses it.
//!
//! Module `j` is stored as decoder layer `N + j`. For position `i` it combines the embedding of
//! token `i + j + 1` with the previous depth's hidden state `hʲᵢ` (`h⁰` = the main model's
//! final-normed output): `u = eh_proj([enorm(emb) ; hnorm(h)])` (embedding first), runs one MoE
//! decoder layer over the shifted sequence, and normalises with `shared_head.norm`; the shared
//! `lm_head` turns `hʲ⁺¹` into logits for token `i + j + 2`. The release copies
//! `embed_tokens` / `shared_head.head` of layer `N + j` are the main model's embedding and head
//! (shared, not loaded).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};

use crate::ModelError;
use crate::causal_lm::causal_lm_loss;
use crate::distributed::{AttentionInputs, ParallelContext, RouterTrace, ShardModel};
use crate::layers::{RmsNorm, RmsNormConfig};

/// A decoder layer an [`MtpModule`] can hold: the layer on this rank's sequence-parallel rows
/// under `ctx` (the signature every decoder layer's `forward_in` shares).
pub trait MtpBlock {
    /// `x [T, H]` of `batch` sequences → `[T, H]`; MoE blocks report to `trace`.
    fn forward_in(
        &self,
        ctx: &ParallelContext,
        x: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
        inputs: AttentionInputs<'_>,
    ) -> Result<Tensor<2>, ModelError>;
}

/// One MTP module (HF `MtpLayer`; release names `model.layers.{N+j}.*`) around a decoder layer
/// `L` of its family.
#[derive(Module, Debug)]
pub struct MtpModule<L> {
    /// Norm of the token embedding `[H]`.
    pub enorm: RmsNorm,
    /// Norm of the previous hidden state `[H]`.
    pub hnorm: RmsNorm,
    /// `2H → H` projection of `[enorm(emb) ; hnorm(h)]`.
    pub eh_proj: Linear,
    /// A full MoE decoder layer (same names as any layer).
    pub block: L,
    /// Output norm `[H]` (`shared_head.norm`, HF `post_norm`).
    pub shared_head_norm: RmsNorm,
}

impl<L: Module> MtpModule<L> {
    /// A module around `block` with norms at one (epsilon `eps`) and a randomly initialised
    /// `eh_proj` `2H → H` (no bias).
    pub fn around(block: L, hidden: usize, eps: f64, device: &Device) -> Self {
        let norm = || RmsNormConfig::new(hidden).with_epsilon(eps).init(device);
        Self {
            enorm: norm(),
            hnorm: norm(),
            eh_proj: LinearConfig::new(2 * hidden, hidden)
                .with_bias(false)
                .init(device),
            block,
            shared_head_norm: norm(),
        }
    }
}

impl<L: MtpBlock> MtpModule<L> {
    /// This rank's sequence-parallel rows `[T, H]` of `embeds` (tokens `i + j + 1`) and of
    /// `hidden` (`hʲᵢ`) → normed `hʲ⁺¹ [T, H]` under `ctx` (`batch` sequences; the whole
    /// `[B·S', H]` at `world = 1`): `eh_proj([enorm(emb) ; hnorm(h)])`, one decoder layer
    /// (its routing reported to `trace`), `shared_head.norm`.
    pub fn forward_in(
        &self,
        ctx: &ParallelContext,
        embeds: Tensor<2>,
        hidden: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
        inputs: AttentionInputs<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        let u = self.eh_proj.forward(Tensor::cat(
            vec![self.enorm.forward(embeds), self.hnorm.forward(hidden)],
            1,
        ));
        let y = self.block.forward_in(ctx, u, batch, trace, inputs)?;
        Ok(self.shared_head_norm.forward(y))
    }
}

/// MTP logits of every depth `j` of the whole model `model` (single rank, HF 5.23's
/// `MtpModel.forward_layer` then the shared head): `[B, S − 1 − j, V]`, position `i`
/// predicting token `i + j + 2`, from `input_ids [B, S]` and the main forward's final-normed
/// `hidden [B, S, H]`. Each depth runs the model's own MTP forward
/// ([`DecoderStack::mtp_forward`](crate::distributed::DecoderStack::mtp_forward)) on positions `j + 1 ..` (HF's drafter positions).
pub fn mtp_logits<M: ShardModel>(
    model: &M,
    input_ids: Tensor<2, Int>,
    hidden: Tensor<3>,
) -> Result<Vec<Tensor<3>>, ModelError> {
    let [b, s] = input_ids.dims();
    let h = hidden.dims()[2];
    let device = input_ids.device();
    let ctx = crate::family::local_context::<M>(model.model_config())?;
    let mut trace = RouterTrace::new(1.0);
    let mut hidden = hidden;
    let depths = model.mtp_depths();
    let mut logits = Vec::with_capacity(depths);
    for j in 0..depths {
        let len =
            s.checked_sub(j + 1)
                .filter(|&l| l > 0)
                .ok_or_else(|| ModelError::InvalidInput {
                    what: "input_ids",
                    reason: format!("{s} tokens are too few for MTP depth {}", j + 1),
                })?;
        let embeds = ctx.embed_ids(
            model.embed_tokens()?,
            input_ids.clone().narrow(1, j + 1, len),
        )?;
        let prev = hidden.narrow(1, 0, len).reshape([b * len, h]);
        // Positions of the shifted tokens (HF's drafter); RoPE only sees differences.
        let rope = ctx.rope_at(j + 1, len, &device);
        let inputs = AttentionInputs::Masked {
            rope: &rope,
            mask: None,
            exchange: None,
            recompute_core: false,
        };
        let next = model.mtp_forward(j, &ctx, embeds, prev, b, &mut trace, inputs)?;
        let out = ctx.head_logits(next.clone(), model.lm_head(), model.embed_tokens().ok())?;
        let v = out.dims()[1];
        logits.push(out.reshape([b, len, v]));
        hidden = next.reshape([b, len, h]);
    }
    Ok(logits)
}

/// MTP loss (docs/models.md §Multi-token prediction): `λ / D · Σ_j CE_j`, where depth `j`'s logits
/// `[B, S − 1 − j, V]` (from [`mtp_logits`]) predict
/// `labels[:, i + j + 2]` (host values `[B, S]`, −100 ignored). Returns `[1]`.
pub fn mtp_loss(
    mtp_logits: &[Tensor<3>],
    labels: &[i64],
    [batch, seq]: [usize; 2],
    lambda: f64,
) -> Result<Tensor<1>, ModelError> {
    let Some(first) = mtp_logits.first() else {
        return Err(ModelError::InvalidInput {
            what: "mtp_logits",
            reason: "the model has no MTP module".to_owned(),
        });
    };
    if labels.len() != batch * seq {
        return Err(ModelError::InvalidInput {
            what: "labels",
            reason: format!("{} labels for shape [{batch}, {seq}]", labels.len()),
        });
    }
    let mut total = Tensor::<1>::zeros([1], &first.device());
    for (j, logits) in mtp_logits.iter().enumerate() {
        // `causal_lm_loss` shifts by one more: logits[:, i] is scored against labels[:, i + j + 2].
        let shifted: Vec<i64> = labels
            .chunks(seq)
            .flat_map(|row| row[j + 1..].iter().copied())
            .collect();
        total = total + causal_lm_loss(logits.clone(), &shifted)?;
    }
    Ok(total.mul_scalar(lambda / mtp_logits.len() as f64))
}

#[cfg(test)]
mod tests {
    use burn::tensor::Int;

    use super::*;
    use crate::DeepseekV3Config;

    #[test]
    fn mtp_loss_of_uniform_logits_is_scaled_ln_v() {
        let device = Device::flex();
        // Depth 0 of a [1, 4] sequence: 3 positions, 2 scored targets (labels 2 and 3).
        let logits = Tensor::<3>::zeros([1, 3, 8], &device);
        let loss = mtp_loss(std::slice::from_ref(&logits), &[0, 1, 2, 3], [1, 4], 0.3).unwrap();
        assert!((loss.into_scalar::<f32>() - 0.3 * 8f32.ln()).abs() < 1e-6);
        assert!(mtp_loss(&[logits], &[0, 1, 2], [1, 4], 0.3).is_err());
        assert!(mtp_loss(&[], &[0, 1, 2, 3], [1, 4], 0.3).is_err());
    }

    #[test]
    fn random_mtp_module_runs_and_forward_mtp_shapes() {
        let device = Device::flex();
        let cfg = DeepseekV3Config {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 24,
            moe_intermediate_size: 8,
            num_hidden_layers: 1,
            first_k_dense_replace: 1,
            num_attention_heads: 2,
            n_routed_experts: 4,
            num_experts_per_tok: 2,
            n_group: 2,
            topk_group: 1,
            q_lora_rank: Some(8),
            kv_lora_rank: 8,
            qk_nope_head_dim: 4,
            qk_rope_head_dim: 4,
            v_head_dim: 4,
            num_nextn_predict_layers: 2,
            ..DeepseekV3Config::default()
        };
        let model = cfg.init(&device).unwrap();
        let ids = Tensor::<2, Int>::from_data([[1, 2, 3, 4, 5]], &device);
        let out = model.forward(ids.clone()).unwrap();
        let mtp = model.forward_mtp(ids, out.hidden).unwrap();
        assert_eq!(mtp.len(), 2);
        assert_eq!(mtp[0].dims(), [1, 4, 32]);
        assert_eq!(mtp[1].dims(), [1, 3, 32]);
        let loss = mtp_loss(&mtp, &[1, 2, 3, 4, 5], [1, 5], 0.1).unwrap();
        assert!(loss.into_scalar::<f32>().is_finite());
    }
}
