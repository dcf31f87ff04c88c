//! Distributed checkpoints (docs/checkpoints.md §Distributed checkpoint format): DCP-compatible
//! safetensors files, one set per writing rank, and a JSON index that is the source of truth.
//!
//! - [`index`]: the `moe_dcp.index.json` schema and the per-file DCP `__metadata__`.
//! - [`sharding`]: the box each rank holds of each canonical tensor under a
//!   [`ParallelLayout`](moe_backend::parallel::ParallelLayout), given the model's split rule
//!   ([`ShardRule`]), and which copy is the main replica that writes it.
//! - [`region`]: boxes, strided copies and DistOpt flat-range decomposition.
//! - [`save`]: the SPMD save every rank calls ([`save::save_spmd`]) and the offline writer for
//!   conversion ([`save::OfflineWriter`]); the commit is atomic ([`commit`]).
//! - [`load`]: opening (refusing partial saves) and reading any box from the overlapping chunks
//!   ([`load::DistCheckpoint`]); resharding is loading another layout's boxes.
//! - [`validate`]: coverage and file-header checks
//!   (docs/checkpoints.md §Distributed checkpoint validation).
//! - [`convert`]: streaming HF → distributed conversion and distributed → HF export.
//! - [`fp8`]: FP8 weights kept as bytes plus `<fqn>_scale_inv` block scales, and their
//!   dequantisation on read.
//! - [`retention`]: keeping the newest `K` checkpoints of a root, removed crash-safely.
//! - [`train_record`]: the training state object ([`TrainState`]) of a training checkpoint.
//!
//! The bridge knows no model: what it must know of one (its config, name-mapping rules,
//! expected tensors, split rule) it is handed as a [`ModelSchema`](crate::schema::ModelSchema).
//! Where a model shard's parameters lie in the canonical tensors, and saving and restoring a
//! trainer's parameters and optimizer state, are moe-models' (`moe_models::checkpoint`).
//!
//! Layout on disk: `<root>/iter_{step:07}/{moe_dcp.index.json, config.json, .complete,
//! shard-{rank:05}-model-{j:05}-of-{n:05}.safetensors}` and `<root>/latest`.

pub mod commit;
pub mod convert;
mod files;
pub mod fp8;
pub mod index;
pub mod load;
pub mod region;
pub mod retention;
pub mod save;
pub mod sharding;
#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;
pub mod train_record;
pub mod validate;

pub use files::{SavedChunk, TensorMeta};
pub use index::{DcpIndex, TensorEntry, TensorKind};
pub use load::DistCheckpoint;
pub use region::TensorBox;
pub use save::{LocalChunk, OfflineWriter, SaveMeta, save_offline, save_spmd};
pub use sharding::{RankShard, ShardRule, ShardRuleFn, ShardingPlan, StageFn, StagePlace};
pub use train_record::{TRAIN_STATE_OBJECT, TrainState, read_train_state};
