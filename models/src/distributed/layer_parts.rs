//! What the generic shard code reads of one decoder layer: its attention, its MoE block if it
//! has one and its dense MLP if it has one ([`LayerParts`]). From these alone
//! [`ShardModel`](super::ShardModel)'s defaults load and localize a shard, copy the FP8
//! settings onto it, count and list its routers, put a model in FP8 and make a gathered model
//! single-rank again, for every family alike (Megatron-Core's `TransformerLayer` submodules:
//! `self_attention`, `mlp` as a dense MLP or an `MoELayer`).

use burn::module::Module;
use moe_backend::fp8::Fp8Recipe;
use moe_backend::layer::MoeLayer;
use moe_backend::router::TopKRouter;

use crate::ModelError;
use crate::layers::mla::Mla;
use crate::layers::{Attention, Mlp};
use crate::weights::ShardSpec;

/// What the shard code needs of a layer's self-attention.
pub trait ShardAttention {
    /// Refuses a tensor-parallel size `tp` the attention's (whole-model) heads do not split
    /// over, naming `tp`.
    fn check_split(&self, tp: usize) -> Result<(), ModelError>;
    /// Sets the head counts from the loaded tensors' shapes (this rank's heads of a shard,
    /// every head of a whole model).
    fn localize_heads(&mut self) -> Result<(), ModelError>;
    /// The FP8 recipe of the attention's projections (`None`: high precision, or an attention
    /// with no FP8 path).
    fn fp8(&self) -> Option<Fp8Recipe> {
        None
    }
    /// Sets the FP8 recipe of the attention's projections (nothing for an attention with no
    /// FP8 path).
    fn set_fp8(&mut self, recipe: Option<Fp8Recipe>) {
        let _ = recipe;
    }
}

/// GQA attention: heads from the `q_proj` / `k_proj` widths, FP8 projections.
impl ShardAttention for Attention {
    fn check_split(&self, tp: usize) -> Result<(), ModelError> {
        if !self.num_heads.is_multiple_of(tp) || !self.num_kv_heads.is_multiple_of(tp) {
            return Err(ModelError::layout(
                "tp",
                format!(
                    "{} query / {} KV heads cannot be split over tp = {tp}",
                    self.num_heads, self.num_kv_heads
                ),
            ));
        }
        Ok(())
    }

    fn localize_heads(&mut self) -> Result<(), ModelError> {
        *self = self.clone().with_local_heads()?;
        Ok(())
    }

    fn fp8(&self) -> Option<Fp8Recipe> {
        self.fp8
    }

    fn set_fp8(&mut self, recipe: Option<Fp8Recipe>) {
        self.fp8 = recipe;
    }
}

/// MLA: heads from the `kv_b_proj` width; its projections stay in high precision.
impl ShardAttention for Mla {
    fn check_split(&self, tp: usize) -> Result<(), ModelError> {
        if !self.num_heads.is_multiple_of(tp) {
            return Err(ModelError::layout(
                "tp",
                format!("{} heads cannot be split over tp = {tp}", self.num_heads),
            ));
        }
        if self.o_proj.bias.is_some() && tp > 1 {
            return Err(ModelError::layout(
                "tp",
                format!(
                    "`{}` is row-parallel with a bias, which tp > 1 does not support",
                    crate::param_plan::hf_names::O_PROJ
                ),
            ));
        }
        Ok(())
    }

    fn localize_heads(&mut self) -> Result<(), ModelError> {
        *self = self.clone().with_local_heads();
        Ok(())
    }
}

/// One decoder layer (of the main model or an MTP module) as the shard code reads it.
pub trait LayerParts: Module {
    /// The layer's self-attention.
    type Attention: ShardAttention;
    /// The self-attention.
    fn attention(&self) -> &Self::Attention;
    /// The self-attention, mutably.
    fn attention_mut(&mut self) -> &mut Self::Attention;
    /// The MoE block (`None`: a dense layer).
    fn moe(&self) -> Option<&MoeLayer> {
        None
    }
    /// The MoE block, mutably.
    fn moe_mut(&mut self) -> Option<&mut MoeLayer> {
        None
    }
    /// The dense MLP (`None`: an MoE layer).
    fn dense_mlp(&self) -> Option<&Mlp> {
        None
    }
    /// The dense MLP, mutably.
    fn dense_mlp_mut(&mut self) -> Option<&mut Mlp> {
        None
    }
    /// Fixes the fields derived from tensor shapes after loading `shard` (the whole model:
    /// [`ShardSpec::FULL`]). The default: the attention's head counts.
    fn localize(&mut self, shard: &ShardSpec) -> Result<(), ModelError> {
        let _ = shard;
        self.attention_mut().localize_heads()
    }
}

