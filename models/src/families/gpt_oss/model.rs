//! gpt-oss, read beside HF transformers 5.23 `models/gpt_oss/modeling_gpt_oss.py`
//! (`GptOssForCausalLM`).
//!
//! Every decoder layer is pre-norm GQA attention followed by the MoE block:
//! - attention (`GptOssAttention`): q/k/v/o biases, no QK-norm, YaRN RoPE, a learned sink
//!   logit per head joining every softmax row (`eager_attention_forward`), and a sliding
//!   window on the `"sliding_attention"` layers of `layer_types` (`sliding_window`; query `i`
//!   sees key `j` iff `i − w < j ≤ i`), also in the KV cache and under context parallelism;
//! - the MoE block (`GptOssMLP`): the router (`GptOssTopKRouter`) is a linear with a bias,
//!   top-`k` of its logits, softmax over the `k` (moe-backend's softmax router with
//!   `pre_softmax = false`); experts (`GptOssExperts`) with biases and the clamped SwiGLU
//!   `(clamp(up, ±limit) + 1) · g · σ(alpha · g)`, `g = min(gate, limit)`.
//!
//! HF's loss with `output_router_logits` adds `router_aux_loss_coef ×` its
//! `load_balancing_loss_func` over the router logits (`x Wᵀ + b`).

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};
use moe_backend::experts::ExpertActivation;
use moe_backend::fp8::Fp8Recipe;
use moe_backend::layer::{MoeLayer, MoeLayerConfig};
use moe_backend::router::{ScoreFunction, TopKRouterConfig};

use super::config::GptOssConfig;
use crate::ModelError;
use crate::causal_lm::{CausalLm, LmLosses, causal_lm_loss, hf_load_balancing_loss};
use crate::distributed::{
    AttentionInputs, LayerParts, ParallelContext, RouterTrace, ShardAttention, ShardModel,
    StackShape,
};
use crate::layers::kv_cache::KvCache;
use crate::layers::rope::RotaryEmbedding;
use crate::layers::{Attention, AttentionConfig, LayerStack, RmsNorm, RmsNormConfig};
use crate::routing::ReplaySpec;
use crate::weights::{ShardSpec, WeightLoader, WeightSource};

impl GptOssConfig {
    /// The attention block of layer `i`: GQA with q/k/v/o biases (`attention_bias`), learned
    /// sinks, no QK-norm, the layer's sliding window.
    pub fn attention_config(&self, i: usize) -> AttentionConfig {
        AttentionConfig::new(
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        )
        .with_rms_norm_eps(self.rms_norm_eps)
        .with_attention_bias(self.attention_bias)
        .with_o_proj_bias(true)
        .with_qk_norm(false)
        .with_sinks(true)
        .with_sliding_window(self.layer_sliding_window(i))
    }

    /// The moe-backend layer of every block: a biased router, top-k of the logits then a
    /// softmax over the k; experts of width `intermediate_size` with biases and the clamped
    /// SwiGLU.
    pub fn moe_layer_config(&self) -> MoeLayerConfig {
        let router = TopKRouterConfig::new(
            self.hidden_size,
            self.num_local_experts,
            self.num_experts_per_tok,
        )
        .with_score_function(ScoreFunction::Softmax)
        .with_pre_softmax(false)
        .with_bias(true);
        MoeLayerConfig::new(router, self.intermediate_size)
            .with_activation(ExpertActivation::ClampedSwiGlu {
                alpha: self.swiglu_alpha,
                limit: self.swiglu_limit,
            })
            .with_experts_bias(true)
    }

