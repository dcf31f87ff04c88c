//! Per-model mapping tables: Qwen3 (dense), Qwen3-MoE and DeepSeek-V3 (models.md §6), as
//! rules of moe-bridge's name-mapping engine ([`Registry`], [`Rule`]).
//!
//! Every table lists the HF names explicitly (no catch-all), so a key no rule knows is reported
//! as unexpected. Canonical names equal HF names except routed experts, which are stacked per
//! layer into `mlp.experts.gate_up_proj [E, 2, Im, H]` and `mlp.experts.down_proj [E, H, Im]`
//! (checkpoints.md §3).

use std::path::Path;

use moe_bridge::BridgeError;
use moe_bridge::mapping::{Registry, Rule};
use moe_bridge::safetensors::Dtype;
use serde_json::Value;

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

/// Embeddings, final norm and LM head.
fn top_level() -> Vec<Rule> {
    [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    .into_iter()
    .map(Rule::same)
    .collect()
}

/// `model.layers.*.<suffix>` for each suffix, HF name = canonical name.
fn per_layer(suffixes: &[&str]) -> Vec<Rule> {
    suffixes
        .iter()
        .map(|s| Rule::same(&format!("model.layers.*.{s}")))
        .collect()
}

/// Per-expert and stacked routed-expert rules (both layouts; one is chosen per checkpoint).
fn routed_experts() -> Vec<Rule> {
    let gate_up = "model.layers.*.mlp.experts.gate_up_proj";
    let down = "model.layers.*.mlp.experts.down_proj";
    vec![
        Rule::stack_experts(
            gate_up,
            &[
                "model.layers.*.mlp.experts.{e}.gate_proj.weight",
                "model.layers.*.mlp.experts.{e}.up_proj.weight",
            ],
        ),
        Rule::stack_experts(down, &["model.layers.*.mlp.experts.{e}.down_proj.weight"]),
        Rule::fused_experts(gate_up, gate_up, Some(2)),
        Rule::fused_experts(down, down, None),
    ]
}

const NORMS: [&str; 2] = ["input_layernorm.weight", "post_attention_layernorm.weight"];

const QWEN3_ATTENTION: [&str; 10] = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
];

const DENSE_MLP: [&str; 3] = [
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

fn build(name: &str, groups: Vec<Vec<Rule>>) -> Registry {
    let rules = groups.into_iter().flatten().collect();
    // The tables are fixed and covered by tests; a failure here is a programming error.
    Registry::new(name, rules).unwrap_or_else(|e| panic!("built-in mapping table: {e}"))
}

/// Qwen3 (dense): `Qwen3ForCausalLM`.
pub fn qwen3() -> Registry {
    build(
        "qwen3",
        vec![
            ignores(),
            top_level(),
            per_layer(&NORMS),
            per_layer(&QWEN3_ATTENTION),
            per_layer(&DENSE_MLP),
        ],
    )
}

/// Qwen3-MoE: `Qwen3MoeForCausalLM` (dense layers from `mlp_only_layers` included).
pub fn qwen3_moe() -> Registry {
    build(
        "qwen3_moe",
        vec![
            ignores(),
            top_level(),
            per_layer(&NORMS),
            per_layer(&QWEN3_ATTENTION),
            per_layer(&["mlp.gate.weight"]),
            routed_experts(),
            per_layer(&DENSE_MLP),
        ],
    )
}

/// DeepSeek-V3: `DeepseekV3ForCausalLM`, MLA attention, shared experts, router bias kept F32 on
/// export, and MTP layers (`model.layers.{N+j}`) whose copies of `embed_tokens` and
/// `shared_head.head` are ignored (they are the main model's tensors, re-emitted on export).
pub fn deepseek_v3() -> Registry {
    build(
        "deepseek_v3",
        vec![
            ignores(),
            vec![
                Rule::ignore(
                    "model.layers.*.embed_tokens.weight",
                    "MTP copy of model.embed_tokens.weight",
                ),
                Rule::ignore(
                    "model.layers.*.shared_head.head.weight",
                    "MTP copy of lm_head.weight",
                ),
            ],
            top_level(),
            per_layer(&NORMS),
            per_layer(&[
                "self_attn.q_a_proj.weight",
                "self_attn.q_a_layernorm.weight",
                "self_attn.q_b_proj.weight",
                "self_attn.q_proj.weight",
                "self_attn.kv_a_proj_with_mqa.weight",
                "self_attn.kv_a_layernorm.weight",
                "self_attn.kv_b_proj.weight",
                "self_attn.o_proj.weight",
                // With `attention_bias`.
                "self_attn.q_a_proj.bias",
                "self_attn.kv_a_proj_with_mqa.bias",
                "self_attn.o_proj.bias",
            ]),
            per_layer(&["mlp.gate.weight"]),
            vec![Rule::same_as_dtype(
                "model.layers.*.mlp.gate.e_score_correction_bias",
                Dtype::F32,
            )],
            routed_experts(),
            per_layer(&[
                "mlp.shared_experts.gate_proj.weight",
                "mlp.shared_experts.up_proj.weight",
                "mlp.shared_experts.down_proj.weight",
            ]),
            per_layer(&DENSE_MLP),
            per_layer(&[
                "enorm.weight",
                "hnorm.weight",
                "eh_proj.weight",
                "shared_head.norm.weight",
            ]),
        ],
    )
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
