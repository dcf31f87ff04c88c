//! Grouped experts against a sequential per-expert reference (Megatron's `SequentialMLP`).

use burn::module::Module;
use burn::tensor::activation::{sigmoid, silu};
use burn::tensor::{DType, Device, Tensor, TensorData};

use super::*;
use crate::ops::{PermuteMode, RowIdMap, permute, unpermute};
use crate::testing::{SplitMix, assert_close, tensor, values};

fn ad() -> Device {
    Device::flex().autodiff()
}

/// Sequential reference: one plain matmul chain per expert, probs after the activation (SwiGLU,
/// or the clamped SwiGLU written with Burn's clamps).
fn sequential(e: &GroupedExperts, rows: Tensor<2>, sizes: &[usize], probs: Tensor<1>) -> Tensor<2> {
    let [_, h] = rows.dims();
    let f = e.ffn_hidden_size();
    let mut parts = Vec::new();
    let mut row = 0;
    for (i, &s) in sizes.iter().enumerate() {
        if s == 0 {
            continue;
        }
        let x = rows.clone().slice(row..row + s);
        let p = probs.clone().slice(row..row + s).reshape([s, 1]);
        let w1 = e.fc1.val().slice(i..i + 1).reshape([2 * f, h]);
        let w2 = e.fc2.val().slice(i..i + 1).reshape([h, f]);
        let mut hid = x.matmul(w1.transpose());
        if let Some(b) = &e.fc1_bias {
            hid = hid + b.val().slice(i..i + 1);
        }
        let (gate, up) = (hid.clone().slice([0..s, 0..f]), hid.slice([0..s, f..2 * f]));
        let z = match e.activation {
            ExpertActivation::ClampedSwiGlu { alpha, limit } => {
                let g = gate.clamp_max(limit);
                (up.clamp(-limit, limit) + 1.0) * g.clone() * sigmoid(g * alpha)
            }
            _ => silu(gate) * up,
        } * p.clone();
        let mut y = z.matmul(w2.transpose());
        if let Some(b) = &e.fc2_bias {
            y = y + b.val().slice(i..i + 1) * p;
        }
        parts.push(y);
        row += s;
    }
    Tensor::cat(parts, 0)
}

fn randomize(e: GroupedExperts, rng: &mut SplitMix) -> GroupedExperts {
    randomize_as(e, rng, DType::F64)
}

fn randomize_as(e: GroupedExperts, rng: &mut SplitMix, dtype: DType) -> GroupedExperts {
    let device = ad();
    let rand = |t: Tensor<3>, rng: &mut SplitMix| {
        let n = t.dims().iter().product();
        tensor(rng.values(n), t.dims(), &device, dtype).require_grad()
    };
    let rand2 = |t: Tensor<2>, rng: &mut SplitMix| {
        let n = t.dims().iter().product();
        tensor(rng.values(n), t.dims(), &device, dtype).require_grad()
    };
    GroupedExperts {
        fc1: Param::from_tensor(rand(e.fc1.val(), rng)),
        fc2: Param::from_tensor(rand(e.fc2.val(), rng)),
        fc1_bias: e.fc1_bias.map(|b| Param::from_tensor(rand2(b.val(), rng))),
        fc2_bias: e.fc2_bias.map(|b| Param::from_tensor(rand2(b.val(), rng))),
        adds_fc2_bias: e.adds_fc2_bias,
        activation: e.activation,
        fp8: e.fp8,
    }
}

