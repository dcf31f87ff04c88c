//! Mixtral (`MixtralForCausalLM`) against transformers 5.23 and against itself under other
//! layouts, on the committed fixture `tests/fixtures/mixtral` (2 layers, 8 experts top-2;
//! goldens by `tests/fixtures/make_family_fixtures.py`, see the Mixtral section of
//! `tests/fixtures/README.md`):
//!
//! - forward parity: logits within `1e-4 · max|logit|`, HF's loss / cross-entropy / aux loss
//!   and router logits, the masked aux loss, greedy continuation with the KV cache; through
//!   the family list too (`load_causal_lm` of the directory);
//! - training: 6 [`Trainer`] steps equal the PyTorch reference (transformers model +
//!   `torch.optim.AdamW`): per-step losses and gradient norms within 1e-4 relative, and the
//!   final parameters, exported under the release names (`block_sparse_moe.experts.{e}.w1/w3/w2`),
//!   equal the reference's `save_pretrained` tensors;
//! - parallel equivalence: the same training run under five layouts (EP, TP·EP·ETP, PP, TP·PP,
//!   TP·EP) equals the `world = 1` run;
//! - bad input: a config whose `num_local_experts` contradicts the stored experts is refused
//!   naming the tensor.

mod common;

use burn::tensor::{Device, Int, Tensor, TensorData};
use common::{FixtureSource, Golden, family, fixtures, max_errors};
use moe_backend::parallel::replicate;
use moe_models::causal_lm::{GenerationConfig, generate, hf_load_balancing_loss};
use moe_models::families::mixtral::{MixtralConfig, MixtralForCausalLM};
use moe_models::hf::load_causal_lm;

fn fixture(device: &Device) -> MixtralForCausalLM {
    let dir = fixtures().join("mixtral");
    let config = MixtralConfig::from_file(dir.join("config.json")).expect("config");
    MixtralForCausalLM::from_weights(&config, &FixtureSource::open(&dir), device).expect("load")
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

#[test]
fn mixtral_matches_transformers() {
    let device = Device::flex();
    let model = fixture(&device);
    let golden = Golden::open("mixtral");
    let (ids, t) = golden_ids(&golden, &device);
    let out = model.forward(t.clone()).expect("forward");
    let losses = model.loss(&out, &ids, None).expect("loss");
    assert_logits("mixtral", out.logits.clone(), &golden);
    for (key, ours) in [
        ("loss", losses.loss),
        ("ce_loss", losses.ce_loss),
        ("aux_loss", losses.aux_loss),
    ] {
        let (_, want) = golden.f32(key);
        let ours = f64::from(ours.into_scalar::<f32>());
        family::assert_rel(&format!("mixtral {key}"), ours, f64::from(want[0]), 1e-5);
    }
    // The routers see the same inputs: their logits match HF's.
    for (l, ours) in out.router_logits.iter().enumerate() {
        let (shape, want) = golden.f32(&format!("router_logits.{l}"));
        assert_eq!(ours.dims().to_vec(), shape);
        let (err, scale) = max_errors(&f32s(ours.clone()), &want);
        assert!(err <= 1e-4 * scale, "router {l}: {err} vs {scale}");
    }
    // HF's masked aux loss of HF's own router logits.
    let (_, mask) = golden.i64("aux_attention_mask");
    let mask: Vec<f32> = mask.iter().map(|&m| m as f32).collect();
    let layers: Vec<Tensor<2>> = (0..2)
        .map(|l| {
            let (shape, v) = golden.f32(&format!("router_logits.{l}"));
            Tensor::from_data(TensorData::new(v, [shape[0], shape[1]]), &device)
        })
        .collect();
    let masked = hf_load_balancing_loss(&layers, 2, Some(&mask)).expect("masked aux");
    let (_, want) = golden.f32("aux_loss_masked");
    let masked = f64::from(masked.into_scalar::<f32>());
    family::assert_rel("mixtral aux_loss_masked", masked, f64::from(want[0]), 1e-5);

    // Greedy continuation with the KV cache.
    let (_, prompt) = golden.i64("prompt_ids");
    let (_, want) = golden.i64("greedy_ids");
    let prompt: Vec<usize> = prompt.iter().map(|&t| t as usize).collect();
    let new = want.len() - prompt.len();
    let got = generate(&model, &prompt, &GenerationConfig::greedy(new), &device).expect("gen");
    let want: Vec<usize> = want[prompt.len()..].iter().map(|&t| t as usize).collect();
    assert_eq!(got, want, "greedy continuation differs from transformers");

    // The directory through the family list: config dispatch, mapping and expected tables,
    // the checked loader.
    let any = load_causal_lm(fixtures().join("mixtral"), &device).expect("load_causal_lm");
    assert_eq!(any.model_type(), "mixtral");
    assert_logits(
        "mixtral (load_causal_lm)",
        any.logits(t).expect("logits"),
        &golden,
    );
}

#[test]
fn mixtral_training_matches_pytorch() {
    let start = replicate(&fixture(&Device::flex().autodiff()));
    // An element moves by at most ~lr per step; f32 reduction-order differences reach
    // the parameters through Adam's m/√v at a small fraction of that.
    family::training_matches_pytorch(&start, "mixtral", 2e-5);
}

/// Layouts the `world = 1` training run is compared under: EP, EP·ETP with TP, PP, TP with
/// PP, and TP with EP over all ranks.
const LAYOUTS: [(usize, &str); 5] = [
    (2, "ep=2"),
    (4, "tp=2,ep=2,etp=2"),
    (2, "pp=2"),
    (4, "tp=2,pp=2"),
    (4, "tp=2,ep=4"),
];

#[test]
fn mixtral_training_under_five_layouts_matches_one_rank() {
    let start = replicate(&fixture(&Device::flex().autodiff()));
    family::layouts_match_one_rank(&start, "mixtral", &LAYOUTS);
}

#[test]
fn a_config_contradicting_the_weights_is_refused_naming_the_tensor() {
    let dir = std::env::temp_dir().join(format!("mixtral-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let src = fixtures().join("mixtral");
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).expect("copy");
    let text = std::fs::read_to_string(src.join("config.json")).expect("config");
    let mut config: serde_json::Value = serde_json::from_str(&text).expect("json");
    config["num_local_experts"] = 4.into();
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write");
    let err = match load_causal_lm(&dir, &Device::flex()) {
        Ok(_) => panic!("8 stored experts under num_local_experts = 4 must be refused"),
        Err(e) => e.to_string(),
    };
    println!("{err}");
    assert!(err.contains("block_sparse_moe"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
