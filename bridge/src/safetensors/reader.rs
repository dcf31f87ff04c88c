//! Memory-mapped safetensors files: validated header, zero-copy tensor views.
//!
//! Kept on top of the `safetensors` crate, whose `SafeTensors` only borrows a buffer the caller
//! keeps alive: [`SafetensorsFile`] owns the mapping together with the header (validated with
//! the crate, [`SafetensorsHeader::parse`]) and hands out views that name the file and tensor in
//! errors. Pages are read only when a view's bytes are touched, so reading part of a tensor
//! does not read the rest.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{OwnedTensor, SafetensorsHeader, TensorInfo, TensorView};
use crate::BridgeError;
use crate::dist::region::{TensorBox, for_each_run};

/// An open, memory-mapped safetensors file whose header has been validated
/// ([`SafetensorsHeader::parse`]: offsets inside the file, no overlaps or holes, byte lengths
/// matching dtype and shape). A truncated file fails to open.
///
/// Only the header is read eagerly; tensor bytes are paged in when a view is used.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    header: SafetensorsHeader,
    mmap: Mmap,
}

impl SafetensorsFile {
    /// Opens and maps `path`, validating its header.
    ///
    /// The mapping assumes the file is not modified while it is open (as every mmap-based
    /// safetensors reader does); checkpoints are written atomically by rename, which keeps an
    /// open mapping intact.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, BridgeError> {
        let path = path.as_ref();
        let io = |source| BridgeError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < 8 {
            return Err(BridgeError::FileTooShort {
                path: path.to_path_buf(),
                len,
            });
        }
        // SAFETY: the file is opened read-only and the mapping is private to this value; see
        // the doc comment for the assumption that the file is not modified concurrently.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = SafetensorsHeader::parse(&mmap, path)?;
        Ok(Self {
            path: path.to_path_buf(),
            header,
            mmap,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated header.
    pub fn header(&self) -> &SafetensorsHeader {
        &self.header
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.header.tensors.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.header.tensors.len()
    }

    /// Whether the file holds no tensors.
    pub fn is_empty(&self) -> bool {
        self.header.tensors.is_empty()
    }

    /// Whether the file holds tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.header.tensors.contains_key(name)
    }

    /// dtype, shape and offsets of tensor `name`.
    pub fn info(&self, name: &str) -> Result<&TensorInfo, BridgeError> {
        self.header
            .tensors
            .get(name)
            .ok_or_else(|| BridgeError::TensorNotFound {
                path: self.path.clone(),
                tensor: name.to_owned(),
            })
    }

    /// A zero-copy view of tensor `name`.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, BridgeError> {
        let (key, info) =
            self.header
                .tensors
                .get_key_value(name)
                .ok_or_else(|| BridgeError::TensorNotFound {
                    path: self.path.clone(),
                    tensor: name.to_owned(),
                })?;
        let (begin, end) = info.data_offsets;
        let start = self.header.data_start;
        // The header was validated against this very mapping, so the range is in bounds; the
        // checked lookup keeps that a typed error rather than a panic all the same.
        let bytes = self.mmap.get(start + begin..start + end).ok_or_else(|| {
            BridgeError::OffsetsOutOfBounds {
                path: self.path.clone(),
                tensor: name.to_owned(),
                end,
                data_len: self.mmap.len().saturating_sub(start),
            }
        })?;
        Ok(TensorView {
            path: &self.path,
            name: key,
            dtype: info.dtype,
            shape: &info.shape,
            bytes,
        })
    }

    /// The box at `offsets` of extent `shape` of tensor `name`, in the stored dtype, read with
    /// positioned reads of its contiguous runs (one per row of the box that is not whole):
    /// nothing outside the box is read, and the file mapping is not touched, so the pages read
    /// never count towards this process's resident memory.
    ///
    /// Errors: [`BridgeError::TensorNotFound`], [`BridgeError::ShapeMismatch`] when the box
    /// does not lie inside the tensor, [`BridgeError::Io`] when a read fails.
    pub fn read_box(
        &self,
        name: &str,
        offsets: &[usize],
        shape: &[usize],
    ) -> Result<OwnedTensor, BridgeError> {
        use std::os::unix::fs::FileExt;

        let info = self.info(name)?;
        let request = TensorBox::new(offsets.to_vec(), shape.to_vec());
        if !request.within(&info.shape) {
            return Err(BridgeError::ShapeMismatch {
                path: self.path.clone(),
                tensor: format!("{name} (box at {offsets:?})"),
                expected: info.shape.clone(),
                actual: shape.to_vec(),
            });
        }
        let elem = info.dtype.size();
        let base = (self.header.data_start + info.data_offsets.0) as u64;
        let io = |source| BridgeError::Io {
            path: self.path.clone(),
            source,
        };
        let file = File::open(&self.path).map_err(io)?;
        let mut out = vec![0u8; request.numel() * elem];
        let mut result = Ok(());
        for_each_run(offsets, shape, &info.shape, |start, dense, run| {
            if result.is_ok() {
                result = file.read_exact_at(
                    &mut out[dense * elem..(dense + run) * elem],
                    base + (start * elem) as u64,
                );
            }
        });
        result.map_err(io)?;
        OwnedTensor::new(name, info.dtype, shape.to_vec(), out)
    }

    /// All tensors in data order (ascending offsets).
    pub fn tensors(&self) -> Result<Vec<TensorView<'_>>, BridgeError> {
        let mut names: Vec<(&String, &TensorInfo)> = self.header.tensors.iter().collect();
        names.sort_by_key(|(name, info)| (info.data_offsets, *name));
        names.into_iter().map(|(n, _)| self.tensor(n)).collect()
    }
}

#[cfg(test)]
mod tests;
