//! The `moe` binary end to end on the committed fixtures: `inspect`, `logits` (against the
//! transformers goldens), `generate` (greedy continuation of the golden prompt), `export`, and
//! clear non-zero exits for an unknown `model_type`, a truncated shard and a missing shard.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn_moe::bridge::fp8::is_scale_inv;
use burn_moe::bridge::hf::HfCheckpoint;
use burn_moe::bridge::safetensors::{Dtype, OwnedTensor, SafetensorsFile, write_safetensors};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir =
            std::env::temp_dir().join(format!("burn-moe-cli-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// A copy of fixture `name` inside this directory.
    fn copy_fixture(&self, name: &str) -> PathBuf {
        let dir = self.join(name);
        std::fs::create_dir_all(&dir).expect("mkdir");
        for entry in std::fs::read_dir(fixtures().join(name)).expect("fixture") {
            let entry = entry.expect("entry");
            std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
        }
        dir
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `moe args…` with logs limited to warnings.
fn moe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moe"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the moe binary")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts success and returns stdout.
fn ok(args: &[&str]) -> String {
    let out = moe(args);
    assert!(
        out.status.success(),
        "moe {args:?} failed ({}):\n{}",
        out.status,
        stderr(&out)
    );
    stdout(&out)
}

/// Asserts a non-zero exit without a panic and returns stderr.
fn fails(args: &[&str]) -> String {
    let out = moe(args);
    let err = stderr(&out);
    assert!(
        !out.status.success(),
        "moe {args:?} should fail:\n{}",
        stdout(&out)
    );
    // 1 for a failed command, 2 for arguments clap rejects.
    assert!(
        matches!(out.status.code(), Some(1 | 2)),
        "moe {args:?}: {err}"
    );
    assert!(!err.contains("panicked"), "moe {args:?} panicked:\n{err}");
    assert!(
        err.starts_with("error: ") || err.contains("\nerror: "),
        "{err}"
    );
    err
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
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
    t.to_tensor_data()
        .expect("data")
        .try_into_vec::<i64>()
        .expect("i64")
}

fn golden(name: &str) -> PathBuf {
    fixtures().join(format!("{name}.golden.safetensors"))
}

#[test]
fn help_lists_every_command() {
    let text = ok(&["--help"]);
    for command in ["inspect", "logits", "generate", "export"] {
        assert!(text.contains(command), "{text}");
    }
    assert!(ok(&["logits", "--help"]).contains("--labels"));
}

#[test]
fn inspect_reports_architecture_counts_shards_and_fp8() {
    let text = ok(&["inspect", path(&fixtures().join("deepseek_v3_sharded"))]);
    assert!(text.contains("DeepseekV3ForCausalLM"), "{text}");
    assert!(
        text.contains("parameters:") && text.contains("active"),
        "{text}"
    );
    assert!(
        text.contains("sharded") && text.contains("13 file(s)"),
        "{text}"
    );
    assert!(
        text.contains("F32") && text.contains("FP8:          no"),
        "{text}"
    );
    let text = ok(&["inspect", path(&fixtures().join("deepseek_v3_fp8"))]);
    assert!(
        text.contains("FP8:          yes") && text.contains("block 16x16"),
        "{text}"
    );
    assert!(text.contains("F8_E4M3") && text.contains("BF16"), "{text}");
    let text = ok(&[
        "inspect",
        path(&fixtures().join("qwen3").join("config.json")),
    ]);
    assert!(
        text.contains("Qwen3ForCausalLM") && text.contains("dense"),
        "{text}"
    );
}

/// `moe logits` on `dir` with the golden's own `input_ids`, checked against it.
fn check_logits(dir: &str, golden_name: &str, labels: bool) {
    let tmp = TempDir::new(dir);
    let out = tmp.join("out.safetensors");
    let golden = golden(golden_name);
    let model = fixtures().join(dir);
    let mut args = vec![
        "logits",
        "--model",
        path(&model),
        "--input",
        path(&golden),
        "--out",
        path(&out),
    ];
    if labels {
        args.push("--labels");
    }
    ok(&args);
    let (shape, ours) = read_f32(&out, "logits");
    let (want_shape, want) = read_f32(&golden, "logits");
    assert_eq!(shape, want_shape);
    let err = ours
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let scale = want.iter().map(|b| b.abs()).fold(0.0f32, f32::max);
    assert!(err <= 1e-4 * scale, "{dir}: logits err {err} (max {scale})");
    if labels {
        for key in ["loss", "aux_loss"] {
            let (shape, ours) = read_f32(&out, key);
            assert_eq!(shape, vec![1], "{key}");
            let golden_file = SafetensorsFile::open(&golden).expect("golden");
            if golden_file.contains(key) {
                let (_, want) = read_f32(&golden, key);
                let rel = (ours[0] - want[0]).abs() / want[0].abs();
                assert!(rel <= 1e-5, "{dir} {key}: {} vs {}", ours[0], want[0]);
            } else if key == "aux_loss" {
                assert_eq!(
                    ours[0], 0.0,
                    "{dir}: a model without a router aux loss reports 0"
                );
            } else {
                let ids = read_i64(&golden, "input_ids");
                let want = cross_entropy(&want, &ids, want_shape[1], want_shape[2]);
                let rel = (f64::from(ours[0]) - want).abs() / want;
                assert!(
                    rel <= 1e-5,
                    "{dir} {key}: {} vs CE of the golden {want}",
                    ours[0]
                );
            }
        }
    }
}

/// HF's causal-LM loss of `logits [B, S, V]` with labels = `ids [B, S]` (shifted by one).
fn cross_entropy(logits: &[f32], ids: &[i64], seq: usize, vocab: usize) -> f64 {
    let (mut total, mut count) = (0.0f64, 0usize);
    for (r, row) in logits.chunks(vocab).enumerate() {
        if r % seq == seq - 1 {
            continue;
        }
        let max = row.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
        let lse = max
            + row
                .iter()
                .map(|&x| (f64::from(x) - max).exp())
                .sum::<f64>()
                .ln();
        total += lse - f64::from(row[ids[r + 1] as usize]);
        count += 1;
    }
    total / count as f64
}

#[test]
fn logits_match_the_goldens() {
    check_logits("qwen3_moe", "qwen3_moe", true);
    check_logits("qwen3", "qwen3", true);
    check_logits("qwen3_moe_bf16", "qwen3_moe_bf16", true);
    check_logits("deepseek_v3", "deepseek_v3", true);
    check_logits("deepseek_v3_sharded", "deepseek_v3", false);
    check_logits("deepseek_v3_fp8", "deepseek_v3_fp8_dequant", false);
}

#[test]
fn logits_reads_a_hand_written_input_and_bf16_weights_stay_close() {
    let tmp = TempDir::new("input");
    let input = tmp.join("ids.safetensors");
    let ids: Vec<i64> = vec![1, 5, 9, 200, 3, 3];
    let bytes: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
    let t = OwnedTensor::new("input_ids", Dtype::I64, vec![2, 3], bytes).expect("tensor");
    write_safetensors(&input, &[t.view()]).expect("write");
    let model = fixtures().join("qwen3_moe");
    let (f32_out, bf16_out) = (tmp.join("f32.safetensors"), tmp.join("bf16.safetensors"));
    for (out, dtype) in [(&f32_out, "f32"), (&bf16_out, "bf16")] {
        ok(&[
            "logits",
            "--model",
            path(&model),
            "--input",
            path(&input),
            "--out",
            path(out),
            "--dtype",
            dtype,
        ]);
    }
    let (shape, a) = read_f32(&f32_out, "logits");
    assert_eq!(shape, vec![2, 3, 256]);
    let (_, b) = read_f32(&bf16_out, "logits");
    let scale = a.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
    let err = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        err > 0.0 && err <= 5e-2 * scale,
        "bf16 weights: err {err}, max {scale}"
    );

    // Out-of-vocabulary ids are a clear error.
    let bad = tmp.join("bad.safetensors");
    let bytes: Vec<u8> = [1i64, 256].iter().flat_map(|x| x.to_le_bytes()).collect();
    let t = OwnedTensor::new("input_ids", Dtype::I64, vec![1, 2], bytes).expect("tensor");
    write_safetensors(&bad, &[t.view()]).expect("write");
    let err = fails(&[
        "logits",
        "--model",
        path(&model),
        "--input",
        path(&bad),
        "--out",
        path(&tmp.join("x.safetensors")),
    ]);
    assert!(err.contains("256") && err.contains("input_ids"), "{err}");
}

#[test]
fn generate_reproduces_the_greedy_continuation_and_seeded_sampling() {
    for name in ["qwen3_moe", "deepseek_v3"] {
        let golden = golden(name);
        let prompt = read_i64(&golden, "prompt_ids");
        let want = read_i64(&golden, "greedy_ids");
        let prompt_arg: Vec<String> = prompt.iter().map(i64::to_string).collect();
        let n = (want.len() - prompt.len()).to_string();
        let text = ok(&[
            "generate",
            "--model",
            path(&fixtures().join(name)),
            "--prompt-ids",
            &prompt_arg.join(","),
            "--max-new-tokens",
            &n,
        ]);
        let want: Vec<String> = want[prompt.len()..].iter().map(i64::to_string).collect();
        assert_eq!(text.trim(), want.join(","), "{name}");
    }
    let model = fixtures().join("qwen3");
    let sample = |seed: &str| {
        ok(&[
            "generate",
            "--model",
            path(&model),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "6",
            "--temperature",
            "1.5",
            "--seed",
            seed,
        ])
    };
    let (a, b) = (sample("7"), sample("7"));
    assert_eq!(a, b, "same seed, same tokens");
    assert_eq!(a.trim().split(',').count(), 6, "{a}");
    let err = fails(&[
        "generate",
        "--model",
        path(&model),
        "--prompt-ids",
        "1",
        "--temperature",
        "0",
    ]);
    assert!(
        err.contains("temperature") && err.contains("positive"),
        "{err}"
    );
}

#[test]
fn export_writes_a_loadable_checkpoint() {
    let tmp = TempDir::new("export");
    let out = tmp.join("bf16");
    let text = ok(&[
        "export",
        "--model",
        path(&fixtures().join("deepseek_v3_fp8")),
        "--out",
        path(&out),
        "--dtype",
        "bf16",
        "--max-shard-size",
        "100KB",
    ]);
    assert!(text.contains("wrote"), "{text}");
    let exported = HfCheckpoint::open(&out).expect("reload");
    assert!(exported.is_sharded());
    assert!(!exported.tensor_names().any(is_scale_inv));
    let inspect = ok(&["inspect", path(&out)]);
    assert!(inspect.contains("FP8:          no"), "{inspect}");
    // Logits of the export equal those of the reference dequantisation.
    let logits = tmp.join("logits.safetensors");
    let golden = golden("deepseek_v3_fp8_dequant");
    ok(&[
        "logits",
        "--model",
        path(&out),
        "--input",
        path(&golden),
        "--out",
        path(&logits),
    ]);
    let (_, ours) = read_f32(&logits, "logits");
    let (_, want) = read_f32(&golden, "logits");
    let scale = want.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
    let err = ours
        .iter()
        .zip(&want)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(err <= 1e-4 * scale, "{err}");
    // A second export to the same place needs --overwrite.
    let qwen3 = fixtures().join("qwen3");
    let args = ["export", "--model", path(&qwen3), "--out", path(&out)];
    let err = fails(&args);
    assert!(err.contains("already exists"), "{err}");
    let mut args = args.to_vec();
    args.push("--overwrite");
    ok(&args);
}

#[test]
fn bad_checkpoints_fail_with_a_clear_error() {
    let tmp = TempDir::new("bad");
    let input = golden("deepseek_v3");
    let logits = |model: &Path| {
        fails(&[
            "logits",
            "--model",
            path(model),
            "--input",
            path(&input),
            "--out",
            path(&tmp.join("out.safetensors")),
        ])
    };

    let unknown = tmp.copy_fixture("qwen3");
    let config = unknown.join("config.json");
    let text = std::fs::read_to_string(&config).expect("config");
    let edited = text.replace("\"model_type\": \"qwen3\"", "\"model_type\": \"llama\"");
    assert_ne!(text, edited);
    std::fs::write(&config, edited).expect("write");
    let err = logits(&unknown);
    assert!(err.contains("unknown model_type \"llama\""), "{err}");
    let err = fails(&["inspect", path(&unknown)]);
    assert!(err.contains("unknown model_type"), "{err}");

    let truncated = tmp.copy_fixture("deepseek_v3_sharded");
    let shard = truncated.join("model-00005-of-00013.safetensors");
    let bytes = std::fs::read(&shard).expect("shard");
    std::fs::write(&shard, &bytes[..bytes.len() - 1000]).expect("truncate");
    let err = logits(&truncated);
    assert!(err.contains("model-00005-of-00013.safetensors"), "{err}");

    let missing = tmp.copy_fixture("deepseek_v3_sharded");
    std::fs::remove_file(missing.join("model-00007-of-00013.safetensors")).expect("rm");
    let err = logits(&missing);
    assert!(
        err.contains("model-00007-of-00013.safetensors") && err.contains("does not exist"),
        "{err}"
    );
    let err = fails(&["inspect", path(&missing)]);
    assert!(err.contains("model-00007-of-00013.safetensors"), "{err}");
}
