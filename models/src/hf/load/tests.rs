use std::path::PathBuf;

use super::*;
use moe_backend::testing::TempDir;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("tests")
        .join("fixtures")
        .join(name)
}

/// Copies a fixture's files into a fresh temporary directory.
fn copy_fixture(name: &str, tag: &str) -> TempDir {
    let dir = TempDir::new(tag);
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(&entry.file_name().to_string_lossy())).unwrap();
    }
    dir
}

#[test]
fn fp8_tensors_are_dequantised_bit_equal_to_the_reference() {
    let fp8 = HfCheckpoint::open(fixture("deepseek_v3_fp8")).unwrap();
    let reference = HfCheckpoint::open(fixture("deepseek_v3_fp8_dequant")).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut quantised = 0;
    for name in reference.tensor_names() {
        quantised += usize::from(fp8.contains(&moe_bridge::fp8::scale_inv_name(name)));
        let (shape, got) = WeightSource::tensor_f32(&fp8, name).unwrap();
        let (want_shape, want) = WeightSource::tensor_f32(&reference, name).unwrap();
        assert_eq!(shape, want_shape, "{name}");
        assert!(bits(&got) == bits(&want), "{name}");
    }
    assert!(quantised > 0);
}

#[test]
fn missing_tensor_is_a_missing_tensor_error() {
    let ckpt = HfCheckpoint::open(fixture("qwen3")).unwrap();
    let err = WeightSource::tensor_f32(&ckpt, "lm_head.weight").unwrap_err();
    assert!(matches!(err, ModelError::MissingTensor { .. }), "{err}");
    assert!(!WeightSource::contains(&ckpt, "lm_head.weight"));
    assert!(WeightSource::contains(&ckpt, "model.norm.weight"));
}

#[test]
fn config_reports_type_counts_and_experts() {
    let config = ModelConfig::from_dir(fixture("deepseek_v3")).unwrap();
    assert_eq!(config.model_type(), "deepseek_v3");
    assert_eq!(config.architecture(), "DeepseekV3ForCausalLM");
    assert_eq!(config.experts(), Some((8, 2)));
    let count = config.param_count().unwrap();
    assert!(count.active < count.total && count.mtp > 0, "{count:?}");
    let dense = ModelConfig::from_dir(fixture("qwen3")).unwrap();
    assert_eq!(dense.experts(), None);
    let dense = dense.param_count().unwrap();
    assert_eq!(dense.active, dense.total);
}

#[test]
fn unknown_or_missing_model_type_is_a_clear_error() {
    let path = PathBuf::from("cfg/config.json");
    let err = ModelConfig::from_json(&serde_json::json!({"model_type": "llama"}), &path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown model_type \"llama\""), "{err}");
    assert!(
        err.contains("qwen3_moe") && err.contains("cfg/config.json"),
        "{err}"
    );
    let err = ModelConfig::from_json(&serde_json::json!({"vocab_size": 3}), &path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("`model_type`: missing"), "{err}");
    let err = ModelConfig::from_json(
        &serde_json::json!({"model_type": "qwen3", "hidden_size": "big"}),
        &path,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("`hidden_size`"), "{err}");
}

#[test]
fn loads_a_fixture_and_reports_its_type() {
    let device = Device::flex();
    let model = load_causal_lm(fixture("qwen3"), &device).unwrap();
    assert_eq!(model.model_type(), "qwen3");
    assert_eq!(model.config().architecture(), "Qwen3ForCausalLM");
    assert_eq!(
        model.param_count().unwrap(),
        ModelConfig::from_dir(fixture("qwen3"))
            .unwrap()
            .param_count()
            .unwrap()
    );
    assert_eq!(crate::CausalLm::vocab_size(&model), 256);
}

#[test]
fn a_truncated_shard_reports_the_file() {
    let dir = copy_fixture("deepseek_v3_sharded", "weights-truncated");
    let shard = dir.join("model-00004-of-00013.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_causal_lm(dir.path(), &Device::flex())
        .unwrap_err()
        .to_string();
    assert!(err.contains("model-00004-of-00013.safetensors"), "{err}");
}

#[test]
fn a_missing_tensor_names_the_checkpoint_and_tensor() {
    let dir = copy_fixture("qwen3", "weights-untied");
    let config = dir.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let untied = text.replace(
        "\"tie_word_embeddings\": true",
        "\"tie_word_embeddings\": false",
    );
    assert_ne!(text, untied);
    std::fs::write(&config, untied).unwrap();
    let err = load_causal_lm(dir.path(), &Device::flex())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("lm_head.weight") && err.contains(&dir.path().display().to_string()),
        "{err}"
    );
}

#[test]
fn bf16_precision_rounds_weights() {
    let ckpt = HfCheckpoint::open(fixture("qwen3")).unwrap();
    let source = CheckpointSource {
        checkpoint: &ckpt,
        precision: WeightPrecision::Bf16,
        first_error: RefCell::new(None),
        plan: None,
    };
    let (_, values) = source.tensor_f32("model.norm.weight").unwrap();
    assert!(values.iter().all(|v| v.to_bits() & 0xFFFF == 0));
}
