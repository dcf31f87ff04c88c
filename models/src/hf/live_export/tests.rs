use std::collections::BTreeSet;
use std::path::PathBuf;

use crate::export::export_hf_tensors;
use crate::{
    DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
};
use burn::tensor::Device;

use super::*;
use moe_backend::testing::TempDir;
use moe_bridge::hf::HfCheckpoint;
use moe_bridge::safetensors::elem::f32_to_bf16_bits;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name)
}

/// The fixture checkpoint (a `WeightSource`) and its `config.json`.
fn open(name: &str) -> (HfCheckpoint, Value) {
    let ck = HfCheckpoint::open(fixture(name)).unwrap();
    let config = ck.config_json().unwrap();
    (ck, config)
}

fn f32_opts() -> LiveExportOptions {
    LiveExportOptions {
        dtype: LiveDtype::F32,
        ..LiveExportOptions::default()
    }
}

/// Same key set and bit-identical bytes as the fixture.
fn assert_same_checkpoint(fixture_name: &str, out: &Path) {
    let (a, b) = (
        HfCheckpoint::open(fixture(fixture_name)).unwrap(),
        HfCheckpoint::open(out).unwrap(),
    );
    let keys = |c: &HfCheckpoint| c.tensor_names().map(str::to_owned).collect::<BTreeSet<_>>();
    assert_eq!(keys(&a), keys(&b), "{fixture_name}: key sets differ");
    for name in a.tensor_names() {
        let (x, y) = (a.tensor(name).unwrap(), b.tensor(name).unwrap());
        assert_eq!(x.dtype, y.dtype, "{fixture_name}: {name}");
        assert_eq!(x.shape, y.shape, "{fixture_name}: {name}");
        assert!(x.bytes == y.bytes, "{fixture_name}: {name} differs");
    }
}

#[test]
fn f32_export_of_every_fixture_is_bit_identical() {
    let device = Device::flex();
    let tmp = TempDir::new("live-f32");

    let (src, config) = open("qwen3");
    let cfg = Qwen3Config::from_json_str(&config.to_string()).unwrap();
    let model = Qwen3ForCausalLM::from_weights(&cfg, &src, &device).unwrap();
    let out = tmp.join("qwen3");
    export_live_model(&model, &config, None, &out, &f32_opts()).unwrap();
    assert_same_checkpoint("qwen3", &out);

    let (src, config) = open("qwen3_moe");
    let cfg = Qwen3MoeConfig::from_json_str(&config.to_string()).unwrap();
    let model = Qwen3MoeForCausalLM::from_weights(&cfg, &src, &device).unwrap();
    let out = tmp.join("qwen3_moe");
    // Small shards: several files and an index.
    let opts = LiveExportOptions {
        max_shard_size: 100_000,
        ..f32_opts()
    };
    let summary = export_live_model(&model, &config, None, &out, &opts).unwrap();
    assert!(
        summary.shards > 1 && out.join(INDEX_FILE).is_file(),
        "{summary:?}"
    );
    assert_same_checkpoint("qwen3_moe", &out);
    let written = HfCheckpoint::open(&out).unwrap().config_json().unwrap();
    assert_eq!(written["dtype"], "float32");
    assert_eq!(written["num_local_experts"], 8, "unknown keys kept");

    let (src, config) = open("deepseek_v3");
    let cfg = DeepseekV3Config::from_json_str(&config.to_string()).unwrap();
    let model = DeepseekV3ForCausalLM::from_weights(&cfg, &src, &device).unwrap();
    let out = tmp.join("deepseek_v3");
    export_live_model(&model, &config, None, &out, &f32_opts()).unwrap();
    assert_same_checkpoint("deepseek_v3", &out);
    let ck = HfCheckpoint::open(&out).unwrap();
    let bias = ck
        .info("model.layers.1.mlp.gate.e_score_correction_bias")
        .unwrap();
    assert_eq!(bias.dtype, Dtype::F32);

    // The release MTP copies on request.
    let embedding = model.model.embed_tokens.as_ref().map(|e| e.weight.val());
    let head = model.lm_head.as_ref().map(|h| h.weight.val().transpose());
    let (layers, depths) = (model.config().num_hidden_layers, model.mtp.len());
    let with_copies =
        (model.hf_tensors().expect("export")).with_mtp_copies(layers, depths, embedding, head);
    let names: Vec<String> = with_copies.specs().iter().map(|s| s.name.clone()).collect();
    assert!(names.contains(&"model.layers.3.embed_tokens.weight".to_owned()));
    assert!(names.contains(&"model.layers.3.shared_head.head.weight".to_owned()));

    // The target exists now.
    let err = export_live_model(&model, &config, None, &out, &f32_opts()).unwrap_err();
    assert!(
        matches!(err, ModelError::Bridge(BridgeError::TargetExists { .. })),
        "{err}"
    );
}