    /// A randomly initialised model (Burn's default initialisers, norms at one).
    pub fn init(&self, device: &Device) -> Result<GptOssForCausalLM, ModelError> {
        self.validate()?;
        let (h, eps) = (self.hidden_size, self.rms_norm_eps);
        let norm = || RmsNormConfig::new(h).with_epsilon(eps).init(device);
        let layers = (0..self.num_hidden_layers)
            .map(|i| {
                Ok(GptOssDecoderLayer {
                    input_layernorm: norm(),
                    self_attn: self.attention_config(i).init(device)?,
                    post_attention_layernorm: norm(),
                    mlp: self.moe_layer_config().init(device)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(GptOssForCausalLM {
            model: GptOssModel {
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

/// One pre-norm decoder layer (HF `GptOssDecoderLayer`).
#[derive(Module, Debug)]
pub struct GptOssDecoderLayer {
    /// Norm before attention `[H]`.
    pub input_layernorm: RmsNorm,
    /// Self-attention with sinks and (on sliding layers) a window.
    pub self_attn: Attention,
    /// Norm before the MoE block `[H]`.
    pub post_attention_layernorm: RmsNorm,
    /// The MoE block (HF `GptOssMLP`: `router`, `experts` with biases).
    pub mlp: MoeLayer,
}

impl GptOssDecoderLayer {
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
        let y = ctx.moe(&self.mlp, normed, batch, trace)?;
        Ok(h + y)
    }
}

/// The decoder stack (HF `GptOssModel`).
#[derive(Module, Debug)]
pub struct GptOssModel {
    /// Token embedding `[V, H]`.
    pub embed_tokens: Option<Embedding>,
    /// Decoder layers.
    pub layers: LayerStack<GptOssDecoderLayer>,
    /// Final norm `[H]`.
    pub norm: Option<RmsNorm>,
}

/// Output of [`GptOssForCausalLM::forward`].
#[derive(Debug, Clone)]
pub struct GptOssOutput {
    /// `[B, S, V]` logits.
    pub logits: Tensor<3>,
    /// Router logits `x Wᵀ + b`, `[B·S, E]` of every layer, in layer order (rows `b·S + s`).
    pub router_logits: Vec<Tensor<2>>,
    /// Selected experts `[B·S, k]` of every layer, in layer order.
    pub topk_indices: Vec<Tensor<2, Int>>,
}

/// Losses of a labelled forward, as HF's with `output_router_logits=True`.
#[derive(Debug, Clone)]
pub struct GptOssLoss {
    /// `ce + router_aux_loss_coef · aux_loss`, `[1]`.
    pub loss: Tensor<1>,
    /// Causal-LM cross-entropy, `[1]`.
    pub ce_loss: Tensor<1>,
    /// HF `load_balancing_loss_func` over all layers, `[1]`.
    pub aux_loss: Tensor<1>,
}

/// gpt-oss causal language model (HF `GptOssForCausalLM`).
#[derive(Module, Debug)]
pub struct GptOssForCausalLM {
    /// The decoder stack.
    pub model: GptOssModel,
    /// Output projection `H → V`; `None` when tied to `model.embed_tokens`.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    rope: RotaryEmbedding,
    #[module(skip)]
    config: GptOssConfig,
}

crate::distributed::stage_model!(GptOssForCausalLM);

impl GptOssForCausalLM {
    /// Loads every tensor by its HF name (the release's fused, interleaved experts, dense or
    /// MXFP4 when the source decodes it); shapes are checked and errors name the tensor.
    pub fn from_weights(
        config: &GptOssConfig,
        source: &dyn WeightSource,
        device: &Device,
    ) -> Result<Self, ModelError> {
        <Self as ShardModel>::from_loader(config, &WeightLoader::new(source, device))
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &GptOssConfig {
        &self.config
    }

    /// Logits and router logits of `input_ids [B, S]` (positions `0..S`, no cache).
    pub fn forward(&self, input_ids: Tensor<2, Int>) -> Result<GptOssOutput, ModelError> {
        self.run(input_ids, None, None)
    }

    /// HF's labelled forward with `output_router_logits=True`: cross-entropy of `labels`
    /// (`[B, S]` host values, −100 ignored) plus `router_aux_loss_coef` × the load-balancing
    /// loss, with `attention_mask` (`[B, S]` host values, 1 = token) applied to the aux loss
    /// only.
    pub fn loss(
        &self,
        output: &GptOssOutput,
        labels: &[i64],
        attention_mask: Option<&[f32]>,
    ) -> Result<GptOssLoss, ModelError> {
        let ce_loss = causal_lm_loss(output.logits.clone(), labels)?;
        let aux_loss = hf_load_balancing_loss(
            &output.router_logits,
            self.config.num_experts_per_tok,
            attention_mask,
        )?;
        let loss = ce_loss.clone()
            + aux_loss
                .clone()
                .mul_scalar(self.config.router_aux_loss_coef);
        Ok(GptOssLoss {
            loss,
            ce_loss,
            aux_loss,
        })
    }

    /// The single-rank forward on the `world = 1` context, after the positions in `cache`.
    fn run(
        &self,
        input_ids: Tensor<2, Int>,
        cache: Option<&mut KvCache>,
        replay: Option<Vec<Tensor<2, Int>>>,
    ) -> Result<GptOssOutput, ModelError> {
        let (out, trace) = crate::families::local_run(self, input_ids, None, cache, replay)?;
        Ok(GptOssOutput {
            logits: out.logits,
            router_logits: trace.logits,
            topk_indices: trace.selected,
        })
    }
}

crate::distributed::decoder_stack!(GptOssForCausalLM, GptOssDecoderLayer);

impl ShardModel for GptOssForCausalLM {
    type Config = GptOssConfig;

    fn template(config: &GptOssConfig, device: &Device) -> Result<Self, ModelError> {
        config.init(device)
    }

    fn select_stage(self, stage: &crate::weights::StageHolding) -> Result<Self, ModelError> {
        Self::select_stage(self, stage)
    }

    fn model_config(&self) -> &GptOssConfig {
        &self.config
    }

    fn stack_shape(config: &GptOssConfig) -> Result<StackShape, ModelError> {
        let rope = RotaryEmbedding::new(&config.rope_parameters, config.head_dim)?;
        Ok(crate::families::stack_shape(config, rope))
    }

    fn replay_spec(&self) -> Option<ReplaySpec> {
        crate::families::replay_spec::<GptOss>(&self.config)
    }

    fn with_fp8(self, recipe: Fp8Recipe, linears: bool) -> Result<Self, ModelError> {
        self.with_fp8_layers(Some(recipe), linears)
    }
}

impl LayerParts for GptOssDecoderLayer {
    type Attention = Attention;

    fn attention(&self) -> &Attention {
        &self.self_attn
    }

    fn attention_mut(&mut self) -> &mut Attention {
        &mut self.self_attn
    }

    fn moe(&self) -> Option<&MoeLayer> {
        Some(&self.mlp)
    }

    fn moe_mut(&mut self) -> Option<&mut MoeLayer> {
        Some(&mut self.mlp)
    }

    /// The local heads; the routed experts' `fc2` bias is added by the first expert-TP rank
    /// only (Megatron's row-parallel bias: the combine sums the ranks' partial outputs).
    fn localize(&mut self, shard: &ShardSpec) -> Result<(), ModelError> {
        self.self_attn.localize_heads()?;
        self.mlp.experts.adds_fc2_bias = shard.etp_rank == 0;
        Ok(())
    }
}

impl CausalLm for GptOssForCausalLM {
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

impl crate::config::FamilyConfig for GptOssConfig {
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

/// gpt-oss (`GptOssForCausalLM`).
#[derive(Debug, Clone, Copy)]
pub struct GptOss;

impl crate::families::Family for GptOss {
    const MODEL_TYPE: &'static str = GptOssConfig::MODEL_TYPE;
    const ARCHITECTURE: &'static str = "GptOssForCausalLM";
    type Config = GptOssConfig;
    type Model = GptOssForCausalLM;

    fn model_shape(c: &GptOssConfig) -> Option<crate::param_plan::ModelShape> {
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

    fn mapping_rules() -> Vec<moe_bridge::mapping::Rule> {
        super::plan::mapping_rules()
    }

    /// The release stores the routed experts' `gate_up_proj` / `down_proj` as MXFP4 pairs
    /// whose blocks decode to the output-major `[E, out, in]` matrices (the canonical
    /// tensors), transformers' `Mxfp4GptOssExperts`.
    fn release_mxfp4(hf_name: &str, canonical: &[usize]) -> Option<Vec<usize>> {
        super::plan::is_mxfp4_expert(hf_name).then(|| canonical.to_vec())
    }

    /// HF's loss: cross-entropy plus `router_aux_loss_coef ·` the load-balancing loss.
    fn hf_losses(
        model: &GptOssForCausalLM,
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
