//! Parsing and validating a safetensors header (checkpoints.md §1).
//!
//! Everything read from the file is treated as untrusted: lengths are bounds-checked before any
//! allocation, sizes use checked arithmetic, and every failure is a typed [`BridgeError`].

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::Path;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;

use super::Dtype;
use crate::BridgeError;

/// Largest header accepted, in bytes (the limit of the reference `safetensors` crate).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// Where one tensor lives in a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major); `[]` is a scalar.
    pub shape: Vec<usize>,
    /// `[begin, end)` byte range relative to the start of the data section.
    pub data_offsets: (usize, usize),
}

impl TensorInfo {
    /// Number of elements (validated not to overflow at parse time).
    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size of the tensor's data in bytes.
    pub fn byte_len(&self) -> usize {
        self.data_offsets.1 - self.data_offsets.0
    }
}

/// A validated safetensors header.
///
/// Guarantees: every tensor's byte range has exactly `product(shape) · dtype size` bytes, lies
/// inside the data section, no two tensors overlap and together they cover the data section
/// without holes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsHeader {
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// The `__metadata__` string map (empty when absent).
    pub metadata: BTreeMap<String, String>,
    /// Absolute file offset of the data section (`8 + header length`).
    pub data_start: usize,
}

impl SafetensorsHeader {
    /// Parses and validates the header of a whole safetensors file held in memory. `path` is
    /// only used to name the file in errors.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, BridgeError> {
        let file_len = bytes.len() as u64;
        let prefix = bytes.first_chunk::<8>().ok_or(BridgeError::FileTooShort {
            path: path.to_path_buf(),
            len: file_len,
        })?;
        let header_len = checked_header_len(*prefix, file_len, path)?;
        let json = bytes
            .get(8..8 + header_len)
            .ok_or_else(|| truncated(path, header_len as u64, file_len))?;
        parse_json(json, file_len, path)
    }

    /// Absolute byte range of tensor `name` in the file.
    pub fn byte_range(&self, name: &str) -> Option<Range<usize>> {
        let (begin, end) = self.tensors.get(name)?.data_offsets;
        Some(self.data_start + begin..self.data_start + end)
    }

    /// Length of the data section in bytes (the sum of all tensor sizes).
    pub fn data_len(&self) -> usize {
        self.tensors.values().map(TensorInfo::byte_len).sum()
    }
}

/// Reads and validates only the header of the safetensors file at `path` (the data section is
/// not read; its length comes from the file size).
pub fn read_header(path: &Path) -> Result<SafetensorsHeader, BridgeError> {
    let io = |source| BridgeError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    if file_len < 8 {
        return Err(BridgeError::FileTooShort {
            path: path.to_path_buf(),
            len: file_len,
        });
    }
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix).map_err(io)?;
    let header_len = checked_header_len(prefix, file_len, path)?;
    let mut json = vec![0u8; header_len];
    file.read_exact(&mut json).map_err(io)?;
    parse_json(&json, file_len, path)
}

/// Decodes the length prefix and checks it against the limit and the file size.
fn checked_header_len(prefix: [u8; 8], file_len: u64, path: &Path) -> Result<usize, BridgeError> {
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_LEN {
        return Err(BridgeError::HeaderTooLarge {
            path: path.to_path_buf(),
            header_len,
            limit: MAX_HEADER_LEN,
        });
    }
    // header_len <= 1e8, so neither the addition nor the cast can overflow.
    if header_len + 8 > file_len {
        return Err(truncated(path, header_len, file_len));
    }
    Ok(header_len as usize)
}

fn truncated(path: &Path, header_len: u64, file_len: u64) -> BridgeError {
    BridgeError::Truncated {
        path: path.to_path_buf(),
        header_len,
        file_len,
    }
}

/// The top-level JSON object as an ordered list of entries, so duplicate keys are visible.
struct Entries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, Value>()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_map(EntriesVisitor)
    }
}

/// Parses the JSON header (`json`, the `n` bytes after the prefix) of a file of `file_len` bytes.
fn parse_json(json: &[u8], file_len: u64, path: &Path) -> Result<SafetensorsHeader, BridgeError> {
    let text = std::str::from_utf8(json).map_err(|e| BridgeError::InvalidHeaderJson {
        path: path.to_path_buf(),
        reason: format!("not UTF-8: {e}"),
    })?;
    let Entries(entries) =
        serde_json::from_str(text).map_err(|e| BridgeError::InvalidHeaderJson {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    let data_start = 8 + json.len();
    // file_len >= data_start was checked, and data_start <= 1e8 + 8 fits in usize.
    let data_len = usize::try_from(file_len - data_start as u64).map_err(|_| {
        BridgeError::InvalidHeaderJson {
            path: path.to_path_buf(),
            reason: "data section larger than the address space".to_owned(),
        }
    })?;

    let mut metadata = None;
    let mut tensors = BTreeMap::new();
    for (name, value) in entries {
        if name == "__metadata__" {
            if metadata.is_some() {
                return Err(bad_metadata(path, "appears more than once"));
            }
            metadata = Some(parse_metadata(value, path)?);
            continue;
        }
        let info = parse_entry(&name, value, data_len, path)?;
        if tensors.contains_key(&name) {
            return Err(BridgeError::DuplicateTensor {
                path: path.to_path_buf(),
                tensor: name,
            });
        }
        tensors.insert(name, info);
    }
    check_coverage(&tensors, data_len, path)?;
    Ok(SafetensorsHeader {
        tensors,
        metadata: metadata.unwrap_or_default(),
        data_start,
    })
}

fn bad_metadata(path: &Path, reason: impl Into<String>) -> BridgeError {
    BridgeError::InvalidMetadata {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn parse_metadata(value: Value, path: &Path) -> Result<BTreeMap<String, String>, BridgeError> {
    match value {
        Value::Null => Ok(BTreeMap::new()),
        Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k, s)),
                other => Err(bad_metadata(
                    path,
                    format!("value of \"{k}\" is {other}, not a string"),
                )),
            })
            .collect(),
        other => Err(bad_metadata(
            path,
            format!("expected an object, found {other}"),
        )),
    }
}

