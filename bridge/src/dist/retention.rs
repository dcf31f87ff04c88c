//! Checkpoint retention: keep the newest `K` checkpoints of a root (torchtitan's
//! `keep_latest_k`, `moe train --keep-last K`), removing the older `iter_*` directories after
//! a successful save.
//!
//! Removal is crash-safe: a directory is first renamed, atomically, to a hidden
//! `.removing-iter_{step:07}-{nonce}` name (the root fsynced), then deleted. A process killed
//! at any moment therefore leaves each `iter_*` directory either whole or gone, never half
//! deleted under its checkpoint name; a half-deleted hidden directory is no checkpoint
//! (nothing resolves to it) and [`sweep_removals`] deletes it later. The checkpoint `latest`
//! names is never removed, nor anything that is not a complete `iter_*` directory (saves in
//! progress live in `.tmp-*` directories).

use std::path::{Path, PathBuf};

use moe_backend::fs::sync_dir;

use super::index::{COMPLETE_MARKER, LATEST_FILE};
use crate::BridgeError;

/// Name prefix of a checkpoint directory being removed.
pub const REMOVING_PREFIX: &str = ".removing-";

/// Where [`keep_last_with`] is in the removal of one directory (for callers that log, and for
/// crash tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemovalPoint<'a> {
    /// The `iter_*` directory was renamed to its hidden name (the first argument), which is
    /// about to be deleted.
    Renamed(&'a Path),
}

/// What [`keep_last`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetentionReport {
    /// The `iter_*` directories removed (their former paths), oldest first.
    pub removed: Vec<PathBuf>,
    /// Leftovers of interrupted removals deleted first ([`sweep_removals`]).
    pub swept: Vec<PathBuf>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BridgeError + '_ {
    move |source| BridgeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The step of an `iter_{step}` directory name.
fn iter_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("iter_")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The complete `iter_*` checkpoint directories of `root` with their steps, oldest first.
pub fn checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>, BridgeError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io(root))? {
        let entry = entry.map_err(io(root))?;
        let name = entry.file_name();
        let Some(step) = name.to_str().and_then(iter_step) else {
            continue;
        };
        let path = entry.path();
        if path.is_dir() && path.join(COMPLETE_MARKER).is_file() {
            out.push((step, path));
        }
    }
    out.sort();
    Ok(out)
}

/// Deletes the hidden directories interrupted removals left under `root`; returns them.
pub fn sweep_removals(root: &Path) -> Result<Vec<PathBuf>, BridgeError> {
    let mut swept = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io(root))? {
        let entry = entry.map_err(io(root))?;
        let hidden = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(REMOVING_PREFIX));
        let path = entry.path();
        if hidden && path.is_dir() {
            std::fs::remove_dir_all(&path).map_err(io(&path))?;
            swept.push(path);
        }
    }
    if !swept.is_empty() {
        sync_dir(root)?;
    }
    Ok(swept)
}

/// [`keep_last_with`] without a progress callback.
pub fn keep_last(root: &Path, keep: usize) -> Result<RetentionReport, BridgeError> {
    keep_last_with(root, keep, &mut |_| {})
}

