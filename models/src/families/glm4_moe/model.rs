//! GLM-4.5 MoE, read beside HF transformers 5.23 `models/glm4_moe/modeling_glm4_moe.py`.
//!
//! `embed_tokens → [input_layernorm → GQA attention → residual → post_attention_layernorm →
//! MLP or MoE → residual] × N → norm → lm_head`. The attention is [`crate::layers::Attention`]
//! with biases on q/k/v only (`Glm4MoeAttention`'s `o_proj` has none), the optional per-head
//! QK-norm (`use_qk_norm`, before RoPE) and partial rotary (`partial_rotary_factor`: the first
//! `int(hd·factor)` dims of each head, rotate-half). Layers `0..first_k_dense_replace` use a
//! dense SwiGLU MLP, the others DeepSeek-V3's MoE block (`Glm4MoeTopkRouter` is
//! `DeepseekV3TopkRouter`: sigmoid scores, `e_score_correction_bias` for the selection,
//! group-limited top-k, renormalised and scaled weights, plus shared experts). The release's
//! MTP layers (`model.layers.{N+j}`, always MoE) are the shared [`MtpModule`] around this
//! family's decoder layer; they train like DeepSeek's and are not part of the main forward.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};
use moe_backend::fp8::Fp8Recipe;
use moe_backend::layer::MoeLayerConfig;

use super::config::Glm4MoeConfig;
use crate::ModelError;
use crate::causal_lm::CausalLm;
use crate::distributed::{AttentionInputs, ParallelContext, RouterTrace, ShardModel, StackShape};
use crate::families::blocks::moe::{MoeBlock, MoeFeedForward, MoeRouting};
use crate::families::blocks::mtp::{MtpBlock, MtpModule};
use crate::layers::kv_cache::KvCache;
use crate::layers::rope::RotaryEmbedding;
use crate::layers::{Attention, AttentionConfig, LayerStack, MlpConfig, RmsNorm, RmsNormConfig};
use crate::packing::SequenceLayout;
use crate::routing::ReplaySpec;
use crate::weights::{WeightLoader, WeightSource};

impl Glm4MoeConfig {
    /// The attention block of every layer: GQA with q/k/v biases (`attention_bias`; never on
    /// `o_proj`), QK-norm with `use_qk_norm`, partial rotary.
    pub fn attention_config(&self) -> AttentionConfig {
        AttentionConfig::new(
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        )
        .with_rms_norm_eps(self.rms_norm_eps)
        .with_attention_bias(self.attention_bias)
        .with_o_proj_bias(false)
        .with_qk_norm(self.use_qk_norm)
        .with_partial_rotary_factor(self.partial_rotary_factor)
    }

    /// The rotary embedding over the rotated width `int(head_dim · partial_rotary_factor)`.
    pub fn rotary_embedding(&self) -> Result<RotaryEmbedding, ModelError> {
        self.attention_config()
            .rotary_embedding(&self.rope_parameters)
    }

    /// The moe-backend layer of an MoE block (DeepSeek-V3's router and shared experts).
    pub fn moe_layer_config(&self) -> Result<MoeLayerConfig, ModelError> {
        self.moe_block().layer_config()
    }

