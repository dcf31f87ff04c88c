//! Validation of a distributed checkpoint (docs/checkpoints.md §Distributed checkpoint validation):
//! per fqn every chunk has the index dtype and lies inside the global shape, chunk volumes add up
//! to the global volume and no two chunks intersect (so every element is covered exactly once);
//! every chunk file's header shape, dtype and DCP `saved_offsets` equal the index entry. FP8 scale
//! tensors must have the block-grid shape of their weight ([`super::fp8::validate_fp8`]). The index
//! must describe the model of the directory's `config.json` ([`validate_config`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::convert::hf_parts;
use super::index::{DcpIndex, INDEX_FILE, TensorEntry, TensorKind, parse_dcp_metadata};
use super::region::TensorBox;
use crate::BridgeError;
use crate::fp8::DEFAULT_BLOCK_SIZE;
use crate::hf::{CONFIG_FILE, read_json};
use crate::mapping::ExpertLayout;
use crate::safetensors::read_header;
use crate::schema::ModelSchema;

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

/// The checks of docs/checkpoints.md §Distributed checkpoint validation on one index entry; `dir`
/// names the checkpoint in errors.
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

/// The checks of docs/checkpoints.md §Distributed checkpoint validation on every entry of `index`
/// (no file is opened).
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

/// The index against the `config.json` of checkpoint directory `dir`, read as the model
/// config `C` (nothing to check without one): the config is valid and of the index's
/// `model_family`, every stored
/// parameter and buffer is a tensor of that model with the shape the config implies (as HF
/// tensors, per expert), and every tensor the model requires is stored. What a checkpoint whose
/// `config.json` (or index) belongs to another model fails.
pub fn validate_config<C: ModelSchema>(dir: &Path, index: &DcpIndex) -> Result<(), BridgeError> {
    let config_path = dir.join(CONFIG_FILE);
    if !config_path.is_file() {
        return Ok(());
    }
    let index_path = dir.join(INDEX_FILE);
    let json = read_json(&config_path)?;
    let config = C::from_config(&json, &config_path)?;
    if let Some(family) = &index.model_family
        && family != config.model_type()
    {
        return Err(BridgeError::InvalidDistIndex {
            path: index_path,
            reason: format!(
                "model_family is \"{family}\" but {} has model_type \"{}\": the config of \
                 another model",
                config_path.display(),
                config.model_type()
            ),
        });
    }
    let registry = C::registry_of(&json, &config_path)?;
    let block = index
        .fp8
        .as_ref()
        .map_or(DEFAULT_BLOCK_SIZE, |r| r.weight_block_size);
    let expected = config.expected_hf_tensors(ExpertLayout::PerExpert, &config_path, block)?;
    let tied = C::tied_head(&json);
    let mut stored = BTreeSet::new();
    for (fqn, entry) in &index.tensors {
        // Scales are checked against their weights (validate_fp8); a tied head is not exported.
        let model_tensor = matches!(entry.kind, TensorKind::Param | TensorKind::Buffer);
        if !model_tensor || tied.as_deref() == Some(fqn.as_str()) {
            continue;
        }
        let (_, parts) = hf_parts(&registry, fqn, entry, &config_path)?;
        for part in parts {
            let Some(want) = expected.get(&part.name) else {
                return Err(BridgeError::InvalidDistIndex {
                    path: index_path,
                    reason: format!(
                        "`{fqn}` (HF `{}`) is not a tensor of the `{}` model {} describes",
                        part.name,
                        config.model_type(),
                        config_path.display()
                    ),
                });
            };
            let part_shape = config
                .release_shape(&part.name, &part.shape)?
                .unwrap_or(part.shape);
            if want.shape != part_shape {
                return Err(BridgeError::ConfigMismatch {
                    path: index_path,
                    config: config_path,
                    tensor: part.name,
                    expected: want.shape.clone(),
                    found: part_shape,
                });
            }
            stored.insert(part.name);
        }
    }
    if let Some((name, want)) = expected
        .iter()
        .find(|(name, want)| want.required && !stored.contains(name.as_str()))
    {
        return Err(BridgeError::MissingWeight {
            path: index_path,
            config: config_path,
            tensor: name.clone(),
            expected: want.shape.clone(),
        });
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
    // A file that is gone is the finding, not what the other files lack or hold extra.
    for (file, chunks) in &by_file {
        let path = dir.join(file);
        if !path.is_file() {
            return Err(BridgeError::MissingShard {
                index: dir.join(INDEX_FILE),
                shard: (*file).to_owned(),
                tensor: chunks.first().map_or_else(String::new, |c| c.0.to_owned()),
                path,
            });
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
                let saved = offsets
                    .get(*fqn)
                    .map_or_else(|| "none".to_owned(), |o| format!("{o:?}"));
                return Err(corrupt(
                    fqn,
                    format!(
                        "its DCP saved_offsets are {saved}, the index says {:?}",
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
