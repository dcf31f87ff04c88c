//! Sharded HuggingFace checkpoint writer (docs/checkpoints.md §Minimal loadable export,
//! §Streaming conversion).
//!
//! A [`ShardPlan`] fixes up front which tensor goes to which file. An [`HfDirWriter`] writes
//! shards into a hidden temporary directory next to the target, each as soon as all of its
//! tensors are available, then the index, and on [`HfDirWriter::finish`] fsyncs and renames the
//! directory into place. A writer dropped before `finish` removes its temporary directory.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use moe_backend::fs::{sibling_temp_path, sync_dir, sync_parent, write_atomic, write_atomic_bytes};
use serde::Serialize;
use serde_json::Value;

use super::writer::{pt_metadata, write_safetensors_to};
use super::{OwnedTensor, TensorView};
use crate::BridgeError;
use crate::hf::{INDEX_FILE, SINGLE_FILE};

/// Which tensors go into which file, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// `(file name, sorted tensor names)` per shard.
    files: Vec<(String, Vec<String>)>,
    /// Tensor name → shard index.
    shard_of: HashMap<String, usize>,
}

impl ShardPlan {
    /// Greedy plan over the sorted names: shards are filled up to `max_shard_size` bytes; a
    /// tensor larger than the limit gets a shard of its own. One shard is named
    /// `model.safetensors`; `n > 1` shards `model-{i:05}-of-{n:05}.safetensors` (1-based).
    pub fn greedy(sizes: &BTreeMap<String, u64>, max_shard_size: u64) -> Self {
        let mut groups: Vec<Vec<String>> = Vec::new();
        let mut current = 0u64;
        for (name, &size) in sizes {
            match groups.last_mut() {
                Some(group) if current.saturating_add(size) <= max_shard_size => {
                    group.push(name.clone());
                    current += size;
                }
                _ => {
                    groups.push(vec![name.clone()]);
                    current = size;
                }
            }
        }
        let n = groups.len();
        let files = match n {
            0 => vec![(SINGLE_FILE.to_owned(), Vec::new())],
            1 => groups
                .into_iter()
                .map(|g| (SINGLE_FILE.to_owned(), g))
                .collect(),
            _ => groups
                .into_iter()
                .enumerate()
                .map(|(i, g)| (format!("model-{:05}-of-{n:05}.safetensors", i + 1), g))
                .collect(),
        };
        Self::from_files(files)
    }

    /// A plan reusing a source checkpoint's `weight_map` (tensor → file name), e.g. when
    /// round-tripping an HF import. Files are ordered by name.
    pub fn from_weight_map(weight_map: &BTreeMap<String, String>) -> Self {
        let mut by_file: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for (tensor, file) in weight_map {
            by_file.entry(file).or_default().push(tensor.clone());
        }
        Self::from_files(
            by_file
                .into_iter()
                .map(|(f, names)| (f.to_owned(), names))
                .collect(),
        )
    }

    fn from_files(files: Vec<(String, Vec<String>)>) -> Self {
        let shard_of = files
            .iter()
            .enumerate()
            .flat_map(|(i, (_, names))| names.iter().map(move |n| (n.clone(), i)))
            .collect();
        Self { files, shard_of }
    }

    /// Number of files.
    pub fn num_shards(&self) -> usize {
        self.files.len()
    }

    /// File name of shard `i`.
    pub fn file_name(&self, i: usize) -> Option<&str> {
        self.files.get(i).map(|(f, _)| f.as_str())
    }

    /// Sorted tensor names of shard `i`.
    pub fn keys(&self, i: usize) -> &[String] {
        self.files.get(i).map_or(&[], |(_, k)| k.as_slice())
    }

    /// The shard a tensor is planned into.
    pub fn shard_of(&self, name: &str) -> Option<usize> {
        self.shard_of.get(name).copied()
    }

    /// Whether an index file is written (anything but a lone `model.safetensors`).
    pub fn needs_index(&self) -> bool {
        !(self.files.len() == 1 && self.files[0].0 == SINGLE_FILE)
    }
}

/// `model.safetensors.index.json`, serialised with sorted keys.
#[derive(Serialize)]
struct IndexFile<'a> {
    metadata: BTreeMap<&'static str, u64>,
    weight_map: BTreeMap<&'a str, &'a str>,
}

/// Writes an HF checkpoint directory atomically; see the module docs.
#[derive(Debug)]
pub struct HfDirWriter {
    target: PathBuf,
    tmp: PathBuf,
    plan: ShardPlan,
    overwrite: bool,
    written: Vec<bool>,
    pending: Vec<Vec<OwnedTensor>>,
    total_size: u64,
    total_parameters: u64,
    finished: bool,
}

