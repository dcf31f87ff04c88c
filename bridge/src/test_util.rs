//! Helpers shared by unit tests: a self-deleting temporary directory and raw file builders.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh directory under `std::env::temp_dir()`, removed (with its contents) on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `<tmp>/moe-bridge-<tag>-<pid>-<n>`.
    pub fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "moe-bridge-{tag}-{}-{n}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `self.path().join(name)`.
    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A raw safetensors file: 8-byte length, `header` JSON text, then `data`.
pub fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A valid file written by the reference `safetensors` crate: `a` F32 [2,3] = 0..6,
/// `b` BF16 [2] = [1, -2], `c` F8_E4M3 [2,2] = [1, 2, 448, -1].
pub fn reference_file() -> Vec<u8> {
    use safetensors::Dtype as St;
    use safetensors::tensor::TensorView;
    let a: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let b: Vec<u8> = [0x3F80u16, 0xC000]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let c: Vec<u8> = vec![0x38, 0x40, 0x7E, 0xB8];
    let views = vec![
        ("a", TensorView::new(St::F32, vec![2, 3], &a).expect("view")),
        ("b", TensorView::new(St::BF16, vec![2], &b).expect("view")),
        (
            "c",
            TensorView::new(St::F8_E4M3, vec![2, 2], &c).expect("view"),
        ),
    ];
    safetensors::serialize(views, None).expect("serialize")
}
