use std::path::PathBuf;
use std::time::{Duration, Instant};

use moe_bridge::fp8::DEFAULT_BLOCK_SIZE;
use moe_bridge::hf::HfCheckpoint;
use moe_bridge::mapping::HfRole;
use moe_bridge::mxfp4::{BLOCKS_SUFFIX, SCALES_SUFFIX, mxfp4_base};
use serde_json::Value;

use super::*;
use crate::families::{Family, FamilyConfig, FamilyVisitor, visit_family};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// Every fixture's tensors are exactly the required ones (plus allowed optional ones),
/// with the implied shapes; an MXFP4 pair stands for its weight, its blocks
/// `[.., out, G, 16]` and scales `[.., out, G]` decoding to the table's `[.., out, G·32]`.
#[test]
fn fixtures_match_their_config_tables() {
    for name in [
        "qwen3",
        "qwen3_sliding",
        "qwen3_moe",
        "qwen3_moe_bf16",
        "deepseek_v3",
        "deepseek_v3_sharded",
        "deepseek_v3_fp8",
        "deepseek_v3_fp8_dequant",
        "glm4_moe",
        "mixtral",
        "gpt_oss",
        "gpt_oss_mxfp4",
    ] {
        let dir = fixtures().join(name);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let ckpt = HfCheckpoint::open(&dir).unwrap();
        let block = ckpt.fp8_block_size().unwrap();
        let path = dir.join("config.json");
        let table = expected_hf_tensors(&config, ExpertLayout::PerExpert, &path, block).unwrap();
        let mut pairs = 0;
        for (n, want) in &table {
            if !want.required || ckpt.contains(n) {
                continue;
            }
            let blocks = format!("{n}{BLOCKS_SUFFIX}");
            let scales = format!("{n}{SCALES_SUFFIX}");
            let stored = (want.mxfp4.as_ref()).unwrap_or_else(|| panic!("{name}: {n} missing"));
            let (b, s) = (
                &ckpt.info(&blocks).unwrap().shape,
                &ckpt.info(&scales).unwrap().shape,
            );
            let [lead @ .., out, groups, 16] = b.as_slice() else {
                panic!("{name}: {blocks} of shape {b:?}");
            };
            assert_eq!(
                [lead, &[*out, groups * 32]].concat(),
                *stored,
                "{name}: {blocks}"
            );
            assert_eq!([lead, &[*out, *groups]].concat(), *s, "{name}: {scales}");
            pairs += 1;
        }
        assert_eq!(
            pairs > 0,
            name == "gpt_oss_mxfp4",
            "{name}: {pairs} MXFP4 pairs"
        );
        for n in ckpt.tensor_names() {
            if mxfp4_base(n).is_some_and(|base| table.get(base).is_some_and(|w| w.mxfp4.is_some()))
            {
                continue;
            }
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

/// The table of family `F` for a `config.json` text (parsed and validated, not bounded).
struct Table<'a>(&'a str);

impl FamilyVisitor for Table<'_> {
    type Output = Result<Result<ExpectedTable, BridgeError>, ModelError>;
    fn visit<F: Family>(self) -> Self::Output {
        let config = F::Config::from_json_str(self.0)?;
        Ok(F::expected_tensors(
            &config,
            ExpertLayout::PerExpert,
            Path::new("config.json"),
            DEFAULT_BLOCK_SIZE,
        ))
    }
}

use crate::ModelError;

/// An absurd config of every family (10¹² layers, 10⁹ experts, a hidden × vocabulary product
/// or a head count that overflows) is refused by the table, fast, before any model of it is
/// built, as an [`BridgeError::InvalidConfig`] naming the field.
#[test]
fn absurd_sizes_are_config_errors_not_overflows() {
    let layers_of = |family: &str| match family {
        "deepseek_v3" | "glm4_moe" => "num_hidden_layers/num_nextn_predict_layers",
        _ => "num_hidden_layers",
    };
    let experts_of = |family: &str| match family {
        "qwen3_moe" => Some("num_experts"),
        "deepseek_v3" | "glm4_moe" => Some("n_routed_experts"),
        "mixtral" | "gpt_oss" => Some("num_local_experts"),
        _ => None,
    };
    let (mut tabled, mut validated) = (0, 0);
    for family in [
        "qwen3",
        "qwen3_moe",
        "deepseek_v3",
        "glm4_moe",
        "mixtral",
        "gpt_oss",
    ] {
        let text = std::fs::read_to_string(fixtures().join(family).join("config.json")).unwrap();
        let mut base: Value = serde_json::from_str(&text).unwrap();
        // Per-layer lists would contradict the layer counts below.
        if let Some(map) = base.as_object_mut() {
            map.remove("layer_types");
        }
        let heads = match family {
            "deepseek_v3" => "qk_nope_head_dim",
            _ => "head_dim",
        };
        let mut cases: Vec<(Vec<(&str, Value)>, &str)> = vec![
            (
                vec![("num_hidden_layers", Value::from(1u64 << 40))],
                layers_of(family),
            ),
            (
                vec![("num_hidden_layers", Value::from(1_000_000_000_000u64))],
                layers_of(family),
            ),
            (
                vec![("hidden_size", Value::from(1u64 << 30))],
                "hidden_size",
            ),
            (
                vec![("vocab_size", Value::from(usize::MAX as u64 / 2))],
                "vocab_size",
            ),
            (vec![(heads, Value::from(usize::MAX as u64 / 4))], heads),
            (
                // Every size plausible on its own, their products not.
                vec![
                    ("hidden_size", Value::from(1u64 << 24)),
                    ("vocab_size", Value::from(1u64 << 24)),
                    ("intermediate_size", Value::from(1u64 << 24)),
                ],
                "not plausible",
            ),
        ];
        if let Some(experts) = experts_of(family) {
            let key = if family == "qwen3_moe" {
                "num_experts"
            } else {
                experts
            };
            cases.push((vec![(key, Value::from(1_000_000_000u64))], experts));
            cases.push((
                vec![
                    (key, Value::from(1u64 << 20)),
                    ("num_hidden_layers", Value::from(64)),
                ],
                experts,
            ));
        }
        for (edits, needle) in cases {
            let mut config = base.clone();
            for (key, value) in &edits {
                config[*key] = value.clone();
            }
            let start = Instant::now();
            let result = visit_family(family, Table(&config.to_string())).unwrap();
            let elapsed = start.elapsed();
            let what = format!("{family} {edits:?}");
            let table = match result {
                Ok(table) => table,
                Err(err) => {
                    // Refused by the config's own parsing (a per-layer list of that many
                    // layers), naming the field, fast: as good.
                    let field = needle.split('/').next().unwrap_or(needle);
                    assert!(err.to_string().contains(field), "{what}: {err}");
                    assert!(elapsed < Duration::from_secs(10), "{what}: {elapsed:?}");
                    validated += 1;
                    continue;
                }
            };
            tabled += 1;
            let err = table.expect_err(&what);
            assert!(
                matches!(err, BridgeError::InvalidConfig { .. }),
                "{what}: {err}"
            );
            assert!(err.to_string().contains(needle), "{what}: {err}");
            assert!(elapsed < Duration::from_secs(10), "{what}: {elapsed:?}");
        }
    }
    // The table, not the configs' own checks, refuses nearly all of them.
    assert!(
        tabled >= 40 && tabled + validated == 46,
        "{tabled} by the table, {validated} by validation"
    );
}
