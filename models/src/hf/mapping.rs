//! Per-model mapping tables: Qwen3 (dense), Qwen3-MoE and DeepSeek-V3
//! (docs/models.md §HF tensor names), as rules of moe-bridge's name-mapping engine ([`Registry`],
//! [`Rule`]).
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

use crate::param_plan::{deepseek_v3 as ds, qwen3 as q3, qwen3_moe as q3m};

/// The `model_type`s with a table.
pub const KNOWN_MODEL_TYPES: [&str; 3] = ["qwen3", "qwen3_moe", "deepseek_v3"];

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

/// Qwen3 (dense): `Qwen3ForCausalLM`.
pub fn qwen3() -> Registry {
    build("qwen3", q3::mapping_rules())
}

/// Qwen3-MoE: `Qwen3MoeForCausalLM` (dense layers from `mlp_only_layers` included).
pub fn qwen3_moe() -> Registry {
    build("qwen3_moe", q3m::mapping_rules())
}

/// DeepSeek-V3: `DeepseekV3ForCausalLM`, MLA attention, shared experts, router bias kept F32 on
/// export, and MTP layers (`model.layers.{N+j}`) whose copies of `embed_tokens` and
/// `shared_head.head` are ignored (they are the main model's tensors, re-emitted on export).
pub fn deepseek_v3() -> Registry {
    build("deepseek_v3", ds::mapping_rules())
}

/// The table for `model_type`; [`BridgeError::UnknownModelType`] (naming `path`) otherwise.
pub fn for_model_type(model_type: &str, path: &Path) -> Result<Registry, BridgeError> {
    match model_type {
        "qwen3" => Ok(qwen3()),
        "qwen3_moe" => Ok(qwen3_moe()),
        "deepseek_v3" => Ok(deepseek_v3()),
        other => Err(BridgeError::UnknownModelType {
            path: path.to_path_buf(),
            model_type: other.to_owned(),
            known: KNOWN_MODEL_TYPES.join(", "),
        }),
    }
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
