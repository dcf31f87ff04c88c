//! A decoder-only causal LM written once against a [`ParallelContext`]: the built-in models
//! implement [`DecoderStack`] (their embedding, layers, final norm and head) and every forward
//! (the single-rank HF forward, the sharded training forward, cached generation, MTP) runs the
//! same layers through the context. At `world = 1` the context's collectives are the identity
//! and its dispatcher is local ([`ParallelContext::local`]): the single-rank model *is* the
//! parallel model at world 1.

use burn::nn::{Embedding, Linear};
use burn::tensor::{Device, Int, Tensor};
use moe_backend::comm::GroupComms;

use super::context_parallel::CpExchange;
use super::pipeline::ChunkParts;
use super::replay::{ForwardRouting, train_replay};
use super::runtime::{RouterTrace, SpRuntime};
use super::sharded::{ChunkForward, TrainForward};
use super::{DispatcherKind, ForwardTraced, err};
use crate::ModelError;
use crate::layers::mla::Mla;
use crate::layers::rope::{RopeTables, RotaryEmbedding};
use crate::layers::{Attention, AttentionMask, KvCache, LayerCache, RmsNorm};
use crate::packing::{PackedInputs, SequenceLayout};
use crate::recompute::RecomputeModule;

/// What a decoder layer's attention reads besides its input: the RoPE tables of the
/// positions, and either the attention mask of a (packed) batch or this layer's KV cache.
#[derive(Debug)]
pub enum AttentionInputs<'a> {
    /// A whole sequence: causal, or under a packed/padded batch's mask.
    Masked {
        /// RoPE tables of the positions.
        rope: &'a RopeTables,
        /// The mask of a packed or padded batch, or of this rank's positions against the
        /// gathered keys under context parallelism (`None`: plain causal).
        mask: Option<&'a AttentionMask>,
        /// The context-parallel group whose keys and values (or MLA latents) this rank's
        /// queries also see, exchanged along the sequence (`None`: no context
        /// parallelism).
        exchange: Option<CpExchange<'a>>,
        /// Recompute the attention core in the backward pass instead of keeping its scores
        /// (Megatron's `core_attn` selective recompute).
        recompute_core: bool,
    },
    /// Decoding after the positions held in `cache` (which the call extends).
    Cached {
        /// RoPE tables of the new positions.
        rope: &'a RopeTables,
        /// This layer's cache of this rank's heads (or MLA latents).
        cache: &'a mut LayerCache,
    },
}

/// A self-attention module this rank runs on the gathered sequence `[B, S, H]`.
pub trait SelfAttention {
    /// This rank's heads' (partial, for TP) output `[B, S, H]` of `x`, without
    /// [`output_bias`](Self::output_bias).
    fn attend(&self, x: Tensor<3>, inputs: AttentionInputs<'_>) -> Result<Tensor<3>, ModelError>;

    /// The output projection's bias `[H]`, added once after the tensor-parallel reduction
    /// (Megatron's row-parallel bias; `None`: none, or already in [`attend`](Self::attend)).
    fn output_bias(&self) -> Option<Tensor<1>> {
        None
    }
}

/// GQA attention: its `o_proj` bias is added after the reduce-scatter.
impl SelfAttention for Attention {
    fn attend(&self, x: Tensor<3>, inputs: AttentionInputs<'_>) -> Result<Tensor<3>, ModelError> {
        Ok(match inputs {
            AttentionInputs::Masked {
                rope,
                mask,
                exchange: Some(cp),
                recompute_core,
            } => self.forward_partial(x, rope, mask, None, |t| cp.gather(t), recompute_core)?,
            AttentionInputs::Masked {
                rope,
                mask,
                exchange: None,
                recompute_core,
            } => {
                let Ok(out) = self.forward_partial(
                    x,
                    rope,
                    mask,
                    None,
                    Ok::<_, std::convert::Infallible>,
                    recompute_core,
                );
                out
            }
            AttentionInputs::Cached { rope, cache } => {
                let Ok(out) = self.forward_partial(
                    x,
                    rope,
                    None,
                    Some(cache),
                    Ok::<_, std::convert::Infallible>,
                    false,
                );
                out
            }
        })
    }

