//! Qwen3-MoE, read beside HF transformers 5.23 `models/qwen3_moe/modeling_qwen3_moe.py`
//! (docs/models.md §Qwen3 and its attention, §Qwen3-MoE).
//!
//! The decoder is Qwen3's (QK-norm GQA attention, pre-norm residuals); layer `i` uses the
//! sparse MoE block iff `i ∉ mlp_only_layers ∧ E > 0 ∧ (i+1) % decoder_sparse_step == 0`,
//! otherwise a dense SwiGLU MLP of `intermediate_size`. The MoE block is moe-backend's
//! [`MoeLayer`]: softmax router over all experts, top-k, renormalised when `norm_topk_prob`
//! (post-softmax routing, equal to HF's softmax → top-k → divide up to rounding), no shared
//! expert, no scaling factor.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};
use moe_backend::fp8::Fp8Recipe;
use moe_backend::layer::{MoeLayer, MoeLayerConfig};
use moe_backend::router::{ScoreFunction, TopKRouterConfig};

use crate::ModelError;
use crate::Qwen3MoeConfig;
use crate::causal_lm::{CausalLm, hf_load_balancing_loss};
use crate::distributed::{
    AttentionInputs, LayerParts, ParallelContext, RouterTrace, ShardModel, StackShape,
};
use crate::layers::kv_cache::KvCache;
use crate::layers::rope::RotaryEmbedding;
use crate::layers::{Attention, AttentionConfig, Mlp, MlpConfig, RmsNorm, RmsNormConfig};
use crate::packing::SequenceLayout;
use crate::routing::ReplaySpec;
use crate::weights::{WeightLoader, WeightSource};

impl Qwen3MoeConfig {
    /// The attention block of every layer.
    pub fn attention_config(&self) -> AttentionConfig {
        AttentionConfig::new(
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        )
        .with_rms_norm_eps(self.rms_norm_eps)
        .with_attention_bias(self.attention_bias)
        .with_qk_norm(true)
    }

    /// The moe-backend layer of a sparse block (docs/models.md §Qwen3-MoE router): softmax scores,
    /// pre-softmax (plain top-k of the probabilities) without `norm_topk_prob`, post-softmax (top-k
    /// then softmax over the k, i.e. renormalised) with it; f32 router.
    pub fn moe_layer_config(&self) -> Result<MoeLayerConfig, ModelError> {
        if self.norm_topk_prob && self.num_experts_per_tok == 1 {
            return Err(ModelError::invalid(
                "norm_topk_prob",
                "renormalising a single routed expert (num_experts_per_tok = 1) gives a \
                 constant weight of 1 and is not supported",
            ));
        }
        let router =
            TopKRouterConfig::new(self.hidden_size, self.num_experts, self.num_experts_per_tok)
                .with_score_function(ScoreFunction::Softmax)
                .with_pre_softmax(!self.norm_topk_prob);
        Ok(MoeLayerConfig::new(router, self.moe_intermediate_size))
    }

