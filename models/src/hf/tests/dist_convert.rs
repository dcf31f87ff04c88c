//! HF ↔ distributed conversion and resharding (moe-bridge's `dist::convert`) of the models'
//! fixtures.

use std::path::{Path, PathBuf};

use moe_backend::parallel::ParallelLayout;
use moe_bridge::dist::convert::*;
use moe_bridge::dist::{DistCheckpoint, TensorBox, TensorKind};
use moe_bridge::export::ExportOptions;
use moe_bridge::fp8::OutDtype;
use moe_bridge::hf::{CONFIG_FILE, HfCheckpoint, read_json};
use moe_bridge::safetensors::Dtype;

use crate::hf::ModelConfig;
use moe_backend::testing::TempDir;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

/// Every tensor of `a` is in `b` with the same dtype, shape and bytes, and vice versa.
fn assert_same_tensors(a: &Path, b: &Path) {
    let (a, b) = (
        HfCheckpoint::open(a).unwrap(),
        HfCheckpoint::open(b).unwrap(),
    );
    let names_a: Vec<&str> = a.tensor_names().collect();
    let names_b: Vec<&str> = b.tensor_names().collect();
    assert_eq!(names_a, names_b);
    for name in names_a {
        let (x, y) = (a.tensor(name).unwrap(), b.tensor(name).unwrap());
        assert_eq!((x.dtype, x.shape), (y.dtype, y.shape), "{name}");
        assert!(x.bytes == y.bytes, "{name}: bytes differ");
    }
}

fn round_trip(source: &str, reference: &str, layout: &str) {
    let dir = TempDir::new("dist-convert");
    let layout = ParallelLayout::parse_spec(layout).unwrap();
    let mut calls = Vec::new();
    let saved = convert_hf_to_dist_with::<ModelConfig>(
        &fixture(source),
        &dir.join("ckpt"),
        &layout,
        7,
        &mut |p| calls.push((p.done, p.total)),
    )
    .unwrap();
    assert_eq!(saved, dir.join("ckpt").join("iter_0000007"));
    assert!(calls.last().is_some_and(|(d, t)| d == t && *t > 0));
    let ckpt = DistCheckpoint::open::<ModelConfig>(dir.join("ckpt")).unwrap();
    ckpt.validate::<ModelConfig>().unwrap();
    assert!(ckpt.index().tensors.values().all(|e| !e.hf.is_empty()));
    // Resharding to another layout keeps every tensor.
    let other = ParallelLayout::parse_spec("world=2,tp=2,etp=2").unwrap();
    let resharded = reshard::<ModelConfig>(&ckpt, &dir.join("resharded"), &other).unwrap();
    let again = DistCheckpoint::open::<ModelConfig>(&resharded).unwrap();
    again.validate::<ModelConfig>().unwrap();
    assert_eq!(again.index().layout.tp, 2);
    for fqn in ckpt.index().tensors.keys() {
        assert_eq!(
            ckpt.read_tensor(fqn).unwrap(),
            again.read_tensor(fqn).unwrap()
        );
    }
    let out = dir.join("hf");
    let summary = export_dist_to_hf::<ModelConfig>(&ckpt, &out, &ExportOptions::default()).unwrap();
    assert_eq!(summary.target, out);
    assert_same_tensors(&fixture(reference), &out);
    let config = read_json(&out.join(CONFIG_FILE)).unwrap();
    assert!(config.get("quantization_config").is_none());
}

#[test]
fn qwen3_round_trips_bit_exactly() {
    round_trip("qwen3", "qwen3", "world=4,tp=2");
}

#[test]
fn qwen3_moe_round_trips_bit_exactly() {
    round_trip("qwen3_moe", "qwen3_moe", "world=4,tp=2,ep=4");
    round_trip("qwen3_moe", "qwen3_moe", "world=8,tp=2,ep=2,etp=2");
}

#[test]
fn deepseek_v3_round_trips_bit_exactly() {
    round_trip("deepseek_v3", "deepseek_v3", "world=8,tp=2,ep=4,etp=2");
    round_trip("deepseek_v3_sharded", "deepseek_v3_sharded", "world=2,pp=2");
}

/// HF FP8 → distributed (FP8 kept) → resharded → HF FP8: every byte of every tensor, scales
/// included, and the `quantization_config` come back unchanged.
#[test]
fn fp8_source_round_trips_bit_exactly_in_fp8() {
    let dir = TempDir::new("dist-convert-fp8");
    let layout = ParallelLayout::parse_spec("world=4,tp=2,ep=2").unwrap();
    convert_hf_to_dist::<ModelConfig>(&fixture("deepseek_v3_fp8"), &dir.join("ckpt"), &layout)
        .unwrap();
    let ckpt = DistCheckpoint::open::<ModelConfig>(dir.join("ckpt")).unwrap();
    ckpt.validate::<ModelConfig>().unwrap();
    let index = ckpt.index();
    assert_eq!(
        index.fp8.as_ref().map(|r| r.weight_block_size),
        Some([16, 16])
    );
    let experts = "model.layers.1.mlp.experts.gate_up_proj";
    assert_eq!(ckpt.entry(experts).unwrap().dtype, Dtype::F8E4M3);
    let scale = ckpt.entry(&format!("{experts}_scale_inv")).unwrap();
    assert_eq!(scale.kind, TensorKind::Scale);
    assert_eq!(scale.global_shape, vec![8, 2, 2, 4]);
    assert_eq!(
        ckpt.entry("model.layers.0.self_attn.o_proj.weight_scale_inv")
            .unwrap()
            .global_shape,
        vec![4, 4]
    );
    let other = ParallelLayout::parse_spec("world=8,tp=2,ep=4,etp=2").unwrap();
    let resharded = reshard::<ModelConfig>(&ckpt, &dir.join("resharded"), &other).unwrap();
    let again = DistCheckpoint::open::<ModelConfig>(&resharded).unwrap();
    again.validate::<ModelConfig>().unwrap();
    let out = dir.join("hf");
    export_dist_to_hf::<ModelConfig>(&again, &out, &ExportOptions::default()).unwrap();
    assert_same_tensors(&fixture("deepseek_v3_fp8"), &out);
    let source = read_json(&fixture("deepseek_v3_fp8").join(CONFIG_FILE)).unwrap();
    let config = read_json(&out.join(CONFIG_FILE)).unwrap();
    assert_eq!(
        config.get("quantization_config"),
        source.get("quantization_config")
    );
}

