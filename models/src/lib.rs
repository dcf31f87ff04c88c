//! Model definitions for burn-moe: dense Qwen3, Qwen3-MoE and DeepSeek-V3 written
//! against Burn 0.22.1, each readable beside its HF transformers 5.23 twin.
//!
//! Layering: this crate sits on `moe-backend` (ops, parallel layouts, optimizers) and
//! `moe-bridge` (checkpoint formats, which know no model); it declares each model's plan and
//! name mapping and hands them to the formats. The `burn-moe` facade and the `moe` CLI sit on
//! top.
//!
//! - [`config`]: HF `config.json` parsing with HF defaults, both accepted spellings of renamed
//!   keys, unknown keys preserved for export, and validation errors that name the field.
//! - [`layers`]: building blocks shared by the model families — [`layers::RmsNorm`], the dense
//!   SwiGLU [`layers::Mlp`], RoPE/YaRN ([`layers::rope`]), GQA attention with QK-norm
//!   ([`layers::Attention`]) and the KV cache.
//! - [`qwen3`], [`qwen3_moe`], [`deepseek_v3`]: the models, with HF module/tensor names
//!   (MLA in [`layers::mla`], multi-token prediction in [`mtp`]).
//! - [`causal_lm`]: loss, HF load-balancing loss, generation, parameter counting.
//! - [`packing`]: packed sequences (document boundaries, `cu_seqlens`) and padding masks.
//! - [`weights`]: the [`WeightSource`] trait through which checkpoints are loaded.
//! - [`hf`]: HF checkpoints as these models, on moe-bridge's formats: [`ModelConfig`] (the
//!   parsed `config.json` of any family, moe-bridge's
//!   [`ModelSchema`](moe_bridge::ModelSchema)), each family's name-mapping table and expected
//!   HF tensors, [`load_causal_lm`] and sharded loading, and a live model's export as an HF
//!   directory.
//! - [`checkpoint`]: training checkpoints on moe-bridge's distributed format: where each
//!   parameter of a rank's shard lies in the canonical tensors (from the model's parallel
//!   plan), and saving / restoring a trainer's parameters and optimizer state.
//! - [`distributed`]: each model's shard under any parallel layout on the ranks of a
//!   moe-backend world (tensor and sequence parallel attention and MLPs, vocab-parallel
//!   embedding, head and loss, expert-parallel experts behind a token dispatcher).
//! - [`param_plan`]: each model's parallel plan, one table keyed by module path giving every
//!   parameter's HF name, storage transform, split, gradient class and FP8 eligibility; the
//!   trainer's gradient classes, gathering, FP8 primary weights and checkpoint placement read
//!   it ([`param_plan::Planned`]).
//! - [`train`]: the training step ([`train::Trainer`]: one rank's shard with ZeRO-1 AdamW or
//!   Muon, micro-batches, packed or padded batches, router losses).
//! - [`export`]: a live model's weights streamed in HF layout and names.
//! - [`replay`]: router replay (record a forward's routing in a small file, force it later).
//! - [`rollout`], [`rl`]: RL rollouts (batched sampling with log-probs and routed experts) and
//!   policy-gradient losses (PPO, GSPO, KL, GRPO advantages).
//! - [`weight_sync`]: streaming, bucketed HF weights from any training layout to a rollout
//!   model or engine (RL).
//! - [`upcycle`]: a dense Qwen3 HF checkpoint upcycled into a Qwen3-MoE one (written with
//!   moe-bridge's formats).
//! - [`plan`]: the layout planner's formulas (parameters, optimizer state and communication
//!   volume per rank).
//! - `testing` (feature `testing`): naive loop-based references used by the tests.
//!
//! Errors are one [`ModelError`] enum: config errors name the `config.json` field, tensor errors
//! the tensor, input errors the input, layout errors the parallel degree at fault; a format
//! error of moe-bridge passes through unchanged ([`ModelError::Bridge`]).
//!
//! Tensors are `Tensor<D>` on a runtime [`burn::tensor::Device`] (e.g. `Device::flex()`); wrap
//! the device with `.autodiff()` for training. Compute is f32 by default; bf16 checkpoints are
//! upcast on load (the arithmetic policy of docs/models.md §Goldens and parity tests).

pub mod batch;
pub mod causal_lm;
pub mod checkpoint;
pub mod config;
pub mod distributed;
mod error;
pub mod export;
pub mod families;
pub mod hf;
pub mod layers;
pub mod logprob;
pub mod packing;
pub mod param_plan;
pub mod plan;
pub mod recompute;
pub mod replay;
pub mod rl;
pub mod rollout;
pub mod routing;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod train;
pub mod upcycle;
pub mod weight_sync;
pub mod weights;

pub use causal_lm::{CausalLm, GenerationConfig, ParamCount, Sampling, generate};
pub use error::ModelError;
/// The family trait and list (also at [`families`]).
pub use families as family;
pub use families::prelude::*;
pub use hf::{AnyCausalLm, ModelConfig, load_causal_lm};
pub use weights::{WeightLoader, WeightSource};
