//! Routing decisions: parameters, dtypes, dropping, group limits, expert bias, replay,
//! padding, configuration errors.

use burn::module::{Module, Param};
use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};

use super::{padding_mask, route, route_with, router_f64};
use crate::error::BackendError;
use crate::router::testing::{
    f64_tensor, host_bool, host_f64, host_usize, lcg_values, ref_capacity_column,
    ref_column_counts, ref_logits, ref_softmax, ref_topk,
};
use crate::router::{
    AuxLossSpec, AuxLossType, DropPolicy, GroupLimitConfig, ReplayMode, RouteOptions,
    ScoreFunction, TopKRouterConfig,
};

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn router_parameter_count_is_h_times_e() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 1.
    let device = Device::flex();
    let router = TopKRouterConfig::new(12, 4, 2).init(&device).unwrap();
    assert_eq!(router.num_params(), 48);
    let with_bias = TopKRouterConfig::new(12, 4, 2)
        .with_bias(true)
        .init(&device)
        .unwrap();
    assert_eq!(with_bias.num_params(), 52);
}

#[test]
fn router_probs_dtype_follows_router_dtype_and_gating_is_a_plain_matmul() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 4 (f64, f32, bf16).
    let device = Device::flex();
    let (t, h, e, k) = (6, 5, 4, 2);
    let x = lcg_values(t * h, 1);
    let w = lcg_values(e * h, 2);
    let want = ref_logits(&x, &w, t, h, e);
    for (dtype, rel) in [
        (FloatDType::F64, 1e-13),
        (FloatDType::F32, 1e-5),
        (FloatDType::BF16, 3e-2),
    ] {
        let mut router = TopKRouterConfig::new(h, e, k)
            .with_router_dtype(dtype)
            .init(&device)
            .unwrap();
        router.weight = Param::from_tensor(f64_tensor(&w, [e, h], &device));
        let out = router
            .forward(
                f64_tensor(&x, [t, h], &device),
                &router.init_state(),
                &RouteOptions::default(),
            )
            .unwrap();
        assert_eq!(out.probs.dtype(), DType::from(dtype));
        assert_eq!(out.logits.dtype(), DType::from(dtype));
        let got = host_f64(out.logits);
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= rel * (1.0 + w.abs()),
                "{dtype:?}: {g} vs {w}"
            );
        }
        for row in host_f64(out.probs).chunks(e) {
            assert!(
                (row.iter().sum::<f64>() - 1.0).abs() <= 4.0 * rel,
                "{dtype:?}: {row:?}"
            );
        }
    }
}

#[test]
fn router_token_dropping_matches_reference_for_every_policy() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 5: T=32, E=4, k=2; cf ∈ {None, 1,
    // 2} × {probs, position} × pad.
    let device = Device::flex();
    let (t, h, e, k) = (32, 6, 4, 2);
    let x = lcg_values(t * h, 11);
    let w = lcg_values(e * h, 12);
    let logits = ref_logits(&x, &w, t, h, e);
    // Natural routing (post-softmax): top-k logits, softmax over the k.
    let mut natural = vec![0.0; t * e];
    for r in 0..t {
        let row = &logits[r * e..(r + 1) * e];
        let idx = ref_topk(row, k);
        let p = ref_softmax(&idx.iter().map(|&i| row[i]).collect::<Vec<_>>());
        for (i, pi) in idx.iter().zip(p) {
            natural[r * e + i] = pi;
        }
    }
    for cf in [None, Some(1.0), Some(2.0)] {
        for policy in [DropPolicy::Probs, DropPolicy::Position] {
            for pad in [false, true] {
                if pad && cf.is_none() {
                    continue;
                }
                let cfg = TopKRouterConfig::new(h, e, k)
                    .with_capacity_factor(cf)
                    .with_drop_policy(policy)
                    .with_pad_to_capacity(pad);
                let out = route(&router_f64(cfg, &w, &device), &x, t, &device);
                let map = host_bool(out.routing_map);
                let probs = host_f64(out.probs);
                let total = map.iter().filter(|&&m| m).count();
                let mut want_map: Vec<bool> = natural.iter().map(|&p| p > 0.0).collect();
                match cf {
                    None => assert_eq!(total, t * k),
                    Some(c) => {
                        let cap = ((t * k) as f64 / e as f64 * c).ceil() as usize;
                        assert_eq!(out.capacity, Some(cap));
                        if pad {
                            assert_eq!(total as f64, (t * k) as f64 * c);
                        } else {
                            assert!(total as f64 <= (t * k) as f64 * c);
                        }
                        for col in 0..e {
                            let p: Vec<f64> = (0..t).map(|r| natural[r * e + col]).collect();
                            let routed: Vec<bool> = p.iter().map(|&v| v > 0.0).collect();
                            let keep =
                                ref_capacity_column(&p, &routed, cap, policy == DropPolicy::Probs);
                            for r in 0..t {
                                want_map[r * e + col] = keep[r] && (pad || routed[r]);
                            }
                        }
                    }
                }
                assert_eq!(map, want_map, "cf={cf:?} {policy:?} pad={pad}");
                for (i, (&p, &m)) in probs.iter().zip(&want_map).enumerate() {
                    let want = if m { natural[i] } else { 0.0 };
                    assert!(
                        (p - want).abs() < 1e-12,
                        "cf={cf:?} {policy:?} pad={pad} @{i}"
                    );
                }
                let counts = ref_column_counts(&map, e, &(0..t).collect::<Vec<_>>());
                let tpe: Vec<f64> = out.tokens_per_expert.iter().map(|&c| c as f64).collect();
                assert_eq!(tpe, counts);
            }
        }
    }
}

