//! Load-balancing losses and z-loss: values, gradients, padding invariance.

use burn::tensor::Device;

use super::{padding_mask, route_with, router_f64};
use crate::router::testing::{
    f64_tensor, host_f64, lcg_values, ref_aux_loss, ref_logits, ref_softmax, ref_topk,
};
use crate::router::{
    AuxLossSpec, AuxLossType, RouteOptions, RouterLossKind, RouterOutput, RouterState,
    ScoreFunction, TopKRouter, TopKRouterConfig,
};

const KINDS: [(AuxLossType, RouterLossKind); 3] = [
    (AuxLossType::Aux, RouterLossKind::Aux),
    (AuxLossType::SeqAux, RouterLossKind::SeqAux),
    (AuxLossType::GlobalAux, RouterLossKind::GlobalAux),
];

fn all_aux(coeff: f64) -> Vec<AuxLossSpec> {
    KINDS
        .iter()
        .map(|(k, _)| AuxLossSpec::new(*k, coeff))
        .collect()
}

fn value(out: &RouterOutput, kind: RouterLossKind) -> f64 {
    out.loss(kind)
        .expect("loss computed")
        .value()
        .expect("readable")
}

/// Gate-weight and input gradients of `(probs · 0).sum()`: only the attached losses contribute.
fn loss_grads(
    router: &TopKRouter,
    x: &[f64],
    t: usize,
    opts: &RouteOptions<'_>,
) -> (Vec<f64>, Vec<f64>, RouterOutput) {
    let device = Device::flex().autodiff();
    let x = f64_tensor(x, [t, router.config().hidden_size], &device).require_grad();
    let out = route_with(router, x.clone(), &router.init_state(), opts);
    let grads = out.probs.clone().mul_scalar(0.0).sum().backward();
    // A missing gradient is a zero gradient.
    let (e, h) = (router.config().num_experts, router.config().hidden_size);
    let wg = router
        .weight
        .grad(&grads)
        .map_or(vec![0.0; e * h], host_f64);
    let xg = x.grad(&grads).map_or(vec![0.0; t * h], host_f64);
    (wg, xg, out)
}

/// Host aux-loss input `P` for softmax (softmax of logits) or sigmoid (normalised sigmoid).
fn ref_scores(logits: &[f64], e: usize, function: ScoreFunction) -> Vec<f64> {
    logits
        .chunks(e)
        .flat_map(|row| match function {
            ScoreFunction::Softmax => ref_softmax(row),
            _ => {
                let s: Vec<f64> = row.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
                let sum: f64 = s.iter().sum();
                s.iter().map(|v| v / (sum + 1e-20)).collect()
            }
        })
        .collect()
}

#[test]
fn router_uniform_router_gives_each_aux_loss_exactly_its_coeff() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 12 (and the uniform property of
    // §Load-balancing losses and z-loss), for softmax and sigmoid scores.
    let device = Device::flex().autodiff();
    let (t, h, e, k, b) = (16, 4, 8, 2, 2);
    for function in [ScoreFunction::Softmax, ScoreFunction::Sigmoid] {
        let cfg = TopKRouterConfig::new(h, e, k)
            .with_score_function(function)
            .with_aux_losses(all_aux(1.0));
        let router = router_f64(cfg, &[0.0; 32], &device);
        let opts = RouteOptions::default().with_batch_size(b);
        let x = f64_tensor(&lcg_values(t * h, 1), [t, h], &device);
        let out = route_with(&router, x, &router.init_state(), &opts);
        for (_, kind) in KINDS {
            assert_eq!(value(&out, kind), 1.0, "{function:?} {kind:?}");
        }
    }
}

