//! Safetensors encoding of [`RouterReplayFile`] (see the parent module for the format). A
//! self-contained reader/writer: moe-models does not depend on moe-bridge.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::{REPLAY_FORMAT, RouterReplayFile, replay_error, replay_tensor_name};
use crate::ModelError;

/// Largest header accepted (the file holds a few dozen tensor entries).
const MAX_HEADER: u64 = 1 << 24;

pub(super) fn encode(file: &RouterReplayFile) -> Vec<u8> {
    let mut header = Map::new();
    header.insert(
        "__metadata__".to_owned(),
        json!({
            "format": REPLAY_FORMAT,
            "version": "1",
            "model_type": file.model_type,
            "k": file.topk.to_string(),
            "num_tokens": file.num_tokens.to_string(),
        }),
    );
    let mut offset = 0usize;
    for (&layer, ids) in &file.layers {
        let end = offset + ids.len() * 4;
        header.insert(
            replay_tensor_name(layer),
            json!({
                "dtype": "I32",
                "shape": [file.num_tokens, file.topk],
                "data_offsets": [offset, end],
            }),
        );
        offset = end;
    }
    let mut text = Value::Object(header).to_string();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = Vec::with_capacity(8 + text.len() + offset);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    for ids in file.layers.values() {
        out.extend(ids.iter().flat_map(|v| v.to_le_bytes()));
    }
    out
}

fn metadata_usize(meta: &Map<String, Value>, key: &str) -> Result<usize, ModelError> {
    let text = meta
        .get(key)
        .ok_or_else(|| replay_error(format!("`__metadata__` lacks `{key}`")))?;
    text.as_str().and_then(|t| t.parse().ok()).ok_or_else(|| {
        replay_error(format!(
            "`__metadata__.{key}` must be a string holding an integer, found {text}"
        ))
    })
}

/// `layers.{i}.topk_indices` → `i`.
fn layer_of(name: &str) -> Option<usize> {
    let digits = name
        .strip_prefix("layers.")?
        .strip_suffix(".topk_indices")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

pub(super) fn decode(bytes: &[u8]) -> Result<RouterReplayFile, ModelError> {
    let len_bytes: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| {
            replay_error(format!(
                "{} bytes: too short for a safetensors file",
                bytes.len()
            ))
        })?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER || header_len > (bytes.len() - 8) as u64 {
        return Err(replay_error(format!(
            "header length {header_len} exceeds the file ({} bytes) or the {MAX_HEADER}-byte limit",
            bytes.len()
        )));
    }
    let data = &bytes[8 + header_len as usize..];
    let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + header_len as usize])
        .map_err(|e| replay_error(format!("header is not a JSON object: {e}")))?;
    let meta = match header.get("__metadata__") {
        Some(Value::Object(m)) => m.clone(),
        _ => {
            return Err(replay_error(
                "`__metadata__` with `model_type` and `k` is missing",
            ));
        }
    };
    let model_type = meta
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| replay_error("`__metadata__` lacks the string `model_type`"))?
        .to_owned();
    let topk = metadata_usize(&meta, "k")?;
    let mut num_tokens: Option<usize> = match meta.contains_key("num_tokens") {
        true => Some(metadata_usize(&meta, "num_tokens")?),
        false => None,
    };
    let mut layers = BTreeMap::new();
    for (name, entry) in header.iter().filter(|(n, _)| *n != "__metadata__") {
        let bad = |reason: String| replay_error(format!("tensor `{name}`: {reason}"));
        let layer = layer_of(name)
            .ok_or_else(|| bad("unexpected name (expected `layers.{i}.topk_indices`)".into()))?;
        let dtype = entry.get("dtype").and_then(Value::as_str);
        if dtype != Some("I32") {
            return Err(bad(format!("dtype {dtype:?}, expected \"I32\"")));
        }
        let dims: Option<Vec<usize>> = entry.get("shape").and_then(Value::as_array).map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64().and_then(|v| usize::try_from(v).ok()))
                .collect()
        });
        let [t, k] = dims.as_deref().unwrap_or(&[]) else {
            return Err(bad(format!("shape {:?} is not [T, k]", entry.get("shape"))));
        };
        if *k != topk {
            return Err(bad(format!(
                "k = {k} in the shape, `__metadata__.k` = {topk}"
            )));
        }
        match num_tokens {
            Some(n) if n != *t => {
                return Err(bad(format!(
                    "{t} tokens, expected {n} (every layer has the same T)"
                )));
            }
            _ => num_tokens = Some(*t),
        }
        let offsets: Vec<usize> = entry
            .get("data_offsets")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64().map(|v| v as usize))
                    .collect()
            })
            .unwrap_or_default();
        let [begin, end] = offsets[..] else {
            return Err(bad("`data_offsets` must be [begin, end]".into()));
        };
        let needed = t.checked_mul(*k).and_then(|n| n.checked_mul(4));
        if end < begin || end > data.len() || Some(end - begin) != needed {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] do not hold [{t}, {k}] I32 values within the \
                 {}-byte data section",
                data.len()
            )));
        }
        let ids = data[begin..end]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        layers.insert(layer, ids);
    }
    Ok(RouterReplayFile {
        model_type,
        topk,
        num_tokens: num_tokens.unwrap_or(0),
        layers,
    })
}
