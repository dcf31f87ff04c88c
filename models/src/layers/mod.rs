//! Building blocks shared by the model families (docs/models.md §Shared building blocks,
//! §RoPE and YaRN, §Qwen3 and its attention).

pub mod attention;
pub mod kv_cache;
pub mod layer_stack;
pub mod mla;
pub mod mlp;
pub mod rms_norm;
pub mod rope;

pub use attention::{
    Attention, AttentionConfig, AttentionMask, CoreOptions, attention_core, attention_core_with,
    causal_attention, causal_attention_with, masked_attention, masked_attention_with, repeat_kv,
};
pub use kv_cache::{KvCache, LayerCache};
pub use layer_stack::LayerStack;
pub use mla::{Mla, MlaConfig, mla_softmax_scale};
pub use mlp::{Mlp, MlpConfig};
pub use rms_norm::{RmsNorm, RmsNormConfig};
pub use rope::{
    RopeTables, RotaryEmbedding, apply_rotary, apply_rotary_interleaved, rotary_dim,
    yarn_get_mscale,
};
