use std::collections::BTreeMap;
use std::path::PathBuf;

use super::*;
use crate::deepseek_v3::DeepseekV3;
use crate::qwen3::Qwen3;
use crate::qwen3_moe::Qwen3Moe;
use moe_bridge::hf::HfCheckpoint;
use moe_bridge::mapping::{
    CaptureKind, Captures, ExpectedTensor, ExpertLayout, HfTarget, LoadReport, RuleKind,
};
use moe_bridge::safetensors::Dtype;

fn all() -> Vec<Registry> {
    vec![
        for_family::<Qwen3>(),
        for_family::<Qwen3Moe>(),
        for_family::<DeepseekV3>(),
    ]
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// A concrete name for a pattern: `*` → 3, `**` → `a.b`, `{e}` → 5.
fn sample_captures(kinds: &[CaptureKind]) -> Captures {
    Captures {
        values: kinds
            .iter()
            .map(|k| match k {
                CaptureKind::Digits => "3".to_owned(),
                CaptureKind::Any => "a.b".to_owned(),
            })
            .collect(),
        expert: Some(5),
    }
}

#[test]
fn hf_to_canon_to_hf_is_the_identity_for_every_rule() {
    for registry in all() {
        for (i, rule) in registry.rules().iter().enumerate() {
            for (part, pattern) in rule.hf_patterns().into_iter().enumerate() {
                let hf = pattern
                    .fill(&sample_captures(&pattern.capture_kinds()))
                    .unwrap();
                let resolved = registry.hf_to_canon(&hf).unwrap();
                let ctx = format!("{} rule {i} ({hf})", registry.name());
                assert_eq!(resolved.rule, i, "{ctx}: shadowed by an earlier rule");
                let layout = match rule.kind {
                    RuleKind::Ignore { .. } => {
                        assert!(matches!(resolved.target, HfTarget::Ignored { .. }), "{ctx}");
                        continue;
                    }
                    RuleKind::FusedExperts { .. } => ExpertLayout::Stacked,
                    _ => ExpertLayout::PerExpert,
                };
                let canon = resolved.target.canon().unwrap();
                let back = registry.canon_to_hf(canon, 8, layout).unwrap();
                assert_eq!(back.rule, i, "{ctx}");
                let (expert, want_part) = match &resolved.target {
                    HfTarget::ExpertSlice { expert, part, .. } => (Some(*expert), *part),
                    _ => (None, None),
                };
                if let RuleKind::StackExperts { hf_parts, .. } = &rule.kind {
                    assert_eq!(expert, Some(5), "{ctx}");
                    assert_eq!(want_part, (hf_parts.len() > 1).then_some(part), "{ctx}");
                    assert_eq!(back.pieces.len(), 8 * hf_parts.len(), "{ctx}");
                } else {
                    assert_eq!(back.pieces.len(), 1, "{ctx}");
                }
                let piece = back.pieces.iter().find(|p| p.hf == hf);
                let piece = piece.unwrap_or_else(|| panic!("{ctx}: not reproduced"));
                assert_eq!((piece.expert, piece.part), (expert, want_part), "{ctx}");
            }
        }
    }
}

#[test]
fn model_types_resolve_and_unknown_is_an_error() {
    let p = std::path::Path::new("m/config.json");
    for &t in KNOWN_MODEL_TYPES {
        assert_eq!(for_model_type(t, p).unwrap().name(), t);
    }
    let err = for_model_type("llama", p).unwrap_err();
    assert!(matches!(err, BridgeError::UnknownModelType { .. }));
    assert!(err.to_string().contains("llama") && err.to_string().contains("m/config.json"));
    assert!(for_config(&serde_json::json!({"model_type": 3}), p).is_err());
    let ok = for_config(&serde_json::json!({"model_type": "deepseek_v3"}), p).unwrap();
    assert_eq!(ok.name(), "deepseek_v3");
}

#[test]
fn deepseek_specifics() {
    let r = for_family::<DeepseekV3>();
    let bias = r
        .hf_to_canon("model.layers.4.mlp.gate.e_score_correction_bias")
        .unwrap();
    assert!(matches!(
        bias.target,
        HfTarget::Direct {
            export_dtype: Some(Dtype::F32),
            ..
        }
    ));
    for ignored in [
        "model.layers.61.embed_tokens.weight",
        "model.layers.61.shared_head.head.weight",
        "model.layers.3.mlp.experts.7.up_proj.weight_scale_inv",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
    ] {
        let t = r.hf_to_canon(ignored).unwrap().target;
        assert!(matches!(t, HfTarget::Ignored { .. }), "{ignored}");
    }
    let kept = r
        .hf_to_canon("model.layers.61.shared_head.norm.weight")
        .unwrap();
    assert_eq!(
        kept.target.canon(),
        Some("model.layers.61.shared_head.norm.weight")
    );
    assert!(
        r.hf_to_canon("model.layers.0.self_attn.q_norm.weight")
            .is_none()
    );
    assert!(
        for_family::<Qwen3>()
            .hf_to_canon("model.layers.0.mlp.experts.0.up_proj.weight")
            .is_none()
    );
}

/// Expected canonical tensors of a checkpoint, from its own per-expert HF shapes and
/// `num_experts`.
fn expectations(
    ckpt: &HfCheckpoint,
    registry: &Registry,
    num_experts: usize,
) -> BTreeMap<String, ExpectedTensor> {
    let mut out = BTreeMap::new();
    for name in ckpt.tensor_names() {
        let info = ckpt.info(name).unwrap();
        let Some(resolved) = registry.hf_to_canon(name) else {
            continue;
        };
        let shape = match &resolved.target {
            HfTarget::Direct { .. } => info.shape.clone(),
            HfTarget::ExpertSlice { part: Some(_), .. } => {
                [vec![num_experts, 2], info.shape.clone()].concat()
            }
            HfTarget::ExpertSlice { part: None, .. } => {
                [vec![num_experts], info.shape.clone()].concat()
            }
            _ => continue,
        };
        let canon = resolved.target.canon().unwrap().to_owned();
        out.insert(
            canon,
            ExpectedTensor {
                shape,
                dtype: Some(info.dtype),
            },
        );
    }
    out
}

fn entries(ckpt: &HfCheckpoint) -> Vec<(&str, Dtype, &[usize])> {
    ckpt.tensor_names()
        .map(|n| {
            let info = ckpt.info(n).unwrap();
            (n, info.dtype, info.shape.as_slice())
        })
        .collect()
}

#[test]
fn fixtures_map_completely() {
    for (dir, experts) in [
        ("qwen3", 0),
        ("qwen3_moe", 8),
        ("deepseek_v3", 8),
        ("deepseek_v3_fp8", 8),
    ] {
        let ckpt = HfCheckpoint::open(fixtures().join(dir)).unwrap();
        let path = ckpt.dir().join("config.json");
        let registry = for_config(&ckpt.config_json().unwrap(), &path).unwrap();
        let mut expected = expectations(&ckpt, &registry, experts);
        let report = LoadReport::build(&registry, entries(&ckpt), &expected, ckpt.dir()).unwrap();
        assert!(report.is_clean(), "{dir}: {report}");
        assert_eq!(report.layout.is_some(), experts > 0, "{dir}");
        if dir == "deepseek_v3_fp8" {
            assert!(!report.ignored.is_empty());
        }
        // A canonical tensor the model expects but the checkpoint lacks is missing.
        expected.insert(
            "model.layers.9.input_layernorm.weight".into(),
            ExpectedTensor {
                shape: vec![64],
                dtype: None,
            },
        );
        let report = LoadReport::build(&registry, entries(&ckpt), &expected, ckpt.dir()).unwrap();
        assert_eq!(
            report.missing,
            ["model.layers.9.input_layernorm.weight"],
            "{dir}"
        );
        let err = report.into_strict(ckpt.dir()).unwrap_err();
        assert!(err.to_string().contains("missing (1)"), "{err}");
    }
}

#[test]
fn report_finds_every_kind_of_problem() {
    let ckpt = HfCheckpoint::open(fixtures().join("qwen3_moe")).unwrap();
    let registry = for_family::<Qwen3Moe>();
    let mut expected = expectations(&ckpt, &registry, 8);
    let gate_up = "model.layers.1.mlp.experts.gate_up_proj";
    let im_h = expected[gate_up].shape[2..].to_vec();
    let mut hf = entries(&ckpt);
    // Drop one expert's up projection: the stacked tensor is missing.
    hf.retain(|(n, _, _)| *n != "model.layers.1.mlp.experts.3.up_proj.weight");
    // An unknown key, a key for a layer the model lacks, an out-of-range expert, a bad shape.
    let wrong = [9usize, 9];
    hf.push(("model.layers.0.mlp.mystery.weight", Dtype::F32, &[2]));
    hf.push(("model.layers.7.input_layernorm.weight", Dtype::F32, &[64]));
    hf.push((
        "model.layers.1.mlp.experts.8.up_proj.weight",
        Dtype::F32,
        &im_h,
    ));
    hf.push((
        "model.layers.1.mlp.experts.03.gate_proj.weight",
        Dtype::F32,
        &im_h,
    ));
    hf.push(("model.norm.weight", Dtype::F32, &wrong));
    expected.get_mut("lm_head.weight").unwrap().dtype = Some(Dtype::BF16);
    let report = LoadReport::build(&registry, hf, &expected, ckpt.dir()).unwrap();
    assert_eq!(report.missing, [gate_up]);
    assert_eq!(
        report.unexpected,
        [
            "model.layers.0.mlp.mystery.weight",
            "model.layers.7.input_layernorm.weight"
        ]
    );
    let mismatched: Vec<&str> = report.mismatched.iter().map(|m| m.hf.as_str()).collect();
    assert!(mismatched.contains(&"model.layers.1.mlp.experts.8.up_proj.weight"));
    assert!(mismatched.contains(&"model.norm.weight"));
    assert!(mismatched.contains(&"lm_head.weight"));
    // `experts.03` and `experts.3` are the same expert.
    assert_eq!(report.duplicate.len(), 2, "{report}");
    assert!(!report.is_clean());
}

#[test]
fn stacked_layout_and_mixed_layouts() {
    let registry = for_family::<Qwen3Moe>();
    let mut expected = BTreeMap::new();
    let gate_up = "model.layers.1.mlp.experts.gate_up_proj";
    let down = "model.layers.1.mlp.experts.down_proj";
    expected.insert(
        gate_up.to_owned(),
        ExpectedTensor {
            shape: vec![4, 2, 3, 5],
            dtype: None,
        },
    );
    expected.insert(
        down.to_owned(),
        ExpectedTensor {
            shape: vec![4, 5, 3],
            dtype: None,
        },
    );
    let (s1, s2) = ([4usize, 6, 5], [4usize, 5, 3]);
    let hf = vec![
        (gate_up, Dtype::BF16, &s1[..]),
        (down, Dtype::BF16, &s2[..]),
    ];
    let report = LoadReport::build(&registry, hf.clone(), &expected, Path::new("c")).unwrap();
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.layout, Some(ExpertLayout::Stacked));
    let bad = [4usize, 3, 5];
    let hf_bad = vec![
        (gate_up, Dtype::BF16, &bad[..]),
        (down, Dtype::BF16, &s2[..]),
    ];
    let report = LoadReport::build(&registry, hf_bad, &expected, Path::new("c")).unwrap();
    assert_eq!(report.mismatched.len(), 1);
    let mut mixed = hf;
    let piece = [3usize, 5];
    mixed.push((
        "model.layers.1.mlp.experts.0.up_proj.weight",
        Dtype::BF16,
        &piece,
    ));
    let err = LoadReport::build(&registry, mixed, &expected, Path::new("c")).unwrap_err();
    assert!(
        matches!(err, BridgeError::MixedExpertLayout { .. }),
        "{err}"
    );
}
