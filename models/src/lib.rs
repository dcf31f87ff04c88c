//! Model definitions for burn-moe: Qwen3-MoE (and later DeepSeek-V3 and dense Qwen3) written
//! against Burn 0.22.1, readable beside their HF transformers 5.23 twins.
//!
//! - [`config`]: HF `config.json` parsing with HF defaults, both accepted spellings of renamed
//!   keys, unknown keys preserved for export, and validation errors that name the field.
//! - [`layers`]: building blocks shared by the model families — [`layers::RmsNorm`] and the dense
//!   SwiGLU [`layers::Mlp`] — with HF parameter names.
//! - `testing` (feature `testing`): naive loop-based references used by the tests.
//!
//! Tensors are `Tensor<D>` on a runtime [`burn::tensor::Device`] (e.g. `Device::flex()`); wrap
//! the device with `.autodiff()` for training.

pub mod config;
mod error;
pub mod layers;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use config::Qwen3MoeConfig;
pub use error::ModelError;
