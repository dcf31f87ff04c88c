//! A corpus of broken distributed checkpoints, generated from valid ones (one defect each), run
//! through every command that reads one: `moe validate`, `moe reshard`, `moe export`
//! (distributed → HF), `moe train --model ROOT` (one rank, and two ranks that must both stop)
//! and `moe train --save ROOT --resume`. Each must fail with a non-zero exit within seconds,
//! name the broken file / tensor / field on stderr, never panic, never report the checkpoint
//! valid, and leave nothing behind: no `latest` or `iter_*` in the `reshard --out` root, no
//! export directory, no temporary directory, no training checkpoint, and the resumed root as it
//! was.
//!
//! The valid checkpoints: a conversion of the Qwen3-MoE fixture under `world=4,tp=2,ep=4`
//! (model only), a training save of it under `ep=2` (optimizer state and `train_state`), and a
//! conversion of the DeepSeek-V3 FP8 fixture keeping FP8 weights and block scales. The defects
//! are the ways a real save fails or a real file rots: a missing `.complete`, a missing,
//! truncated or corrupt chunk file, a chunk file lacking a tensor or its DCP metadata, an index
//! that is not JSON, names a missing file, or contradicts the files (offsets, shapes, dtypes),
//! chunks that do not tile their tensor (gap, overlap), a `latest` naming nothing, the metadata
//! of another model (config.json, `model_family`), broken FP8 scale records and a corrupt
//! `train_state`.
//!
//! `MOE_BAD_INPUTS_VERBOSE=1 cargo test --test bad_dist_checkpoints -- --nocapture` prints every
//! message.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

/// Longest a failing command may run before it counts as hung (and is killed).
const DEADLINE: Duration = Duration::from_secs(30);
/// What "within a few seconds" means for one failing command.
const QUICK: Duration = Duration::from_secs(8);
/// Cases checked at once.
const WORKERS: usize = 4;
const INDEX: &str = "moe_dcp.index.json";
/// Why `moe export` legitimately succeeds on a checkpoint whose optimizer state alone is broken.
const EXPORT_SKIPS_OPTIMIZER_STATE: &str =
    "`export` writes the model weights only; it does not read the optimizer state";

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
        let dir = std::env::temp_dir().join(format!(
            "burn-moe-bad-dist-{tag}-{}-{nanos}",
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

/// Copies the directory tree `from` to `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read dir").flatten() {
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy");
        }
    }
}

/// Every file under `dir` (relative path → contents), to compare a tree before and after.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                out.insert(path.strip_prefix(base).expect("prefix").into(), Vec::new());
                walk(base, &path, out);
            } else {
                let bytes = std::fs::read(&path).unwrap_or_default();
                out.insert(path.strip_prefix(base).expect("prefix").into(), bytes);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
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

/// Runs `moe args…`, which must succeed.
fn moe_ok(args: &[&str], logs: &Path) {
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    let outcome = run(&args, logs);
    assert_eq!(
        outcome.code,
        Some(0),
        "moe {args:?} failed:\n{}",
        outcome.text()
    );
}

/// A valid checkpoint root the cases start from.
struct Source {
    name: &'static str,
    /// The HF fixture it was made from (the `--model` of `train --resume`).
    fixture: &'static str,
    root: PathBuf,
    /// Its `iter_*` directory name.
    iter: &'static str,
    /// Its step (`train` runs to `step + 1`).
    step: usize,
}

impl Source {
    fn iter_dir(&self, root: &Path) -> PathBuf {
        root.join(self.iter)
    }
}

/// The three valid checkpoints, made under `dir`.
fn sources(dir: &Path) -> Vec<Source> {
    std::fs::create_dir_all(dir).expect("mkdir");
    let logs = dir.join("make");
    let s = |p: &Path| p.display().to_string();
    let converted = dir.join("converted");
    moe_ok(
        &[
            "convert",
            "--from-hf",
            &s(&fixture("qwen3_moe")),
            "--out",
            &s(&converted),
            "--layout",
            "world=4,tp=2,ep=4",
        ],
        &logs,
    );
    let trained = dir.join("trained");
    moe_ok(
        &[
            "train",
            "--model",
            &s(&fixture("qwen3_moe")),
            "--layout",
            "ep=2",
            "--steps",
            "1",
            "--gbs",
            "2",
            "--seq-len",
            "8",
            "--transport",
            "threads",
            "--save",
            &s(&trained),
        ],
        &logs,
    );
    let fp8 = dir.join("fp8");
    moe_ok(
        &[
            "convert",
            "--from-hf",
            &s(&fixture("deepseek_v3_fp8")),
            "--out",
            &s(&fp8),
            "--layout",
            "world=2,ep=2",
        ],
        &logs,
    );
    vec![
        Source {
            name: "converted",
            fixture: "qwen3_moe",
            root: converted,
            iter: "iter_0000000",
            step: 0,
        },
        Source {
            name: "trained",
            fixture: "qwen3_moe",
            root: trained,
            iter: "iter_0000001",
            step: 1,
        },
        Source {
            name: "fp8",
            fixture: "deepseek_v3_fp8",
            root: fp8,
            iter: "iter_0000000",
            step: 0,
        },
    ]
}

/// The commands that read a distributed checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    Validate,
    Reshard,
    Export,
    /// `train --model ROOT` on one rank.
    Train,
    /// `train --model ROOT --layout ep=2`: two ranks, of which any may meet the defect.
    TrainRanks,
    /// `train --model <fixture> --save ROOT --resume`.
    Resume,
}

