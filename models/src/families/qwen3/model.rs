//! Dense Qwen3, read beside HF transformers 5.23 `models/qwen3/modeling_qwen3.py`
//! (docs/models.md §Shared building blocks, §Qwen3 and its attention).
//!
//! `embed_tokens → [input_layernorm → Attention (QK-norm, RoPE, GQA) → residual →
//! post_attention_layernorm → SwiGLU MLP → residual] × L → norm → lm_head` (tied to
//! `embed_tokens` when `tie_word_embeddings`). Module paths mirror the HF tensor names
//! (`model.layers.{i}.self_attn.q_proj`, …).

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};

use crate::ModelError;
use crate::Qwen3Config;
use crate::causal_lm::CausalLm;
use crate::distributed::{AttentionInputs, ParallelContext, RouterTrace, ShardModel};
use crate::layers::kv_cache::KvCache;
use crate::layers::rope::RotaryEmbedding;
use crate::layers::{Attention, AttentionConfig, Mlp, MlpConfig, RmsNorm, RmsNormConfig};
use crate::packing::SequenceLayout;
use crate::weights::{WeightLoader, WeightSource};

impl Qwen3Config {
    /// The attention block of layer `layer` (its sliding window, if it has one).
    pub fn layer_attention_config(&self, layer: usize) -> AttentionConfig {
        self.attention_config()
            .with_sliding_window(self.layer_sliding_window(layer))
    }

    /// The attention block of every layer, without the per-layer sliding window
    /// ([`layer_attention_config`](Self::layer_attention_config)).
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

