//! A corpus of broken HF checkpoints, generated from the fixtures (one defect each), run
//! through every command that reads one: `moe inspect`, `moe convert --from-hf`,
//! `moe export --model` and `moe logits`. Each must fail with a non-zero exit within seconds,
//! name the file / tensor / config field on stderr, never panic, and leave no output behind
//! (no `latest` in the `convert --out` root, no export directory, no logits file).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn_moe::bridge::dist::DistCheckpoint;
use burn_moe::bridge::hf::{CONFIG_FILE, HfCheckpoint, INDEX_FILE, SINGLE_FILE};
use burn_moe::bridge::safetensors::{Dtype, OwnedTensor, TensorView, write_safetensors};
use serde_json::Value;

/// Longest a failing command may run.
const DEADLINE: Duration = Duration::from_secs(20);
/// What "within a few seconds" means for one failing command.
const QUICK: Duration = Duration::from_secs(5);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
        .join(name)
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir =
            std::env::temp_dir().join(format!("burn-moe-bad-{tag}-{}-{nanos}", std::process::id()));
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

/// A copy of fixture `name`'s files in `dir`.
fn copy_fixture(name: &str, dir: &Path) {
    std::fs::create_dir_all(dir).expect("mkdir");
    for entry in std::fs::read_dir(fixture(name)).expect("fixture") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
    }
}

/// Every tensor of the checkpoint in `dir`, owned, in name order.
fn tensors(dir: &Path) -> Vec<OwnedTensor> {
    let ckpt = HfCheckpoint::open(dir).expect("open");
    ckpt.tensor_names()
        .map(|n| ckpt.tensor(n).expect("tensor").to_owned_tensor())
        .collect()
}

fn write_file(path: &Path, tensors: &[OwnedTensor]) {
    let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
    write_safetensors(path, &views).expect("write safetensors");
}

/// Replaces the weights of `dir` (single file) by `tensors`.
fn rewrite(dir: &Path, tensors: &[OwnedTensor]) {
    write_file(&dir.join(SINGLE_FILE), tensors);
}

/// Rewrites `dir`'s tensors with `edit` applied.
fn edit_tensors(dir: &Path, edit: impl FnOnce(&mut Vec<OwnedTensor>)) {
    let mut ts = tensors(dir);
    edit(&mut ts);
    rewrite(dir, &ts);
}

/// Sets config field `key` to `value`.
fn edit_config(dir: &Path, key: &str, value: Value) {
    let path = dir.join(CONFIG_FILE);
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
    config[key] = value;
    std::fs::write(&path, config.to_string()).expect("write config");
}

fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
}

/// Turns the single-file checkpoint in `dir` into two shards plus an index; returns the
/// `weight_map`. `extra` adds tensors to a shard's file without listing them.
fn make_sharded(dir: &Path, extra: &[(usize, &str)]) -> BTreeMap<String, String> {
    let ts = tensors(dir);
    std::fs::remove_file(dir.join(SINGLE_FILE)).expect("rm single file");
    let half = ts.len() / 2;
    let mut map = BTreeMap::new();
    for (i, part) in [&ts[..half], &ts[half..]].into_iter().enumerate() {
        let mut part = part.to_vec();
        for t in &part {
            map.insert(t.name.clone(), shard_name(i, 2));
        }
        for (shard, name) in extra {
            if *shard == i {
                part.extend(ts.iter().find(|t| t.name == *name).cloned());
            }
        }
        write_file(&dir.join(shard_name(i, 2)), &part);
    }
    write_index(dir, &map);
    map
}

fn write_index(dir: &Path, map: &BTreeMap<String, String>) {
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join(INDEX_FILE), index.to_string()).expect("write index");
}

/// A broken checkpoint and what its error must mention.
struct Case {
    name: &'static str,
    dir: PathBuf,
    needles: Vec<String>,
}

