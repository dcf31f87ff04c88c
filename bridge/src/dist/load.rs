//! Opening and reading distributed checkpoints, with resharding
//! (docs/checkpoints.md §Distributed checkpoint format, §Resharding).
//!
//! [`DistCheckpoint::open`] accepts a checkpoint root (its `latest` is followed) or one
//! `iter_*` directory and refuses `.tmp-*` directories and directories without `.complete` or
//! index. [`DistCheckpoint::read_box`] assembles any requested box of a tensor from the stored
//! chunks that overlap it: each chunk file is memory-mapped on first use and only the
//! overlapping sub-boxes are copied (contiguous runs along trailing dims). Resharding is
//! nothing more than reading the boxes of another layout
//! ([`ShardingPlan::rank_shard`](super::sharding::ShardingPlan::rank_shard)).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::commit::{TempDirStatus, temp_dirs};
use super::index::{
    COMPLETE_MARKER, DcpIndex, INDEX_FILE, LATEST_FILE, TensorEntry, parse_dcp_metadata,
};
use super::region::{TensorBox, copy_box};
use super::validate::{validate_config, validate_files, validate_index};
use crate::BridgeError;
use crate::safetensors::{Dtype, OwnedTensor, SafetensorsFile};
use crate::schema::ModelSchema;

/// Resolves `path` (a checkpoint root with `latest`, or an `iter_*` directory) to a complete
/// checkpoint directory, refusing partial saves with [`BridgeError::NotACheckpoint`].
pub fn resolve_checkpoint_dir(path: &Path) -> Result<PathBuf, BridgeError> {
    let refuse = |path: &Path, reason: &str| BridgeError::NotACheckpoint {
        path: path.to_path_buf(),
        reason: reason.to_owned(),
    };
    let latest = path.join(LATEST_FILE);
    let dir = if !path.join(INDEX_FILE).exists()
        && !path.join(COMPLETE_MARKER).exists()
        && latest.is_file()
    {
        let text = std::fs::read_to_string(&latest).map_err(|source| BridgeError::Io {
            path: latest.clone(),
            source,
        })?;
        let name = text.trim();
        if name.is_empty() {
            return Err(refuse(&latest, "`latest` is empty"));
        }
        if name.contains(['/', '\\']) || name.starts_with('.') {
            return Err(refuse(&latest, &format!("`latest` names `{name}`")));
        }
        path.join(name)
    } else {
        path.to_path_buf()
    };
    if !dir.is_dir() {
        return Err(refuse(&dir, "no such directory"));
    }
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    if name.as_deref().is_some_and(|n| n.starts_with(".tmp-")) {
        return Err(refuse(
            &dir,
            "a temporary save directory (.tmp-*): the save is in progress or was aborted",
        ));
    }
    if !dir.join(COMPLETE_MARKER).is_file() {
        return Err(refuse(
            &dir,
            "no .complete marker: the save did not finish (or this is not a checkpoint)",
        ));
    }
    if !dir.join(INDEX_FILE).is_file() {
        return Err(refuse(&dir, "no moe_dcp.index.json"));
    }
    Ok(dir)
}

/// A mapped chunk file and the DCP `saved_offsets` of its `__metadata__` (fqn → global
/// offsets of the chunk it holds).
#[derive(Debug)]
struct ChunkFile {
    file: SafetensorsFile,
    saved_offsets: BTreeMap<String, Vec<usize>>,
}

/// An open distributed checkpoint: the parsed, validated index and lazily mapped chunk files.
/// Shareable between threads (the ranks of an in-process world can read through one value).
#[derive(Debug)]
pub struct DistCheckpoint {
    dir: PathBuf,
    index: DcpIndex,
    files: BTreeMap<String, OnceLock<ChunkFile>>,
}

impl DistCheckpoint {
    /// Opens `path` (see [`resolve_checkpoint_dir`]) and validates the index (coverage as
    /// docs/checkpoints.md §Distributed checkpoint validation, FP8 scales) and its agreement with
    /// the directory's `config.json`, when there is one, read as the model config `C`
    /// ([`validate_config`]); chunk files are opened on first read.
    pub fn open<C: ModelSchema>(path: impl AsRef<Path>) -> Result<Self, BridgeError> {
        let dir = resolve_checkpoint_dir(path.as_ref())?;
        let index = DcpIndex::read(&dir.join(INDEX_FILE))?;
        validate_index(&dir, &index)?;
        validate_config::<C>(&dir, &index)?;
        let files = index
            .tensors
            .values()
            .flat_map(|e| e.chunks.iter().map(|c| (c.file.clone(), OnceLock::new())))
            .collect();
        Ok(Self { dir, index, files })
    }

