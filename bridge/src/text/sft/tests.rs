//! SFT data against TRL 1.16.0's own preparation (`tests/fixtures/sft/goldens.json`, made by
//! `tests/make_sft_goldens.py`), and the refusals of bad rows.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use moe_backend::testing::SplitMix;
use serde_json::Value;

use super::*;
use crate::text::training_templates::{TRAINING_TEMPLATES, training_variant};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn sft_dir() -> PathBuf {
    fixtures().join("sft")
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(fixtures().join("tokenizer")).expect("tokenizer fixture")
}

fn goldens() -> Value {
    let text = std::fs::read_to_string(sft_dir().join("goldens.json")).expect("goldens.json");
    serde_json::from_str(&text).expect("goldens parse")
}

fn u32s(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("list")
        .iter()
        .map(|v| u32::try_from(v.as_u64().expect("id")).expect("u32"))
        .collect()
}

fn i64s(value: &Value) -> Vec<i64> {
    value
        .as_array()
        .expect("list")
        .iter()
        .map(|v| v.as_i64().expect("int"))
        .collect()
}

fn usizes(value: &Value) -> Vec<usize> {
    value
        .as_array()
        .expect("list")
        .iter()
        .map(|v| usize::try_from(v.as_u64().expect("int")).expect("usize"))
        .collect()
}

fn template_file(name: &str) -> ChatTemplate {
    let path = sft_dir().join(name);
    ChatTemplate {
        source: std::fs::read_to_string(&path).expect("template"),
        path,
        name: None,
    }
}

/// The options a golden case was made with.
fn case_options(case: &Value) -> SftOptions {
    SftOptions {
        max_length: case["max_length"].as_u64().map(|n| n as usize),
        truncation: Truncation::Truncate,
        assistant_only_loss: case["assistant_only_loss"].as_bool().expect("flag"),
        completion_only_loss: case["completion_only_loss"].as_bool(),
        chat_template: case["chat_template_file"].as_str().map(template_file),
    }
}

/// Lines of the non-blank rows of a fixture file.
fn row_lines(file: &str) -> Vec<usize> {
    let text = std::fs::read_to_string(sft_dir().join(file)).expect("fixture");
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, _)| i + 1)
        .collect()
}

#[test]
fn examples_match_trl() {
    let tok = tokenizer();
    let golden = goldens();
    let cases = golden["cases"].as_array().expect("cases");
    assert!(cases.len() >= 13, "all shapes and settings");
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let file = case["file"].as_str().expect("file");
        let options = case_options(case);
        let data = read_sft_jsonl(sft_dir().join(file), &tok, &options)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = case["examples"].as_array().expect("examples");
        let lines: Vec<usize> = data.examples.iter().map(|e| e.line).collect();
        let want_lines: Vec<usize> = want
            .iter()
            .map(|e| e["line"].as_u64().unwrap() as usize)
            .collect();
        assert_eq!(lines, want_lines, "{name}: rows kept");
        // TRL drops the rows truncation leaves without a trained token; we list them.
        let kept: BTreeSet<usize> = want_lines.iter().copied().collect();
        let dropped: Vec<usize> = row_lines(file)
            .into_iter()
            .filter(|l| !kept.contains(l))
            .collect();
        assert_eq!(data.dropped_lines, dropped, "{name}: rows dropped");
        for (example, want) in data.examples.iter().zip(want) {
            let line = example.line;
            assert_eq!(
                example.input_ids,
                u32s(&want["input_ids"]),
                "{name} line {line}: ids"
            );
            assert_eq!(
                example.labels(),
                i64s(&want["labels"]),
                "{name} line {line}: labels"
            );
            assert_eq!(example.loss_mask.len(), example.input_ids.len());
            if let Some(max) = options.max_length {
                assert!(example.len() <= max);
                assert_eq!(example.is_truncated(), example.untruncated_len > max);
            }
        }
    }
}

