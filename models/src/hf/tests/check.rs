//! [`HfCheckpoint::check`] (moe-bridge) on the models' fixtures.

use std::path::{Path, PathBuf};

use moe_bridge::BridgeError;
use moe_bridge::hf::{CONFIG_FILE, HfCheckpoint, INDEX_FILE, SINGLE_FILE};
use moe_bridge::safetensors::{Dtype, OwnedTensor, TensorView, write_safetensors};

use crate::hf::ModelConfig;
use moe_backend::testing::TempDir;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

/// The tensors of fixture `name`, owned.
fn tensors(name: &str) -> Vec<OwnedTensor> {
    let ckpt = HfCheckpoint::open(fixture(name)).unwrap();
    ckpt.tensor_names()
        .map(|n| ckpt.tensor(n).unwrap().to_owned_tensor())
        .collect()
}

/// A single-file checkpoint of `tensors` with fixture `config_of`'s config.
fn write_single(dir: &Path, config_of: &str, tensors: &[OwnedTensor]) {
    let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
    write_safetensors(&dir.join(SINGLE_FILE), &views).unwrap();
    std::fs::copy(fixture(config_of).join(CONFIG_FILE), dir.join(CONFIG_FILE)).unwrap();
}

#[test]
fn every_fixture_passes_without_warnings() {
    for name in [
        "qwen3",
        "qwen3_moe",
        "qwen3_moe_bf16",
        "deepseek_v3",
        "deepseek_v3_sharded",
        "deepseek_v3_fp8",
        "deepseek_v3_fp8_dequant",
    ] {
        let report = HfCheckpoint::open(fixture(name))
            .unwrap()
            .check::<ModelConfig>()
            .unwrap();
        assert!(report.unused.is_empty(), "{name}: {:?}", report.unused);
        assert!(report.warnings.is_empty(), "{name}: {:?}", report.warnings);
        assert_eq!(
            report.expert_layout.is_some(),
            report.config.experts().is_some(),
            "{name}"
        );
    }
}

#[test]
fn integer_weights_are_dtype_errors_and_unused_tensors_warnings() {
    let tmp = TempDir::new("check-dtype");
    let mut ts = tensors("qwen3");
    let norm = ts
        .iter_mut()
        .find(|t| t.name == "model.norm.weight")
        .unwrap();
    norm.dtype = Dtype::I32;
    write_single(tmp.path(), "qwen3", &ts);
    let err = HfCheckpoint::open(tmp.path())
        .unwrap()
        .check::<ModelConfig>()
        .unwrap_err();
    assert!(matches!(err, BridgeError::DtypeMismatch { .. }), "{err}");
    assert!(err.to_string().contains("model.norm.weight"), "{err}");
    // Nor is it widened value by value when read directly.
    let err = HfCheckpoint::open(tmp.path())
        .unwrap()
        .read_f32("model.norm.weight")
        .unwrap_err();
    assert!(matches!(err, BridgeError::DtypeMismatch { .. }), "{err}");

    let mut ts = tensors("qwen3");
    ts.push(
        OwnedTensor::from_f32(
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            vec![2],
            &[1.0, 2.0],
        )
        .unwrap(),
    );
    ts.push(
        OwnedTensor::from_f32("model.layers.9.input_layernorm.weight", vec![1], &[1.0]).unwrap(),
    );
    write_single(tmp.path(), "qwen3", &ts);
    let report = HfCheckpoint::open(tmp.path())
        .unwrap()
        .check::<ModelConfig>()
        .unwrap();
    assert_eq!(report.unused.len(), 2);
    assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
    assert!(report.warnings[0].contains("rotary_emb.inv_freq"));
}

