//! The `moe` commands on the Mixtral fixture (`tests/fixtures/mixtral`, goldens from
//! transformers 5.23 by `tests/fixtures/make_family_fixtures.py`): `logits` (with HF's loss
//! and aux loss), `logprobs` (one rank and `ep=2`), `train` (two steps under `ep=2`, saving a
//! distributed checkpoint) and `export` of that checkpoint, which must write exactly the
//! release's tensor names (`block_sparse_moe.experts.{e}.w1/w3/w2`) holding the checkpoint's
//! trained values.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use burn_moe::bridge::dist::DistCheckpoint;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::bridge::safetensors::{Dtype, SafetensorsFile};
use burn_moe::models::hf::ModelConfig;
use common::{scratch, threads, train_args};

const MIXTRAL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/mixtral");

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mixtral.golden.safetensors")
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Runs `moe args…` (logs limited to warnings) and returns its stdout; fails on an error.
fn ok(args: &[&str]) -> String {
    let out = Command::new(common::MOE)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the moe binary");
    assert!(
        out.status.success(),
        "moe {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn read_f32(file: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let f = SafetensorsFile::open(file).expect("open");
    let t = f.tensor(name).expect("tensor");
    assert_eq!(t.dtype, Dtype::F32, "{name}");
    (t.shape.to_vec(), t.to_f32_vec().expect("f32"))
}

fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0.0, |m, v| m.max(v.abs()))
}

#[test]
fn logits_and_logprobs_match_transformers() {
    let dir = scratch("mixtral-logits");
    let out = dir.join("logits.safetensors");
    let golden = golden();
    let args = ["logits", "--model", MIXTRAL, "--input", path(&golden)];
    ok(&[&args[..], &["--out", path(&out), "--labels"]].concat());
    let (shape, logits) = read_f32(&golden, "logits");
    let (got_shape, got) = read_f32(&out, "logits");
    assert_eq!(got_shape, shape);
    let scale = max_abs(&logits);
    assert!(max_err(&got, &logits) <= 1e-4 * scale);
    for key in ["loss", "aux_loss"] {
        let (_, want) = read_f32(&golden, key);
        let (_, ours) = read_f32(&out, key);
        let rel = (ours[0] - want[0]).abs() / want[0].abs();
        assert!(rel <= 1e-5, "{key}: {} vs {}", ours[0], want[0]);
    }
    // Log-probs of the next tokens from the golden logits (log-softmax in f64).
    let ids: Vec<i64> = {
        let f = SafetensorsFile::open(&golden).expect("golden");
        let t = f.tensor("input_ids").expect("ids");
        (t.bytes.chunks_exact(8))
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect()
    };
    let (b, s, v) = (shape[0], shape[1], shape[2]);
    let mut want = Vec::new();
    for r in 0..b {
        for i in 0..s - 1 {
            let row = &logits[(r * s + i) * v..(r * s + i + 1) * v];
            let m = row.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
            let lse = m + row
                .iter()
                .map(|&x| (f64::from(x) - m).exp())
                .sum::<f64>()
                .ln();
            let next = ids[r * s + i + 1] as usize;
            want.push((f64::from(row[next]) - lse) as f32);
        }
    }
    for layout in ["", "world=2,ep=2"] {
        let lp = dir.join("logprobs.safetensors");
        let _ = std::fs::remove_file(&lp);
        let args = ["logprobs", "--model", MIXTRAL, "--input", path(&golden)];
        ok(&[&args[..], &["--out", path(&lp), "--layout", layout]].concat());
        let (lp_shape, got) = read_f32(&lp, "logprobs");
        assert_eq!(lp_shape, [b, s - 1], "{layout}");
        let err = max_err(&got, &want);
        assert!(
            err <= 1e-4 * max_abs(&want),
            "{layout:?}: log-prob error {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_trained_checkpoint_exports_the_release_names_and_its_values() {
    let dir = scratch("mixtral-train");
    let extra = ["--model", MIXTRAL, "--gbs", "2"];
    threads(&train_args(&dir, "world=2,ep=2", 2, &extra));
    let hf = dir.join("hf");
    let ckpt = dir.join("ckpt");
    let text = ok(&["export", path(&ckpt), "--out", path(&hf), "--dtype", "f32"]);
    assert!(text.contains("wrote"), "{text}");
    let exported = HfCheckpoint::open(&hf).expect("the export opens");
    let names: BTreeSet<String> = exported.tensor_names().map(str::to_owned).collect();
    let release = HfCheckpoint::open(MIXTRAL).expect("fixture");
    let want: BTreeSet<String> = release.tensor_names().map(str::to_owned).collect();
    assert_eq!(names, want, "exactly the release checkpoint's tensor names");

    // Every value is the checkpoint's: canonical tensors as stored, the stacked experts
    // `[E, 2, Im, H]` / `[E, H, Im]` cut by the test into w1 (gate), w3 (up), w2 (down).
    let dist = DistCheckpoint::open::<ModelConfig>(&ckpt).expect("checkpoint");
    let tensor = |hf: &HfCheckpoint, n: &str| -> Vec<f32> {
        (hf.tensor(n).and_then(|t| t.to_tensor_data()))
            .expect("tensor")
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32")
    };
    let stored = |fqn: &str| -> Vec<f32> {
        dist.read_tensor(fqn)
            .unwrap_or_else(|e| panic!("{fqn}: {e}"))
            .to_f32_vec()
            .expect("f32")
    };
    let mut trained = 0;
    for name in &names {
        let got = tensor(&exported, name);
        let parts: Vec<&str> = name.split('.').collect();
        let want = match parts.as_slice() {
            [m, l, i, "block_sparse_moe", "experts", e, proj, "weight"] => {
                let e: usize = e.parse().expect("expert index");
                let experts = format!("{m}.{l}.{i}.block_sparse_moe.experts");
                let n = got.len();
                match *proj {
                    "w1" => stored(&format!("{experts}.gate_up_proj"))[2 * e * n..][..n].to_vec(),
                    "w3" => {
                        stored(&format!("{experts}.gate_up_proj"))[(2 * e + 1) * n..][..n].to_vec()
                    }
                    "w2" => stored(&format!("{experts}.down_proj"))[e * n..][..n].to_vec(),
                    other => panic!("unexpected projection {other}"),
                }
            }
            _ => stored(name),
        };
        assert_eq!(got, want, "{name}: the checkpoint's values");
        if got != tensor(&release, name) {
            trained += 1;
        }
    }
    assert_eq!(trained, names.len(), "two steps moved every tensor");
    // The export is a Mixtral checkpoint again: it loads and runs.
    let out = dir.join("logits.safetensors");
    let golden = golden();
    let args = ["logits", "--model", path(&hf), "--input", path(&golden)];
    ok(&[&args[..], &["--out", path(&out)]].concat());
    let _ = std::fs::remove_dir_all(&dir);
}
