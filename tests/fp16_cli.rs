//! `moe train --fp16` end to end on threads (docs/training-and-rl.md §Mixed precision (FP16 and
//! loss scaling)): a run whose dynamic loss scale starts too high overflows, skips those steps
//! and backs off (the logged `loss_scale` follows Megatron's rules, checked step by step), then
//! trains; the scaler's state is saved in the checkpoint, so a run resumed mid-way equals the
//! uninterrupted one bit for bit (metrics, `loss_scale` included, and parameters); `--fp16`
//! with `--bf16` is refused by name.

mod common;

use common::*;
use serde_json::Value;

/// 2²⁰ overflows F16 gradients on this fixture at first (measured: the scale reaching 2¹⁶ or
/// lower trains); hysteresis 1 and a window of 2 make backing off and growing both happen
/// within a few steps.
const FLAGS: [&str; 7] = [
    "--fp16",
    "--initial-loss-scale",
    "1048576",
    "--hysteresis",
    "1",
    "--loss-scale-window",
    "2",
];

const STEPS: usize = 8;

fn scale(record: &Value) -> f64 {
    record["loss_scale"].as_f64().expect("loss_scale logged")
}

/// An overflowed step logs no gradient norm (it was never computed: `null`).
fn overflowed(record: &Value) -> bool {
    record["grad_norm"].is_null()
}

#[test]
fn fp16_trains_backs_off_and_resumes_bit_for_bit() {
    let (whole, resumed) = (scratch("fp16-whole"), scratch("fp16-resumed"));
    threads(&train_args(&whole, "ep=2", STEPS, &FLAGS));
    let m = metrics(&whole);
    assert_eq!(m.len(), STEPS);
    // Megatron's rules with hysteresis 1 and window 2, from the first scale: an overflow halves
    // the scale and resets the window; two finite steps in a row double it.
    let (mut want, mut growth) = (1048576.0f64, 0);
    let mut overflows = 0;
    for r in &m {
        assert_eq!(
            scale(r),
            want,
            "step {}: the scale its backward used",
            r["step"]
        );
        if overflowed(r) {
            overflows += 1;
            want /= 2.0;
            growth = 0;
        } else {
            growth += 1;
            if growth == 2 {
                want *= 2.0;
                growth = 0;
            }
        }
        assert!(r["loss"].as_f64().is_some_and(f64::is_finite), "{r}");
    }
    eprintln!(
        "loss scales {:?}, {overflows} overflows",
        m.iter().map(scale).collect::<Vec<_>>()
    );
    assert!(overflows >= 1, "the first scale should overflow");
    assert!(overflows < STEPS, "no step trained");
    // Saved mid-way and resumed: the scaler's state comes back with the checkpoint.
    threads(&train_args(&resumed, "ep=2", STEPS / 2, &FLAGS));
    let mut more = FLAGS.to_vec();
    more.push("--resume");
    threads(&train_args(&resumed, "ep=2", STEPS, &more));
    let r = metrics(&resumed);
    assert_metrics_equal(&r, &m, "fp16 resumed");
    for (g, w) in r.iter().zip(&m) {
        assert_eq!(g["loss_scale"], w["loss_scale"], "step {}", w["step"]);
    }
    let (a, b) = (params(&whole), params(&resumed));
    for (name, w) in &a {
        assert!(
            b[name]
                .iter()
                .zip(w)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "resumed: {name} differs"
        );
    }
}

#[test]
fn fp16_and_bf16_together_are_refused_by_name() {
    let dir = scratch("fp16-bf16");
    let out = std::process::Command::new(MOE)
        .args(train_args(&dir, "", 1, &["--fp16", "--bf16"]))
        .output()
        .expect("moe");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--fp16") && err.contains("--bf16"), "{err}");
}
