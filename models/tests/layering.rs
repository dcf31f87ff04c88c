//! The layers of moe-models import one way only (docs/architecture.md §Layers):
//!
//! *core* (configs' shared parts, layers, batches and packing, weights, the plan machinery,
//! the causal-LM basics) ← *parallel* (`distributed`: the context models are written against,
//! the stack / pipeline / context-parallel drivers, the one sharded model) ← *families* (one
//! folder per family and the family list) ← *consumers* (HF loading and export, checkpoints,
//! the trainer, RL, replay files, rollout, weight sync, upcycling, the planner).
//!
//! This test reads every non-test source file of the crate, resolves each `crate::…` and
//! `super::…` path it names to the top-level module it lands in (items re-exported at the
//! crate root are followed to the module `lib.rs` takes them from), and fails on any path
//! from a lower layer to a higher one, naming the file, the line and both layers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The layers, low to high.
const LAYERS: [&str; 4] = ["core", "parallel", "families", "consumers"];

/// The layer of each top-level module of `models/src` (and of the root aliases of `lib.rs`).
fn layer_of_module(top: &str) -> Option<usize> {
    let layer = match top {
        "error" | "config" | "layers" | "packing" | "weights" | "param_plan" | "causal_lm"
        | "batch" | "recompute" | "routing" | "logprob" | "export" => "core",
        "distributed" => "parallel",
        "families" | "family" | "qwen3" | "qwen3_moe" | "deepseek_v3" | "mtp" => "families",
        "hf" | "checkpoint" | "train" | "rl" | "rollout" | "replay" | "weight_sync" | "upcycle"
        | "plan" => "consumers",
        _ => return None,
    };
    LAYERS.iter().position(|&l| l == layer)
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a source file (`a/b.rs` and `a/b/mod.rs` are `[a, b]`; `lib.rs` is `[]`).
fn module_path(file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src()).expect("under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// Test-only files: `tests.rs`, `*_tests.rs`, anything under a `tests/` folder, `testing.rs`.
fn is_test_file(file: &Path) -> bool {
    let rel = file.strip_prefix(src()).expect("under src");
    let name = rel.file_name().unwrap_or_default().to_string_lossy();
    name == "tests.rs"
        || name.ends_with("_tests.rs")
        || name == "testing.rs"
        || rel.iter().any(|p| p == "tests")
}

/// The source of `file` without its trailing `#[cfg(test)]` module, comments stripped.
fn code(file: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(file).expect("read");
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate().peekable();
    while let Some((i, line)) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            // `#[cfg(test)] mod tests;` (a file of its own) or a trailing inline module: the
            // rest of the file is test code either way when an inline module follows.
            if let Some((_, next)) = lines.peek()
                && next.trim_start().starts_with("mod ")
                && next.trim_end().ends_with('{')
            {
                break;
            }
            continue;
        }
        if t.starts_with("//") {
            continue;
        }
        let line = match line.find("//") {
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        };
        // A `use` statement over several lines is read as one.
        let mut line = line.to_owned();
        if t.starts_with("use ") || t.starts_with("pub use ") || t.starts_with("pub(crate) use ") {
            while !line.contains(';') {
                let Some((_, next)) = lines.next() else {
                    break;
                };
                line.push(' ');
                line.push_str(next.trim());
            }
        }
        out.push((i + 1, line));
    }
    out
}

/// The first segment of every path in a `{a::X, b::{Y, Z}, W}` group starting at `text`
/// (just after the `{`).
fn group_heads(text: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                heads.push(text[start..i].to_owned());
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                heads.push(text[start..i].to_owned());
                start = i + 1;
            }
            _ => {}
        }
    }
    heads
        .iter()
        .map(|h| {
            h.trim()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|h| !h.is_empty() && h != "self")
        .collect()
}

/// The key under which [`root_reexports`] records the module of the root's glob re-export.
const GLOB: &str = "*";

/// Root items `lib.rs` re-exports: item name → the top-level module it comes from.
fn root_reexports() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(src().join("lib.rs")).expect("lib.rs");
    let mut map = BTreeMap::new();
    let flat = text.replace('\n', " ");
    for stmt in flat.split(';') {
        let stmt = stmt.trim();
        let Some(rest) = stmt.strip_prefix("pub use ") else {
            continue;
        };
        let (module, items) = match rest.split_once("::{") {
            Some((m, items)) => (m.trim(), items.trim_end_matches('}').to_owned()),
            None => match rest.rsplit_once("::") {
                Some((m, item)) => (m.trim(), item.to_owned()),
                None => (rest, rest.to_owned()),
            },
        };
        let top = module.split("::").next().unwrap_or(module).to_owned();
        if items == "*" {
            // A glob (the families' prelude): every other root item names that module.
            map.insert(GLOB.to_owned(), top.clone());
            continue;
        }
        for item in items.split(',') {
            let item = item.trim();
            let name = item.rsplit(" as ").next().unwrap_or(item);
            let name = name.rsplit("::").next().unwrap_or(name).trim();
            if !name.is_empty() {
                map.insert(name.to_owned(), top.clone());
            }
        }
    }
    map
}

