//! HF → HF export (moe-bridge's [`export_hf`]) of the models' fixtures.

use std::path::{Path, PathBuf};

use moe_bridge::BridgeError;
use moe_bridge::export::*;
use moe_bridge::fp8::{OutDtype, is_scale_inv};
use moe_bridge::hf::{CONFIG_FILE, HfCheckpoint, INDEX_FILE};
use moe_bridge::mapping::{ExpertLayout, read_canonical};
use moe_bridge::safetensors::{Dtype, OwnedTensor, TensorView, write_hf_checkpoint};
use serde_json::{Value, json};

use crate::hf::ModelConfig;
use crate::hf::mapping::for_family;
use crate::qwen3_moe::Qwen3Moe;
use moe_backend::testing::TempDir;

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

fn fixture(name: &str) -> HfCheckpoint {
    HfCheckpoint::open(fixture_dir(name)).unwrap()
}

fn assert_same_tensors(a: &HfCheckpoint, b: &HfCheckpoint) {
    assert_eq!(
        a.tensor_names().collect::<Vec<_>>(),
        b.tensor_names().collect::<Vec<_>>()
    );
    for n in a.tensor_names() {
        let (x, y) = (a.tensor(n).unwrap(), b.tensor(n).unwrap());
        assert_eq!((x.dtype, x.shape), (y.dtype, y.shape), "{n}");
        assert!(x.bytes == y.bytes, "{n}: bytes differ");
    }
}

#[test]
fn parses_shard_sizes() {
    assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
    assert_eq!(parse_size("500MB"), Ok(500_000_000));
    assert_eq!(parse_size("2GiB"), Ok(2 << 30));
    assert_eq!(parse_size(" 1024 "), Ok(1024));
    assert_eq!(parse_size("10kb"), Ok(10_000));
    assert!(parse_size("GB").is_err() && parse_size("5XB").is_err());
    assert!(parse_size("99999999999TB").is_err());
}

#[test]
fn export_then_reload_is_bit_identical() {
    for name in ["qwen3", "qwen3_moe", "deepseek_v3"] {
        let src = fixture(name);
        let tmp = TempDir::new("export-rt");
        let opts = ExportOptions {
            max_shard_size: 100_000,
            ..ExportOptions::default()
        };
        let summary = export_hf::<ModelConfig>(&src, &tmp.join("out"), &opts).unwrap();
        assert!(summary.shards > 1, "{name}");
        assert!(summary.dropped.is_empty(), "{name}: {:?}", summary.dropped);
        let out = HfCheckpoint::open(&summary.target).unwrap();
        assert_same_tensors(&src, &out);
        assert_eq!(
            out.config_json().unwrap(),
            src.config_json().unwrap(),
            "{name}"
        );
        assert!(out.generation_config_json().unwrap().is_some());
        let index = read_json_value(&summary.target.join(INDEX_FILE));
        assert_eq!(index["metadata"]["total_size"], json!(summary.total_size));
    }
}

