//! moe-bridge's mapping conversion (`read_canonical`, `canonical_to_hf`, …) through the
//! models' tables, on their fixtures.

use std::path::PathBuf;

use moe_bridge::BridgeError;
use moe_bridge::fp8::{OutDtype, is_scale_inv};
use moe_bridge::hf::HfCheckpoint;
use moe_bridge::mapping::*;
use moe_bridge::safetensors::{Dtype, OwnedTensor, TensorView, write_hf_checkpoint};

use crate::deepseek_v3::DeepseekV3;
use crate::hf::mapping::for_family;
use crate::qwen3_moe::Qwen3Moe;
use moe_backend::testing::TempDir;

fn fixture(name: &str) -> HfCheckpoint {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name);
    HfCheckpoint::open(dir).unwrap()
}

const GATE_UP: &str = "model.layers.1.mlp.experts.gate_up_proj";
const DOWN: &str = "model.layers.1.mlp.experts.down_proj";

/// Every canonical tensor of `ckpt`, read in the per-expert layout.
fn canonical(ckpt: &HfCheckpoint, registry: &Registry, out: OutDtype) -> Vec<OwnedTensor> {
    canonical_tensors(registry, ckpt.tensor_names())
        .into_iter()
        .map(|(canon, experts)| {
            let e = experts.unwrap_or(0);
            read_canonical(ckpt, registry, &canon, e, ExpertLayout::PerExpert, out).unwrap()
        })
        .collect()
}

#[test]
fn stacks_per_expert_tensors() {
    let ckpt = fixture("qwen3_moe");
    let registry = for_family::<Qwen3Moe>();
    let inventory = canonical_tensors(&registry, ckpt.tensor_names());
    assert_eq!(inventory[GATE_UP], Some(8));
    assert_eq!(inventory["model.norm.weight"], None);
    let gate_up = read_canonical(
        &ckpt,
        &registry,
        GATE_UP,
        8,
        ExpertLayout::PerExpert,
        OutDtype::BF16,
    )
    .unwrap();
    let up3 = ckpt
        .tensor("model.layers.1.mlp.experts.3.up_proj.weight")
        .unwrap();
    let (im, h) = (up3.shape[0], up3.shape[1]);
    assert_eq!(gate_up.shape, vec![8, 2, im, h]);
    let chunk = up3.bytes.len();
    assert_eq!(
        &gate_up.bytes[(3 * 2 + 1) * chunk..(3 * 2 + 2) * chunk],
        up3.bytes
    );
    let down = read_canonical(
        &ckpt,
        &registry,
        DOWN,
        8,
        ExpertLayout::PerExpert,
        OutDtype::BF16,
    )
    .unwrap();
    assert_eq!(down.shape, vec![8, h, im]);
    // One EP rank's box: experts 2..5 only.
    let part = read_canonical_experts(
        &ckpt,
        &registry,
        GATE_UP,
        8,
        ExpertLayout::PerExpert,
        2..5,
        OutDtype::BF16,
    )
    .unwrap();
    assert_eq!(part.shape, vec![3, 2, im, h]);
    assert_eq!(part.bytes, gate_up.bytes[2 * 2 * chunk..5 * 2 * chunk]);
    let err = read_canonical_experts(
        &ckpt,
        &registry,
        GATE_UP,
        8,
        ExpertLayout::PerExpert,
        6..9,
        OutDtype::BF16,
    );
    assert!(err.is_err());
}

#[test]
fn hf_canonical_hf_round_trip_is_bit_identical() {
    for (name, registry) in [
        ("qwen3_moe", for_family::<Qwen3Moe>()),
        ("deepseek_v3", for_family::<DeepseekV3>()),
    ] {
        let ckpt = fixture(name);
        let mut exported: Vec<OwnedTensor> = Vec::new();
        for t in canonical(&ckpt, &registry, OutDtype::BF16) {
            exported.extend(canonical_to_hf(&registry, &t, None).unwrap());
        }
        exported.sort_by(|a, b| a.name.cmp(&b.name));
        let names: Vec<&str> = exported.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ckpt.tensor_names().collect::<Vec<_>>(), "{name}");
        let tmp = TempDir::new("convert-rt");
        let views: Vec<TensorView<'_>> = exported.iter().map(OwnedTensor::view).collect();
        let out = write_hf_checkpoint(&tmp.join("out"), &views, 50_000, false).unwrap();
        let reloaded = HfCheckpoint::open(out).unwrap();
        assert!(reloaded.is_sharded());
        assert_eq!(reloaded.len(), ckpt.len());
        for n in ckpt.tensor_names() {
            let (a, b) = (ckpt.tensor(n).unwrap(), reloaded.tensor(n).unwrap());
            assert_eq!(
                (a.dtype, a.shape, a.bytes),
                (b.dtype, b.shape, b.bytes),
                "{name}: {n}"
            );
        }
    }
}

