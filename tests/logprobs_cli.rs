//! `moe logprobs` end to end on the committed fixtures: every layout (tensor, expert, data,
//! pipeline — 1F1B and interleaved, in micro-batches — and context parallelism) writes the
//! single-rank (`--layout ""`) log-probs and entropies, for Qwen3-MoE and dense Qwen3; bad
//! inputs or layouts are clear errors; the DeepSeek-V3 fixtures (BF16 and FP8) agree across
//! layouts and with the transformers goldens.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn_moe::bridge::safetensors::{Dtype, OwnedTensor, SafetensorsFile, write_safetensors};
use moe_backend::testing::XorShift64;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3_moe");

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!(
            "burn-moe-logprobs-{tag}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Runs `moe logprobs` on `input` with `layout`, writing `out`.
fn logprobs(input: &Path, out: &Path, layout: &str) -> Output {
    logprobs_of(FIXTURE, input, out, layout)
}

/// Runs `moe logprobs --model model` on `input` with `layout`, writing `out`.
fn logprobs_of(model: &str, input: &Path, out: &Path, layout: &str) -> Output {
    logprobs_with(model, input, out, layout, &[])
}

/// [`logprobs_of`] with `extra` arguments.
fn logprobs_with(model: &str, input: &Path, out: &Path, layout: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moe"))
        .args(["logprobs", "--model", model, "--input", path(input)])
        .args(["--out", path(out), "--layout", layout])
        .args(extra)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the moe binary")
}

fn ok_of(model: &str, input: &Path, out: &Path, layout: &str) {
    let o = logprobs_of(model, input, out, layout);
    assert!(
        o.status.success(),
        "layout {layout:?} failed ({}):\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Asserts a failure without a panic and returns stderr.
fn fails(input: &Path, layout: &str) -> String {
    let o = logprobs(input, &input.with_extension("out"), layout);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(
        o.status.code(),
        Some(1),
        "layout {layout:?} should fail: {err}"
    );
    assert!(!err.contains("panicked"), "panicked:\n{err}");
    assert!(err.starts_with("error: "), "{err}");
    err
}

fn write_ids(file: &Path, dtype: Dtype, shape: Vec<usize>, ids: &[i64]) {
    let bytes: Vec<u8> = match dtype {
        Dtype::I64 => ids.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::I32 => ids.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
        Dtype::F32 => ids.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        other => panic!("{other:?}"),
    };
    let t = OwnedTensor::new("input_ids", dtype, shape, bytes).expect("tensor");
    write_safetensors(file, &[t.view()]).expect("write");
}

fn read_f32(file: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let f = SafetensorsFile::open(file).expect("open");
    let t = f.tensor(name).expect("tensor");
    assert_eq!(t.dtype, Dtype::F32, "{name}");
    (t.shape.to_vec(), t.to_f32_vec().expect("f32"))
}

/// `[4, 12]` deterministic ids below 256 (the fixtures' vocabulary).
fn ids() -> Vec<i64> {
    XorShift64::new(0x1234_5678_9abc_def1).ids(48, 256)
}

/// Every layout, pipeline (1F1B and interleaved, in micro-batches) and context parallelism
/// included, writes the single-rank log-probs and entropies; dense Qwen3 too.
#[test]
fn every_layout_writes_the_single_rank_logprobs() {
    let tmp = TempDir::new("equal");
    let input = tmp.join("ids.safetensors");
    // I32 ids are accepted like I64 ones; 12 positions split over 2·cp = 4 chunks.
    write_ids(&input, Dtype::I32, vec![4, 12], &ids());
    let qwen3 = fixture("qwen3");
    let cases: [(&str, &str, &[&str]); 7] = [
        (FIXTURE, "tp=2,ep=4", &[]),
        (
            FIXTURE,
            "pp=2,pp_layout=Et|t*2L",
            &["--micro-batch-size", "1"],
        ),
        (
            FIXTURE,
            "pp=2,vpp=2,pp_layout=E|t|t|tL",
            &["--micro-batch-size", "2"],
        ),
        (
            FIXTURE,
            "pp=2,cp=2,ep=2,pp_layout=Et*2|tL",
            &["--micro-batch-size", "2"],
        ),
        (
            FIXTURE,
            "world=8,tp=2,cp=2,pp=2,ep=4,pp_layout=Et|t*2L",
            &[],
        ),
        (&qwen3, "pp=2,cp=2", &["--micro-batch-size", "2"]),
        (&qwen3, "tp=2", &[]),
    ];
    for (i, (model, layout, extra)) in cases.into_iter().enumerate() {
        let (one, sharded) = (
            tmp.join(&format!("one-{i}.safetensors")),
            tmp.join(&format!("sharded-{i}.safetensors")),
        );
        ok_of(model, &input, &one, "");
        let o = logprobs_with(model, &input, &sharded, layout, extra);
        assert!(
            o.status.success(),
            "layout {layout:?} failed ({}):\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        for name in ["logprobs", "entropy"] {
            let (shape, want) = read_f32(&one, name);
            assert_eq!(shape, vec![4, 11], "{name}");
            let (shape, got) = read_f32(&sharded, name);
            assert_eq!(shape, vec![4, 11], "{name}");
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = max_err(&got, &want);
            println!("{layout} {name}: max err {err:.3e}, max|value| {scale:.4}");
            assert!(
                err <= 1e-5 * scale,
                "{layout} {name}: max error {err} > 1e-5 · {scale}"
            );
            assert!(want.iter().all(|v| v.is_finite()), "{name}");
        }
        let (_, lp) = read_f32(&one, "logprobs");
        assert!(lp.iter().all(|&v| v < 0.0), "log-probs are negative");
    }
}

#[test]
fn bad_inputs_and_layouts_are_clear_errors() {
    let tmp = TempDir::new("errors");
    let ids = ids();
    // 3 sequences cannot split over the 2 replicas of tp=2,ep=4 (world 4).
    let odd = tmp.join("odd.safetensors");
    write_ids(&odd, Dtype::I64, vec![3, 12], &ids[..36]);
    let err = fails(&odd, "tp=2,ep=4");
    assert!(
        err.contains("3 sequences") && err.contains("2 data-parallel"),
        "{err}"
    );
    // One token per sequence: nothing to score.
    let short = tmp.join("short.safetensors");
    write_ids(&short, Dtype::I64, vec![4, 1], &ids[..4]);
    let err = fails(&short, "");
    assert!(err.contains("at least 2 tokens"), "{err}");
    // Float ids, 1-D ids, ids outside the vocabulary.
    let float = tmp.join("float.safetensors");
    write_ids(&float, Dtype::F32, vec![4, 12], &ids);
    assert!(fails(&float, "").contains("I64 or I32"));
    let flat = tmp.join("flat.safetensors");
    write_ids(&flat, Dtype::I64, vec![48], &ids);
    assert!(fails(&flat, "").contains("expected [batch, seq]"));
    let oov = tmp.join("oov.safetensors");
    let mut bad = ids.clone();
    bad[15] = 256;
    write_ids(&oov, Dtype::I64, vec![4, 12], &bad);
    let err = fails(&oov, "tp=2,ep=4");
    assert!(
        err.contains("row 1 column 3 holds 256") && err.contains("0..256"),
        "{err}"
    );
    // One sequence cannot make the interleaved schedule's multiple of pp micro-batches.
    let one = tmp.join("one-row.safetensors");
    write_ids(&one, Dtype::I64, vec![1, 12], &ids[..12]);
    let err = fails(&one, "pp=2,vpp=2,pp_layout=E|t|t|tL");
    assert!(
        err.contains("interleaved pipeline schedule") && err.contains("pp = 2"),
        "{err}"
    );
    // Rows that do not cut into 2·cp chunks under context parallelism.
    let odd = tmp.join("odd-len.safetensors");
    write_ids(&odd, Dtype::I64, vec![4, 10], &ids[..40]);
    let err = fails(&odd, "cp=2");
    assert!(err.contains("2·cp = 4") && err.contains("10"), "{err}");
    // A layout the model cannot be sharded under (4 query / 2 KV heads over tp=4).
    let input = tmp.join("ids.safetensors");
    write_ids(&input, Dtype::I64, vec![4, 12], &ids);
    let err = fails(&input, "tp=4");
    assert!(err.contains("heads") && err.contains("tp = 4"), "{err}");
}

/// A committed fixture directory.
fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `max |a − b|`.
fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// DeepSeek-V3 (and its FP8 release, dequantised on load): the single-rank run and the
/// `tp=2,ep=4`, `pp=2,cp=2,ep=2` and `pp=2,vpp=2` runs agree within 1e-5 of max|value|, and all
/// equal `log_softmax` of the
/// transformers golden logits (the FP8 release against the golden of its reference
/// dequantisation) within 1e-4 of max|logit|.
#[test]
fn deepseek_v3_logprobs_equal_the_transformers_goldens_under_any_layout() {
    let tmp = TempDir::new("deepseek");
    for (model, golden) in [
        ("deepseek_v3", "deepseek_v3"),
        ("deepseek_v3_fp8", "deepseek_v3_fp8_dequant"),
    ] {
        let file =
            SafetensorsFile::open(Path::new(&fixture(&format!("{golden}.golden.safetensors"))))
                .expect("golden");
        let ids = file.tensor("input_ids").expect("input_ids");
        let shape = ids.shape.to_vec();
        let ids: Vec<i64> = ids
            .to_tensor_data()
            .expect("ids")
            .convert::<i64>()
            .try_into_vec::<i64>()
            .expect("i64");
        let logits_view = file.tensor("logits").expect("logits");
        let v = logits_view.shape[2];
        let logits = logits_view.to_f32_vec().expect("logits");
        let (b, s) = (shape[0], shape[1]);
        let input = tmp.join(&format!("{model}-ids.safetensors"));
        write_ids(&input, Dtype::I64, shape, &ids);
        let (mut want_lp, mut want_h) = (Vec::new(), Vec::new());
        for row in 0..b {
            for t in 0..s - 1 {
                let l = &logits[(row * s + t) * v..(row * s + t + 1) * v];
                let max = l.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
                let lse = max
                    + l.iter()
                        .map(|&x| (f64::from(x) - max).exp())
                        .sum::<f64>()
                        .ln();
                let target = ids[row * s + t + 1] as usize;
                want_lp.push((f64::from(l[target]) - lse) as f32);
                want_h.push(
                    -l.iter()
                        .map(|&x| (f64::from(x) - lse).exp() * (f64::from(x) - lse))
                        .sum::<f64>() as f32,
                );
            }
        }
        let scale = logits.iter().fold(0f32, |m, x| m.max(x.abs()));
        let dir = fixture(model);
        let one = tmp.join(&format!("{model}-one.safetensors"));
        ok_of(&dir, &input, &one, "");
        // The MTP module (DeepSeek-V3's fixture has one, the FP8 one none) sits on the last stage.
        let m = if model == "deepseek_v3" { "m" } else { "" };
        let layouts = [
            "tp=2,ep=4".to_owned(),
            format!("pp=2,cp=2,ep=2,pp_layout=Et*2|t{m}L"),
            format!("pp=2,vpp=2,pp_layout=E|t|t|t{m}L"),
        ];
        for (i, layout) in layouts.iter().enumerate() {
            let sharded = tmp.join(&format!("{model}-{i}.safetensors"));
            ok_of(&dir, &input, &sharded, layout);
            for (name, want) in [("logprobs", &want_lp), ("entropy", &want_h)] {
                let (shape1, one) = read_f32(&one, name);
                let (shape2, got) = read_f32(&sharded, name);
                assert_eq!((shape1, shape2), (vec![b, s - 1], vec![b, s - 1]), "{name}");
                let value_scale = one.iter().fold(0f32, |m, v| m.max(v.abs()));
                let layouts = max_err(&got, &one);
                let (e_one, e_sharded) = (max_err(&one, want), max_err(&got, want));
                println!(
                    "{model} {name}: {layout} vs world=1 {layouts:.3e} (max|value| \
                     {value_scale:.4}); vs golden: world=1 {e_one:.3e}, {layout} \
                     {e_sharded:.3e} (max|logit| {scale:.4})"
                );
                assert!(
                    layouts <= 1e-5 * value_scale,
                    "{model} {name}: {layout} differs by {layouts}"
                );
                assert!(
                    e_one <= 1e-4 * scale && e_sharded <= 1e-4 * scale,
                    "{model} {name}: golden error {e_one} / {e_sharded} > 1e-4 · {scale}"
                );
            }
        }
    }
}