#[test]
fn golden_cases_cover_truncation_and_masking() {
    // The goldens exercise what they are meant to: cut rows, dropped rows, partial masks.
    let golden = goldens();
    let tok = tokenizer();
    let mut truncated = 0;
    let mut dropped = 0;
    let mut partial = 0;
    for case in golden["cases"].as_array().expect("cases") {
        let file = case["file"].as_str().expect("file");
        let data = read_sft_jsonl(sft_dir().join(file), &tok, &case_options(case)).expect("read");
        truncated += data.examples.iter().filter(|e| e.is_truncated()).count();
        dropped += data.dropped_lines.len();
        partial += data
            .examples
            .iter()
            .filter(|e| e.trained_tokens() < e.len())
            .count();
    }
    assert!(
        truncated >= 10 && dropped >= 4 && partial >= 30,
        "{truncated} {dropped} {partial}"
    );
}

#[test]
fn packed_rows_match_trl() {
    let tok = tokenizer();
    let golden = goldens();
    let cases = golden["packed"].as_array().expect("packed");
    assert_eq!(cases.len(), 3);
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let seq_len = case["seq_len"].as_u64().expect("seq_len") as usize;
        let options = SftOptions {
            max_length: Some(seq_len),
            ..case_options(&serde_json::json!({
                "max_length": seq_len,
                "assistant_only_loss": case["assistant_only_loss"],
                "completion_only_loss": case["completion_only_loss"],
                "chat_template_file": null,
            }))
        };
        let file = case["file"].as_str().expect("file");
        let data = read_sft_jsonl(sft_dir().join(file), &tok, &options).expect("read");
        let rows = data.pack_bfd(seq_len).expect("pack");
        let want = case["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), want.len(), "{name}: row count");
        assert!(
            rows.iter().any(|r| r.examples.len() > 1),
            "{name}: some row packs several"
        );
        for (i, (row, want)) in rows.iter().zip(want).enumerate() {
            let lines: Vec<usize> = row
                .examples
                .iter()
                .map(|&e| data.examples[e].line)
                .collect();
            assert_eq!(lines, usizes(&want["lines"]), "{name} row {i}: examples");
            assert_eq!(
                row.seq_lengths,
                usizes(&want["seq_lengths"]),
                "{name} row {i}"
            );
            assert_eq!(
                row.input_ids,
                u32s(&want["input_ids"]),
                "{name} row {i}: ids"
            );
            assert_eq!(row.labels, i64s(&want["labels"]), "{name} row {i}: labels");
            assert_eq!(
                row.position_ids,
                usizes(&want["position_ids"]),
                "{name} row {i}"
            );
            let cu = row.cu_seqlens();
            assert_eq!(cu.first(), Some(&0));
            assert_eq!(cu.last(), Some(&row.len()));
            assert!(row.len() <= seq_len);
        }
    }
}

#[test]
fn bfd_matches_trl() {
    let golden = goldens();
    let cases = golden["bfd"].as_array().expect("bfd");
    assert_eq!(cases.len(), 3);
    for case in cases {
        let lengths = usizes(&case["lengths"]);
        let seq_len = case["seq_len"].as_u64().expect("seq_len") as usize;
        let want: Vec<Vec<usize>> = case["rows"]
            .as_array()
            .expect("rows")
            .iter()
            .map(usizes)
            .collect();
        let got = match case["via"].as_str() {
            Some("_pack_bfd") => pack_bfd_batch(&lengths, seq_len),
            Some("pack_dataset") => {
                assert!(lengths.len() > 2 * TRL_PACK_BATCH, "several map batches");
                pack_bfd(&lengths, seq_len)
            }
            other => panic!("unknown case {other:?}"),
        };
        assert_eq!(got, want, "seq_len {seq_len}, {} lengths", lengths.len());
    }
}

