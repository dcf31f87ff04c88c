use std::path::PathBuf;

use super::*;
use crate::safetensors::Dtype;
use crate::test_util::{TempDir, reference_file};

/// Writes a safetensors file with the reference crate: F32 tensors named `names`, each `[2]`
/// holding `[i, i]` for its position `i`.
fn write_shard(path: &Path, names: &[&str]) {
    use safetensors::tensor::TensorView as Ref;
    let data: Vec<Vec<u8>> = (0..names.len())
        .map(|i| {
            [i as f32, i as f32]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        })
        .collect();
    let views: Vec<(&str, Ref<'_>)> = names
        .iter()
        .zip(&data)
        .map(|(n, d)| (*n, Ref::new(safetensors::Dtype::F32, vec![2], d).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn sharded_dir(tag: &str) -> TempDir {
    let dir = TempDir::new(tag);
    write_shard(&dir.join("model-00001-of-00002.safetensors"), &["a", "b"]);
    write_shard(&dir.join("model-00002-of-00002.safetensors"), &["c"]);
    std::fs::write(
        dir.join(INDEX_FILE),
        r#"{"metadata": {"total_size": 24}, "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    dir
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

#[test]
fn opens_single_file_checkpoints() {
    let dir = TempDir::new("hf-single");
    std::fs::write(dir.join(SINGLE_FILE), reference_file()).unwrap();
    std::fs::write(dir.join(CONFIG_FILE), r#"{"model_type": "qwen3"}"#).unwrap();
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    assert!(!ckpt.is_sharded());
    assert_eq!(ckpt.tensor_names().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(
        ckpt.tensor("b").unwrap().to_f32_vec().unwrap(),
        vec![1.0, -2.0]
    );
    assert_eq!(ckpt.config_json().unwrap()["model_type"], "qwen3");
    assert!(ckpt.generation_config_json().unwrap().is_none());
    assert!(matches!(
        ckpt.tensor("zz"),
        Err(BridgeError::TensorNotFound { .. })
    ));
    assert!(ckpt.verify().unwrap().is_empty());
}

#[test]
fn opens_sharded_checkpoints_lazily() {
    let dir = sharded_dir("hf-sharded");
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    assert!(ckpt.is_sharded());
    assert_eq!(ckpt.len(), 3);
    assert_eq!(ckpt.shard_paths().len(), 2);
    assert!(ckpt.shards.iter().all(|s| s.get().is_none()));
    assert_eq!(
        ckpt.tensor("c").unwrap().to_f32_vec().unwrap(),
        vec![0.0, 0.0]
    );
    assert!(ckpt.shards[0].get().is_none() && ckpt.shards[1].get().is_some());
    assert_eq!(
        ckpt.tensor("b").unwrap().to_f32_vec().unwrap(),
        vec![1.0, 1.0]
    );
    assert_eq!(ckpt.info("a").unwrap().dtype, Dtype::F32);
    assert!(
        ckpt.file_of("c")
            .unwrap()
            .ends_with("model-00002-of-00002.safetensors")
    );
    assert!(ckpt.verify().unwrap().is_empty());
    // config.json is absent: a clear I/O error naming it.
    let err = ckpt.config_json().unwrap_err();
    assert!(err.to_string().contains("config.json"));
    assert!(ckpt.config_json_opt().unwrap().is_none());
}

#[test]
fn missing_shard_is_named() {
    let dir = sharded_dir("hf-missing-shard");
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let err = HfCheckpoint::open(dir.path()).unwrap_err();
    assert!(matches!(err, BridgeError::MissingShard { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("model-00002-of-00002.safetensors") && msg.contains("`c`"),
        "{msg}"
    );
}

#[test]
fn index_naming_a_tensor_its_shard_lacks() {
    let dir = sharded_dir("hf-lacking");
    std::fs::write(
        dir.join(INDEX_FILE),
        r#"{"weight_map": {"a": "model-00001-of-00002.safetensors",
                           "x": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    let err = ckpt.tensor("x").unwrap_err();
    assert!(matches!(err, BridgeError::TensorNotFound { .. }));
    assert!(err.to_string().contains("model-00002-of-00002.safetensors"));
    assert!(ckpt.verify().is_err());
}

#[test]
fn verify_reports_tensors_missing_from_the_index() {
    let dir = sharded_dir("hf-unlisted");
    std::fs::write(
        dir.join(INDEX_FILE),
        r#"{"weight_map": {"a": "model-00001-of-00002.safetensors",
                           "c": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    let unlisted = ckpt.verify().unwrap();
    assert_eq!(unlisted.len(), 1);
    assert_eq!(unlisted[0].1, "b");
}

#[test]
fn malformed_index_and_empty_dirs() {
    let dir = sharded_dir("hf-bad-index");
    std::fs::write(dir.join(INDEX_FILE), r#"{"weight_map": "nope"}"#).unwrap();
    let err = HfCheckpoint::open(dir.path()).unwrap_err();
    assert!(matches!(err, BridgeError::InvalidIndex { .. }), "{err}");
    let empty = TempDir::new("hf-empty");
    assert!(matches!(
        HfCheckpoint::open(empty.path()),
        Err(BridgeError::NoCheckpoint { .. })
    ));
    std::fs::write(empty.join(SINGLE_FILE), reference_file()).unwrap();
    std::fs::write(empty.join(CONFIG_FILE), "{not json").unwrap();
    let ckpt = HfCheckpoint::open(empty.path()).unwrap();
    assert!(matches!(
        ckpt.config_json(),
        Err(BridgeError::InvalidJson { .. })
    ));
}

#[test]
fn truncated_shard_fails_on_first_use() {
    let dir = sharded_dir("hf-trunc");
    let shard = dir.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 4]).unwrap();
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    assert!(ckpt.tensor("a").is_ok());
    let err = ckpt.tensor("c").unwrap_err();
    assert!(
        err.to_string().contains("model-00002-of-00002.safetensors"),
        "{err}"
    );
}

#[test]
fn sharded_fixture_matches_single_file_fixture() {
    let single = HfCheckpoint::open(fixtures().join("deepseek_v3")).unwrap();
    let sharded = HfCheckpoint::open(fixtures().join("deepseek_v3_sharded")).unwrap();
    assert!(sharded.is_sharded());
    assert!(sharded.verify().unwrap().is_empty());
    assert_eq!(
        single.tensor_names().collect::<Vec<_>>(),
        sharded.tensor_names().collect::<Vec<_>>()
    );
    for name in single.tensor_names() {
        let (a, b) = (single.tensor(name).unwrap(), sharded.tensor(name).unwrap());
        assert_eq!(
            (a.dtype, a.shape, a.bytes),
            (b.dtype, b.shape, b.bytes),
            "{name}"
        );
    }
    assert_eq!(sharded.config_json().unwrap()["model_type"], "deepseek_v3");
    assert!(sharded.generation_config_json().unwrap().is_some());
}

#[test]
fn wrong_dtype_or_shape_expectations_name_file_and_tensor() {
    let dir = sharded_dir("hf-expect");
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    assert!(
        ckpt.tensor_expect("a", Some(Dtype::F32), Some(&[2]))
            .is_ok()
    );
    let err = ckpt
        .tensor_expect("c", Some(Dtype::BF16), None)
        .unwrap_err();
    assert!(matches!(err, BridgeError::DtypeMismatch { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("model-00002-of-00002.safetensors") && msg.contains("`c`"),
        "{msg}"
    );
    let err = ckpt.tensor_expect("a", None, Some(&[3, 2])).unwrap_err();
    assert!(matches!(err, BridgeError::ShapeMismatch { .. }));
    assert!(err.to_string().contains("model-00001-of-00002.safetensors"));
}