    fn output_bias(&self) -> Option<Tensor<1>> {
        Attention::output_bias(self)
    }
}

/// [`SelfAttention`] of an attention block with a cached `forward`, a `forward_masked` and a
/// `forward_exchanged` (keys exchanged over the context-parallel group).
macro_rules! self_attention {
    ($ty:ty) => {
        impl SelfAttention for $ty {
            fn attend(
                &self,
                x: Tensor<3>,
                inputs: AttentionInputs<'_>,
            ) -> Result<Tensor<3>, ModelError> {
                Ok(match inputs {
                    AttentionInputs::Masked {
                        rope,
                        mask,
                        exchange: Some(cp),
                        recompute_core,
                    } => self.forward_exchanged(x, rope, mask, |t| cp.gather(t), recompute_core)?,
                    AttentionInputs::Masked {
                        rope,
                        mask,
                        exchange: None,
                        recompute_core,
                    } => {
                        let Ok(out) = self.forward_exchanged(
                            x,
                            rope,
                            mask,
                            Ok::<_, std::convert::Infallible>,
                            recompute_core,
                        );
                        out
                    }
                    AttentionInputs::Cached { rope, cache } => self.forward(x, rope, Some(cache)),
                })
            }
        }
    };
}

self_attention!(Mla);

/// A decoder-only causal LM as the context runs it: token embedding, decoder layers on the
/// sequence-parallel block, final norm and head (tied to the embedding without `lm_head`).
/// The same value is the whole model at `world = 1` and one rank's shard under any layout.
pub trait DecoderStack {
    /// Token embedding (this rank's vocabulary rows); an error on a pipeline stage that does
    /// not hold it.
    fn embed_tokens(&self) -> Result<&Embedding, ModelError>;
    /// Final norm; an error on a pipeline stage that does not hold it.
    fn final_norm(&self) -> Result<&RmsNorm, ModelError>;
    /// Output projection (this rank's vocabulary columns); `None` when tied.
    fn lm_head(&self) -> Option<&Linear>;
    /// The decoder layers' type (of the main model and the MTP modules alike).
    type Layer: super::LayerParts;
    /// The main model's decoder layers this rank holds.
    fn layers(&self) -> &crate::layers::LayerStack<Self::Layer>;
    /// The main model's decoder layers, mutably.
    fn layers_mut(&mut self) -> &mut crate::layers::LayerStack<Self::Layer>;
    /// Number of decoder layers (of the main model).
    fn num_layers(&self) -> usize;
    /// Decoder layer `i` on this rank's sequence-parallel block `x [B·S/tp, H]` of `batch`
    /// sequences; MoE blocks report to `trace`.
    fn layer_forward(
        &self,
        i: usize,
        ctx: &SpRuntime,
        x: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
        inputs: AttentionInputs<'_>,
    ) -> Result<Tensor<2>, ModelError>;

    /// [`layer_forward`](Self::layer_forward) of a training batch (`rope`, `mask`) with the
    /// layer recomputed in the backward pass (full recompute,
    /// [`SpRuntime::recompute_layer`]). Stacks that cannot refuse.
    #[allow(clippy::too_many_arguments)]
    fn layer_forward_recomputed(
        &self,
        i: usize,
        ctx: &SpRuntime,
        x: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
    ) -> Result<Tensor<2>, ModelError> {
        let _ = (i, ctx, x, batch, trace, rope, mask);
        Err(ModelError::unsupported(
            "recompute",
            "`full`: this decoder stack does not recompute its layers",
        ))
    }

    /// Number of multi-token-prediction modules this rank holds (the last pipeline stage's;
    /// the default: none).
    fn mtp_depths(&self) -> usize {
        0
    }