#[test]
fn grouped_matches_sequential_outputs_and_all_gradients() {
    let mut rng = SplitMix::new(11);
    let (h, f, sizes) = (16, 8, vec![3usize, 0, 5, 2]);
    let n: usize = sizes.iter().sum();
    // A limit of 1 clamps some of these pre-activations (`|fc1 row · x| ≲ 4`).
    let clamped = ExpertActivation::ClampedSwiGlu {
        alpha: 1.702,
        limit: 1.0,
    };
    for (bias, activation) in [
        (false, ExpertActivation::SwiGlu),
        (true, ExpertActivation::SwiGlu),
        (true, clamped),
    ] {
        let cfg = GroupedExpertsConfig::new(4, h, f)
            .with_bias(bias)
            .with_activation(activation);
        let experts = randomize(cfg.init(&ad()).expect("init"), &mut rng);
        let xv = rng.values(n * h);
        let pv = rng.values(n);
        let rv = rng.values(n * h);
        let run = |seq: bool| {
            let x = tensor(xv.clone(), [n, h], &ad(), DType::F64).require_grad();
            let p = tensor(pv.clone(), [n], &ad(), DType::F64).require_grad();
            let y = if seq {
                sequential(&experts, x.clone(), &sizes, p.clone())
            } else {
                experts
                    .forward(x.clone(), &sizes, p.clone())
                    .expect("forward")
            };
            let grads = (y.clone() * tensor(rv.clone(), [n, h], &ad(), DType::F64))
                .sum()
                .backward();
            let mut out = vec![
                values(y),
                values(x.grad(&grads).expect("dx")),
                values(p.grad(&grads).expect("dp")),
            ];
            out.push(values(experts.fc1.grad(&grads).expect("dfc1")));
            out.push(values(experts.fc2.grad(&grads).expect("dfc2")));
            if let (Some(b1), Some(b2)) = (&experts.fc1_bias, &experts.fc2_bias) {
                out.push(values(b1.grad(&grads).expect("db1")));
                out.push(values(b2.grad(&grads).expect("db2")));
            }
            out
        };
        let (ours, reference) = (run(false), run(true));
        let names = [
            "output",
            "d input",
            "d probs",
            "d fc1",
            "d fc2",
            "d fc1 bias",
            "d fc2 bias",
        ];
        for ((a, b), name) in ours.iter().zip(&reference).zip(names) {
            assert_close(a, b, 1e-10, 1e-12, name);
        }
        // Expert 1 has no tokens: its weight gradients are exactly zero.
        let (f2, hf) = (2 * f * h, h * f);
        assert!(ours[3][f2..2 * f2].iter().all(|&v| v == 0.0));
        assert!(ours[4][hf..2 * hf].iter().all(|&v| v == 0.0));
    }
}

#[test]
fn parameter_count_matches_spec() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 20: H = 12, E = 2, GLU, F = 48 ->
    // experts 2·3·12·48 = 3456.
    let experts = GroupedExpertsConfig::new(2, 12, 48)
        .init(&Device::flex())
        .expect("init");
    assert_eq!(experts.num_params(), 3456);
    assert_eq!(experts.fc1.dims(), [2, 96, 12]);
    assert_eq!(experts.fc2.dims(), [2, 12, 48]);
}

#[test]
fn probs_before_fc2_equal_probs_after_combine() {
    let mut rng = SplitMix::new(12);
    let (t, h, e, f) = (9, 8, 4, 6);
    let experts = randomize(
        GroupedExpertsConfig::new(e, h, f)
            .init(&ad())
            .expect("init"),
        &mut rng,
    );
    let mut map = vec![false; t * e];
    for tok in 0..t {
        for ex in rng.distinct(e, 2) {
            map[tok * e + ex] = true;
        }
    }
    let map_t = Tensor::from_data(TensorData::new(map, [t, e]), &ad());
    let x = tensor(rng.values(t * h), [t, h], &ad(), DType::F64);
    let probs = tensor(rng.values(t * e), [t, e], &ad(), DType::F64);
    let perm = permute(x, map_t, Some(probs), PermuteMode::Dropless).expect("permute");
    let sizes = perm.row_id_map.tokens_per_expert_host();
    let p = perm.probs.clone().expect("probs");
    let n = p.dims()[0];
    let inside = experts
        .forward(perm.rows.clone(), &sizes, p.clone())
        .expect("forward");
    let y1 = unpermute(inside, &perm.row_id_map, None).expect("unpermute");
    let ones = Tensor::<1>::ones([n], (&ad(), DType::F64));
    let outside = experts.forward(perm.rows, &sizes, ones).expect("forward");
    let map: &RowIdMap = &perm.row_id_map;
    let y2 = unpermute(outside, map, Some(p)).expect("unpermute");
    assert_close(&values(y1), &values(y2), 1e-12, 1e-12, "probs placement");
}

