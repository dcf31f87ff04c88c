//! A family folder: its `config.json` ([`config`]), model ([`model`], which says what upstream
//! code it follows) and HF layout ([`plan`]).

pub mod config;
pub mod model;
pub mod plan;

pub use config::*;
pub use model::*;
