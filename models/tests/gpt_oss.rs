//! gpt-oss (`GptOssForCausalLM`) against transformers 5.23 and against itself under other
//! layouts, on the committed fixtures `tests/fixtures/gpt_oss` (f32) and
//! `tests/fixtures/gpt_oss_mxfp4` (the release format; goldens by
//! `tests/fixtures/make_family_fixtures.py`, see the gpt-oss section of
//! `tests/fixtures/README.md`):
//!
//! - forward parity on 12 tokens past the sliding window 4: logits within `1e-4 · max|logit|`,
//!   HF's loss / cross-entropy / aux loss and router logits, the masked aux loss, greedy
//!   continuation with the KV cache past the window; for the f32 directory and the MXFP4
//!   release (its experts decoded bit-exactly as transformers dequantises them);
//! - training: 6 [`Trainer`] steps equal the PyTorch reference;
//! - parallel equivalence: the same training run under EP, TP, PP, CP and EP·ETP (beside CP,
//!   beside TP) equals the `world = 1` run;
//! - bad inputs (`tests/fixtures/gpt_oss_bad/`): refused before any rank allocates, naming the
//!   field or tensor.

mod common;

use std::collections::BTreeMap;

use burn::tensor::{Device, Int, Tensor, TensorData};
use common::{Golden, family, fixtures, max_errors};
use moe_backend::parallel::replicate;
use moe_models::causal_lm::{GenerationConfig, generate, hf_load_balancing_loss};
use moe_models::export::export_hf_tensors;
use moe_models::families::gpt_oss::{GptOss, GptOssForCausalLM};
use moe_models::hf::load_causal_lm;

fn load(name: &str, device: &Device) -> GptOssForCausalLM {
    let any = load_causal_lm(fixtures().join(name), device).expect("load_causal_lm");
    assert_eq!(any.model_type(), "gpt_oss");
    any.get::<GptOss>().expect("a gpt-oss model").clone()
}

fn fixture(device: &Device) -> GptOssForCausalLM {
    load("gpt_oss", device)
}

fn f32s<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32")
}

fn assert_logits(what: &str, ours: Tensor<3>, golden: &Golden) {
    let (shape, want) = golden.f32("logits");
    assert_eq!(ours.dims().to_vec(), shape, "{what}: logits shape");
    let (err, scale) = max_errors(&f32s(ours), &want);
    println!("{what}: max|logit err| = {err:.3e}, max|golden| = {scale:.4}");
    assert!(
        err <= 1e-4 * scale,
        "{what}: max error {err} > 1e-4 · {scale}"
    );
}

fn golden_ids(golden: &Golden, device: &Device) -> (Vec<i64>, Tensor<2, Int>) {
    let (shape, ids) = golden.i64("input_ids");
    let t = Tensor::from_data(TensorData::new(ids.clone(), [shape[0], shape[1]]), device);
    (ids, t)
}

fn parity(name: &str) {
    let device = Device::flex();
    let model = load(name, &device);
    let golden = Golden::open(name);
    let (ids, t) = golden_ids(&golden, &device);
    assert!(t.dims()[1] > 4, "longer than the sliding window");
    let out = model.forward(t.clone()).expect("forward");
    let losses = model.loss(&out, &ids, None).expect("loss");
    assert_logits(name, out.logits.clone(), &golden);
    for (key, ours) in [
        ("loss", losses.loss),
        ("ce_loss", losses.ce_loss),
        ("aux_loss", losses.aux_loss),
    ] {
        let (_, want) = golden.f32(key);
        let ours = f64::from(ours.into_scalar::<f32>());
        family::assert_rel(&format!("{name} {key}"), ours, f64::from(want[0]), 1e-5);
    }
    for (l, ours) in out.router_logits.iter().enumerate() {
        let (shape, want) = golden.f32(&format!("router_logits.{l}"));
        assert_eq!(ours.dims().to_vec(), shape);
        let (err, scale) = max_errors(&f32s(ours.clone()), &want);
        assert!(err <= 1e-4 * scale, "router {l}: {err} vs {scale}");
    }
    let (_, mask) = golden.i64("aux_attention_mask");
    let mask: Vec<f32> = mask.iter().map(|&m| m as f32).collect();
    let layers: Vec<Tensor<2>> = (0..4)
        .map(|l| {
            let (shape, v) = golden.f32(&format!("router_logits.{l}"));
            Tensor::from_data(TensorData::new(v, [shape[0], shape[1]]), &device)
        })
        .collect();
    let masked = hf_load_balancing_loss(&layers, 2, Some(&mask)).expect("masked aux");
    let (_, want) = golden.f32("aux_loss_masked");
    let masked = f64::from(masked.into_scalar::<f32>());
    family::assert_rel(
        &format!("{name} aux_loss_masked"),
        masked,
        f64::from(want[0]),
        1e-5,
    );

    // Greedy continuation with the KV cache, past the sliding window.
    let (_, prompt) = golden.i64("prompt_ids");
    let (_, want) = golden.i64("greedy_ids");
    assert!(want.len() > 4);
    let prompt: Vec<usize> = prompt.iter().map(|&t| t as usize).collect();
    let new = want.len() - prompt.len();
    let got = generate(&model, &prompt, &GenerationConfig::greedy(new), &device).expect("gen");
    let want: Vec<usize> = want[prompt.len()..].iter().map(|&t| t as usize).collect();
    assert_eq!(
        got, want,
        "{name}: greedy continuation differs from transformers"
    );
}