    /// A randomly initialised model (Burn's default initialisers, norms at one).
    pub fn init(&self, device: &Device) -> Result<Qwen3ForCausalLM, ModelError> {
        self.validate()?;
        let (h, eps) = (self.hidden_size, self.rms_norm_eps);
        let norm = || RmsNormConfig::new(h).with_epsilon(eps).init(device);
        let layers = (0..self.num_hidden_layers)
            .map(|i| {
                Ok(Qwen3DecoderLayer {
                    input_layernorm: norm(),
                    self_attn: self.layer_attention_config(i).init(device)?,
                    post_attention_layernorm: norm(),
                    mlp: MlpConfig::new(h, self.intermediate_size).init(device),
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Qwen3ForCausalLM {
            model: Qwen3Model {
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

/// One pre-norm decoder layer (HF `Qwen3DecoderLayer`).
#[derive(Module, Debug)]
pub struct Qwen3DecoderLayer {
    /// Norm before attention `[H]`.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: Attention,
    /// Norm before the MLP `[H]`.
    pub post_attention_layernorm: RmsNorm,
    /// SwiGLU MLP of width `intermediate_size`.
    pub mlp: Mlp,
}

impl Qwen3DecoderLayer {
    /// The layer on this rank's sequence-parallel block `x [B·S/tp, H]` of `batch` sequences
    /// under `ctx` (the whole `[B·S, H]` at `world = 1`): `h = x + attn(norm(x))`, then
    /// `h + mlp(norm(h))` with attention heads and MLP columns TP-sharded (`_trace`: no MoE
    /// block reports to it; the signature every decoder layer shares).
    pub fn forward_in(
        &self,
        ctx: &ParallelContext,
        x: Tensor<2>,
        batch: usize,
        _trace: &mut RouterTrace,
        inputs: AttentionInputs<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        let h = ctx.attention_block(x, &self.input_layernorm, &self.self_attn, batch, inputs)?;
        let normed = self.post_attention_layernorm.forward(h.clone());
        Ok(h + ctx.dense_mlp(&self.mlp, normed)?)
    }
}

/// The decoder stack (HF `Qwen3Model`).
#[derive(Module, Debug)]
pub struct Qwen3Model {
    /// Token embedding `[V, H]`.
    pub embed_tokens: Option<Embedding>,
    /// Decoder layers.
    pub layers: crate::layers::LayerStack<Qwen3DecoderLayer>,
    /// Final norm `[H]`.
    pub norm: Option<RmsNorm>,
}

/// Dense Qwen3 causal language model (HF `Qwen3ForCausalLM`).
#[derive(Module, Debug)]
pub struct Qwen3ForCausalLM {
    /// The decoder stack.
    pub model: Qwen3Model,
    /// Output projection `H → V`; `None` when tied to `model.embed_tokens`.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    rope: RotaryEmbedding,
    #[module(skip)]
    config: Qwen3Config,
}

crate::distributed::stage_model!(Qwen3ForCausalLM);

impl Qwen3ForCausalLM {
    /// Loads every tensor by its HF name (docs/models.md §HF tensor names) from `source`; shapes
    /// are checked and errors name the tensor. `lm_head.weight` is read only when embeddings are
    /// untied.
    pub fn from_weights(
        config: &Qwen3Config,
        source: &dyn WeightSource,
        device: &Device,
    ) -> Result<Self, ModelError> {
        <Self as ShardModel>::from_loader(config, &WeightLoader::new(source, device))
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &Qwen3Config {
        &self.config
    }

    /// Logits `[B, S, V]` of `input_ids [B, S]` (positions `0..S`, no cache).
    pub fn forward(&self, input_ids: Tensor<2, Int>) -> Result<Tensor<3>, ModelError> {
        self.run(input_ids, None, None)
    }

    /// [`forward`](Self::forward) of a packed or padded batch (see [`crate::packing`]):
    /// attention stays within each document and skips padded keys, RoPE positions restart at
    /// every document. Errors if `layout` is not `[B, S]`.
    pub fn forward_packed(
        &self,
        input_ids: Tensor<2, Int>,
        layout: &SequenceLayout,
    ) -> Result<Tensor<3>, ModelError> {
        self.run(input_ids, None, Some(layout))
    }

    /// The single-rank forward ([`crate::families::local_run`]), after the positions in
    /// `cache` or of a packed/padded batch with `layout`.
    fn run(
        &self,
        input_ids: Tensor<2, Int>,
        cache: Option<&mut KvCache>,
        layout: Option<&SequenceLayout>,
    ) -> Result<Tensor<3>, ModelError> {
        Ok(
            crate::families::local_run(self, input_ids, layout, cache, None)?
                .0
                .logits,
        )
    }
}

crate::distributed::decoder_stack!(Qwen3ForCausalLM, Qwen3DecoderLayer);

impl ShardModel for Qwen3ForCausalLM {
    type Config = Qwen3Config;

    fn template(config: &Qwen3Config, device: &Device) -> Result<Self, ModelError> {
        config.init(device)
    }

    fn select_stage(self, stage: &crate::weights::StageHolding) -> Result<Self, ModelError> {
        Self::select_stage(self, stage)
    }

    fn model_config(&self) -> &Qwen3Config {
        &self.config
    }

    fn stack_shape(config: &Qwen3Config) -> Result<crate::distributed::StackShape, ModelError> {
        let rope = RotaryEmbedding::new(&config.rope_parameters, config.head_dim)?;
        Ok(crate::families::stack_shape(config, rope))
    }
}

crate::layer_parts!(
    Qwen3DecoderLayer,
    Attention,
    attention = self_attn,
    mlp = mlp
);

impl CausalLm for Qwen3ForCausalLM {
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
        self.run(input_ids, Some(cache), None)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Tolerance;

    use super::*;

    fn tiny() -> Qwen3Config {
        Qwen3Config {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            tie_word_embeddings: true,
            ..Qwen3Config::default()
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_greedy_matches_argmax() {
        use crate::causal_lm::{GenerationConfig, Sampling, generate};
        let device = Device::flex();
        let model = tiny().init(&device).unwrap();
        let sampled = |seed| {
            let cfg = GenerationConfig {
                max_new_tokens: 6,
                sampling: Sampling::Sample {
                    temperature: 2.0,
                    top_k: Some(10),
                    seed,
                },
                eos_token_ids: Vec::new(),
            };
            generate(&model, &[3, 1, 4], &cfg, &device).unwrap()
        };
        assert_eq!(sampled(11), sampled(11));
        assert_eq!(sampled(11).len(), 6);
        // The first greedy token is the argmax of the full forward's last position.
        let greedy = generate(&model, &[3, 1, 4], &GenerationConfig::greedy(1), &device).unwrap();
        let logits = model
            .forward(Tensor::<2, Int>::from_data([[3, 1, 4]], &device))
            .unwrap();
        let last = logits
            .narrow(1, 2, 1)
            .reshape([32])
            .argmax(0)
            .into_scalar::<i64>();
        assert_eq!(greedy, [last as usize]);
        // An end-of-sequence token stops generation (and is returned).
        let cfg = GenerationConfig {
            eos_token_ids: greedy.clone(),
            ..GenerationConfig::greedy(5)
        };
        assert_eq!(generate(&model, &[3, 1, 4], &cfg, &device).unwrap(), greedy);
        assert!(generate(&model, &[], &GenerationConfig::greedy(1), &device).is_err());
        assert!(generate(&model, &[99], &GenerationConfig::greedy(1), &device).is_err());
    }

    #[test]
    fn tied_head_and_cached_decoding_match_the_full_forward() {
        let device = Device::flex();
        let model = tiny().init(&device).unwrap();
        assert!(model.lm_head.is_none());
        let ids = Tensor::<2, Int>::from_data([[1, 5, 7, 2, 9]], &device);
        let full = model.forward(ids.clone()).unwrap();
        assert_eq!(full.dims(), [1, 5, 32]);
        let mut cache = model.new_cache();
        let a = model
            .forward_cached(ids.clone().narrow(1, 0, 3), &mut cache)
            .unwrap();
        let b = model
            .forward_cached(ids.narrow(1, 3, 2), &mut cache)
            .unwrap();
        Tensor::cat(vec![a, b], 1)
            .into_data()
            .assert_approx_eq::<f32>(&full.into_data(), Tolerance::rel_abs(1e-4, 1e-5));
    }
}

impl crate::config::FamilyConfig for Qwen3Config {
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
        None
    }

    fn tie_word_embeddings(&self) -> bool {
        self.tie_word_embeddings
    }

    fn sizes(&self) -> crate::config::ConfigSizes {
        crate::config::ConfigSizes {
            layers: ("num_hidden_layers", self.num_hidden_layers),
            experts: None,
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

/// Dense Qwen3 (`Qwen3ForCausalLM`).
#[derive(Debug, Clone, Copy)]
pub struct Qwen3;

impl crate::family::Family for Qwen3 {
    const MODEL_TYPE: &'static str = Qwen3Config::MODEL_TYPE;
    const ARCHITECTURE: &'static str = "Qwen3ForCausalLM";
    type Config = Qwen3Config;
    type Model = Qwen3ForCausalLM;
}