#[test]
fn router_seq_aux_equals_aux_bit_exactly_for_one_sequence() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 10: B=1 ⇒ seq_aux == aux bit-exact
    // (E=32, k=8, f64); B=2 ⇒ the mean of per-sequence aux losses; aux itself against the host
    // reference.
    let device = Device::flex().autodiff();
    let (t, h, e, k) = (24, 6, 32, 8);
    let w = lcg_values(e * h, 61);
    let x = lcg_values(t * h, 62);
    let cfg = TopKRouterConfig::new(h, e, k).with_aux_losses(vec![
        AuxLossSpec::new(AuxLossType::Aux, 0.5),
        AuxLossSpec::new(AuxLossType::SeqAux, 0.5),
    ]);
    let router = router_f64(cfg, &w, &device);
    let state = router.init_state();
    let run = |b| {
        route_with(
            &router,
            f64_tensor(&x, [t, h], &device),
            &state,
            &RouteOptions::default().with_batch_size(b),
        )
    };
    let one = run(1);
    let (aux, seq) = (
        value(&one, RouterLossKind::Aux),
        value(&one, RouterLossKind::SeqAux),
    );
    assert_eq!(aux.to_bits(), seq.to_bits(), "{aux} vs {seq}");
    let p = ref_scores(&ref_logits(&x, &w, t, h, e), e, ScoreFunction::Softmax);
    let want_aux = ref_aux_loss(&p, e, k, &(0..t).collect::<Vec<_>>(), 0.5);
    assert!((aux - want_aux).abs() < 1e-13, "{aux} vs {want_aux}");
    let b = 2;
    let two = run(b);
    let want: f64 = (0..b)
        .map(|seq| {
            let rows: Vec<usize> = (0..t / b).map(|s| s * b + seq).collect();
            ref_aux_loss(&p, e, k, &rows, 0.5)
        })
        .sum::<f64>()
        / b as f64;
    let got = value(&two, RouterLossKind::SeqAux);
    assert!((got - want).abs() < 1e-13, "{got} vs {want}");
    // The [S, B, H] entry point routes identically and sets B.
    let sbh = router
        .forward_sbh(
            f64_tensor(&x, [t / b, b, h], &device),
            &state,
            &RouteOptions::default(),
        )
        .unwrap();
    assert_eq!(value(&sbh, RouterLossKind::SeqAux).to_bits(), got.to_bits());
    assert_eq!(host_f64(sbh.probs), host_f64(two.probs));
}

#[test]
fn router_global_aux_accumulates_counts_and_resets() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 11 (single rank): counts sum to
    // T·ga_steps·k; equals aux for the first micro-batch; averaged counts afterwards; reset each
    // global batch.
    let device = Device::flex().autodiff();
    let (t, h, e, k) = (12, 5, 8, 2);
    let w = lcg_values(e * h, 71);
    let cfg = TopKRouterConfig::new(h, e, k)
        .with_score_function(ScoreFunction::Sigmoid)
        .with_aux_losses(vec![
            AuxLossSpec::new(AuxLossType::Aux, 1.0),
            AuxLossSpec::new(AuxLossType::GlobalAux, 1.0),
        ]);
    let router = router_f64(cfg, &w, &device);
    let mut state = router.init_state();
    let micro = [lcg_values(t * h, 72), lcg_values(t * h, 73)];
    let rows: Vec<usize> = (0..t).collect();
    let host_counts = |x: &[f64]| {
        let p = ref_scores(&ref_logits(x, &w, t, h, e), e, ScoreFunction::Sigmoid);
        let mut c = vec![0.0; e];
        for r in 0..t {
            ref_topk(&p[r * e..(r + 1) * e], k)
                .into_iter()
                .for_each(|i| c[i] += 1.0);
        }
        (p, c)
    };
    let step = |state: &mut RouterState, x: &[f64]| {
        let out = route_with(
            &router,
            f64_tensor(x, [t, h], &device),
            state,
            &RouteOptions::default(),
        );
        state.commit(&out.state_update).unwrap();
        out
    };
    let first = step(&mut state, &micro[0]);
    assert_eq!(
        value(&first, RouterLossKind::GlobalAux).to_bits(),
        value(&first, RouterLossKind::Aux).to_bits()
    );
    let second = step(&mut state, &micro[1]);
    assert_eq!(state.global_aux_steps(), 2);
    assert_eq!(
        state.global_tokens_per_expert().iter().sum::<f64>(),
        (t * 2 * k) as f64
    );
    let (_, c1) = host_counts(&micro[0]);
    let (p2, c2) = host_counts(&micro[1]);
    let avg: Vec<f64> = c1.iter().zip(&c2).map(|(a, b)| (a + b) / 2.0).collect();
    let sums: Vec<f64> = (0..e)
        .map(|c| rows.iter().map(|&r| p2[r * e + c]).sum())
        .collect();
    let want = sums.iter().zip(&avg).map(|(s, c)| s * c).sum::<f64>() * e as f64
        / (k as f64 * (t * t) as f64);
    let got = value(&second, RouterLossKind::GlobalAux);
    assert!((got - want).abs() < 1e-13, "{got} vs {want}");
    state.reset_global_aux();
    assert_eq!(state.global_aux_steps(), 0);
    let third = step(&mut state, &micro[1]);
    assert_eq!(
        value(&third, RouterLossKind::GlobalAux).to_bits(),
        value(&third, RouterLossKind::Aux).to_bits()
    );
}

#[test]
fn router_z_loss_matches_mean_of_squared_logsumexp() {
    let device = Device::flex().autodiff();
    let (t, h, e, k) = (9, 4, 6, 2);
    let w = lcg_values(e * h, 81);
    let x = lcg_values(t * h, 82);
    let router = router_f64(
        TopKRouterConfig::new(h, e, k).with_z_loss_coeff(Some(0.01)),
        &w,
        &device,
    );
    let out = route_with(
        &router,
        f64_tensor(&x, [t, h], &device),
        &router.init_state(),
        &RouteOptions::default(),
    );
    let logits = ref_logits(&x, &w, t, h, e);
    let want = 0.01
        * logits
            .chunks(e)
            .map(|r| r.iter().map(|v| v.exp()).sum::<f64>().ln().powi(2))
            .sum::<f64>()
        / t as f64;
    let got = value(&out, RouterLossKind::Z);
    assert!((got - want).abs() < 1e-14, "{got} vs {want}");
}

