//! Text in and out of the `moe` binary: `generate --prompt` (plain and `--chat`) on the dense
//! Qwen3 fixture with the tiny Qwen3-style tokenizer of `tests/fixtures/tokenizer/` copied in,
//! checked against `--prompt-ids` with transformers' token ids; EOS from the tokenizer; clear
//! errors for bad tokenizer files, raising or missing chat templates and bad arguments; and
//! `train --data` on `.jsonl` / `.txt` text.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use burn_moe::bridge::Tokenizer;
use burn_moe::bridge::safetensors::{Dtype, TensorView, write_safetensors};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
}

fn goldens() -> Value {
    let text = std::fs::read_to_string(fixtures().join("tokenizer").join("goldens.json"))
        .expect("goldens.json");
    serde_json::from_str(&text).expect("goldens")
}

/// A scratch directory holding a copy of the dense Qwen3 fixture with the tokenizer files,
/// removed on drop.
struct Model {
    root: PathBuf,
    dir: PathBuf,
}

impl Model {
    fn new(tag: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let root =
            std::env::temp_dir().join(format!("burn-moe-text-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("qwen3");
        std::fs::create_dir_all(&dir).expect("mkdir");
        for entry in std::fs::read_dir(fixtures().join("qwen3")).expect("fixture") {
            let entry = entry.expect("entry");
            std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
        }
        for name in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(fixtures().join("tokenizer").join(name), dir.join(name)).expect("copy");
        }
        Self { root, dir }
    }

    fn path(&self) -> &str {
        self.dir.to_str().expect("utf-8 path")
    }

    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.dir.join(name), text).expect("write");
    }

    fn edit_config(&self, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
        let path = self.dir.join("tokenizer_config.json");
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        edit(config.as_object_mut().expect("object"));
        std::fs::write(&path, config.to_string()).expect("write");
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn moe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moe"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the moe binary")
}

/// Asserts success and returns stdout.
fn ok(args: &[&str]) -> String {
    let out = moe(args);
    assert!(
        out.status.success(),
        "moe {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Asserts a non-zero exit (`code`) without a panic, with an `error:` line containing every
/// needle; returns stderr.
fn fails(args: &[&str], code: i32, needles: &[&str]) -> String {
    let out = moe(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "moe {args:?}:\n{err}");
    assert!(!err.contains("panicked"), "moe {args:?} panicked:\n{err}");
    assert!(
        err.starts_with("error: ") || err.contains("\nerror: "),
        "{err}"
    );
    for needle in needles {
        assert!(
            err.contains(needle),
            "moe {args:?}: no {needle:?} in:\n{err}"
        );
    }
    err
}

fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn parse_ids(line: &str) -> Vec<u32> {
    line.split(',').map(|t| t.parse().expect("id")).collect()
}

/// The text of `new` continuing `prompt`, decoded with the library tokenizer.
fn continuation(tok: &Tokenizer, prompt: &[u32], new: &[u32]) -> String {
    let all: Vec<u32> = prompt.iter().chain(new).copied().collect();
    let whole = tok.decode(&all, true).expect("decode");
    let head = tok.decode(prompt, true).expect("decode");
    whole.strip_prefix(&head).expect("prefix").to_string()
}

#[test]
fn generate_from_text_equals_generate_from_its_ids() {
    let golden = goldens();
    let model = Model::new("prompt");
    let tok = Tokenizer::from_dir(&model.dir).expect("tokenizer");
    let m = model.path();
    // Plain text: the ids transformers' `encode` gives.
    let case = &golden["encode"][0];
    let text = case["text"].as_str().unwrap();
    let prompt: Vec<u32> = parse_ids(&ids_arg(
        &case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect::<Vec<_>>(),
    ));
    let n = "8";
    let from_ids = ok(&[
        "generate",
        "--model",
        m,
        "--prompt-ids",
        &ids_arg(&prompt),
        "--max-new-tokens",
        n,
    ]);
    let both = ok(&[
        "generate",
        "--model",
        m,
        "--prompt",
        text,
        "--max-new-tokens",
        n,
        "--print",
        "both",
    ]);
    let (ids_line, text_line) = both.split_once('\n').expect("two lines");
    assert_eq!(
        ids_line,
        from_ids.trim_end(),
        "same ids from text and from its token ids"
    );
    let new = parse_ids(ids_line);
    assert!(!new.is_empty() && new.len() <= 8);
    assert_eq!(
        text_line,
        format!("{}\n", continuation(&tok, &prompt, &new))
    );
    // The default for --prompt is the text alone.
    let only_text = ok(&[
        "generate",
        "--model",
        m,
        "--prompt",
        text,
        "--max-new-tokens",
        n,
    ]);
    assert_eq!(only_text, text_line);
    // And --print text works with ids in.
    let text_from_ids = ok(&[
        "generate",
        "--model",
        m,
        "--prompt-ids",
        &ids_arg(&prompt),
        "--max-new-tokens",
        n,
        "--print",
        "text",
    ]);
    assert_eq!(text_from_ids, text_line);

    // --chat: the chat template's ids as transformers renders and encodes them.
    let chat = &golden["chat"][0];
    assert_eq!(chat["name"], "single_user");
    let user = chat["messages"][0]["content"].as_str().unwrap();
    let chat_ids: Vec<u32> = chat["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let from_ids = ok(&[
        "generate",
        "--model",
        m,
        "--prompt-ids",
        &ids_arg(&chat_ids),
        "--max-new-tokens",
        "5",
    ]);
    let both = ok(&[
        "generate",
        "--model",
        m,
        "--prompt",
        user,
        "--chat",
        "--max-new-tokens",
        "5",
        "--print",
        "both",
    ]);
    let (ids_line, text_line) = both.split_once('\n').expect("two lines");
    assert_eq!(ids_line, from_ids.trim_end());
    assert_eq!(
        text_line,
        format!("{}\n", continuation(&tok, &chat_ids, &parse_ids(ids_line)))
    );
}

#[test]
fn generation_stops_at_the_tokenizers_eos_when_the_config_has_none() {
    let model = Model::new("eos");
    let m = model.path();
    // The fixture's config.json and generation_config.json set no eos_token_id.
    let free = ok(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "8",
        "--print",
        "ids",
        "--ignore-eos",
    ]);
    let free = parse_ids(free.trim_end());
    assert_eq!(free.len(), 8);
    let tok = Tokenizer::from_dir(&model.dir).expect("tokenizer");
    // Make the third generated token the tokenizer's EOS: generation ends right after it.
    let stop = free[2];
    let first = free.iter().position(|&t| t == stop).unwrap();
    let content = tok.id_to_token(stop).expect("token");
    model.edit_config(|c| {
        c.insert("eos_token".into(), Value::String(content.clone()));
    });
    let stopped = ok(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "8",
        "--print",
        "ids",
    ]);
    assert_eq!(
        parse_ids(stopped.trim_end()),
        free[..=first].to_vec(),
        "eos {stop} ({content:?})"
    );
    // generation_config.json's eos_token_id wins over the tokenizer's.
    model.write(
        "generation_config.json",
        &format!("{{\"eos_token_id\": [{}]}}", free[0]),
    );
    let stopped = ok(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "8",
        "--print",
        "ids",
    ]);
    assert_eq!(parse_ids(stopped.trim_end()), free[..1].to_vec());
}

