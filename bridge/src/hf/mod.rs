//! HuggingFace checkpoint directories: `model.safetensors` or a sharded
//! `model.safetensors.index.json`, plus `config.json` / `generation_config.json`
//! (docs/checkpoints.md §HF checkpoint conventions), and their validation against the config before
//! any weight is used ([`HfCheckpoint::check`]).

mod check;
#[cfg(feature = "hub")]
mod download;
mod index;
mod resolve;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;

use crate::BridgeError;
use crate::safetensors::{SafetensorsFile, TensorInfo, TensorView};

pub use check::CheckReport;
pub use index::{INDEX_FILE, SINGLE_FILE, parse_index};
pub use resolve::{HubModelId, hub_cache_dir, resolve_in, resolve_model_dir};

/// Name of the model config file.
pub const CONFIG_FILE: &str = "config.json";
/// Name of the generation config file.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// A local HuggingFace checkpoint directory.
///
/// Opening reads only the index (or the single file's header); each shard is mapped on first use
/// and stays mapped. Nothing holds the whole model in memory.
#[derive(Debug)]
pub struct HfCheckpoint {
    dir: PathBuf,
    /// Where tensor names came from: the index file, or the single safetensors file.
    source: PathBuf,
    /// Tensor name → index into `shard_paths`.
    weight_map: BTreeMap<String, usize>,
    shard_paths: Vec<PathBuf>,
    shards: Vec<OnceLock<SafetensorsFile>>,
    /// FP8 block size from `config.json`, read on first dequantisation.
    pub(crate) fp8_block: OnceLock<[usize; 2]>,
}

