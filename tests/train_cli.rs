//! `moe train` on threads: gradient accumulation over micro-batches equals one big batch, a
//! `--data` file trains, and bad input is refused before any step runs with an error naming
//! what is wrong.

mod common;

use std::path::Path;
use std::process::Command;

use burn_moe::bridge::safetensors::{Dtype, TensorView, write_safetensors};
use common::*;

/// Writes `name` `[rows, cols]` of `dtype` (i64 values converted) to a safetensors file.
fn write_ids(path: &Path, name: &str, dtype: Dtype, rows: usize, cols: usize, ids: &[i64]) {
    let bytes: Vec<u8> = match dtype {
        Dtype::I64 => ids.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::I32 => ids.iter().flat_map(|v| (*v as i32).to_le_bytes()).collect(),
        _ => ids.iter().flat_map(|v| (*v as f32).to_le_bytes()).collect(),
    };
    let shape = [rows, cols];
    let view = TensorView {
        path,
        name,
        dtype,
        shape: &shape,
        bytes: &bytes,
    };
    write_safetensors(path, &[view]).expect("write ids");
}

#[test]
fn four_micro_batches_equal_one_batch_four_times_the_size() {
    // Global batch 8 over DP2 (tp=2,ep=4): per replica one micro-batch of 4, or 4 of 1.
    let extra = [
        "--aux-loss-coeff",
        "0",
        "--adam-eps",
        ADAM_EPS,
        "--gbs",
        "8",
    ];
    let (one, four) = (scratch("mb-one"), scratch("mb-four"));
    threads(&train_args(&one, "tp=2,ep=4", 4, &extra));
    let mut args = train_args(&four, "tp=2,ep=4", 4, &extra);
    args.extend(["--mbs".into(), "1".into()]);
    threads(&args);
    // Same objective and gradients up to the order of f32 sums: the parallel-equivalence
    // tolerance (1e-5·max + 1e-6).
    assert_metrics_close(&metrics(&four), &metrics(&one), "4 micro-batches vs 1");
    assert_params_close(&params(&four), &params(&one), "4 micro-batches vs 1");
    for d in [one, four] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn trains_on_a_data_file() {
    let dir = scratch("data");
    let data = dir.join("ids.safetensors");
    // 6 rows of 10 tokens, I32 (HF tokenizers' usual output) is accepted.
    let ids: Vec<i64> = (0..60).map(|i| (i * 7 % 250) as i64).collect();
    write_ids(&data, "input_ids", Dtype::I32, 6, 10, &ids);
    let mut args = train_args(&dir, "ep=2", 3, &[]);
    args.extend(["--data".into(), data.display().to_string()]);
    threads(&args);
    let m = metrics(&dir);
    assert_eq!(m.len(), 3);
    assert!(m.iter().all(|s| field(s, "loss").is_finite()));
    let _ = std::fs::remove_dir_all(dir);
}

/// Runs `moe train` expecting a failure whose message contains every one of `needles`, and
/// that no checkpoint was written.
fn refused(dir: &Path, args: &[String], needles: &[&str]) {
    // The metrics of an earlier run survive a refused one.
    let metrics = dir.join("metrics.jsonl");
    std::fs::create_dir_all(dir).expect("dir");
    std::fs::write(&metrics, "{\"step\": 1}\n").expect("metrics");
    let out = Command::new(MOE)
        .args(args)
        .args(["--transport", "threads"])
        .output()
        .expect("moe");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "must fail: {args:?}\n{text}");
    assert!(!text.contains("panicked"), "no panic: {text}");
    for n in needles {
        assert!(text.contains(n), "the error names `{n}`:\n{text}");
    }
    assert!(
        !dir.join("ckpt").join("latest").exists(),
        "nothing is committed on bad input"
    );
    assert_eq!(
        std::fs::read_to_string(&metrics).expect("metrics"),
        "{\"step\": 1}\n",
        "a refused run leaves the metrics file alone: {args:?}"
    );
    // The job's own error, not a wrapper naming a config field `train`.
    assert!(!text.contains("field `train`"), "{text}");
}

