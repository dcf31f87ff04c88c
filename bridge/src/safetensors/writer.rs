//! Writing safetensors files (docs/checkpoints.md §HF checkpoint conventions) in the `safetensors`
//! crate's layout.
//!
//! The layout is the crate's `serialize` output byte for byte (tested): tensors in descending
//! order of the crate's [`Dtype`](::safetensors::Dtype) (by alignment, then by name), the
//! header the crate's JSON of each [`TensorInfo`](::safetensors::tensor::TensorInfo) after
//! `__metadata__`, padded with spaces to a multiple of 8 so every tensor starts aligned to its
//! element size. The metadata written is `{"format": "pt"}`.
//!
//! Why the bytes are not written by the crate: `safetensors::serialize` builds the whole file
//! in one `Vec` (a multi-GB shard would be held in memory twice), and `serialize_to_file`,
//! which streams tensor by tensor, only writes to a path through its own temporary file, without
//! fsync, so it cannot write into a caller's [`Write`] (the shards of
//! [`HfDirWriter`](super::HfDirWriter)) or give the fsync-then-rename of [`write_safetensors`].
//! So [`write_safetensors_to`] streams the data itself after the crate-format header. The
//! header map is serialised here rather than through the crate's `Metadata` because that keeps
//! `__metadata__` in a `HashMap`, whose key order changes from run to run; ours is sorted.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::Path;

use ::safetensors::Dtype as St;
use ::safetensors::tensor::TensorInfo as StInfo;
use moe_backend::fs::write_atomic;
use serde::ser::{Serialize, SerializeMap, Serializer};

use super::view::byte_len_of;
use super::{MAX_HEADER_LEN, TensorView};
use crate::BridgeError;

/// The `__metadata__` that `save_pretrained` writes.
pub fn pt_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([("format".to_owned(), "pt".to_owned())])
}

/// The JSON header: `__metadata__` (when not empty), then the entries in data order.
struct HeaderJson<'a> {
    metadata: &'a BTreeMap<String, String>,
    entries: Vec<(&'a str, StInfo)>,
}

impl Serialize for HeaderJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        if !self.metadata.is_empty() {
            map.serialize_entry("__metadata__", self.metadata)?;
        }
        for (name, info) in &self.entries {
            map.serialize_entry(name, info)?;
        }
        map.end()
    }
}

/// A planned file: the header bytes (length prefix included) and the tensors in data order.
struct Layout<'a, 'b> {
    header: Vec<u8>,
    order: Vec<&'b TensorView<'a>>,
}

/// Checks `tensors` (unique names, byte lengths) and builds the header. `path` names the output
/// in errors.
fn layout<'a, 'b>(
    tensors: &'b [TensorView<'a>],
    metadata: &BTreeMap<String, String>,
    path: &Path,
) -> Result<Layout<'a, 'b>, BridgeError> {
    let invalid = |tensor: &str, reason: String| BridgeError::InvalidWrite {
        path: path.to_path_buf(),
        tensor: tensor.to_owned(),
        reason,
    };
    let mut seen = BTreeSet::new();
    for t in tensors {
        if t.name == "__metadata__" {
            return Err(invalid(t.name, "reserved name".to_owned()));
        }
        if !seen.insert(t.name) {
            return Err(invalid(t.name, "name given twice".to_owned()));
        }
        let expected = byte_len_of(t.dtype, t.shape)
            .ok_or_else(|| invalid(t.name, format!("shape {:?} overflows", t.shape)))?;
        if expected != t.bytes.len() {
            return Err(invalid(
                t.name,
                format!(
                    "{} {:?} needs {expected} bytes, got {}",
                    t.dtype,
                    t.shape,
                    t.bytes.len()
                ),
            ));
        }
    }
    // The crate's order (`safetensors::tensor::prepare`).
    let mut order: Vec<&TensorView<'a>> = tensors.iter().collect();
    order.sort_by(|a, b| {
        St::from(b.dtype)
            .cmp(&St::from(a.dtype))
            .then_with(|| a.name.cmp(b.name))
    });
    let mut offset = 0usize;
    let entries = order
        .iter()
        .map(|t| {
            let begin = offset;
            offset += t.bytes.len();
            let info = StInfo {
                dtype: t.dtype.into(),
                shape: t.shape.to_vec(),
                data_offsets: (begin, offset),
            };
            (t.name, info)
        })
        .collect();
    let header = header_bytes(metadata, entries, path)?;
    Ok(Layout { header, order })
}

/// Header bytes and each entry's `[begin, end)` data range.
pub(crate) type PlannedHeader = (Vec<u8>, Vec<(usize, usize)>);

