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
use crate::param_plan::hf_names;

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
}