impl Cmd {
    const ALL: [Cmd; 6] = [
        Cmd::Validate,
        Cmd::Reshard,
        Cmd::Export,
        Cmd::Train,
        Cmd::TrainRanks,
        Cmd::Resume,
    ];

    fn name(self) -> &'static str {
        match self {
            Cmd::Validate => "validate",
            Cmd::Reshard => "reshard",
            Cmd::Export => "export",
            Cmd::Train => "train",
            Cmd::TrainRanks => "train-ep2",
            Cmd::Resume => "train-resume",
        }
    }

    /// The command line on checkpoint root `root` (made from `source`), outputs under
    /// `scratch`.
    fn args(self, source: &Source, root: &Path, scratch: &Path) -> Vec<String> {
        let s = |p: &Path| p.display().to_string();
        let steps = (source.step + 1).to_string();
        let train = |model: String, layout: &str, save: String, resume: bool| {
            let mut args = vec![
                "train".to_owned(),
                "--model".to_owned(),
                model,
                "--layout".to_owned(),
                layout.to_owned(),
                "--steps".to_owned(),
                steps.clone(),
                "--gbs".to_owned(),
                "2".to_owned(),
                "--seq-len".to_owned(),
                "8".to_owned(),
                "--transport".to_owned(),
                "threads".to_owned(),
                "--comm-timeout".to_owned(),
                "20".to_owned(),
                "--save".to_owned(),
                save,
            ];
            if resume {
                args.push("--resume".to_owned());
            }
            args
        };
        match self {
            Cmd::Validate => vec!["validate".into(), s(root)],
            Cmd::Reshard => vec![
                "reshard".into(),
                s(root),
                "--out".into(),
                s(&scratch.join("reshard")),
                "--layout".into(),
                "world=2,ep=2".into(),
            ],
            Cmd::Export => vec![
                "export".into(),
                s(root),
                "--out".into(),
                s(&scratch.join("export")),
            ],
            Cmd::Train => train(s(root), "", s(&scratch.join("train")), false),
            Cmd::TrainRanks => train(s(root), "ep=2", s(&scratch.join("train-ep2")), false),
            Cmd::Resume => train(s(&fixture(source.fixture)), "", s(root), true),
        }
    }
}

/// A broken checkpoint and what its errors must mention.
struct Case {
    name: &'static str,
    source: usize,
    root: PathBuf,
    needles: Vec<String>,
    /// Commands that legitimately do not read the broken part, with the reason.
    blind: Vec<(Cmd, &'static str)>,
}

/// The index of the checkpoint under `iter`.
fn read_index(iter: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(iter.join(INDEX)).expect("index")).expect("json")
}

fn write_index(iter: &Path, index: &Value) {
    std::fs::write(iter.join(INDEX), index.to_string()).expect("write index");
}