#[test]
fn bad_input_is_refused_before_any_step() {
    let dir = scratch("bad");
    let with = |layout: &str, extra: &[&str]| train_args(&dir, layout, 2, extra);
    // The global batch does not split over the data-parallel replicas / micro-batches.
    refused(
        &dir,
        &with("tp=2,ep=4", &["--gbs", "3"]),
        &["gbs", "3", "2 data-parallel"],
    );
    refused(
        &dir,
        &with("tp=2,ep=4", &["--gbs", "8", "--mbs", "3"]),
        &["mbs", "micro-batches of 3"],
    );
    // A layout the model cannot take: ep not dividing the 8 experts, tp not dividing the
    // 4 attention heads (world 3 and 8).
    refused(&dir, &with("ep=3", &[]), &["ep", "3"]);
    refused(&dir, &with("tp=8", &["--gbs", "8"]), &["8"]);
    // More pipeline stages than the fixture's 3 decoder layers; 3 layers on 2 stages
    // without an explicit pipeline layout.
    refused(
        &dir,
        &with("world=4,pp=4", &[]),
        &["pp", "4 pipeline stages", "3 decoder layers"],
    );
    refused(
        &dir,
        &with("world=2,pp=2", &[]),
        &["pp", "do not split evenly", "pipeline layout"],
    );
    // A pipeline layout that does not cover the model's layers; an interleaved schedule with
    // fewer micro-batches (2 of 2 sequences) than pipeline stages (4).
    refused(
        &dir,
        &with("world=2,pp=2", &["--pipeline-layout", "Et|tL"]),
        &["pipeline_layout", "Et|tL"],
    );
    refused(
        &dir,
        &with("world=4,pp=4,vpp=2", &["--mbs", "2"]),
        &["mbs", "2 micro-batches", "at least pp = 4"],
    );
    // Sequences of 12 tokens do not cut into 2·cp = 8 chunks.
    refused(
        &dir,
        &with("world=4,cp=4", &[]),
        &["seq_len", "2·cp = 8", "12 tokens"],
    );
    // Data without `input_ids`, of a float dtype, or with ids outside the vocabulary.
    let data = dir.join("bad.safetensors");
    write_ids(&data, "tokens", Dtype::I64, 2, 4, &[1, 2, 3, 4, 5, 6, 7, 8]);
    let d = data.display().to_string();
    refused(
        &dir,
        &with("", &["--data", &d]),
        &["input_ids", "bad.safetensors"],
    );
    write_ids(
        &data,
        "input_ids",
        Dtype::F32,
        2,
        4,
        &[1, 2, 3, 4, 5, 6, 7, 8],
    );
    refused(
        &dir,
        &with("", &["--data", &d]),
        &["input_ids", "I64 or I32"],
    );
    write_ids(
        &data,
        "input_ids",
        Dtype::I64,
        2,
        4,
        &[1, 2, 3, 4, 5, 6, 7, 99_999],
    );
    refused(
        &dir,
        &with("", &["--data", &d]),
        &["row 1 column 3", "99999", "vocabulary"],
    );
    // A model `moe train` cannot train, named with its model_type.
    let other = dir.join("llama");
    std::fs::create_dir_all(&other).expect("dir");
    std::fs::write(other.join("config.json"), r#"{"model_type": "llama"}"#).expect("config");
    let other = other.display().to_string();
    refused(
        &dir,
        &with("", &["--model", &other]),
        &["model_type", "llama", "qwen3_moe", "deepseek_v3"],
    );
    // --resume without a checkpoint to resume from.
    refused(&dir, &with("", &["--resume"]), &["resume", "no checkpoint"]);
    let _ = std::fs::remove_dir_all(dir);
}

/// Megatron's warmup + cosine schedule, written from its formula: step `s` (0-based, the
/// optimizer steps already taken) of a warmup of `w` steps from 0 and a decay to `min` at `d`.
fn warmup_cosine(s: usize, max: f64, min: f64, w: usize, d: usize) -> f64 {
    if s < w {
        max * s as f64 / w as f64
    } else if s > d {
        min
    } else {
        let r = (s - w) as f64 / (d - w) as f64;
        min + (max - min) * 0.5 * (1.0 + (std::f64::consts::PI * r).cos())
    }
}

#[test]
fn lr_schedule_follows_megatron_and_continues_across_resume() {
    let schedule = [
        "--lr",
        "1e-2",
        "--min-lr",
        "1e-3",
        "--lr-warmup-iters",
        "2",
        "--lr-decay-style",
        "cosine",
        "--lr-decay-iters",
        "6",
        "--aux-loss-coeff",
        "0",
    ];
    let straight = scratch("lr-straight");
    threads(&train_args(&straight, "ep=2", 7, &schedule));
    let lrs: Vec<f64> = metrics(&straight).iter().map(|m| field(m, "lr")).collect();
    let want: Vec<f64> = (0..7).map(|s| warmup_cosine(s, 1e-2, 1e-3, 2, 6)).collect();
    for (s, (got, want)) in lrs.iter().zip(&want).enumerate() {
        assert!((got - want).abs() <= 1e-12, "step {s}: lr {got} vs {want}");
    }
    // 3 steps, then a resumed run to 7 (another layout): the schedule continues.
    let split = scratch("lr-split");
    threads(&train_args(&split, "ep=2", 3, &schedule));
    let mut args = train_args(&split, "tp=2,ep=4", 7, &schedule);
    args.push("--resume".into());
    threads(&args);
    let resumed: Vec<f64> = metrics(&split).iter().map(|m| field(m, "lr")).collect();
    assert_eq!(resumed, lrs, "the resumed run's learning rates");
    for d in [straight, split] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn router_losses_do_not_depend_on_how_a_micro_batch_is_split_over_ranks() {
    // Megatron's aux loss (counts summed over tp_cp, per micro-batch) and the z-loss, on. A
    // global batch of 8 sequences in micro-batches of 2 everywhere: 4 after one another on one
    // rank, 2 per replica under attention TP2 × DP2 (sequence parallel, experts EP4), 1 per
    // replica under DP4 × EP2 × ETP2 — the same micro-batches, so the same objective.
    let losses = [
        "--z-loss-coeff",
        "1e-3",
        "--adam-eps",
        ADAM_EPS,
        "--gbs",
        "8",
    ];
    let run = |layout: &str, mbs: &str| {
        let dir = scratch("router-losses");
        let mut extra = losses.to_vec();
        extra.extend(["--mbs", mbs]);
        threads(&train_args(&dir, layout, 3, &extra));
        let out = (metrics(&dir), params(&dir));
        let _ = std::fs::remove_dir_all(dir);
        out
    };
    let (one_m, one_p) = run("", "2");
    for layout in ["tp=2,ep=4", "world=4,ep=2,etp=2"] {
        let (m, p) = run(layout, "2");
        assert!(
            m.iter().all(|s| field(s, "aux_loss") > 0.5),
            "the loss is on"
        );
        assert_metrics_close(&m, &one_m, &format!("{layout} vs one rank"));
        assert_params_close(&p, &one_p, &format!("{layout} vs one rank"));
    }
}

#[test]
fn weight_decay_schedule_sets_each_steps_decay() {
    // Linear 0 -> 0.5 over 2 steps: step 0 decays with 0, step 1 with 0.25. The same as one
    // step with weight decay 0, resumed for a step with weight decay 0.25.
    let base = ["--steps", "2", "--aux-loss-coeff", "0"];
    let scheduled = scratch("wd-scheduled");
    let mut extra = base.to_vec();
    extra.extend(["--start-weight-decay", "0", "--end-weight-decay", "0.5"]);
    threads(&train_args(&scheduled, "ep=2", 2, &extra));
    let split = scratch("wd-split");
    threads(&train_args(
        &split,
        "ep=2",
        1,
        &["--weight-decay", "0", "--aux-loss-coeff", "0"],
    ));
    let mut resumed = train_args(
        &split,
        "ep=2",
        2,
        &["--weight-decay", "0.25", "--aux-loss-coeff", "0"],
    );
    resumed.push("--resume".into());
    threads(&resumed);
    assert_eq!(
        params(&scheduled),
        params(&split),
        "scheduled vs 0 then 0.25"
    );
    let constant = scratch("wd-constant");
    threads(&train_args(
        &constant,
        "ep=2",
        2,
        &["--weight-decay", "0", "--aux-loss-coeff", "0"],
    ));
    assert_ne!(
        params(&scheduled),
        params(&constant),
        "the schedule decays at step 1"
    );
    for d in [scheduled, split, constant] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn resume_refuses_a_checkpoint_of_another_model() {
    // A checkpoint of the fixture, then --resume with --model naming a copy whose config
    // differs in one architecture field.
    let dir = scratch("resume-other");
    threads(&train_args(&dir, "ep=2", 1, &[]));
    let other = dir.join("other-model");
    std::fs::create_dir_all(&other).expect("dir");
    for entry in std::fs::read_dir(FIXTURE).expect("fixture").flatten() {
        std::fs::copy(entry.path(), other.join(entry.file_name())).expect("copy");
    }
    let config = other.join("config.json");
    let text = std::fs::read_to_string(&config).expect("config");
    let mut json: serde_json::Value = serde_json::from_str(&text).expect("json");
    json["num_experts_per_tok"] = serde_json::json!(4);
    std::fs::write(&config, json.to_string()).expect("write");
    let other = other.display().to_string();
    let out = Command::new(MOE)
        .args(train_args(
            &dir,
            "ep=2",
            2,
            &["--model", &other, "--resume"],
        ))
        .args(["--transport", "threads"])
        .output()
        .expect("moe");
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "must fail");
    assert!(
        text.contains("another model") && text.contains("num_experts_per_tok"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn recompute_changes_nothing_but_memory() {
    let (plain, recompute) = (scratch("rc-plain"), scratch("rc-on"));
    threads(&train_args(&plain, "tp=2,ep=4", 3, &[]));
    threads(&train_args(
        &recompute,
        "tp=2,ep=4",
        3,
        &["--recompute", "memory-bound"],
    ));
    // Megatron's module-level selective recompute, with the memory-bound one.
    let modules = scratch("rc-modules");
    threads(&train_args(
        &modules,
        "tp=2,ep=4",
        3,
        &["--recompute", "memory-bound,core_attn,moe_act,mlp"],
    ));
    // Bit-identical: the same metrics (timing aside) and parameters.
    assert_metrics_equal(&metrics(&recompute), &metrics(&plain), "recompute vs plain");
    assert_eq!(params(&recompute), params(&plain), "parameters");
    assert_metrics_equal(&metrics(&modules), &metrics(&plain), "modules vs plain");
    assert_eq!(params(&modules), params(&plain), "parameters (modules)");
    for d in [plain, recompute, modules] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn dense_qwen3_trains_resumes_under_another_layout_and_exports() {
    let dense = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen3");
    let extra = |more: &[&'static str]| {
        let mut v = vec!["--model", dense, "--adam-eps", ADAM_EPS];
        v.extend_from_slice(more);
        v
    };
    let (whole, split) = (scratch("dense-whole"), scratch("dense-split"));
    threads(&train_args(&whole, "tp=2", 4, &extra(&["--gbs", "4"])));
    threads(&train_args(&split, "tp=2", 2, &extra(&["--gbs", "4"])));
    threads(&train_args(
        &split,
        "world=2",
        4,
        &extra(&["--gbs", "4", "--resume"]),
    ));
    assert_metrics_close(
        &metrics(&split),
        &metrics(&whole),
        "resumed vs uninterrupted",
    );
    let (p_whole, p_split) = (params(&whole), params(&split));
    assert_params_close(&p_split, &p_whole, "resumed vs uninterrupted parameters");
    assert!(p_whole.contains_key("model.layers.0.mlp.down_proj.weight"));
    for d in [whole, split] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn muon_resumes_under_another_layout() {
    let extra = |more: &[&'static str]| {
        let mut v = vec!["--optimizer", "muon", "--adam-eps", ADAM_EPS];
        v.extend_from_slice(more);
        v
    };
    let (whole, split) = (scratch("muon-whole"), scratch("muon-split"));
    threads(&train_args(&whole, "tp=2,ep=4", 4, &extra(&[])));
    threads(&train_args(&split, "tp=2,ep=4", 2, &extra(&[])));
    threads(&train_args(&split, "ep=2", 4, &extra(&["--resume"])));
    assert_metrics_close(
        &metrics(&split),
        &metrics(&whole),
        "resumed vs uninterrupted",
    );
    assert_params_close(&params(&split), &params(&whole), "resumed vs uninterrupted");
    // The momentum is in the checkpoint, resharded like the parameters.
    let ckpt = burn_moe::bridge::dist::DistCheckpoint::open::<burn_moe::models::hf::ModelConfig>(
        whole.join("ckpt"),
    )
    .expect("ckpt");
    assert!(
        ckpt.entry("optim.muon_momentum.model.layers.1.self_attn.q_proj.weight")
            .is_ok()
    );
    // An AdamW run cannot resume it.
    let out = std::process::Command::new(MOE)
        .args(train_args(
            &whole,
            "ep=2",
            5,
            &["--adam-eps", ADAM_EPS, "--resume"],
        ))
        .args(["--transport", "threads"])
        .output()
        .expect("moe");
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success() && text.contains("muon_adamw"),
        "{text}"
    );
    for d in [whole, split] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn context_parallel_training_matches_one_rank_and_resumes_across_cp() {
    // Rows of 12 tokens cut into 2·cp = 4 chunks of 3, two per rank; router losses on, the
    // same micro-batches of 2 sequences under every layout.
    let extra = [
        "--z-loss-coeff",
        "1e-3",
        "--adam-eps",
        ADAM_EPS,
        "--mbs",
        "2",
    ];
    // Keys and values all-gathered, then passed around the ring (`--cp-comm-type p2p`); a
    // checkpoint saved under context parallelism resumes without it, and the reverse.
    runs_match_one_rank(
        &extra,
        &[
            ("world=2,cp=2", &["--cp-comm-type", "all_gather"]),
            ("world=8,tp=2,cp=2,ep=2", &["--cp-comm-type", "p2p"]),
        ],
        &[
            ("world=8,tp=2,cp=2,ep=2", "tp=2,ep=4"),
            ("world=2,ep=2", "world=4,cp=2,ep=2"),
        ],
    );
}

#[test]
fn pipeline_parallel_training_matches_one_rank_and_resumes_across_pp() {
    // The fixture's 3 decoder layers on 3 pipeline stages; router losses on, 2 micro-batches.
    let extra = [
        "--z-loss-coeff",
        "1e-3",
        "--adam-eps",
        ADAM_EPS,
        "--mbs",
        "2",
    ];
    // Even and explicit (`--pipeline-layout`) splits, interleaved; saved by pipeline stages,
    // resumed without them, and the reverse. `params` exports each checkpoint to HF.
    runs_match_one_rank(
        &extra,
        &[
            ("world=3,pp=3", &[]),
            ("world=6,pp=3,ep=2", &[]),
            ("world=2,pp=2", &["--pipeline-layout", "Et|ttL"]),
            ("world=2,pp=2,vpp=2", &["--pipeline-layout", "Et|t|t|L"]),
        ],
        &[
            ("world=3,pp=3", "tp=2,ep=2"),
            ("world=2,ep=2", "world=6,pp=3,ep=2"),
        ],
    );
}

/// 4 steps under each of `runs` (a layout and its own flags) and, for each `(first, then)`
/// of `resumes`, 2 steps under `first` resumed to 4 under `then`, all with `extra`: the
/// metrics and saved parameters equal the one-rank run's.
fn runs_match_one_rank(extra: &[&str], runs: &[(&str, &[&str])], resumes: &[(&str, &str)]) {
    let one = scratch("one-rank");
    threads(&train_args(&one, "", 4, extra));
    let (one_m, one_p) = (metrics(&one), params(&one));
    for (layout, flags) in runs {
        let dir = scratch("run");
        let mut args = extra.to_vec();
        args.extend_from_slice(flags);
        threads(&train_args(&dir, layout, 4, &args));
        assert_metrics_close(&metrics(&dir), &one_m, &format!("{layout} vs one rank"));
        assert_params_close(&params(&dir), &one_p, &format!("{layout} vs one rank"));
        let _ = std::fs::remove_dir_all(dir);
    }
    for (first, then) in resumes {
        let dir = scratch("resume");
        threads(&train_args(&dir, first, 2, extra));
        let mut args = train_args(&dir, then, 4, extra);
        args.push("--resume".into());
        threads(&args);
        let what = format!("{first} resumed under {then}");
        assert_metrics_close(&metrics(&dir), &one_m, &what);
        assert_params_close(&params(&dir), &one_p, &what);
        let _ = std::fs::remove_dir_all(dir);
    }
    let _ = std::fs::remove_dir_all(one);
}
