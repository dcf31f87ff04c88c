//! DeepSeek-V3, read beside HF transformers 5.23 `models/deepseek_v3/modeling_deepseek_v3.py`
//! (docs/models.md §DeepSeek-V3).
//!
//! `embed_tokens → [input_layernorm → MLA → residual → post_attention_layernorm → MLP or MoE →
//! residual] × N → norm → lm_head`. Layers `0..first_k_dense_replace` use a dense SwiGLU MLP;
//! the others the MoE block: moe-backend's [`MoeLayer`](moe_backend::layer::MoeLayer) with a sigmoid router, group-limited
//! top-k (group score = sum of the top 2, `topk_group` groups kept, −inf elsewhere),
//! `e_score_correction_bias` for the selection only, weights renormalised
//! (`norm_topk_prob`) and scaled by `routed_scaling_factor`, plus the shared experts.
//! The MTP modules (`model.layers.{N+j}`, [`crate::mtp`]) are loaded when
//! `num_nextn_predict_layers > 0` but are not part of the main forward
//! (docs/models.md §Multi-token prediction).

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};
use moe_backend::layer::MoeLayerConfig;

use crate::DeepseekV3Config;
use crate::ModelError;
use crate::causal_lm::CausalLm;
use crate::distributed::{AttentionInputs, ParallelContext, RouterTrace, ShardModel, StackShape};
use crate::families::blocks::mtp::MtpModule;
use crate::layers::kv_cache::KvCache;
use crate::layers::mla::{Mla, MlaConfig, mla_softmax_scale};
use crate::layers::rope::RotaryEmbedding;
use crate::layers::{LayerStack, MlpConfig, RmsNorm, RmsNormConfig};
use crate::packing::SequenceLayout;
use crate::routing::ReplaySpec;
use crate::weights::{WeightLoader, WeightSource};

impl DeepseekV3Config {
    /// The MLA block of every layer (softmax scale per
    /// docs/models.md §Multi-head latent attention).
    pub fn mla_config(&self) -> MlaConfig {
        MlaConfig::new(
            self.hidden_size,
            self.num_attention_heads,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            mla_softmax_scale(self.qk_head_dim(), &self.rope_parameters),
        )
        .with_q_lora_rank(self.q_lora_rank)
        .with_attention_bias(self.attention_bias)
        .with_rope_interleave(self.rope_interleave)
    }

    /// The moe-backend layer of an MoE block (docs/models.md §DeepSeek-V3 router,
    /// §DeepSeek-V3 MoE block): sigmoid scores, `group_score_topk = 2`, expert bias for selection,
    /// normalisation and scaling, shared experts of width `Im · n_shared_experts`.
    pub fn moe_layer_config(&self) -> Result<MoeLayerConfig, ModelError> {
        self.moe_block().layer_config()
    }

    /// A randomly initialised model (Burn's default initialisers, norms at one, zero bias).
    pub fn init(&self, device: &Device) -> Result<DeepseekV3ForCausalLM, ModelError> {
        self.validate()?;
        let (h, eps) = (self.hidden_size, self.rms_norm_eps);
        let norm = || RmsNormConfig::new(h).with_epsilon(eps).init(device);
        let layers = (0..self.num_hidden_layers)
            .map(|i| self.init_layer(self.is_moe_layer(i), device))
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(DeepseekV3ForCausalLM {
            model: DeepseekV3Model {
                embed_tokens: Some(EmbeddingConfig::new(self.vocab_size, h).init(device)),
                layers: crate::layers::LayerStack::new(layers),
                norm: Some(norm()),
            },
            lm_head: (!self.tie_word_embeddings).then(|| {
                LinearConfig::new(h, self.vocab_size)
                    .with_bias(false)
                    .init(device)
            }),
            mtp: (0..self.num_nextn_predict_layers)
                .map(|_| MtpModule::init(self, device))
                .collect::<Result<Vec<_>, ModelError>>()?,
            rope: RotaryEmbedding::new(&self.rope_parameters, self.qk_rope_head_dim)?,
            config: self.clone(),
        })
    }

