//! Mixtral, read beside HF transformers 5.23 `models/mixtral/modeling_mixtral.py`
//! (`MixtralForCausalLM`).
//!
//! Every decoder layer is pre-norm GQA attention without QK-norm or biases (RoPE, full causal
//! attention: `sliding_window` must be null) followed by the sparse MoE block
//! (`MixtralSparseMoeBlock`): moe-backend's [`MoeLayer`] with a softmax router over all `E`
//! experts, top-`k`, the `k` weights renormalised to sum to one (HF `MixtralTopKRouter`:
//! softmax in f32 → top-k → divide by the sum; here top-k of the logits then softmax over the
//! `k`, equal up to rounding), and SwiGLU experts `w2(silu(w1 x) ⊙ w3 x)`. HF's loss with
//! `output_router_logits` adds `router_aux_loss_coef ×` its `load_balancing_loss_func`.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};
use moe_backend::fp8::Fp8Recipe;
use moe_backend::layer::{MoeLayer, MoeLayerConfig};
use moe_backend::router::{ScoreFunction, TopKRouterConfig};

use super::config::MixtralConfig;
use crate::ModelError;
use crate::causal_lm::{CausalLm, LmLosses, causal_lm_loss, hf_load_balancing_loss};
use crate::distributed::{AttentionInputs, ParallelContext, RouterTrace, ShardModel, StackShape};
use crate::layers::kv_cache::KvCache;
use crate::layers::rope::RotaryEmbedding;
use crate::layers::{Attention, AttentionConfig, LayerStack, RmsNorm, RmsNormConfig};
use crate::routing::ReplaySpec;
use crate::weights::{WeightLoader, WeightSource};

impl MixtralConfig {
    /// The attention block of every layer (GQA, no QK-norm, no biases).
    pub fn attention_config(&self) -> AttentionConfig {
        AttentionConfig::new(
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        )
        .with_rms_norm_eps(self.rms_norm_eps)
        .with_attention_bias(false)
        .with_qk_norm(false)
    }

    /// The moe-backend layer of every block: softmax scores over all experts, top-k, the k
    /// weights renormalised (post-softmax routing); f32 router, experts of width
    /// `intermediate_size`.
    pub fn moe_layer_config(&self) -> MoeLayerConfig {
        let router = TopKRouterConfig::new(
            self.hidden_size,
            self.num_local_experts,
            self.num_experts_per_tok,
        )
        .with_score_function(ScoreFunction::Softmax)
        .with_pre_softmax(false);
        MoeLayerConfig::new(router, self.intermediate_size)
    }