#[test]
fn router_zero_coefficients_give_an_exactly_zero_gate_gradient() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 2: with output × 0, the gate
    // gradient is exactly 0 without losses and non-zero with an aux or z coefficient of 1.
    let (t, h, e, k) = (16, 5, 4, 2);
    let device = Device::flex().autodiff();
    let w = lcg_values(e * h, 91);
    let x = lcg_values(t * h, 92);
    let zero = TopKRouterConfig::new(h, e, k)
        .with_aux_losses(all_aux(0.0))
        .with_z_loss_coeff(Some(0.0));
    let (g, _, out) = loss_grads(
        &router_f64(zero, &w, &device),
        &x,
        t,
        &RouteOptions::default(),
    );
    assert!(out.losses.is_empty());
    assert!(g.iter().all(|&v| v == 0.0), "{g:?}");
    let aux = TopKRouterConfig::new(h, e, k)
        .with_aux_losses(vec![AuxLossSpec::new(AuxLossType::Aux, 1.0)]);
    let (g, _, _) = loss_grads(
        &router_f64(aux, &w, &device),
        &x,
        t,
        &RouteOptions::default(),
    );
    assert!(g.iter().any(|&v| v != 0.0));
    let z = TopKRouterConfig::new(h, e, k).with_z_loss_coeff(Some(1.0));
    let (g, _, _) = loss_grads(&router_f64(z, &w, &device), &x, t, &RouteOptions::default());
    assert!(g.iter().any(|&v| v != 0.0));
}

#[test]
fn router_loss_gradient_matches_central_finite_differences() {
    // d(Σ losses)/dW from the attached losses vs central differences of the reported values,
    // f64, h = 1e-6, tolerance 1e-7·(1 + |g|). Counts are piecewise constant in W and the
    // random inputs have no near-ties, so the differences see the smooth part only.
    let device = Device::flex().autodiff();
    let (t, h, e, k, b) = (8, 3, 4, 2, 2);
    let w = lcg_values(e * h, 101);
    let x = lcg_values(t * h, 102);
    for function in [ScoreFunction::Softmax, ScoreFunction::Sigmoid] {
        let cfg = || {
            TopKRouterConfig::new(h, e, k)
                .with_score_function(function)
                .with_aux_losses(vec![
                    AuxLossSpec::new(AuxLossType::Aux, 0.1),
                    AuxLossSpec::new(AuxLossType::SeqAux, 0.2),
                    AuxLossSpec::new(AuxLossType::GlobalAux, 0.3),
                ])
                .with_z_loss_coeff(Some(0.05))
        };
        let opts = RouteOptions::default().with_batch_size(b);
        let (grad, _, _) = loss_grads(&router_f64(cfg(), &w, &device), &x, t, &opts);
        let total = |w: &[f64]| {
            let router = router_f64(cfg(), w, &device);
            let out = route_with(
                &router,
                f64_tensor(&x, [t, h], &device),
                &router.init_state(),
                &opts,
            );
            out.losses.iter().map(|l| l.value().unwrap()).sum::<f64>()
        };
        assert!(
            grad.iter().any(|g| g.abs() > 1e-4),
            "{function:?}: gradient too small to test"
        );
        let step = 1e-6;
        for i in 0..e * h {
            let (mut wp, mut wm) = (w.clone(), w.clone());
            wp[i] += step;
            wm[i] -= step;
            let fd = (total(&wp) - total(&wm)) / (2.0 * step);
            assert!(
                (grad[i] - fd).abs() < 1e-7 * (1.0 + fd.abs()),
                "{function:?} w[{i}]: {} vs {fd}",
                grad[i]
            );
        }
    }
}

