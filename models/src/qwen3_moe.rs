//! Qwen3-MoE, read beside HF transformers 5.23 `models/qwen3_moe/modeling_qwen3_moe.py`
//! (models.md §4, §5).
//!
//! The decoder is Qwen3's (QK-norm GQA attention, pre-norm residuals); layer `i` uses the
//! sparse MoE block iff `i ∉ mlp_only_layers ∧ E > 0 ∧ (i+1) % decoder_sparse_step == 0`,
//! otherwise a dense SwiGLU MLP of `intermediate_size`. The MoE block is moe-backend's
//! [`MoeLayer`]: softmax router over all experts, top-k, renormalised when `norm_topk_prob`
//! (post-softmax routing, equal to HF's softmax → top-k → divide up to rounding), no shared
//! expert, no scaling factor.

use std::collections::BTreeMap;

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};
use moe_backend::fp8::Fp8Recipe;
use moe_backend::layer::{MoeLayer, MoeLayerConfig};
use moe_backend::router::{RouteOptions, RouterState, ScoreFunction, TopKRouterConfig};

use crate::ModelError;
use crate::causal_lm::{CausalLm, hf_load_balancing_loss, lm_logits};
use crate::config::Qwen3MoeConfig;
use crate::layers::kv_cache::{KvCache, LayerCache};
use crate::layers::rope::{RopeTables, RotaryEmbedding};
use crate::layers::{Attention, AttentionConfig, Mlp, MlpConfig, RmsNorm, RmsNormConfig};
use crate::packing::{PackedInputs, SequenceLayout};
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

    /// The moe-backend layer of a sparse block (models.md §5.2): softmax scores, pre-softmax
    /// (plain top-k of the probabilities) without `norm_topk_prob`, post-softmax (top-k then
    /// softmax over the k, i.e. renormalised) with it; f32 router.
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
                embed_tokens: EmbeddingConfig::new(self.vocab_size, h).init(device),
                layers,
                norm: norm(),
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

impl Qwen3MoeSparseMoeBlock {
    /// `x [B, S, H] → ([B, S, H], router logits [B·S, E])`.
    pub fn forward(&self, x: Tensor<3>) -> Result<(Tensor<3>, Tensor<2>), ModelError> {
        let (y, routing) = self.forward_with_state(x, &self.moe.router.init_state())?;
        Ok((y, routing.router_logits))
    }

    /// [`forward`](Self::forward) reading the router `state` (e.g. router replay, moe-ops
    /// §10); also returns the selected experts `[B·S, k]`.
    pub fn forward_with_state(
        &self,
        x: Tensor<3>,
        state: &RouterState,
    ) -> Result<(Tensor<3>, Qwen3MoeRouting), ModelError> {
        self.forward_with_options(x, state, &RouteOptions::default())
    }

    /// [`forward_with_state`](Self::forward_with_state) with the router's per-call `options`
    /// (e.g. the `[B·S]` padding mask of a padded or packed batch).
    pub fn forward_with_options(
        &self,
        x: Tensor<3>,
        state: &RouterState,
        options: &RouteOptions<'_>,
    ) -> Result<(Tensor<3>, Qwen3MoeRouting), ModelError> {
        let [b, s, h] = x.dims();
        let out = self.moe.forward(x.reshape([b * s, h]), state, options)?;
        Ok((
            out.output.reshape([b, s, h]),
            Qwen3MoeRouting {
                router_logits: out.routing.logits,
                topk_indices: out.routing.topk_indices,
            },
        ))
    }
}