/// FP8 weights kept in the checkpoint dequantise like the release on export (BF16) and on any
/// box read (global block coordinates); converting with dequantisation stores the same BF16.
#[test]
fn fp8_source_exports_the_reference_dequantisation() {
    let dir = TempDir::new("dist-convert-fp8-dequant");
    let layout = ParallelLayout::parse_spec("world=4,tp=2,ep=2").unwrap();
    convert_hf_to_dist::<ModelConfig>(&fixture("deepseek_v3_fp8"), &dir.join("fp8"), &layout)
        .unwrap();
    let ckpt = DistCheckpoint::open::<ModelConfig>(dir.join("fp8")).unwrap();
    let opts = ExportOptions {
        dtype: Some(Dtype::BF16),
        ..ExportOptions::default()
    };
    let summary = export_dist_to_hf::<ModelConfig>(&ckpt, &dir.join("hf"), &opts).unwrap();
    assert!(summary.dropped.iter().any(|d| d.ends_with("_scale_inv")));
    assert_same_tensors(&fixture("deepseek_v3_fp8_dequant"), &dir.join("hf"));
    let config = read_json(&dir.join("hf").join(CONFIG_FILE)).unwrap();
    assert!(config.get("quantization_config").is_none());
    // A box crossing block boundaries of experts 3..5, up_proj rows 5..25, cols 7..37, equals
    // the same slice of the release dequantisation (exact f32).
    let hf = HfCheckpoint::open(fixture("deepseek_v3_fp8")).unwrap();
    let b = TensorBox::new(vec![3, 1, 5, 7], vec![2, 1, 20, 30]);
    let got = ckpt
        .read_box_dequantized("model.layers.1.mlp.experts.gate_up_proj", &b, OutDtype::F32)
        .unwrap()
        .to_f32_vec()
        .unwrap();
    let mut want = Vec::new();
    for e in 3..5 {
        let name = format!("model.layers.1.mlp.experts.{e}.up_proj.weight");
        let full = hf.read_dequantized(&name, OutDtype::F32).unwrap();
        let (v, cols) = (full.to_f32_vec().unwrap(), full.shape[1]);
        for r in 5..25 {
            want.extend_from_slice(&v[r * cols + 7..r * cols + 37]);
        }
    }
    assert_eq!(got, want);
    // Dequantising at conversion instead stores BF16 and exports the same tensors.
    let opts = ConvertOptions {
        step: 0,
        keep_fp8: false,
    };
    convert_hf_to_dist_opts::<ModelConfig>(
        &fixture("deepseek_v3_fp8"),
        &dir.join("bf16"),
        &layout,
        &opts,
        &mut |_| {},
    )
    .unwrap();
    let bf16 = DistCheckpoint::open::<ModelConfig>(dir.join("bf16")).unwrap();
    assert!(bf16.index().fp8.is_none());
    assert!(
        bf16.index()
            .tensors
            .keys()
            .all(|k| !k.ends_with("_scale_inv"))
    );
    export_dist_to_hf::<ModelConfig>(&bf16, &dir.join("hf2"), &ExportOptions::default()).unwrap();
    assert_same_tensors(&fixture("deepseek_v3_fp8_dequant"), &dir.join("hf2"));
}

#[test]
fn experts_are_read_per_expert_and_reshard() {
    // The stacked expert tensor of a layer equals the stack of the HF experts, and any EP/ETP
    // box reads back from a checkpoint saved under another layout.
    let dir = TempDir::new("dist-convert-experts");
    let layout = ParallelLayout::parse_spec("world=4,ep=4").unwrap();
    convert_hf_to_dist::<ModelConfig>(&fixture("qwen3_moe"), dir.path(), &layout).unwrap();
    let ckpt = DistCheckpoint::open::<ModelConfig>(dir.path()).unwrap();
    let hf = HfCheckpoint::open(fixture("qwen3_moe")).unwrap();
    let fqn = "model.layers.1.mlp.experts.gate_up_proj";
    let entry = ckpt.entry(fqn).unwrap();
    assert_eq!(entry.chunks.len(), 4);
    let [e, parts, im, h] = entry.global_shape[..] else {
        panic!("rank-4 expert tensor expected");
    };
    assert_eq!(parts, 2);
    let b = TensorBox::new(vec![3, 0, im / 2, 0], vec![2, 2, im / 2, h]);
    let got = ckpt.read_box(fqn, &b).unwrap();
    let elem = got.dtype.size();
    let row = h * elem;
    for (i, expert) in (3..5).enumerate() {
        for (p, proj) in ["gate_proj", "up_proj"].into_iter().enumerate() {
            let name = format!("model.layers.1.mlp.experts.{expert}.{proj}.weight");
            let src = hf.tensor(&name).unwrap();
            let want = &src.bytes[(im / 2) * row..];
            let at = (i * 2 + p) * (im / 2) * row;
            assert_eq!(&got.bytes[at..at + want.len()], want, "{name}");
        }
    }
    assert!(e >= 5);
}
