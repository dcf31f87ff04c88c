//! Per-family mapping tables (docs/models.md §HF tensor names), as rules of moe-bridge's
//! name-mapping engine ([`Registry`], [`Rule`]): each family's [`Family::mapping_rules`] behind
//! the ignored HF-only tensors every table shares.
//!
//! Every table lists the HF names explicitly (no catch-all), so a key no rule knows is reported as
//! unexpected. Canonical names equal HF names except routed experts, which are stacked per layer
//! into `mlp.experts.gate_up_proj [E, 2, Im, H]` and `mlp.experts.down_proj [E, H, Im]`
//! (docs/checkpoints.md §Canonical names and sharding). The names themselves are each model's,
//! spelled in its plan file (`param_plan/{qwen3,qwen3_moe,deepseek_v3}.rs`, shared Llama-family
//! names in [`crate::param_plan::hf_names`]); this module assembles the registries.

use std::path::Path;

use moe_bridge::BridgeError;
use moe_bridge::mapping::{Registry, Rule};
use serde_json::Value;

use crate::family::{Family, FamilyVisitor, visit_family};

/// The `model_type`s with a table: every family's ([`crate::family::MODEL_TYPES`]).
pub use crate::family::MODEL_TYPES as KNOWN_MODEL_TYPES;

/// Rules shared by every table, in front: ignored HF-only tensors.
fn ignores() -> Vec<Rule> {
    vec![
        Rule::ignore(
            "**_scale_inv",
            "FP8 inverse scale, consumed by dequantisation",
        ),
        Rule::ignore(
            "**rotary_emb.inv_freq",
            "RoPE buffer, recomputed from the config",
        ),
    ]
}

fn build(name: &str, rules: Vec<Rule>) -> Registry {
    let rules = ignores().into_iter().chain(rules).collect();
    // The tables are fixed and covered by tests; a failure here is a programming error.
    Registry::new(name, rules).unwrap_or_else(|e| panic!("built-in mapping table: {e}"))
}

/// The table of family `F`.
pub fn for_family<F: Family>() -> Registry {
    build(F::MODEL_TYPE, F::mapping_rules())
}

/// The table for `model_type`; [`BridgeError::UnknownModelType`] (naming `path`) otherwise.
pub fn for_model_type(model_type: &str, path: &Path) -> Result<Registry, BridgeError> {
    struct Table;
    impl FamilyVisitor for Table {
        type Output = Registry;
        fn visit<F: Family>(self) -> Registry {
            for_family::<F>()
        }
    }
    visit_family(model_type, Table).ok_or_else(|| BridgeError::UnknownModelType {
        path: path.to_path_buf(),
        model_type: model_type.to_owned(),
        known: KNOWN_MODEL_TYPES.join(", "),
    })
}

/// The table for a parsed `config.json` (its `model_type`).
pub fn for_config(config: &Value, path: &Path) -> Result<Registry, BridgeError> {
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| BridgeError::InvalidConfig {
            path: path.to_path_buf(),
            field: "model_type".to_owned(),
            reason: "missing or not a string".to_owned(),
        })?;
    for_model_type(model_type, path)
}

#[cfg(test)]
mod tests;