/// Routing decisions of one sparse layer.
#[derive(Debug, Clone)]
pub struct Qwen3MoeRouting {
    /// `[B·S, E]` router logits (rows `b·S + s`).
    pub router_logits: Tensor<2>,
    /// `[B·S, k]` selected experts (descending score, or as replayed).
    pub topk_indices: Tensor<2, Int>,
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
    /// `x [B, S, H] → ([B, S, H], router logits of a sparse layer)`.
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        cache: Option<&mut LayerCache>,
    ) -> Result<(Tensor<3>, Option<Tensor<2>>), ModelError> {
        let (y, routing) = self.forward_with_state(x, rope, cache, None)?;
        Ok((y, routing.map(|r| r.router_logits)))
    }

    /// [`forward`](Self::forward) with an optional router `state` for a sparse layer (a fresh
    /// one when `None`), returning the full routing.
    pub fn forward_with_state(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        cache: Option<&mut LayerCache>,
        state: Option<&RouterState>,
    ) -> Result<(Tensor<3>, Option<Qwen3MoeRouting>), ModelError> {
        self.forward_inner(x, rope, None, cache, state)
    }

    /// [`forward_with_state`](Self::forward_with_state) of a packed or padded batch (no
    /// cache): attention under `packed.mask`, the router told which rows are padding.
    pub fn forward_packed(
        &self,
        x: Tensor<3>,
        packed: &PackedInputs,
        state: Option<&RouterState>,
    ) -> Result<(Tensor<3>, Option<Qwen3MoeRouting>), ModelError> {
        self.forward_inner(x, &packed.rope, Some(packed), None, state)
    }

    fn forward_inner(
        &self,
        x: Tensor<3>,
        rope: &RopeTables,
        packed: Option<&PackedInputs>,
        cache: Option<&mut LayerCache>,
        state: Option<&RouterState>,
    ) -> Result<(Tensor<3>, Option<Qwen3MoeRouting>), ModelError> {
        let normed = self.input_layernorm.forward(x.clone());
        let h = x + match packed {
            Some(p) => self.self_attn.forward_masked(normed, rope, Some(&p.mask)),
            None => self.self_attn.forward(normed, rope, cache),
        };
        let normed = self.post_attention_layernorm.forward(h.clone());
        let (y, routing) = match &self.mlp {
            Qwen3MoeFeedForward::Dense(mlp) => (mlp.forward(normed), None),
            Qwen3MoeFeedForward::Sparse(block) => {
                let fresh = block.moe.router.init_state();
                let options = packed.map_or_else(RouteOptions::default, |p| p.route_options());
                let (y, routing) =
                    block.forward_with_options(normed, state.unwrap_or(&fresh), &options)?;
                (y, Some(routing))
            }
        };
        Ok((h + y, routing))
    }
}

/// The decoder stack (HF `Qwen3MoeModel`).
#[derive(Module, Debug)]
pub struct Qwen3MoeModel {
    /// Token embedding `[V, H]`.
    pub embed_tokens: Embedding,
    /// Decoder layers.
    pub layers: Vec<Qwen3MoeDecoderLayer>,
    /// Final norm `[H]`.
    pub norm: RmsNorm,
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

/// Losses of a labelled forward (models.md §5.3).
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

impl Qwen3MoeForCausalLM {
    /// Loads every tensor by its HF name (models.md §6). Experts may be stored per expert or
    /// stacked (`mlp.experts.gate_up_proj` / `down_proj`), not mixed; shapes are checked and
    /// errors name the tensor. Modules are built from the loaded tensors (nothing is
    /// initialised and overwritten).
    pub fn from_weights(
        config: &Qwen3MoeConfig,
        source: &dyn WeightSource,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::from_loader(config, &WeightLoader::new(source, device))
    }