    /// A randomly initialised model (Burn's default initialisers, norms at one, zero bias).
    pub fn init(&self, device: &Device) -> Result<Glm4MoeForCausalLM, ModelError> {
        self.validate()?;
        let (h, eps) = (self.hidden_size, self.rms_norm_eps);
        let layers = (0..self.num_hidden_layers)
            .map(|i| self.init_layer(self.is_moe_layer(i), device))
            .collect::<Result<Vec<_>, ModelError>>()?;
        let mtp = (0..self.num_nextn_predict_layers)
            .map(|_| {
                Ok(MtpModule::around(
                    self.init_layer(true, device)?,
                    h,
                    eps,
                    device,
                ))
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Glm4MoeForCausalLM {
            model: Glm4MoeModel {
                embed_tokens: Some(EmbeddingConfig::new(self.vocab_size, h).init(device)),
                layers: crate::layers::LayerStack::new(layers),
                norm: Some(RmsNormConfig::new(h).with_epsilon(eps).init(device)),
            },
            lm_head: (!self.tie_word_embeddings).then(|| {
                LinearConfig::new(h, self.vocab_size)
                    .with_bias(false)
                    .init(device)
            }),
            mtp,
            rope: self.rotary_embedding()?,
            config: self.clone(),
        })
    }

    /// A randomly initialised decoder layer with an MoE block or a dense MLP.
    pub fn init_layer(
        &self,
        moe: bool,
        device: &Device,
    ) -> Result<Glm4MoeDecoderLayer, ModelError> {
        let norm = || {
            RmsNormConfig::new(self.hidden_size)
                .with_epsilon(self.rms_norm_eps)
                .init(device)
        };
        let mlp = if moe {
            MoeFeedForward::Moe(MoeBlock {
                moe: self.moe_layer_config()?.init(device)?,
            })
        } else {
            MoeFeedForward::Dense(
                MlpConfig::new(self.hidden_size, self.intermediate_size).init(device),
            )
        };
        Ok(Glm4MoeDecoderLayer {
            input_layernorm: norm(),
            self_attn: self.attention_config().init(device)?,
            post_attention_layernorm: norm(),
            mlp,
        })
    }
}

/// One pre-norm decoder layer (HF `Glm4MoeDecoderLayer`).
#[derive(Module, Debug)]
pub struct Glm4MoeDecoderLayer {
    /// Norm before attention `[H]`.
    pub input_layernorm: RmsNorm,
    /// GQA self-attention (q/k/v biases, optional QK-norm, partial rotary).
    pub self_attn: Attention,
    /// Norm before the feed-forward block `[H]`.
    pub post_attention_layernorm: RmsNorm,
    /// Dense MLP (`layer < first_k_dense_replace`) or the MoE block (`mlp.gate`,
    /// `mlp.experts`, `mlp.shared_experts`).
    pub mlp: MoeFeedForward,
}

impl Glm4MoeDecoderLayer {
    /// The layer on this rank's sequence-parallel block `x [B·S/tp, H]` of `batch` sequences
    /// under `ctx` (the whole `[B·S, H]` at `world = 1`): `h = x + attn(norm(x))` with heads
    /// TP-sharded, then `h + ffn(norm(h))` with the dense MLP TP-sharded or the MoE block
    /// (shared experts on the local rows) behind the context's dispatcher, its routing
    /// reported to `trace`.
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
            MoeFeedForward::Dense(mlp) => ctx.dense_mlp(mlp, normed)?,
            MoeFeedForward::Moe(block) => ctx.moe(&block.moe, normed, batch, trace)?,
        };
        Ok(h + y)
    }
}

impl MtpBlock for Glm4MoeDecoderLayer {
    fn forward_in(
        &self,
        ctx: &ParallelContext,
        x: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
        inputs: AttentionInputs<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        Glm4MoeDecoderLayer::forward_in(self, ctx, x, batch, trace, inputs)
    }
}

/// The decoder stack (HF `Glm4MoeModel`).
#[derive(Module, Debug)]
pub struct Glm4MoeModel {
    /// Token embedding `[V, H]`.
    pub embed_tokens: Option<Embedding>,
    /// Decoder layers.
    pub layers: crate::layers::LayerStack<Glm4MoeDecoderLayer>,
    /// Final norm `[H]`.
    pub norm: Option<RmsNorm>,
}

/// Output of [`Glm4MoeForCausalLM::forward`].
#[derive(Debug, Clone)]
pub struct Glm4MoeOutput {
    /// `[B, S, V]` logits.
    pub logits: Tensor<3>,
    /// `[B, S, H]` final-normed hidden states (HF `last_hidden_state`; `h⁰` of the MTP).
    pub hidden: Tensor<3>,
    /// Routing of every MoE layer, in layer order (rows `b·S + s`; HF `Glm4MoeTopkRouter`
    /// outputs).
    pub routing: Vec<MoeRouting>,
}