/// Runs `moe args…` to completion (killed past [`DEADLINE`]); returns success, stdout + stderr
/// and the wall time.
fn run(args: &[&str], logs: &Path) -> (bool, String, Duration) {
    let out_path = logs.with_extension("out");
    let err_path = logs.with_extension("err");
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_moe"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(File::create(&out_path).expect("stdout file"))
        .stderr(File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("run the moe binary");
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("moe {args:?} still running after {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let elapsed = started.elapsed();
    let text = format!(
        "{}{}",
        std::fs::read_to_string(&out_path).unwrap_or_default(),
        std::fs::read_to_string(&err_path).unwrap_or_default()
    );
    (status.success(), text, elapsed)
}

/// An `input_ids` file `[1, 4]` for `moe logits`.
fn ids_file(path: &Path) {
    let ids: Vec<u8> = [1i64, 7, 42, 3]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let t = OwnedTensor::new("input_ids", Dtype::I64, vec![1, 4], ids).expect("ids");
    write_file(path, &[t]);
}

/// The four commands on `dir`, with outputs under `scratch`.
fn commands(dir: &Path, scratch: &Path, ids: &Path) -> Vec<(&'static str, Vec<String>)> {
    let s = |p: &Path| p.display().to_string();
    vec![
        ("inspect", vec!["inspect".into(), s(dir)]),
        (
            "convert",
            vec![
                "convert".into(),
                "--from-hf".into(),
                s(dir),
                "--out".into(),
                s(&scratch.join("dist")),
                "--layout".into(),
                "world=1".into(),
            ],
        ),
        (
            "export",
            vec![
                "export".into(),
                "--model".into(),
                s(dir),
                "--out".into(),
                s(&scratch.join("export")),
            ],
        ),
        (
            "logits",
            vec![
                "logits".into(),
                "--model".into(),
                s(dir),
                "--input".into(),
                s(ids),
                "--out".into(),
                s(&scratch.join("logits.safetensors")),
            ],
        ),
    ]
}

/// Builds the corpus under `root`.
fn corpus(root: &Path) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut add = |name: &'static str,
                   fixture_name: &str,
                   needles: &[&str],
                   edit: &dyn Fn(&Path) -> Vec<String>| {
        // Not the case name: a needle must never match the directory's own path.
        let dir = root.join(format!("c{:02}", cases.len()));
        copy_fixture(fixture_name, &dir);
        let mut needles: Vec<String> = needles.iter().map(|s| (*s).to_owned()).collect();
        needles.extend(edit(&dir));
        cases.push(Case { name, dir, needles });
    };

    add(
        "config_wrong_json_type",
        "qwen3_moe",
        &["config.json", "hidden_size"],
        &|d| {
            edit_config(d, "hidden_size", Value::from("64"));
            vec![]
        },
    );
    add(
        "config_wrong_json_type_deepseek",
        "deepseek_v3",
        &["config.json", "n_group"],
        &|d| {
            edit_config(d, "n_group", Value::from(2.5));
            vec![]
        },
    );
    add(
        "config_contradicts_weights",
        "qwen3_moe",
        &[
            "config.json",
            "model.safetensors",
            "lm_head.weight",
            "[256, 128]",
        ],
        &|d| {
            edit_config(d, "hidden_size", Value::from(128));
            vec![]
        },
    );
    add(
        "topk_above_experts",
        "qwen3_moe",
        &["config.json", "num_experts_per_tok"],
        &|d| {
            edit_config(d, "num_experts_per_tok", Value::from(9));
            vec![]
        },
    );
    add(
        "topk_above_experts_deepseek",
        "deepseek_v3",
        &["config.json", "num_experts_per_tok"],
        &|d| {
            edit_config(d, "num_experts_per_tok", Value::from(9));
            vec![]
        },
    );
    add(
        "zero_attention_heads",
        "qwen3",
        &["config.json", "num_attention_heads"],
        &|d| {
            edit_config(d, "num_attention_heads", Value::from(0));
            vec![]
        },
    );
    add(
        "missing_dense_weight",
        "qwen3",
        &["model.layers.1.mlp.down_proj.weight", "missing"],
        &|d| {
            edit_tensors(d, |ts| {
                ts.retain(|t| t.name != "model.layers.1.mlp.down_proj.weight")
            });
            vec![]
        },
    );
    add(
        "mis_shaped_weight",
        "deepseek_v3",
        &["model.layers.0.self_attn.kv_b_proj.weight", "[16, 96]"],
        &|d| {
            edit_tensors(d, |ts| {
                let t = ts
                    .iter_mut()
                    .find(|t| t.name == "model.layers.0.self_attn.kv_b_proj.weight")
                    .expect("kv_b_proj");
                t.shape = vec![16, 96];
            });
            vec![]
        },
    );
    add(
        "i32_weight",
        "qwen3_moe",
        &["model.norm.weight", "I32", "model.safetensors"],
        &|d| {
            edit_tensors(d, |ts| {
                let t = ts
                    .iter_mut()
                    .find(|t| t.name == "model.norm.weight")
                    .expect("norm");
                t.dtype = Dtype::I32;
            });
            vec![]
        },
    );
    add(
        "i32_fp8_scale",
        "deepseek_v3_fp8",
        &["model.layers.1.self_attn.o_proj.weight_scale_inv", "I32"],
        &|d| {
            edit_tensors(d, |ts| {
                let t = ts
                    .iter_mut()
                    .find(|t| t.name == "model.layers.1.self_attn.o_proj.weight_scale_inv")
                    .expect("scale");
                t.dtype = Dtype::I32;
            });
            vec![]
        },
    );
    add(
        "tensor_in_two_shards",
        "qwen3_moe",
        &["model.embed_tokens.weight", INDEX_FILE],
        &|d| {
            make_sharded(d, &[(1, "model.embed_tokens.weight")]);
            vec![shard_name(0, 2), shard_name(1, 2)]
        },
    );
    add(
        "shard_tensor_not_in_index",
        "qwen3",
        &["model.norm.weight", INDEX_FILE],
        &|d| {
            let mut map = make_sharded(d, &[]);
            let shard = map.remove("model.norm.weight").expect("listed");
            write_index(d, &map);
            vec![shard]
        },
    );
    add(
        "index_names_a_missing_file",
        "qwen3",
        &["model-00009-of-00009.safetensors", "does not exist"],
        &|d| {
            let mut map = make_sharded(d, &[]);
            map.insert(
                "model.norm.weight".into(),
                "model-00009-of-00009.safetensors".into(),
            );
            write_index(d, &map);
            vec![]
        },
    );
    add(
        "index_names_a_shard_lacking_the_tensor",
        "deepseek_v3",
        &["model.norm.weight", INDEX_FILE],
        &|d| {
            let mut map = make_sharded(d, &[]);
            let listed = map["model.norm.weight"].clone();
            let other = [shard_name(0, 2), shard_name(1, 2)]
                .into_iter()
                .find(|s| *s != listed)
                .expect("other shard");
            map.insert("model.norm.weight".into(), other.clone());
            write_index(d, &map);
            vec![other]
        },
    );
    add(
        "truncated_file",
        "deepseek_v3",
        &[SINGLE_FILE, "truncated"],
        &|d| {
            let path = d.join(SINGLE_FILE);
            let bytes = std::fs::read(&path).expect("read");
            std::fs::write(&path, &bytes[..bytes.len() / 2]).expect("truncate");
            vec![]
        },
    );
    add(
        "header_longer_than_file",
        "qwen3",
        &[SINGLE_FILE, "header length"],
        &|d| {
            let path = d.join(SINGLE_FILE);
            let mut bytes = std::fs::read(&path).expect("read");
            let claimed = bytes.len() as u64 * 2;
            bytes[..8].copy_from_slice(&claimed.to_le_bytes());
            std::fs::write(&path, bytes).expect("write");
            vec![]
        },
    );
    add(
        "absurd_header_length",
        "qwen3_moe",
        &[SINGLE_FILE, "header length"],
        &|d| {
            let path = d.join(SINGLE_FILE);
            let mut bytes = std::fs::read(&path).expect("read");
            bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
            std::fs::write(&path, bytes).expect("write");
            vec![]
        },
    );
    cases
}

/// The commands on one directory; returns a description of every broken expectation.
fn check_case(case: &Case, scratch: &Path, ids: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    std::fs::create_dir_all(scratch).expect("scratch");
    for (command, args) in commands(&case.dir, scratch, ids) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, text, elapsed) = run(&args, &scratch.join(command));
        let what = format!("{}: moe {command}", case.name);
        if ok {
            problems.push(format!("{what} succeeded:\n{text}"));
            continue;
        }
        if text.contains("panicked") {
            problems.push(format!("{what} panicked:\n{text}"));
        }
        if !text.contains("error: ") {
            problems.push(format!("{what}: no `error: ` line:\n{text}"));
        }
        for needle in &case.needles {
            if !text.contains(needle.as_str()) {
                problems.push(format!(
                    "{what}: output does not mention `{needle}`:\n{text}"
                ));
            }
        }
        if elapsed > QUICK {
            problems.push(format!("{what} took {elapsed:?}"));
        }
    }
    let dist = scratch.join("dist");
    if dist.join("latest").exists() {
        problems.push(format!(
            "{}: convert left {}",
            case.name,
            dist.join("latest").display()
        ));
    }
    let leftovers: Vec<_> = std::fs::read_dir(&dist)
        .map(|entries| entries.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    if !leftovers.is_empty() {
        problems.push(format!("{}: convert left {leftovers:?}", case.name));
    }
    for left in ["export", "logits.safetensors"] {
        if scratch.join(left).exists() {
            problems.push(format!("{}: {left} was written", case.name));
        }
    }
    problems
}

