//! A corpus of broken HF checkpoints, generated from the fixtures (one defect each), run
//! through every command that reads one: `moe inspect`, `convert --from-hf`, `export --model`,
//! `logits`, `generate`, `logprobs`, `upcycle --from`, `train --model` and `plan --model
//! config.json` (the defects `plan` can see: it reads `config.json` only). Each must fail with
//! a non-zero exit within seconds, name the file / tensor / config field on stderr, never
//! panic, and leave no output behind (no `latest` or chunk in the `convert --out` root, no
//! export or upcycle directory, no temporary directory, no logits or log-probs file, no
//! training checkpoint, no generated tokens on stdout).
//!
//! The defects: invalid or contradictory `config.json` values, missing / mis-shaped / integer
//! weights, ambiguous shard sets, broken `model.safetensors.index.json` files, and truncated,
//! corrupt or hostile safetensors files (every way the header can lie about the data section;
//! trailing bytes after the last tensor are refused as the `safetensors` crate refuses them,
//! `MetadataIncompleteBuffer`).
//!
//! `MOE_BAD_INPUTS_VERBOSE=1 cargo test --test bad_inputs -- --nocapture` prints every message.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use burn_moe::bridge::dist::DistCheckpoint;
use burn_moe::bridge::hf::{CONFIG_FILE, HfCheckpoint, INDEX_FILE, SINGLE_FILE};
use burn_moe::bridge::safetensors::{Dtype, OwnedTensor, TensorView, write_safetensors};
use burn_moe::models::hf::ModelConfig;
use serde_json::{Map, Value, json};

/// Longest a failing command may run before it counts as hung (and is killed).
const DEADLINE: Duration = Duration::from_secs(20);
/// What "within a few seconds" means for one failing command.
const QUICK: Duration = Duration::from_secs(5);
/// Cases checked at once.
const WORKERS: usize = 4;

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
    let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join(INDEX_FILE), index.to_string()).expect("write index");
}

/// The header (as a JSON object) and the data section of the safetensors file at `path`.
fn read_raw(path: &Path) -> (Map<String, Value>, Vec<u8>) {
    let bytes = std::fs::read(path).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("prefix")) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    (header, bytes[8 + n..].to_vec())
}

/// Writes a safetensors file of header bytes `header` (space-padded to 8 bytes) and `data`,
/// whatever they hold.
fn write_raw(path: &Path, header: &[u8], data: &[u8]) {
    let mut header = header.to_vec();
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).expect("write raw");
}

/// Applies `edit` to the header JSON of `dir`'s `file`, keeping its data section.
fn edit_header(dir: &Path, file: &str, edit: impl FnOnce(&mut Map<String, Value>)) {
    let path = dir.join(file);
    let (mut header, data) = read_raw(&path);
    edit(&mut header);
    write_raw(&path, Value::Object(header).to_string().as_bytes(), &data);
}

/// Replaces the header of `dir`'s `model.safetensors` by the bytes `header`.
fn replace_header(dir: &Path, header: &[u8]) {
    let path = dir.join(SINGLE_FILE);
    let (_, data) = read_raw(&path);
    write_raw(&path, header, &data);
}

/// Sets field `key` of tensor `tensor`'s header entry in `dir`'s `model.safetensors`.
fn edit_entry(dir: &Path, tensor: &str, key: &str, value: Value) {
    edit_header(dir, SINGLE_FILE, |h| {
        h[tensor][key] = value;
    });
}

/// The `[begin, end)` data offsets of `tensor` in `dir`'s `model.safetensors`.
fn offsets(dir: &Path, tensor: &str) -> (u64, u64) {
    let (header, _) = read_raw(&dir.join(SINGLE_FILE));
    let o = &header[tensor]["data_offsets"];
    (o[0].as_u64().expect("begin"), o[1].as_u64().expect("end"))
}

