//! `moe train --bf16` end to end on threads (issue 34 item 1; docs/training-and-rl.md §Mixed
//! precision (BF16)): train, save, resume (same layout: bit for bit; another layout: within
//! the BF16 tolerance), `moe export` (BF16 by default: the main weights rounded once;
//! `--dtype f32`: the main weights), and `--grad-reduce-in-bf16` (refused without `--bf16`;
//! with it, within the stated tolerance of the f32 reduction under a data-parallel layout).

mod common;

use std::path::Path;

use burn::tensor::bf16;
use burn_moe::bridge::dist::DistCheckpoint;
use burn_moe::bridge::dist::index::TensorKind;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::bridge::safetensors::Dtype;
use burn_moe::models::hf::ModelConfig;
use common::*;
use serde_json::Value;

/// The stated tolerance of a BF16 run against another BF16 run of the same steps that sums
/// its f32 gradients in another order (another layout, or a resume under another layout):
/// every step's loss and gradient norm within 1% (relative). Measured over 4 steps: losses
/// 4e-5 (resume under another layout) and 7e-5 (BF16 reduction), gradient norms 9e-4 and
/// 1.1e-3.
const BF16_RTOL: f64 = 0.01;

/// The stated tolerance of the main weights (the F32 export) of such runs:
/// `max |a − b| ≤ 1e-2 · max |b|` per tensor (Adam's steps of `lr = 1e-2` move elements whose
/// tiny gradients change with the rounding by up to `lr`; measured: 2.9e-3 resumed under
/// another layout, 3.9e-3 BF16 reduction).
const BF16_PARAM_RTOL: f64 = 0.01;

/// `max` over the steps of `|a − b| / |b|` for `key`.
fn worst_metric(got: &[Value], want: &[Value], key: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "steps");
    got.iter()
        .zip(want)
        .map(|(g, w)| ((field(g, key) - field(w, key)) / field(w, key)).abs())
        .fold(0f64, f64::max)
}

/// Losses and gradient norms of two BF16 runs within [`BF16_RTOL`].
fn metrics_within(got: &[Value], want: &[Value], what: &str) {
    for key in ["loss", "grad_norm"] {
        let w = worst_metric(got, want, key);
        eprintln!("{what}: worst relative {key} difference {w:.2e}");
        assert!(w <= BF16_RTOL, "{what}: {key} {w:e} > {BF16_RTOL}");
    }
}

/// Every exported parameter of two runs within [`BF16_PARAM_RTOL`] of the largest.
fn params_within(
    got: &std::collections::BTreeMap<String, Vec<f32>>,
    want: &std::collections::BTreeMap<String, Vec<f32>>,
    what: &str,
) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    let mut worst = 0f64;
    for (name, w) in want {
        let g = &got[name];
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
        let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let r = f64::from(err / scale);
        worst = worst.max(r);
        assert!(r <= BF16_PARAM_RTOL, "{what}: {name}: {r:e}");
    }
    eprintln!("{what}: worst parameter difference {worst:.2e} of the largest");
}

fn bf(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// The run's flags: BF16, Adam's ε of the layout comparisons.
fn bf16_flags<'a>(more: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--bf16", "--adam-eps", ADAM_EPS];
    v.extend_from_slice(more);
    v
}

/// `moe export <dir>/ckpt` with `flags` into `out`: every tensor as `(dtype, f32 values)` and
/// the config.
fn cli_export(dir: &Path, out: &Path, flags: &[&str]) -> (Vec<(String, Dtype, Vec<f32>)>, Value) {
    let mut args = vec![
        "export".to_string(),
        dir.join("ckpt").display().to_string(),
        "--out".into(),
        out.display().to_string(),
    ];
    args.extend(flags.iter().map(|s| s.to_string()));
    check(
        std::process::Command::new(MOE)
            .args(&args)
            .output()
            .expect("moe"),
        "moe export",
    );
    let hf = HfCheckpoint::open(out).expect("export opens");
    let names: Vec<String> = hf.tensor_names().map(str::to_string).collect();
    let tensors = names
        .into_iter()
        .map(|n| {
            let t = hf.tensor(&n).expect("tensor");
            let v = t.to_f32_vec().expect("f32");
            (n, t.dtype, v)
        })
        .collect();
    let config =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("config"))
            .expect("config json");
    (tensors, config)
}

