//! HF checkpoints through `moe-bridge` end to end (no Python): every committed fixture loads with
//! [`moe_models::hf::load_causal_lm`] and matches the transformers 5.23 goldens
//! (docs/models.md §Goldens and parity tests: `max|ours − golden| ≤ 1e-4 · max|golden|`, losses to
//! 1e-5 relative, greedy continuations token for token); sharded and single-file copies give
//! bit-identical logits; an FP8 checkpoint loads like its exact dequantisation; and an export
//! reloads with the same key set and bit-identical tensors
//! (docs/checkpoints.md §Minimal loadable export, §FP8 release format, §Streaming conversion).

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor};
use burn_moe::bridge::export::{ExportOptions, export_hf};
use burn_moe::bridge::fp8::is_scale_inv;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::bridge::safetensors::{Dtype, SafetensorsFile};
use burn_moe::models::causal_lm::token_ids;
use burn_moe::models::hf::{AnyCausalLm, ModelConfig, load_causal_lm};
use burn_moe::models::{CausalLm, GenerationConfig};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!(
            "burn-moe-roundtrip-{tag}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `tests/fixtures/<name>.golden.safetensors`.
struct Golden(SafetensorsFile);

impl Golden {
    fn open(name: &str) -> Self {
        let path = fixtures().join(format!("{name}.golden.safetensors"));
        Self(SafetensorsFile::open(&path).expect("golden"))
    }

    fn has(&self, name: &str) -> bool {
        self.0.contains(name)
    }

    fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let view = self.0.tensor(name).expect("golden tensor");
        (view.shape.to_vec(), view.to_f32_vec().expect("f32"))
    }

    fn i64(&self, name: &str) -> (Vec<usize>, Vec<i64>) {
        let view = self.0.tensor(name).expect("golden tensor");
        assert_eq!(view.dtype, Dtype::I64, "golden `{name}`");
        let data = view.to_tensor_data().expect("data");
        (
            view.shape.to_vec(),
            data.try_into_vec::<i64>().expect("i64"),
        )
    }
}

fn load(dir: &str) -> (AnyCausalLm, Device) {
    let device = Device::flex();
    let model = load_causal_lm(fixtures().join(dir), &device)
        .unwrap_or_else(|e| panic!("{dir}: load through moe-bridge failed: {e}"));
    (model, device)
}

fn input_ids(golden: &Golden, model: &AnyCausalLm, device: &Device) -> (Vec<i64>, Tensor<2, Int>) {
    let (shape, ids) = golden.i64("input_ids");
    let t = token_ids(&ids, [shape[0], shape[1]], model.vocab_size(), device).expect("ids");
    (ids, t)
}

fn host(t: Tensor<3>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32")
}

/// Asserts `max|ours − golden| ≤ 1e-4 · max|golden|`.
fn assert_logits(name: &str, ours: &[f32], golden: &Golden) {
    let (_, want) = golden.f32("logits");
    assert_eq!(ours.len(), want.len(), "{name}: logits size");
    let err = ours
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let scale = want.iter().map(|b| b.abs()).fold(0.0f32, f32::max);
    println!("{name}: max|logit err| {err:.3e}, max|golden| {scale:.4}");
    assert!(
        err <= 1e-4 * scale,
        "{name}: max error {err} > 1e-4 · {scale}"
    );
}

fn assert_rel(name: &str, ours: f32, golden: f32) {
    let rel = (ours - golden).abs() / golden.abs();
    println!("{name}: ours {ours:.7}, golden {golden:.7}, rel {rel:.3e}");
    assert!(rel <= 1e-5, "{name}: {ours} vs {golden}");
}

fn assert_greedy(name: &str, model: &AnyCausalLm, golden: &Golden, device: &Device) {
    let (_, prompt) = golden.i64("prompt_ids");
    let (_, want) = golden.i64("greedy_ids");
    let prompt: Vec<usize> = prompt.iter().map(|&t| t as usize).collect();
    let config = GenerationConfig::greedy(want.len() - prompt.len());
    let got = model.generate(&prompt, &config, device).expect("generate");
    let want: Vec<usize> = want[prompt.len()..].iter().map(|&t| t as usize).collect();
    assert_eq!(
        got, want,
        "{name}: greedy continuation differs from transformers"
    );
}

/// Logits (and, where the golden has them, losses and the greedy continuation) of fixture
/// `dir` against golden `golden_name`; returns our logits.
fn check_fixture(dir: &str, golden_name: &str) -> Vec<f32> {
    let (model, device) = load(dir);
    let golden = Golden::open(golden_name);
    let (ids, t) = input_ids(&golden, &model, &device);
    let (logits, losses) = model.losses(t, &ids).expect("forward");
    let logits = host(logits);
    assert_logits(dir, &logits, &golden);
    if golden.has("loss") {
        let (_, want) = golden.f32("loss");
        assert_rel(
            &format!("{dir} loss"),
            losses.loss.into_scalar::<f32>(),
            want[0],
        );
    }
    if golden.has("aux_loss") {
        let (_, want) = golden.f32("aux_loss");
        let aux = losses.aux_loss.expect("an MoE model reports aux_loss");
        assert_rel(
            &format!("{dir} aux_loss"),
            aux.into_scalar::<f32>(),
            want[0],
        );
    }
    if golden.has("greedy_ids") {
        assert_greedy(dir, &model, &golden, &device);
    }
    logits
}

#[test]
fn qwen3_moe_loads_through_the_bridge_and_matches_transformers() {
    let (model, _) = load("qwen3_moe");
    assert_eq!(model.model_type(), "qwen3_moe");
    check_fixture("qwen3_moe", "qwen3_moe");
}

