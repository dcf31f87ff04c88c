//! The expected-tensor tables derived from the plans
//! ([`derive_expected`](crate::families::expected::derive_expected)) against the tables the
//! families wrote by hand before (per-family `*_expected` functions, removed since): every
//! fixture config and variants of it (tied / untied heads, biases, QK-norms, low-rank queries,
//! shared experts, MTP depths, dense layers), both expert layouts, two FP8 block sizes. The
//! hand-written tables were written to `tests/fixtures/expected_tables.txt` by
//! [`write_hand_written_tables`] at the commit that introduced this test, while they still
//! existed (`cargo test -p moe-models --lib write_hand_written_tables -- --ignored`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use moe_bridge::mapping::{ExpectedTable, ExpertLayout, HfRole};
use serde_json::{Value, json};

use crate::ModelConfig;
use crate::families::{Family, expected::derive_expected};
use crate::hf::ConfigVisitor;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn golden_path() -> PathBuf {
    fixtures().join("expected_tables.txt")
}

/// `(label, config.json)` of every case: each fixture config, and edits of some.
fn cases() -> Vec<(String, Value)> {
    let read = |name: &str| -> Value {
        let text = std::fs::read_to_string(fixtures().join(name).join("config.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    };
    let mut out = Vec::new();
    for name in [
        "qwen3",
        "qwen3_sliding",
        "qwen3_moe",
        "qwen3_moe_bf16",
        "deepseek_v3",
        "deepseek_v3_sharded",
        "deepseek_v3_fp8",
        "deepseek_v3_fp8_dequant",
        "glm4_moe",
        "mixtral",
        "gpt_oss",
        "gpt_oss_mxfp4",
    ] {
        out.push((name.to_owned(), read(name)));
    }
    type Edit<'a> = (&'a str, &'a str, &'a [(&'a str, Value)]);
    let edits: &[Edit<'_>] = &[
        (
            "qwen3",
            "untied_bias",
            &[
                ("tie_word_embeddings", json!(false)),
                ("attention_bias", json!(true)),
            ],
        ),
        (
            "qwen3_moe",
            "tied_sparse_step",
            &[
                ("tie_word_embeddings", json!(true)),
                ("mlp_only_layers", json!([])),
                ("decoder_sparse_step", json!(2)),
            ],
        ),
        ("qwen3_moe", "bias", &[("attention_bias", json!(true))]),
        (
            "deepseek_v3",
            "direct_q_bias",
            &[
                ("q_lora_rank", Value::Null),
                ("attention_bias", json!(true)),
            ],
        ),
        (
            "deepseek_v3",
            "tied_two_mtp",
            &[
                ("tie_word_embeddings", json!(true)),
                ("num_nextn_predict_layers", json!(2)),
            ],
        ),
        (
            "deepseek_v3",
            "no_shared_no_mtp",
            &[
                ("n_shared_experts", json!(0)),
                ("num_nextn_predict_layers", json!(0)),
                ("first_k_dense_replace", json!(0)),
            ],
        ),
        (
            "glm4_moe",
            "plain",
            &[
                ("use_qk_norm", json!(false)),
                ("attention_bias", json!(false)),
                ("num_nextn_predict_layers", json!(0)),
            ],
        ),
        (
            "glm4_moe",
            "tied_two_mtp",
            &[
                ("tie_word_embeddings", json!(true)),
                ("num_nextn_predict_layers", json!(2)),
                ("n_shared_experts", json!(2)),
            ],
        ),
        ("mixtral", "tied", &[("tie_word_embeddings", json!(true))]),
        (
            "gpt_oss",
            "tied_no_bias",
            &[
                ("tie_word_embeddings", json!(true)),
                ("attention_bias", json!(false)),
            ],
        ),
    ];
    for (fixture, label, changes) in edits {
        let mut config = read(fixture);
        for (key, value) in *changes {
            config[*key] = value.clone();
        }
        out.push((format!("{fixture}:{label}"), config));
    }
    out
}

const LAYOUTS: [ExpertLayout; 2] = [ExpertLayout::PerExpert, ExpertLayout::Stacked];
const BLOCKS: [[usize; 2]; 2] = [[128, 128], [16, 8]];

/// One line per tensor: name, shape, required / optional, weight / scale of, MXFP4 shape.
fn render(table: &ExpectedTable) -> Vec<String> {
    table
        .iter()
        .map(|(name, t)| {
            let mut line = format!(
                "{name} {:?} {}",
                t.shape,
                if t.required { "required" } else { "optional" }
            );
            match t.role {
                HfRole::Weight => line.push_str(" weight"),
                HfRole::ScaleInv => {
                    let _ = write!(line, " scale_of={}", t.scale_of.as_deref().unwrap_or("?"));
                }
            }
            if let Some(m) = &t.mxfp4 {
                let _ = write!(line, " mxfp4={m:?}");
            }
            line
        })
        .collect()
}

fn header(label: &str, layout: ExpertLayout, block: [usize; 2]) -> String {
    format!("## {label} {layout:?} {}x{}", block[0], block[1])
}

/// The golden file's sections by header.
fn golden() -> BTreeMap<String, Vec<String>> {
    let text = std::fs::read_to_string(golden_path()).unwrap();
    let mut sections = BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in text.lines() {
        if line.starts_with("## ") {
            if let Some((h, lines)) = current.take() {
                sections.insert(h, lines);
            }
            current = Some((line.to_owned(), Vec::new()));
        } else if !line.starts_with('#')
            && let Some((_, lines)) = &mut current
        {
            lines.push(line.to_owned());
        }
    }
    if let Some((h, lines)) = current {
        sections.insert(h, lines);
    }
    sections
}

/// Writes the tables of the current `expected_hf_tensors` (the hand-written ones, when run at
/// the commit that introduced this test) to the golden file.
#[test]
#[ignore = "writes tests/fixtures/expected_tables.txt from the hand-written tables"]
fn write_hand_written_tables() {
    let mut out = String::from(
        "# The expected-tensor tables of the families' hand-written `*_expected` functions (moe-models\n\
         # before the tables were derived from the plans), written by\n\
         # models/src/hf/tests/expected_tables.rs `write_hand_written_tables`.\n",
    );
    for (label, config) in cases() {
        let path = Path::new("config.json");
        let parsed = ModelConfig::from_json(&config, path).unwrap();
        for layout in LAYOUTS {
            for block in BLOCKS {
                let table = parsed.expected_hf_tensors(layout, path, block).unwrap();
                out.push_str(&header(&label, layout, block));
                out.push('\n');
                for line in render(&table) {
                    out.push_str(&line);
                    out.push('\n');
                }
            }
        }
    }
    std::fs::write(golden_path(), out).unwrap();
}

struct Derive(ExpertLayout, [usize; 2]);

impl ConfigVisitor for Derive {
    type Output = Result<ExpectedTable, moe_bridge::BridgeError>;
    fn visit<F: Family>(self, config: &F::Config) -> Self::Output {
        derive_expected::<F>(config, self.0, Path::new("config.json"), self.1)
    }
}

/// The derived tables equal the hand-written ones for every family, fixture config and
/// variant, both expert layouts and two FP8 block sizes; so does what loading uses
/// (`expected_hf_tensors`).
#[test]
fn derived_tables_equal_the_hand_written_ones() {
    let golden = golden();
    let mut checked = 0;
    let mut problems = Vec::new();
    for (label, config) in cases() {
        let path = Path::new("config.json");
        let parsed = ModelConfig::from_json(&config, path).unwrap();
        for layout in LAYOUTS {
            for block in BLOCKS {
                let h = header(&label, layout, block);
                let want = golden.get(&h).unwrap_or_else(|| panic!("no golden `{h}`"));
                let derived = parsed.visit(Derive(layout, block)).unwrap().unwrap();
                let used = parsed.expected_hf_tensors(layout, path, block).unwrap();
                for (what, table) in [("derived", &derived), ("expected_hf_tensors", &used)] {
                    let got = render(table);
                    if &got != want {
                        let missing: Vec<_> = want.iter().filter(|l| !got.contains(l)).collect();
                        let extra: Vec<_> = got.iter().filter(|l| !want.contains(l)).collect();
                        problems.push(format!(
                            "{h} ({what}): {} missing {:?}…, {} extra {:?}…",
                            missing.len(),
                            &missing[..missing.len().min(4)],
                            extra.len(),
                            &extra[..extra.len().min(4)]
                        ));
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert_eq!(checked, golden.len(), "every golden section checked");
    assert_eq!(checked, 22 * 4);
}