#[test]
fn router_group_limited_sigmoid_routing_spans_at_most_g_groups() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 6 through the router
    // (DeepSeek-style sigmoid + bias + scaling).
    let device = Device::flex();
    let (t, h, e, k) = (24, 5, 16, 4);
    for (g, groups) in [(3, 8), (2, 4)] {
        let cfg = TopKRouterConfig::new(h, e, k)
            .with_score_function(ScoreFunction::Sigmoid)
            .with_enable_expert_bias(true)
            .with_topk_scaling_factor(Some(2.5))
            .with_group_limit(Some(GroupLimitConfig::new(groups, g, (k / g).max(1))));
        let w = lcg_values(e * h, 21);
        let out = route(
            &router_f64(cfg, &w, &device),
            &lcg_values(t * h, 22),
            t,
            &device,
        );
        let idx = host_usize(out.topk_indices);
        let probs = host_f64(out.probs);
        for r in 0..t {
            let mut used: Vec<usize> = idx[r * k..(r + 1) * k]
                .iter()
                .map(|i| i / (e / groups))
                .collect();
            used.sort_unstable();
            used.dedup();
            assert!(used.len() <= g, "row {r}: groups {used:?}");
            let sum: f64 = probs[r * e..(r + 1) * e].iter().sum();
            assert!((sum - 2.5).abs() < 1e-12, "row {r}: probs sum {sum}");
        }
    }
}

#[test]
fn router_uniform_logits_tie_to_the_lowest_experts() {
    let device = Device::flex();
    let (t, h, e, k) = (5, 3, 8, 3);
    let out = route(
        &router_f64(TopKRouterConfig::new(h, e, k), &[0.0; 24], &device),
        &lcg_values(t * h, 1),
        t,
        &device,
    );
    assert_eq!(host_usize(out.topk_indices), [0, 1, 2].repeat(t));
}