    /// MTP module `j` on this rank's sequence-parallel rows: the embedded (rolled) tokens
    /// `embeds` and the previous depth's output `hidden` (the main model's final-normed
    /// output for `j = 0`) → this depth's normed output (DeepSeek-V3's
    /// `eh_proj([enorm(e) ; hnorm(h)])`, one decoder layer, `shared_head.norm`).
    #[allow(clippy::too_many_arguments)]
    fn mtp_forward(
        &self,
        j: usize,
        ctx: &SpRuntime,
        embeds: Tensor<2>,
        hidden: Tensor<2>,
        batch: usize,
        trace: &mut RouterTrace,
        inputs: AttentionInputs<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        let _ = (ctx, embeds, hidden, batch, trace, inputs);
        Err(ModelError::unsupported(
            "mtp",
            format!("this decoder stack has no MTP module {j}"),
        ))
    }
}

/// `part` of a model, or an error saying this pipeline stage does not hold `what`.
pub fn held<'a, T>(part: Option<&'a T>, what: &str) -> Result<&'a T, ModelError> {
    part.ok_or_else(|| {
        ModelError::layout(
            "pp",
            format!("this pipeline stage does not hold {what} (another stage does)"),
        )
    })
}

/// [`DecoderStack`] of a built-in causal LM: `model.embed_tokens`, `model.layers` (of the given
/// layer type, each with `forward_in(ctx, x, batch, trace, inputs)`), `model.norm` and an
/// optional `lm_head`.
macro_rules! decoder_stack {
    ($ty:ty, $layer:ty) => {
        $crate::distributed::decoder_stack!($ty, $layer, {});
    };
    ($ty:ty, $layer:ty, mtp = $mtp:ident) => {
        $crate::distributed::decoder_stack!($ty, $layer, {
            fn mtp_depths(&self) -> usize {
                self.$mtp.len()
            }

            fn mtp_forward(
                &self,
                j: usize,
                ctx: &$crate::distributed::ParallelContext,
                embeds: burn::tensor::Tensor<2>,
                hidden: burn::tensor::Tensor<2>,
                batch: usize,
                trace: &mut $crate::distributed::RouterTrace,
                inputs: $crate::distributed::AttentionInputs<'_>,
            ) -> Result<burn::tensor::Tensor<2>, $crate::ModelError> {
                let module = self.$mtp.get(j).ok_or_else(|| {
                    $crate::ModelError::layout(
                        "pp",
                        format!("this pipeline stage does not hold MTP module {j}"),
                    )
                })?;
                module.forward_in(ctx, embeds, hidden, batch, trace, inputs)
            }
        });
    };
    ($ty:ty, $layer:ty, { $($extra:item)* }) => {
        impl $crate::distributed::DecoderStack for $ty {
            type Layer = $layer;

            $($extra)*

            fn layers(&self) -> &$crate::layers::LayerStack<$layer> {
                &self.model.layers
            }

            fn layers_mut(&mut self) -> &mut $crate::layers::LayerStack<$layer> {
                &mut self.model.layers
            }

            fn embed_tokens(&self) -> Result<&burn::nn::Embedding, $crate::ModelError> {
                $crate::distributed::held(self.model.embed_tokens.as_ref(), "the token embedding")
            }

            fn final_norm(&self) -> Result<&$crate::layers::RmsNorm, $crate::ModelError> {
                $crate::distributed::held(self.model.norm.as_ref(), "the final norm")
            }

            fn lm_head(&self) -> Option<&burn::nn::Linear> {
                self.lm_head.as_ref()
            }

            fn num_layers(&self) -> usize {
                self.model.layers.len()
            }

            fn layer_forward(
                &self,
                i: usize,
                ctx: &$crate::distributed::ParallelContext,
                x: burn::tensor::Tensor<2>,
                batch: usize,
                trace: &mut $crate::distributed::RouterTrace,
                inputs: $crate::distributed::AttentionInputs<'_>,
            ) -> Result<burn::tensor::Tensor<2>, $crate::ModelError> {
                self.model.layers[i].forward_in(ctx, x, batch, trace, inputs)
            }

            fn layer_forward_recomputed(
                &self,
                i: usize,
                ctx: &$crate::distributed::ParallelContext,
                x: burn::tensor::Tensor<2>,
                batch: usize,
                trace: &mut $crate::distributed::RouterTrace,
                rope: &$crate::layers::rope::RopeTables,
                mask: Option<&$crate::layers::AttentionMask>,
            ) -> Result<burn::tensor::Tensor<2>, $crate::ModelError> {
                ctx.recompute_layer(
                    &self.model.layers[i],
                    x,
                    batch,
                    trace,
                    rope,
                    mask,
                    |layer, ctx, x, batch, trace, inputs| {
                        layer.forward_in(ctx, x, batch, trace, inputs)
                    },
                )
            }
        }
    };
}
pub(crate) use decoder_stack;