/// GLM-4.5 MoE causal language model (HF `Glm4MoeForCausalLM`).
#[derive(Module, Debug)]
pub struct Glm4MoeForCausalLM {
    /// The decoder stack.
    pub model: Glm4MoeModel,
    /// Output projection `H → V`; `None` when tied.
    pub lm_head: Option<Linear>,
    /// Multi-token-prediction modules (`num_nextn_predict_layers`, stored as layers `N + j`);
    /// not used by [`Self::forward`], see [`Self::forward_mtp`].
    pub mtp: Vec<MtpModule<Glm4MoeDecoderLayer>>,
    #[module(skip)]
    rope: RotaryEmbedding,
    #[module(skip)]
    config: Glm4MoeConfig,
}

crate::distributed::stage_model!(Glm4MoeForCausalLM, |model, stage| {
    if !stage.mtp {
        model.mtp = Vec::new();
    }
});

impl Glm4MoeForCausalLM {
    /// Loads every tensor (main model and MTP layers) by its HF name; experts per expert or
    /// stacked; `e_score_correction_bias` kept in f32 and never trained.
    pub fn from_weights(
        config: &Glm4MoeConfig,
        source: &dyn WeightSource,
        device: &Device,
    ) -> Result<Self, ModelError> {
        <Self as ShardModel>::from_loader(config, &WeightLoader::new(source, device))
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &Glm4MoeConfig {
        &self.config
    }

    /// Logits, final hidden states and per-MoE-layer routing of `input_ids [B, S]`
    /// (positions `0..S`, no cache).
    pub fn forward(&self, input_ids: Tensor<2, Int>) -> Result<Glm4MoeOutput, ModelError> {
        self.run(input_ids, None, None, None)
    }

    /// [`forward`](Self::forward) of a packed or padded batch (see [`crate::packing`]).
    pub fn forward_packed(
        &self,
        input_ids: Tensor<2, Int>,
        layout: &SequenceLayout,
    ) -> Result<Glm4MoeOutput, ModelError> {
        self.run(input_ids, None, None, Some(layout))
    }

    /// MTP logits of every depth `j` (`[B, S − 1 − j, V]`, position `i` predicting token
    /// `i + j + 2`) from `input_ids [B, S]` and the main forward's `hidden`
    /// ([`Glm4MoeOutput::hidden`]); see [`crate::families::blocks::mtp::mtp_logits`].
    pub fn forward_mtp(
        &self,
        input_ids: Tensor<2, Int>,
        hidden: Tensor<3>,
    ) -> Result<Vec<Tensor<3>>, ModelError> {
        crate::families::blocks::mtp::mtp_logits(self, input_ids, hidden)
    }

    /// The single-rank forward ([`DecoderStack`](crate::distributed::DecoderStack) on the
    /// `world = 1` context): after the positions in `cache`, or of a packed/padded batch with
    /// `layout`; `replay` forces every MoE layer's experts.
    fn run(
        &self,
        input_ids: Tensor<2, Int>,
        cache: Option<&mut KvCache>,
        replay: Option<Vec<Tensor<2, Int>>>,
        layout: Option<&SequenceLayout>,
    ) -> Result<Glm4MoeOutput, ModelError> {
        let [b, s] = input_ids.dims();
        let (out, trace) = crate::families::local_run(self, input_ids, layout, cache, replay)?;
        let h = out.hidden.dims()[1];
        let routing = (trace.logits.into_iter())
            .zip(trace.selected)
            .zip(trace.selected_weights)
            .map(|((router_logits, topk_indices), topk_weights)| MoeRouting {
                router_logits,
                topk_indices,
                topk_weights,
            })
            .collect();
        Ok(Glm4MoeOutput {
            logits: out.logits,
            hidden: out.hidden.reshape([b, s, h]),
            routing,
        })
    }
}

crate::distributed::decoder_stack!(Glm4MoeForCausalLM, Glm4MoeDecoderLayer, mtp = mtp);

impl ShardModel for Glm4MoeForCausalLM {
    type Config = Glm4MoeConfig;

