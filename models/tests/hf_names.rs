//! HF tensor-name literals (`model.layers`, `self_attn.q_proj`, `lm_head`, …) are spelled
//! only in the models' plan/mapping files: `param_plan/hf_names.rs` (the shared Llama-family
//! layout) and each model's `param_plan/{qwen3,qwen3_moe,deepseek_v3}.rs`. Everything else
//! reads names from there (issue 15).
//!
//! This test scans the workspace's non-test Rust sources (skipping `tests/` directories,
//! `*tests.rs`, `benches/`, `examples/`, modules declared under `#[cfg(test)]`, the rest of a
//! file from an inline `#[cfg(test)] mod … {`, and comments) for string literals holding an HF tensor-name
//! token and fails listing `file:line` of every one outside the allowed files.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The files that may spell HF tensor names: the shared names and every family's plan file
/// (`models/src/families/<family>/plan.rs`, see [`allowed`]).
const ALLOWED: [&str; 2] = [
    "models/src/param_plan/hf_names.rs",
    "models/src/families/<family>/plan.rs",
];

/// Whether `rel` may spell HF tensor names.
fn allowed(rel: &str) -> bool {
    ALLOWED[..1].contains(&rel)
        || (rel.starts_with("models/src/families/") && rel.ends_with("/plan.rs"))
}

/// HF tensor-name tokens, matched whole (not inside a longer identifier such as
/// `n_shared_experts`).
const TOKENS: [&str; 32] = [
    "model.layers",
    "model.embed_tokens",
    "embed_tokens",
    "model.norm",
    "lm_head",
    "self_attn",
    "input_layernorm",
    "post_attention_layernorm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
    "q_norm",
    "k_norm",
    "mlp.gate",
    "mlp.experts",
    "e_score_correction_bias",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "shared_experts",
    "enorm",
    "hnorm",
    "eh_proj",
    "shared_head",
];

/// Literals that contain a token but are not HF tensor names: `(file, token, why)`.
const NOT_TENSOR_NAMES: [(&str, &str, &str); 8] = [
    (
        "models/src/plan/activations.rs",
        "shared_experts",
        "a recompute module name (config value)",
    ),
    (
        "models/src/recompute.rs",
        "shared_experts",
        "a recompute module name (config value)",
    ),
    (
        "models/src/distributed/runtime.rs",
        "shared_experts",
        "the recompute module list in an error message",
    ),
    (
        "models/src/layers/attention.rs",
        "o_proj",
        "an error message naming the module",
    ),
    (
        "models/src/layers/mla.rs",
        "o_proj",
        "an error message naming the module",
    ),
    (
        "moe-backend/src/optim/muon.rs",
        "lm_head",
        "Muon's default selection by Burn module path (Megatron / HF naming convention) for \
         modules without a plan; the trainer takes the plan's (`ParallelPlan::muon_matrices`)",
    ),
    (
        "moe-backend/src/optim/muon.rs",
        "o_proj",
        "Muon's default row-parallel heuristic by Burn module path",
    ),
    (
        "moe-backend/src/optim/muon.rs",
        "down_proj",
        "Muon's default row-parallel heuristic by Burn module path",
    ),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            let skip = name.starts_with('.')
                || matches!(
                    name.as_str(),
                    "target" | "tests" | "benches" | "examples" | "fixtures" | "shared"
                );
            if !skip {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") && !name.ends_with("tests.rs") {
            out.push(path);
        }
    }
}

/// Module files declared under `#[cfg(test)]` (`#[cfg(test)] mod x;` → `x.rs`, `x/mod.rs`).
fn test_only_modules(files: &[PathBuf]) -> HashSet<PathBuf> {
    let mut out = HashSet::new();
    for file in files {
        let Ok(text) = fs::read_to_string(file) else {
            continue;
        };
        let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
        let dir = file.parent().unwrap_or(Path::new(""));
        let mod_dir = if matches!(stem, "mod" | "lib" | "main") {
            dir.to_path_buf()
        } else {
            dir.join(stem)
        };
        let lines: Vec<&str> = text.lines().collect();
        for w in lines.windows(2) {
            if !w[0].trim().starts_with("#[cfg(test)]") {
                continue;
            }
            let decl = w[1].trim();
            let decl = decl
                .strip_prefix("pub(crate) ")
                .or_else(|| decl.strip_prefix("pub "))
                .unwrap_or(decl);
            if let Some(name) = decl.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
                out.insert(mod_dir.join(format!("{name}.rs")));
                out.insert(mod_dir.join(name).join("mod.rs"));
            }
        }
    }
    out
}

