use serde_json::json;

use super::*;
use moe_backend::testing::TempDir;
use moe_bridge::safetensors::{TensorView, write_hf_checkpoint};

fn relu(x: f32) -> f32 {
    x.max(0.0)
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `down · (act(gate·x) ⊙ up·x)` for row-major `gate`, `up` `[f, h]`, `down` `[h, f]`.
fn glu(gate: &[f32], up: &[f32], down: &[f32], x: &[f32], act: fn(f32) -> f32) -> Vec<f32> {
    let h = x.len();
    let f = gate.len() / h;
    let dot = |w: &[f32], r: usize| (0..h).map(|j| w[r * h + j] * x[j]).sum::<f32>();
    let a: Vec<f32> = (0..f).map(|r| act(dot(gate, r)) * dot(up, r)).collect();
    (0..h)
        .map(|r| (0..f).map(|j| down[r * f + j] * a[j]).sum())
        .collect()
}

/// Post-softmax MoE forward on the host: top-k of the router logits (ties → lower index),
/// softmax over the k; returns the output and the chosen experts.
fn moe(
    router: &[f32],
    shards: &[ExpertShard],
    scale: &UpcycleScale,
    x: &[f32],
    act: fn(f32) -> f32,
) -> (Vec<f32>, Vec<usize>) {
    let h = x.len();
    let logits: Vec<f32> = (0..scale.experts)
        .map(|e| (0..h).map(|j| router[e * h + j] * x[j]).sum())
        .collect();
    let mut order: Vec<usize> = (0..scale.experts).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let chosen = order[..scale.topk].to_vec();
    let max = chosen.iter().map(|&e| logits[e]).fold(f32::MIN, f32::max);
    let z: f32 = chosen.iter().map(|&e| (logits[e] - max).exp()).sum();
    let mut out = vec![0.0; h];
    for &e in &chosen {
        let w = (logits[e] - max).exp() / z;
        let s = &shards[scale.shard_of(e)];
        for (o, y) in out.iter_mut().zip(glu(&s.gate, &s.up, &s.down, x, act)) {
            *o += w * y;
        }
    }
    (out, chosen)
}

#[test]
fn scale_rules_and_divisibility_errors() {
    let s = UpcycleScale::new(4, 2, 2, 8, RouterMode::PostSoftmax).unwrap();
    assert_eq!((s.expansion, s.moe_intermediate, s.scale), (2, 4, 2.0));
    assert!((s.weight_multiplier.powi(3) - 2.0).abs() < 1e-12);
    let pre = UpcycleScale::new(8, 2, 2, 8, RouterMode::PreSoftmax).unwrap();
    assert_eq!(pre.scale, 4.0 * 4.0 / 2.0);
    let (field, reason) = UpcycleScale::new(4, 2, 3, 8, RouterMode::PostSoftmax).unwrap_err();
    assert_eq!(field, "granularity");
    assert!(reason.contains("intermediate_size"), "{reason}");
    let (field, reason) = UpcycleScale::new(6, 2, 4, 8, RouterMode::PostSoftmax).unwrap_err();
    assert_eq!(field, "granularity");
    assert!(reason.contains("E = 6"), "{reason}");
    assert_eq!(
        UpcycleScale::new(4, 5, 1, 8, RouterMode::PostSoftmax)
            .unwrap_err()
            .0,
        "topk"
    );
}

#[test]
fn worked_example_e2g2t2() {
    // Dense SwiGLU H = 3, F = 4; E = 4, G = 2, k = 2 (R = 2), post-softmax.
    let (h, f) = (3, 4);
    let gate: Vec<f32> = (0..f * h)
        .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1)
        .collect();
    let up: Vec<f32> = (0..f * h)
        .map(|i| ((i * 5 % 13) as f32 - 6.0) * 0.1)
        .collect();
    let down: Vec<f32> = (0..h * f)
        .map(|i| ((i * 3 % 7) as f32 - 3.0) * 0.1)
        .collect();
    let scale = UpcycleScale::new(4, 2, 2, f, RouterMode::PostSoftmax).unwrap();
    let shards = split_dense_mlp(&gate, &up, &down, h, &scale);
    assert_eq!(shards.len(), 2);
    // Experts [s0, s1, s0, s1].
    assert_eq!(
        (0..4).map(|e| scale.shard_of(e)).collect::<Vec<_>>(),
        [0, 1, 0, 1]
    );
    // Shard 1 = rows 2..4 of gate and of up (split separately), columns 2..4 of down, × c.
    let c = scale.weight_multiplier;
    assert_eq!(shards[1].gate[0], (f64::from(gate[2 * h]) * c) as f32);
    assert_eq!(shards[1].up[h + 2], (f64::from(up[3 * h + 2]) * c) as f32);
    assert_eq!(shards[1].down[1], (f64::from(down[3]) * c) as f32);
    assert_eq!(shards[0].down[2], (f64::from(down[f]) * c) as f32);
    // Router rows [r0, r0, r1, r1].
    let router = upcycled_router(&mut SplitMix64::new(7), &scale, h, 0.5);
    assert_eq!(router[..h], router[h..2 * h]);
    assert_eq!(router[2 * h..3 * h], router[3 * h..]);
    assert_ne!(router[..h], router[2 * h..3 * h]);

    for x in [[0.3f32, -1.2, 0.7], [-0.5, 0.4, 1.1], [1.0, 1.0, -2.0]] {
        let (y, chosen) = moe(&router, &shards, &scale, &x, relu);
        // Top-2 picks one whole group, i.e. one copy of each shard.
        assert!(chosen == [0, 1] || chosen == [2, 3], "{chosen:?}");
        // 0.5 · 2 · (s0(x) + s1(x)) = dense(x): exact up to rounding for ReLU.
        let dense = glu(&gate, &up, &down, &x, relu);
        for (a, b) in y.iter().zip(&dense) {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                "{y:?} vs {dense:?}"
            );
        }
        // SiLU is not homogeneous: close, not exact.
        let (y, _) = moe(&router, &shards, &scale, &x, silu);
        let dense = glu(&gate, &up, &down, &x, silu);
        for (a, b) in y.iter().zip(&dense) {
            assert!((a - b).abs() <= 0.1 + 0.1 * b.abs(), "{y:?} vs {dense:?}");
        }
    }
}

