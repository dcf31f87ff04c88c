//! DeepSeek-V3 multi-token prediction (docs/models.md §Multi-token prediction), beside HF 5.23's
//! `MtpLayer`.
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
use burn::tensor::{Device, Tensor};

use crate::DeepseekV3Config;
use crate::ModelError;
use crate::causal_lm::causal_lm_loss;
use crate::deepseek_v3::DeepseekV3DecoderLayer;
use crate::distributed::{AttentionInputs, ParallelContext, RouterTrace};
use crate::layers::{RmsNorm, RmsNormConfig};

/// One MTP module (HF `MtpLayer`; release names `model.layers.{N+j}.*`).
#[derive(Module, Debug)]
pub struct MtpModule {
    /// Norm of the token embedding `[H]`.
    pub enorm: RmsNorm,
    /// Norm of the previous hidden state `[H]`.
    pub hnorm: RmsNorm,
    /// `2H → H` projection of `[enorm(emb) ; hnorm(h)]`.
    pub eh_proj: Linear,
    /// A full MoE decoder layer (same names as any layer).
    pub block: DeepseekV3DecoderLayer,
    /// Output norm `[H]` (`shared_head.norm`, HF `post_norm`).
    pub shared_head_norm: RmsNorm,
}

impl MtpModule {
    /// A randomly initialised module (norms at one).
    pub fn init(config: &DeepseekV3Config, device: &Device) -> Result<Self, ModelError> {
        let h = config.hidden_size;
        let norm = || {
            RmsNormConfig::new(h)
                .with_epsilon(config.rms_norm_eps)
                .init(device)
        };
        Ok(Self {
            enorm: norm(),
            hnorm: norm(),
            eh_proj: LinearConfig::new(2 * h, h).with_bias(false).init(device),
            block: config.init_layer(true, device)?,
            shared_head_norm: norm(),
        })
    }

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

/// MTP loss (docs/models.md §Multi-token prediction): `λ / D · Σ_j CE_j`, where depth `j`'s logits
/// `[B, S − 1 − j, V]` (from [`crate::deepseek_v3::DeepseekV3ForCausalLM::forward_mtp`]) predict
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