    /// A randomly initialised decoder layer with an MoE block or a dense MLP.
    pub fn init_layer(
        &self,
        moe: bool,
        device: &Device,
    ) -> Result<DeepseekV3DecoderLayer, ModelError> {
        let norm = || {
            RmsNormConfig::new(self.hidden_size)
                .with_epsilon(self.rms_norm_eps)
                .init(device)
        };
        let mlp = if moe {
            DeepseekV3FeedForward::Moe(DeepseekV3Moe {
                moe: self.moe_layer_config()?.init(device)?,
            })
        } else {
            DeepseekV3FeedForward::Dense(
                MlpConfig::new(self.hidden_size, self.intermediate_size).init(device),
            )
        };
        Ok(DeepseekV3DecoderLayer {
            input_layernorm: norm(),
            self_attn: self.mla_config().init(device),
            post_attention_layernorm: norm(),
            mlp,
        })
    }
}

pub use crate::families::blocks::moe::{
    MoeBlock as DeepseekV3Moe, MoeFeedForward as DeepseekV3FeedForward,
    MoeRouting as DeepseekV3Routing,
};

/// One pre-norm decoder layer (HF `DeepseekV3DecoderLayer`).
#[derive(Module, Debug)]
pub struct DeepseekV3DecoderLayer {
    /// Norm before attention `[H]`.
    pub input_layernorm: RmsNorm,
    /// Multi-head latent attention.
    pub self_attn: Mla,
    /// Norm before the feed-forward block `[H]`.
    pub post_attention_layernorm: RmsNorm,
    /// Dense MLP or MoE block.
    pub mlp: DeepseekV3FeedForward,
}

impl DeepseekV3DecoderLayer {
    /// The layer on this rank's sequence-parallel block `x [B·S/tp, H]` of `batch` sequences
    /// under `ctx` (the whole `[B·S, H]` at `world = 1`): `h = x + mla(norm(x))` with MLA
    /// heads TP-sharded, then `h + ffn(norm(h))` with the dense MLP TP-sharded or the MoE
    /// block (shared experts on the local rows) behind the context's dispatcher, its routing
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
            DeepseekV3FeedForward::Dense(mlp) => ctx.dense_mlp(mlp, normed)?,
            DeepseekV3FeedForward::Moe(block) => ctx.moe(&block.moe, normed, batch, trace)?,
        };
        Ok(h + y)
    }
}

/// The decoder stack (HF `DeepseekV3Model`).
#[derive(Module, Debug)]
pub struct DeepseekV3Model {
    /// Token embedding `[V, H]`.
    pub embed_tokens: Option<Embedding>,
    /// Decoder layers.
    pub layers: crate::layers::LayerStack<DeepseekV3DecoderLayer>,
    /// Final norm `[H]`.
    pub norm: Option<RmsNorm>,
}

/// Output of [`DeepseekV3ForCausalLM::forward`].
#[derive(Debug, Clone)]
pub struct DeepseekV3Output {
    /// `[B, S, V]` logits.
    pub logits: Tensor<3>,
    /// `[B, S, H]` final-normed hidden states (HF `last_hidden_state`; `h⁰` of the MTP).
    pub hidden: Tensor<3>,
    /// Routing of every MoE layer, in layer order (rows `b·S + s`).
    pub routing: Vec<DeepseekV3Routing>,
}

/// DeepSeek-V3 causal language model (HF `DeepseekV3ForCausalLM`).
#[derive(Module, Debug)]
pub struct DeepseekV3ForCausalLM {
    /// The decoder stack.
    pub model: DeepseekV3Model,
    /// Output projection `H → V`; `None` when tied.
    pub lm_head: Option<Linear>,
    /// Multi-token-prediction modules (`num_nextn_predict_layers`, stored as layers `N + j`);
    /// not used by [`Self::forward`], see [`Self::forward_mtp`].
    pub mtp: Vec<MtpModule<DeepseekV3DecoderLayer>>,
    #[module(skip)]
    rope: RotaryEmbedding,
    #[module(skip)]
    config: DeepseekV3Config,
}

crate::distributed::stage_model!(DeepseekV3ForCausalLM, |model, stage| {
    if !stage.mtp {
        model.mtp = Vec::new();
    }
});