/// [`LayerParts`] of a decoder layer whose parts are plain fields:
/// `layer_parts!(Layer, Attention, attention = self_attn, moe = moe)` (an MoE layer) or
/// `layer_parts!(Layer, Attention, attention = self_attn, mlp = mlp)` (a dense one), or
/// `layer_parts!(Layer, Attention, attention = self_attn, ffn = mlp)` where the field is either
/// kind and says which through `moe()` / `moe_mut()` / `dense()` / `dense_mut()` (the
/// DeepSeek-style block of `families::blocks`); other layers implement the trait themselves.
#[macro_export]
macro_rules! layer_parts {
    ($layer:ty, $attention:ty, attention = $attn:ident, ffn = $ffn:ident $(,)?) => {
        impl $crate::distributed::LayerParts for $layer {
            type Attention = $attention;

            fn attention(&self) -> &$attention {
                &self.$attn
            }

            fn attention_mut(&mut self) -> &mut $attention {
                &mut self.$attn
            }

            fn moe(&self) -> Option<&$crate::distributed::MoeLayer> {
                self.$ffn.moe()
            }

            fn moe_mut(&mut self) -> Option<&mut $crate::distributed::MoeLayer> {
                self.$ffn.moe_mut()
            }

            fn dense_mlp(&self) -> Option<&$crate::layers::Mlp> {
                self.$ffn.dense()
            }

            fn dense_mlp_mut(&mut self) -> Option<&mut $crate::layers::Mlp> {
                self.$ffn.dense_mut()
            }
        }
    };
    ($layer:ty, $attention:ty, attention = $attn:ident $(, moe = $moe:ident)? $(, mlp = $mlp:ident)? $(,)?) => {
        impl $crate::distributed::LayerParts for $layer {
            type Attention = $attention;

            fn attention(&self) -> &$attention {
                &self.$attn
            }

            fn attention_mut(&mut self) -> &mut $attention {
                &mut self.$attn
            }
            $(
            fn moe(&self) -> Option<&$crate::distributed::MoeLayer> {
                Some(&self.$moe)
            }

            fn moe_mut(&mut self) -> Option<&mut $crate::distributed::MoeLayer> {
                Some(&mut self.$moe)
            }
            )?
            $(
            fn dense_mlp(&self) -> Option<&$crate::layers::Mlp> {
                Some(&self.$mlp)
            }

            fn dense_mlp_mut(&mut self) -> Option<&mut $crate::layers::Mlp> {
                Some(&mut self.$mlp)
            }
            )?
        }
    };
}

/// Copies the FP8 settings of `src` (the whole model's layer) onto `dst` (its shard):
/// attention projections, dense MLP and routed experts.
pub(crate) fn copy_layer_fp8<L: LayerParts>(dst: &mut L, src: &L) {
    dst.attention_mut().set_fp8(src.attention().fp8());
    if let (Some(d), Some(s)) = (dst.dense_mlp_mut(), src.dense_mlp()) {
        d.fp8 = s.fp8;
    }
    if let (Some(d), Some(s)) = (dst.moe_mut(), src.moe()) {
        d.experts.fp8 = s.experts.fp8;
    }
}

/// Puts `layer`'s routed experts in FP8 (`recipe`) and, with `linears`, its attention
/// projections and dense MLP too; routers, shared experts and norms stay in high precision.
pub(crate) fn set_layer_fp8<L: LayerParts>(
    layer: &mut L,
    recipe: Option<Fp8Recipe>,
    linears: bool,
) -> Result<(), ModelError> {
    if linears {
        layer.attention_mut().set_fp8(recipe);
        if let Some(mlp) = layer.dense_mlp_mut() {
            mlp.fp8 = recipe;
        }
    }
    if let Some(moe) = layer.moe_mut() {
        moe.experts = moe.experts.clone().with_fp8(recipe)?;
    }
    Ok(())
}

/// The router of `layer`'s MoE block, if any.
pub(crate) fn layer_router<L: LayerParts>(layer: &mut L) -> Option<&mut TopKRouter> {
    layer.moe_mut().map(|moe| &mut moe.router)
}