#[test]
fn bf16_export_equals_a_host_rne_cast_and_the_bf16_fixture() {
    let device = Device::flex();
    let tmp = TempDir::new("live-bf16");
    let (src, config) = open("qwen3_moe");
    let cfg = Qwen3MoeConfig::from_json_str(&config.to_string()).unwrap();
    let model = Qwen3MoeForCausalLM::from_weights(&cfg, &src, &device).unwrap();
    let out = tmp.join("bf16");
    export_live_model(&model, &config, None, &out, &LiveExportOptions::default()).unwrap();
    let ck = HfCheckpoint::open(&out).unwrap();
    for (name, data) in export_hf_tensors(&model).expect("export") {
        let expected: Vec<u8> = data
            .try_into_vec_as::<f32>()
            .unwrap()
            .iter()
            .flat_map(|&v| f32_to_bf16_bits(v).to_le_bytes())
            .collect();
        let t = ck.tensor(&name).unwrap();
        assert_eq!(t.dtype, Dtype::BF16, "{name}");
        assert!(t.bytes == expected.as_slice(), "{name}: not the RNE cast");
    }
    assert_eq!(ck.config_json().unwrap()["dtype"], "bfloat16");
    // The bf16 fixture holds the RNE cast of the same weights.
    assert_same_checkpoint("qwen3_moe_bf16", &out);
}

#[test]
fn fp8_export_writes_scales_and_quantization_config() {
    let device = Device::flex();
    let tmp = TempDir::new("live-fp8");
    let (src, config) = open("deepseek_v3");
    let cfg = DeepseekV3Config::from_json_str(&config.to_string()).unwrap();
    let model = DeepseekV3ForCausalLM::from_weights(&cfg, &src, &device).unwrap();
    let out = tmp.join("fp8");
    let opts = LiveExportOptions {
        dtype: LiveDtype::Fp8 { block: [16, 16] },
        ..LiveExportOptions::default()
    };
    export_live_model(&model, &config, None, &out, &opts).unwrap();
    let ck = HfCheckpoint::open(&out).unwrap();
    let config = ck.config_json().unwrap();
    assert_eq!(
        config["quantization_config"]["weight_block_size"],
        json!([16, 16])
    );
    assert_eq!(config["quantization_config"]["fmt"], "e4m3");
    let q = "model.layers.1.mlp.experts.3.down_proj.weight";
    assert_eq!(ck.info(q).unwrap().dtype, Dtype::F8E4M3);
    assert_eq!(ck.info(&scale_inv_name(q)).unwrap().dtype, Dtype::F32);
    for name in [
        "model.embed_tokens.weight",
        "model.layers.1.mlp.gate.weight",
    ] {
        assert_eq!(ck.info(name).unwrap().dtype, Dtype::BF16, "{name}");
    }
    let bias = "model.layers.1.mlp.gate.e_score_correction_bias";
    assert_eq!(ck.info(bias).unwrap().dtype, Dtype::F32);
    // Dequantised weights are within E4M3 precision (3 mantissa bits) of the originals.
    let (_, deq) = ck.read_f32(q).unwrap();
    let (_, orig) = HfCheckpoint::open(fixture("deepseek_v3"))
        .unwrap()
        .read_f32(q)
        .unwrap();
    let amax = orig.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (a, b) in deq.iter().zip(&orig) {
        assert!(
            (a - b).abs() <= 0.0625 * b.abs() + amax / 448.0 * 2.0,
            "{a} vs {b}"
        );
    }
}