/// The `model_type` of a fixture.
fn model_type(fixture_name: &str) -> String {
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(fixture_name).join(CONFIG_FILE)).expect("config"),
    )
    .expect("json");
    config["model_type"]
        .as_str()
        .expect("model_type")
        .to_owned()
}

/// Where a case's defect lies, hence which commands can see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// `config.json` alone is invalid: every command, `plan` included, reads it.
    Config,
    /// The weight files, the index, or their agreement with a valid `config.json`.
    Weights,
}

/// A broken checkpoint and what its error must mention.
struct Case {
    name: &'static str,
    fixture: &'static str,
    scope: Scope,
    dir: PathBuf,
    needles: Vec<String>,
}

/// The commands that read an HF checkpoint directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    Inspect,
    Convert,
    Export,
    Logits,
    Generate,
    Logprobs,
    Upcycle,
    Train,
    Plan,
}

impl Cmd {
    const ALL: [Cmd; 9] = [
        Cmd::Inspect,
        Cmd::Convert,
        Cmd::Export,
        Cmd::Logits,
        Cmd::Generate,
        Cmd::Logprobs,
        Cmd::Upcycle,
        Cmd::Train,
        Cmd::Plan,
    ];

    fn name(self) -> &'static str {
        match self {
            Cmd::Inspect => "inspect",
            Cmd::Convert => "convert",
            Cmd::Export => "export",
            Cmd::Logits => "logits",
            Cmd::Generate => "generate",
            Cmd::Logprobs => "logprobs",
            Cmd::Upcycle => "upcycle",
            Cmd::Train => "train",
            Cmd::Plan => "plan",
        }
    }

    /// The command line on `dir`, with every output under `scratch`.
    fn args(self, dir: &Path, scratch: &Path, ids: &Path) -> Vec<String> {
        let s = |p: &Path| p.display().to_string();
        let out = |name: &str| s(&scratch.join(name));
        let args: Vec<String> = match self {
            Cmd::Inspect => vec!["inspect".into(), s(dir)],
            Cmd::Convert => vec![
                "convert".into(),
                "--from-hf".into(),
                s(dir),
                "--out".into(),
                out("dist"),
                "--layout".into(),
                "world=1".into(),
            ],
            Cmd::Export => vec![
                "export".into(),
                "--model".into(),
                s(dir),
                "--out".into(),
                out("export"),
            ],
            Cmd::Logits => vec![
                "logits".into(),
                "--model".into(),
                s(dir),
                "--input".into(),
                s(ids),
                "--out".into(),
                out("logits.safetensors"),
            ],
            Cmd::Generate => vec![
                "generate".into(),
                "--model".into(),
                s(dir),
                "--prompt-ids".into(),
                "1,2,3".into(),
                "--max-new-tokens".into(),
                "2".into(),
            ],
            Cmd::Logprobs => vec![
                "logprobs".into(),
                "--model".into(),
                s(dir),
                "--input".into(),
                s(ids),
                "--out".into(),
                out("logprobs.safetensors"),
            ],
            Cmd::Upcycle => vec![
                "upcycle".into(),
                "--from".into(),
                s(dir),
                "--out".into(),
                out("upcycle"),
                "--experts".into(),
                "4".into(),
                "--topk".into(),
                "2".into(),
            ],
            Cmd::Train => vec![
                "train".into(),
                "--model".into(),
                s(dir),
                "--data".into(),
                s(ids),
                "--steps".into(),
                "1".into(),
                "--gbs".into(),
                "1".into(),
                "--transport".into(),
                "threads".into(),
                "--save".into(),
                out("train"),
            ],
            Cmd::Plan => vec![
                "plan".into(),
                "--model".into(),
                s(&dir.join(CONFIG_FILE)),
                "--gpus".into(),
                "1".into(),
            ],
        };
        args
    }

    /// Why the command legitimately does not see a defect of `scope` (the pairing is skipped
    /// and reported), or `None` when it must reject it.
    fn blind_to(self, scope: Scope) -> Option<&'static str> {
        match (self, scope) {
            (Cmd::Plan, Scope::Weights) => {
                Some("`plan` reads config.json only, and this config.json is valid")
            }
            _ => None,
        }
    }

    /// The clear refusal of an intact checkpoint of `model_type` the command does not run
    /// (a needle of its message), or `None` when it runs it.
    fn refuses(self, model_type: &str) -> Option<&'static str> {
        match (self, model_type) {
            (Cmd::Upcycle, t) if t != "qwen3" => {
                Some("upcycling needs a dense \"qwen3\" checkpoint")
            }
            (Cmd::Plan, "qwen3") => Some("needs an MoE model"),
            _ => None,
        }
    }
}