/// [`DecoderStack`] and pipeline-stage selection (`select_stage`) of a user's model whose
/// parts are flat fields: `embed_tokens: Option<Embedding>`, `layers:`
/// [`LayerStack<L>`](crate::layers::LayerStack) where each layer has
/// `forward_in(ctx, x, batch, trace, inputs) -> Result<Tensor<2>, ModelError>`,
/// `norm: Option<RmsNorm>` and `lm_head: Option<Linear>` (the built-in families nest the same
/// parts under `model` as HF does). `examples/custom_moe.rs` uses it.
#[macro_export]
macro_rules! flat_decoder_stack {
    ($ty:ty, $layer:ty) => {
        impl $crate::distributed::DecoderStack for $ty {
            type Layer = $layer;

            fn layers(&self) -> &$crate::layers::LayerStack<$layer> {
                &self.layers
            }

            fn layers_mut(&mut self) -> &mut $crate::layers::LayerStack<$layer> {
                &mut self.layers
            }

            fn embed_tokens(&self) -> Result<&burn::nn::Embedding, $crate::ModelError> {
                $crate::distributed::held(self.embed_tokens.as_ref(), "the token embedding")
            }

            fn final_norm(&self) -> Result<&$crate::layers::RmsNorm, $crate::ModelError> {
                $crate::distributed::held(self.norm.as_ref(), "the final norm")
            }

            fn lm_head(&self) -> Option<&burn::nn::Linear> {
                self.lm_head.as_ref()
            }

            fn num_layers(&self) -> usize {
                self.layers.len()
            }

            fn layer_forward(
                &self,
                i: usize,
                ctx: &$crate::distributed::ParallelContext,
                x: burn::tensor::Tensor<2>,
                batch: usize,
                trace: &mut $crate::distributed::RouterTrace,
                inputs: $crate::distributed::AttentionInputs<'_>,
            ) -> Result<burn::tensor::Tensor<2>, $crate::ModelError> {
                self.layers[i].forward_in(ctx, x, batch, trace, inputs)
            }
        }

        impl $ty {
            /// The parts a pipeline stage holds (`stage`): its layers (named by their global
            /// index), the embedding and the final norm and head only where held.
            pub fn select_stage(
                mut self,
                stage: &$crate::weights::StageHolding,
            ) -> Result<Self, $crate::ModelError> {
                self.layers = self.layers.select(&stage.layers)?;
                self.embed_tokens = self.embed_tokens.filter(|_| stage.embedding);
                if !stage.head {
                    self.norm = None;
                    self.lm_head = None;
                }
                Ok(self)
            }
        }
    };
}

/// What a logits forward returns: this rank's final-normed sequence-parallel block
/// `[B·S/tp, H]` and the logits `[B, S, V]` over the full vocabulary.
#[derive(Debug, Clone)]
pub struct StackLogits {
    /// Final-normed hidden states of this rank's sequence-parallel rows.
    pub hidden: Tensor<2>,
    /// Full-vocabulary logits `[B, S, V]` (identical on the replica's TP ranks).
    pub logits: Tensor<3>,
}

impl SpRuntime {
    /// The context of a single rank (`world = 1`): every collective is the identity, the
    /// MoE blocks dispatch locally. What a model's single-rank forward runs on.
    pub fn local(
        num_experts: Option<usize>,
        vocab_size: usize,
        rope: RotaryEmbedding,
    ) -> Result<Self, ModelError> {
        let groups = GroupComms::single().map_err(err)?;
        Self::new(
            &groups,
            DispatcherKind::default(),
            num_experts,
            vocab_size,
            rope,
        )
    }