fn tiny_dense(dir: &Path, tied: bool) {
    let (v, h, f, layers) = (8, 4, 6, 2);
    let mut tensors = vec![
        OwnedTensor::from_f32("model.embed_tokens.weight", vec![v, h], &vec![0.5; v * h]).unwrap(),
        OwnedTensor::from_f32("model.norm.weight", vec![h], &[1.0; 4]).unwrap(),
    ];
    if !tied {
        tensors
            .push(OwnedTensor::from_f32("lm_head.weight", vec![v, h], &vec![0.25; v * h]).unwrap());
    }
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        let vals = |n: usize, k: usize| (0..n).map(|i| (i + k) as f32 * 0.01).collect::<Vec<_>>();
        tensors.push(
            OwnedTensor::from_f32(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                &vals(h, l),
            )
            .unwrap(),
        );
        tensors.push(
            OwnedTensor::from_f32(
                format!("{p}.self_attn.q_proj.weight"),
                vec![h, h],
                &vals(h * h, l),
            )
            .unwrap()
            .cast(Dtype::BF16)
            .unwrap(),
        );
        for (proj, shape) in [
            ("gate_proj", [f, h]),
            ("up_proj", [f, h]),
            ("down_proj", [h, f]),
        ] {
            tensors.push(
                OwnedTensor::from_f32(
                    format!("{p}.mlp.{proj}.weight"),
                    shape.to_vec(),
                    &vals(f * h, l),
                )
                .unwrap(),
            );
        }
    }
    let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
    write_hf_checkpoint(dir, &views, u64::MAX, false).unwrap();
    let config = json!({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": h,
        "intermediate_size": f, "num_hidden_layers": layers, "vocab_size": v,
        "tie_word_embeddings": tied, "initializer_range": 0.1, "custom_key": [1, 2],
    });
    std::fs::write(dir.join(CONFIG_FILE), config.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
}