impl HfDirWriter {
    /// Starts writing `target` with `plan`. Fails with [`BridgeError::TargetExists`] if
    /// `target` exists and `overwrite` is false; with `overwrite` the old directory is replaced
    /// only when [`finish`](Self::finish) succeeds.
    pub fn create(target: &Path, plan: ShardPlan, overwrite: bool) -> Result<Self, BridgeError> {
        if target.exists() && !overwrite {
            return Err(BridgeError::TargetExists {
                path: target.to_path_buf(),
            });
        }
        if let Some(parent) = target.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|source| BridgeError::Io {
                path: parent.to_path_buf(),
                source,
            })?;
        }
        let tmp = sibling_temp_path(target, "tmp");
        std::fs::create_dir(&tmp).map_err(|source| BridgeError::Io {
            path: tmp.clone(),
            source,
        })?;
        let n = plan.num_shards();
        Ok(Self {
            target: target.to_path_buf(),
            tmp,
            plan,
            overwrite,
            written: vec![false; n],
            pending: (0..n).map(|_| Vec::new()).collect(),
            total_size: 0,
            total_parameters: 0,
            finished: false,
        })
    }

    /// The plan being written.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    fn invalid(&self, tensor: &str, reason: impl Into<String>) -> BridgeError {
        BridgeError::InvalidWrite {
            path: self.target.clone(),
            tensor: tensor.to_owned(),
            reason: reason.into(),
        }
    }

    /// Writes shard `i`; `tensors` must be exactly the plan's keys for it (any order).
    pub fn write_shard(&mut self, i: usize, tensors: &[TensorView<'_>]) -> Result<(), BridgeError> {
        let Some(file_name) = self.plan.file_name(i).map(str::to_owned) else {
            return Err(self.invalid("", format!("no shard {i} in the plan")));
        };
        if self.written[i] {
            return Err(self.invalid("", format!("shard {file_name} written twice")));
        }
        let mut names: Vec<&str> = tensors.iter().map(|t| t.name).collect();
        names.sort_unstable();
        for name in &names {
            if self.plan.shard_of(name) != Some(i) {
                return Err(self.invalid(name, format!("not planned for {file_name}")));
            }
        }
        if let Some(missing) = self
            .plan
            .keys(i)
            .iter()
            .find(|k| names.binary_search(&k.as_str()).is_err())
        {
            return Err(self.invalid(missing, format!("missing from shard {file_name}")));
        }
        let path = self.tmp.join(&file_name);
        write_atomic(&path, |out| {
            write_safetensors_to(out, tensors, &pt_metadata(), &path)
        })?;
        self.written[i] = true;
        for t in tensors {
            self.total_size += t.bytes.len() as u64;
            self.total_parameters += t.num_elements() as u64;
        }
        Ok(())
    }

    /// Hands over one tensor; its shard is written (and its buffers freed) as soon as all of
    /// the shard's tensors have arrived.
    pub fn push(&mut self, tensor: OwnedTensor) -> Result<(), BridgeError> {
        let Some(i) = self.plan.shard_of(&tensor.name) else {
            return Err(self.invalid(&tensor.name, "not in the shard plan"));
        };
        if self.written[i] || self.pending[i].iter().any(|t| t.name == tensor.name) {
            return Err(self.invalid(&tensor.name, "given twice"));
        }
        self.pending[i].push(tensor);
        if self.pending[i].len() == self.plan.keys(i).len() {
            let tensors = std::mem::take(&mut self.pending[i]);
            let views: Vec<TensorView<'_>> = tensors.iter().map(OwnedTensor::view).collect();
            self.write_shard(i, &views)?;
        }
        Ok(())
    }

    /// Writes an extra file (e.g. a tokenizer file) into the checkpoint; `name` must be a plain
    /// file name.
    pub fn write_file(&mut self, name: &str, bytes: &[u8]) -> Result<(), BridgeError> {
        if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\\', '\0']) {
            return Err(self.invalid(name, "not a plain file name"));
        }
        Ok(write_atomic_bytes(&self.tmp.join(name), bytes)?)
    }

    /// Writes `value` as `name` (pretty JSON, two-space indent, trailing newline), e.g.
    /// `config.json`.
    pub fn write_json(&mut self, name: &str, value: &Value) -> Result<(), BridgeError> {
        let text = to_pretty_json(value, &self.tmp.join(name))?;
        self.write_file(name, text.as_bytes())
    }

    /// Checks every shard was written, writes the index (unless the plan is a lone
    /// `model.safetensors`), fsyncs and renames the directory into place. Returns the target.
    pub fn finish(mut self) -> Result<PathBuf, BridgeError> {
        for i in 0..self.plan.num_shards() {
            if self.written[i] {
                continue;
            }
            if self.plan.keys(i).is_empty() {
                self.write_shard(i, &[])?;
                continue;
            }
            return Err(BridgeError::ShardNotWritten {
                path: self.target.clone(),
                shard: self.plan.file_name(i).unwrap_or_default().to_owned(),
            });
        }
        if self.plan.needs_index() {
            let index = IndexFile {
                metadata: BTreeMap::from([
                    ("total_parameters", self.total_parameters),
                    ("total_size", self.total_size),
                ]),
                weight_map: self
                    .plan
                    .files
                    .iter()
                    .flat_map(|(f, names)| names.iter().map(move |n| (n.as_str(), f.as_str())))
                    .collect(),
            };
            let text = to_pretty_json(&index, &self.tmp.join(INDEX_FILE))?;
            self.write_file(INDEX_FILE, text.as_bytes())?;
        }
        commit_dir(&self.tmp, &self.target, self.overwrite)?;
        self.finished = true;
        Ok(self.target.clone())
    }
}