    /// The checkpoint directory (`…/iter_*`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The index.
    pub fn index(&self) -> &DcpIndex {
        &self.index
    }

    /// The index entry of `fqn` ([`BridgeError::TensorNotFound`] naming the checkpoint).
    pub fn entry(&self, fqn: &str) -> Result<&TensorEntry, BridgeError> {
        self.index
            .tensors
            .get(fqn)
            .ok_or_else(|| BridgeError::TensorNotFound {
                path: self.dir.clone(),
                tensor: fqn.to_owned(),
            })
    }

    /// The temporary save directories in checkpoint root `root` (saves in progress, or left by
    /// saves that died), classified live, pending or stale; see [`super::commit::stale`].
    /// `moe validate` reports them as warnings: they do not make a checkpoint invalid.
    pub fn temp_dirs(root: impl AsRef<Path>) -> Result<Vec<TempDirStatus>, BridgeError> {
        temp_dirs(root.as_ref())
    }

    /// Full offline validation (`moe validate`): index coverage, the index against
    /// `config.json` (read as the model config `C`), every chunk file's header against the
    /// index, and the `train_state` object.
    pub fn validate<C: ModelSchema>(&self) -> Result<(), BridgeError> {
        validate_index(&self.dir, &self.index)?;
        validate_config::<C>(&self.dir, &self.index)?;
        validate_files(&self.dir, &self.index)?;
        self.validate_values()?;
        super::train_record::read_train_state(self).map(|_| ())
    }

    /// Reads every chunk of every tensor (parameters, buffers, optimizer state) and refuses
    /// the first holding NaN or infinite values ([`BridgeError::NonFinite`], naming the tensor
    /// and the count). One chunk is in memory at a time.
    pub fn validate_values(&self) -> Result<(), BridgeError> {
        for (fqn, entry) in &self.index.tensors {
            for chunk in &entry.chunks {
                let request = TensorBox::new(chunk.offsets.clone(), chunk.shape.clone());
                self.read_box(fqn, &request).map_err(|e| match e {
                    BridgeError::NonFinite {
                        tensor,
                        count,
                        numel,
                        ..
                    } => BridgeError::NonFinite {
                        path: self.dir.join(&chunk.file),
                        tensor,
                        count,
                        numel,
                    },
                    other => other,
                })?;
            }
        }
        Ok(())
    }

    /// Chunk file `name`, mapped (and its DCP metadata parsed) on first use.
    fn file(&self, name: &str) -> Result<&ChunkFile, BridgeError> {
        let cell = self
            .files
            .get(name)
            .ok_or_else(|| BridgeError::InvalidDistIndex {
                path: self.dir.join(INDEX_FILE),
                reason: format!("chunk file {name} is not listed"),
            })?;
        if let Some(file) = cell.get() {
            return Ok(file);
        }
        let file = SafetensorsFile::open(self.dir.join(name))?;
        let saved_offsets = parse_dcp_metadata(&file.header().metadata, file.path())?;
        let _ = cell.set(ChunkFile {
            file,
            saved_offsets,
        });
        cell.get().ok_or_else(|| BridgeError::InvalidDistIndex {
            path: self.dir.join(name),
            reason: "could not be mapped".to_owned(),
        })
    }

