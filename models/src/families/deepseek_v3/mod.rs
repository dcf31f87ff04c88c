//! DeepSeek-V3 (HF `DeepseekV3ForCausalLM`): its config, model (MLA in
//! [`crate::layers::mla`]), multi-token prediction modules and plan.

mod config;
mod model;
pub mod moe;
pub mod mtp;
pub mod plan;

pub use config::DeepseekV3Config;
pub use model::*;