#[test]
fn router_expert_bias_counts_update_and_steer_selection() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 7 (sigmoid, rate 0.1) and
    // §Aux-loss-free expert bias (exact ±rate moves, no gradient).
    let device = Device::flex().autodiff();
    let (t, h, e, k) = (16, 6, 8, 2);
    let cfg = TopKRouterConfig::new(h, e, k)
        .with_score_function(ScoreFunction::Sigmoid)
        .with_enable_expert_bias(true)
        .with_expert_bias_update_rate(0.1);
    let w = lcg_values(e * h, 31);
    let x = lcg_values(t * h, 32);
    let mut router = router_f64(cfg, &w, &device);
    let mut state = router.init_state();
    let out = route_with(
        &router,
        f64_tensor(&x, [t, h], &device),
        &state,
        &RouteOptions::default(),
    );
    let grads = out.probs.clone().sum().backward();
    assert!(router.weight.grad(&grads).is_some());
    let bias_param = router.expert_bias.clone().unwrap();
    assert!(
        bias_param.grad(&grads).is_none(),
        "the expert bias must get no gradient"
    );
    state.commit(&out.state_update).unwrap();
    let counts = ref_column_counts(&host_bool(out.routing_map), e, &(0..t).collect::<Vec<_>>());
    assert_eq!(state.local_tokens_per_expert(), &counts[..]);
    assert_eq!(counts.iter().sum::<f64>(), (t * k) as f64);
    let old = router.expert_bias_values().unwrap().unwrap();
    router.update_expert_bias(&mut state).unwrap();
    let new = router.expert_bias_values().unwrap().unwrap();
    assert_ne!(old, new, "the bias changes after one update");
    let mean = counts.iter().sum::<f64>() / e as f64;
    for i in 0..e {
        let want = match counts[i].partial_cmp(&mean) {
            Some(std::cmp::Ordering::Less) => old[i] + 0.1f32,
            Some(std::cmp::Ordering::Greater) => old[i] - 0.1f32,
            _ => old[i],
        };
        assert_eq!(new[i], want, "expert {i}");
    }
    assert!(state.local_tokens_per_expert().iter().all(|&c| c == 0.0));
    // The bias shifts the selection but not the probs.
    let out = route_with(
        &router,
        f64_tensor(&x, [t, h], &device),
        &state,
        &RouteOptions::default(),
    );
    let logits = ref_logits(&x, &w, t, h, e);
    let idx = host_usize(out.topk_indices);
    for r in 0..t {
        let biased: Vec<f64> = (0..e)
            .map(|c| sigmoid(logits[r * e + c]) + f64::from(new[c]))
            .collect();
        assert_eq!(
            &idx[r * k..(r + 1) * k],
            &ref_topk(&biased, k)[..],
            "row {r}"
        );
    }
    // Evaluation forwards (not tracked) produce no counts.
    let eval = router.valid();
    let out = route_with(
        &eval,
        f64_tensor(&x, [t, h], &Device::flex()),
        &eval.init_state(),
        &RouteOptions::default(),
    );
    assert!(out.state_update.expert_load.is_none() && out.losses.is_empty());
}

#[test]
fn router_replay_reproduces_recorded_routing_and_honours_forced_indices() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 8 and §Router replay.
    let device = Device::flex();
    let (t, h, e, k) = (10, 4, 8, 2);
    let w = lcg_values(e * h, 41);
    let x_host = lcg_values(t * h, 42);
    let router = router_f64(TopKRouterConfig::new(h, e, k), &w, &device);
    let x = || f64_tensor(&x_host, [t, h], &device);
    let mut state = router.init_state();
    let opts = RouteOptions::default();
    let err = router.forward(
        x(),
        &{
            let mut s = router.init_state();
            s.replay.set_mode(ReplayMode::ReplayForward);
            s
        },
        &opts,
    );
    assert!(
        matches!(err, Err(BackendError::Replay(_))),
        "nothing recorded"
    );
    state.replay.set_mode(ReplayMode::Record);
    let recorded = route_with(&router, x(), &state, &opts);
    state.commit(&recorded.state_update).unwrap();
    let stored = host_usize(state.replay.indices().unwrap().clone());
    assert_eq!(stored, host_usize(recorded.topk_indices.clone()));
    state.replay.set_mode(ReplayMode::ReplayForward);
    let replayed = route_with(&router, x(), &state, &opts);
    assert_eq!(
        host_f64(replayed.probs),
        host_f64(recorded.probs),
        "bit-exact probs"
    );
    assert_eq!(
        host_bool(replayed.routing_map),
        host_bool(recorded.routing_map)
    );
    // Forced indices, e.g. from an inference engine.
    let forced: Vec<i32> = (0..t)
        .flat_map(|r| [(r % e) as i32, ((r + 3) % e) as i32])
        .collect();
    state.replay.set_indices(Tensor::<2, Int>::from_data(
        TensorData::new(forced.clone(), [t, k]),
        &device,
    ));
    let out = route_with(&router, x(), &state, &opts);
    assert_eq!(
        host_usize(out.topk_indices),
        forced.iter().map(|&i| i as usize).collect::<Vec<_>>()
    );
    let logits = ref_logits(&x_host, &w, t, h, e);
    let probs = host_f64(out.probs);
    for r in 0..t {
        let sel = [forced[2 * r] as usize, forced[2 * r + 1] as usize];
        let p = ref_softmax(&[logits[r * e + sel[0]], logits[r * e + sel[1]]]);
        for c in 0..e {
            let want = sel.iter().position(|&s| s == c).map_or(0.0, |j| p[j]);
            assert!(
                (probs[r * e + c] - want).abs() < 1e-14,
                "row {r} expert {c}"
            );
        }
    }
    state
        .replay
        .set_indices(Tensor::<2, Int>::zeros([t - 1, k], &device));
    assert!(matches!(
        router.forward(x(), &state, &opts),
        Err(BackendError::Replay(_))
    ));
}