#[test]
fn missing_and_mis_shaped_weights_name_the_tensor() {
    let tmp = TempDir::new("check-shape");
    let mut ts = tensors("qwen3_moe");
    ts.retain(|t| t.name != "model.layers.0.mlp.up_proj.weight");
    write_single(tmp.path(), "qwen3_moe", &ts);
    let err = HfCheckpoint::open(tmp.path())
        .unwrap()
        .check::<ModelConfig>()
        .unwrap_err();
    assert!(matches!(err, BridgeError::MissingWeight { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("model.layers.0.mlp.up_proj.weight")
    );

    let mut ts = tensors("qwen3_moe");
    let gate = ts
        .iter_mut()
        .find(|t| t.name == "model.layers.2.mlp.gate.weight")
        .unwrap();
    gate.shape = vec![64, 8];
    write_single(tmp.path(), "qwen3_moe", &ts);
    let err = HfCheckpoint::open(tmp.path())
        .unwrap()
        .check::<ModelConfig>()
        .unwrap_err();
    assert!(matches!(err, BridgeError::ConfigMismatch { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("mlp.gate.weight") && text.contains("config.json"),
        "{text}"
    );
}

#[test]
fn fp8_without_scale_warns_and_wrong_scale_shape_fails() {
    let tmp = TempDir::new("check-fp8");
    let mut ts = tensors("deepseek_v3_fp8");
    ts.retain(|t| t.name != "model.layers.0.mlp.up_proj.weight_scale_inv");
    write_single(tmp.path(), "deepseek_v3_fp8", &ts);
    let report = HfCheckpoint::open(tmp.path())
        .unwrap()
        .check::<ModelConfig>()
        .unwrap();
    assert!(
        report
            .warnings
            .iter()
            .any(|w| w.contains("value-cast") && w.contains("model.layers.0.mlp.up_proj.weight")),
        "{:?}",
        report.warnings
    );

    let mut ts = tensors("deepseek_v3_fp8");
    let scale = ts
        .iter_mut()
        .find(|t| t.name == "model.layers.0.mlp.up_proj.weight_scale_inv")
        .unwrap();
    scale.shape = vec![4, 8];
    write_single(tmp.path(), "deepseek_v3_fp8", &ts);
    let err = HfCheckpoint::open(tmp.path())
        .unwrap()
        .check::<ModelConfig>()
        .unwrap_err();
    assert!(
        err.to_string().contains("up_proj.weight_scale_inv"),
        "{err}"
    );
}

#[test]
fn ambiguous_shard_sets_name_the_tensor_and_files() {
    let tmp = TempDir::new("check-shards");
    let dir = tmp.path();
    let ts = tensors("qwen3");
    let (a, b) = ts.split_at(ts.len() / 2);
    let write = |file: &str, part: &[OwnedTensor]| {
        let views: Vec<TensorView<'_>> = part.iter().map(OwnedTensor::view).collect();
        write_safetensors(&dir.join(file), &views).unwrap();
    };
    std::fs::copy(fixture("qwen3").join(CONFIG_FILE), dir.join(CONFIG_FILE)).unwrap();
    let index = |map: &[(&str, &str)]| {
        let weight_map: serde_json::Map<String, serde_json::Value> = map
            .iter()
            .map(|(t, f)| ((*t).to_owned(), (*f).into()))
            .collect();
        let text = serde_json::json!({ "weight_map": weight_map }).to_string();
        std::fs::write(dir.join(INDEX_FILE), text).unwrap();
    };
    let mut map: Vec<(&str, &str)> = a
        .iter()
        .map(|t| (t.name.as_str(), "s1.safetensors"))
        .collect();
    map.extend(b.iter().map(|t| (t.name.as_str(), "s2.safetensors")));
    write("s1.safetensors", a);
    write("s2.safetensors", b);
    index(&map);
    HfCheckpoint::open(dir)
        .unwrap()
        .check::<ModelConfig>()
        .unwrap();

    // A tensor of s1 copied into s2 as well.
    let mut b2 = b.to_vec();
    b2.push(a[0].clone());
    write("s2.safetensors", &b2);
    let err = HfCheckpoint::open(dir)
        .unwrap()
        .check::<ModelConfig>()
        .unwrap_err();
    assert!(
        matches!(err, BridgeError::TensorInTwoShards { .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&a[0].name)
            && text.contains("s1.safetensors")
            && text.contains("s2.safetensors"),
        "{text}"
    );
    write("s2.safetensors", b);

    // An index entry dropped.
    index(&map[1..]);
    let err = HfCheckpoint::open(dir)
        .unwrap()
        .check::<ModelConfig>()
        .unwrap_err();
    assert!(matches!(err, BridgeError::UnindexedTensor { .. }), "{err}");
    assert!(err.to_string().contains(&a[0].name));

    // An index entry naming the wrong shard.
    let mut wrong = map.clone();
    wrong[0].1 = "s2.safetensors";
    index(&wrong);
    let err = HfCheckpoint::open(dir)
        .unwrap()
        .check::<ModelConfig>()
        .unwrap_err();
    assert!(
        matches!(err, BridgeError::IndexedTensorMissing { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("s2.safetensors"));
}