    /// `x + attention(norm(x))` of a decoder layer on the sequence-parallel block `x`: the
    /// normed block is gathered to `[batch, S, H]`, `attention` runs this rank's heads with
    /// `inputs`, and its partial output is reduce-scattered back.
    pub fn attention_block(
        &self,
        x: Tensor<2>,
        norm: &RmsNorm,
        attention: &impl SelfAttention,
        batch: usize,
        inputs: AttentionInputs<'_>,
    ) -> Result<Tensor<2>, ModelError> {
        let bias = attention.output_bias();
        let out =
            self.try_attention_residual(x, norm, batch, |full| attention.attend(full, inputs))?;
        Ok(match bias {
            Some(b) => out + b.unsqueeze_dim(0),
            None => out,
        })
    }

    /// This rank's sequence-parallel block `[B·S/tp, H]` of the embedded device ids
    /// `[B, S]`: on the device under `tp = 1`, through the host ids' vocab-parallel lookup
    /// otherwise.
    pub fn embed_ids(
        &self,
        embed: &Embedding,
        input_ids: Tensor<2, Int>,
    ) -> Result<Tensor<2>, ModelError> {
        let [b, s] = input_ids.dims();
        if self.tp.size() == 1 {
            let h = embed.weight.dims()[1];
            return Ok(embed.forward(input_ids).reshape([b * s, h]));
        }
        let ids = input_ids
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .map_err(|e| ModelError::input("input_ids", format!("unreadable ids: {e:?}")))?;
        self.embed(embed, &ids, b)
    }

    /// The decoder layers of `model` on the sequence-parallel block `x`: every layer with
    /// `rope` and `mask`, or with its part of `cache` when decoding.
    #[allow(clippy::too_many_arguments)]
    pub fn decode<M: DecoderStack + ?Sized>(
        &self,
        model: &M,
        x: Tensor<2>,
        batch: usize,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
        cache: Option<&mut KvCache>,
        trace: &mut RouterTrace,
    ) -> Result<Tensor<2>, ModelError> {
        let layers = 0..model.num_layers();
        self.decode_layers(model, layers, x, batch, rope, mask, cache, trace)
    }

    /// [`decode`](Self::decode) through the local layers `layers` only (a pipeline chunk).
    #[allow(clippy::too_many_arguments)]
    pub fn decode_layers<M: DecoderStack + ?Sized>(
        &self,
        model: &M,
        layers: std::ops::Range<usize>,
        mut x: Tensor<2>,
        batch: usize,
        rope: &RopeTables,
        mask: Option<&AttentionMask>,
        mut cache: Option<&mut KvCache>,
        trace: &mut RouterTrace,
    ) -> Result<Tensor<2>, ModelError> {
        if layers.end > model.num_layers() {
            return Err(ModelError::layout(
                "pipeline_layout",
                format!(
                    "layers {layers:?} of a stage holding {}",
                    model.num_layers()
                ),
            ));
        }
        for i in layers {
            let inputs = match cache.as_deref_mut() {
                Some(c) => {
                    let have = c.layers.len();
                    let cache = c.layers.get_mut(i).ok_or_else(|| {
                        ModelError::input(
                            "cache",
                            format!("a KV cache of {have} layers for a model of more"),
                        )
                    })?;
                    AttentionInputs::Cached { rope, cache }
                }
                None if self.recomputes_layers() => {
                    x = model.layer_forward_recomputed(i, self, x, batch, trace, rope, mask)?;
                    continue;
                }
                None => AttentionInputs::Masked {
                    rope,
                    mask,
                    exchange: self.cp_exchange(),
                    recompute_core: self.recomputes(RecomputeModule::CoreAttn),
                },
            };
            x = model.layer_forward(i, self, x, batch, trace, inputs)?;
        }
        Ok(x)
    }

