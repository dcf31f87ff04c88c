//! The MoE layer as gpt-oss's MoE block against transformers 5.23 `GptOssMLP` (router with a
//! bias, "top-k then softmax", experts with biases, clamped SwiGLU): forward, routing and every
//! gradient from `tests/fixtures/gpt_oss_moe.golden.safetensors`, made by
//! `tests/fixtures/make_gpt_oss_moe_golden.py`. The HF parameters go through the layout
//! conversions of [`crate::experts::layout`].

use std::collections::HashMap;

use burn::module::Param;
use burn::tensor::{DType, Device, Tensor, TensorData};

use super::*;
use crate::experts::layout::{
    fc1_bias_from_interleaved, fc1_bias_to_interleaved, fc1_from_interleaved, fc1_to_interleaved,
};
use crate::ops::int_tensor_to_usize;
use crate::testing::values;

const GOLDEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/gpt_oss_moe.golden.safetensors"
);
const T: usize = 24;
const H: usize = 16;
const E: usize = 4;
const K: usize = 2;
const I: usize = 8;

/// The F32 tensors of a safetensors file: name -> (shape, values).
fn read_f32_safetensors(path: &str) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let len = u64::from_le_bytes(bytes[..8].try_into().expect("header length")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).expect("header");
    let data = &bytes[8 + len..];
    let mut out = HashMap::new();
    for (name, entry) in header.as_object().expect("header object") {
        if name == "__metadata__" {
            continue;
        }
        assert_eq!(entry["dtype"], "F32", "{name}");
        let shape: Vec<usize> = entry["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_u64().expect("dim") as usize)
            .collect();
        let offsets = entry["data_offsets"].as_array().expect("offsets");
        let (a, b) = (
            offsets[0].as_u64().expect("start") as usize,
            offsets[1].as_u64().expect("end") as usize,
        );
        let vals = data[a..b]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("f32")))
            .collect();
        out.insert(name.clone(), (shape, vals));
    }
    out
}

struct Golden(HashMap<String, (Vec<usize>, Vec<f32>)>);

impl Golden {
    fn get<const D: usize>(&self, name: &str, device: &Device) -> Tensor<D> {
        let (shape, vals) = self.0.get(name).unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(shape.len(), D, "{name}");
        Tensor::from_data(
            TensorData::new(vals.clone(), shape.clone()),
            (device, DType::F32),
        )
    }

    fn host(&self, name: &str) -> Vec<f64> {
        self.0[name].1.iter().map(|&v| f64::from(v)).collect()
    }
}

/// A trainable leaf with the values of `t`.
fn leaf<const D: usize>(t: Tensor<D>) -> Param<Tensor<D>> {
    let ad = Device::flex().autodiff();
    Param::from_tensor(Tensor::from_data(t.into_data(), (&ad, DType::F32)).require_grad())
}

/// `|a − b| ≤ rel · max|b|` over the tensor, reporting the worst element.
fn assert_rel(a: &[f64], b: &[f64], rel: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "{what}: all zero");
    let (i, err) = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .enumerate()
        .fold((0, 0.0), |m, (i, e)| if e > m.1 { (i, e) } else { m });
    assert!(
        err <= rel * scale,
        "{what}: index {i}: {} vs {} (error {err:e}, {:e} of max |{scale}|)",
        a[i],
        b[i],
        err / scale
    );
}

#[test]
fn layer_matches_transformers_gpt_oss_mlp_forward_and_every_gradient() {
    let golden = Golden(read_f32_safetensors(GOLDEN));
    let (host, ad) = (Device::flex(), Device::flex().autodiff());

    // gpt-oss's router: logits = x·Wᵀ + b, top-k of the logits, softmax over the k values, which
    // is the default post-softmax softmax router with a bias.
    let router_cfg = TopKRouterConfig::new(H, E, K).with_bias(true);
    let cfg = MoeLayerConfig::new(router_cfg.clone(), I)
        .with_activation(ExpertActivation::clamped_swiglu())
        .with_experts_bias(true);
    let router = router_cfg
        .init_with_params(
            leaf(golden.get::<2>("router.weight", &host)),
            Some(leaf(golden.get::<1>("router.bias", &host))),
            None,
        )
        .expect("router");
    let fc1 = fc1_from_interleaved(golden.get("experts.gate_up_proj", &host)).expect("fc1");
    let fc1_bias = fc1_bias_from_interleaved(golden.get("experts.gate_up_proj_bias", &host))
        .expect("fc1 bias");
    let fc2 = golden.get::<3>("experts.down_proj", &host).swap_dims(1, 2);
    let experts = GroupedExpertsConfig::new(E, H, I)
        .with_activation(cfg.activation)
        .with_bias(cfg.experts_bias)
        .init_with_params(
            leaf(fc1),
            leaf(fc2),
            Some(leaf(fc1_bias)),
            Some(leaf(golden.get("experts.down_proj_bias", &host))),
        )
        .expect("experts");
    let layer = MoeLayer {
        router,
        experts,
        shared_experts: None,
    };

    let x = golden.get::<2>("x", &ad).require_grad();
    let out = layer
        .forward(
            x.clone(),
            &layer.router.init_state(),
            &RouteOptions::default(),
        )
        .expect("forward");
    let loss = (out.output.clone() * golden.get::<2>("loss_weight", &ad)).sum();
    let grads = loss.backward();

    let rel = 1e-5;
    assert_rel(&values(out.output), &golden.host("out"), rel, "output");
    assert_rel(
        &values(out.routing.logits.clone()),
        &golden.host("router_logits"),
        rel,
        "router logits",
    );
    let indices = out.routing.topk_indices.clone();
    let chosen: Vec<f64> = int_tensor_to_usize(indices.clone())
        .into_iter()
        .map(|v| v as f64)
        .collect();
    assert_eq!(chosen, golden.host("router_indices"), "top-k experts");
    let scores = out.routing.probs.clone().gather(1, indices);
    assert_eq!(scores.dims(), [T, K]);
    assert_rel(
        &values(scores),
        &golden.host("router_scores"),
        rel,
        "router scores",
    );

    let grad2 = |p: &Param<Tensor<2>>| p.grad(&grads).expect("grad");
    let grad3 = |p: &Param<Tensor<3>>| p.grad(&grads).expect("grad");
    let bias = |p: &Option<Param<Tensor<1>>>| p.as_ref().expect("bias").grad(&grads).expect("grad");
    let checks: [(&str, Vec<f64>); 7] = [
        ("grad.x", values(x.grad(&grads).expect("dx"))),
        ("grad.router.weight", values(grad2(&layer.router.weight))),
        ("grad.router.bias", values(bias(&layer.router.bias))),
        (
            "grad.experts.gate_up_proj",
            values(fc1_to_interleaved(grad3(&layer.experts.fc1)).expect("layout")),
        ),
        (
            "grad.experts.gate_up_proj_bias",
            values(
                fc1_bias_to_interleaved(grad2(layer.experts.fc1_bias.as_ref().expect("b1")))
                    .expect("layout"),
            ),
        ),
        (
            "grad.experts.down_proj",
            values(grad3(&layer.experts.fc2).swap_dims(1, 2)),
        ),
        (
            "grad.experts.down_proj_bias",
            values(grad2(layer.experts.fc2_bias.as_ref().expect("b2"))),
        ),
    ];
    for (name, got) in checks {
        assert_rel(&got, &golden.host(name), rel, name);
    }
}