#[test]
fn gpt_oss_matches_transformers() {
    parity("gpt_oss");
}

#[test]
fn the_mxfp4_release_matches_transformers_and_decodes_bit_exactly() {
    parity("gpt_oss_mxfp4");
    // The experts as loaded equal transformers' own dequantisation bit for bit.
    let device = Device::flex();
    let model = load("gpt_oss_mxfp4", &device);
    let golden = Golden::open("gpt_oss_mxfp4");
    let exported: BTreeMap<String, Vec<f32>> = export_hf_tensors(&model)
        .expect("export")
        .map(|(n, d)| (n, d.convert::<f32>().try_to_vec::<f32>().expect("f32")))
        .collect();
    let mut checked = 0;
    for l in 0..4 {
        for proj in ["gate_up_proj", "down_proj"] {
            let name = format!("model.layers.{l}.mlp.experts.{proj}");
            let (_, want) = golden.f32(&format!("dequant.{name}"));
            let got = &exported[&name];
            assert_eq!(got.len(), want.len(), "{name}");
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name}: not bit-exact");
            checked += 1;
        }
    }
    assert_eq!(checked, 8);
}

#[test]
fn gpt_oss_training_matches_pytorch() {
    let start = replicate(&fixture(&Device::flex().autodiff()));
    // An element moves by at most ~lr (1e-3) per step; f32 reduction-order differences
    // reach the parameters through Adam's m/√v (amplified for near-zero gradients, e.g.
    // through the sinks' and the clamp's) at a small fraction of that: 5% of one step.
    family::training_matches_pytorch(&start, "gpt_oss", 5e-5);
}

/// Layouts the `world = 1` training run is compared under: EP, TP (the `o_proj` bias added
/// after the reduction, sinks split by head), PP, CP (sliding windows across the split
/// sequence), and expert TP with EP beside CP or TP (`etp = 2`: the `fc2` bias held whole on
/// both expert-TP ranks, added by one, counted once in the gradient norm). The world-4 expert
/// layouts keep two data-parallel replicas for the two sequences of a step (a plain
/// `ep=2,etp=2` at world 4 would need four).
const LAYOUTS: [(usize, &str); 6] = [
    (2, "ep=2"),
    (2, "tp=2"),
    (2, "pp=2"),
    (2, "cp=2"),
    (4, "cp=2,ep=2,etp=2"),
    (4, "tp=2,ep=2,etp=2"),
];

#[test]
fn gpt_oss_training_under_six_layouts_matches_one_rank() {
    let start = replicate(&fixture(&Device::flex().autodiff()));
    family::layouts_match_one_rank(&start, "gpt_oss", &LAYOUTS);
}

/// A copy of fixture directory `base` with `file` replaced by `gpt_oss_bad/{bad}`.
fn bad_dir(base: &str, file: &str, bad: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gpt-oss-bad-{}-{bad}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join(base).join(f), dir.join(f)).expect("copy");
    }
    let bad_path = fixtures().join("gpt_oss_bad").join(bad);
    if file == "config.json" {
        std::fs::copy(bad_path, dir.join(file)).expect("copy bad");
        return dir;
    }
    // Substitute the bad file's tensors into the directory's checkpoint.
    let base_bytes = std::fs::read(dir.join(file)).expect("read");
    let bad_bytes = std::fs::read(bad_path).expect("read bad");
    let base_st = safetensors::SafeTensors::deserialize(&base_bytes).expect("base");
    let bad_st = safetensors::SafeTensors::deserialize(&bad_bytes).expect("bad");
    let mut tensors: BTreeMap<String, safetensors::tensor::TensorView<'_>> =
        base_st.tensors().into_iter().collect();
    for (name, view) in bad_st.tensors() {
        assert!(
            tensors.insert(name.clone(), view).is_some(),
            "{name} replaces a tensor"
        );
    }
    let bytes = safetensors::serialize(tensors, None).expect("serialize");
    std::fs::write(dir.join(file), bytes).expect("write");
    dir
}