/// Applies `edit` to the index of `iter`.
fn edit_index(iter: &Path, edit: impl FnOnce(&mut Value)) {
    let mut index = read_index(iter);
    edit(&mut index);
    write_index(iter, &index);
}

/// The header (as a JSON object) and the data section of the safetensors file at `path`.
fn read_raw(path: &Path) -> (Map<String, Value>, Vec<u8>) {
    let bytes = std::fs::read(path).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("prefix")) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    (header, bytes[8 + n..].to_vec())
}

/// Writes a safetensors file of `header` (space-padded to 8 bytes) and `data`.
fn write_raw(path: &Path, header: &Map<String, Value>, data: &[u8]) {
    let mut text = Value::Object(header.clone()).to_string().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&text);
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).expect("write raw");
}

/// Rewrites chunk file `path` without tensor `fqn` (bytes and DCP `saved_offsets` too, so the
/// file is consistent in itself and only the index still lists the chunk).
fn drop_from_file(path: &Path, fqn: &str) {
    let (header, data) = read_raw(path);
    let mut entries: Vec<(String, Value)> = header.into_iter().filter(|(k, _)| k != fqn).collect();
    let mut meta = Map::new();
    let mut tensors = Vec::new();
    for (name, entry) in entries.drain(..) {
        if name == "__metadata__" {
            let mut m = entry.as_object().expect("metadata").clone();
            let info = m["DCP_SHARDING_INFO"].as_str().expect("info");
            let mut info: Map<String, Value> = serde_json::from_str(info).expect("info json");
            info.remove(fqn);
            m.insert(
                "DCP_SHARDING_INFO".into(),
                Value::String(Value::Object(info).to_string()),
            );
            meta.insert(name, Value::Object(m));
        } else {
            tensors.push((name, entry));
        }
    }
    tensors.sort_by_key(|(_, e)| e["data_offsets"][0].as_u64());
    let mut out = Vec::new();
    for (name, mut entry) in tensors {
        let begin = entry["data_offsets"][0].as_u64().expect("begin") as usize;
        let end = entry["data_offsets"][1].as_u64().expect("end") as usize;
        let at = out.len();
        out.extend_from_slice(&data[begin..end]);
        entry["data_offsets"] = json!([at, out.len()]);
        meta.insert(name, entry);
    }
    write_raw(path, &meta, &out);
}

/// The file holding the first chunk of `fqn` in the index of `iter`.
fn file_of(iter: &Path, fqn: &str) -> String {
    read_index(iter)["tensors"][fqn]["chunks"][0]["file"]
        .as_str()
        .expect("file")
        .to_owned()
}