    /// Full-vocabulary logits of `input_ids [B, S]` (device ids) under `model`: positions
    /// after those in `cache` when decoding, restarting at every document of `layout` for a
    /// packed or padded batch (no cache then), plain `0..S` otherwise. The routers report to
    /// `trace` (replay, record); a layout's padding rows are set on it. `B·S` must split over
    /// `tp`.
    pub fn logits<M: DecoderStack + ?Sized>(
        &self,
        model: &M,
        input_ids: Tensor<2, Int>,
        layout: Option<&SequenceLayout>,
        cache: Option<&mut KvCache>,
        trace: &mut RouterTrace,
    ) -> Result<StackLogits, ModelError> {
        self.require_whole_sequence("a logits forward (generation)")?;
        self.require_whole_model("a logits forward (generation)")?;
        let [batch, s] = input_ids.dims();
        let (_, tp) = self.tp_rank_size();
        if !(batch * s).is_multiple_of(tp) {
            return Err(ModelError::layout(
                "tp",
                format!("{batch} sequences × {s} positions do not split over tp = {tp}"),
            ));
        }
        let device = input_ids.device();
        let (rope, mask) = match (layout, &cache) {
            (Some(_), Some(_)) => {
                return Err(ModelError::input(
                    "layout",
                    "a packed or padded batch cannot be decoded with a KV cache",
                ));
            }
            (Some(l), None) => {
                l.check_shape("input_ids", batch, s)?;
                let packed = self.packed_inputs(l, batch * s, &device);
                trace.padding = Some(packed.padding);
                (packed.rope, Some(packed.mask))
            }
            (None, _) => {
                let offset = cache.as_ref().map_or(0, |c| c.seq_len());
                (self.rope_at(offset, s, &device), None)
            }
        };
        let x = self.embed_ids(model.embed_tokens()?, input_ids)?;
        let x = self.decode(model, x, batch, &rope, mask.as_ref(), cache, trace)?;
        let hidden = model.final_norm()?.forward(x);
        let logits =
            self.head_logits(hidden.clone(), model.lm_head(), model.embed_tokens().ok())?;
        let v = logits.dims()[1];
        Ok(StackLogits {
            hidden,
            logits: logits.reshape([batch, s, v]),
        })
    }