    fn template(config: &Glm4MoeConfig, device: &Device) -> Result<Self, ModelError> {
        config.init(device)
    }

    fn select_stage(self, stage: &crate::weights::StageHolding) -> Result<Self, ModelError> {
        Self::select_stage(self, stage)
    }

    fn model_config(&self) -> &Glm4MoeConfig {
        &self.config
    }

    fn stack_shape(config: &Glm4MoeConfig) -> Result<StackShape, ModelError> {
        Ok(crate::families::stack_shape(
            config,
            config.rotary_embedding()?,
        ))
    }

    fn mtp_layers(&self) -> Vec<&Glm4MoeDecoderLayer> {
        self.mtp.iter().map(|m| &m.block).collect()
    }

    fn layers_with_mtp_mut(
        &mut self,
    ) -> (
        &mut LayerStack<Glm4MoeDecoderLayer>,
        Vec<&mut Glm4MoeDecoderLayer>,
    ) {
        let mtp = self.mtp.iter_mut().map(|m| &mut m.block).collect();
        (&mut self.model.layers, mtp)
    }

    fn replay_spec(&self) -> Option<ReplaySpec> {
        crate::families::replay_spec::<Glm4Moe>(&self.config)
    }

    /// Routed experts in FP8 and, with `linears`, the attention projections and the dense
    /// MLPs too (main layers and MTP blocks); routers, shared experts, `eh_proj`, embedding,
    /// head and norms stay in high precision.
    fn with_fp8(self, recipe: Fp8Recipe, linears: bool) -> Result<Self, ModelError> {
        self.with_fp8_layers(Some(recipe), linears)
    }
}

crate::layer_parts!(
    Glm4MoeDecoderLayer,
    Attention,
    attention = self_attn,
    ffn = mlp
);

impl CausalLm for Glm4MoeForCausalLM {
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

impl crate::config::FamilyConfig for Glm4MoeConfig {
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
        Some((self.n_routed_experts, self.num_experts_per_tok))
    }

    fn is_moe_layer(&self, layer: usize) -> bool {
        Self::is_moe_layer(self, layer)
    }

    fn mtp_layers(&self) -> usize {
        self.num_nextn_predict_layers
    }

    fn tie_word_embeddings(&self) -> bool {
        self.tie_word_embeddings
    }

    fn sizes(&self) -> crate::config::ConfigSizes {
        crate::config::ConfigSizes {
            layers: (
                "num_hidden_layers/num_nextn_predict_layers",
                self.num_hidden_layers
                    .saturating_add(self.num_nextn_predict_layers),
            ),
            experts: Some(("n_routed_experts", self.n_routed_experts)),
            dims: vec![
                ("vocab_size", self.vocab_size),
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("n_shared_experts", self.n_shared_experts),
                ("num_attention_heads", self.num_attention_heads),
                ("num_key_value_heads", self.num_key_value_heads),
                ("head_dim", self.head_dim),
            ],
        }
    }
}

/// GLM-4.5 / 4.6 MoE (`Glm4MoeForCausalLM`), MTP layers included.
#[derive(Debug, Clone, Copy)]
pub struct Glm4Moe;

impl crate::family::Family for Glm4Moe {
    const MODEL_TYPE: &'static str = Glm4MoeConfig::MODEL_TYPE;
    const ARCHITECTURE: &'static str = "Glm4MoeForCausalLM";
    type Config = Glm4MoeConfig;
    type Model = Glm4MoeForCausalLM;