/// Parses and checks one tensor entry on its own (dtype, shape, byte length, bounds).
fn parse_entry(
    name: &str,
    value: Value,
    data_len: usize,
    path: &Path,
) -> Result<TensorInfo, BridgeError> {
    let entry_err = |reason: String| BridgeError::InvalidTensorEntry {
        path: path.to_path_buf(),
        tensor: name.to_owned(),
        reason,
    };
    let Value::Object(obj) = value else {
        return Err(entry_err(format!("expected an object, found {value}")));
    };
    let dtype_str = match obj.get("dtype") {
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(entry_err(format!("`dtype` is {other}, not a string"))),
        None => return Err(entry_err("missing `dtype`".to_owned())),
    };
    let dtype = Dtype::from_header_str(dtype_str).ok_or_else(|| BridgeError::UnsupportedDtype {
        path: path.to_path_buf(),
        tensor: name.to_owned(),
        dtype: dtype_str.to_owned(),
    })?;
    let shape = usize_array(obj.get("shape"), "shape", None).map_err(entry_err)?;
    let offsets =
        usize_array(obj.get("data_offsets"), "data_offsets", Some(2)).map_err(entry_err)?;
    let (begin, end) = match offsets.as_slice() {
        &[begin, end] => (begin, end),
        _ => return Err(entry_err("`data_offsets` must have 2 entries".to_owned())),
    };

    let expected = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.size()))
        .ok_or_else(|| BridgeError::ShapeOverflow {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            shape: shape.clone(),
        })?;
    let Some(actual) = end.checked_sub(begin) else {
        return Err(BridgeError::InvalidOffsets {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            begin,
            end,
        });
    };
    if actual != expected {
        return Err(BridgeError::ByteLengthMismatch {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            dtype: dtype.to_string(),
            shape,
            expected,
            actual,
        });
    }
    if end > data_len {
        return Err(BridgeError::OffsetsOutOfBounds {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            end,
            data_len,
        });
    }
    Ok(TensorInfo {
        dtype,
        shape,
        data_offsets: (begin, end),
    })
}

/// An array of non-negative integers that fit in `usize`, optionally of a fixed length.
fn usize_array(value: Option<&Value>, key: &str, len: Option<usize>) -> Result<Vec<usize>, String> {
    let items = match value {
        Some(Value::Array(items)) => items,
        Some(other) => return Err(format!("`{key}` is {other}, not an array")),
        None => return Err(format!("missing `{key}`")),
    };
    if let Some(len) = len.filter(|&l| l != items.len()) {
        return Err(format!(
            "`{key}` has {} entries, expected {len}",
            items.len()
        ));
    }
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| format!("`{key}` holds {v}, not a non-negative integer"))
        })
        .collect()
}

/// Checks that the tensors tile `[0, data_len)` exactly: no overlap, no hole.
fn check_coverage(
    tensors: &BTreeMap<String, TensorInfo>,
    data_len: usize,
    path: &Path,
) -> Result<(), BridgeError> {
    let mut by_offset: Vec<(&String, &TensorInfo)> = tensors.iter().collect();
    by_offset.sort_by_key(|(name, info)| (info.data_offsets, *name));
    let mut cursor = 0usize;
    let mut last: Option<&String> = None;
    for (name, info) in by_offset {
        let (begin, end) = info.data_offsets;
        if begin < cursor {
            return Err(BridgeError::OverlappingTensors {
                path: path.to_path_buf(),
                first: last.map_or_else(String::new, Clone::clone),
                second: name.clone(),
            });
        }
        if begin > cursor {
            return Err(BridgeError::DataGap {
                path: path.to_path_buf(),
                start: cursor,
                end: begin,
                next: format!("tensor `{name}`"),
            });
        }
        if end > begin {
            last = Some(name);
        }
        cursor = end;
    }
    if cursor < data_len {
        return Err(BridgeError::DataGap {
            path: path.to_path_buf(),
            start: cursor,
            end: data_len,
            next: "the end of the file".to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
