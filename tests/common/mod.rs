//! Helpers shared by the CLI training tests: scratch directories, `moe train` runs on threads,
//! metrics and checkpoint parameters, and the parallel-equivalence comparisons.
#![allow(dead_code)] // each test file uses a subset

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn_moe::bridge::dist::DistCheckpoint;
use burn_moe::bridge::dist::convert::export_dist_to_hf;
use burn_moe::bridge::export::ExportOptions;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::bridge::safetensors::Dtype;
use burn_moe::models::hf::ModelConfig;
use serde_json::Value;

pub const MOE: &str = env!("CARGO_BIN_EXE_moe");
pub const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3_moe");
pub const STEPS: usize = 5;
/// Adam's ε for comparisons with other layouts: as in `models/tests/parallel_equivalence.rs`,
/// elements whose gradient is ~0 get updates `g/(|g|+ε)` that amplify the f32 rounding of
/// `g` (which depends on the reduction order of the layout) without bound as ε → 0. Runs
/// compared across transports alone keep the default 1e-8 and agree bit for bit.
pub const ADAM_EPS: &str = "1e-3";

/// A fresh directory (unique across the tests running at once).
pub fn scratch(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("moe-processes-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// `moe train` arguments for a job writing its metrics and checkpoints under `dir`; a flag in
/// `extra` replaces the default of the same flag.
pub fn train_args(dir: &Path, layout: &str, steps: usize, extra: &[&str]) -> Vec<String> {
    let steps = steps.to_string();
    let save = dir.join("ckpt").display().to_string();
    let metrics = dir.join("metrics.jsonl").display().to_string();
    let defaults: [(&str, &str); 9] = [
        ("--model", FIXTURE),
        ("--layout", layout),
        ("--steps", &steps),
        ("--gbs", "4"),
        ("--seq-len", "12"),
        ("--lr", "1e-2"),
        ("--weight-decay", "0.1"),
        ("--save", &save),
        ("--metrics-out", &metrics),
    ];
    let mut args = vec!["train".to_string()];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            args.extend([flag.to_string(), value.to_string()]);
        }
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

pub fn check(out: Output, what: &str) -> Output {
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `moe` with `args` on threads, success or not.
pub fn moe_threads(args: &[String]) -> Output {
    Command::new(MOE)
        .args(args)
        .args(["--transport", "threads"])
        .output()
        .expect("moe")
}

/// An output's stdout and stderr, joined.
pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

pub fn threads(args: &[String]) -> Output {
    let out = Command::new(MOE)
        .args(args)
        .args(["--transport", "threads"])
        .output()
        .expect("moe");
    check(out, &format!("moe {}", args.join(" ")))
}

pub fn metrics(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

pub fn field(m: &Value, key: &str) -> f64 {
    m[key].as_f64().unwrap_or(f64::NAN)
}

/// Every parameter of the latest checkpoint under `dir`, exported to HF as F32.
pub fn params(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let ckpt = DistCheckpoint::open::<ModelConfig>(dir.join("ckpt")).expect("checkpoint");
    ckpt.validate::<ModelConfig>().expect("valid checkpoint");
    let hf = dir.join("hf");
    let _ = std::fs::remove_dir_all(&hf);
    let opts = ExportOptions {
        dtype: Some(Dtype::F32),
        ..ExportOptions::default()
    };
    export_dist_to_hf::<ModelConfig>(&ckpt, &hf, &opts).expect("export");
    let hf = HfCheckpoint::open(&hf).expect("export opens");
    let names: Vec<String> = hf.tensor_names().map(str::to_string).collect();
    names
        .into_iter()
        .map(|n| {
            let v = hf
                .tensor(&n)
                .and_then(|t| t.to_tensor_data())
                .expect("tensor")
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("f32");
            (n, v)
        })
        .collect()
}

/// Parallel-equivalence tolerance (docs/architecture.md §Equality and tolerances):
/// `1e-5·max|want| + 1e-6`.
pub fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let tol = 1e-5 * scale + 1e-6;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: {g} vs {w} (tol {tol:e})"
        );
    }
}

pub fn assert_params_close(
    got: &BTreeMap<String, Vec<f32>>,
    want: &BTreeMap<String, Vec<f32>>,
    what: &str,
) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (name, w) in want {
        assert_close(&got[name], w, &format!("{what}: {name}"));
    }
}

pub fn assert_metrics_close(got: &[Value], want: &[Value], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: steps");
    for (g, w) in got.iter().zip(want) {
        for key in ["loss", "aux_loss", "grad_norm"] {
            let (a, b) = (field(g, key), field(w, key));
            assert!(
                (a - b).abs() <= 1e-5 * b.abs() + 1e-6,
                "{what} step {}: {key} {a} vs {b}",
                w["step"]
            );
        }
    }
}

/// Bitwise equality of everything but the timing.
pub fn assert_metrics_equal(got: &[Value], want: &[Value], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: steps");
    for (g, w) in got.iter().zip(want) {
        for key in ["step", "loss", "aux_loss", "grad_norm", "lr"] {
            assert_eq!(g[key], w[key], "{what} step {}: {key}", w["step"]);
        }
    }
}