impl DeepseekV3ForCausalLM {
    /// Loads every main-model tensor by its HF name (docs/models.md §HF tensor names); experts per
    /// expert or stacked, not mixed; `e_score_correction_bias` is kept in f32 and never trained.
    /// Modules are built from the loaded tensors (nothing is initialised and overwritten).
    pub fn from_weights(
        config: &DeepseekV3Config,
        source: &dyn WeightSource,
        device: &Device,
    ) -> Result<Self, ModelError> {
        <Self as ShardModel>::from_loader(config, &WeightLoader::new(source, device))
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &DeepseekV3Config {
        &self.config
    }

    /// Logits and per-MoE-layer routing of `input_ids [B, S]` (positions `0..S`, no cache).
    pub fn forward(&self, input_ids: Tensor<2, Int>) -> Result<DeepseekV3Output, ModelError> {
        self.run(input_ids, None, None, None)
    }

    /// [`forward`](Self::forward) of a packed or padded batch (see [`crate::packing`]): MLA
    /// stays within each document and skips padded keys, RoPE positions restart at every
    /// document (HF `cumsum(mask) − 1` for padded rows), and the routers are told which rows
    /// are padding. Each document's logits equal those of the document run alone. Errors if
    /// `layout` is not `[B, S]`.
    pub fn forward_packed(
        &self,
        input_ids: Tensor<2, Int>,
        layout: &SequenceLayout,
    ) -> Result<DeepseekV3Output, ModelError> {
        self.run(input_ids, None, None, Some(layout))
    }

    /// MTP logits of every depth `j < D` (docs/models.md §Multi-token prediction):
    /// `[B, S − 1 − j, V]`, position `i` predicting token `i + j + 2`, from `input_ids [B, S]` and
    /// the main forward's final-normed `hidden` ([`DeepseekV3Output::hidden`]).
    pub fn forward_mtp(
        &self,
        input_ids: Tensor<2, Int>,
        hidden: Tensor<3>,
    ) -> Result<Vec<Tensor<3>>, ModelError> {
        crate::families::blocks::mtp::mtp_logits(self, input_ids, hidden)
    }

    /// The single-rank forward ([`crate::families::local_run`]): after the positions in
    /// `cache`, or of a packed/padded batch with `layout`; `replay` forces every MoE layer's
    /// experts (per MoE layer, [`crate::replay`]).
    pub(crate) fn run(
        &self,
        input_ids: Tensor<2, Int>,
        cache: Option<&mut KvCache>,
        replay: Option<Vec<Tensor<2, Int>>>,
        layout: Option<&SequenceLayout>,
    ) -> Result<DeepseekV3Output, ModelError> {
        let [b, s] = input_ids.dims();
        let (out, trace) = crate::families::local_run(self, input_ids, layout, cache, replay)?;
        let h = out.hidden.dims()[1];
        let routing = (trace.logits.into_iter())
            .zip(trace.selected)
            .zip(trace.selected_weights)
            .map(
                |((router_logits, topk_indices), topk_weights)| DeepseekV3Routing {
                    router_logits,
                    topk_indices,
                    topk_weights,
                },
            )
            .collect();
        Ok(DeepseekV3Output {
            logits: out.logits,
            hidden: out.hidden.reshape([b, s, h]),
            routing,
        })
    }
}

impl MtpModule<DeepseekV3DecoderLayer> {
    /// A randomly initialised DeepSeek-V3 module (norms at one).
    pub fn init(config: &DeepseekV3Config, device: &Device) -> Result<Self, ModelError> {
        let block = config.init_layer(true, device)?;
        Ok(Self::around(
            block,
            config.hidden_size,
            config.rms_norm_eps,
            device,
        ))
    }
}

impl crate::families::blocks::mtp::MtpBlock for DeepseekV3DecoderLayer {
    fn forward_in(
        &self,
        ctx: &ParallelContext,
        x: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
        inputs: AttentionInputs<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        DeepseekV3DecoderLayer::forward_in(self, ctx, x, batch, trace, inputs)
    }
}

crate::distributed::decoder_stack!(DeepseekV3ForCausalLM, DeepseekV3DecoderLayer, mtp = mtp);

impl ShardModel for DeepseekV3ForCausalLM {
    type Config = DeepseekV3Config;

    fn template(config: &DeepseekV3Config, device: &Device) -> Result<Self, ModelError> {
        config.init(device)
    }

    fn select_stage(self, stage: &crate::weights::StageHolding) -> Result<Self, ModelError> {
        Self::select_stage(self, stage)
    }

    fn model_config(&self) -> &DeepseekV3Config {
        &self.config
    }

    fn stack_shape(config: &DeepseekV3Config) -> Result<StackShape, ModelError> {
        Ok(crate::families::stack_shape(
            config,
            RotaryEmbedding::new(&config.rope_parameters, config.qk_rope_head_dim)?,
        ))
    }

