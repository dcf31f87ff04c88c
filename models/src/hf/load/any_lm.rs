//! [`AnyCausalLm`]: one of the supported models behind one type, for tools (the `moe` CLI)
//! that pick the model from `config.json` at run time.

use crate::causal_lm::causal_lm_loss;
use crate::layers::KvCache;
use crate::{
    CausalLm, DeepseekV3ForCausalLM, GenerationConfig, ModelError, ParamCount, Qwen3ForCausalLM,
    Qwen3MoeForCausalLM, generate,
};
use burn::tensor::{Device, Int, Tensor};

/// A loaded causal LM of any supported family.
#[derive(Debug)]
pub enum AnyCausalLm {
    /// Dense Qwen3.
    Qwen3(Qwen3ForCausalLM),
    /// Qwen3-MoE.
    Qwen3Moe(Qwen3MoeForCausalLM),
    /// DeepSeek-V3 (MTP modules loaded when the checkpoint has them).
    DeepseekV3(DeepseekV3ForCausalLM),
}

/// Losses of a labelled forward ([`AnyCausalLm::losses`]), each `[1]`.
#[derive(Debug, Clone)]
pub struct LmLosses {
    /// What HF's `outputs.loss` is: cross-entropy, plus `router_aux_loss_coef · aux_loss` for
    /// Qwen3-MoE (docs/models.md §Qwen3-MoE load-balancing loss).
    pub loss: Tensor<1>,
    /// HF's load-balancing loss (Qwen3-MoE); `None` for models HF computes none for (dense
    /// Qwen3, DeepSeek-V3, whose routing is auxiliary-loss free).
    pub aux_loss: Option<Tensor<1>>,
}

impl AnyCausalLm {
    /// HF `model_type`.
    pub fn model_type(&self) -> &'static str {
        match self {
            Self::Qwen3(_) => "qwen3",
            Self::Qwen3Moe(_) => "qwen3_moe",
            Self::DeepseekV3(_) => "deepseek_v3",
        }
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> super::ModelConfig {
        match self {
            Self::Qwen3(m) => super::ModelConfig::Qwen3(m.config().clone()),
            Self::Qwen3Moe(m) => super::ModelConfig::Qwen3Moe(m.config().clone()),
            Self::DeepseekV3(m) => super::ModelConfig::DeepseekV3(m.config().clone()),
        }
    }

    /// Shape-only parameter counts of the model's configuration.
    pub fn param_count(&self) -> ParamCount {
        match self {
            Self::Qwen3(m) => m.config().param_count(),
            Self::Qwen3Moe(m) => m.config().param_count(),
            Self::DeepseekV3(m) => m.config().param_count(),
        }
    }

    /// Logits `[B, S, V]` of `input_ids [B, S]` (positions `0..S`, no cache).
    pub fn logits(&self, input_ids: Tensor<2, Int>) -> Result<Tensor<3>, ModelError> {
        match self {
            Self::Qwen3(m) => m.forward(input_ids),
            Self::Qwen3Moe(m) => Ok(m.forward(input_ids)?.logits),
            Self::DeepseekV3(m) => Ok(m.forward(input_ids)?.logits),
        }
    }

    /// Logits of `input_ids [B, S]` and the losses HF reports for `labels` (`[B, S]` host
    /// values, −100 ignored; HF shifts them internally, so `labels = input_ids` is the usual
    /// choice).
    pub fn losses(
        &self,
        input_ids: Tensor<2, Int>,
        labels: &[i64],
    ) -> Result<(Tensor<3>, LmLosses), ModelError> {
        match self {
            Self::Qwen3Moe(m) => {
                let out = m.forward(input_ids)?;
                let losses = m.loss(&out, labels, None)?;
                Ok((
                    out.logits,
                    LmLosses {
                        loss: losses.loss,
                        aux_loss: Some(losses.aux_loss),
                    },
                ))
            }
            _ => {
                let logits = self.logits(input_ids)?;
                let loss = causal_lm_loss(logits.clone(), labels)?;
                Ok((
                    logits,
                    LmLosses {
                        loss,
                        aux_loss: None,
                    },
                ))
            }
        }
    }

    /// Continues `prompt` (one sequence) with up to `config.max_new_tokens` tokens using a KV
    /// cache; returns the new tokens only.
    pub fn generate(
        &self,
        prompt: &[usize],
        config: &GenerationConfig,
        device: &Device,
    ) -> Result<Vec<usize>, ModelError> {
        generate(self, prompt, config, device)
    }
}

impl CausalLm for AnyCausalLm {
    fn vocab_size(&self) -> usize {
        match self {
            Self::Qwen3(m) => m.vocab_size(),
            Self::Qwen3Moe(m) => m.vocab_size(),
            Self::DeepseekV3(m) => m.vocab_size(),
        }
    }

    fn new_cache(&self) -> KvCache {
        match self {
            Self::Qwen3(m) => m.new_cache(),
            Self::Qwen3Moe(m) => m.new_cache(),
            Self::DeepseekV3(m) => m.new_cache(),
        }
    }

    fn forward_cached(
        &self,
        input_ids: Tensor<2, Int>,
        cache: &mut KvCache,
    ) -> Result<Tensor<3>, ModelError> {
        match self {
            Self::Qwen3(m) => m.forward_cached(input_ids, cache),
            Self::Qwen3Moe(m) => m.forward_cached(input_ids, cache),
            Self::DeepseekV3(m) => m.forward_cached(input_ids, cache),
        }
    }
}