#[test]
fn router_padding_mask_keeps_valid_rows_identical() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 3: probs of valid rows equal the
    // run without the padded rows; the expert-bias counts are map[valid].sum(0) and sum to valid·k.
    // Also with capacity.
    let device = Device::flex().autodiff();
    let (h, e, k) = (6, 8, 2);
    let padded_at = [2usize, 7, 13];
    let t_full = 15;
    let valid_rows: Vec<usize> = (0..t_full).filter(|r| !padded_at.contains(r)).collect();
    let x_full = lcg_values(t_full * h, 51);
    let x_valid: Vec<f64> = valid_rows
        .iter()
        .flat_map(|&r| x_full[r * h..(r + 1) * h].to_vec())
        .collect();
    let flags: Vec<bool> = (0..t_full).map(|r| padded_at.contains(&r)).collect();
    let w = lcg_values(e * h, 52);
    for (cf, pad) in [(None, false), (Some(1.0), false), (Some(1.0), true)] {
        let cfg = TopKRouterConfig::new(h, e, k)
            .with_score_function(ScoreFunction::Sigmoid)
            .with_enable_expert_bias(true)
            .with_capacity_factor(cf)
            .with_pad_to_capacity(pad);
        let router = router_f64(cfg, &w, &device);
        let state = router.init_state();
        let plain = route_with(
            &router,
            f64_tensor(&x_valid, [valid_rows.len(), h], &device),
            &state,
            &RouteOptions::default(),
        );
        let opts = RouteOptions::default().with_padding_mask(padding_mask(&flags, &device));
        let masked = route_with(
            &router,
            f64_tensor(&x_full, [t_full, h], &device),
            &state,
            &opts,
        );
        let (pp, pm) = (host_f64(plain.probs), host_f64(masked.probs));
        for (i, &r) in valid_rows.iter().enumerate() {
            for c in 0..e {
                assert!(
                    (pp[i * e + c] - pm[r * e + c]).abs() < 1e-12,
                    "cf={cf:?} row {r}"
                );
            }
        }
        let map = host_bool(masked.routing_map);
        let want = ref_column_counts(&map, e, &valid_rows);
        assert_eq!(masked.state_update.expert_load.as_deref(), Some(&want[..]));
        if cf.is_none() {
            assert_eq!(want.iter().sum::<f64>(), (valid_rows.len() * k) as f64);
        } else {
            assert_eq!(masked.capacity, plain.capacity);
            for &r in &padded_at {
                assert!(
                    pm[r * e..(r + 1) * e].iter().all(|&p| p == 0.0),
                    "padded row {r}"
                );
            }
        }
    }
}

