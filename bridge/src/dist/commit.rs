//! The atomic commit of a distributed checkpoint
//! (docs/checkpoints.md §Distributed checkpoint format, atomic commit steps 1, 3–5): a hidden
//! `.tmp-iter_{step:07}-{nonce}` directory, validated and completed by rank 0, renamed into place,
//! then `latest` replaced atomically.
//!
//! Each temporary directory carries an owner file ([`stale::OWNER_FILE`]) while the save runs;
//! [`begin_save`] first removes the temporary directories of earlier saves that died (see
//! [`stale`] for the rules), and [`temp_dirs`] lists them for `moe validate`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use moe_backend::fs::{sync_dir, write_atomic_bytes};
use serde_json::Value;

use super::files::SavedChunk;
use super::index::{
    COMPLETE_MARKER, DcpIndex, INDEX_FILE, LATEST_FILE, TensorEntry, iter_dir_name,
};
use super::validate::{validate_files, validate_index};
use crate::BridgeError;
use crate::hf::CONFIG_FILE;

pub mod stale;
#[cfg(test)]
mod tests;

pub use stale::{
    CleanupReport, FOREIGN_OWNER_GRACE, NO_OWNER_GRACE, OWNER_FILE, StalePolicy, TEMP_DIR_PREFIX,
    TempDirOwner, TempDirState, TempDirStatus, remove_stale_temp_dirs, temp_dirs, temp_dirs_with,
};

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BridgeError + '_ {
    move |source| BridgeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A fresh nonce: process id, time and a counter.
fn nonce() -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{}-{nanos:x}-{n}", std::process::id())
}

/// A temporary save directory just created by [`begin_save_with`].
#[derive(Debug)]
pub struct SaveStart {
    /// The new `<root>/.tmp-iter_{step:07}-{nonce}/`, holding its owner file.
    pub tmp: PathBuf,
    /// The stale temporary directories of earlier saves removed first (for the caller to log).
    pub cleanup: CleanupReport,
}

/// Step 1 with the default [`StalePolicy`]: see [`begin_save_with`]; returns the temporary
/// directory (the cleanup report is dropped).
pub fn begin_save(root: &Path, step: u64) -> Result<PathBuf, BridgeError> {
    begin_save_with(root, step, &StalePolicy::default()).map(|start| start.tmp)
}

/// Step 1: creates `root`, removes the stale temporary directories of earlier saves in it
/// ([`remove_stale_temp_dirs`] under `policy`; a root that cannot be listed is reported in
/// [`CleanupReport::failed`], not fatal), then creates `<root>/.tmp-iter_{step:07}-{nonce}/`
/// with this process's owner file.
pub fn begin_save_with(
    root: &Path,
    step: u64,
    policy: &StalePolicy,
) -> Result<SaveStart, BridgeError> {
    std::fs::create_dir_all(root).map_err(io(root))?;
    let cleanup = remove_stale_temp_dirs(root, policy).unwrap_or_else(|e| CleanupReport {
        failed: vec![e],
        ..CleanupReport::default()
    });
    let tmp = root.join(format!(".tmp-{}-{}", iter_dir_name(step), nonce()));
    std::fs::create_dir(&tmp).map_err(io(&tmp))?;
    if let Err(e) = TempDirOwner::current().write(&tmp) {
        abort_save(&tmp);
        return Err(e);
    }
    Ok(SaveStart { tmp, cleanup })
}

/// Removes an aborted save's temporary directory (best effort: loaders refuse it anyway).
pub fn abort_save(tmp: &Path) {
    let _ = std::fs::remove_dir_all(tmp);
}

/// Merges the chunk records of every rank into `index.tensors`; tensors reported with
/// different metadata by two ranks are an error.
pub fn merge_chunks(
    tmp: &Path,
    index: &mut DcpIndex,
    chunks: impl IntoIterator<Item = SavedChunk>,
) -> Result<(), BridgeError> {
    for SavedChunk { meta, chunk } in chunks {
        let entry = index
            .tensors
            .entry(meta.fqn.clone())
            .or_insert_with(|| TensorEntry {
                kind: meta.kind,
                dtype: meta.dtype,
                global_shape: meta.global_shape.clone(),
                hf: meta.hf.clone(),
                chunks: Vec::new(),
            });
        if (entry.kind, entry.dtype, &entry.global_shape)
            != (meta.kind, meta.dtype, &meta.global_shape)
        {
            return Err(BridgeError::Coverage {
                path: tmp.to_path_buf(),
                tensor: meta.fqn,
                reason: format!(
                    "rank {} saved it as {:?} {} {:?}, another rank as {:?} {} {:?}",
                    chunk.writer_rank,
                    meta.kind,
                    meta.dtype,
                    meta.global_shape,
                    entry.kind,
                    entry.dtype,
                    entry.global_shape
                ),
            });
        }
        entry.chunks.push(chunk);
    }
    for entry in index.tensors.values_mut() {
        entry.chunks.sort_by(|a, b| a.offsets.cmp(&b.offsets));
    }
    Ok(())
}

/// Steps 3–4 (rank 0): validates the index against
/// docs/checkpoints.md §Distributed checkpoint validation and the files' headers, writes the index,
/// `config.json` and `extra` JSON files, `.complete`, renames `tmp` to `<root>/iter_{step:07}` and
/// points `latest` at it. Returns the checkpoint directory. On failure `tmp` is removed and nothing
/// visible changes.
pub fn commit_save(
    root: &Path,
    tmp: &Path,
    index: &DcpIndex,
    config: Option<&Value>,
    extra: &BTreeMap<String, Value>,
) -> Result<PathBuf, BridgeError> {
    let result = commit_inner(root, tmp, index, config, extra);
    if result.is_err() {
        abort_save(tmp);
    }
    result
}

fn commit_inner(
    root: &Path,
    tmp: &Path,
    index: &DcpIndex,
    config: Option<&Value>,
    extra: &BTreeMap<String, Value>,
) -> Result<PathBuf, BridgeError> {
    validate_index(tmp, index)?;
    validate_files(tmp, index)?;
    // The owner file only marks the save in progress; the checkpoint does not keep it.
    let owner = tmp.join(OWNER_FILE);
    match std::fs::remove_file(&owner) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&owner)(e)),
        _ => {}
    }
    let index_path = tmp.join(INDEX_FILE);
    write_atomic_bytes(&index_path, index.to_json(&index_path)?.as_bytes())?;
    let json_files = config
        .map(|c| (CONFIG_FILE.to_owned(), c))
        .into_iter()
        .chain(extra.iter().map(|(k, v)| (k.clone(), v)));
    for (name, value) in json_files {
        let path = tmp.join(&name);
        let mut text =
            serde_json::to_string_pretty(value).map_err(|e| BridgeError::InvalidJson {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        text.push('\n');
        write_atomic_bytes(&path, text.as_bytes())?;
    }
    write_atomic_bytes(&tmp.join(COMPLETE_MARKER), b"")?;
    sync_dir(tmp)?;
    let name = iter_dir_name(index.step);
    let target = root.join(&name);
    if target.exists() {
        return Err(BridgeError::TargetExists { path: target });
    }
    std::fs::rename(tmp, &target).map_err(io(&target))?;
    sync_dir(root)?;
    write_atomic_bytes(&root.join(LATEST_FILE), format!("{name}\n").as_bytes())?;
    Ok(target)
}