fn read_json_value(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn fp8_export_is_bf16_without_scales_or_quantization_config() {
    let src = fixture("deepseek_v3_fp8");
    let reference = fixture("deepseek_v3_fp8_dequant");
    let tmp = TempDir::new("export-fp8");
    let summary =
        export_hf::<ModelConfig>(&src, &tmp.join("out"), &ExportOptions::default()).unwrap();
    assert_eq!(summary.shards, 1);
    assert!(summary.dropped.iter().all(|n| is_scale_inv(n)));
    assert!(!summary.dropped.is_empty());
    let out = HfCheckpoint::open(&summary.target).unwrap();
    assert!(out.tensor_names().all(|n| !is_scale_inv(n)));
    assert_same_tensors(&reference, &out);
    let config = out.config_json().unwrap();
    assert!(config.get("quantization_config").is_none());
    assert_eq!(config["dtype"], "bfloat16");
    // The source has no generation_config.json: the default one is written.
    let generation = out.generation_config_json().unwrap().unwrap();
    assert_eq!(generation["_from_model_config"], true);
}

#[test]
fn bf16_export_keeps_the_router_bias_f32() {
    let src = fixture("deepseek_v3");
    let tmp = TempDir::new("export-bf16");
    let opts = ExportOptions {
        dtype: Some(Dtype::BF16),
        ..ExportOptions::default()
    };
    let out = HfCheckpoint::open(
        export_hf::<ModelConfig>(&src, &tmp.join("o"), &opts)
            .unwrap()
            .target,
    )
    .unwrap();
    for n in out.tensor_names() {
        let t = out.tensor(n).unwrap();
        let want = if n.ends_with("e_score_correction_bias") {
            Dtype::F32
        } else {
            Dtype::BF16
        };
        assert_eq!(t.dtype, want, "{n}");
        let source = src.tensor(n).unwrap().to_owned_tensor();
        assert_eq!(t.bytes, source.cast(want).unwrap().bytes.as_slice(), "{n}");
    }
    assert_eq!(out.config_json().unwrap()["dtype"], "bfloat16");
    let bad = ExportOptions {
        dtype: Some(Dtype::I32),
        ..ExportOptions::default()
    };
    assert!(export_hf::<ModelConfig>(&src, &tmp.join("bad"), &bad).is_err());
}

#[test]
fn tied_head_is_dropped_and_extra_files_copied() {
    let tmp = TempDir::new("export-tied");
    let src_dir = tmp.join("src");
    let ckpt = fixture("qwen3");
    // Add an lm_head that the tied config makes redundant, and a tokenizer file.
    let mut tensors: Vec<OwnedTensor> = ckpt
        .tensor_names()
        .map(|n| ckpt.tensor(n).unwrap().to_owned_tensor())
        .collect();
    let mut head = ckpt
        .tensor("model.embed_tokens.weight")
        .unwrap()
        .to_owned_tensor();
    head.name = "lm_head.weight".into();
    tensors.push(head);
    let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
    write_hf_checkpoint(&src_dir, &views, 1 << 30, false).unwrap();
    let config = ckpt.config_json().unwrap();
    assert_eq!(config["tie_word_embeddings"], true);
    std::fs::write(src_dir.join(CONFIG_FILE), config.to_string()).unwrap();
    std::fs::write(src_dir.join("tokenizer.json"), "{\"version\": \"1.0\"}").unwrap();
    let src = HfCheckpoint::open(&src_dir).unwrap();
    let summary =
        export_hf::<ModelConfig>(&src, &tmp.join("out"), &ExportOptions::default()).unwrap();
    assert_eq!(summary.dropped, ["lm_head.weight"]);
    let out = HfCheckpoint::open(&summary.target).unwrap();
    assert!(!out.contains("lm_head.weight"));
    assert_eq!(out.len(), ckpt.len());
    let tokenizer = std::fs::read_to_string(summary.target.join("tokenizer.json")).unwrap();
    assert_eq!(tokenizer, "{\"version\": \"1.0\"}");
    // The target exists now: exporting again needs `overwrite`.
    let err =
        export_hf::<ModelConfig>(&src, &summary.target, &ExportOptions::default()).unwrap_err();
    assert!(matches!(err, BridgeError::TargetExists { .. }));
    let again = ExportOptions {
        overwrite: true,
        ..ExportOptions::default()
    };
    export_hf::<ModelConfig>(&src, &summary.target, &again).unwrap();
}

#[test]
fn stacked_source_exports_per_expert_names() {
    let src = fixture("qwen3_moe");
    let registry = for_family::<Qwen3Moe>();
    let tmp = TempDir::new("export-fused");
    // Rewrite the fixture with HF in-memory stacked expert tensors.
    let mut tensors: Vec<OwnedTensor> = Vec::new();
    for n in src.tensor_names().filter(|n| !n.contains(".experts.")) {
        tensors.push(src.tensor(n).unwrap().to_owned_tensor());
    }
    for layer in 1..3 {
        for proj in ["gate_up_proj", "down_proj"] {
            let canon = format!("model.layers.{layer}.mlp.experts.{proj}");
            let per = ExpertLayout::PerExpert;
            let mut t = read_canonical(&src, &registry, &canon, 8, per, OutDtype::F32).unwrap();
            if proj == "gate_up_proj" {
                t.shape = vec![t.shape[0], t.shape[1] * t.shape[2], t.shape[3]];
            }
            tensors.push(t);
        }
    }
    let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
    let stacked_dir = write_hf_checkpoint(&tmp.join("stacked"), &views, 1 << 30, false).unwrap();
    std::fs::copy(
        fixture_dir("qwen3_moe").join(CONFIG_FILE),
        stacked_dir.join(CONFIG_FILE),
    )
    .unwrap();
    let stacked = HfCheckpoint::open(&stacked_dir).unwrap();
    let summary =
        export_hf::<ModelConfig>(&stacked, &tmp.join("out"), &ExportOptions::default()).unwrap();
    let out = HfCheckpoint::open(&summary.target).unwrap();
    assert_same_tensors(&src, &out);
}

#[test]
fn mtp_copies_are_emitted_on_request() {
    let src = fixture("deepseek_v3");
    let tmp = TempDir::new("export-mtp");
    let opts = ExportOptions {
        emit_mtp_copies: true,
        ..ExportOptions::default()
    };
    let out = HfCheckpoint::open(
        export_hf::<ModelConfig>(&src, &tmp.join("o"), &opts)
            .unwrap()
            .target,
    )
    .unwrap();
    assert_eq!(out.len(), src.len() + 2);
    let copy = out.tensor("model.layers.3.embed_tokens.weight").unwrap();
    assert_eq!(
        copy.bytes,
        src.tensor("model.embed_tokens.weight").unwrap().bytes
    );
    let head = out
        .tensor("model.layers.3.shared_head.head.weight")
        .unwrap();
    assert_eq!(head.bytes, src.tensor("lm_head.weight").unwrap().bytes);
}

#[test]
fn unknown_model_type_is_a_clear_error() {
    let tmp = TempDir::new("export-unknown");
    let dir = tmp.join("src");
    let src = fixture("qwen3");
    let t = src.tensor("model.norm.weight").unwrap();
    write_hf_checkpoint(&dir, &[t], 1 << 20, false).unwrap();
    std::fs::write(dir.join(CONFIG_FILE), r#"{"model_type": "llama"}"#).unwrap();
    let ckpt = HfCheckpoint::open(&dir).unwrap();
    let err =
        export_hf::<ModelConfig>(&ckpt, &tmp.join("out"), &ExportOptions::default()).unwrap_err();
    assert!(matches!(err, BridgeError::UnknownModelType { .. }), "{err}");
    assert!(err.to_string().contains("llama"));
    assert!(!tmp.join("out").exists());
}

/// The API's MXFP4 export: `mxfp4` with `dtype` `None` packs gpt-oss's dense experts into the
/// release's pairs (their shapes: `[E, out, in/32, 16]`, `[E, out, in/32]`), writes every other
/// float tensor in BF16 and the plan's `quantization_config`; a reference without `mxfp4`, and
/// `mxfp4` for a family with no MXFP4 tensors, are refused by field and name before anything
/// is written.
#[test]
fn mxfp4_export_packs_the_release_tensors_and_refuses_other_families() {
    let tmp = TempDir::new("mxfp4-export");
    let opts = ExportOptions {
        mxfp4: true,
        ..ExportOptions::default()
    };
    let src = fixture("gpt_oss");
    let out = HfCheckpoint::open(
        export_hf::<ModelConfig>(&src, &tmp.join("o"), &opts)
            .unwrap()
            .target,
    )
    .unwrap();
    let release = fixture("gpt_oss_mxfp4");
    for name in release.tensor_names() {
        let (got, want) = (out.tensor(name).unwrap(), release.tensor(name).unwrap());
        assert_eq!((got.dtype, got.shape), (want.dtype, want.shape), "{name}");
    }
    assert_eq!(out.tensor_names().count(), release.tensor_names().count());
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.join("o").join(CONFIG_FILE)).unwrap())
            .unwrap();
    assert_eq!(
        config["quantization_config"],
        release.config_json().unwrap()["quantization_config"]
    );
    assert_eq!(config["dtype"], "bfloat16");

    let reference_only = ExportOptions {
        mxfp4_reference: Some(fixture_dir("gpt_oss_mxfp4")),
        ..ExportOptions::default()
    };
    let err = export_hf::<ModelConfig>(&src, &tmp.join("r"), &reference_only).unwrap_err();
    assert!(
        matches!(&err, BridgeError::InvalidConfig { field, .. } if field == "mxfp4_reference"),
        "{err}"
    );
    let err = export_hf::<ModelConfig>(&fixture("qwen3_moe"), &tmp.join("q"), &opts).unwrap_err();
    assert!(
        err.to_string().contains("`qwen3_moe` has no MXFP4 tensors"),
        "{err}"
    );
    assert!(!tmp.join("q").exists() && !tmp.join("r").exists());
}
