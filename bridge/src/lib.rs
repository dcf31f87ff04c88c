//! Checkpoint I/O for burn-moe: HuggingFace safetensors checkpoints in and out
//! (checkpoints.md §1–§5), distributed checkpoints (§5–§8) and a model directory's text side.
//!
//! - [`safetensors`]: header validation that never panics on bad input and accepts the FP8
//!   dtypes of release checkpoints; a memory-mapped reader ([`safetensors::SafetensorsFile`])
//!   with zero-copy [`safetensors::TensorView`]s and conversions to f32 and Burn `TensorData`;
//!   writers for single files and atomically written, sharded HF directories
//!   ([`safetensors::HfDirWriter`], [`safetensors::write_hf_checkpoint`]).
//! - [`hf`]: HF checkpoint directories ([`hf::HfCheckpoint`]: single file or sharded index,
//!   shards mapped lazily, `config.json` / `generation_config.json`), their validation against
//!   the config before any weight is read, and model resolution from a path or a hub id
//!   `org/name[@rev]` in the hub cache, read with `hf-hub` ([`hf::resolve_model_dir`];
//!   downloads behind the opt-in `hub` feature).
//! - [`weights`]: HF checkpoints as model weights: [`load_causal_lm`] builds whichever model
//!   `config.json` names ([`AnyCausalLm`]: Qwen3, Qwen3-MoE or DeepSeek-V3), [`ModelConfig`]
//!   parses a config without touching the weights.
//! - [`fp8`]: blockwise FP8 dequantisation (and the release quantisation recipe).
//! - [`mapping`]: the HF ↔ canonical name-mapping registry, per-model tables and the
//!   completeness report.
//! - [`export`]: HF → HF export (FP8 → BF16, stacked → per-expert names, re-sharding) with
//!   configs and tokenizer files, written atomically.
//! - [`live_export`]: a live model's weights as an HF directory (F32, BF16 or blockwise FP8),
//!   streamed tensor by tensor with bounded memory.
//! - [`upcycle`]: a dense Qwen3 checkpoint upcycled into a Qwen3-MoE one.
//! - [`dist`]: distributed checkpoints — DCP-compatible per-rank safetensors files and a JSON
//!   index, saved by every rank of any parallel layout and committed atomically, read back
//!   (resharded) under any other; HF ↔ distributed conversion; training checkpoints with the
//!   optimizer state.
//! - [`text`]: the model directory's HF tokenizer ([`Tokenizer`]) and chat templates.
//!
//! Single files are written atomically through [`moe_backend::fs::write_atomic`] (temporary
//! file, fsync, rename, directory fsync); checkpoint directories are filled in a hidden
//! temporary directory and appear whole, by a rename. Errors are one [`BridgeError`] enum whose
//! messages name the file and tensor involved.

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
