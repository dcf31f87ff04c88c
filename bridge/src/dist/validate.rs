//! Validation of a distributed checkpoint (checkpoints.md §8): per fqn every chunk has the
//! index dtype and lies inside the global shape, chunk volumes add up to the global volume and
//! no two chunks intersect (so every element is covered exactly once); every chunk file's
//! header shape, dtype and DCP `saved_offsets` equal the index entry. FP8 scale tensors must
//! have the block-grid shape of their weight ([`super::fp8::validate_fp8`]).

use std::collections::BTreeMap;
use std::path::Path;

use super::index::{DcpIndex, TensorEntry, parse_dcp_metadata};
use super::region::TensorBox;
use crate::BridgeError;
use crate::safetensors::read_header;

/// Checks that `boxes` tile a tensor of `global` shape exactly once; the reason otherwise.
pub fn check_tiling(boxes: &[TensorBox], global: &[usize]) -> Result<(), String> {
    let mut volume: u128 = 0;
    for b in boxes {
        if !b.within(global) {
            return Err(format!(
                "chunk at {:?} of shape {:?} lies outside {global:?}",
                b.offsets, b.shape
            ));
        }
        volume += b.numel() as u128;
    }
    let expected: u128 = global.iter().map(|&d| d as u128).product();
    if volume != expected {
        return Err(format!(
            "chunks hold {volume} elements, the global shape {global:?} has {expected}"
        ));
    }
    // Sorting by offsets lets the pairwise test stop early along dim 0.
    let mut sorted: Vec<&TensorBox> = boxes.iter().filter(|b| b.numel() > 0).collect();
    sorted.sort_by(|a, b| a.offsets.cmp(&b.offsets));
    for (i, a) in sorted.iter().enumerate() {
        for b in &sorted[i + 1..] {
            if let (Some(&a0), Some(&b0), Some(&a_len)) =
                (a.offsets.first(), b.offsets.first(), a.shape.first())
                && b0 >= a0 + a_len
            {
                break;
            }
            if a.intersect(b).is_some() {
                return Err(format!(
                    "chunks at {:?} and {:?} overlap",
                    a.offsets, b.offsets
                ));
            }
        }
    }
    Ok(())
}

/// §8 checks of one index entry; `dir` names the checkpoint in errors.
pub fn validate_entry(dir: &Path, fqn: &str, entry: &TensorEntry) -> Result<(), BridgeError> {
    let boxes: Vec<TensorBox> = entry
        .chunks
        .iter()
        .map(|c| {
            if c.offsets.len() != entry.global_shape.len() || c.shape.len() != c.offsets.len() {
                return Err(BridgeError::Coverage {
                    path: dir.to_path_buf(),
                    tensor: fqn.to_owned(),
                    reason: format!(
                        "chunk in {} has offsets {:?} / shape {:?} for a rank-{} tensor",
                        c.file,
                        c.offsets,
                        c.shape,
                        entry.global_shape.len()
                    ),
                });
            }
            Ok(TensorBox::new(c.offsets.clone(), c.shape.clone()))
        })
        .collect::<Result<_, _>>()?;
    check_tiling(&boxes, &entry.global_shape).map_err(|reason| BridgeError::Coverage {
        path: dir.to_path_buf(),
        tensor: fqn.to_owned(),
        reason,
    })
}

/// §8 checks of every entry of `index` (no file is opened).
pub fn validate_index(dir: &Path, index: &DcpIndex) -> Result<(), BridgeError> {
    super::fp8::validate_fp8(dir, index)?;
    for (fqn, entry) in &index.tensors {
        validate_entry(dir, fqn, entry)?;
        let mut seen = BTreeMap::new();
        for c in &entry.chunks {
            if seen.insert(c.file.as_str(), ()).is_some() {
                return Err(BridgeError::InvalidDistIndex {
                    path: dir.to_path_buf(),
                    reason: format!("`{fqn}` has two chunks in {}", c.file),
                });
            }
            if c.file.contains(['/', '\\']) || c.file.starts_with('.') {
                return Err(BridgeError::InvalidDistIndex {
                    path: dir.to_path_buf(),
                    reason: format!("`{fqn}`: chunk file `{}` is not a plain file name", c.file),
                });
            }
        }
    }
    Ok(())
}

/// Reads every chunk file's header (not its data) and checks shape, dtype and `saved_offsets`
/// of each chunk against the index, and that files hold nothing the index does not list.
pub fn validate_files(dir: &Path, index: &DcpIndex) -> Result<(), BridgeError> {
    let mut by_file: BTreeMap<&str, Vec<(&str, &TensorEntry, usize)>> = BTreeMap::new();
    for (fqn, entry) in &index.tensors {
        for (i, c) in entry.chunks.iter().enumerate() {
            by_file
                .entry(c.file.as_str())
                .or_default()
                .push((fqn.as_str(), entry, i));
        }
    }
    for (file, chunks) in by_file {
        let path = dir.join(file);
        let header = read_header(&path)?;
        let offsets = parse_dcp_metadata(&header.metadata, &path)?;
        let corrupt = |tensor: &str, reason: String| BridgeError::CorruptChunk {
            path: path.clone(),
            tensor: tensor.to_owned(),
            reason,
        };
        for (fqn, entry, i) in &chunks {
            let chunk = &entry.chunks[*i];
            let info = header
                .tensors
                .get(*fqn)
                .ok_or_else(|| corrupt(fqn, "missing from the file".to_owned()))?;
            if info.dtype != entry.dtype || info.shape != chunk.shape {
                return Err(corrupt(
                    fqn,
                    format!(
                        "file has {} {:?}, index says {} {:?}",
                        info.dtype, info.shape, entry.dtype, chunk.shape
                    ),
                ));
            }
            if offsets.get(*fqn) != Some(&chunk.offsets) {
                return Err(corrupt(
                    fqn,
                    format!(
                        "saved_offsets {:?}, index says {:?}",
                        offsets.get(*fqn),
                        chunk.offsets
                    ),
                ));
            }
        }
        if header.tensors.len() != chunks.len() {
            let extra = header
                .tensors
                .keys()
                .find(|k| !chunks.iter().any(|(f, _, _)| f == k))
                .cloned()
                .unwrap_or_default();
            return Err(corrupt(
                &extra,
                "stored in the file but not in the index".to_owned(),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiling_detects_gaps_overlaps_and_out_of_bounds() {
        let g = [4, 6];
        let ok = [
            TensorBox::new(vec![0, 0], vec![4, 3]),
            TensorBox::new(vec![0, 3], vec![2, 3]),
            TensorBox::new(vec![2, 3], vec![2, 3]),
        ];
        check_tiling(&ok, &g).unwrap();
        let gap = &ok[..2];
        assert!(check_tiling(gap, &g).unwrap_err().contains("elements"));
        let overlap = [
            TensorBox::new(vec![0, 0], vec![4, 3]),
            TensorBox::new(vec![0, 2], vec![2, 3]),
            TensorBox::new(vec![2, 3], vec![2, 3]),
        ];
        assert!(check_tiling(&overlap, &g).unwrap_err().contains("overlap"));
        let outside = [TensorBox::new(vec![1, 0], vec![4, 6])];
        assert!(check_tiling(&outside, &g).unwrap_err().contains("outside"));
        check_tiling(&[TensorBox::full(&[])], &[]).unwrap();
    }
}