/// Keeps the `keep` newest complete checkpoints of `root` (by step) and the one `latest`
/// names, removing the other `iter_*` directories oldest first, each renamed to a hidden name
/// before it is deleted (see the module docs); `at` is called at each [`RemovalPoint`].
/// Leftovers of interrupted removals are deleted first. `keep` must be at least 1.
pub fn keep_last_with(
    root: &Path,
    keep: usize,
    at: &mut dyn FnMut(RemovalPoint<'_>),
) -> Result<RetentionReport, BridgeError> {
    if keep == 0 {
        return Err(BridgeError::NotACheckpoint {
            path: root.to_path_buf(),
            reason: "retention must keep at least one checkpoint (--keep-last 0)".into(),
        });
    }
    let swept = sweep_removals(root)?;
    let latest_file = root.join(LATEST_FILE);
    let latest = match std::fs::read_to_string(&latest_file) {
        Ok(text) => Some(text.trim().to_owned()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(BridgeError::Io {
                path: latest_file,
                source,
            });
        }
    };
    let all = checkpoints(root)?;
    let old = all.len().saturating_sub(keep);
    let mut removed = Vec::new();
    for (_, dir) in all.into_iter().take(old) {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if latest.as_deref() == Some(name.as_str()) {
            continue;
        }
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let hidden = root.join(format!(
            "{REMOVING_PREFIX}{name}-{}-{nonce:x}",
            std::process::id()
        ));
        std::fs::rename(&dir, &hidden).map_err(io(&dir))?;
        sync_dir(root)?;
        at(RemovalPoint::Renamed(&hidden));
        std::fs::remove_dir_all(&hidden).map_err(io(&hidden))?;
        removed.push(dir);
    }
    if !removed.is_empty() {
        sync_dir(root)?;
    }
    Ok(RetentionReport { removed, swept })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_checkpoint(root: &Path, step: u64, complete: bool) -> PathBuf {
        let dir = root.join(format!("iter_{step:07}"));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("shard.safetensors"), b"x").expect("file");
        if complete {
            std::fs::write(dir.join(COMPLETE_MARKER), b"").expect("marker");
        }
        dir
    }

    fn root(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "moe-retention-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("root");
        dir
    }

    fn names(root: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(root)
            .expect("read")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn keeps_the_newest_and_latest_and_nothing_else_is_touched() {
        let r = root("keep");
        for s in [2, 4, 6, 8] {
            fake_checkpoint(&r, s, true);
        }
        // An incomplete directory and a save in progress are not checkpoints: left alone.
        fake_checkpoint(&r, 1, false);
        std::fs::create_dir_all(r.join(".tmp-iter_0000010-1-2-3")).expect("tmp");
        // `latest` names an older checkpoint (e.g. a run resumed from it): kept.
        std::fs::write(r.join(LATEST_FILE), "iter_0000004\n").expect("latest");
        let report = keep_last(&r, 2).expect("retention");
        assert_eq!(
            report.removed,
            vec![r.join("iter_0000002")],
            "the oldest goes; iter_4 is latest"
        );
        assert_eq!(
            names(&r),
            [
                ".tmp-iter_0000010-1-2-3",
                "iter_0000001",
                "iter_0000004",
                "iter_0000006",
                "iter_0000008",
                "latest"
            ]
        );
        std::fs::write(r.join(LATEST_FILE), "iter_0000008").expect("latest");
        keep_last(&r, 1).expect("retention");
        assert_eq!(
            names(&r),
            [
                ".tmp-iter_0000010-1-2-3",
                "iter_0000001",
                "iter_0000008",
                "latest"
            ]
        );
        assert!(keep_last(&r, 0).is_err(), "keep 0 is refused");
        let _ = std::fs::remove_dir_all(r);
    }

    #[test]
    fn an_interrupted_removal_leaves_no_half_checkpoint_and_is_swept_later() {
        let r = root("crash");
        for s in [1, 2, 3] {
            fake_checkpoint(&r, s, true);
        }
        std::fs::write(r.join(LATEST_FILE), "iter_0000003").expect("latest");
        // Interrupt the removal right after the rename (as a crash would: the callback
        // panics, so nothing after it runs).
        let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            keep_last_with(&r, 1, &mut |point| match point {
                RemovalPoint::Renamed(hidden) => {
                    // Half deleted.
                    std::fs::remove_file(hidden.join("shard.safetensors")).expect("rm");
                    panic!("killed");
                }
            })
        }));
        assert!(crashed.is_err());
        let left = names(&r);
        assert!(
            left.iter().any(|n| n.starts_with(REMOVING_PREFIX)),
            "{left:?}"
        );
        // Every `iter_*` directory still there is whole.
        for (_, dir) in checkpoints(&r).expect("list") {
            assert!(dir.join("shard.safetensors").is_file(), "{dir:?}");
        }
        let report = keep_last(&r, 1).expect("retention");
        assert_eq!(report.swept.len(), 1);
        assert_eq!(names(&r), ["iter_0000003", "latest"]);
        let _ = std::fs::remove_dir_all(r);
    }
}