    /// The attention inputs of a prepared training batch: its RoPE tables and mask, and the
    /// context-parallel group to exchange keys over.
    pub fn masked_inputs<'a>(&'a self, p: &'a super::Prepared<'_>) -> AttentionInputs<'a> {
        AttentionInputs::Masked {
            rope: &p.rope,
            mask: p.mask.as_ref(),
            exchange: self.cp_exchange(),
            recompute_core: self.recomputes(RecomputeModule::CoreAttn),
        }
    }

    /// The device inputs of a packed or padded batch of `rows` token rows: RoPE tables and
    /// mask of the whole batch, router padding of this rank's sequence-parallel rows.
    pub(crate) fn packed_inputs(
        &self,
        layout: &SequenceLayout,
        rows: usize,
        device: &Device,
    ) -> PackedInputs {
        let (rank, tp) = self.tp_rank_size();
        let local = rows / tp;
        PackedInputs::for_rows(layout, &self.rope, rank * local..(rank + 1) * local, device)
    }

    /// Forward and causal-LM loss of this replica's batch (host `input_ids`/`labels
    /// [batch, S]`, packed or padded with `layout`) under `model`, the routers driven by
    /// `trace`: the output, the recorded routing and the expert-bias counts.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn loss_forward<M: DecoderStack + ?Sized>(
        &self,
        model: &M,
        input_ids: &[i64],
        labels: &[i64],
        batch: usize,
        layout: Option<&SequenceLayout>,
        device: &Device,
        mut trace: RouterTrace,
    ) -> Result<ForwardTraced, ModelError> {
        self.require_whole_model("a whole-model loss forward")?;
        let p = self.prepare(input_ids, labels, batch, layout, device)?;
        trace.padding = p.padding.clone();
        let x = self.embed(model.embed_tokens()?, &p.ids, batch)?;
        let x = self.decode(model, x, batch, &p.rope, p.mask.as_ref(), None, &mut trace)?;
        let selected = std::mem::take(&mut trace.selected);
        let load = std::mem::take(&mut trace.expert_load);
        let out = self.head_loss(
            x,
            model.final_norm()?,
            model.lm_head(),
            model.embed_tokens().ok(),
            &p.targets,
            trace,
        )?;
        Ok((out, selected, load))
    }

    /// The input of a pipeline chunk: this rank's sequence-parallel block of the embedded
    /// micro-batch on the first virtual stage, the previous stage's activation otherwise.
    pub(crate) fn chunk_input<M: DecoderStack + ?Sized>(
        &self,
        model: &M,
        chunk: &ChunkParts,
        p: &super::Prepared<'_>,
        batch: usize,
        input: Option<Tensor<2>>,
    ) -> Result<Tensor<2>, ModelError> {
        match (chunk.embedding, input) {
            (true, None) => self.embed(model.embed_tokens()?, &p.ids, batch),
            (false, Some(x)) => Ok(x),
            (true, Some(_)) => Err(ModelError::layout(
                "pipeline_layout",
                format!(
                    "virtual stage {} embeds its tokens but was given an activation",
                    chunk.virtual_stage
                ),
            )),
            (false, None) => Err(ModelError::layout(
                "pipeline_layout",
                format!(
                    "virtual stage {} needs the previous stage's activation",
                    chunk.virtual_stage
                ),
            )),
        }
    }

    /// A pipeline chunk's forward through its layers on one micro-batch: its input
    /// ([`chunk_input`](Self::chunk_input)) and its layers, the routers reporting from MoE
    /// layer `moe_offset` of this rank on, set from the micro-batch's routing when it carries
    /// one and recording as `routing` says ([`super::replay::train_replay`]: the chunk's
    /// layers and, on the last virtual stage, `routing.mtp` MTP depths). What every model's
    /// chunk forward starts with.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn chunk_layers<'b, M: DecoderStack + ?Sized>(
        &self,
        model: &M,
        chunk: &ChunkParts,
        moe_offset: usize,
        batch: &'b crate::batch::TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        input: Option<Tensor<2>>,
        routing: &ForwardRouting<'_>,
    ) -> Result<ChunkRun<'b>, ModelError> {
        let rows = batch.batch;
        let p = self.prepare(
            &batch.input_ids,
            &batch.labels,
            rows,
            batch.layout(),
            device,
        )?;
        let mut trace = p.trace(aux_grad_scale);
        trace.moe_layer_offset = moe_offset;
        let chunk_routing = ForwardRouting {
            mtp: if chunk.loss { routing.mtp } else { 0 },
            ..*routing
        };
        let layers = chunk.layers.clone();
        trace.replay = train_replay(self, &chunk_routing, batch, layers, moe_offset, device)?;
        trace.record = routing.record;
        let x = self.chunk_input(model, chunk, &p, rows, input)?;
        let (rope, mask) = (&p.rope, p.mask.as_ref());
        let layers = chunk.layers.clone();
        let x = self.decode_layers(model, layers, x, rows, rope, mask, None, &mut trace)?;
        Ok(ChunkRun { p, trace, x })
    }

    /// The training forward of pipeline chunk `chunk` of `model` on one micro-batch:
    /// [`chunk_layers`](Self::chunk_layers), and on the last virtual stage the final norm,
    /// head and loss and then `routing.mtp` MTP depths. Also returns the routers' selections
    /// (when `routing.record`; the chunk's MoE layers, then the MTP depths').
    ///
    /// MTP depth `j` runs on the full sequence length as Megatron computes it: the ids and
    /// labels of each row are rolled left by `j + 1` (the freed tail is masked out of the
    /// loss; attention being causal it never reaches the real positions), the module reads
    /// the embedded rolled ids and the previous depth's output (`h⁰` the main model's
    /// final-normed output), and its output goes through the shared vocab-parallel head and
    /// cross-entropy. With a packed or padded batch the ids are rolled within every document
    /// (Megatron's `roll_tensor` of packed sequences: a document's tail gets id 0, as the
    /// document rolled alone) and depth `j`'s target at position `i` (token `i + j + 2`)
    /// counts only when positions `i ..= i + j + 2` are real tokens of one document.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn train_chunk<M: DecoderStack + ?Sized>(
        &self,
        model: &M,
        chunk: &ChunkParts,
        moe_offset: usize,
        batch: &crate::batch::TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        input: Option<Tensor<2>>,
        routing: &ForwardRouting<'_>,
    ) -> Result<(ChunkForward, Vec<Tensor<2, Int>>), ModelError> {
        let mut run = self.chunk_layers(
            model,
            chunk,
            moe_offset,
            batch,
            device,
            aux_grad_scale,
            input,
            routing,
        )?;
        if !chunk.loss {
            let selected = std::mem::take(&mut run.trace.selected);
            return Ok((run.passed_on(), selected));
        }
        let ChunkRun { p, mut trace, x } = run;
        let (rows, s) = (batch.batch, p.s);
        let (head, embed) = (model.lm_head(), model.embed_tokens().ok());
        let mut hidden = model.final_norm()?.forward(x);
        let (loss, _) = self.normed_head_loss(hidden.clone(), head, embed, &p.targets)?;
        let mut mtp_losses = Vec::with_capacity(routing.mtp);
        for j in 0..routing.mtp {
            if j + 2 > s {
                return Err(ModelError::input(
                    "input_ids",
                    format!("{s} tokens are too few for MTP depth {}", j + 1),
                ));
            }
            let ids = match p.layout {
                Some(l) => l.roll_within_documents(&batch.input_ids, j + 1, 0),
                None => super::sharded::roll_rows(&batch.input_ids, s, j + 1, 0),
            };
            let targets = p.local_targets(&p.mtp_labels(j));
            let embedding = held(embed, "the token embedding (the MTP modules read it)")?;
            let embeds = self.embed(embedding, &p.local(&ids), rows)?;
            let inputs = self.masked_inputs(&p);
            hidden = model.mtp_forward(j, self, embeds, hidden, rows, &mut trace, inputs)?;
            let (l, _) = self.normed_head_loss(hidden.clone(), head, embed, &targets)?;
            mtp_losses.push(l);
        }
        let selected = std::mem::take(&mut trace.selected);
        let out = ChunkForward::Loss(TrainForward {
            loss,
            mtp_losses,
            router_losses: trace.losses,
            expert_load: trace.expert_load,
        });
        Ok((out, selected))
    }
}