#[test]
fn bad_inputs_are_refused_before_any_rank_allocates_naming_the_field_or_tensor() {
    let cases = [
        (
            "gpt_oss",
            "config.json",
            "config.layer_types_short.json",
            "layer_types",
        ),
        (
            "gpt_oss",
            "model.safetensors",
            "sinks_wrong_length.safetensors",
            "model.layers.1.self_attn.sinks",
        ),
        (
            "gpt_oss_mxfp4",
            "model.safetensors",
            "mxfp4_block_width_24.safetensors",
            "model.layers.0.mlp.experts.gate_up_proj_blocks",
        ),
        (
            "gpt_oss_mxfp4",
            "model.safetensors",
            "mxfp4_input_width_mismatch.safetensors",
            "model.layers.0.mlp.experts.down_proj_blocks",
        ),
    ];
    for (base, file, bad, named) in cases {
        let dir = bad_dir(base, file, bad);
        // The checked loader validates the whole checkpoint against the config first: the
        // same check every rank's `load_shard_checked` runs before reading its shard.
        let ckpt = moe_bridge::hf::HfCheckpoint::open(&dir).map_err(|e| e.to_string());
        let err = match ckpt.and_then(|c| {
            c.check::<moe_models::hf::ModelConfig>()
                .map(|_| ())
                .map_err(|e| e.to_string())
        }) {
            Ok(()) => panic!("{bad}: accepted"),
            Err(e) => e,
        };
        println!("{bad}: {err}");
        assert!(err.contains(named), "{bad}: {err}");
        let err = match load_causal_lm(&dir, &Device::flex()) {
            Ok(_) => panic!("{bad}: loaded"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(named), "{bad}: {err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The `config.json` of an `openai/gpt-oss-*` release (Hugging Face hub, 2025-08): 64 query
/// heads of 64, 8 KV heads, hidden and expert width 2880, top-4 routing, vocab 201088,
/// alternating 128-token sliding / full attention, YaRN ×32.
fn release_config(layers: usize, experts: usize) -> String {
    let types: Vec<&str> = (0..layers)
        .map(|i| {
            if i % 2 == 0 {
                "\"sliding_attention\""
            } else {
                "\"full_attention\""
            }
        })
        .collect();
    format!(
        r#"{{"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "attention_bias": true, "attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": [{}], "max_position_embeddings": 131072,
        "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": {layers},
        "num_key_value_heads": 8, "num_local_experts": {experts}, "output_router_logits": false,
        "rms_norm_eps": 1e-05, "rope_scaling": {{"beta_fast": 32.0, "beta_slow": 1.0,
        "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn",
        "truncate": false}}, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
        "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": false,
        "use_cache": true, "vocab_size": 201088}}"#,
        types.join(", ")
    )
}

/// `param_count` of gpt-oss-120b and gpt-oss-20b from their released configs against the
/// counts OpenAI publishes (gpt-oss model card, table 1: 116.83B total / 5.13B active for
/// 120b, 20.91B / 3.61B for 20b; "active" there leaves out the input embedding) and against
/// the closed form written out here from the architecture.
#[test]
fn param_count_matches_the_published_gpt_oss_120b_and_20b_counts() {
    use moe_models::families::gpt_oss::GptOssConfig;
    for (layers, experts, total_b, active_b) in [(36, 128, 116.83, 5.13), (24, 32, 20.91, 3.61)] {
        let config = GptOssConfig::from_json_str(&release_config(layers, experts)).expect("config");
        let count = moe_models::families::param_count::<GptOss>(&config).expect("count");
        let (h, v, q, kv, f) = (2880u64, 201_088u64, 64 * 64u64, 8 * 64u64, 2880u64);
        let attention = (h * q + q) + 2 * (h * kv + kv) + (q * h + h) + 64;
        let router = h * experts as u64 + experts as u64;
        let expert = (h * 2 * f + 2 * f) + (f * h + h);
        let norms = 2 * h;
        let embeddings = 2 * v * h + h;
        let layer = |routed: u64| attention + router + norms + routed * expert;
        let total = embeddings + layers as u64 * layer(experts as u64);
        let active = embeddings + layers as u64 * layer(4);
        assert_eq!((count.total, count.active, count.mtp), (total, active, 0));
        let billions = |n: u64| (n as f64 / 1e7).round() / 100.0;
        assert_eq!(billions(count.total), total_b, "{layers} layers: total");
        assert_eq!(
            billions(count.active - v * h),
            active_b,
            "{layers} layers: active"
        );
        println!(
            "gpt-oss {layers}×{experts}: {} total, {} active",
            count.total, count.active
        );
    }
}