#[test]
fn bfd_invariants() {
    // Every non-empty sequence is placed once; rows never overflow; edge inputs.
    let mut rng = SplitMix::new(7);
    for _ in 0..50 {
        let seq_len = 1 + rng.below(64);
        let lengths: Vec<usize> = (0..rng.below(300)).map(|_| rng.below(80)).collect();
        let rows = pack_bfd_batch(&lengths, seq_len);
        let mut seen: Vec<usize> = rows.iter().flatten().copied().collect();
        seen.sort_unstable();
        let want: Vec<usize> = (0..lengths.len()).filter(|&i| lengths[i] > 0).collect();
        assert_eq!(seen, want);
        for row in &rows {
            let total: usize = row.iter().map(|&i| lengths[i].min(seq_len)).sum();
            assert!(total <= seq_len && !row.is_empty());
        }
    }
    assert!(pack_bfd_batch(&[3, 4], 0).is_empty());
    assert!(pack_bfd(&[], 8).is_empty());
    assert_eq!(pack_bfd_batch(&[0, 0, 2], 4), vec![vec![2]]);
}

#[test]
fn padded_batch_matches_trl_collator() {
    let tok = tokenizer();
    let golden = goldens();
    let loss = &golden["loss"];
    let case = golden["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == loss["case"])
        .expect("loss case");
    let data = read_sft_jsonl(
        sft_dir().join(case["file"].as_str().expect("file")),
        &tok,
        &case_options(case),
    )
    .expect("read");
    let lines: Vec<usize> = data.examples.iter().map(|e| e.line).collect();
    assert_eq!(lines, usizes(&loss["lines"]));
    let pad = trl_pad_token_id(&tok).expect("pad token");
    assert_eq!(u64::from(pad), loss["pad_token_id"].as_u64().expect("pad"));
    let examples: Vec<&SftExample> = data.examples.iter().collect();
    let batch = pad_batch(&examples, pad);
    let rows = |key: &str| loss[key].as_array().expect("rows").clone();
    assert_eq!(
        batch.input_ids,
        rows("input_ids").iter().map(u32s).collect::<Vec<_>>()
    );
    assert_eq!(
        batch.labels,
        rows("labels").iter().map(i64s).collect::<Vec<_>>()
    );
    let mask: Vec<Vec<u8>> = rows("attention_mask")
        .iter()
        .map(|r| usizes(r).into_iter().map(|v| v as u8).collect())
        .collect();
    assert_eq!(batch.attention_mask, mask);
    let value = loss["loss"].as_f64().expect("loss");
    assert!(value.is_finite() && value > 0.0);
}

#[test]
fn trl_errors_are_reproduced() {
    let tok = tokenizer();
    let golden = goldens();
    let errors = &golden["errors"];
    // Assistant-only loss on prompt-completion text.
    let options = SftOptions {
        assistant_only_loss: true,
        ..SftOptions::default()
    };
    let err = read_sft_jsonl(sft_dir().join("prompt_completion.jsonl"), &tok, &options)
        .expect_err("not conversational");
    let text = err.to_string();
    assert!(matches!(err, BridgeError::SftData { .. }), "{text}");
    assert!(
        text.contains(
            errors["assistant_only_loss_not_conversational"]
                .as_str()
                .unwrap()
        )
    );
    assert!(text.contains("line 1"), "{text}");
    // A template TRL cannot patch (Qwen3's with one more space).
    let mut template = tok
        .chat_templates()
        .unwrap()
        .select(None, false)
        .unwrap()
        .clone();
    template.source.push(' ');
    let options = SftOptions {
        assistant_only_loss: true,
        chat_template: Some(template),
        ..SftOptions::default()
    };
    let err = read_sft_jsonl(sft_dir().join("conversational.jsonl"), &tok, &options)
        .expect_err("unknown template");
    let text = err.to_string();
    assert!(matches!(err, BridgeError::ChatTemplate { .. }), "{text}");
    assert!(
        text.contains(errors["unknown_template"].as_str().unwrap()),
        "{text}"
    );
}

#[test]
fn qwen3_template_is_swapped_for_trls_training_variant() {
    let tok = tokenizer();
    let qwen3 = tok.chat_templates().unwrap().select(None, false).unwrap();
    assert!(!qwen3.has_generation_markers());
    let variant = training_variant(&qwen3.source).expect("TRL knows Qwen3's template");
    assert_eq!(variant.name, "qwen3");
    let swapped = crate::text::training_templates::assistant_mask_template(qwen3).unwrap();
    assert_eq!(swapped.name.as_deref(), Some("trl:qwen3"));
    assert!(swapped.has_generation_markers());
    for t in TRAINING_TEMPLATES {
        assert!(
            !crate::text::chat::has_generation_markers(t.original),
            "{}",
            t.name
        );
        assert!(
            crate::text::chat::has_generation_markers(t.training),
            "{}",
            t.name
        );
        // Each embedded template parses.
        crate::text::training_templates::assistant_mask_template(&ChatTemplate {
            source: t.original.to_string(),
            path: PathBuf::from(t.name),
            name: None,
        })
        .and_then(|t| t.compile())
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn generation_markers_match_trls_regex() {
    use crate::text::chat::has_generation_markers as has;
    for yes in [
        "{% generation %}",
        "{%- generation %}",
        "{%generation%}",
        "{%- generation -%}",
        "a {%   generation\n-%} b",
    ] {
        assert!(has(yes), "{yes}");
    }
    // The regex allows no `+`, no text after the keyword, and only `-` before `%}`.
    for no in [
        "{%+ generation %}",
        "{% generation_x %}",
        "{% generations %}",
        "{% if generation %}",
        "{{ generation }}",
        "{% endgeneration %}",
        "{% generation -- %}",
        "{%",
    ] {
        assert!(!has(no), "{no}");
    }
}

#[test]
fn generation_spans_count_characters() {
    let template = ChatTemplate {
        source: "{%- for m in messages %}[{{ m.role }}]\n{%- if m.role == 'assistant' %}\n  \
                 {%- generation %} {{ m.content }}!{% endgeneration %}{% else %}{{ m.content }}\
                 {% endif %}{% endfor %}"
            .into(),
        path: PathBuf::from("inline"),
        name: None,
    };
    let compiled = template.compile().expect("compile");
    let messages = vec![
        serde_json::json!({"role": "user", "content": "héllo → wörld"}),
        serde_json::json!({"role": "assistant", "content": "ça va"}),
        serde_json::json!({"role": "user", "content": "ok"}),
        serde_json::json!({"role": "assistant", "content": "日本"}),
    ];
    let special = Default::default();
    let kwargs = Map::new();
    let plain = compiled
        .render(&messages, false, &special, &kwargs)
        .expect("render");
    let tracked = compiled
        .render_with_generation_spans(&messages, false, &special, &kwargs)
        .expect("tracked");
    assert_eq!(tracked.text, plain);
    assert_eq!(
        plain,
        "[user]héllo → wörld[assistant] ça va![user]ok[assistant] 日本!"
    );
    let spans: Vec<String> = tracked
        .generation_spans
        .iter()
        .map(|&(s, e)| plain.chars().skip(s).take(e - s).collect())
        .collect();
    assert_eq!(spans, [" ça va!", " 日本!"]);
    // Markers in the input are refused rather than taken for spans.
    let bad = vec![serde_json::json!({"role": "user", "content": "a\u{FDD0}b"})];
    assert!(
        compiled
            .render_with_generation_spans(&bad, false, &special, &kwargs)
            .is_err()
    );
    assert!(compiled.render(&bad, false, &special, &kwargs).is_ok());
}

/// Parses inline JSONL rows with the tokenizer fixture.
fn parse(rows: &str, options: &SftOptions) -> Result<SftDataset, BridgeError> {
    parse_sft_jsonl(
        Path::new("inline.jsonl"),
        rows.as_bytes(),
        &tokenizer(),
        options,
    )
}

/// Asserts `rows` are refused at `line` (and `field`), the message holding `needle`.
fn refused(rows: &str, options: &SftOptions, line: usize, field: Option<&str>, needle: &str) {
    match parse(rows, options) {
        Err(BridgeError::SftRow {
            path,
            line: got_line,
            field: got_field,
            reason,
        }) => {
            let text = format!("{path:?} {got_line} {got_field:?} {reason}");
            assert_eq!(path, Path::new("inline.jsonl"), "{text}");
            assert_eq!(got_line, line, "{text}");
            assert_eq!(got_field.as_deref(), field, "{text}");
            assert!(reason.contains(needle), "{text}: expected {needle:?}");
        }
        other => panic!("expected a row error at line {line}, got {other:?}"),
    }
}

const GOOD: &str = r#"{"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}"#;

#[test]
fn bad_rows_are_refused_naming_line_and_field() {
    let o = SftOptions::default();
    let good = GOOD;
    refused(&format!("{good}\n{{not json"), &o, 2, None, "not JSON");
    refused(
        &format!("{good}\n\n[1, 2]"),
        &o,
        3,
        None,
        "expected a JSON object",
    );
    refused(r#"{"text": "plain"}"#, &o, 1, None, "no `messages`");
    refused(r#"{"prompt": "a"}"#, &o, 1, Some("completion"), "missing");
    refused(
        r#"{"completion": "a", "prompt": null}"#,
        &o,
        1,
        Some("prompt"),
        "missing",
    );
    refused(
        r#"{"messages": [], "prompt": "a", "completion": "b"}"#,
        &o,
        1,
        None,
        "both `messages`",
    );
    refused(
        r#"{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}"#,
        &o,
        1,
        Some("completion"),
        "both must be text",
    );
    refused(
        r#"{"prompt": 3, "completion": "b"}"#,
        &o,
        1,
        Some("prompt"),
        "a number",
    );
    refused(
        &format!("{good}\n{{\"prompt\": \"a\", \"completion\": \"b\"}}"),
        &o,
        2,
        None,
        "line 1 is conversational",
    );
    refused(r#"{"messages": []}"#, &o, 1, Some("messages"), "empty list");
    refused(
        r#"{"messages": {"role": "user"}}"#,
        &o,
        1,
        Some("messages"),
        "a list of messages",
    );
    refused(
        r#"{"messages": ["hi"]}"#,
        &o,
        1,
        Some("messages[0]"),
        "message object",
    );
    refused(
        r#"{"messages": [{"content": "hi"}]}"#,
        &o,
        1,
        Some("messages[0].role"),
        "missing",
    );
    refused(
        r#"{"messages": [{"role": 1, "content": "hi"}]}"#,
        &o,
        1,
        Some("messages[0].role"),
        "expected a string",
    );
    refused(
        r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}]}"#,
        &o,
        1,
        Some("messages[1].role"),
        "unknown role \"narrator\"",
    );
    refused(
        r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}"#,
        &o,
        1,
        Some("messages[0].content"),
        "content parts",
    );
    refused(
        r#"{"messages": [{"role": "user"}]}"#,
        &o,
        1,
        Some("messages[0].content"),
        "missing",
    );
    refused(
        r#"{"prompt": [{"role": "user", "content": "a"}], "completion": []}"#,
        &o,
        1,
        Some("completion"),
        "empty list",
    );
    refused(&format!("{good}\n\u{0}\u{1}"), &o, 2, None, "not JSON");
    let with_tools = good.replace("]}", r#"], "tools": 5}"#);
    refused(&with_tools, &o, 1, Some("tools"), "list of tools");
    let with_tools = good.replace("]}", r#"], "tools": "[oops"}"#);
    refused(&with_tools, &o, 1, Some("tools"), "not JSON text");
    let kwargs = good.replace("]}", r#"], "chat_template_kwargs": [1]}"#);
    refused(&kwargs, &o, 1, Some("chat_template_kwargs"), "an object");
}

#[test]
fn invalid_utf8_is_refused_naming_the_line() {
    let mut bytes = GOOD.as_bytes().to_vec();
    bytes.extend_from_slice(b"\n{\"prompt\": \"\xff\"}");
    let err = parse_sft_jsonl(
        Path::new("x.jsonl"),
        &bytes,
        &tokenizer(),
        &SftOptions::default(),
    )
    .expect_err("bad utf-8");
    assert!(matches!(err, BridgeError::SftRow { line: 2, .. }), "{err}");
    assert!(err.to_string().contains("not UTF-8"), "{err}");
}

#[test]
fn a_raising_template_is_refused_with_its_message_and_line() {
    let options = SftOptions {
        chat_template: Some(template_file("generation_template.jinja")),
        ..SftOptions::default()
    };
    let rows = format!(
        "{GOOD}\n{}",
        r#"{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]}"#
    );
    refused(
        &rows,
        &options,
        2,
        Some("messages"),
        "The system message must come first.",
    );
    let err = parse(&rows, &options).unwrap_err().to_string();
    assert!(err.contains("generation_template.jinja"), "{err}");
    // Prompt-completion messages: the prompt renders first, the whole conversation second.
    let rows = r#"{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "system", "content": "late"}]}"#;
    refused(rows, &options, 1, Some("completion"), "must come first");
}

#[test]
fn untrained_and_overlong_examples_are_refused() {
    // Assistant-only loss on a conversation without an assistant turn (TRL raises too).
    let options = SftOptions {
        assistant_only_loss: true,
        ..SftOptions::default()
    };
    let rows = format!(
        "{GOOD}\n{}",
        r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}"#
    );
    refused(&rows, &options, 2, Some("messages"), "no assistant token");
    // No trained token: the completion adds nothing to what the template writes.
    let options = SftOptions {
        chat_template: Some(ChatTemplate {
            source: "{% for m in messages %}{{ m.content }}{% endfor %}".into(),
            path: PathBuf::from("concat.jinja"),
            name: None,
        }),
        ..SftOptions::default()
    };
    let rows = r#"{"prompt": [{"role": "user", "content": "abc"}], "completion": [{"role": "assistant", "content": ""}]}"#;
    refused(rows, &options, 1, None, "no token");
    // Over the maximum length, refused rather than cut.
    let options = SftOptions {
        max_length: Some(8),
        truncation: Truncation::Refuse,
        ..SftOptions::default()
    };
    let rows = format!(
        "{}\n{}",
        r#"{"prompt": "a", "completion": "b"}"#,
        r#"{"prompt": "a", "completion": "a longer completion"}"#
    );
    refused(&rows, &options, 2, None, "more than the maximum length 8");
    // The same row is cut with `Truncate`.
    let options = SftOptions {
        max_length: Some(8),
        ..SftOptions::default()
    };
    let data = parse(&rows, &options).expect("truncated");
    assert_eq!(data.examples[1].len(), 8);
    assert!(data.examples[1].is_truncated());
}

#[test]
fn bad_files_and_options_are_refused() {
    let o = SftOptions::default();
    for rows in ["", "\n  \n"] {
        let err = parse(rows, &o).expect_err("no rows");
        assert!(matches!(err, BridgeError::SftData { .. }), "{err}");
    }
    let zero = SftOptions {
        max_length: Some(0),
        ..SftOptions::default()
    };
    assert!(matches!(
        parse(GOOD, &zero),
        Err(BridgeError::SftData { .. })
    ));
    let with_bom = format!("\u{feff}{GOOD}\r\n\r\n{GOOD}\r\n");
    let data = parse(&with_bom, &o).expect("BOM and CRLF");
    assert_eq!(
        data.examples.iter().map(|e| e.line).collect::<Vec<_>>(),
        [1, 3]
    );
    let err = read_sft_jsonl("/nonexistent/sft.jsonl", &tokenizer(), &o).expect_err("missing");
    assert!(matches!(err, BridgeError::Io { .. }), "{err}");
    // Packing refuses rows too long for it and empty rows.
    let data = parse(GOOD, &o).expect("good");
    let err = data.pack_bfd(4).expect_err("too long");
    assert!(matches!(err, BridgeError::SftRow { line: 1, .. }), "{err}");
    assert!(matches!(data.pack_bfd(0), Err(BridgeError::SftData { .. })));
}

#[test]
fn conversation_defaults_train_every_token_and_add_no_eos() {
    // TRL's defaults: no assistant-only loss, so a conversation trains on every token, and the
    // template (not TRL) ends it.
    let tok = tokenizer();
    let data = parse(GOOD, &SftOptions::default()).expect("good");
    let example = &data.examples[0];
    assert_eq!(data.shape, SftShape::Conversational);
    assert_eq!(example.trained_tokens(), example.len());
    let messages: Vec<Value> = serde_json::from_str::<Value>(GOOD).unwrap()["messages"]
        .as_array()
        .unwrap()
        .clone();
    let text = tok
        .apply_chat_template(&messages, false, &Map::new())
        .unwrap();
    assert_eq!(example.input_ids, tok.encode(&text, false).unwrap());
}

#[test]
fn rows_pass_tools_and_template_kwargs() {
    let tok = tokenizer();
    let tools = serde_json::json!([{"type": "function", "function": {"name": "lookup"}}]);
    let row = serde_json::json!({
        "messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Yo."}],
        "tools": tools.to_string(),
        "chat_template_kwargs": {"enable_thinking": false},
    });
    let data = parse(&row.to_string(), &SftOptions::default()).expect("tools");
    let mut kwargs = Map::new();
    kwargs.insert("tools".into(), tools);
    kwargs.insert("enable_thinking".into(), Value::Bool(false));
    let text = tok
        .apply_chat_template(row["messages"].as_array().unwrap(), false, &kwargs)
        .unwrap();
    assert!(text.contains("lookup"), "{text}");
    assert_eq!(
        data.examples[0].input_ids,
        tok.encode(&text, false).unwrap()
    );
}

#[test]
fn mangled_rows_never_panic() {
    let tok = tokenizer();
    let mut source = Vec::new();
    for file in [
        "conversational.jsonl",
        "prompt_completion.jsonl",
        "prompt_completion_messages.jsonl",
    ] {
        source.extend(std::fs::read(sft_dir().join(file)).expect("fixture"));
    }
    let mut rng = SplitMix::new(11);
    let flips = [
        b'"', b'{', b'}', b'[', b']', b',', b':', b'\n', b' ', b'x', 0xff, b'\\',
    ];
    for round in 0..200 {
        let mut bytes = source.clone();
        for _ in 0..1 + rng.below(6) {
            let at = rng.below(bytes.len());
            match rng.below(3) {
                0 => bytes[at] = rng.pick(&flips),
                1 => {
                    bytes.remove(at);
                }
                _ => bytes.insert(at, rng.pick(&flips)),
            }
        }
        let options = SftOptions {
            max_length: Some(1 + rng.below(80)),
            truncation: if round % 2 == 0 {
                Truncation::Truncate
            } else {
                Truncation::Refuse
            },
            assistant_only_loss: round % 3 == 0,
            completion_only_loss: None,
            chat_template: None,
        };
        if let Ok(data) = parse_sft_jsonl(Path::new("m.jsonl"), &bytes, &tok, &options) {
            let _ = data.pack_bfd(1 + rng.below(128));
        }
    }
}