/// Builds the corpus under `root` from `sources`.
fn corpus(root: &Path, sources: &[Source]) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut add = |name: &'static str,
                   source: usize,
                   needles: &[&str],
                   blind: &[(Cmd, &'static str)],
                   edit: &dyn Fn(&Path, &Path) -> Vec<String>| {
        // Not the case name: a needle must never match the directory's own path.
        let case_root = root.join(format!("c{:02}", cases.len()));
        copy_tree(&sources[source].root, &case_root);
        let iter = sources[source].iter_dir(&case_root);
        let mut needles: Vec<String> = needles.iter().map(|s| (*s).to_owned()).collect();
        needles.extend(edit(&case_root, &iter));
        cases.push(Case {
            name,
            source,
            root: case_root,
            needles,
            blind: blind.to_vec(),
        });
    };
    const CONVERTED: usize = 0;
    const TRAINED: usize = 1;
    const FP8: usize = 2;
    let rank_file = |rank: usize| format!("shard-{rank:05}-model-00001-of-00001.safetensors");

    // The save did not finish, or files went missing or rotted.
    add(
        "no_complete_marker",
        CONVERTED,
        &[".complete"],
        &[],
        &|_, iter| {
            std::fs::remove_file(iter.join(".complete")).expect("rm");
            vec![]
        },
    );
    add(
        "no_complete_marker_trained",
        TRAINED,
        &[".complete"],
        &[],
        &|_, iter| {
            std::fs::remove_file(iter.join(".complete")).expect("rm");
            vec![]
        },
    );
    add("missing_rank_file", CONVERTED, &[], &[], &|_, iter| {
        std::fs::remove_file(iter.join(rank_file(2))).expect("rm");
        vec![rank_file(2)]
    });
    add(
        "missing_rank_file_trained",
        TRAINED,
        &[],
        &[],
        &|_, iter| {
            let file = "shard-00001-model-00001-of-00002.safetensors";
            std::fs::remove_file(iter.join(file)).expect("rm");
            vec![file.to_owned()]
        },
    );
    add(
        "missing_optimizer_state_file",
        TRAINED,
        &[],
        &[(Cmd::Export, EXPORT_SKIPS_OPTIMIZER_STATE)],
        &|_, iter| {
            let file = "shard-00000-model-00002-of-00002.safetensors";
            std::fs::remove_file(iter.join(file)).expect("rm");
            vec![file.to_owned()]
        },
    );
    add(
        "truncated_rank_file",
        CONVERTED,
        &["truncated"],
        &[],
        &|_, iter| {
            let path = iter.join(rank_file(1));
            let bytes = std::fs::read(&path).expect("read");
            std::fs::write(&path, &bytes[..bytes.len() * 2 / 3]).expect("truncate");
            vec![rank_file(1)]
        },
    );
    add(
        "truncated_fp8_rank_file",
        FP8,
        &["truncated"],
        &[],
        &|_, iter| {
            let path = iter.join(rank_file(0));
            let bytes = std::fs::read(&path).expect("read");
            std::fs::write(&path, &bytes[..bytes.len() - 100]).expect("truncate");
            vec![rank_file(0)]
        },
    );
    add(
        "empty_rank_file",
        CONVERTED,
        &["0 bytes"],
        &[],
        &|_, iter| {
            std::fs::write(iter.join(rank_file(3)), b"").expect("write");
            vec![rank_file(3)]
        },
    );
    add(
        "corrupt_chunk_header",
        CONVERTED,
        &["unsupported dtype", "model.layers.1.mlp.experts.down_proj"],
        &[],
        &|_, iter| {
            let path = iter.join(rank_file(1));
            let (mut header, data) = read_raw(&path);
            header["model.layers.1.mlp.experts.down_proj"]["dtype"] = json!("F7");
            write_raw(&path, &header, &data);
            vec![rank_file(1)]
        },
    );
    add(
        "chunk_file_lacks_a_tensor",
        CONVERTED,
        &["model.norm.weight"],
        &[],
        &|_, iter| {
            let file = file_of(iter, "model.norm.weight");
            drop_from_file(&iter.join(&file), "model.norm.weight");
            vec![file]
        },
    );
    add(
        "chunk_file_lacks_optimizer_state",
        TRAINED,
        &["optim.exp_avg.model.norm.weight"],
        &[(Cmd::Export, EXPORT_SKIPS_OPTIMIZER_STATE)],
        &|_, iter| {
            let file = file_of(iter, "optim.exp_avg.model.norm.weight");
            drop_from_file(&iter.join(&file), "optim.exp_avg.model.norm.weight");
            vec![file]
        },
    );
    add(
        "chunk_file_without_dcp_metadata",
        CONVERTED,
        &["DCP_SHARDING_INFO"],
        &[],
        &|_, iter| {
            let path = iter.join(rank_file(0));
            let (mut header, data) = read_raw(&path);
            header.insert("__metadata__".into(), json!({"format": "pt"}));
            write_raw(&path, &header, &data);
            vec![rank_file(0)]
        },
    );

    // The index.
    add("index_not_json", CONVERTED, &[INDEX], &[], &|_, iter| {
        let text = std::fs::read_to_string(iter.join(INDEX)).expect("index");
        std::fs::write(iter.join(INDEX), &text[..text.len() / 2]).expect("write");
        vec![]
    });
    add("index_missing", TRAINED, &[INDEX], &[], &|_, iter| {
        std::fs::remove_file(iter.join(INDEX)).expect("rm");
        vec![]
    });
    add(
        "index_names_a_missing_file",
        CONVERTED,
        &["shard-00009-model-00001-of-00001.safetensors"],
        &[],
        &|_, iter| {
            edit_index(iter, |index| {
                index["tensors"]["model.norm.weight"]["chunks"][0]["file"] =
                    json!("shard-00009-model-00001-of-00001.safetensors");
            });
            vec![]
        },
    );
    add(
        "index_offsets_contradict_the_file",
        CONVERTED,
        &["lm_head.weight", "offsets"],
        &[],
        &|_, iter| {
            // The two row halves swapped: still a tiling, but not what the files hold.
            edit_index(iter, |index| {
                let chunks = &mut index["tensors"]["lm_head.weight"]["chunks"];
                let a = chunks[0]["offsets"].clone();
                chunks[0]["offsets"] = chunks[1]["offsets"].clone();
                chunks[1]["offsets"] = a;
            });
            vec![]
        },
    );
    add(
        "index_global_shape_contradicts_the_chunks",
        CONVERTED,
        &["model.norm.weight", "[128]"],
        &[],
        &|_, iter| {
            edit_index(iter, |index| {
                index["tensors"]["model.norm.weight"]["global_shape"] = json!([128]);
            });
            vec![]
        },
    );
    add(
        "index_shapes_contradict_the_file",
        TRAINED,
        &["model.norm.weight", "[32]"],
        &[],
        &|_, iter| {
            edit_index(iter, |index| {
                let t = &mut index["tensors"]["model.norm.weight"];
                t["global_shape"] = json!([32]);
                t["chunks"][0]["shape"] = json!([32]);
            });
            vec![]
        },
    );
    add(
        "index_dtype_contradicts_the_file",
        CONVERTED,
        &["model.layers.0.input_layernorm.weight", "F16"],
        &[],
        &|_, iter| {
            edit_index(iter, |index| {
                index["tensors"]["model.layers.0.input_layernorm.weight"]["dtype"] = json!("F16");
            });
            vec![]
        },
    );
    add(
        "chunks_leave_a_gap",
        CONVERTED,
        &["model.layers.1.mlp.experts.down_proj", "elements"],
        &[],
        &|_, iter| {
            edit_index(iter, |index| {
                let chunks = index["tensors"]["model.layers.1.mlp.experts.down_proj"]["chunks"]
                    .as_array_mut()
                    .expect("chunks");
                chunks.pop();
            });
            vec![]
        },
    );
    add(
        "chunks_overlap",
        CONVERTED,
        &["model.layers.2.mlp.experts.gate_up_proj", "overlap"],
        &[],
        &|_, iter| {
            edit_index(iter, |index| {
                let chunks =
                    &mut index["tensors"]["model.layers.2.mlp.experts.gate_up_proj"]["chunks"];
                let first = chunks[1]["offsets"][0].as_u64().expect("offset");
                chunks[1]["offsets"][0] = json!(first - 1);
            });
            vec![]
        },
    );
    add(
        "chunk_outside_the_tensor",
        TRAINED,
        &["optim.exp_avg_sq.model.embed_tokens.weight", "outside"],
        &[],
        &|_, iter| {
            edit_index(iter, |index| {
                let chunks =
                    &mut index["tensors"]["optim.exp_avg_sq.model.embed_tokens.weight"]["chunks"];
                chunks[0]["offsets"][0] = json!(1000);
            });
            vec![]
        },
    );

    // `latest`.
    add(
        "latest_names_a_missing_iteration",
        CONVERTED,
        &["iter_0000042"],
        &[],
        &|root, _| {
            std::fs::write(root.join("latest"), "iter_0000042\n").expect("write");
            vec![]
        },
    );
    add(
        "latest_not_utf8",
        TRAINED,
        &["latest", "UTF-8"],
        &[],
        &|root, _| {
            std::fs::write(root.join("latest"), [0xff, 0xfe, 0x00, 0x9c]).expect("write");
            vec![]
        },
    );
    add(
        "latest_escapes_the_root",
        CONVERTED,
        &["latest", "../c00/iter_0000000"],
        &[],
        &|root, _| {
            std::fs::write(root.join("latest"), "../c00/iter_0000000").expect("write");
            vec![]
        },
    );
    add(
        "latest_empty",
        FP8,
        &["latest", "empty"],
        &[],
        &|root, _| {
            std::fs::write(root.join("latest"), "\n").expect("write");
            vec![]
        },
    );

    // Metadata of another model.
    add(
        "config_of_another_family",
        CONVERTED,
        &["config.json", "deepseek_v3", "qwen3_moe"],
        &[],
        &|_, iter| {
            std::fs::copy(
                fixture("deepseek_v3").join("config.json"),
                iter.join("config.json"),
            )
            .expect("copy");
            vec![]
        },
    );
    add(
        "config_of_another_size",
        TRAINED,
        &["config.json", "[256, 128]"],
        &[],
        &|_, iter| {
            let path = iter.join("config.json");
            let mut config: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).expect("config"))
                    .expect("json");
            config["hidden_size"] = json!(128);
            std::fs::write(&path, config.to_string()).expect("write");
            vec![]
        },
    );
    add(
        "config_not_json",
        FP8,
        &["config.json", "EOF while parsing"],
        &[],
        &|_, iter| {
            std::fs::write(iter.join("config.json"), "{\"model_type\": ").expect("write");
            vec![]
        },
    );
    add(
        "model_family_of_another_model",
        CONVERTED,
        &["model_family", "deepseek_v3"],
        &[],
        &|_, iter| {
            edit_index(iter, |index| index["model_family"] = json!("deepseek_v3"));
            vec![]
        },
    );
    add(
        "index_lacks_a_model_tensor",
        TRAINED,
        &["model.layers.2.self_attn.k_norm.weight", "missing"],
        &[],
        &|_, iter| {
            // The entry and its chunks gone from index and files alike.
            let fqn = "model.layers.2.self_attn.k_norm.weight";
            let index = read_index(iter);
            for c in index["tensors"][fqn]["chunks"].as_array().expect("chunks") {
                drop_from_file(&iter.join(c["file"].as_str().expect("file")), fqn);
            }
            edit_index(iter, |index| {
                index["tensors"]
                    .as_object_mut()
                    .expect("tensors")
                    .remove(fqn);
            });
            vec![]
        },
    );

    // FP8 records.
    add(
        "fp8_scale_of_the_wrong_shape",
        FP8,
        &["model.layers.0.self_attn.o_proj.weight_scale_inv", "[4, 2]"],
        &[],
        &|_, iter| {
            edit_index(iter, |index| {
                let t = &mut index["tensors"]["model.layers.0.self_attn.o_proj.weight_scale_inv"];
                t["global_shape"] = json!([4, 2]);
                t["chunks"][0]["shape"] = json!([4, 2]);
            });
            vec![]
        },
    );
    add("fp8_record_missing", FP8, &["fp8"], &[], &|_, iter| {
        edit_index(iter, |index| index["fp8"] = Value::Null);
        vec![]
    });
    add(
        "fp8_scale_missing",
        FP8,
        &["model.layers.0.self_attn.o_proj.weight_scale_inv"],
        &[],
        &|_, iter| {
            // The FP8 bytes without their scale would read as unscaled values.
            let fqn = "model.layers.0.self_attn.o_proj.weight_scale_inv";
            let index = read_index(iter);
            for c in index["tensors"][fqn]["chunks"].as_array().expect("chunks") {
                drop_from_file(&iter.join(c["file"].as_str().expect("file")), fqn);
            }
            edit_index(iter, |index| {
                index["tensors"]
                    .as_object_mut()
                    .expect("tensors")
                    .remove(fqn);
            });
            vec![]
        },
    );

    // Training state.
    add(
        "train_state_garbage",
        TRAINED,
        &["train_state"],
        &[
            (
                Cmd::Export,
                "`export` writes the model weights only; it does not read the training state",
            ),
            (
                Cmd::Reshard,
                "`reshard` copies the index objects verbatim without interpreting them",
            ),
        ],
        &|_, iter| {
            edit_index(iter, |index| {
                index["objects"]["train_state"] = json!({"step": "one", "data_position": -1});
            });
            vec![]
        },
    );
    cases
}

