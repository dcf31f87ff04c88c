//! Dense Qwen3 (HF `Qwen3ForCausalLM`): its config, model and plan.

mod config;
mod model;
pub mod plan;

pub use config::Qwen3Config;
pub use model::*;
