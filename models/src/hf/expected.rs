//! The HF tensors a model's `config.json` implies: name, shape and role of every tensor the model
//! loads (docs/models.md §HF tensor names), per family
//! ([`Family::expected_tensors`](crate::families::Family::expected_tensors)), with the optional
//! FP8 `*_scale_inv` companions of every matrix
//! (docs/checkpoints.md §FP8 release format) and DeepSeek-V3's MTP layers.
//!
//! This is the shape source of checkpoint validation ([`HfCheckpoint::check`]): a weight the
//! table requires must be present with exactly this shape; a tensor the table does not list is
//! one the model does not use.
//!
//! Shapes are computed with checked arithmetic and the table is bounded
//! ([`MAX_TENSORS`](moe_bridge::mapping::MAX_TENSORS),
//! [`MAX_ELEMENTS`](moe_bridge::mapping::MAX_ELEMENTS)) by moe-bridge's
//! [`ExpectedBuilder`](moe_bridge::mapping::ExpectedBuilder), so
//! an absurd config is an error rather than an overflow, a huge allocation or a hang.
//!
//! The tables are built in each family's plan file (`families/<family>/plan.rs`,
//! shared Llama-family names in [`crate::param_plan::hf_names`]), which spell the names.
//!
//! [`HfCheckpoint::check`]: moe_bridge::hf::HfCheckpoint::check

use std::path::Path;

use moe_bridge::BridgeError;
use moe_bridge::mapping::{ExpectedTable, ExpertLayout};

use super::load::ModelConfig;

/// The HF tensors `config` implies (its family's [`Family::expected_tensors`](crate::family::Family::expected_tensors)).
pub fn expected_hf_tensors(
    config: &ModelConfig,
    layout: ExpertLayout,
    path: &Path,
    block: [usize; 2],
) -> Result<ExpectedTable, BridgeError> {
    config.expected_hf_tensors(layout, path, block)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use moe_bridge::fp8::DEFAULT_BLOCK_SIZE;
    use moe_bridge::hf::HfCheckpoint;
    use moe_bridge::mapping::HfRole;

    use super::*;
    use crate::Qwen3Config;
    use crate::families::qwen3::plan::qwen3_expected;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
    }

    /// Every fixture's tensors are exactly the required ones (plus allowed optional ones),
    /// with the implied shapes.
    #[test]
    fn fixtures_match_their_config_tables() {
        for name in [
            "qwen3",
            "qwen3_moe",
            "qwen3_moe_bf16",
            "deepseek_v3",
            "deepseek_v3_sharded",
            "deepseek_v3_fp8",
            "deepseek_v3_fp8_dequant",
        ] {
            let dir = fixtures().join(name);
            let config = ModelConfig::from_dir(&dir).unwrap();
            let ckpt = HfCheckpoint::open(&dir).unwrap();
            let block = ckpt.fp8_block_size().unwrap();
            let path = dir.join("config.json");
            let table =
                expected_hf_tensors(&config, ExpertLayout::PerExpert, &path, block).unwrap();
            for (n, want) in &table {
                if want.required {
                    assert!(ckpt.contains(n), "{name}: {n} missing");
                }
            }
            for n in ckpt.tensor_names() {
                let want = table
                    .get(n)
                    .unwrap_or_else(|| panic!("{name}: {n} unexpected"));
                assert_eq!(ckpt.info(n).unwrap().shape, want.shape, "{name}: {n}");
            }
        }
    }

    #[test]
    fn stacked_layout_and_scales() {
        let dir = fixtures().join("qwen3_moe");
        let config = ModelConfig::from_dir(&dir).unwrap();
        let path = dir.join("config.json");
        let t = expected_hf_tensors(&config, ExpertLayout::Stacked, &path, [16, 16]).unwrap();
        assert_eq!(
            t["model.layers.1.mlp.experts.gate_up_proj"].shape,
            [8, 32, 64]
        );
        assert_eq!(t["model.layers.2.mlp.experts.down_proj"].shape, [8, 64, 16]);
        let scale = &t["model.layers.2.mlp.experts.down_proj_scale_inv"];
        assert_eq!(scale.shape, [8, 4, 1]);
        assert_eq!(scale.role, HfRole::ScaleInv);
        assert!(!scale.required);
        assert!(!t.contains_key("model.layers.1.mlp.experts.0.up_proj.weight"));
        assert!(!t.contains_key("model.layers.0.mlp.gate.weight"));
        assert_eq!(t["model.layers.0.mlp.up_proj.weight"].shape, [64, 64]);
    }

    #[test]
    fn absurd_sizes_are_config_errors_not_overflows() {
        let path = Path::new("config.json");
        let huge = Qwen3Config {
            num_attention_heads: usize::MAX / 2,
            num_key_value_heads: 1,
            head_dim: 4,
            ..Qwen3Config::default()
        };
        let err = qwen3_expected(&huge, path, DEFAULT_BLOCK_SIZE).unwrap_err();
        assert!(matches!(err, BridgeError::InvalidConfig { .. }), "{err}");
        let layers = Qwen3Config {
            num_hidden_layers: 1 << 40,
            ..Qwen3Config::default()
        };
        let err = qwen3_expected(&layers, path, DEFAULT_BLOCK_SIZE).unwrap_err();
        assert!(err.to_string().contains("num_hidden_layers"), "{err}");
        let wide = Qwen3Config {
            hidden_size: 1 << 30,
            intermediate_size: 1 << 30,
            ..Qwen3Config::default()
        };
        let err = qwen3_expected(&wide, path, DEFAULT_BLOCK_SIZE).unwrap_err();
        assert!(err.to_string().contains("not plausible"), "{err}");
    }
}
