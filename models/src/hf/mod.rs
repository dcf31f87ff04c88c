//! HF checkpoints as these models, on moe-bridge's formats (which know no model).
//!
//! - [`ModelConfig`]: a parsed, validated `config.json` of any supported family; it is the
//!   [`ModelSchema`](moe_bridge::ModelSchema) the bridge's generic checks, conversions and
//!   exports are instantiated with (`checkpoint.check::<ModelConfig>()`,
//!   `convert_hf_to_dist::<ModelConfig>(…)`).
//! - [`mapping`]: each family's HF ↔ canonical name-mapping table ([`mapping::for_config`]).
//! - [`expected`]: the HF tensors (names, shapes, FP8 scale companions) each family's config
//!   implies ([`expected_hf_tensors`]), the shape source of checkpoint validation.
//! - [`load`]: model loading from an HF directory ([`load_causal_lm`], [`AnyCausalLm`],
//!   rank shards with [`load_shard_checked`]); moe-bridge's `HfCheckpoint` is a
//!   [`WeightSource`](crate::WeightSource).
//! - [`live_export`]: a live model's weights as an HF directory (F32, BF16 or blockwise FP8),
//!   streamed tensor by tensor with bounded memory.

pub mod expected;
pub mod live_export;
pub mod load;
pub mod mapping;
mod schema;
#[cfg(test)]
mod tests;

pub use expected::expected_hf_tensors;
pub use live_export::{LiveDtype, LiveExportOptions, export_live_model};
pub use load::{
    AnyCausalLm, CheckReport, ConfigVisitor, HfShard, LmLosses, ModelConfig, ModelVisitor,
    ModelVisitorMut, WeightPrecision, load_causal_lm, load_checked, load_from_checkpoint,
    load_shard_checked,
};
pub use mapping::{KNOWN_MODEL_TYPES, for_config, for_family, for_model_type};
