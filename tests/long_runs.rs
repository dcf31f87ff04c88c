//! `moe train` for runs that last days: the non-finite guard (a diverging run stops naming the
//! step and keeps the last finite checkpoint; `moe validate` and `--resume` refuse a checkpoint
//! holding a NaN; `--skip-nonfinite-steps`), clean early exits (SIGTERM, `--exit-interval`,
//! `--exit-duration-in-mins`) under threads (TCP and MPI processes: `tests/processes.rs`),
//! retention (`--keep-last`, with a kill -9 in the middle of a removal) and evaluation
//! (`--eval-data`: equal under every layout, no effect on training).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn_moe::bridge::dist::DistCheckpoint;
use burn_moe::bridge::safetensors::{Dtype, TensorView, write_safetensors};
use burn_moe::models::hf::ModelConfig;
use common::*;

const DEEPSEEK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/deepseek_v3");

/// The `iter_*` directory `latest` names under `root`.
fn latest(root: &Path) -> PathBuf {
    let name = std::fs::read_to_string(root.join("latest")).expect("latest");
    root.join(name.trim())
}

#[test]
fn a_diverging_run_stops_naming_the_step_and_keeps_the_last_finite_checkpoint() {
    let dir = scratch("diverge");
    let root = dir.join("ckpt");
    let args = train_args(
        &dir,
        "tp=2,ep=4",
        20,
        &["--lr", "1e8", "--clip-grad", "0", "--save-every", "1"],
    );
    let out = moe_threads(&args);
    let all = output_text(&out);
    assert!(!out.status.success(), "a diverging run fails:\n{all}");
    assert!(!all.contains("panicked"), "{all}");
    let m = metrics(&dir);
    let failed = m.len() + 1;
    assert!(failed < 20, "stopped early: {all}");
    for needle in [
        format!("step {failed}:"),
        "non-finite".into(),
        "rank".into(),
        "Nothing of this step was applied or saved".into(),
    ] {
        assert!(all.contains(&needle), "names `{needle}`:\n{all}");
    }
    assert!(
        m.iter().all(|s| field(s, "loss").is_finite()),
        "no NaN was logged as a step"
    );
    // `latest` is the last finite step, and it validates (values included).
    assert!(latest(&root).ends_with(format!("iter_{:07}", failed - 1)));
    let status = Command::new(MOE)
        .args(["validate", &root.display().to_string()])
        .output()
        .expect("validate");
    assert!(status.status.success(), "{}", output_text(&status));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn skip_nonfinite_steps_skips_counts_and_then_fails() {
    let dir = scratch("skip");
    let args = train_args(
        &dir,
        "ep=2",
        20,
        &[
            "--lr",
            "1e8",
            "--clip-grad",
            "0",
            "--skip-nonfinite-steps",
            "2",
        ],
    );
    let out = moe_threads(&args);
    let all = output_text(&out);
    assert!(!out.status.success(), "{all}");
    let m = metrics(&dir);
    // Step 1 diverges the weights; steps 2 and 3 are skipped; step 4 exceeds the budget.
    let skipped: Vec<f64> = m.iter().map(|s| field(s, "skipped_steps")).collect();
    assert_eq!(skipped, [0.0, 1.0, 2.0], "{m:?}");
    assert!(all.contains("step 4:"), "{all}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Writes NaN over the first two elements of the first F32 parameter of a chunk file of
/// `iter`; returns its name.
fn poison(iter: &Path) -> String {
    for entry in std::fs::read_dir(iter).expect("dir").flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let mut bytes = std::fs::read(&path).expect("read");
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8")) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("json");
        let found = header
            .as_object()
            .expect("object")
            .iter()
            .find(|(name, t)| {
                name.starts_with("model.")
                    && t["dtype"] == "F32"
                    && t["shape"][0].as_u64() > Some(1)
            });
        if let Some((name, t)) = found {
            let at = 8 + n + t["data_offsets"][0].as_u64().expect("offset") as usize;
            for k in 0..2 {
                bytes[at + 4 * k..at + 4 * k + 4].copy_from_slice(&f32::NAN.to_le_bytes());
            }
            std::fs::write(&path, bytes).expect("write");
            return name.clone();
        }
    }
    panic!("no F32 parameter in {}", iter.display());
}

#[test]
fn validate_and_resume_refuse_a_checkpoint_holding_a_nan() {
    let dir = scratch("nan-ckpt");
    let root = dir.join("ckpt");
    moe_threads(&train_args(&dir, "ep=2", 2, &[]));
    let tensor = poison(&latest(&root));
    let out = Command::new(MOE)
        .args(["validate", &root.display().to_string()])
        .output()
        .expect("validate");
    let all = output_text(&out);
    assert!(!out.status.success(), "a NaN checkpoint is invalid:\n{all}");
    for needle in [tensor.as_str(), "2 non-finite value(s)"] {
        assert!(all.contains(needle), "names `{needle}`:\n{all}");
    }
    let mut resume = train_args(&dir, "ep=2", 3, &[]);
    resume.push("--resume".into());
    let out = moe_threads(&resume);
    let all = output_text(&out);
    assert!(!out.status.success(), "resuming from it is refused:\n{all}");
    assert!(all.contains(&tensor) && all.contains("non-finite"), "{all}");
    assert!(!all.contains("panicked"), "{all}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn sigterm_under_threads_saves_exits_zero_and_resumes_to_the_same_run() {
    let steps = 12;
    let dir = scratch("sigterm-threads");
    let args = train_args(&dir, "tp=2,ep=4", steps, &[]);
    let child = Command::new(MOE)
        .args(&args)
        .args(["--transport", "threads"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("moe");
    let start = Instant::now();
    while std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |m| m.lines().count()) < 2 {
        assert!(start.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(5));
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let out = child.wait_with_output().expect("wait");
    let all = output_text(&out);
    assert!(out.status.success(), "exit 0 after SIGTERM:\n{all}");
    assert!(
        all.contains("stopped after step") && all.contains("an exit signal reached"),
        "the message names the signal stop:\n{all}"
    );
    let reached = metrics(&dir).len();
    assert!(reached < steps, "stopped early ({reached})");
    let ckpt = DistCheckpoint::open::<ModelConfig>(dir.join("ckpt")).expect("checkpoint");
    assert_eq!(ckpt.index().step as usize, reached);
    let mut resume = args.clone();
    resume.push("--resume".into());
    threads(&resume);
    let straight = scratch("sigterm-threads-straight");
    threads(&train_args(&straight, "tp=2,ep=4", steps, &[]));
    assert_metrics_equal(&metrics(&dir), &metrics(&straight), "resumed vs straight");
    assert_eq!(params(&dir), params(&straight));
    for d in [dir, straight] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn exit_interval_and_duration_save_and_exit_zero() {
    let dir = scratch("exit-interval");
    let out = threads(&train_args(&dir, "ep=2", 10, &["--exit-interval", "3"]));
    assert!(
        output_text(&out).contains("--exit-interval"),
        "{}",
        output_text(&out)
    );
    assert_eq!(metrics(&dir).len(), 3);
    assert!(latest(&dir.join("ckpt")).ends_with("iter_0000003"));
    let dir2 = scratch("exit-duration");
    let out = threads(&train_args(
        &dir2,
        "ep=2",
        10,
        &["--exit-duration-in-mins", "0"],
    ));
    assert!(
        output_text(&out).contains("--exit-duration-in-mins"),
        "{}",
        output_text(&out)
    );
    assert_eq!(
        metrics(&dir2).len(),
        1,
        "the budget is spent after the first step"
    );
    assert!(latest(&dir2.join("ckpt")).ends_with("iter_0000001"));
    for d in [dir, dir2] {
        let _ = std::fs::remove_dir_all(d);
    }
}

fn iter_dirs(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root)
        .expect("root")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("iter_"))
        .collect();
    v.sort();
    v
}

#[test]
fn keep_last_keeps_the_newest_and_a_kill_9_mid_removal_leaves_loadable_checkpoints() {
    let dir = scratch("keep-last");
    let root = dir.join("ckpt");
    let keep = ["--save-every", "1", "--keep-last", "2"];
    threads(&train_args(&dir, "ep=2", 4, &keep));
    assert_eq!(iter_dirs(&root), ["iter_0000003", "iter_0000004"]);
    // Killed (SIGKILL) half-way through deleting iter_0000003 at the save of step 5.
    let mut args = train_args(&dir, "ep=2", 6, &keep);
    args.push("--resume".into());
    let out = Command::new(MOE)
        .args(&args)
        .args(["--transport", "threads"])
        .env("MOE_TEST_KILL_IN_RETENTION", "1")
        .output()
        .expect("moe");
    assert!(!out.status.success(), "killed: {}", output_text(&out));
    let left = iter_dirs(&root);
    assert_eq!(
        left,
        ["iter_0000004", "iter_0000005"],
        "the removal had begun"
    );
    for name in &left {
        let ckpt = DistCheckpoint::open::<ModelConfig>(root.join(name)).expect("opens");
        ckpt.validate::<ModelConfig>()
            .expect("every remaining checkpoint loads");
    }
    let hidden = std::fs::read_dir(&root)
        .expect("root")
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with(".removing-"));
    assert!(hidden, "the half-deleted directory is out of the way");
    // The next run resumes from latest and sweeps the leftover.
    threads(&args);
    assert_eq!(iter_dirs(&root), ["iter_0000005", "iter_0000006"]);
    let hidden = std::fs::read_dir(&root)
        .expect("root")
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with(".removing-"));
    assert!(!hidden);
    let _ = std::fs::remove_dir_all(dir);
}

/// Writes `input_ids [rows, cols]` (I64) to a safetensors file.
fn write_ids(path: &Path, rows: usize, cols: usize, seed: i64) {
    let ids: Vec<i64> = (0..(rows * cols) as i64)
        .map(|i| (i * 37 + seed * 11) % 240)
        .collect();
    let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    let shape = [rows, cols];
    let view = TensorView {
        path,
        name: "input_ids",
        dtype: Dtype::I64,
        shape: &shape,
        bytes: &bytes,
    };
    write_safetensors(path, &[view]).expect("write ids");
}

fn eval_losses(dir: &Path) -> Vec<(f64, f64)> {
    metrics(dir)
        .iter()
        .filter(|m| m.get("eval_loss").is_some())
        .map(|m| (field(m, "step"), field(m, "eval_loss")))
        .collect()
}

#[test]
fn eval_loss_is_equal_under_every_layout_and_changes_nothing_of_the_training() {
    let data_dir = scratch("eval-data");
    let (train, held_out) = (
        data_dir.join("train.safetensors"),
        data_dir.join("eval.safetensors"),
    );
    write_ids(&train, 16, 12, 1);
    write_ids(&held_out, 6, 12, 7);
    let (train, held_out) = (train.display().to_string(), held_out.display().to_string());
    let common = [
        "--data",
        train.as_str(),
        "--adam-eps",
        ADAM_EPS,
        "--mbs",
        "1",
    ];
    let with_eval = |layout: &str, model: &str| {
        let dir = scratch("eval");
        let mut extra = common.to_vec();
        extra.extend([
            "--model",
            model,
            "--eval-data",
            held_out.as_str(),
            "--eval-interval",
            "2",
            "--eval-iters",
            "2",
        ]);
        threads(&train_args(&dir, layout, 4, &extra));
        dir
    };
    let one = with_eval("", FIXTURE);
    let reference = eval_losses(&one);
    assert_eq!(
        reference.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        [2.0, 4.0],
        "every 2 steps and at the end"
    );
    assert!(reference.iter().all(|(_, l)| l.is_finite() && *l > 0.0));
    let one_ppl = field(&metrics(&one)[1], "eval_ppl");
    assert!((one_ppl - reference[0].1.exp()).abs() <= 1e-6 * one_ppl);
    for layout in [
        "tp=2,ep=4",
        "world=2,cp=2",
        "world=4,pp=2,ep=2,pp_layout=Et|ttL",
    ] {
        let dir = with_eval(layout, FIXTURE);
        let got = eval_losses(&dir);
        assert_eq!(got.len(), reference.len(), "{layout}");
        for ((_, g), (step, w)) in got.iter().zip(&reference) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs() + 1e-6,
                "{layout} step {step}: eval loss {g} vs {w}"
            );
        }
        // No effect on training: the same run without evaluation, bit for bit.
        let plain = scratch("eval-plain");
        threads(&train_args(&plain, layout, 4, &common));
        assert_metrics_equal(&metrics(&dir), &metrics(&plain), layout);
        assert_eq!(params(&dir), params(&plain), "{layout}: parameters");
        for d in [dir, plain] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    // DeepSeek-V3: expert-bias counts and router statistics untouched by the evaluation.
    let ds = with_eval("ep=2", DEEPSEEK);
    let plain = scratch("eval-ds-plain");
    let mut extra = common.to_vec();
    extra.extend(["--model", DEEPSEEK]);
    threads(&train_args(&plain, "ep=2", 4, &extra));
    assert_metrics_equal(&metrics(&ds), &metrics(&plain), "deepseek");
    assert_eq!(
        params(&ds),
        params(&plain),
        "deepseek: parameters and expert biases"
    );
    for d in [one, ds, plain, data_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
}
