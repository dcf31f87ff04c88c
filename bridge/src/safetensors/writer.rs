//! Writing safetensors files (checkpoints.md §1).
//!
//! Like the reference writer, tensors are laid out by descending element size and then by name,
//! so with the header padded to 8 bytes every tensor starts at an offset aligned to its element
//! size. The header is padded with spaces and carries `__metadata__ = {"format": "pt"}`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::TensorView;
use super::view::byte_len_of;
use crate::BridgeError;

/// The `__metadata__` that `save_pretrained` writes.
pub fn pt_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([("format".to_owned(), "pt".to_owned())])
}

/// A planned file: the padded header bytes and the tensors in data order.
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
    let mut order: Vec<&TensorView<'a>> = tensors.iter().collect();
    order.sort_by(|a, b| {
        b.dtype
            .size()
            .cmp(&a.dtype.size())
            .then_with(|| a.name.cmp(b.name))
    });

    let json_str = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""));
    let mut json = String::from("{");
    if !metadata.is_empty() {
        json.push_str("\"__metadata__\":{");
        let entries: Vec<String> = metadata
            .iter()
            .map(|(k, v)| format!("{}:{}", json_str(k), json_str(v)))
            .collect();
        json.push_str(&entries.join(","));
        json.push('}');
    }
    let mut offset = 0usize;
    for (i, t) in order.iter().enumerate() {
        if i > 0 || !metadata.is_empty() {
            json.push(',');
        }
        let end = offset + t.bytes.len();
        let shape: Vec<String> = t.shape.iter().map(usize::to_string).collect();
        json.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            json_str(t.name),
            t.dtype,
            shape.join(",")
        ));
        offset = end;
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut header = (json.len() as u64).to_le_bytes().to_vec();
    header.extend_from_slice(json.as_bytes());
    Ok(Layout { header, order })
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

/// Writes `tensors` to `path` atomically: into a temporary file in the same directory, flushed
/// and fsynced, then renamed over `path` (an existing file is replaced). Metadata is
/// `{"format": "pt"}`.
pub fn write_safetensors(path: &Path, tensors: &[TensorView<'_>]) -> Result<(), BridgeError> {
    let tmp = sibling_temp_path(path, "tmp");
    let result = (|| {
        let io = |source| BridgeError::Io {
            path: tmp.clone(),
            source,
        };
        let file = File::create(&tmp).map_err(io)?;
        let mut out = BufWriter::new(file);
        write_safetensors_to(&mut out, tensors, &pt_metadata(), path)?;
        let file = out.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(|source| BridgeError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        sync_parent(path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// `<dir>/.<file name>.<tag>-<pid>-<n>`: a unique hidden sibling of `path`.
pub(crate) fn sibling_temp_path(path: &Path, tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = path
        .file_name()
        .map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
    let hidden = format!(".{name}.{tag}-{}-{n}", std::process::id());
    match path.parent() {
        Some(parent) => parent.join(hidden),
        None => PathBuf::from(hidden),
    }
}

/// fsyncs the directory containing `path`, so a rename into it is durable.
pub(crate) fn sync_parent(path: &Path) -> Result<(), BridgeError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    sync_dir(parent)
}

/// fsyncs a directory.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), BridgeError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| BridgeError::Io {
            path: dir.to_path_buf(),
            source,
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
