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
