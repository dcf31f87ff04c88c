//! `model.safetensors.index.json`: the tensor → shard map of a sharded checkpoint.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::BridgeError;

/// File name of the single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Parses an index file's text into `tensor name → shard file name`.
///
/// Only `weight_map` is required (docs/checkpoints.md §HF checkpoint conventions); `metadata` is
/// ignored. Shard names must be plain file names in the checkpoint directory (no separators, not
/// `.`/`..`).
pub fn parse_index(text: &str, path: &Path) -> Result<BTreeMap<String, String>, BridgeError> {
    let invalid = |reason: String| BridgeError::InvalidIndex {
        path: path.to_path_buf(),
        reason,
    };
    let value: Value = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
    let Value::Object(mut top) = value else {
        return Err(invalid("top level is not a JSON object".to_owned()));
    };
    let map = match top.remove("weight_map") {
        Some(Value::Object(map)) => map,
        Some(other) => {
            return Err(invalid(format!(
                "`weight_map` is {}, not an object",
                json_kind(&other)
            )));
        }
        None => return Err(invalid("missing `weight_map`".to_owned())),
    };
    map.into_iter()
        .map(|(tensor, shard)| match shard {
            Value::String(s) if is_plain_file_name(&s) => Ok((tensor, s)),
            Value::String(s) => Err(invalid(format!(
                "tensor `{tensor}`: shard \"{s}\" is not a plain file name"
            ))),
            other => Err(invalid(format!(
                "tensor `{tensor}`: shard is {}, not a string",
                json_kind(&other)
            ))),
        })
        .collect()
}

/// What a JSON value is, for errors (a whole `weight_map` can be megabytes: never printed).
fn json_kind(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(_) => "a string".to_owned(),
        Value::Array(items) => format!("an array of {} items", items.len()),
        Value::Object(map) => format!("an object of {} entries", map.len()),
    }
}

fn is_plain_file_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\\', '\0'])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<BTreeMap<String, String>, BridgeError> {
        parse_index(text, Path::new("ckpt/model.safetensors.index.json"))
    }

    #[test]
    fn only_weight_map_is_required() {
        let map =
            parse(r#"{"weight_map": {"b": "s2.safetensors", "a": "s1.safetensors"}}"#).unwrap();
        assert_eq!(map.len(), 2);
        assert_eq!(map["a"], "s1.safetensors");
        let map = parse(r#"{"metadata": {"total_size": 8}, "weight_map": {}}"#).unwrap();
        assert!(map.is_empty());
    }

    #[test]
    fn malformed_indexes_are_typed_errors() {
        for bad in [
            "",
            "[1, 2]",
            "{\"weight_map\": ",
            r#"{"metadata": {}}"#,
            r#"{"weight_map": [1]}"#,
            r#"{"weight_map": {"a": 3}}"#,
            r#"{"weight_map": {"a": "../escape.safetensors"}}"#,
            r#"{"weight_map": {"a": "sub/dir.safetensors"}}"#,
        ] {
            let err = parse(bad).unwrap_err();
            assert!(
                matches!(err, BridgeError::InvalidIndex { .. }),
                "{bad}: {err}"
            );
            assert!(err.to_string().contains("model.safetensors.index.json"));
        }
    }
}
