//! Durable file writes, shared by every crate of the workspace that writes files.
//!
//! [`write_atomic`] (and [`write_atomic_bytes`]) is the one way a file is written atomically:
//! into a hidden temporary sibling in the same directory ([`sibling_temp_path`]), flushed and
//! fsynced, renamed over the target, then the directory is fsynced so that the rename survives
//! a crash. A reader sees the old file or the new one, never a partial one; on error the
//! temporary file is removed and the target is untouched. Errors ([`FsError`]) name the path
//! that failed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// An I/O error and the path it happened on.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
pub struct FsError {
    /// The file or directory that failed (the temporary file for a failed write).
    pub path: PathBuf,
    /// The underlying I/O error.
    #[source]
    pub source: std::io::Error,
}

impl FsError {
    /// A closure wrapping an [`std::io::Error`] with `path`, for `map_err`.
    pub fn at(path: &Path) -> impl FnOnce(std::io::Error) -> FsError + '_ {
        move |source| FsError {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Writes `path` atomically with `write`, which receives a buffered writer on a temporary file
/// in the same directory. After `write` succeeds the buffer is flushed, the file fsynced and
/// renamed over `path` (an existing file is replaced), and the directory fsynced. On any error
/// (of `write` or of the file system) the temporary file is removed and `path` is untouched.
///
/// Errors of `write` are returned as they are; file-system errors are [`FsError`]s converted
/// into `E`, naming the temporary file (create, write, fsync), `path` (rename) or the directory
/// (its fsync).
pub fn write_atomic<T, E: From<FsError>>(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<T, E>,
) -> Result<T, E> {
    let tmp = sibling_temp_path(path, "tmp");
    let result = (|| {
        let file = File::create(&tmp).map_err(FsError::at(&tmp))?;
        let mut out = BufWriter::new(file);
        let value = write(&mut out)?;
        let file = out
            .into_inner()
            .map_err(|e| FsError::at(&tmp)(e.into_error()))?;
        file.sync_all().map_err(FsError::at(&tmp))?;
        std::fs::rename(&tmp, path).map_err(FsError::at(path))?;
        sync_parent(path)?;
        Ok(value)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// [`write_atomic`] of a byte slice.
pub fn write_atomic_bytes(path: &Path, bytes: &[u8]) -> Result<(), FsError> {
    write_atomic(path, |out| out.write_all(bytes).map_err(FsError::at(path)))
}

/// `<dir>/.<file name>.<tag>-<pid>-<n>`: a hidden sibling of `path`, unique within the
/// process (`n` counts up) and across processes (the process id).
pub fn sibling_temp_path(path: &Path, tag: &str) -> PathBuf {
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

/// fsyncs the directory containing `path` (the current directory for a bare file name), so
/// that a rename into it is durable.
pub fn sync_parent(path: &Path) -> Result<(), FsError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    sync_dir(parent)
}

/// fsyncs a directory, so that the entries created or renamed in it are durable.
pub fn sync_dir(dir: &Path) -> Result<(), FsError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(FsError::at(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh, empty directory under the system temp dir, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "moe-backend-fs-{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn entries(&self) -> Vec<String> {
            let mut names: Vec<String> = std::fs::read_dir(&self.0)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn writes_and_replaces_leaving_no_temporary_file() {
        let dir = Dir::new("replace");
        let path = dir.0.join("out.bin");
        write_atomic_bytes(&path, b"first").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        write_atomic_bytes(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        assert_eq!(dir.entries(), ["out.bin"]);
    }

    #[test]
    fn a_failed_write_keeps_the_target_and_removes_the_temporary_file() {
        let dir = Dir::new("fail");
        let path = dir.0.join("keep.txt");
        write_atomic_bytes(&path, b"old").unwrap();
        let err = write_atomic(&path, |out| {
            out.write_all(b"half").map_err(FsError::at(&path))?;
            Err::<(), _>(FsError {
                path: path.clone(),
                source: std::io::Error::other("writer failed"),
            })
        })
        .unwrap_err();
        assert!(err.to_string().contains("keep.txt"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(dir.entries(), ["keep.txt"]);
    }

    #[test]
    fn errors_name_the_path() {
        let dir = Dir::new("missing");
        let path = dir.0.join("no-such-dir").join("x.json");
        let err = write_atomic_bytes(&path, b"{}").unwrap_err();
        assert!(err.path.starts_with(dir.0.join("no-such-dir")), "{err}");
        assert!(err.to_string().contains("x.json"), "{err}");
    }

    #[test]
    fn temporary_siblings_are_hidden_and_unique() {
        let a = sibling_temp_path(Path::new("d/f.json"), "tmp");
        let b = sibling_temp_path(Path::new("d/f.json"), "tmp");
        assert_ne!(a, b);
        assert_eq!(a.parent(), Some(Path::new("d")));
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(".f.json.tmp-"), "{name}");
    }
}