    fn mtp_layers(&self) -> Vec<&DeepseekV3DecoderLayer> {
        self.mtp.iter().map(|m| &m.block).collect()
    }

    fn layers_with_mtp_mut(
        &mut self,
    ) -> (
        &mut LayerStack<DeepseekV3DecoderLayer>,
        Vec<&mut DeepseekV3DecoderLayer>,
    ) {
        let mtp = self.mtp.iter_mut().map(|m| &mut m.block).collect();
        (&mut self.model.layers, mtp)
    }

    fn replay_spec(&self) -> Option<ReplaySpec> {
        crate::families::replay_spec::<DeepseekV3>(&self.config)
    }
}

crate::layer_parts!(
    DeepseekV3DecoderLayer,
    Mla,
    attention = self_attn,
    ffn = mlp
);

impl CausalLm for DeepseekV3ForCausalLM {
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

    #[test]
    fn official_config_parameter_counts() {
        let cfg = DeepseekV3Config::from_json_str(
            r#"{"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}"#,
        )
        .unwrap();
        let c = crate::families::param_count::<DeepseekV3>(&cfg).unwrap();
        let b = |x: u64| x as f64 / 1e9;
        assert!((669.0..673.0).contains(&b(c.total)), "{c:?}");
        assert!((683.0..687.0).contains(&b(c.total + c.mtp)), "{c:?}");
        assert!((36.5..38.0).contains(&b(c.active)), "{c:?}");
    }

    #[test]
    fn tiny_random_model_runs_and_routes_within_kept_groups() {
        let device = Device::flex();
        let cfg = DeepseekV3Config {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 24,
            moe_intermediate_size: 8,
            num_hidden_layers: 2,
            first_k_dense_replace: 1,
            num_attention_heads: 2,
            n_routed_experts: 8,
            num_experts_per_tok: 2,
            n_group: 4,
            topk_group: 1,
            q_lora_rank: None,
            kv_lora_rank: 8,
            qk_nope_head_dim: 4,
            qk_rope_head_dim: 4,
            v_head_dim: 4,
            ..DeepseekV3Config::default()
        };
        let model = cfg.init(&device).unwrap();
        let ids = Tensor::<2, Int>::from_data([[1, 2, 3, 4]], &device);
        let out = model.forward(ids).unwrap();
        assert_eq!(out.logits.dims(), [1, 4, 32]);
        assert_eq!(out.routing.len(), 1);
        let idx = out.routing[0]
            .topk_indices
            .clone()
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .unwrap();
        for row in idx.chunks(2) {
            assert_eq!(
                row[0] / 2,
                row[1] / 2,
                "one kept group of 2 experts: {row:?}"
            );
        }
    }
}

impl crate::config::FamilyConfig for DeepseekV3Config {
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

    fn warnings(&self) -> Vec<String> {
        Self::warnings(self)
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
                ("kv_lora_rank", self.kv_lora_rank),
                ("qk_nope_head_dim", self.qk_nope_head_dim),
                ("qk_rope_head_dim", self.qk_rope_head_dim),
                ("v_head_dim", self.v_head_dim),
                ("q_lora_rank", self.q_lora_rank.unwrap_or(0)),
            ],
        }
    }
}

/// DeepSeek-V3 (`DeepseekV3ForCausalLM`), MTP modules included.
#[derive(Debug, Clone, Copy)]
pub struct DeepseekV3;

impl crate::family::Family for DeepseekV3 {
    const MODEL_TYPE: &'static str = DeepseekV3Config::MODEL_TYPE;
    const ARCHITECTURE: &'static str = "DeepseekV3ForCausalLM";
    type Config = DeepseekV3Config;
    type Model = DeepseekV3ForCausalLM;

    fn model_shape(c: &Self::Config) -> Option<crate::param_plan::ModelShape> {
        Some(crate::param_plan::ModelShape {
            vocab: c.vocab_size,
            hidden: c.hidden_size,
            attention: crate::param_plan::AttentionShape::Mla {
                heads: c.num_attention_heads,
                q_lora_rank: c.q_lora_rank,
                kv_lora_rank: c.kv_lora_rank,
                qk_nope: c.qk_nope_head_dim,
                qk_rope: c.qk_rope_head_dim,
                v_head: c.v_head_dim,
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

    fn export_copies(
        config: &DeepseekV3Config,
        has: &dyn Fn(&str) -> bool,
    ) -> Vec<(String, String)> {
        super::plan::mtp_export_copies(config, has)
    }
}
