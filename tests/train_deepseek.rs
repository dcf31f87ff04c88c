//! `moe train` on DeepSeek-V3 (MTP loss, expert-bias updates): fine-tunes from the HF fixture,
//! saves, resumes under another layout equal to the uninterrupted run, exports an HF directory
//! that loads with the trained weights; the FP8 release trains like its dequantised copy.

mod common;

use std::collections::BTreeMap;

use burn::tensor::Device;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::models::{DeepseekV3Config, DeepseekV3ForCausalLM};
use common::*;

const DEEPSEEK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/deepseek_v3");
const DEEPSEEK_FP8: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/deepseek_v3_fp8"
);
const DEEPSEEK_FP8_DEQUANT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/deepseek_v3_fp8_dequant"
);

/// The fixture's tensors as f32.
fn fixture_params(dir: &str) -> BTreeMap<String, Vec<f32>> {
    let hf = HfCheckpoint::open(dir).expect("fixture");
    let names: Vec<String> = hf.tensor_names().map(str::to_string).collect();
    names
        .into_iter()
        .map(|n| {
            let v = hf
                .tensor(&n)
                .and_then(|t| t.to_tensor_data())
                .expect("tensor")
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("f32");
            (n, v)
        })
        .collect()
}

#[test]
fn deepseek_v3_trains_resumes_under_another_layout_and_exports() {
    let extra = |more: &[&'static str]| {
        let mut v = vec![
            "--model",
            DEEPSEEK,
            "--adam-eps",
            ADAM_EPS,
            "--expert-bias-update-rate",
            "1e-2",
        ];
        v.extend_from_slice(more);
        v
    };
    // 4 uninterrupted steps under tp2·ep4 (world 4: two replicas).
    let whole = scratch("ds-whole");
    threads(&train_args(&whole, "tp=2,ep=4", 4, &extra(&[])));
    // 2 steps under tp2·ep4, then 2 more resumed under ep2 (world 2).
    let split = scratch("ds-split");
    threads(&train_args(&split, "tp=2,ep=4", 2, &extra(&[])));
    threads(&train_args(&split, "ep=2", 4, &extra(&["--resume"])));

    let (m_whole, m_split) = (metrics(&whole), metrics(&split));
    assert_eq!(m_whole.len(), 4);
    assert_eq!(m_split.len(), 4, "2 steps + 2 resumed steps appended");
    assert!(
        m_whole.iter().all(|m| field(m, "mtp_loss").is_finite()),
        "every step reports the MTP loss: {m_whole:?}"
    );
    assert_metrics_close(&m_split, &m_whole, "resumed under ep2 vs uninterrupted");

    // The exported checkpoints (F32 HF directories) hold every fixture tensor, the MTP module
    // and the moved expert bias included, and agree between the two runs.
    let (p_whole, p_split) = (params(&whole), params(&split));
    assert_params_close(&p_split, &p_whole, "resumed vs uninterrupted parameters");
    let start = fixture_params(DEEPSEEK);
    let names = |m: &BTreeMap<String, Vec<f32>>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(&p_whole),
        names(&start),
        "export has the fixture's tensors"
    );
    assert!(
        p_whole.contains_key("model.layers.3.eh_proj.weight"),
        "MTP exported"
    );
    for name in [
        "model.layers.3.eh_proj.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.1.self_attn.kv_b_proj.weight",
    ] {
        assert_ne!(p_whole[name], start[name], "{name} was trained");
    }

    // The export loads as a DeepSeek-V3 model with the trained values.
    let hf_dir = whole.join("hf");
    let config = DeepseekV3Config::from_file(hf_dir.join("config.json")).expect("config");
    let hf = HfCheckpoint::open(&hf_dir).expect("export");
    let model = DeepseekV3ForCausalLM::from_weights(&config, &hf, &Device::flex()).expect("loads");
    assert_eq!(model.mtp.len(), 1);
    for d in [whole, split] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn fp8_release_trains_like_its_dequantised_copy() {
    let steps = |dir: &std::path::Path, model: &'static str| {
        threads(&train_args(dir, "ep=2", 2, &["--model", model]));
        metrics(dir)
    };
    let (fp8, dequant) = (scratch("ds-fp8"), scratch("ds-dequant"));
    let (m_fp8, m_dequant) = (
        steps(&fp8, DEEPSEEK_FP8),
        steps(&dequant, DEEPSEEK_FP8_DEQUANT),
    );
    // The FP8 weights load exactly as their BF16 dequantisation: the same run bit for bit.
    assert_metrics_equal(&m_fp8, &m_dequant, "FP8 release vs dequantised copy");
    let (p_fp8, p_dequant) = (params(&fp8), params(&dequant));
    assert_eq!(p_fp8, p_dequant, "trained parameters");
    assert!(
        !p_fp8.keys().any(|n| n.ends_with("_scale_inv")),
        "the trained checkpoint is dequantised"
    );
    for d in [fp8, dequant] {
        let _ = std::fs::remove_dir_all(d);
    }
}