/// How a command ended.
struct Outcome {
    /// Exit code (`None`: killed by a signal, or past [`DEADLINE`]).
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
    timed_out: bool,
}

impl Outcome {
    fn text(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Runs `moe args…` to completion, killed past [`DEADLINE`]; `logs` is the stem of the files
/// receiving stdout and stderr.
fn run(args: &[String], logs: &Path) -> Outcome {
    let out_path = logs.with_extension("out");
    let err_path = logs.with_extension("err");
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_moe"))
        .args(args)
        .env("RUST_LOG", "warn")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(File::create(&out_path).expect("stdout file"))
        .stderr(File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("run the moe binary");
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            timed_out = true;
            break child.wait().expect("wait");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Outcome {
        code: if timed_out { None } else { status.code() },
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
        elapsed: started.elapsed(),
        timed_out,
    }
}

/// An `input_ids` file `[1, 4]` for `moe logits`, `logprobs` and `train --data`.
fn ids_file(path: &Path) {
    let ids: Vec<u8> = [1i64, 7, 42, 3]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let t = OwnedTensor::new("input_ids", Dtype::I64, vec![1, 4], ids).expect("ids");
    write_file(path, &[t]);
}

/// Builds the corpus under `root`.
fn corpus(root: &Path) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut add = |name: &'static str,
                   fixture_name: &'static str,
                   scope: Scope,
                   needles: &[&str],
                   edit: &dyn Fn(&Path) -> Vec<String>| {
        // Not the case name: a needle must never match the directory's own path.
        let dir = root.join(format!("c{:02}", cases.len()));
        copy_fixture(fixture_name, &dir);
        let mut needles: Vec<String> = needles.iter().map(|s| (*s).to_owned()).collect();
        needles.extend(edit(&dir));
        cases.push(Case {
            name,
            fixture: fixture_name,
            scope,
            dir,
            needles,
        });
    };
    use Scope::{Config, Weights};

    // config.json on its own.
    add(
        "config_wrong_json_type",
        "qwen3_moe",
        Config,
        &["config.json", "hidden_size"],
        &|d| {
            edit_config(d, "hidden_size", Value::from("64"));
            vec![]
        },
    );
    add(
        "config_wrong_json_type_deepseek",
        "deepseek_v3",
        Config,
        &["config.json", "n_group"],
        &|d| {
            edit_config(d, "n_group", Value::from(2.5));
            vec![]
        },
    );
    add(
        "config_not_json",
        "qwen3",
        Config,
        &["config.json", "EOF while parsing"],
        &|d| {
            std::fs::write(d.join(CONFIG_FILE), "{\"model_type\": \"qwen3\",").expect("write");
            vec![]
        },
    );
    add(
        "config_missing",
        "qwen3_moe",
        Config,
        &["config.json"],
        &|d| {
            std::fs::remove_file(d.join(CONFIG_FILE)).expect("rm config");
            vec![]
        },
    );
    add(
        "topk_above_experts",
        "qwen3_moe",
        Config,
        &["config.json", "num_experts_per_tok"],
        &|d| {
            edit_config(d, "num_experts_per_tok", Value::from(9));
            vec![]
        },
    );
    add(
        "topk_above_experts_deepseek",
        "deepseek_v3",
        Config,
        &["config.json", "num_experts_per_tok"],
        &|d| {
            edit_config(d, "num_experts_per_tok", Value::from(9));
            vec![]
        },
    );
    add(
        "zero_attention_heads",
        "qwen3",
        Config,
        &["config.json", "num_attention_heads"],
        &|d| {
            edit_config(d, "num_attention_heads", Value::from(0));
            vec![]
        },
    );

    // The weights against a valid config.
    add(
        "config_contradicts_weights",
        "qwen3_moe",
        Weights,
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
        "config_contradicts_weights_dense",
        "qwen3",
        Weights,
        &[
            "config.json",
            "model.safetensors",
            "model.layers.0.mlp.down_proj.weight",
        ],
        &|d| {
            edit_config(d, "intermediate_size", Value::from(96));
            vec![]
        },
    );
    add(
        "missing_dense_weight",
        "qwen3",
        Weights,
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
        Weights,
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
        "mis_shaped_dense_weight",
        "qwen3",
        Weights,
        &["model.layers.0.mlp.up_proj.weight", "[32, 128]"],
        &|d| {
            edit_tensors(d, |ts| {
                let t = ts
                    .iter_mut()
                    .find(|t| t.name == "model.layers.0.mlp.up_proj.weight")
                    .expect("up_proj");
                t.shape = vec![32, 128];
            });
            vec![]
        },
    );
    add(
        "i32_weight",
        "qwen3_moe",
        Weights,
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
        "i32_dense_mlp_weight",
        "qwen3",
        Weights,
        &["model.layers.1.mlp.gate_proj.weight", "I32"],
        &|d| {
            edit_tensors(d, |ts| {
                let t = ts
                    .iter_mut()
                    .find(|t| t.name == "model.layers.1.mlp.gate_proj.weight")
                    .expect("gate_proj");
                t.dtype = Dtype::I32;
            });
            vec![]
        },
    );
    add(
        "i32_fp8_scale",
        "deepseek_v3_fp8",
        Weights,
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

    // Ambiguous shard sets.
    add(
        "tensor_in_two_shards",
        "qwen3_moe",
        Weights,
        &["model.embed_tokens.weight", INDEX_FILE],
        &|d| {
            make_sharded(d, &[(1, "model.embed_tokens.weight")]);
            vec![shard_name(0, 2), shard_name(1, 2)]
        },
    );
    add(
        "tensor_in_two_shards_dense",
        "qwen3",
        Weights,
        &["model.norm.weight", INDEX_FILE],
        &|d| {
            make_sharded(d, &[(0, "model.norm.weight")]);
            vec![shard_name(0, 2), shard_name(1, 2)]
        },
    );
    add(
        "shard_tensor_not_in_index",
        "qwen3",
        Weights,
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
        Weights,
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
        Weights,
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

    // Broken indices.
    add(
        "index_not_json",
        "qwen3",
        Weights,
        &[INDEX_FILE, "invalid safetensors index"],
        &|d| {
            make_sharded(d, &[]);
            std::fs::write(d.join(INDEX_FILE), "{\"weight_map\": {\"a\": ").expect("write");
            vec![]
        },
    );
    add(
        "index_without_weight_map",
        "qwen3_moe",
        Weights,
        &[INDEX_FILE, "weight_map"],
        &|d| {
            make_sharded(d, &[]);
            let index = json!({"metadata": {"total_size": 0}});
            std::fs::write(d.join(INDEX_FILE), index.to_string()).expect("write");
            vec![]
        },
    );
    add(
        "index_weight_map_not_an_object",
        "deepseek_v3",
        Weights,
        // Described, not dumped (a real weight_map is megabytes).
        &[INDEX_FILE, "`weight_map` is an array of"],
        &|d| {
            let map = make_sharded(d, &[]);
            let pairs: Vec<Value> = map.iter().map(|(t, s)| json!([t, s])).collect();
            let index = json!({"weight_map": pairs});
            std::fs::write(d.join(INDEX_FILE), index.to_string()).expect("write");
            vec![]
        },
    );
    add(
        "index_shard_not_a_string",
        "qwen3",
        Weights,
        &[INDEX_FILE, "model.norm.weight", "not a string"],
        &|d| {
            let map = make_sharded(d, &[]);
            let mut index = json!({"weight_map": map});
            index["weight_map"]["model.norm.weight"] = json!(2);
            std::fs::write(d.join(INDEX_FILE), index.to_string()).expect("write");
            vec![]
        },
    );
    add(
        "index_shard_outside_the_directory",
        "qwen3_moe",
        Weights,
        &[
            INDEX_FILE,
            "model.norm.weight",
            "../x.safetensors",
            "plain file name",
        ],
        &|d| {
            let mut map = make_sharded(d, &[]);
            // A real file there: it must be refused, not read.
            let parent = d.parent().expect("parent");
            std::fs::copy(
                d.join(&map["model.norm.weight"]),
                parent.join("x.safetensors"),
            )
            .expect("copy");
            map.insert("model.norm.weight".into(), "../x.safetensors".into());
            write_index(d, &map);
            vec![]
        },
    );
    add(
        "index_lists_no_tensors",
        "deepseek_v3",
        Weights,
        &[INDEX_FILE, "weight_map", "no tensors"],
        &|d| {
            make_sharded(d, &[]);
            write_index(d, &BTreeMap::new());
            vec![]
        },
    );

    // Truncated and corrupt safetensors files.
    add(
        "truncated_file",
        "deepseek_v3",
        Weights,
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
        Weights,
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
        Weights,
        &[SINGLE_FILE, "header length"],
        &|d| {
            let path = d.join(SINGLE_FILE);
            let mut bytes = std::fs::read(&path).expect("read");
            bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
            std::fs::write(&path, bytes).expect("write");
            vec![]
        },
    );
    add(
        "zero_length_file",
        "qwen3",
        Weights,
        &[SINGLE_FILE, "0 bytes"],
        &|d| {
            std::fs::write(d.join(SINGLE_FILE), b"").expect("write");
            vec![]
        },
    );
    add(
        "eight_byte_file",
        "deepseek_v3",
        Weights,
        &[SINGLE_FILE, "truncated", "header length"],
        &|d| {
            let path = d.join(SINGLE_FILE);
            let bytes = std::fs::read(&path).expect("read");
            std::fs::write(&path, &bytes[..8]).expect("write");
            vec![]
        },
    );
    add(
        "trailing_garbage",
        "qwen3_moe",
        Weights,
        &[SINGLE_FILE, "belong to no tensor"],
        &|d| {
            let path = d.join(SINGLE_FILE);
            let mut bytes = std::fs::read(&path).expect("read");
            bytes.extend_from_slice(&[0x5a; 24]);
            std::fs::write(&path, bytes).expect("write");
            vec![]
        },
    );

    // Hostile headers.
    add(
        "header_not_json",
        "qwen3",
        Weights,
        &[SINGLE_FILE, "not a valid JSON object"],
        &|d| {
            replace_header(d, b"{\"model.norm.weight\": {\"dtype\": F32");
            vec![]
        },
    );
    add(
        "header_not_utf8",
        "qwen3_moe",
        Weights,
        &[SINGLE_FILE, "UTF-8"],
        &|d| {
            replace_header(d, b"{\"model.norm.\xff\xfeweight\": {}}");
            vec![]
        },
    );
    add(
        "header_is_an_array",
        "deepseek_v3",
        Weights,
        &[SINGLE_FILE, "not a valid JSON object"],
        &|d| {
            replace_header(d, b"[{\"dtype\": \"F32\"}]");
            vec![]
        },
    );
    add(
        "duplicate_tensor_name",
        "qwen3",
        Weights,
        &[SINGLE_FILE, "model.norm.weight", "more than once"],
        &|d| {
            let (header, data) = read_raw(&d.join(SINGLE_FILE));
            let entry = header["model.norm.weight"].to_string();
            let text = Value::Object(header).to_string();
            let text = format!(
                "{},\"model.norm.weight\":{entry}}}",
                text.strip_suffix('}').expect("object")
            );
            write_raw(&d.join(SINGLE_FILE), text.as_bytes(), &data);
            vec![]
        },
    );
    add(
        "overlapping_data_offsets",
        "deepseek_v3",
        Weights,
        &[
            SINGLE_FILE,
            "model.norm.weight",
            "model.layers.0.input_layernorm.weight",
            "overlap",
        ],
        &|d| {
            // Same dtype and shape [64]: only the position lies.
            let (b, e) = offsets(d, "model.layers.0.input_layernorm.weight");
            edit_entry(d, "model.norm.weight", "data_offsets", json!([b, e]));
            vec![]
        },
    );
    add(
        "data_offsets_past_the_data_section",
        "qwen3",
        Weights,
        &[SINGLE_FILE, "model.norm.weight", "past the data section"],
        &|d| {
            let (b, e) = offsets(d, "model.norm.weight");
            let len = std::fs::metadata(d.join(SINGLE_FILE)).expect("len").len();
            edit_entry(
                d,
                "model.norm.weight",
                "data_offsets",
                json!([b + len, e + len]),
            );
            vec![]
        },
    );
    add(
        "data_offsets_reversed",
        "qwen3_moe",
        Weights,
        &[SINGLE_FILE, "model.norm.weight", "end before they begin"],
        &|d| {
            let (b, e) = offsets(d, "model.norm.weight");
            edit_entry(d, "model.norm.weight", "data_offsets", json!([e, b]));
            vec![]
        },
    );
    add(
        "data_offsets_not_shape_times_dtype",
        "qwen3_moe",
        Weights,
        &[SINGLE_FILE, "model.norm.weight", "needs 128 bytes"],
        &|d| {
            edit_entry(d, "model.norm.weight", "shape", json!([32]));
            vec![]
        },
    );
    add(
        "shape_product_overflows",
        "deepseek_v3",
        Weights,
        &[SINGLE_FILE, "model.norm.weight", "overflows"],
        &|d| {
            edit_entry(
                d,
                "model.norm.weight",
                "shape",
                json!([4_294_967_296u64, 4_294_967_296u64, 16]),
            );
            vec![]
        },
    );
    add(
        "unknown_dtype",
        "qwen3",
        Weights,
        &[SINGLE_FILE, "model.norm.weight", "\"Q4\""],
        &|d| {
            edit_entry(d, "model.norm.weight", "dtype", json!("Q4"));
            vec![]
        },
    );
    add(
        "negative_dimension",
        "qwen3_moe",
        Weights,
        &[SINGLE_FILE, "model.norm.weight", "-64"],
        &|d| {
            edit_entry(d, "model.norm.weight", "shape", json!([-64]));
            vec![]
        },
    );
    add(
        "non_integer_dimension",
        "deepseek_v3",
        Weights,
        &[SINGLE_FILE, "model.norm.weight", "64.5"],
        &|d| {
            edit_entry(d, "model.norm.weight", "shape", json!([64.5]));
            vec![]
        },
    );
    add(
        "entry_without_data_offsets",
        "qwen3",
        Weights,
        &[SINGLE_FILE, "model.norm.weight", "data_offsets"],
        &|d| {
            edit_header(d, SINGLE_FILE, |h| {
                h["model.norm.weight"]
                    .as_object_mut()
                    .expect("entry")
                    .remove("data_offsets");
            });
            vec![]
        },
    );
    add(
        "metadata_value_not_a_string",
        "qwen3",
        Weights,
        &[SINGLE_FILE, "__metadata__", "\"format\""],
        &|d| {
            edit_header(d, SINGLE_FILE, |h| {
                h.insert("__metadata__".into(), json!({"format": 1}));
            });
            vec![]
        },
    );
    add(
        "metadata_not_an_object",
        "qwen3_moe",
        Weights,
        &[SINGLE_FILE, "__metadata__"],
        &|d| {
            edit_header(d, SINGLE_FILE, |h| {
                h.insert("__metadata__".into(), json!(["pt"]));
            });
            vec![]
        },
    );
    add(
        "hostile_header_in_one_shard",
        "deepseek_v3_sharded",
        Weights,
        &["model-00007-of-00013.safetensors", "unsupported dtype"],
        &|d| {
            let file = "model-00007-of-00013.safetensors";
            let (header, _) = read_raw(&d.join(file));
            let tensor = header
                .keys()
                .find(|k| *k != "__metadata__")
                .expect("a tensor")
                .clone();
            edit_header(d, file, |h| {
                h[&tensor]["dtype"] = json!("F4_E9M9");
            });
            vec![tensor]
        },
    );
    cases
}

/// What one `moe` run on a broken input got wrong, if anything.
fn judge(what: &str, outcome: &Outcome, needles: &[String], problems: &mut Vec<String>) {
    let text = outcome.text();
    if std::env::var_os("MOE_BAD_INPUTS_VERBOSE").is_some() {
        eprintln!(
            "{what}: exit {:?}\n{}",
            outcome.code,
            outcome.stderr.trim_end()
        );
    }
    if outcome.timed_out {
        problems.push(format!("{what} still running after {DEADLINE:?}:\n{text}"));
        return;
    }
    match outcome.code {
        Some(0) => {
            problems.push(format!("{what} succeeded:\n{text}"));
            return;
        }
        Some(101) | None => {
            problems.push(format!("{what} crashed (exit {:?}):\n{text}", outcome.code))
        }
        Some(_) => {}
    }
    if text.contains("panicked") {
        problems.push(format!("{what} panicked:\n{text}"));
    }
    if !outcome.stderr.contains("error: ") {
        problems.push(format!("{what}: no `error: ` line:\n{text}"));
    }
    for needle in needles {
        if !outcome.stderr.contains(needle.as_str()) {
            problems.push(format!(
                "{what}: the error does not mention `{needle}`:\n{text}"
            ));
        }
    }
    if outcome.elapsed > QUICK {
        problems.push(format!("{what} took {:?}", outcome.elapsed));
    }
}

/// What a failed run left in `scratch` beyond its logs (`*.out`, `*.err`): only an empty
/// `convert --out` or `train --save` root may remain.
fn leftovers(scratch: &Path) -> Vec<PathBuf> {
    let mut left = Vec::new();
    for entry in std::fs::read_dir(scratch).expect("scratch").flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".out") || name.ends_with(".err") {
            continue;
        }
        let empty_root = (name == "dist" || name == "train")
            && std::fs::read_dir(&path).is_ok_and(|mut d| d.next().is_none());
        if !empty_root {
            left.push(path);
        }
    }
    left
}

/// Every command on one case; returns a description of every broken expectation and the
/// pairings skipped (with the reason).
fn check_case(case: &Case, ids: &Path) -> (Vec<String>, Vec<String>) {
    let scratch = case.dir.with_extension("out");
    std::fs::create_dir_all(&scratch).expect("scratch");
    let (mut problems, mut skipped) = (Vec::new(), Vec::new());
    for cmd in Cmd::ALL {
        let what = format!("{}: moe {}", case.name, cmd.name());
        if let Some(why) = cmd.blind_to(case.scope) {
            skipped.push(format!("{what}: {why}"));
            continue;
        }
        let outcome = run(
            &cmd.args(&case.dir, &scratch, ids),
            &scratch.join(cmd.name()),
        );
        judge(&what, &outcome, &case.needles, &mut problems);
        if cmd == Cmd::Generate && !outcome.stdout.trim().is_empty() {
            problems.push(format!("{what} printed tokens: {}", outcome.stdout));
        }
    }
    let left = leftovers(&scratch);
    if !left.is_empty() {
        problems.push(format!("{}: output left behind: {left:?}", case.name));
    }
    (problems, skipped)
}

/// Runs `check` on every case, [`WORKERS`] at a time; the problems of all cases.
fn check_all<T: Sync>(items: &[T], check: impl Fn(&T) -> Vec<String> + Sync) -> Vec<String> {
    let next = AtomicUsize::new(0);
    let results: Vec<Vec<String>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..WORKERS)
            .map(|_| {
                s.spawn(|| {
                    let mut problems = Vec::new();
                    while let Some(item) = items.get(next.fetch_add(1, Ordering::Relaxed)) {
                        problems.extend(check(item));
                    }
                    problems
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .collect()
    });
    results.concat()
}

/// The harness itself works: every intact fixture the corpus starts from passes every
/// command that runs its model type, and the others refuse it clearly.
fn check_intact(fixtures: &[&'static str], tmp: &TempDir, ids: &Path) -> Vec<String> {
    check_all(fixtures, |name| {
        let mut problems = Vec::new();
        let dir = tmp.join(&format!("good-{name}"));
        copy_fixture(name, &dir);
        let scratch = tmp.join(&format!("good-{name}-out"));
        std::fs::create_dir_all(&scratch).expect("scratch");
        let model_type = model_type(name);
        for cmd in Cmd::ALL {
            let outcome = run(&cmd.args(&dir, &scratch, ids), &scratch.join(cmd.name()));
            let what = format!("intact {name}: moe {}", cmd.name());
            match cmd.refuses(&model_type) {
                Some(needle) => {
                    judge(&what, &outcome, &[needle.to_owned()], &mut problems);
                }
                None if outcome.code != Some(0) => {
                    problems.push(format!("{what} failed:\n{}", outcome.text()));
                }
                None if outcome.stderr.contains("warning:") => {
                    problems.push(format!("{what} warned:\n{}", outcome.text()));
                }
                None => {}
            }
        }
        problems
    })
}

#[test]
fn every_command_rejects_every_broken_checkpoint() {
    let started = Instant::now();
    let tmp = TempDir::new("corpus");
    let ids = tmp.join("ids.safetensors");
    ids_file(&ids);
    let cases = corpus(&tmp.join("cases"));

    let mut fixtures: Vec<&'static str> = cases.iter().map(|c| c.fixture).collect();
    fixtures.sort_unstable();
    fixtures.dedup();
    let mut problems = check_intact(&fixtures, &tmp, &ids);

    let skipped = std::sync::Mutex::new(Vec::new());
    problems.extend(check_all(&cases, |case| {
        let (problems, skips) = check_case(case, &ids);
        skipped.lock().expect("lock").extend(skips);
        problems
    }));
    // Every pairing not run is listed with its reason, never dropped silently.
    let skipped = skipped.into_inner().expect("lock");
    let config_cases = cases.iter().filter(|c| c.scope == Scope::Config).count();
    assert_eq!(skipped.len(), cases.len() - config_cases, "{skipped:#?}");
    eprintln!(
        "{} cases × {} commands ({} pairings skipped: `plan` on defects outside \
         config.json) in {:?}",
        cases.len(),
        Cmd::ALL.len(),
        skipped.len(),
        started.elapsed()
    );
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
    for cmd in [Cmd::Inspect, Cmd::Convert, Cmd::Export, Cmd::Logits] {
        let outcome = run(&cmd.args(&dir, &scratch, &ids), &scratch.join(cmd.name()));
        let text = outcome.text();
        assert_eq!(outcome.code, Some(0), "moe {} failed:\n{text}", cmd.name());
        assert!(
            text.contains("warning: ")
                && text.contains("rotary_emb.inv_freq")
                && text.contains("model.layers.7.input_layernorm.weight"),
            "moe {}: {text}",
            cmd.name()
        );
    }
    let converted = DistCheckpoint::open::<ModelConfig>(scratch.join("dist")).expect("converted");
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