#[test]
fn upcycles_a_checkpoint_with_per_expert_names_and_a_qwen3_moe_config() {
    let tmp = TempDir::new("upcycle");
    let (src_dir, out) = (tmp.join("dense"), tmp.join("moe"));
    tiny_dense(&src_dir, true);
    let opts = UpcycleOptions {
        experts: 4,
        topk: 2,
        granularity: 2,
        seed: 3,
        ..UpcycleOptions::default()
    };
    let summary = upcycle(&src_dir, &out, &opts).unwrap();
    assert_eq!((summary.scale.moe_intermediate, summary.moe_layers), (3, 2));
    let ck = HfCheckpoint::open(&out).unwrap();
    let src = HfCheckpoint::open(&src_dir).unwrap();
    assert!(!ck.contains("lm_head.weight"), "tied embeddings stay tied");
    assert!(!ck.contains("model.layers.0.mlp.gate_proj.weight"));
    for name in [
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ] {
        let (a, b) = (ck.tensor(name).unwrap(), src.tensor(name).unwrap());
        assert_eq!(
            (a.dtype, a.bytes),
            (b.dtype, b.bytes),
            "{name} copied byte for byte"
        );
    }
    assert_eq!(
        ck.info("model.layers.1.mlp.gate.weight").unwrap().shape,
        [4, 4]
    );
    assert_eq!(
        ck.info("model.layers.0.mlp.experts.3.down_proj.weight")
            .unwrap()
            .shape,
        [4, 3]
    );
    let e1 = ck
        .read_f32("model.layers.0.mlp.experts.1.up_proj.weight")
        .unwrap()
        .1;
    let e3 = ck
        .read_f32("model.layers.0.mlp.experts.3.up_proj.weight")
        .unwrap()
        .1;
    assert_eq!(e1, e3, "experts 1 and 3 both hold shard 1");
    assert_eq!(
        ck.len(),
        2 + 2 * (2 + 1 + 12),
        "{:?}",
        ck.tensor_names().collect::<Vec<_>>()
    );
    let config = ck.config_json().unwrap();
    assert_eq!(config["model_type"], "qwen3_moe");
    assert_eq!(config["architectures"], json!(["Qwen3MoeForCausalLM"]));
    assert_eq!(config["moe_intermediate_size"], 3);
    assert_eq!(config["num_experts"], 4);
    assert_eq!(config["num_experts_per_tok"], 2);
    assert_eq!(config["norm_topk_prob"], true);
    assert_eq!(config["mlp_only_layers"], json!([]));
    assert_eq!(config["decoder_sparse_step"], 1);
    assert_eq!(config["custom_key"], json!([1, 2]));
    assert_eq!(config["tie_word_embeddings"], true);
    assert!(out.join("tokenizer.json").is_file());

    // Same seed, same router; a different seed, a different one.
    let again = tmp.join("again");
    upcycle(&src_dir, &again, &opts).unwrap();
    let router = |dir: &Path| {
        HfCheckpoint::open(dir)
            .unwrap()
            .read_f32("model.layers.1.mlp.gate.weight")
            .unwrap()
            .1
    };
    assert_eq!(router(&out), router(&again));
    let other = tmp.join("other");
    upcycle(
        &src_dir,
        &other,
        &UpcycleOptions {
            seed: 4,
            ..opts.clone()
        },
    )
    .unwrap();
    assert_ne!(router(&out), router(&other));
}

#[test]
fn rejects_bad_granularity_and_non_qwen3_sources() {
    let tmp = TempDir::new("upcycle-bad");
    let src_dir = tmp.join("dense");
    tiny_dense(&src_dir, false);
    let bad = UpcycleOptions {
        experts: 4,
        topk: 2,
        granularity: 4,
        ..UpcycleOptions::default()
    };
    let err = upcycle(&src_dir, &tmp.join("out"), &bad)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("upcycle.granularity") && err.contains("F = 6"),
        "{err}"
    );
    assert!(err.contains("config.json"), "{err}");
    assert!(!tmp.join("out").exists());
    let bad = UpcycleOptions {
        experts: 3,
        granularity: 2,
        ..UpcycleOptions::default()
    };
    let err = upcycle(&src_dir, &tmp.join("out"), &bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("E = 3"), "{err}");
    // Untied lm_head is copied.
    let out = tmp.join("untied");
    upcycle(&src_dir, &out, &UpcycleOptions::default()).unwrap();
    assert!(HfCheckpoint::open(&out).unwrap().contains("lm_head.weight"));
    // A MoE source is refused.
    let err = upcycle(&out, &tmp.join("twice"), &UpcycleOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model_type") && err.contains("qwen3_moe"),
        "{err}"
    );
}