impl SpRuntime {
    /// The log-prob forward of pipeline chunk `chunk` of `model` on one micro-batch:
    /// [`chunk_layers`](Self::chunk_layers), and on the last virtual stage the final norm,
    /// the vocab-parallel head and the per-token log-probs and entropies of the micro-batch's
    /// targets, whole rows gathered over context parallelism
    /// ([`token_logprobs`](Self::token_logprobs)).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn logprobs_chunk<M: DecoderStack + ?Sized>(
        &self,
        model: &M,
        chunk: &ChunkParts,
        moe_offset: usize,
        batch: &crate::batch::TrainBatch,
        device: &Device,
        aux_grad_scale: f64,
        input: Option<Tensor<2>>,
        routing: &ForwardRouting<'_>,
    ) -> Result<ChunkForward, ModelError> {
        let run = self.chunk_layers(
            model,
            chunk,
            moe_offset,
            batch,
            device,
            aux_grad_scale,
            input,
            routing,
        )?;
        if !chunk.loss {
            return Ok(run.passed_on());
        }
        let ChunkRun { p, trace, x } = run;
        let normed = model.final_norm()?.forward(x);
        let logits =
            self.vocab_parallel_logits(normed, model.lm_head(), model.embed_tokens().ok())?;
        let logprobs = self.token_logprobs(logits, &p, batch.batch)?;
        Ok(ChunkForward::LogProbs {
            logprobs,
            router_losses: trace.losses,
            expert_load: trace.expert_load,
        })
    }
}

/// What a pipeline chunk's layers produced ([`SpRuntime::chunk_layers`]): the prepared
/// micro-batch, the routers' trace and the chunk's output block.
pub(crate) struct ChunkRun<'b> {
    /// The micro-batch's prepared inputs (positions, masks, targets).
    pub p: super::Prepared<'b>,
    /// The chunk's routers' losses and counts so far.
    pub trace: RouterTrace,
    /// The chunk's output, this rank's sequence-parallel block.
    pub x: Tensor<2>,
}

impl ChunkRun<'_> {
    /// The output passed on to the next virtual stage, with the chunk's router statistics.
    pub(crate) fn passed_on(self) -> ChunkForward {
        ChunkForward::Activation {
            hidden: self.x,
            router_losses: self.trace.losses,
            expert_load: self.trace.expert_load,
        }
    }
}
