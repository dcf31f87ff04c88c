//! `moe logprobs` end to end on the committed qwen3_moe fixture: the vocab-parallel run under
//! `tp=2,ep=4` (4 in-process ranks, 2 replicas) writes the single-rank (`--layout ""`)
//! log-probs and entropies, and bad inputs or layouts are clear errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn_moe::bridge::safetensors::{Dtype, OwnedTensor, SafetensorsFile, write_safetensors};

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
    Command::new(env!("CARGO_BIN_EXE_moe"))
        .args(["logprobs", "--model", FIXTURE, "--input", path(input)])
        .args(["--out", path(out), "--layout", layout])
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the moe binary")
}

fn ok(input: &Path, out: &Path, layout: &str) {
    let o = logprobs(input, out, layout);
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

/// `[4, 10]` deterministic ids below 256 (the fixture's vocabulary).
fn ids() -> Vec<i64> {
    let mut x = 0x1234_5678_9abc_def1_u64;
    (0..40)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 256) as i64
        })
        .collect()
}

#[test]
fn tensor_and_expert_parallel_logprobs_equal_the_single_rank_ones() {
    let tmp = TempDir::new("equal");
    let input = tmp.join("ids.safetensors");
    // I32 ids are accepted like I64 ones.
    write_ids(&input, Dtype::I32, vec![4, 10], &ids());
    let (one, sharded) = (tmp.join("one.safetensors"), tmp.join("tp2ep4.safetensors"));
    ok(&input, &one, "");
    ok(&input, &sharded, "tp=2,ep=4");
    for name in ["logprobs", "entropy"] {
        let (shape, want) = read_f32(&one, name);
        assert_eq!(shape, vec![4, 9], "{name}");
        let (shape, got) = read_f32(&sharded, name);
        assert_eq!(shape, vec![4, 9], "{name}");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("{name}: max err {err:.3e}, max|value| {scale:.4}");
        assert!(
            err <= 1e-5 * scale,
            "{name}: max error {err} > 1e-5 · {scale}"
        );
        assert!(want.iter().all(|v| v.is_finite()), "{name}");
    }
    let (_, lp) = read_f32(&one, "logprobs");
    assert!(lp.iter().all(|&v| v < 0.0), "log-probs are negative");
}

#[test]
fn bad_inputs_and_layouts_are_clear_errors() {
    let tmp = TempDir::new("errors");
    let ids = ids();
    // 3 sequences cannot split over the 2 replicas of tp=2,ep=4 (world 4).
    let odd = tmp.join("odd.safetensors");
    write_ids(&odd, Dtype::I64, vec![3, 10], &ids[..30]);
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
    write_ids(&float, Dtype::F32, vec![4, 10], &ids);
    assert!(fails(&float, "").contains("I64 or I32"));
    let flat = tmp.join("flat.safetensors");
    write_ids(&flat, Dtype::I64, vec![40], &ids);
    assert!(fails(&flat, "").contains("expected [batch, seq]"));
    let oov = tmp.join("oov.safetensors");
    let mut bad = ids.clone();
    bad[13] = 256;
    write_ids(&oov, Dtype::I64, vec![4, 10], &bad);
    let err = fails(&oov, "tp=2,ep=4");
    assert!(
        err.contains("row 1 column 3 holds 256") && err.contains("0..256"),
        "{err}"
    );
    // A layout the model cannot be sharded under (4 query / 2 KV heads over tp=4).
    let input = tmp.join("ids.safetensors");
    write_ids(&input, Dtype::I64, vec![4, 10], &ids);
    let err = fails(&input, "tp=4");
    assert!(err.contains("heads") && err.contains("tp = 4"), "{err}");
}
