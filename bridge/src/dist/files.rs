//! One rank's chunk files: `shard-{rank:05}-model-{j:05}-of-{n:05}.safetensors`
//! (docs/checkpoints.md §Distributed checkpoint format).
//!
//! The headers are planned up front from the chunks' dtypes and shapes (so a file can be
//! filled piece by piece, at computed offsets, without ever holding a whole chunk): tensors are
//! laid out by descending element size, then name, after a header padded to 8 bytes, so every
//! tensor is aligned to its element size. A rank with several chunks of one fqn puts the j-th
//! in file j; `n` is the largest such count.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::index::{ChunkEntry, TensorKind, chunk_file_name, dcp_metadata};
use super::region::{TensorBox, copy_box, for_each_run};
use crate::BridgeError;
use crate::safetensors::{Dtype, planned_header};

/// What is known about a tensor independently of its chunks (one index entry without chunks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// The fqn.
    pub fqn: String,
    /// Parameter, buffer or optimizer state.
    pub kind: TensorKind,
    /// Element type.
    #[serde(with = "dtype_str")]
    pub dtype: Dtype,
    /// Global shape.
    pub global_shape: Vec<usize>,
    /// HF names the tensor maps to (informative).
    pub hf: Vec<String>,
}

mod dtype_str {
    use super::Dtype;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Dtype, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Dtype, D::Error> {
        let text = String::deserialize(d)?;
        Dtype::from_header_str(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown dtype {text}")))
    }
}

/// A chunk as written: the tensor's metadata and where the chunk went (what ranks report to
/// rank 0).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedChunk {
    /// The tensor.
    pub meta: TensorMeta,
    /// The chunk's index entry.
    pub chunk: ChunkEntry,
}

/// Where a planned chunk lives in its file.
#[derive(Debug)]
struct Slot {
    file: usize,
    /// Absolute byte offset of the chunk's data.
    start: u64,
    tensor_box: TensorBox,
    written: u64,
    meta: TensorMeta,
}

/// Writer of one rank's chunk files.
#[derive(Debug)]
pub(crate) struct RankFiles {
    rank: usize,
    files: Vec<(String, PathBuf, File)>,
    /// `(fqn, j)` → slot, `j` 0-based.
    slots: BTreeMap<(String, usize), Slot>,
}

impl RankFiles {
    /// Plans and creates the files of `rank` in `dir` for `chunks` (tensor, box); writes their
    /// headers. A rank without chunks creates no file.
    pub(crate) fn create(
        dir: &Path,
        rank: usize,
        chunks: Vec<(TensorMeta, TensorBox)>,
    ) -> Result<Self, BridgeError> {
        let mut per_file: Vec<Vec<(TensorMeta, TensorBox)>> = Vec::new();
        let mut count: BTreeMap<String, usize> = BTreeMap::new();
        for (meta, b) in chunks {
            let j = count.entry(meta.fqn.clone()).or_insert(0);
            if per_file.len() <= *j {
                per_file.push(Vec::new());
            }
            per_file[*j].push((meta, b));
            *j += 1;
        }
        let n = per_file.len();
        let mut files = Vec::with_capacity(n);
        let mut slots = BTreeMap::new();
        for (j, mut entries) in per_file.into_iter().enumerate() {
            let name = chunk_file_name(rank, j + 1, n);
            let path = dir.join(&name);
            entries.sort_by(|a, b| (b.0.dtype.size(), &a.0.fqn).cmp(&(a.0.dtype.size(), &b.0.fqn)));
            let (header, offsets) = plan_header(&entries, &path)?;
            let io = |source| BridgeError::Io {
                path: path.clone(),
                source,
            };
            let mut file = File::create(&path).map_err(io)?;
            file.write_all(&header).map_err(io)?;
            let data_len = offsets.last().map_or(0, |&(_, end)| end);
            file.set_len(header.len() as u64 + data_len as u64)
                .map_err(io)?;
            for ((meta, b), (begin, _)) in entries.into_iter().zip(offsets) {
                let slot = Slot {
                    file: j,
                    start: (header.len() + begin) as u64,
                    tensor_box: b,
                    written: 0,
                    meta,
                };
                slots.insert((slot.meta.fqn.clone(), j), slot);
            }
            files.push((name, path, file));
        }
        Ok(Self { rank, files, slots })
    }

    /// The chunks of `fqn` this rank writes, in file order.
    pub(crate) fn boxes_of(&self, fqn: &str) -> Vec<(usize, &TensorBox)> {
        (0..self.files.len())
            .filter_map(|j| {
                self.slots
                    .get(&(fqn.to_owned(), j))
                    .map(|s| (j, &s.tensor_box))
            })
            .collect()
    }