#[test]
fn bad_text_input_fails_with_a_clear_error() {
    let model = Model::new("bad");
    let m = model.path();
    let gen_args = |extra: &[&'static str]| -> Vec<String> {
        let mut args: Vec<String> = ["generate", "--model", m, "--max-new-tokens", "2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let run = |extra: &[&'static str], code: i32, needles: &[&str]| {
        let args = gen_args(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        fails(&args, code, needles)
    };

    // Arguments clap refuses: both inputs, neither, --chat without --prompt.
    run(&["--prompt", "hi", "--prompt-ids", "1"], 2, &["--prompt"]);
    run(&[], 2, &["--prompt-ids", "--prompt"]);
    run(&["--prompt-ids", "1", "--chat"], 2, &["--chat", "--prompt"]);
    // A prompt that encodes to nothing, and one outside the model's vocabulary (a BOS the
    // config adds past the model's 256 ids).
    run(&["--prompt", ""], 1, &["tokenizer.json", "no tokens"]);
    model.edit_config(|c| {
        c.insert("bos_token".into(), Value::String("<s>".into()));
    });
    run(
        &["--prompt", "<s>Hi"],
        1,
        &["tokenizer.json", "256", "vocabulary"],
    );

    // --chat without a chat template names tokenizer_config.json.
    model.edit_config(|c| {
        c.remove("chat_template");
    });
    run(
        &["--prompt", "hi", "--chat"],
        1,
        &["tokenizer_config.json", "no `chat_template`"],
    );
    // A template that raises names its file, line and message.
    model.write(
        "chat_template.jinja",
        "{% if messages %}\n{{ raise_exception('no chatting, please') }}\n{% endif %}",
    );
    run(
        &["--prompt", "hi", "--chat"],
        1,
        &["chat_template.jinja", "line 2", "no chatting, please"],
    );
    // One that does not parse.
    model.write(
        "chat_template.jinja",
        "{% for m in messages %}{{ m.content }}",
    );
    run(
        &["--prompt", "hi", "--chat"],
        1,
        &["chat_template.jinja", "syntax error"],
    );
    std::fs::remove_file(model.dir.join("chat_template.jinja")).expect("rm");

    // tokenizer.json that is not JSON, and JSON the tokenizers crate rejects.
    let good = std::fs::read_to_string(model.dir.join("tokenizer.json")).expect("read");
    model.write("tokenizer.json", "{\"version\": \"1.0\", \"model\": ");
    run(&["--prompt", "hi"], 1, &["tokenizer.json", "invalid JSON"]);
    // Ids in and out need the tokenizer only for its EOS: a warning, not an error.
    let out = moe(&[
        "generate",
        "--model",
        m,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("tokenizer.json"));
    model.write(
        "tokenizer.json",
        &good.replace("\"BPE\"", "\"NoSuchModel\""),
    );
    run(
        &["--prompt", "hi"],
        1,
        &["tokenizer.json", "crate can load"],
    );
    // No tokenizer at all: text in, or text out.
    std::fs::remove_file(model.dir.join("tokenizer.json")).expect("rm");
    run(&["--prompt", "hi"], 1, &["no tokenizer.json"]);
    run(
        &["--prompt-ids", "1", "--print", "text"],
        1,
        &["no tokenizer.json"],
    );
    // Ids in and out still work without one.
    let out = ok(&[
        "generate",
        "--model",
        m,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
    ]);
    assert_eq!(out.trim_end().split(',').count(), 2, "{out}");
}

fn train(model: &Model, data: &Path, extra: &[&str]) -> Output {
    let save = model.root.join("ckpt");
    let _ = std::fs::remove_dir_all(&save);
    let mut args = vec![
        "train",
        "--model",
        model.path(),
        "--layout",
        "",
        "--steps",
        "2",
        "--gbs",
        "2",
        "--seq-len",
        "8",
        "--lr",
        "1e-3",
        "--transport",
        "threads",
        "--data",
        data.to_str().expect("utf-8"),
    ];
    args.extend(extra);
    moe(&args)
}

#[test]
fn train_takes_text_data_tokenized_with_the_models_tokenizer() {
    let model = Model::new("train");
    let jsonl = model.root.join("docs.jsonl");
    std::fs::write(
        &jsonl,
        "{\"text\": \"The quick brown fox jumps over the lazy dog.\"}\n\n{\"text\": \"Hello world! How are you today?\", \"id\": 2}\n",
    )
    .expect("write");
    let out = train(&model, &jsonl, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let txt = model.root.join("docs.txt");
    std::fs::write(
        &txt,
        "The quick brown fox jumps over the lazy dog.\nHello world! How are you today?\n",
    )
    .expect("write");
    let out = train(&model, &txt, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let refused = |data: &Path, extra: &[&str], needles: &[&str]| {
        let out = train(&model, data, extra);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        for needle in needles {
            assert!(err.contains(needle), "no {needle:?} in:\n{err}");
        }
    };
    // A line that is not JSON, or has no `text`: the file and line are named.
    let bad = model.root.join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"text\": 3}\n").expect("write");
    refused(&bad, &[], &["bad.jsonl", "line 2", "`text`"]);
    std::fs::write(&bad, "{\"text\": \"ok\"}\n\nnot json\n").expect("write");
    refused(&bad, &[], &["bad.jsonl", "line 3", "not valid JSON"]);
    // Too little text for one sequence.
    let short = model.root.join("short.txt");
    std::fs::write(&short, "Hi\n").expect("write");
    refused(&short, &[], &["short.txt", "fewer than one sequence"]);
    // A tokenizer elsewhere, and a directory without one.
    let out = train(
        &model,
        &txt,
        &[
            "--tokenizer",
            fixtures().join("tokenizer").to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    refused(
        &txt,
        &["--tokenizer", fixtures().join("qwen3").to_str().unwrap()],
        &["no tokenizer.json"],
    );
}

#[test]
fn text_rows_are_the_documents_joined_by_eos() {
    // The rows `moe train` builds from text, reproduced from the library tokenizer: checked
    // through the loss of step 1, which is a function of the rows only (same model, same seed).
    let model = Model::new("rows");
    let tok = Tokenizer::from_dir(&model.dir).expect("tokenizer");
    let docs = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world! How are you today?",
    ];
    let eos = tok.eos_token_id().expect("eos");
    let mut ids: Vec<i64> = Vec::new();
    for doc in docs {
        ids.extend(
            tok.encode(doc, true)
                .expect("encode")
                .into_iter()
                .map(i64::from),
        );
        ids.push(i64::from(eos));
    }
    let seq = 8;
    let rows = ids.len() / seq;
    ids.truncate(rows * seq);
    // The same rows as a safetensors `input_ids` file.
    let ids_file = model.root.join("ids.safetensors");
    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    let shape = [rows, seq];
    let view = TensorView {
        path: &ids_file,
        name: "input_ids",
        dtype: Dtype::I64,
        shape: &shape,
        bytes: &bytes,
    };
    write_safetensors(&ids_file, &[view]).expect("write ids");
    let txt = model.root.join("docs.txt");
    std::fs::write(&txt, docs.join("\n")).expect("write");
    let loss = |data: &Path| {
        let metrics = model.root.join(format!(
            "m-{}.jsonl",
            data.extension().unwrap().to_str().unwrap()
        ));
        let out = train(&model, data, &["--metrics-out", metrics.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = std::fs::read_to_string(&metrics).expect("metrics");
        text.lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).expect("json")["loss"]
                    .as_f64()
                    .expect("loss")
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(loss(&txt), loss(&ids_file));
}