    /// Builds the model from `w`: the whole model from an unsharded loader, one rank's shard
    /// at local shapes from a sharded one ([`WeightLoader::sharded`]: TP slices of attention,
    /// dense MLPs, embedding and head, this rank's experts and their ETP block), zeros at local
    /// shapes from a skeleton.
    pub fn from_loader(config: &Qwen3MoeConfig, w: &WeightLoader<'_>) -> Result<Self, ModelError> {
        config.validate()?;
        let (h, eps) = (config.hidden_size, config.rms_norm_eps);
        let moe_config = (config.num_moe_layers() > 0)
            .then(|| config.moe_layer_config())
            .transpose()?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                let mlp = match (&moe_config, config.is_moe_layer(i)) {
                    (Some(moe), true) => Qwen3MoeFeedForward::Sparse(Qwen3MoeSparseMoeBlock {
                        moe: w.moe(moe, &format!("{p}.mlp"))?,
                    }),
                    _ => Qwen3MoeFeedForward::Dense(w.mlp(
                        &format!("{p}.mlp"),
                        h,
                        config.intermediate_size,
                    )?),
                };
                Ok(Qwen3MoeDecoderLayer {
                    input_layernorm: w.rms_norm(&format!("{p}.input_layernorm"), h, eps)?,
                    self_attn: config
                        .attention_config()
                        .load(w, &format!("{p}.self_attn"))?,
                    post_attention_layernorm: w.rms_norm(
                        &format!("{p}.post_attention_layernorm"),
                        h,
                        eps,
                    )?,
                    mlp,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Self {
            model: Qwen3MoeModel {
                embed_tokens: w.embedding("model.embed_tokens.weight", config.vocab_size, h)?,
                layers,
                norm: w.rms_norm("model.norm", h, eps)?,
            },
            lm_head: if config.tie_word_embeddings {
                None
            } else {
                Some(w.linear("lm_head", h, config.vocab_size, false)?)
            },
            rope: RotaryEmbedding::new(&config.rope_parameters, config.head_dim)?,
            config: config.clone(),
        })
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &Qwen3MoeConfig {
        &self.config
    }

    /// The same model with the routed experts' fc1/fc2 GEMMs of every sparse layer in FP8
    /// (`Some(recipe)`, blockwise recipe of fp8.md §3) or back in high precision (`None`).
    /// Attention, dense MLPs, the router, embeddings, the LM head and norms stay in high
    /// precision (fp8.md §7). A training-time choice, so it is not part of the HF config.
    pub fn with_fp8_experts(mut self, recipe: Option<Fp8Recipe>) -> Result<Self, ModelError> {
        for layer in std::mem::take(&mut self.model.layers) {
            let mlp = match layer.mlp {
                Qwen3MoeFeedForward::Sparse(block) => {
                    Qwen3MoeFeedForward::Sparse(Qwen3MoeSparseMoeBlock {
                        moe: block.moe.with_fp8_experts(recipe)?,
                    })
                }
                dense => dense,
            };
            self.model
                .layers
                .push(Qwen3MoeDecoderLayer { mlp, ..layer });
        }
        Ok(self)
    }

    /// The same model with the dense linears — every layer's attention projections
    /// (`q/k/v/o_proj`) and the dense MLPs of `mlp_only_layers` — in FP8 (`Some(recipe)`,
    /// fp8.md §3) or back in high precision (`None`). The routed experts keep their own
    /// setting ([`Self::with_fp8_experts`]); the router, embeddings, LM head, norms and the
    /// attention core stay in high precision (fp8.md §7).
    pub fn with_fp8_linears(mut self, recipe: Option<Fp8Recipe>) -> Result<Self, ModelError> {
        if let Some(r) = &recipe {
            r.validate()?;
        }
        for layer in &mut self.model.layers {
            layer.self_attn.fp8 = recipe;
            if let Qwen3MoeFeedForward::Dense(mlp) = &mut layer.mlp {
                mlp.fp8 = recipe;
            }
        }
        Ok(self)
    }

    /// Logits and router logits of `input_ids [B, S]` (positions `0..S`, no cache).
    pub fn forward(&self, input_ids: Tensor<2, Int>) -> Result<Qwen3MoeOutput, ModelError> {
        self.run(input_ids, None, None)
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
        let [b, s] = input_ids.dims();
        layout.check_shape("input_ids", b, s)?;
        let packed = PackedInputs::new(layout, &self.rope, &input_ids.device());
        self.run_inner(input_ids, None, None, Some(&packed))
    }

    /// HF's labelled forward with `output_router_logits=True`: cross-entropy of `labels`
    /// (`[B, S]` host values, −100 ignored) plus `router_aux_loss_coef` × the load-balancing
    /// loss, with `attention_mask` (`[B, S]` host values, 1 = token) applied to the aux loss
    /// only (models.md §5.3).
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

    /// The forward pass; `states` are per-MoE-layer router states by decoder-layer index
    /// (router replay, [`crate::replay`]).
    pub(crate) fn run(
        &self,
        input_ids: Tensor<2, Int>,
        cache: Option<&mut KvCache>,
        states: Option<&BTreeMap<usize, RouterState>>,
    ) -> Result<Qwen3MoeOutput, ModelError> {
        self.run_inner(input_ids, cache, states, None)
    }

    /// The forward; with `packed` (and no cache) that of a packed or padded batch.
    fn run_inner(
        &self,
        input_ids: Tensor<2, Int>,
        mut cache: Option<&mut KvCache>,
        states: Option<&BTreeMap<usize, RouterState>>,
        packed: Option<&PackedInputs>,
    ) -> Result<Qwen3MoeOutput, ModelError> {
        let [_, s] = input_ids.dims();
        let offset = cache.as_ref().map_or(0, |c| c.seq_len());
        let plain;
        let rope = match packed {
            Some(p) => &p.rope,
            None => {
                plain = self.rope.tables(offset, s, &input_ids.device());
                &plain
            }
        };
        let mut x = self.model.embed_tokens.forward(input_ids);
        let (mut router_logits, mut topk_indices) = (Vec::new(), Vec::new());
        for (i, layer) in self.model.layers.iter().enumerate() {
            let layer_cache = cache.as_deref_mut().and_then(|c| c.layers.get_mut(i));
            let state = states.and_then(|m| m.get(&i));
            let (y, routing) = layer.forward_inner(x, rope, packed, layer_cache, state)?;
            x = y;
            if let Some(r) = routing {
                router_logits.push(r.router_logits);
                topk_indices.push(r.topk_indices);
            }
        }
        let logits = lm_logits(
            self.model.norm.forward(x),
            self.lm_head.as_ref(),
            &self.model.embed_tokens,
        );
        Ok(Qwen3MoeOutput {
            logits,
            router_logits,
            topk_indices,
        })
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
        Ok(self.run(input_ids, Some(cache), None)?.logits)
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
            model.model.embed_tokens.weight.grad(&grads).is_some(),
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