#[test]
fn bf16_trains_saves_resumes_and_exports() {
    let (whole, same, other) = (
        scratch("bf16-whole"),
        scratch("bf16-same"),
        scratch("bf16-other"),
    );
    threads(&train_args(&whole, "tp=2,ep=4", 4, &bf16_flags(&[])));
    // The checkpoint: BF16 parameters, f32 main weights and moments.
    let ckpt = DistCheckpoint::open::<ModelConfig>(whole.join("ckpt")).expect("checkpoint");
    ckpt.validate::<ModelConfig>().expect("valid");
    for (fqn, entry) in &ckpt.index().tensors {
        let want = match entry.kind {
            TensorKind::Param => Dtype::BF16,
            _ => Dtype::F32,
        };
        assert_eq!(entry.dtype, want, "{fqn}");
    }
    // Saved at step 2 and resumed under the same layout: bit for bit.
    threads(&train_args(&same, "tp=2,ep=4", 2, &bf16_flags(&[])));
    threads(&train_args(
        &same,
        "tp=2,ep=4",
        4,
        &bf16_flags(&["--resume"]),
    ));
    assert_metrics_equal(&metrics(&same), &metrics(&whole), "resumed, same layout");
    let (p_whole, p_same) = (params(&whole), params(&same));
    for (name, w) in &p_whole {
        let g = &p_same[name];
        assert!(
            g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
            "resumed, same layout: {name} differs"
        );
    }
    // Resumed under another layout: within the BF16 tolerance of the uninterrupted run.
    threads(&train_args(&other, "tp=2,ep=4", 2, &bf16_flags(&[])));
    threads(&train_args(&other, "ep=2", 4, &bf16_flags(&["--resume"])));
    metrics_within(
        &metrics(&other),
        &metrics(&whole),
        "tp=2,ep=4 resumed as ep=2",
    );
    params_within(&params(&other), &p_whole, "tp=2,ep=4 resumed as ep=2");
    // `moe export`: BF16 by default, each weight its main weight (`params`: the F32 export)
    // rounded once; `--dtype f32` the main weights.
    let (tensors, config) = cli_export(&whole, &whole.join("hf-bf16"), &[]);
    assert_eq!(config["dtype"], "bfloat16");
    let (f32_tensors, f32_config) = cli_export(&whole, &whole.join("hf-f32"), &["--dtype", "f32"]);
    assert_eq!(f32_config["dtype"], "float32");
    assert_eq!(tensors.len(), p_whole.len());
    let mut unrounded = 0;
    for ((name, dtype, values), (f_name, f_dtype, f_values)) in tensors.iter().zip(&f32_tensors) {
        assert_eq!(name, f_name);
        assert_eq!(*dtype, Dtype::BF16, "{name}");
        assert_eq!(*f_dtype, Dtype::F32, "{name}");
        let main = &p_whole[name];
        assert!(
            f_values
                .iter()
                .zip(main)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        for (i, (v, m)) in values.iter().zip(main).enumerate() {
            assert!(
                v.to_bits() == bf(*m).to_bits(),
                "{name}[{i}]: exported {v}, main weight {m}"
            );
        }
        unrounded += main.iter().filter(|m| bf(**m) != **m).count();
    }
    assert!(unrounded > 0, "the main weights are not BF16 values");
    for d in [whole, same, other] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn grad_reduce_in_bf16_needs_bf16_and_stays_within_tolerance_of_f32_reduction() {
    // Without --bf16: refused by the argument parser, naming the missing flag.
    let dir = scratch("bf16-reduce-refused");
    let out = moe_threads(&train_args(&dir, "world=4", 2, &["--grad-reduce-in-bf16"]));
    let text = output_text(&out);
    assert!(!out.status.success() && text.contains("--bf16"), "{text}");
    assert!(!dir.join("ckpt").exists());
    // Four data-parallel replicas reduce-scatter their gradients in BF16: within the BF16
    // tolerance of the f32 reduction.
    let (f32_reduce, bf16_reduce) = (scratch("bf16-reduce-f32"), scratch("bf16-reduce-bf16"));
    threads(&train_args(&f32_reduce, "world=4", 4, &bf16_flags(&[])));
    threads(&train_args(
        &bf16_reduce,
        "world=4",
        4,
        &bf16_flags(&["--grad-reduce-in-bf16"]),
    ));
    let (m_f32, m_bf16) = (metrics(&f32_reduce), metrics(&bf16_reduce));
    metrics_within(&m_bf16, &m_f32, "BF16 vs f32 gradient reduction, dp=4");
    params_within(
        &params(&bf16_reduce),
        &params(&f32_reduce),
        "BF16 vs f32 gradient reduction, dp=4",
    );
    // The BF16 reduction is in effect: the gradient norms differ from the f32 reduction's.
    assert!(
        m_bf16
            .iter()
            .zip(&m_f32)
            .any(|(a, b)| field(a, "grad_norm") != field(b, "grad_norm")),
        "the BF16 reduction changes the reduced gradients"
    );
    for d in [dir, f32_reduce, bf16_reduce] {
        let _ = std::fs::remove_dir_all(d);
    }
}
