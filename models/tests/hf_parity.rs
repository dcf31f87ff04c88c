//! Parity with HF transformers 5.23 goldens (docs/models.md §Goldens and parity tests) on the
//! committed tiny fixtures (`tests/fixtures/make_fixtures.py`). Tolerance:
//! `max|ours − golden| ≤ 1e-4 · max|golden|` for logits, 1e-5 relative for losses; greedy
//! continuations token for token.

mod common;

use burn::tensor::{Device, Int, Tensor};
use common::{FixtureSource, Golden, fixtures, max_errors};
use moe_models::WeightSource;
use moe_models::causal_lm::{
    CausalLm, GenerationConfig, generate, hf_load_balancing_loss, token_ids,
};
use moe_models::{
    DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
};

fn input_ids(golden: &Golden, vocab: usize, device: &Device) -> (Vec<i64>, Tensor<2, Int>) {
    let (shape, ids) = golden.i64("input_ids");
    let t = token_ids(&ids, [shape[0], shape[1]], vocab, device).expect("ids");
    (ids, t)
}

fn assert_logits(name: &str, ours: Tensor<3>, golden: &Golden) {
    let (shape, want) = golden.f32("logits");
    assert_eq!(ours.dims().to_vec(), shape, "{name}: logits shape");
    let got = ours.into_data().try_to_vec::<f32>().expect("f32 logits");
    let (err, scale) = max_errors(&got, &want);
    println!(
        "{name}: max|logit err| = {err:.3e}, max|golden| = {scale:.4}, ratio {:.3e}",
        err / scale
    );
    assert!(
        err <= 1e-4 * scale,
        "{name}: max error {err} > 1e-4 · {scale}"
    );
}

fn assert_rel(name: &str, ours: f32, golden: f32) {
    let rel = (ours - golden).abs() / golden.abs();
    println!("{name}: ours {ours:.7}, golden {golden:.7}, rel err {rel:.3e}");
    assert!(rel <= 1e-5, "{name}: {ours} vs {golden} (rel {rel})");
}

fn assert_greedy<M: CausalLm>(name: &str, model: &M, golden: &Golden, device: &Device) {
    let (_, prompt) = golden.i64("prompt_ids");
    let (_, want) = golden.i64("greedy_ids");
    let prompt: Vec<usize> = prompt.iter().map(|&t| t as usize).collect();
    let new = want.len() - prompt.len();
    let got = generate(model, &prompt, &GenerationConfig::greedy(new), device).expect("generate");
    let want: Vec<usize> = want[prompt.len()..].iter().map(|&t| t as usize).collect();
    println!("{name}: greedy {got:?}");
    assert_eq!(
        got, want,
        "{name}: greedy continuation differs from transformers"
    );
}

fn qwen3_moe(dir: &str) -> (Qwen3MoeForCausalLM, Device) {
    let device = Device::flex();
    let path = fixtures().join(dir);
    let config = Qwen3MoeConfig::from_file(path.join("config.json")).expect("config");
    let model = Qwen3MoeForCausalLM::from_weights(&config, &FixtureSource::open(&path), &device)
        .expect("load");
    (model, device)
}

fn check_qwen3_moe(name: &str) {
    let (model, device) = qwen3_moe(name);
    let golden = Golden::open(name);
    let (ids, t) = input_ids(&golden, model.config().vocab_size, &device);
    let out = model.forward(t).expect("forward");
    let losses = model.loss(&out, &ids, None).expect("loss");
    assert_logits(name, out.logits, &golden);
    for (key, ours) in [
        ("loss", losses.loss),
        ("aux_loss", losses.aux_loss),
        ("ce_loss", losses.ce_loss),
    ] {
        let (_, want) = golden.f32(key);
        assert_rel(&format!("{name} {key}"), ours.into_scalar::<f32>(), want[0]);
    }
    // The masked aux loss on HF's own router logits
    // (docs/models.md §Qwen3-MoE load-balancing loss).
    let (_, mask) = golden.i64("aux_attention_mask");
    let mask: Vec<f32> = mask.iter().map(|&m| m as f32).collect();
    let layers: Vec<Tensor<2>> = [1, 2]
        .iter()
        .map(|l| {
            let (shape, v) = golden.f32(&format!("router_logits.{l}"));
            Tensor::from_data(
                burn::tensor::TensorData::new(v, [shape[0], shape[1]]),
                &device,
            )
        })
        .collect();
    let k = model.config().num_experts_per_tok;
    let masked = hf_load_balancing_loss(&layers, k, Some(&mask)).expect("masked aux");
    let (_, want) = golden.f32("aux_loss_masked");
    assert_rel(
        &format!("{name} aux_loss_masked"),
        masked.into_scalar::<f32>(),
        want[0],
    );
    assert_greedy(name, &model, &golden, &device);
}

