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
//!   the test from the canonical tensors; the export loads and runs again;
//! - `export --dtype mxfp4` (the release format): of the release converted to a distributed
//!   checkpoint, with the release as the reference, every tensor byte for byte the release's
//!   (without it, the same values: only the scales of blocks whose largest code is below 4
//!   differ, as the OCP rule picks them); of a trained checkpoint and of the f32 fixture
//!   (HF → HF), the experts' blocks decode to the OCP MX quantisation of the weights,
//!   computed here block by block in closed form, and the export runs.

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
    logits_run(&hf, "gpt_oss_mxfp4", &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `moe logits` of the exported directory `hf` on the input ids of golden `golden_name` runs
/// (the export is a gpt-oss checkpoint again: it loads and runs); output under `dir`.
fn logits_run(hf: &Path, golden_name: &str, dir: &Path) {
    let out = dir.join("logits.safetensors");
    let golden = golden(golden_name);
    let args = [
        "logits",
        "--model",
        path(hf),
        "--input",
        path(&golden),
        "--out",
    ];
    ok(&[&args[..], &[path(&out)]].concat());
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

/// The OCP MX (MXFP4) quantisation of one block of 32 values, in closed form: the shared scale
/// `2^(⌊log2 amax⌋ − 2)` (the exponent read off amax's f32 bits; byte 0 for an all-zero block),
/// each value the nearest E2M1 magnitude of `x / scale` (ties to the even code, saturating at 6)
/// with its sign. Returns the scale byte and the quantised values.
fn ocp_block(block: &[f32]) -> (u8, Vec<f32>) {
    const MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
    let exponent = if amax == 0.0 {
        -127
    } else {
        assert!(amax.is_normal(), "a test weight of {amax}");
        i32::try_from((amax.to_bits() >> 23) & 0xFF).expect("exponent") - 127 - 2
    };
    let exponent = exponent.clamp(-127, 127);
    let scale = 2f32.powi(exponent);
    let values = block
        .iter()
        .map(|&x| {
            let q = (x / scale).abs();
            let mut best = 0;
            for (c, &m) in MAGNITUDES.iter().enumerate() {
                let (d, db) = ((q - m).abs(), (q - MAGNITUDES[best]).abs());
                if d < db || (d == db && c % 2 == 0) {
                    best = c;
                }
            }
            let v = MAGNITUDES[best] * scale;
            if x.is_sign_negative() { -v } else { v }
        })
        .collect();
    (u8::try_from(exponent + 127).expect("scale byte"), values)
}

/// Checks MXFP4 pair `name` of `export` against the OCP quantisation ([`ocp_block`]) of
/// `param`, the weight in the release's parameter layout `[E, in, out]`: the scales byte for
/// byte and the decoded values bit for bit. Returns how many values differ from `param`.
fn check_ocp(export: &HfCheckpoint, name: &str, param: &[f32], shape: &[usize]) -> usize {
    let [e, k, out] = shape.try_into().expect("[E, in, out]");
    let (_, scales) = export.read_mxfp4_scales(name).expect("scales");
    let (stored, decoded) = export.read_mxfp4(name).expect("decodes");
    assert_eq!(stored, vec![e, out, k], "{name}: the stored [E, out, in]");
    let mut moved = 0;
    for x in 0..e {
        for r in 0..out {
            let row: Vec<f32> = (0..k).map(|c| param[(x * k + c) * out + r]).collect();
            for (g, block) in row.chunks_exact(32).enumerate() {
                let (scale, want) = ocp_block(block);
                let at = (x * out + r) * (k / 32) + g;
                assert_eq!(scales[at], scale, "{name}: block {at}'s scale");
                let got = &decoded[at * 32..(at + 1) * 32];
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name}: block {at}: {got:?} vs {want:?}"
                );
                moved += got.iter().zip(block).filter(|(a, b)| a != b).count();
            }
        }
    }
    moved
}

fn read_config(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config"))
        .expect("json")
}

