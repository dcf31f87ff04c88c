//! The tokenizer and chat templates against transformers' goldens
//! (`tests/fixtures/tokenizer/`, made by `tests/make_tokenizer_fixture.py`), and the errors of
//! bad inputs.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use super::*;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer")
}

fn goldens() -> Value {
    let text = std::fs::read_to_string(fixture().join("goldens.json")).expect("goldens.json");
    serde_json::from_str(&text).expect("goldens parse")
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("id list")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

fn str_of<'a>(value: &'a Value, key: &str) -> &'a str {
    value[key]
        .as_str()
        .unwrap_or_else(|| panic!("{key}: {value}"))
}

/// A scratch copy of the fixture (plus `edit` applied), removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("moe-bridge-text-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch");
        for name in [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE] {
            std::fs::copy(fixture().join(name), dir.join(name)).expect("copy");
        }
        Self(dir)
    }

    fn edit_config(&self, edit: impl FnOnce(&mut Map<String, Value>)) {
        let path = self.0.join(TOKENIZER_CONFIG_FILE);
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        edit(config.as_object_mut().expect("object"));
        std::fs::write(&path, serde_json::to_string(&config).expect("json")).expect("write");
    }

    fn write(&self, name: &str, text: &str) {
        let path = self.0.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::write(path, text).expect("write");
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn special_tokens_match_transformers() {
    let golden = goldens();
    let tok = Tokenizer::from_dir(fixture()).expect("load");
    assert_eq!(
        tok.vocab_size(),
        golden["vocab_size"].as_u64().unwrap() as usize
    );
    let map = golden["special_tokens_map"].as_object().unwrap();
    assert_eq!(
        tok.special_tokens().len(),
        map.len(),
        "{:?}",
        tok.special_tokens()
    );
    for (name, text) in map {
        assert_eq!(tok.special_token(name), text.as_str(), "{name}");
    }
    let id = |v: &Value| v.as_u64().map(|x| x as u32);
    assert_eq!(tok.eos_token_id(), id(&golden["eos_token_id"]));
    assert_eq!(tok.pad_token_id(), id(&golden["pad_token_id"]));
    assert_eq!(tok.bos_token_id(), id(&golden["bos_token_id"]));
    // No generation_config.json / config.json beside the fixture: the tokenizer's EOS.
    assert_eq!(tok.generation_stop_ids(), vec![tok.eos_token_id().unwrap()]);
}

#[test]
fn encode_matches_transformers() {
    let golden = goldens();
    let tok = Tokenizer::from_dir(fixture()).expect("load");
    let cases = golden["encode"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let text = str_of(case, "text");
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&case["ids"]),
            "{text:?}"
        );
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&case["ids_no_special"]),
            "{text:?}"
        );
        let tokens: Vec<String> = ids(&case["ids"])
            .iter()
            .map(|&i| tok.id_to_token(i).unwrap())
            .collect();
        let want: Vec<&str> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(tokens, want, "{text:?}");
    }
    let texts: Vec<&str> = cases.iter().map(|c| str_of(c, "text")).collect();
    let batch = tok.encode_batch(&texts, true).unwrap();
    for (case, got) in cases.iter().zip(batch) {
        assert_eq!(got, ids(&case["ids"]));
    }
}

#[test]
fn decode_matches_transformers() {
    let golden = goldens();
    let tok = Tokenizer::from_dir(fixture()).expect("load");
    let cleanup = Scratch::new("cleanup");
    cleanup.edit_config(|c| {
        c.insert("clean_up_tokenization_spaces".into(), json!(true));
    });
    let cleanup = Tokenizer::from_dir(&cleanup.0).expect("load");
    let forced = Scratch::new("forced");
    forced.edit_config(|c| {
        c.insert("clean_up_tokenization_spaces".into(), json!(true));
        c.insert(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output".into(),
            json!(true),
        );
    });
    let forced = Tokenizer::from_dir(&forced.0).expect("load");
    let cases = golden["decode"].as_array().unwrap();
    let mut cleaned = 0;
    for case in cases {
        let ids = ids(&case["ids"]);
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            str_of(case, "text"),
            "{ids:?}"
        );
        let skip = str_of(case, "text_skip_special");
        assert_eq!(tok.decode(&ids, true).unwrap(), skip, "{ids:?}");
        assert_eq!(
            cleanup.decode(&ids, true).unwrap(),
            str_of(case, "text_skip_special_cleanup"),
            "{ids:?}"
        );
        let want = str_of(case, "text_skip_special_cleanup_forced");
        assert_eq!(forced.decode(&ids, true).unwrap(), want, "{ids:?}");
        cleaned += usize::from(want != skip);
    }
    assert!(cleaned > 0, "no golden exercises the clean-up");
}