impl HfCheckpoint {
    /// Opens the checkpoint in `dir`: `model.safetensors.index.json` if present (every shard it
    /// names must exist), else `model.safetensors`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, BridgeError> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join(INDEX_FILE);
        if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| BridgeError::Io {
                path: index_path.clone(),
                source,
            })?;
            let map = parse_index(&text, &index_path)?;
            let mut shard_names: Vec<&str> = map.values().map(String::as_str).collect();
            shard_names.sort_unstable();
            shard_names.dedup();
            let shard_paths: Vec<PathBuf> = shard_names.iter().map(|s| dir.join(s)).collect();
            for (name, path) in shard_names.iter().zip(&shard_paths) {
                if !path.is_file() {
                    let tensor = map
                        .iter()
                        .find(|(_, shard)| shard == name)
                        .map(|(t, _)| t.clone())
                        .unwrap_or_default();
                    return Err(BridgeError::MissingShard {
                        index: index_path,
                        shard: (*name).to_owned(),
                        tensor,
                        path: path.clone(),
                    });
                }
            }
            let shard_ids: BTreeMap<&str, usize> = shard_names
                .iter()
                .enumerate()
                .map(|(i, s)| (*s, i))
                .collect();
            let weight_map = map
                .iter()
                .filter_map(|(tensor, shard)| {
                    shard_ids.get(shard.as_str()).map(|&i| (tensor.clone(), i))
                })
                .collect();
            let shards = shard_paths.iter().map(|_| OnceLock::new()).collect();
            return Ok(Self {
                dir,
                source: index_path,
                weight_map,
                shard_paths,
                shards,
                fp8_block: OnceLock::new(),
            });
        }
        let single = dir.join(SINGLE_FILE);
        if !single.is_file() {
            return Err(BridgeError::NoCheckpoint { dir });
        }
        let file = SafetensorsFile::open(&single)?;
        let weight_map = file.names().map(|n| (n.to_owned(), 0)).collect();
        let cell = OnceLock::new();
        let _ = cell.set(file);
        Ok(Self {
            dir,
            source: single.clone(),
            weight_map,
            shard_paths: vec![single],
            shards: vec![cell],
            fp8_block: OnceLock::new(),
        })
    }

    /// Resolves `id_or_path` with [`resolve_model_dir`] and opens it.
    pub fn open_model(id_or_path: &str) -> Result<Self, BridgeError> {
        Self::open(resolve_model_dir(id_or_path)?)
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the checkpoint is sharded (has an index file).
    pub fn is_sharded(&self) -> bool {
        self.source.file_name().is_some_and(|n| n == INDEX_FILE)
    }

    /// Paths of the safetensors files, sorted by name.
    pub fn shard_paths(&self) -> &[PathBuf] {
        &self.shard_paths
    }

    /// Tensor names, sorted.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.weight_map.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.weight_map.len()
    }

    /// Whether the checkpoint has no tensors.
    pub fn is_empty(&self) -> bool {
        self.weight_map.is_empty()
    }

    /// Whether tensor `name` is listed.
    pub fn contains(&self, name: &str) -> bool {
        self.weight_map.contains_key(name)
    }

    /// Path of the file holding tensor `name`.
    pub fn file_of(&self, name: &str) -> Result<&Path, BridgeError> {
        let i = self.shard_index(name)?;
        Ok(&self.shard_paths[i])
    }

    fn shard_index(&self, name: &str) -> Result<usize, BridgeError> {
        self.weight_map
            .get(name)
            .copied()
            .ok_or_else(|| BridgeError::TensorNotFound {
                path: self.source.clone(),
                tensor: name.to_owned(),
            })
    }

    /// The shard file holding `name`, mapped on first use.
    pub fn shard_for(&self, name: &str) -> Result<&SafetensorsFile, BridgeError> {
        let i = self.shard_index(name)?;
        self.shard_at(i, name)
    }

    /// Shard `i` of [`shard_paths`](Self::shard_paths), mapped on first use; `name` is the
    /// tensor reported should the mapping vanish.
    fn shard_at(&self, i: usize, name: &str) -> Result<&SafetensorsFile, BridgeError> {
        let cell = &self.shards[i];
        if let Some(file) = cell.get() {
            return Ok(file);
        }
        let file = SafetensorsFile::open(&self.shard_paths[i])?;
        // Another thread may have won the race; either mapping is equally good.
        let _ = cell.set(file);
        cell.get().ok_or_else(|| BridgeError::TensorNotFound {
            path: self.shard_paths[i].clone(),
            tensor: name.to_owned(),
        })
    }

    /// The index file of a sharded checkpoint, or the single safetensors file.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// dtype, shape and offsets of tensor `name` (maps its shard).
    pub fn info(&self, name: &str) -> Result<&TensorInfo, BridgeError> {
        self.shard_for(name)?.info(name)
    }

    /// A zero-copy view of tensor `name`. Fails with [`BridgeError::TensorNotFound`] naming the
    /// shard when the index places the tensor in a shard that lacks it.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, BridgeError> {
        self.shard_for(name)?.tensor(name)
    }

    /// Like [`tensor`](Self::tensor), failing with [`BridgeError::DtypeMismatch`] or
    /// [`BridgeError::ShapeMismatch`] (naming file and tensor) when the caller's expectation is
    /// not met (`None` accepts anything).
    pub fn tensor_expect(
        &self,
        name: &str,
        dtype: Option<crate::safetensors::Dtype>,
        shape: Option<&[usize]>,
    ) -> Result<TensorView<'_>, BridgeError> {
        let view = self.tensor(name)?;
        if let Some(dtype) = dtype {
            view.expect_dtype(dtype)?;
        }
        if let Some(shape) = shape {
            view.expect_shape(shape)?;
        }
        Ok(view)
    }

    /// Opens every shard and checks that the index and the shards agree exactly; returns the
    /// tensors present in shards but missing from the index (`Err` for the reverse, or any
    /// unreadable shard).
    pub fn verify(&self) -> Result<Vec<(PathBuf, String)>, BridgeError> {
        let mut unlisted = Vec::new();
        for (i, path) in self.shard_paths.iter().enumerate() {
            let Some(name) = self
                .weight_map
                .iter()
                .find(|(_, s)| **s == i)
                .map(|(n, _)| n)
            else {
                continue;
            };
            let file = self.shard_for(name)?;
            for t in file.names() {
                if self.weight_map.get(t) != Some(&i) {
                    unlisted.push((path.clone(), t.to_owned()));
                }
            }
        }
        for name in self.weight_map.keys() {
            self.info(name)?;
        }
        Ok(unlisted)
    }

    /// `config.json` as JSON (an error when it is missing or invalid).
    pub fn config_json(&self) -> Result<Value, BridgeError> {
        read_json(&self.dir.join(CONFIG_FILE))
    }

    /// `generation_config.json` as JSON, `None` when the file is absent.
    pub fn generation_config_json(&self) -> Result<Option<Value>, BridgeError> {
        let path = self.dir.join(GENERATION_CONFIG_FILE);
        if !path.exists() {
            return Ok(None);
        }
        read_json(&path).map(Some)
    }

    /// `config.json` when present, `None` when absent (invalid JSON is still an error).
    pub fn config_json_opt(&self) -> Result<Option<Value>, BridgeError> {
        let path = self.dir.join(CONFIG_FILE);
        if !path.exists() {
            return Ok(None);
        }
        read_json(&path).map(Some)
    }
}

/// Reads and parses a JSON file.
pub fn read_json(path: &Path) -> Result<Value, BridgeError> {
    let text = std::fs::read_to_string(path).map_err(|source| BridgeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| BridgeError::InvalidJson {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests;
