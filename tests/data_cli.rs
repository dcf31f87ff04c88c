//! `moe train` on the data users bring and the logs they watch: Megatron's indexed datasets
//! (`--data-path`, made by Megatron's own `IndexedDatasetBuilder`, blended; a run resumed under
//! another layout sees the same samples), SFT data (TRL's conversational and prompt–completion
//! shapes: the first step's loss equals transformers' loss on TRL's rows, packed equals padded,
//! layouts equal one rank, bad rows refused naming the line) and TensorBoard event files read
//! back (a resumed run's stale values purged as TensorBoard purges them).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn_moe::bridge::tensorboard::read_scalars_dir;
use common::*;
use serde_json::Value;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

fn fixture(rel: &str) -> String {
    format!("{FIXTURES}/{rel}")
}

fn losses(dir: &Path) -> Vec<f64> {
    metrics(dir).iter().map(|m| field(m, "loss")).collect()
}

fn assert_losses_close(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: steps");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * w.abs() + 1e-6,
            "{what} step {}: {g} vs {w}",
            i + 1
        );
    }
}

#[test]
fn megatron_datasets_train_blend_and_resume_under_another_layout_on_the_same_samples() {
    let a = fixture("megatron_data/corpus_a");
    let b = fixture("megatron_data/corpus_b");
    let common = ["--adam-eps", ADAM_EPS, "--seq-len", "11", "--gbs", "4"];
    // One dataset, 4 steps straight under ep=2.
    let straight = scratch("mg-straight");
    let mut args = train_args(&straight, "ep=2", 4, &common);
    args.extend(["--data-path".into(), a.clone()]);
    threads(&args);
    let want = losses(&straight);
    assert_eq!(want.len(), 4);
    // 2 steps under tp=2,ep=4, then 2 more under ep=2 from the checkpoint: the same samples.
    let split = scratch("mg-split");
    let mut first = train_args(&split, "tp=2,ep=4", 4, &common);
    first.extend([
        "--data-path".into(),
        a.clone(),
        "--exit-interval".into(),
        "2".into(),
    ]);
    threads(&first);
    assert_eq!(metrics(&split).len(), 2);
    let mut rest = train_args(&split, "ep=2", 4, &common);
    rest.extend(["--data-path".into(), a.clone(), "--resume".into()]);
    threads(&rest);
    assert_losses_close(&losses(&split), &want, 1e-5, "resumed under another layout");
    // Another seed: other samples, another loss.
    let seeded = scratch("mg-seed");
    let mut args = train_args(&seeded, "ep=2", 1, &common);
    args.extend(["--data-path".into(), a.clone(), "--seed".into(), "7".into()]);
    threads(&args);
    assert_ne!(losses(&seeded)[0], want[0], "the seed orders the samples");
    // A blend of two datasets trains.
    let blend = scratch("mg-blend");
    let mut args = train_args(&blend, "ep=2", 2, &common);
    args.extend([
        "--data-path".into(),
        "0.3".into(),
        a.clone(),
        "0.7".into(),
        b,
    ]);
    threads(&args);
    assert!(losses(&blend).iter().all(|l| l.is_finite()));
    // Bad input is refused before any step, naming the file.
    let bad = scratch("mg-bad");
    let copy = bad.join("broken");
    std::fs::copy(format!("{a}.idx"), copy.with_extension("idx")).expect("copy");
    let mut bin = std::fs::read(format!("{a}.bin")).expect("bin");
    bin.truncate(bin.len() / 2);
    std::fs::write(copy.with_extension("bin"), bin).expect("write");
    let mut args = train_args(&bad, "ep=2", 2, &common);
    args.extend(["--data-path".into(), copy.display().to_string()]);
    let out = moe_threads(&args);
    let all = output_text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("broken.bin") && !all.contains("panicked"),
        "{all}"
    );
    assert!(!bad.join("metrics.jsonl").exists(), "no step ran");
    for d in [straight, split, seeded, blend, bad] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The SFT goldens of `tests/make_sft_goldens.py` (TRL and transformers).
fn sft_goldens() -> Value {
    let text = std::fs::read_to_string(fixture("sft/goldens.json")).expect("goldens");
    serde_json::from_str(&text).expect("json")
}

fn sft_args(dir: &Path, layout: &str, data: &str, extra: &[&str]) -> Vec<String> {
    let tokenizer = fixture("tokenizer");
    let defaults = [
        ("--data", data),
        ("--tokenizer", tokenizer.as_str()),
        ("--seq-len", "64"),
        ("--gbs", "6"),
        ("--adam-eps", ADAM_EPS),
    ];
    let mut all: Vec<&str> = extra.to_vec();
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            all.extend([flag, value]);
        }
    }
    train_args(dir, layout, 2, &all)
}