#[test]
fn qwen3_moe_fp32_matches_transformers() {
    check_qwen3_moe("qwen3_moe");
}

#[test]
fn qwen3_moe_bf16_upcast_matches_transformers_f32_arithmetic() {
    check_qwen3_moe("qwen3_moe_bf16");
}

#[test]
fn qwen3_dense_tied_matches_transformers() {
    let device = Device::flex();
    let path = fixtures().join("qwen3");
    let config = Qwen3Config::from_file(path.join("config.json")).expect("config");
    assert!(config.tie_word_embeddings);
    let model = Qwen3ForCausalLM::from_weights(&config, &FixtureSource::open(&path), &device)
        .expect("load");
    let golden = Golden::open("qwen3");
    let (ids, t) = input_ids(&golden, config.vocab_size, &device);
    let logits = model.forward(t).expect("forward");
    let loss = moe_models::causal_lm::causal_lm_loss(logits.clone(), &ids).expect("loss");
    assert_logits("qwen3", logits, &golden);
    let (_, want) = golden.f32("loss");
    assert_rel("qwen3 loss", loss.into_scalar::<f32>(), want[0]);
    assert_greedy("qwen3", &model, &golden, &device);
}

/// Dense Qwen3 with sliding windows (`qwen3_sliding`: written `layer_types` sliding, full,
/// sliding, sliding; window 5 < the 12 positions), and greedy decoding with the KV cache 16
/// positions long, past the window (the sliding layers keep only their last 4 keys).
#[test]
fn qwen3_sliding_window_matches_transformers() {
    let device = Device::flex();
    let path = fixtures().join("qwen3_sliding");
    let config = Qwen3Config::from_file(path.join("config.json")).expect("config");
    let windows: Vec<_> = (0..4).map(|i| config.layer_sliding_window(i)).collect();
    assert_eq!(windows, [Some(5), None, Some(5), Some(5)]);
    let model = Qwen3ForCausalLM::from_weights(&config, &FixtureSource::open(&path), &device)
        .expect("load");
    let golden = Golden::open("qwen3_sliding");
    let (ids, t) = input_ids(&golden, config.vocab_size, &device);
    let logits = model.forward(t).expect("forward");
    let loss = moe_models::causal_lm::causal_lm_loss(logits.clone(), &ids).expect("loss");
    assert_logits("qwen3_sliding", logits, &golden);
    let (_, want) = golden.f32("loss");
    assert_rel("qwen3_sliding loss", loss.into_scalar::<f32>(), want[0]);
    assert_greedy("qwen3_sliding", &model, &golden, &device);
}

#[test]
fn missing_and_misshaped_tensors_are_named() {
    struct Without<'a>(&'a FixtureSource, &'static str);
    impl moe_models::WeightSource for Without<'_> {
        fn tensor_f32(&self, n: &str) -> Result<(Vec<usize>, Vec<f32>), moe_models::ModelError> {
            if n == self.1 {
                return Err(moe_models::ModelError::MissingTensor { name: n.to_owned() });
            }
            self.0.tensor_f32(n)
        }
        fn contains(&self, n: &str) -> bool {
            n != self.1 && self.0.contains(n)
        }
    }
    let device = Device::flex();
    let path = fixtures().join("qwen3_moe");
    let config = Qwen3MoeConfig::from_file(path.join("config.json")).expect("config");
    let source = FixtureSource::open(&path);
    let missing = "model.layers.2.mlp.experts.5.up_proj.weight";
    let err = Qwen3MoeForCausalLM::from_weights(&config, &Without(&source, missing), &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains(missing), "{err}");
    // A config with a different expert width mis-shapes every expert tensor.
    let wrong = Qwen3MoeConfig {
        moe_intermediate_size: config.moe_intermediate_size + 8,
        ..config
    };
    let err = Qwen3MoeForCausalLM::from_weights(&wrong, &source, &device)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.1.mlp.experts.0.gate_proj.weight"),
        "{err}"
    );
}