#[test]
fn shared_experts_match_naive_swiglu_with_gate() {
    let device = Device::flex();
    let shared = SharedExpertsConfig::new(5, 7)
        .with_gate(true)
        .init(&device)
        .expect("init");
    let mut rng = SplitMix::new(13);
    let x = rng.values(3 * 5);
    let y = values(shared.forward(tensor(x.clone(), [3, 5], &device, DType::F32)));
    // Burn's Linear stores weight [in, out].
    let w = |l: &Linear| values(l.weight.val());
    let (wg, wu, wd) = (
        w(&shared.gate_proj),
        w(&shared.up_proj),
        w(&shared.down_proj),
    );
    let g = w(shared.gate.as_ref().expect("gate"));
    for t in 0..3 {
        let xr = &x[t * 5..(t + 1) * 5];
        let z: Vec<f64> = (0..7)
            .map(|j| {
                let a: f64 = (0..5).map(|i| xr[i] * wg[i * 7 + j]).sum();
                let b: f64 = (0..5).map(|i| xr[i] * wu[i * 7 + j]).sum();
                a / (1.0 + (-a).exp()) * b
            })
            .collect();
        let gate: f64 = (0..5).map(|i| xr[i] * g[i]).sum();
        let gate = 1.0 / (1.0 + (-gate).exp());
        for o in 0..5 {
            let v: f64 = (0..7).map(|j| z[j] * wd[j * 5 + o]).sum::<f64>() * gate;
            assert!(
                (y[t * 5 + o] - v).abs() < 1e-5,
                "token {t} out {o}: {} vs {v}",
                y[t * 5 + o]
            );
        }
    }
}

#[test]
fn bad_expert_inputs_are_errors() {
    let device = Device::flex();
    assert!(matches!(
        GroupedExpertsConfig::new(0, 4, 4).init(&device),
        Err(BackendError::Config { .. })
    ));
    let e = GroupedExpertsConfig::new(2, 4, 4)
        .init(&device)
        .expect("init");
    let x = tensor(vec![0.0; 8], [2, 4], &device, DType::F32);
    let p = tensor(vec![1.0; 2], [2], &device, DType::F32);
    assert!(matches!(
        e.forward(x.clone(), &[2], p.clone()),
        Err(BackendError::Shape { .. })
    ));
    assert!(matches!(
        e.forward(x, &[1, 2], p),
        Err(BackendError::SizeSum { .. })
    ));
}