/// Runs the chat cases of `key` with `render`, checking text and ids (or the error).
fn check_chats(
    golden: &Value,
    key: &str,
    tok: &Tokenizer,
    render: impl Fn(&[Value], bool, &Map<String, Value>) -> Result<String, BridgeError>,
) {
    let cases = golden[key].as_array().unwrap();
    for case in cases {
        let name = str_of(case, "name");
        let messages = case["messages"].as_array().unwrap();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let kwargs = case["kwargs"].as_object().unwrap();
        let got = render(messages, add, kwargs);
        if let Some(error) = case.get("error") {
            let err = got.expect_err(name).to_string();
            assert!(err.contains(error.as_str().unwrap()), "{name}: {err}");
            assert!(err.contains("line "), "{name}: {err}");
            continue;
        }
        let text = got.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(text, str_of(case, "text"), "{name}");
        assert_eq!(
            tok.encode(&text, false).unwrap(),
            ids(&case["ids"]),
            "{name}"
        );
    }
}

#[test]
fn qwen3_chat_template_matches_transformers() {
    let golden = goldens();
    let tok = Tokenizer::from_dir(fixture()).expect("load");
    assert!(matches!(
        tok.chat_templates(),
        Some(ChatTemplates::Single(_))
    ));
    check_chats(&golden, "chat", &tok, |m, add, kw| {
        tok.apply_chat_template(m, add, kw)
    });
    // `chat_prompt` is the single-user-message case.
    let single = &golden["chat"][0];
    assert_eq!(single["name"], "single_user");
    let user = str_of(&single["messages"][0], "content");
    assert_eq!(tok.chat_prompt(user).unwrap(), str_of(single, "text"));
}

#[test]
fn alternating_template_raises_and_renders_like_transformers() {
    let golden = goldens();
    let scratch = Scratch::new("alternating");
    // The template as its own file, which takes priority over tokenizer_config.json's.
    scratch.write(CHAT_TEMPLATE_FILE, str_of(&golden, "alternating_template"));
    let tok = Tokenizer::from_dir(&scratch.0).expect("load");
    check_chats(&golden, "alternating_chat", &tok, |m, add, kw| {
        tok.apply_chat_template(m, add, kw)
    });
    let err = tok
        .apply_chat_template(
            &[json!({"role": "assistant", "content": "x"})],
            true,
            &Map::new(),
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("chat_template.jinja")
            && err.contains("line 4")
            && err.contains("raise_exception"),
        "{err}"
    );
}

#[test]
fn named_templates_pick_default_or_tool_use() {
    let scratch = Scratch::new("named");
    scratch.edit_config(|c| {
        c.insert(
            "chat_template".into(),
            json!([
                {"name": "default", "template": "D{{ messages[0].content }}"},
                {"name": "tool_use", "template": "T{{ tools | length }}"},
            ]),
        );
    });
    let tok = Tokenizer::from_dir(&scratch.0).expect("load");
    let messages = [json!({"role": "user", "content": "x"})];
    assert_eq!(
        tok.apply_chat_template(&messages, true, &Map::new())
            .unwrap(),
        "Dx"
    );
    let mut kwargs = Map::new();
    kwargs.insert("tools".into(), json!([{"a": 1}]));
    assert_eq!(
        tok.apply_chat_template(&messages, true, &kwargs).unwrap(),
        "T1"
    );
    // Only named ones, none "default": a clear error.
    scratch.edit_config(|c| {
        c.insert(
            "chat_template".into(),
            json!([{"name": "other", "template": "x"}]),
        );
    });
    let tok = Tokenizer::from_dir(&scratch.0).expect("load");
    let err = tok
        .apply_chat_template(&messages, true, &Map::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("default") && err.contains("other"), "{err}");
}

#[test]
fn python_string_methods_and_loop_controls_render() {
    let scratch = Scratch::new("pycompat");
    scratch.edit_config(|c| {
        c.insert(
            "chat_template".into(),
            json!(concat!(
                "{% for m in messages %}{% if loop.index0 > 1 %}{% break %}{% endif %}",
                "{{ m.content.strip().upper() }}|{{ m.content.startswith(' a') }}|",
                "{{ m.get('missing', 'd') }}|{{ m.content.split(',')[0] | trim }};",
                "{% endfor %}{{ eos_token }}{{ strftime_now('%Y')|length }}"
            )),
        );
    });
    let tok = Tokenizer::from_dir(&scratch.0).expect("load");
    let messages = [
        json!({"role": "user", "content": " a,b "}),
        json!({"role": "user", "content": "c"}),
        json!({"role": "user", "content": "never"}),
    ];
    // Python prints booleans as `True` / `False`, and so does the template.
    assert_eq!(
        tok.apply_chat_template(&messages, false, &Map::new())
            .unwrap(),
        "A,B|True|d|a;C|False|d|c;<|im_end|>4"
    );
}