impl Drop for HfDirWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Moves the finished temporary directory `tmp` (a sibling of `target`) into place: fsyncs it,
/// renames it to `target`, fsyncs the parent and removes the replaced target. An existing
/// `target` is refused with [`BridgeError::TargetExists`] unless `overwrite`; with it, the old
/// target is first moved aside and put back if the rename fails. The directory-level
/// counterpart of [`moe_backend::fs::write_atomic`], shared with the live export.
pub fn commit_dir(tmp: &Path, target: &Path, overwrite: bool) -> Result<(), BridgeError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BridgeError::Io { path, source }
    };
    sync_dir(tmp)?;
    let old = if target.exists() {
        if !overwrite {
            return Err(BridgeError::TargetExists {
                path: target.to_path_buf(),
            });
        }
        let old = sibling_temp_path(target, "old");
        std::fs::rename(target, &old).map_err(io(target))?;
        Some(old)
    } else {
        None
    };
    if let Err(e) = std::fs::rename(tmp, target) {
        if let Some(old) = &old {
            let _ = std::fs::rename(old, target);
        }
        return Err(io(target)(e));
    }
    sync_parent(target)?;
    if let Some(old) = old {
        let remove = if old.is_dir() {
            std::fs::remove_dir_all(&old)
        } else {
            std::fs::remove_file(&old)
        };
        remove.map_err(io(&old))?;
    }
    Ok(())
}

/// Pretty JSON with a trailing newline (`json.dumps(indent=2)` layout).
fn to_pretty_json(value: &impl Serialize, path: &Path) -> Result<String, BridgeError> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| BridgeError::InvalidJson {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    text.push('\n');
    Ok(text)
}

/// Writes `tensors` as an HF checkpoint at `target` with a greedy plan of at most
/// `max_shard_size` bytes per shard ([`ShardPlan::greedy`]); atomic as [`HfDirWriter`].
pub fn write_hf_checkpoint(
    target: &Path,
    tensors: &[TensorView<'_>],
    max_shard_size: u64,
    overwrite: bool,
) -> Result<PathBuf, BridgeError> {
    let sizes: BTreeMap<String, u64> = tensors
        .iter()
        .map(|t| (t.name.to_owned(), t.bytes.len() as u64))
        .collect();
    if sizes.len() != tensors.len() {
        let dup = tensors
            .iter()
            .enumerate()
            .find(|(i, t)| tensors[..*i].iter().any(|u| u.name == t.name))
            .map_or("", |(_, t)| t.name);
        return Err(BridgeError::InvalidWrite {
            path: target.to_path_buf(),
            tensor: dup.to_owned(),
            reason: "name given twice".to_owned(),
        });
    }
    let plan = ShardPlan::greedy(&sizes, max_shard_size);
    let mut writer = HfDirWriter::create(target, plan, overwrite)?;
    for i in 0..writer.plan.num_shards() {
        let keys = writer.plan.keys(i);
        let shard: Vec<TensorView<'_>> = tensors
            .iter()
            .filter(|t| keys.binary_search_by(|k| k.as_str().cmp(t.name)).is_ok())
            .copied()
            .collect();
        writer.write_shard(i, &shard)?;
    }
    writer.finish()
}

#[cfg(test)]
mod tests;