#[test]
fn fp8_source_exports_bf16_without_scales() {
    let fp8 = fixture("deepseek_v3_fp8");
    let reference = fixture("deepseek_v3_fp8_dequant");
    let registry = for_family::<DeepseekV3>();
    let mut exported = Vec::new();
    for t in canonical(&fp8, &registry, OutDtype::BF16) {
        exported.extend(canonical_to_hf(&registry, &t, Some(Dtype::BF16)).unwrap());
    }
    assert!(exported.iter().all(|t| !is_scale_inv(&t.name)));
    assert_eq!(exported.len(), reference.len());
    for t in &exported {
        let want = reference.tensor(&t.name).unwrap();
        assert_eq!(
            (t.dtype, t.shape.as_slice()),
            (want.dtype, want.shape),
            "{}",
            t.name
        );
        assert!(t.bytes == want.bytes, "{}", t.name);
    }
    // The router bias keeps its F32 export dtype even when BF16 is asked for.
    let bias = exported
        .iter()
        .find(|t| t.name.ends_with("e_score_correction_bias"))
        .unwrap();
    assert_eq!(bias.dtype, Dtype::F32);
}

#[test]
fn fused_layout_reads_back_to_the_same_canonical_tensor() {
    let ckpt = fixture("qwen3_moe");
    let registry = for_family::<Qwen3Moe>();
    let per = ExpertLayout::PerExpert;
    let gate_up = read_canonical(&ckpt, &registry, GATE_UP, 8, per, OutDtype::BF16).unwrap();
    let down = read_canonical(&ckpt, &registry, DOWN, 8, per, OutDtype::BF16).unwrap();
    // HF in-memory layout: gate_up [E, 2·Im, H], down [E, H, Im].
    let s = &gate_up.shape;
    let fused_shape = vec![s[0], s[1] * s[2], s[3]];
    let fused =
        OwnedTensor::new(GATE_UP, gate_up.dtype, fused_shape, gate_up.bytes.clone()).unwrap();
    let tmp = TempDir::new("convert-fused");
    let out =
        write_hf_checkpoint(&tmp.join("o"), &[fused.view(), down.view()], 1 << 30, false).unwrap();
    let stacked = HfCheckpoint::open(out).unwrap();
    let layout = registry
        .detect_layout(stacked.tensor_names(), stacked.dir())
        .unwrap();
    assert_eq!(layout, Some(ExpertLayout::Stacked));
    let st = ExpertLayout::Stacked;
    let back = read_canonical(&stacked, &registry, GATE_UP, 8, st, OutDtype::BF16).unwrap();
    assert_eq!(back, gate_up);
    let back = read_canonical(&stacked, &registry, DOWN, 8, st, OutDtype::BF16).unwrap();
    assert_eq!(back, down);
    let part =
        read_canonical_experts(&stacked, &registry, GATE_UP, 8, st, 1..3, OutDtype::BF16).unwrap();
    let chunk = gate_up.bytes.len() / 8;
    assert_eq!(part.bytes, gate_up.bytes[chunk..3 * chunk]);
}

#[test]
fn bad_canonical_tensors_are_errors() {
    let registry = for_family::<Qwen3Moe>();
    let wrong_parts = OwnedTensor::new(GATE_UP, Dtype::U8, vec![2, 3, 1, 1], vec![0; 6]).unwrap();
    assert!(matches!(
        canonical_to_hf(&registry, &wrong_parts, None),
        Err(BridgeError::ShapeMismatch { .. })
    ));
    let unknown = OwnedTensor::new("model.mystery", Dtype::U8, vec![1], vec![0]).unwrap();
    let err = canonical_to_hf(&registry, &unknown, None).unwrap_err();
    assert!(err.to_string().contains("model.mystery"));
    let ckpt = fixture("qwen3_moe");
    let err = read_canonical(
        &ckpt,
        &registry,
        "model.mystery",
        0,
        ExpertLayout::PerExpert,
        OutDtype::BF16,
    )
    .unwrap_err();
    assert!(matches!(err, BridgeError::TensorNotFound { .. }));
    // Asking for more experts than the checkpoint has names the first missing HF tensor.
    let err = read_canonical(
        &ckpt,
        &registry,
        DOWN,
        9,
        ExpertLayout::PerExpert,
        OutDtype::BF16,
    )
    .unwrap_err();
    assert!(err.to_string().contains("experts.8.down_proj"), "{err}");
}
