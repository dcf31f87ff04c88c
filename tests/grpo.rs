//! The GRPO example, shortened: on 4 in-process ranks (experts EP4) the tiny model's mean
//! reward on the copy-a-digit task rises clearly within 150 policy updates.

use burn_moe::grpo::{GrpoOptions, grpo, prompt, reward};

#[test]
fn the_reward_rule() {
    assert_eq!(reward(&[3, 1], &[3]), 1.0);
    assert_eq!(reward(&[3, 1], &[1]), 0.1);
    assert_eq!(reward(&[3, 1], &[200]), 0.0);
    assert_eq!(reward(&[3], &[]), 0.0);
    let p = prompt(7, 2, 1, 0, 5);
    assert_eq!(p.len(), 5);
    assert!(p.iter().all(|d| (0..10).contains(d)));
    assert_eq!(p, prompt(7, 2, 1, 0, 5), "seeded");
}

#[test]
fn grpo_raises_the_mean_reward() {
    let options = GrpoOptions {
        steps: 150,
        ..GrpoOptions::default()
    };
    let report = grpo(&options, &|_, _| {}).expect("grpo");
    let r = &report.mean_rewards;
    assert_eq!(r.len(), 150);
    // The rollout model is synced (f32) before every step: its log-probabilities are the
    // trainer's up to the rounding of another reduction order (one rank's model vs the EP
    // shards), every step — a stale or partial sync would move them apart as the policy trains.
    assert_eq!(report.token_mult_prob_error.len(), 150);
    for (step, (m, k3)) in report
        .token_mult_prob_error
        .iter()
        .zip(&report.rollout_k3_kl)
        .enumerate()
    {
        assert!((1.0..1.0 + 1e-4).contains(m), "step {step}: exp|Δlogp| {m}");
        assert!(k3.abs() < 1e-6, "step {step}: K3 {k3}");
    }
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let (first, last) = (mean(&r[..20]), mean(&r[130..]));
    // A random policy scores about 0.01; the copy rate is what rises.
    assert!(first < 0.1, "first 20 steps: {first}");
    assert!(
        last > first + 0.1 && last > 0.15,
        "mean reward {first:.3} (first 20 steps) -> {last:.3} (last 20): {r:?}"
    );
    assert!(
        mean(&report.exact[130..]) > 0.1,
        "exact copies {:?}",
        report.exact
    );
}

/// GRPO under pipeline parallelism (the policy loss on the last stage, the weight sync
/// streaming each stage's tensors) takes the same steps as without it: the same rollouts and
/// rewards step after step (a policy that drifted apart would sample other answers), and a
/// rollout model synced exactly (the mismatch metrics of a faithful sync).
#[test]
fn grpo_under_pipeline_layouts_equals_the_same_replicas_without_them() {
    for (plain, piped) in [
        ("", "pp=2,pp_layout=Et|t*2L"),
        ("ep=2", "pp=2,ep=2,pp_layout=Et*2|tL"),
    ] {
        let run = |layout: &str| {
            let options = GrpoOptions {
                steps: 6,
                layout: layout.into(),
                ..GrpoOptions::default()
            };
            grpo(&options, &|_, _| {}).unwrap_or_else(|e| panic!("{layout}: {e}"))
        };
        let (a, b) = (run(plain), run(piped));
        // The world mean of the replicas' values is an f32 all-reduce over 2 or 4 ranks: equal
        // up to its rounding (one different sample would move a mean by ≥ 1/320).
        let same = |x: &[f64], y: &[f64]| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| (p - q).abs() <= 1e-6)
        };
        assert!(
            same(&a.mean_rewards, &b.mean_rewards),
            "{piped} vs {plain:?}: rewards {:?} vs {:?}",
            b.mean_rewards,
            a.mean_rewards
        );
        assert!(
            same(&a.exact, &b.exact),
            "{piped} vs {plain:?}: exact copies"
        );
        for (step, (m, k3)) in b
            .token_mult_prob_error
            .iter()
            .zip(&b.rollout_k3_kl)
            .enumerate()
        {
            assert!(
                (1.0..1.0 + 1e-4).contains(m),
                "{piped} step {step}: exp|Δlogp| {m}"
            );
            assert!(k3.abs() < 1e-6, "{piped} step {step}: K3 {k3}");
        }
        // Rewards that differ from step to step: equal sequences are not all zeros.
        assert!(
            a.mean_rewards.iter().any(|&r| r > 0.0),
            "{plain:?}: no reward at all"
        );
    }
}
