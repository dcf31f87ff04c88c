//! The HF tensors a model's `config.json` implies: name, shape and role of every tensor the model
//! loads (docs/models.md §HF tensor names), per family
//! ([`Family::expected_tensors`](crate::families::Family::expected_tensors)), with the optional
//! FP8 `*_scale_inv` companions of every matrix
//! (docs/checkpoints.md §FP8 release format) and the MTP layers of DeepSeek-V3 and GLM-4.5.
//!
//! This is the shape source of checkpoint validation ([`HfCheckpoint::check`]): a weight the
//! table requires must be present with exactly this shape; a tensor the table does not list is
//! one the model does not use.
//!
//! A config's sizes are bounded before its model is built
//! ([`check_sizes`](crate::families::expected::check_sizes)), shapes are computed with checked
//! arithmetic and the table is bounded
//! ([`MAX_TENSORS`](moe_bridge::mapping::MAX_TENSORS),
//! [`MAX_ELEMENTS`](moe_bridge::mapping::MAX_ELEMENTS)) by moe-bridge's
//! [`ExpectedBuilder`](moe_bridge::mapping::ExpectedBuilder), so
//! an absurd config is an error rather than an overflow, a huge allocation or a hang.
//!
//! The tables are derived from each family's model and plan
//! ([`crate::families::expected`]): no family writes one.
//!
//! [`HfCheckpoint::check`]: moe_bridge::hf::HfCheckpoint::check

use std::path::Path;

use moe_bridge::BridgeError;
use moe_bridge::mapping::{ExpectedTable, ExpertLayout};

use super::load::ModelConfig;

/// The HF tensors `config` implies (its family's [`Family::expected_tensors`](crate::families::Family::expected_tensors)).
pub fn expected_hf_tensors(
    config: &ModelConfig,
    layout: ExpertLayout,
    path: &Path,
    block: [usize; 2],
) -> Result<ExpectedTable, BridgeError> {
    config.expected_hf_tensors(layout, path, block)
}

#[cfg(test)]
mod tests;