    fn model_shape(c: &Glm4MoeConfig) -> Option<crate::param_plan::ModelShape> {
        Some(crate::param_plan::ModelShape {
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            attention: crate::param_plan::AttentionShape::Gqa {
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                qk_norm: c.use_qk_norm,
            },
            moe_layers: (0..c.num_hidden_layers)
                .map(|l| c.is_moe_layer(l))
                .collect(),
            dense_ffn: c.intermediate_size,
            experts: c.n_routed_experts,
            top_k: c.num_experts_per_tok,
            moe_ffn: c.moe_intermediate_size,
            shared_ffn: c.n_shared_experts * c.moe_intermediate_size,
            tied_embeddings: c.tie_word_embeddings,
        })
    }

    fn mapping_rules() -> Vec<moe_bridge::mapping::Rule> {
        super::plan::mapping_rules()
    }

    fn export_copies(config: &Glm4MoeConfig, has: &dyn Fn(&str) -> bool) -> Vec<(String, String)> {
        super::plan::mtp_export_copies(config, has)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Tolerance;

    use super::*;

    fn tiny() -> Glm4MoeConfig {
        Glm4MoeConfig {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 24,
            moe_intermediate_size: 8,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            n_routed_experts: 8,
            num_experts_per_tok: 2,
            n_group: 4,
            topk_group: 1,
            attention_bias: true,
            use_qk_norm: true,
            num_nextn_predict_layers: 1,
            ..Glm4MoeConfig::default()
        }
    }

    #[test]
    fn routes_within_kept_groups_and_caches_like_the_full_forward() {
        let device = Device::flex();
        let model = tiny().init(&device).unwrap();
        assert!(model.model.layers[0].self_attn.o_proj.bias.is_none());
        assert!(model.model.layers[0].self_attn.q_proj.bias.is_some());
        let ids = Tensor::<2, Int>::from_data([[1, 5, 7, 2, 9]], &device);
        let out = model.forward(ids.clone()).unwrap();
        assert_eq!(out.logits.dims(), [1, 5, 32]);
        assert_eq!(out.routing.len(), 1);
        let idx = (out.routing[0].topk_indices.clone().into_data())
            .convert::<i64>()
            .try_into_vec::<i64>()
            .unwrap();
        for row in idx.chunks(2) {
            assert_eq!(row[0] / 2, row[1] / 2, "one kept group of 2: {row:?}");
        }
        let mtp = model.forward_mtp(ids.clone(), out.hidden.clone()).unwrap();
        assert_eq!(mtp[0].dims(), [1, 4, 32]);
        let mut cache = model.new_cache();
        let a = model
            .forward_cached(ids.clone().narrow(1, 0, 3), &mut cache)
            .unwrap();
        let b = model
            .forward_cached(ids.narrow(1, 3, 2), &mut cache)
            .unwrap();
        Tensor::cat(vec![a, b], 1)
            .into_data()
            .assert_approx_eq::<f32>(&out.logits.into_data(), Tolerance::rel_abs(1e-4, 1e-5));
    }

    #[test]
    fn release_config_parameter_counts() {
        // GLM-4.5 as released: 355 B total, 32 B active (zai-org/GLM-4.5 model card).
        let cfg = Glm4MoeConfig::from_json_str(
            r#"{"model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 5120,
                "intermediate_size": 12288, "moe_intermediate_size": 1536,
                "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
                "head_dim": 128, "n_routed_experts": 160, "n_shared_experts": 1,
                "num_experts_per_tok": 8, "first_k_dense_replace": 3, "attention_bias": true,
                "use_qk_norm": true, "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5,
                "num_nextn_predict_layers": 1}"#,
        )
        .unwrap();
        let c = crate::families::param_count::<Glm4Moe>(&cfg).unwrap();
        let b = |x: u64| x as f64 / 1e9;
        assert!((350.0..356.0).contains(&b(c.total)), "{c:?}");
        assert!((31.0..34.0).contains(&b(c.active)), "{c:?}");
    }
}
