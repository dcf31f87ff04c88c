//! GLM-4.5 MoE (HF `Glm4MoeForCausalLM`): its config, model (DeepSeek-V3's MoE block and MTP
//! layers around GQA attention with partial rotary) and plan.

mod config;
mod model;
pub mod plan;

pub use config::Glm4MoeConfig;
pub use model::*;
