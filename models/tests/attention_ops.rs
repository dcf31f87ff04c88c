//! The attention options of the newer families against transformers 5.23's own modules
//! (goldens by `tests/fixtures/make_attention_fixtures.py`):
//! - one gpt-oss attention block (`GptOssAttention`: q/k/v/o biases, learned sinks, a full and
//!   a sliding-window layer) — output and the gradients of the input, every weight, bias and
//!   the sinks;
//! - GLM-4.5-MoE partial rotary (`apply_rotary_pos_emb` with `Glm4MoeRotaryEmbedding`'s
//!   frequencies, `partial_rotary_factor` 0.5) — outputs and input gradients.
//!
//! Tolerance: `max|ours − golden| ≤ 1e-5 · max|golden| + 1e-6`.

mod common;

use burn::module::Param;
use burn::tensor::{Device, Tensor, TensorData};
use common::{Golden, max_errors};
use moe_models::config::RopeParameters;
use moe_models::layers::rope::{RotaryEmbedding, apply_rotary};
use moe_models::layers::{Attention, AttentionConfig};

fn ad() -> Device {
    Device::flex().autodiff()
}

fn tensor<const D: usize>(golden: &Golden, name: &str, device: &Device) -> Tensor<D> {
    let (shape, values) = golden.f32(name);
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// A torch `[out, in]` linear weight as Burn's `[in, out]` parameter.
fn weight(golden: &Golden, name: &str, device: &Device) -> Param<Tensor<2>> {
    Param::from_tensor(tensor::<2>(golden, name, device).transpose())
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32")
}

fn assert_close(what: &str, ours: Vec<f32>, golden: &[f32]) {
    let (err, scale) = max_errors(&ours, golden);
    println!("{what}: max err {err:.3e} (max|golden| {scale:.4})");
    assert!(
        err <= 1e-5 * scale + 1e-6,
        "{what}: max error {err} > 1e-5 · {scale} + 1e-6"
    );
}

fn gpt_oss_block(name: &str, window: Option<usize>) {
    let device = ad();
    let g = Golden::open("attention_ops");
    let p = format!("gpt_oss.{name}");
    let mut attn: Attention = AttentionConfig::new(32, 4, 2, 8)
        .with_attention_bias(true)
        .with_qk_norm(false)
        .with_sinks(true)
        .with_sliding_window(window)
        .init(&device)
        .expect("block");
    for (proj, linear) in [
        ("q_proj", &mut attn.q_proj),
        ("k_proj", &mut attn.k_proj),
        ("v_proj", &mut attn.v_proj),
        ("o_proj", &mut attn.o_proj),
    ] {
        linear.weight = weight(&g, &format!("{p}.{proj}.weight"), &device);
        linear.bias = Some(Param::from_tensor(tensor::<1>(
            &g,
            &format!("{p}.{proj}.bias"),
            &device,
        )));
    }
    attn.sinks = Some(Param::from_tensor(tensor::<1>(
        &g,
        &format!("{p}.sinks"),
        &device,
    )));
    let x = tensor::<3>(&g, &format!("{p}.x"), &device).require_grad();
    let [_, s, _] = x.dims();
    let rope = RotaryEmbedding::new(&RopeParameters::default(), 8).expect("rope");
    let out = attn.forward(x.clone(), &rope.tables(0, s, &device), None);
    let w = tensor::<3>(&g, &format!("{p}.w"), &device);
    let grads = (out.clone() * w).sum().backward();
    assert_close(
        &format!("{p} out"),
        values(out),
        &g.f32(&format!("{p}.out")).1,
    );
    let grad = |what: &str| g.f32(&format!("{p}.grad.{what}")).1;
    assert_close(
        &format!("{p} grad x"),
        values(x.grad(&grads).expect("x grad")),
        &grad("x"),
    );
    for (proj, linear) in [
        ("q_proj", &attn.q_proj),
        ("k_proj", &attn.k_proj),
        ("v_proj", &attn.v_proj),
        ("o_proj", &attn.o_proj),
    ] {
        let gw = linear.weight.val().grad(&grads).expect("weight grad");
        assert_close(
            &format!("{p} grad {proj}.weight"),
            values(gw.transpose()),
            &grad(&format!("{proj}.weight")),
        );
        let bias = linear.bias.as_ref().expect("bias");
        let gb = bias.val().grad(&grads).expect("bias grad");
        assert_close(
            &format!("{p} grad {proj}.bias"),
            values(gb),
            &grad(&format!("{proj}.bias")),
        );
    }
    let sinks = attn.sinks.as_ref().expect("sinks").val();
    assert_close(
        &format!("{p} grad sinks"),
        values(sinks.grad(&grads).expect("sinks grad")),
        &grad("sinks"),
    );
}

#[test]
fn gpt_oss_full_attention_block_with_sinks_and_biases_matches_transformers() {
    gpt_oss_block("full", None);
}

#[test]
fn gpt_oss_sliding_attention_block_with_sinks_and_biases_matches_transformers() {
    gpt_oss_block("sliding", Some(4));
}

#[test]
fn glm4_moe_partial_rotary_matches_transformers() {
    let device = ad();
    let g = Golden::open("attention_ops");
    let config = AttentionConfig::new(64, 4, 2, 16).with_partial_rotary_factor(0.5);
    assert_eq!(config.rotary_dim().expect("rotary dim"), 8);
    let rope = config
        .rotary_embedding(&RopeParameters::default())
        .expect("rope");
    assert_close(
        "inv_freq",
        rope.inv_freq().to_vec(),
        &g.f32("partial_rope.inv_freq").1,
    );
    let q = tensor::<4>(&g, "partial_rope.q", &device).require_grad();
    let k = tensor::<4>(&g, "partial_rope.k", &device).require_grad();
    let s = q.dims()[2];
    let tables = rope.tables(3, s, &device);
    let (qe, ke) = (
        apply_rotary(q.clone(), &tables),
        apply_rotary(k.clone(), &tables),
    );
    let wq = tensor::<4>(&g, "partial_rope.wq", &device);
    let wk = tensor::<4>(&g, "partial_rope.wk", &device);
    let grads = ((qe.clone() * wq).sum() + (ke.clone() * wk).sum()).backward();
    assert_close("q_embed", values(qe), &g.f32("partial_rope.q_embed").1);
    assert_close("k_embed", values(ke), &g.f32("partial_rope.k_embed").1);
    assert_close(
        "grad q",
        values(q.grad(&grads).expect("q grad")),
        &g.f32("partial_rope.grad.q").1,
    );
    assert_close(
        "grad k",
        values(k.grad(&grads).expect("k grad")),
        &g.f32("partial_rope.grad.k").1,
    );
}

#[test]
fn bad_attention_options_are_refused_naming_the_field() {
    let device = Device::flex();
    let err = |c: AttentionConfig| c.init(&device).expect_err("refused").to_string();
    let base = || AttentionConfig::new(64, 4, 2, 16);
    assert!(err(base().with_sliding_window(Some(0))).contains("sliding_window"));
    for f in [0.0, 1.5, 0.1, f64::NAN] {
        // 0.1 · 16 = 1 rotated dim: odd.
        let e = err(base().with_partial_rotary_factor(f));
        assert!(e.contains("partial_rotary_factor"), "{f}: {e}");
    }
}