/// The top-level module a root path segment `first` lands in: a module itself, an item
/// `lib.rs` re-exports by name, or else one of its glob's.
fn resolve_root(roots: &BTreeMap<String, String>, first: String) -> String {
    if let Some(top) = roots.get(&first) {
        return top.clone();
    }
    let is_module = layer_of_module(&first).is_some();
    match roots.get(GLOB) {
        Some(glob) if !is_module && first.starts_with(|c: char| c.is_ascii_uppercase()) => {
            glob.clone()
        }
        _ => first,
    }
}

/// Every `crate::a…` / `super::…` path start in `line`, resolved to a top-level module name.
fn referenced_modules(
    line: &str,
    here: &[String],
    roots: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = line.as_bytes();
    let ident = |from: usize| -> String {
        line[from..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let boundary =
        |at: usize| at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_');
    for (at, _) in line.match_indices("crate::") {
        if !boundary(at) || line[..at].ends_with('$') {
            continue;
        }
        let after = at + "crate::".len();
        let firsts = match line[after..].strip_prefix('{') {
            Some(group) => group_heads(group),
            None => vec![ident(after)],
        };
        for first in firsts {
            out.push(resolve_root(roots, first));
        }
    }
    for (at, _) in line.match_indices("super::") {
        if !boundary(at) || (at >= 7 && &line[at - 7..at] == "super::") {
            continue;
        }
        // Count the chain of `super::`.
        let mut depth = 0;
        let mut p = at;
        while line[p..].starts_with("super::") {
            depth += 1;
            p += "super::".len();
        }
        // `super` of a file's module: its parent (a `mod.rs` module is its own folder).
        let mut base: Vec<String> = here.to_vec();
        for _ in 0..depth {
            base.pop();
        }
        match base.first() {
            Some(top) => out.push(top.clone()),
            None => {
                let firsts = match line[p..].strip_prefix('{') {
                    Some(group) => group_heads(group),
                    None => vec![ident(p)],
                };
                // (Only `crate::` paths take the glob: a `super::` at the root from an inline
                // module names the file's own module.)
                for first in firsts {
                    out.push(roots.get(&first).cloned().unwrap_or(first));
                }
            }
        }
    }
    out
}

#[test]
fn imports_run_from_consumers_down_to_core_only() {
    let roots = root_reexports();
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut violations = Vec::new();
    let mut checked = 0;
    for file in files.iter().filter(|f| !is_test_file(f)) {
        let here = module_path(file);
        let Some(top) = here.first() else {
            continue; // lib.rs: the crate root re-exports every layer
        };
        let Some(mine) = layer_of_module(top) else {
            panic!(
                "{}: top-level module `{top}` has no layer (add it to layer_of_module)",
                file.display()
            );
        };
        for (line_no, line) in code(file) {
            for module in referenced_modules(&line, &here, &roots) {
                checked += 1;
                let Some(theirs) = layer_of_module(&module) else {
                    continue; // a root item defined in lib.rs itself or a macro path
                };
                if theirs > mine {
                    violations.push(format!(
                        "{}:{line_no}: {} (layer `{}`) imports `{module}` (layer `{}`)",
                        file.strip_prefix(src()).unwrap_or(file).display(),
                        here.join("::"),
                        LAYERS[mine],
                        LAYERS[theirs],
                    ));
                }
            }
        }
    }
    assert!(
        checked > 300,
        "only {checked} paths found: the scanner is broken"
    );
    assert!(
        violations.is_empty(),
        "{} imports go up a layer:\n{}",
        violations.len(),
        violations.join("\n")
    );
}

/// The scanner sees an upward import: a probe line in a core file naming a consumer.
#[test]
fn a_probe_import_from_core_to_a_consumer_is_caught() {
    let roots = root_reexports();
    let here = vec!["layers".to_owned(), "attention".to_owned()];
    let found = referenced_modules("use crate::train::TrainBatch;", &here, &roots);
    assert_eq!(found, vec!["train".to_owned()]);
    let mine = layer_of_module("layers");
    let theirs = layer_of_module("train");
    assert!(theirs > mine);
    // `super::super::` from `families/qwen3/model.rs` lands in `families`; from
    // `distributed/runtime.rs`, `super::` stays in `distributed`.
    let here = vec![
        "families".to_owned(),
        "qwen3".to_owned(),
        "model".to_owned(),
    ];
    assert_eq!(
        referenced_modules("use super::super::Family;", &here, &roots),
        vec!["families".to_owned()]
    );
    // A family's type re-exported by the root's glob resolves to the families.
    assert_eq!(
        referenced_modules("use crate::Qwen3MoeConfig;", &here, &roots),
        vec!["families".to_owned()]
    );
    // A root re-export resolves to its module.
    assert_eq!(
        referenced_modules("use crate::ModelError;", &here, &roots),
        vec!["error".to_owned()]
    );
}