    /// Writes the overlap of `region` (a box of `fqn` whose row-major bytes are `bytes`) into
    /// chunk `j` of `fqn`; returns the number of elements written.
    pub(crate) fn write_region(
        &mut self,
        fqn: &str,
        j: usize,
        region: &TensorBox,
        bytes: &[u8],
    ) -> Result<usize, BridgeError> {
        let Some(slot) = self.slots.get_mut(&(fqn.to_owned(), j)) else {
            return Err(BridgeError::InvalidWrite {
                path: self.files.get(j).map_or_else(PathBuf::new, |f| f.1.clone()),
                tensor: fqn.to_owned(),
                reason: format!("rank {} has no chunk {} of it", self.rank, j + 1),
            });
        };
        let (_, path, file) = &mut self.files[slot.file];
        let elem = slot.meta.dtype.size();
        let needed = region.numel() * elem;
        if bytes.len() != needed {
            return Err(BridgeError::InvalidWrite {
                path: path.clone(),
                tensor: fqn.to_owned(),
                reason: format!(
                    "region {region:?} needs {needed} bytes, got {}",
                    bytes.len()
                ),
            });
        }
        let Some(inter) = region.intersect(&slot.tensor_box) else {
            return Ok(0);
        };
        let owned;
        let src: &[u8] = if inter == *region {
            bytes
        } else {
            let mut buf = vec![0u8; inter.numel() * elem];
            copy_box(
                bytes,
                &region.shape,
                &inter.relative_to(&region.offsets),
                &mut buf,
                &inter.shape,
                &vec![0; inter.shape.len()],
                &inter.shape,
                elem,
            );
            owned = buf;
            &owned
        };
        let at = inter.relative_to(&slot.tensor_box.offsets);
        let mut result = Ok(());
        for_each_run(
            &at,
            &inter.shape,
            &slot.tensor_box.shape,
            |dst, dense, run| {
                if result.is_err() {
                    return;
                }
                let pos = slot.start + (dst * elem) as u64;
                let data = &src[dense * elem..(dense + run) * elem];
                result = file
                    .seek(SeekFrom::Start(pos))
                    .and_then(|_| file.write_all(data));
            },
        );
        result.map_err(|source| BridgeError::Io {
            path: path.clone(),
            source,
        })?;
        slot.written += inter.numel() as u64;
        Ok(inter.numel())
    }

    /// Checks every chunk was completely written, fsyncs the files and returns the chunks'
    /// index records.
    pub(crate) fn finish(self) -> Result<Vec<SavedChunk>, BridgeError> {
        for slot in self.slots.values() {
            if slot.written != slot.tensor_box.numel() as u64 {
                return Err(BridgeError::InvalidWrite {
                    path: self.files[slot.file].1.clone(),
                    tensor: slot.meta.fqn.clone(),
                    reason: format!(
                        "chunk at {:?} received {} of {} elements",
                        slot.tensor_box.offsets,
                        slot.written,
                        slot.tensor_box.numel()
                    ),
                });
            }
        }
        for (_, path, file) in &self.files {
            file.sync_all().map_err(|source| BridgeError::Io {
                path: path.clone(),
                source,
            })?;
        }
        Ok(self
            .slots
            .into_values()
            .map(|slot| SavedChunk {
                chunk: ChunkEntry {
                    file: self.files[slot.file].0.clone(),
                    offsets: slot.tensor_box.offsets,
                    shape: slot.tensor_box.shape,
                    writer_rank: self.rank,
                },
                meta: slot.meta,
            })
            .collect())
    }
}

/// A file's header bytes and each tensor's `[begin, end)` range in the data section.
type PlannedHeader = (Vec<u8>, Vec<(usize, usize)>);

/// The padded header of a file holding `entries` in this order, and each entry's data range.
fn plan_header(
    entries: &[(TensorMeta, TensorBox)],
    path: &Path,
) -> Result<PlannedHeader, BridgeError> {
    let saved: BTreeMap<String, Vec<usize>> = entries
        .iter()
        .map(|(m, b)| (m.fqn.clone(), b.offsets.clone()))
        .collect();
    let mut planned = Vec::with_capacity(entries.len());
    for (meta, b) in entries {
        let len =
            b.numel()
                .checked_mul(meta.dtype.size())
                .ok_or_else(|| BridgeError::ShapeOverflow {
                    path: path.to_path_buf(),
                    tensor: meta.fqn.clone(),
                    shape: b.shape.clone(),
                })?;
        planned.push((meta.fqn.as_str(), meta.dtype, b.shape.clone(), len));
    }
    let (header, offsets) = planned_header(&dcp_metadata(&saved), planned, path)?;
    Ok((header, offsets))
}
