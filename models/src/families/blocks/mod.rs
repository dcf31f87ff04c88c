//! Building blocks several families share (not a family themselves): the DeepSeek-style MoE
//! block ([`moe`]: sigmoid group-limited routing with an expert bias and shared experts), the
//! multi-token-prediction modules ([`mtp`]) and their HF layout ([`plan`]).

pub mod moe;
pub mod mtp;
pub mod plan;
