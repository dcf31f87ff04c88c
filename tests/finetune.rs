//! The fine-tuning job of `examples/finetune.rs` (tiny Qwen3-MoE, attention TP2 × DP2, experts
//! EP4 on 4 in-process ranks) learns: the loss falls by a clear margin in 20 steps.

use burn_moe::finetune::{FinetuneOptions, finetune};

#[test]
fn finetune_on_four_ranks_lowers_the_loss() {
    let options = FinetuneOptions {
        steps: 20,
        ..FinetuneOptions::default()
    };
    let report = finetune(&options, &|_, _| {}).expect("fine-tuning runs");
    assert_eq!(report.losses.len(), 20);
    let first = report.losses[0];
    let last3 = report.losses[17..].iter().sum::<f32>() / 3.0;
    // Uniform guessing over 256 tokens is ln 256 ≈ 5.5; the arithmetic corpus is learnable.
    assert!(first > 5.0, "initial loss {first}");
    assert!(
        last3 < first - 1.0,
        "loss {first} -> {last3} (mean of the last 3 steps)"
    );
    assert!(report.grad_norms.iter().all(|g| g.is_finite() && *g > 0.0));
    assert!(report.aux_losses.iter().all(|a| a.is_finite() && *a > 0.0));
    assert!(report.tokens_per_second > 0.0);
}

#[test]
fn impossible_layouts_are_reported() {
    // 4 query heads cannot be split over tp = 8.
    let options = FinetuneOptions {
        layout: "tp=8,ep=8".into(),
        steps: 1,
        ..FinetuneOptions::default()
    };
    let err = finetune(&options, &|_, _| {}).expect_err("tp=8 is impossible");
    assert!(err.to_string().contains("tp"), "{err}");
}