/// What one `moe` run on a broken checkpoint got wrong, if anything.
fn judge(what: &str, cmd: Cmd, outcome: &Outcome, needles: &[String], problems: &mut Vec<String>) {
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
    if cmd == Cmd::Validate && outcome.stdout.contains("valid (") {
        problems.push(format!("{what} reported the checkpoint valid:\n{text}"));
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

/// What failed runs left in `scratch` beyond their logs (`*.out`, `*.err`): only an empty
/// `reshard --out` or `train --save` root may remain.
fn leftovers(scratch: &Path) -> Vec<PathBuf> {
    let mut left = Vec::new();
    for entry in std::fs::read_dir(scratch).expect("scratch").flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".out") || name.ends_with(".err") {
            continue;
        }
        let empty_root = ["reshard", "train", "train-ep2"].contains(&name.as_str())
            && std::fs::read_dir(&path).is_ok_and(|mut d| d.next().is_none());
        if !empty_root {
            left.push(path);
        }
    }
    left
}

/// Every command on one case; the broken expectations and the pairings skipped.
fn check_case(case: &Case, sources: &[Source]) -> (Vec<String>, Vec<String>) {
    let source = &sources[case.source];
    let scratch = case.root.with_extension("out");
    std::fs::create_dir_all(&scratch).expect("scratch");
    let (mut problems, mut skipped) = (Vec::new(), Vec::new());
    let before = snapshot(&case.root);
    for cmd in Cmd::ALL {
        let what = format!("{} ({}): moe {}", case.name, source.name, cmd.name());
        if let Some((_, why)) = case.blind.iter().find(|(c, _)| *c == cmd) {
            skipped.push(format!("{what}: {why}"));
            continue;
        }
        let outcome = run(
            &cmd.args(source, &case.root, &scratch),
            &scratch.join(cmd.name()),
        );
        judge(&what, cmd, &outcome, &case.needles, &mut problems);
    }
    let left = leftovers(&scratch);
    if !left.is_empty() {
        problems.push(format!("{}: output left behind: {left:?}", case.name));
    }
    let after = snapshot(&case.root);
    if before != after {
        let changed: Vec<_> = before
            .keys()
            .chain(after.keys())
            .filter(|k| before.get(*k) != after.get(*k))
            .collect();
        problems.push(format!(
            "{}: the broken checkpoint was modified: {changed:?}",
            case.name
        ));
    }
    (problems, skipped)
}