fn deepseek(dir: &str) -> (DeepseekV3ForCausalLM, Device) {
    let device = Device::flex();
    let path = fixtures().join(dir);
    let config = DeepseekV3Config::from_file(path.join("config.json")).expect("config");
    assert!(config.warnings().is_empty(), "{:?}", config.warnings());
    let model = DeepseekV3ForCausalLM::from_weights(&config, &FixtureSource::open(&path), &device)
        .expect("load");
    (model, device)
}

/// Rows of `(indices, weights)` sorted by expert index (HF's top-k is `sorted=False`,
/// docs/models.md §Goldens and parity tests, item 2).
fn sorted_rows(idx: &[i64], w: &[f32], k: usize) -> Vec<Vec<(i64, f32)>> {
    idx.chunks(k)
        .zip(w.chunks(k))
        .map(|(i, w)| {
            let mut row: Vec<(i64, f32)> = i.iter().copied().zip(w.iter().copied()).collect();
            row.sort_by_key(|p| p.0);
            row
        })
        .collect()
}

fn check_deepseek(dir: &str, golden_name: &str, greedy: bool) {
    let (model, device) = deepseek(dir);
    let golden = Golden::open(golden_name);
    let (_, t) = input_ids(&golden, model.config().vocab_size, &device);
    let out = model.forward(t.clone()).expect("forward");
    // Layer 1 is the first MoE layer (first_k_dense_replace = 1).
    let routing = out.routing[0].clone();
    if golden.has("mtp_logits") {
        // docs/models.md §Multi-token prediction: MTP module 0 (stored as layer N = 3) against HF
        // 5.23's `MtpLayer`.
        assert_eq!(model.mtp.len(), 1, "{dir}: the MTP layer should be loaded");
        let mtp = model.forward_mtp(t, out.hidden.clone()).expect("mtp");
        let (shape, want) = golden.f32("mtp_logits");
        assert_eq!(mtp[0].dims().to_vec(), shape);
        let got = mtp[0].clone().into_data().try_to_vec::<f32>().unwrap();
        let (err, scale) = max_errors(&got, &want);
        println!("{dir}: MTP logits max err {err:.3e} (max {scale:.3})");
        assert!(err <= 1e-4 * scale, "{dir}: MTP logits differ by {err}");
    }
    assert_logits(golden_name, out.logits, &golden);

    let (shape, want_logits) = golden.f32("router_logits");
    let got_logits = routing
        .router_logits
        .clone()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    assert_eq!(routing.router_logits.dims().to_vec(), shape);
    let (err, scale) = max_errors(&got_logits, &want_logits);
    println!("{golden_name}: router logits max err {err:.3e} (max {scale:.3})");
    assert!(err <= 1e-4 * scale);

    let k = model.config().num_experts_per_tok;
    let (_, want_idx) = golden.i64("topk_indices");
    let (_, want_w) = golden.f32("topk_weights");
    let got_idx = routing
        .topk_indices
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .unwrap();
    let got_w = routing
        .topk_weights
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let (ours, theirs) = (
        sorted_rows(&got_idx, &got_w, k),
        sorted_rows(&want_idx, &want_w, k),
    );
    let mut max_w = 0.0f32;
    for (r, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let ia: Vec<i64> = a.iter().map(|p| p.0).collect();
        let ib: Vec<i64> = b.iter().map(|p| p.0).collect();
        assert_eq!(ia, ib, "{golden_name}: row {r} selects different experts");
        for (x, y) in a.iter().zip(b) {
            max_w = max_w.max((x.1 - y.1).abs());
        }
    }
    println!("{golden_name}: top-k indices identical, max weight err {max_w:.3e}");
    assert!(
        max_w <= 1e-5,
        "{golden_name}: top-k weights differ by {max_w}"
    );
    if greedy {
        assert_greedy(golden_name, &model, &golden, &device);
    }
}

#[test]
fn deepseek_v3_matches_transformers() {
    check_deepseek("deepseek_v3", "deepseek_v3", true);
}

#[test]
fn deepseek_v3_sharded_matches_transformers() {
    check_deepseek("deepseek_v3_sharded", "deepseek_v3", false);
}

#[test]
fn deepseek_v3_fp8_reference_dequant_matches_transformers() {
    check_deepseek("deepseek_v3_fp8_dequant", "deepseek_v3_fp8_dequant", false);
}