/// The header of a safetensors file (8-byte length, JSON, spaces to a multiple of 8) holding
/// `entries` in this data order, each `(name, dtype, shape, byte length)`; returns it with
/// each entry's `[begin, end)` data range. The one header encoder of the crate: single files,
/// HF shards, live exports and distributed-checkpoint chunk files all use it. `path` names the
/// output in errors.
pub fn planned_header<'n>(
    metadata: &BTreeMap<String, String>,
    entries: impl IntoIterator<Item = (&'n str, super::Dtype, Vec<usize>, usize)>,
    path: &Path,
) -> Result<PlannedHeader, BridgeError> {
    let mut offset = 0usize;
    let mut ranges = Vec::new();
    let entries = entries
        .into_iter()
        .map(|(name, dtype, shape, len)| {
            let begin = offset;
            offset += len;
            ranges.push((begin, offset));
            let info = StInfo {
                dtype: dtype.into(),
                shape,
                data_offsets: (begin, offset),
            };
            (name, info)
        })
        .collect();
    Ok((header_bytes(metadata, entries, path)?, ranges))
}

fn header_bytes(
    metadata: &BTreeMap<String, String>,
    entries: Vec<(&str, StInfo)>,
    path: &Path,
) -> Result<Vec<u8>, BridgeError> {
    let invalid = |reason: String| BridgeError::InvalidWrite {
        path: path.to_path_buf(),
        tensor: String::new(),
        reason,
    };
    let json = HeaderJson { metadata, entries };
    let mut header = vec![0u8; 8];
    serde_json::to_writer(&mut header, &json).map_err(|e| invalid(e.to_string()))?;
    header.resize(8 + (header.len() - 8).next_multiple_of(8), b' ');
    let n = header.len() as u64 - 8;
    if n > MAX_HEADER_LEN {
        return Err(invalid(format!(
            "header of {n} bytes exceeds the limit of {MAX_HEADER_LEN}"
        )));
    }
    header[..8].copy_from_slice(&n.to_le_bytes());
    Ok(header)
}