#[test]
fn router_config_validation_names_the_field() {
    let device = Device::flex();
    let with_k = |k| TopKRouterConfig::new(8, 8, k);
    let base = || with_k(2);
    let field = |cfg: TopKRouterConfig| match cfg.init(&device) {
        Err(BackendError::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    assert_eq!(field(with_k(0)), "topk");
    assert_eq!(field(with_k(9)), "topk");
    assert_eq!(field(with_k(1)), "pre_softmax");
    assert_eq!(
        field(base().with_enable_expert_bias(true)),
        "enable_expert_bias"
    );
    assert_eq!(
        field(base().with_topk_scaling_factor(Some(0.0))),
        "topk_scaling_factor"
    );
    assert_eq!(
        field(base().with_group_limit(Some(GroupLimitConfig::new(3, 1, 1)))),
        "group_limit"
    );
    assert_eq!(
        field(base().with_group_limit(Some(GroupLimitConfig::new(4, 5, 1)))),
        "group_limit"
    );
    assert_eq!(
        field(base().with_group_limit(Some(GroupLimitConfig::new(4, 1, 3)))),
        "group_limit"
    );
    assert_eq!(
        field(with_k(3).with_group_limit(Some(GroupLimitConfig::new(4, 1, 1)))),
        "group_limit"
    );
    assert_eq!(field(base().with_pad_to_capacity(true)), "pad_to_capacity");
    assert_eq!(
        field(
            base()
                .with_capacity_factor(Some(-1.0))
                .with_pad_to_capacity(true)
        ),
        "pad_to_capacity"
    );
    assert_eq!(
        field(base().with_capacity_factor(Some(f64::NAN))),
        "capacity_factor"
    );
    let twice = vec![
        AuxLossSpec::new(AuxLossType::Aux, 1.0),
        AuxLossSpec::new(AuxLossType::Aux, 0.5),
    ];
    assert_eq!(field(base().with_aux_losses(twice)), "aux_losses");
    assert_eq!(
        field(base().with_aux_losses(vec![AuxLossSpec::new(AuxLossType::SeqAux, -1.0)])),
        "aux_losses"
    );
    assert_eq!(
        field(base().with_z_loss_coeff(Some(f64::INFINITY))),
        "z_loss_coeff"
    );
    assert_eq!(
        field(base().with_router_dtype(FloatDType::Flex32)),
        "router_dtype"
    );
    assert_eq!(field(base().with_tp_cp_size(0)), "tp_cp_size");
    assert_eq!(field(base().with_tp_cp_size(2)), "tp_dp_cp_size");
    // A negative capacity factor means dropless; k = 1 is fine with pre-softmax and sigmoid.
    assert!(
        base()
            .with_capacity_factor(Some(-1.0))
            .init(&device)
            .is_ok()
    );
    assert!(with_k(1).with_pre_softmax(true).init(&device).is_ok());
    assert!(
        with_k(1)
            .with_score_function(ScoreFunction::Sigmoid)
            .init(&device)
            .is_ok()
    );
}

#[test]
fn router_forward_rejects_bad_inputs() {
    let device = Device::flex();
    let (h, e, k) = (4, 4, 2);
    // cap = ceil(4·2/4·3) = 6 > 4 tokens: padding cannot be satisfied.
    let cfg = TopKRouterConfig::new(h, e, k)
        .with_capacity_factor(Some(3.0))
        .with_pad_to_capacity(true);
    let router = router_f64(cfg, &lcg_values(e * h, 1), &device);
    let state = router.init_state();
    let x = f64_tensor(&lcg_values(4 * h, 2), [4, h], &device);
    let run = |x: Tensor<2>, o: &RouteOptions<'_>| router.forward(x, &state, o);
    let config_field = |r| match r {
        Err(BackendError::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    assert_eq!(
        config_field(run(x.clone(), &RouteOptions::default())),
        "pad_to_capacity"
    );
    let wrong_h = f64_tensor(&[0.0; 10], [2, 5], &device);
    assert!(matches!(
        run(wrong_h, &RouteOptions::default()),
        Err(BackendError::Shape { .. })
    ));
    let bad_mask = RouteOptions::default().with_padding_mask(padding_mask(&[false; 3], &device));
    assert!(matches!(
        run(x.clone(), &bad_mask),
        Err(BackendError::Shape { .. })
    ));
    let zero_b = RouteOptions::default().with_batch_size(0);
    assert!(matches!(run(x, &zero_b), Err(BackendError::Shape { .. })));
    let other_state = crate::router::RouterState::new(e + 1);
    let x = f64_tensor(&lcg_values(4 * h, 2), [4, h], &device);
    assert!(
        router
            .forward(x, &other_state, &RouteOptions::default())
            .is_err()
    );
}