/// The string literals of `line` outside comments; `in_str` carries an unterminated literal
/// over lines.
fn literals(line: &str, in_str: &mut Option<String>) -> Vec<String> {
    let c: Vec<char> = line.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        if let Some(cur) = in_str.as_mut() {
            match c[i] {
                '\\' => {
                    i += 2;
                    continue;
                }
                '"' => {
                    out.push(std::mem::take(cur));
                    *in_str = None;
                }
                ch => cur.push(ch),
            }
            i += 1;
            continue;
        }
        match c[i] {
            '/' if c.get(i + 1) == Some(&'/') => break,
            '"' => *in_str = Some(String::new()),
            '\'' if c.get(i + 1) == Some(&'\\') => {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
            }
            '\'' if c.get(i + 2) == Some(&'\'') => i += 2,
            _ => {}
        }
        i += 1;
    }
    if let Some(cur) = in_str.as_mut() {
        out.push(std::mem::take(cur));
    }
    out
}

/// Whether the item after a `#[cfg(test)]` (the first line of `rest` that is not an attribute)
/// opens an inline module (`mod tests {`).
fn inline_module(rest: &[&str]) -> bool {
    rest.iter()
        .map(|l| l.trim())
        .find(|l| !l.starts_with("#["))
        .is_some_and(|l| {
            let l = l
                .strip_prefix("pub(crate) ")
                .or_else(|| l.strip_prefix("pub "))
                .unwrap_or(l);
            l.starts_with("mod ") && l.ends_with('{')
        })
}

/// The HF-name tokens found whole in `s`.
fn tokens_in(s: &str) -> Vec<&'static str> {
    let ident = |ch: Option<char>| ch.is_some_and(|ch| ch.is_ascii_alphanumeric() || ch == '_');
    TOKENS
        .iter()
        .copied()
        .filter(|t| {
            s.match_indices(t).any(|(at, _)| {
                !ident(s[..at].chars().next_back()) && !ident(s[at + t.len()..].chars().next())
            })
        })
        .collect()
}

/// `file:line: text` of every HF tensor-name literal outside the allowed files.
fn violations() -> Vec<String> {
    let root = root();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    let test_only = test_only_modules(&files);
    let mut out = Vec::new();
    for file in &files {
        let rel = file
            .strip_prefix(&root)
            .unwrap_or(file)
            .to_string_lossy()
            .replace('\\', "/");
        if allowed(&rel) || test_only.contains(file) {
            continue;
        }
        let Ok(text) = fs::read_to_string(file) else {
            continue;
        };
        let mut in_str = None;
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in lines.iter().enumerate() {
            if line.trim_start().starts_with("#[cfg(test)]") && inline_module(&lines[n + 1..]) {
                // An inline test module: the rest of the file is tests.
                break;
            }
            for lit in literals(line, &mut in_str) {
                for token in tokens_in(&lit) {
                    let excused = NOT_TENSOR_NAMES
                        .iter()
                        .any(|(f, t, _)| *f == rel && (*t == token || *t == "*"));
                    if !excused {
                        out.push(format!("{rel}:{}: `{token}` in {:?}", n + 1, lit));
                    }
                }
            }
        }
    }
    out
}

#[test]
fn hf_tensor_names_live_in_the_plan_files() {
    let found = violations();
    assert!(
        found.is_empty(),
        "HF tensor-name literals outside {ALLOWED:?} (read them from \
         moe_models::param_plan::hf_names or the model's plan file):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_scanner_sees_literals_and_skips_comments() {
    let mut s = None;
    assert_eq!(
        literals(r#"let a = "model.layers.{l}"; // "lm_head""#, &mut s),
        ["model.layers.{l}"]
    );
    assert_eq!(literals(r#"let q = '"'; f("x")"#, &mut s), ["x"]);
    assert_eq!(
        tokens_in("model.layers.0.mlp.gate_proj.weight"),
        ["model.layers", "gate_proj"]
    );
    assert!(tokens_in("n_shared_experts renormalise mla_up_proj").is_empty());
}