#[test]
fn experts_from_params_name_a_mis_shaped_bias() {
    let device = Device::flex();
    let (l, h, f) = (3, 4, 5);
    let cfg = GroupedExpertsConfig::new(l, h, f)
        .with_bias(true)
        .with_activation(ExpertActivation::clamped_swiglu());
    let p3 = |dims: [usize; 3]| Param::from_tensor(Tensor::<3>::zeros(dims, &device));
    let p2 = |dims: [usize; 2]| Param::from_tensor(Tensor::<2>::zeros(dims, &device));
    let build = |fc1_bias: Option<[usize; 2]>, fc2_bias: Option<[usize; 2]>| {
        cfg.init_with_params(
            p3([l, 2 * f, h]),
            p3([l, h, f]),
            fc1_bias.map(p2),
            fc2_bias.map(p2),
        )
    };
    let field = |r: crate::Result<GroupedExperts>| match r {
        Err(BackendError::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    let experts = build(Some([l, 2 * f]), Some([l, h])).expect("well-shaped");
    assert_eq!(
        experts.fc1_bias.as_ref().map(|b| b.dims()),
        Some([l, 2 * f])
    );
    assert_eq!(field(build(Some([l, f]), Some([l, h]))), "fc1_bias");
    assert_eq!(field(build(Some([l, 2 * f]), Some([l, f]))), "fc2_bias");
    assert_eq!(field(build(None, Some([l, h]))), "fc1_bias");
    let unbiased = GroupedExpertsConfig::new(l, h, f).init_with_params(
        p3([l, 2 * f, h]),
        p3([l, h, f]),
        Some(p2([l, 2 * f])),
        None,
    );
    assert_eq!(field(unbiased), "fc1_bias");
    let wrong_fc1 = cfg.init_with_params(p3([l, f, h]), p3([l, h, f]), None, None);
    assert_eq!(field(wrong_fc1), "fc1");
    // A bias swapped in after construction is refused by the forward, naming it.
    let mut swapped = experts;
    swapped.fc2_bias = Some(p2([l, h + 1]));
    let x = Tensor::<2>::zeros([2, h], &device);
    let p = Tensor::<1>::ones([2], &device);
    assert_eq!(
        field(swapped.forward(x, &[1, 1, 0], p).map(|_| swapped.clone())),
        "fc2_bias"
    );
    // The clamped SwiGLU's parameters are validated.
    let bad = GroupedExpertsConfig::new(l, h, f).with_activation(ExpertActivation::ClampedSwiGlu {
        alpha: 1.702,
        limit: -1.0,
    });
    assert_eq!(field(bad.init(&device)), "activation");
}

/// Sum of the gradient of parameter `id` over the outer graph and the recomputed regions.
fn grad_of<const D: usize>(
    id: burn::module::ParamId,
    outer: &burn::optim::GradientsParams,
    sides: &[burn::optim::GradientsParams],
) -> Vec<f64> {
    let mut total: Vec<f64> = Vec::new();
    for g in std::iter::once(outer).chain(sides) {
        if let Some(t) = g.get::<D>(id) {
            let v = values(t);
            if total.is_empty() {
                total = v;
            } else {
                total.iter_mut().zip(v).for_each(|(a, b)| *a += b);
            }
        }
    }
    total
}

#[test]
fn etp_shards_of_biased_clamped_experts_share_the_fc2_bias_gradient_with_and_without_recompute() {
    let mut rng = SplitMix::new(14);
    let (h, f, sizes) = (8, 6, vec![2usize, 3, 0, 4]);
    let n: usize = sizes.iter().sum();
    let cfg = GroupedExpertsConfig::new(4, h, f)
        .with_bias(true)
        .with_activation(ExpertActivation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 1.0,
        });
    // f32: the recompute region rebuilds its input in the default float dtype.
    let full = randomize_as(cfg.init(&ad()).expect("init"), &mut rng, DType::F32);
    let (xv, pv, rv) = (rng.values(n * h), rng.values(n), rng.values(n * h));
    let mut per_rank = Vec::new();
    for etp_rank in [0, 1] {
        let experts = full.shard(0..4, etp_rank, 2).expect("shard");
        assert_eq!(experts.adds_fc2_bias, etp_rank == 0);
        let run = |recompute: bool| {
            crate::recompute::clear_param_grads();
            let x = tensor(xv.clone(), [n, h], &ad(), DType::F32).require_grad();
            let p = tensor(pv.clone(), [n], &ad(), DType::F32).require_grad();
            let y = experts
                .forward_recomputing(x.clone(), &sizes, p.clone(), recompute)
                .expect("forward");
            let grads = (y.clone() * tensor(rv.clone(), [n, h], &ad(), DType::F32))
                .sum()
                .backward();
            let (dx, dp) = (
                values(x.grad(&grads).expect("dx")),
                values(p.grad(&grads).expect("dp")),
            );
            let outer = burn::optim::GradientsParams::from_grads(grads, &experts);
            let sides = crate::recompute::take_param_grads();
            let b1 = experts.fc1_bias.as_ref().expect("b1").id;
            let b2 = experts.fc2_bias.as_ref().expect("b2").id;
            vec![
                values(y),
                dx,
                dp,
                grad_of::<3>(experts.fc1.id, &outer, &sides),
                grad_of::<3>(experts.fc2.id, &outer, &sides),
                grad_of::<2>(b1, &outer, &sides),
                grad_of::<2>(b2, &outer, &sides),
            ]
        };
        let (plain, recomputed) = (run(false), run(true));
        assert_eq!(
            plain, recomputed,
            "ETP rank {etp_rank}: recompute changed a value"
        );
        per_rank.push(plain);
    }
    // Both ranks see the same rows and upstream gradient: the same full fc2-bias gradient, and
    // the two partial outputs sum to the unsharded experts' output (the bias counted once).
    assert!(per_rank[1][6].iter().any(|v| *v != 0.0));
    assert_eq!(per_rank[1][6], per_rank[0][6], "fc2 bias grad");
    let x = tensor(xv.clone(), [n, h], &ad(), DType::F32);
    let p = tensor(pv.clone(), [n], &ad(), DType::F32);
    let whole = values(full.forward(x, &sizes, p).expect("forward"));
    let summed: Vec<f64> = per_rank[0][0]
        .iter()
        .zip(&per_rank[1][0])
        .map(|(a, b)| a + b)
        .collect();
    assert_close(&summed, &whole, 1e-5, 1e-6, "ETP partial outputs");
}

#[test]
fn fp8_experts_keep_their_biases_and_clamped_activation_in_high_precision() {
    // Only fc1 and fc2 are quantised: the fc2 bias's gradient (a per-expert sum of the upstream
    // gradient times the probs) is the high-precision one, and the output stays within FP8
    // error of it.
    let mut rng = SplitMix::new(15);
    let (h, f, sizes) = (16, 8, vec![3usize, 0, 4, 5]);
    let n: usize = sizes.iter().sum();
    let cfg = GroupedExpertsConfig::new(4, h, f)
        .with_bias(true)
        .with_activation(ExpertActivation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 1.0,
        });
    let high = randomize_as(cfg.init(&ad()).expect("init"), &mut rng, DType::F32);
    let (xv, pv, rv) = (rng.values(n * h), rng.values(n), rng.values(n * h));
    let recipe = crate::fp8::Fp8Recipe::new().with_block_size(8);
    let run = |experts: &GroupedExperts| {
        let x = tensor(xv.clone(), [n, h], &ad(), DType::F32).require_grad();
        let p = tensor(pv.clone(), [n], &ad(), DType::F32).require_grad();
        let y = experts.forward(x, &sizes, p).expect("forward");
        let grads = (y.clone() * tensor(rv.clone(), [n, h], &ad(), DType::F32))
            .sum()
            .backward();
        let bias = |b: &Option<Param<Tensor<2>>>| {
            values(b.as_ref().expect("bias").grad(&grads).expect("bias grad"))
        };
        (values(y), bias(&experts.fc2_bias))
    };
    // (fc1's bias gradient is not compared: FP8's error moves pre-activations near the limit
    // across it, which switches their gradient between zero and non-zero.)
    let (y_hi, b2_hi) = run(&high);
    let (y_fp8, b2_fp8) = run(&high.clone().with_fp8(Some(recipe)).expect("fp8"));
    assert_close(&b2_fp8, &b2_hi, 1e-6, 1e-7, "fc2 bias grad");
    let scale = y_hi.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert_close(&y_fp8, &y_hi, 0.0, 0.1 * scale, "fp8 output");
    assert_ne!(y_fp8, y_hi, "the GEMMs ran in FP8");
}
