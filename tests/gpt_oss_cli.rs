//! The `moe` commands on the gpt-oss fixtures (`tests/fixtures/gpt_oss`, f32, and
//! `tests/fixtures/gpt_oss_mxfp4`, the release format with MXFP4 experts; goldens from
//! transformers 5.23 by `tests/fixtures/make_family_fixtures.py`):
//!
//! - `logits` (HF's loss and aux loss) and `logprobs` (one rank and `ep=2`) of both directories
//!   against the goldens;
//! - `generate` continues greedily past the sliding window (4) as transformers does;
//! - `export` of the MXFP4 release (HF → HF, the default keeps each tensor's stored format)
//!   re-packs its `*_blocks` / `*_scales` to the release's bytes;
//! - `train` two steps under `ep=2` from the MXFP4 release, then `export` of the distributed
//!   checkpoint: exactly the release's dequantised tensor names (those of the f32 fixture),
//!   no `quantization_config`, holding the checkpoint's trained values in the release layout
//!   (`gate_up_proj [E, H, 2I]` gate/up interleaved, `down_proj [E, I, H]`), permuted here by
//!   the test from the canonical tensors; the export loads and runs again.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use burn_moe::bridge::dist::DistCheckpoint;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::bridge::safetensors::{Dtype, SafetensorsFile};
use burn_moe::models::hf::ModelConfig;
use common::{scratch, threads, train_args};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

fn fixture(name: &str) -> PathBuf {
    Path::new(FIXTURES).join(name)
}

