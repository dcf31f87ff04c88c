//! Qwen3-MoE (HF `Qwen3MoeForCausalLM`): its config, model and plan.

mod config;
mod model;
pub mod plan;

pub use config::Qwen3MoeConfig;
pub use model::*;
