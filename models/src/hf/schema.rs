//! [`ModelConfig`] as moe-bridge's [`ModelSchema`]: what the formats (checkpoint validation,
//! HF ↔ distributed conversion, export, resharding) need to know of these models.

use std::path::Path;

use moe_bridge::dist::{ShardRule, StagePlace};
use moe_bridge::mapping::{ExpectedTable, ExpertLayout, Registry};
use moe_bridge::{BridgeError, ModelSchema};
use serde_json::Value;

use super::expected::expected_hf_tensors;
use super::load::ModelConfig;
use super::mapping::for_config;
use crate::param_plan::{ReleaseLayout, hf_names};

impl ModelSchema for ModelConfig {
    fn from_config(config: &Value, path: &Path) -> Result<Self, BridgeError> {
        ModelConfig::from_json(config, path)
    }

    fn registry_of(config: &Value, path: &Path) -> Result<Registry, BridgeError> {
        for_config(config, path)
    }

    /// The models' split table ([`crate::families::shard_rule`]).
    fn shard_rule(name: &str) -> ShardRule {
        crate::families::shard_rule(name)
    }

    fn stage_place(name: &str) -> StagePlace {
        hf_names::stage_place(name)
    }

    fn tied_head(config: &Value) -> Option<String> {
        let tied = config.get("tie_word_embeddings").and_then(Value::as_bool);
        (tied == Some(true)).then(hf_names::lm_head_weight)
    }

    fn model_type(&self) -> &str {
        ModelConfig::model_type(self)
    }

    fn num_layers(&self) -> usize {
        ModelConfig::num_layers(self)
    }

    fn expected_hf_tensors(
        &self,
        layout: ExpertLayout,
        path: &Path,
        block: [usize; 2],
    ) -> Result<ExpectedTable, BridgeError> {
        expected_hf_tensors(self, layout, path, block)
    }

    fn warnings(&self) -> Vec<String> {
        ModelConfig::warnings(self)
    }

    fn export_copies(&self, has: &dyn Fn(&str) -> bool) -> Vec<(String, String)> {
        ModelConfig::export_copies(self, has)
    }

    /// The family plan's [`ReleaseLayout`] of `name`, if any; the checkpoint's gated shapes
    /// (`[E, 2, F, H]`, `[E, 2, F]`) are the canonical `[E, 2F, H]`, `[E, 2F]` in the same
    /// element order.
    fn release_shape(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Vec<usize>>, BridgeError> {
        match self.release_layout(name) {
            Some(layout) => (layout.stored_shape(name, &merged_gate_up(layout, shape)))
                .map(Some)
                .map_err(|e| conversion(name, e)),
            None => Ok(None),
        }
    }

    fn to_release(
        &self,
        name: &str,
        shape: &[usize],
        values: &[f32],
    ) -> Result<Option<Vec<f32>>, BridgeError> {
        match self.release_layout(name) {
            Some(layout) => (layout.to_stored(name, &merged_gate_up(layout, shape), values))
                .map(Some)
                .map_err(|e| conversion(name, e)),
            None => Ok(None),
        }
    }

    /// The canonical shape of the plan's [`ReleaseLayout`] of `name` stored as `stored`, the
    /// gate/up layouts' `[E, 2F, …]` as the checkpoint's gated `[E, 2, F, …]`.
    fn release_canonical_shape(
        &self,
        name: &str,
        stored: &[usize],
    ) -> Result<Option<Vec<usize>>, BridgeError> {
        match self.release_layout(name) {
            Some(layout) => (layout.canonical_shape(name, stored))
                .map(|shape| Some(split_gate_up(layout, &shape)))
                .map_err(|e| conversion(name, e)),
            None => Ok(None),
        }
    }

    /// The canonical values of the plan's [`ReleaseLayout`] of `name` (the gated
    /// `[E, 2, F, …]` holds the same element order as `[E, 2F, …]`).
    fn release_to_canonical(
        &self,
        name: &str,
        stored: &[usize],
        values: &[f32],
    ) -> Result<Option<Vec<f32>>, BridgeError> {
        match self.release_layout(name) {
            Some(layout) => (layout.to_canonical(name, stored, values))
                .map(Some)
                .map_err(|e| conversion(name, e)),
            None => Ok(None),
        }
    }

    /// The family plan's [`Mxfp4Release`](crate::param_plan::Mxfp4Release) tensors.
    fn release_mxfp4(&self, name: &str) -> bool {
        crate::families::plan_of(ModelConfig::model_type(self)).is_some_and(|p| p.is_mxfp4(name))
    }

    /// The family plan's MXFP4 `quantization_config`.
    fn mxfp4_quantization_config(&self) -> Option<Value> {
        crate::families::plan_of(ModelConfig::model_type(self))
            .and_then(|p| p.mxfp4_release().map(|m| m.quantization_config()))
    }
}

impl ModelConfig {
    /// How this family's release stores canonical tensor `name`, when not as is
    /// ([`Stacked`](ReleaseLayout::Stacked) tensors are stored as is).
    fn release_layout(&self, name: &str) -> Option<ReleaseLayout> {
        crate::families::plan_of(ModelConfig::model_type(self))
            .and_then(|p| p.release_layout(name))
            .filter(|l| *l != ReleaseLayout::Stacked)
    }
}

/// A checkpoint's gated expert shape (`[E, 2, F, …]`) as the canonical `[E, 2F, …]` for the
/// gate/up layouts; other shapes unchanged.
fn merged_gate_up(layout: ReleaseLayout, shape: &[usize]) -> Vec<usize> {
    let gated = matches!(
        layout,
        ReleaseLayout::InterleavedGateUp | ReleaseLayout::InterleavedGateUpBias
    );
    match shape {
        [e, 2, f, rest @ ..] if gated && rest.len() <= 1 => [&[*e, 2 * f][..], rest].concat(),
        _ => shape.to_vec(),
    }
}

/// The canonical `[E, 2F, …]` of a gate/up layout as the checkpoint's gated `[E, 2, F, …]`
/// (the inverse of [`merged_gate_up`]); other shapes unchanged.
fn split_gate_up(layout: ReleaseLayout, shape: &[usize]) -> Vec<usize> {
    let gated = matches!(
        layout,
        ReleaseLayout::InterleavedGateUp | ReleaseLayout::InterleavedGateUpBias
    );
    match shape {
        [e, f2, rest @ ..] if gated && f2.is_multiple_of(2) && rest.len() <= 1 => {
            [&[*e, 2, f2 / 2][..], rest].concat()
        }
        _ => shape.to_vec(),
    }
}

fn conversion(name: &str, e: crate::ModelError) -> BridgeError {
    BridgeError::Sharding {
        tensor: name.to_owned(),
        reason: e.to_string(),
    }
}