/// Runs `check` on every item, [`WORKERS`] at a time; the problems of all items.
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

#[test]
fn every_command_rejects_every_broken_distributed_checkpoint() {
    let started = Instant::now();
    let tmp = TempDir::new("corpus");
    let sources = sources(&tmp.join("sources"));

    // The harness itself works: every command accepts each intact checkpoint (a copy, as
    // training writes into it and the others write next to it).
    let mut problems = check_all(&sources, |source| {
        let root = tmp.join(&format!("good-{}", source.name));
        copy_tree(&source.root, &root);
        let scratch = tmp.join(&format!("good-{}-out", source.name));
        std::fs::create_dir_all(&scratch).expect("scratch");
        let mut problems = Vec::new();
        for cmd in Cmd::ALL {
            let outcome = run(
                &cmd.args(source, &root, &scratch),
                &scratch.join(cmd.name()),
            );
            if outcome.code != Some(0) || outcome.stderr.contains("warning:") {
                problems.push(format!(
                    "intact {}: moe {} ({:?}):\n{}",
                    source.name,
                    cmd.name(),
                    outcome.code,
                    outcome.text()
                ));
            }
        }
        problems
    });

    let cases = corpus(&tmp.join("cases"), &sources);
    let skipped = std::sync::Mutex::new(Vec::new());
    problems.extend(check_all(&cases, |case| {
        let (problems, skips) = check_case(case, &sources);
        skipped.lock().expect("lock").extend(skips);
        problems
    }));
    let skipped = skipped.into_inner().expect("lock");
    eprintln!(
        "{} cases × {} commands, {} pairings skipped in {:?}:\n{}",
        cases.len(),
        Cmd::ALL.len(),
        skipped.len(),
        started.elapsed(),
        skipped.join("\n")
    );
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}