#[test]
fn qwen3_moe_bf16_loads_through_the_bridge_and_matches_transformers() {
    check_fixture("qwen3_moe_bf16", "qwen3_moe_bf16");
}

#[test]
fn qwen3_dense_tied_loads_through_the_bridge_and_matches_transformers() {
    check_fixture("qwen3", "qwen3");
}

#[test]
fn deepseek_v3_sharded_equals_single_file_and_matches_transformers() {
    let single = check_fixture("deepseek_v3", "deepseek_v3");
    let sharded = check_fixture("deepseek_v3_sharded", "deepseek_v3");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&single),
        bits(&sharded),
        "sharded and single-file logits must be bit-identical"
    );
}

#[test]
fn deepseek_v3_fp8_loads_like_its_exact_dequantisation() {
    let fp8 = check_fixture("deepseek_v3_fp8", "deepseek_v3_fp8_dequant");
    let reference = check_fixture("deepseek_v3_fp8_dequant", "deepseek_v3_fp8_dequant");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&fp8), bits(&reference));
}

/// Every tensor of `a` and `b`: same key set, dtypes, shapes and bytes.
fn assert_same_tensors(a: &HfCheckpoint, b: &HfCheckpoint, what: &str) {
    let names_a: Vec<&str> = a.tensor_names().collect();
    let names_b: Vec<&str> = b.tensor_names().collect();
    assert_eq!(names_a, names_b, "{what}: key sets differ");
    for name in names_a {
        let (ta, tb) = (a.tensor(name).expect("a"), b.tensor(name).expect("b"));
        assert_eq!(ta.dtype, tb.dtype, "{what}: `{name}` dtype");
        assert_eq!(ta.shape, tb.shape, "{what}: `{name}` shape");
        assert!(ta.bytes == tb.bytes, "{what}: `{name}` bytes differ");
    }
}

#[test]
fn export_then_reload_gives_identical_keys_and_bit_identical_tensors() {
    let fixtures_to_check = [
        "qwen3",
        "qwen3_moe",
        "qwen3_moe_bf16",
        "deepseek_v3",
        "deepseek_v3_sharded",
        "deepseek_v3_fp8_dequant",
    ];
    for name in fixtures_to_check {
        let source = HfCheckpoint::open(fixtures().join(name)).expect("source");
        let tmp = TempDir::new(name);
        // A small shard limit exercises the sharded writer on every fixture.
        let target = tmp.path().join("export");
        let options = ExportOptions {
            max_shard_size: 200_000,
            ..ExportOptions::default()
        };
        let summary = export_hf::<ModelConfig>(&source, &target, &options).expect("export");
        assert!(
            summary.dropped.is_empty(),
            "{name}: dropped {:?}",
            summary.dropped
        );
        let exported = HfCheckpoint::open(&target).expect("reload");
        assert_eq!(exported.is_sharded(), summary.shards > 1);
        assert_same_tensors(&source, &exported, name);
        let unlisted = exported.verify().expect("index and shards agree");
        assert!(unlisted.is_empty(), "{name}: {unlisted:?}");
    }
}

#[test]
fn fp8_exported_as_bf16_drops_scales_and_equals_the_reference_dequantisation() {
    let source = HfCheckpoint::open(fixtures().join("deepseek_v3_fp8")).expect("source");
    assert!(source.tensor_names().any(is_scale_inv));
    let tmp = TempDir::new("fp8");
    let target = tmp.path().join("bf16");
    let options = ExportOptions {
        dtype: Some(Dtype::BF16),
        ..ExportOptions::default()
    };
    export_hf::<ModelConfig>(&source, &target, &options).expect("export");
    let exported = HfCheckpoint::open(&target).expect("reload");
    let scales: Vec<&str> = exported
        .tensor_names()
        .filter(|n| is_scale_inv(n))
        .collect();
    assert!(scales.is_empty(), "scales left in the export: {scales:?}");
    let config = exported.config_json().expect("config");
    assert!(config.get("quantization_config").is_none());
    assert_eq!(config["dtype"], "bfloat16");
    assert_eq!(
        exported
            .info("model.layers.1.mlp.gate.e_score_correction_bias")
            .expect("bias")
            .dtype,
        Dtype::F32,
        "the router bias stays F32"
    );
    let reference =
        HfCheckpoint::open(fixtures().join("deepseek_v3_fp8_dequant")).expect("reference");
    assert_same_tensors(&reference, &exported, "FP8 → BF16 export vs reference");
}

#[test]
fn f32_export_of_a_bf16_checkpoint_gives_bit_identical_logits() {
    let source = HfCheckpoint::open(fixtures().join("qwen3_moe_bf16")).expect("source");
    let tmp = TempDir::new("f32");
    let target = tmp.path().join("f32");
    let options = ExportOptions {
        dtype: Some(Dtype::F32),
        ..ExportOptions::default()
    };
    export_hf::<ModelConfig>(&source, &target, &options).expect("export");
    let exported = HfCheckpoint::open(&target).expect("reload");
    assert!(
        exported
            .tensor_names()
            .all(|n| exported.info(n).expect("info").dtype == Dtype::F32)
    );
    let device = Device::flex();
    let golden = Golden::open("qwen3_moe_bf16");
    let a = load_causal_lm(fixtures().join("qwen3_moe_bf16"), &device).expect("source model");
    let b = load_causal_lm(&target, &device).expect("exported model");
    let (_, t) = input_ids(&golden, &a, &device);
    let la = host(a.logits(t.clone()).expect("forward"));
    let lb = host(b.logits(t).expect("forward"));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&la), bits(&lb));
}