fn golden(name: &str) -> PathBuf {
    fixture(&format!("{name}.golden.safetensors"))
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

fn read_i64(file: &Path, name: &str) -> Vec<i64> {
    let f = SafetensorsFile::open(file).expect("open");
    let t = f.tensor(name).expect("tensor");
    assert_eq!(t.dtype, Dtype::I64, "{name}");
    (t.bytes.chunks_exact(8))
        .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect()
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

/// Next-token log-probs of the golden logits (log-softmax in f64).
fn golden_logprobs(golden: &Path) -> (Vec<usize>, Vec<f32>) {
    let (shape, logits) = read_f32(golden, "logits");
    let ids = read_i64(golden, "input_ids");
    let (b, s, v) = (shape[0], shape[1], shape[2]);
    let mut want = Vec::new();
    for r in 0..b {
        for i in 0..s - 1 {
            let row = &logits[(r * s + i) * v..(r * s + i + 1) * v];
            let m = row.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
            let lse = m
                + (row.iter())
                    .map(|&x| (f64::from(x) - m).exp())
                    .sum::<f64>()
                    .ln();
            let next = ids[r * s + i + 1] as usize;
            want.push((f64::from(row[next]) - lse) as f32);
        }
    }
    (vec![b, s - 1], want)
}

#[test]
fn logits_logprobs_and_generation_match_transformers_for_both_formats() {
    for name in ["gpt_oss", "gpt_oss_mxfp4"] {
        let dir = scratch(&format!("{name}-logits"));
        let (model, golden) = (fixture(name), golden(name));
        let out = dir.join("logits.safetensors");
        let args = ["logits", "--model", path(&model), "--input", path(&golden)];
        ok(&[&args[..], &["--out", path(&out), "--labels"]].concat());
        let (shape, logits) = read_f32(&golden, "logits");
        let (got_shape, got) = read_f32(&out, "logits");
        assert_eq!(got_shape, shape, "{name}");
        assert!(shape[1] > 4, "longer than the sliding window");
        let (err, scale) = (max_err(&got, &logits), max_abs(&logits));
        assert!(
            err <= 1e-4 * scale,
            "{name}: logit error {err} (scale {scale})"
        );
        for key in ["loss", "aux_loss"] {
            let (_, want) = read_f32(&golden, key);
            let (_, ours) = read_f32(&out, key);
            let rel = (ours[0] - want[0]).abs() / want[0].abs();
            assert!(rel <= 1e-5, "{name} {key}: {} vs {}", ours[0], want[0]);
        }
        let (lp_shape, want) = golden_logprobs(&golden);
        for layout in ["", "world=2,ep=2"] {
            let lp = dir.join("logprobs.safetensors");
            let _ = std::fs::remove_file(&lp);
            let args = [
                "logprobs",
                "--model",
                path(&model),
                "--input",
                path(&golden),
            ];
            ok(&[&args[..], &["--out", path(&lp), "--layout", layout]].concat());
            let (shape, got) = read_f32(&lp, "logprobs");
            assert_eq!(shape, lp_shape, "{name} {layout:?}");
            let err = max_err(&got, &want);
            assert!(
                err <= 1e-4 * max_abs(&want),
                "{name} {layout:?}: log-prob error {err}"
            );
        }
        // Greedy continuation of an 8-token prompt by 8 tokens (the window is 4).
        let prompt = read_i64(&golden, "prompt_ids");
        let greedy = read_i64(&golden, "greedy_ids");
        let ids: Vec<String> = prompt.iter().map(i64::to_string).collect();
        let new = (greedy.len() - prompt.len()).to_string();
        let args = ["generate", "--model", path(&model), "--prompt-ids"];
        let text = ok(&[&args[..], &[&ids.join(","), "--max-new-tokens", &new]].concat());
        let want: Vec<String> = greedy[prompt.len()..].iter().map(i64::to_string).collect();
        assert_eq!(text.trim(), want.join(","), "{name}: greedy continuation");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn exporting_the_mxfp4_release_repacks_it_bit_for_bit() {
    let dir = scratch("gpt-oss-repack");
    let release = fixture("gpt_oss_mxfp4");
    let out = dir.join("hf");
    ok(&["export", "--model", path(&release), "--out", path(&out)]);
    let src = SafetensorsFile::open(release.join("model.safetensors")).expect("release");
    let dst = HfCheckpoint::open(&out).expect("the export opens");
    let mut packed = 0;
    for name in src.names() {
        let want = src.tensor(name).expect("tensor");
        let got = dst.tensor(name).expect("exported");
        assert_eq!((got.dtype, got.shape), (want.dtype, want.shape), "{name}");
        if name.ends_with("_blocks") || name.ends_with("_scales") {
            assert_eq!(got.bytes, want.bytes, "{name}: the release's bytes");
            packed += 1;
        }
    }
    assert_eq!(packed, 16, "gate_up / down blocks and scales of 4 layers");
    assert_eq!(dst.tensor_names().count(), src.names().count());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("config"))
            .expect("json");
    assert_eq!(config["quantization_config"]["quant_method"], "mxfp4");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The release layout of canonical checkpoint tensor `name` (`values` of `shape`), written
/// out by hand: `gate_up_proj [E, 2, I, H]` → `[E, H, 2I]` with column `2i` gate row `i` and
/// `2i + 1` up row `i`; its bias `[E, 2, I]` → `[E, 2I]` interleaved; `down_proj [E, H, I]` →
/// `[E, I, H]`; everything else as stored.
fn release_values(name: &str, shape: &[usize], values: &[f32]) -> Vec<f32> {
    if name.ends_with("experts.gate_up_proj") {
        let [e, two, i, h] = shape.try_into().expect("[E, 2, I, H]");
        assert_eq!(two, 2);
        let mut out = vec![0.0; values.len()];
        for x in 0..e {
            for g in 0..2 {
                for r in 0..i {
                    for c in 0..h {
                        out[(x * h + c) * 2 * i + 2 * r + g] =
                            values[((x * 2 + g) * i + r) * h + c];
                    }
                }
            }
        }
        out
    } else if name.ends_with("experts.gate_up_proj_bias") {
        let [e, two, i] = shape.try_into().expect("[E, 2, I]");
        assert_eq!(two, 2);
        let mut out = vec![0.0; values.len()];
        for x in 0..e {
            for g in 0..2 {
                for r in 0..i {
                    out[x * 2 * i + 2 * r + g] = values[(x * 2 + g) * i + r];
                }
            }
        }
        out
    } else if name.ends_with("experts.down_proj") {
        let [e, h, i] = shape.try_into().expect("[E, H, I]");
        let mut out = vec![0.0; values.len()];
        for x in 0..e {
            for r in 0..h {
                for c in 0..i {
                    out[(x * i + c) * h + r] = values[(x * h + r) * i + c];
                }
            }
        }
        out
    } else {
        values.to_vec()
    }
}

#[test]
fn a_trained_mxfp4_checkpoint_exports_the_dequantised_release_and_loads_back() {
    let dir = scratch("gpt-oss-train");
    let release = fixture("gpt_oss_mxfp4");
    let extra = ["--model", path(&release), "--gbs", "2"];
    threads(&train_args(&dir, "world=2,ep=2", 2, &extra));
    let (hf, ckpt) = (dir.join("hf"), dir.join("ckpt"));
    let text = ok(&["export", path(&ckpt), "--out", path(&hf), "--dtype", "f32"]);
    assert!(text.contains("wrote"), "{text}");
    let exported = HfCheckpoint::open(&hf).expect("the export opens");
    let names: BTreeSet<String> = exported.tensor_names().map(str::to_owned).collect();
    let dense = HfCheckpoint::open(fixture("gpt_oss")).expect("f32 fixture");
    let want: BTreeSet<String> = dense.tensor_names().map(str::to_owned).collect();
    assert_eq!(names, want, "the release's names, experts dequantised");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).expect("config"))
            .expect("json");
    assert!(config.get("quantization_config").is_none(), "dense experts");

    let dist = DistCheckpoint::open::<ModelConfig>(&ckpt).expect("checkpoint");
    let start = HfCheckpoint::open(&release).expect("release");
    let mut trained = 0;
    for name in &names {
        let t = exported.tensor(name).expect("tensor");
        let got = t.to_f32_vec().expect("f32");
        let stored = dist.read_tensor(name).expect("stored");
        let want = release_values(name, &stored.shape, &stored.to_f32_vec().expect("f32"));
        assert_eq!(
            got, want,
            "{name}: the checkpoint's values in the release layout"
        );
        let before = if start.contains(name) {
            let t = start.tensor(name).expect("tensor");
            t.to_f32_vec().expect("f32")
        } else {
            // The experts' matrices: the release's MXFP4 pair, decoded.
            start.read_mxfp4(name).expect("mxfp4").1
        };
        if before.len() == got.len() && max_err(&before, &got) > 0.0 {
            trained += 1;
        }
    }
    assert_eq!(trained, names.len(), "two steps moved every tensor");
    // The export is a gpt-oss checkpoint again: it loads and runs.
    let out = dir.join("logits.safetensors");
    let golden = golden("gpt_oss_mxfp4");
    ok(&[
        "logits",
        "--model",
        path(&hf),
        "--input",
        path(&golden),
        "--out",
        path(&out),
    ]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The values of HF tensor `name` of release directory `release` as the model sees them: a
/// stored tensor widened to f32, an MXFP4 pair decoded and transposed to the parameter
/// orientation (`[E, H, 2I]`, `[E, I, H]`) as transformers' `convert_moe_packed_tensors` does.
fn release_param(release: &HfCheckpoint, name: &str) -> (Vec<usize>, Vec<f32>) {
    if release.contains(name) {
        let t = release.tensor(name).expect("tensor");
        (t.shape.to_vec(), t.to_f32_vec().expect("f32"))
    } else {
        let (shape, values) = release.read_mxfp4(name).expect("mxfp4");
        let [e, rows, cols] = shape.as_slice().try_into().expect("[E, out, in]");
        let mut out = vec![0.0; values.len()];
        for x in 0..e {
            for r in 0..rows {
                for c in 0..cols {
                    out[(x * cols + c) * rows + r] = values[(x * rows + r) * cols + c];
                }
            }
        }
        (vec![e, cols, rows], out)
    }
}

/// `moe convert --from-hf` of both fixtures under `tp=2,ep=2,etp=2` (world 4), `moe reshard` to
/// `ep=4`, `moe export`: the canonical checkpoint holds the release's tensors in the stacked
/// layout (checked through the hand-written permutation above), and the export has exactly the
/// f32 fixture's names holding the source's values bit for bit (the MXFP4 release: its decoded
/// values, exact in BF16, the experts dequantised).
#[test]
fn hf_to_distributed_conversion_reshards_and_exports_back_bit_for_bit() {
    let dense: BTreeSet<String> = (HfCheckpoint::open(fixture("gpt_oss")).expect("f32 fixture"))
        .tensor_names()
        .map(str::to_owned)
        .collect();
    for name in ["gpt_oss", "gpt_oss_mxfp4"] {
        let dir = scratch(&format!("{name}-convert"));
        let src = fixture(name);
        let (a, b, hf) = (dir.join("a"), dir.join("b"), dir.join("hf"));
        let layout = "world=4,tp=2,ep=2,etp=2";
        ok(&[
            "convert",
            "--from-hf",
            path(&src),
            "--out",
            path(&a),
            "--layout",
            layout,
        ]);
        ok(&["validate", path(&a)]);
        ok(&["reshard", path(&a), "--out", path(&b), "--layout", "ep=4"]);
        ok(&["export", path(&b), "--out", path(&hf)]);

        let release = HfCheckpoint::open(&src).expect("source");
        let dist = DistCheckpoint::open::<ModelConfig>(&b).expect("resharded checkpoint");
        let back = HfCheckpoint::open(&hf).expect("the export opens");
        let names: BTreeSet<String> = back.tensor_names().map(str::to_owned).collect();
        assert_eq!(names, dense, "{name}: the release's dequantised names");
        let mut permuted = 0;
        for t in &names {
            let (shape, want) = release_param(&release, t);
            let stored = dist.read_tensor(t).expect("stored");
            let canonical = stored.to_f32_vec().expect("f32");
            let as_release = release_values(t, &stored.shape, &canonical);
            assert_eq!(as_release, want, "{name} {t}: the canonical tensor");
            permuted += usize::from(stored.shape != shape);
            let got = back.tensor(t).expect("exported");
            assert_eq!(got.shape, shape, "{name} {t}");
            let values = got.to_f32_vec().expect("f32");
            assert!(
                values
                    .iter()
                    .zip(&want)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name} {t}: values bit for bit"
            );
            if release.contains(t) {
                let orig = release.tensor(t).expect("tensor");
                assert_eq!(
                    (got.dtype, got.bytes),
                    (orig.dtype, orig.bytes),
                    "{name} {t}"
                );
            }
        }
        // gate_up_proj, its bias and down_proj of 4 layers change layout.
        assert_eq!(permuted, 12, "{name}: the release-layout tensors");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