#[test]
fn router_grad_scale_and_per_token_mode_scale_the_attached_gradient() {
    let device = Device::flex().autodiff();
    let (t, h, e, k) = (10, 4, 4, 2);
    let w = lcg_values(e * h, 111);
    let x = lcg_values(t * h, 112);
    let cfg = || {
        TopKRouterConfig::new(h, e, k)
            .with_aux_losses(all_aux(0.1))
            .with_z_loss_coeff(Some(0.01))
    };
    let (base, _, _) = loss_grads(
        &router_f64(cfg(), &w, &device),
        &x,
        t,
        &RouteOptions::default(),
    );
    let (scaled, _, _) = loss_grads(
        &router_f64(cfg(), &w, &device),
        &x,
        t,
        &RouteOptions::default().with_grad_scale(3.0),
    );
    let (per_token, _, out) = loss_grads(
        &router_f64(cfg().with_per_token_loss(true), &w, &device),
        &x,
        t,
        &RouteOptions::default(),
    );
    for i in 0..e * h {
        assert!((scaled[i] - 3.0 * base[i]).abs() < 1e-13 * (1.0 + base[i].abs()));
        assert!(
            (per_token[i] - t as f64 * base[i]).abs() < 1e-12 * (1.0 + t as f64 * base[i].abs())
        );
    }
    // Logged values are not pre-multiplied.
    let plain = route_with(
        &router_f64(cfg(), &w, &device),
        f64_tensor(&x, [t, h], &device),
        &RouterState::new(e),
        &RouteOptions::default(),
    );
    assert_eq!(
        value(&out, RouterLossKind::Aux).to_bits(),
        value(&plain, RouterLossKind::Aux).to_bits()
    );
}

#[test]
fn router_padding_mask_gives_the_same_losses_and_gradients() {
    // docs/routing-and-dispatch.md §Acceptance properties, item 13: aux, global aux and z-loss
    // values and the gate / input gradients with padded rows masked equal those of the input
    // without them; padded inputs get 0.
    let (h, e, k) = (5, 8, 2);
    let padded_at = [0usize, 5, 6];
    let t_full = 14;
    let valid: Vec<usize> = (0..t_full).filter(|r| !padded_at.contains(r)).collect();
    let x_full = lcg_values(t_full * h, 121);
    let x_valid: Vec<f64> = valid
        .iter()
        .flat_map(|&r| x_full[r * h..(r + 1) * h].to_vec())
        .collect();
    let flags: Vec<bool> = (0..t_full).map(|r| padded_at.contains(&r)).collect();
    let w = lcg_values(e * h, 122);
    let device = Device::flex().autodiff();
    for function in [ScoreFunction::Softmax, ScoreFunction::SqrtSoftplus] {
        let cfg = TopKRouterConfig::new(h, e, k)
            .with_score_function(function)
            .with_aux_losses(vec![
                AuxLossSpec::new(AuxLossType::Aux, 0.3),
                AuxLossSpec::new(AuxLossType::SeqAux, 0.2),
                AuxLossSpec::new(AuxLossType::GlobalAux, 0.1),
            ])
            .with_z_loss_coeff(Some(0.02));
        let router = router_f64(cfg, &w, &device);
        let (gw, gx, plain) = loss_grads(&router, &x_valid, valid.len(), &RouteOptions::default());
        let opts = RouteOptions::default().with_padding_mask(padding_mask(&flags, &device));
        let (gw_m, gx_m, masked) = loss_grads(&router, &x_full, t_full, &opts);
        for kind in [
            RouterLossKind::Aux,
            RouterLossKind::SeqAux,
            RouterLossKind::GlobalAux,
            RouterLossKind::Z,
        ] {
            let (a, b) = (value(&plain, kind), value(&masked, kind));
            assert!((a - b).abs() < 1e-13, "{function:?} {kind:?}: {a} vs {b}");
        }
        for (a, b) in gw.iter().zip(&gw_m) {
            assert!((a - b).abs() < 1e-12, "{function:?} gate grad {a} vs {b}");
        }
        for (i, &r) in valid.iter().enumerate() {
            for j in 0..h {
                assert!((gx[i * h + j] - gx_m[r * h + j]).abs() < 1e-12, "row {r}");
            }
        }
        for &r in &padded_at {
            assert!(
                gx_m[r * h..(r + 1) * h].iter().all(|&g| g == 0.0),
                "padded row {r}"
            );
        }
    }
}

#[test]
fn router_losses_need_a_tracked_forward_and_valid_batch() {
    let (t, h, e, k) = (6, 3, 4, 2);
    let w = lcg_values(e * h, 131);
    let x = lcg_values(t * h, 132);
    let cfg = || {
        TopKRouterConfig::new(h, e, k)
            .with_aux_losses(all_aux(1.0))
            .with_z_loss_coeff(Some(1.0))
    };
    // Not tracked: no losses, no state changes.
    let plain = Device::flex();
    let router = router_f64(cfg(), &w, &plain);
    let out = route_with(
        &router,
        f64_tensor(&x, [t, h], &plain),
        &router.init_state(),
        &RouteOptions::default(),
    );
    assert!(out.losses.is_empty() && out.state_update.global_aux_counts.is_none());
    // seq_aux needs T divisible by B.
    let device = Device::flex().autodiff();
    let router = router_f64(cfg(), &w, &device);
    let bad = router.forward(
        f64_tensor(&x, [t, h], &device),
        &router.init_state(),
        &RouteOptions::default().with_batch_size(4),
    );
    assert!(bad.is_err());
}