    /// A randomly initialised model (Burn's default initialisers, norms at one).
    pub fn init(&self, device: &Device) -> Result<MixtralForCausalLM, ModelError> {
        self.validate()?;
        let (h, eps) = (self.hidden_size, self.rms_norm_eps);
        let norm = || RmsNormConfig::new(h).with_epsilon(eps).init(device);
        let layers = (0..self.num_hidden_layers)
            .map(|_| {
                Ok(MixtralDecoderLayer {
                    input_layernorm: norm(),
                    self_attn: self.attention_config().init(device)?,
                    post_attention_layernorm: norm(),
                    block_sparse_moe: self.moe_layer_config().init(device)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(MixtralForCausalLM {
            model: MixtralModel {
                embed_tokens: Some(EmbeddingConfig::new(self.vocab_size, h).init(device)),
                layers: LayerStack::new(layers),
                norm: Some(norm()),
            },
            lm_head: (!self.tie_word_embeddings).then(|| {
                LinearConfig::new(h, self.vocab_size)
                    .with_bias(false)
                    .init(device)
            }),
            rope: RotaryEmbedding::new(&self.rope_parameters, self.head_dim)?,
            config: self.clone(),
        })
    }
}

/// One pre-norm decoder layer (HF `MixtralDecoderLayer`).
#[derive(Module, Debug)]
pub struct MixtralDecoderLayer {
    /// Norm before attention `[H]`.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: Attention,
    /// Norm before the MoE block `[H]`.
    pub post_attention_layernorm: RmsNorm,
    /// The sparse MoE block (HF `MixtralSparseMoeBlock`: router `gate`, experts
    /// `fc1 = [w1; w3]`, `fc2 = w2`).
    pub block_sparse_moe: MoeLayer,
}

impl MixtralDecoderLayer {
    /// The layer on this rank's sequence-parallel block `x [B·S/tp, H]` of `batch` sequences
    /// under `ctx` (the whole `[B·S, H]` at `world = 1`): `h = x + attn(norm(x))`, then
    /// `h + moe(norm(h))` behind the context's dispatcher (its routing reported to `trace`).
    pub fn forward_in(
        &self,
        ctx: &ParallelContext,
        x: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
        inputs: AttentionInputs<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        let h = ctx.attention_block(x, &self.input_layernorm, &self.self_attn, batch, inputs)?;
        let normed = self.post_attention_layernorm.forward(h.clone());
        let y = ctx.moe(&self.block_sparse_moe, normed, batch, trace)?;
        Ok(h + y)
    }
}

/// The decoder stack (HF `MixtralModel`).
#[derive(Module, Debug)]
pub struct MixtralModel {
    /// Token embedding `[V, H]`.
    pub embed_tokens: Option<Embedding>,
    /// Decoder layers.
    pub layers: LayerStack<MixtralDecoderLayer>,
    /// Final norm `[H]`.
    pub norm: Option<RmsNorm>,
}

/// Output of [`MixtralForCausalLM::forward`].
#[derive(Debug, Clone)]
pub struct MixtralOutput {
    /// `[B, S, V]` logits.
    pub logits: Tensor<3>,
    /// Router logits `[B·S, E]` of every layer, in layer order (rows `b·S + s`).
    pub router_logits: Vec<Tensor<2>>,
    /// Selected experts `[B·S, k]` of every layer, in layer order (rows `b·S + s`).
    pub topk_indices: Vec<Tensor<2, Int>>,
}

/// Losses of a labelled forward, as HF's with `output_router_logits=True`.
#[derive(Debug, Clone)]
pub struct MixtralLoss {
    /// `ce + router_aux_loss_coef · aux_loss`, `[1]`.
    pub loss: Tensor<1>,
    /// Causal-LM cross-entropy, `[1]`.
    pub ce_loss: Tensor<1>,
    /// HF `load_balancing_loss_func` over all layers, `[1]`.
    pub aux_loss: Tensor<1>,
}

/// Mixtral causal language model (HF `MixtralForCausalLM`).
#[derive(Module, Debug)]
pub struct MixtralForCausalLM {
    /// The decoder stack.
    pub model: MixtralModel,
    /// Output projection `H → V`; `None` when tied to `model.embed_tokens`.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    rope: RotaryEmbedding,
    #[module(skip)]
    config: MixtralConfig,
}

crate::distributed::stage_model!(MixtralForCausalLM);

impl MixtralForCausalLM {
    /// Loads every tensor by its HF name (the release's per-expert
    /// `block_sparse_moe.experts.{e}.w1/w3/w2`, or stacked `gate_up_proj` / `down_proj`, not
    /// mixed); shapes are checked and errors name the tensor.
    pub fn from_weights(
        config: &MixtralConfig,
        source: &dyn WeightSource,
        device: &Device,
    ) -> Result<Self, ModelError> {
        <Self as ShardModel>::from_loader(config, &WeightLoader::new(source, device))
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &MixtralConfig {
        &self.config
    }

    /// Logits and router logits of `input_ids [B, S]` (positions `0..S`, no cache).
    pub fn forward(&self, input_ids: Tensor<2, Int>) -> Result<MixtralOutput, ModelError> {
        self.run(input_ids, None, None)
    }

    /// HF's labelled forward with `output_router_logits=True`: cross-entropy of `labels`
    /// (`[B, S]` host values, −100 ignored) plus `router_aux_loss_coef` × the load-balancing
    /// loss, with `attention_mask` (`[B, S]` host values, 1 = token) applied to the aux loss
    /// only.
    pub fn loss(
        &self,
        output: &MixtralOutput,
        labels: &[i64],
        attention_mask: Option<&[f32]>,
    ) -> Result<MixtralLoss, ModelError> {
        let ce_loss = causal_lm_loss(output.logits.clone(), labels)?;
        let aux_loss = hf_load_balancing_loss(
            &output.router_logits,
            self.config.num_experts_per_tok,
            attention_mask,
        )?;
        let coef = self.config.router_aux_loss_coef;
        let loss = ce_loss.clone() + aux_loss.clone().mul_scalar(coef);
        Ok(MixtralLoss {
            loss,
            ce_loss,
            aux_loss,
        })
    }

    /// The single-rank forward ([`DecoderStack`](crate::distributed::DecoderStack) on the
    /// `world = 1` context), after the positions in `cache`; `replay` forces every layer's
    /// experts ([`crate::replay`]).
    fn run(
        &self,
        input_ids: Tensor<2, Int>,
        cache: Option<&mut KvCache>,
        replay: Option<Vec<Tensor<2, Int>>>,
    ) -> Result<MixtralOutput, ModelError> {
        let (out, trace) = crate::families::local_run(self, input_ids, None, cache, replay)?;
        Ok(MixtralOutput {
            logits: out.logits,
            router_logits: trace.logits,
            topk_indices: trace.selected,
        })
    }
}

crate::distributed::decoder_stack!(MixtralForCausalLM, MixtralDecoderLayer);

impl ShardModel for MixtralForCausalLM {
    type Config = MixtralConfig;

    fn template(config: &MixtralConfig, device: &Device) -> Result<Self, ModelError> {
        config.init(device)
    }

    fn select_stage(self, stage: &crate::weights::StageHolding) -> Result<Self, ModelError> {
        Self::select_stage(self, stage)
    }

    fn model_config(&self) -> &MixtralConfig {
        &self.config
    }

    fn stack_shape(config: &MixtralConfig) -> Result<StackShape, ModelError> {
        let rope = RotaryEmbedding::new(&config.rope_parameters, config.head_dim)?;
        Ok(crate::families::stack_shape(config, rope))
    }

    fn replay_spec(&self) -> Option<ReplaySpec> {
        crate::families::replay_spec::<Mixtral>(&self.config)
    }

    fn with_fp8(self, recipe: Fp8Recipe, linears: bool) -> Result<Self, ModelError> {
        self.with_fp8_layers(Some(recipe), linears)
    }
}

crate::layer_parts!(
    MixtralDecoderLayer,
    Attention,
    attention = self_attn,
    moe = block_sparse_moe
);

impl CausalLm for MixtralForCausalLM {
    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn new_cache(&self) -> KvCache {
        KvCache::new(self.config.num_hidden_layers)
    }

    fn forward_cached(
        &self,
        input_ids: Tensor<2, Int>,
        cache: &mut KvCache,
    ) -> Result<Tensor<3>, ModelError> {
        Ok(self.run(input_ids, Some(cache), None)?.logits)
    }
}

impl crate::config::FamilyConfig for MixtralConfig {
    fn from_json_str(text: &str) -> Result<Self, ModelError> {
        Self::from_json_str(text)
    }

    fn validate(&self) -> Result<(), ModelError> {
        Self::validate(self)
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn num_layers(&self) -> usize {
        self.num_hidden_layers
    }

    fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    fn experts(&self) -> Option<(usize, usize)> {
        Some((self.num_local_experts, self.num_experts_per_tok))
    }

    fn tie_word_embeddings(&self) -> bool {
        self.tie_word_embeddings
    }

    fn sizes(&self) -> crate::config::ConfigSizes {
        crate::config::ConfigSizes {
            layers: ("num_hidden_layers", self.num_hidden_layers),
            experts: Some(("num_local_experts", self.num_local_experts)),
            dims: vec![
                ("vocab_size", self.vocab_size),
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
                ("num_attention_heads", self.num_attention_heads),
                ("num_key_value_heads", self.num_key_value_heads),
                ("head_dim", self.head_dim),
            ],
        }
    }
}

/// Mixtral (`MixtralForCausalLM`).
#[derive(Debug, Clone, Copy)]
pub struct Mixtral;

impl crate::families::Family for Mixtral {
    const MODEL_TYPE: &'static str = MixtralConfig::MODEL_TYPE;
    const ARCHITECTURE: &'static str = "MixtralForCausalLM";
    type Config = MixtralConfig;
    type Model = MixtralForCausalLM;

    fn model_shape(c: &MixtralConfig) -> Option<crate::param_plan::ModelShape> {
        Some(crate::param_plan::ModelShape {
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            attention: crate::param_plan::AttentionShape::Gqa {
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                qk_norm: false,
            },
            moe_layers: vec![true; c.num_hidden_layers],
            dense_ffn: c.intermediate_size,
            experts: c.num_local_experts,
            top_k: c.num_experts_per_tok,
            moe_ffn: c.intermediate_size,
            shared_ffn: 0,
            tied_embeddings: c.tie_word_embeddings,
        })
    }

    /// HF's loss: cross-entropy plus `router_aux_loss_coef ·` the load-balancing loss.
    fn hf_losses(
        model: &MixtralForCausalLM,
        input_ids: Tensor<2, Int>,
        labels: &[i64],
    ) -> Result<(Tensor<3>, LmLosses), ModelError> {
        let out = model.forward(input_ids)?;
        let losses = model.loss(&out, labels, None)?;
        let losses = LmLosses {
            loss: losses.loss,
            aux_loss: Some(losses.aux_loss),
        };
        Ok((out.logits, losses))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> MixtralConfig {
        MixtralConfig {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 8,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            num_local_experts: 4,
            num_experts_per_tok: 2,
            ..MixtralConfig::default()
        }
    }

    #[test]
    fn every_layer_routes_and_gradients_reach_router_and_experts() {
        let device = Device::flex().autodiff();
        let model = tiny().init(&device).unwrap();
        let ids = Tensor::<2, Int>::from_data([[1, 2, 3, 4], [5, 6, 7, 8]], &device);
        let out = model.forward(ids).unwrap();
        assert_eq!(out.logits.dims(), [2, 4, 32]);
        assert_eq!(out.router_logits.len(), 2);
        assert_eq!(out.topk_indices[1].dims(), [8, 2]);
        let losses = model.loss(&out, &[1, 2, 3, 4, 5, 6, 7, 8], None).unwrap();
        let grads = losses.loss.backward();
        let moe = &model.model.layers[1].block_sparse_moe;
        assert!(moe.router.weight.grad(&grads).is_some(), "router");
        assert!(moe.experts.fc2.grad(&grads).is_some(), "experts fc2");
        assert!(model.model.layers[0].self_attn.q_norm.is_none());
    }

    /// Mixtral-8x7B (the class defaults): 46,702,792,704 parameters (its model card's 46.7 B),
    /// 12,879,925,248 active (12.9 B).
    #[test]
    fn param_count_of_mixtral_8x7b() {
        let c = MixtralConfig::default();
        let count = crate::families::param_count::<Mixtral>(&c).unwrap();
        assert_eq!(count.total, 46_702_792_704);
        assert_eq!(count.active, 12_879_925_248);
    }
}