    /// The box `request` of tensor `fqn`, in the stored dtype, assembled from the overlapping
    /// chunks; errors when the box lies outside the tensor, a chunk file disagrees with the
    /// index, the chunks do not cover the box, or the box holds NaN or infinite values (a
    /// diverged run's save is never loaded: [`BridgeError::NonFinite`]).
    pub fn read_box(&self, fqn: &str, request: &TensorBox) -> Result<OwnedTensor, BridgeError> {
        let entry = self.entry(fqn)?;
        if !request.within(&entry.global_shape) {
            return Err(BridgeError::Sharding {
                tensor: fqn.to_owned(),
                reason: format!(
                    "requested box at {:?} of shape {:?} lies outside the stored {:?}",
                    request.offsets, request.shape, entry.global_shape
                ),
            });
        }
        let elem = entry.dtype.size();
        let mut out = vec![0u8; request.numel() * elem];
        let mut copied = 0usize;
        for chunk in &entry.chunks {
            let chunk_box = TensorBox::new(chunk.offsets.clone(), chunk.shape.clone());
            let Some(inter) = request.intersect(&chunk_box) else {
                continue;
            };
            let ChunkFile {
                file,
                saved_offsets,
            } = self.file(&chunk.file)?;
            let corrupt = |reason: String| BridgeError::CorruptChunk {
                path: file.path().to_path_buf(),
                tensor: fqn.to_owned(),
                reason,
            };
            let view = file.tensor(fqn)?;
            if view.dtype != entry.dtype || view.shape != chunk.shape.as_slice() {
                return Err(corrupt(format!(
                    "file has {} {:?}, index says {} {:?}",
                    view.dtype, view.shape, entry.dtype, chunk.shape
                )));
            }
            // The same bytes at other global offsets would be read into the wrong place.
            if saved_offsets.get(fqn) != Some(&chunk.offsets) {
                let saved = saved_offsets
                    .get(fqn)
                    .map_or_else(|| "none".to_owned(), |o| format!("{o:?}"));
                return Err(corrupt(format!(
                    "its DCP saved_offsets are {saved}, the index says {:?}",
                    chunk.offsets
                )));
            }
            copy_box(
                view.bytes,
                &chunk.shape,
                &inter.relative_to(&chunk.offsets),
                &mut out,
                &request.shape,
                &inter.relative_to(&request.offsets),
                &inter.shape,
                elem,
            );
            copied += inter.numel();
        }
        if copied != request.numel() {
            return Err(BridgeError::Coverage {
                path: self.dir.clone(),
                tensor: fqn.to_owned(),
                reason: format!(
                    "chunks cover {copied} of the {} elements of the box at {:?} of shape {:?}",
                    request.numel(),
                    request.offsets,
                    request.shape
                ),
            });
        }
        let bad = crate::safetensors::elem::count_non_finite(entry.dtype, &out);
        if bad > 0 {
            let path = entry
                .chunks
                .first()
                .map_or_else(|| self.dir.clone(), |c| self.dir.join(&c.file));
            return Err(BridgeError::NonFinite {
                path,
                tensor: fqn.to_owned(),
                count: bad,
                numel: request.numel(),
            });
        }
        OwnedTensor::new(fqn, entry.dtype, request.shape.clone(), out)
    }

    /// [`read_box`](Self::read_box) after checking the caller's model: the stored global shape
    /// must equal `global_shape`, and the dtype `dtype` (`None` accepts any). With
    /// `allow_cast`, BF16 / F16 ↔ F32 differences are converted instead of refused.
    pub fn read_box_checked(
        &self,
        fqn: &str,
        global_shape: &[usize],
        dtype: Option<Dtype>,
        request: &TensorBox,
        allow_cast: bool,
    ) -> Result<OwnedTensor, BridgeError> {
        let entry = self.entry(fqn)?;
        if entry.global_shape != global_shape {
            return Err(BridgeError::ShapeMismatch {
                path: self.dir.clone(),
                tensor: fqn.to_owned(),
                expected: global_shape.to_vec(),
                actual: entry.global_shape.clone(),
            });
        }
        let cast_to = match dtype {
            Some(d) if d != entry.dtype => {
                let castable = matches!(
                    (entry.dtype, d),
                    (Dtype::BF16 | Dtype::F16, Dtype::F32) | (Dtype::F32, Dtype::BF16 | Dtype::F16)
                );
                if !(allow_cast && castable) {
                    return Err(BridgeError::DtypeMismatch {
                        path: self.dir.clone(),
                        tensor: fqn.to_owned(),
                        expected: d.to_string(),
                        actual: entry.dtype.to_string(),
                    });
                }
                Some(d)
            }
            _ => None,
        };
        let t = self.read_box(fqn, request)?;
        match cast_to {
            Some(d) => t.cast(d),
            None => Ok(t),
        }
    }

    /// The whole tensor `fqn`.
    pub fn read_tensor(&self, fqn: &str) -> Result<OwnedTensor, BridgeError> {
        let shape = self.entry(fqn)?.global_shape.clone();
        self.read_box(fqn, &TensorBox::full(&shape))
    }
}