#[test]
fn sft_first_step_loss_equals_transformers_on_trl_rows_packed_equals_padded_and_layouts_agree() {
    let golden = sft_goldens();
    // transformers' cross-entropy alone (TRL trains this MoE with its router aux loss added;
    // the step's logged loss is the cross-entropy).
    let want = golden["loss"]["ce_loss"].as_f64().expect("golden loss");
    let examples = golden["loss"]["input_ids"].as_array().expect("rows").len();
    assert_eq!(examples, 6, "one global batch holds every example");
    let data = fixture("sft/conversational.jsonl");
    // Padded: one example per row, the rows transformers saw.
    let padded = scratch("sft-padded");
    threads(&sft_args(&padded, "", &data, &["--sft-packing", "none"]));
    let got = losses(&padded)[0];
    assert!(
        (got - want).abs() <= 1e-5 * want,
        "first-step loss {got} vs transformers {want}"
    );
    // Packed rows train on the same tokens as padded ones: the same loss (f32 rounding apart)
    // when one global batch holds every example either way. Prompt–completion examples are
    // short enough to share rows.
    let pc = fixture("sft/prompt_completion.jsonl");
    let tokenizer = burn_moe::bridge::Tokenizer::from_dir(fixture("tokenizer")).expect("tok");
    let rows = |packing| {
        let settings = burn_moe::job_data::SftSettings {
            packing,
            ..Default::default()
        };
        burn_moe::job_data::SftRows::open(Path::new(&pc), &tokenizer, 64, settings, 256)
            .expect("sft rows")
            .rows()
    };
    let (n_packed, n_padded) = (
        rows(burn_moe::job_data::SftPacking::Packed),
        rows(burn_moe::job_data::SftPacking::Padded),
    );
    assert!(
        n_packed < n_padded,
        "packing puts several examples in a row"
    );
    let (packed, pc_padded) = (scratch("sft-packed"), scratch("sft-pc-padded"));
    let (gbs_packed, gbs_padded) = (n_packed.to_string(), n_padded.to_string());
    threads(&sft_args(
        &packed,
        "",
        &pc,
        &["--gbs", &gbs_packed, "--steps", "1"],
    ));
    threads(&sft_args(
        &pc_padded,
        "",
        &pc,
        &[
            "--gbs",
            &gbs_padded,
            "--steps",
            "1",
            "--sft-packing",
            "none",
        ],
    ));
    let (a, b) = (losses(&packed)[0], losses(&pc_padded)[0]);
    assert!((a - b).abs() <= 1e-5 * b, "packed {a} vs padded {b}");
    // Layouts equal one rank (packed rows, two steps of two rows).
    let one = scratch("sft-one");
    threads(&sft_args(&one, "", &data, &["--gbs", "2", "--mbs", "1"]));
    for layout in ["tp=2,ep=4", "world=2,cp=2"] {
        let dir = scratch("sft-layout");
        threads(&sft_args(
            &dir,
            layout,
            &data,
            &["--gbs", "2", "--mbs", "1"],
        ));
        assert_losses_close(&losses(&dir), &losses(&one), 1e-5, layout);
        assert_params_close(&params(&dir), &params(&one), layout);
        let _ = std::fs::remove_dir_all(dir);
    }
    let _ = std::fs::remove_dir_all(one);
    // Prompt–completion data trains too (plain text and messages).
    for file in [
        "prompt_completion.jsonl",
        "prompt_completion_messages.jsonl",
    ] {
        let dir = scratch("sft-pc");
        threads(&sft_args(
            &dir,
            "ep=2",
            &fixture(&format!("sft/{file}")),
            &["--gbs", "2"],
        ));
        assert!(losses(&dir).iter().all(|l| l.is_finite()), "{file}");
        let _ = std::fs::remove_dir_all(dir);
    }
    for d in [padded, packed, pc_padded] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn bad_sft_rows_are_refused_naming_the_line() {
    let dir = scratch("sft-bad");
    let cases: [(&str, &[&str]); 4] = [
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n{\"messages\": [{\"role\": \"wizard\", \"content\": \"hi\"}]}\n",
            &["line 2", "wizard"],
        ),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n{\"prompt\": \"only a prompt\"}\n",
            &["line 2", "completion"],
        ),
        ("{\"messages\": []}\n", &["line 1", "messages"]),
        (
            "{\"prompt\": \"a\", \"completion\": \"b\"}\nnot json\n",
            &["line 2", "JSON"],
        ),
    ];
    for (i, (rows, needles)) in cases.iter().enumerate() {
        let data = dir.join(format!("bad{i}.jsonl"));
        std::fs::write(&data, rows).expect("write");
        let args = sft_args(&dir, "", &data.display().to_string(), &[]);
        let out = moe_threads(&args);
        let all = output_text(&out);
        assert!(!out.status.success(), "case {i}: {all}");
        assert!(!all.contains("panicked"), "{all}");
        for n in needles.iter() {
            assert!(all.contains(n), "case {i} names `{n}`:\n{all}");
        }
    }
    // Longer than --seq-len with --sft-truncation refuse.
    let long = format!(
        "{{\"prompt\": \"{}\", \"completion\": \"end\"}}\n",
        "many words here ".repeat(20)
    );
    let data = dir.join("long.jsonl");
    std::fs::write(&data, long).expect("write");
    let args = sft_args(
        &dir,
        "",
        &data.display().to_string(),
        &["--sft-truncation", "refuse"],
    );
    let out = moe_threads(&args);
    let all = output_text(&out);
    assert!(!out.status.success() && all.contains("line 1"), "{all}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn tensorboard_files_hold_the_metrics_and_a_resumed_run_replaces_the_stale_steps() {
    let dir = scratch("tb");
    let tb = dir.join("tb");
    let tb_arg = tb.display().to_string();
    let data_dir = scratch("tb-data");
    let held_out = data_dir.join("eval.jsonl");
    std::fs::write(
        &held_out,
        "{\"text\": \"one two three four five six seven eight nine ten\"}\n".repeat(4),
    )
    .expect("eval data");
    let eval = held_out.display().to_string();
    let tokenizer = fixture("tokenizer");
    let extra = [
        "--save-every",
        "2",
        "--tensorboard-dir",
        tb_arg.as_str(),
        "--eval-data",
        eval.as_str(),
        "--tokenizer",
        tokenizer.as_str(),
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
    ];
    // A run killed (SIGKILL) after logging step 3 or later, its last checkpoint behind it.
    let child = Command::new(MOE)
        .args(train_args(&dir, "ep=2", 10_000, &extra))
        .args(["--transport", "threads"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("moe");
    let start = Instant::now();
    while std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |m| m.lines().count()) < 3 {
        assert!(start.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut child = child;
    child.kill().expect("kill");
    let _ = child.wait();
    let logged = metrics(&dir).len();
    let saved = burn_moe::bridge::dist::DistCheckpoint::open::<burn_moe::models::hf::ModelConfig>(
        dir.join("ckpt"),
    )
    .expect("checkpoint")
    .index()
    .step as usize;
    // Killed within milliseconds of step 3's record, the checkpoint is normally step 2's: the
    // steps past it were logged and are logged again by the resumed run (the purge path).
    assert!(saved <= logged, "{saved} <= {logged}");
    let end = logged + 2;
    let mut resume = train_args(&dir, "ep=2", end, &extra);
    resume.push("--resume".into());
    threads(&resume);
    // The series equal the metrics each step last wrote (the resumed run's for the steps
    // logged twice), with nothing stale left.
    let mut last: std::collections::BTreeMap<i64, Value> = Default::default();
    for m in metrics(&dir) {
        last.insert(field(&m, "step") as i64, m);
    }
    let scalars = read_scalars_dir(&tb).expect("event files");
    let loss = &scalars["lm loss"];
    let steps: Vec<i64> = loss.iter().map(|p| p.step).collect();
    assert_eq!(
        steps,
        (1..=end as i64).collect::<Vec<_>>(),
        "every step once"
    );
    for p in loss {
        let want = field(&last[&p.step], "loss") as f32;
        assert_eq!(p.value as f32, want, "step {}", p.step);
    }
    for (tag, key) in [("grad-norm", "grad_norm"), ("learning-rate", "lr")] {
        for p in &scalars[tag] {
            assert_eq!(p.value as f32, field(&last[&p.step], key) as f32, "{tag}");
        }
    }
    let eval_steps: Vec<i64> = scalars["lm loss validation"]
        .iter()
        .map(|p| p.step)
        .collect();
    let want_eval: Vec<i64> = last
        .iter()
        .filter(|(_, m)| m.get("eval_loss").is_some())
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(eval_steps, want_eval);
    assert!(scalars.contains_key("skipped-iterations"));
    let files = std::fs::read_dir(&tb).expect("tb").count();
    assert_eq!(files, 2, "the resumed run added a file");
    for d in [dir, data_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
}
