//! Safetensors encoding of [`RouterReplayFile`] (see the parent module for the format) with the
//! `safetensors` crate: it writes the file and validates the header (offsets contiguous, byte
//! lengths); this module checks the length prefix, maps the layers to tensors and back, and
//! names the tensor or field at fault.

use std::collections::{BTreeMap, HashMap};

use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo, TensorView};

use super::{REPLAY_FORMAT, RouterReplayFile, replay_error, replay_tensor_name};
use crate::ModelError;

/// Largest header accepted (the file holds a few dozen tensor entries), below the crate's
/// 100 MB.
const MAX_HEADER: u64 = 1 << 24;

/// The file's bytes; an error when a layer does not hold `num_tokens · topk` ids (only
/// editing [`RouterReplayFile::layers`] directly, not through `insert_layer`, can cause it).
pub(super) fn encode(file: &RouterReplayFile) -> Result<Vec<u8>, ModelError> {
    let metadata = HashMap::from([
        ("format".to_owned(), REPLAY_FORMAT.to_owned()),
        ("version".to_owned(), "1".to_owned()),
        ("model_type".to_owned(), file.model_type.clone()),
        ("k".to_owned(), file.topk.to_string()),
        ("num_tokens".to_owned(), file.num_tokens.to_string()),
    ]);
    let bytes: Vec<(String, Vec<u8>)> = file
        .layers
        .iter()
        .map(|(&layer, ids)| {
            let bytes = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
            (replay_tensor_name(layer), bytes)
        })
        .collect();
    let shape = vec![file.num_tokens, file.topk];
    let tensors = bytes
        .iter()
        .map(|(name, data)| {
            TensorView::new(Dtype::I32, shape.clone(), data)
                .map(|view| (name, view))
                .map_err(|e| {
                    replay_error(format!(
                        "`{name}`: {} ids do not fill [{}, {}] ({e})",
                        data.len() / 4,
                        file.num_tokens,
                        file.topk
                    ))
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize(tensors, Some(metadata))
        .map_err(|e| replay_error(format!("cannot serialise: {e}")))
}

fn metadata_usize(meta: &HashMap<String, String>, key: &str) -> Result<usize, ModelError> {
    let text = meta
        .get(key)
        .ok_or_else(|| replay_error(format!("`__metadata__` lacks `{key}`")))?;
    text.parse().map_err(|_| {
        replay_error(format!(
            "`__metadata__.{key}` must hold an integer, found \"{text}\""
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

/// The first entry whose `data_offsets` do not span `product(shape) · dtype size` bytes: the
/// crate reports that case without naming the tensor.
fn mis_sized(json: &[u8]) -> Option<String> {
    let entries: HashMap<String, serde_json::Value> = serde_json::from_slice(json).ok()?;
    entries.into_iter().find_map(|(name, entry)| {
        let info: TensorInfo = serde_json::from_value(entry).ok()?;
        let (begin, end) = info.data_offsets;
        let needed = info
            .shape
            .iter()
            .try_fold(info.dtype.bitsize() / 8, |n, &d| n.checked_mul(d));
        (needed != end.checked_sub(begin)).then(|| {
            format!(
                "tensor `{name}`: data_offsets [{begin}, {end}] do not hold {} {:?}",
                info.dtype, info.shape
            )
        })
    })
}

pub(super) fn decode(bytes: &[u8]) -> Result<RouterReplayFile, ModelError> {
    let Some(prefix) = bytes.first_chunk::<8>() else {
        return Err(replay_error(format!(
            "{} bytes: too short for a safetensors file",
            bytes.len()
        )));
    };
    let header_len = u64::from_le_bytes(*prefix);
    if header_len > MAX_HEADER || header_len > (bytes.len() - 8) as u64 {
        return Err(replay_error(format!(
            "header length {header_len} exceeds the file ({} bytes) or the {MAX_HEADER}-byte limit",
            bytes.len()
        )));
    }
    let (json, data) = bytes[8..].split_at(header_len as usize);
    // The crate's `Metadata` checks the entries as it deserialises them.
    let header: Metadata = serde_json::from_slice(json).map_err(|e| {
        let culprit = mis_sized(json).map_or_else(String::new, |c| format!(" ({c})"));
        replay_error(format!("invalid safetensors header: {e}{culprit}"))
    })?;
    let meta = header
        .metadata()
        .as_ref()
        .ok_or_else(|| replay_error("`__metadata__` with `model_type` and `k` is missing"))?;
    let model_type = meta
        .get("model_type")
        .ok_or_else(|| replay_error("`__metadata__` lacks `model_type`"))?
        .clone();
    let topk = metadata_usize(meta, "k")?;
    let mut num_tokens: Option<usize> = match meta.contains_key("num_tokens") {
        true => Some(metadata_usize(meta, "num_tokens")?),
        false => None,
    };
    let mut layers = BTreeMap::new();
    // The crate checked that the offsets are contiguous and span each tensor's byte length.
    for name in header.offset_keys() {
        let Some(info) = header.info(&name) else {
            continue;
        };
        let TensorInfo {
            dtype,
            shape,
            data_offsets: (begin, end),
        } = info;
        let bad = |reason: String| replay_error(format!("tensor `{name}`: {reason}"));
        let layer = layer_of(&name)
            .ok_or_else(|| bad("unexpected name (expected `layers.{i}.topk_indices`)".into()))?;
        if *dtype != Dtype::I32 {
            return Err(bad(format!("dtype {dtype}, expected I32")));
        }
        let &[t, k] = shape.as_slice() else {
            return Err(bad(format!("shape {shape:?} is not [T, k]")));
        };
        if k != topk {
            return Err(bad(format!(
                "k = {k} in the shape, `__metadata__.k` = {topk}"
            )));
        }
        match num_tokens {
            Some(n) if n != t => {
                return Err(bad(format!(
                    "{t} tokens, expected {n} (every layer has the same T)"
                )));
            }
            _ => num_tokens = Some(t),
        }
        let ids = data
            .get(*begin..*end)
            .ok_or_else(|| {
                bad(format!(
                    "data_offsets [{begin}, {end}] lie outside the {}-byte data section",
                    data.len()
                ))
            })?
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        layers.insert(layer, ids);
    }
    if header.data_len() != data.len() {
        return Err(replay_error(format!(
            "the {}-byte data section is longer than the {} bytes of the tensors",
            data.len(),
            header.data_len()
        )));
    }
    Ok(RouterReplayFile {
        model_type,
        topk,
        num_tokens: num_tokens.unwrap_or(0),
        layers,
    })
}