/// `moe convert --from-hf` of the MXFP4 release, then `moe export --dtype mxfp4` of that
/// untrained checkpoint: with `--mxfp4-reference` the release itself, byte for byte (tensors,
/// dtypes, `quantization_config`); without it, the same decoded values, the scales those of the
/// OCP rule (they differ exactly in the blocks whose largest code is below 4, which hold the
/// same values at half the scale).
#[test]
fn the_converted_mxfp4_release_exports_mxfp4_byte_for_byte() {
    let dir = scratch("gpt-oss-mxfp4-repack");
    let release = fixture("gpt_oss_mxfp4");
    let (ckpt, hf, plain) = (dir.join("ckpt"), dir.join("hf"), dir.join("plain"));
    ok(&[
        "convert",
        "--from-hf",
        path(&release),
        "--out",
        path(&ckpt),
        "--layout",
        "world=2,ep=2",
    ]);
    ok(&[
        "export",
        path(&ckpt),
        "--out",
        path(&hf),
        "--dtype",
        "mxfp4",
        "--mxfp4-reference",
        path(&release),
    ]);
    let src = SafetensorsFile::open(release.join("model.safetensors")).expect("release");
    let dst = HfCheckpoint::open(&hf).expect("the export opens");
    let mut packed = 0;
    for name in src.names() {
        let want = src.tensor(name).expect("tensor");
        let got = dst.tensor(name).expect("exported");
        assert_eq!(
            (got.dtype, got.shape, got.bytes),
            (want.dtype, want.shape, want.bytes),
            "{name}: the release's tensor"
        );
        packed += usize::from(name.ends_with("_blocks") || name.ends_with("_scales"));
    }
    assert_eq!(packed, 16, "gate_up / down blocks and scales of 4 layers");
    assert_eq!(dst.tensor_names().count(), src.names().count());
    let (got, want) = (read_config(&hf), read_config(&release));
    assert_eq!(got["quantization_config"], want["quantization_config"]);
    assert_eq!(got["dtype"], "bfloat16");

    // Without the reference: the OCP rule's scales for the same values.
    ok(&[
        "export",
        path(&ckpt),
        "--out",
        path(&plain),
        "--dtype",
        "mxfp4",
    ]);
    let plain = HfCheckpoint::open(&plain).expect("the export opens");
    let start = HfCheckpoint::open(&release).expect("release");
    let (mut rescaled, mut below_four) = (0, 0);
    for name in start
        .tensor_names()
        .filter_map(|n| n.strip_suffix("_blocks"))
    {
        let (shape, values) = start.read_mxfp4_param(name).expect("release values");
        assert_eq!(
            check_ocp(&plain, name, &values, &shape),
            0,
            "{name}: lossless"
        );
        let (_, a) = start.read_mxfp4_scales(name).expect("scales");
        let (_, b) = plain.read_mxfp4_scales(name).expect("scales");
        let codes = start.tensor(&format!("{name}_blocks")).expect("blocks");
        for (g, block) in codes.bytes.chunks_exact(16).enumerate() {
            let top = block
                .iter()
                .flat_map(|b| [b & 7, (b >> 4) & 7])
                .max()
                .unwrap_or(0);
            let small = top > 0 && top < 6; // the largest magnitude below 4 (code 6)
            below_four += usize::from(small);
            rescaled += usize::from(a[g] != b[g]);
            assert_eq!(a[g] != b[g], small, "{name}: block {g}'s scale");
        }
    }
    assert!(
        rescaled > 0 && rescaled == below_four,
        "{rescaled} rescaled"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `moe train` two steps from the MXFP4 release, then `moe export --dtype mxfp4` (with the
/// release as the reference: trained blocks no longer fit it): the experts' blocks decode to
/// the OCP quantisation of the trained values (closed form, [`ocp_block`]), every other tensor
/// is the trained one in bf16, and the export loads and runs.
#[test]
fn a_trained_checkpoint_exports_mxfp4_as_the_ocp_quantisation_of_its_weights() {
    let dir = scratch("gpt-oss-train-mxfp4");
    let release = fixture("gpt_oss_mxfp4");
    let extra = ["--model", path(&release), "--gbs", "2"];
    threads(&train_args(&dir, "world=2,ep=2", 2, &extra));
    let (hf, ckpt) = (dir.join("hf"), dir.join("ckpt"));
    ok(&[
        "export",
        path(&ckpt),
        "--out",
        path(&hf),
        "--dtype",
        "mxfp4",
        "--mxfp4-reference",
        path(&release),
    ]);
    let exported = HfCheckpoint::open(&hf).expect("the export opens");
    let start = HfCheckpoint::open(&release).expect("release");
    let names: BTreeSet<&str> = exported.tensor_names().collect();
    let want: BTreeSet<&str> = start.tensor_names().collect();
    assert_eq!(names, want, "the release's tensor names");
    let dist = DistCheckpoint::open::<ModelConfig>(&ckpt).expect("checkpoint");
    let (mut packed, mut moved) = (0, 0);
    for name in start.tensor_names().filter(|n| !n.ends_with("_scales")) {
        let base = name.strip_suffix("_blocks");
        let stored = dist.read_tensor(base.unwrap_or(name)).expect("stored");
        let values = release_values(
            base.unwrap_or(name),
            &stored.shape,
            &stored.to_f32_vec().expect("f32"),
        );
        if let Some(base) = base {
            let shape = start.mxfp4_param_shape(base).expect("shape");
            moved += check_ocp(&exported, base, &values, &shape);
            packed += 1;
        } else {
            let t = exported.tensor(name).expect("tensor");
            assert_eq!(t.dtype, Dtype::BF16, "{name}");
            let bf16: Vec<f32> = values
                .iter()
                .map(|&v| burn::tensor::bf16::from_f32(v).to_f32())
                .collect();
            assert_eq!(
                t.to_f32_vec().expect("f32"),
                bf16,
                "{name}: the trained values"
            );
        }
    }
    assert_eq!(packed, 8, "gate_up / down of 4 layers");
    assert!(moved > 0, "the quantisation rounds the trained weights");
    assert_eq!(
        read_config(&hf)["quantization_config"],
        read_config(&release)["quantization_config"]
    );
    logits_run(&hf, "gpt_oss_mxfp4", &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// HF → HF: `moe export --model <f32 fixture> --dtype mxfp4` packs the dense experts (OCP
/// rule, closed form), writes the release's tensor names and `quantization_config`, and runs.
#[test]
fn the_dense_fixture_exports_mxfp4_experts() {
    let dir = scratch("gpt-oss-dense-mxfp4");
    let dense = fixture("gpt_oss");
    let hf = dir.join("hf");
    ok(&[
        "export",
        "--model",
        path(&dense),
        "--out",
        path(&hf),
        "--dtype",
        "mxfp4",
    ]);
    let exported = HfCheckpoint::open(&hf).expect("the export opens");
    let release = HfCheckpoint::open(fixture("gpt_oss_mxfp4")).expect("release");
    let names: BTreeSet<&str> = exported.tensor_names().collect();
    let want: BTreeSet<&str> = release.tensor_names().collect();
    assert_eq!(names, want, "the release's tensor names");
    let source = HfCheckpoint::open(&dense).expect("dense");
    let mut packed = 0;
    for name in names.iter().filter_map(|n| n.strip_suffix("_blocks")) {
        let t = source.tensor(name).expect("dense experts");
        check_ocp(&exported, name, &t.to_f32_vec().expect("f32"), t.shape);
        packed += 1;
    }
    assert_eq!(packed, 8);
    let config = read_config(&hf);
    assert_eq!(config["quantization_config"]["quant_method"], "mxfp4");
    logits_run(&hf, "gpt_oss", &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--dtype mxfp4` of a family whose release has no MXFP4 tensors is refused by name, before
/// anything is written.
#[test]
fn mxfp4_export_of_another_family_is_refused_by_name() {
    let dir = scratch("gpt-oss-mxfp4-refused");
    let out = dir.join("hf");
    let model = fixture("qwen3_moe");
    let run = Command::new(common::MOE)
        .args([
            "export",
            "--model",
            path(&model),
            "--out",
            path(&out),
            "--dtype",
            "mxfp4",
        ])
        .output()
        .expect("moe");
    let text = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{text}");
    assert!(text.contains("`qwen3_moe` has no MXFP4 tensors"), "{text}");
    assert!(!out.exists(), "nothing written");
    let _ = std::fs::remove_dir_all(&dir);
}
