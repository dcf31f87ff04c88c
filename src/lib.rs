//! # burn-moe
//!
//! Megatron-Core-style Mixture-of-Experts training for the [Burn](https://burn.dev) deep-learning
//! framework. This facade re-exports the three crates of the workspace:
//!
//! - [`backend`] (`moe-backend`): the MoE compute core — router, permutation, grouped GEMM,
//!   experts and the single-rank [`backend::layer::MoeLayer`], as a Burn backend extension —
//!   and what runs across ranks: parallel layouts and process groups, communicators (threads,
//!   TCP, MPI, NCCL), token dispatchers, ZeRO-1 AdamW and Muon, FP8;
//! - [`bridge`] (`moe-bridge`): the checkpoint formats, which know no model — HuggingFace
//!   safetensors in and out (validation, export, upcycling), the name-mapping engine,
//!   distributed checkpoints saved and resharded under any layout, and the HF tokenizer and
//!   chat templates; model knowledge comes in through [`bridge::ModelSchema`];
//! - [`models`] (`moe-models`, on top of the other two): dense Qwen3, Qwen3-MoE and DeepSeek-V3
//!   (with MTP) beside their HF twins, their sharded forms under any parallel layout, the
//!   [`models::train::Trainer`], generation, rollouts, router replay, RL losses, weight sync and
//!   the layout planner; each model's mapping table and plan, model loading and live export
//!   ([`models::hf`]) and training checkpoints ([`models::checkpoint`]).
//!
//! [`finetune`] is the library side of `examples/finetune.rs`: a Qwen3-MoE fine-tuning job on
//! in-process ranks under any parallel layout. [`quickstart`] is the main-job pipeline of
//! `examples/quickstart.rs`: HF → distributed checkpoint → fine-tune on in-process ranks → save
//! with optimizer state → reshard → HF export, checked against the trained logits.
//! [`grpo`] is the RL example: GRPO on a verifiable synthetic task, rollouts → rewards →
//! advantages → policy update → weight sync on the ranks of a layout.
//! [`train_job`] is the training job behind `moe train`, one rank's part of it on threads or
//! processes (with its non-finite guard, evaluation, retention and clean early exits);
//! [`job_data`] reads Megatron's indexed datasets and SFT data for it; [`preempt`] installs the exit-signal handlers of `moe train`; [`device`] maps `--device cpu|vulkan|cuda` to a Burn device; [`launch`] picks the transport at start-up (threads, or one process per rank over
//! TCP or MPI) and runs a rank closure on it.

pub mod device;
pub mod finetune;
pub mod grpo;
pub mod job_data;
pub mod launch;
pub mod preempt;
pub mod quickstart;
pub mod train_job;

pub use moe_backend as backend;
pub use moe_bridge as bridge;
pub use moe_models as models;

/// Installs a `tracing` subscriber printing structured logs to stderr, filtered by `RUST_LOG`
/// (default `info`). Safe to call more than once.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// The README's Rust snippets, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