#[test]
fn every_command_rejects_every_broken_checkpoint() {
    let tmp = TempDir::new("corpus");
    let ids = tmp.join("ids.safetensors");
    ids_file(&ids);
    let root = tmp.join("cases");
    let cases = corpus(&root);

    // The harness itself works: an intact fixture passes every command.
    let good = tmp.join("good");
    copy_fixture("qwen3", &good);
    let scratch = tmp.join("good-out");
    std::fs::create_dir_all(&scratch).expect("scratch");
    for (command, args) in commands(&good, &scratch, &ids) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, text, _) = run(&args, &scratch.join(command));
        assert!(ok, "intact fixture: moe {command} failed:\n{text}");
        assert!(!text.contains("warning:"), "moe {command}: {text}");
    }

    let problems: Vec<String> = cases
        .iter()
        .flat_map(|case| check_case(case, &case.dir.with_extension("out"), &ids))
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

/// What transformers tolerates passes with a warning: unused tensors (a RoPE buffer, a layer
/// beyond `num_hidden_layers`) are reported and left out of the conversion and export.
#[test]
fn tolerated_extras_warn_and_are_left_out() {
    let tmp = TempDir::new("tolerated");
    let dir = tmp.join("src");
    copy_fixture("qwen3", &dir);
    edit_tensors(&dir, |ts| {
        let f: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        ts.push(
            OwnedTensor::new(
                "model.layers.0.self_attn.rotary_emb.inv_freq",
                Dtype::F32,
                vec![2],
                f.clone(),
            )
            .expect("inv_freq"),
        );
        ts.push(
            OwnedTensor::new(
                "model.layers.7.input_layernorm.weight",
                Dtype::F32,
                vec![2],
                f,
            )
            .expect("extra layer"),
        );
    });
    let scratch = tmp.join("out");
    std::fs::create_dir_all(&scratch).expect("scratch");
    let ids = tmp.join("ids.safetensors");
    ids_file(&ids);
    for (command, args) in commands(&dir, &scratch, &ids) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, text, _) = run(&args, &scratch.join(command));
        assert!(ok, "moe {command} failed:\n{text}");
        assert!(
            text.contains("warning: ")
                && text.contains("rotary_emb.inv_freq")
                && text.contains("model.layers.7.input_layernorm.weight"),
            "moe {command}: {text}"
        );
    }
    let converted = DistCheckpoint::open(scratch.join("dist")).expect("converted");
    let fqns = &converted.index().tensors;
    assert!(!fqns.contains_key("model.layers.7.input_layernorm.weight"));
    assert!(fqns.keys().all(|k| !k.contains("inv_freq")));
    let exported = HfCheckpoint::open(scratch.join("export")).expect("export");
    assert!(!exported.contains("model.layers.7.input_layernorm.weight"));
    assert!(!exported.contains("model.layers.0.self_attn.rotary_emb.inv_freq"));
    assert_eq!(
        exported.len(),
        HfCheckpoint::open(fixture("qwen3")).expect("src").len()
    );
}
