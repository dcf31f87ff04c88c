//! Parsing and validating a safetensors header (docs/checkpoints.md §HF checkpoint conventions).
//!
//! Everything read from the file is treated as untrusted and every failure is a typed
//! [`BridgeError`] naming the file and, where one is involved, the tensor.
//!
//! The `safetensors` crate does the format's validation: each entry is deserialised as its
//! [`TensorInfo`](::safetensors::tensor::TensorInfo) (dtype spelling, `shape`, two
//! `data_offsets`) and the entries are checked by its [`Metadata::new`] (offsets contiguous
//! from 0, byte lengths equal to `product(shape) · dtype size`, checked arithmetic). Kept here,
//! because the crate does not do it:
//! - reading the header alone: [`read_header`] reads `8 + n` bytes, not the data section
//!   (`SafeTensors::read_metadata` wants the whole file, to compare its length with the
//!   offsets), so the length prefix is checked here against [`MAX_HEADER_LEN`] before
//!   allocating and against the file size, and the offsets against the data section's length;
//! - duplicate tensor names and a repeated `__metadata__` (the crate deserialises into a
//!   `HashMap` and keeps the last one), and `__metadata__` values that are not strings, named
//!   per key;
//! - accepting only the dtypes this crate converts ([`Dtype`]: FP8 included, sub-byte, `C64`
//!   and FNUZ not);
//! - naming the tensor and what is wrong: the crate's [`SafeTensorError`] says
//!   `InvalidOffset(name)` for overlaps, holes and reversed offsets alike, and
//!   `TensorInvalidInfo` / `ValidationOverflow` without a name; `crate_error` turns them into
//!   the matching [`BridgeError`].

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::Path;

use ::safetensors::SafeTensorError;
use ::safetensors::tensor::{Metadata, TensorInfo as StInfo};
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;

use super::Dtype;
use super::view::byte_len_of;
use crate::BridgeError;

/// Largest header accepted, in bytes (the limit of the `safetensors` crate, which does not
/// export it).
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
        let info = parse_entry(&name, value, path)?;
        let end = info.data_offsets.1;
        if end > data_len {
            return Err(BridgeError::OffsetsOutOfBounds {
                path: path.to_path_buf(),
                tensor: name,
                end,
                data_len,
            });
        }
        if tensors.contains_key(&name) {
            return Err(BridgeError::DuplicateTensor {
                path: path.to_path_buf(),
                tensor: name,
            });
        }
        tensors.insert(name, info);
    }

    // The crate validates the entries in data order.
    let entries = || {
        let mut by_offset: Vec<(String, StInfo)> = tensors
            .iter()
            .map(|(name, info)| {
                let st = StInfo {
                    dtype: info.dtype.into(),
                    shape: info.shape.clone(),
                    data_offsets: info.data_offsets,
                };
                (name.clone(), st)
            })
            .collect();
        by_offset.sort_by(|(a, x), (b, y)| (x.data_offsets, a).cmp(&(y.data_offsets, b)));
        by_offset
    };
    let validated = Metadata::new(None, entries()).map_err(|e| crate_error(e, &entries(), path))?;
    if validated.data_len() < data_len {
        return Err(BridgeError::DataGap {
            path: path.to_path_buf(),
            start: validated.data_len(),
            end: data_len,
            next: "the end of the file".to_owned(),
        });
    }
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

/// `__metadata__`: `null` or an object of strings (the crate's `Option<HashMap<String,
/// String>>`), checked per key so the error names it.
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

/// One tensor entry, deserialised as the crate's `TensorInfo`, with a dtype we read.
fn parse_entry(name: &str, value: Value, path: &Path) -> Result<TensorInfo, BridgeError> {
    let unsupported = |dtype: String| BridgeError::UnsupportedDtype {
        path: path.to_path_buf(),
        tensor: name.to_owned(),
        dtype,
    };
    // A dtype string that is not ours is reported as such, whatever else is wrong.
    if let Some(s) = value.get("dtype").and_then(Value::as_str)
        && Dtype::from_header_str(s).is_none()
    {
        return Err(unsupported(s.to_owned()));
    }
    let info: StInfo =
        serde_json::from_value(value).map_err(|e| BridgeError::InvalidTensorEntry {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            reason: e.to_string(),
        })?;
    Ok(TensorInfo {
        dtype: Dtype::try_from(info.dtype).map_err(|d| unsupported(d.to_string()))?,
        shape: info.shape,
        data_offsets: info.data_offsets,
    })
}

/// The typed error for the crate's rejection of the entries `by_offset` (in the order given to
/// [`Metadata::new`]), naming the tensor at fault.
fn crate_error(err: SafeTensorError, by_offset: &[(String, StInfo)], path: &Path) -> BridgeError {
    let path_buf = path.to_path_buf();
    match err {
        // Not where the previous tensor ended: reversed offsets, an overlap or a hole.
        SafeTensorError::InvalidOffset(failing) => {
            let (mut cursor, mut last) = (0usize, "");
            for (name, info) in by_offset {
                let (begin, end) = info.data_offsets;
                if *name == failing {
                    let tensor = name.clone();
                    return if end < begin {
                        BridgeError::InvalidOffsets {
                            path: path_buf,
                            tensor,
                            begin,
                            end,
                        }
                    } else if begin < cursor {
                        BridgeError::OverlappingTensors {
                            path: path_buf,
                            first: last.to_owned(),
                            second: tensor,
                        }
                    } else {
                        BridgeError::DataGap {
                            path: path_buf,
                            start: cursor,
                            end: begin,
                            next: format!("tensor `{tensor}`"),
                        }
                    };
                }
                if end > begin {
                    last = name;
                }
                cursor = end;
            }
            BridgeError::InvalidTensorEntry {
                path: path_buf,
                tensor: failing,
                reason: "invalid data_offsets".to_owned(),
            }
        }
        // A byte length that does not match, or overflows: the first such tensor.
        SafeTensorError::TensorInvalidInfo | SafeTensorError::ValidationOverflow => by_offset
            .iter()
            .find_map(|(name, info)| {
                let dtype = Dtype::try_from(info.dtype).ok()?;
                let actual = info.data_offsets.1.checked_sub(info.data_offsets.0)?;
                let tensor = name.clone();
                let shape = info.shape.clone();
                match byte_len_of(dtype, &info.shape) {
                    None => Some(BridgeError::ShapeOverflow {
                        path: path_buf.clone(),
                        tensor,
                        shape,
                    }),
                    Some(expected) if expected != actual => Some(BridgeError::ByteLengthMismatch {
                        path: path_buf.clone(),
                        tensor,
                        dtype: dtype.to_string(),
                        shape,
                        expected,
                        actual,
                    }),
                    Some(_) => None,
                }
            })
            .unwrap_or_else(|| BridgeError::InvalidHeaderJson {
                path: path_buf,
                reason: err.to_string(),
            }),
        other => BridgeError::InvalidHeaderJson {
            path: path_buf,
            reason: other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests;
