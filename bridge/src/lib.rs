//! Checkpoint formats for burn-moe: HuggingFace safetensors checkpoints in and out, distributed
//! checkpoints and a model directory's text side (docs/checkpoints.md).
//!
//! This crate holds the formats and knows no model: what it must know of one (its parsed
//! `config.json`, name-mapping rules, the HF tensors it implies, how its tensors are split) it
//! is handed through the [`ModelSchema`] trait, which `moe-models` implements for the models
//! it defines (Qwen3, Qwen3-MoE, DeepSeek-V3) together with their mapping tables, plans,
//! model loading and training checkpoints. It depends on `moe-backend` for layout types only.
//!
//! - [`safetensors`]: header validation that never panics on bad input and accepts the FP8
//!   dtypes of release checkpoints; a memory-mapped reader ([`safetensors::SafetensorsFile`])
//!   with zero-copy [`safetensors::TensorView`]s and conversions to f32 and Burn `TensorData`;
//!   writers for single files and atomically written, sharded HF directories
//!   ([`safetensors::HfDirWriter`], [`safetensors::write_hf_checkpoint`]).
//! - [`hf`]: HF checkpoint directories ([`hf::HfCheckpoint`]: single file or sharded index,
//!   shards mapped lazily, `config.json` / `generation_config.json`), their validation against
//!   the config before any weight is read ([`hf::HfCheckpoint::check`]), and model resolution
//!   from a path or a hub id `org/name[@rev]` in the hub cache, read with `hf-hub`
//!   ([`hf::resolve_model_dir`]; downloads behind the opt-in `hub` feature).
//! - [`schema`]: [`ModelSchema`], the model knowledge the formats are generic over.
//! - [`fp8`]: blockwise FP8 dequantisation (and the release quantisation recipe).
//! - [`mapping`]: the HF ↔ canonical name-mapping engine (patterns, rules, registries,
//!   conversion, the completeness report) and the expected-tensor tables' types.
//! - [`export`]: HF → HF export (FP8 → BF16, stacked → per-expert names, re-sharding) with
//!   configs and tokenizer files, written atomically.
//! - [`dist`]: distributed checkpoints — DCP-compatible per-rank safetensors files and a JSON
//!   index, saved by every rank of any parallel layout and committed atomically, read back
//!   (resharded) under any other; HF ↔ distributed conversion; the training state object.
//! - [`text`]: the model directory's HF tokenizer ([`Tokenizer`]) and chat templates.
//! - [`tensorboard`]: TensorBoard event files — a writer for training scalars
//!   ([`tensorboard::EventWriter`], resumed runs marked so that TensorBoard drops the stale
//!   steps) and a reader that checks every record ([`tensorboard::read_scalars_dir`]).
//! - [`data`]: Megatron pretraining data — indexed datasets (`.bin` + `.idx`), Megatron-Core's
//!   `GPTDataset` samples and `--data-path` blends ([`data::TrainDataset`]), sample for sample
//!   as Megatron draws them.
//!
//! Single files are written atomically through [`moe_backend::fs::write_atomic`] (temporary
//! file, fsync, rename, directory fsync); checkpoint directories are filled in a hidden
//! temporary directory and appear whole, by a rename. Errors are one [`BridgeError`] enum whose
//! messages name the file and tensor involved.

pub mod data;
pub mod dist;
mod error;
pub mod export;
pub mod fp8;
pub mod hf;
pub mod mapping;
pub mod mxfp4;
pub mod safetensors;
pub mod schema;
pub mod tensorboard;
#[cfg(test)]
mod test_util;
pub mod text;

pub use error::BridgeError;
pub use schema::ModelSchema;
pub use text::Tokenizer;