/// Writes a safetensors file to `out`; returns the number of bytes written. `path` names the
/// destination in errors.
pub fn write_safetensors_to(
    out: &mut impl Write,
    tensors: &[TensorView<'_>],
    metadata: &BTreeMap<String, String>,
    path: &Path,
) -> Result<u64, BridgeError> {
    let layout = layout(tensors, metadata, path)?;
    let io = |source| BridgeError::Io {
        path: path.to_path_buf(),
        source,
    };
    out.write_all(&layout.header).map_err(io)?;
    let mut written = layout.header.len() as u64;
    for t in layout.order {
        out.write_all(t.bytes).map_err(io)?;
        written += t.bytes.len() as u64;
    }
    Ok(written)
}

/// The bytes of a safetensors file holding `tensors`, with `__metadata__ = {"format": "pt"}`.
pub fn serialize(tensors: &[TensorView<'_>]) -> Result<Vec<u8>, BridgeError> {
    let mut out = Vec::new();
    write_safetensors_to(&mut out, tensors, &pt_metadata(), Path::new(super::MEMORY))?;
    Ok(out)
}

/// Writes `tensors` to `path` atomically ([`moe_backend::fs::write_atomic`]): into a
/// temporary file in the same directory, flushed and fsynced, then renamed over `path` (an
/// existing file is replaced) and the directory fsynced. Metadata is `{"format": "pt"}`.
pub fn write_safetensors(path: &Path, tensors: &[TensorView<'_>]) -> Result<(), BridgeError> {
    write_atomic(path, |out| {
        write_safetensors_to(out, tensors, &pt_metadata(), path).map(|_| ())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::{Dtype, OwnedTensor, SafetensorsFile, SafetensorsHeader};
    use crate::test_util::TempDir;

    fn sample() -> Vec<OwnedTensor> {
        vec![
            OwnedTensor::from_f32("w.f32", vec![2, 3], &[0.5, -1.0, 2.0, 3.0, 4.0, 5.0]).unwrap(),
            OwnedTensor::new("b.bf16", Dtype::BF16, vec![3], vec![1, 2, 3, 4, 5, 6]).unwrap(),
            OwnedTensor::new("q.fp8", Dtype::F8E4M3, vec![3], vec![0x38, 0x7E, 0xFE]).unwrap(),
            OwnedTensor::new("i.i64", Dtype::I64, vec![], (-7i64).to_le_bytes().to_vec()).unwrap(),
            OwnedTensor::new("e.empty", Dtype::F32, vec![0, 4], vec![]).unwrap(),
            OwnedTensor::new("naïve \"quoted\"", Dtype::U8, vec![1], vec![9]).unwrap(),
        ]
    }

    #[test]
    fn header_is_padded_aligned_and_tagged() {
        let tensors = sample();
        let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
        let bytes = serialize(&views).unwrap();
        let header = SafetensorsHeader::parse(&bytes, Path::new("mem")).unwrap();
        assert_eq!(header.data_start % 8, 0);
        assert_eq!(header.metadata, pt_metadata());
        for t in &tensors {
            let info = &header.tensors[&t.name];
            assert_eq!(info.data_offsets.0 % t.dtype.size(), 0, "{}", t.name);
            assert_eq!(
                &bytes[header.byte_range(&t.name).unwrap()],
                t.bytes.as_slice()
            );
        }
    }

    #[test]
    fn layout_is_the_reference_crates_byte_for_byte() {
        let mut tensors = sample();
        // Dtypes of equal size, which the crate orders by dtype before name.
        for (name, dtype, bytes) in [
            ("a.i32", Dtype::I32, vec![1, 0, 0, 0]),
            ("a.u32", Dtype::U32, vec![2, 0, 0, 0]),
            ("z.f16", Dtype::F16, vec![0, 0x3C]),
            ("m.bool", Dtype::Bool, vec![1]),
            ("m.e5m2", Dtype::F8E5M2, vec![0x3C]),
            ("m.e8m0", Dtype::F8E8M0, vec![127]),
            ("f.f64", Dtype::F64, 1f64.to_le_bytes().to_vec()),
        ] {
            tensors.push(
                OwnedTensor::new(name, dtype, vec![bytes.len() / dtype.size()], bytes).unwrap(),
            );
        }
        let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
        let reference_views = views.iter().map(|v| {
            let view =
                safetensors::tensor::TensorView::new(v.dtype.into(), v.shape.to_vec(), v.bytes);
            (v.name, view.unwrap())
        });
        let metadata = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
        let reference = safetensors::serialize(reference_views, Some(metadata)).unwrap();
        assert_eq!(serialize(&views).unwrap(), reference);
        assert_eq!(
            serialize(&[]).unwrap(),
            safetensors::serialize(
                Vec::<(&str, safetensors::tensor::TensorView<'_>)>::new(),
                Some(std::collections::HashMap::from([(
                    "format".to_owned(),
                    "pt".to_owned()
                )]))
            )
            .unwrap()
        );
    }

    #[test]
    fn reference_crate_reads_our_files() {
        let tensors = sample();
        let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
        let bytes = serialize(&views).unwrap();
        let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(reference.len(), tensors.len());
        for t in &tensors {
            let r = reference.tensor(&t.name).unwrap();
            assert_eq!(r.dtype().to_string(), t.dtype.as_str());
            assert_eq!(r.shape(), t.shape.as_slice());
            assert_eq!(r.data(), t.bytes.as_slice());
        }
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let format = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("format").cloned());
        assert_eq!(format.as_deref(), Some("pt"));
    }

    #[test]
    fn file_round_trip_is_bit_identical() {
        let dir = TempDir::new("writer-rt");
        let path = dir.join("out.safetensors");
        let tensors = sample();
        let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
        write_safetensors(&path, &views).unwrap();
        // Overwrite in place works too (atomic rename).
        write_safetensors(&path, &views).unwrap();
        let file = SafetensorsFile::open(&path).unwrap();
        assert_eq!(file.len(), tensors.len());
        for t in &tensors {
            let v = file.tensor(&t.name).unwrap();
            assert_eq!(
                (v.dtype, v.shape, v.bytes),
                (t.dtype, &t.shape[..], &t.bytes[..])
            );
        }
        // No temporary files are left behind.
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1);
        // Writing the same tensors again gives the same bytes (deterministic layout).
        assert_eq!(std::fs::read(&path).unwrap(), serialize(&views).unwrap());
    }

    #[test]
    fn inconsistent_inputs_are_rejected() {
        let a = OwnedTensor::from_f32("a", vec![1], &[1.0]).unwrap();
        let dup = [a.view(), a.view()];
        assert!(matches!(
            serialize(&dup),
            Err(BridgeError::InvalidWrite { .. })
        ));
        let mut bad = a.view();
        bad.bytes = &[0, 0];
        let err = serialize(&[bad]).unwrap_err();
        assert!(err.to_string().contains("`a`"));
        let mut reserved = a.view();
        reserved.name = "__metadata__";
        assert!(serialize(&[reserved]).is_err());
        let dir = TempDir::new("writer-bad");
        let missing_dir = dir.join("no/such/dir/x.safetensors");
        assert!(matches!(
            write_safetensors(&missing_dir, &[a.view()]),
            Err(BridgeError::Io { .. })
        ));
    }
}