#[test]
fn deepseek_v3_router_in_isolation_reproduces_topk_from_golden_logits() {
    // docs/models.md §Goldens and parity tests, item 2: golden router_logits → identical top-k
    // indices, weights to 1e-6.
    use burn::tensor::TensorData;
    use moe_backend::router::{GroupLimitConfig, ScoreFunction, ScoreSpec, compute_routing};
    let device = Device::flex();
    let path = fixtures().join("deepseek_v3");
    let config = DeepseekV3Config::from_file(path.join("config.json")).expect("config");
    let (_, bias) = FixtureSource::open(&path)
        .tensor_f32("model.layers.1.mlp.gate.e_score_correction_bias")
        .expect("bias");
    let golden = Golden::open("deepseek_v3");
    let (shape, logits) = golden.f32("router_logits");
    let spec = ScoreSpec {
        function: ScoreFunction::Sigmoid,
        pre_softmax: false,
        normalize: config.norm_topk_prob,
        scaling_factor: Some(config.routed_scaling_factor),
    };
    let k = config.num_experts_per_tok;
    let routing = compute_routing(
        Tensor::from_data(TensorData::new(logits, [shape[0], shape[1]]), &device),
        &spec,
        k,
        Some(&GroupLimitConfig::new(config.n_group, config.topk_group, 2)),
        Some(Tensor::from_data(
            TensorData::new(bias, [shape[1]]),
            &device,
        )),
        None,
    )
    .expect("routing");
    let idx = routing
        .indices
        .clone()
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .unwrap();
    let w = routing
        .probs
        .gather(1, routing.indices)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let (_, want_idx) = golden.i64("topk_indices");
    let (_, want_w) = golden.f32("topk_weights");
    for (r, (a, b)) in sorted_rows(&idx, &w, k)
        .iter()
        .zip(&sorted_rows(&want_idx, &want_w, k))
        .enumerate()
    {
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x.0, y.0, "row {r}");
            assert!((x.1 - y.1).abs() <= 1e-6, "row {r}: {} vs {}", x.1, y.1);
        }
    }
}

/// Serves a per-expert checkpoint in HF's in-memory stacked layout
/// (`mlp.experts.gate_up_proj [E, 2Im, H]`, `mlp.experts.down_proj [E, H, Im]`).
struct Stacked {
    inner: FixtureSource,
    experts: usize,
}

impl Stacked {
    fn split(name: &str) -> Option<(&str, &str)> {
        let (prefix, tail) = name.rsplit_once(".mlp.experts.")?;
        matches!(tail, "gate_up_proj" | "down_proj").then_some((prefix, tail))
    }
}

impl moe_models::WeightSource for Stacked {
    fn tensor_f32(&self, n: &str) -> Result<(Vec<usize>, Vec<f32>), moe_models::ModelError> {
        if n.contains(".mlp.experts.") && Self::split(n).is_none() {
            return Err(moe_models::ModelError::MissingTensor { name: n.to_owned() });
        }
        let Some((prefix, tail)) = Self::split(n) else {
            return self.inner.tensor_f32(n);
        };
        let parts: &[&str] = if tail == "gate_up_proj" {
            &["gate_proj", "up_proj"]
        } else {
            &["down_proj"]
        };
        let mut values = Vec::new();
        let mut rows = 0;
        let mut cols = 0;
        for e in 0..self.experts {
            rows = 0;
            for p in parts {
                let (shape, v) = self
                    .inner
                    .tensor_f32(&format!("{prefix}.mlp.experts.{e}.{p}.weight"))?;
                rows += shape[0];
                cols = shape[1];
                values.extend(v);
            }
        }
        Ok((vec![self.experts, rows, cols], values))
    }

    fn contains(&self, n: &str) -> bool {
        match Self::split(n) {
            Some((prefix, _)) => self
                .inner
                .contains(&format!("{prefix}.mlp.experts.0.down_proj.weight")),
            None => !n.contains(".mlp.experts.") && self.inner.contains(n),
        }
    }
}

#[test]
fn qwen3_moe_stacked_expert_layout_gives_the_same_logits() {
    let device = Device::flex();
    let path = fixtures().join("qwen3_moe");
    let config = Qwen3MoeConfig::from_file(path.join("config.json")).expect("config");
    let source = Stacked {
        inner: FixtureSource::open(&path),
        experts: config.num_experts,
    };
    let model = Qwen3MoeForCausalLM::from_weights(&config, &source, &device).expect("load stacked");
    let golden = Golden::open("qwen3_moe");
    let (_, t) = input_ids(&golden, config.vocab_size, &device);
    assert_logits(
        "qwen3_moe (stacked experts)",
        model.forward(t).expect("forward").logits,
        &golden,
    );
}