    /// A randomly initialised model (Burn's default initialisers, norms at one).
    pub fn init(&self, device: &Device) -> Result<Qwen3MoeForCausalLM, ModelError> {
        self.validate()?;
        let (h, eps) = (self.hidden_size, self.rms_norm_eps);
        let norm = || RmsNormConfig::new(h).with_epsilon(eps).init(device);
        let layers = (0..self.num_hidden_layers)
            .map(|i| {
                let mlp = if self.is_moe_layer(i) {
                    Qwen3MoeFeedForward::Sparse(Qwen3MoeSparseMoeBlock {
                        moe: self.moe_layer_config()?.init(device)?,
                    })
                } else {
                    Qwen3MoeFeedForward::Dense(
                        MlpConfig::new(h, self.intermediate_size).init(device),
                    )
                };
                Ok(Qwen3MoeDecoderLayer {
                    input_layernorm: norm(),
                    self_attn: self.attention_config().init(device)?,
                    post_attention_layernorm: norm(),
                    mlp,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Qwen3MoeForCausalLM {
            model: Qwen3MoeModel {
                embed_tokens: Some(EmbeddingConfig::new(self.vocab_size, h).init(device)),
                layers: crate::layers::LayerStack::new(layers),
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

/// HF `Qwen3MoeSparseMoeBlock`: `gate` (router `[E, H]`) + `experts` (stacked SwiGLU).
#[derive(Module, Debug)]
pub struct Qwen3MoeSparseMoeBlock {
    /// Router (`mlp.gate.weight`) and experts (`mlp.experts.*`, `fc1 = gate_up_proj`,
    /// `fc2 = down_proj`).
    pub moe: MoeLayer,
}

/// The feed-forward part of a decoder layer.
// One value per layer: the size difference between variants is immaterial, and boxing would
// hide the module from Burn's derive.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Qwen3MoeFeedForward {
    /// Dense SwiGLU MLP (`mlp_only_layers`, or off the sparse step).
    Dense(Mlp),
    /// Sparse MoE block.
    Sparse(Qwen3MoeSparseMoeBlock),
}

/// One pre-norm decoder layer (HF `Qwen3MoeDecoderLayer`).
#[derive(Module, Debug)]
pub struct Qwen3MoeDecoderLayer {
    /// Norm before attention `[H]`.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: Attention,
    /// Norm before the feed-forward block `[H]`.
    pub post_attention_layernorm: RmsNorm,
    /// Dense MLP or sparse MoE block.
    pub mlp: Qwen3MoeFeedForward,
}

impl Qwen3MoeDecoderLayer {
    /// The layer on this rank's sequence-parallel block `x [B·S/tp, H]` of `batch` sequences
    /// under `ctx` (the whole `[B·S, H]` at `world = 1`): `h = x + attn(norm(x))`, then
    /// `h + mlp(norm(h))` with the dense MLP TP-sharded or the MoE block behind the context's
    /// dispatcher (its routing reported to `trace`).
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
        let y = match &self.mlp {
            Qwen3MoeFeedForward::Dense(mlp) => ctx.dense_mlp(mlp, normed)?,
            Qwen3MoeFeedForward::Sparse(block) => ctx.moe(&block.moe, normed, batch, trace)?,
        };
        Ok(h + y)
    }
}

/// The decoder stack (HF `Qwen3MoeModel`).
#[derive(Module, Debug)]
pub struct Qwen3MoeModel {
    /// Token embedding `[V, H]`.
    pub embed_tokens: Option<Embedding>,
    /// Decoder layers.
    pub layers: crate::layers::LayerStack<Qwen3MoeDecoderLayer>,
    /// Final norm `[H]`.
    pub norm: Option<RmsNorm>,
}

/// Output of [`Qwen3MoeForCausalLM::forward`].
#[derive(Debug, Clone)]
pub struct Qwen3MoeOutput {
    /// `[B, S, V]` logits.
    pub logits: Tensor<3>,
    /// Router logits `[B·S, E]` of every sparse layer, in layer order (rows `b·S + s`).
    pub router_logits: Vec<Tensor<2>>,
    /// Selected experts `[B·S, k]` of every sparse layer, in layer order (rows `b·S + s`).
    pub topk_indices: Vec<Tensor<2, Int>>,
}

/// Losses of a labelled forward (docs/models.md §Qwen3-MoE load-balancing loss).
#[derive(Debug, Clone)]
pub struct Qwen3MoeLoss {
    /// `ce + router_aux_loss_coef · aux_loss`, `[1]`.
    pub loss: Tensor<1>,
    /// Causal-LM cross-entropy, `[1]`.
    pub ce_loss: Tensor<1>,
    /// HF `load_balancing_loss_func` over all sparse layers, `[1]`.
    pub aux_loss: Tensor<1>,
}

/// Qwen3-MoE causal language model (HF `Qwen3MoeForCausalLM`).
#[derive(Module, Debug)]
pub struct Qwen3MoeForCausalLM {
    /// The decoder stack.
    pub model: Qwen3MoeModel,
    /// Output projection `H → V`; `None` when tied to `model.embed_tokens`.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    rope: RotaryEmbedding,
    #[module(skip)]
    config: Qwen3MoeConfig,
}

crate::distributed::stage_model!(Qwen3MoeForCausalLM);

impl Qwen3MoeForCausalLM {
    /// Loads every tensor by its HF name (docs/models.md §HF tensor names). Experts may be stored
    /// per expert or stacked (`mlp.experts.gate_up_proj` / `down_proj`), not mixed; shapes are
    /// checked and errors name the tensor. Modules are built from the loaded tensors (nothing is
    /// initialised and overwritten).
    pub fn from_weights(
        config: &Qwen3MoeConfig,
        source: &dyn WeightSource,
        device: &Device,
    ) -> Result<Self, ModelError> {
        <Self as ShardModel>::from_loader(config, &WeightLoader::new(source, device))
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &Qwen3MoeConfig {
        &self.config
    }

    /// The same model with the routed experts' fc1/fc2 GEMMs of every sparse layer in FP8
    /// (`Some(recipe)`, blockwise recipe of docs/fp8.md §Recipes) or back in high precision
    /// (`None`). Attention, dense MLPs, the router, embeddings, the LM head and norms stay in high
    /// precision (docs/fp8.md §Selective precision). A training-time choice, so it is not part of
    /// the HF config.
    pub fn with_fp8_experts(self, recipe: Option<Fp8Recipe>) -> Result<Self, ModelError> {
        self.with_fp8_layers(recipe, false)
    }

    /// Logits and router logits of `input_ids [B, S]` (positions `0..S`, no cache).
    pub fn forward(&self, input_ids: Tensor<2, Int>) -> Result<Qwen3MoeOutput, ModelError> {
        self.run(input_ids, None, None, None)
    }

    /// [`forward`](Self::forward) of a packed or padded batch (see [`crate::packing`]):
    /// attention stays within each document and skips padded keys, RoPE positions restart at
    /// every document (HF `cumsum(mask) − 1` for padded rows), and the routers are told which
    /// rows are padding. Each document's logits equal those of the document run alone.
    /// Errors if `layout` is not `[B, S]`.
    pub fn forward_packed(
        &self,
        input_ids: Tensor<2, Int>,
        layout: &SequenceLayout,
    ) -> Result<Qwen3MoeOutput, ModelError> {
        self.run(input_ids, None, None, Some(layout))
    }

    /// HF's labelled forward with `output_router_logits=True`: cross-entropy of `labels`
    /// (`[B, S]` host values, −100 ignored) plus `router_aux_loss_coef` × the load-balancing
    /// loss, with `attention_mask` (`[B, S]` host values, 1 = token) applied to the aux loss
    /// only (docs/models.md §Qwen3-MoE load-balancing loss).
    pub fn loss(
        &self,
        output: &Qwen3MoeOutput,
        labels: &[i64],
        attention_mask: Option<&[f32]>,
    ) -> Result<Qwen3MoeLoss, ModelError> {
        let ce_loss = crate::causal_lm::causal_lm_loss(output.logits.clone(), labels)?;
        let aux_loss = hf_load_balancing_loss(
            &output.router_logits,
            self.config.num_experts_per_tok,
            attention_mask,
        )?;
        let loss = ce_loss.clone()
            + aux_loss
                .clone()
                .mul_scalar(self.config.router_aux_loss_coef);
        Ok(Qwen3MoeLoss {
            loss,
            ce_loss,
            aux_loss,
        })
    }

    /// The single-rank forward ([`crate::families::local_run`]): after the positions in
    /// `cache`, or of a packed/padded batch with `layout`; `replay` forces every sparse
    /// layer's experts (per sparse layer, [`crate::replay`]).
    pub(crate) fn run(
        &self,
        input_ids: Tensor<2, Int>,
        cache: Option<&mut KvCache>,
        replay: Option<Vec<Tensor<2, Int>>>,
        layout: Option<&SequenceLayout>,
    ) -> Result<Qwen3MoeOutput, ModelError> {
        let (out, trace) = crate::families::local_run(self, input_ids, layout, cache, replay)?;
        Ok(Qwen3MoeOutput {
            logits: out.logits,
            router_logits: trace.logits,
            topk_indices: trace.selected,
        })
    }
}

crate::distributed::decoder_stack!(Qwen3MoeForCausalLM, Qwen3MoeDecoderLayer);

impl ShardModel for Qwen3MoeForCausalLM {
    type Config = Qwen3MoeConfig;

    fn template(config: &Qwen3MoeConfig, device: &Device) -> Result<Self, ModelError> {
        config.init(device)
    }

    fn select_stage(self, stage: &crate::weights::StageHolding) -> Result<Self, ModelError> {
        Self::select_stage(self, stage)
    }

    fn model_config(&self) -> &Qwen3MoeConfig {
        &self.config
    }

    fn stack_shape(config: &Qwen3MoeConfig) -> Result<StackShape, ModelError> {
        let rope = RotaryEmbedding::new(&config.rope_parameters, config.head_dim)?;
        Ok(crate::families::stack_shape(config, rope))
    }

    fn replay_spec(&self) -> Option<ReplaySpec> {
        crate::families::replay_spec::<Qwen3Moe>(&self.config)
    }

    fn with_fp8(self, recipe: Fp8Recipe, linears: bool) -> Result<Self, ModelError> {
        self.with_fp8_layers(Some(recipe), linears)
    }
}

impl LayerParts for Qwen3MoeDecoderLayer {
    type Attention = Attention;

    fn attention(&self) -> &Attention {
        &self.self_attn
    }

    fn attention_mut(&mut self) -> &mut Attention {
        &mut self.self_attn
    }

    fn moe(&self) -> Option<&MoeLayer> {
        match &self.mlp {
            Qwen3MoeFeedForward::Sparse(block) => Some(&block.moe),
            Qwen3MoeFeedForward::Dense(_) => None,
        }
    }

    fn moe_mut(&mut self) -> Option<&mut MoeLayer> {
        match &mut self.mlp {
            Qwen3MoeFeedForward::Sparse(block) => Some(&mut block.moe),
            Qwen3MoeFeedForward::Dense(_) => None,
        }
    }

    fn dense_mlp(&self) -> Option<&Mlp> {
        match &self.mlp {
            Qwen3MoeFeedForward::Dense(mlp) => Some(mlp),
            Qwen3MoeFeedForward::Sparse(_) => None,
        }
    }

    fn dense_mlp_mut(&mut self) -> Option<&mut Mlp> {
        match &mut self.mlp {
            Qwen3MoeFeedForward::Dense(mlp) => Some(mlp),
            Qwen3MoeFeedForward::Sparse(_) => None,
        }
    }
}

impl CausalLm for Qwen3MoeForCausalLM {
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
        Ok(self.run(input_ids, Some(cache), None, None)?.logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Qwen3MoeConfig {
        Qwen3MoeConfig {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 24,
            moe_intermediate_size: 8,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            num_experts: 4,
            num_experts_per_tok: 2,
            norm_topk_prob: true,
            mlp_only_layers: vec![0],
            ..Qwen3MoeConfig::default()
        }
    }

    #[test]
    fn layer_types_follow_the_config_and_router_logits_are_returned() {
        let device = Device::flex();
        let model = tiny().init(&device).unwrap();
        let kinds: Vec<bool> = model
            .model
            .layers
            .iter()
            .map(|l| matches!(l.mlp, Qwen3MoeFeedForward::Sparse(_)))
            .collect();
        assert_eq!(kinds, [false, true, true]);
        let ids = Tensor::<2, Int>::from_data([[1, 2, 3], [4, 5, 6]], &device);
        let out = model.forward(ids).unwrap();
        assert_eq!(out.logits.dims(), [2, 3, 32]);
        assert_eq!(out.router_logits.len(), 2);
        assert_eq!(out.router_logits[0].dims(), [6, 4]);
        let losses = model.loss(&out, &[1, 2, 3, 4, 5, 6], None).unwrap();
        assert!(losses.loss.into_scalar::<f32>().is_finite());
    }

    #[test]
    fn loss_gradients_reach_router_experts_and_embeddings() {
        let device = Device::flex().autodiff();
        let model = tiny().init(&device).unwrap();
        let ids = Tensor::<2, Int>::from_data([[1, 2, 3, 4], [5, 6, 7, 8]], &device);
        let out = model.forward(ids).unwrap();
        let losses = model.loss(&out, &[1, 2, 3, 4, 5, 6, 7, 8], None).unwrap();
        let grads = losses.loss.backward();
        let Qwen3MoeFeedForward::Sparse(block) = &model.model.layers[1].mlp else {
            panic!("layer 1 is sparse");
        };
        assert!(block.moe.router.weight.grad(&grads).is_some(), "router");
        assert!(block.moe.experts.fc1.grad(&grads).is_some(), "experts fc1");
        assert!(
            model
                .model
                .embed_tokens
                .as_ref()
                .unwrap()
                .weight
                .grad(&grads)
                .is_some(),
            "embedding"
        );
    }

    #[test]
    fn single_expert_renormalisation_is_rejected() {
        let cfg = Qwen3MoeConfig {
            num_experts_per_tok: 1,
            ..tiny()
        };
        let err = cfg.init(&Device::flex()).unwrap_err().to_string();
        assert!(err.contains("norm_topk_prob"), "{err}");
    }
}

impl crate::config::FamilyConfig for Qwen3MoeConfig {
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
        Some((self.num_experts, self.num_experts_per_tok))
    }

    fn is_moe_layer(&self, layer: usize) -> bool {
        Self::is_moe_layer(self, layer)
    }

    fn tie_word_embeddings(&self) -> bool {
        self.tie_word_embeddings
    }

    fn sizes(&self) -> crate::config::ConfigSizes {
        crate::config::ConfigSizes {
            layers: ("num_hidden_layers", self.num_hidden_layers),
            experts: Some(("num_experts", self.num_experts)),
            dims: vec![
                ("vocab_size", self.vocab_size),
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("num_attention_heads", self.num_attention_heads),
                ("num_key_value_heads", self.num_key_value_heads),
                ("head_dim", self.head_dim),
            ],
        }
    }
}

/// Qwen3-MoE (`Qwen3MoeForCausalLM`).
#[derive(Debug, Clone, Copy)]
pub struct Qwen3Moe;

impl crate::family::Family for Qwen3Moe {
    const MODEL_TYPE: &'static str = Qwen3MoeConfig::MODEL_TYPE;
    const ARCHITECTURE: &'static str = "Qwen3MoeForCausalLM";
    type Config = Qwen3MoeConfig;
    type Model = Qwen3MoeForCausalLM;

    fn model_shape(c: &Self::Config) -> Option<crate::param_plan::ModelShape> {
        Some(crate::param_plan::ModelShape {
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            attention: crate::param_plan::AttentionShape::Gqa {
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                qk_norm: true,
            },
            moe_layers: (0..c.num_hidden_layers)
                .map(|l| c.is_moe_layer(l))
                .collect(),
            dense_ffn: c.intermediate_size,
            experts: c.num_experts,
            top_k: c.num_experts_per_tok,
            moe_ffn: c.moe_intermediate_size,
            shared_ffn: 0,
            tied_embeddings: c.tie_word_embeddings,
        })
    }

    /// HF's loss: cross-entropy plus `router_aux_loss_coef ·` the load-balancing loss.
    fn hf_losses(
        model: &Qwen3MoeForCausalLM,
        input_ids: Tensor<2, Int>,
        labels: &[i64],
    ) -> Result<(Tensor<3>, crate::causal_lm::LmLosses), ModelError> {
        let out = model.forward(input_ids)?;
        let losses = model.loss(&out, labels, None)?;
        let losses = crate::causal_lm::LmLosses {
            loss: losses.loss,
            aux_loss: Some(losses.aux_loss),
        };
        Ok((out.logits, losses))
    }

    const UPCYCLED_FROM: Option<&'static str> = Some(crate::Qwen3Config::MODEL_TYPE);

    /// The dense Qwen3 fields copied (including `tie_word_embeddings` and the dense
    /// `intermediate_size`), then `model_type`, `architectures`, `moe_intermediate_size`,
    /// `num_experts`, `num_experts_per_tok`, `norm_topk_prob`, `mlp_only_layers = []`,
    /// `decoder_sparse_step = 1` set (every layer sparse).
    fn upcycled_config(
        source: &serde_json::Value,
        moe: crate::families::UpcycledMoe,
    ) -> Option<serde_json::Value> {
        use serde_json::json;
        let mut config = source.clone();
        if let serde_json::Value::Object(map) = &mut config {
            map.remove("num_local_experts");
            let entries = [
                ("model_type", json!(Self::MODEL_TYPE)),
                ("architectures", json!([Self::ARCHITECTURE])),
                ("moe_intermediate_size", json!(moe.moe_intermediate)),
                ("num_experts", json!(moe.experts)),
                ("num_experts_per_tok", json!(moe.topk)),
                ("norm_topk_prob", json!(moe.norm_topk_prob)),
                ("mlp_only_layers", json!([])),
                ("decoder_sparse_step", json!(1)),
            ];
            for (key, value) in entries {
                map.insert(key.to_owned(), value);
            }
        }
        Some(config)
    }
}
