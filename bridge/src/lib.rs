//! Checkpoint I/O for burn-moe: HuggingFace safetensors checkpoints in and out
//! (checkpoints.md §1–§5); the distributed checkpoint format of §6 comes later.
//!
//! - [`safetensors`]: header validation that never panics on bad input and accepts the FP8
//!   dtypes of release checkpoints; a memory-mapped reader ([`safetensors::SafetensorsFile`])
//!   with zero-copy [`safetensors::TensorView`]s and conversions to f32 and Burn `TensorData`;
//!   writers for single files and atomically written, sharded HF directories
//!   ([`safetensors::HfDirWriter`], [`safetensors::write_hf_checkpoint`]).
//! - [`hf`]: HF checkpoint directories ([`hf::HfCheckpoint`]: single file or sharded index,
//!   shards mapped lazily, `config.json` / `generation_config.json`) and model resolution from a
//!   path or a hub id `org/name[@rev]` in the hub cache, read with `hf-hub`
//!   ([`hf::resolve_model_dir`]; downloads behind the opt-in `hub` feature).
//! - [`fp8`]: blockwise FP8 dequantisation (and the release quantisation recipe).
//! - [`export`]: HF → HF export (FP8 → BF16, stacked → per-expert names, re-sharding) with
//!   configs and tokenizer files, written atomically.
//! - [`mapping`]: the HF ↔ canonical name-mapping registry, per-model tables and the
//!   completeness report.
//!
//! Errors are one [`BridgeError`] enum whose messages name the file and tensor involved.

pub mod dist;
mod error;
pub mod export;
pub mod fp8;
pub mod hf;
pub mod live_export;
pub mod mapping;
pub mod safetensors;
#[cfg(test)]
mod test_util;
pub mod text;
pub mod upcycle;
pub mod weights;

pub use error::BridgeError;
pub use text::Tokenizer;
pub use weights::{AnyCausalLm, ModelConfig, load_causal_lm};