#[test]
fn stop_ids_prefer_generation_config_then_config() {
    let scratch = Scratch::new("stop");
    let tok = Tokenizer::from_dir(&scratch.0).expect("load");
    let eos = tok.eos_token_id().unwrap();
    scratch.write("config.json", r#"{"eos_token_id": 5}"#);
    assert_eq!(
        Tokenizer::from_dir(&scratch.0)
            .unwrap()
            .generation_stop_ids(),
        vec![5]
    );
    scratch.write("generation_config.json", r#"{"eos_token_id": [7, 8]}"#);
    assert_eq!(
        Tokenizer::from_dir(&scratch.0)
            .unwrap()
            .generation_stop_ids(),
        vec![7, 8]
    );
    scratch.write("generation_config.json", r#"{"eos_token_id": null}"#);
    scratch.write("config.json", r#"{"eos_token_id": null}"#);
    assert_eq!(
        Tokenizer::from_dir(&scratch.0)
            .unwrap()
            .generation_stop_ids(),
        vec![eos]
    );
    scratch.write("generation_config.json", r#"{"eos_token_id": "x"}"#);
    let err = Tokenizer::from_dir(&scratch.0).unwrap_err().to_string();
    assert!(
        err.contains("generation_config.json") && err.contains("eos_token_id"),
        "{err}"
    );
}

#[test]
fn missing_tokens_named_by_the_config_are_added() {
    let scratch = Scratch::new("added");
    scratch.edit_config(|c| {
        c.insert(
            "bos_token".into(),
            json!({"__type": "AddedToken", "content": "<s>", "lstrip": false}),
        );
    });
    let tok = Tokenizer::from_dir(&scratch.0).expect("load");
    assert_eq!(tok.special_token("bos_token"), Some("<s>"));
    let bos = tok.bos_token_id().expect("added");
    assert_eq!(bos as usize, tok.vocab_size() - 1);
    // Added as special: one token when encoding, skipped when decoding.
    let ids = tok.encode("<s>Hi", false).unwrap();
    assert_eq!(ids[0], bos);
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hi");
}

#[test]
fn bad_files_fail_with_errors_naming_them() {
    let scratch = Scratch::new("bad");
    // No tokenizer.json at all.
    let empty = std::env::temp_dir().join(format!("moe-bridge-text-empty-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let err = Tokenizer::from_dir(&empty).unwrap_err();
    assert!(matches!(err, BridgeError::MissingTokenizer { .. }), "{err}");
    assert!(Tokenizer::from_dir_if_present(&empty).unwrap().is_none());
    let _ = std::fs::remove_dir_all(&empty);

    // tokenizer.json that is not JSON.
    let good = std::fs::read_to_string(fixture().join(TOKENIZER_FILE)).unwrap();
    scratch.write(TOKENIZER_FILE, &good[..good.len() / 2]);
    let err = Tokenizer::from_dir(&scratch.0).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, BridgeError::InvalidJson { .. }), "{text}");
    assert!(
        text.contains("tokenizer.json") && text.contains("line"),
        "{text}"
    );

    // JSON the crate rejects (an unknown model type).
    scratch.write(
        TOKENIZER_FILE,
        &good.replace(r#""type": "BPE""#, r#""type": "Nonsense""#),
    );
    let err = Tokenizer::from_dir(&scratch.0).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, BridgeError::InvalidTokenizer { .. }),
        "{text}"
    );
    assert!(text.contains("tokenizer.json"), "{text}");
    scratch.write(TOKENIZER_FILE, &good);

    // tokenizer_config.json that is not JSON, or with a mistyped special token.
    scratch.write(TOKENIZER_CONFIG_FILE, "{\"eos_token\": ");
    let text = Tokenizer::from_dir(&scratch.0).unwrap_err().to_string();
    assert!(
        text.contains("tokenizer_config.json") && text.contains("invalid JSON"),
        "{text}"
    );
    scratch.write(TOKENIZER_CONFIG_FILE, r#"{"eos_token": 3}"#);
    let text = Tokenizer::from_dir(&scratch.0).unwrap_err().to_string();
    assert!(
        text.contains("tokenizer_config.json") && text.contains("eos_token"),
        "{text}"
    );

    // No chat template.
    scratch.write(TOKENIZER_CONFIG_FILE, r#"{"eos_token": "<|im_end|>"}"#);
    let tok = Tokenizer::from_dir(&scratch.0).unwrap();
    let err = tok.chat_prompt("hi").unwrap_err();
    assert!(matches!(err, BridgeError::NoChatTemplate { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");

    // A template with a syntax error, and one calling an unknown function: the line is named.
    scratch.write(
        CHAT_TEMPLATE_FILE,
        "ok\n{% for m in messages %}\n{{ m.content }\n",
    );
    let tok = Tokenizer::from_dir(&scratch.0).unwrap();
    let text = tok.chat_prompt("hi").unwrap_err().to_string();
    assert!(
        text.contains("chat_template.jinja")
            && text.contains("syntax error")
            && text.contains("line 3"),
        "{text}"
    );
    scratch.write(CHAT_TEMPLATE_FILE, "a\nb\n{{ nope() }}");
    let tok = Tokenizer::from_dir(&scratch.0).unwrap();
    let text = tok.chat_prompt("hi").unwrap_err().to_string();
    assert!(text.contains("line 3") && text.contains("nope"), "{text}");
}
